"""Capacity: the highest rate of new messages one server sustains while replies accumulate.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/capacity.py [--rates 5 10 20 40 80] [--seconds 20]
        [--warmup-seconds 10] [--memory none user] [--tokens-per-second 20] [--reply-words 60]

One `chatmem serve` (embedded Postgres, demo model streaming each reply at
`--tokens-per-second`, so a reply lasts several seconds and open streams pile up as they
would in production). For each memory setting and each rate, new messages arrive as a
Poisson stream for `--seconds`, each in a conversation of its own (many users), and each
client reads its reply to the end. Per arrival: accept (until the response headers) and
time to first token (until the first `message.delta`). The sustainable rate is the highest
rate whose accept p99 < 250 ms and time-to-first-token p99 < 1 s. Also the server's CPU
milliseconds per message (the server's processes only), with this client's and, when
Postgres runs on this machine, Postgres's beside it, and the most streams open at once.

Steady state: each step's arrivals run `--warmup-seconds` first, unmeasured (the pool
opens its connections and each prepares its statements, caches fill, streams pile up to
their steady number), then `--seconds` measured. CPU per message is the server's CPU
during the measured window divided by the messages that arrived in it: at a steady rate
the window holds as much of earlier replies' streaming as later ones will hold of its
own. Latencies are those of the messages that arrived in the window.

Every message is a different question (the same generator as bench/ttft.py), so neither
the query encoder's cache nor the search sees the same text twice. The demo model's
replies are `--reply-words` words long whether or not they quote memories
(DEMO_REPLY_WORDS): left to itself it quotes up to three recalled memories, which makes
a memory-on reply two to three times as long and charges every per-token cost (SSE
writes, events, checkpoints) to memory two to three times. `reply_words` in the table is
the mean length the clients received.

`--workers N` runs N API processes on the port (`serve --workers N`). The load generator
runs in this process and costs CPU too: on a 2-core machine it competes with the server,
which the figures include.

`--embedding-url URL --embedding-model M [--embedding-key K] [--embedding-pid P]`: the
server encodes through an OpenAI-compatible embedding service (`EMBEDDING_BASE_URL`)
instead of its own encoder; with the service's process id, its CPU per message is
reported beside the server's (a service on the same machine competes for the same cores).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
from common import Server, database, headers, percentile, print_table, write_json
from ttft import question

ACCEPT_P99_MS = 250.0
TTFT_P99_MS = 1000.0


def server_cpu_seconds(pid: int) -> float:
    """CPU time of the server process and its children (the server and anything it starts)."""
    root = psutil.Process(pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


async def postgres_pid(url: str) -> int | None:
    """The postmaster's process id, for a Postgres on this machine (None if not found)."""
    import asyncpg

    from memory.storage.db import asyncpg_dsn

    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        backend = int(await conn.fetchval("SELECT pg_backend_pid()"))
    finally:
        await conn.close()
    try:
        parent = psutil.Process(backend).parent()
        return parent.pid if parent is not None and "postgres" in parent.name() else None
    except psutil.Error:
        return None


class Arrivals:
    """What the clients measured during one rate step."""

    def __init__(self) -> None:
        self.accept: list[float] = []
        self.ttft: list[float] = []
        self.words: list[int] = []
        self.errors = 0
        self.open = 0
        self.most_open = 0


async def one_message(client: httpx.AsyncClient, text: str, scope: str, seen: Arrivals) -> None:
    """One new conversation and its first message, measured into `seen`."""
    try:
        created = await client.post("/v1/conversations", json={"memory_mode": "persistent"})
        created.raise_for_status()
        cid = created.json()["id"]
        started = time.perf_counter()
        async with client.stream(
            "POST",
            f"/v1/conversations/{cid}/messages",
            json={"content": text, "memory_scope": scope},
        ) as response:
            seen.accept.append(time.perf_counter() - started)
            if response.status_code != 200:
                seen.errors += 1
                return
            seen.open += 1
            seen.most_open = max(seen.most_open, seen.open)
            first = False
            words = 0
            try:
                async for line in response.aiter_lines():
                    if line == "event: message.delta":
                        words += 1
                        if not first:
                            seen.ttft.append(time.perf_counter() - started)
                            first = True
            finally:
                seen.open -= 1
            seen.words.append(words)
    except httpx.HTTPError:
        seen.errors += 1


