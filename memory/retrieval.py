"""Hybrid memory search: dense (pgvector HNSW) and keyword (BM25 over tsvector), fused by RRF.

One SQL statement in the style of pgvector-python's ``examples/hybrid_search/rrf.py``.
Choices measured on the LoCoMo slice (``bench/memory_eval.py``):

- Keyword scoring is Okapi BM25 computed in SQL from the matching rows' tsvectors
  (term frequency from lexeme positions, document frequency over the user's matching
  rows, N over the user's rows). ``ts_rank_cd`` has no IDF, and frequent words drowned
  the rare names and nouns that questions hinge on.
- The keyword list is weighted 1.5x the dense list and RRF uses k = 10: on this data
  the keyword ranking is the stronger signal, and a small k lets the top of each list
  matter more than the long tail.
- Every row that can be returned passes the tenant/user filter inside both candidate
  lists; nothing is joined in later without it. The same filter drops rows of turns off
  their conversation's active branch (``on_active_branch``, a flag kept by
  ``memory.branches``), so it costs one column test per row and no join.

The dense side uses pgvector 0.8 iterative index scans so a per-user filter on a shared
HNSW index still yields ``candidates`` rows instead of whatever survived the filter
out of ``ef_search`` neighbours. The caller owns the transaction; the ``SET LOCAL``
style settings below last until it ends.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pgvector.sqlalchemy import Vector
from sqlalchemy import bindparam, text
from sqlalchemy.dialects.postgresql import ARRAY, UUID
from sqlalchemy.ext.asyncio import AsyncSession

from memory.errors import NotFound
from memory.keywords import query_terms
from memory.models import EMBEDDING_DIM
from memory.tenancy import TENANT_ROLE, current_tenant

BM25_K1 = 1.2
BM25_B = 0.75
# Candidates the HNSW scan keeps in its queue; at least `candidates`, iterative scan does the rest.
MIN_EF_SEARCH = 100


@dataclass(frozen=True, slots=True)
class Fusion:
    """How the dense and keyword rankings are fused (weighted RRF) and how deep each one goes."""

    keyword_weight: float = 1.5
    vector_weight: float = 1.0
    rrf_k: float = 10.0
    candidates: int = 50

    def score(self, vector_rank: int | None, keyword_rank: int | None) -> float:
        """The SQL's fused score of a pair of ranks, normalised so that first in both lists is 1.0."""
        total = 0.0
        if vector_rank is not None:
            total += self.vector_weight / (self.rrf_k + vector_rank)
        if keyword_rank is not None:
            total += self.keyword_weight / (self.rrf_k + keyword_rank)
        return total / ((self.vector_weight + self.keyword_weight) / (self.rrf_k + 1))


DEFAULT_FUSION = Fusion()

SET_SEARCH_SETTINGS = text(
    "SELECT set_config('hnsw.iterative_scan', 'relaxed_order', true),"
    " set_config('hnsw.ef_search', :ef_search, true)"
)
# Under row-level security Postgres may not use an index for a non-leakproof operator such
# as `@@` (only a superuser can mark one leakproof), so keyword search would scan every
# memory row. The search statement filters tenant and user itself inside every candidate
# list and is only run for the transaction's own tenant (checked in search_memory), so it
# alone runs as the connecting role; the rest of the transaction stays scoped.
SET_SEARCH_SETTINGS_AS_OWNER = text(
    "SELECT set_config('hnsw.iterative_scan', 'relaxed_order', true),"
    " set_config('hnsw.ef_search', :ef_search, true), set_config('role', 'none', true)"
)
RESTORE_TENANT_ROLE = text(f"SELECT set_config('role', '{TENANT_ROLE}', true)")

# on_active_branch: turns a regenerate or an edit replaced are not memory (memory/branches.py).
_OWNER_FILTER = """m.tenant_id = :tenant_id AND m.user_id = :user_id AND m.on_active_branch
      AND m.deleted_at IS NULL AND m.turn_id <> ALL(:exclude_turn_ids){conversation_filter}"""

