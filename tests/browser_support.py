"""A real `chatmem up` in a subprocess, and Debian's headless Chromium, for the browser tests."""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = Path("/usr/bin/chromium")
INSTALL_SCRIPT = ROOT / "scripts" / "install-browser.sh"
ARTIFACTS = ROOT / "test-artifacts" / "browser"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-quic",
    "--no-first-run",
    "--disable-component-update",
    "--disable-sync",
]


def _has_playwright() -> bool:
    importlib.invalidate_caches()  # it may have been installed by this very process
    return importlib.util.find_spec("playwright") is not None


def browser_missing() -> str | None:
    """Why the browser tests cannot run here (after trying the install script), or None."""
    if not (CHROMIUM.exists() and _has_playwright()):
        subprocess.run(["bash", str(INSTALL_SCRIPT)], cwd=ROOT, check=False, timeout=900)
    if not CHROMIUM.exists():
        return "Debian's chromium is not installed and scripts/install-browser.sh could not install it"
    if not _has_playwright():
        return "the playwright package is not installed and could not be installed"
    return None


class ChatmemUp:
    """`chatmem up` on a free port with its own data directory; stopped with Ctrl-C (SIGINT)."""

    def __init__(self, **env: Any) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.data_dir = Path(tempfile.mkdtemp(prefix="chatmem-browser-"))
        self.log_path = self.data_dir / "server.log"
        self.env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "LOG_LEVEL": "WARNING",
            **{k.upper(): str(v) for k, v in env.items()},
        }
        for name in ("DATABASE_URL", "JWT_SECRET", "LLM_PROVIDER", "KAFKA_BOOTSTRAP_SERVERS"):
            self.env.pop(name, None)
        self.proc: subprocess.Popen[bytes] | None = None
        self.token = ""

    def start(self, timeout: float = 120.0) -> None:
        # `python -m chat_api.cli` is the `chatmem` console script, without needing it on PATH.
        command = [sys.executable, "-m", "chat_api.cli", "up"]
        command += ["--host", "127.0.0.1", "--port", str(self.port), "--data-dir", str(self.data_dir)]
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                command, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + timeout
        with httpx.Client(base_url=self.base_url, timeout=5) as client:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"chatmem up exited early:\n{self.log()[-3000:]}")
                try:
                    if client.get("/readyz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"chatmem up not ready in {timeout}s:\n{self.log()[-3000:]}")
                time.sleep(0.2)
            self.token = client.get("/ui/config").json()["token"]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        """Ctrl-C, as a person would: the embedded Postgres is stopped by the process itself."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def client(self) -> httpx.Client:
        """The API as the page's user (the embedded installation's token)."""
        return httpx.Client(
            base_url=self.base_url, headers={"Authorization": f"Bearer {self.token}"}, timeout=30
        )
