"""The AG-UI door's server-side rules that its JS client cannot show: version dialects, hang-ups, ownership.

The client suite (`tests/js/ag_ui.test.mjs`, run by test_ag_ui_client.py) covers the protocol
end to end; here an in-process server is read with the project's SSE reader, and every
event is parsed with the AG-UI SDK's own event model.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import httpx
from ag_ui.core import Event
from pydantic import TypeAdapter

from tests.conftest import LiveServer
from tests.fake_openai import FakeOpenAI, Reply
from tests.sse import iter_sse
from tests.support import conversation_locked, new_conversation, wait_until

EVENTS: TypeAdapter[Any] = TypeAdapter(Event)
SLOW = {"demo_tokens_per_second": 40}


def run_input(thread_id: str, text: str, **extra: Any) -> dict[str, Any]:
    message = {"id": str(uuid.uuid4()), "role": "user", "content": text}
    return {"threadId": thread_id, "runId": str(uuid.uuid4()), "messages": [message], **extra}


async def stopped_run(server: LiveServer, **extra: Any) -> list[dict[str, Any]]:
    """A long run stopped after some text: every event, as the SDK's model reads it."""
    thread_id = str(uuid.uuid4())
    events: list[dict[str, Any]] = []
    async with server.client() as api:
        body = run_input(thread_id, "/long a story", **extra)
        async with api.stream("POST", "/v1/ag-ui", json=body) as response:
            assert response.status_code == 200
            async for item in iter_sse(response):
                events.append(EVENTS.validate_python(item.data).model_dump(by_alias=True, exclude_none=True))
                if sum(e["type"] == "TEXT_MESSAGE_CONTENT" for e in events) == 5:
                    stop = await api.post(f"/v1/ag-ui/{thread_id}/stop")
                    assert stop.json() == {"success": True}
    return events


async def test_a_stopped_run_ends_cancelled_for_1_0_clients_and_plainly_for_older_ones(
    start_server: Any,
) -> None:
    server: LiveServer = await start_server(**SLOW)
    modern = await stopped_run(server, protocolVersion="1.0")
    assert modern[-1]["type"] == "RUN_FINISHED"
    assert modern[-1]["outcome"] == {"type": "cancelled"}
    assert modern[-2]["type"] == "TEXT_MESSAGE_END"
    older = await stopped_run(server)  # 0.0.x clients declare no version and reject unknown outcomes
    assert older[-1]["type"] == "RUN_FINISHED"
    assert "outcome" not in older[-1]
    assert [e["type"] for e in older][:2] == ["RUN_STARTED", "CUSTOM"]


async def test_on_disconnect_stop_makes_a_hang_up_a_stop(start_server: Any) -> None:
    server: LiveServer = await start_server(**SLOW)
    thread_id = str(uuid.uuid4())
    body = run_input(thread_id, "/long a story", forwardedProps={"on_disconnect": "stop"})
    async with server.client() as api:
        async with api.stream("POST", "/v1/ag-ui", json=body) as response:
            async for item in iter_sse(response):
                if item.data["type"] == "TEXT_MESSAGE_CONTENT":
                    break  # the client goes away

        async def stopped() -> bool:
            reply = (await api.get(f"/v1/ai-sdk/chat/{thread_id}/messages")).json()[-1]
            return bool(reply["metadata"]["status"] == "interrupted_by_user")

        await wait_until(stopped, timeout=10)
        reply = (await api.get(f"/v1/ai-sdk/chat/{thread_id}/messages")).json()[-1]
        assert reply["metadata"]["interrupt_reason"] == "client_disconnected"


