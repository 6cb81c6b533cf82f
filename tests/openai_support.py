"""Helpers of the OpenAI-compatible API tests: keys, SDK clients, and reading back what was stored."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from openai import AsyncOpenAI, OpenAI

from tests.procs import ServerProcess

MODEL = "chatmem-demo"
TENANT = "t-openai"
# A client tool, in chat completions' shape.
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def new_user() -> str:
    return f"u-{uuid.uuid4().hex[:10]}"


async def make_key(live: ServerProcess, user: str) -> str:
    async with live.client(TENANT, user) as api:
        response = await api.post("/v1/keys", json={"name": "sdk test"})
    assert response.status_code == 201, response.text
    return str(response.json()["key"])


def sdk(live: ServerProcess, key: str) -> OpenAI:
    return OpenAI(base_url=f"{live.base_url}/openai/v1", api_key=key, max_retries=0, timeout=30)


def async_sdk(live: ServerProcess, key: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{live.base_url}/openai/v1", api_key=key, max_retries=0, timeout=30)


async def turns(live: ServerProcess, user: str, conversation_id: str) -> list[dict[str, Any]]:
    async with live.client(TENANT, user) as api:
        response = await api.get(f"/v1/conversations/{conversation_id}/turns")
    assert response.status_code == 200, response.text
    return list(response.json()["items"])


async def conversations(live: ServerProcess, user: str) -> list[dict[str, Any]]:
    async with live.client(TENANT, user) as api:
        response = await api.get("/v1/conversations")
    return list(response.json()["items"])


async def wait_for(check: Callable[[], Awaitable[Any]], timeout: float = 20) -> Any:
    """Poll `check` until it returns something truthy (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def ended_turns(live: ServerProcess, user: str, conversation_id: str) -> list[dict[str, Any]]:
    async def check() -> list[dict[str, Any]] | None:
        items = await turns(live, user, conversation_id)
        return None if any(t["status"] == "streaming" for t in items) else items

    return list(await wait_for(check))
