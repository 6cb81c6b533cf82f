"""Would cheap lexical cues of each candidate lift the learned fusion, held out, on both kinds of chat?

The learned fusion (``memory/recall/fusion.py``) already reads the cosine and BM25 values,
who said it, the length, the neighbours, and answer types (a "when" question and a time
word, "how many" and a number, "where"/"who" and a capitalised word). This measures cues
it does not have, each computed from the question and the candidate's stored text alone:

- ``proper_overlap``: the share of the question's capitalised words (not the first word of a
  sentence, not "I") that the candidate contains;
- ``number_overlap``: the share of the question's numbers, months, weekdays and number words
  that the candidate contains;
- ``when_date``: a "when" question and a specific time expression in the candidate (a date,
  a month, a weekday, a year, "yesterday", "N weeks ago"), stricter than ``when_time``;
- ``count_noun``: a "how many X" question and a number within three words before X;
- ``coverage``: the share of the question's content terms (stopwords removed, stemmed: the
  keyword index's own terms) that the candidate contains; ``idf_coverage`` weighs each term by
  its rarity among the question's candidates; ``best_sentence_coverage``: the same share in
  the candidate's best sentence; ``bigram_coverage``: the share of the question's adjacent
  term pairs found adjacent in the candidate;
- ``is_user_role``: the turn is the user's (role user), beside ``model_reply_unasked``.

The data and the candidates are fit_fusion's (``fit_fusion.collect_all``: a real
``chatmem serve`` imports both slices, the product's own search statement gives each
question's candidates and signals; ``--cache`` keeps them). Each variant is the shipped
features plus some cue columns, measured with fit_fusion's own protocols: the joint
cross-validation (each fold holds out one LoCoMo conversation and a fifth of the LongMemEval
questions), fitted on all of LoCoMo and measured on LongMemEval, and the other way round.
A cue is worth shipping only if it helps held out on both benchmarks, or helps one and costs
nothing on the other.

    python bench/cue_eval.py --data ../shared/bench/locomo_dev.json \
        --lme-data ../shared/bench/longmemeval_dev.json --cache /tmp/fit.pickle

A measured negative, run by hand: it is not among ``run_small.py``'s runs (its fits take
minutes even on two conversations).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import fit_fusion as ff
import longmemeval_eval as lme
import numpy as np
from common import write_json
from memory_eval import ADVERSARIAL, KS, load_questions

from memory.recall.fusion import FEATURE_NAMES, CandidateSignals
from memory.recall.keywords import query_terms, search_terms

DEPTH = 100  # MEMORY_CANDIDATES
PAIRED_K = 10
BOOTSTRAP = 2000

_MONTHS = (
    "january february march april may june july august september october november december "
    "jan feb mar apr jun jul aug sep sept oct nov dec"
).split()
_WEEKDAYS = "monday tuesday wednesday thursday friday saturday sunday".split()
_NUMBER_WORDS = (
    "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "twenty thirty forty fifty hundred thousand dozen once twice first second third half"
).split()
_NUMERIC = re.compile(r"\d+(?:[.,]\d+)?")
_WORD = re.compile(r"[A-Za-z][A-Za-z'’-]*|\d+(?:[.,]\d+)?")
# Capitalised words that are not names.
_NOT_NAMES = {"i", "i'm", "i've", "i'd", "i'll"} | set(_MONTHS) | set(_WEEKDAYS)
_SENTENCE_END = re.compile(r"[.!?]\s+|\n+")
_ASKS_WHEN = re.compile(
    r"\bwhen\b|what (?:date|time|year|month|day)|which (?:year|month|day|date)|how long ago", re.I
)
_SPECIFIC_TIME = re.compile(
    r"\b(?:yesterday|today|tonight|tomorrow|ago"
    r"|last (?:week|month|year|night|weekend|summer|winter|spring|fall)"
    r"|(?:mon|tues|wednes|thurs|fri|satur|sun)days?"
    r"|january|february|march|april|may|june|july|august|september|october|november|december"
    r"|(?:19|20)\d\d|\d{1,2}(?:st|nd|rd|th)|\d{1,2}/\d{1,2})\b",
    re.I,
)
_HOW_MANY = re.compile(r"\bhow many (\w+)(?: of)?(?: \w+)?", re.I)
_NUMBER_TOKEN = re.compile(
    r"^(?:\d+(?:[.,]\d+)?|" + "|".join(_NUMBER_WORDS) + r"|a|an|several|few|couple)$", re.I
)

CUES: tuple[str, ...] = (
    "proper_overlap",
    "number_overlap",
    "when_date",
    "count_noun",
    "coverage",
    "idf_coverage",
    "best_sentence_coverage",
    "bigram_coverage",
    "is_user_role",
)


def proper_words(query: str) -> set[str]:
    """The query's capitalised words that are not a sentence's first word (lower-cased)."""
    found = set()
    for sentence in _SENTENCE_END.split(query):
        words = _WORD.findall(sentence)
        for word in words[1:]:
            bare = word.lower().replace("’", "'").removesuffix("'s")
            if word[:1].isupper() and bare not in _NOT_NAMES:
                found.add(bare)
    return found


def number_words(text: str) -> set[str]:
    """Numbers, months, weekdays and number words of a text (lower-cased; months abbreviated)."""
    found = set(_NUMERIC.findall(text))
    for word in re.findall(r"[a-z]+", text.lower()):
        if word in _MONTHS:
            found.add(word[:3])
        elif word in _WEEKDAYS or word in _NUMBER_WORDS:
            found.add(word)
    return found


def _share(wanted: set[str], have: set[str]) -> float:
    return len(wanted & have) / len(wanted) if wanted else 0.0


def cue_columns(signals: Sequence[CandidateSignals], query: str) -> np.ndarray:
    """One row of ``CUES`` per candidate."""
    if not signals:
        return np.zeros((0, len(CUES)))
    names = proper_words(query)
    numbers = number_words(query)
    asks_when = _ASKS_WHEN.search(query) is not None
    counted = [_stem_term(m.group(1)) for m in _HOW_MANY.finditer(query)]
    terms = query_terms(query)
    wanted = set(terms)
    pairs = set(itertools.pairwise(terms))
    texts = [s.text for s in signals]
    candidate_terms = [search_terms(t).split() for t in texts]
    term_sets = [set(ts) for ts in candidate_terms]
    frequency = Counter(t for ts in term_sets for t in ts & wanted)
    idf = {t: math.log((len(signals) + 1) / (frequency[t] + 0.5)) for t in wanted}
    idf_total = sum(idf.values()) or 1.0
    rows = []
    for s, text, words, have in zip(signals, texts, candidate_terms, term_sets, strict=True):
        lowered = {w.lower().replace("’", "'").removesuffix("'s") for w in _WORD.findall(text)}
        sentence_best = 0.0
        if wanted:
            for sentence in _SENTENCE_END.split(text):
                sentence_best = max(sentence_best, _share(wanted, set(search_terms(sentence).split())))
        adjacent = set(itertools.pairwise(words))
        count_hit = 0.0
        if counted:
            for i, w in enumerate(words):
                if w in counted and any(_NUMBER_TOKEN.match(x) for x in words[max(0, i - 3) : i]):
                    count_hit = 1.0
                    break
        rows.append(
            (
                _share(names, lowered),
                _share(numbers, number_words(text)),
                1.0 if asks_when and _SPECIFIC_TIME.search(text) else 0.0,
                count_hit,
                _share(wanted, have),
                sum(idf[t] for t in wanted & have) / idf_total,
                sentence_best,
                _share(pairs, adjacent),
                1.0 if s.role == "user" else 0.0,
            )
        )
    return np.asarray(rows, dtype=float)


def _stem_term(word: str) -> str:
    terms = search_terms(word).split()
    return terms[0] if terms else word.lower()


# Each cue alone, the groups the brief names, and all of them.
VARIANTS: dict[str, tuple[str, ...]] = {
    "shipped features": (),
    **{f"+ {cue}": (cue,) for cue in CUES},
    "+ names and numbers": ("proper_overlap", "number_overlap"),
    "+ question types": ("when_date", "count_noun"),
    "+ coverages": ("coverage", "idf_coverage", "best_sentence_coverage", "bigram_coverage"),
    "+ all cues": CUES,
}


def with_cues(asked: Sequence[ff.Asked]) -> None:
    """Append the cue columns to every question's features (after the shipped ones)."""
    for a in asked:
        a.features = np.hstack([a.features[:, : len(FEATURE_NAMES)], cue_columns(a.signals, a.query)])


