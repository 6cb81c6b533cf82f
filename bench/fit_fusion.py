"""Fit the learned fusion's weights on both kinds of chat, and measure how they generalise.

The data goes in the way a user's does: a real `chatmem serve --with-workers` imports
every LoCoMo conversation in both layouts (``memory_eval.load``: one user per LoCoMo
conversation) and the LongMemEval slice pooled in one user (``longmemeval_eval.load``:
one conversation per session). The server is then stopped and, for every question
(LoCoMo categories 1-4, every LongMemEval question), this script asks the product's own
``memory.recall.index_search.search_candidates`` (the statement the search runs) for the
candidates and their signals, and builds the features with
``memory.recall.fusion.fusion_features``: what is fitted is what runs. A candidate is
positive when its ``external_id`` is evidence.

The model is a logistic regression on standardised features (L2, C = 1, Newton's method
in numpy; no scikit-learn), LongMemEval rows weighted ``LME_WEIGHT`` (50 questions beside
760 x 2 LoCoMo ones: unweighted, one kind of chat would drown the other). Measured, each
with the product's de-duplication (``best_distinct``) and RRF beside it:

- joint cross-validation (the figure quoted): 5 folds, fold i holds out LoCoMo
  conversation i (both layouts) and a fifth of the LongMemEval questions with their
  sessions, fitted on the rest;
- within each benchmark: LoCoMo fitted on 3 conversations and measured on the other 2
  (10 splits); LongMemEval 5 folds by question;
- across: fitted on all of LoCoMo, measured on LongMemEval, and the other way round;
- an ablation: the joint cross-validation without each group of signals.

``--write`` fits on everything and writes ``memory/recall/fusion_weights.py``. ``--cache`` keeps
the collected signals, so a change of the features refits without a reload; ``--no-load`` with
``--database-url`` (a database an earlier run loaded) collects again without loading, so a
change of the search statement is measured on the same rows in minutes.

    python bench/fit_fusion.py --data ../shared/bench/locomo_dev.json \
        --lme-data ../shared/bench/longmemeval_dev.json --cache /tmp/fit.pickle --write
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import pickle
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import longmemeval_eval as lme
import numpy as np
from common import ROOT, Server, database, write_json
from memory_eval import ADVERSARIAL, CATEGORIES, KS, LAYOUTS, RATE_LIMIT_PER_MINUTE, load_questions, tenant_of
from memory_eval import load as load_both_layouts

from memory.config import default_embedding_model
from memory.recall.embeddings import SentenceTransformerEmbedder
from memory.recall.found import FoundMemory, best_distinct
from memory.recall.fusion import (
    FEATURE_NAMES,
    RRF_FEATURE,
    CandidateSignals,
    fusion_features,
    linear_scores,
)
from memory.recall.index_search import search_candidates
from memory.storage.db import Database

# The memory API's k (the evals ask for 20) plus the overfetch of memory.recall.search.
RANKED = 25
L2_C = 1.0
LME_WEIGHT = 5.0
FOLDS = 5
TUNING_CONVERSATIONS = 3
LME = "longmemeval"
WEIGHTS_MODULE = ROOT / "memory" / "recall" / "fusion_weights.py"


def _names(*prefixes: str) -> list[str]:
    return [n for n in FEATURE_NAMES if n.removesuffix("_squared").startswith(prefixes)]


# Ablation: each group left out of the joint cross-validation in turn (its squares too).
GROUPS = {
    "sentence keys": _names("key_"),
    "who said it (model_reply_unasked)": _names("model_reply_unasked"),
    "neighbours": _names("previous_", "next_", "neighbour_"),
    "neighbours that are model replies": _names("previous_model_", "next_model_", "neighbour_model_"),
    "day context": _names("day_best"),
    "answer types": _names("when_time", "count_number", "where_place", "who_name"),
    "recency": _names("recency"),
    "length": _names("log_length"),
    "speaker named, caption (LoCoMo only)": _names("speaker_named", "has_caption"),
    "squares": [n for n in FEATURE_NAMES if n.endswith("_squared")],
}


@dataclass
class Asked:
    """One question (in one LoCoMo layout, or of LongMemEval): its candidates, features, labels."""

    bench: str  # "locomo-conversation", "locomo-session" or "longmemeval"
    unit: str  # what a fold holds out: the LoCoMo conversation, or the LongMemEval question
    group: str  # LoCoMo category or LongMemEval question type
    evidence: set[str]
    hits: list[FoundMemory]
    features: np.ndarray
    labels: np.ndarray
    # What the features are made from (kept in the cache, so a change of the features refits
    # without loading the benchmarks again).
    query: str = ""
    signals: list[CandidateSignals] = field(default_factory=list)

    @property
    def is_lme(self) -> bool:
        return self.bench == LME

    def recalls(self, scores: np.ndarray) -> dict[int, float]:
        """Recall@k for every k of KS, of the ranking these scores give."""
        scored = [replace(h, score=float(s)) for h, s in zip(self.hits, scores, strict=True)]
        found = [str(h.external_id) for h in best_distinct(scored, RANKED)]
        return {k: len(set(found[:k]) & self.evidence) / len(self.evidence) for k in KS}


async def _ask(
    db: Database, tenant: str, user: str, text: str, vector: Sequence[float], depth: int
) -> tuple[list[FoundMemory], list[CandidateSignals]]:
    async with db.transaction() as session:
        candidates = await search_candidates(
            session,
            tenant_id=tenant,
            user_id=user,
            query_text=text,
            query_embedding=vector,
            index_id=1,  # the loaded rows' generation
            depth=depth,
        )
    return [c.memory for c in candidates], [c.signals for c in candidates]


async def collect(
    database_url: str, questions: Sequence[Any], pool: lme.Pool | None, depth: int
) -> list[Asked]:
    """Candidates and features of every question, through the product's search."""
    embedder = SentenceTransformerEmbedder(default_embedding_model())
    await asyncio.to_thread(embedder.load, threads=1)
    lme_questions = pool.questions if pool else []
    texts = [q.text.strip() for q in questions] + [q.text.strip() for q in lme_questions]
    vectors = await asyncio.to_thread(embedder.encode_sync, texts)
    db = Database(database_url, pool_size=2)
    asked = []

    def add(
        bench: str,
        unit: str,
        group: str,
        evidence: set[str],
        text: str,
        found: tuple[list[FoundMemory], list[CandidateSignals]],
    ) -> None:
        hits, signals = found
        labels = np.array([1.0 if h.external_id in evidence else 0.0 for h in hits])
        features = fusion_features(signals, text)
        asked.append(Asked(bench, unit, group, evidence, hits, features, labels, text, signals))

    try:
        for layout in LAYOUTS:
            for q, text, vector in zip(questions, texts, vectors, strict=False):
                found = await _ask(db, tenant_of(layout), q.sample_id, text, vector, depth)
                add(f"locomo-{layout}", q.sample_id, CATEGORIES[q.category], set(q.evidence), text, found)
        for q, text, vector in zip(
            lme_questions, texts[len(questions) :], vectors[len(questions) :], strict=True
        ):
            found = await _ask(db, lme.TENANT, lme.USER, text, vector, depth)
            add(LME, q.question_id, q.type, q.evidence, text, found)
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
    """Weighted L2-regularised logistic regression (C = L2_C) on standardised features, by Newton's method."""
    x = np.concatenate([a.features[:, columns] for a in asked])
    y = np.concatenate([a.labels for a in asked])
    w = np.concatenate([np.full(len(a.labels), LME_WEIGHT if a.is_lme else 1.0) for a in asked])
    means = x.mean(axis=0)
    scales = x.std(axis=0)
    scales[scales == 0] = 1.0
    design = np.hstack([(x - means) / scales, np.ones((len(x), 1))])
    theta = np.zeros(design.shape[1])
    penalty = np.full(design.shape[1], 1.0 / L2_C)
    penalty[-1] = 0.0  # the intercept is not shrunk
    for _ in range(50):
        p = 1.0 / (1.0 + np.exp(-(design @ theta)))
        gradient = design.T @ (w * (p - y)) + penalty * theta
        hessian = (design * (w * p * (1 - p))[:, None]).T @ design + np.diag(penalty)
        step = np.linalg.solve(hessian, gradient)
        theta -= step
        if np.abs(step).max() < 1e-8:
            break
    return Model(columns, means, scales, theta[:-1], float(theta[-1]))


