"""Fusion: how the dense and keyword rankings of a memory become one score.

Two methods, chosen by ``MEMORY_FUSION``, both scored here and nowhere else (the search
statement only fetches ranks and signals):

- ``learned`` (the default): a fixed linear formula over cheap signals of each candidate;
- ``rrf``: weighted reciprocal rank fusion of the two ranks, kept so operators can fall
  back to it. Its formula, ``Fusion.rrf``, is also one of the learned formula's signals.

Reciprocal rank fusion sees only two ranks. Measured on two kinds of chat, LoCoMo (two
people) and LongMemEval (a user and an assistant; ``bench/fit_fusion.py``), what it cannot
express carries most of the evidence it misses:

- the score *values* (a cosine of 0.62 next to a best of 0.64 is not "rank 7");
- the best sentence of a long message (``memory.recall.sentence_keys``): the fact a user
  states inside a request about something else matches by its sentence, not by the chunk;
- who said it: in a user-assistant chat the evidence is the user's own words, while the
  model's long replies repeat the topic (and the fact) at length. A model's reply (role
  assistant, no speaker name) is a signal unless the query asks what the assistant said;
  so is a turn being a question (the user's question is not the user's statement);
- the neighbouring turns, split by author: after a person's question comes its answer
  ("What did you research?" / "Adoption agencies."), while a model's reply next to a user
  statement only restates it, so the two get separate weights;
- the best candidate of the same conversation and day (a session about the topic);
- answer types (a "when" question and a memory with a time word; "how many" and a
  number; "where"/"who" and a name), and recency (more so when the query asks for the
  current value of something that changed);
- priors only LoCoMo has, kept because they are zero where absent: the question names
  this turn's speaker; the turn shared a captioned image.

Every signal comes from the search statement (``memory.recall.index_search``) or the
candidate's own row; the speaker names are the ``name`` values of the user's own
candidates, so nothing here knows about any data set. The weights
(``memory.recall.fusion_weights``) were fitted by ``bench/fit_fusion.py`` through this very
module, so what is fitted is what runs. The learned score is the logistic of the weighted
sum: a probability-like value in (0, 1) that ``MEMORY_MIN_SCORE`` thresholds the same way
it thresholds the RRF score.
"""

from __future__ import annotations

import math
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
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
    candidates: int = 100

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


_NEIGHBOUR_SIGNALS = tuple(
    f"{side}_{author}_{score}"
    for side in ("previous", "next")
    for author in ("person", "model")
    for score in ("cosine", "bm25_of_best", "rrf")
)
SIGNALS: tuple[str, ...] = (
    # the candidate's own match
    "cosine",
    "cosine_below_best",
    "vector_rank_reciprocal",
    "bm25_of_best",
    "keyword_rank_reciprocal",
    "keyword_matched",
    "rrf",
    "log_length",
    "is_question",
    # its best sentence key (the chunk's own cosine when it has none) and that key's dense rank
    "key_cosine",
    "key_cosine_below_best",
    "key_rank_reciprocal",
    # its neighbours, split by author: a person's turn (the question a reply answers) and a
    # model's reply (which restates what the user just said) mean different things
    *_NEIGHBOUR_SIGNALS,
    "previous_person_is_question",
    "previous_model_is_question",
    "neighbour_person_rrf_max",
    "neighbour_model_rrf_max",
    # who said it: a model's reply, when the query does not ask what the assistant said
    "model_reply_unasked",
    # the best candidate of the same conversation and day (a session about the topic)
    "day_best_cosine",
    "day_best_bm25_of_best",
    # answer types: the question asks when / how many / where / who and the memory has one
    "when_time",
    "count_number",
    "where_place",
    "who_name",
    # newer memories of a fact that changed; more so when the query asks for the current value
    "recency",
    "recency_asked",
    # zero where absent (user-assistant chats): the query names the speaker; a shared photo
    "speaker_named",
    "has_caption",
)
_YES_NO = {
    "keyword_matched",
    "is_question",
    "previous_person_is_question",
    "previous_model_is_question",
    "model_reply_unasked",
    "when_time",
    "count_number",
    "where_place",
    "who_name",
    "speaker_named",
    "has_caption",
}
# Every signal that is not yes/no also enters squared, so the formula can bend: a cosine
# just below the best counts for more than a straight line gives it.
SQUARED: tuple[str, ...] = tuple(name for name in SIGNALS if name not in _YES_NO)
FEATURE_NAMES: tuple[str, ...] = SIGNALS + tuple(f"{name}_squared" for name in SQUARED)
_SQUARED_COLUMNS = [SIGNALS.index(name) for name in SQUARED]

