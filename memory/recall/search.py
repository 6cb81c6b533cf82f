"""Memory search as the chat uses it: the index, plus finished turns the indexer has not reached yet.

``memory.recall.index_search.search_memory`` searches ``memory_items``, which the indexer fills
asynchronously. A fact stated two seconds ago may still sit behind a conversation's
watermark (``indexed_seq``), so this module also reads the user's newest finished turns
above the watermark (at most ``UNINDEXED_LIMIT``), embeds them together with the query in
one call, scores them with the search's fusion (the learned formula over the signals a
short list has, or the same weighted RRF), and merges them with the indexed hits. Rank
positions of the unindexed turns are taken within their own small list; to keep a lone
unrelated turn from reaching the top by default, one counts only when it shares a keyword
with the query or its cosine similarity reaches ``UNINDEXED_MIN_SIMILARITY``.

Both sides obey the same rules: tenant and user always; the conversation when scoped;
never a deleted conversation or one whose memory mode is ``none``; never turns at or
below a conversation's ``memory_forgotten_seq`` (set by ``forget_user_memory``); never
turns off their conversation's active branch (``memory.branches``); never the turns
already in the prompt's recent window.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from sqlalchemy import bindparam, text
from sqlalchemy.dialects.postgresql import ARRAY, UUID
from sqlalchemy.ext.asyncio import AsyncSession

from memory.db import Database
from memory.outbox import RECORDED_ROLES, RECORDED_STATUSES
from memory.recall.embeddings import Embedder
from memory.recall.index_search import DEFAULT_FUSION, Fusion, MemoryHit, normalised_text, search_memory
from memory.recall.keywords import memory_text, photo_caption, query_terms, search_terms
from memory.recall.learned_fusion import CandidateSignals, NeighbourSignals, is_question, learned_scores
from memory.recall.vector_cache import VectorCache

UNINDEXED_LIMIT = 32
UNINDEXED_MIN_SIMILARITY = 0.3
# Characters of an unindexed turn that are embedded (the model reads ~256 tokens anyway).
UNINDEXED_EMBED_CHARS = 2000
# Indexed hits fetched beyond k, so dropping hits of conversations switched off still leaves k.
OVERFETCH = 5

_UNINDEXED_TURNS = """
SELECT t.id AS turn_id, t.conversation_id, c.title, t.seq, t.role, t.name, t.content, t.created_at,
       t.external_id, t.metadata
FROM conversations c
JOIN branches b ON b.id = c.active_branch_id
CROSS JOIN LATERAL (
    SELECT * FROM turns t
    WHERE t.conversation_id = c.id
      AND t.seq > GREATEST(c.indexed_seq, c.memory_forgotten_seq)
      AND t.role = ANY(:roles) AND t.status = ANY(:statuses)
      AND t.content <> '' AND t.id <> ALL(:exclude_turn_ids) AND t.deleted_at IS NULL
      -- Only the active branch: a regenerated-away answer or an edited-away message is not memory.
      AND EXISTS (SELECT 1 FROM unnest(b.lineage_ids, b.lineage_max_seqs) AS l(branch_id, max_seq)
                  WHERE l.branch_id = t.branch_id AND t.seq <= l.max_seq)
    ORDER BY t.seq DESC
    LIMIT :limit
) t
WHERE c.tenant_id = :tenant_id AND c.user_id = :user_id
  AND c.deleted_at IS NULL AND c.memory_mode <> 'none'
  -- Most conversations are fully indexed: skip them without touching their turns.
  AND c.next_seq - 1 > GREATEST(c.indexed_seq, c.memory_forgotten_seq){conversation_filter}