async def test_another_users_conversation_id_as_thread_id_is_like_an_unused_id(server: LiveServer) -> None:
    """A thread of the caller's own: the owner's is neither changed, nor shown, nor confirmed to exist."""
    async with server.client(user="u1") as owner, server.client(user="u2") as other:
        conversation_id = await new_conversation(owner, title="owner's")
        unused = str(uuid.uuid4())
        for thread_id in (unused, conversation_id):
            connect = await other.post(f"/v1/ag-ui/{thread_id}/connect", json={})
            assert (connect.status_code, connect.json()["error"]["code"]) == (404, "not_found")
            # Kept for the first run of a thread of their own, alike for both ids.
            stop = await other.post(f"/v1/ag-ui/{thread_id}/stop")
            assert (stop.status_code, stop.json()) == (202, {"success": False})
            body = run_input(thread_id, "let me in", protocolVersion="1.0")
            async with other.stream("POST", "/v1/ag-ui", json=body) as response:
                events = [item.data async for item in iter_sse(response)]
            assert events[-1]["type"] == "RUN_FINISHED" and events[-1]["outcome"] == {"type": "cancelled"}
            assert "owner's" not in json.dumps(events)
        assert (await owner.get(f"/v1/conversations/{conversation_id}/turns")).json()["items"] == []
        assert len((await other.get("/v1/conversations")).json()["items"]) == 2  # two threads of its own


async def test_a_thread_is_the_owners_conversation_when_named_by_its_id(server: LiveServer) -> None:
    async with server.client() as api:
        conversation_id = await new_conversation(api)
        async with api.stream("POST", "/v1/ag-ui", json=run_input(conversation_id, "hello")) as response:
            events = [item.data async for item in iter_sse(response)]
        assert events[-1]["type"] == "RUN_FINISHED"
        turns = (await api.get(f"/v1/conversations/{conversation_id}/turns")).json()["items"]
        assert [t["role"] for t in turns] == ["user", "assistant"]


async def test_a_retried_run_reattaches_to_the_reply_it_started(server: LiveServer) -> None:
    body = run_input(str(uuid.uuid4()), "hello once")
    async with server.client() as api:
        first = (await api.post("/v1/ag-ui", json=body)).text
        again = (await api.post("/v1/ag-ui", json=body)).text
        stored = (await api.get(f"/v1/ai-sdk/chat/{body['threadId']}/messages")).json()
    assert len(stored) == 2
    assert first.count("TEXT_MESSAGE_START") == again.count("TEXT_MESSAGE_START") == 1


async def test_the_stream_is_sse_and_a_refusal_is_json(server: LiveServer) -> None:
    async with server.client() as api:
        ok = await api.post("/v1/ag-ui", json=run_input(str(uuid.uuid4()), "hi"))
        refused = await api.post("/v1/ag-ui", json={"threadId": "x", "messages": []})
    assert ok.headers["content-type"].startswith("text/event-stream")
    assert refused.status_code == 422
    assert refused.headers["content-type"].startswith("application/json")
    assert isinstance(refused.json()["error"]["code"], str)


async def test_a_client_that_sends_only_its_new_message_continues_the_thread(server: LiveServer) -> None:
    thread_id = str(uuid.uuid4())
    async with server.client() as api:
        for text in ("my name is Ada", "what is my name?"):
            async with api.stream("POST", "/v1/ag-ui", json=run_input(thread_id, text)) as response:
                assert [item.data async for item in iter_sse(response)][-1]["type"] == "RUN_FINISHED"
        stored = (await api.get(f"/v1/ai-sdk/chat/{thread_id}/messages")).json()
    assert [m["role"] for m in stored] == ["user", "assistant", "user", "assistant"]


async def test_the_apps_system_messages_and_context_reach_the_model_for_that_run_only(
    start_server: Any, fake_openai: FakeOpenAI
) -> None:
    """Found: CopilotKit's instructions (a system message) and readables (`context`) were dropped."""
    server: LiveServer = await start_server(
        llm_provider="openai", llm_base_url=fake_openai.base_url, llm_api_key="test", llm_model="fake-model"
    )
    fake_openai.script(Reply(text="Aye."), Reply(text="Fine."))
    thread_id = str(uuid.uuid4())
    system = {"id": "s1", "role": "system", "content": "Answer like a ship's captain."}
    context = [{"description": "The page the user is on", "value": "Harbour schedule"}]
    async with server.client() as api:
        first = run_input(thread_id, "any ships today?", context=context)
        first["messages"].insert(0, system)
        async with api.stream("POST", "/v1/ag-ui", json=first) as response:
            types = [EVENTS.validate_python(item.data).type async for item in iter_sse(response)]
        assert types[-1] == "RUN_FINISHED"
        later = run_input(thread_id, "and tomorrow?")
        async with api.stream("POST", "/v1/ag-ui", json=later) as response:
            assert [item async for item in iter_sse(response)]
        turns = (await api.get(f"/v1/conversations/{thread_id}/turns")).json()
    # The replies' requests (a follow-up's query rewrite asks the model too, not streamed).
    told, untold = (request.messages for request in fake_openai.requests if request.stream)
    assert [m["role"] for m in told].count("system") == 1
    assert told[0]["content"].endswith(
        "Answer like a ship's captain.\n\nThe page the user is on: Harbour schedule"
    )
    assert "captain" not in untold[0]["content"] and "Harbour" not in untold[0]["content"]
    assert not any("captain" in (turn["content"] or "") for turn in turns.get("items", []))


