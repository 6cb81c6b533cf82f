"""What recall finds: one type for a found memory, one for a recall's result, one de-duplication.

Every caller gets these: the prompt's memory block, the `memory.retrieved` event,
`POST /v1/memory/search`, the `recall_memory` tool, the memory items API and MCP. Each
builds its own view from a ``FoundMemory`` at its edge.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from memory.recall.rewrite import Rewrite


@dataclass(frozen=True, slots=True, kw_only=True)
class FoundMemory:
    """One remembered turn (its best chunk) found for a query, and how it scored."""

    turn_id: uuid.UUID
    # None for a fact the user stated outside any conversation.
    conversation_id: uuid.UUID | None
    text: str
    role: str
    # When it was said (the turn's time; a stated fact's when it was stated).
    created_at: datetime
    # The fused score, higher is better: the learned formula's (0, 1) value, or the RRF
    # score normalised to (0, 1] (1.0 means first in both lists).
    score: float
    conversation_title: str | None = None
    chunk_index: int = 0
    name: str | None = None
    external_id: str | None = None
    metadata: dict[str, Any] | None = None
    # Positions in the dense and keyword top lists; None when outside them.
    vector_rank: int | None = None
    keyword_rank: int | None = None
    # False when it came from a finished turn the indexer had not reached yet.
    indexed: bool = True
    # The sentences a reply's block shows instead of the whole text (memory.recall.excerpts).
    excerpt: str | None = None


@dataclass(frozen=True, slots=True)
class RecallResult:
    """What one recall found, and how its query was made."""

    query: str  # the query searched: the rewritten message, or the message as it came
    rewrite: Rewrite
    memories: list[FoundMemory]  # best first, at most k, one per turn and per text
    latency_ms: dict[str, float]  # what each step cost
    # (code, reason) when the search went on without a query vector: keyword search only
    # (memory.events.RecallError.EMBEDDING_UNAVAILABLE: the embedding service did not answer).
    degraded: tuple[str, str] | None = None
    # The query's vector was the one encoded while the reply was accepted (prepared_queries.py).
    query_ahead: bool = False


def normalised_text(text: str) -> str:
    """The duplicate key: the same words regardless of date prefix, case and punctuation."""
    return re.sub(r"\W+", "", re.sub(r"^\[[^]]*\]\s*", "", text).lower())


def best_distinct(found: Iterable[FoundMemory], k: int, min_score: float = 0.0) -> list[FoundMemory]:
    """The ``k`` best at or above ``min_score``: one per turn (its best chunk) and one per text.

    Best first; on a tie an indexed memory wins over one not indexed yet, then the newer,
    then the lower chunk, then the lower turn id: the order never follows the order the
    memories came in (a search's rows come in whatever order its plan made). Of memories
    with the same normalised text the best is kept.
    """
    if k <= 0:
        return []
    ordered = sorted(
        (memory for memory in found if memory.score >= min_score),
        key=lambda m: (-m.score, not m.indexed, -m.created_at.timestamp(), m.chunk_index, m.turn_id),
    )
    turns: set[uuid.UUID] = set()
    texts: set[str] = set()
    kept: list[FoundMemory] = []
    for memory in ordered:
        if memory.turn_id in turns:
            continue
        turns.add(memory.turn_id)  # a turn competes with its best chunk only
        key = normalised_text(memory.text)
        if key in texts:
            continue
        texts.add(key)
        kept.append(memory)
        if len(kept) == k:
            break
    return kept
