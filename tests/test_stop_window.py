"""A stop sent while the reply it means is being started: before its turns are stored.

The client has sent its message (or picked its AG-UI runId) and then stops; the server may
not have stored the reply yet, on this process or another. Each test holds the
conversation's row lock in its own transaction, so the start (and the stop) wait at it;
`pg_stat_activity` tells when they do (a condition, not a sleep). Then the lock is let go.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import pytest
from openai import AsyncOpenAI
from sqlalchemy import text

from chat_api.protocols.openai.conversations import chat_key_conversation
from memory.record.conversations import Owner
from memory.record.pending_stops import NEW_CHAT_STOP_SECONDS
from tests.conftest import LiveServer, token_for
from tests.sse import iter_sse
from tests.support import conversation_locked, new_conversation, wait_until

SLOW = {"demo_tokens_per_second": 40}


def run_input(thread_id: str, content: str) -> dict[str, Any]:
    message = {"id": str(uuid.uuid4()), "role": "user", "content": content}
    run_id = str(uuid.uuid4())
    return {"threadId": thread_id, "runId": run_id, "messages": [message], "protocolVersion": "1.0"}


def ui_message(content: str) -> dict[str, Any]:
    return {"id": str(uuid.uuid4()), "role": "user", "parts": [{"type": "text", "text": content}]}


async def stored_replies(api: Any, chat_id: str) -> list[tuple[str, str]]:
    stored = (await api.get(f"/v1/ai-sdk/chat/{chat_id}/messages")).json()
    return [
        (m["metadata"]["status"], "".join(p.get("text", "") for p in m["parts"]))
        for m in stored
        if m["role"] == "assistant"
    ]


async def test_an_ag_ui_stop_naming_a_run_not_yet_stored_answered_404_and_the_run_streamed_to_its_end(
    start_server: Any, db: Any
) -> None:
    """Found: the client picks the runId, so its stop can come before the run's turns are
    stored; it answered 404 and the run then started and streamed to its end. The stop is now
    kept for the run (202, not confirmed yet), and the run starts stopped: RUN_FINISHED
    `cancelled`, stored `interrupted_by_user` with nothing said."""
    server: LiveServer = await start_server(**SLOW)
    async with server.client() as api:
        thread_id = await new_conversation(api)
        body = run_input(thread_id, "/long story")
        async with conversation_locked(db, thread_id) as waiting:
            stop = asyncio.create_task(api.post(f"/v1/ag-ui/{thread_id}/stop", json={"runId": body["runId"]}))
            await waiting(1)  # the stop has the lock next
            run = asyncio.create_task(api.post("/v1/ag-ui", json=body))
            await waiting(2)  # the run's start waits behind it, its turns not stored
        stopped = await stop
        assert (stopped.status_code, stopped.json()) == (202, {"success": False}), stopped.text
        answered = await run
        assert answered.status_code == 200, answered.text
        events = [item.data async for item in iter_sse(answered)]
        assert events[0]["type"] == "RUN_STARTED"
        assert events[-1]["type"] == "RUN_FINISHED" and events[-1]["outcome"] == {"type": "cancelled"}
        assert await stored_replies(api, thread_id) == [("interrupted_by_user", "")]
        # The kept stop was taken: the thread's next run is answered in full.
        async with api.stream("POST", "/v1/ag-ui", json=run_input(thread_id, "hello")) as response:
            await response.aread()
        statuses = [status for status, _ in await stored_replies(api, thread_id)]
        assert statuses == ["interrupted_by_user", "completed"]


async def test_an_ai_sdk_stop_while_the_reply_was_being_stored_answered_success_and_stopped_nothing(
    start_server: Any, db: Any
) -> None:
    """Found: the AI SDK stop names only the chat; sent while the reply's turns were being
    stored, it read no running reply, answered `{"success": true}`, and the reply streamed to
    its end. The stop now waits for the conversation's lock, reads the reply just stored, and
    stops it: the stream ends with `abort`, the reply is stored `interrupted_by_user`."""
    server: LiveServer = await start_server(**SLOW)
    async with server.client() as api:
        chat_id = await new_conversation(api)  # the conversation's own id names it as a chat
        body = {"id": chat_id, "trigger": "submit-message", "messages": [ui_message("/long story")]}
        async with conversation_locked(db, chat_id) as waiting:
            sent = asyncio.create_task(api.post("/v1/ai-sdk/chat", json=body))
            await waiting(1)  # the message's start waits at the lock, nothing stored
            stop = asyncio.create_task(api.post(f"/v1/ai-sdk/chat/{chat_id}/stop", json={}))
            await waiting(2)
        stopped = await stop
        assert (stopped.status_code, stopped.json()) == (200, {"success": True}), stopped.text
        answered = await sent
        assert answered.status_code == 200, answered.text
        assert last_chunk(answered)["type"] == "abort"
        assert [status for status, _ in await stored_replies(api, chat_id)] == ["interrupted_by_user"]


async def test_a_stop_of_a_chat_with_nothing_running_stopped_the_next_message(start_server: Any) -> None:
    """A stop that found nothing running is kept only for a reply whose start had begun before
    it. The person stopped a reply that had just ended (the stop came too late) and then
    sent a new message: that message's reply must be answered in full, not started stopped."""
    server: LiveServer = await start_server()
    async with server.client() as api:
        chat_id = await new_conversation(api)
        late = await api.post(f"/v1/ai-sdk/chat/{chat_id}/stop", json={})
        assert (late.status_code, late.json()) == (200, {"success": True}), late.text
        body = {"id": chat_id, "trigger": "submit-message", "messages": [ui_message("hello")]}
        answered = await api.post("/v1/ai-sdk/chat", json=body)
        assert answered.status_code == 200, answered.text
        assert [status for status, _ in await stored_replies(api, chat_id)] == ["completed"]


