"""Would diversifying the final top k help? Re-ranks over the same fused candidates, on both kinds of chat.

Multi-hop and open-domain LoCoMo questions, and LongMemEval's multi-session ones, have
several evidence turns, often in different sessions; if the top of the list were filled by
one session, or by near-duplicates, a diversified list could hold more of them. This
measures that, without touching the product: the data is loaded and the candidates are
collected exactly as ``bench/fit_fusion.py`` does (``fit_fusion.collect``: the product's own
search statement and features), plus each candidate chunk's stored embedding. Each question's
candidates are scored by the learned fusion, de-duplicated by the product's
``best_distinct`` (its best 40), then re-ranked greedily to 20 by one of:

- ``mmr``: maximal marginal relevance, ``lam * relevance - (1 - lam) * max cosine`` with the
  candidates already chosen (the stored MiniLM vectors); the relevance is the fused
  probability, or its logit;
- ``duplicate``: a candidate whose cosine with one already chosen exceeds ``tau`` goes last;
- ``session``: the logit minus ``alpha`` for each candidate already chosen from the same
  conversation and day (LoCoMo's sessions are days; in the session layout and LongMemEval a
  session is also a conversation). A negative ``alpha`` concentrates instead.

Two scorings: the shipped weights (``memory/recall/fusion_weights.py``: what runs, but fitted
on these very questions) and the joint cross-validation's held-out fits (each question scored
by a fit that did not see it: what generalises). For each family the parameter is tuned on
one benchmark (LoCoMo: mean R@10 of both layouts; LongMemEval: R@10, then R@5) and measured on
the other, both ways. Recall here is over candidates of the index alone (no unindexed turns:
everything is indexed before the questions), as ``fit_fusion.py`` measures.

    python bench/diversify_eval.py --data ../shared/bench/locomo_dev.json \
        --lme-data ../shared/bench/longmemeval_dev.json --cache /tmp/diversify.pickle
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pickle
import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import fit_fusion as ff
import longmemeval_eval as lme
import numpy as np
from common import Server, database, write_json
from memory_eval import ADVERSARIAL, KS, RATE_LIMIT_PER_MINUTE, load_questions
from memory_eval import load as load_both_layouts
from sqlalchemy import text

from memory.recall.found import best_distinct
from memory.recall.fusion import FEATURE_NAMES, fusion_features, learned_scores
from memory.storage.db import Database

DEPTH = 100  # MEMORY_CANDIDATES
POOL = 40  # the distinct candidates a re-ranking chooses from
TOP = 20  # what the memory API returns to the evals (k = 20)
BENCHES = ("locomo-conversation", "locomo-session", ff.LME)
CHUNK_EMBEDDING = text(
    """
    SELECT embedding::text FROM memory_items
    WHERE index_id = 1 AND turn_id = :turn_id AND chunk_index = :chunk_index
      AND kind = 'chunk' AND key_index = 0 AND deleted_at IS NULL
    """
)


async def collect(
    args: argparse.Namespace, questions: list[Any], sample_ids: list[str], pool: lme.Pool
) -> Any:
    """fit_fusion's candidates of every question, and each candidate's stored vector (or read --cache)."""
    if args.cache and args.cache.exists():
        return pickle.loads(args.cache.read_bytes())
    with database(args.database_url) as url:
        if not args.no_load:
            async with Server(url, with_workers=True, rate_limit_per_minute=RATE_LIMIT_PER_MINUTE) as server:
                await load_both_layouts(server.url, args.data, sample_ids)
                await lme.load(server.url, pool)
        asked = await ff.collect(url, questions, pool, DEPTH)
        db = Database(url, pool_size=2)
        vectors: dict[tuple[Any, int], list[float]] = {}
        embeddings = []
        try:
            async with db.session() as session:
                for a in asked:
                    for h in a.hits:
                        key = (h.turn_id, h.chunk_index)
                        if key not in vectors:
                            found = await session.execute(
                                CHUNK_EMBEDDING, {"turn_id": h.turn_id, "chunk_index": h.chunk_index}
                            )
                            vectors[key] = json.loads(found.scalar_one())
                    embeddings.append([vectors[(h.turn_id, h.chunk_index)] for h in a.hits])
        finally:
            await db.dispose()
    collected = (asked, embeddings)
    if args.cache:
        args.cache.write_bytes(pickle.dumps(collected))
    return collected


@dataclass
class Ranked:
    """One question's distinct candidates, best first (indices into its hits), and their fused scores."""

    asked: ff.Asked
    order: list[int]
    scores: np.ndarray
    vectors: np.ndarray

    def logits(self, picked: list[int]) -> np.ndarray:
        p = np.clip(self.scores[picked], 1e-12, 1 - 1e-12)
        return np.log(p / (1 - p))


