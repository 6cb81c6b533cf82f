"""The index's search: dense (exact cosine) and keyword (BM25 over tsvector) candidates.

One statement fetches the union of both top lists, each candidate with every signal
``memory.recall.fusion`` scores (its neighbours' too, for the learned fusion); the fusion
and the de-duplication happen in Python (``memory.recall.fusion``, ``memory.recall.found``),
once for every method. Choices measured on the LoCoMo slice (``bench/memory_eval.py``,
``bench/fit_fusion.py``):

- Keyword scoring is Okapi BM25 computed in SQL from the matching rows' tsvectors
  (term frequency from lexeme positions, document frequency over the user's matching
  rows, N over the user's rows). ``ts_rank_cd`` has no IDF, and frequent words drowned
  the rare names and nouns that questions hinge on.
- Every row that can be returned passes the tenant/user filter inside both candidate
  lists; nothing is joined in later without it. The same filter drops rows of turns off
  their conversation's active branch (``on_active_branch``, a flag kept by
  ``memory.record.branches``), so it costs one column test per row and no join.
- Both top lists, the BM25 corpus count and the neighbours window read one materialized
  pass over the owner's rows (the owner btree), matching the question's terms there.
  Through the GIN index the keyword list read every user's postings of the question's
  words, a cost that grew with the whole table (``bench/retrieval_latency.py``,
  docs/scaling.md).
- The dense list is exact: that pass takes every owner row's cosine distance and keeps the
  nearest ``candidates``. The pass reads each of the user's rows for BM25 anyway, so an
  approximate HNSW scan saved no row reads; and leaving the choice to the planner made the
  found lists depend on table size and storage: with the terms kept in the row (migration
  0021) the heap grew and, for a user owning most of the table, the planner switched from
  the exact per-user sort to the HNSW scan, whose relaxed order and ``ef_search`` cut changed
  the candidates (LongMemEval found lists of 14 of 50 questions). No search read the HNSW
  index after that, and migration 0022 dropped it.
- Results do not depend on physical row order or on the plan: every ``ORDER BY ... LIMIT``
  and every rank breaks ties by id, BM25 sums its terms in lexeme order, and the one
  de-duplication (``memory.recall.found.best_distinct``) ends its order on the turn id.

- The dense list holds chunks and their keys together; chunks and keys are ranked apart
  (a key is any row whose kind is not ``chunk``). A key is never a candidate: the chunk it
  points to is (also when the chunk itself is in neither list), with the key's rank and the
  best cosine of its keys as signals (``memory.recall.sentence_keys``). The keyword list
  holds chunks only.

The caller owns the transaction; the ``SET LOCAL`` style role switch below lasts until it
ends.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pgvector.sqlalchemy import Vector
from sqlalchemy import bindparam, text
from sqlalchemy.dialects.postgresql import ARRAY, UUID
from sqlalchemy.ext.asyncio import AsyncSession

from memory.errors import NotFound
from memory.recall.found import FoundMemory, best_distinct
from memory.recall.fusion import (
    DEFAULT_FUSION,
    QUESTION_PATTERN,
    CandidateSignals,
    Fusion,
    NeighbourSignals,
    is_model_reply,
)
from memory.recall.index import ForeignGeneration, describe
from memory.recall.keywords import photo_caption, query_terms
from memory.storage.models import EMBEDDING_DIM
from memory.storage.tenancy import TENANT_ROLE, current_tenant

BM25_K1 = 1.2
BM25_B = 0.75

# Under row-level security Postgres may not use an index for a non-leakproof operator such
# as `@@` (only a superuser can mark one leakproof), so keyword search would scan every
# memory row. The search statement filters tenant and user itself inside every candidate
# list and is only run for the transaction's own tenant (checked in _execute_search), so it
# alone runs as the connecting role; the rest of the transaction stays scoped.
SEARCH_AS_OWNER = text("SELECT set_config('role', 'none', true)")
RESTORE_TENANT_ROLE = text(f"SELECT set_config('role', '{TENANT_ROLE}', true)")

# on_active_branch: turns a regenerate or an edit replaced are not memory (memory/record/branches.py).
# index_id: only rows of the generation whose encoder made the query vector (memory/recall/index.py).
_OWNER_FILTER = """m.tenant_id = :tenant_id AND m.user_id = :user_id AND m.index_id = :index_id
      AND m.on_active_branch AND m.deleted_at IS NULL
      AND m.turn_id <> ALL(:exclude_turn_ids){conversation_filter}"""

# The generation is still made by the encoder of the query's vector (its key): one taken over
# while empty (memory/recall/index.py) keeps its id under another encoder's key, and a process
# that has not read it again since must not rank that encoder's rows by its own vector. Without
# a row column it is a one-time filter: the primary-key read runs once per statement, before the
# owner's rows are read, and a mismatch reads none. A caller with no key (a test or benchmark
# that built the generation with its own encoder) checks nothing.
_GENERATION_FILTER = """(CAST(:index_key AS text) IS NULL
           OR (SELECT g.spec_key FROM memory_indexes g WHERE g.id = :index_id) = :index_key)"""

# The dense and keyword top lists.
_RANKED_LISTS = """
WITH query_lexemes AS (
    SELECT DISTINCT lexeme
    FROM unnest(tsvector_to_array(to_tsvector('simple', :query_terms))) AS lexeme
),
keyword_query AS (
    SELECT to_tsquery('simple', string_agg(quote_literal(lexeme), ' | ')) AS tsq,
           array_agg(lexeme) AS lexemes
    FROM query_lexemes
),
-- The owner's rows, read once (owner btree), for both top lists, the corpus count and the
-- neighbours. Matching the question's terms here, not through the GIN index, reads only this
-- user's rows: the GIN's posting lists hold every user's rows, so its cost grew with the table.
-- A row is matched first (`matched`, tested once: OFFSET 0 keeps the subquery from being inlined
-- into each use); only a matching row's tsvector is copied with the question's lexemes weighted
-- A, so ts_filter keeps just them for the term frequencies (unnesting whole vectors was most of
-- the search at 5,000 rows a user). Weighting every row copied each tsvector, about half of them
-- for nothing: the tsvector is kept in the row (0021), so the match reads it in place. The
-- cosine distance of every row is taken here too: the dense list is exact (module docstring).
owner_rows AS MATERIALIZED (
    SELECT m.id, m.kind, m.conversation_id, m.turn_id, m.turn_seq, m.chunk_index,
           m.embedding <=> :embedding AS distance,
           CASE WHEN t.matched THEN ts_filter(setweight(m.search_terms, 'A', q.lexemes), '{{a}}') END
               AS matched_terms,
           CASE WHEN t.matched THEN length(m.search_terms) END AS doc_len
    FROM memory_items m
    CROSS JOIN keyword_query q
    CROSS JOIN LATERAL (SELECT m.search_terms @@ q.tsq AS matched OFFSET 0) t
    WHERE {owner}
      AND {generation}
),
-- The dense top list, chunks and keys together, then ranked per kind; ties broken by id.
vector_kinds AS MATERIALIZED (
    SELECT h.id, h.distance, h.kind, h.turn_id, h.chunk_index,
           row_number() OVER (PARTITION BY h.kind ORDER BY h.distance, h.id) AS rank
    FROM (SELECT o.id, o.distance, o.kind, o.turn_id, o.chunk_index
          FROM owner_rows o
          WHERE o.distance IS NOT NULL
          ORDER BY o.distance, o.id
          LIMIT :candidates) h
),
vector_ranked AS (
    SELECT id, distance, rank FROM vector_kinds WHERE kind = 'chunk'
),
-- The chunks the dense list's sentence keys point to, with their best key's rank.
key_ranked AS (
    SELECT c.id, k.rank AS key_rank
    FROM (SELECT turn_id, chunk_index, min(rank) AS rank FROM vector_kinds
          WHERE kind <> 'chunk' GROUP BY turn_id, chunk_index) k
    JOIN memory_items c
      ON c.index_id = :index_id AND c.turn_id = k.turn_id AND c.kind = 'chunk'
     AND c.chunk_index = k.chunk_index AND c.key_index = 0
),
keyword_rows AS MATERIALIZED (
    SELECT o.id, o.matched_terms, o.doc_len FROM owner_rows o WHERE o.matched_terms IS NOT NULL
),
corpus AS (
    SELECT greatest(count(*), 1) AS n FROM owner_rows WHERE kind = 'chunk'
),
term_freqs AS (
    SELECT k.id, t.lexeme, coalesce(array_length(t.positions, 1), 1) AS tf, k.doc_len
    FROM keyword_rows k, keyword_query q, unnest(k.matched_terms) AS t
    WHERE t.lexeme = ANY(q.lexemes)
),
doc_freqs AS (
    SELECT lexeme, count(*) AS df FROM term_freqs GROUP BY lexeme
),
average_length AS (
    SELECT greatest(avg(doc_len), 1) AS avg_len FROM keyword_rows
),
keyword_scored AS (
    -- summed in lexeme order: a float sum's last bits follow its order, which the plan chose
    SELECT f.id,
           sum(ln(1 + (c.n - d.df + 0.5) / (d.df + 0.5))
               * f.tf * (CAST(:bm25_k1 AS float8) + 1)
               / (f.tf + CAST(:bm25_k1 AS float8)
                  * (1 - CAST(:bm25_b AS float8) + CAST(:bm25_b AS float8) * f.doc_len / a.avg_len))
               ORDER BY f.lexeme) AS score
    FROM term_freqs f
    JOIN doc_freqs d USING (lexeme)
    CROSS JOIN corpus c
    CROSS JOIN average_length a
    GROUP BY f.id
),
keyword_ranked AS (
    SELECT id, score, row_number() OVER (ORDER BY score DESC, id) AS rank
    FROM keyword_scored
    ORDER BY score DESC, id
    LIMIT :candidates
)"""

# The union of both top lists with every signal the learned fusion reads (memory/recall/fusion.py),
# the neighbours' scores included: fetched here, so a neighbour outside both lists still counts.
_CANDIDATE_SIGNALS = """,
candidates AS (
    SELECT coalesce(v.id, k.id, s.id) AS id, v.rank AS vector_rank, k.rank AS keyword_rank,
           s.key_rank
    FROM vector_ranked v
    FULL OUTER JOIN keyword_ranked k ON v.id = k.id
    FULL OUTER JOIN key_ranked s ON s.id = coalesce(v.id, k.id)
),
candidate_rows AS MATERIALIZED (
    SELECT c.id, c.vector_rank, c.keyword_rank, c.key_rank, m.turn_id, m.conversation_id, m.chunk_index,
           m.role, m.name, m.text, m.turn_created_at, m.external_id, m.metadata,
           1 - (m.embedding <=> :embedding) AS cosine
    FROM candidates c
    JOIN memory_items m ON m.id = c.id
    -- a key's chunk is checked like a listed row (the key passed the filter, its chunk may not)
    WHERE {owner}
),
-- The best cosine of each candidate's sentence keys (its chunk's, found through the turn).
key_cosines AS (
    SELECT c.id, max(1 - (k.embedding <=> :embedding)) AS key_cosine
    FROM candidate_rows c
    JOIN memory_items k
      ON k.index_id = :index_id AND k.turn_id = c.turn_id AND k.kind <> 'chunk'
     AND k.chunk_index = c.chunk_index
    WHERE k.deleted_at IS NULL
    GROUP BY c.id
),
-- The indexed turns just before and after each candidate's turn (first chunks; rows the owner
-- filter hides are skipped over), for the candidates' turns only.
neighbour_ids AS MATERIALIZED (
    SELECT w.turn_id, w.previous_id, w.next_id
    FROM (
        SELECT o.turn_id, lag(o.id) OVER turns AS previous_id, lead(o.id) OVER turns AS next_id
        FROM owner_rows o
        WHERE o.kind = 'chunk' AND o.chunk_index = 0
          AND o.conversation_id = ANY(ARRAY(SELECT conversation_id FROM candidate_rows))
        WINDOW turns AS (PARTITION BY o.conversation_id ORDER BY o.turn_seq, o.id)
    ) w
    WHERE w.turn_id = ANY(ARRAY(SELECT turn_id FROM candidate_rows))
),
-- Their signals, one row per candidate turn. The planner estimates every CTE here at a row or
-- so: joined in the final select, it re-read the neighbour rows (and re-ran the window) once
-- per candidate; the ARRAY(...) filters run their subquery once, not per row. The scores are
-- joined on the neighbour ids, not on the fetched rows: joined after a row fetch, each
-- neighbour re-scanned the whole keyword list (1,500 rows at 5,000 rows a user).
neighbours AS MATERIALIZED (
    SELECT n.turn_id,
           p.id IS NOT NULL AS has_previous, 1 - (p.embedding <=> :embedding) AS previous_cosine,
           coalesce(pk.score, 0) AS previous_bm25, pc.vector_rank AS previous_vector_rank,
           pc.keyword_rank AS previous_keyword_rank, p.text ~ :question_pattern AS previous_is_question,
           p.role AS previous_role, p.name AS previous_name,
           x.id IS NOT NULL AS has_next, 1 - (x.embedding <=> :embedding) AS next_cosine,
           coalesce(xk.score, 0) AS next_bm25, xc.vector_rank AS next_vector_rank,
           xc.keyword_rank AS next_keyword_rank, x.text ~ :question_pattern AS next_is_question,
           x.role AS next_role, x.name AS next_name
    FROM neighbour_ids n
    LEFT JOIN keyword_scored pk ON pk.id = n.previous_id
    LEFT JOIN candidates pc ON pc.id = n.previous_id
    LEFT JOIN keyword_scored xk ON xk.id = n.next_id
    LEFT JOIN candidates xc ON xc.id = n.next_id
    LEFT JOIN memory_items p ON p.id = n.previous_id
    LEFT JOIN memory_items x ON x.id = n.next_id
)
SELECT c.turn_id, c.conversation_id, c.chunk_index, c.role, c.name, c.text, c.turn_created_at,
       c.external_id, c.metadata, c.vector_rank, c.keyword_rank, c.cosine,
       coalesce(ck.score, 0) AS bm25, c.key_rank, kc.key_cosine,
       coalesce(n.has_previous, false) AS has_previous, n.previous_cosine,
       coalesce(n.previous_bm25, 0) AS previous_bm25, n.previous_vector_rank, n.previous_keyword_rank,
       n.previous_is_question, n.previous_role, n.previous_name,
       coalesce(n.has_next, false) AS has_next, n.next_cosine, coalesce(n.next_bm25, 0) AS next_bm25,
       n.next_vector_rank, n.next_keyword_rank, n.next_is_question, n.next_role, n.next_name