def rrf_scores(a: Asked) -> np.ndarray:
    return np.array([RRF_FEATURE.rrf(h.vector_rank, h.keyword_rank) for h in a.hits])


Scorer = Callable[[Asked], np.ndarray]


def scorer_of(model: Model) -> Scorer:
    return lambda a: model.scores(a.features)


def table(asked: Sequence[Asked], scorer: Scorer) -> dict[str, dict[str, float]]:
    """Recall@k overall and per category / question type, rounded."""
    measured = [(a.group, a.recalls(scorer(a))) for a in asked]
    groups = {"overall": [r for _, r in measured]}
    for name in sorted({g for g, _ in measured}):
        groups[name] = [r for g, r in measured if g == name]
    return {
        name: {f"R@{k}": round(statistics.fmean(r[k] for r in members), 3) for k in KS} | {"n": len(members)}
        for name, members in groups.items()
    }


def both_tables(asked: Sequence[Asked], scorer: Scorer) -> dict[str, Any]:
    """LoCoMo (both layouts together) and LongMemEval, each its own table."""
    locomo = [a for a in asked if not a.is_lme]
    out = {}
    if locomo:
        out["locomo"] = table(locomo, scorer)
    if any(a.is_lme for a in asked):
        out[LME] = table([a for a in asked if a.is_lme], scorer)
    return out