async def stop_while_a_message_waits_its_turn(
    server: LiveServer,
    api: Any,
    db: Any,
    chat_id: str,
    stop_path: str,
    stop_body: dict[str, Any],
    send: tuple[str, dict[str, Any]] | None = None,
) -> tuple[Any, Any]:
    """Send a message (by default to the AI SDK door; `send`: another door's path and body),
    then a stop that takes the conversation's lock before the message's start does: the
    message waits in line behind a run (at the lock) that then fails, so the stop finds
    nothing running. The stop's answer, and the message's."""
    enqueue = {"on_busy": "enqueue"}
    # Answers no tool call of the conversation: refused under the lock, nothing stored.
    result = {"id": str(uuid.uuid4()), "role": "tool", "toolCallId": "call_none", "content": "{}"}
    failing = {
        "threadId": chat_id,
        "runId": str(uuid.uuid4()),
        "messages": [result],
        "forwardedProps": enqueue,
    }
    message = {"id": chat_id, "trigger": "submit-message", "messages": [ui_message("/long story")], **enqueue}
    path, body = send or ("/v1/ai-sdk/chat", message)
    async with conversation_locked(db, chat_id) as waiting:
        ahead = asyncio.create_task(api.post("/v1/ag-ui", json=failing))
        await waiting(1)
        sent = asyncio.create_task(api.post(path, json={**body, **enqueue}))
        await wait_until(lambda: server.services.queues.waiting(uuid.UUID(chat_id)) == 2, what="in line")
        stop = asyncio.create_task(api.post(stop_path, json=stop_body))
        await waiting(2)
    assert (await ahead).status_code == 422
    answered = await sent
    assert answered.status_code == 200, answered.text
    return await stop, answered


def last_chunk(answered: Any) -> dict[str, Any]:
    """The AI SDK stream's last chunk before `[DONE]`."""
    chunks = [line[len("data: ") :] for line in answered.text.splitlines() if line.startswith("data: ")]
    assert chunks[-1] == "[DONE]"
    found: dict[str, Any] = json.loads(chunks[-2])
    return found


async def test_a_stop_sent_after_a_message_but_stored_before_its_turns_stopped_nothing(
    start_server: Any, db: Any
) -> None:
    """A stop that finds nothing running is kept for a reply whose request arrived before it:
    the message's reply starts stopped. Before, the stop answered success and the reply
    streamed to its end."""
    server: LiveServer = await start_server(**SLOW)
    async with server.client() as api:
        chat_id = await new_conversation(api)
        stop_path = f"/v1/ai-sdk/chat/{chat_id}/stop"
        stopped, answered = await stop_while_a_message_waits_its_turn(server, api, db, chat_id, stop_path, {})
        assert (stopped.status_code, stopped.json()) == (200, {"success": True}), stopped.text
        assert last_chunk(answered)["type"] == "abort"
        assert await stored_replies(api, chat_id) == [("interrupted_by_user", "")]


