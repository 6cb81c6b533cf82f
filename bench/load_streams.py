"""N concurrent SSE streams on one API process: memory, CPU, and how late tokens arrive.

    .venv/bin/python bench/load_streams.py --streams 100 500 1000

One `chatmem serve` subprocess (demo model at 20 tokens/s, `/long` replies of ~230
tokens, persistence on: checkpoints, events and outbox rows are written as in
production). Every stream belongs to its own user and conversation, as real traffic
would. The load generator runs in separate processes (raw asyncio sockets, no HTTP
library) so that reading 20,000 events a second does not compete with the server's
event loop; each process holds a share of the streams.

Delivery lag. The events carry no server timestamp, so lag is estimated per stream
against the demo model's schedule. The demo model keeps an absolute schedule (token i
is due at its first token's time + i / rate, on the server's clock), as a real model's
tokens keep arriving on its socket whatever the server does. So token i should arrive
at `anchor + i / rate`, where the anchor is the earliest schedule the arrivals allow,
`anchor = min over j of (arrival_j − j / rate)` (the stream's least delayed token sets
it), and `lag_i = arrival_i − (anchor + i / rate)` for every token, the first included.
It counts every delay of a token beyond the stream's best one — the server's event
loop falling behind (in generation or in delivery), checkpoint pauses, socket
buffering, the load generator's own scheduling — but not the time to the first token
(TTFT, reported apart). Two corrections to the earlier version of this bench, which
anchored at the first arrival and ran a demo model that slept a fixed interval
*between* tokens: there, every late wake-up of the model was added to every later
token of the reply (the accumulated lateness of the model's emulation, not delivery),
while a late *first* token made all later ones look early (clamped to 0). The N=1
baseline row shows the floor on an idle server. `window_lag` measures against the best
schedule of the last second (`min over j in [i−20, i) of arrival_j + (i−j) / rate`), so
slow drift drops out and stalls remain. `gap` is the other view: each inter-arrival
time minus the interval, i.e. the extra wait on a single token.

Memory is the server's resident set (psutil) before the streams open and at its peak
while they are open; CPU is the server process's CPU time over the wall time of the run
(100 % = one full core), `loop_cpu_pct` the same for its main thread alone (the event
loop: near 100 % means it is saturated, whatever the other cores do). `load_1m` is the
machine's one-minute load average at the end of the run: other work on the same cores
(tests, other benchmarks) shows there, and `machine_cpu_pct` is every process's CPU
over the run (200 % = both cores of this machine: server, Postgres, load generator),
`postgres_cpu_pct` and `client_cpu_pct` the shares of the embedded Postgres and of the
load generator. Backends that exit during the run take their CPU time with them, so
`postgres_cpu_pct` is a lower bound.
Results go to bench/results/load_streams.json.

    --profile FILE records the server with py-spy (collapsed stacks) while it runs.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import multiprocessing
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

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
    headers_at = 0.0
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
                headers_at = now
            # Events are matched on a window spanning reads, so one split across two reads still counts.
            window = tail + data
            arrivals.extend([now] * window.count(DELTA))
            tail = window[-(len(DELTA) - 1) :]
            if any(t in window for t in TERMINAL):
                ended = True
                break
    finally:
        writer.close()
    return {"status": status, "ended": ended, "sent": sent, "headers_at": headers_at, "arrivals": arrivals}


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
    results = asyncio.run(_client_main(port, work, ready, go))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out.put((results, usage.ru_utime + usage.ru_stime))


# --- measuring -----------------------------------------------------------------------


def stream_lags(arrivals: list[float]) -> tuple[list[float], list[float], list[float]]:
    """Per token, in seconds: schedule lag (all), windowed lag and extra wait of its gap (after the first)."""
    if len(arrivals) < 2:
        return [], [], []
    interval = 1.0 / RATE
    # The earliest schedule the arrivals allow: no token can arrive before it is generated.
    anchor = min(t - i * interval for i, t in enumerate(arrivals))
    lags = [t - (anchor + i * interval) for i, t in enumerate(arrivals)]
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


def postgres_processes(database_url: str) -> list[psutil.Process]:
    """The server's Postgres (postmaster and backends), found by its socket directory in the URL."""
    socket_dir = parse_qs(urlsplit(database_url).query).get("host", [""])[0]
    if not socket_dir:
        return []  # an external Postgres: not ours to measure
    found: list[psutil.Process] = []
    for candidate in psutil.process_iter(["name", "cmdline"]):
        cmdline = candidate.info["cmdline"] or []
        if candidate.info["name"] == "postgres" and socket_dir in cmdline:
            found = [candidate, *candidate.children(recursive=True)]
    return found


def _cpu_of(processes: list[psutil.Process]) -> float:
    """CPU seconds of the processes (and of backends started since), skipping those gone."""
    total = 0.0
    for process in {p.pid: p for p in processes + [c for p in processes[:1] for c in _children(p)]}.values():
        try:
            total += sum(process.cpu_times()[:2])
        except psutil.Error:
            pass
    return total


def _children(process: psutil.Process) -> list[psutil.Process]:
    try:
        return process.children(recursive=True)
    except psutil.Error:
        return []


def _main_thread_cpu(proc: psutil.Process) -> float:
    """CPU seconds of the process's main thread (where uvicorn runs the event loop)."""
    return next((t.user_time + t.system_time for t in proc.threads() if t.id == proc.pid), 0.0)