# The query asks about the assistant's own words: then a model's reply is what is wanted.
_ASKS_ASSISTANT = re.compile(
    r"\byou (?:\w+ )?(?:said|told|mentioned|recommended|suggested|gave|provided|listed|shared|wrote"
    r"|explained|described|remind|recommend|suggest)|remind me"
    r"|our (?:previous |last |earlier )?(?:conversation|chat|discussion)",
    re.IGNORECASE,
)
_ASKS_WHEN = re.compile(
    r"\bwhen\b|what (?:date|time|year|month|day)|which (?:year|month|day|date)|how long ago"
    r"|how (?:many|much) (?:days|weeks|months|years)",
    re.IGNORECASE,
)
_ASKS_COUNT = re.compile(r"\bhow (?:many|much|often|long|old)\b|\bnumber of\b|\btotal\b", re.IGNORECASE)
_ASKS_WHERE = re.compile(
    r"\bwhere\b|which (?:city|country|place|state|town|restaurant|store|shop)", re.IGNORECASE
)
_ASKS_WHO = re.compile(r"\bwho(?:m|se)?\b|\bwhat(?:'s| is) the name\b", re.IGNORECASE)
_ASKS_CURRENT = re.compile(
    r"\b(?:current(?:ly)?|now|so far|most recent(?:ly)?|latest|last time|these days|still)\b", re.IGNORECASE
)
_TIME_WORDS = re.compile(
    r"\b(?:yesterday|today|tonight|tomorrow|ago|last (?:week|month|year|night|weekend|time)"
    r"|next (?:week|month|year)|this (?:week|month|year|weekend|morning|evening)"
    r"|(?:mon|tues|wednes|thurs|fri|satur|sun)days?"
    r"|january|february|march|april|may|june|july|august|september|october|november|december"
    r"|\d{4}|\d+(?:st|nd|rd|th)|weeks?|months?|years?|days?|weekend|recently|since)\b",
    re.IGNORECASE,
)
_NUMBER_WORDS = re.compile(
    r"\d|\b(?:one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|twenty|thirty|forty|fifty"
    r"|hundred|thousand|dozen|once|twice|first|second|third|half)\b",
    re.IGNORECASE,
)
# A capitalised word inside a sentence: a name or a place.
_NAME_INSIDE = re.compile(r"(?<=[a-z,;:] )[A-Z][a-z]+")


@dataclass(frozen=True, slots=True)
class NeighbourSignals:
    """The scores of the turn just before or after a candidate in its conversation."""

    cosine: float
    bm25: float
    vector_rank: int | None
    keyword_rank: int | None
    is_question: bool
    # The neighbour is a model's reply (``is_model_reply``), not a person's turn.
    by_model: bool = False


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
    role: str = "user"
    conversation_id: uuid.UUID | None = None
    created_at: datetime | None = None
    # The best cosine of the chunk's sentence keys (None: it has none), and the best key's
    # rank among the dense list's keys (None: none of its keys is in the list).
    key_cosine: float | None = None
    key_rank: int | None = None


def is_question(text: str) -> bool:
    """The text ends with a question mark."""
    return _QUESTION.search(text) is not None


def is_model_reply(role: str, name: str | None) -> bool:
    """A reply by the assistant (a model): role assistant and no speaker name.

    An assistant turn with a name is a person (an import of a chat between two people).
    """
    return role == "assistant" and not (name or "").strip()


def asks_about_assistant(query_text: str) -> bool:
    """The query asks what the assistant said ("what did you recommend", "remind me")."""
    return _ASKS_ASSISTANT.search(query_text) is not None


def _reciprocal(rank: int | None) -> float:
    return 0.0 if rank is None else 1.0 / (RRF_FEATURE.rrf_k + rank)


def named_speakers(query_text: str, names: Sequence[str | None]) -> set[str]:
    """The distinct speaker names (as stored on memories) that the query mentions as words."""
    found = set()
    for name in {n.strip() for n in names if n and n.strip()}:
        if re.search(rf"(?<!\w){re.escape(name)}(?!\w)", query_text, re.IGNORECASE):
            found.add(name)
    return found