def lme_folds(asked: Sequence[Asked]) -> list[set[str]]:
    units = sorted({a.unit for a in asked if a.is_lme})
    np.random.default_rng(0).shuffle(units)
    return [set(units[i::FOLDS]) for i in range(FOLDS)]


def held_out(asked: Sequence[Asked], columns: list[int], folds: list[tuple[set[str], set[str]]]) -> Scorer:
    """Scores of every question from the fit that did not see it: folds are (LoCoMo units, LME units)."""
    predicted: dict[int, np.ndarray] = {}
    for locomo_units, lme_units in folds:
        test = [a for a in asked if a.unit in (lme_units if a.is_lme else locomo_units)]
        if not test:
            continue
        train = [a for a in asked if a.unit not in (lme_units if a.is_lme else locomo_units)]
        model = fit(train, columns)
        for a in test:
            predicted[id(a)] = model.scores(a.features)
    return lambda a: predicted[id(a)]


def joint_cv(asked: Sequence[Asked], columns: list[int]) -> dict[str, Any]:
    conversations = sorted({a.unit for a in asked if not a.is_lme})
    lme_units = lme_folds(asked)
    folds = [({conversations[i]} if i < len(conversations) else set(), lme_units[i]) for i in range(FOLDS)]
    held_conversations = set().union(*(units for units, _ in folds))
    mine = [a for a in asked if a.is_lme or a.unit in held_conversations]
    return both_tables(mine, held_out(asked, columns, folds))


def within_cv(asked: Sequence[Asked], columns: list[int]) -> dict[str, Any]:
    """LoCoMo: fitted on 3 conversations, measured on 2 (mean of the splits); LongMemEval: 5 folds."""
    out: dict[str, Any] = {}
    locomo = [a for a in asked if not a.is_lme]
    conversations = sorted({a.unit for a in locomo})
    if len(conversations) > 1:
        tables = []
        for tune in itertools.combinations(conversations, min(TUNING_CONVERSATIONS, len(conversations) - 1)):
            model = fit([a for a in locomo if a.unit in tune], columns)
            tables.append(table([a for a in locomo if a.unit not in tune], scorer_of(model)))
        out["locomo"] = {
            group: {
                key: round(statistics.fmean(t[group][key] for t in tables), 3) for key in tables[0][group]
            }
            for group in tables[0]
        }
    only_lme = [a for a in asked if a.is_lme]
    if only_lme:
        folds: list[tuple[set[str], set[str]]] = [(set(), units) for units in lme_folds(only_lme)]
        out[LME] = table(only_lme, held_out(only_lme, columns, folds))
    return out


