"""What tests share: a conversation factory and one bounded wait (the SSE parser is tests/sse.py)."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx

T = TypeVar("T")


async def new_conversation(client: httpx.AsyncClient, title: str = "", **fields: Any) -> str:
    """Create a conversation through the API (201 or the test fails); its id."""
    r = await client.post("/v1/conversations", json={"title": title, **fields})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


async def wait_until(
    check: Callable[[], Awaitable[T] | T],
    timeout: float = 15.0,
    what: str = "the condition",
    *,
    every: float = 0.05,
) -> T:
    """Poll `check()` (sync or async) until it returns something truthy, and return that.

    Fails the test after `timeout` seconds.
    """

    async def value_now() -> T:
        value = check()
        return await value if inspect.isawaitable(value) else value

    try:
        async with asyncio.timeout(timeout):
            while not (value := await value_now()):
                await asyncio.sleep(every)
    except TimeoutError:
        raise AssertionError(f"timed out after {timeout:g}s waiting for {what}") from None
    return value
