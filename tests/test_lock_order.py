"""No deadlock, ever, between background work and user actions.

Found: ``DELETE /v1/users/me`` while the Postgres-queue indexer worked on that user's turns
never returned. The indexer's claim transaction sat idle holding outbox row locks while it
embedded; the erasure's ``DELETE FROM outbox`` waited on it; the indexer's next lock on the
conversations waited on the erasure. Postgres could not see the cycle (one wait was in the
application), and indexing stopped for every tenant. Claims are committed leases now, and
no transaction stays open across embedding (indexer/outbox_claims.py).

The indexer is made to stop inside its embedding on cue (`GatedEmbedder`), so the user
action lands exactly where the deadlock was.

Found too: correcting one memory locked its row and then the conversations, against every
other writer's conversations-then-memory order. A deletion or "forget all" at the same moment
deadlocked with it (one of them answered 500), and so did a redelivered batch of the same
turn, which otherwise wrote the turn's sentence keys (the old words) back after the correction
deleted them. A second session holding one of the turn's keys (`holding`) stops the change at
that statement, so the other writer lands exactly between its two locks; a reply started
there recalls the memory before the change commits and stores its prompt after.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from sqlalchemy import text

from indexer.kafka_transport import KafkaQueueConsumer
from indexer.pipeline import IndexPipeline
from indexer.relay import OutboxRelay
from indexer.worker import IndexerWorker
from memory.config import Settings
from memory.events import EventName
from memory.recall.embeddings import HashEmbedder
from memory.recall.forgetting import SHOWN_LOCK_CLASS
from memory.record.conversations import Owner
from memory.storage.db import Database
from memory.storage.retention import RetentionJob, RetentionPolicy
from tests.conftest import LiveServer
from tests.fake_openai import Reply, ToolCall
from tests.sse import iter_sse
from tests.support import wait_until
from tests.test_approvals import park, transfer_tools
from tests.test_indexer import chat_turns, memorable, scalar, test_settings
from tests.test_memory_items import item_with, items, recalled_texts
from tests.test_memory_recall import QUESTION, index_outbox, new_conversation, retrieved, say
from tests.test_remembering_rule import small_model_server
from tests.test_transport_contract import kafka_test_settings

# Every user action must answer within this, whatever the indexer is doing.
REQUEST_BOUND_SECONDS = 15.0
TABLES = ("conversations", "turns", "turn_events", "tool_invocations", "outbox", "memory_items")


class GatedEmbedder:
    """The deterministic test embedder, held inside `embed` until the test opens the gate."""

    dim = 384

    def __init__(self) -> None:
        self._inner = HashEmbedder(dim=self.dim)
        self.entered = asyncio.Event()
        self.gate = asyncio.Event()

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        self.entered.set()
        await self.gate.wait()
        return await self._inner.embed(texts)


class WorkingEmbedder:
    """The deterministic test embedder taking a real model's time per batch (a busy indexer)."""

    dim = 384

    def __init__(self, seconds_per_batch: float = 0.05) -> None:
        self._inner = HashEmbedder(dim=self.dim)
        self._seconds = seconds_per_batch

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        await asyncio.sleep(self._seconds)  # simulated encode time, not a wait for a condition
        return await self._inner.embed(texts)


async def rows_of(db: Database, owner: Owner) -> dict[str, int]:
    """Rows per table of one user (read unscoped, as an operator would)."""
    async with db.transaction() as session:
        return {
            table: (
                await session.execute(
                    text(f"SELECT count(*) FROM {table} WHERE tenant_id = :t AND user_id = :u"),
                    {"t": owner.tenant_id, "u": owner.user_id},
                )
            ).scalar_one()
            for table in TABLES
        }


@asynccontextmanager
async def running(*parts: Any) -> AsyncIterator[None]:
    """Run indexer workers / relays (anything with `run(stop)`) for the block, then stop them."""
    stop = asyncio.Event()
    tasks = [asyncio.ensure_future(part.run(stop)) for part in parts]
    try:
        yield
        for task in tasks:
            if task.done():
                task.result()  # a crashed worker fails the test
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 30)


