"""A fuzz run over each adapter: valid requests with one value made odd answer a 4xx in the protocol's shape.

Hypothesis takes a valid request of each door (OpenAI chat completions, the AI SDK chat, an
AG-UI run, MCP tool calls, the import) and replaces one value anywhere in it, or adds one,
with the kind of input that used to reach a handler and answer 500: NUL and lone surrogates in
strings (keys too), integers past what Python converts or Postgres stores, JSON nested
past the parsers' depth, times UTC cannot hold, wrong types. No answer may be a 5xx, and
each error is in its protocol's own shape. The schema-driven run (test_schemathesis.py)
covers every route's declared schema; this one aims at the values a schema allows.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.conftest import LiveServer, auth

FAST = {"demo_tokens_per_second": 5000.0, "rate_limit_per_minute": 0, "max_streams_per_user": 0}
FUZZ = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)

# Placeholders replaced in the JSON text: values json.dumps cannot write.
HUGE_INT = "\x01huge-int\x01"
DEEP = "\x01deep\x01"
RAW = {json.dumps(HUGE_INT): "9" * 4400, json.dumps(DEEP): "[" * 1200 + "]" * 1200}

odd_text = st.one_of(
    st.sampled_from(["\x00", "a\x00b", "\ud800", "x\udfff", "\udc00\ud800", "", " ", "\u2028", "é" * 300]),
    st.text(st.characters(categories=["Cc", "Cs", "Zs", "So"]), max_size=8),
)
odd_value = st.one_of(
    odd_text,
    st.sampled_from([HUGE_INT, DEEP, "0001-01-01T00:00:00+14:00", "9999-12-31T23:59:59-14:00"]),
    st.sampled_from([2**31, 2**63, -(2**63) - 1, 10**30, -1, 0, 1.5e308, None, True, [], {}, [[[]]]]),
    st.integers(),
    st.floats(allow_nan=False),
)


@pytest.fixture
async def fuzz_server(start_server: Any) -> LiveServer:
    """One server for all the examples of a test (the demo model at full speed, no rate limit)."""
    server: LiveServer = await start_server(**FAST)
    return server


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every position in a JSON value (the value itself included)."""
    found = [prefix]
    if isinstance(value, dict):
        for key, inner in value.items():
            found += paths(inner, (*prefix, key))
    elif isinstance(value, list):
        for index, inner in enumerate(value):
            found += paths(inner, (*prefix, index))
    return found


@st.composite
def mutated(draw: st.DrawFn, bases: list[Any]) -> str:
    """One base request as JSON text, with one value replaced (or one key added) by an odd one."""
    document = json.loads(json.dumps(draw(st.sampled_from(bases))))
    where = draw(st.sampled_from(paths(document)[1:]))
    parent = document
    for step in where[:-1]:
        parent = parent[step]
    if isinstance(parent, dict) and draw(st.booleans()):
        parent[draw(odd_text | st.sampled_from(["id", "metadata", "extra"]))] = draw(odd_value)
    else:
        parent[where[-1]] = draw(odd_value)
    text = json.dumps(document)  # lone surrogates are written as \ud800 escapes, as a client would
    for placeholder, raw in RAW.items():
        text = text.replace(placeholder, raw)
    return text


async def post(server: LiveServer, path: str, text: str, **headers: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=server.base_url, headers=auth(), timeout=30) as client:
        return await client.post(
            path, content=text.encode(), headers={"Content-Type": "application/json", **headers}
        )


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


OPENAI_BASES: list[Any] = [
    {"model": "chatmem-demo", "messages": [user("hi")]},
    {"model": "chatmem-demo", "messages": [user("hi")], "stream": True, "metadata": {"chat_key": "k1"}},
    {
        "model": "chatmem-demo",
        "messages": [
            {"role": "system", "content": "be brief"},
            user("q"),
            {"role": "assistant", "content": "a"},
        ],
        "user": "chat:k2",
    },
    {
        "model": "chatmem-demo",
        "messages": [
            user("call it"),
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        ],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    },
]


@FUZZ
@given(body=mutated(OPENAI_BASES))
@example(
    body='{"model": "chatmem-demo", "messages": [{"role": "user", "content": "hi"}], "n": ' + "1" * 4301 + "}"
)
async def test_openai_chat_completions_never_answer_5xx(fuzz_server: LiveServer, body: str) -> None:
    r = await post(fuzz_server, "/openai/v1/chat/completions", body)
    assert r.status_code < 500, (body[:300], r.status_code, r.text[:500])
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text


def ui_message(text: str, message_id: str = "m1") -> dict[str, Any]:
    return {"id": message_id, "role": "user", "parts": [{"type": "text", "text": text}]}


AI_SDK_BASES: list[Any] = [
    {"id": "chat-a", "trigger": "submit-message", "messages": [ui_message("hi")]},
    {"id": "chat-b", "trigger": "submit-message", "messages": [ui_message("hi")], "messageId": "m1"},
    {"id": "chat-a", "trigger": "regenerate-message", "messages": [ui_message("hi")], "on_busy": "interrupt"},
    {
        "id": "chat-a",
        "trigger": "submit-message",
        "messages": [
            {
                "id": "a1",
                "role": "assistant",
                "parts": [
                    {
                        "type": "tool-transfer_funds",
                        "toolCallId": "c1",
                        "state": "approval-responded",
                        "approval": {"id": "c1", "approved": True},
                    }
                ],
            }
        ],
    },
]