ORDER BY t.created_at DESC, t.seq DESC
LIMIT :limit
"""


def _unindexed_sql(*, by_conversation: bool) -> Any:
    statement = _UNINDEXED_TURNS.format(
        conversation_filter="\n  AND c.id = :conversation_id" if by_conversation else ""
    )
    return text(statement).bindparams(bindparam("exclude_turn_ids", type_=ARRAY(UUID(as_uuid=True))))


UNINDEXED_TURNS_USER = _unindexed_sql(by_conversation=False)
UNINDEXED_TURNS_CONVERSATION = _unindexed_sql(by_conversation=True)

LIVE_CONVERSATIONS = text(
    """
    SELECT id, title FROM conversations
    WHERE id = ANY(:ids) AND tenant_id = :tenant_id AND user_id = :user_id
      AND deleted_at IS NULL AND memory_mode <> 'none'
    """
).bindparams(bindparam("ids", type_=ARRAY(UUID(as_uuid=True))))


@dataclass(frozen=True, slots=True)
class UnindexedTurn:
    """A finished turn above its conversation's watermark."""

    turn_id: uuid.UUID
    conversation_id: uuid.UUID
    conversation_title: str | None
    seq: int
    role: str
    name: str | None
    text: str
    created_at: datetime
    external_id: str | None
    metadata: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class RecalledMemory:
    """One memory found for a query, with the title of its conversation."""

    hit: MemoryHit
    conversation_title: str | None
    # False when it came from a finished turn the indexer had not reached yet.
    indexed: bool


async def load_unindexed_turns(
    session: AsyncSession,
    *,
    tenant_id: str,
    user_id: str,
    conversation_id: uuid.UUID | None = None,
    exclude_turn_ids: Collection[uuid.UUID] = (),
    limit: int = UNINDEXED_LIMIT,
) -> list[UnindexedTurn]:
    """The user's newest finished, not yet indexed, not forgotten turns (newest first)."""
    params: dict[str, Any] = {
        "tenant_id": tenant_id,
        "user_id": user_id,
        "roles": sorted(RECORDED_ROLES),
        "statuses": sorted(RECORDED_STATUSES),
        "exclude_turn_ids": list(exclude_turn_ids),
        "limit": limit,
    }
    statement = UNINDEXED_TURNS_USER
    if conversation_id is not None:
        statement = UNINDEXED_TURNS_CONVERSATION
        params["conversation_id"] = conversation_id
    rows = await session.execute(statement, params)
    return [
        UnindexedTurn(
            turn_id=row.turn_id,
            conversation_id=row.conversation_id,
            conversation_title=row.title,
            seq=row.seq,
            role=row.role,
            name=row.name,
            text=row.content,
            created_at=row.created_at,
            external_id=row.external_id,
            metadata=row.metadata,
        )
        for row in rows
    ]


