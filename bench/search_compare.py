"""The search statement of another commit against this one's, on the same loaded rows.

For rows kept by ``bench/retrieval_latency.py --keep-data`` (its data directory, upgraded to
this commit's schema on start): random users with the slices' questions, each searched with
the candidate statement of ``--base`` (a git revision's ``memory/recall/index_search.py``) and
with this commit's, in alternating order, each in its own transaction. Prints how many
searches returned identical candidates with identical signals (every field, floats exactly)
and each statement's time (p50/p95, the statement alone).

    nice -n 10 python bench/search_compare.py --data-dir DIR --base main --queries 200
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import ROOT, percentile
from retrieval_latency import BENCH, TENANT, KnownQuestions, Vectors, slice_questions

from memory.config import get_settings
from memory.recall import index_search
from memory.recall.embeddings import load_embedder
from memory.recall.fusion import DEFAULT_FUSION
from memory.recall.index import MemoryIndex
from memory.storage.db import Database, upgrade
from memory.storage.embedded import EmbeddedPostgres


def base_module(revision: str) -> Any:
    """`memory.recall.index_search` as it is at `revision`, imported under another name."""
    source = subprocess.run(
        ["git", "show", f"{revision}:memory/recall/index_search.py"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = Path(tempfile.mkdtemp()) / "base_index_search.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("base_index_search", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["base_index_search"] = module
    spec.loader.exec_module(module)
    return module


def ordered(candidates: list[Any]) -> list[dict[str, Any]]:
    """Every field of every candidate (its memory and signals, neighbours included), in one order."""
    fields = [dataclasses.asdict(c.memory) | {"signals": dataclasses.asdict(c.signals)} for c in candidates]
    return sorted(fields, key=lambda c: (str(c["turn_id"]), c["chunk_index"]))


async def compare(args: argparse.Namespace, url: str) -> dict[str, Any]:
    settings = get_settings()
    encoder = await load_embedder(settings, threads=1)
    questions = slice_questions(args.locomo, args.longmemeval)
    vectors = dict(zip(questions, await Vectors(encoder, args.vector_cache).of(questions), strict=True))
    base = base_module(args.base)
    db = Database(url, pool_size=2)
    try:
        generation = await MemoryIndex(db, KnownQuestions(encoder, vectors)).start()
        rng = np.random.default_rng(args.seed)
        users = rng.integers(0, args.users, args.queries)
        asked = [
            (f"user{u}", questions[int(q)])
            for u, q in zip(users, rng.integers(0, len(questions), args.queries), strict=True)
        ]
        times: dict[str, list[float]] = {"base": [], "head": []}
        same = 0
        differing: list[tuple[str, str]] = []
        for i, (user, question) in enumerate(asked):
            found: dict[str, list[Any]] = {}
            order = [("base", base), ("head", index_search)]
            if i % 2:
                order.reverse()
            for name, module in order:
                started = time.perf_counter()
                async with db.transaction() as session:
                    found[name] = await module.search_candidates(
                        session,
                        tenant_id=TENANT,
                        user_id=user,
                        query_text=question,
                        query_embedding=vectors[question].tolist(),
                        index_id=generation.id,
                        depth=DEFAULT_FUSION.candidates,
                    )
                times[name].append(time.perf_counter() - started)
            if ordered(found["base"]) == ordered(found["head"]):
                same += 1
            else:
                differing.append((user, question))
    finally:
        await db.dispose()
    return {
        "searches": len(asked),
        "identical": same,
        "differing": differing[:10],
        **{
            f"{name}_p50_p95_ms": [round(1000 * percentile(t, 50), 1), round(1000 * percentile(t, 95), 1)]
            for name, t in times.items()
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--base", default="main", help="the git revision whose statement is compared")
    parser.add_argument("--users", type=int, default=1_000)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--locomo", type=Path, default=BENCH / "locomo_dev.json")
    parser.add_argument("--longmemeval", type=Path, default=BENCH / "longmemeval_dev.json")
    parser.add_argument(
        "--vector-cache", type=Path, default=Path(tempfile.gettempdir()) / "chatmem-bench-vectors"
    )
    args = parser.parse_args()
    server = EmbeddedPostgres(args.data_dir)
    url = server.start()
    try:
        upgrade(url)
        load = os.getloadavg()[0]
        result = asyncio.run(compare(args, url))
        result["load_avg_1m"] = [round(load, 1), round(os.getloadavg()[0], 1)]
    finally:
        server.stop()
    print(result)


if __name__ == "__main__":
    main()