async def test_context_longer_than_a_message_is_refused_before_anything_is_stored(start_server: Any) -> None:
    server: LiveServer = await start_server(max_message_chars=1000)
    context = [{"description": "notes", "value": "x" * 1000}]
    async with server.client() as api:
        refused = await api.post("/v1/ag-ui", json=run_input(str(uuid.uuid4()), "hi", context=context))
        assert refused.status_code == 422
        assert refused.json()["error"]["details"]["field"] == "context"
        assert (await api.get("/v1/conversations")).json()["items"] == []


async def test_a_run_that_answers_a_call_a_stop_cut_off_is_refused_and_stores_nothing(
    start_server: Any,
) -> None:
    """The stopped run's own closing result, sent back as the last message, must not undo the stop.

    It was stored as the call's result and the user's message answered again, so the model
    called the tool once more; the next prompt leaves out every call of a stopped reply.
    """
    server: LiveServer = await start_server(**SLOW)
    thread_id = str(uuid.uuid4())
    tools = [{"name": "get_weather", "description": "The weather", "parameters": {"type": "object"}}]
    arguments = json.dumps({"city": "Paris " * 60})
    body = run_input(thread_id, f"/tool get_weather {arguments}", tools=tools, protocolVersion="1.0")
    events: list[dict[str, Any]] = []
    async with server.client() as api:
        async with api.stream("POST", "/v1/ag-ui", json=body) as response:
            async for item in iter_sse(response):
                events.append(EVENTS.validate_python(item.data).model_dump(by_alias=True, exclude_none=True))
                if sum(e["type"] == "TOOL_CALL_ARGS" for e in events) == 3:
                    assert (await api.post(f"/v1/ag-ui/{thread_id}/stop")).json() == {"success": True}
        assert events[-1]["outcome"] == {"type": "cancelled"}
        start = next(e for e in events if e["type"] == "TOOL_CALL_START")
        result = next(e for e in events if e["type"] == "TOOL_CALL_RESULT")
        cut = "".join(e["delta"] for e in events if e["type"] == "TOOL_CALL_ARGS")
        stored = (await api.get(f"/v1/ai-sdk/chat/{thread_id}/messages")).json()
        assert stored[-1]["metadata"]["status"] == "interrupted_by_user"
        call = {
            "id": start["toolCallId"],
            "type": "function",
            "function": {"name": "get_weather", "arguments": cut},
        }
        again = {
            **body,
            "runId": str(uuid.uuid4()),
            "messages": [
                *body["messages"],
                {"id": start["parentMessageId"], "role": "assistant", "toolCalls": [call]},
                {
                    "id": result["messageId"],
                    "role": "tool",
                    "toolCallId": call["id"],
                    "content": result["content"],
                },
            ],
        }
        refused = await api.post("/v1/ag-ui", json=again)
        assert refused.status_code == 422, refused.text
        assert refused.headers["content-type"].startswith("application/json")
        assert refused.json()["error"]["details"]["tool_call_id"] == call["id"]
        assert (await api.get(f"/v1/ai-sdk/chat/{thread_id}/messages")).json() == stored


