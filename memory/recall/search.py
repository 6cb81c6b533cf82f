"""The one search composition: the index, plus finished turns the indexer has not reached yet.

The chat before each reply, the memory API, the ``recall_memory`` tool, the memory items
API, MCP and the benchmarks all come here, through ``memory.recall.recaller.Recaller``.
Three steps, so that no pooled connection waits on the (CPU-bound, one-at-a-time)
encoder: under load, replies queue there, and would otherwise drain the pool.

1. read the turns the indexer has not reached yet (``memory.recall.unindexed``);
2. embed the query and those turns in one call, with no connection held;
3. in one transaction: the index's candidates (``memory.recall.index_search``), fused
   (``memory.recall.fusion``), kept only from conversations still live; the unindexed
   turns scored the same way; then the one de-duplication (``memory.recall.found``).

A query whose vector was encoded ahead (``memory.recall.prepared_queries``) and is ready
when the search starts needs no encoder before the index search, so steps 1 and 3's reads
share one transaction (a transaction's BEGIN, tenant scope and end: three round trips
fewer before the first token), and only the unindexed turns the vector cache lacks are
encoded after it, with no connection held. The memories found are the same: the same
statements, the same scoring, the same de-duplication. A vector still being encoded (its
encoder busy) is waited for as before, after step 1, so that the read overlaps the wait.

If the embedding service does not answer (``memory.recall.embedding_service``), step 3 ranks
by keywords alone (BM25 order; unindexed turns, which need vectors, are left out) and the
outcome says why, so a reply's recall can say so in ``memory.retrieved``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace

from sqlalchemy import bindparam, text
from sqlalchemy.dialects.postgresql import ARRAY, UUID
from sqlalchemy.ext.asyncio import AsyncSession

from memory.events import RecallError
from memory.recall.embedding_service import EmbeddingServiceError
from memory.recall.embeddings import Embedder
from memory.recall.found import FoundMemory, best_distinct
from memory.recall.fusion import DEFAULT_FUSION, Fusion
from memory.recall.index import Generation, generation_of, looking_again_if_taken_over
from memory.recall.index_search import fuse, search_candidates
from memory.recall.keywords import memory_text, photo_caption
from memory.recall.prepared_queries import PreparedQuery
from memory.recall.stored import NothingStored
from memory.recall.unindexed import UNINDEXED_LIMIT, UnindexedTurn, find_unindexed, score_unindexed
from memory.recall.vector_cache import VectorCache, embed_with_query, turn_key
from memory.storage.db import Database

# Characters of an unindexed turn that are embedded (the model reads ~256 tokens anyway).
UNINDEXED_EMBED_CHARS = 2000
# Candidates fetched beyond k, so dropping those of conversations switched off still leaves k.
OVERFETCH = 5

LIVE_CONVERSATIONS = text(
    """
    SELECT id, title FROM conversations
    WHERE id = ANY(:ids) AND tenant_id = :tenant_id AND user_id = :user_id
      AND deleted_at IS NULL AND memory_mode <> 'none'
    """
).bindparams(bindparam("ids", type_=ARRAY(UUID(as_uuid=True))))

# Keyword search alone: the keyword rank's reciprocal, normalised (the RRF formula with one list).
KEYWORDS_ONLY = Fusion(method="rrf", vector_weight=0.0, keyword_weight=1.0)


@dataclass(frozen=True, slots=True)
class Recalled:
    """What one search found, what each step cost, and whether it went without vectors."""

    memories: list[FoundMemory]
    latency_ms: dict[str, float] = field(default_factory=dict)
    # (RecallError.EMBEDDING_UNAVAILABLE, reason): no query vector, so keyword search only.
    degraded: tuple[str, str] | None = None
    # The query's vector and the generation it was encoded for (None when degraded or nothing searched).
    query_vector: list[float] | None = None
    generation: Generation | None = None
    # The query's vector was encoded ahead (memory/recall/prepared_queries.py), not here.
    query_ahead: bool = False


async def recall_memories(
    db: Database,
    embedder: Embedder,
    *,
    tenant_id: str,
    user_id: str,
    query_text: str,
    k: int,
    conversation_id: uuid.UUID | None = None,
    exclude_turn_ids: Collection[uuid.UUID] = (),
    min_score: float = 0.0,
    prepare_text: Callable[[str], str | None] | None = None,
    unindexed_limit: int = UNINDEXED_LIMIT,
    fusion: Fusion = DEFAULT_FUSION,
    cache: VectorCache | None = None,
    prepared: PreparedQuery | None = None,
    nothing_stored: NothingStored | None = None,
) -> Recalled:
    """The user's ``k`` best memories for a query, indexed or not yet, best first; and each step's ms.

    ``prepare_text`` shapes an unindexed turn's text as the indexer would (redaction) and
    returns None for a turn the indexer would skip (low information). ``cache`` keeps
    the unindexed turns' vectors from one recall to the next. ``prepared``: the query's
    vector encoded ahead, used if it is this query's in this generation. If the embedding
    service gives no query vector, the memories come from keyword search alone (``degraded``).
    ``nothing_stored``: the user had nothing to recall as the reply was accepted
    (``memory.recall.stored``); if this is the generation that check saw, nothing is encoded
    or read: no search would find anything.
    """
    latency: dict[str, float] = {}
    if k <= 0 or not query_text.strip():
        return Recalled([], latency)
    started = time.perf_counter()
    # The query is encoded by the encoder of the generation it is compared with (never mixed).
    generation = await generation_of(embedder, db)
    if nothing_stored is not None and nothing_stored.holds_for(generation):
        return Recalled([], {"unindexed": 0.0, "embed": 0.0, "rank": 0.0})

    async def search_index(session: AsyncSession, query_vector: list[float]) -> list[FoundMemory]:
        with looking_again_if_taken_over(embedder):
            return await index_memories(
                session,
                tenant_id=tenant_id,
                user_id=user_id,
                query_text=query_text,
                query_vector=query_vector,
                generation=generation,
                k=k,
                conversation_id=conversation_id,
                exclude_turn_ids=exclude_turn_ids,
                fusion=fusion,
            )

    # A vector encoded ahead and ready now: no encoder before the index search, which then
    # shares the unindexed read's transaction. One still encoding is waited for after the read.
    ready = prepared is not None and prepared.ready()
    ahead = await prepared.vector_for(query_text, generation) if prepared is not None and ready else None
    indexed: list[FoundMemory] | None = None
    async with db.transaction() if ahead is not None else db.session() as session:
        unindexed = await find_unindexed(
            session,
            tenant_id=tenant_id,
            user_id=user_id,
            conversation_id=conversation_id,
            exclude_turn_ids=exclude_turn_ids,
            prepare_text=prepare_text,
            limit=unindexed_limit,
        )
        if ahead is not None:
            indexed = await search_index(session, ahead)
    latency["unindexed"] = _ms_since(started)
    mark = time.perf_counter()
    degraded: tuple[str, str] | None = None
    query_vector = ahead
    if prepared is not None and not ready:
        query_vector = await prepared.vector_for(query_text, generation)
    query_ahead = query_vector is not None
    try:
        query_vector, turn_vectors = await embed_for_recall(
            generation.embedder,
            query_text,
            unindexed,
            cache,
            generation_id=generation.id,
            query_vector=query_vector,
        )
    except EmbeddingServiceError as exc:
        degraded = (RecallError.EMBEDDING_UNAVAILABLE, str(exc))
    latency["embed"] = _ms_since(mark)
    mark = time.perf_counter()
    if degraded is not None or query_vector is None:
        with looking_again_if_taken_over(embedder):
            async with db.transaction() as session:
                memories = await rank_by_keywords(
                    session,
                    tenant_id=tenant_id,
                    user_id=user_id,
                    query_text=query_text,
                    generation=generation,
                    k=k,
                    conversation_id=conversation_id,
                    exclude_turn_ids=exclude_turn_ids,
                    min_score=min_score,
                    depth=max(fusion.candidates, k + OVERFETCH),
                )
    else:
        if indexed is None:
            async with db.transaction() as session:
                indexed = await search_index(session, query_vector)
        fresh = score_unindexed(unindexed, turn_vectors, query_text, query_vector, fusion)
        memories = best_distinct([*indexed, *fresh], k, min_score)
    latency["rank"] = _ms_since(mark)
    return Recalled(memories, latency, degraded, query_vector, generation, query_ahead)


def _ms_since(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 2)


async def embed_for_recall(
    embedder: Embedder,
    query_text: str,
    unindexed: Sequence[UnindexedTurn],
    cache: VectorCache | None = None,
    *,
    generation_id: int = 0,
    query_vector: list[float] | None = None,
) -> tuple[list[float], list[list[float]]]:
    """One encode call for the query and the unindexed turns not kept in ``cache``.

    One call, because the embedder runs one at a time. Call it with no database
    connection held: under load, replies queue here for the CPU. ``cache`` keeps vectors
    per generation (``generation_id``): after a reindex, a turn is encoded again. A
    ``query_vector`` already encoded (ahead, by the same encoder) is not encoded again.
    """
    embedded = [
        memory_text(
            turn.text[:UNINDEXED_EMBED_CHARS],
            name=turn.name,
            created_at=turn.created_at,
            extra=photo_caption(turn.metadata),
        )
        for turn in unindexed
    ]
    keys = [turn_key(generation_id, text) for text in embedded]
    return await embed_with_query(embedder, query_text, embedded, keys, cache, query_vector=query_vector)


async def index_memories(
    session: AsyncSession,
    *,
    tenant_id: str,
    user_id: str,
    query_text: str,
    query_vector: Sequence[float],
    generation: Generation,
    k: int,
    conversation_id: uuid.UUID | None = None,
    exclude_turn_ids: Collection[uuid.UUID] = (),
    fusion: Fusion = DEFAULT_FUSION,
) -> list[FoundMemory]:
    """The index's candidates, fused, from conversations still live (not de-duplicated yet).

    ``generation``: the one whose encoder made ``query_vector`` (its id and key are checked in
    the search statement: ``ForeignGeneration`` if another encoder took it over).
    """
    candidates = await search_candidates(
        session,
        tenant_id=tenant_id,
        user_id=user_id,
        query_text=query_text,
        query_embedding=query_vector,
        index_id=generation.id,
        index_key=generation.key,
        depth=max(fusion.candidates, k + OVERFETCH),
        conversation_id=conversation_id,
        exclude_turn_ids=exclude_turn_ids,
    )
    return await _in_live_conversations(
        session, fuse(candidates, query_text, fusion), tenant_id=tenant_id, user_id=user_id
    )


async def rank_by_keywords(
    session: AsyncSession,
    *,
    tenant_id: str,
    user_id: str,
    query_text: str,
    generation: Generation,
    k: int,
    depth: int,
    conversation_id: uuid.UUID | None = None,
    exclude_turn_ids: Collection[uuid.UUID] = (),
    min_score: float = 0.0,
) -> list[FoundMemory]:
    """The user's ``k`` best indexed memories by keyword search alone (no query vector), best first.

    The one search statement runs with a placeholder vector; its dense list and cosine
    signals are dropped and only the keyword list's BM25 order counts.
    """
    placeholder = [1.0] + [0.0] * (generation.embedder.dim - 1)
    candidates = await search_candidates(
        session,
        tenant_id=tenant_id,
        user_id=user_id,
        query_text=query_text,
        query_embedding=placeholder,
        index_id=generation.id,
        index_key=generation.key,
        depth=depth,
        conversation_id=conversation_id,
        exclude_turn_ids=exclude_turn_ids,
    )
    found = [
        replace(c.memory, score=KEYWORDS_ONLY.rrf(None, c.signals.keyword_rank), vector_rank=None)
        for c in candidates
        if c.signals.keyword_rank is not None
    ]
    live = await _in_live_conversations(session, found, tenant_id=tenant_id, user_id=user_id)
    return best_distinct(live, k, min_score)


async def _in_live_conversations(
    session: AsyncSession, memories: list[FoundMemory], *, tenant_id: str, user_id: str
) -> list[FoundMemory]:
    """The memories whose conversation is still live and remembered, with its title."""
    titles: dict[uuid.UUID, str | None] = {}
    if memories:
        rows = await session.execute(
            LIVE_CONVERSATIONS,
            {
                "ids": list({m.conversation_id for m in memories if m.conversation_id is not None}),
                "tenant_id": tenant_id,
                "user_id": user_id,
            },
        )
        titles = {row.id: row.title for row in rows}
    # A fact the user stated outside any conversation has none (memory/recall/items.py).
    return [
        replace(m, conversation_title=titles[m.conversation_id]) if m.conversation_id is not None else m
        for m in memories
        if m.conversation_id is None or m.conversation_id in titles
    ]