async def test_a_stop_naming_a_run_that_had_ended_stopped_the_next_message(
    start_server: Any, db: Any
) -> None:
    """A stop naming by its runId a run that had ended stops nothing, and keeps nothing: it
    must not be kept as a stop of the chat and stop a message in flight beside it."""
    server: LiveServer = await start_server(**SLOW)
    async with server.client() as api:
        thread_id = await new_conversation(api)
        ended = run_input(thread_id, "hello")
        async with api.stream("POST", "/v1/ag-ui", json=ended) as response:
            await response.aread()
        stop_path = f"/v1/ag-ui/{thread_id}/stop"
        stop_body = {"runId": ended["runId"]}
        stopped, answered = await stop_while_a_message_waits_its_turn(
            server, api, db, thread_id, stop_path, stop_body
        )
        assert (stopped.status_code, stopped.json()) == (200, {"success": True}), stopped.text
        assert last_chunk(answered)["type"] == "finish"
        assert [status for status, _ in await stored_replies(api, thread_id)] == ["completed", "completed"]


async def test_a_stop_of_the_chat_kept_while_a_message_to_the_turns_door_waited_stopped_nothing(
    start_server: Any, db: Any
) -> None:
    """Found: the doors that passed no arrival time (chatmem's own messages, regenerate and
    edit, the OpenAI doors, ...) counted a kept stop from the start of the transaction storing
    the reply, so a stop sent after the message, but kept before its turns were stored, was
    taken as stale: the reply streamed to its end. Every door's request now arrives at the
    door, and the stop is taken: the reply is stored `interrupted_by_user`, empty."""
    server: LiveServer = await start_server(**SLOW)
    async with server.client() as api:
        conversation_id = await new_conversation(api)
        stop_path = f"/v1/ai-sdk/chat/{conversation_id}/stop"
        send = (f"/v1/conversations/{conversation_id}/messages", {"content": "/long story", "stream": False})
        stopped, answered = await stop_while_a_message_waits_its_turn(
            server, api, db, conversation_id, stop_path, {}, send
        )
        assert (stopped.status_code, stopped.json()) == (200, {"success": True}), stopped.text
        assert answered.json()["status"] == "interrupted_by_user", answered.text
        assert await stored_replies(api, conversation_id) == [("interrupted_by_user", "")]


async def test_a_stop_of_a_brand_new_ag_ui_thread_answered_404_and_its_first_run_streamed_to_its_end(
    start_server: Any,
) -> None:
    """Found: the client picks the threadId, so the stop of a new thread's first run can come
    before the run's request has made the thread; it answered 404 and the run streamed
    unstopped. The stop is kept for the thread id (202, not confirmed), and the first run
    (the one it names) starts stopped; the next run is answered in full."""
    server: LiveServer = await start_server(**SLOW)
    thread_id = str(uuid.uuid4())
    body = run_input(thread_id, "/long story")
    async with server.client() as api:
        stopped = await api.post(f"/v1/ag-ui/{thread_id}/stop", json={"runId": body["runId"]})
        assert (stopped.status_code, stopped.json()) == (202, {"success": False}), stopped.text
        answered = await api.post("/v1/ag-ui", json=body)
        assert answered.status_code == 200, answered.text
        events = [item.data async for item in iter_sse(answered)]
        assert events[-1]["type"] == "RUN_FINISHED" and events[-1]["outcome"] == {"type": "cancelled"}
        assert await stored_replies(api, thread_id) == [("interrupted_by_user", "")]
        async with api.stream("POST", "/v1/ag-ui", json=run_input(thread_id, "hello")) as response:
            await response.aread()
        assert [status for status, _ in await stored_replies(api, thread_id)] == [
            "interrupted_by_user",
            "completed",
        ]


async def test_a_stop_of_a_brand_new_ai_sdk_chat_answered_404_and_its_first_reply_streamed_to_its_end(
    start_server: Any,
) -> None:
    """The same for the AI SDK's stop, which names only the chat: kept for the chat's first
    reply, which starts stopped (the stream ends with `abort`)."""
    server: LiveServer = await start_server(**SLOW)
    chat_id = f"chat-{uuid.uuid4().hex}"
    async with server.client() as api:
        stopped = await api.post(f"/v1/ai-sdk/chat/{chat_id}/stop", json={})
        assert (stopped.status_code, stopped.json()) == (202, {"success": False}), stopped.text
        body = {"id": chat_id, "trigger": "submit-message", "messages": [ui_message("/long story")]}
        answered = await api.post("/v1/ai-sdk/chat", json=body)
        assert answered.status_code == 200, answered.text
        assert last_chunk(answered)["type"] == "abort"
        assert await stored_replies(api, chat_id) == [("interrupted_by_user", "")]


