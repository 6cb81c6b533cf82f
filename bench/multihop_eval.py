"""Do more candidates, or one extra search per named part of a question, reach multi-hop evidence?

Issue #26: a fifth of LoCoMo's multi-hop evidence is not among the candidates at all
(``bench/diversify_eval.py``). This loads both slices once (as ``bench/fit_fusion.py``), then
asks every question through the product's search statement (``search_candidates``) at
several depths (MEMORY_CANDIDATES 100, 200, 300, interleaved question by question, each
search timed), and, for a question naming two or more things, once more per part
(``parts``): each part's candidates get the fusion's features of the part's text, and the
parts' candidates join the question's own (union; a turn keeps its best fused score,
``best_distinct``). Scored with the shipped weights and with the joint cross-validation's
held-out fits (refitted at each depth). Reports evidence coverage of the candidates,
Recall@k per category / question type, and the search statement's p50/p95.

    python bench/multihop_eval.py --cache /tmp/multihop.pickle
"""

from __future__ import annotations

import argparse
import asyncio
import pickle
import re
import statistics
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import fit_fusion as ff
import longmemeval_eval as lme
import numpy as np
from common import Server, database, write_json
from memory_eval import ADVERSARIAL, CATEGORIES, KS, LAYOUTS, RATE_LIMIT_PER_MINUTE, load_questions, tenant_of
from memory_eval import load as load_both_layouts

from memory.config import default_embedding_model
from memory.recall.embeddings import SentenceTransformerEmbedder
from memory.recall.found import best_distinct
from memory.recall.fusion import FEATURE_NAMES, fusion_features, learned_scores
from memory.storage.db import Database

DEPTHS = (100, 200, 300)
PART_DEPTH = 100
NOT_NAMES = {
    "I", "I'm", "I've", "I'd", "I'll", "What", "When", "Where", "Who", "Why", "How", "Which", "Would",
    "Does", "Did", "Do", "Is", "Are", "Was", "Were", "Has", "Have", "Can", "Could", "Should", "In",
    "On", "At", "The", "A", "An", "My", "Me", "Of", "For", "If", "And", "But", "Based", "According",
    "After", "Before", "Any", "Also", "Dr", "Mr", "Mrs", "Ms", "Monday", "Tuesday", "Wednesday",
    "Thursday", "Friday", "Saturday", "Sunday", "January", "February", "March", "April", "May",
    "June", "July", "August", "September", "October", "November", "December",
}  # fmt: skip
NAME = re.compile(r"\b[A-Z][a-z'\-]+(?:\s+[A-Z][a-z'\-]+)*")
JOINED = re.compile(r"\b(?:and|both|in common)\b", re.IGNORECASE)
MAX_PARTS = 3


def names(question: str) -> list[str]:
    found = []
    for m in NAME.finditer(question):
        words = [
            w
            for w in m.group(0).split()
            if w.removesuffix("'s").removesuffix("s") not in NOT_NAMES
            and w.removesuffix("'s") not in NOT_NAMES
        ]
        name = " ".join(words).removesuffix("'s")
        if name and name not in found:
            found.append(name)
    return found


def tidy(text: str) -> str:
    return re.sub(r"\s+([?,.])", r"\1", re.sub(r"\s+", " ", text)).strip()


def parts(question: str) -> list[str]:
    """The sub-queries of a question naming two or more things (none for any other question)."""
    named = names(question)
    if len(named) >= 2:
        out = []
        for n in named[:MAX_PARTS]:
            text = question
            for other in named:
                if other != n:
                    text = re.sub(rf"(?:\band\s+)?\b{re.escape(other)}(?:'s)?\b(?:\s+and\b)?", " ", text)
            out.append(tidy(text))
        return out
    if JOINED.search(question):
        pieces = [p.strip(" ,?") for p in re.split(r"\band\b", question, flags=re.IGNORECASE)]
        pieces = [p for p in pieces if len(p.split()) >= 2]
        if len(pieces) >= 2:
            head = " ".join(question.split()[:2])
            return [tidy(p if i == 0 else f"{head} {p}") + "?" for i, p in enumerate(pieces[:MAX_PARTS])]
    return []


async def timed(
    db: Database, tenant: str, user: str, text: str, vector: Any, depth: int
) -> tuple[Any, float]:
    start = time.perf_counter()
    found = await ff._ask(db, tenant, user, text, vector, depth)
    return found, time.perf_counter() - start


def asked_of(bench: str, unit: str, group: str, evidence: set[str], text: str, found: Any) -> ff.Asked:
    hits, signals = found
    labels = np.array([1.0 if h.external_id in evidence else 0.0 for h in hits])
    return ff.Asked(bench, unit, group, evidence, hits, fusion_features(signals, text), labels, text, signals)


