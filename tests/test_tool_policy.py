"""Which tools a step is offered, and the loop's end: tools off, the memory tool, repeated calls."""

from __future__ import annotations

import json
from typing import Any

from memory.events import EventName
from tests.conftest import LiveServer
from tests.fake_openai import FakeOpenAI, Reply, ToolCall
from tests.sse import SSEEvent, iter_sse

NO_RECALL = {"memory_scope": "none"}
CLIENT_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
}


async def _server(start_server: Any, fake_openai: FakeOpenAI, **settings: Any) -> LiveServer:
    server: LiveServer = await start_server(
        llm_provider="openai", llm_base_url=fake_openai.base_url, llm_api_key="test", **settings
    )
    return server


async def _ask(server: LiveServer, content: str, **body: Any) -> list[SSEEvent]:
    async with server.client() as client:
        cid = (await client.post("/v1/conversations", json={})).json()["id"]
        async with client.stream(
            "POST", f"/v1/conversations/{cid}/messages", json={"content": content, **body}
        ) as r:
            return [e async for e in iter_sse(r)]


def _offered(request: Any) -> list[str]:
    return [tool["function"]["name"] for tool in request.tools or ()]


async def test_max_tool_steps_zero_offers_no_tools(start_server: Any, fake_openai: FakeOpenAI) -> None:
    server = await _server(start_server, fake_openai, max_tool_steps=0)
    fake_openai.script(Reply(text="Hello."))
    events = await _ask(server, "hi", **NO_RECALL)
    assert events[-1].event == EventName.TURN_COMPLETED
    assert [_offered(r) for r in fake_openai.requests] == [[]]


async def test_max_tool_steps_zero_still_passes_the_clients_own_tools(
    start_server: Any, fake_openai: FakeOpenAI
) -> None:
    """On the OpenAI-compatible door the client asked for its tools: they stay, and end the reply."""
    server = await _server(start_server, fake_openai, max_tool_steps=0)
    fake_openai.script(Reply(tool_calls=[ToolCall("get_weather", {})]))
    async with server.client() as client:
        r = await client.post(
            "/openai/v1/chat/completions",
            json={
                "model": server.services.provider.model,
                "messages": [{"role": "user", "content": "weather?"}],
                "tools": [CLIENT_TOOL],
            },
        )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert [_offered(req) for req in fake_openai.requests] == [["get_weather"]]


async def test_memory_tool_off_is_not_offered(start_server: Any, fake_openai: FakeOpenAI) -> None:
    server = await _server(start_server, fake_openai, memory_tool="off")
    fake_openai.script(Reply(text="Hello."))
    await _ask(server, "hi", **NO_RECALL)
    assert _offered(fake_openai.requests[-1]) == ["current_time"]


async def test_memory_tool_is_not_offered_when_the_replys_memory_is_off(
    start_server: Any, fake_openai: FakeOpenAI
) -> None:
    server = await _server(start_server, fake_openai)
    fake_openai.script(Reply(text="Hello."))
    await _ask(server, "hi", **NO_RECALL)
    assert _offered(fake_openai.requests[-1]) == ["current_time"]


async def test_a_repeated_identical_call_is_not_run_again_and_ends_the_loop(
    start_server: Any, fake_openai: FakeOpenAI
) -> None:
    """Seen with a 0.5B model: the same call, step after step, until MAX_TOOL_STEPS ran out."""
    server = await _server(start_server, fake_openai, max_tool_steps=5)
    call = ToolCall("current_time", {"timezone": "Europe/Paris"})
    same = ToolCall("current_time", '{ "timezone":"Europe/Paris" }')
    fake_openai.script(Reply(tool_calls=[call]), Reply(tool_calls=[same]), Reply(text="It is noon."))
    events = await _ask(server, "time?", **NO_RECALL)
    assert events[-1].event == EventName.TURN_COMPLETED
    results = [e.data for e in events if e.event == EventName.TOOL_RESULT]
    assert [r["state"] for r in results] == ["succeeded", "failed"]
    assert "not run again" in json.loads(results[1]["result"])["error"]
    assert len([e for e in events if e.event == EventName.TOOL_STARTED]) == 1
    # Three model requests, not five: the repeat ended the loop; the last was offered no tools.
    assert [_offered(r) for r in fake_openai.requests] == [
        ["current_time"],
        ["current_time"],
        [],
    ]
    assert "plain text" in fake_openai.requests[-1].messages[-1]["content"]


async def test_a_call_repeated_in_the_same_step_runs_once(start_server: Any, fake_openai: FakeOpenAI) -> None:
    server = await _server(start_server, fake_openai)
    call = ToolCall("current_time", {"timezone": "UTC"})
    fake_openai.script(Reply(tool_calls=[call, call]), Reply(text="Noon."))
    events = await _ask(server, "time?", **NO_RECALL)
    results = [e.data["state"] for e in events if e.event == EventName.TOOL_RESULT]
    assert results == ["succeeded", "failed"] and events[-1].event == EventName.TURN_COMPLETED
    assert _offered(fake_openai.requests[1]) == ["current_time"]  # one real call ran: the loop goes on


async def test_current_time_with_an_unknown_zone_is_stored_failed(
    start_server: Any, fake_openai: FakeOpenAI
) -> None:
    """Found: the tool's error came back as its result and the call was stored `succeeded`."""
    server = await _server(start_server, fake_openai)
    fake_openai.script(
        Reply(tool_calls=[ToolCall("current_time", {"timezone": "Mars/Olympus"})]), Reply(text="?")
    )
    events = await _ask(server, "time on Mars?", **NO_RECALL)
    result = next(e.data for e in events if e.event == EventName.TOOL_RESULT)
    assert result["state"] == "failed" and "Mars/Olympus" in json.loads(result["result"])["error"]
