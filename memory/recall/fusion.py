"""Fusion: how the dense and keyword rankings of a memory become one score.

Two methods, chosen by ``MEMORY_FUSION``, both scored here and nowhere else (the search
statement only fetches ranks and signals):

- ``learned`` (the default): a fixed linear formula over cheap signals of each candidate;
- ``rrf``: weighted reciprocal rank fusion of the two ranks, kept so operators can fall
  back to it. Its formula, ``Fusion.rrf``, is also one of the learned formula's signals.

Reciprocal rank fusion sees only two ranks. On LoCoMo (``bench/fit_fusion.py``) three
things it cannot express carry most of the evidence it misses:

- the score *values* (a cosine of 0.62 next to a best of 0.64 is not "rank 7");
- the neighbouring turns: the answer is often the reply right after the turn that
  matches the question ("What did you research?" / "Adoption agencies."), so the
  previous and next turn's scores are features of a candidate;
- priors: the question names this turn's speaker; the turn shared a captioned image;
  whether it (or the turn before it) is itself a question. Not its length: LoCoMo's
  evidence turns are longer than most, but a model's replies are longer still, and a
  length prior ranked a long reply quoting a fact above the user's own statement of it.

Every signal comes from the search statement (``memory.recall.index_search``) or the
candidate's own row; the speaker names are the ``name`` values of the user's own
candidates, so nothing here knows about any data set. The weights
(``memory.recall.fusion_weights``) were fitted by ``bench/fit_fusion.py`` through this very
module, so what is fitted is what runs. The learned score is the logistic of the weighted
sum: a probability-like value in (0, 1) that ``MEMORY_MIN_SCORE`` thresholds the same way
it thresholds the RRF score.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from memory.recall import fusion_weights

FusionMethod = Literal["learned", "rrf"]

# Shared with the SQL (``memory.recall.index_search``): one definition of the question test.
QUESTION_PATTERN = r"\?\s*$"
_QUESTION = re.compile(QUESTION_PATTERN)


@dataclass(frozen=True, slots=True)
class Fusion:
    """How the dense and keyword rankings are fused and how deep each one goes.

    The weights and ``rrf_k`` are RRF's only; ``candidates`` is the depth of each list. The
    RRF defaults were measured on LoCoMo: the keyword list weighs 1.5x the dense list (the
    keyword ranking is the stronger signal there), and a small k lets the top of each list
    matter more than the long tail.
    """

    method: FusionMethod = "learned"
    keyword_weight: float = 1.5
    vector_weight: float = 1.0
    rrf_k: float = 10.0
    candidates: int = 50

    def rrf(self, vector_rank: int | None, keyword_rank: int | None) -> float:
        """Weighted reciprocal rank fusion of two ranks, normalised so first in both is 1.0."""
        total = 0.0
        if vector_rank is not None:
            total += self.vector_weight / (self.rrf_k + vector_rank)
        if keyword_rank is not None:
            total += self.keyword_weight / (self.rrf_k + keyword_rank)
        return total / ((self.vector_weight + self.keyword_weight) / (self.rrf_k + 1))

    def scores(self, candidates: Sequence[CandidateSignals], query_text: str) -> list[float]:
        """The fused score of each candidate of one list, higher is more relevant."""
        if self.method == "rrf":
            return [self.rrf(c.vector_rank, c.keyword_rank) for c in candidates]
        return learned_scores(candidates, query_text)


DEFAULT_FUSION = Fusion()
# RRF as a signal of the learned formula: its constants are part of the fitted formula,
# not the RRF settings.
RRF_FEATURE = Fusion(method="rrf", keyword_weight=1.5, vector_weight=1.0, rrf_k=10.0)


SIGNALS: tuple[str, ...] = (
    "cosine",
    "cosine_below_best",
    "vector_rank_reciprocal",
    "bm25_of_best",
    "keyword_rank_reciprocal",
    "keyword_matched",
    "rrf",
    "previous_cosine",
    "previous_bm25_of_best",
    "previous_rrf",
    "next_cosine",
    "next_bm25_of_best",
    "next_rrf",
    "neighbour_rrf_max",
    "speaker_named",
    "has_caption",
    "is_question",
    "previous_is_question",
)
_YES_NO = {"keyword_matched", "speaker_named", "has_caption", "is_question", "previous_is_question"}
# Every signal that is not yes/no also enters squared, so the formula can bend: a cosine
# just below the best counts for more than a straight line gives it (held out on LoCoMo,
# bench/fit_fusion.py: R@10 0.792 -> 0.802).
SQUARED: tuple[str, ...] = tuple(name for name in SIGNALS if name not in _YES_NO)
FEATURE_NAMES: tuple[str, ...] = SIGNALS + tuple(f"{name}_squared" for name in SQUARED)
_SQUARED_COLUMNS = [SIGNALS.index(name) for name in SQUARED]


@dataclass(frozen=True, slots=True)
class NeighbourSignals:
    """The scores of the turn just before or after a candidate in its conversation."""

    cosine: float
    bm25: float
    vector_rank: int | None
    keyword_rank: int | None
    is_question: bool


@dataclass(frozen=True, slots=True)
class CandidateSignals:
    """What the fusion knows of one candidate: its scores, its neighbours' and its own row."""

    cosine: float
    # 0.0 when none of the query's terms is in the memory.
    bm25: float
    # Positions in the dense and keyword top lists; None when outside them.
    vector_rank: int | None
    keyword_rank: int | None
    name: str | None
    text: str
    # The turn shared an image with a caption (``memory.recall.keywords.photo_caption``).
    has_caption: bool
    previous: NeighbourSignals | None
    next: NeighbourSignals | None


