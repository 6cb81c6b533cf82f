"""Stop through the OpenAI-compatible API closes the model's stream: chatmem in front of a scripted
OpenAI-compatible model (tests/fake_openai.py), driven by the `openai` SDK and by a client that gives up."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

from tests.conftest import LiveServer, token_for
from tests.fake_openai import FakeOpenAI, Reply

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


@pytest.mark.parametrize("timeout", [0.5])
async def test_a_client_leaving_a_non_streamed_request_stops_the_reply(
    start_server: Any, fake_openai: FakeOpenAI, timeout: float
) -> None:
    server = await fake_backed(start_server, fake_openai)
    fake_openai.script(Reply(text=LONG, chunk_delay=0.02))
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "talk"}]}
    async with httpx.AsyncClient(
        base_url=server.base_url, headers={"Authorization": f"Bearer {token_for()}"}
    ) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post("/openai/v1/chat/completions", json=body, timeout=timeout)
    assert await fake_openai.requests[0].wait_disconnected(within=5), "the model's stream must be closed"
    async with server.client() as api:
        conversation_id = (await api.get("/v1/conversations")).json()["items"][0]["id"]
    reply = await stored_reply(server, conversation_id)
    assert reply["status"] == "interrupted_by_user"
    assert reply["interrupt_reason"] == "client_disconnected"
    assert 0 < len(reply["content"]) < len(LONG)
