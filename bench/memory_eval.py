"""Retrieval quality on the LoCoMo slice: recall@1/5/10 of ``search_memory``, beside the baselines.

Each LoCoMo conversation is one user (tenant ``locomo``, user = sample id) and each of
its sessions one chat conversation. ``ingest_sample`` is the one place that turns
LoCoMo turns into memory rows, so it can be swapped for the real indexer later.

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

from sqlalchemy import func, insert

from indexer.chunking import chunk_text
from memory.config import Settings, get_settings
from memory.db import Database, upgrade
from memory.embedded_pg import EmbeddedPostgres
from memory.embeddings import SentenceTransformerEmbedder
from memory.keywords import memory_search_terms, memory_text
from memory.models import MemoryItem
from memory.redaction import redact
from memory.retrieval import search_memory

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
    db: Database, embedder: SentenceTransformerEmbedder, sample: LocomoSample, settings: Settings
) -> dict[uuid.UUID, str]:
    """Write one sample's turns as the memory of user ``sample_id``; returns turn id -> dia id."""
    conversations = {s: uuid.uuid4() for s in {t.session for t in sample.turns}}
    rows: list[dict[str, Any]] = []
    turn_ids: dict[uuid.UUID, str] = {}
    previous: LocomoTurn | None = None
    for seq, turn in enumerate(sample.turns, start=1):
        turn_id = uuid.uuid4()
        turn_ids[turn_id] = turn.dia_id
        content = redact(turn.text)
        before = None
        if previous is not None and previous.session == turn.session:
            before = f"{previous.speaker}: {redact(previous.text)}"
        extra = f"photo: {turn.caption}" if turn.caption else None
        for index, chunk in enumerate(
            chunk_text(content, max_chars=settings.chunk_chars, overlap=settings.chunk_overlap_chars)
        ):
            text = memory_text(chunk, name=turn.speaker, created_at=turn.created_at, extra=extra)
            rows.append(
                {
                    "tenant_id": TENANT,
                    "user_id": sample.sample_id,
                    "conversation_id": conversations[turn.session],
                    "turn_id": turn_id,
                    "chunk_index": index,
                    "turn_seq": seq,
                    "role": "user" if turn.speaker == sample.speaker_a else "assistant",
                    "name": turn.speaker,
                    "text": text,
                    "search_terms": memory_search_terms(text, previous=before),
                    "turn_created_at": turn.created_at,
                    "external_id": turn.dia_id,
                }
            )
        previous = turn
    vectors = await embedder.embed([row["text"] for row in rows])
    for row, vector in zip(rows, vectors, strict=True):
        row["embedding"] = vector
        row["search_terms"] = func.to_tsvector("simple", row["search_terms"])
    async with db.transaction() as session:
        for row in rows:
            await session.execute(insert(MemoryItem).values(**row))
    return turn_ids


async def evaluate(db: Database, embedder: SentenceTransformerEmbedder, samples: list[LocomoSample]) -> dict:
    """Recall@k per category, overall (categories 1-4) and adversarial, plus latency."""
    recalls: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    latencies: list[float] = []
    settings = get_settings()
    for sample in samples:
        turn_ids = await ingest_sample(db, embedder, sample, settings)
        vectors = await embedder.embed([q["question"] for q in sample.questions])
        for qa, vector in zip(sample.questions, vectors, strict=True):
            started = time.perf_counter()
            async with db.transaction() as session:
                hits = await search_memory(
                    session,
                    tenant_id=TENANT,
                    user_id=sample.sample_id,
                    query_text=qa["question"],
                    query_embedding=vector,
                    k=max(KS),
                )
            latencies.append(time.perf_counter() - started)
            found = [turn_ids[h.turn_id] for h in hits]
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
        "search_ms_p50": round(1000 * latencies[len(latencies) // 2], 2),
        "search_ms_p95": round(1000 * latencies[int(len(latencies) * 0.95)], 2),
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
    print(f"search latency p50 {result['search_ms_p50']} ms, p95 {result['search_ms_p95']} ms")


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