@FUZZ
@given(body=mutated(AI_SDK_BASES))
@example(body=json.dumps({**AI_SDK_BASES[0], "messages": [ui_message("hi", "m\x00")]}))
async def test_ai_sdk_chat_never_answers_5xx(fuzz_server: LiveServer, body: str) -> None:
    r = await post(fuzz_server, "/v1/ai-sdk/chat", body)
    assert r.status_code < 500, (body[:300], r.status_code, r.text[:500])
    if r.status_code >= 400:
        assert {"code", "message"} <= set(r.json()["error"]), r.text


def ag_ui_input(thread: str, messages: list[Any], **extra: Any) -> dict[str, Any]:
    base = {"threadId": thread, "runId": "r1", "tools": [], "context": [], "state": {}, "forwardedProps": {}}
    return {**base, "messages": messages, **extra}


AG_UI_BASES: list[Any] = [
    ag_ui_input("thread-a", [{"id": "m1", "role": "user", "content": "hi"}]),
    ag_ui_input(
        "thread-b",
        [{"id": "m1", "role": "user", "content": "hi"}],
        tools=[{"name": "get_weather", "description": "w", "parameters": {"type": "object"}}],
        forwardedProps={"on_disconnect": "stop", "memory_scope": "conversation"},
        protocolVersion="1.0",
    ),
    ag_ui_input("thread-c", [{"id": "t1", "role": "tool", "toolCallId": "c1", "content": "{}"}]),
    ag_ui_input(
        "thread-d",
        [],
        resume=[
            {
                "interruptId": "approval:00000000-0000-0000-0000-000000000001:c1",
                "status": "resolved",
                "payload": {"approved": True, "editedArgs": {"amount": 1}},
            }
        ],
    ),
]


@FUZZ
@given(body=mutated(AG_UI_BASES))
async def test_ag_ui_runs_never_answer_5xx(fuzz_server: LiveServer, body: str) -> None:
    r = await post(fuzz_server, "/v1/ag-ui", body)
    assert r.status_code < 500, (body[:300], r.status_code, r.text[:500])
    if r.status_code >= 400:
        assert {"code", "message"} <= set(r.json()["error"]), r.text
    else:
        frames = [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:")]
        assert frames[0]["type"] == "RUN_STARTED" and frames[-1]["type"] == "RUN_FINISHED", r.text[-500:]


MCP_HEADERS = {"Accept": "application/json, text/event-stream", "MCP-Protocol-Version": "2025-06-18"}


def tool_call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    params = {"name": name, "arguments": arguments}
    return {"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": params}


MCP_BASES: list[Any] = [
    tool_call("search_memory", {"query": "bees", "k": 3}),
    tool_call("remember", {"fact": "I keep bees."}),
    tool_call("forget", {"item_id": 1}),
    {"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
]


@FUZZ
@given(body=mutated(MCP_BASES))
async def test_mcp_tool_calls_never_answer_5xx(fuzz_server: LiveServer, body: str) -> None:
    r = await post(fuzz_server, "/mcp", body, **MCP_HEADERS)
    assert r.status_code < 500, (body[:300], r.status_code, r.text[:500])
    if r.status_code == 200:
        answer = r.json()
        assert answer["jsonrpc"] == "2.0" and ("result" in answer or "error" in answer), answer
        if "result" in answer and answer["result"].get("isError"):
            text = json.dumps(answer["result"])
            assert "Traceback" not in text and "asyncpg" not in text, text


IMPORT_BASES: list[Any] = [
    {
        "turns": [
            {"role": "user", "content": "hi", "created_at": "2024-01-01T10:00:00Z", "external_id": "e1"},
            {"role": "assistant", "content": "hello", "name": "bot", "metadata": {"source": "x", "n": [1]}},
        ]
    }
]


@FUZZ
@given(body=mutated(IMPORT_BASES))
async def test_import_never_answers_5xx(fuzz_server: LiveServer, body: str) -> None:
    async with httpx.AsyncClient(base_url=fuzz_server.base_url, headers=auth()) as client:
        cid = (await client.post("/v1/conversations", json={})).json()["id"]
    r = await post(fuzz_server, f"/v1/conversations/{cid}/import", body)
    assert r.status_code < 500, (body[:300], r.status_code, r.text[:500])


RESPONSES_BASES: list[Any] = [
    {"model": "chatmem-demo", "input": "hi", "metadata": {"k": "v"}, "instructions": "be brief"},
    {
        "model": "chatmem-demo",
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]},
            {"type": "message", "role": "assistant", "content": "a"},
            {"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA=="}]},
        ],
        "stream": True,
        "temperature": 0.5,
    },
    {
        "model": "chatmem-demo",
        "input": [
            {"role": "user", "content": "call it"},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        ],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "f"},
    },
]


@FUZZ
@given(body=mutated(RESPONSES_BASES))
async def test_openai_responses_never_answer_5xx(fuzz_server: LiveServer, body: str) -> None:
    r = await post(fuzz_server, "/openai/v1/responses", body)
    assert r.status_code < 500, (body[:300], r.status_code, r.text[:500])
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
