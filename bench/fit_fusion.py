"""Fit the learned fusion's weights on the LoCoMo slice, and cross-validate them against RRF.

The data goes in the way a user's does: a real `chatmem serve --with-workers` imports
every LoCoMo conversation in both layouts (``memory_eval.load``: one user per LoCoMo
conversation, its own indexer). The server is then stopped and, for every question of
categories 1-4, this script asks the product's own ``memory.recall.index_search.search_candidates``
(the statement the search runs) for the candidates and their signals, and builds the
features with ``memory.recall.fusion.fusion_features``: what is fitted is what runs.
A candidate is positive when its ``external_id`` (the dia id) is evidence.

The model is a logistic regression on standardised features (L2, C = 1, Newton's
method in numpy; no scikit-learn). Cross-validation: for each of the 10 ways to pick
3 of the 5 conversations, fit on their questions (both layouts) and rank the other two
conversations' questions with the product's dedupe (``best_distinct``), beside RRF
(the product's fallback) on the same candidates. Printed as a table and written as JSON:
mean over splits of held-out recall@1/5/10/20 per layout and per category, and an
ablation by feature group. ``--write`` fits on all five conversations and writes
``memory/recall/fusion_weights.py``.

    python bench/fit_fusion.py --data ../shared/bench/locomo_dev.json --depth 50 100 --write
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import pickle
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from common import ROOT, Server, database, write_json
from memory_eval import (
    ADVERSARIAL,
    CATEGORIES,
    KS,
    LAYOUTS,
    RATE_LIMIT_PER_MINUTE,
    Question,
    load_questions,
    tenant_of,
)
from memory_eval import load as load_both_layouts

from memory.config import default_embedding_model
from memory.recall.embeddings import SentenceTransformerEmbedder
from memory.recall.found import FoundMemory, best_distinct
from memory.recall.fusion import FEATURE_NAMES, RRF_FEATURE, SQUARED, fusion_features, linear_scores
from memory.recall.index_search import search_candidates
from memory.storage.db import Database

# The memory API's k (memory_eval asks for 20) plus the overfetch of memory.recall.search.
RANKED = 25
L2_C = 1.0
TUNING_CONVERSATIONS = 3
WEIGHTS_MODULE = ROOT / "memory" / "recall" / "fusion_weights.py"
# Ablation: feature groups added one after another.
GROUPS = {
    "scores": [
        "cosine",
        "cosine_below_best",
        "vector_rank_reciprocal",
        "bm25_of_best",
        "keyword_rank_reciprocal",
        "keyword_matched",
        "rrf",
    ],
    "neighbours": [
        "previous_cosine",
        "previous_bm25_of_best",
        "previous_rrf",
        "next_cosine",
        "next_bm25_of_best",
        "next_rrf",
        "neighbour_rrf_max",
    ],
    "priors": ["speaker_named", "has_caption", "is_question", "previous_is_question"],
    "squares": [f"{name}_squared" for name in SQUARED],
}


@dataclass
class Asked:
    """One question in one layout: its candidates, their features and labels."""

    question: Question
    layout: str
    hits: list[FoundMemory]
    features: np.ndarray
    labels: np.ndarray

    def found(self, scores: np.ndarray) -> list[str]:
        scored = [replace(h, score=float(s)) for h, s in zip(self.hits, scores, strict=True)]
        ranked = best_distinct(scored, RANKED)
        return [str(h.external_id) for h in ranked]

    def recalls(self, scores: np.ndarray) -> dict[int, float]:
        """Recall@k for every k of KS, of the ranking these scores give."""
        found, evidence = self.found(scores), set(self.question.evidence)
        return {k: len(set(found[:k]) & evidence) / len(evidence) for k in KS}


async def collect(database_url: str, questions: Sequence[Question], depth: int) -> list[Asked]:
    """Candidates and features of every question in both layouts, through the product's search."""
    embedder = SentenceTransformerEmbedder(default_embedding_model())
    await asyncio.to_thread(embedder.load, threads=1)
    texts = [q.text.strip() for q in questions]
    vectors = await asyncio.to_thread(embedder.encode_sync, texts)
    db = Database(database_url, pool_size=2)
    asked = []
    try:
        for layout in LAYOUTS:
            for question, text, vector in zip(questions, texts, vectors, strict=True):
                async with db.transaction() as session:
                    candidates = await search_candidates(
                        session,
                        tenant_id=tenant_of(layout),
                        user_id=question.sample_id,
                        query_text=text,
                        query_embedding=vector,
                        index_id=1,  # the loaded rows' generation
                        depth=depth,
                    )
                evidence = set(question.evidence)
                asked.append(
                    Asked(
                        question,
                        layout,
                        [c.memory for c in candidates],
                        fusion_features([c.signals for c in candidates], text),
                        np.array([1.0 if c.memory.external_id in evidence else 0.0 for c in candidates]),
                    )
                )
    finally:
        await db.dispose()
    return asked