def layout_tables(asked: Sequence[ff.Asked], scorer: ff.Scorer) -> dict[str, Any]:
    """fit_fusion's tables, plus LoCoMo's conversation layout on its own (the issue's target)."""
    out = ff.both_tables(asked, scorer)
    conversation = [a for a in asked if a.bench == "locomo-conversation"]
    if conversation:
        out["locomo-conversation"] = ff.table(conversation, scorer)
    return out


def joint_cv(asked: Sequence[ff.Asked], columns: list[int]) -> tuple[dict[str, Any], dict[int, float]]:
    """fit_fusion.joint_cv, with the conversation layout's own table beside; and each held-out
    question's R@10 (by ``id``), for the paired comparison."""
    conversations = sorted({a.unit for a in asked if not a.is_lme})
    lme_units = ff.lme_folds(asked)
    folds = [({conversations[i]} if i < len(conversations) else set(), lme_units[i]) for i in range(ff.FOLDS)]
    held = set().union(*(units for units, _ in folds))
    mine = [a for a in asked if a.is_lme or a.unit in held]
    scorer = ff.held_out(asked, columns, folds)
    return layout_tables(mine, scorer), {id(a): a.recalls(scorer(a))[PAIRED_K] for a in mine}


def paired(asked: Sequence[ff.Asked], base: dict[int, float], variant: dict[int, float]) -> dict[str, Any]:
    """Per benchmark: questions whose held-out R@10 the cues raise / lower, and a bootstrap 95%
    interval of the mean change. A LoCoMo question counts once (its two layouts averaged)."""
    out: dict[str, Any] = {}
    for bench in ("locomo", ff.LME):
        deltas: dict[tuple[str, str, str], list[float]] = {}
        for a in asked:
            if id(a) in base and a.is_lme == (bench == ff.LME):
                deltas.setdefault((a.unit, a.group, a.query), []).append(variant[id(a)] - base[id(a)])
        values = np.array([float(np.mean(d)) for d in deltas.values()])
        if not len(values):
            continue
        means = np.random.default_rng(0).choice(values, (BOOTSTRAP, len(values))).mean(axis=1)
        out[bench] = {
            "questions": len(values),
            "raised": int((values > 0).sum()),
            "lowered": int((values < 0).sum()),
            "mean_change": round(float(values.mean()), 4),
            "ci95": [round(float(np.percentile(means, 2.5)), 4), round(float(np.percentile(means, 97.5)), 4)],
        }
    return out