async def test_deleting_a_user_while_the_indexer_embeds_their_turns_does_not_deadlock(
    server: LiveServer, db: Database, pg_url: str
) -> None:
    victim, bystander = Owner("t1", "u1"), Owner("t2", "u2")
    await chat_turns(db, [memorable(i) for i in range(20)], owner=victim)
    embedder = GatedEmbedder()
    worker = IndexerWorker(db, test_settings(pg_url), embedder)
    async with running(worker):
        await asyncio.wait_for(embedder.entered.wait(), 20)  # the indexer holds the batch, mid-embed
        async with server.client(tenant=victim.tenant_id, user=victim.user_id) as client:
            async with asyncio.timeout(REQUEST_BOUND_SECONDS):
                assert (await client.delete("/v1/users/me")).status_code == 204
        embedder.gate.set()
        # The batch in hand finds no conversation and writes nothing; the next tenant goes on.
        await chat_turns(db, [memorable(99)], owner=bystander)
        await wait_until(lambda: _indexed(db, bystander, 1), 20, "the bystander's turn indexed")
    assert await rows_of(db, victim) == dict.fromkeys(TABLES, 0)


async def _indexed(db: Database, owner: Owner, count: int) -> bool:
    found = await scalar(
        db,
        "SELECT count(*) FROM memory_items WHERE tenant_id = :t AND user_id = :u",
        t=owner.tenant_id,
        u=owner.user_id,
    )
    return bool(found >= count)


async def _aged_deleted_conversation(db: Database, owner: Owner, turns: int) -> uuid.UUID:
    """A conversation deleted long ago, its turns still waiting in the outbox: the purge's work."""
    conversation_id, _ = await chat_turns(db, [memorable(i) for i in range(turns)], owner=owner)
    async with db.transaction() as session:
        await session.execute(
            text("UPDATE conversations SET deleted_at = now() - interval '30 days' WHERE id = :id"),
            {"id": conversation_id},
        )
    return conversation_id


async def _conversation_rows(db: Database, conversation_id: uuid.UUID) -> int:
    total = 0
    for table in ("turns", "outbox", "memory_items"):
        total += await scalar(
            db, f"SELECT count(*) FROM {table} WHERE conversation_id = :c", c=conversation_id
        )
    total += await scalar(db, "SELECT count(*) FROM conversations WHERE id = :c", c=conversation_id)
    return int(total)


async def _one_round(server: LiveServer, db: Database, round_no: int) -> None:
    """User deletion, conversation deletion and the purge at once, while the indexer is busy."""
    leaving = Owner("t-leaving", f"u{round_no}")
    tidying = Owner("t-tidy", f"u{round_no}")
    purged = Owner("t-purge", f"u{round_no}")
    bystander = Owner("t-bystander", f"u{round_no}")
    await chat_turns(db, [memorable(i) for i in range(30)], owner=leaving)
    deleted_conversation, _ = await chat_turns(db, [memorable(i) for i in range(30)], owner=tidying)
    purged_conversation = await _aged_deleted_conversation(db, purged, 30)

    async def delete_user() -> None:
        async with server.client(tenant=leaving.tenant_id, user=leaving.user_id) as client:
            assert (await client.delete("/v1/users/me")).status_code == 204

    async def delete_conversation() -> None:
        async with server.client(tenant=tidying.tenant_id, user=tidying.user_id) as client:
            response = await client.delete(f"/v1/conversations/{deleted_conversation}")
            assert response.status_code == 204

    async def purge() -> None:
        await RetentionJob(db, RetentionPolicy(grace_days=0), interval_seconds=3600).purge()

    async with asyncio.timeout(REQUEST_BOUND_SECONDS):
        await asyncio.gather(delete_user(), delete_conversation(), purge())
    # Nothing half-deleted: the user and the purged conversation are gone whole.
    assert await rows_of(db, leaving) == dict.fromkeys(TABLES, 0)
    assert await _conversation_rows(db, purged_conversation) == 0
    # The deleted conversation is hidden from its owner whatever the indexer did meanwhile.
    async with server.client(tenant=tidying.tenant_id, user=tidying.user_id) as client:
        assert (await client.get(f"/v1/conversations/{deleted_conversation}")).status_code == 404
    # Another tenant's new turn is still indexed promptly.
    await chat_turns(db, [memorable(round_no)], owner=bystander)
    await wait_until(lambda: _indexed(db, bystander, 1), 20, "the bystander's turn indexed")


