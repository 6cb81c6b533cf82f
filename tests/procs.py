"""Real server processes for tests that need another process or a crash."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx

from bench.common import wait_until_ready
from tests.conftest import TEST_SECRET, auth, free_port


async def hand_index_to_the_real_encoder(pg_url: str) -> None:
    """Let a real-model server start on the shared test database.

    Tests in this process index with the deterministic fake encoder (or an embedding
    service); a server process encodes with the real local model and refuses to answer from
    vectors another encoder made (memory/recall/index.py). Memory left by an earlier test's
    fake encoder or embedding service (any runtime but a local one a server loads) is dropped,
    so the server takes the empty index.
    """
    from sqlalchemy import text

    from memory.recall.embeddings import RUNTIMES
    from memory.storage.db import Database

    db = Database(pg_url, pool_size=1)
    try:
        async with db.transaction() as session:
            runtime = (
                await session.execute(
                    text("SELECT spec->>'runtime' FROM memory_indexes WHERE state = 'active'")
                )
            ).scalar()
            if runtime not in RUNTIMES:
                await session.execute(text("DELETE FROM memory_items"))
    finally:
        await db.dispose()


class ServerProcess:
    """`chatmem serve` in a subprocess against the test database."""

    def __init__(self, pg_url: str, *, args: Sequence[str] = (), **env: Any) -> None:
        self.port = free_port()
        self.args = list(args)  # more `chatmem serve` options, e.g. --with-workers
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "DATABASE_URL": pg_url,
            "JWT_SECRET": TEST_SECRET,
            "LLM_PROVIDER": "demo",
            "CHECKPOINT_INTERVAL_MS": "100",
            "LOG_LEVEL": "WARNING",
            **{k.upper(): str(v) for k, v in env.items()},
        }
        self.proc: subprocess.Popen[bytes] | None = None

    async def start(self) -> None:
        await hand_index_to_the_real_encoder(self.env["DATABASE_URL"])
        self.proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "chat_api.cli", "serve"),
                *("--host", "127.0.0.1", "--port", str(self.port), *self.args),
            ],
            env=self.env,
            stdout=subprocess.DEVNULL,
            # Inherited: pytest captures it with the test's own output, so a failing test shows the
            # server's errors (a 500's traceback) beside its own. A pipe nobody read showed nothing,
            # and a server that logged more than the pipe holds would block on its next line.
            stderr=None,
        )
        try:
            await wait_until_ready(self.base_url, self.proc, 180)
        except BaseException:
            # Not ready in time (a loaded machine) or cancelled: a server left running would
            # outlive the test run.
            self.kill()
            raise

    def kill(self) -> None:
        """SIGKILL: no shutdown code runs, as in a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()

    def client(self, tenant: str = "t1", user: str = "u1") -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.base_url, headers=auth(tenant, user), timeout=30)


@asynccontextmanager
async def server_process(
    pg_url: str, *, args: Sequence[str] = (), **env: Any
) -> AsyncIterator[ServerProcess]:
    proc = ServerProcess(pg_url, args=args, **env)
    try:
        # Also when it does not start in time: a server left running outlives the test run.
        await proc.start()
        yield proc
    finally:
        proc.terminate()


@asynccontextmanager
async def server_processes(pg_url: str, count: int, **env: Any) -> AsyncIterator[list[ServerProcess]]:
    """`count` replicas on one database, started at once (each start is mostly waiting on imports)."""
    procs = [ServerProcess(pg_url, **env) for _ in range(count)]
    try:
        await asyncio.gather(*(proc.start() for proc in procs))
        yield procs
    finally:
        for proc in procs:
            proc.terminate()