KEPT_FOR_NEW_CHATS = text("SELECT chat_id FROM chat_stops ORDER BY chat_id")
AGE_KEPT_STOPS = text(
    "UPDATE chat_stops SET requested_at = requested_at - make_interval(secs => CAST(:seconds AS float8))"
)


async def test_a_stop_of_a_chat_id_no_run_came_for_stopped_a_chat_begun_later_and_was_kept_forever(
    start_server: Any, db: Any
) -> None:
    """A stop of a chat id is kept for that chat's first run only NEW_CHAT_STOP_SECONDS: a
    chat begun after that (the run the stop meant never came) is answered in full, and the
    next stop kept in the tenant deletes the stale row, so stops of ids nobody uses do not
    pile up. (Time is moved by SQL, not waited for.)"""
    server: LiveServer = await start_server()
    async with server.client() as api:
        stale = await api.post("/v1/ai-sdk/chat/never-sent/stop", json={})
        assert stale.status_code == 202, stale.text
        async with db.transaction() as session:
            await session.execute(AGE_KEPT_STOPS, {"seconds": NEW_CHAT_STOP_SECONDS + 1})
        body = {"id": "never-sent", "trigger": "submit-message", "messages": [ui_message("hello")]}
        answered = await api.post("/v1/ai-sdk/chat", json=body)
        assert answered.status_code == 200, answered.text
        assert [status for status, _ in await stored_replies(api, "never-sent")] == ["completed"]

        for chat_id in ("unused-a", "unused-b"):
            assert (await api.post(f"/v1/ai-sdk/chat/{chat_id}/stop", json={})).status_code == 202
        async with db.transaction() as session:
            await session.execute(AGE_KEPT_STOPS, {"seconds": NEW_CHAT_STOP_SECONDS + 1})
        assert (await api.post("/v1/ai-sdk/chat/unused-c/stop", json={})).status_code == 202
        async with db.session() as session:
            assert list((await session.execute(KEPT_FOR_NEW_CHATS)).scalars()) == ["unused-c"]


CHAT_OF = text("SELECT conversation_id FROM ai_sdk_chats WHERE chat_id = :chat_id")
STOP_PATHS = {"ai-sdk": "/v1/ai-sdk/chat/{chat_id}/stop", "ag-ui": "/v1/ag-ui/{thread_id}/stop"}


async def test_a_stop_of_a_deleted_chat_answered_404_by_its_picked_id_and_202_by_its_conversation_id(
    server: LiveServer, db: Any
) -> None:
    """Found: both stop routes documented 404 for a chat whose conversation was deleted, but
    only a chat id the client picked got it; the conversation's own id (a chat id too) answered
    202 `{success: false}`, as any id the caller has not used does. A stop is what a client
    sends blind (on a button, on unmount), and its answer must not tell a deleted chat from
    one never used: every form answers 202 `{success: false}` on both doors, and nothing is
    kept for a picked id that still names the deleted conversation (no run can start under
    it). The published contract no longer promises a 404."""
    async with server.client() as api:
        picked = f"chat-{uuid.uuid4().hex}"
        body = {"id": picked, "trigger": "submit-message", "messages": [ui_message("hello")]}
        assert (await api.post("/v1/ai-sdk/chat", json=body)).status_code == 200
        async with db.session() as session:
            conversation_id = str((await session.execute(CHAT_OF, {"chat_id": picked})).scalar_one())
        assert (await api.delete(f"/v1/conversations/{conversation_id}")).status_code == 204
        for path in STOP_PATHS.values():
            for chat_id in (picked, conversation_id):
                stop = path.format(chat_id=chat_id, thread_id=chat_id)
                stopped = await api.post(stop, json={})
                assert (stopped.status_code, stopped.json()) == (202, {"success": False}), stop
        async with db.session() as session:
            # The conversation's id is a chat id not used now: a message to it starts a new chat.
            assert list((await session.execute(KEPT_FOR_NEW_CHATS)).scalars()) == [conversation_id]
        contract = (await api.get("/openapi.json")).json()
        for path in STOP_PATHS.values():
            assert "404" not in contract["paths"][path]["post"]["responses"], path


# The chat completions door reads the caller's histories (to find the conversation a request
# continues) before it takes the conversation's lock; a stop never reads turns.
TURNS_LOCKED = text("LOCK TABLE turns IN ACCESS EXCLUSIVE MODE")
CHOOSING_AT_THE_TURNS_LOCK = text(
    "SELECT count(*) FROM pg_stat_activity"
    " WHERE wait_event_type = 'Lock' AND query LIKE '%SELECT c.id FROM conversations c%'"
)