def score_unindexed(
    turns: Sequence[UnindexedTurn],
    vectors: Sequence[Sequence[float]],
    query_text: str,
    query: Sequence[float],
    fusion: Fusion = DEFAULT_FUSION,
) -> list[MemoryHit]:
    """Unindexed turns as hits, scored by the search's fusion over ranks within this list.

    The keyword score here is the number of query terms the turn holds, counting its
    speaker's name and image caption as the index does (there is no BM25 over a list this
    short); the learned fusion divides it by the list's best, as it does BM25, and takes
    neighbours from this list (the turns just before and after).
    """
    wanted = set(query_terms(query_text))
    scored = []
    for turn, vector in zip(turns, vectors, strict=True):
        similarity = sum(a * b for a, b in zip(vector, query, strict=True))
        said = f"{turn.name or ''} {turn.text} {photo_caption(turn.metadata) or ''}"
        terms = set(search_terms(said).split())
        matches = len(wanted & terms)
        if matches or similarity >= UNINDEXED_MIN_SIMILARITY:
            scored.append((turn, similarity, matches))
    by_vector = {id(item[0]): rank for rank, item in enumerate(sorted(scored, key=lambda s: -s[1]), 1)}
    keyword_sorted = sorted((s for s in scored if s[2]), key=lambda s: (-s[2], -s[1]))
    by_keyword = {id(item[0]): rank for rank, item in enumerate(keyword_sorted, 1)}
    hits = [
        MemoryHit(
            turn_id=turn.turn_id,
            conversation_id=turn.conversation_id,
            chunk_index=0,
            role=turn.role,
            name=turn.name,
            text=turn.text,
            turn_created_at=turn.created_at,
            external_id=turn.external_id,
            metadata=turn.metadata,
            score=fusion.score(by_vector.get(id(turn)), by_keyword.get(id(turn))),
            vector_rank=by_vector.get(id(turn)),
            keyword_rank=by_keyword.get(id(turn)),
        )
        for turn, _similarity, _matches in scored
    ]
    if fusion.method == "rrf" or not hits:
        return hits
    by_seq = {(t.conversation_id, t.seq): (t, sim, matches) for t, sim, matches in scored}

    def neighbour(turn: UnindexedTurn, step: int) -> NeighbourSignals | None:
        found = by_seq.get((turn.conversation_id, turn.seq + step))
        if found is None:
            return None
        other, similarity, matches = found
        return NeighbourSignals(
            similarity,
            float(matches),
            by_vector.get(id(other)),
            by_keyword.get(id(other)),
            is_question(other.text),
        )

    signals = [
        CandidateSignals(
            cosine=similarity,
            bm25=float(matches),
            vector_rank=by_vector.get(id(turn)),
            keyword_rank=by_keyword.get(id(turn)),
            name=turn.name,
            text=turn.text,
            has_caption=photo_caption(turn.metadata) is not None,
            previous=neighbour(turn, -1),
            next=neighbour(turn, 1),
        )
        for turn, similarity, matches in scored
    ]
    scores = learned_scores(signals, query_text)
    return [replace(hit, score=score) for hit, score in zip(hits, scores, strict=True)]