_HYBRID_SEARCH = """
WITH query_lexemes AS (
    SELECT DISTINCT lexeme
    FROM unnest(tsvector_to_array(to_tsvector('simple', :query_terms))) AS lexeme
),
keyword_query AS (
    SELECT to_tsquery('simple', string_agg(quote_literal(lexeme), ' | ')) AS tsq FROM query_lexemes
),
vector_hits AS MATERIALIZED (
    SELECT m.id, m.embedding <=> :embedding AS distance
    FROM memory_items m
    WHERE {owner}
    ORDER BY m.embedding <=> :embedding
    LIMIT :candidates
),
vector_ranked AS (
    -- relaxed_order may return rows slightly out of order: rank by the real distance.
    SELECT id, row_number() OVER (ORDER BY distance, id) AS rank FROM vector_hits
),
keyword_rows AS MATERIALIZED (
    SELECT m.id, m.search_terms
    FROM memory_items m, keyword_query q
    WHERE {owner} AND m.search_terms @@ q.tsq
),
corpus AS (
    SELECT greatest(count(*), 1) AS n FROM memory_items m WHERE {owner}
),
term_freqs AS (
    SELECT k.id, t.lexeme, coalesce(array_length(t.positions, 1), 1) AS tf,
           length(k.search_terms) AS doc_len
    FROM keyword_rows k, unnest(k.search_terms) AS t
    WHERE t.lexeme IN (SELECT lexeme FROM query_lexemes)
),
doc_freqs AS (
    SELECT lexeme, count(*) AS df FROM term_freqs GROUP BY lexeme
),
average_length AS (
    SELECT greatest(avg(length(search_terms)), 1) AS avg_len FROM keyword_rows
),
keyword_scored AS (
    SELECT f.id,
           sum(ln(1 + (c.n - d.df + 0.5) / (d.df + 0.5))
               * f.tf * (CAST(:bm25_k1 AS float8) + 1)
               / (f.tf + CAST(:bm25_k1 AS float8)
                  * (1 - CAST(:bm25_b AS float8) + CAST(:bm25_b AS float8) * f.doc_len / a.avg_len))) AS score
    FROM term_freqs f
    JOIN doc_freqs d USING (lexeme)
    CROSS JOIN corpus c
    CROSS JOIN average_length a
    GROUP BY f.id
),
keyword_ranked AS (
    SELECT id, row_number() OVER (ORDER BY score DESC, id) AS rank
    FROM keyword_scored
    ORDER BY score DESC, id
    LIMIT :candidates
),
fused AS (
    SELECT coalesce(v.id, k.id) AS id, v.rank AS vector_rank, k.rank AS keyword_rank,
           (coalesce(CAST(:vector_weight AS float8) / (CAST(:rrf_k AS float8) + v.rank), 0)
            + coalesce(CAST(:keyword_weight AS float8) / (CAST(:rrf_k AS float8) + k.rank), 0))
           -- Divided by the best possible score (first in both lists), so 1.0 is the top.
           / ((CAST(:vector_weight AS float8) + CAST(:keyword_weight AS float8))
              / (CAST(:rrf_k AS float8) + 1)) AS score
    FROM vector_ranked v
    FULL OUTER JOIN keyword_ranked k ON v.id = k.id
),
best_per_turn AS (
    SELECT DISTINCT ON (m.turn_id)
           m.turn_id, m.conversation_id, m.chunk_index, m.role, m.name, m.text, m.turn_created_at,
           m.external_id, m.metadata, f.score, f.vector_rank, f.keyword_rank,
           -- Same words regardless of date prefix, case and punctuation: one memory.
           regexp_replace(lower(regexp_replace(m.text, '^\\[[^]]*\\]\\s*', '')), '\\W+', '', 'g')
               AS normalised_text
    FROM fused f
    JOIN memory_items m ON m.id = f.id
    ORDER BY m.turn_id, f.score DESC, m.chunk_index
),
best_per_text AS (
    SELECT DISTINCT ON (normalised_text) *
    FROM best_per_turn
    ORDER BY normalised_text, score DESC, turn_created_at DESC
)
SELECT turn_id, conversation_id, chunk_index, role, name, text, turn_created_at, external_id,
       metadata, score, vector_rank, keyword_rank
FROM best_per_text
WHERE score >= CAST(:min_score AS float8)
ORDER BY score DESC, turn_created_at DESC
LIMIT :k
"""


