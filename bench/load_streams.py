"""N concurrent SSE streams on one API process: memory, CPU, and how late tokens arrive.

    .venv/bin/python bench/load_streams.py --streams 100 500 1000

One `chatmem serve` subprocess (demo model at 20 tokens/s, `/long` replies of ~230
tokens, persistence on: checkpoints, events and outbox rows are written as in
production). Every stream belongs to its own user and conversation, as real traffic
would. The load generator runs in separate processes (raw asyncio sockets, no HTTP
library) so that reading 20,000 events a second does not compete with the server's
event loop; each process holds a share of the streams.

Delivery lag. The events carry no server timestamp, so lag is estimated per stream
against the demo model's schedule: token i should arrive at `first + i / rate`, and
`lag_i = arrival_i − (first_arrival + i / rate)`. That is how far behind its ideal
schedule the client is at each token. It counts every delay after the first token —
the server's event loop falling behind (in generation or in delivery), checkpoint
pauses, socket buffering, the load generator's own scheduling — but not the time to
the first token. The demo model sleeps a fixed interval *between* tokens, so a few
milliseconds of drift per hundred tokens are the model's, even on an idle server; the
N=1 baseline row shows that floor. `window_lag` measures against the best schedule of
the last second (`min over j in [i−20, i) of arrival_j + (i−j) / rate`), so slow drift
of the model's pace drops out and stalls remain. `gap` is the other view: each inter-arrival time
minus the interval, i.e. the extra wait on a single token.

Memory is the server's resident set (psutil) before the streams open and at its peak
while they are open; CPU is the server process's CPU time over the wall time of the run
(100 % = one full core). Results go to bench/results/load_streams.json.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing
import resource
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))


from common import ROOT, Server, database, headers, percentile, print_table, write_json

RATE = 20.0
PROMPT = "Tell me about the weather this week /long"
DELTA = b"event: message.delta"
TERMINAL = (b"event: turn.completed", b"event: turn.interrupted", b"event: turn.failed")
STREAMS_PER_CLIENT_PROCESS = 400


def raise_open_files_limit(needed: int) -> int:
    """Lift the soft RLIMIT_NOFILE towards the hard one; returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, max(soft, needed))
    if want > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


# --- the load generator (runs in child processes) ----------------------------------


