"""Retention (expire, then purge after a grace period) and deleting a user, on a real server and Postgres.

Time moves by SQL (`created_at`/`deleted_at` set into the past), never by sleeping: the
job compares with the database's `now()`.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import httpx
from sqlalchemy import text

from memory.events import EventName
from memory.record.pending_stops import NEW_CHAT_STOP_SECONDS
from memory.storage.db import Database
from memory.storage.retention import RetentionJob, RetentionPolicy
from tests.conftest import LiveServer
from tests.support import new_conversation, wait_until
from tests.test_memory_recall import index_outbox, say

FACT = "My sister Ingrid moved to Reykjavik last spring and keeps honeybees there."
LATER_FACT = "Ingrid also adopted a one-eyed cat called Pirate."
QUESTION = "Where does my sister Ingrid live now?"
TABLES = ("conversations", "turns", "turn_events", "tool_invocations", "outbox", "memory_items")


STORED_UP_TO = text("SELECT coalesce(max(last_id), 0) FROM turn_events WHERE reply_id = :reply_id")


async def rows_of(db: Database, tenant: str, user: str) -> dict[str, int]:
    """Rows per table of one user (read unscoped, as an operator would)."""
    counts = {}
    async with db.transaction() as session:
        for table in TABLES:
            result = await session.execute(
                text(f"SELECT count(*) FROM {table} WHERE tenant_id = :t AND user_id = :u"),
                {"t": tenant, "u": user},
            )
            counts[table] = int(result.scalar_one())
    return counts


async def age(db: Database, statement: str, **params: Any) -> None:
    async with db.transaction() as session:
        await session.execute(text(statement), params)


def job(db: Database, **policy: Any) -> RetentionJob:
    return RetentionJob(db, RetentionPolicy(**policy), interval_seconds=3600)


async def expired_turns(db: Database, tenant: str) -> tuple[int, int]:
    """(soft-deleted, live) turns of a tenant."""
    async with db.transaction() as session:
        row = (
            await session.execute(
                text(
                    "SELECT count(*) FILTER (WHERE deleted_at IS NOT NULL) AS gone,"
                    " count(*) FILTER (WHERE deleted_at IS NULL) AS live FROM turns WHERE tenant_id = :t"
                ),
                {"t": tenant},
            )
        ).one()
    return int(row.gone), int(row.live)


async def test_each_tenant_expires_at_its_own_age(server: LiveServer, db: Database) -> None:
    for tenant in ("short", "default", "forever"):
        async with server.client(tenant=tenant) as client:
            await say(client, await new_conversation(client), FACT)
    await age(db, "UPDATE turns SET created_at = now() - interval '5 days'")
    retention = job(db, default_days=30, tenant_days={"short": 1, "forever": 0})
    await retention.expire()
    assert await expired_turns(db, "short") == (2, 0)
    assert await expired_turns(db, "default") == (0, 2)
    await age(db, "UPDATE turns SET created_at = now() - interval '40 days'")
    await retention.expire()
    assert await expired_turns(db, "default") == (2, 0)
    assert await expired_turns(db, "forever") == (0, 2)


async def test_expired_turns_vanish_at_once_from_lists_context_and_recall(
    server: LiveServer, db: Database, make_settings: Callable[..., Any]
) -> None:
    async with server.client() as client:
        old = await new_conversation(client, "Family")
        await say(client, old, FACT)
        await index_outbox(db, make_settings())
        await say(client, old, LATER_FACT)  # not indexed yet: found through the unindexed path
        fresh = await new_conversation(client, "Today")
        before = (await client.post("/v1/memory/search", json={"query": QUESTION})).json()["items"]
        assert {FACT, LATER_FACT} <= {item["text"] for item in before}
        turns = (await client.get(f"/v1/conversations/{old}/turns")).json()["items"]

        await age(
            db, "UPDATE turns SET created_at = now() - interval '3 days' WHERE conversation_id = :c", c=old
        )
        counts = await job(db, default_days=1).expire()
        assert counts["turns"] == 4

        assert (await client.get(f"/v1/conversations/{old}/turns")).json()["items"] == []
        assert (await client.get(f"/v1/turns/{turns[0]['id']}")).status_code == 404
        context = (await client.get(f"/v1/conversations/{old}/context")).json()
        assert "Reykjavik" not in str(context["messages"])
        after = (await client.post("/v1/memory/search", json={"query": QUESTION})).json()["items"]
        assert not {FACT, LATER_FACT} & {item["text"] for item in after}
        events = await say(client, fresh, QUESTION)
        recalled = next(e.data for e in events if e.event == EventName.MEMORY_RETRIEVED)
        assert "Reykjavik" not in str(recalled["items"])
    async with db.transaction() as session:
        live_memory = await session.execute(
            text("SELECT count(*) FROM memory_items WHERE deleted_at IS NULL")
        )
        assert live_memory.scalar_one() == 0  # only the expired conversation was indexed


async def test_purge_after_the_grace_period_removes_rows_and_spares_everyone_else(
    server: LiveServer, db: Database, make_settings: Callable[..., Any]
) -> None:
    async with server.client(tenant="t1", user="gone") as client:
        expiring = await new_conversation(client)
        await say(client, expiring, FACT)
        await say(client, expiring, "what time is it")  # a tool call: tool_invocations and events
        deleted = await new_conversation(client)
        await say(client, deleted, LATER_FACT)
    async with server.client(tenant="t1", user="stays") as client:
        await say(client, await new_conversation(client), FACT)
    await index_outbox(db, make_settings())
    await age(db, "UPDATE outbox SET consumed_at = now()")
    stays = await rows_of(db, "t1", "stays")
    async with server.client(tenant="t1", user="gone") as client:
        assert (await client.delete(f"/v1/conversations/{deleted}")).status_code == 204
    await age(
        db,
        "UPDATE turns SET created_at = now() - interval '40 days' WHERE conversation_id = :c",
        c=expiring,
    )
    await age(
        db,
        "UPDATE outbox SET created_at = now() - interval '40 days' WHERE conversation_id = :c",
        c=expiring,
    )
    retention = job(db, default_days=30, grace_days=7, batch_size=2)  # small batches: several rounds
    await retention.run_once()
    purged_too_early = await rows_of(db, "t1", "gone")
    assert (
        purged_too_early["turns"] == 6 + 2
    )  # soft-deleted (or in a deleted conversation), kept for the grace
    await age(db, "UPDATE turns SET deleted_at = now() - interval '8 days' WHERE deleted_at IS NOT NULL")
    await age(
        db, "UPDATE memory_items SET deleted_at = now() - interval '8 days' WHERE deleted_at IS NOT NULL"
    )
    await age(
        db, "UPDATE conversations SET deleted_at = now() - interval '8 days' WHERE deleted_at IS NOT NULL"
    )
    result = await retention.run_once()
    gone = await rows_of(db, "t1", "gone")
    assert gone == {table: 0 for table in TABLES} | {"conversations": 1}  # the expiring one, now empty
    assert result["purged"]["turns"] == 8
    assert await rows_of(db, "t1", "stays") == stays


async def _two_users_and_another_tenant(server: LiveServer, db: Database, settings: Any) -> dict[str, Any]:
    for tenant, user in (("t1", "u1"), ("t1", "u2"), ("t2", "u1")):
        async with server.client(tenant=tenant, user=user) as client:
            cid = await new_conversation(client)
            await say(client, cid, FACT)
            await say(client, cid, "what time is it")
    await index_outbox(db, settings)
    return {key: await rows_of(db, *key) for key in (("t1", "u2"), ("t2", "u1"))}


async def test_deleting_a_user_removes_everything_of_theirs_and_nothing_else(
    server: LiveServer, db: Database, make_settings: Callable[..., Any]
) -> None:
    others = await _two_users_and_another_tenant(server, db, make_settings())
    mine = await rows_of(db, "t1", "u1")
    assert all(mine[table] > 0 for table in TABLES), mine
    async with db.transaction() as session:  # what Kafka (or a slow queue) may still hold
        queued = list(
            (
                await session.execute(
                    text("SELECT payload FROM outbox WHERE tenant_id = 't1' AND user_id = 'u1'")
                )
            ).scalars()
        )
    async with server.client(tenant="t1", user="u1") as client:
        assert (await client.delete("/v1/users/me")).status_code == 204
        assert await rows_of(db, "t1", "u1") == {table: 0 for table in TABLES}
        assert (await client.get("/v1/conversations")).json()["items"] == []
        assert (await client.delete("/v1/users/me")).status_code == 204  # idempotent
    # A delivery that arrives after the deletion finds no conversation and writes nothing.
    from indexer.pipeline import IndexPipeline
    from memory.recall.embeddings import HashEmbedder

    result = await IndexPipeline(db, HashEmbedder(), make_settings()).index(queued)
    assert result.indexed_turns == 0 and result.skipped["deleted"] == len(queued)
    assert await rows_of(db, "t1", "u1") == {table: 0 for table in TABLES}
    assert {key: await rows_of(db, *key) for key in others} == others


async def test_deleting_a_user_stops_the_reply_streaming_first(start_server: Any, db: Database) -> None:
    server: LiveServer = await start_server(demo_tokens_per_second=20.0)
    async with server.client(tenant="t1", user="u1") as client:
        cid = await new_conversation(client)
        async with client.stream("POST", f"/v1/conversations/{cid}/messages", json={"content": "/long"}) as r:
            lines = r.aiter_lines()
            async with asyncio.timeout(10):
                async for line in lines:
                    if line == "event: message.delta":
                        break
            async with httpx.AsyncClient(base_url=server.base_url, headers=client.headers) as other:
                assert (await other.delete("/v1/users/me")).status_code == 204
            rest = [line async for line in lines]
        assert "event: turn.interrupted" in rest
    # The reply's ending was written before the deletion, so nothing came back after it.
    assert await rows_of(db, "t1", "u1") == {table: 0 for table in TABLES}


async def test_a_checkpoint_still_waiting_to_write_when_the_reply_ends_cannot_outlive_the_users_deletion(
    start_server: Any, db: Database
) -> None:
    """Under load a checkpoint write could commit after the reply's ending, and after a deletion
    that came next: a `turn_events` row of the deleted user came back (seen as a flaky failure of
    the test above). The ending now waits for a checkpoint write that claimed its events."""
    server: LiveServer = await start_server(demo_tokens_per_second=20.0)
    checkpoints = server.services.checkpointer.db.engine
    async with server.client(tenant="t1", user="u1") as client:
        cid = await new_conversation(client)
        async with client.stream("POST", f"/v1/conversations/{cid}/messages", json={"content": "/long"}) as r:
            lines = r.aiter_lines()
            async with asyncio.timeout(10):
                async for line in lines:
                    if line == "event: message.delta":
                        break
            (reply,) = server.services.registry.all()
            # Every connection of the checkpointer's pool is taken, as on a loaded server: its
            # next tick claims the reply's new events, then waits for a connection.
            pool = checkpoints.pool
            held = [await checkpoints.connect() for _ in range(pool.size() + pool._max_overflow)]

            async def a_write_waits() -> bool:
                """A checkpoint write claimed events it has not stored (one that had a connection
                before ours were taken may still be finishing: its events are stored)."""
                if reply.checkpoint_idle.is_set():
                    return False
                claimed = reply.events[reply.persisted - 1].id
                async with db.session() as session:
                    stored = await session.scalar(STORED_UP_TO, {"reply_id": reply.id})
                return bool(stored < claimed)

            try:
                await wait_until(a_write_waits, 10, "a checkpoint write to claim events and wait")

                async def stop_then_delete() -> None:
                    async with httpx.AsyncClient(base_url=server.base_url, headers=client.headers) as other:
                        assert (await other.post(f"/v1/turns/{reply.turn_id}/stop")).status_code == 200
                        assert (await other.delete("/v1/users/me")).status_code == 204

                deleting = asyncio.create_task(stop_then_delete())
                done, _ = await asyncio.wait({deleting}, timeout=1.0)
                assert not done, "the reply ended while a checkpoint of its events was still to be written"
            finally:
                for connection in held:
                    await connection.close()
            await deleting
            rest = [line async for line in lines]
        assert "event: turn.interrupted" in rest
    assert await rows_of(db, "t1", "u1") == {table: 0 for table in TABLES}


async def test_the_retention_job_runs_periodically_in_a_real_server(start_server: Any, db: Database) -> None:
    server: LiveServer = await start_server(retention_days=1.0, retention_interval_seconds=0.2)
    async with server.client(tenant="t1") as client:
        await say(client, await new_conversation(client), FACT)
    await age(db, "UPDATE turns SET created_at = now() - interval '2 days'")

    async def expired() -> bool:
        return await expired_turns(db, "t1") == (2, 0)

    await wait_until(expired, 10, "the retention job to expire both turns")


async def test_operator_cli_deletes_a_user(server: LiveServer, db: Database, pg_url: str) -> None:
    async with server.client(tenant="t1", user="u1") as client:
        await say(client, await new_conversation(client), FACT)
    async with server.client(tenant="t1", user="u2") as client:
        await say(client, await new_conversation(client), FACT)
    env = {**os.environ, "DATABASE_URL": pg_url}
    command = [sys.executable, "-m", "chat_api.cli", "users", "delete", "--tenant", "t1", "--user", "u1"]
    done = await asyncio.to_thread(
        subprocess.run, command, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "deleted user 'u1' of tenant 't1'" in done.stdout and "turns 2" in done.stdout
    assert await rows_of(db, "t1", "u1") == {table: 0 for table in TABLES}
    assert (await rows_of(db, "t1", "u2"))["turns"] == 2


BACKDATE_DELETION = "UPDATE conversations SET deleted_at = now() - interval '8 days' WHERE id = :c"


async def test_purging_a_deleted_conversation_waits_while_a_fork_shares_its_turns(
    server: LiveServer, db: Database
) -> None:
    """A fork shares the original's turns (no copies): purging the original must not cut its history."""
    async with server.client() as client:
        original = await new_conversation(client)
        await say(client, original, FACT)
        turns = (await client.get(f"/v1/conversations/{original}/turns")).json()["items"]
        r = await client.post(f"/v1/conversations/{original}/fork", json={"turn_id": turns[-1]["id"]})
        assert r.status_code == 201, r.text
        fork = r.json()["id"]
        await say(client, fork, LATER_FACT)
        history = (await client.get(f"/v1/conversations/{fork}/turns")).json()["items"]
        assert (await client.delete(f"/v1/conversations/{original}")).status_code == 204
        await age(db, BACKDATE_DELETION, c=original)
        retention = job(db, default_days=0, grace_days=7)
        await retention.run_once()
        # The fork still reads its whole history, shared turns included.
        assert (await client.get(f"/v1/conversations/{fork}/turns")).json()["items"] == history
        async with db.transaction() as session:
            kept = text("SELECT count(*) FROM turns WHERE conversation_id = :c")
            assert (await session.execute(kept, {"c": original})).scalar_one() == 2
        # Once the fork is gone too, both are purged.
        assert (await client.delete(f"/v1/conversations/{fork}")).status_code == 204
        await age(db, BACKDATE_DELETION, c=fork)
        await retention.run_once()
        await retention.run_once()  # the original becomes purgeable once its fork is gone
    assert (await rows_of(db, "t1", "u1"))["turns"] == 0
    async with db.transaction() as session:
        assert (await session.execute(text("SELECT count(*) FROM branches"))).scalar_one() == 0