async def measure(server: Server, n: int, run: int, ramp_per_100: float) -> dict[str, Any]:
    proc = psutil.Process(server.pid)
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
    machine_before = psutil.cpu_times()
    cpu_before = sum(proc.cpu_times()[:2])
    loop_before = _main_thread_cpu(proc)
    started = time.monotonic()
    go.set()
    peak = rss_before
    results: list[dict[str, Any]] = []
    client_cpu = 0.0
    db_procs = postgres_processes(server.env["DATABASE_URL"])
    db_before = _cpu_of(db_procs)
    while len(results) < n:
        try:
            batch, batch_cpu = await asyncio.to_thread(out.get, True, 0.5)
            results.extend(batch)
            client_cpu += batch_cpu
        except Exception:  # queue.Empty: sample the server while the streams run
            pass
        peak = max(peak, proc.memory_info().rss)
        if time.monotonic() - started > 600:
            raise TimeoutError("streams did not finish in 10 minutes")
    wall = time.monotonic() - started
    cpu = sum(proc.cpu_times()[:2]) - cpu_before
    loop_cpu = _main_thread_cpu(proc) - loop_before
    db_cpu = _cpu_of(db_procs) - db_before
    machine = psutil.cpu_times()
    fields = ("user", "system", "nice", "irq", "softirq")
    busy = sum(getattr(machine, f) - getattr(machine_before, f) for f in fields)
    for child in children:
        child.join(30)
    lags: list[float] = []
    windowed: list[float] = []
    gaps: list[float] = []
    ttft: list[float] = []
    # Time to the response headers: the message accepted and stored, the reply launched.
    accepted = [r["headers_at"] - r["sent"] for r in results if r["headers_at"]]
    for result in results:
        stream_lag, stream_windowed, stream_gap = stream_lags(result["arrivals"])
        lags += stream_lag
        windowed += stream_windowed
        gaps += stream_gap
        if result["arrivals"]:
            ttft.append(result["arrivals"][0] - result["sent"])
    ok = sum(1 for r in results if r["status"] == 200 and r["ended"])
    failed = collections.Counter(f"{r['status']}{'' if r['ended'] else ' unended'}" for r in results)
    del failed["200"]
    return {
        "streams": n,
        "ramp_s": round(ramp, 1),
        "completed": ok,
        "not_completed": dict(failed),
        "tokens": sum(len(r["arrivals"]) for r in results),
        "wall_s": round(wall, 1),
        "rss_before_mb": round(rss_before / 2**20, 1),
        "rss_peak_mb": round(peak / 2**20, 1),
        "rss_added_mb": round((peak - rss_before) / 2**20, 1),
        "cpu_pct": round(100 * cpu / wall, 1),
        "loop_cpu_pct": round(100 * loop_cpu / wall, 1),
        "load_1m": round(os.getloadavg()[0], 2),
        # All cores, every process (the server, Postgres, the load generator, anyone else).
        "machine_cpu_pct": round(100 * busy / wall, 1),
        "postgres_cpu_pct": round(100 * db_cpu / wall, 1),
        "client_cpu_pct": round(100 * client_cpu / wall, 1),
        "lag_p50_ms": round(percentile(lags, 50) * 1000, 1),
        "lag_p99_ms": round(percentile(lags, 99) * 1000, 1),
        "lag_max_ms": round(max(lags, default=float("nan")) * 1000, 1),
        "window_lag_p50_ms": round(percentile(windowed, 50) * 1000, 1),
        "window_lag_p99_ms": round(percentile(windowed, 99) * 1000, 1),
        "gap_p99_ms": round(percentile(gaps, 99) * 1000, 1),
        "accept_p50_ms": round(percentile(accepted, 50) * 1000, 1),
        "accept_p99_ms": round(percentile(accepted, 99) * 1000, 1),
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
    parser.add_argument(
        "--profile",
        type=Path,
        help="record the server with py-spy into this file (collapsed stacks; needs py-spy)",
    )
    parser.add_argument(
        "--server-env",
        nargs="*",
        default=[],
        metavar="NAME=VALUE",
        help="extra environment of the server (settings to compare; recorded in the results)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "load_streams.json")
    args = parser.parse_args()
    limit = raise_open_files_limit(max(args.streams) * 2 + 200)
    print(f"open files limit (soft): {limit}")
    counts = ([1] if args.baseline else []) + list(args.streams)
    rows: list[dict[str, Any]] = []
    with database(args.database_url) as url:
        env = {"demo_tokens_per_second": RATE, "rate_limit_per_minute": 0, "max_streams_per_user": 0}
        env.update(dict(item.split("=", 1) for item in args.server_env))
        prefix = []
        if args.profile:
            py_spy = str(Path(sys.executable).parent / "py-spy")
            prefix = [py_spy, "record", "--rate", "50", "--format", "raw", "-o", str(args.profile), "--"]
        async with Server(url, prefix=prefix, **env) as server:
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
        "loop_cpu_pct",
        "lag_p50_ms",
        "lag_p99_ms",
        "window_lag_p99_ms",
        "gap_p99_ms",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "load_1m",
    ]
    print_table(f"{RATE:g} tokens/s per stream, one API process, persistence on", rows, columns)
    write_json(
        args.out,
        {
            "rate_tokens_per_second": RATE,
            "cpus": psutil.cpu_count(),
            "open_files_limit": limit,
            "server_env": args.server_env,
            "targets_at_1000": {"lag_p99_ms": 250, "rss_added_mb": 300},
            "runs": rows,
        },
    )


if __name__ == "__main__":
    asyncio.run(main())
