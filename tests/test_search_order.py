"""A search's results depend on the rows and the question only: not on where Postgres keeps the
rows, nor on the plan it picks to read them.

Keeping the search terms in the row (migration 0021) once changed LongMemEval's found lists:
the bigger heap made the planner read the dense list through the approximate HNSW index
instead of sorting the user's rows, and ties cut by LIMIT fell wherever the rows lay.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest
from sqlalchemy import func, insert, text

from memory.recall.embeddings import HashEmbedder
from memory.recall.index_search import search_candidates, search_index
from memory.recall.keywords import memory_search_terms, memory_text
from memory.storage.db import Database, asyncpg_dsn
from memory.storage.models import MemoryItem

EMBEDDER = HashEmbedder()
WHEN = datetime(2024, 3, 1, 8, 0, tzinfo=UTC)
QUESTION = "Where do I keep the spare key?"
DEPTH = 20

# The same table, its rows laid out again: the ids stay, the order on the pages changes.
REVERSED = [
    "CREATE TEMP TABLE reordered AS SELECT * FROM memory_items ORDER BY id DESC",
    "DELETE FROM memory_items",
    "INSERT INTO memory_items SELECT * FROM reordered",
    "VACUUM FULL memory_items",
    "ANALYZE memory_items",
]
TERMS_IN_ROW = [
    "ALTER TABLE memory_items ALTER COLUMN search_terms SET STORAGE MAIN",
    "VACUUM FULL memory_items",
    "ANALYZE memory_items",
]
# The exact dense order, whatever index exists: no index scan can serve it.
EXACT_DENSE = text(
    "SELECT turn_id FROM memory_items ORDER BY embedding <=> CAST(:query AS vector), id LIMIT :depth"
)


async def _remember_all(db: Database, contents: list[str]) -> list[uuid.UUID]:
    """One user's memory rows, one turn each, all on one day (same-text turns get the same vector)."""
    turn_ids = [uuid.uuid4() for _ in contents]
    texts = [memory_text(c, name=None, created_at=WHEN) for c in contents]
    vectors = await EMBEDDER.embed(texts)
    conversation_id = uuid.uuid4()
    rows = [
        {
            "index_id": 1,
            "tenant_id": "t1",
            "user_id": "u1",
            "conversation_id": conversation_id,
            "turn_id": turn_id,
            "chunk_index": 0,
            "turn_seq": seq,
            "role": "user",
            "text": body,
            "search_terms": func.to_tsvector("simple", memory_search_terms(body)),
            "embedding": vector,
            "turn_created_at": WHEN + timedelta(minutes=seq),
        }
        for seq, (turn_id, body, vector) in enumerate(zip(turn_ids, texts, vectors, strict=True), 1)
    ]
    async with db.transaction() as session:
        for row in rows:
            await session.execute(insert(MemoryItem).values(**row))
    return turn_ids


async def _admin(db: Database, statements: list[str]) -> None:
    conn = await asyncpg.connect(asyncpg_dsn(db.url))
    try:
        for statement in statements:  # one by one: VACUUM refuses a transaction block
            await conn.execute(statement)
    finally:
        await conn.close()


Ranked = tuple[list[tuple[object, ...]], list[tuple[object, ...]]]


async def _ranked(db: Database, planner: tuple[str, ...] = (), depth: int = DEPTH) -> Ranked:
    """The candidates (turn, dense rank, keyword rank) and the found memories (turn, score)."""
    (vector,) = await EMBEDDER.embed([QUESTION])
    params = {
        "tenant_id": "t1",
        "user_id": "u1",
        "query_text": QUESTION,
        "query_embedding": vector,
        "index_id": 1,
    }
    async with db.transaction() as session:
        for setting in planner:
            await session.execute(text(setting))
        candidates = await search_candidates(session, depth=depth, **params)
        found = await search_index(session, k=5, **params)
    listed = sorted((c.memory.turn_id, c.signals.vector_rank, c.signals.keyword_rank) for c in candidates)
    return listed, [(m.turn_id, m.score) for m in found]


@pytest.mark.parametrize("relayout", [REVERSED, TERMS_IN_ROW], ids=["reversed_rows", "terms_in_row"])
async def test_ranking_is_the_same_whatever_the_physical_row_order_or_storage(
    db: Database, relayout: list[str]
) -> None:
    # Three times the depth of identical memories: equal distance and equal BM25, so each top
    # list cuts among ties; the rest share some of the question's words.
    same = ["I keep the spare key under the blue flowerpot."] * (3 * DEPTH)
    others = [f"The spare tyre number {i} is in the garage, the key ring {i} on the hook." for i in range(40)]
    await _remember_all(db, same + others)
    before = await _ranked(db)
    await _admin(db, relayout)
    after = await _ranked(db)
    assert after == before


HNSW = (
    "CREATE INDEX test_memory_hnsw ON memory_items USING hnsw (embedding vector_cosine_ops)"
    " WITH (m = 16, ef_construction = 64)"
)


async def test_the_dense_list_is_exact_whatever_plan_the_planner_picks(db: Database) -> None:
    # Distinct memories, many more than the depth; with an HNSW index on the vectors (as before
    # migration 0022 dropped it) the planner is pushed towards an index-ordered plan (the HNSW
    # scan, approximate) and then away from it: the dense list stays the exact one.
    words = ["key", "garden", "piano", "Lisbon", "sister", "dinner", "rain", "train", "book", "dog"]
    contents = [
        f"Note {i}: {words[i % 10]} {words[i * 7 // 10 % 10]} {words[i * 3 // 100 % 10]} {i}"
        for i in range(2000)
    ]
    await _remember_all(db, contents)
    (query,) = await EMBEDDER.embed([QUESTION])
    depth = 100
    async with db.transaction() as session:
        await session.execute(text("SET LOCAL enable_indexscan = off"))
        exact = list((await session.execute(EXACT_DENSE, {"query": str(query), "depth": depth})).scalars())
    plans = [
        (),
        ("SET LOCAL enable_seqscan = off", "SET LOCAL enable_sort = off"),
        ("SET LOCAL enable_indexscan = off", "SET LOCAL enable_bitmapscan = off"),
    ]
    await _admin(db, [HNSW])
    try:
        results = [await _ranked(db, plan, depth) for plan in plans]
    finally:
        await _admin(db, ["DROP INDEX test_memory_hnsw"])
    for listed, _ in results:
        dense = [turn for rank, turn in sorted((r[1], r[0]) for r in listed if r[1] is not None)]
        assert dense == exact
    assert results[1] == results[0] and results[2] == results[0]