def _hybrid_search_sql(*, by_conversation: bool) -> Any:
    owner = _OWNER_FILTER.format(
        conversation_filter="\n      AND m.conversation_id = :conversation_id" if by_conversation else ""
    )
    return text(_HYBRID_SEARCH.format(owner=owner)).bindparams(
        bindparam("embedding", type_=Vector(EMBEDDING_DIM)),
        bindparam("exclude_turn_ids", type_=ARRAY(UUID(as_uuid=True))),
    )


HYBRID_SEARCH_USER = _hybrid_search_sql(by_conversation=False)
HYBRID_SEARCH_CONVERSATION = _hybrid_search_sql(by_conversation=True)


@dataclass(frozen=True)
class MemoryHit:
    """One remembered turn (its best chunk) and how it was found."""

    turn_id: uuid.UUID
    # None for a fact the user stated outside any conversation.
    conversation_id: uuid.UUID | None
    chunk_index: int
    role: str
    name: str | None
    text: str
    turn_created_at: datetime
    external_id: str | None
    metadata: dict[str, Any] | None
    # Fused RRF score normalised to (0, 1]: 1.0 means first in both lists.
    score: float
    vector_rank: int | None
    keyword_rank: int | None


async def search_memory(
    session: AsyncSession,
    *,
    tenant_id: str,
    user_id: str,
    query_text: str,
    query_embedding: Sequence[float],
    k: int,
    conversation_id: uuid.UUID | None = None,
    exclude_turn_ids: Collection[uuid.UUID] = (),
    min_score: float = 0.0,
    fusion: Fusion = DEFAULT_FUSION,
) -> list[MemoryHit]:
    """The user's ``k`` most relevant memories for a query, best first, one per turn and text."""
    if k <= 0:
        return []
    candidates = max(fusion.candidates, k)
    scope = current_tenant()
    if scope is not None and scope != tenant_id:
        raise NotFound("no such memory")  # a scoped caller never searches another tenant
    settings = SET_SEARCH_SETTINGS if scope is None else SET_SEARCH_SETTINGS_AS_OWNER
    await session.execute(settings, {"ef_search": str(max(MIN_EF_SEARCH, candidates))})
    statement = HYBRID_SEARCH_USER if conversation_id is None else HYBRID_SEARCH_CONVERSATION
    params: dict[str, Any] = {
        "tenant_id": tenant_id,
        "user_id": user_id,
        "exclude_turn_ids": list(exclude_turn_ids),
        "embedding": list(query_embedding),
        "query_terms": " ".join(query_terms(query_text)),
        "candidates": candidates,
        "k": k,
        "min_score": min_score,
        "keyword_weight": fusion.keyword_weight,
        "vector_weight": fusion.vector_weight,
        "rrf_k": fusion.rrf_k,
        "bm25_k1": BM25_K1,
        "bm25_b": BM25_B,
    }
    if conversation_id is not None:
        params["conversation_id"] = conversation_id
    result = (await session.execute(statement, params)).all()
    if scope is not None:
        await session.execute(RESTORE_TENANT_ROLE)
    return [
        MemoryHit(
            turn_id=row.turn_id,
            conversation_id=row.conversation_id,
            chunk_index=row.chunk_index,
            role=row.role,
            name=row.name,
            text=row.text,
            turn_created_at=row.turn_created_at,
            external_id=row.external_id,
            metadata=row.metadata,
            score=float(row.score),
            vector_rank=row.vector_rank,
            keyword_rank=row.keyword_rank,
        )
        for row in result
    ]
