"""Requests do what the client asked, once.

Found: five messages sent with on_busy=enqueue one after another were stored in the
order 1, 2, 4, 0, 3; the waiting line had no bound; the same Idempotency-Key with another
text answered 200 with the earlier reply and dropped the new text; and the per-user
limit counted open connections, so replies started and hung up on ran without bound.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import httpx
import pytest

from memory.events import EventName
from tests.conftest import LiveServer
from tests.sse import iter_sse
from tests.support import new_conversation, wait_until


async def start_long_reply(client: httpx.AsyncClient, cid: str) -> str:
    """Start a long reply and hang up on it (it goes on: a disconnect is not a stop); its reply id."""
    async with client.stream("POST", f"/v1/conversations/{cid}/messages", json={"content": "/long go"}) as r:
        assert r.status_code == 200, await r.aread()
        started = await anext(iter_sse(r))
    assert started.event == EventName.TURN_STARTED
    return str(started.data["reply_id"])


def enqueue(client: httpx.AsyncClient, cid: str, content: str, **fields: Any) -> asyncio.Task[httpx.Response]:
    body = {"content": content, "on_busy": "enqueue", "stream": False, **fields}
    return asyncio.create_task(client.post(f"/v1/conversations/{cid}/messages", json=body))


async def user_texts(client: httpx.AsyncClient, cid: str) -> list[str]:
    items = (await client.get(f"/v1/conversations/{cid}/turns")).json()["items"]
    return [t["content"] for t in items if t["role"] == "user"]


async def test_enqueued_messages_run_in_arrival_order(start_server: Any) -> None:
    server: LiveServer = await start_server(demo_tokens_per_second=150)
    queues = server.services.queues
    async with server.client() as client:
        cid = await new_conversation(client)
        running = await start_long_reply(client, cid)
        sent = []
        for i in range(5):
            sent.append(enqueue(client, cid, f"queued {i}"))
            await wait_until(lambda n=i + 1: queues.waiting(uuid.UUID(cid)) == n)
        assert (await client.post(f"/v1/turns/{running}/stop")).status_code == 200
        replies = await asyncio.gather(*sent)
        assert all(r.status_code == 200 and r.json()["status"] == "completed" for r in replies)
        assert await user_texts(client, cid) == ["/long go"] + [f"queued {i}" for i in range(5)]
        # Each waited for the one before it: every reply answers its own message.
        for i, reply in enumerate(replies):
            assert f"queued {i}" in reply.json()["turns"][-1]["content"]
    assert queues.waiting(uuid.UUID(cid)) == 0


async def test_the_line_of_waiting_messages_is_bounded(start_server: Any) -> None:
    server: LiveServer = await start_server(demo_tokens_per_second=150, max_queued_per_conversation=2)
    queues = server.services.queues
    async with server.client() as client:
        cid = await new_conversation(client)
        running = await start_long_reply(client, cid)
        # One after the other: two requests sent at once may reach the server in either order.
        waiting = []
        for n, text in enumerate(["a", "b"], start=1):
            waiting.append(enqueue(client, cid, text))
            await wait_until(lambda n=n: queues.waiting(uuid.UUID(cid)) == n)
        refused = await client.post(
            f"/v1/conversations/{cid}/messages",
            json={"content": "c", "on_busy": "enqueue", "stream": False},
        )
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "rate_limited" and int(refused.headers["Retry-After"]) >= 1
        # Another conversation has its own line.
        other = await new_conversation(client)
        ok = await client.post(f"/v1/conversations/{other}/messages", json={"content": "d", "stream": False})
        assert ok.status_code == 200
        await client.post(f"/v1/turns/{running}/stop")
        assert [r.status_code for r in await asyncio.gather(*waiting)] == [200, 200]
        assert await user_texts(client, cid) == ["/long go", "a", "b"]  # nothing of the refused one


async def test_a_queued_message_whose_client_left_is_dropped_with_on_disconnect_stop(
    start_server: Any,
) -> None:
    server: LiveServer = await start_server(demo_tokens_per_second=150)
    queues = server.services.queues
    async with server.client() as client:
        cid = await new_conversation(client)
        running = await start_long_reply(client, cid)
        # Two clients that give up while their message waits: one asked for a stop on
        # disconnect, the other (the default) for the message to go on.
        async with httpx.AsyncClient(base_url=server.base_url, headers=client.headers) as leaving:
            gone = [
                enqueue(leaving, cid, "dropped", on_disconnect="stop"),
                enqueue(leaving, cid, "kept", on_disconnect="continue"),
            ]
            await wait_until(lambda: queues.waiting(uuid.UUID(cid)) == 2)
            for task in gone:
                task.cancel()
            await asyncio.gather(*gone, return_exceptions=True)
        # The dropped one leaves the line as soon as its client is seen gone, before its turn.
        await wait_until(lambda: queues.waiting(uuid.UUID(cid)) == 1)
        assert await user_texts(client, cid) == ["/long go"]
        await client.post(f"/v1/turns/{running}/stop")
        await wait_until(lambda: queues.waiting(uuid.UUID(cid)) == 0)

        async def kept_answered() -> bool:
            items = (await client.get(f"/v1/conversations/{cid}/turns")).json()["items"]
            return len(items) == 4 and items[-1]["status"] == "completed"

        await wait_until(kept_answered)
        assert await user_texts(client, cid) == ["/long go", "kept"]


def door_enqueue(client: httpx.AsyncClient, door: str, cid: str, text: str) -> asyncio.Task[httpx.Response]:
    """A message sent on the AG-UI or AI SDK door with on_busy=enqueue and on_disconnect=stop."""
    options = {"on_busy": "enqueue", "on_disconnect": "stop"}
    message_id = str(uuid.uuid4())
    if door == "ag-ui":
        path = "/v1/ag-ui"
        message = {"id": message_id, "role": "user", "content": text}
        body = {"threadId": cid, "runId": str(uuid.uuid4()), "messages": [message], "forwardedProps": options}
    else:
        path = "/v1/ai-sdk/chat"
        message = {"id": message_id, "role": "user", "parts": [{"type": "text", "text": text}]}
        body = {"id": cid, "trigger": "submit-message", "messages": [message], **options}
    return asyncio.create_task(client.post(path, json=body))


@pytest.mark.parametrize("door", ["ag-ui", "ai-sdk"])
async def test_a_queued_message_whose_client_left_is_dropped_with_on_disconnect_stop_on_every_door(
    start_server: Any, door: str
) -> None:
    """Found: on the AG-UI and AI SDK doors the message stayed in line, was stored once its
    turn came, and its reply was started and cut off: a message the user abandoned, kept."""
    server: LiveServer = await start_server(demo_tokens_per_second=150)
    queues = server.services.queues
    async with server.client() as client:
        cid = await new_conversation(client)
        running = await start_long_reply(client, cid)
        async with httpx.AsyncClient(base_url=server.base_url, headers=client.headers) as leaving:
            gone = door_enqueue(leaving, door, cid, "dropped")
            await wait_until(lambda: queues.waiting(uuid.UUID(cid)) == 1)
            gone.cancel()
            await asyncio.gather(gone, return_exceptions=True)
        # It leaves the line as soon as its client is seen gone, while the reply before it runs.
        await wait_until(lambda: queues.waiting(uuid.UUID(cid)) == 0, timeout=5)
        await client.post(f"/v1/turns/{running}/stop")
        assert await user_texts(client, cid) == ["/long go"]


async def test_same_idempotency_key_with_a_different_body_is_a_422(server: LiveServer) -> None:
    async with server.client() as client:
        cid = await new_conversation(client)
        url = f"/v1/conversations/{cid}/messages"
        headers = {"Idempotency-Key": "key-1"}
        first = await client.post(url, json={"content": "pay 5", "stream": False}, headers=headers)
        assert first.status_code == 200
        replay = await client.post(url, json={"content": "pay 5", "stream": False}, headers=headers)
        assert replay.status_code == 200
        assert replay.json()["turns"][-1]["id"] == first.json()["turns"][-1]["id"]
        changed = await client.post(url, json={"content": "pay 500", "stream": False}, headers=headers)
        assert changed.status_code == 422, changed.text
        assert changed.json()["error"]["code"] == "idempotency_key_reused"
        assert changed.json()["error"]["details"]["field"] == "Idempotency-Key"
        # The message's key reused for a regenerate is another request too.
        last = first.json()["turns"][-1]["id"]
        regen = await client.post(f"/v1/turns/{last}/regenerate", json={"stream": False}, headers=headers)
        assert regen.status_code == 422, regen.text
        assert await user_texts(client, cid) == ["pay 5"]


async def test_running_replies_are_capped_even_when_their_clients_hang_up(start_server: Any) -> None:
    server: LiveServer = await start_server(demo_tokens_per_second=20, max_running_replies_per_user=2)
    async with server.client() as client:
        a, b, c = [await new_conversation(client) for _ in range(3)]
        replies = [await start_long_reply(client, a), await start_long_reply(client, b)]
        # No connection is open any more, and still the third reply is refused.
        r = await client.post(f"/v1/conversations/{c}/messages", json={"content": "third", "stream": False})
        assert r.status_code == 429, r.text
        assert int(r.headers["Retry-After"]) >= 1
        assert await user_texts(client, c) == []
        # Another user is not held by this one's cap.
        async with server.client(user="u2") as other:
            mine = await new_conversation(other)
            body = {"content": "hi", "stream": False}
            ok = await other.post(f"/v1/conversations/{mine}/messages", json=body)
            assert ok.status_code == 200
        for reply_id in replies:
            assert (await client.post(f"/v1/turns/{reply_id}/stop")).status_code == 200
        r = await client.post(f"/v1/conversations/{c}/messages", json={"content": "third", "stream": False})
        assert r.status_code == 200, r.text