async def test_on_disconnect_stop_makes_a_hang_up_a_stop_also_in_a_run_resumed_after_an_approval(
    start_server: Any,
) -> None:
    """Found: a resumed run ignored `forwardedProps.on_disconnect`: hung up on, its reply went on."""
    server: LiveServer = await start_server(
        tool_modules=["tests.approval_tools"],
        tools_requiring_approval=["transfer_funds"],
        demo_tokens_per_second=10,
    )
    thread_id = str(uuid.uuid4())
    stop = {"on_disconnect": "stop"}
    body = run_input(thread_id, '/tool transfer_funds {"amount": 5, "to": "bob"}', protocolVersion="1.0")
    async with server.client() as api:
        parked = [item.data async for item in iter_sse(await api.post("/v1/ag-ui", json=body))]
        interrupt = parked[-1]["outcome"]["interrupts"][0]
        answer = {"interruptId": interrupt["id"], "status": "resolved", "payload": {"approved": True}}
        resumed = {**run_input(thread_id, "", forwardedProps=stop), "messages": [], "resume": [answer]}
        async with api.stream("POST", "/v1/ag-ui", json=resumed) as response:
            async for item in iter_sse(response):
                if item.data["type"] == "TEXT_MESSAGE_CONTENT":
                    break  # the client goes away

        async def ended() -> str | None:
            status = (await api.get(f"/v1/ai-sdk/chat/{thread_id}/messages")).json()[-1]["metadata"]["status"]
            return None if status == "streaming" else str(status)

        assert await wait_until(ended, timeout=10) == "interrupted_by_user"


async def test_a_resume_with_nothing_to_decide_carries_the_headers_of_every_run_stream(
    start_server: Any,
) -> None:
    """Found: the answer to a cancellation of interrupts already closed lacked the stream headers
    (`X-Accel-Buffering: no`) that every other run's stream sends."""
    server: LiveServer = await start_server(
        tool_modules=["tests.approval_tools"], tools_requiring_approval=["transfer_funds"]
    )
    thread_id = str(uuid.uuid4())
    body = run_input(thread_id, '/tool transfer_funds {"amount": 7, "to": "eve"}', protocolVersion="1.0")
    async with server.client() as api:
        parked = [item.data async for item in iter_sse(await api.post("/v1/ag-ui", json=body))]
        cancelled = [{"interruptId": parked[-1]["outcome"]["interrupts"][0]["id"], "status": "cancelled"}]
        steered = await api.post(
            "/v1/ag-ui", json={**run_input(thread_id, "just say hi"), "resume": cancelled}
        )
        assert steered.status_code == 200, steered.text
        again = {**run_input(thread_id, ""), "messages": [], "resume": cancelled}
        replay = await api.post("/v1/ag-ui", json=again)
        assert replay.status_code == 200, replay.text
    assert [item.data["type"] async for item in iter_sse(replay)] == [
        "RUN_STARTED",
        "MESSAGES_SNAPSHOT",
        "RUN_FINISHED",
    ]
    for name in ("content-type", "cache-control", "x-accel-buffering"):
        assert replay.headers.get(name) == steered.headers.get(name), name
    assert replay.headers["x-accel-buffering"] == "no"


async def test_a_stop_naming_a_run_waiting_in_line_drops_it_and_leaves_the_run_ahead_going(
    start_server: Any,
) -> None:
    """Found: the stop stopped the run ahead, and then the waiting run started anyway."""
    server: LiveServer = await start_server(**SLOW)
    thread_id = str(uuid.uuid4())
    async with server.client() as api:
        async with api.stream(
            "POST", "/v1/ag-ui", json=run_input(thread_id, "/long ahead", protocolVersion="1.0")
        ) as ahead:
            assert ahead.status_code == 200
            events = iter_sse(ahead)
            while (await anext(events)).data["type"] != "TEXT_MESSAGE_CONTENT":
                pass  # the run ahead streams
            waiting_body = run_input(thread_id, "waits", forwardedProps={"on_busy": "enqueue"})
            waiting = asyncio.create_task(api.post("/v1/ag-ui", json=waiting_body))
            conversation_id = server.services.registry.all()[0].conversation_id
            await wait_until(
                lambda: server.services.queues.waiting(conversation_id) == 1, what="the run to wait"
            )
            stop = await api.post(f"/v1/ag-ui/{thread_id}/stop", json={"runId": waiting_body["runId"]})
            assert stop.json() == {"success": True}
            dropped = await waiting
            assert dropped.status_code == 409, dropped.text
            assert dropped.json()["error"]["code"] == "stopped_while_waiting"
            rest = [item.data async for item in events]
        assert rest[-1]["type"] == "RUN_FINISHED" and rest[-1]["outcome"] != {"type": "cancelled"}
        stored = (await api.get(f"/v1/ai-sdk/chat/{thread_id}/messages")).json()
        assert [m["metadata"]["status"] for m in stored if m["role"] == "assistant"] == ["completed"]
        assert [m["parts"][0]["text"] for m in stored if m["role"] == "user"] == ["/long ahead"]