FROM candidate_rows c
LEFT JOIN keyword_scored ck ON ck.id = c.id
LEFT JOIN key_cosines kc ON kc.id = c.id
LEFT JOIN neighbours n ON n.turn_id = c.turn_id
"""


def _owner_filter(*, by_conversation: bool) -> str:
    return _OWNER_FILTER.format(
        conversation_filter="\n      AND m.conversation_id = :conversation_id" if by_conversation else ""
    )


def _candidate_signals_sql(*, by_conversation: bool) -> Any:
    owner = _owner_filter(by_conversation=by_conversation)
    statement = (_RANKED_LISTS + _CANDIDATE_SIGNALS).format(owner=owner, generation=_GENERATION_FILTER)
    return text(statement).bindparams(
        bindparam("embedding", type_=Vector(EMBEDDING_DIM)),
        bindparam("exclude_turn_ids", type_=ARRAY(UUID(as_uuid=True))),
    )


CANDIDATE_SIGNALS_USER = _candidate_signals_sql(by_conversation=False)
CANDIDATE_SIGNALS_CONVERSATION = _candidate_signals_sql(by_conversation=True)
GENERATION_SPEC = text("SELECT spec, spec_key FROM memory_indexes WHERE id = :id")


@dataclass(frozen=True, slots=True)
class Candidate:
    """One candidate chunk: the memory it would be (score 0.0 until fused) and its signals."""

    memory: FoundMemory
    signals: CandidateSignals


async def search_candidates(
    session: AsyncSession,
    *,
    tenant_id: str,
    user_id: str,
    query_text: str,
    query_embedding: Sequence[float],
    index_id: int,
    depth: int,
    conversation_id: uuid.UUID | None = None,
    exclude_turn_ids: Collection[uuid.UUID] = (),
    index_key: str | None = None,
) -> list[Candidate]:
    """The union of the dense and keyword top ``depth`` chunks (and the chunks of the dense list's
    sentence keys), with the fusion's signals.

    Unscored and in no particular order; ``bench/fit_fusion.py`` fits the learned weights on
    exactly these. ``index_key``: the key of the encoder that made ``query_embedding``
    (``Generation.key``); if generation ``index_id`` is made by another encoder now (taken over),
    nothing is compared and ``ForeignGeneration`` is raised.
    """
    params: dict[str, Any] = {
        "tenant_id": tenant_id,
        "user_id": user_id,
        "index_id": index_id,
        "index_key": index_key,
        "exclude_turn_ids": list(exclude_turn_ids),
        "embedding": list(query_embedding),
        "query_terms": " ".join(query_terms(query_text)),
        "candidates": depth,
        "bm25_k1": BM25_K1,
        "bm25_b": BM25_B,
        "question_pattern": QUESTION_PATTERN,
    }
    statement = CANDIDATE_SIGNALS_USER
    if conversation_id is not None:
        params["conversation_id"] = conversation_id
        statement = CANDIDATE_SIGNALS_CONVERSATION
    found = await _execute_search(session, tenant_id, statement, params)
    if not found and index_key is not None:
        await _check_generation(session, index_id, index_key)
    return [_candidate(row) for row in found]


def fuse(candidates: Sequence[Candidate], query_text: str, fusion: Fusion) -> list[FoundMemory]:
    """Every candidate as a found memory with its fused score (not de-duplicated)."""
    scores = fusion.scores([c.signals for c in candidates], query_text)
    return [replace(c.memory, score=score) for c, score in zip(candidates, scores, strict=True)]


async def search_index(
    session: AsyncSession,
    *,
    tenant_id: str,
    user_id: str,
    query_text: str,
    query_embedding: Sequence[float],
    index_id: int,
    k: int,
    conversation_id: uuid.UUID | None = None,
    exclude_turn_ids: Collection[uuid.UUID] = (),
    min_score: float = 0.0,
    fusion: Fusion = DEFAULT_FUSION,
    index_key: str | None = None,
) -> list[FoundMemory]:
    """The user's ``k`` most relevant indexed memories for a query, best first, one per turn and text.

    ``index_id``, ``index_key``: the generation whose encoder made ``query_embedding``
    (memory/recall/index.py), as ``search_candidates`` takes them.
    """
    if k <= 0:
        return []
    candidates = await search_candidates(
        session,
        tenant_id=tenant_id,
        user_id=user_id,
        query_text=query_text,
        query_embedding=query_embedding,
        index_id=index_id,
        depth=max(fusion.candidates, k),
        conversation_id=conversation_id,
        exclude_turn_ids=exclude_turn_ids,
        index_key=index_key,
    )
    return best_distinct(fuse(candidates, query_text, fusion), k, min_score)


async def _execute_search(
    session: AsyncSession, tenant_id: str, statement: Any, params: dict[str, Any]
) -> Any:
    scope = current_tenant()
    if scope is not None and scope != tenant_id:
        raise NotFound("no such memory")  # a scoped caller never searches another tenant
    if scope is not None:
        await session.execute(SEARCH_AS_OWNER)
    result = (await session.execute(statement, params)).all()
    if scope is not None:
        await session.execute(RESTORE_TENANT_ROLE)
    return result


async def _check_generation(session: AsyncSession, index_id: int, index_key: str) -> None:
    """After a search found nothing: raise if that is because the generation is another encoder's now."""
    row = (await session.execute(GENERATION_SPEC, {"id": index_id})).one_or_none()
    if row is not None and row.spec_key != index_key:
        raise ForeignGeneration(
            f"memory index generation {index_id} was taken over by {describe(row.spec)}: "
            "it is not searched with the query vector of the encoder it replaced"
        )


