"""What tests share: a conversation factory, one bounded wait, a counting encoder (SSE: tests/sse.py)."""

from __future__ import annotations

import asyncio
import inspect
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx
from sqlalchemy import text

from memory.recall.embeddings import HashEmbedder

T = TypeVar("T")


class CountingEmbedder(HashEmbedder):
    """The deterministic embedder, counting the texts it is asked to encode."""

    def __init__(self) -> None:
        super().__init__()
        self.texts: list[str] = []

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        self.texts.extend(texts)
        return await super().embed(texts)


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


async def run_node_tests(
    directory: Path,
    suite: str | Sequence[str],
    env: dict[str, str],
    *,
    timeout: float,
    reporter: str = "spec",
) -> str:
    """Run a `node --test` suite, or several (a protocol's own JS client against a live server); its report.

    Fails the test with node's output when a test failed or the suite took longer than `timeout`.
    """
    node = shutil.which("node")
    assert node is not None, "node is not installed"
    proc = await asyncio.create_subprocess_exec(
        node,
        "--test",
        f"--test-reporter={reporter}",
        *([suite] if isinstance(suite, str) else suite),
        cwd=directory,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        output, _ = await asyncio.wait_for(proc.communicate(), timeout=timeout)
    except TimeoutError:
        proc.kill()
        output, _ = await proc.communicate()
        raise AssertionError(
            f"{suite} took over {timeout}s:\n{output.decode(errors='replace')[-20000:]}"
        ) from None
    report = output.decode(errors="replace")
    print(report)  # node's report, shown with -s or -rA
    assert proc.returncode == 0, report[-20000:]
    return report


# Requests waiting for a conversation's row lock (its begin transaction's `FOR UPDATE`).
AT_THE_LOCK = text(
    "SELECT count(*) FROM pg_stat_activity"
    " WHERE wait_event_type = 'Lock' AND query LIKE '%FROM conversations%FOR UPDATE%'"
)


@asynccontextmanager
async def conversation_locked(
    db: Any, conversation_id: str
) -> AsyncIterator[Callable[[int], Awaitable[None]]]:
    """Hold the conversation's row lock; yields `waiting(n)`: wait until n requests wait at it."""

    async def waiting(count: int) -> None:
        async def there() -> bool:
            async with db.session() as watch:  # a new snapshot of pg_stat_activity each time
                return bool((await watch.execute(AT_THE_LOCK)).scalar_one() == count)

        await wait_until(there, what=f"{count} request(s) at the conversation's lock")

    async with db.transaction() as session:
        lock = text("SELECT 1 FROM conversations WHERE id = :id FOR UPDATE")
        await session.execute(lock, {"id": conversation_id})
        yield waiting
