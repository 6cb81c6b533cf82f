"""A user with nothing to recall: their reply neither encodes the question nor searches, and
announces what a search would have found (nothing); once they have memory, indexed or not
yet, their replies search it as before.

Live server, real Postgres, the deterministic HashEmbedder (wrapped to record what it is
asked to encode), the real indexing pipeline.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import event, text

from memory.recall.found import RecallResult
from memory.recall.recaller import Recaller
from memory.recall.stored import nothing_stored
from memory.record.conversations import Owner
from tests.conftest import LiveServer
from tests.support import CountingEmbedder, new_conversation
from tests.test_memory_recall import FACT, QUESTION, index_outbox, retrieved, say

OWNER = Owner("t1", "u1")  # the user of server.client()

# The statements of a search: the unindexed turns' read, and the index's search.
SEARCH_STATEMENTS = ("t.memory_use = ANY(:remembered_uses)", "owner_rows AS MATERIALIZED")


def searches(log: list[str]) -> Any:
    """Note in ``log`` each search statement the server runs."""

    def note(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        log.extend(s for s in SEARCH_STATEMENTS if s in statement)

    return note


def without_latency(found: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in found.items() if key != "latency_ms"}


def as_announced(found: RecallResult) -> tuple[str, str, list[str]]:
    return found.query, found.rewrite.method, [m.text for m in found.memories]


async def test_a_user_with_nothing_stored_is_answered_without_encode_or_search(start_server: Any) -> None:
    embedder = CountingEmbedder()
    server: LiveServer = await start_server(embedder=embedder)
    engine = server.services.db.engine.sync_engine
    log: list[str] = []
    note = searches(log)
    event.listen(engine, "before_cursor_execute", note)
    try:
        async with server.client() as client:
            found = retrieved(await say(client, await new_conversation(client, "Travel"), QUESTION))
    finally:
        event.remove(engine, "before_cursor_execute", note)
    assert embedder.texts == [] and log == []
    # What a search of nothing announces: the rewrite as it always is, no items, no error.
    assert without_latency(found) == {
        "query": QUESTION,
        "rewritten_query": QUESTION,
        "rewrite": "skipped",
        "scope": "user",
        "items": [],
    }
    assert set(found["latency_ms"]) == {"context", "rewrite", "embed", "search", "excerpts", "total"}
    # Another user with nothing stored, recalled both ways: the same query, rewrite and memories.
    recaller: Recaller = server.services.recaller
    new = Owner("t1", "someone-new")
    async with server.services.db.transaction() as session:
        empty = await recaller.nothing_stored(session, new)
    assert empty is not None
    searched = await recaller.search(new, QUESTION, k=5, for_block=True)
    skipped = await recaller.search(new, QUESTION, k=5, for_block=True, nothing_stored=empty)
    assert as_announced(skipped) == as_announced(searched) == (QUESTION, "skipped", [])


async def test_a_fact_not_indexed_yet_is_recalled_the_user_has_memory_then(start_server: Any) -> None:
    embedder = CountingEmbedder()
    server: LiveServer = await start_server(embedder=embedder)
    async with server.client() as client:
        await say(client, await new_conversation(client, "Family"), FACT)
        found = retrieved(await say(client, await new_conversation(client, "Travel"), QUESTION))
    assert FACT in [item["text"] for item in found["items"]]
    assert QUESTION in embedder.texts


async def test_an_indexed_fact_is_recalled_when_no_turn_waits_for_the_indexer(start_server: Any) -> None:
    server: LiveServer = await start_server(embedder=CountingEmbedder())
    db = server.services.db
    async with server.client() as client:
        family = await new_conversation(client, "Family")
        await say(client, family, FACT)
        await index_outbox(db, server.services.settings)
        # Nothing waits for the indexer now: only the memory rows say the user has memory.
        async with db.transaction() as session:
            waiting = await session.execute(
                text(
                    "SELECT count(*) FROM conversations WHERE user_id = :user_id"
                    " AND next_seq - 1 > GREATEST(indexed_seq, memory_forgotten_seq)"
                ),
                {"user_id": OWNER.user_id},
            )
        assert waiting.scalar_one() == 0
        # Asked in another conversation, where the fact is not in the window: found in the index.
        found = retrieved(await say(client, await new_conversation(client, "Travel"), QUESTION))
    assert FACT in [item["text"] for item in found["items"]]


async def test_memory_in_another_generation_is_not_nothing_stored(start_server: Any) -> None:
    server: LiveServer = await start_server()
    generation = server.services.recaller.embedder.current()
    async with server.services.db.transaction() as session:
        assert await nothing_stored(session, OWNER, generation) is not None
        await session.execute(
            text("UPDATE memory_indexes SET spec_key = :key WHERE id = :id"),
            {"key": "another encoder", "id": generation.id},
        )
        # Taken over by another encoder: its search refuses (ForeignGeneration); never skipped.
        assert await nothing_stored(session, OWNER, generation) is None
        await session.execute(
            text("UPDATE memory_indexes SET spec_key = :key WHERE id = :id"),
            {"key": generation.key, "id": generation.id},
        )


async def test_a_user_seen_with_memory_is_not_checked_again(start_server: Any) -> None:
    server: LiveServer = await start_server(embedder=CountingEmbedder())
    engine = server.services.db.engine.sync_engine
    checks: list[str] = []

    def note(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if "AS index_key" in statement:
            checks.append(statement)

    event.listen(engine, "before_cursor_execute", note)
    try:
        async with server.client() as client:
            await say(client, await new_conversation(client, "Family"), FACT)  # nothing stored yet
            first = retrieved(await say(client, await new_conversation(client, "Travel"), QUESTION))
            again = retrieved(await say(client, await new_conversation(client, "Trip"), QUESTION))
    finally:
        event.remove(engine, "before_cursor_execute", note)
    # Checked for the first two replies (nothing, then the fact), not for the third.
    assert len(checks) == 2
    assert FACT in [item["text"] for item in first["items"]]
    assert FACT in [item["text"] for item in again["items"]]