def _neighbour(row: Any, side: str) -> NeighbourSignals | None:
    if not getattr(row, f"has_{side}"):
        return None
    return NeighbourSignals(
        cosine=float(getattr(row, f"{side}_cosine") or 0.0),
        bm25=float(getattr(row, f"{side}_bm25")),
        vector_rank=getattr(row, f"{side}_vector_rank"),
        keyword_rank=getattr(row, f"{side}_keyword_rank"),
        is_question=bool(getattr(row, f"{side}_is_question")),
        by_model=is_model_reply(getattr(row, f"{side}_role"), getattr(row, f"{side}_name")),
    )


def _candidate(row: Any) -> Candidate:
    memory = FoundMemory(
        turn_id=row.turn_id,
        conversation_id=row.conversation_id,
        chunk_index=row.chunk_index,
        role=row.role,
        name=row.name,
        text=row.text,
        created_at=row.turn_created_at,
        external_id=row.external_id,
        metadata=row.metadata,
        score=0.0,
        vector_rank=row.vector_rank,
        keyword_rank=row.keyword_rank,
    )
    signals = CandidateSignals(
        cosine=float(row.cosine),
        bm25=float(row.bm25),
        vector_rank=row.vector_rank,
        keyword_rank=row.keyword_rank,
        name=row.name,
        text=row.text,
        has_caption=photo_caption(row.metadata) is not None,
        previous=_neighbour(row, "previous"),
        next=_neighbour(row, "next"),
        role=row.role,
        conversation_id=row.conversation_id,
        created_at=row.turn_created_at,
        key_cosine=None if row.key_cosine is None else float(row.key_cosine),
        key_rank=row.key_rank,
    )
    return Candidate(memory, signals)
