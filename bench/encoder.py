"""The encoder runtimes side by side: speed at one and two threads, agreement, dense recall.

Loads the packaged MiniLM once per runtime (torch, and OpenVINO from its cached export) in
this process and measures, interleaving the runtimes round by round (rotating which goes
first, so that a change of machine load hits every runtime alike):

- query encode: one bench question per round, never repeated (wall and CPU ms, p50/p95);
- a 64-turn indexer batch: 64 real turn chunks drawn at random per round (wall and CPU ms);
- agreement: cosine of each runtime's vectors with torch's over every text encoded;
- dense recall@1/5/10/20 on both memory slices (LoCoMo: one user per conversation, its
  turns against its questions, categories 1-4; LongMemEval: the 50 questions' haystacks
  pooled in one user), turns chunked as the indexer chunks them, a turn scored by its best
  chunk. (`bench/memory_eval.py` measures the whole system's recall on LoCoMo.)

CPU time is the process's (only one encode runs at a time), so it includes every thread
a runtime uses: on a busy machine a second thread can cost more CPU than it saves time.

With ``--service URL --service-model M`` an OpenAI-compatible embedding service (what
``EMBEDDING_BASE_URL`` points at) is a third runtime, through chatmem's own client: its CPU
columns are this process's (what an API or indexer process still pays per encode), and
``--service-pid`` adds the server process's own CPU (with its children) per encode.

    python bench/encoder.py --threads 1 --queries 80 --batches 5
    python bench/encoder.py --threads 2 --queries 40 --batches 3 --no-recall
    python bench/encoder.py --service http://127.0.0.1:7997/v1 --service-model minilm --service-pid 1234
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from common import percentile, print_table, write_json

from indexer.chunking import chunk_text
from memory.config import get_settings
from memory.recall.embedding_service import ServiceEmbedder
from memory.recall.embeddings import SentenceTransformerEmbedder, configured_embedder

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT.parent / "shared" / "bench"
RUNTIMES = ("torch", "openvino")
EVIDENCE = re.compile(r"D:?(\d+):0*(\d+)$")
KS = (1, 5, 10, 20)

Task = tuple[list[str], list[str], list[tuple[str, set[str]]]]  # turn ids, texts, (question, evidence)


def locomo(path: Path) -> list[Task]:
    users: list[Task] = []
    for sample in json.loads(path.read_text()):
        conv = sample["conversation"]
        ids: list[str] = []
        texts: list[str] = []
        n = 1
        while f"session_{n}" in conv:
            date = conv.get(f"session_{n}_date_time", "")
            for turn in conv[f"session_{n}"]:
                caption = f" [photo: {turn['blip_caption']}]" if turn.get("blip_caption") else ""
                ids.append(turn["dia_id"])
                texts.append(f"[{date}] {turn['speaker']}: {turn['text'].strip()}{caption}")
            n += 1
        known = set(ids)
        questions = []
        for qa in sample["qa"]:
            if qa.get("category") == 5:
                continue
            evidence = set()
            for item in qa.get("evidence", []):
                for part in re.split(r"[;,\s]+", item):
                    match = EVIDENCE.match(part.strip())
                    if match and f"D{match[1]}:{match[2]}" in known:
                        evidence.add(f"D{match[1]}:{match[2]}")
            if evidence:
                questions.append((qa["question"], evidence))
        users.append((ids, texts, questions))
    return users


def longmemeval(path: Path) -> list[Task]:
    seen: set[str] = set()
    ids: list[str] = []
    texts: list[str] = []
    questions = []
    for q in json.loads(path.read_text()):
        evidence = set()
        for sid, date, session in zip(
            q["haystack_session_ids"], q["haystack_dates"], q["haystack_sessions"], strict=True
        ):
            for i, turn in enumerate(session):
                if turn.get("has_answer"):
                    evidence.add(f"{sid}:{i}")
                if sid not in seen:
                    ids.append(f"{sid}:{i}")
                    texts.append(f"[{date}] {turn['content'].strip()}")
            seen.add(sid)
        if evidence:
            questions.append((q["question"], evidence))
    return [(ids, texts, questions)]


def chunked(task: Task, size: int, overlap: int) -> tuple[list[str], list[str]]:
    owners, chunks = [], []
    for turn_id, text in zip(task[0], task[1], strict=True):
        for chunk in chunk_text(text, max_chars=size, overlap=overlap):
            owners.append(turn_id)
            chunks.append(chunk)
    return owners, chunks


def dense_recall(
    tasks: list[Task], vectors: dict[str, np.ndarray], size: int, overlap: int
) -> dict[str, float]:
    hits = {k: [] for k in KS}
    for task in tasks:
        owners, chunks = chunked(task, size, overlap)
        matrix = np.stack([vectors[c] for c in chunks])
        for question, evidence in task[2]:
            scores = matrix @ vectors[question]
            best: dict[str, float] = {}
            for owner, score in zip(owners, scores, strict=True):
                best[owner] = max(best.get(owner, -2.0), float(score))
            ranked = sorted(best, key=best.__getitem__, reverse=True)
            for k in KS:
                hits[k].append(len(evidence & set(ranked[:k])) / len(evidence))
    return {f"R@{k}": round(statistics.fmean(v), 4) for k, v in hits.items()}


class SyncService:
    """The embedding service behind the same synchronous call as a local model (for timing)."""

    runtime = "service"

    def __init__(self, embedder: ServiceEmbedder, server_pid: int | None) -> None:
        self.embedder = embedder
        self.loop = asyncio.new_event_loop()
        self.server = psutil.Process(server_pid) if server_pid else None

    def encode_sync(self, texts: Sequence[str]) -> list[list[float]]:
        return self.loop.run_until_complete(self.embedder.embed(texts))

    def server_cpu_seconds(self) -> float:
        """The server's CPU so far, its children's included (0.0 without --service-pid)."""
        if self.server is None:
            return 0.0
        total = 0.0
        for process in [self.server, *self.server.children(recursive=True)]:
            times = process.cpu_times()
            total += times.user + times.system
        return total


Model = SentenceTransformerEmbedder | SyncService


def encode_all(model: Model, texts: Sequence[str]) -> dict[str, np.ndarray]:
    unique = list(dict.fromkeys(texts))
    out: dict[str, np.ndarray] = {}
    for start in range(0, len(unique), 64):
        part = unique[start : start + 64]
        for text, vector in zip(part, model.encode_sync(part), strict=True):
            out[text] = np.asarray(vector, dtype=np.float32)
    return out


def timed(model: Model, texts: list[str]) -> tuple[float, float, float]:
    """Wall, this process's CPU and the service's CPU (ms) of one encode."""
    server = model.server_cpu_seconds() if isinstance(model, SyncService) else 0.0
    wall, cpu = time.perf_counter(), time.process_time()
    model.encode_sync(texts)
    wall_ms, cpu_ms = (time.perf_counter() - wall) * 1000, (time.process_time() - cpu) * 1000
    if isinstance(model, SyncService):
        return wall_ms, cpu_ms, (model.server_cpu_seconds() - server) * 1000
    return wall_ms, cpu_ms, 0.0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--queries", type=int, default=80)
    parser.add_argument("--batches", type=int, default=5)
    parser.add_argument("--no-recall", action="store_true")
    parser.add_argument("--locomo", type=Path, default=BENCH / "locomo_dev.json")
    parser.add_argument("--longmemeval", type=Path, default=BENCH / "longmemeval_dev.json")
    parser.add_argument("--out", type=Path, default=Path("bench/results/encoder.json"))
    parser.add_argument("--service", help="an OpenAI-compatible /v1 base URL, timed as a third runtime")
    parser.add_argument("--service-model", default="minilm")
    parser.add_argument("--service-key", default=None)
    parser.add_argument("--service-timeout", type=float, default=120.0, help="seconds per request")
    parser.add_argument("--service-pid", type=int, default=None, help="the service's process, for its CPU")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    settings = get_settings()
    runtimes = (*RUNTIMES, "service") if args.service else RUNTIMES
    models: dict[str, Model] = {}
    load_seconds = {}
    for runtime in RUNTIMES:
        model = configured_embedder(settings.model_copy(update={"embedding_runtime": runtime}))
        started = time.perf_counter()
        model.load(threads=args.threads)
        load_seconds[runtime] = round(time.perf_counter() - started, 1)
        assert model.runtime == runtime, f"{runtime} fell back: {model.fallback_reason}"
        models[runtime] = model
    if args.service:
        service = ServiceEmbedder(
            args.service, args.service_model, api_key=args.service_key, timeout_seconds=args.service_timeout
        )
        models["service"] = SyncService(service, args.service_pid)
        load_seconds["service"] = 0.0
    slices = {"LoCoMo": locomo(args.locomo), "LongMemEval": longmemeval(args.longmemeval)}
    size, overlap = settings.chunk_chars, settings.chunk_overlap_chars
    questions = [q for tasks in slices.values() for task in tasks for q, _ in task[2]]
    turn_chunks = [c for tasks in slices.values() for task in tasks for c in chunked(task, size, overlap)[1]]
    rng = random.Random(28)
    query_order = rng.sample(list(dict.fromkeys(questions)), args.queries)
    for model in models.values():  # warm-up, not measured
        model.encode_sync(query_order[:2])
    times: dict[str, dict[str, list[float]]] = {
        r: {k: [] for k in ("qw", "qc", "qs", "bw", "bc", "bs")} for r in runtimes
    }
    load_before = os.getloadavg()[0]
    n = len(runtimes)
    for i, query in enumerate(query_order):
        for runtime in runtimes[i % n :] + runtimes[: i % n]:
            wall, cpu, server = timed(models[runtime], [query])
            times[runtime]["qw"].append(wall)
            times[runtime]["qc"].append(cpu)
            times[runtime]["qs"].append(server)
    for i in range(args.batches):
        batch = rng.sample(turn_chunks, 64)
        for runtime in runtimes[i % n :] + runtimes[: i % n]:
            wall, cpu, server = timed(models[runtime], batch)
            times[runtime]["bw"].append(wall)
            times[runtime]["bc"].append(cpu)
            times[runtime]["bs"].append(server)
    rows: list[dict[str, Any]] = []
    for runtime in runtimes:
        t = times[runtime]
        row = {
            "runtime": runtime,
            "threads": args.threads,
            "load s": load_seconds[runtime],
            "query wall p50": round(statistics.median(t["qw"]), 1),
            "query wall p95": round(percentile(t["qw"], 95), 1),
            "query CPU p50": round(statistics.median(t["qc"]), 1),
            "batch64 wall p50": round(statistics.median(t["bw"]), 0),
            "batch64 CPU p50": round(statistics.median(t["bc"]), 0),
        }
        if args.service_pid:
            row["query server CPU p50"] = round(statistics.median(t["qs"]), 1)
            row["batch64 server CPU p50"] = round(statistics.median(t["bs"]), 0)
        rows.append(row)
    print_table(
        f"encode ms, {args.threads} thread(s), load {load_before:.1f} -> {os.getloadavg()[0]:.1f}",
        rows,
        list(rows[0]),
    )
    result: dict[str, Any] = {
        "threads": args.threads,
        "timing": rows,
        "load": [load_before, os.getloadavg()[0]],
    }
    if not args.no_recall:
        texts = list(dict.fromkeys(questions + turn_chunks))
        vectors = {runtime: encode_all(model, texts) for runtime, model in models.items()}
        recall_rows = []
        for runtime in runtimes:
            for name, tasks in slices.items():
                recall_rows.append(
                    {
                        "runtime": runtime,
                        "slice": name,
                        **dense_recall(tasks, vectors[runtime], size, overlap),
                    }
                )
        print_table("dense recall (best chunk per turn)", recall_rows, list(recall_rows[0]))
        agreement: dict[str, dict[str, float]] = {}
        for runtime in runtimes[1:]:
            cosines = [float(vectors[runtime][t] @ vectors["torch"][t]) for t in texts]
            agreement[runtime] = {
                "texts": len(texts),
                "cos_min": round(min(cosines), 6),
                "cos_mean": round(statistics.fmean(cosines), 6),
            }
            print(f"{runtime} vs torch: {agreement[runtime]}")
        result |= {"recall": recall_rows, "agreement": agreement}
    write_json(args.out, result)


if __name__ == "__main__":
    main()