def across(asked: Sequence[Asked], columns: list[int]) -> dict[str, Any]:
    """Fitted on one benchmark, measured on the other."""
    locomo = [a for a in asked if not a.is_lme]
    only_lme = [a for a in asked if a.is_lme]
    if not locomo or not only_lme:
        return {}
    to_lme, to_locomo = fit(locomo, columns), fit(only_lme, columns)
    return {
        "locomo_to_longmemeval": {LME: table(only_lme, scorer_of(to_lme))},
        "longmemeval_to_locomo": {"locomo": table(locomo, scorer_of(to_locomo))},
    }


def line(tables: dict[str, Any]) -> str:
    return "  ".join(
        f"{bench} " + "/".join(f"{t['overall'][f'R@{k}']:.3f}" for k in (1, 5, 10))
        for bench, t in tables.items()
    )


def write_weights(model: Model, *, depth: int, counts: dict[str, int], cv: dict[str, Any]) -> None:
    """memory/recall/fusion_weights.py: the fitted formula as named constants."""

    def block(name: str, values: np.ndarray) -> str:
        rows = "".join(f'    "{f}": {float(v)!r},\n' for f, v in zip(FEATURE_NAMES, values, strict=True))
        return f"{name} = {{\n{rows}}}\n"

    text = f'''"""The fitted formula of memory/recall/fusion.py: standardise, weigh, add.

Written by ``bench/fit_fusion.py --write``; do not edit by hand. Fitted by L2-regularised
logistic regression (C = {L2_C}) on both kinds of chat: the LoCoMo slice (two people;
{counts["locomo"]} question-layouts, categories 1-4, both import layouts) and the LongMemEval
slice (a user and an assistant; {counts[LME]} questions pooled in one user, rows weighted
{LME_WEIGHT}), one row per candidate of the product's search (dense and keyword top {depth}),
labelled by whether the turn is evidence. Joint cross-validation (each fold holds out one
LoCoMo conversation and a fifth of the LongMemEval questions), R@1/R@5/R@10:
{line(cv)}.
A feature's score is ``(value - MEANS[name]) / SCALES[name] * WEIGHTS[name]``.
"""

{block("MEANS", model.means)}
{block("SCALES", model.scales)}
{block("WEIGHTS", model.weights)}
INTERCEPT = {model.intercept!r}
'''
    WEIGHTS_MODULE.write_text(text)
    print(f"wrote {WEIGHTS_MODULE}")


async def collect_all(
    args: argparse.Namespace, questions: list[Any], sample_ids: list[str], pool: lme.Pool
) -> Any:
    """Load both slices into a fresh database and collect every depth's candidates (or read --cache)."""
    if args.cache and args.cache.exists():
        loading, by_depth = pickle.loads(args.cache.read_bytes())
        for asked in by_depth.values():
            for a in asked:  # the features as this checkout computes them
                a.features = fusion_features(a.signals, a.query)
        return loading, by_depth
    loading = {}
    with database(args.database_url) as url:
        if not args.no_load:
            async with Server(url, with_workers=True, rate_limit_per_minute=RATE_LIMIT_PER_MINUTE) as server:
                loading = await load_both_layouts(server.url, args.data, sample_ids)
                loading[LME] = await lme.load(server.url, pool)
        by_depth = {depth: await collect(url, questions, pool, depth) for depth in args.depth}
    collected = (loading, by_depth)
    if args.cache:
        args.cache.write_bytes(pickle.dumps(collected))
    return collected


