"""chatmem against a real llama-server running a real small model (Qwen2.5-Coder-0.5B).

What the fake OpenAI server cannot show: the real server's own chunking of tool-call
arguments, a real chat template rendering (and refusing) our message sequences, whether a
closed connection really stops generation (read from the server's `/slots`), and a real
model as the query rewriter. Assertions are about the protocol and the stored data, never
the model's wording; each test has a time bound, and the server caps every reply at 64
tokens.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any, cast

import httpx
import openai
import pytest

from bench.common import ModelServer
from memory.events import EventName
from tests.conftest import LiveServer
from tests.real_model import MAX_TOKENS, RealModel
from tests.sse import SSEEvent, iter_sse
from tests.support import new_conversation

pytestmark = pytest.mark.real_model

NO_MEMORY: dict[str, Any] = {"memory_scope": "none"}
# Each test is bounded; generous because the machines are shared and slow (2 cores).
TEST_SECONDS = 240
ASK_FOR_TIME = "What time is it in Europe/Paris right now? Call the current_time tool."
ASK_FOR_LONG_TEXT = "Count from 1 to 200, separated by commas. Do not call any tool."

StopWhen = Callable[[list[SSEEvent]], bool]


async def send(
    client: httpx.AsyncClient, cid: str, content: str, *, stop_when: StopWhen | None = None, **body: Any
) -> tuple[list[SSEEvent], httpx.Response | None]:
    """Send a message, read the SSE stream; stop the reply once `stop_when` holds; all events."""
    events: list[SSEEvent] = []
    stop: httpx.Response | None = None
    payload = {"content": content, **body}
    async with client.stream("POST", f"/v1/conversations/{cid}/messages", json=payload) as response:
        assert response.status_code == 200, await response.aread()
        async for event in iter_sse(response):
            events.append(event)
            if stop is None and stop_when is not None and stop_when(events):
                stop = await client.post(f"/v1/turns/{events[0].data['reply_id']}/stop")
    return events, stop


def texts_by_turn(events: list[SSEEvent]) -> dict[str, str]:
    """Visible text the client received, per assistant turn."""
    out: dict[str, str] = {}
    for event in events:
        if event.event == EventName.MESSAGE_DELTA:
            out[event.data["turn_id"]] = out.get(event.data["turn_id"], "") + event.data["text"]
    return out


def arguments_by_call(events: list[SSEEvent]) -> dict[str, str]:
    """Raw tool-call argument text the client received, per call id."""
    out: dict[str, str] = {}
    current: dict[tuple[str, int], str] = {}
    for event in events:
        if event.event == EventName.TOOL_CALL_DELTA:
            key = (event.data["turn_id"], event.data["index"])
            call_id = event.data.get("id") or current[key]
            current[key] = call_id
            out[call_id] = out.get(call_id, "") + event.data["arguments"]
    return out


def client_of(server: LiveServer) -> httpx.AsyncClient:
    """An API client with a timeout for a slow real model (the test's own bound still applies)."""
    client = server.client()
    client.timeout = httpx.Timeout(180)
    return client


async def assert_generation_stopped(real_model: RealModel) -> None:
    """The server itself is idle, it stopped before its token cap, and generates nothing more."""
    slot = await real_model.wait_idle(within=10)
    decoded = slot["next_token"][0]["n_decoded"]
    assert decoded < MAX_TOKENS, f"the server generated {decoded} tokens: it ran to its cap, not stopped"
    before = await real_model.tokens_predicted()
    await asyncio.sleep(1.0)  # a window for tokens that would still be generated; not a wait on a condition
    assert await real_model.tokens_predicted() == before


async def test_streamed_reply_is_persisted_and_completes(start_server: Any, real_model: RealModel) -> None:
    server: LiveServer = await start_server(**real_model.settings())
    async with asyncio.timeout(TEST_SECONDS), client_of(server) as client:
        cid = await new_conversation(client)
        events, _ = await send(client, cid, "Say hello in one short sentence.", **NO_MEMORY)
        assert events[0].event == EventName.TURN_STARTED
        assert events[-1].event == EventName.TURN_COMPLETED, events[-1]
        seen = texts_by_turn(events)
        assert any(seen.values()), "the real model streamed no text"
        turns = (await client.get(f"/v1/conversations/{cid}/turns")).json()["items"]
        assert [t["status"] for t in turns] == ["completed"] * len(turns)
        assert turns[0]["role"] == "user"
        for turn in turns:
            if turn["role"] == "assistant":
                assert turn["content"] == seen.get(turn["id"], "")
                assert turn["model"] == real_model.model
        final = (await client.get(f"/v1/turns/{events[-1].data['turn_id']}")).json()
        assert final["usage"]["completion_tokens"] > 0


async def test_real_tool_call_is_stored_raw_runs_and_the_follow_up_is_accepted(
    start_server: Any, real_model: RealModel
) -> None:
    server: LiveServer = await start_server(**real_model.settings())

    def second_step_streams(events: list[SSEEvent]) -> bool:
        # The follow-up request (with the tool result) was accepted once its step streams anything.
        steps = [i for i, e in enumerate(events) if e.event == EventName.STEP_STARTED]
        return bool(steps) and any(
            e.event in (EventName.MESSAGE_DELTA, EventName.TOOL_CALL_DELTA) for e in events[steps[0] + 1 :]
        )

    async with asyncio.timeout(TEST_SECONDS), client_of(server) as client:
        cid = await new_conversation(client)
        events, stop = await send(client, cid, ASK_FOR_TIME, stop_when=second_step_streams, **NO_MEMORY)
        names = [e.event for e in events]
        deltas = [e for e in events if e.event == EventName.TOOL_CALL_DELTA]
        assert deltas, f"the real model made no tool call: {names}"
        first_turn = deltas[0].data["turn_id"]
        first_call = [e for e in deltas if e.data["turn_id"] == first_turn and e.data["index"] == 0]
        assert first_call[0].data["name"] == "current_time" and first_call[0].data["id"]
        assert len(first_call) > 1, "arguments arrive in the server's own pieces"
        raw = arguments_by_call(events)[first_call[0].data["id"]]
        assert json.loads(raw)  # complete JSON, as the server streamed it

        stored = (await client.get(f"/v1/turns/{first_turn}")).json()
        call = stored["tool_calls"][0]
        assert call["arguments"] == raw and call["state"] == "succeeded"
        result = next(e for e in events if e.event == EventName.TOOL_RESULT)
        assert result.data["state"] == "succeeded" and result.data["name"] == "current_time"
        tool_turn = (await client.get(f"/v1/turns/{result.data['turn_id']}")).json()
        assert tool_turn["role"] == "tool" and tool_turn["status"] == "completed"
        assert EventName.STEP_STARTED in names, names
        assert second_step_streams(events), f"the follow-up with the tool result was not accepted: {names}"
        assert not [e for e in events if e.event in ("error", EventName.TURN_FAILED)]
        if stop is not None:  # stopped once the second step was accepted: a bounded test
            assert stop.json()["status"] in ("interrupted_by_user", "completed")


async def test_stop_mid_text_stops_the_real_generation(start_server: Any, real_model: RealModel) -> None:
    # Text is what this test stops: no tools offered (as `local-model start` prints), since the
    # 0.5B model offered tools may call one whatever it is asked.
    server: LiveServer = await start_server(**real_model.settings(max_tool_steps=0))

    def some_text(events: list[SSEEvent]) -> bool:
        return sum(e.event == EventName.MESSAGE_DELTA for e in events) >= 3

    async with asyncio.timeout(TEST_SECONDS), client_of(server) as client:
        cid = await new_conversation(client)
        events, stop = await send(client, cid, ASK_FOR_LONG_TEXT, stop_when=some_text, **NO_MEMORY)
        assert stop is not None, [e.event for e in events]
        assert stop.json()["status"] == "interrupted_by_user"
        assert events[-1].event == EventName.TURN_INTERRUPTED
        seen = texts_by_turn(events)
        turn = (await client.get(f"/v1/turns/{events[-1].data['turn_id']}")).json()
        assert turn["status"] == "interrupted_by_user"
        assert turn["content"] == seen[turn["id"]] and turn["content"]
        await assert_generation_stopped(real_model)

        events, _ = await send(client, cid, "Thanks, that is enough.", **NO_MEMORY)
        assert events[-1].event == EventName.TURN_COMPLETED, "the real template refused the next prompt"


async def test_stop_mid_tool_arguments_stops_the_real_generation(
    start_server: Any, real_model: RealModel
) -> None:
    server: LiveServer = await start_server(**real_model.settings())

    def arguments_started(events: list[SSEEvent]) -> bool:
        return any(e.event == EventName.TOOL_CALL_DELTA and e.data["arguments"] for e in events)

    async with asyncio.timeout(TEST_SECONDS), client_of(server) as client:
        cid = await new_conversation(client)
        events, stop = await send(client, cid, ASK_FOR_TIME, stop_when=arguments_started, **NO_MEMORY)
        assert stop is not None, [e.event for e in events]
        assert stop.json()["status"] == "interrupted_by_user"
        delta = next(e for e in events if e.event == EventName.TOOL_CALL_DELTA)
        turn = (await client.get(f"/v1/turns/{delta.data['turn_id']}")).json()
        assert turn["status"] == "interrupted_by_user"
        call = turn["tool_calls"][0]
        assert call["arguments"] == arguments_by_call(events)[delta.data["id"]]
        assert call["state"] in ("streaming", "ready", "cancelled")
        assert not [e for e in events if e.event == EventName.TOOL_RESULT] or call["state"] != "streaming"
        await assert_generation_stopped(real_model)

        context = (await client.get(f"/v1/conversations/{cid}/context")).json()
        assert all("tool_calls" not in m and m["role"] != "tool" for m in context["messages"])
        events, _ = await send(client, cid, "Never mind.", **NO_MEMORY)
        assert events[-1].event == EventName.TURN_COMPLETED, "the real template refused the next prompt"


async def test_query_rewrite_with_the_real_model_is_time_boxed_and_stored(
    start_server: Any, real_model: RealModel
) -> None:
    def first_text(events: list[SSEEvent]) -> bool:
        return any(e.event in (EventName.MESSAGE_DELTA, EventName.TOOL_CALL_DELTA) for e in events)

    async with asyncio.timeout(TEST_SECONDS):
        for timeout, methods in ((30.0, {"model", "heuristic"}), (0.05, {"heuristic"})):
            server: LiveServer = await start_server(
                **real_model.settings(rewrite_timeout_seconds=timeout, recall_timeout_seconds=timeout + 30)
            )
            async with client_of(server) as client:
                cid = await new_conversation(client)
                await send(client, cid, "My favourite editor is Helix.", stop_when=first_text, **NO_MEMORY)
                events, _ = await send(
                    client, cid, "Why do I like it?", stop_when=first_text, memory_scope="user"
                )
                recalled = next(e for e in events if e.event == EventName.MEMORY_RETRIEVED).data
                assert recalled["rewrite"] in methods, recalled
                if recalled["rewrite"] == "heuristic":
                    assert recalled.get("rewrite_fallback"), "a fallback says why"
                if timeout < 1:
                    assert "timeout" in recalled["rewrite_fallback"]
                # Stored on the reply's turn, for auditing what was searched.
                reply_turn = (await client.get(f"/v1/turns/{events[0].data['reply_id']}")).json()
                assert reply_turn["rewritten_query"] == recalled["rewritten_query"]
                assert recalled["rewritten_query"] and "\n" not in recalled["rewritten_query"]
            await real_model.wait_idle(within=30)


async def test_dangling_tool_call_is_refused_raw_and_accepted_through_the_context_builder(
    start_server: Any, real_model: RealModel
) -> None:
    """The classic failure, on the real template: a stored half tool call replayed as is."""
    server: LiveServer = await start_server(**real_model.settings())

    def arguments_started(events: list[SSEEvent]) -> bool:
        return any(e.event == EventName.TOOL_CALL_DELTA and e.data["arguments"] for e in events)

    sdk = openai.AsyncOpenAI(
        base_url=real_model.base_url, api_key=real_model.api_key, max_retries=0, timeout=120
    )
    async with asyncio.timeout(TEST_SECONDS), client_of(server) as client:
        cid = await new_conversation(client)
        _, stop = await send(client, cid, ASK_FOR_TIME, stop_when=arguments_started, **NO_MEMORY)
        assert stop is not None
        await real_model.wait_idle(within=10)
        turns = (await client.get(f"/v1/conversations/{cid}/turns")).json()["items"]
        call = turns[-1]["tool_calls"][0]
        # The history as stored: the interrupted call with its partial raw arguments, no result.
        raw_history: list[dict[str, Any]] = [
            {"role": "user", "content": turns[0]["content"]},
            {
                "role": "assistant",
                "content": turns[-1]["content"] or None,
                "tool_calls": [
                    {
                        "id": call["id"],
                        "type": "function",
                        "function": {"name": call["name"], "arguments": call["arguments"]},
                    }
                ],
            },
            {"role": "user", "content": "Never mind."},
        ]
        tools = [
            {
                "type": "function",
                "function": {
                    "name": "current_time",
                    "description": "The current date and time in a timezone.",
                    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}},
                },
            }
        ]
        refused = await _status_of(sdk, raw_history, tools)
        complete_args = json.dumps({"timezone": "Europe/Paris"})
        raw_history[1]["tool_calls"][0]["function"]["arguments"] = complete_args
        rendered = await _render(real_model, raw_history, tools)
        # Half-JSON arguments are refused by the server; complete ones without their result are
        # accepted but rendered as a call nobody answered.
        try:
            json.loads(call["arguments"])
            mangled = "<tool_response>" not in rendered and call["name"] in rendered
            assert mangled
        except ValueError:
            assert refused >= 400, refused

        context = (await client.get(f"/v1/conversations/{cid}/context")).json()["messages"]
        sanitized = [*context, {"role": "user", "content": "Never mind."}]
        assert await _status_of(sdk, sanitized, tools) == 200
        rendered = await _render(real_model, sanitized, tools)
        history = rendered.split("<|im_end|>", 1)[1]  # after the system prompt and its tool instructions
        assert "```json" not in history and "<tool_response>" not in history, "no tool call left"
    await sdk.close()


