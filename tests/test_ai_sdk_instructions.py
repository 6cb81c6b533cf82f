"""The AI SDK door gives the model the client's system messages, for that reply only.

Found: `useChat` apps that keep a system message in their messages had it dropped (only the
last message was read), while the OpenAI and AG-UI doors pass theirs on. What reaches the
model is read from the scripted OpenAI-compatible model (tests/fake_openai.py).
"""

from __future__ import annotations

from typing import Any

from tests.conftest import LiveServer
from tests.fake_openai import FakeOpenAI, Reply

SYSTEM = {"id": "s1", "role": "system", "parts": [{"type": "text", "text": "Answer like a ship's captain."}]}


def user(message_id: str, text: str) -> dict[str, Any]:
    return {"id": message_id, "role": "user", "parts": [{"type": "text", "text": text}]}


async def send(server: LiveServer, body: dict[str, Any]) -> None:
    async with server.client() as api, api.stream("POST", "/v1/ai-sdk/chat", json=body) as response:
        assert response.status_code == 200, await response.aread()
        assert (await response.aread()).rstrip().endswith(b"data: [DONE]")


async def test_a_system_message_reaches_the_model_for_its_reply_and_a_regenerated_one(
    start_server: Any, fake_openai: FakeOpenAI
) -> None:
    server: LiveServer = await start_server(
        llm_provider="openai", llm_base_url=fake_openai.base_url, llm_api_key="test", llm_model="fake-model"
    )
    fake_openai.script(Reply(text="Aye."), Reply(text="Fine."), Reply(text="Aye aye."))
    chat = {"id": "chat-captain", "trigger": "submit-message"}
    await send(server, {**chat, "messages": [SYSTEM, user("u1", "any ships today?")]})
    await send(server, {**chat, "messages": [user("u2", "and tomorrow?")]})
    await send(
        server, {**chat, "trigger": "regenerate-message", "messages": [SYSTEM, user("u2", "and tomorrow?")]}
    )
    told, untold, regenerated = (r.messages for r in fake_openai.requests if r.stream)
    assert told[0]["content"].endswith("\n\nAnswer like a ship's captain.")
    assert "captain" not in untold[0]["content"], "instructions hold for the request that sent them"
    assert regenerated[0]["content"].endswith("\n\nAnswer like a ship's captain.")
    async with server.client() as api:
        messages = (await api.get("/v1/ai-sdk/chat/chat-captain/messages")).json()
    assert "captain" not in str(messages), "a system message is not stored as a turn"


async def test_system_messages_longer_than_a_message_are_refused_before_anything_is_stored(
    start_server: Any,
) -> None:
    server: LiveServer = await start_server(max_message_chars=1000)
    system = {**SYSTEM, "parts": [{"type": "text", "text": "x" * 1001}]}
    body = {"id": "chat-long", "trigger": "submit-message", "messages": [system, user("u1", "hi")]}
    async with server.client() as api:
        refused = await api.post("/v1/ai-sdk/chat", json=body)
        assert refused.status_code == 422
        assert refused.json()["error"]["details"]["field"] == "messages"
        assert (await api.get("/v1/conversations")).json()["items"] == []
