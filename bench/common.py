"""What the benchmarks share: a private database, server processes, percentiles, output."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from chat_api.auth import issue_token  # noqa: E402
from memory.storage.db import upgrade  # noqa: E402
from memory.storage.embedded import EmbeddedPostgres  # noqa: E402

SECRET = "bench-secret-0123456789-0123456789-abcdef"


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0–100), linear between closest ranks."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summary_ms(values_s: Sequence[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values_s]
    return {
        "n": len(ms),
        "p50_ms": round(percentile(ms, 50), 2),
        "p95_ms": round(percentile(ms, 95), 2),
        "p99_ms": round(percentile(ms, 99), 2),
        "mean_ms": round(statistics.fmean(ms), 2) if ms else float("nan"),
    }


def print_table(title: str, rows: list[dict[str, Any]], columns: list[str]) -> None:
    print(f"\n{title}")
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(str(row.get(c, "")).ljust(w) for c, w in zip(columns, widths, strict=True)))


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Write results; a relative path is taken from the repository root."""
    path = path if path.is_absolute() else ROOT / path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))
    print(f"\nwrote {path}")


@contextmanager
def database(url: str | None = None) -> Iterator[str]:
    """A migrated database: the given URL, or a private embedded Postgres deleted afterwards."""
    if url:
        upgrade(url)
        yield url
        return
    server = EmbeddedPostgres(Path(tempfile.mkdtemp(prefix="chatmem-bench-")), delete_on_stop=True)
    dsn = server.start()
    try:
        upgrade(dsn)  # a failed migration must not leave the private Postgres running
        yield dsn
    finally:
        server.stop()


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def wait_until_ready(
    url: str,
    proc: subprocess.Popen[bytes],
    timeout: float,
    *,
    exited: Callable[[], str] | None = None,
) -> None:
    """Wait until the chatmem server at `url` answers /readyz with 200.

    Raises when `proc` exits first (with `exited()`'s text, say its standard error, when given)
    and TimeoutError after `timeout` seconds; stopping the process is the caller's.
    """
    async with httpx.AsyncClient(base_url=url) as client:
        async with asyncio.timeout(timeout):
            while True:
                if proc.poll() is not None:
                    detail = f": {exited()}" if exited is not None else ""
                    raise RuntimeError(
                        f"the server exited with {proc.returncode} before it was ready{detail}"
                    )
                try:
                    if (await client.get("/readyz")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.1)


class Server:
    """`chatmem serve` in its own process, so the load generator does not share its event loop."""

    def __init__(
        self,
        database_url: str,
        *,
        with_workers: bool = False,
        prefix: Sequence[str] = (),
        args: Sequence[str] = (),
        **env: Any,
    ) -> None:
        self.with_workers = with_workers
        # Appended to `chatmem serve`, e.g. ["--workers", "2"].
        self.args = list(args)
        # Prepended to the server's command line, e.g. a profiler: ["py-spy", "record", ..., "--"].
        self.prefix = list(prefix)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "DATABASE_URL": database_url,
            "JWT_SECRET": SECRET,
            "LOG_LEVEL": "WARNING",
            "HF_HUB_OFFLINE": "1",
            # Benchmarks measure the system, not the per-user limits a deployment sets.
            "RATE_LIMIT_PER_MINUTE": "0",
            "MAX_STREAMS_PER_USER": "0",
            "MAX_RUNNING_REPLIES_PER_USER": "0",
            "IMPORT_TURNS_PER_HOUR": "0",
            **{k.upper(): str(v) for k, v in env.items()},
        }
        self.proc: subprocess.Popen[bytes] | None = None
        # A busy shared machine can take minutes to start a server (the model loads, the
        # encoder export is made once); BENCH_SERVER_START_SECONDS raises the limit.
        self.start_timeout = float(os.environ.get("BENCH_SERVER_START_SECONDS", "180"))

    async def __aenter__(self) -> Server:
        self.proc = subprocess.Popen(
            [*self.prefix, sys.executable, "-m", "chat_api.cli", "serve", "--port", str(self.port)]
            + (["--with-workers"] if self.with_workers else [])
            + self.args,
            env=self.env,
            cwd=ROOT,
        )
        try:
            await wait_until_ready(self.url, self.proc, self.start_timeout)
        except BaseException:
            # A server that never got ready must not outlive the benchmark (it would keep
            # running against a database the benchmark is about to delete).
            self._stop()
            raise
        return self

    def _stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    @property
    def pid(self) -> int:
        """The server's own process id (below the prefix's process, if there is one)."""
        assert self.proc is not None
        if not self.prefix:
            return self.proc.pid
        import psutil

        for child in psutil.Process(self.proc.pid).children(recursive=True):
            if "chat_api.cli" in child.cmdline():
                return child.pid
        raise RuntimeError("the server process was not found under its prefix")

    async def __aexit__(self, *exc: object) -> None:
        if self.proc is not None:
            # The server itself, so that a profiler prefix sees it exit and writes its output.
            os.kill(self.pid, signal.SIGTERM)
            self.proc.wait(60)


