"""A real llama-server with a real small model, started once per test session by the project's
own command (`chatmem local-model start`), for the tests marked `real_model`.

The server gets one thread (the machines have 2 cores, shared), a temperature of 0 (fewer
surprises, though the tests never assert wording) and a 64-token cap per reply, so every
generation is bounded. Its private directory is `DATA_DIR/local-model-tests`, kept between
runs, so the packages are installed once per machine. When they cannot be installed (no
PyPI, a CPU the prebuilt server cannot run on) the tests skip and say why; any other
failure of the command fails them.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from chat_api.cli.local_model import default_dir
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parent.parent
MAX_TOKENS = 64
# Reasons the command gives when the packages (or this CPU) are not there: a skip, not a failure.
UNAVAILABLE = re.compile(r"could not install|could not run pip|this CPU lacks|is for Linux x86_64")


@dataclass
class RealModel:
    """The running llama-server: its OpenAI base URL, model name and its own monitoring endpoints."""

    base_url: str
    model: str
    api_key: str
    home: Path

    @property
    def root(self) -> str:
        return self.base_url.removesuffix("/v1")

    @property
    def headers(self) -> dict[str, str]:
        """The server answers only requests with its key (`chatmem local-model` made it)."""
        return {"Authorization": f"Bearer {self.api_key}"}

    def settings(self, **overrides: Any) -> dict[str, Any]:
        """start_server overrides that point chatmem at this model."""
        return {
            "llm_provider": "openai",
            "llm_base_url": self.base_url,
            "llm_model": self.model,
            "llm_api_key": self.api_key,
            "rewrite_model": self.model,
            "llm_timeout_seconds": 120.0,
            **overrides,
        }

    async def slot(self) -> dict[str, Any]:
        """The server's view of its one slot (`/slots`)."""
        async with httpx.AsyncClient(timeout=10, headers=self.headers) as client:
            slots = (await client.get(f"{self.root}/slots")).json()
        return dict(slots[0])

    async def wait_idle(self, within: float) -> dict[str, Any]:
        """The slot once it stopped processing; fails if it is still generating after `within` s."""
        async with asyncio.timeout(within):
            while True:
                slot = await self.slot()
                if not slot["is_processing"]:
                    return slot
                await asyncio.sleep(0.1)

    async def prompt_tokens(self) -> float:
        """The server's own count of prompt tokens it processed (`llamacpp:prompt_tokens_total`)."""
        async with httpx.AsyncClient(timeout=10, headers=self.headers) as client:
            text = (await client.get(f"{self.root}/metrics")).text
        match = re.search(r"^llamacpp:prompt_tokens_total (\S+)$", text, re.MULTILINE)
        assert match, "llama-server's /metrics has no prompt_tokens_total"
        return float(match.group(1))

    async def count_tokens(self, text: str) -> int:
        """How many tokens the model's own tokenizer makes of `text` (`/tokenize`)."""
        async with httpx.AsyncClient(timeout=10, headers=self.headers) as client:
            answer = await client.post(f"{self.root}/tokenize", json={"content": text})
        return len(answer.json()["tokens"])

    async def tokens_predicted(self) -> float:
        """The server's own count of generated tokens (`llamacpp:tokens_predicted_total`)."""
        async with httpx.AsyncClient(timeout=10, headers=self.headers) as client:
            text = (await client.get(f"{self.root}/metrics")).text
        match = re.search(r"^llamacpp:tokens_predicted_total (\S+)$", text, re.MULTILINE)
        assert match, "llama-server's /metrics has no tokens_predicted_total"
        return float(match.group(1))


def _command(*args: str) -> list[str]:
    return [sys.executable, "-m", "chat_api.cli", "local-model", *args]


@pytest.fixture(scope="session")
def real_model() -> Iterator[RealModel]:
    """One llama-server for the session, started and stopped with `chatmem local-model`."""
    home = default_dir().with_name("local-model-tests")
    start = _command(
        "start", "--dir", str(home), "--port", str(free_port()), "--threads", "1",
        "--max-tokens", str(MAX_TOKENS), "--ctx-size", "4096", "--temperature", "0", "--wait", "300",
    )  # fmt: skip
    try:
        done = subprocess.run(start, cwd=ROOT, capture_output=True, text=True, timeout=1200, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail("chatmem local-model start took more than 20 minutes")
    if done.returncode != 0:
        if UNAVAILABLE.search(done.stderr):
            pytest.skip(f"no real model here: {done.stderr.strip().splitlines()[-1]}")
        pytest.fail(f"chatmem local-model start failed: {done.stderr.strip()[-2000:]}")
    assert "Traceback" not in done.stderr
    values = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    try:
        yield RealModel(values["LLM_BASE_URL"], values["LLM_MODEL"], values["LLM_API_KEY"], home)
    finally:
        subprocess.run(_command("stop", "--dir", str(home)), cwd=ROOT, timeout=60, check=False)
