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
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import replace

from sqlalchemy import bindparam, text
from sqlalchemy.dialects.postgresql import ARRAY, UUID
from sqlalchemy.ext.asyncio import AsyncSession

from memory.recall.embeddings import Embedder
from memory.recall.found import FoundMemory, best_distinct
from memory.recall.fusion import DEFAULT_FUSION, Fusion
from memory.recall.index import generation_of
from memory.recall.index_search import fuse, search_candidates
from memory.recall.keywords import memory_text, photo_caption
from memory.recall.unindexed import UNINDEXED_LIMIT, UnindexedTurn, find_unindexed, score_unindexed
from memory.recall.vector_cache import VectorCache
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

# Work the caller adds to the search transaction (e.g. storing the query for auditing).
InSearchTransaction = Callable[[AsyncSession], Awaitable[None]]


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
    in_search_transaction: InSearchTransaction | None = None,
    fusion: Fusion = DEFAULT_FUSION,
    cache: VectorCache | None = None,
) -> tuple[list[FoundMemory], dict[str, float]]:
    """The user's ``k`` best memories for a query, indexed or not yet, best first; and each step's ms.

    ``prepare_text`` shapes an unindexed turn's text as the indexer would (redaction) and
    returns None for a turn the indexer would skip (low information);
    ``in_search_transaction`` runs in the search's transaction, after it. ``cache`` keeps
    the unindexed turns' vectors from one recall to the next.
    """
    latency: dict[str, float] = {}
    if k <= 0 or not query_text.strip():
        return [], latency
    started = time.perf_counter()
    async with db.session() as session:
        unindexed = await find_unindexed(
            session,
            tenant_id=tenant_id,
            user_id=user_id,
            conversation_id=conversation_id,
            exclude_turn_ids=exclude_turn_ids,
            prepare_text=prepare_text,
            limit=unindexed_limit,
        )
    latency["unindexed"] = _ms_since(started)
    mark = time.perf_counter()
    # The query is encoded by the encoder of the generation it is compared with (never mixed).
    generation = await generation_of(embedder, db)
    query_vector, turn_vectors = await embed_for_recall(
        generation.embedder, query_text, unindexed, cache, generation_id=generation.id
    )
    latency["embed"] = _ms_since(mark)
    mark = time.perf_counter()
    async with db.transaction() as session:
        memories = await rank_memories(
            session,
            tenant_id=tenant_id,
            user_id=user_id,
            query_text=query_text,
            query_vector=query_vector,
            index_id=generation.id,
            unindexed=unindexed,
            turn_vectors=turn_vectors,
            k=k,
            conversation_id=conversation_id,
            exclude_turn_ids=exclude_turn_ids,
            min_score=min_score,
            fusion=fusion,
        )
        if in_search_transaction is not None:
            await in_search_transaction(session)
    latency["rank"] = _ms_since(mark)
    return memories, latency


def _ms_since(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 2)


async def embed_for_recall(
    embedder: Embedder,
    query_text: str,
    unindexed: Sequence[UnindexedTurn],
    cache: VectorCache | None = None,
    *,
    generation_id: int = 0,
) -> tuple[list[float], list[list[float]]]:
    """One encode call for the query and the unindexed turns not kept in ``cache``.

    One call, because the embedder runs one at a time. Call it with no database
    connection held: under load, replies queue here for the CPU. ``cache`` keeps vectors
    per generation (``generation_id``): after a reindex, a turn is encoded again.
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
    keys = [f"{generation_id}\x00{text}" for text in embedded]
    kept = cache.take(keys) if cache is not None else [None] * len(embedded)
    missing = [i for i, vector in enumerate(kept) if vector is None]
    query_vector, *encoded = await embedder.embed([query_text, *(embedded[i] for i in missing)])
    if cache is not None:
        cache.keep([keys[i] for i in missing], encoded)
    fresh = iter(encoded)
    turn_vectors = [vector if vector is not None else next(fresh) for vector in kept]
    return query_vector, turn_vectors


async def rank_memories(
    session: AsyncSession,
    *,
    tenant_id: str,
    user_id: str,
    query_text: str,
    query_vector: Sequence[float],
    index_id: int,
    unindexed: Sequence[UnindexedTurn],
    turn_vectors: Sequence[Sequence[float]],
    k: int,
    conversation_id: uuid.UUID | None = None,
    exclude_turn_ids: Collection[uuid.UUID] = (),
    min_score: float = 0.0,
    fusion: Fusion = DEFAULT_FUSION,
) -> list[FoundMemory]:
    """Search the index and fuse in the unindexed turns: the user's ``k`` best memories."""
    candidates = await search_candidates(
        session,
        tenant_id=tenant_id,
        user_id=user_id,
        query_text=query_text,
        query_embedding=query_vector,
        index_id=index_id,
        depth=max(fusion.candidates, k + OVERFETCH),
        conversation_id=conversation_id,
        exclude_turn_ids=exclude_turn_ids,
    )
    indexed = fuse(candidates, query_text, fusion)
    titles: dict[uuid.UUID, str | None] = {}
    if indexed:
        rows = await session.execute(
            LIVE_CONVERSATIONS,
            {
                "ids": list({m.conversation_id for m in indexed if m.conversation_id is not None}),
                "tenant_id": tenant_id,
                "user_id": user_id,
            },
        )
        titles = {row.id: row.title for row in rows}
    # A fact the user stated outside any conversation has none (memory/recall/items.py).
    live = [
        replace(m, conversation_title=titles[m.conversation_id]) if m.conversation_id is not None else m
        for m in indexed
        if m.conversation_id is None or m.conversation_id in titles
    ]
    fresh = score_unindexed(unindexed, turn_vectors, query_text, query_vector, fusion)
    return best_distinct([*live, *fresh], k, min_score)
