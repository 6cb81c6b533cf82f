"""A deploy's SIGTERM: running replies end on their streams in each protocol's shape, new ones are refused.

The SIGTERM tests run `chatmem serve` in a subprocess and send it the signal, as a rolling
deploy (Kubernetes, systemd) does; the refusal test begins the same drain in-process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import threading
import uuid
from pathlib import Path
from typing import Any, cast

import httpx
import openai
import pytest
from sqlalchemy import func, select

from chat_api.replies.approve import ApprovalTimeouts
from chat_api.replies.drain import STOP_SIGNALS, Drain
from memory.events import EventName
from memory.storage.models import Turn
from tests.conftest import LiveServer, token_for
from tests.openai_support import MODEL, TENANT, async_sdk, make_key, new_user
from tests.procs import ServerProcess, server_process
from tests.sse import SSEEvent, iter_sse
from tests.support import new_conversation, wait_until
from tests.test_approvals import park, required, transfer_tools
from tests.test_stop import text_of

JS_DIR = Path(__file__).parent / "js"
NODE = shutil.which("node")


def ui_message(text: str) -> dict[str, Any]:
    return {"id": str(uuid.uuid4()), "role": "user", "parts": [{"type": "text", "text": text}]}


def ag_ui_run(text: str) -> dict[str, Any]:
    message = {"id": str(uuid.uuid4()), "role": "user", "content": text}
    return {"threadId": str(uuid.uuid4()), "runId": str(uuid.uuid4()), "messages": [message]}


async def exited(victim: ServerProcess, timeout: float) -> bool:
    """True once the process has ended by the signal, as uvicorn does after a graceful shutdown
    (it raises the signal again); fails the test after `timeout` seconds."""
    assert victim.proc is not None
    code = await asyncio.wait_for(asyncio.to_thread(victim.proc.wait), timeout)
    return code == -signal.SIGTERM


async def test_sigterm_mid_reply_sends_every_stream_its_ending_before_the_connection_closes(
    pg_url: str, start_server: Any
) -> None:
    """SIGTERM closed every live stream before its ending was sent (sse-starlette ended the native and
    OpenAI streams at once; uvicorn cut the others at its timeout, before the app stopped the replies).
    Now each reply is stopped as a shutdown once the drain is over, and each stream (a follower's too)
    gets its ending in its protocol's shape, then the connection closes cleanly; the stored turns
    hold what was sent."""
    user = new_user()
    async with server_process(pg_url, demo_tokens_per_second=20, shutdown_drain_seconds=1) as victim:
        key = await make_key(victim, user)
        sdk = async_sdk(victim, key)
        started = asyncio.Event()
        ready: list[str] = []

        def one_more_started(name: str) -> None:
            ready.append(name)
            if len(ready) == 5:
                started.set()

        async def native() -> list[SSEEvent]:
            events: list[SSEEvent] = []
            async with victim.client(TENANT, user) as api:
                conversation = (await api.post("/v1/conversations", json={})).json()["id"]
                body = {"content": "/long"}
                async with api.stream("POST", f"/v1/conversations/{conversation}/messages", json=body) as r:
                    async for event in iter_sse(r):
                        events.append(event)
                        if (
                            event.event == EventName.MESSAGE_DELTA
                            and len(ready) < 5
                            and "native" not in ready
                        ):
                            one_more_started("native")
            return events

        async def js_clients() -> dict[str, Any]:
            # The AI SDK's and AG-UI's own clients (tests/js/shutdown_clients.mjs), one node process.
            assert NODE is not None, "node is not installed"
            env = {**os.environ, "CHATMEM_URL": victim.base_url, "CHATMEM_TOKEN": token_for(TENANT, user)}
            node = await asyncio.create_subprocess_exec(
                NODE, "shutdown_clients.mjs", cwd=JS_DIR, env=env, stdout=asyncio.subprocess.PIPE
            )
            assert node.stdout is not None
            lines = []
            async for line in node.stdout:
                lines.append(line.decode())
                if line.strip() == b"started":
                    one_more_started("ai-sdk")
                    one_more_started("ag-ui")
            assert await node.wait() == 0, lines
            return dict(json.loads(lines[-1]))

        async def chat() -> tuple[str, BaseException | None]:
            text = ""
            stream = await sdk.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "/long"}], stream=True
            )
            try:
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        text += chunk.choices[0].delta.content
                        if "chat" not in ready:
                            one_more_started("chat")
            except openai.APIError as exc:
                return text, exc
            return text, None

        async def responses() -> tuple[list[Any], BaseException | None]:
            events: list[Any] = []
            stream = await sdk.responses.create(model=MODEL, input="/long", stream=True)
            try:
                async for event in stream:
                    events.append(event)
                    if event.type == "response.output_text.delta" and "responses" not in ready:
                        one_more_started("responses")
            except openai.APIError as exc:
                return events, exc
            return events, None

        tasks = (
            asyncio.ensure_future(native()),
            asyncio.ensure_future(chat()),
            asyncio.ensure_future(responses()),
            asyncio.ensure_future(js_clients()),
        )
        async with asyncio.timeout(30):
            await started.wait()
        assert victim.proc is not None
        victim.proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            (
                native_events,
                (chat_text, chat_error),
                (response_events, response_error),
                js,
            ) = await asyncio.gather(*tasks)
        assert await exited(victim, 30)

    # Native SSE: the stored ending, as a resume on another replica would replay it.
    assert native_events[-1].event == EventName.TURN_INTERRUPTED
    assert native_events[-1].data["error"]["code"] == "server_shutdown"
    # OpenAI chat completions: the SDK reads the error chunk the adapter sends for this ending.
    assert isinstance(chat_error, openai.APIError) and chat_text
    assert chat_error.code == "server_shutdown"
    # Responses: `error`, then `response.failed`; the SDK raises at the `error` event.
    assert response_error is not None or [e.type for e in response_events[-2:]] == [
        "error",
        "response.failed",
    ]
    assert isinstance(response_error, openai.APIError) and response_error.code == "server_shutdown"
    # AI SDK (useChat's transport and reader): the stream ends with its `error` chunk, which the
    # reader reports as the chat's error; the message holds the text that came before it.
    ai_sdk, ag_ui = js["aiSdk"], js["agUi"]
    assert ai_sdk["chunks"][-1] == "error" and ai_sdk.get("error")
    assert ai_sdk["text"] and ai_sdk["messageText"] == ai_sdk["text"]
    # AG-UI (HttpAgent): RUN_ERROR ends the run.
    assert ag_ui["events"][-1] == "RUN_ERROR" and ag_ui["text"]
    # A second client following each of those replies (useChat's resume from the start, AG-UI's
    # connect after its snapshot) gets the same ending, not a cut at uvicorn's timeout.
    ai_follower, ag_follower = js["aiSdkFollower"], js["agUiFollower"]
    assert ai_follower["chunks"][-1] == "error" and ai_follower["text"] == ai_sdk["text"]
    assert ag_follower["events"][-1] == "RUN_ERROR" and not ag_follower["rejected"]
    assert ag_follower["text"] and ag_ui["text"].endswith(ag_follower["text"])

    survivor: LiveServer = await start_server()
    async with survivor.client(TENANT, user) as api:
        reply_id = native_events[0].data["reply_id"]
        stored = (await api.get(f"/v1/turns/{reply_id}")).json()
        assert stored["status"] == "interrupted_by_error" and stored["content"] == text_of(native_events)
        async with api.stream("GET", f"/v1/turns/{reply_id}/events") as r:
            resumed = [event async for event in iter_sse(r)]
        assert resumed[-1].event == EventName.TURN_INTERRUPTED and resumed[-1].id == native_events[-1].id
        # What each JS client showed is what was stored, ended by the shutdown.
        for chat_id, shown in ((ai_sdk["chatId"], ai_sdk["text"]), (ag_ui["threadId"], ag_ui["text"])):
            _, reply = (await api.get(f"/v1/ai-sdk/chat/{chat_id}/messages")).json()
            assert reply["metadata"]["status"] == "interrupted_by_error"
            assert "".join(p["text"] for p in reply["parts"] if p["type"] == "text") == shown


async def refuses_connections(server: ServerProcess) -> bool:
    """Whether the server's port refuses a new connection: uvicorn has closed its listening
    socket, which it does at a stop signal after the drain has begun."""
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", server.port)
    except OSError:
        return True
    writer.close()
    await writer.wait_closed()
    return False


async def test_sigterm_closed_the_responses_websocket_before_its_response_ended(pg_url: str) -> None:
    """uvicorn closed every WebSocket at the signal (1012, "service restart"), before the drain had
    ended the connection's response: the SDK's Responses connection raised without the response's
    ending, and a connection that sent nothing was cut too. Now a connection stays open through
    the drain: its response ends in the Responses shape, a `response.create` meanwhile is refused
    with an error event, and then the server closes the connection normally (going away)."""
    user = new_user()
    async with server_process(pg_url, demo_tokens_per_second=20, shutdown_drain_seconds=5) as victim:
        sdk = async_sdk(victim, await make_key(victim, user))
        async with sdk.responses.connect() as streaming, sdk.responses.connect() as idle:
            await streaming.response.create(model=MODEL, input="/long")
            events = [await streaming.recv()]
            while events[-1].type != "response.output_text.delta":
                events.append(await streaming.recv())
            assert victim.proc is not None
            victim.proc.send_signal(signal.SIGTERM)
            await wait_until(lambda: refuses_connections(victim), what="the drain to begin")
            await idle.response.create(model=MODEL, input="one more, while it drains")
            async with asyncio.timeout(30):
                # Each iteration ends without raising: the server closed its connection normally.
                refused = [event async for event in idle]
                events += [event async for event in streaming]
        assert await exited(victim, 30)
    # The streaming response: stopped at the drain's end, as over HTTP (`error`, `response.failed`).
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2].error.code == "server_shutdown"
    failed = events[-1].response
    assert failed.error is not None and failed.error.code == "server_shutdown"
    assert failed.output and failed.output[0].content[0].text  # what was sent before the stop
    # The new response, refused in the error envelope WebSocket mode uses, with nothing started.
    assert [e.type for e in refused] == ["error"]
    assert refused[0].status == 503 and refused[0].error.code == "shutting_down"


async def test_a_reply_that_ends_within_the_drain_completes_after_sigterm(
    pg_url: str, start_server: Any
) -> None:
    """A rolling deploy cut short a reply that would have ended a moment later: now it completes,
    a stop sent to another replica meanwhile still stops a reply draining here (as the user's stop,
    not a shutdown), and the process exits once no reply runs, not after the whole drain period."""
    other: LiveServer = await start_server()
    async with server_process(pg_url, demo_tokens_per_second=20, shutdown_drain_seconds=60) as victim:
        assert victim.proc is not None
        async with victim.client() as api, other.client() as on_other:
            short, long = await new_conversation(api), await new_conversation(api)

            async def reply(cid: str, content: str, events: list[SSEEvent], ready: asyncio.Event) -> None:
                async with api.stream(
                    "POST", f"/v1/conversations/{cid}/messages", json={"content": content}
                ) as r:
                    async for event in iter_sse(r):
                        events.append(event)
                        if event.event == EventName.MESSAGE_DELTA:
                            ready.set()

            short_events: list[SSEEvent] = []
            long_events: list[SSEEvent] = []
            short_started, long_started = asyncio.Event(), asyncio.Event()
            short_reply = asyncio.ensure_future(reply(short, "hi", short_events, short_started))
            long_reply = asyncio.ensure_future(reply(long, "/long", long_events, long_started))
            async with asyncio.timeout(30):
                await short_started.wait()
                await long_started.wait()
            victim.proc.send_signal(signal.SIGTERM)
            async with asyncio.timeout(30):
                await short_reply
            assert short_events[-1].event == EventName.TURN_COMPLETED
            assert not long_reply.done()
            reply_id = long_events[0].data["reply_id"]
            stop = await on_other.post(f"/v1/turns/{reply_id}/stop")
            assert stop.status_code == 200 and stop.json()["status"] == "interrupted_by_user"
            async with asyncio.timeout(30):
                await long_reply
            assert long_events[-1].event == EventName.TURN_INTERRUPTED
            assert long_events[-1].data["reason"] == "user"
            # Far below the drain period: the process leaves once its last reply has ended.
            assert await exited(victim, 30)
            stored = (await on_other.get(f"/v1/turns/{reply_id}")).json()
            assert stored["content"] == text_of(long_events)


async def test_a_draining_server_refuses_new_replies_with_503_and_retry_after_on_every_door(
    start_server: Any,
) -> None:
    server: LiveServer = await start_server()
    key = await make_key(server, new_user())  # type: ignore[arg-type]
    server.services.drain.begin()
    async with server.client() as api:
        ready = await api.get("/readyz")
        assert ready.status_code == 503 and ready.headers["Retry-After"]
        conversation = await api.post("/v1/conversations", json={})
        assert conversation.status_code == 201  # only what starts a reply is refused
        cid = conversation.json()["id"]
        refused = [
            await api.post(f"/v1/conversations/{cid}/messages", json={"content": "hi"}),
            await api.post(
                "/v1/ai-sdk/chat",
                json={"id": str(uuid.uuid4()), "trigger": "submit-message", "messages": [ui_message("hi")]},
            ),
            await api.post("/v1/ag-ui", json=ag_ui_run("hi")),
        ]
        for response in refused:
            assert response.status_code == 503, response.text
            assert response.headers["Retry-After"] == "1"
            assert response.json()["error"]["code"] == "shutting_down"
        assert not (await api.get(f"/v1/conversations/{cid}/turns")).json()["items"]
    sdk = async_sdk(server, key)  # type: ignore[arg-type]
    for start in (
        sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True),
        sdk.responses.create(model=MODEL, input="hi", stream=True),
    ):
        with pytest.raises(openai.InternalServerError) as refused_by_sdk:
            await start
        assert refused_by_sdk.value.status_code == 503
        assert refused_by_sdk.value.code == "shutting_down"
        assert refused_by_sdk.value.response.headers["Retry-After"] == "1"


async def test_a_draining_server_does_not_resume_a_reply_whose_approval_timed_out(start_server: Any) -> None:
    """The approval sweep of a shutting-down process resumed an expired parked reply, only for the
    drain to stop it as a shutdown a moment later; it is left parked for a replica that stays."""
    runs: list[dict[str, Any]] = []
    server: LiveServer = await start_server(
        tools=transfer_tools(runs, timeout=0.01), approval_sweep_seconds=3600
    )
    async with server.client() as client:
        waiting = required(await park(client, await new_conversation(client)))

        async def expired() -> bool:
            async with server.services.db.session() as session:
                late = await session.execute(
                    select(func.count()).where(Turn.approval_expires_at <= func.now())
                )
                return late.scalar_one() == 1

        await wait_until(expired)
        server.services.drain.begin()
        assert await ApprovalTimeouts(server.services, interval_seconds=3600).sweep_once() == 0
        parked = (await client.get(f"/v1/turns/{waiting['turn_id']}")).json()
        assert parked["status"] == "awaiting_approval"
    assert runs == []


async def test_a_message_waiting_in_line_when_the_drain_begins_is_refused_not_started(
    start_server: Any,
) -> None:
    """A message sent with on_busy=enqueue, admitted before the shutdown, started its reply once the
    running one ended, during the drain, only to be stopped as a shutdown; it is refused with 503
    before anything of it is stored, and the reply it waited for ends on its stream as a shutdown."""
    server: LiveServer = await start_server(demo_tokens_per_second=20, shutdown_drain_seconds=0.5)
    async with server.client() as client:
        cid = await new_conversation(client)
        async with client.stream("POST", f"/v1/conversations/{cid}/messages", json={"content": "/long"}) as r:
            events = iter_sse(r)
            first = await anext(events)
            waiting = asyncio.ensure_future(
                client.post(
                    f"/v1/conversations/{cid}/messages",
                    json={"content": "five", "on_busy": "enqueue", "stream": False},
                )
            )
            await wait_until(lambda: server.services.queues.waiting(uuid.UUID(cid)) == 1)
            server.services.drain.begin()
            rest = [event async for event in events]
        refused = await waiting
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
        assert refused.json()["error"]["code"] == "shutting_down"
        assert rest[-1].event == EventName.TURN_INTERRUPTED
        assert rest[-1].data["error"]["code"] == "server_shutdown"
        turns = (await client.get(f"/v1/conversations/{cid}/turns")).json()["items"]
        assert [t["content"] for t in turns if t["role"] == "user"] == ["/long"]
        assert first.data["reply_id"] == turns[-1]["reply_id"]


async def test_a_follower_of_a_reply_another_replica_runs_does_not_hold_up_the_exit(
    pg_url: str, start_server: Any
) -> None:
    """With sse-starlette's own exit held back for the drain, a stream following a reply that another
    replica runs kept the process alive until uvicorn's timeout (drain + 5 s) though no reply ran here.
    It is closed once this process's replies have ended; its client resumes elsewhere."""
    runner: LiveServer = await start_server(demo_tokens_per_second=5)
    async with server_process(pg_url, shutdown_drain_seconds=60) as victim:
        assert victim.proc is not None
        async with runner.client() as api, victim.client() as follower:
            cid = await new_conversation(api)
            async with api.stream(
                "POST", f"/v1/conversations/{cid}/messages", json={"content": "/long"}
            ) as r:
                first = await anext(iter_sse(r))
                followed: list[SSEEvent] = []
                # Closed without an ending (none exists yet): a cut, which an EventSource resumes.
                with contextlib.suppress(httpx.RemoteProtocolError):
                    async with follower.stream("GET", f"/v1/turns/{first.data['reply_id']}/events") as f:
                        async for event in iter_sse(f):
                            followed.append(event)
                            if event.event == EventName.MESSAGE_DELTA and len(followed) < 4:
                                victim.proc.send_signal(signal.SIGTERM)
                # Far below the drain period and uvicorn's wait after it.
                assert await exited(victim, 20)
                assert followed[-1].event not in (EventName.TURN_INTERRUPTED, EventName.TURN_COMPLETED)
                await api.post(f"/v1/turns/{first.data['reply_id']}/stop")


def test_a_stop_signal_after_the_apps_loop_closed_is_passed_on_not_raised() -> None:
    """An app made twice in one process can leave its stop-signal handler installed after its
    loop closed; a SIGTERM then raised `Event loop is closed` in whatever the process ran."""
    assert threading.current_thread() is threading.main_thread()  # where signals are handled
    received: list[int] = []
    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    signal.signal(signal.SIGTERM, lambda sig, frame: received.append(sig))
    try:
        drain = Drain(cast(Any, None), cast(Any, None), seconds=1.0, refuse_replies=lambda _: None)

        async def watch() -> None:
            drain.on_stop_signals()  # its undo never runs, as for the first of two apps

        loop = asyncio.new_event_loop()
        loop.run_until_complete(watch())
        loop.close()
        signal.raise_signal(signal.SIGTERM)
        assert received == [signal.SIGTERM]
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
