"""The outbox payload and the indexing pipeline, on the real Postgres with a deterministic embedder."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import asyncpg
import pytest
from sqlalchemy import func, select, text, update

from indexer.pipeline import IndexPipeline, PoisonPayload
from indexer.table_statistics import MemoryTableStatistics
from indexer.worker import IndexerWorker
from memory.config import Settings, get_settings
from memory.events import TurnStatus
from memory.recall.embeddings import HashEmbedder
from memory.recall.index import generation_of
from memory.recall.keywords import memory_text
from memory.recall.redaction import redact
from memory.recall.search import recall_memories
from memory.recall.vector_cache import VectorCache, turn_key
from memory.record.conversations import Owner, create_conversation
from memory.record.outbox import PAYLOAD_VERSION, record_finished_turn, turn_payload
from memory.record.turns import add_turn
from memory.storage.db import Database, asyncpg_dsn
from memory.storage.models import Conversation, MemoryItem, OutboxRow, Turn
from tests.support import CountingEmbedder, wait_until

OWNER = Owner("tenant-a", "user-a")


def test_settings(pg_url: str, **overrides: Any) -> Settings:
    """Settings for a test: the test database, small fast batches."""
    base: dict[str, Any] = {
        "database_url": pg_url,
        "indexer_batch_wait_ms": 50,
        "relay_poll_seconds": 0.2,
        "indexer_batch_size": 64,
    }
    return get_settings(**(base | overrides))


test_settings.__test__ = False  # type: ignore[attr-defined]


async def chat_turns(
    db: Database,
    texts: Sequence[str],
    *,
    owner: Owner = OWNER,
    conversation_id: uuid.UUID | None = None,
    memory_mode: str = "persistent",
    one_transaction_per_turn: bool = False,
) -> tuple[uuid.UUID, list[Turn]]:
    """Finished user/assistant turns (alternating), each recorded in the outbox with its turn."""
    async with db.transaction() as session:
        if conversation_id is None:
            conversation = await create_conversation(session, owner, memory_mode=memory_mode)
            conversation_id = conversation.id
    turns: list[Turn] = []
    for start in range(0, len(texts), 1 if one_transaction_per_turn else max(1, len(texts))):
        group = texts[start : start + (1 if one_transaction_per_turn else len(texts))]
        async with db.transaction() as session:
            found = await session.get(Conversation, conversation_id)
            assert found is not None
            conversation = found
            for i, content in enumerate(group):
                role = "user" if (start + i) % 2 == 0 else "assistant"
                turn = await add_turn(
                    session, conversation, role=role, status=TurnStatus.COMPLETED, content=content
                )
                await record_finished_turn(session, turn)
                turns.append(turn)
    return conversation_id, turns


def memorable(i: int) -> str:
    """A turn with something worth remembering."""
    return f"On day {i} I planted {i} tomato seedlings in the raised bed behind the house."


async def scalar(db: Database, sql: str, **params: Any) -> Any:
    async with db.transaction() as session:
        return (await session.execute(text(sql), params)).scalar_one()


async def test_finished_turn_payload_is_versioned_and_carries_visible_text_only(db: Database) -> None:
    async with db.transaction() as session:
        conversation = await create_conversation(session, OWNER)
        turn = await add_turn(
            session,
            conversation,
            role="assistant",
            status=TurnStatus.INTERRUPTED_BY_USER,
            content="Visible part of the answer",
            tool_calls=[
                {"index": 0, "id": "c1", "name": "search", "arguments": '{"q": "half', "state": "streaming"}
            ],
            name="Assistant",
        )
        await record_finished_turn(session, turn)
    async with db.transaction() as session:
        row = (await session.execute(select(OutboxRow))).scalar_one()
    payload = row.payload
    assert payload["v"] == PAYLOAD_VERSION
    assert payload["text"] == "Visible part of the answer"
    assert "half" not in str(payload)
    assert payload["status"] == "interrupted_by_user"
    assert payload["turn_id"] == str(turn.id) and payload["conversation_id"] == str(conversation.id)
    assert (payload["tenant_id"], payload["user_id"], payload["seq"], payload["role"]) == (
        "tenant-a",
        "user-a",
        turn.seq,
        "assistant",
    )
    assert payload["created_at"] and payload["completed_at"]
    assert row.turn_id == turn.id and row.published_at is None and row.consumed_at is None


async def test_outbox_row_rolls_back_with_the_turn_and_skips_tool_and_unfinished_turns(db: Database) -> None:
    with pytest.raises(RuntimeError):
        async with db.transaction() as session:
            conversation = await create_conversation(session, OWNER)
            turn = await add_turn(
                session, conversation, role="user", status=TurnStatus.COMPLETED, content="hi there"
            )
            await record_finished_turn(session, turn)
            raise RuntimeError("the turn's transaction fails")
    async with db.transaction() as session:
        conversation = await create_conversation(session, OWNER)
        for role, status in [("tool", TurnStatus.COMPLETED), ("assistant", TurnStatus.FAILED)]:
            turn = await add_turn(session, conversation, role=role, status=status, content="tool output")
            await record_finished_turn(session, turn)
    assert await scalar(db, "SELECT count(*) FROM outbox") == 0


async def test_notification_is_sent_when_the_turn_commits(db: Database, pg_url: str) -> None:
    woken = asyncio.Event()
    conn = await asyncpg.connect(asyncpg_dsn(pg_url))
    try:
        await conn.add_listener("chatmem_outbox", lambda *_: woken.set())
        await chat_turns(db, [memorable(1)])
        await asyncio.wait_for(woken.wait(), 5)
    finally:
        await conn.close()


async def index_all(db: Database, settings: Settings, payloads: list[dict[str, Any]]) -> Any:
    return await IndexPipeline(db, HashEmbedder(dim=384), settings).index(payloads)


async def test_long_turn_is_chunked_with_overlap_and_redelivery_changes_nothing(
    db: Database, pg_url: str
) -> None:
    settings = test_settings(pg_url, chunk_chars=200, chunk_overlap_chars=50, redact_pii=False)
    long_text = " ".join(f"Sentence {i} is about my sister's bakery in Lyon." for i in range(30))
    conversation_id, turns = await chat_turns(db, [long_text, memorable(2)])
    payloads = [turn_payload(t) for t in turns]
    result = await index_all(db, settings, payloads)
    assert result.indexed_turns == 2
    async with db.transaction() as session:
        rows = (
            await session.execute(
                text("SELECT xmin::text AS x, * FROM memory_items ORDER BY turn_seq, chunk_index")
            )
        ).all()
    long_rows = [r for r in rows if r.turn_id == turns[0].id]
    assert len(long_rows) > 1 and all(len(r.text) <= 200 for r in long_rows)
    assert [r.chunk_index for r in long_rows] == list(range(len(long_rows)))
    assert long_rows[0].text[-20:] in long_rows[1].text  # overlapping chunks
    assert all(r.search_terms and r.embedding is not None for r in rows)
    assert rows[0].tenant_id == "tenant-a" and rows[0].turn_seq == turns[0].seq
    assert await scalar(db, "SELECT indexed_seq FROM conversations") == turns[1].seq

    again = await index_all(db, settings, payloads + payloads)  # redelivered, even twice in one batch
    async with db.transaction() as session:
        after = (
            await session.execute(text("SELECT xmin::text AS x, id FROM memory_items ORDER BY id"))
        ).all()
    before = sorted((r.id, r.x) for r in rows)
    assert [(r.id, r.x) for r in after] == before, "a redelivered message rewrote or added rows"
    assert again.chunks == len(rows)
    assert conversation_id == turns[0].conversation_id


async def test_a_long_turns_vector_stays_in_its_row_not_in_toast(db: Database, pg_url: str) -> None:
    # Nearly every memory row is over 2 KB (384 floats + text + a tsvector with the previous
    # turn's words); pgvector's default `external` storage then moved the vector out to the
    # TOAST table, and every read of it cost a TOAST index probe and page: at 1M rows the dense
    # top list read 4.7 buffers per row (bench/retrieval_latency.py, docs/scaling.md).
    question = "What did the baker in Lyon tell you about sourdough starters and proofing times?"
    answer = " ".join(f"Point {i}: my sister feeds her starter twice a day in Lyon." for i in range(16))
    _, turns = await chat_turns(db, [question, answer])
    await index_all(db, test_settings(pg_url, redact_pii=False), [turn_payload(t) for t in turns])
    async with db.transaction() as session:
        rows = (
            await session.execute(
                text(
                    # the row's content before the toaster (it now compresses the terms in the row)
                    "SELECT octet_length(m.text) + 4 * vector_dims(m.embedding) AS size,"
                    " pg_column_toast_chunk_id(embedding) AS toasted"
                    " FROM memory_items m WHERE embedding IS NOT NULL"
                )
            )
        ).all()
    assert len(rows) == 2 and max(r.size for r in rows) > 2100  # big enough to be toasted
    assert [r.toasted for r in rows] == [None, None]


async def test_pipeline_skips_what_is_not_worth_or_allowed_to_remember(db: Database, pg_url: str) -> None:
    settings = test_settings(pg_url, low_information_extra=["roger that"])
    _, kept = await chat_turns(db, ["你好", "thanks!", "Roger that", "   ", memorable(3)])
    _, off = await chat_turns(db, [memorable(4)], memory_mode="none")
    deleted_id, gone = await chat_turns(db, [memorable(5)])
    async with db.transaction() as session:
        await session.execute(
            update(Conversation).where(Conversation.id == deleted_id).values(deleted_at=func.now())
        )
    result = await index_all(db, settings, [turn_payload(t) for t in kept + off + gone])
    assert result.indexed_turns == 1
    assert result.skipped == {"low_information": 3, "empty": 1, "memory_off": 1, "deleted": 1}
    async with db.transaction() as session:
        texts = list((await session.execute(select(MemoryItem.text))).scalars())
        marks = dict((await session.execute(select(Conversation.id, Conversation.indexed_seq))).all())
    assert texts == [memorable(3)]
    assert marks[kept[0].conversation_id] == kept[-1].seq  # skipped turns still count as processed
    assert marks[off[0].conversation_id] == off[0].seq
    assert marks[deleted_id] == 0


async def test_pii_is_redacted_before_it_is_stored(db: Database, pg_url: str) -> None:
    secret = "Write to me at jane.doe@example.com or call +44 20 7946 0958 about the lease."
    assert redact(secret) != secret, "the redaction module no longer changes this text"
    _, turns = await chat_turns(db, [secret])
    await index_all(db, test_settings(pg_url, redact_pii=True), [turn_payload(turns[0])])
    stored = await scalar(db, "SELECT text FROM memory_items")
    assert stored == redact(secret)
    assert "jane.doe@example.com" not in stored


async def test_watermark_never_passes_a_queued_turn_nor_goes_back(db: Database, pg_url: str) -> None:
    settings = test_settings(pg_url)
    _, turns = await chat_turns(db, [memorable(i) for i in range(3)])
    watermark = "SELECT indexed_seq FROM conversations"
    await index_all(db, settings, [turn_payload(turns[2])])  # delivered before the older turns
    assert await scalar(db, watermark) == 0
    await index_all(db, settings, [turn_payload(turns[0])])
    assert await scalar(db, watermark) == turns[0].seq  # turns[1] still queued
    await index_all(db, settings, [turn_payload(turns[1])])
    assert await scalar(db, watermark) == turns[2].seq  # up to the turn consumed first
    await index_all(db, settings, [turn_payload(turns[0])])  # a redelivery
    assert await scalar(db, watermark) == turns[2].seq
    # Rows consumed before consumption was marked (Kafka) stay pending: below the watermark they
    # hold nothing back.
    async with db.transaction() as session:
        await session.execute(text("UPDATE outbox SET consumed_at = NULL"))
    conversation_id = turns[0].conversation_id
    _, later = await chat_turns(db, [memorable(3)], conversation_id=conversation_id)
    await index_all(db, settings, [turn_payload(later[0])])
    assert await scalar(db, watermark) == later[0].seq


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"v": 2}, "version"),
        ({"turn_id": None}, "UUID"),
        ({"seq": "7"}, "seq"),
        ({"role": "tool"}, "role"),
        ({"status": "streaming"}, "status"),
        ({"created_at": "yesterday"}, "created_at"),
        ({"tenant_id": ""}, "tenant_id"),
    ],
)
async def test_invalid_payloads_are_poison(
    db: Database, pg_url: str, change: dict[str, Any], reason: str
) -> None:
    _, turns = await chat_turns(db, [memorable(1)])
    bad = turn_payload(turns[0]) | change
    pipeline = IndexPipeline(db, HashEmbedder(dim=384), test_settings(pg_url))
    problem = pipeline.validate(bad)
    assert problem is not None and reason in problem
    assert pipeline.validate(turn_payload(turns[0])) is None
    with pytest.raises(PoisonPayload):
        await pipeline.index([turn_payload(turns[0]), bad])
    assert await scalar(db, "SELECT count(*) FROM memory_items") == 0


async def run_worker_until(
    worker: IndexerWorker, done: Callable[[], Awaitable[bool]], timeout: float = 30
) -> None:
    """Run the worker until `done()` holds, then stop it (the batch in hand is finished)."""
    stop = asyncio.Event()
    task = asyncio.ensure_future(worker.run(stop))
    try:
        await wait_until(lambda: _done_or_crashed(task, done), timeout, "the worker to finish")
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def _done_or_crashed(task: asyncio.Future[None], done: Callable[[], Awaitable[bool]]) -> bool:
    if task.done():
        task.result()  # re-raise the worker's crash
        raise AssertionError("the worker stopped on its own")
    return await done()


async def test_worker_on_postgres_indexes_every_turn_and_marks_rows_consumed(
    db: Database, pg_url: str
) -> None:
    settings = test_settings(pg_url, indexer_batch_size=16)
    _, turns = await chat_turns(db, [memorable(i) for i in range(40)], one_transaction_per_turn=True)
    worker = IndexerWorker(db, settings, HashEmbedder(dim=384))

    async def all_consumed() -> bool:
        return await scalar(db, "SELECT count(*) FROM outbox WHERE consumed_at IS NULL") == 0

    await run_worker_until(worker, all_consumed)
    assert await scalar(db, "SELECT count(DISTINCT turn_id) FROM memory_items") == 40
    assert await scalar(db, "SELECT count(*) FROM memory_items") == 40
    assert await scalar(db, "SELECT indexed_seq FROM conversations") == turns[-1].seq
    assert worker.stats["indexed_turns"] == 40 and worker.stats["batches"] >= 3


async def test_the_indexer_refreshes_the_planners_statistics_after_writing_many_rows(
    db: Database, pg_url: str
) -> None:
    """A table that grew from nearly nothing was planned as if empty until autovacuum's ANALYZE
    (up to a minute later): searches right after importing 1,000 turns took 1.2-4 s, not 45 ms."""
    settings = test_settings(pg_url, indexer_batch_size=16)
    await chat_turns(db, [memorable(i) for i in range(40)], one_transaction_per_turn=True)
    statistics = MemoryTableStatistics(db, min_rows=20)
    worker = IndexerWorker(db, settings, HashEmbedder(dim=384), statistics=statistics)

    async def all_consumed() -> bool:
        return await scalar(db, "SELECT count(*) FROM outbox WHERE consumed_at IS NULL") == 0

    await run_worker_until(worker, all_consumed)
    assert worker.stats["analyzed"] >= 1
    rows = await scalar(db, "SELECT count(*) FROM memory_items")
    # What the planner counts is what was written up to its last ANALYZE (every row, at 40).
    assert rows == 40
    known = await scalar(db, "SELECT reltuples FROM pg_class WHERE oid = 'memory_items'::regclass")
    assert known >= 20
    # Few rows, or few against what the statistics already count, are left to autovacuum.
    assert not await MemoryTableStatistics(db, min_rows=20).wrote(19)
    assert not await MemoryTableStatistics(db, min_rows=1, share=0.5).wrote(int(known * 0.5) - 1)


async def test_a_turn_recall_encoded_while_unindexed_is_indexed_with_that_vector(
    db: Database, pg_url: str
) -> None:
    # In the API's process the indexer shares the recall's cache: a turn recall already encoded
    # while it was unindexed was encoded again for the index (two thirds of the indexer's text
    # in bench/capacity.py with the indexer running).
    settings = test_settings(pg_url, redact_pii=False)
    embedder = CountingEmbedder()
    cache = VectorCache()
    _, turns = await chat_turns(db, [memorable(1), memorable(2)])
    found = await recall_memories(
        db, embedder, tenant_id=OWNER.tenant_id, user_id=OWNER.user_id, query_text="tomato", k=5, cache=cache
    )
    assert {m.turn_id for m in found.memories} == {t.id for t in turns}
    assert len(embedder.texts) == 3  # the query and both turns, in one call
    generation = await generation_of(embedder, db)
    # A vector kept for another generation is never used for this one.
    stranger = memory_text(memorable(3), name=None, created_at=turns[0].created_at)
    cache.keep([turn_key(generation.id + 1, stranger)], [[1.0] + [0.0] * 383])
    _, later = await chat_turns(db, [memorable(3)])
    embedder.texts.clear()

    result = await IndexPipeline(db, embedder, settings, vectors=cache).index(
        [turn_payload(t) for t in [*turns, *later]]
    )

    assert result.chunks == 3
    assert [text.endswith(memorable(3)) for text in embedder.texts] == [True]  # only the new turn
    async with db.transaction() as session:
        rows = (await session.execute(select(MemoryItem.text, MemoryItem.embedding))).all()
    for row in rows:  # every row holds its own text's vector (HashEmbedder is deterministic)
        said = next(t for t in [*turns, *later] if t.content == row.text)
        expected = HashEmbedder().embed_one(memory_text(said.content, name=None, created_at=said.created_at))
        assert list(row.embedding) == pytest.approx(expected, abs=1e-6)
    # And the turn the indexer encoded is kept for a recall that runs before its batch commits.
    assert cache.take([turn_key(generation.id, stranger)]) != [None]
