"""Indexer throughput and lag, against the raw encode speed of the same model in the same run.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/indexer_throughput.py [--turns 1024] [--lag-seconds 20]

1. raw: `embed` of the turns' memory texts, in one call (the model's best case);
2. end to end: the same number of turns put in the outbox first, then the indexer (Postgres
   transport, the embedded default) started; turns per second until every row is searchable;
3. lag: turns chatted one per transaction at half the measured throughput; for each, the
   time from its commit to its memory row being visible to a reader (p50, p95).

Targets: end to end >= 0.8 x raw; p95 lag < 2 s. Runs on a private embedded Postgres.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import text

from indexer.worker import IndexerWorker
from memory.config import get_settings
from memory.events import TurnStatus
from memory.recall.embeddings import load_embedder
from memory.recall.keywords import memory_text
from memory.record.conversations import Owner, create_conversation
from memory.record.outbox import record_finished_turn
from memory.record.turns import add_turn
from memory.storage.db import Database, upgrade
from memory.storage.embedded import EmbeddedPostgres
from memory.storage.models import Conversation

TOPICS = ["garden", "sister's bakery", "marathon training", "the new job", "Lisbon trip", "piano lessons"]


def turn_text(i: int) -> str:
    """A chat turn of typical length with something worth remembering."""
    topic = TOPICS[i % len(TOPICS)]
    return (
        f"Update {i}: about {topic}, this week I spent {i % 9 + 1} evenings on it and I think the hardest "
        f"part is keeping a routine when work gets busy; next month I want to try a different approach."
    )


async def add_turns(db: Database, conversation_id: uuid.UUID, texts: list[str]) -> list[uuid.UUID]:
    async with db.transaction() as session:
        conversation = await session.get(Conversation, conversation_id)
        assert conversation is not None
        turns = [
            await add_turn(session, conversation, role="user", status=TurnStatus.COMPLETED, content=t)
            for t in texts
        ]
        for turn in turns:
            await record_finished_turn(session, turn)
    return [t.id for t in turns]


async def searchable(db: Database, ids: list[uuid.UUID]) -> set[uuid.UUID]:
    async with db.transaction() as session:
        rows = await session.execute(
            text("SELECT DISTINCT turn_id FROM memory_items WHERE turn_id = ANY(:ids)"), {"ids": ids}
        )
        return set(rows.scalars())


async def bench(turns: int, lag_seconds: float, out: Path) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    server = EmbeddedPostgres(Path(tempfile.mkdtemp(prefix="chatmem-bench-")), delete_on_stop=True)
    url = server.start()
    await asyncio.to_thread(upgrade, url)
    settings = get_settings(database_url=url, indexer_batch_wait_ms=100)
    db = Database(url)
    try:
        embedder = await load_embedder(settings)
        texts = [turn_text(i) for i in range(turns)]
        now = datetime.now(UTC)
        await embedder.embed([memory_text(t, name=None, created_at=now) for t in texts[:64]])  # warm up

        started = time.perf_counter()
        await embedder.embed([memory_text(t, name=None, created_at=now) for t in texts])
        raw = turns / (time.perf_counter() - started)

        async with db.transaction() as session:
            conversation = await create_conversation(session, Owner("bench", "bench"))
        ids = await add_turns(db, conversation.id, texts)
        worker = IndexerWorker(db, settings, embedder)
        stop = asyncio.Event()
        started = time.perf_counter()
        task = asyncio.ensure_future(worker.run(stop))
        # Polling the reader's view is the measurement: "searchable" is what a reader sees.
        while len(await searchable(db, ids)) < turns:
            await asyncio.sleep(0.05)
        end_to_end = turns / (time.perf_counter() - started)

        rate = end_to_end / 2
        committed: dict[uuid.UUID, float] = {}
        seen: dict[uuid.UUID, float] = {}

        async def chat() -> None:
            begin = time.perf_counter()
            i = 0
            while time.perf_counter() - begin < lag_seconds:
                (turn_id,) = await add_turns(db, conversation.id, [turn_text(turns + i)])
                committed[turn_id] = time.perf_counter()
                i += 1
                await asyncio.sleep(max(0.0, begin + i / rate - time.perf_counter()))

        async def watch(chatting: asyncio.Future[None]) -> None:
            while not chatting.done() or len(seen) < len(committed):
                pending = [t for t in committed if t not in seen]
                if pending:
                    found = await searchable(db, pending)
                    stamp = time.perf_counter()
                    seen.update({t: stamp for t in found})
                await asyncio.sleep(0.02)

        chatting = asyncio.ensure_future(chat())
        await asyncio.gather(chatting, watch(chatting))
        stop.set()
        await task
        lags = sorted(seen[t] - committed[t] for t in committed)
        p50 = statistics.median(lags)
        p95 = lags[min(len(lags) - 1, int(0.95 * len(lags)))]
        print(f"model: {settings.embedding_model}")
        print(f"turns: {turns}; raw encode: {raw:.1f} turns/s; end to end: {end_to_end:.1f} turns/s")
        print(f"ratio end-to-end / raw: {end_to_end / raw:.2f} (target >= 0.8)")
        print(
            f"lag at {rate:.1f} turns/s over {len(lags)} turns: "
            f"p50 {p50 * 1000:.0f} ms, p95 {p95 * 1000:.0f} ms"
        )
        print(f"(target p95 < 2000 ms); indexer batches: {worker.stats['batches']}")
        result = {
            "benchmark": "indexer_throughput",
            "model": settings.embedding_model,
            "turns": turns,
            "raw_encode_turns_per_s": round(raw, 1),
            "end_to_end_turns_per_s": round(end_to_end, 1),
            "ratio": round(end_to_end / raw, 3),
            "lag_rate_turns_per_s": round(rate, 1),
            "lag_n": len(lags),
            "lag_p50_ms": round(p50 * 1000, 1),
            "lag_p95_ms": round(p95 * 1000, 1),
            "targets": {"ratio": 0.8, "lag_p95_ms": 2000},
        }
        out = out if out.is_absolute() else Path(__file__).resolve().parent.parent / out
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")
    finally:
        await db.dispose()
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=1024)
    parser.add_argument("--lag-seconds", type=float, default=20.0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/indexer_throughput.json"))
    args = parser.parse_args()
    asyncio.run(bench(args.turns, args.lag_seconds, args.out))


if __name__ == "__main__":
    main()