@dataclass
class Model:
    columns: list[int]
    means: np.ndarray
    scales: np.ndarray
    weights: np.ndarray
    intercept: float

    def scores(self, features: np.ndarray) -> np.ndarray:
        return linear_scores(
            features[:, self.columns],
            means=self.means,
            scales=self.scales,
            weights=self.weights,
            intercept=self.intercept,
        )


def fit(asked: Sequence[Asked], columns: list[int]) -> Model:
    """L2-regularised logistic regression (C = L2_C) on standardised features, by Newton's method."""
    x = np.concatenate([a.features[:, columns] for a in asked])
    y = np.concatenate([a.labels for a in asked])
    means = x.mean(axis=0)
    scales = x.std(axis=0)
    scales[scales == 0] = 1.0
    design = np.hstack([(x - means) / scales, np.ones((len(x), 1))])
    theta = np.zeros(design.shape[1])
    penalty = np.full(design.shape[1], 1.0 / L2_C)
    penalty[-1] = 0.0  # the intercept is not shrunk
    for _ in range(50):
        p = 1.0 / (1.0 + np.exp(-(design @ theta)))
        gradient = design.T @ (p - y) + penalty * theta
        hessian = (design * (p * (1 - p))[:, None]).T @ design + np.diag(penalty)
        step = np.linalg.solve(hessian, gradient)
        theta -= step
        if np.abs(step).max() < 1e-8:
            break
    return Model(columns, means, scales, theta[:-1], float(theta[-1]))


def rrf_scores(a: Asked) -> np.ndarray:
    return np.array([RRF_FEATURE.rrf(h.vector_rank, h.keyword_rank) for h in a.hits])


def table(asked: Sequence[Asked], scores: Sequence[np.ndarray]) -> dict[str, dict[str, float]]:
    """Recall@k overall (categories 1-4) and per category."""
    out: dict[str, dict[str, float]] = {}
    measured = [(a.question.category, a.recalls(s)) for a, s in zip(asked, scores, strict=True)]
    groups = {"overall": [r for _, r in measured]}
    for number, name in CATEGORIES.items():
        groups[name] = [r for category, r in measured if category == number]
    for name, members in groups.items():
        out[name] = {f"R@{k}": statistics.fmean(r[k] for r in members) if members else 0.0 for k in KS}
        out[name]["n"] = len(members)
    return out