async def collect(url: str, questions: Sequence[Any], pool: lme.Pool) -> dict[str, Any]:
    embedder = SentenceTransformerEmbedder(default_embedding_model())
    await asyncio.to_thread(embedder.load, threads=1)
    items = []  # (bench, tenant, user, unit, group, evidence, text)
    for layout in LAYOUTS:
        for q in questions:
            items.append(
                (f"locomo-{layout}", tenant_of(layout), q.sample_id, q.sample_id, CATEGORIES[q.category],
                 set(q.evidence), q.text.strip())
            )  # fmt: skip
    for q in pool.questions:
        items.append((ff.LME, lme.TENANT, lme.USER, q.question_id, q.type, set(q.evidence), q.text.strip()))
    texts = sorted({it[6] for it in items} | {p for it in items for p in parts(it[6])})
    vectors = dict(zip(texts, await asyncio.to_thread(embedder.encode_sync, texts), strict=True))
    db = Database(url, pool_size=2)
    by_depth: dict[int, list[ff.Asked]] = {d: [] for d in DEPTHS}
    seconds: dict[int, list[float]] = {d: [] for d in DEPTHS}
    subs: list[list[ff.Asked]] = []
    part_seconds: list[float] = []  # per decomposed question: all its part searches, one after another
    try:
        for bench, tenant, user, unit, group, evidence, text in items:
            for depth in DEPTHS:
                found, s = await timed(db, tenant, user, text, vectors[text], depth)
                by_depth[depth].append(asked_of(bench, unit, group, evidence, text, found))
                seconds[depth].append(s)
            mine, total = [], 0.0
            for p in parts(text):
                found, s = await timed(db, tenant, user, p, vectors[p], PART_DEPTH)
                mine.append(asked_of(bench, unit, group, evidence, p, found))
                total += s
            subs.append(mine)
            if mine:
                part_seconds.append(total)
    finally:
        await db.dispose()
    return {"by_depth": by_depth, "seconds": seconds, "subs": subs, "part_seconds": part_seconds}


def held_out_models(asked: Sequence[ff.Asked]) -> list[tuple[set[str], set[str], ff.Model]]:
    every = list(range(len(FEATURE_NAMES)))
    conversations = sorted({a.unit for a in asked if not a.is_lme})
    out = []
    for i, lme_units in enumerate(ff.lme_folds(asked)):
        locomo_units = {conversations[i]} if i < len(conversations) else set()
        train = [a for a in asked if a.unit not in (lme_units if a.is_lme else locomo_units)]
        out.append((locomo_units, lme_units, ff.fit(train, every)))
    return out


def scorer(models: list[tuple[set[str], set[str], ff.Model]] | None) -> Any:
    def score(a: ff.Asked) -> np.ndarray:
        if models is None:
            return np.asarray(learned_scores(a.signals, a.query))
        for locomo_units, lme_units, model in models:
            if a.unit in (lme_units if a.is_lme else locomo_units):
                return model.scores(a.features)
        raise KeyError(a.unit)

    return score


def ranked_ids(lists: Sequence[ff.Asked], score: Any) -> list[str]:
    scored = [replace(h, score=float(s)) for a in lists for h, s in zip(a.hits, score(a), strict=True)]
    return [str(h.external_id) for h in best_distinct(scored, ff.RANKED)]


def table(rows: Sequence[tuple[ff.Asked, list[ff.Asked]]], score: Any) -> dict[str, Any]:
    """Per benchmark (LoCoMo = both layouts) and group: coverage, Recall@k, and evidence rank buckets."""
    out: dict[str, dict[str, dict[str, list[float]]]] = {}
    for a, extra in rows:
        lists = [a, *extra]
        ids = ranked_ids(lists, score)
        candidates = {str(h.external_id) for x in lists for h in x.hits}
        values = {f"R@{k}": len(set(ids[:k]) & a.evidence) / len(a.evidence) for k in KS}
        values["coverage"] = len(candidates & a.evidence) / len(a.evidence)
        bench = ff.LME if a.is_lme else "locomo"
        for group in ("overall", a.group):
            cell = out.setdefault(bench, {}).setdefault(group, {})
            for key, v in values.items():
                cell.setdefault(key, []).append(v)
            cell.setdefault("missing_turns", []).append(len(a.evidence - candidates))
            cell.setdefault("evidence_turns", []).append(len(a.evidence))
    counts = ("missing_turns", "evidence_turns")
    return {
        bench: {
            group: {k: round(statistics.fmean(v), 3) for k, v in cell.items() if k not in counts}
            | {"n": len(cell["R@10"])}
            | {k: sum(cell[k]) for k in counts}
            for group, cell in groups.items()
        }
        for bench, groups in out.items()
    }


