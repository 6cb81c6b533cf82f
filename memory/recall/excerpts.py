"""Excerpts: the sentences of a recalled memory that answer the question, for a reply's block.

A memory is a whole message, and a person's message often states several facts at once
("More about me: my dog is called Biscuit. I work as a nurse at St. Mary's hospital. I was
born in 1987."). Ranked as a whole, such a message can lose to a shorter one about another
topic, and a small local model given two whole messages answers from the wrong fact, or from
the user's own earlier question ("Where does my sister live?"), which states nothing.

So, when ``MEMORY_SENTENCES`` is n > 0, the reply's recall fetches a few more memories than
it shows and, with the same encoder as the search (one call, vectors of sentences kept in
the recaller's cache), scores every sentence of each against the query:

- a memory ranks by its best sentence; a question states nothing, so a memory made only of
  questions scores zero;
- memories whose best sentence scores below ``MEMORY_RELATIVE_CUT`` times the first one's are
  left out (a follow-up's block no longer adds another person's fact);
- the block shows each memory's best n sentences, in the order they were said, and the
  memory's score (in ``memory.retrieved`` too) is its best sentence's cosine: what it was
  ranked by.

Without sentences, ``MEMORY_RELATIVE_CUT`` applies to the fused scores of the memories as
recall ranked them. Only the reply's block is shaped here; the memory API, the tool, MCP and
the benchmarks see recall's own ranking.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from memory.recall.embeddings import Embedder
from memory.recall.found import FoundMemory
from memory.recall.fusion import is_question
from memory.recall.sentence_keys import sentences
from memory.recall.vector_cache import VectorCache, embed_with_query

# How many memories are fetched for each one shown (and at least FETCH_MIN) when excerpts are on.
FETCH_PER_SHOWN = 4
FETCH_MIN = 8
# Sentences of one memory that are scored (a chunk holds ~1,200 characters: ~10-15 sentences).
MAX_SENTENCES = 16


def fetch_count(k: int, sentences_shown: int) -> int:
    """How many memories recall fetches for a block of ``k`` (more when they are re-ranked by sentence)."""
    return max(k * FETCH_PER_SHOWN, FETCH_MIN) if sentences_shown > 0 else k


def cut_relative(memories: Sequence[FoundMemory], cut: float) -> list[FoundMemory]:
    """The memories (best first) whose fused score is at least ``cut`` times the first one's."""
    if not memories or cut <= 0:
        return list(memories)
    floor = memories[0].score * cut
    return [m for m in memories if m.score >= floor]


async def focus(
    embedder: Embedder,
    query: str,
    memories: Sequence[FoundMemory],
    *,
    k: int,
    sentences_shown: int,
    cut: float,
    cache: VectorCache | None = None,
    cache_prefix: str = "",
    query_vector: list[float] | None = None,
) -> list[FoundMemory]:
    """The ``k`` memories whose best sentences answer ``query`` best, each with its excerpt set.

    ``query_vector``: the query's vector from the search, by the same encoder (not encoded again).
    """
    if not memories:
        return []
    pieces = [sentences(m.text)[:MAX_SENTENCES] or [m.text] for m in memories]
    flat = [sentence for piece in pieces for sentence in piece]
    keys = [f"{cache_prefix}\x00sentence\x00{sentence}" for sentence in flat]
    query_vector, vectors = await embed_with_query(
        embedder, query, flat, keys, cache, query_vector=query_vector
    )
    cosines = _cosines(np.asarray(vectors, dtype=float), np.asarray(query_vector, dtype=float))
    scored: list[tuple[float, int, FoundMemory]] = []
    start = 0
    for position, (memory, piece) in enumerate(zip(memories, pieces, strict=True)):
        own = cosines[start : start + len(piece)]
        start += len(piece)
        # A question states nothing the reply could answer from.
        stated = [
            (float(c), i) for i, (c, s) in enumerate(zip(own, piece, strict=True)) if not is_question(s)
        ]
        if not stated:
            scored.append((0.0, position, memory))
            continue
        best = sorted(stated, reverse=True)[:sentences_shown]
        excerpt = " ".join(piece[i] for _, i in sorted(best, key=lambda pair: pair[1]))
        scored.append((best[0][0], position, replace(memory, excerpt=excerpt, score=best[0][0])))
    scored.sort(key=lambda entry: (-entry[0], entry[1]))
    top = scored[0][0]
    if top <= 0:  # nothing but questions: recall's own order, whole
        return list(memories[:k])
    return [memory for score, _, memory in scored if score > 0 and score >= top * cut][:k]


def _cosines(vectors: np.ndarray, query: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=1) * max(float(np.linalg.norm(query)), 1e-12)
    return np.asarray((vectors @ query) / np.maximum(norms, 1e-12))