@pytest.mark.parametrize("transport", ["postgres", "kafka"])
async def test_deletions_and_the_purge_race_a_busy_indexer_without_a_stuck_request(
    transport: str, server: LiveServer, db: Database, pg_url: str, request: pytest.FixtureRequest
) -> None:
    settings: Settings
    parts: list[Any]
    if transport == "postgres":
        settings = test_settings(pg_url, indexer_batch_size=8, outbox_lease_seconds=5)
        parts = [IndexerWorker(db, settings, WorkingEmbedder())]
    else:
        settings = kafka_test_settings(
            pg_url, request.getfixturevalue("kafka_bootstrap"), indexer_batch_size=8, outbox_lease_seconds=5
        )
        parts = [
            OutboxRelay(db, settings),
            IndexerWorker(db, settings, WorkingEmbedder(), consumer=KafkaQueueConsumer(settings)),
        ]
    async with running(*parts):
        for round_no in range(6):
            await _one_round(server, db, round_no)
    # Whatever is left pending belongs to nobody who still exists, or was delivered.
    pending_for_live = await scalar(
        db,
        "SELECT count(*) FROM outbox o JOIN conversations c ON c.id = o.conversation_id"
        " WHERE c.deleted_at IS NULL AND o.consumed_at IS NULL AND o.published_at IS NULL",
    )
    assert pending_for_live == 0


# --- a user's change to one memory, against everything else that writes memory rows ----------

# A message long enough (a person's, over 300 characters) to get sentence keys beside its chunk.
LONG_FACT = (
    "I am redoing the kitchen this autumn and could use some ideas for the tiles. "
    "My sister Ingrid moved to Reykjavik last spring and keeps honeybees there now. "
    "We are thinking about a dark green tile behind the stove, with oak shelves above it. "
    "The budget is tight, so anything that a careful beginner can lay would be best for us."
)
CORRECTED = "My sister Ingrid moved to Akureyri last spring."


@asynccontextmanager
async def holding(db: Database, sql: str, **params: Any) -> AsyncIterator[asyncio.Event]:
    """A second session holding the rows ``sql`` locks until the event is set: where a test
    stops another transaction, at a statement that must wait for those rows."""
    taken, release = asyncio.Event(), asyncio.Event()

    async def hold() -> None:
        async with db.transaction() as session:
            assert (await session.execute(text(sql), params)).all(), "nothing to hold"
            taken.set()
            await release.wait()

    task = asyncio.ensure_future(hold())
    try:
        await asyncio.wait_for(taken.wait(), REQUEST_BOUND_SECONDS)
        yield release
    finally:
        release.set()
        await task


async def _waiting_on_locks(db: Database, count: int) -> bool:
    """``count`` sessions of the database wait for a lock now."""
    waiting = await scalar(
        db,
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE datname = current_database() AND wait_event_type = 'Lock'",
    )
    return bool(waiting >= count)


async def _reply_waits_for_the_change(db: Database) -> bool:
    """A reply waits to store what it was shown (its prompt part, its recall tool's turn) for the
    change of a memory to commit: so its recall ran before, and read the memory as it was.

    Its own wait, not any session's: waiting on any lock, the reply's recall could be that other
    session (the flake: released then, its recall ran after the change and found the new text).
    """
    waiting = await scalar(
        db,
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND mode = 'ShareLock'"
        " AND classid = CAST(:class_id AS oid) AND objsubid = 2",
        class_id=SHOWN_LOCK_CLASS,
    )
    return bool(waiting)


async def _remembered(server: LiveServer, db: Database, how: str) -> tuple[str, dict[str, Any]]:
    """A conversation whose long message is indexed with its sentence keys: (conversation, its item)."""
    async with server.client() as client:
        conversation = await new_conversation(client)
        if how == "said":
            await say(client, conversation, LONG_FACT)  # the demo model's reply was shown it
        else:
            response = await client.post(
                f"/v1/conversations/{conversation}/import",
                json={"turns": [{"role": "user", "content": LONG_FACT}]},
            )
            assert response.status_code == 201, response.text
        await index_outbox(db, server.services.settings)
        item = await item_with(client, LONG_FACT)
    assert await _keys_of(db, item["turn_id"]) > 0
    return conversation, item


async def _keys_of(db: Database, turn_id: str) -> int:
    keys = "SELECT count(*) FROM memory_items WHERE turn_id = :t AND kind <> 'chunk'"
    return int(await scalar(db, keys, t=turn_id))


def _one_key_of(turn_id: str) -> dict[str, Any]:
    """`holding` arguments: one sentence key of the turn, which a correction or a forget deletes."""
    return {
        "sql": "SELECT id FROM memory_items WHERE turn_id = CAST(:t AS uuid) AND kind = 'sentence'"
        " ORDER BY id LIMIT 1 FOR UPDATE",
        "t": turn_id,
    }