@pytest.mark.parametrize("door", ["chat-completions", "responses"])
async def test_a_stop_kept_while_an_openai_sdk_request_was_on_its_way_to_being_stored_stopped_nothing(
    start_server: Any, db: Any, door: str
) -> None:
    """The OpenAI doors passed no arrival time: a stop of the conversation sent after the
    request had passed the door, and kept before its turns were stored, was taken as stale (as
    if it meant a reply that had ended) and the reply streamed in full. Through the `openai`
    SDK: the request is held where it chooses its conversation, the stop finds nothing running
    and is kept, and the reply starts stopped: nothing streamed, stored `interrupted_by_user`."""
    server: LiveServer = await start_server(**SLOW)
    openai = AsyncOpenAI(base_url=f"{server.base_url}/openai/v1", api_key=token_for(), max_retries=0)
    async with openai, server.client() as api:
        first: list[Any] = [{"role": "user", "content": "hello"}]
        raw = await openai.chat.completions.with_raw_response.create(model="chatmem-demo", messages=first)
        conversation_id = raw.headers["x-chatmem-conversation-id"]
        answer = raw.parse().choices[0].message.content
        said = {"role": "assistant", "content": answer}
        messages = [*first, said, {"role": "user", "content": "/long story"}]
        async with db.transaction() as session:
            await session.execute(TURNS_LOCKED)
            if door == "responses":  # the whole history as input: mapped as chat completions' is
                sent: asyncio.Task[Any] = asyncio.create_task(
                    openai.responses.create(model="chatmem-demo", input=messages, stream=True)
                )
            else:
                sent = asyncio.create_task(
                    openai.chat.completions.create(model="chatmem-demo", messages=messages, stream=True)
                )

            async def choosing() -> bool:
                async with db.session() as watch:
                    return bool((await watch.execute(CHOOSING_AT_THE_TURNS_LOCK)).scalar_one() == 1)

            await wait_until(choosing, what="the request choosing its conversation, at the lock")
            stopped = await api.post(f"/v1/ai-sdk/chat/{conversation_id}/stop", json={})
            assert (stopped.status_code, stopped.json()) == (200, {"success": True}), stopped.text
        stream = await sent
        chunks = [chunk async for chunk in stream]
        assert stream.response.headers["x-chatmem-conversation-id"] == conversation_id
        if door == "responses":
            assert [c.type for c in chunks if c.type == "response.output_text.delta"] == []
        else:
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
        statuses = [status for status, _ in await stored_replies(api, conversation_id)]
        assert statuses == ["completed", "interrupted_by_user"]


def chat_keyed(server: LiveServer, key: str, tenant: str = "t1", user: str = "u1") -> AsyncOpenAI:
    """An `openai` SDK client of the OpenAI doors whose requests name their chat by `key`."""
    return AsyncOpenAI(
        base_url=f"{server.base_url}/openai/v1",
        api_key=token_for(tenant, user),
        max_retries=0,
        default_headers={"X-Chatmem-Chat-Key": key},
    )


async def streamed_text(openai: AsyncOpenAI, door: str, content: str) -> tuple[str, str]:
    """A first message streamed through the door: (the conversation it went to, the text streamed)."""
    messages: list[Any] = [{"role": "user", "content": content}]
    if door == "responses":
        answer: Any = await openai.responses.create(model="chatmem-demo", input=messages, stream=True)
        text = "".join([c.delta async for c in answer if c.type == "response.output_text.delta"])
    else:
        answer = await openai.chat.completions.create(model="chatmem-demo", messages=messages, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in answer if c.choices])
    return answer.response.headers["x-chatmem-conversation-id"], text


