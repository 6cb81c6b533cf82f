"""Tool calls a small model writes as text: parsed into calls, or kept out of the answer.

The filter alone (every form, in pieces of several sizes), then through a live server whose
model is the fake OpenAI server scripted to write calls as text: nothing call-shaped reaches
the stream or the stored turn.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from chat_api.providers.base import Delta, StreamEnd, TextDelta, ToolCallDelta
from chat_api.providers.textual_calls import TextualCalls, textual_tool_calls
from memory.events import EventName
from tests.conftest import LiveServer
from tests.fake_openai import FakeOpenAI, Reply
from tests.sse import SSEEvent, iter_sse

TOOLS = ("current_time", "recall_memory")
FENCED = '```json\n{"name": "current_time", "arguments": {"timezone": "Europe/Paris"}}\n```'
BARE = '{"name": "recall_memory", "arguments": {"query": "What do you do for a living?"}}'
TAGGED = '<tool_call>\n{"name": "current_time", "arguments": {}}\n</tool_call>'


async def run(text: str, offered: tuple[str, ...] = TOOLS, chunk: int | None = None) -> tuple[str, Any, Any]:
    pieces = [text] if chunk is None else [text[i : i + chunk] for i in range(0, len(text), chunk)]

    async def source() -> AsyncIterator[Delta]:
        for piece in pieces:
            yield TextDelta(piece)
        yield StreamEnd("stop")

    record = TextualCalls()
    out = [d async for d in textual_tool_calls(source(), offered, record)]
    assert isinstance(out[-1], StreamEnd)
    shown = "".join(d.text for d in out if isinstance(d, TextDelta))
    calls = [(d.name, json.loads(d.arguments)) for d in out if isinstance(d, ToolCallDelta)]
    return shown, calls, record


@pytest.mark.parametrize("chunk", [None, 1, 3, 7])
@pytest.mark.parametrize(
    "text,name", [(FENCED, "current_time"), (BARE, "recall_memory"), (TAGGED, "current_time")]
)
async def test_a_call_written_as_text_becomes_a_call(text: str, name: str, chunk: int | None) -> None:
    shown, calls, record = await run(text, chunk=chunk)
    assert shown == "" and [c[0] for c in calls] == [name] and record.parsed == 1


@pytest.mark.parametrize("chunk", [None, 2])
async def test_a_call_to_a_tool_not_offered_is_never_shown(chunk: int | None) -> None:
    shown, calls, record = await run(FENCED, offered=(), chunk=chunk)
    assert shown == "" and calls == [] and record.dropped == ["current_time"]


async def test_a_call_cut_off_by_the_token_cap_is_never_shown() -> None:
    shown, calls, record = await run('{"name": "recall_memory", "arguments": {"query": "What do', chunk=4)
    assert shown == "" and calls == [] and record.dropped == ["recall_memory"]


@pytest.mark.parametrize("chunk", [None, 1, 5])
@pytest.mark.parametrize(
    "text",
    [
        "Your sister lives in Porto.",
        "```python\nprint(1)\n```",
        '```json\n{"a": 1}\n```',
        '{"a": {"name": 1}}',
        "<b>bold</b>",
        "  \n Leading space then words",
        '```json\n[{"name": "x"}]\n```',
        '```json\n{\n  "name": "John Doe",\n  "age": 39,\n  "occupation": "Nurse"\n}\n```',
        '{"name": "Leeds", "arguments": "none"}',
    ],
)
async def test_ordinary_text_and_json_answers_pass_unchanged(text: str, chunk: int | None) -> None:
    shown, calls, record = await run(text, chunk=chunk)
    assert shown == text and calls == [] and not record.dropped


async def test_an_answer_is_released_at_its_first_piece() -> None:
    async def source() -> AsyncIterator[Delta]:
        yield TextDelta("Porto")
        raise AssertionError("the filter must not read ahead of an ordinary answer")

    stream = textual_tool_calls(source(), TOOLS, TextualCalls())
    assert (await anext(stream)) == TextDelta("Porto")
    await stream.aclose()


async def test_closing_the_filter_closes_the_upstream_stream() -> None:
    closed = []

    async def source() -> AsyncIterator[Delta]:
        try:
            yield TextDelta("Porto")
            yield TextDelta(" is")
        finally:
            closed.append(True)

    stream = textual_tool_calls(source(), TOOLS, TextualCalls())
    await anext(stream)
    await stream.aclose()
    assert closed == [True]


async def test_two_calls_then_words() -> None:
    shown, calls, _ = await run(FENCED + "\n" + BARE + "\nDone.", chunk=3)
    assert [c[0] for c in calls] == ["current_time", "recall_memory"]
    assert shown.strip() == "Done."


async def test_fenced_call_without_closing_fence_at_the_end() -> None:
    shown, calls, _ = await run('```json\n{"name": "current_time", "arguments": {}}')
    assert shown == "" and calls == [("current_time", {})]


async def test_real_tool_call_deltas_pass_and_text_calls_number_after_them() -> None:
    async def source() -> AsyncIterator[Delta]:
        yield ToolCallDelta(0, "a", "current_time", "{}")
        yield TextDelta(BARE)
        yield StreamEnd("stop")

    out = [d async for d in textual_tool_calls(source(), TOOLS, TextualCalls())]
    assert [d.index for d in out if isinstance(d, ToolCallDelta)] == [0, 1]


async def test_a_json_answer_cut_off_by_the_token_cap_is_shown() -> None:
    text = '```json\n{\n  "name": "John Doe",\n  "age": 39,\n  "birth_year": 1987\n'
    shown, calls, record = await run(text, chunk=5)
    assert shown == text and calls == [] and not record.dropped


# --- through a live server ------------------------------------------------------------------

NO_RECALL = {"memory_scope": "none"}


async def _ask(client: Any, cid: str, content: str) -> list[SSEEvent]:
    async with client.stream(
        "POST", f"/v1/conversations/{cid}/messages", json={"content": content, **NO_RECALL}
    ) as r:
        return [e async for e in iter_sse(r)]


def _shown(events: list[SSEEvent]) -> str:
    return "".join(e.data["text"] for e in events if e.event == EventName.MESSAGE_DELTA)


async def _openai_server(start_server: Any, fake_openai: FakeOpenAI, **settings: Any) -> LiveServer:
    server: LiveServer = await start_server(
        llm_provider="openai",
        llm_base_url=fake_openai.base_url,
        llm_api_key="test",
        llm_model="fake-model",
        **settings,
    )
    return server


async def test_a_call_written_as_text_runs_as_a_call_and_is_never_shown_or_stored(
    start_server: Any, fake_openai: FakeOpenAI
) -> None:
    server = await _openai_server(start_server, fake_openai)
    fake_openai.script(Reply(text=FENCED, text_chunk_chars=3), Reply(text="It is noon in Paris."))
    async with server.client() as client:
        cid = (await client.post("/v1/conversations", json={})).json()["id"]
        events = await _ask(client, cid, "What time is it in Paris?")
        assert events[-1].event == EventName.TURN_COMPLETED
        assert _shown(events) == "It is noon in Paris."
        results = [e.data for e in events if e.event == EventName.TOOL_RESULT]
        assert [(r["name"], r["state"]) for r in results] == [("current_time", "succeeded")]
        turns = (await client.get(f"/v1/conversations/{cid}/turns")).json()["items"]
        assistant = [t for t in turns if t["role"] == "assistant"]
        assert [t["content"] for t in assistant] == ["", "It is noon in Paris."]
        assert assistant[0]["tool_calls"][0]["name"] == "current_time"
        assert json.loads(assistant[0]["tool_calls"][0]["arguments"]) == {"timezone": "Europe/Paris"}
    # The model was then sent the call as a real call with its result (the fake checks the sequence).
    second = fake_openai.requests[1]
    assert second.status == 200 and [m["role"] for m in second.messages][-2:] == ["assistant", "tool"]


async def test_with_tools_off_a_call_written_as_text_is_asked_again_then_never_shown(
    start_server: Any, fake_openai: FakeOpenAI
) -> None:
    server = await _openai_server(start_server, fake_openai, max_tool_steps=0)
    fake_openai.script(Reply(text=BARE), Reply(text=BARE))
    async with server.client() as client:
        cid = (await client.post("/v1/conversations", json={})).json()["id"]
        events = await _ask(client, cid, "What do I do for a living?")
        assert events[-1].event == EventName.TURN_COMPLETED
        assert _shown(events) == "" and not [e for e in events if e.event == EventName.TOOL_CALL_DELTA]
        errors = [e.data for e in events if e.event == EventName.ERROR]
        assert [e["code"] for e in errors] == ["tool_call_as_text"]
        turns = (await client.get(f"/v1/conversations/{cid}/turns")).json()["items"]
        stored = [t for t in turns if t["role"] == "assistant"]
        assert all(t["content"] == "" and not t["tool_calls"] for t in stored)
        assert stored[-1]["status"] == "completed" and stored[-1]["error"]["code"] == "tool_call_as_text"
    first, again = fake_openai.requests
    assert first.tools is None and again.tools is None
    assert again.messages[-1]["content"].endswith("in plain text, without calling any tool.")


async def test_with_tools_off_the_second_try_answers(start_server: Any, fake_openai: FakeOpenAI) -> None:
    server = await _openai_server(start_server, fake_openai, max_tool_steps=0)
    fake_openai.script(Reply(text=FENCED), Reply(text="A nurse."))
    async with server.client() as client:
        cid = (await client.post("/v1/conversations", json={})).json()["id"]
        events = await _ask(client, cid, "What do I do for a living?")
        assert _shown(events) == "A nurse." and events[-1].event == EventName.TURN_COMPLETED
        assert not [e for e in events if e.event == EventName.ERROR]


async def test_stop_while_a_call_is_held_back_keeps_exactly_what_was_shown(
    start_server: Any, fake_openai: FakeOpenAI
) -> None:
    server = await _openai_server(start_server, fake_openai, max_tool_steps=0)
    fake_openai.script(
        Reply(text="Sure. ", chunk_delay=0.02),
        Reply(text=BARE, chunk_delay=0.05, text_chunk_chars=2),
    )
    async with server.client() as client:
        cid = (await client.post("/v1/conversations", json={})).json()["id"]
        await _ask(client, cid, "hello")
        events: list[SSEEvent] = []
        async with client.stream(
            "POST", f"/v1/conversations/{cid}/messages", json={"content": "and now?", **NO_RECALL}
        ) as r:
            stream = iter_sse(r)
            async for event in stream:
                events.append(event)
                if event.event == EventName.TURN_STARTED:
                    break
            # The model is writing the call (held back): stop once it has sent a part of it.
            request = fake_openai.requests[-1]
            while request.chunks_sent < 6:
                await asyncio.sleep(0.01)
            stop = await client.post(f"/v1/turns/{events[0].data['reply_id']}/stop")
            events += [e async for e in stream]
        assert stop.json()["status"] == "interrupted_by_user"
        assert _shown(events) == "" and stop.json()["turn"]["content"] == ""
