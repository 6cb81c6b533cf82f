"""`chatmem serve --workers 2`: two API processes on one port behave as one server.

A keep-alive connection stays with the worker that accepted it, so the test holds one
connection per worker (told apart by the opaque `worker` name /readyz returns) and sends
the stop, and the resume, over the connection of the worker that does not run the reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.common import wait_until_ready
from memory.events import EventName
from tests.conftest import TEST_SECRET, auth, free_port
from tests.procs import hand_index_to_the_real_encoder
from tests.sse import SSEEvent, collect, iter_sse
from tests.support import conversation_locked, new_conversation
from tests.test_stop import read_until, text_of
from tests.test_stop_window import run_input, stored_replies

pytestmark = pytest.mark.slow


@contextlib.asynccontextmanager
async def two_workers(pg_url: str) -> AsyncIterator[str]:
    await hand_index_to_the_real_encoder(pg_url)
    port = free_port()
    env = {
        **os.environ,
        "DATABASE_URL": pg_url,
        "JWT_SECRET": TEST_SECRET,
        "LLM_PROVIDER": "demo",
        "DEMO_TOKENS_PER_SECOND": "30",
        "CHECKPOINT_INTERVAL_MS": "100",
        "LOG_LEVEL": "WARNING",
    }
    command = [sys.executable, "-m", "chat_api.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen([*command, "--workers", "2"], env=env, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_until_ready(url, proc, 300)
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


async def one_client_per_worker(url: str) -> list[httpx.AsyncClient]:
    """Two clients of one connection each, held by different workers."""
    by_worker: dict[str, httpx.AsyncClient] = {}
    spare: list[httpx.AsyncClient] = []
    for _ in range(60):
        client = httpx.AsyncClient(
            base_url=url, headers=auth(), timeout=30, limits=httpx.Limits(max_connections=1)
        )
        # Both workers must be ready (the first to answer /readyz may be alone for a while).
        worker = (await client.get("/readyz")).json()["worker"]
        # Keep the held connections busy: uvicorn closes one idle for 5 s, and its next would
        # land on either worker.
        for held in by_worker.values():
            await held.get("/healthz")
        if worker in by_worker:
            spare.append(client)
        else:
            by_worker[worker] = client
        if len(by_worker) == 2:
            break
        await asyncio.sleep(0.05)
    for client in spare:
        await client.aclose()
    assert len(by_worker) == 2, "every connection landed on one worker"
    for worker, client in by_worker.items():  # still the same worker on the kept connection
        assert (await client.get("/readyz")).json()["worker"] == worker
    return list(by_worker.values())


async def test_stop_and_resume_sent_to_the_other_worker_of_one_port(pg_url: str) -> None:
    async with two_workers(pg_url) as url:
        a, b = await one_client_per_worker(url)
        try:
            worker_a = (await a.get("/readyz")).json()["worker"]
            # Stop: the reply runs on worker A, the stop arrives at worker B.
            cid = await new_conversation(a)
            events: list[SSEEvent] = []
            async with a.stream("POST", f"/v1/conversations/{cid}/messages", json={"content": "/long"}) as r:
                stream = iter_sse(r)
                await read_until(stream, lambda e: e.event == EventName.MESSAGE_DELTA, events)
                stop = await b.post(f"/v1/turns/{events[0].data['reply_id']}/stop")
                events += [e async for e in stream]
            assert stop.status_code == 200 and stop.json()["status"] == "interrupted_by_user"
            assert events[-1].event == EventName.TURN_INTERRUPTED
            assert (await b.get("/readyz")).json()["worker"] != worker_a  # the stop went to B
            stored = (await b.get(f"/v1/turns/{events[0].data['reply_id']}")).json()
            assert stored["content"] == text_of(events)
            assert (await a.get("/readyz")).json()["worker"] == worker_a  # the stream was A's

            # Resume: the reply starts on worker A, the client comes back on worker B.
            cid = await new_conversation(a)
            seen: list[SSEEvent] = []
            async with a.stream("POST", f"/v1/conversations/{cid}/messages", json={"content": "/long"}) as r:
                await read_until(iter_sse(r), lambda e: e.id == 10, seen)
            reply_id = seen[0].data["reply_id"]
            assert (await b.get("/readyz")).json()["worker"] != worker_a  # the resume goes to B
            headers = {"Last-Event-ID": "10"}
            async with b.stream("GET", f"/v1/turns/{reply_id}/events", headers=headers) as r:
                assert r.status_code == 200
                resumed = await collect(r)
            ids = [e.id for e in seen + resumed]
            assert ids == list(range(1, len(ids) + 1))  # no gap, no duplicate
            assert resumed[-1].event == EventName.TURN_COMPLETED
            stored = (await a.get(f"/v1/turns/{reply_id}")).json()
            assert stored["content"] == text_of(seen + resumed)
        finally:
            await a.aclose()
            await b.aclose()


async def test_up_with_two_workers_serves_indexes_and_stops_everything(tmp_path: Path) -> None:
    """`chatmem up --workers 2`: both workers answer on one port, the indexer process indexes,
    Ctrl-C stops the workers, the indexer and the embedded Postgres."""
    port = free_port()
    data_dir = tmp_path / "data"
    env = {**os.environ, "HOME": str(tmp_path)}
    for key in ("DATABASE_URL", "JWT_SECRET", "LLM_PROVIDER"):
        env.pop(key, None)
    command = [sys.executable, "-m", "chat_api.cli", "up", "--port", str(port), "--data-dir", str(data_dir)]
    proc = subprocess.Popen(
        [*command, "--workers", "2"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: list[str] = []
    try:
        async with asyncio.timeout(300):
            while not any("Ctrl-C" in line for line in lines):
                line = await asyncio.to_thread(proc.stdout.readline)  # type: ignore[union-attr]
                assert line, "chatmem up exited early:\n" + "".join(lines)
                lines.append(line)
        token = re.search(r"^(eyJ[\w-]+\.[\w-]+\.[\w-]+)$", "".join(lines), re.MULTILINE)
        assert token
        url = f"http://127.0.0.1:{port}"
        workers: set[str] = set()
        async with asyncio.timeout(120):
            while len(workers) < 2:  # a new connection each time: the kernel spreads them
                async with httpx.AsyncClient(base_url=url) as probe:
                    answer = await probe.get("/readyz")
                    if answer.status_code == 200:
                        workers.add(answer.json()["worker"])
                await asyncio.sleep(0.1)
        headers = {"Authorization": f"Bearer {token.group(1)}"}
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as client:
            cid = await new_conversation(client)
            reply = await client.post(
                f"/v1/conversations/{cid}/messages",
                json={"content": "My flight leaves on May 3rd", "stream": False},
            )
            assert reply.json()["status"] == "completed"
            async with asyncio.timeout(120):  # indexed by the indexer process, not by a worker
                while (await client.get(f"/v1/conversations/{cid}")).json()["indexed_seq"] < 2:
                    await asyncio.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGINT)
        output = await asyncio.to_thread(proc.communicate, timeout=120)
    assert proc.returncode == 0, output[0][-2000:]
    assert not (data_dir / "pg" / "postmaster.pid").exists()  # the embedded Postgres stopped too


def _scraped(text: str, name: str, **labels: str) -> list[float]:
    """The values of the samples of `name` with `labels` in a scrape (read by prometheus_client)."""
    from prometheus_client.parser import text_string_to_metric_families

    return [
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    ]


async def test_metrics_of_either_worker_count_the_requests_of_both(pg_url: str) -> None:
    """A scrape reaches one worker; it reported that worker's requests only, so every figure of
    a `--workers 2` server was about half of the truth, and which half depended on the scrape."""
    async with two_workers(pg_url) as url:
        a, b = await one_client_per_worker(url)
        try:
            for client, times in ((a, 3), (b, 2)):
                for _ in range(times):
                    assert (await client.get("/v1/conversations")).status_code == 200
            listed = {"route": "/v1/conversations", "status": "200"}
            for client in (a, b):
                scrape = (await client.get("/metrics")).text
                assert _scraped(scrape, "chatmem_http_requests_total", **listed) == [5.0]
                # The database's state is reported once, not once per worker.
                assert len(_scraped(scrape, "chatmem_outbox_backlog")) == 1
                assert _scraped(scrape, "chatmem_encoder_info", runtime="openvino") == [1.0]
        finally:
            await a.aclose()
            await b.aclose()


async def test_a_stop_sent_to_the_other_worker_while_a_run_was_being_started_was_lost(
    pg_url: str, db: Any
) -> None:
    """Found: an AG-UI stop naming a run whose turns were not stored yet answered 404 (on the
    other worker the enqueue line's places do not help), and the run streamed to its end.
    Both orders at the conversation's lock: the stop first (kept in the database, the run on
    the other worker starts stopped) and the run first (the stop waits, then stops it there)."""
    async with two_workers(pg_url) as url:
        a, b = await one_client_per_worker(url)
        try:
            for stop_first in (True, False):
                thread_id = await new_conversation(a)
                body = run_input(thread_id, "/long story")
                async with conversation_locked(db, thread_id) as waiting:
                    stop_body = {"runId": body["runId"]}
                    if stop_first:
                        stop = asyncio.create_task(b.post(f"/v1/ag-ui/{thread_id}/stop", json=stop_body))
                        await waiting(1)
                        run = asyncio.create_task(a.post("/v1/ag-ui", json=body))
                    else:
                        run = asyncio.create_task(a.post("/v1/ag-ui", json=body))
                        await waiting(1)
                        stop = asyncio.create_task(b.post(f"/v1/ag-ui/{thread_id}/stop", json=stop_body))
                    await waiting(2)
                stopped = await stop
                expected = (202, {"success": False}) if stop_first else (200, {"success": True})
                assert (stopped.status_code, stopped.json()) == expected, stopped.text
                answered = await run
                assert answered.status_code == 200, answered.text
                events = [item.data async for item in iter_sse(answered)]
                assert events[-1]["type"] == "RUN_FINISHED", events[-1]
                assert events[-1]["outcome"] == {"type": "cancelled"}, events[-1]
                replies = await stored_replies(b, thread_id)
                assert [status for status, _ in replies] == ["interrupted_by_user"], (stop_first, replies)
        finally:
            await a.aclose()
            await b.aclose()