def mean_tables(tables: Sequence[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    return {
        group: {key: round(statistics.fmean(t[group][key] for t in tables), 3) for key in tables[0][group]}
        for group in tables[0]
    }


def cross_validate(asked: Sequence[Asked], sample_ids: list[str], columns: list[int]) -> dict[str, Any]:
    """Mean over the 10 splits (3 tuning / 2 held-out conversations) of held-out recall, per layout."""
    per_layout: dict[str, dict[str, list[dict[str, dict[str, float]]]]] = {
        layout: {"rrf": [], "learned": []} for layout in (*LAYOUTS, "both")
    }
    splits = []
    # Three of five conversations; fewer when a small run loads fewer (bench/run_small.py).
    for tune in itertools.combinations(sample_ids, min(TUNING_CONVERSATIONS, len(sample_ids) - 1)):
        model = fit([a for a in asked if a.question.sample_id in tune], columns)
        held = [a for a in asked if a.question.sample_id not in tune]
        split: dict[str, Any] = {"tune": list(tune)}
        for layout in (*LAYOUTS, "both"):
            mine = [a for a in held if layout in ("both", a.layout)]
            for method, scores in (
                ("rrf", [rrf_scores(a) for a in mine]),
                ("learned", [model.scores(a.features) for a in mine]),
            ):
                result = table(mine, scores)
                per_layout[layout][method].append(result)
                split[f"{layout}_{method}"] = {k: round(v, 3) for k, v in result["overall"].items()}
        splits.append(split)
    return {
        "mean": {
            layout: {method: mean_tables(results) for method, results in methods.items()}
            for layout, methods in per_layout.items()
        },
        "splits": splits,
    }


def write_weights(
    model: Model,
    *,
    depth: int,
    questions: int,
    conversations: list[str],
    held_out: dict[str, dict[str, float]],
) -> None:
    """memory/recall/fusion_weights.py: the fitted formula as named constants."""

    def block(name: str, values: np.ndarray) -> str:
        rows = "".join(f'    "{f}": {float(v)!r},\n' for f, v in zip(FEATURE_NAMES, values, strict=True))
        return f"{name} = {{\n{rows}}}\n"

    text = f'''"""The fitted formula of memory/recall/fusion.py: standardise, weigh, add.

Written by ``bench/fit_fusion.py --write``; do not edit by hand. Fitted by L2-regularised
logistic regression (C = {L2_C}) on the LoCoMo slice (../shared/bench/locomo_dev.json:
conversations {", ".join(conversations)}; {questions} questions of categories 1-4, each
in both import layouts), one row per candidate of the product's search (dense and keyword
top {depth}), labelled by whether the turn is evidence. Held-out recall (fitted on three
conversations, measured on the other two, mean of all ten splits, both layouts):
{held_out_line(held_out)}.
A feature's score is ``(value - MEANS[name]) / SCALES[name] * WEIGHTS[name]``.
"""

{block("MEANS", model.means)}
{block("SCALES", model.scales)}
{block("WEIGHTS", model.weights)}
INTERCEPT = {model.intercept!r}
'''
    WEIGHTS_MODULE.write_text(text)
    print(f"wrote {WEIGHTS_MODULE}")


def held_out_line(held_out: dict[str, dict[str, float]]) -> str:
    """'RRF R@5 0.640 R@10 0.733; learned R@5 0.715 R@10 0.794' from a cross-validation's mean."""
    return "; ".join(
        f"{method} " + " ".join(f"R@{k} {held_out[method]['overall'][f'R@{k}']:.3f}" for k in (5, 10))
        for method in ("rrf", "learned")
    )


def print_cv(label: str, cv: dict[str, Any]) -> None:
    print(f"\n{label}: held-out mean of 10 splits (3 tuning / 2 held-out conversations)")
    header = f"{'layout':<13}{'set':<13}{'method':<9}" + "".join(f"{'R@' + str(k):>7}" for k in KS)
    print(header)
    for layout, methods in cv["mean"].items():
        for group in ("overall", *CATEGORIES.values()):
            for method in ("rrf", "learned"):
                row = methods[method][group]
                print(f"{layout:<13}{group:<13}{method:<9}" + "".join(f"{row[f'R@{k}']:>7.3f}" for k in KS))


async def collect_all(args: argparse.Namespace, questions: list[Question], sample_ids: list[str]) -> Any:
    """Load the slice into a fresh database and collect every depth's candidates (or read --cache)."""
    if args.cache and args.cache.exists():
        return pickle.loads(args.cache.read_bytes())
    with database(args.database_url) as url:
        async with Server(url, with_workers=True, rate_limit_per_minute=RATE_LIMIT_PER_MINUTE) as server:
            loading = await load_both_layouts(server.url, args.data, sample_ids)
        collected = (loading, {depth: await collect(url, questions, depth) for depth in args.depth})
    if args.cache:
        args.cache.write_bytes(pickle.dumps(collected))
    return collected


async def run(args: argparse.Namespace) -> dict[str, Any]:
    data = load_questions(args.data, args.limit_conversations)
    questions = [q for q in data.questions if q.category != ADVERSARIAL]
    loading, by_depth = await collect_all(args, questions, data.sample_ids)
    every = list(range(len(FEATURE_NAMES)))
    result: dict[str, Any] = {
        "benchmark": "fit_fusion",
        "data": str(args.data),
        "conversations": data.sample_ids,
        "questions": len(questions),
        "load_seconds": loading,
        "features": list(FEATURE_NAMES),
        "by_depth": {},
    }
    for depth in args.depth:
        asked = by_depth[depth]
        positives = [a for a in asked if a.labels.any()]
        coverage = statistics.fmean(
            len({h.external_id for h, y in zip(a.hits, a.labels, strict=True) if y})
            / len(a.question.evidence)
            for a in asked
        )
        print(
            f"\ndepth {depth}: {statistics.fmean(len(a.hits) for a in asked):.0f} candidates per question,"
            f" evidence among them {coverage:.3f} ({len(positives)} of {len(asked)} with any)"
        )
        cv = cross_validate(asked, data.sample_ids, every)
        print_cv(f"depth {depth}, all {len(FEATURE_NAMES)} features", cv)
        ablation = {}
        columns: list[int] = []
        for group, names in GROUPS.items():
            columns = columns + [FEATURE_NAMES.index(n) for n in names]
            means = cross_validate(asked, data.sample_ids, columns)["mean"]["both"]["learned"]["overall"]
            ablation[f"+ {group}"] = means
            print(
                f"ablation, depth {depth}, up to {group}: "
                + " ".join(f"R@{k} {means[f'R@{k}']:.3f}" for k in KS)
            )
        result["by_depth"][str(depth)] = {
            "candidate_evidence_coverage": round(coverage, 3),
            "cv": cv,
            "ablation": ablation,
        }
        if args.write and depth == args.depth[0]:
            write_weights(
                fit(asked, every),
                depth=depth,
                questions=len(questions),
                conversations=data.sample_ids,
                held_out=cv["mean"]["both"],
            )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "bench" / "locomo_dev.json")
    parser.add_argument("--limit-conversations", type=int, default=0)
    parser.add_argument(
        "--depth", type=int, nargs="+", default=[50], help="candidates of each list (the first is written)"
    )
    parser.add_argument(
        "--write", action="store_true", help="write memory/recall/fusion_weights.py (first depth)"
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/fit_fusion.json"))
    parser.add_argument(
        "--cache", type=Path, help="keep the collected candidates here and reuse them (refits skip the load)"
    )
    parser.add_argument(
        "--database-url", help="an empty Postgres with pgvector; default: a private embedded one"
    )
    args = parser.parse_args()
    result = asyncio.run(run(args))
    write_json(args.out, result)


if __name__ == "__main__":
    main()