def _neighbour_values(
    neighbour: NeighbourSignals | None, best_bm25: float
) -> tuple[tuple[float, float, float], tuple[float, float, float], float, float]:
    """(person cosine/bm25/rrf, model cosine/bm25/rrf, person is question, model is question)."""
    zero = (0.0, 0.0, 0.0)
    if neighbour is None:
        return zero, zero, 0.0, 0.0
    values = (
        neighbour.cosine,
        neighbour.bm25 / best_bm25,
        RRF_FEATURE.rrf(neighbour.vector_rank, neighbour.keyword_rank),
    )
    question = 1.0 if neighbour.is_question else 0.0
    if neighbour.by_model:
        return zero, values, 0.0, question
    return values, zero, question, 0.0


def fusion_features(candidates: Sequence[CandidateSignals], query_text: str) -> np.ndarray:
    """One row of ``FEATURE_NAMES`` per candidate (raw, not standardised)."""
    if not candidates:
        return np.zeros((0, len(FEATURE_NAMES)))
    best_cosine = max(c.cosine for c in candidates)
    key_cosines = [c.cosine if c.key_cosine is None else c.key_cosine for c in candidates]
    best_key_cosine = max(key_cosines)
    best_bm25 = max(max(c.bm25 for c in candidates), 1e-9)
    named = named_speakers(query_text, [c.name for c in candidates])
    # Only a question about one person says whose turn the answer is likely to be.
    speaker = next(iter(named)) if len(named) == 1 else None
    asks_assistant = asks_about_assistant(query_text)
    asks_when = _ASKS_WHEN.search(query_text) is not None
    asks_count = _ASKS_COUNT.search(query_text) is not None
    asks_where = _ASKS_WHERE.search(query_text) is not None
    asks_who = _ASKS_WHO.search(query_text) is not None
    asks_current = _ASKS_CURRENT.search(query_text) is not None
    # The best candidate of each conversation and day, and the span of the candidates' dates.
    day_best: dict[tuple[object, object], tuple[float, float]] = {}
    for c in candidates:
        key = _day(c)
        cosine, bm25 = day_best.get(key, (-1.0, 0.0))
        day_best[key] = (max(cosine, c.cosine), max(bm25, c.bm25))
    stamps = [c.created_at.timestamp() for c in candidates if c.created_at is not None]
    oldest, newest = (min(stamps), max(stamps)) if stamps else (0.0, 0.0)
    rows = []
    for c, key_cosine in zip(candidates, key_cosines, strict=True):
        p_person, p_model, p_person_q, p_model_q = _neighbour_values(c.previous, best_bm25)
        n_person, n_model, _, _ = _neighbour_values(c.next, best_bm25)
        stamp = c.created_at.timestamp() if c.created_at is not None else oldest
        recency = (stamp - oldest) / max(newest - oldest, 1.0)
        day_cosine, day_bm25 = day_best[_day(c)]
        # Only a where/who question reads it: the search over a long reply is most of this loop.
        has_name = (asks_where or asks_who) and _NAME_INSIDE.search(c.text) is not None
        rows.append(
            (
                c.cosine,
                c.cosine - best_cosine,
                _reciprocal(c.vector_rank),
                c.bm25 / best_bm25,
                _reciprocal(c.keyword_rank),
                1.0 if c.bm25 > 0 else 0.0,
                RRF_FEATURE.rrf(c.vector_rank, c.keyword_rank),
                math.log1p(len(c.text)),
                1.0 if is_question(c.text) else 0.0,
                key_cosine,
                key_cosine - best_key_cosine,
                _reciprocal(c.key_rank),
                *p_person,
                *p_model,
                *n_person,
                *n_model,
                p_person_q,
                p_model_q,
                max(p_person[2], n_person[2]),
                max(p_model[2], n_model[2]),
                1.0 if is_model_reply(c.role, c.name) and not asks_assistant else 0.0,
                day_cosine - best_cosine,
                day_bm25 / best_bm25,
                1.0 if asks_when and _TIME_WORDS.search(c.text) else 0.0,
                1.0 if asks_count and _NUMBER_WORDS.search(c.text) else 0.0,
                1.0 if asks_where and has_name else 0.0,
                1.0 if asks_who and has_name else 0.0,
                recency,
                recency if asks_current else 0.0,
                1.0 if speaker is not None and (c.name or "").strip().lower() == speaker.lower() else 0.0,
                1.0 if c.has_caption else 0.0,
            )
        )
    signals = np.asarray(rows, dtype=float)
    return np.hstack([signals, signals[:, _SQUARED_COLUMNS] ** 2])


def _day(c: CandidateSignals) -> tuple[object, object]:
    return (c.conversation_id, c.created_at.date() if c.created_at is not None else None)


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