def is_question(text: str) -> bool:
    """The text ends with a question mark."""
    return _QUESTION.search(text) is not None


def _reciprocal(rank: int | None) -> float:
    return 0.0 if rank is None else 1.0 / (RRF_FEATURE.rrf_k + rank)


def named_speakers(query_text: str, names: Sequence[str | None]) -> set[str]:
    """The distinct speaker names (as stored on memories) that the query mentions as words."""
    found = set()
    for name in {n.strip() for n in names if n and n.strip()}:
        if re.search(rf"(?<!\w){re.escape(name)}(?!\w)", query_text, re.IGNORECASE):
            found.add(name)
    return found


def fusion_features(candidates: Sequence[CandidateSignals], query_text: str) -> np.ndarray:
    """One row of ``FEATURE_NAMES`` per candidate (raw, not standardised)."""
    if not candidates:
        return np.zeros((0, len(FEATURE_NAMES)))
    best_cosine = max(c.cosine for c in candidates)
    best_bm25 = max(max(c.bm25 for c in candidates), 1e-9)
    named = named_speakers(query_text, [c.name for c in candidates])
    # Only a question about one person says whose turn the answer is likely to be.
    speaker = next(iter(named)) if len(named) == 1 else None
    rows = []
    for c in candidates:
        previous, following = c.previous, c.next
        previous_rrf = RRF_FEATURE.rrf(previous.vector_rank, previous.keyword_rank) if previous else 0.0
        next_rrf = RRF_FEATURE.rrf(following.vector_rank, following.keyword_rank) if following else 0.0
        rows.append(
            (
                c.cosine,
                c.cosine - best_cosine,
                _reciprocal(c.vector_rank),
                c.bm25 / best_bm25,
                _reciprocal(c.keyword_rank),
                1.0 if c.bm25 > 0 else 0.0,
                RRF_FEATURE.rrf(c.vector_rank, c.keyword_rank),
                previous.cosine if previous else 0.0,
                previous.bm25 / best_bm25 if previous else 0.0,
                previous_rrf,
                following.cosine if following else 0.0,
                following.bm25 / best_bm25 if following else 0.0,
                next_rrf,
                max(previous_rrf, next_rrf),
                1.0 if speaker is not None and (c.name or "").strip().lower() == speaker.lower() else 0.0,
                1.0 if c.has_caption else 0.0,
                1.0 if is_question(c.text) else 0.0,
                1.0 if previous is not None and previous.is_question else 0.0,
            )
        )
    signals = np.asarray(rows, dtype=float)
    return np.hstack([signals, signals[:, _SQUARED_COLUMNS] ** 2])


def linear_scores(
    features: np.ndarray,
    *,
    means: Sequence[float],
    scales: Sequence[float],
    weights: Sequence[float],
    intercept: float,
) -> np.ndarray:
    """The logistic of standardised features times weights plus intercept: one score per row."""
    standardised = (features - np.asarray(means)) / np.asarray(scales)
    logits = standardised @ np.asarray(weights) + intercept
    return 1.0 / (1.0 + np.exp(-logits))


def _shipped(table: dict[str, float]) -> list[float]:
    if set(table) != set(FEATURE_NAMES):
        raise RuntimeError(
            "memory.recall.fusion_weights does not match FEATURE_NAMES; refit with bench/fit_fusion.py"
        )
    return [table[name] for name in FEATURE_NAMES]


def learned_scores(candidates: Sequence[CandidateSignals], query_text: str) -> list[float]:
    """The shipped formula's score of each candidate, in (0, 1), higher is more relevant."""
    if not candidates:
        return []
    scores = linear_scores(
        fusion_features(candidates, query_text),
        means=_shipped(fusion_weights.MEANS),
        scales=_shipped(fusion_weights.SCALES),
        weights=_shipped(fusion_weights.WEIGHTS),
        intercept=fusion_weights.INTERCEPT,
    )
    return [float(s) for s in scores]