def across(asked: Sequence[ff.Asked], columns: list[int]) -> dict[str, Any]:
    locomo = [a for a in asked if not a.is_lme]
    only_lme = [a for a in asked if a.is_lme]
    if not locomo or not only_lme:
        return {}
    return {
        "locomo_to_longmemeval": layout_tables(only_lme, ff.scorer_of(ff.fit(locomo, columns))),
        "longmemeval_to_locomo": layout_tables(locomo, ff.scorer_of(ff.fit(only_lme, columns))),
    }


def _overall(tables: dict[str, Any], bench: str) -> str:
    t = tables.get(bench)
    return "/".join(f"{t['overall'][f'R@{k}']:.3f}" for k in (1, 5, 10)) if t else "-"


async def run(args: argparse.Namespace) -> dict[str, Any]:
    data = load_questions(args.data, args.limit_conversations)
    questions = [q for q in data.questions if q.category != ADVERSARIAL]
    pool = lme.load_pool(args.lme_data, args.lme_limit_questions)
    args.depth = [DEPTH]
    loading, by_depth = await ff.collect_all(args, questions, data.sample_ids, pool)
    asked = by_depth[DEPTH]
    with_cues(asked)
    base = list(range(len(FEATURE_NAMES)))
    result: dict[str, Any] = {
        "benchmark": "cue_eval",
        "data": [str(args.data), str(args.lme_data)],
        "questions": {"locomo": len(questions), ff.LME: len(pool.questions)},
        "load_seconds": loading,
        "cues": list(CUES),
        "ks": list(KS),
        "variants": {},
    }
    print(
        f"{'variant':<30}{'cv LoCoMo both':>18}{'cv LoCoMo conv':>18}{'cv LME':>18}"
        f"{'LoCoMo->LME':>18}{'LME->LoCoMo':>18}   (R@1/R@5/R@10)  cv R@10 +/- questions"
    )
    baseline: dict[int, float] = {}
    for name, cues in VARIANTS.items():
        columns = base + [len(FEATURE_NAMES) + CUES.index(c) for c in cues]
        cv, per_question = joint_cv(asked, columns)
        baseline = baseline or per_question
        change = paired(asked, baseline, per_question)
        cross = across(asked, columns)
        result["variants"][name] = {"cues": list(cues), "joint_cv": cv, "paired_r10": change, "across": cross}
        moved = "  ".join(f"{b} +{c['raised']}/-{c['lowered']}" for b, c in change.items())
        print(
            f"{name:<30}{_overall(cv, 'locomo'):>18}{_overall(cv, 'locomo-conversation'):>18}"
            f"{_overall(cv, ff.LME):>18}"
            f"{_overall(cross.get('locomo_to_longmemeval', {}), ff.LME):>18}"
            f"{_overall(cross.get('longmemeval_to_locomo', {}), 'locomo'):>18}   {moved}",
            flush=True,
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ff.slice_arguments(parser)
    parser.add_argument("--no-load", action="store_true", help="both slices are already in --database-url")
    parser.add_argument("--out", type=Path, default=Path("bench/results/cue_eval.json"))
    parser.add_argument(
        "--cache", type=Path, help="fit_fusion's cache of the collected candidates (depth 100)"
    )
    args = parser.parse_args()
    write_json(args.out, asyncio.run(run(args)))


if __name__ == "__main__":
    main()