async def test_a_stop_naming_a_run_let_out_of_the_line_before_its_turns_were_stored_was_lost(
    start_server: Any, db: Any
) -> None:
    """Found: a run let out of the `on_busy: enqueue` line keeps its place until its turns are
    stored; a stop naming it then was answered `{"success": true}` and nothing watched it, so the
    run started and streamed to its end. A stop of a run that no longer waits is the database's
    to carry, as on any process: it waits for the conversation's lock (or is kept on its row for
    the run) and stops the reply stored: the run ends cancelled, stored `interrupted_by_user`."""
    server: LiveServer = await start_server(**SLOW)
    async with server.client() as api:
        thread_id = await new_conversation(api)  # the conversation's own id names it as a thread
        body = run_input(
            thread_id, "/long story", protocolVersion="1.0", forwardedProps={"on_busy": "enqueue"}
        )
        # The run is first in line, so let out at once; it waits at the conversation's lock,
        # before its turns are stored.
        async with conversation_locked(db, thread_id) as waiting:
            run = asyncio.create_task(api.post("/v1/ag-ui", json=body))
            await waiting(1)
            assert server.services.queues.waiting(uuid.UUID(thread_id)) == 1
            stop = asyncio.create_task(api.post(f"/v1/ag-ui/{thread_id}/stop", json={"runId": body["runId"]}))
            await waiting(2)  # not dropped from the line: it waits behind the run's start
        stopped = await stop
        assert (stopped.status_code, stopped.json()) == (200, {"success": True}), stopped.text
        answered = await run
        assert answered.status_code == 200, answered.text
        events = [item.data async for item in iter_sse(answered)]
        assert events[-1]["type"] == "RUN_FINISHED" and events[-1]["outcome"] == {"type": "cancelled"}
        stored = (await api.get(f"/v1/ai-sdk/chat/{thread_id}/messages")).json()
        replies = [m["metadata"]["status"] for m in stored if m["role"] == "assistant"]
        assert replies == ["interrupted_by_user"]


async def test_stopping_a_thread_or_a_run_that_does_not_exist_answered_200(server: LiveServer) -> None:
    """A stop of a thread the caller never used answered `{"success": true}`, as if a run had
    been stopped: a client could not tell a wrong id from a stop. It is a 202 `{"success":
    false}` (accepted, not confirmed: kept for the thread's first run, which the client may
    have sent already), as stopping an unknown turn is a 404 on chatmem's own door; a run that
    has ended still answers 200."""
    thread_id = str(uuid.uuid4())
    async with server.client() as api:
        conversations = len((await api.get("/v1/conversations")).json()["items"])
        turn = await api.post(f"/v1/turns/{uuid.uuid4()}/stop")
        unknown = await api.post(f"/v1/ag-ui/{thread_id}/stop", json={"runId": "r-1"})
        assert (unknown.status_code, unknown.json()) == (202, {"success": False}), unknown.text
        assert (turn.status_code, turn.json()["error"]["code"]) == (404, "not_found"), turn.text
        assert len((await api.get("/v1/conversations")).json()["items"]) == conversations  # nothing made

        # The thread's first run is another run than the stop named: answered in full.
        body = run_input(thread_id, "hello")
        async with api.stream("POST", "/v1/ag-ui", json=body) as response:
            assert response.status_code == 200
            await response.aread()
        before = (await api.get(f"/v1/ai-sdk/chat/{thread_id}/messages")).json()
        assert [m["metadata"]["status"] for m in before if m["role"] == "assistant"] == ["completed"]
        # A runId of no stored run may name a run not stored yet: the stop is kept for the
        # thread's next run (202, not confirmed), and a run of another id clears it.
        no_run = await api.post(f"/v1/ag-ui/{thread_id}/stop", json={"runId": "no-such-run"})
        assert (no_run.status_code, no_run.json()) == (202, {"success": False}), no_run.text
        ended = await api.post(f"/v1/ag-ui/{thread_id}/stop", json={"runId": body["runId"]})
        assert (ended.status_code, ended.json()) == (200, {"success": True}), ended.text
        assert (await api.post(f"/v1/ag-ui/{thread_id}/stop")).json() == {"success": True}
        assert (await api.get(f"/v1/ai-sdk/chat/{thread_id}/messages")).json() == before