def percentiles(seconds: Sequence[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {
        "p50_ms": round(1000 * ordered[len(ordered) // 2], 1),
        "p95_ms": round(1000 * ordered[int(0.95 * (len(ordered) - 1))], 1),
        "n": len(ordered),
    }


def show(name: str, t: dict[str, Any]) -> None:
    loc, lm = t["locomo"], t[ff.LME]
    cats = "  ".join(
        f"{g} {loc[g]['coverage']:.3f}/{loc[g]['R@10']:.3f}" for g in sorted(loc) if g != "overall"
    )
    hop = loc.get("multi-hop", {})
    lme_r = "/".join(f"{lm['overall'][f'R@{k}']:.3f}" for k in KS)
    print(
        f"{name:<34} LoCoMo cov {loc['overall']['coverage']:.3f} R@5/10/20 "
        f"{loc['overall']['R@5']:.3f}/{loc['overall']['R@10']:.3f}/{loc['overall']['R@20']:.3f}"
        f" | cov/R@10 {cats}\n{'':<34} LME cov {lm['overall']['coverage']:.3f} R@1/5/10/20 {lme_r}"
        f" multi-session R@10 {lm.get('multi-session', {}).get('R@10', float('nan')):.3f}"
        f" | multi-hop turns not candidates {hop.get('missing_turns')}/{hop.get('evidence_turns')}",
        flush=True,
    )


async def run(args: argparse.Namespace) -> dict[str, Any]:
    data = load_questions(args.data, args.limit_conversations)
    questions = [q for q in data.questions if q.category != ADVERSARIAL]
    pool = lme.load_pool(args.lme_data, args.lme_limit_questions)
    if args.cache and args.cache.exists():
        collected = pickle.loads(args.cache.read_bytes())
    else:
        with database(args.database_url) as url:
            async with Server(url, with_workers=True, rate_limit_per_minute=RATE_LIMIT_PER_MINUTE) as server:
                await load_both_layouts(server.url, args.data, data.sample_ids)
                await lme.load(server.url, pool)
            collected = await collect(url, questions, pool)
        if args.cache:
            args.cache.write_bytes(pickle.dumps(collected))
    by_depth, subs = collected["by_depth"], collected["subs"]
    result: dict[str, Any] = {
        "benchmark": "multihop_eval",
        "latency": {str(d): percentiles(s) for d, s in collected["seconds"].items()},
        "parts_latency": percentiles(collected["part_seconds"]),
        "decomposed": {},
        "variants": {},
    }
    for depth in DEPTHS:  # the fusion's Python side (features, scores, de-duplication) on these candidates
        spent = []
        for a in by_depth[depth]:
            start = time.perf_counter()
            scores = learned_scores(a.signals, a.query)
            best_distinct(
                [replace(h, score=float(x)) for h, x in zip(a.hits, scores, strict=True)], ff.RANKED
            )
            spent.append(time.perf_counter() - start)
        result["latency"][str(depth)]["fusion"] = percentiles(spent)
    decomposed = [(a.bench, a.group) for a, s in zip(by_depth[DEPTHS[0]], subs, strict=True) if s]
    for key in sorted(set(decomposed)):
        result["decomposed"][" ".join(key)] = decomposed.count(key)
    print(
        "latency of the search statement:",
        result["latency"],
        "parts (sum per question):",
        result["parts_latency"],
    )
    print("questions decomposed:", result["decomposed"])
    for depth in DEPTHS:
        models = held_out_models(by_depth[depth])
        for scoring, score in (("shipped", scorer(None)), ("held-out", scorer(models))):
            none: list[list[ff.Asked]] = [[] for _ in subs]
            name = f"depth {depth} {scoring}"
            result["variants"][name] = table(list(zip(by_depth[depth], none, strict=True)), score)
            show(name, result["variants"][name])
            if depth == PART_DEPTH:
                # the parts are scored by the fit of the question they belong to
                name = f"depth {depth} + parts {scoring}"
                result["variants"][name] = table(list(zip(by_depth[depth], subs, strict=True)), score)
                show(name, result["variants"][name])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ff.slice_arguments(parser)
    parser.add_argument("--out", type=Path, default=Path("bench/results/multihop_eval.json"))
    parser.add_argument("--cache", type=Path, help="keep the collected candidates here and reuse them")
    args = parser.parse_args()
    write_json(args.out, asyncio.run(run(args)))


if __name__ == "__main__":
    main()