async def _change(client: httpx.AsyncClient, action: str, item_id: int) -> httpx.Response:
    if action == "correct":
        return await client.patch(f"/v1/memory/items/{item_id}", json={"text": CORRECTED})
    return await client.delete(f"/v1/memory/items/{item_id}")


DELETIONS = {"delete the conversation": "/v1/conversations/{}", "forget all memory": "/v1/memory"}


@pytest.mark.parametrize("deletion", list(DELETIONS))
async def test_correcting_a_memory_while_its_conversation_is_forgotten_does_not_deadlock(
    deletion: str, server: LiveServer, db: Database
) -> None:
    """Found: the correction locked its memory row and then the conversations, the deletion the
    conversations and then the memory rows; Postgres aborted one of the two (40P01)."""
    conversation, item = await _remembered(server, db, "said")
    async with server.client() as client:
        async with holding(db, **_one_key_of(item["turn_id"])) as release:
            correcting = asyncio.ensure_future(_change(client, "correct", item["id"]))
            # The correction stops at the turn's keys, holding what it took before them.
            await wait_until(lambda: _waiting_on_locks(db, 1), REQUEST_BOUND_SECONDS, "the correction waits")
            deleting = asyncio.ensure_future(client.delete(DELETIONS[deletion].format(conversation)))
            await wait_until(lambda: _waiting_on_locks(db, 2), REQUEST_BOUND_SECONDS, "the deletion waits")
            release.set()
            async with asyncio.timeout(REQUEST_BOUND_SECONDS):
                corrected, deleted = await asyncio.gather(correcting, deleting)
        assert corrected.status_code == 200, corrected.text
        assert corrected.json()["text"] == CORRECTED
        assert deleted.status_code == 204, deleted.text
        assert await items(client) == []
    left = "SELECT count(*) FROM memory_items WHERE conversation_id = :c"
    assert await scalar(db, left, c=conversation) == 0


@pytest.mark.parametrize("how", ["said", "imported"])
@pytest.mark.parametrize("action", ["correct", "forget"])
async def test_a_redelivered_turn_does_not_bring_back_the_keys_of_a_memory_the_user_changed(
    action: str, how: str, server: LiveServer, db: Database
) -> None:
    """Found: the indexer read "not changed by the user" before a correction (or forget) of the
    same turn committed, and then wrote the turn's sentence keys again: its old words were found
    once more (imported turn), or the two waited on each other and Postgres aborted one (said
    in chat: the correction locks the conversation of the reply that was shown it)."""
    _, item = await _remembered(server, db, how)
    async with db.transaction() as session:
        payload = (
            await session.execute(
                text("SELECT payload FROM outbox WHERE turn_id = CAST(:t AS uuid)"), {"t": item["turn_id"]}
            )
        ).scalar_one()
    # The API's own index (a bare encoder would start one, taking the index lock exclusively).
    redelivered = IndexPipeline(db, server.services.embedder, server.services.settings)
    async with server.client() as client:
        async with holding(db, **_one_key_of(item["turn_id"])) as release:
            changing = asyncio.ensure_future(_change(client, action, item["id"]))
            await wait_until(lambda: _waiting_on_locks(db, 1), REQUEST_BOUND_SECONDS, "the change waiting")
            indexing = asyncio.ensure_future(redelivered.index([payload]))
            await wait_until(lambda: _waiting_on_locks(db, 2), REQUEST_BOUND_SECONDS, "the indexer waiting")
            release.set()
            async with asyncio.timeout(REQUEST_BOUND_SECONDS):
                changed, _ = await asyncio.gather(changing, indexing)
        assert changed.status_code == (200 if action == "correct" else 204), changed.text
        texts = [i["text"] for i in await items(client)]
    assert await _keys_of(db, item["turn_id"]) == 0
    assert LONG_FACT not in texts
    assert (CORRECTED in texts) == (action == "correct")