# Work the caller adds to the search transaction (e.g. storing the query for auditing).
InSearchTransaction = Callable[[AsyncSession], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Recall:
    """The memories found for a query, and what each step cost (milliseconds)."""

    memories: list[RecalledMemory]
    latency_ms: dict[str, float]


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
) -> Recall:
    """The user's ``k`` best memories for a query, indexed or not yet, best first.

    The one retrieval composition: the chat before each reply, the memory API, the
    ``recall_memory`` tool and the benchmark all come here. Three steps, so that no
    pooled connection waits on the (CPU-bound, one-at-a-time) encoder: under load,
    replies queue there, and would otherwise drain the pool. ``prepare_text`` shapes an
    unindexed turn's text as the indexer would (redaction) and returns None for a turn
    the indexer would skip (low information); ``in_search_transaction`` runs in the
    search's transaction, after it. ``cache`` keeps the unindexed turns' vectors from one
    recall to the next.
    """
    latency: dict[str, float] = {}
    if k <= 0 or not query_text.strip():
        return Recall([], latency)
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
    query_vector, turn_vectors = await embed_for_recall(embedder, query_text, unindexed, cache)
    latency["embed"] = _ms_since(mark)
    mark = time.perf_counter()
    async with db.transaction() as session:
        memories = await rank_memories(
            session,
            tenant_id=tenant_id,
            user_id=user_id,
            query_text=query_text,
            query_vector=query_vector,
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
    return Recall(memories, latency)


def _ms_since(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 2)


async def find_unindexed(
    session: AsyncSession,
    *,
    tenant_id: str,
    user_id: str,
    conversation_id: uuid.UUID | None = None,
    exclude_turn_ids: Collection[uuid.UUID] = (),
    prepare_text: Callable[[str], str | None] | None = None,
    limit: int = UNINDEXED_LIMIT,
) -> list[UnindexedTurn]:
    """The user's finished turns the indexer has not reached yet, shaped as it would index them."""
    unindexed = await load_unindexed_turns(
        session,
        tenant_id=tenant_id,
        user_id=user_id,
        conversation_id=conversation_id,
        exclude_turn_ids=exclude_turn_ids,
        limit=limit,
    )
    if prepare_text is not None:
        prepared = [(turn, prepare_text(turn.text)) for turn in unindexed]
        unindexed = [_with_text(turn, body) for turn, body in prepared if body is not None]
    return unindexed


async def embed_for_recall(
    embedder: Embedder,
    query_text: str,
    unindexed: Sequence[UnindexedTurn],
    cache: VectorCache | None = None,
) -> tuple[list[float], list[list[float]]]:
    """One encode call for the query and the unindexed turns not kept in ``cache``.

    One call, because the embedder runs one at a time. Call it with no database
    connection held: under load, replies queue here for the CPU.
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
    kept = cache.take(embedded) if cache is not None else [None] * len(embedded)
    missing = [text for text, vector in zip(embedded, kept, strict=True) if vector is None]
    query_vector, *encoded = await embedder.embed([query_text, *missing])
    if cache is not None:
        cache.keep(missing, encoded)
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
    unindexed: Sequence[UnindexedTurn],
    turn_vectors: Sequence[Sequence[float]],
    k: int,
    conversation_id: uuid.UUID | None = None,
    exclude_turn_ids: Collection[uuid.UUID] = (),
    min_score: float = 0.0,
    fusion: Fusion = DEFAULT_FUSION,
) -> list[RecalledMemory]:
    """Search the index and fuse in the unindexed turns: the user's ``k`` best memories."""
    indexed = await search_memory(
        session,
        tenant_id=tenant_id,
        user_id=user_id,
        query_text=query_text,
        query_embedding=query_vector,
        k=k + OVERFETCH,
        conversation_id=conversation_id,
        exclude_turn_ids=exclude_turn_ids,
        min_score=min_score,
        fusion=fusion,
    )
    titles: dict[uuid.UUID, str | None] = {}
    if indexed:
        rows = await session.execute(
            LIVE_CONVERSATIONS,
            {
                "ids": list({h.conversation_id for h in indexed if h.conversation_id is not None}),
                "tenant_id": tenant_id,
                "user_id": user_id,
            },
        )
        titles = {row.id: row.title for row in rows}
    # A fact the user stated outside any conversation has none (memory/recall/items.py).
    found = [
        RecalledMemory(h, titles.get(h.conversation_id) if h.conversation_id else None, True)
        for h in indexed
        if h.conversation_id is None or h.conversation_id in titles
    ]
    fresh_titles = {t.turn_id: t.conversation_title for t in unindexed}
    found += [
        RecalledMemory(hit, fresh_titles[hit.turn_id], False)
        for hit in score_unindexed(unindexed, turn_vectors, query_text, query_vector, fusion)
        if hit.score >= min_score
    ]
    return _best_distinct(found, k)


def _with_text(turn: UnindexedTurn, body: str) -> UnindexedTurn:
    if body == turn.text:
        return turn
    return UnindexedTurn(
        turn_id=turn.turn_id,
        conversation_id=turn.conversation_id,
        conversation_title=turn.conversation_title,
        seq=turn.seq,
        role=turn.role,
        name=turn.name,
        text=body,
        created_at=turn.created_at,
        external_id=turn.external_id,
        metadata=turn.metadata,
    )


def _best_distinct(found: list[RecalledMemory], k: int) -> list[RecalledMemory]:
    """Best first, one per turn and per normalised text (indexed wins a tie), at most k."""
    found.sort(key=lambda m: (-m.hit.score, not m.indexed, -m.hit.turn_created_at.timestamp()))
    turns: set[uuid.UUID] = set()
    texts: set[str] = set()
    kept = []
    for memory in found:
        key = normalised_text(memory.hit.text)
        if memory.hit.turn_id in turns or key in texts:
            continue
        turns.add(memory.hit.turn_id)
        texts.add(key)
        kept.append(memory)
        if len(kept) == k:
            break
    return kept