async def test_a_tenants_last_stop_of_a_chat_id_no_run_came_for_was_kept_forever(
    server: LiveServer, db: Database
) -> None:
    """Found: a stale stop kept for a chat id (memory/record/pending_stops.py) was deleted only
    by the same tenant's next kept stop, or with its user: a tenant that stopped an id once and
    never again kept the row forever. The purge deletes stale ones, in batches, for every
    tenant, even one whose data is kept forever; a fresh one stays for its chat's first run."""
    for tenant, chat_ids in (("t1", ("a", "b", "c")), ("t2", ("d",)), ("t3", ("fresh",))):
        async with server.client(tenant=tenant) as client:
            for chat_id in chat_ids:
                stopped = await client.post(f"/v1/ai-sdk/chat/{chat_id}/stop", json={})
                assert (stopped.status_code, stopped.json()) == (202, {"success": False}), stopped.text
    await age(
        db,
        "UPDATE chat_stops SET requested_at = requested_at - make_interval(secs => CAST(:s AS float8))"
        " WHERE tenant_id <> 't3'",
        s=NEW_CHAT_STOP_SECONDS + 1,
    )
    result = await job(db, batch_size=2).run_once()  # retention off (keep forever); small batches
    assert result["purged"]["chat_stops"] == 4
    async with db.transaction() as session:
        kept = (await session.execute(text("SELECT tenant_id, chat_id FROM chat_stops"))).all()
    assert [tuple(row) for row in kept] == [("t3", "fresh")]