async def run(args: argparse.Namespace) -> dict[str, Any]:
    data = load_questions(args.data, args.limit_conversations)
    questions = [q for q in data.questions if q.category != ADVERSARIAL]
    pool = lme.load_pool(args.lme_data, args.lme_limit_questions)
    loading, by_depth = await collect_all(args, questions, data.sample_ids, pool)
    every = list(range(len(FEATURE_NAMES)))
    result: dict[str, Any] = {
        "benchmark": "fit_fusion",
        "data": [str(args.data), str(args.lme_data)],
        "conversations": data.sample_ids,
        "questions": {"locomo": len(questions), LME: len(pool.questions)},
        "lme_weight": LME_WEIGHT,
        "load_seconds": loading,
        "features": list(FEATURE_NAMES),
        "by_depth": {},
    }
    for depth in args.depth:
        asked = by_depth[depth]
        coverage = {
            bench: round(
                statistics.fmean(
                    len({h.external_id for h, y in zip(a.hits, a.labels, strict=True) if y}) / len(a.evidence)
                    for a in asked
                    if a.is_lme == (bench == LME)
                ),
                3,
            )
            for bench in ("locomo", LME)
        }
        print(f"\ndepth {depth}: evidence among the candidates {coverage}")
        measured: dict[str, Any] = {
            "candidate_evidence_coverage": coverage,
            "rrf": both_tables(asked, rrf_scores),
            "joint_cv": joint_cv(asked, every),
        }
        print(f"rrf (no fit)        {line(measured['rrf'])}", flush=True)
        print(f"joint cv            {line(measured['joint_cv'])}", flush=True)
        if args.write and depth == args.depth[0]:
            counts = {"locomo": sum(not a.is_lme for a in asked), LME: sum(a.is_lme for a in asked)}
            write_weights(fit(asked, every), depth=depth, counts=counts, cv=measured["joint_cv"])
        measured["within_cv"] = within_cv(asked, every)
        measured["across"] = across(asked, every)
        measured["ablation_joint_cv"] = {}
        print(f"within-benchmark cv {line(measured['within_cv'])}", flush=True)
        for name, tables in measured["across"].items():
            print(f"{name:<22}{line(tables)}", flush=True)
        if args.ablation:
            for group, names in GROUPS.items():
                columns = [i for i, n in enumerate(FEATURE_NAMES) if n not in names]
                measured["ablation_joint_cv"][group] = joint_cv(asked, columns)
                print(f"joint cv - {group}: {line(measured['ablation_joint_cv'][group])}", flush=True)
        result["by_depth"][str(depth)] = measured
    return result


def slice_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of a bench that collects candidates over both slices: where they are, how
    much of each, and the database."""
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "bench" / "locomo_dev.json")
    parser.add_argument("--limit-conversations", type=int, default=0)
    parser.add_argument(
        "--lme-data", type=Path, default=ROOT.parent / "shared" / "bench" / "longmemeval_dev.json"
    )
    parser.add_argument("--lme-limit-questions", type=int, default=0)
    parser.add_argument(
        "--database-url", help="an empty Postgres with pgvector; default: a private embedded one"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    slice_arguments(parser)
    parser.add_argument(
        "--depth", type=int, nargs="+", default=[100], help="candidates of each list (the first is written)"
    )
    parser.add_argument(
        "--no-load", action="store_true", help="both slices are already in --database-url: only collect"
    )
    parser.add_argument("--ablation", action="store_true", help="joint cross-validation without each group")
    parser.add_argument(
        "--write", action="store_true", help="write memory/recall/fusion_weights.py (first depth)"
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/fit_fusion.json"))
    parser.add_argument(
        "--cache", type=Path, help="keep the collected candidates here and reuse them (refits skip the load)"
    )
    args = parser.parse_args()
    result = asyncio.run(run(args))
    write_json(args.out, result)


if __name__ == "__main__":
    main()
