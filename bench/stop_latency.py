"""Stop latency, same process and across processes.

For each stop: a reply streams (demo model), the client reads a few deltas, then sends
`POST /v1/turns/{id}/stop`. Measured from the moment the stop is sent:
  (a) until the reply's SSE stream has closed at the client (`turn.interrupted` read), and
  (b) until the terminal status is committed. The stop endpoint answers only once the
      ending is committed (in-process: after the commit; cross-process: when the commit's
      NOTIFY arrives), so its response time bounds (b) from above.
"Cross process": the reply runs on server A, the stop is sent to server B; the signal
travels through Postgres LISTEN/NOTIFY.

    python bench/stop_latency.py --stops 200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import httpx
from common import Server, database, headers, print_table, started_together, summary_ms, write_json


async def one_stop(
    stream_client: httpx.AsyncClient, stop_client: httpx.AsyncClient, cid: str
) -> tuple[float, float]:
    async with stream_client.stream(
        "POST", f"/v1/conversations/{cid}/messages", json={"content": "/long"}
    ) as r:
        lines = r.aiter_lines()
        reply_id, deltas = None, 0
        async for line in lines:
            if line.startswith("data:") and reply_id is None:
                reply_id = json.loads(line[5:])["reply_id"]
            if line == "event: message.delta":
                deltas += 1
                if deltas == 3:
                    break
        sent = time.perf_counter()
        stop_task = asyncio.create_task(stop_client.post(f"/v1/turns/{reply_id}/stop"))
        async for line in lines:
            if line == "event: turn.interrupted":
                break
        async for _ in lines:  # until the server closes the stream
            pass
        closed = time.perf_counter() - sent
        response = await stop_task
        committed = time.perf_counter() - sent
        assert response.status_code == 200 and response.json()["status"] == "interrupted_by_user", (
            response.text
        )
    return closed, committed


async def measure(a: str, b: str, stops: int, label: str) -> list[dict]:
    closed, committed = [], []
    async with (
        httpx.AsyncClient(base_url=a, headers=headers(), timeout=30) as ca,
        httpx.AsyncClient(base_url=b, headers=headers(), timeout=30) as cb,
    ):
        cid = (await ca.post("/v1/conversations", json={"memory_mode": "none"})).json()["id"]
        for i in range(stops + 5):
            c, m = await one_stop(ca, cb, cid)
            if i >= 5:  # warm-up
                closed.append(c)
                committed.append(m)
    return [
        {"target": label, "measure": "(a) SSE closed at client", **summary_ms(closed)},
        {"target": label, "measure": "(b) terminal status committed", **summary_ms(committed)},
    ]


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stops", type=int, default=200)
    parser.add_argument("--database-url")
    parser.add_argument("--out", type=Path, default=Path("bench/results/stop_latency.json"))
    args = parser.parse_args()
    with database(args.database_url) as url:
        env = {"demo_tokens_per_second": 40}
        async with started_together(Server(url, **env), Server(url, **env)) as (a, b):
            rows = await measure(a.url, a.url, args.stops, "same process")
            rows += await measure(a.url, b.url, args.stops, "other process")
    print_table("Stop latency", rows, ["target", "measure", "n", "p50_ms", "p95_ms", "p99_ms", "mean_ms"])
    write_json(
        args.out,
        {"benchmark": "stop_latency", "targets": {"same_p99_ms": 50, "cross_p99_ms": 150}, "results": rows},
    )


if __name__ == "__main__":
    asyncio.run(main())
