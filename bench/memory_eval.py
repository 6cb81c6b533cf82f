"""Retrieval quality on the LoCoMo slice through the real pipeline: recall@1/5/10 beside the baselines.

Each LoCoMo conversation is one user (tenant ``locomo``, user = sample id) and each of
its sessions one chat conversation. Turns go in as stored turns plus outbox rows and
reach memory through the Postgres transport and ``IndexPipeline`` (``ingest_sample``,
the one place that ingests); questions go through ``recall_memories``, the retrieval the
chat uses before every reply.

    .venv/bin/python bench/memory_eval.py [--data ../shared/bench/locomo_dev.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import tempfile
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from indexer.pg_queue import PgQueueConsumer
from indexer.pipeline import IndexPipeline
from memory.config import Settings, get_settings
from memory.conversations import Owner, create_conversation
from memory.db import Database, upgrade
from memory.embedded_pg import EmbeddedPostgres
from memory.embeddings import SentenceTransformerEmbedder
from memory.models import Turn, TurnStatus
from memory.outbox import record_finished_turns
from memory.recall_search import recall_memories

REPO_ROOT = Path(__file__).resolve().parent.parent
TENANT = "locomo"
KS = (1, 5, 10)
CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop"}
ADVERSARIAL = 5
BASELINE_OVERALL = {"BM25 dated": (0.323, 0.537, 0.609), "hybrid dated": (0.293, 0.524, 0.606)}
BASELINE_CATEGORY = {1: (0.240, 0.320), 2: (0.720, 0.804), 3: (0.239, 0.305), 4: (0.618, 0.693)}
_EVIDENCE_ID = re.compile(r"D:?(\d+):0*(\d+)$")


@dataclass
class LocomoTurn:
    dia_id: str
    session: int
    speaker: str
    text: str
    created_at: datetime
    caption: str | None


@dataclass
class LocomoSample:
    sample_id: str
    speaker_a: str
    turns: list[LocomoTurn]
    questions: list[dict[str, Any]] = field(default_factory=list)
    skipped: int = 0


def normalise_evidence(raw: list[str], known: set[str]) -> list[str]:
    """Evidence ids as ``D<session>:<turn>``, split, repaired, and dropped when they name no turn."""
    ids: list[str] = []
    for entry in raw:
        for part in re.split(r"[;,\s]+", str(entry)):
            match = _EVIDENCE_ID.match(part.strip())
            if match:
                dia_id = f"D{int(match.group(1))}:{int(match.group(2))}"
                if dia_id in known and dia_id not in ids:
                    ids.append(dia_id)
    return ids


def load_locomo(path: Path) -> list[LocomoSample]:
    """The samples of a LoCoMo file (turns and questions only; the annotations are not used)."""
    samples = []
    for raw in json.loads(path.read_text()):
        conv = raw["conversation"]
        turns: list[LocomoTurn] = []
        n = 1
        while f"session_{n}" in conv:
            started = datetime.strptime(conv[f"session_{n}_date_time"], "%I:%M %p on %d %B, %Y")
            for i, t in enumerate(conv[f"session_{n}"]):
                turns.append(
                    LocomoTurn(
                        dia_id=t["dia_id"],
                        session=n,
                        speaker=t["speaker"],
                        text=t["text"],
                        # A few seconds apart, so order within a session survives.
                        created_at=started.replace(tzinfo=UTC) + timedelta(seconds=30 * i),
                        caption=t.get("blip_caption"),
                    )
                )
            n += 1
        sample = LocomoSample(raw["sample_id"], conv["speaker_a"], turns)
        known = {t.dia_id for t in turns}
        for qa in raw["qa"]:
            evidence = normalise_evidence(qa.get("evidence", []), known)
            if not evidence:
                sample.skipped += 1
                continue
            sample.questions.append(
                {"question": qa["question"], "category": qa["category"], "evidence": evidence}
            )
        samples.append(sample)
    return samples


async def ingest_sample(
    db: Database, pipeline: IndexPipeline, sample: LocomoSample, settings: Settings
) -> dict[uuid.UUID, str]:
    """Store one sample as user ``sample_id``'s conversations and index them; returns turn id -> dia id.

    The turns and their outbox rows are written the way a finished chat turn (or an
    import) writes them, and the real Postgres transport and ``IndexPipeline`` take them
    from the outbox into memory. This is the one place to swap for the import API.
    """
    owner = Owner(TENANT, sample.sample_id)
    turn_ids: dict[uuid.UUID, str] = {}
    async with db.transaction() as session:
        by_session: dict[int, list[LocomoTurn]] = defaultdict(list)
        for turn in sample.turns:
            by_session[turn.session].append(turn)
        turns: list[Turn] = []
        for number, session_turns in sorted(by_session.items()):
            conversation = await create_conversation(
                session, owner, title=f"{sample.sample_id} session {number}"
            )
            conversation.next_seq = len(session_turns) + 1
            conversation.created_at = session_turns[0].created_at
            for seq, turn in enumerate(session_turns, start=1):
                row = Turn(
                    id=uuid.uuid4(),
                    conversation_id=conversation.id,
                    tenant_id=TENANT,
                    user_id=sample.sample_id,
                    seq=seq,
                    role="user" if turn.speaker == sample.speaker_a else "assistant",
                    status=TurnStatus.COMPLETED,
                    content=turn.text,
                    name=turn.speaker,
                    external_id=turn.dia_id,
                    meta={"blip_caption": turn.caption} if turn.caption else None,
                    created_at=turn.created_at,
                    completed_at=turn.created_at,
                )
                turns.append(row)
                turn_ids[row.id] = turn.dia_id
        session.add_all(turns)
        await session.flush()
        await record_finished_turns(session, turns)
    consumer = PgQueueConsumer(db, settings)
    await consumer.start()
    try:
        while batch := await consumer.poll_batch(settings.indexer_batch_size, timeout=0):
            await pipeline.index([message.payload for message in batch])
            await consumer.commit(batch)
    finally:
        await consumer.stop()
    return turn_ids


async def evaluate(db: Database, embedder: SentenceTransformerEmbedder, samples: list[LocomoSample]) -> dict:
    """Recall@k per category, overall (categories 1-4) and adversarial, plus latency."""
    recalls: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    latencies: list[float] = []
    settings = get_settings()
    pipeline = IndexPipeline(db, embedder, settings)
    for sample in samples:
        started = time.perf_counter()
        turn_ids = await ingest_sample(db, pipeline, sample, settings)
        print(f"{sample.sample_id}: {len(turn_ids)} turns indexed in {time.perf_counter() - started:.1f}s")
        for qa in sample.questions:
            started = time.perf_counter()
            # The chat's retrieval: query embedding, index plus not-yet-indexed turns, merged.
            async with db.transaction() as session:
                memories = await recall_memories(
                    session,
                    embedder,
                    tenant_id=TENANT,
                    user_id=sample.sample_id,
                    query_text=qa["question"],
                    k=max(KS),
                )
            latencies.append(time.perf_counter() - started)
            found = [turn_ids[m.hit.turn_id] for m in memories]
            key = "adversarial" if qa["category"] == ADVERSARIAL else CATEGORIES[qa["category"]]
            for k in KS:
                recall = len(set(found[:k]) & set(qa["evidence"])) / len(qa["evidence"])
                recalls[key][k].append(recall)
                if qa["category"] != ADVERSARIAL:
                    recalls["overall"][k].append(recall)
    latencies.sort()
    return {
        "recall": {
            name: {f"R@{k}": round(sum(v) / len(v), 3) for k, v in by_k.items()} | {"n": len(by_k[1])}
            for name, by_k in recalls.items()
        },
        "skipped_questions": sum(s.skipped for s in samples),
        # Embedding the question plus the search, as the chat does it (no rewrite: no history).
        "recall_ms_p50": round(1000 * latencies[len(latencies) // 2], 2),
        "recall_ms_p95": round(1000 * latencies[int(len(latencies) * 0.95)], 2),
    }


def print_table(result: dict) -> None:
    recall = result["recall"]
    print(f"{'set':<14}{'n':>5}{'R@1':>8}{'R@5':>8}{'R@10':>8}   best baseline R@5/R@10")
    overall = recall["overall"]
    best = BASELINE_OVERALL["BM25 dated"]
    print(
        f"{'overall':<14}{overall['n']:>5}{overall['R@1']:>8.3f}{overall['R@5']:>8.3f}{overall['R@10']:>8.3f}"
        f"   {best[1]:.3f}/{best[2]:.3f} (R@1 {best[0]:.3f})"
    )
    for cat, name in CATEGORIES.items():
        if name in recall:
            row = recall[name]
            base = BASELINE_CATEGORY[cat]
            print(
                f"{name:<14}{row['n']:>5}{row['R@1']:>8.3f}{row['R@5']:>8.3f}{row['R@10']:>8.3f}"
                f"   {base[0]:.3f}/{base[1]:.3f}"
            )
    if "adversarial" in recall:
        row = recall["adversarial"]
        print(f"{'adversarial':<14}{row['n']:>5}{row['R@1']:>8.3f}{row['R@5']:>8.3f}{row['R@10']:>8.3f}")
    print(f"recall latency p50 {result['recall_ms_p50']} ms, p95 {result['recall_ms_p95']} ms")


async def run(args: argparse.Namespace, database_url: str) -> dict:
    settings = get_settings()
    embedder = SentenceTransformerEmbedder(settings.embedding_model, batch_size=settings.embedding_batch_size)
    await asyncio.to_thread(embedder.load)
    samples = load_locomo(args.data)
    if args.limit_conversations:
        samples = samples[: args.limit_conversations]
    db = Database(database_url, pool_size=2)
    try:
        result = await evaluate(db, embedder, samples)
    finally:
        await db.dispose()
    result["conversations"] = [s.sample_id for s in samples]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=REPO_ROOT / "../shared/bench/locomo_dev.json")
    parser.add_argument("--limit-conversations", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench/results/memory_eval.json")
    parser.add_argument(
        "--database-url", help="An empty migrated Postgres; default: a temporary embedded one."
    )
    args = parser.parse_args()
    server = None
    if args.database_url:
        url = args.database_url
        upgrade(url)
    else:
        server = EmbeddedPostgres(Path(tempfile.mkdtemp(prefix="chatmem-bench-")), delete_on_stop=True)
        url = server.start()
        upgrade(url)
    try:
        result = asyncio.run(run(args, url))
    finally:
        if server is not None:
            server.stop()
    print_table(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