@pytest.mark.parametrize("action", ["correct", "forget"])
async def test_a_reply_that_recalled_a_memory_while_it_changed_does_not_bring_it_back_to_later_replies(
    action: str, start_server: Any, fake_openai: Any, db: Database
) -> None:
    """Found: a reply whose recall read the memory before a correction (or forget) committed, and
    whose prompt was stored after the change had looked for the replies shown it, stayed
    remembered: replies started after the change recalled that reply, old words and all."""
    server = await small_model_server(start_server, fake_openai)
    fake_openai.script(
        Reply(text="Noted, good luck with the kitchen."),
        Reply(text="Ingrid lives in Reykjavik now, a harbour town with long bright summer nights."),
    )
    _, item = await _remembered(server, db, "said")
    async with server.client() as client:
        async with holding(db, **_one_key_of(item["turn_id"])) as release:
            changing = asyncio.ensure_future(_change(client, action, item["id"]))
            await wait_until(lambda: _waiting_on_locks(db, 1), REQUEST_BOUND_SECONDS, "the change waits")
            # A reply begins while the change is under way: it recalls the old words (and may tell
            # them, in its own), and gets as far as it can before the change commits.
            replying = asyncio.ensure_future(say(client, await new_conversation(client), QUESTION))
            await wait_until(
                lambda: replying.done() or _reply_waits_for_the_change(db), REQUEST_BOUND_SECONDS, "the reply"
            )
            release.set()
            async with asyncio.timeout(REQUEST_BOUND_SECONDS):
                changed, during = await asyncio.gather(changing, replying)
            assert LONG_FACT in [i["text"] for i in retrieved(during)["items"]]
        assert changed.status_code == (200 if action == "correct" else 204), changed.text
        before_indexing = await recalled_texts(client)
        await index_outbox(db, server.services.settings)
        after_indexing = await recalled_texts(client)
    for recalled in (before_indexing, after_indexing):
        assert not [t for t in recalled if "Reykjavik" in t], recalled


@pytest.mark.parametrize("action", ["correct", "forget"])
async def test_a_reply_whose_recall_tool_read_a_memory_while_it_changed_does_not_bring_it_back(
    action: str, server: LiveServer, db: Database
) -> None:
    """As above, for a memory the reply's recall_memory tool showed (kept on its tool turn)."""
    _, item = await _remembered(server, db, "said")
    async with server.client() as client:
        async with holding(db, **_one_key_of(item["turn_id"])) as release:
            changing = asyncio.ensure_future(_change(client, action, item["id"]))
            await wait_until(lambda: _waiting_on_locks(db, 1), REQUEST_BOUND_SECONDS, "the change waits")
            asked = await new_conversation(client)
            # Recall before the reply is of this conversation only: the tool alone shows the memory.
            replying = asyncio.ensure_future(
                say(client, asked, "/remember where my sister Ingrid lives", memory_scope="conversation")
            )
            await wait_until(
                lambda: replying.done() or _reply_waits_for_the_change(db), REQUEST_BOUND_SECONDS, "the reply"
            )
            release.set()
            async with asyncio.timeout(REQUEST_BOUND_SECONDS):
                changed, _ = await asyncio.gather(changing, replying)
        assert changed.status_code == (200 if action == "correct" else 204), changed.text
        turns = (await client.get(f"/v1/conversations/{asked}/turns")).json()["items"]
        assert [t["role"] for t in turns] == ["user", "assistant", "tool", "assistant"]
        assert "Reykjavik" in turns[2]["content"] and "Reykjavik" in turns[3]["content"]
        before_indexing = await recalled_texts(client)
        await index_outbox(db, server.services.settings)
        after_indexing = await recalled_texts(client)
    for recalled in (before_indexing, after_indexing):
        assert not [t for t in recalled if "Reykjavik" in t], recalled


async def _deadlocks(db: Database) -> int:
    found = "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"
    return int(await scalar(db, found))