async def test_a_connect_run_id_of_another_json_type_was_read_as_a_string(server: LiveServer) -> None:
    """`"runId": 5` answered a run `"5"`, `{}` a run `"{}"`, and `0` or `false` a run of a made-up id;
    `""` was refused. Each is a 422 naming runId, as a run's own runId is."""
    thread_id = str(uuid.uuid4())
    async with server.client() as api:
        async with api.stream("POST", "/v1/ag-ui", json=run_input(thread_id, "hello")) as response:
            assert response.status_code == 200
            await response.aread()
        for run_id in (5, {}, 0, False, "", None):
            answer = await api.post(f"/v1/ag-ui/{thread_id}/connect", json={"runId": run_id})
            assert answer.status_code == 422, (run_id, answer.text[:300])
            assert answer.json()["error"]["details"]["field"] == "runId", answer.text
        answer = await api.post(f"/v1/ag-ui/{thread_id}/connect", json={"runId": "r-1"})
        assert answer.status_code == 200, answer.text[:300]
        assert '"runId":"r-1"' in answer.text
        assert (await api.post(f"/v1/ag-ui/{thread_id}/connect", json={})).status_code == 200


async def run_stopped_midway(
    api: httpx.AsyncClient, run: dict[str, Any], stop_run_id: str
) -> tuple[list[dict[str, Any]], httpx.Response]:
    """`run`'s events, a stop naming `stop_run_id` sent once its third text delta came, and the
    stop's answer."""
    events: list[dict[str, Any]] = []
    stop: httpx.Response | None = None
    async with api.stream("POST", "/v1/ag-ui", json=run) as response:
        async for item in iter_sse(response):
            events.append(item.data)
            if stop is None and [e["type"] for e in events].count("TEXT_MESSAGE_CONTENT") == 3:
                stop = await api.post(f"/v1/ag-ui/{run['threadId']}/stop", json={"runId": stop_run_id})
    assert stop is not None, [e["type"] for e in events]
    return events, stop


async def test_a_stop_naming_an_earlier_run_of_the_thread_stopped_the_run_streaming_now(
    start_server: Any,
) -> None:
    """Found: a stop whose runId named a run of the thread that had ended (a client stopping
    late, or a stale button) found that run stored and then stopped whatever ran in the
    thread: the newer run was cut off. A run that has ended answers 200 and stops nothing."""
    server: LiveServer = await start_server(**SLOW)
    thread_id = str(uuid.uuid4())
    async with server.client() as api:
        earlier = run_input(thread_id, "hello")
        async with api.stream("POST", "/v1/ag-ui", json=earlier) as response:
            await response.aread()
        current = run_input(thread_id, "/long story", protocolVersion="1.0")
        events, stale = await run_stopped_midway(api, current, earlier["runId"])
        assert (stale.status_code, stale.json()) == (200, {"success": True}), stale.text
        assert events[-1]["type"] == "RUN_FINISHED" and events[-1]["outcome"] == {"type": "success"}
        stored = (await api.get(f"/v1/ai-sdk/chat/{thread_id}/messages")).json()
        assert [m["metadata"]["status"] for m in stored if m["role"] == "assistant"] == ["completed"] * 2

        # A reload (the last message sent again, a new runId) answers it again: a stop naming
        # that run stops it, though the message it answers was stored by the run before.
        reload = {**current, "runId": str(uuid.uuid4())}
        events, stop = await run_stopped_midway(api, reload, reload["runId"])
        assert (stop.status_code, stop.json()) == (200, {"success": True}), stop.text
        assert events[-1]["type"] == "RUN_FINISHED" and events[-1]["outcome"] == {"type": "cancelled"}