async def step(
    url: str,
    pid: int,
    rate: float,
    seconds: float,
    scope: str,
    users: int,
    embedding_pid: int | None = None,
    warmup: float = 0.0,
    postgres: int | None = None,
) -> dict[str, Any]:
    """Poisson arrivals at `rate`/s for `warmup` + `seconds`; measures the last `seconds`."""
    seen, warming = Arrivals(), Arrivals()
    # The same arrival times for every memory setting at a rate; different questions (and users),
    # so that what one setting's step encoded is not cached for the next one.
    rng, texts = random.Random(f"{rate}"), random.Random(f"{rate}-{scope}")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=200)
    clients = [
        httpx.AsyncClient(base_url=url, headers=headers(user=f"cap-{scope}-{u}"), timeout=120, limits=limits)
        for u in range(users)
    ]
    cpu_before = service_before = client_before = postgres_before = 0.0
    tasks: list[asyncio.Task[None]] = []
    started = time.perf_counter()
    next_at = 0.0
    i = sent = 0
    measuring = False
    while True:
        if not measuring and next_at >= warmup:
            await asyncio.sleep(max(0.0, started + warmup - time.perf_counter()))
            cpu_before, client_before = server_cpu_seconds(pid), time.process_time()
            service_before = server_cpu_seconds(embedding_pid) if embedding_pid else 0.0
            postgres_before = server_cpu_seconds(postgres) if postgres else 0.0
            measuring = True
        if next_at >= warmup + seconds:
            break
        delay = started + next_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        text = question(texts, i)
        tasks.append(
            asyncio.create_task(one_message(clients[i % users], text, scope, seen if measuring else warming))
        )
        sent += measuring
        i += 1
        next_at += rng.expovariate(rate)
    # The window ends when the last arrival would have come: later, only its replies stream.
    await asyncio.sleep(max(0.0, started + warmup + seconds - time.perf_counter()))
    cpu = server_cpu_seconds(pid) - cpu_before
    client_cpu = time.process_time() - client_before
    postgres_cpu = server_cpu_seconds(postgres) - postgres_before if postgres else None
    service_cpu = server_cpu_seconds(embedding_pid) - service_before if embedding_pid else None
    await asyncio.gather(*tasks)
    for client in clients:
        await client.aclose()
    arrived = sent
    accept_ms = [a * 1000 for a in seen.accept]
    ttft_ms = [t * 1000 for t in seen.ttft]
    row = {
        "memory": scope,
        "rate": rate,
        "sent": sent,
        "errors": seen.errors + warming.errors,
        "most_open": max(seen.most_open, warming.most_open),
        "reply_words": round(sum(seen.words) / len(seen.words), 1) if seen.words else 0,
        "accept_p50_ms": round(percentile(accept_ms, 50), 1),
        "accept_p99_ms": round(percentile(accept_ms, 99), 1),
        "ttft_p50_ms": round(percentile(ttft_ms, 50), 1),
        "ttft_p99_ms": round(percentile(ttft_ms, 99), 1),
        "cpu_ms_per_message": round(cpu * 1000 / arrived, 1) if arrived else float("nan"),
    }
    if service_cpu is not None:
        per_message = service_cpu * 1000 / arrived if arrived else float("nan")
        row["service_cpu_ms_per_message"] = round(per_message, 1)
    # This load generator's own CPU (the clients reading every token): on a small machine it
    # takes a share of the cores the server would otherwise have.
    row["client_cpu_ms_per_message"] = round(client_cpu * 1000 / arrived, 1) if arrived else float("nan")
    if postgres_cpu is not None:
        # Postgres's processes (a backend that exits during the window takes its CPU along).
        row["postgres_cpu_ms_per_message"] = (
            round(postgres_cpu * 1000 / arrived, 1) if arrived else float("nan")
        )
    row["sustained"] = (
        row["errors"] == 0 and row["accept_p99_ms"] < ACCEPT_P99_MS and row["ttft_p99_ms"] < TTFT_P99_MS
    )
    return row


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    with database(args.database_url) as url:
        # Only the private Postgres is known to run here (a URL's backend pid may be another host's).
        postgres = None if args.database_url else await postgres_pid(url)
        env = {
            "DEMO_TOKENS_PER_SECOND": args.tokens_per_second,
            "DEMO_FIRST_TOKEN_DELAY_SECONDS": 0,
            "MAX_RUNNING_REPLIES_PER_USER": 0,
            "DB_POOL_SIZE": args.pool_size,
            "DEMO_REPLY_WORDS": args.reply_words,
        }
        if args.embedding_url:
            env |= {"EMBEDDING_BASE_URL": args.embedding_url, "EMBEDDING_SERVICE_MODEL": args.embedding_model}
            if args.embedding_key:
                env["EMBEDDING_API_KEY"] = args.embedding_key
        for workers in args.workers:
            # --workers N: N API processes on the port; CPU counts every process of the server.
            extra = ["--workers", str(workers)] if workers > 1 else []
            async with Server(url, with_workers=args.with_indexer, args=extra, **env) as server:
                failed: set[str] = set()
                # Memory settings alternate at each rate, so that both see the same machine.
                for rate in args.rates:
                    for scope in args.memory:
                        if scope in failed:
                            continue  # higher rates only fail harder
                        load = os.getloadavg()[0]
                        row = await step(
                            server.url,
                            server.pid,
                            rate,
                            args.seconds,
                            scope,
                            args.users,
                            args.embedding_pid,
                            args.warmup_seconds,
                            postgres,
                        )
                        # The machine's 1-minute load before and after the step: other work shows there.
                        row = {
                            "workers": workers,
                            **row,
                            "load_1m": [round(load, 1), round(os.getloadavg()[0], 1)],
                        }
                        rows.append(row)
                        print(row, flush=True)
                        if not row["sustained"] and not args.all_rates:
                            failed.add(scope)
    best = {
        f"{scope}, {workers} worker(s)": max(
            (r["rate"] for r in rows if r["memory"] == scope and r["workers"] == workers and r["sustained"]),
            default=0.0,
        )
        for workers in args.workers
        for scope in args.memory
    }
    print_table(
        f"capacity (replies at {args.tokens_per_second} tokens/s; "
        f"sustained: accept p99 < {ACCEPT_P99_MS:.0f} ms and TTFT p99 < {TTFT_P99_MS:.0f} ms)",
        rows,
        [
            "workers",
            "memory",
            "rate",
            "sent",
            "errors",
            "most_open",
            "reply_words",
            "accept_p50_ms",
            "accept_p99_ms",
            "ttft_p50_ms",
            "ttft_p99_ms",
            "cpu_ms_per_message",
            *(["service_cpu_ms_per_message"] if args.embedding_pid else []),
            "client_cpu_ms_per_message",
            "postgres_cpu_ms_per_message",
            "sustained",
            "load_1m",
        ],
    )
    print(f"\nhighest sustained rate (messages/s): {best}")
    encoder = f"service {args.embedding_url} ({args.embedding_model})" if args.embedding_url else "in process"
    print(f"encoder: {encoder}")
    return {"benchmark": "capacity", "encoder": encoder, "sustained_rate": best, "results": rows}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rates", type=float, nargs="+", default=[5, 10, 20, 30, 40, 60, 80, 100])
    parser.add_argument("--seconds", type=float, default=20.0, help="measured arrivals per rate step")
    parser.add_argument(
        "--warmup-seconds", type=float, default=10.0, help="arrivals at the step's rate before it is measured"
    )
    parser.add_argument(
        "--reply-words",
        type=int,
        default=60,
        help="the demo model's reply length, the same with memory on and off (DEMO_REPLY_WORDS)",
    )
    parser.add_argument("--memory", nargs="+", default=["none", "user"], choices=["none", "user"])
    parser.add_argument("--tokens-per-second", type=float, default=20.0)
    parser.add_argument("--users", type=int, default=50, help="users the arrivals are spread over")
    parser.add_argument("--pool-size", type=int, default=20)
    parser.add_argument(
        "--workers", type=int, nargs="+", default=[1], help="API processes (serve --workers N)"
    )
    parser.add_argument("--all-rates", action="store_true", help="go on past the first unsustained rate")
    parser.add_argument(
        "--with-indexer",
        action="store_true",
        help="run the indexer too (serve --with-workers): replies leave the unindexed set as in production",
    )
    parser.add_argument("--embedding-url", help="encode through this embedding service (EMBEDDING_BASE_URL)")
    parser.add_argument("--embedding-model", help="the service's model name (EMBEDDING_SERVICE_MODEL)")
    parser.add_argument("--embedding-key", help="the service's API key (EMBEDDING_API_KEY)")
    parser.add_argument("--embedding-pid", type=int, help="its process id: CPU per message")
    parser.add_argument("--database-url")
    parser.add_argument("--out", type=Path, default=Path("bench/results/capacity.json"))
    args = parser.parse_args()
    if bool(args.embedding_url) != bool(args.embedding_model):
        parser.error("--embedding-url and --embedding-model go together")
    write_json(args.out, asyncio.run(run(args)))


if __name__ == "__main__":
    main()
