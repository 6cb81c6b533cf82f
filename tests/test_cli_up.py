"""`chatmem up` as a user runs it: one process, embedded Postgres, real model, Ctrl-C or `kill`."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from tests.conftest import free_port


def up_env(tmp_path: Path) -> dict[str, str]:
    env = {**os.environ, "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    for key in ("DATABASE_URL", "JWT_SECRET", "LLM_PROVIDER"):
        env.pop(key, None)
    return env


async def start_up(port: int, data_dir: Path, env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    """`chatmem up` running, and what it printed up to its banner."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "chat_api.cli", "up", "--port", str(port), "--data-dir", str(data_dir)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    try:
        async with asyncio.timeout(120):
            while not any("Ctrl-C" in line for line in lines):
                line = await asyncio.to_thread(proc.stdout.readline)  # type: ignore[union-attr]
                assert line, "chatmem up exited early:\n" + "".join(lines)
                lines.append(line)
    except BaseException:
        proc.kill()
        raise
    return proc, "".join(lines)


async def stopped_by(proc: subprocess.Popen[str], signum: int) -> str:
    """What `up` printed after `signum`, once it exited."""
    proc.send_signal(signum)
    try:
        rest, _ = await asyncio.to_thread(proc.communicate, timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return rest


async def test_up_serves_indexes_and_shuts_down_cleanly(tmp_path: Path) -> None:
    port = free_port()
    data_dir = tmp_path / "data"
    env = up_env(tmp_path)
    proc, output = await start_up(port, data_dir, env)
    try:
        assert f"http://localhost:{port}" in output
        token = re.search(r"^(eyJ[\w-]+\.[\w-]+\.[\w-]+)$", output, re.MULTILINE)
        assert token, output
        headers = {"Authorization": f"Bearer {token.group(1)}"}
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=30
        ) as client:
            async with asyncio.timeout(60):
                while (await client.get("/readyz")).status_code != 200:
                    await asyncio.sleep(0.2)
            cid = (await client.post("/v1/conversations", json={"title": "trip"})).json()["id"]
            reply = await client.post(
                f"/v1/conversations/{cid}/messages",
                json={"content": "My flight to Lisbon leaves on May 3rd", "stream": False},
            )
            assert reply.json()["status"] == "completed"
            # The in-process indexer (real model) makes both turns searchable.
            async with asyncio.timeout(60):
                while (await client.get(f"/v1/conversations/{cid}")).json()["indexed_seq"] < 2:
                    await asyncio.sleep(0.2)
        # Found: `chatmem keys create` needed the embedded DATABASE_URL; like `chatmem token`, it
        # finds the installation by its data directory (attaching to the running Postgres).
        made = await asyncio.to_thread(
            subprocess.run,
            [
                sys.executable,
                "-m",
                "chat_api.cli",
                "keys",
                "create",
                "--data-dir",
                str(data_dir),
                "--name",
                "cli",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert made.returncode == 0, made.stderr
        key = made.stdout.split()[0]
        assert key.startswith("cmk_"), made.stdout
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {key}"}, timeout=30
        ) as keyed:
            assert (await keyed.get(f"/v1/conversations/{cid}")).status_code == 200
        assert (data_dir / "jwt_secret").exists()
        assert (data_dir / "pg" / "postmaster.pid").exists()
    finally:
        rest = await stopped_by(proc, signal.SIGINT)
    assert proc.returncode == 0, rest
    assert "chatmem: stopped." in rest
    assert not (data_dir / "pg" / "postmaster.pid").exists()  # the embedded Postgres stopped too


async def test_kill_stops_up_and_its_embedded_postgres_as_ctrl_c_does(tmp_path: Path) -> None:
    # Found: SIGTERM (`kill`, a service manager's stop) ended `up` once uvicorn had shut down,
    # before the embedded Postgres was stopped; it kept running, holding the data directory.
    data_dir = tmp_path / "data"
    proc, _ = await start_up(free_port(), data_dir, up_env(tmp_path))
    assert (data_dir / "pg" / "postmaster.pid").exists()
    rest = await stopped_by(proc, signal.SIGTERM)
    assert proc.returncode == 0, rest
    assert "chatmem: stopped." in rest
    assert not (data_dir / "pg" / "postmaster.pid").exists()
