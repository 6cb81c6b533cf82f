"""Time the backend adds before the first token, at 1 and at N concurrent streams.

The demo model emits its first token immediately, so the time from sending the message
to receiving the first `message.delta` is what chatmem adds: auth, validation, storing
the user and assistant turns, building the prompt, starting the stream. Each of the N
clients sends its next message shortly after its previous reply has ended, so about N
replies are always streaming at once (each ~1.5 s at the default demo rate).

The demo's replies all have the same length, so clients that started together would
stay in lockstep and send in bursts of N at the same instant. The clients' starts are
spread over one reply's duration and each waits a random 0–100 ms before its next
message, so arrivals are spread as real users' are.

    python bench/ttft.py --concurrency 1 32 --requests 200
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from pathlib import Path

import httpx
from common import Server, database, headers, print_table, summary_ms, write_json

REPLY_SECONDS = 1.5  # a demo reply at 40 tokens/s


async def one_client(
    url: str, user: str, count: int, samples: list[float], start_delay: float, scope: str
) -> None:
    rng = random.Random(user)
    async with httpx.AsyncClient(base_url=url, headers=headers(user=user), timeout=60) as client:
        cid = (await client.post("/v1/conversations", json={"title": "ttft", "memory_mode": "none"})).json()[
            "id"
        ]
        await asyncio.sleep(start_delay)
        for i in range(count):
            await asyncio.sleep(rng.uniform(0, 0.1))
            started = time.perf_counter()
            first = None
            async with client.stream(
                "POST",
                f"/v1/conversations/{cid}/messages",
                json={"content": f"message {i} about my trip", "memory_scope": scope},
            ) as response:
                async for line in response.aiter_lines():
                    if first is None and line == "event: message.delta":
                        first = time.perf_counter() - started
                # read to the end: the next message may only be sent once this reply is over
            if first is not None and i > 0:  # the first request of a client warms its connection
                samples.append(first)


async def measure(url: str, concurrency: int, requests: int, scope: str) -> dict:
    samples: list[float] = []
    per_client = max(2, requests // concurrency + 1)
    spread = REPLY_SECONDS / concurrency
    await asyncio.gather(
        *(
            one_client(url, f"{scope}-user{c}", per_client, samples, c * spread, scope)
            for c in range(concurrency)
        )
    )
    return {"memory": scope, "concurrency": concurrency, **summary_ms(samples)}


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--requests", type=int, default=200, help="measured requests per concurrency level")
    parser.add_argument(
        "--memory",
        nargs="+",
        default=["none", "user"],
        choices=["none", "user"],
        help="memory_scope of the messages: none skips recall; user embeds the query and searches",
    )
    parser.add_argument("--rate", type=float, default=40.0, help="demo tokens per second per stream")
    parser.add_argument(
        "--workers", type=int, nargs="+", default=[1], help="API processes (serve --workers N)"
    )
    parser.add_argument("--database-url")
    parser.add_argument("--url", help="measure an already running server (JWT_SECRET as in bench/common.py)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/ttft.json"))
    args = parser.parse_args()
    if args.url:
        rows = [await measure(args.url, c, args.requests, m) for m in args.memory for c in args.concurrency]
    else:
        rows = []
        with database(args.database_url) as url:
            for workers in args.workers:
                # --workers N: N API processes on one port; each client's connection stays on one.
                extra = ["--workers", str(workers)] if workers > 1 else []
                async with Server(
                    url, args=extra, demo_first_token_delay_seconds=0, demo_tokens_per_second=args.rate
                ) as server:
                    for m in args.memory:
                        for c in args.concurrency:
                            load = os.getloadavg()[0]
                            row = await measure(server.url, c, args.requests, m)
                            rows.append(
                                {
                                    "workers": workers,
                                    **row,
                                    "load_1m": [round(load, 1), round(os.getloadavg()[0], 1)],
                                }
                            )
    print_table(
        "Time added before the first token (demo model, first token immediate)",
        rows,
        ["workers", "memory", "concurrency", "n", "p50_ms", "p95_ms", "p99_ms", "mean_ms", "load_1m"],
    )
    write_json(
        args.out, {"benchmark": "ttft", "targets": {"32": {"p50_ms": 15, "p99_ms": 60}}, "results": rows}
    )


if __name__ == "__main__":
    asyncio.run(main())