async def test_correcting_a_memory_while_a_reply_shown_it_ends_does_not_deadlock(
    start_server: Any, fake_openai: Any, db: Database
) -> None:
    """Found: the correction locked the conversation of a streaming reply shown the memory and then
    its turn; the reply's ending (a stop here) locks its turn and then its conversation. Postgres
    aborted one of them (the ending retried; a correction aborted answers 500)."""
    server = await small_model_server(start_server, fake_openai)
    fake_openai.script(
        Reply(text="Noted, good luck with the kitchen."),
        # A reply long enough to still stream when it is stopped (the model's pace, not a wait).
        Reply(text="Ingrid lives in Reykjavik now. " * 100, chunk_delay=0.05),
    )
    async with server.client() as client:
        # The reply's conversation sorts first, so the correction takes it before the memory's own.
        replying_in, said_in = sorted([await new_conversation(client), await new_conversation(client)])
        await say(client, said_in, LONG_FACT)
        await index_outbox(db, server.services.settings)
        item = await item_with(client, LONG_FACT)
        deadlocks = await _deadlocks(db)
        request = {"content": QUESTION}
        async with client.stream("POST", f"/v1/conversations/{replying_in}/messages", json=request) as r:
            events = iter_sse(r)
            started = await anext(e async for e in events if e.event == EventName.TURN_STARTED)
            await anext(e async for e in events if e.event == EventName.MESSAGE_DELTA)  # its part is stored
            own = {
                "sql": "SELECT id FROM conversations WHERE id = CAST(:c AS uuid) FOR NO KEY UPDATE",
                "c": said_in,
            }
            async with holding(db, **own) as release:
                correcting = asyncio.ensure_future(_change(client, "correct", item["id"]))
                await wait_until(
                    lambda: _waiting_on_locks(db, 1), REQUEST_BOUND_SECONDS, "the correction waits"
                )
                stopping = asyncio.ensure_future(client.post(f"/v1/turns/{started.data['reply_id']}/stop"))
                await wait_until(lambda: _waiting_on_locks(db, 2), REQUEST_BOUND_SECONDS, "the ending waits")
                release.set()
                async with asyncio.timeout(REQUEST_BOUND_SECONDS):
                    corrected, stopped = await asyncio.gather(correcting, stopping)
            assert [e.event async for e in events][-1] == EventName.TURN_INTERRUPTED
    assert corrected.status_code == 200, corrected.text
    assert stopped.status_code == 200 and stopped.json()["status"] == "interrupted_by_user"
    assert await _deadlocks(db) == deadlocks
    memory_use = "SELECT memory_use FROM turns WHERE id = CAST(:r AS uuid)"
    assert await scalar(db, memory_use, r=started.data["reply_id"]) == "forgotten"


@pytest.mark.parametrize("action", ["correct", "forget"])
async def test_changing_a_memory_while_a_parked_reply_shown_it_is_stopped_does_not_deadlock(
    action: str, start_server: Any, fake_openai: Any, db: Database
) -> None:
    """Found: a reply parked for a tool approval was stopped by locking its turn and then its
    conversation; the change locked the conversations and then that turn (only streaming turns
    came first). Postgres aborted one of them (a correction or forget aborted answers 500).
    A parked turn is now taken after its conversation, by every writer."""
    server = await start_server(
        tools=transfer_tools([]),
        llm_provider="openai",
        llm_base_url=fake_openai.base_url,
        llm_api_key="test",
        query_rewrite="heuristic",
    )
    fake_openai.script(
        Reply(text="Noted, good luck with the kitchen."),
        Reply(tool_calls=[ToolCall("transfer_funds", {"amount": 5, "to": "Ingrid"}, id="call_t")]),
    )
    async with server.client() as client:
        # The parked reply's conversation sorts first, so the change takes it before the memory's own.
        parked_in, said_in = sorted([await new_conversation(client), await new_conversation(client)])
        await say(client, said_in, LONG_FACT)
        await index_outbox(db, server.services.settings)
        item = await item_with(client, LONG_FACT)
        parked = await park(client, parked_in, QUESTION)
        assert LONG_FACT in [i["text"] for i in retrieved(parked)["items"]]  # it was shown the memory
        reply_id = parked[0].data["reply_id"]
        deadlocks = await _deadlocks(db)
        own = {
            "sql": "SELECT id FROM conversations WHERE id = CAST(:c AS uuid) FOR NO KEY UPDATE",
            "c": said_in,
        }
        async with holding(db, **own) as release:
            changing = asyncio.ensure_future(_change(client, action, item["id"]))
            await wait_until(lambda: _waiting_on_locks(db, 1), REQUEST_BOUND_SECONDS, "the change waits")
            stopping = asyncio.ensure_future(client.post(f"/v1/turns/{reply_id}/stop"))
            await wait_until(lambda: _waiting_on_locks(db, 2), REQUEST_BOUND_SECONDS, "the stop waits")
            release.set()
            async with asyncio.timeout(REQUEST_BOUND_SECONDS):
                changed, stopped = await asyncio.gather(changing, stopping)
    assert changed.status_code == (200 if action == "correct" else 204), changed.text
    assert stopped.status_code == 200 and stopped.json()["status"] == "interrupted_by_user", stopped.text
    assert await _deadlocks(db) == deadlocks
    memory_use = "SELECT memory_use FROM turns WHERE id = CAST(:r AS uuid)"
    assert await scalar(db, memory_use, r=reply_id) == "forgotten"