async def _one_stream(
    port: int, conversation_id: str, token: str, delay: float, start: asyncio.Event
) -> dict[str, Any]:
    body = json.dumps({"content": PROMPT, "stream": True}).encode()
    request = (
        f"POST /v1/conversations/{conversation_id}/messages HTTP/1.1\r\n"
        f"Host: 127.0.0.1:{port}\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body
    await start.wait()
    await asyncio.sleep(delay)
    arrivals: list[float] = []
    sent = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
    status = 0
    ended = False
    tail = b""
    try:
        writer.write(request)
        await writer.drain()
        while True:
            data = await reader.read(65536)
            if not data:
                break
            now = time.monotonic()
            if not status:
                status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else -1
            # Events are matched on a window spanning reads, so one split across two reads still counts.
            window = tail + data
            arrivals.extend([now] * window.count(DELTA))
            tail = window[-(len(DELTA) - 1) :]
            if any(t in window for t in TERMINAL):
                ended = True
                break
    finally:
        writer.close()
    return {"status": status, "ended": ended, "sent": sent, "arrivals": arrivals}


async def _client_main(
    port: int, work: list[tuple[str, str, float]], ready: Any, go: Any
) -> list[dict[str, Any]]:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    start = asyncio.Event()
    tasks = [asyncio.create_task(_one_stream(port, conv, token, delay, start)) for conv, token, delay in work]
    ready.set()
    await asyncio.to_thread(go.wait)
    start.set()
    return await asyncio.gather(*tasks)


def client_process(port: int, work: list[tuple[str, str, float]], ready: Any, go: Any, out: Any) -> None:
    """Entry point of one load-generator process: run its streams, send back arrival times."""
    raise_open_files_limit(len(work) + 100)
    out.put(asyncio.run(_client_main(port, work, ready, go)))


# --- measuring -----------------------------------------------------------------------


def stream_lags(arrivals: list[float]) -> tuple[list[float], list[float], list[float]]:
    """Per token after the first, in seconds: schedule lag, windowed lag, extra wait of its gap."""
    if len(arrivals) < 2:
        return [], [], []
    first = arrivals[0]
    interval = 1.0 / RATE
    lags = [max(0.0, t - (first + i * interval)) for i, t in enumerate(arrivals) if i]
    # Against the best schedule seen in the last second: slow drift of the model's pace drops out,
    # stalls and bursts of lateness stay.
    window = int(RATE)
    windowed = [
        max(0.0, t - min(arrivals[j] + (i - j) * interval for j in range(max(0, i - window), i)))
        for i, t in enumerate(arrivals)
        if i
    ]
    gaps = [max(0.0, b - a - interval) for a, b in itertools.pairwise(arrivals)]
    return lags, windowed, gaps


async def create_conversations(url: str, n: int, run: int) -> list[tuple[str, str]]:
    """One conversation per stream, each of its own user; returns (conversation id, token) pairs."""
    work: list[tuple[str, str]] = []
    limit = asyncio.Semaphore(32)
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:

        async def make(i: int) -> tuple[str, str]:
            auth = headers(tenant="load", user=f"r{run}-u{i}")
            async with limit:
                response = await client.post("/v1/conversations", json={"title": f"load {i}"}, headers=auth)
            response.raise_for_status()
            return response.json()["id"], auth["Authorization"].removeprefix("Bearer ")

        work = list(await asyncio.gather(*(make(i) for i in range(n))))
    return work


async def measure(server: Server, n: int, run: int, ramp_per_100: float) -> dict[str, Any]:
    assert server.proc is not None
    proc = psutil.Process(server.proc.pid)
    # Streams open spread over a ramp (as users arrive), not in one instant: a burst of N
    # simultaneous first messages measures the burst, not N concurrent streams.
    ramp = ramp_per_100 * n / 100
    conversations = await create_conversations(server.url, n, run)
    work = [(conv, token, i * ramp / n) for i, (conv, token) in enumerate(conversations)]
    await asyncio.sleep(1.0)  # let the creation burst's garbage settle before the baseline
    rss_before = proc.memory_info().rss
    ctx = multiprocessing.get_context("spawn")
    shares = max(1, -(-n // STREAMS_PER_CLIENT_PROCESS))
    ready = [ctx.Event() for _ in range(shares)]
    go = ctx.Event()
    out = ctx.Queue()
    children = [
        ctx.Process(target=client_process, args=(server.port, work[i::shares], ready[i], go, out))
        for i in range(shares)
    ]
    for child in children:
        child.start()
    for event in ready:
        await asyncio.to_thread(event.wait, 60)
    cpu_before = sum(proc.cpu_times()[:2])
    started = time.monotonic()
    go.set()
    peak = rss_before
    results: list[dict[str, Any]] = []
    while len(results) < n:
        try:
            batch = await asyncio.to_thread(out.get, True, 0.5)
            results.extend(batch)
        except Exception:  # queue.Empty: sample the server while the streams run
            pass
        peak = max(peak, proc.memory_info().rss)
        if time.monotonic() - started > 600:
            raise TimeoutError("streams did not finish in 10 minutes")
    wall = time.monotonic() - started
    cpu = sum(proc.cpu_times()[:2]) - cpu_before
    for child in children:
        child.join(30)
    lags: list[float] = []
    windowed: list[float] = []
    gaps: list[float] = []
    ttft: list[float] = []
    for result in results:
        stream_lag, stream_windowed, stream_gap = stream_lags(result["arrivals"])
        lags += stream_lag
        windowed += stream_windowed
        gaps += stream_gap
        if result["arrivals"]:
            ttft.append(result["arrivals"][0] - result["sent"])
    ok = sum(1 for r in results if r["status"] == 200 and r["ended"])
    return {
        "streams": n,
        "ramp_s": round(ramp, 1),
        "completed": ok,
        "tokens": sum(len(r["arrivals"]) for r in results),
        "wall_s": round(wall, 1),
        "rss_before_mb": round(rss_before / 2**20, 1),
        "rss_peak_mb": round(peak / 2**20, 1),
        "rss_added_mb": round((peak - rss_before) / 2**20, 1),
        "cpu_pct": round(100 * cpu / wall, 1),
        "lag_p50_ms": round(percentile(lags, 50) * 1000, 1),
        "lag_p99_ms": round(percentile(lags, 99) * 1000, 1),
        "lag_max_ms": round(max(lags, default=float("nan")) * 1000, 1),
        "window_lag_p50_ms": round(percentile(windowed, 50) * 1000, 1),
        "window_lag_p99_ms": round(percentile(windowed, 99) * 1000, 1),
        "gap_p99_ms": round(percentile(gaps, 99) * 1000, 1),
        "ttft_p50_ms": round(percentile(ttft, 50) * 1000, 1),
        "ttft_p99_ms": round(percentile(ttft, 99) * 1000, 1),
    }


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, nargs="+", default=[100, 500, 1000])
    parser.add_argument("--database-url", help="an external Postgres with pgvector (default: embedded)")
    parser.add_argument("--baseline", action="store_true", help="also run N=1 first (the demo model's floor)")
    parser.add_argument(
        "--ramp-per-100",
        type=float,
        default=1.0,
        help="seconds over which each 100 streams open (0: all at once)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "load_streams.json")
    args = parser.parse_args()
    limit = raise_open_files_limit(max(args.streams) * 2 + 200)
    print(f"open files limit (soft): {limit}")
    counts = ([1] if args.baseline else []) + list(args.streams)
    rows: list[dict[str, Any]] = []
    with database(args.database_url) as url:
        env = {"demo_tokens_per_second": RATE, "rate_limit_per_minute": 0, "max_streams_per_user": 0}
        async with Server(url, **env) as server:
            for run, n in enumerate(counts):
                row = await measure(server, n, run, args.ramp_per_100)
                rows.append(row)
                print(json.dumps(row), flush=True)
    columns = [
        "streams",
        "completed",
        "rss_before_mb",
        "rss_added_mb",
        "cpu_pct",
        "lag_p50_ms",
        "lag_p99_ms",
        "window_lag_p99_ms",
        "gap_p99_ms",
        "ttft_p50_ms",
        "ttft_p99_ms",
    ]
    print_table(f"{RATE:g} tokens/s per stream, one API process, persistence on", rows, columns)
    write_json(
        args.out,
        {
            "rate_tokens_per_second": RATE,
            "cpus": psutil.cpu_count(),
            "open_files_limit": limit,
            "targets_at_1000": {"lag_p99_ms": 250, "rss_added_mb": 300},
            "runs": rows,
        },
    )


if __name__ == "__main__":
    asyncio.run(main())
