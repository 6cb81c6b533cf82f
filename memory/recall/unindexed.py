"""Finished turns the indexer has not reached yet: read, shaped as it would index them, scored.

``memory_items`` is filled asynchronously. A fact stated two seconds ago may still sit
behind a conversation's watermark (``indexed_seq``), so recall also reads the user's
newest finished turns above the watermark (at most ``UNINDEXED_LIMIT``) and scores them
with the search's fusion (the learned formula over the signals a short list has, or the
same weighted RRF). Rank positions are taken within this small list; to keep a lone
unrelated turn from reaching the top by default, one counts only when it shares a keyword
with the query or its cosine similarity reaches ``UNINDEXED_MIN_SIMILARITY``.

The rules are the index's: tenant and user always; the conversation when scoped; never a
deleted conversation or one whose memory mode is ``none``; never turns at or below a
conversation's ``memory_forgotten_seq``; never turns off their conversation's active
branch (``memory.record.branches``); never the turns excluded by the caller.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from sqlalchemy import bindparam, text
from sqlalchemy.dialects.postgresql import ARRAY, UUID
from sqlalchemy.ext.asyncio import AsyncSession

from memory.recall.found import FoundMemory
from memory.recall.fusion import (
    DEFAULT_FUSION,
    CandidateSignals,
    Fusion,
    NeighbourSignals,
    is_model_reply,
    is_question,
)
from memory.recall.keywords import photo_caption, query_terms, search_terms
from memory.recall.remembering import REMEMBERED_MEMORY_USES
from memory.record.outbox import RECORDED_ROLES, RECORDED_STATUSES

UNINDEXED_LIMIT = 32
UNINDEXED_MIN_SIMILARITY = 0.3

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
      -- The remembering rule (memory.recall.remembering.is_remembered_reply), as the indexer applies it.
      AND (t.role <> 'assistant' OR t.memory_use IS NULL OR t.memory_use = ANY(:remembered_uses))
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
        "remembered_uses": sorted(REMEMBERED_MEMORY_USES),
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
    """The user's finished turns the indexer has not reached yet, shaped as it would index them.

    ``prepare_text`` shapes a turn's text as the indexer would (redaction) and returns None
    for a turn the indexer would skip (low information).
    """
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
        unindexed = [replace(turn, text=body) for turn, body in prepared if body is not None]
    return unindexed


def score_unindexed(
    turns: Sequence[UnindexedTurn],
    vectors: Sequence[Sequence[float]],
    query_text: str,
    query: Sequence[float],
    fusion: Fusion = DEFAULT_FUSION,
) -> list[FoundMemory]:
    """Unindexed turns as found memories, scored by the search's fusion over ranks within this list.

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
    if not scored:
        return []
    by_vector = {id(item[0]): rank for rank, item in enumerate(sorted(scored, key=lambda s: -s[1]), 1)}
    keyword_sorted = sorted((s for s in scored if s[2]), key=lambda s: (-s[2], -s[1]))
    by_keyword = {id(item[0]): rank for rank, item in enumerate(keyword_sorted, 1)}
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
            by_model=is_model_reply(other.role, other.name),
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
            role=turn.role,
            conversation_id=turn.conversation_id,
            created_at=turn.created_at,
        )
        for turn, similarity, matches in scored
    ]
    scores = fusion.scores(signals, query_text)
    return [
        FoundMemory(
            turn_id=turn.turn_id,
            conversation_id=turn.conversation_id,
            conversation_title=turn.conversation_title,
            role=turn.role,
            name=turn.name,
            text=turn.text,
            created_at=turn.created_at,
            external_id=turn.external_id,
            metadata=turn.metadata,
            score=score,
            vector_rank=signal.vector_rank,
            keyword_rank=signal.keyword_rank,
            indexed=False,
        )
        for (turn, _similarity, _matches), signal, score in zip(scored, signals, scores, strict=True)
    ]