async def _status_of(
    sdk: openai.AsyncOpenAI, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> int:
    """200 when the real server accepts the messages, else its HTTP status."""
    try:
        await sdk.chat.completions.create(
            model="any", messages=cast(Any, messages), tools=cast(Any, tools), max_tokens=1
        )
    except openai.APIStatusError as exc:
        return exc.status_code
    return 200


async def _render(real_model: RealModel, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> str:
    """The prompt the server's chat template makes of the messages (`/apply-template`)."""
    async with httpx.AsyncClient(timeout=30, headers=real_model.headers) as client:
        answer = await client.post(
            f"{real_model.root}/apply-template", json={"messages": messages, "tools": tools}
        )
    assert answer.status_code == 200, answer.text
    return str(answer.json()["prompt"])


async def test_the_next_message_is_read_from_the_servers_prompt_cache(
    start_server: Any, real_model: RealModel
) -> None:
    """With memory on, a conversation's next reply costs the server only what is new.

    Found: the memory block sat in the system message, before the history, so every reply's
    different memories made llama-server read the whole prompt again (420-620 tokens per
    reply with a short history). Now the server processes at most the previous reply and
    the new message with its part (memories and time); the earlier message keeps its part.
    """
    settings = real_model.settings(max_tool_steps=0, memory_tool="off", query_rewrite="heuristic")
    server: LiveServer = await start_server(**settings)
    async with asyncio.timeout(TEST_SECONDS * 2), server.client() as client:
        facts = await new_conversation(client, "About me")
        await send(client, facts, "My sister Ingrid lives in Reykjavik and keeps honeybees.", **NO_MEMORY)
        cid = await new_conversation(client)
        first, _ = await send(client, cid, "Where does my sister Ingrid live?")
        assert any(e.event == EventName.MEMORY_RETRIEVED and e.data["items"] for e in first)
        await real_model.wait_idle(60)
        before = await real_model.prompt_tokens()
        second, _ = await send(client, cid, "What does Ingrid keep there?")
        await real_model.wait_idle(60)
        processed = await real_model.prompt_tokens() - before
        messages = (await client.get(f"/v1/conversations/{cid}/context")).json()["messages"]
    assert second[-1].event == EventName.TURN_COMPLETED
    assert "Ingrid lives in Reykjavik" in messages[1]["content"]  # the first message kept its block
    new = await real_model.count_tokens(messages[2]["content"] + messages[3]["content"])
    whole = await real_model.count_tokens("".join(m["content"] or "" for m in messages[:4]))
    # The template frames each message with a few tokens (role, start and end markers).
    assert processed <= new + 16, (processed, new, whole)
    assert processed < whole / 2


def test_the_command_takes_a_running_openai_compatible_server(real_model: RealModel) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "chat_api.cli", "local-model", "start", "--url", real_model.base_url],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    settings = dict(line.split("=", 1) for line in done.stdout.splitlines())
    assert settings == {
        "LLM_PROVIDER": "openai",
        "LLM_BASE_URL": real_model.base_url,
        "LLM_MODEL": real_model.model,
        "REWRITE_MODEL": real_model.model,
    }


async def test_the_benchmarks_read_the_sampling_the_command_started_the_server_with(
    real_model: RealModel,
) -> None:
    """The answer benchmark counts only greedy replies; it reads that from the server's /props.

    Found: a running server started with its default sampling was reused as it was, and the
    same code's answer counts went 12/12 → 10/12 between runs.
    """
    sampling = await ModelServer(real_model.base_url, real_model.api_key).sampling()
    assert sampling is not None and sampling["temperature"] == 0, sampling
    assert await ModelServer(real_model.base_url, None).sampling() is None  # the key is needed


async def test_the_local_server_answers_only_with_its_key_and_to_no_web_page(real_model: RealModel) -> None:
    """Found: the local llama-server answered any program and any web page (no key, CORS `*`)."""
    status = subprocess.run(
        [sys.executable, "-m", "chat_api.cli", "local-model", "status", "--dir", str(real_model.home)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    printed = dict(line.split("=", 1) for line in status.stdout.splitlines())
    assert status.returncode == 0 and printed["LLM_API_KEY"] == real_model.api_key
    key_file = real_model.home / "api-key"
    assert key_file.stat().st_mode & 0o077 == 0  # readable by its owner only
    chat = {"model": real_model.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    async with httpx.AsyncClient(base_url=real_model.root, timeout=120) as client:
        for method, path, body in (
            ("POST", "/v1/chat/completions", chat),
            ("GET", "/slots", None),
            ("GET", "/metrics", None),
            ("POST", "/apply-template", {"messages": chat["messages"]}),
        ):
            bare = await client.request(method, path, json=body)
            wrong = await client.request(method, path, json=body, headers={"Authorization": "Bearer guess"})
            assert (bare.status_code, wrong.status_code) == (401, 401), path
        assert (await client.get("/slots", headers=real_model.headers)).status_code == 200
        answered = await client.post("/v1/chat/completions", json=chat, headers=real_model.headers)
        assert answered.status_code == 200
        # A page on another origin: neither the request nor the preflight lets a browser read it.
        page = {"Origin": "http://evil.example"}
        simple = await client.get("/v1/models", headers=page)
        preflight = await client.options(
            "/v1/chat/completions",
            headers={
                **page,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type",
            },
        )
    for answer in (simple, preflight):
        allowed = answer.headers.get("access-control-allow-origin")
        assert allowed not in ("*", "http://evil.example"), allowed
        assert answer.headers.get("access-control-allow-credentials") != "true"
