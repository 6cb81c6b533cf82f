"""Chat completions in front of a scripted OpenAI-compatible model (tests/fake_openai.py), driven by
the `openai` SDK and by a client that gives up.

What the client asked of the model must reach it (its system prompt after chatmem's, tool_choice,
sampling and length), its system prompt must not crowd the prompt past its budget, and stop must
close the model's stream.

Found: chat completions dropped the frontend's system prompt and its sampling and length options
(Open WebUI's and LibreChat's per-model settings), while the Responses API passed them on.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

from memory.prompt.tokens import count_tokens
from tests.conftest import LiveServer, token_for
from tests.fake_openai import FakeOpenAI, Reply, ToolCall
from tests.openai_support import WEATHER_TOOL
from tests.support import wait_until

LONG = "word " * 400


async def fake_backed(start_server: Any, fake_openai: FakeOpenAI) -> LiveServer:
    server: LiveServer = await start_server(
        llm_provider="openai", llm_base_url=fake_openai.base_url, llm_api_key="test", llm_model="fake-model"
    )
    return server


async def stored_reply(server: LiveServer, conversation_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 10
    async with server.client() as api:
        while True:
            items = (await api.get(f"/v1/conversations/{conversation_id}/turns")).json()["items"]
            if items and items[-1]["status"] != "streaming":
                return dict(items[-1])
            assert time.monotonic() < deadline, "the reply did not end"
            await asyncio.sleep(0.05)


async def test_closing_the_sdk_stream_closes_the_upstream_stream(
    start_server: Any, fake_openai: FakeOpenAI
) -> None:
    server = await fake_backed(start_server, fake_openai)
    fake_openai.script(Reply(text=LONG, chunk_delay=0.02))
    client = AsyncOpenAI(base_url=f"{server.base_url}/openai/v1", api_key=token_for(), max_retries=0)
    response = await client.chat.completions.with_raw_response.create(
        model="fake-model", messages=[{"role": "user", "content": "talk"}], stream=True
    )
    conversation_id = response.headers["x-chatmem-conversation-id"]
    stream = response.parse()
    received = ""
    async for chunk in stream:
        received += chunk.choices[0].delta.content or "" if chunk.choices else ""
        if len(received) > 40:
            break
    await stream.close()
    assert await fake_openai.requests[0].wait_disconnected(within=5), "the model's stream must be closed"
    reply = await stored_reply(server, conversation_id)
    assert reply["status"] == "interrupted_by_user"
    assert reply["content"].startswith(received) and len(reply["content"]) < len(LONG)


async def test_a_client_leaving_a_non_streamed_request_stops_the_reply(
    start_server: Any, fake_openai: FakeOpenAI
) -> None:
    # The client leaves once text has streamed (stored at a checkpoint), not at a fixed client
    # timeout: a 0.5 s timeout ran out before a busy server had asked the model at all.
    server = await fake_backed(start_server, fake_openai)
    fake_openai.script(Reply(text=LONG, chunk_delay=0.02))
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "talk"}]}
    async with httpx.AsyncClient(
        base_url=server.base_url, headers={"Authorization": f"Bearer {token_for()}"}
    ) as http:
        request = asyncio.create_task(http.post("/openai/v1/chat/completions", json=body, timeout=60))
        async with server.client() as api:

            async def streaming_text() -> str | None:
                listed = (await api.get("/v1/conversations")).json()["items"]
                if not listed:
                    return None
                items = (await api.get(f"/v1/conversations/{listed[0]['id']}/turns")).json()["items"]
                last = items[-1] if items else {}
                streaming = last.get("role") == "assistant" and last.get("status") == "streaming"
                return str(listed[0]["id"]) if streaming and last.get("content") else None

            conversation_id = await wait_until(streaming_text, what="text of the reply stored")
        request.cancel()  # the client leaves
        with pytest.raises(asyncio.CancelledError):
            await request
    assert await fake_openai.requests[0].wait_disconnected(within=5), "the model's stream must be closed"
    reply = await stored_reply(server, conversation_id)
    assert reply["status"] == "interrupted_by_user"
    assert reply["interrupt_reason"] == "client_disconnected"
    assert 0 < len(reply["content"]) < len(LONG)


async def test_the_system_prompt_tool_choice_sampling_and_length_reach_the_model(
    start_server: Any, fake_openai: FakeOpenAI
) -> None:
    server = await fake_backed(start_server, fake_openai)
    fake_openai.script(Reply(tool_calls=[ToolCall("get_weather", {"city": "Oslo"})]))
    client = AsyncOpenAI(base_url=f"{server.base_url}/openai/v1", api_key=token_for(), max_retries=0)
    response = await client.chat.completions.with_raw_response.create(
        model="fake-model",
        messages=[
            {"role": "system", "content": "Answer like a ship's captain."},
            {"role": "developer", "content": "Use metric units."},
            {"role": "user", "content": "weather in Oslo?"},
        ],
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0.3,
        top_p=0.9,
        max_completion_tokens=64,
    )
    assert response.parse().choices[0].finish_reason == "tool_calls"
    [sent] = fake_openai.requests
    assert [m["role"] for m in sent.messages].count("system") == 1
    assert sent.messages[0]["content"].endswith("Answer like a ship's captain.\n\nUse metric units.")
    assert sent.body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert (sent.body["temperature"], sent.body["top_p"], sent.body["max_tokens"]) == (0.3, 0.9, 64)
    # The system prompt is the client's setting for this reply, not a turn of the conversation.
    async with server.client() as api:
        conversation_id = response.headers["x-chatmem-conversation-id"]
        turns = (await api.get(f"/v1/conversations/{conversation_id}/turns")).json()["items"]
    assert not any("captain" in (turn["content"] or "") for turn in turns)

    fake_openai.script(Reply(text="Calm seas."))
    await client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "and tomorrow?"}], max_tokens=32
    )
    later = fake_openai.requests[1]
    assert later.body["max_tokens"] == 32, "max_tokens is the older name of max_completion_tokens"
    assert "captain" not in later.messages[0]["content"], "instructions hold for the request that sent them"
    assert "temperature" not in later.body and "tool_choice" not in later.body


async def test_a_long_system_prompt_leaves_the_history_less_room(
    start_server: Any, fake_openai: FakeOpenAI
) -> None:
    # Room for chatmem's system prompt, the client's (~1,700 tokens), the memory reserve and a
    # few of the 16 history messages (~150 tokens each), not all of them.
    max_tokens, reserve = 4500, 1024
    server: LiveServer = await start_server(
        llm_provider="openai",
        llm_base_url=fake_openai.base_url,
        llm_api_key="test",
        llm_model="fake-model",
        context_max_tokens=max_tokens,
        reply_reserve_tokens=reserve,
    )
    fake_openai.script(Reply(text="ok"))
    client = AsyncOpenAI(base_url=f"{server.base_url}/openai/v1", api_key=token_for(), max_retries=0)
    history: list[dict[str, str]] = []
    for i in range(8):
        history.append({"role": "user", "content": f"note {i}: " + "alpha beta gamma delta " * 35})
        history.append({"role": "assistant", "content": f"noted {i}: " + "epsilon zeta eta theta " * 35})
    system = "Be precise and name your sources. " * 200
    await client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "system", "content": system}, *history, {"role": "user", "content": "and now?"}],  # type: ignore[list-item]
    )
    # The reply's request (with history to go on, the question may be rewritten first).
    [sent] = [r for r in fake_openai.requests if str(r.messages[0]["content"]).endswith(system.strip())]
    shown = sum(count_tokens(str(m.get("content") or "")) for m in sent.messages)
    assert count_tokens(system) > 1000 and sent.messages[0]["content"].endswith(system.strip())
    assert shown <= max_tokens - reserve, f"{shown} prompt tokens leave less than the reply's reserve"
    assert "and now?" in str(sent.messages[-1]["content"])
    kept = [m for m in sent.messages[1:-1] if str(m.get("content") or "").startswith(("note ", "noted "))]
    assert 0 < len(kept) < len(history), f"{len(kept)} of {len(history)} history messages shown"
    assert kept[-1]["content"] == history[-1]["content"], "the newest history is what is kept"


async def test_a_keyed_completion_retried_after_the_model_failed_gets_a_new_answer_not_the_failure(
    start_server: Any, fake_openai: FakeOpenAI
) -> None:
    # The SDK retries the 500 of a failed reply; with its Idempotency-Key the retry was given
    # the same failed reply again (a 500 each time) while the model had recovered.
    server: LiveServer = await start_server(
        llm_provider="openai",
        llm_base_url=fake_openai.base_url,
        llm_api_key="test",
        llm_model="fake-model",
        llm_max_retries=0,
    )
    fake_openai.script(Reply(fail_status=500), Reply(text="fine now"))
    client = AsyncOpenAI(base_url=f"{server.base_url}/openai/v1", api_key=token_for(), max_retries=2)
    raw = await client.chat.completions.with_raw_response.create(
        model="fake-model",
        messages=[{"role": "user", "content": "hello?"}],
        extra_headers={"Idempotency-Key": "after-a-failure"},
    )
    assert raw.parse().choices[0].message.content == "fine now"
    assert raw.retries_taken == 1 and len(fake_openai.requests) == 2
    async with server.client() as api:
        conversations = (await api.get("/v1/conversations")).json()["items"]
        assert len(conversations) == 1
        stored = (await api.get(f"/v1/conversations/{conversations[0]['id']}/turns")).json()["items"]
    assert [(t["role"], t["status"], t["content"]) for t in stored] == [
        ("user", "completed", "hello?"),
        ("assistant", "completed", "fine now"),
    ]
