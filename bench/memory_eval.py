"""Retrieval quality on the LoCoMo slice through the real pipeline: recall@1/5/10 beside the baselines.

Each LoCoMo conversation is one user (tenant ``locomo``, user = sample id) and each of
its sessions one chat conversation. Turns go in through the HTTP import API of a real
`chatmem serve --with-workers` process, with their session dates and speaker names, and
reach memory through its outbox, Postgres transport and indexer (``ingest_sample``);
questions go through ``recall_memories``, the retrieval the chat uses before every reply.

    .venv/bin/python bench/memory_eval.py [--data ../shared/bench/locomo_dev.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from chat_api.auth import issue_token
from memory.config import get_settings
from memory.db import Database, upgrade
from memory.embedded_pg import EmbeddedPostgres
from memory.embeddings import SentenceTransformerEmbedder
from memory.recall_search import recall_memories

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "bench"))

from common import SECRET, Server  # noqa: E402
from locomo_import import import_locomo, wait_until_searchable  # noqa: E402

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


async def ingest_sample(server_url: str, sample: LocomoSample, data_path: Path) -> dict[uuid.UUID, str]:
    """Import one sample through the HTTP import API and wait until the indexer made it searchable.

    The path a customer's history takes: `POST /v1/conversations/{id}/import` (validation,
    atomic insert, outbox rows), then the server's own indexer (Postgres transport,
    `IndexPipeline`, the real model) until every conversation's `indexed_seq` reached its
    last turn. Returns chatmem turn id -> LoCoMo dia id.
    """
    token_for = partial(issue_token, SECRET)
    async with httpx.AsyncClient(base_url=server_url, timeout=300) as client:
        [imported] = await import_locomo(
            client, data_path, token_for=token_for, tenant=TENANT, sample_ids=[sample.sample_id]
        )
        if not await wait_until_searchable(client, [imported], token_for=token_for, timeout=1800):
            raise TimeoutError(f"{sample.sample_id} was not indexed within 30 minutes")
    return {uuid.UUID(turn_id): dia_id for turn_id, dia_id in imported.dia_ids.items()}


async def evaluate(
    db: Database,
    embedder: SentenceTransformerEmbedder,
    samples: list[LocomoSample],
    server_url: str,
    data_path: Path,
) -> dict:
    """Recall@k per category, overall (categories 1-4) and adversarial, plus latency."""
    recalls: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    latencies: list[float] = []
    for sample in samples:
        started = time.perf_counter()
        turn_ids = await ingest_sample(server_url, sample, data_path)
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
        # A real API process with its in-process indexer, as `chatmem serve --with-workers` runs it.
        async with Server(database_url, with_workers=True, rate_limit_per_minute=0) as server:
            result = await evaluate(db, embedder, samples, server.url, args.data)
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
