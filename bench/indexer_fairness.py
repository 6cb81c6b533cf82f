"""Fairness of the indexer: a bystander's experience while another user imports a big history.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/indexer_fairness.py [--import-turns 5000] [--probes 12]

One `chatmem serve --with-workers` (embedded Postgres, Postgres queue, the real embedding
model) and two users of different tenants:

1. idle: the bystander chats `--probes` messages (demo model, not streamed), one at a
   time; for each, the time from sending it until the conversation's `indexed_seq` covers
   the reply (turn-to-searchable), and one `POST /v1/memory/search` timed after it;
2. loaded: the other user imports `--import-turns` turns in one request (the backlog), and
   the bystander does the same again while the backlog drains.

Prints p50/p95 of both figures idle and loaded, and the ratio (target: loaded p95 within 2x
of idle for both), and how much of the backlog was still waiting at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
from common import Server, database, headers, print_table, summary_ms, write_json

TOPICS = ["garden", "sister's bakery", "marathon training", "the new job", "Lisbon trip", "piano lessons"]


def history(turns: int) -> list[dict[str, Any]]:
    """A long, varied history (alternating user/assistant)."""
    return [
        {
            "role": "user" if i % 2 == 0 else "assistant",
            "content": f"Day {i}: more about the {TOPICS[i % len(TOPICS)]}; detail number {i} worth keeping.",
            "external_id": f"h{i}",
        }
        for i in range(turns)
    ]


async def indexed(client: httpx.AsyncClient, conversation_id: str) -> tuple[int, int]:
    body = (await client.get(f"/v1/conversations/{conversation_id}")).json()
    return int(body["indexed_seq"]), int(body["turn_count"])


async def probe(
    client: httpx.AsyncClient, conversation_id: str, n: int, label: str
) -> dict[str, list[float]]:
    """`n` bystander messages: turn-to-searchable and memory-search latency for each."""
    to_searchable: list[float] = []
    searches: list[float] = []
    for i in range(n):
        started = time.perf_counter()
        response = await client.post(
            f"/v1/conversations/{conversation_id}/messages",
            json={"content": f"Note {label}-{i}: my locker code is {uuid.uuid4().hex[:6]}.", "stream": False},
        )
        response.raise_for_status()
        async with asyncio.timeout(600):
            while True:
                done, total = await indexed(client, conversation_id)
                if done >= total:
                    break
                await asyncio.sleep(0.02)
        to_searchable.append(time.perf_counter() - started)
        started = time.perf_counter()
        found = await client.post("/v1/memory/search", json={"query": "what is my locker code?"})
        found.raise_for_status()
        searches.append(time.perf_counter() - started)
    return {"to_searchable": to_searchable, "search": searches}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with database(args.database_url) as url:
        env = {"EMBEDDING_THREADS": 1, "IMPORT_TURNS_PER_HOUR": 0, "MAX_RUNNING_REPLIES_PER_USER": 0}
        async with Server(url, with_workers=True, **env) as server:
            bystander = httpx.AsyncClient(base_url=server.url, headers=headers("bystander", "b"), timeout=600)
            importer = httpx.AsyncClient(base_url=server.url, headers=headers("importer", "i"), timeout=600)
            async with bystander, importer:
                mine = (await bystander.post("/v1/conversations", json={})).json()["id"]
                theirs = (await importer.post("/v1/conversations", json={})).json()["id"]
                idle = await probe(bystander, mine, args.probes, "idle")
                started = time.perf_counter()
                accepted = await importer.post(
                    f"/v1/conversations/{theirs}/import", json={"turns": history(args.import_turns)}
                )
                accepted.raise_for_status()
                accept_s = time.perf_counter() - started
                loaded = await probe(bystander, mine, args.probes, "loaded")
                done, total = await indexed(importer, theirs)
    rows = []
    results: dict[str, Any] = {"import_turns": args.import_turns, "import_accept_s": round(accept_s, 2)}
    for figure in ("to_searchable", "search"):
        a, b = summary_ms(idle[figure]), summary_ms(loaded[figure])
        ratio = round(b["p95_ms"] / a["p95_ms"], 2) if a["p95_ms"] else float("nan")
        results[figure] = {"idle": a, "loaded": b, "p95_ratio": ratio}
        rows.append(
            {
                "figure": figure,
                "idle p50/p95 ms": f"{a['p50_ms']} / {a['p95_ms']}",
                "loaded p50/p95 ms": f"{b['p50_ms']} / {b['p95_ms']}",
                "p95 loaded/idle": ratio,
            }
        )
    results["backlog_left_at_end"] = total - done
    print_table(
        f"bystander during a {args.import_turns}-turn import (accepted in {accept_s:.2f} s; "
        f"{total - done} of its turns still unindexed at the end)",
        rows,
        ["figure", "idle p50/p95 ms", "loaded p50/p95 ms", "p95 loaded/idle"],
    )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--import-turns", type=int, default=5000)
    parser.add_argument("--probes", type=int, default=12)
    parser.add_argument("--database-url", default=None, help="an existing Postgres (default: embedded)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/indexer_fairness.json"))
    args = parser.parse_args()
    write_json(args.out, asyncio.run(run(args)))


if __name__ == "__main__":
    main()