def ranked(asked: Sequence[ff.Asked], embeddings: Sequence[Any], scorer: ff.Scorer) -> list[Ranked]:
    out = []
    for a, vectors in zip(asked, embeddings, strict=True):
        scores = np.asarray(scorer(a))
        scored = [replace(h, score=float(s)) for h, s in zip(a.hits, scores, strict=True)]
        position = {id(m): i for i, m in enumerate(scored)}
        order = [position[id(m)] for m in best_distinct(scored, POOL)]
        out.append(Ranked(a, order, scores, np.asarray(vectors, dtype=float)))
    return out


Rerank = Callable[[Ranked], list[int]]


def unchanged(r: Ranked) -> list[int]:
    return r.order[:TOP]


def mmr(lam: float, *, logit: bool) -> Rerank:
    def rerank(r: Ranked) -> list[int]:
        pool = r.order
        relevance = r.logits(pool) if logit else r.scores[pool]
        similarity = r.vectors[pool] @ r.vectors[pool].T
        closest = np.full(len(pool), -np.inf)
        left, chosen = list(range(len(pool))), []
        while left and len(chosen) < TOP:
            values = lam * relevance[left] - (1 - lam) * closest[left] if chosen else relevance[left]
            best = left.pop(int(np.argmax(values)))
            chosen.append(best)
            closest = np.maximum(closest, similarity[best])
        return [pool[i] for i in chosen]

    return rerank


def duplicate(tau: float) -> Rerank:
    def rerank(r: Ranked) -> list[int]:
        kept: list[int] = []
        later: list[int] = []
        for i in r.order:
            if any(float(r.vectors[i] @ r.vectors[j]) > tau for j in kept):
                later.append(i)
            else:
                kept.append(i)
        return (kept + later)[:TOP]

    return rerank


def session(alpha: float) -> Rerank:
    def rerank(r: Ranked) -> list[int]:
        pool = r.order
        relevance = r.logits(pool)
        keys = [
            (s.conversation_id, s.created_at.date() if s.created_at else None)
            for s in (r.asked.signals[i] for i in pool)
        ]
        chosen_per: dict[Any, int] = defaultdict(int)
        left, chosen = list(range(len(pool))), []
        while left and len(chosen) < TOP:
            values = [relevance[i] - alpha * chosen_per[keys[i]] for i in left]
            best = left.pop(int(np.argmax(values)))
            chosen.append(best)
            chosen_per[keys[best]] += 1
        return [pool[i] for i in chosen]

    return rerank


FAMILIES: dict[str, dict[str, Rerank]] = {
    "mmr (probability)": {f"lam={v}": mmr(v, logit=False) for v in (0.99, 0.98, 0.95, 0.9, 0.8)},
    "mmr (logit)": {f"lam={v}": mmr(v, logit=True) for v in (0.9, 0.8, 0.7, 0.5, 0.3)},
    "duplicate": {f"tau={v}": duplicate(v) for v in (0.95, 0.9, 0.85, 0.8)},
    "session": {f"alpha={v}": session(v) for v in (0.05, 0.1, 0.25, 0.5, 1.0, -0.1, -0.25)},
}


def tables(questions: Sequence[Ranked], rerank: Rerank) -> dict[str, dict[str, dict[str, float]]]:
    """Recall@k per benchmark (the two LoCoMo layouts apart and together), overall and per group."""
    measured: dict[str, dict[str, list[dict[int, float]]]] = defaultdict(lambda: defaultdict(list))
    for r in questions:
        a = r.asked
        found = [a.hits[i].external_id for i in rerank(r)]
        recall = {k: len(set(found[:k]) & a.evidence) / len(a.evidence) for k in KS}
        for bench in {a.bench, "locomo" if not a.is_lme else ff.LME}:
            measured[bench]["overall"].append(recall)
            measured[bench][a.group].append(recall)
    return {
        bench: {
            group: {f"R@{k}": round(statistics.fmean(r[k] for r in rows), 3) for k in KS} | {"n": len(rows)}
            for group, rows in groups.items()
        }
        for bench, groups in measured.items()
    }