@pytest.mark.parametrize("door", ["chat-completions", "responses"])
async def test_a_stop_of_a_chat_keys_conversation_sent_before_its_first_request_was_never_taken(
    start_server: Any, db: Any, door: str
) -> None:
    """Found: the conversation an OpenAI door makes for a chat key (`X-Chatmem-Chat-Key`) has
    an id that comes from the key, so a stop can name it before the request that makes it is
    served. The stop was kept for that id (202), but making the conversation did not take it:
    the first reply streamed in full and the stop stayed kept. Making it now takes the stop, as
    the AI SDK and AG-UI doors' new chats do: the first reply starts stopped (nothing
    streamed, stored `interrupted_by_user`), and nothing stays kept."""
    server: LiveServer = await start_server(**SLOW)
    key = f"key-{uuid.uuid4().hex}"
    # As the README tells a client to derive it (the token's tenant and user, and the key).
    conversation_id = str(uuid.uuid5(uuid.UUID("8f4a2b1e-5d1c-4c36-9a57-2a0d6f1c9b3e"), f"t1\x1fu1\x1f{key}"))
    async with chat_keyed(server, key) as openai, server.client() as api:
        stopped = await api.post(f"/v1/ai-sdk/chat/{conversation_id}/stop", json={})
        assert (stopped.status_code, stopped.json()) == (202, {"success": False}), stopped.text
        assert await streamed_text(openai, door, "/long story") == (conversation_id, "")
        assert await stored_replies(api, conversation_id) == [("interrupted_by_user", "")]
        async with db.session() as session:
            assert list((await session.execute(KEPT_FOR_NEW_CHATS)).scalars()) == []


async def test_a_chat_keys_first_reply_was_stopped_by_neither_another_owners_stop_of_its_id_nor_a_stale_one(
    start_server: Any, db: Any
) -> None:
    """Only its owner's fresh stop is taken by a chat key's new conversation: a stop naming the
    same id from another user or tenant is a stop of their own unused chat id (kept for them,
    untouched), and one older than NEW_CHAT_STOP_SECONDS is dropped (time moved by SQL). The
    first reply is answered in full either way."""
    server: LiveServer = await start_server()
    owner = Owner("t1", "u1")
    key, stale_key = f"key-{uuid.uuid4().hex}", f"key-{uuid.uuid4().hex}"
    conversation_id = str(chat_key_conversation(owner, key))
    for tenant, user in (("t1", "u2"), ("t2", "u1")):
        async with server.client(tenant, user) as other:
            stopped = await other.post(f"/v1/ai-sdk/chat/{conversation_id}/stop", json={})
            assert (stopped.status_code, stopped.json()) == (202, {"success": False}), stopped.text
    async with chat_keyed(server, key) as openai, server.client() as api:
        said, text = await streamed_text(openai, "chat-completions", "hello")
        assert said == conversation_id and text
        assert await stored_replies(api, conversation_id) == [("completed", text)]
        async with db.session() as session:
            kept = list((await session.execute(KEPT_FOR_NEW_CHATS)).scalars())
        assert kept == [conversation_id, conversation_id]  # the other two owners'

        stale_id = str(chat_key_conversation(owner, stale_key))
        assert (await api.post(f"/v1/ai-sdk/chat/{stale_id}/stop", json={})).status_code == 202
        async with db.transaction() as session:
            await session.execute(AGE_KEPT_STOPS, {"seconds": NEW_CHAT_STOP_SECONDS + 1})
        async with chat_keyed(server, stale_key) as later:
            said, text = await streamed_text(later, "chat-completions", "hello")
        assert said == stale_id and text
        assert await stored_replies(api, stale_id) == [("completed", text)]


async def test_a_stop_of_a_chat_keys_conversation_while_its_first_reply_ran_stopped_it_and_kept_nothing(
    start_server: Any, db: Any
) -> None:
    """Once the key's conversation exists, a stop naming it stops the running reply (200
    `{success: true}`, stored `interrupted_by_user` with exactly the text streamed) and is not
    kept for a first reply to come."""
    server: LiveServer = await start_server(**SLOW)
    key = f"key-{uuid.uuid4().hex}"
    conversation_id = str(chat_key_conversation(Owner("t1", "u1"), key))
    messages: list[Any] = [{"role": "user", "content": "/long story"}]
    async with chat_keyed(server, key) as openai, server.client() as api:
        stream = await openai.chat.completions.create(model="chatmem-demo", messages=messages, stream=True)
        assert stream.response.headers["x-chatmem-conversation-id"] == conversation_id
        text, stopped = "", None
        async for chunk in stream:
            text += (chunk.choices[0].delta.content or "") if chunk.choices else ""
            if text and stopped is None:
                stopped = await api.post(f"/v1/ai-sdk/chat/{conversation_id}/stop", json={})
        assert stopped is not None
        assert (stopped.status_code, stopped.json()) == (200, {"success": True}), stopped.text
        assert await stored_replies(api, conversation_id) == [("interrupted_by_user", text)]
        async with db.session() as session:
            assert list((await session.execute(KEPT_FOR_NEW_CHATS)).scalars()) == []