@asynccontextmanager
async def started_together(*servers: Server) -> AsyncIterator[tuple[Server, ...]]:
    """Start every server at once (a start is mostly imports and loading the model), stop them all after."""
    starts = await asyncio.gather(*(server.__aenter__() for server in servers), return_exceptions=True)
    try:
        for outcome in starts:
            if isinstance(outcome, BaseException):
                raise outcome
        yield servers
    finally:
        # A server that failed to start has stopped itself already.
        for server, outcome in zip(servers, starts, strict=True):
            if not isinstance(outcome, BaseException):
                await server.__aexit__(None, None, None)


def headers(tenant: str = "bench", user: str = "u") -> dict[str, str]:
    return {"Authorization": f"Bearer {issue_token(SECRET, tenant, user)}"}


# llama-server's default sampling fields recorded with a run (temperature 0 is greedy: the same
# prompt gives the same reply whatever the seed). Not its `n_predict`: that reads -1 on a server
# started with `--n-predict 200`, whose replies are still capped at 200.
SAMPLING = ("temperature", "seed", "top_k", "top_p", "min_p")


class ModelServer:
    """The model server's own counters (llama-server's `/metrics`, `/slots`), when it has them."""

    def __init__(self, base_url: str, api_key: str | None) -> None:
        self.root = base_url.rstrip("/").removesuffix("/v1")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def prompt_tokens(self) -> float | None:
        async with httpx.AsyncClient(timeout=10, headers=self.headers) as client:
            try:
                text = (await client.get(f"{self.root}/metrics")).text
            except httpx.HTTPError:
                return None
        found = re.search(r"^llamacpp:prompt_tokens_total (\S+)$", text, re.MULTILINE)
        return float(found.group(1)) if found else None

    async def sampling(self) -> dict[str, Any] | None:
        """How the server samples a request that does not say (llama-server's `/props`).

        `default_generation_settings.params` on current llama-server (older ones put the fields
        one level up); None when the server does not answer `/props`, say a hosted API.
        """
        async with httpx.AsyncClient(timeout=10, headers=self.headers) as client:
            try:
                answer = await client.get(f"{self.root}/props")
                props = answer.json() if answer.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                return None
        if not isinstance(props, dict) or not isinstance(props.get("default_generation_settings"), dict):
            return None
        defaults = props["default_generation_settings"]
        params = defaults.get("params", defaults)
        return {key: params[key] for key in SAMPLING if key in params}

    async def wait_idle(self, within: float = 300) -> None:
        """Until no slot is busy (a reply's last request may still be ending); no-op elsewhere."""
        async with httpx.AsyncClient(timeout=10, headers=self.headers) as client:
            async with asyncio.timeout(within):
                while True:
                    try:
                        answer = await client.get(f"{self.root}/slots")
                        slots = answer.json() if answer.status_code == 200 else []
                    except (httpx.HTTPError, ValueError):
                        return
                    if not any(isinstance(s, dict) and s.get("is_processing") for s in slots):
                        return
                    await asyncio.sleep(0.1)


@contextmanager
def local_model(
    max_tokens: int, directory: Path | None = None, port: int | None = None
) -> Iterator[dict[str, str]]:
    """The settings `chatmem local-model` prints for the local model on its install.

    A server already running there is used as it is (its reply cap included); otherwise one is
    started (installed only if missing) and stopped afterwards. Nothing is written into the
    checkout: the install lives in DATA_DIR (or `directory`).
    """
    where = ["--dir", str(directory)] if directory else []

    def command(*args: str) -> list[str]:
        return [sys.executable, "-m", "chat_api.cli", "local-model", *args, *where]

    status = subprocess.run(
        command("status"), cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    if status.returncode == 0:
        print("local model: using the server already running (its own reply cap)", file=sys.stderr)
        yield _assignments(status.stdout)
        return
    start = command("start", "--max-tokens", str(max_tokens), "--temperature", "0", "--wait", "300")
    start += ["--port", str(port)] if port else ["--port", str(free_port())]
    done = subprocess.run(start, cwd=ROOT, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise SystemExit(f"chatmem local-model start failed: {done.stderr.strip()[-500:]}")
    try:
        yield _assignments(done.stdout)
    finally:
        subprocess.run(command("stop"), cwd=ROOT, capture_output=True, timeout=60, check=False)


def _assignments(output: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in output.splitlines() if "=" in line)