def locomo_key(t: dict[str, Any]) -> float:
    return statistics.fmean(t[b]["overall"]["R@10"] for b in BENCHES[:2])


def lme_key(t: dict[str, Any]) -> tuple[float, float]:
    return t[ff.LME]["overall"]["R@10"], t[ff.LME]["overall"]["R@5"]


def line(t: dict[str, Any]) -> str:
    def r10(bench: str, group: str) -> str:
        return f"{t[bench][group]['R@10']:.3f}" if group in t[bench] else "-"

    overall = ["/".join(f"{t[b]['overall'][f'R@{k}']:.3f}" for k in KS) for b in BENCHES]
    groups = [r10("locomo", "multi-hop"), r10("locomo", "open-domain"), r10(ff.LME, "multi-session")]
    return "  ".join(overall + groups)


def measure(questions: Sequence[Ranked]) -> dict[str, Any]:
    """Every variant's tables, and each family tuned on one benchmark, measured on the other."""
    print(
        f"{'R@1/5/10/20':<28}{'LoCoMo conversation':<25}{'LoCoMo session':<25}{'LongMemEval':<25}"
        "R@10: multi-hop, open-domain, LME multi-session"
    )
    none = tables(questions, unchanged)
    print(f"{'none':<28}{line(none)}", flush=True)
    result: dict[str, Any] = {"none": none, "families": {}}
    for family, variants in FAMILIES.items():
        measured = {}
        for name, rerank in variants.items():
            measured[name] = tables(questions, rerank)
            print(f"{family + ' ' + name:<28}{line(measured[name])}", flush=True)
        on_locomo = max(measured, key=lambda n: locomo_key(measured[n]))
        on_lme = max(measured, key=lambda n: lme_key(measured[n]))
        result["families"][family] = {
            "variants": measured,
            "tuned_on_locomo": {"picked": on_locomo, ff.LME: measured[on_locomo][ff.LME]["overall"]},
            "tuned_on_longmemeval": {"picked": on_lme, "locomo": measured[on_lme]["locomo"]["overall"]},
        }
        print(
            f"  tuned on LoCoMo ({on_locomo}) -> LongMemEval "
            f"{measured[on_locomo][ff.LME]['overall']} (none: {none[ff.LME]['overall']})\n"
            f"  tuned on LongMemEval ({on_lme}) -> LoCoMo "
            f"{measured[on_lme]['locomo']['overall']} (none: {none['locomo']['overall']})",
            flush=True,
        )
    return result


async def run(args: argparse.Namespace) -> dict[str, Any]:
    data = load_questions(args.data, args.limit_conversations)
    questions = [q for q in data.questions if q.category != ADVERSARIAL]
    pool = lme.load_pool(args.lme_data, args.lme_limit_questions)
    asked, embeddings = await collect(args, questions, data.sample_ids, pool)
    for a in asked:  # the features as this checkout computes them
        a.features = fusion_features(a.signals, a.query)
    result: dict[str, Any] = {"benchmark": "diversify_eval", "pool": POOL, "top": TOP, "scorings": {}}
    every = list(range(len(FEATURE_NAMES)))
    conversations = sorted({a.unit for a in asked if not a.is_lme})
    # as fit_fusion's joint cross-validation: fold i holds out LoCoMo conversation i (every one
    # of the slice's five is held out once) and a fifth of the LongMemEval questions
    folds = [
        ({conversations[i]} if i < len(conversations) else set(), units)
        for i, units in enumerate(ff.lme_folds(asked))
    ]
    scorings: dict[str, ff.Scorer] = {
        "shipped weights": lambda a: np.asarray(learned_scores(a.signals, a.query)),
        "held-out fits (joint cross-validation)": ff.held_out(asked, every, folds),
    }
    for name, scorer in scorings.items():
        print(f"\n{name}")
        result["scorings"][name] = measure(ranked(asked, embeddings, scorer))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ff.slice_arguments(parser)
    parser.add_argument("--no-load", action="store_true", help="both slices are already in --database-url")
    parser.add_argument("--out", type=Path, default=Path("bench/results/diversify_eval.json"))
    parser.add_argument(
        "--cache", type=Path, help="keep the candidates and their vectors here and reuse them"
    )
    args = parser.parse_args()
    write_json(args.out, asyncio.run(run(args)))


if __name__ == "__main__":
    main()
