"""Memory search latency at scale: real rows, real questions, chatmem's own search.

Loads ``--rows`` memory rows for ``--users`` users into a private embedded Postgres on the
current schema (every migration applied; rows carry the active index generation's id) and
times the search that ``POST /v1/memory/search`` runs (``Recaller.search``: unindexed turns,
query rewrite, the index's candidate statement, fusion, live conversations) for random
users with varied real questions, one search at a time. Beside it, the dense part alone
(the candidate statement's vector top list, same owner filter and depth).

The rows are real: every turn of the LoCoMo and LongMemEval slices, chunked, remembered and
keyword-indexed as the indexer does it (``memory_text``, ``memory_search_terms``), with its
real vector from the configured encoder. Each of a user's conversations walks the pool from
a random turn (so neighbours are real neighbours), and rows arrive interleaved across users
(each row's owner drawn at random), so a user's rows scatter over the heap as live traffic
leaves them. Every conversation is fully indexed (its watermark at its last row), the
steady state; the questions are the slices' questions, each with the vector the encoder
made for it (so the figure is the database's part; ``bench/encoder.py`` measures the
encoder). Loading: binary COPY with the table's indexes and unique key dropped, then every
index the migrations define rebuilt (timed one by one), then ``VACUUM (ANALYZE)``.

Configurations (``--configs``), measured in order on the same loaded rows, each on top of
the previous ones:

- ``today``: the schema and the embedded server's settings as they are;
- ``shared_buffers``: ``shared_buffers`` at ``--shared-buffers`` (restart);
- ``inline``: the vectors kept in the row (``SET STORAGE MAIN``, table rewritten) instead of
  TOAST; since migration 0016 that is the schema's own storage, so rows loaded now are
  already inline and this only shows what the rewrite costs;
- ``terms_inline``: the keyword terms (tsvector) kept in the row the same way, table
  rewritten: a search reads every one of the user's tsvectors, each through the TOAST index
  and a TOAST page while it is stored out of line; since migration 0021 rows loaded now
  are already so, and this moves in the rows of a ``--reuse-data`` run loaded before it;
- ``clustered``: the table rewritten in owner order (``CLUSTER … USING ix_memory_owner``),
  so a user's rows share pages;
- ``covering``: a covering btree for the dense top list, ``(tenant_id, user_id, index_id)
  INCLUDE (id, turn_id, embedding)`` on live rows, so it is answered from the index alone.

    nice -n 10 python bench/retrieval_latency.py --rows 1000000 --users 1000
    nice -n 10 python bench/retrieval_latency.py --rows 2000000 --users 1000 --configs today covering
    nice -n 10 python bench/retrieval_latency.py --rows 1000000 --users 1000 --configs today \
        --skip-indexes ix_memory_embedding --data-dir DIR --keep-data   # then, another statement:
    nice -n 10 python bench/retrieval_latency.py --rows 1000000 --users 1000 --configs today clustered \
        --data-dir DIR --reuse-data
    python bench/retrieval_latency.py --small          # CI: 3,000 rows, a few questions
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shutil
import struct
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import numpy as np
from common import ROOT, percentile, print_table, write_json
from locomo_import import _sessions, session_turns
from longmemeval_eval import load_pool
from memory_eval import load_questions
from pgvector.asyncpg import register_vector
from pgvector.sqlalchemy import Vector
from sqlalchemy import bindparam, event, text
from sqlalchemy.dialects.postgresql import ARRAY, UUID

from indexer.chunking import chunk_text
from memory.config import Settings, get_settings
from memory.prompt.templates import load_prompts
from memory.recall.embeddings import Embedder, load_embedder
from memory.recall.index import MemoryIndex, spec_key, spec_of
from memory.recall.index_search import _owner_filter
from memory.recall.keywords import memory_search_terms, memory_text, photo_caption
from memory.recall.recaller import Recaller
from memory.record.conversations import Owner
from memory.storage.db import Database, asyncpg_dsn, upgrade
from memory.storage.embedded import EmbeddedPostgres
from memory.storage.models import EMBEDDING_DIM

TENANT = "bench"
BENCH = ROOT.parent / "shared" / "bench"
PG_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)
COPY_HEADER = b"PGCOPY\n\xff\r\n\x00" + struct.pack(">ii", 0, 0)
COPY_COLUMNS = [
    "index_id",
    "tenant_id",
    "user_id",
    "conversation_id",
    "turn_id",
    "chunk_index",
    "turn_seq",
    "role",
    "name",
    "text",
    "search_terms",
    "embedding",
    "turn_created_at",
]
NULL = struct.pack(">i", -1)

# The dense top list of the search statement (memory/recall/index_search.py, `vector_kinds`):
# exact, every owner row's distance, nearest first, ties by id; the statement's own owner filter.
DENSE_TOP = text(
    f"""
    SELECT d.id, d.distance
    FROM (SELECT m.id, m.embedding <=> :embedding AS distance
          FROM memory_items m
          WHERE {_owner_filter(by_conversation=False)}
          OFFSET 0) d
    WHERE d.distance IS NOT NULL
    ORDER BY d.distance, d.id
    LIMIT :candidates
    """
).bindparams(
    bindparam("embedding", type_=Vector(EMBEDDING_DIM)),
    bindparam("exclude_turn_ids", type_=ARRAY(UUID(as_uuid=True))),
)

COVERING_INDEX = (
    "CREATE INDEX ix_memory_owner_dense ON memory_items (tenant_id, user_id, index_id)"
    " INCLUDE (id, turn_id, embedding) WHERE deleted_at IS NULL AND on_active_branch"
)
CONVERSATIONS = """
INSERT INTO conversations (id, tenant_id, user_id, title, memory_mode, next_seq, indexed_seq)
SELECT id, 'bench', user_id, 'bench', 'persistent', last_seq + 1, last_seq
FROM unnest($1::uuid[], $2::text[], $3::int[]) AS c(id, user_id, last_seq)
"""
TABLE_INDEXES = """
SELECT c.relname AS name, pg_get_indexdef(i.indexrelid) AS ddl, con.conname AS constraint_name,
       pg_get_constraintdef(con.oid) AS constraint_ddl
FROM pg_index i
JOIN pg_class c ON c.oid = i.indexrelid
LEFT JOIN pg_constraint con ON con.conindid = i.indexrelid AND con.contype = 'u'
WHERE i.indrelid = 'memory_items'::regclass AND NOT i.indisprimary
ORDER BY c.relname
"""
STORAGE = """
SELECT pg_total_relation_size('memory_items') AS total, pg_relation_size('memory_items') AS heap,
       (SELECT json_object_agg(c.relname, pg_relation_size(c.oid)) FROM pg_index i
        JOIN pg_class c ON c.oid = i.indexrelid WHERE i.indrelid = 'memory_items'::regclass) AS indexes
"""


@dataclass(frozen=True, slots=True)
class PoolRow:
    """One remembered chunk of a real turn: its row fields, already in COPY's binary form."""

    role: bytes
    name: bytes
    text: bytes
    chunk_index: int
    search_terms: bytes
    embedding: bytes


def _field(value: bytes) -> bytes:
    return struct.pack(">i", len(value)) + value


def slice_turns(locomo: Path, longmemeval: Path) -> list[dict[str, Any]]:
    """Every turn of both slices in conversation order: role, name, content, created_at, caption."""
    turns: list[dict[str, Any]] = []
    for sample in json.loads(locomo.read_text()):
        for n in _sessions(sample["conversation"]):
            for turn in session_turns(sample["conversation"], n):
                turns.append({**turn, "created_at": datetime.fromisoformat(turn["created_at"])})
    for started, session in load_pool(longmemeval).sessions.values():
        turns.extend(
            {
                "role": t["role"],
                "content": t["content"],
                "created_at": started,
                "name": None,
                "metadata": None,
            }
            for t in session
        )
    return [t for t in turns if t["content"].strip()]


def slice_questions(locomo: Path, longmemeval: Path) -> list[str]:
    """The questions of both slices (LoCoMo categories 1-4, every LongMemEval question)."""
    asked = [q.text for q in load_questions(locomo).questions]
    asked += [q.text for q in load_pool(longmemeval).questions]
    return list(dict.fromkeys(q.strip() for q in asked if q.strip()))


def remembered_chunks(
    turns: Sequence[dict[str, Any]], settings: Settings
) -> list[tuple[dict, int, str, str]]:
    """(turn, chunk index, chunk, embedded text) as the indexer pipeline makes them."""
    out = []
    for turn in turns:
        pieces = chunk_text(
            turn["content"], max_chars=settings.chunk_chars, overlap=settings.chunk_overlap_chars
        )
        extra = photo_caption(turn.get("metadata"))
        for index, piece in enumerate(p for p in pieces if p.strip()):
            embedded = memory_text(piece, name=turn["name"], created_at=turn["created_at"], extra=extra)
            out.append((turn, index, piece, embedded))
    return out


class Vectors:
    """The encoder's vectors of texts, kept on disk between runs (keyed by encoder and texts)."""

    def __init__(self, encoder: Embedder, cache_dir: Path) -> None:
        self.encoder = encoder
        self.cache_dir = cache_dir

    async def of(self, texts: Sequence[str]) -> np.ndarray:
        key = hashlib.sha256(
            spec_key(spec_of(self.encoder)).encode() + "\x00".join(texts).encode()
        ).hexdigest()
        path = self.cache_dir / f"{key[:24]}.npy"
        if path.exists():
            return np.load(path)
        vectors: list[list[float]] = []
        for start in range(0, len(texts), 64):
            vectors.extend(await self.encoder.embed(list(texts[start : start + 64])))
        array = np.asarray(vectors, dtype=np.float32)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        np.save(path, array)
        return array


class KnownQuestions:
    """An Embedder that answers the bench questions with the vectors the real encoder made for them.

    It records the real encoder's spec, so the index generation is the real encoder's; a text
    it does not know (none is expected) goes to the real encoder.
    """

    def __init__(self, encoder: Embedder, known: dict[str, np.ndarray]) -> None:
        self.dim = encoder.dim
        self.spec = spec_of(encoder)
        self._encoder = encoder
        self._known = known
        self.misses = 0

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        missing = [t for t in texts if t not in self._known]
        if missing:
            self.misses += len(missing)
            for t, v in zip(missing, await self._encoder.embed(missing), strict=True):
                self._known[t] = np.asarray(v, dtype=np.float32)
        return [self._known[t].tolist() for t in texts]


async def build_pool(conn: asyncpg.Connection, chunks: Sequence[tuple], vectors: np.ndarray) -> list[PoolRow]:
    """Each chunk's row fields in binary form; the tsvector made by Postgres, as the indexer's upsert does."""
    pool = []
    previous: str | None = None
    for (turn, index, piece, embedded), vector in zip(chunks, vectors, strict=True):
        terms = memory_search_terms(embedded, previous=previous)
        if index == 0:
            previous = f"{turn['name']}: {turn['content']}" if turn["name"] else turn["content"]
        tsv = await conn.fetchval("SELECT tsvectorsend(to_tsvector('simple', $1))", terms)
        pool.append(
            PoolRow(
                role=_field(turn["role"].encode()),
                name=_field(turn["name"].encode()) if turn["name"] else NULL,
                text=_field(piece.encode()),
                chunk_index=index,
                search_terms=_field(bytes(tsv)),
                embedding=_field(struct.pack(">hh", EMBEDDING_DIM, 0) + vector.astype(">f4").tobytes()),
            )
        )
    return pool


@dataclass(frozen=True, slots=True)
class Layout:
    """Who owns each row, in which conversation, at which seq, with which pool entry."""

    owner: np.ndarray  # user number per row, in arrival order
    conversation: np.ndarray  # global conversation number per row
    seq: np.ndarray  # the row's seq in its conversation
    pick: np.ndarray  # pool entry per row
    conversation_users: np.ndarray  # user number per conversation
    last_seq: np.ndarray  # the last seq per conversation


def layout(rows: int, users: int, conversations: int, pool: int, rng: np.random.Generator) -> Layout:
    """Rows interleaved across users; each user's rows fill their conversations in turn."""
    owner = rng.integers(0, users, rows)
    order = np.argsort(owner, kind="stable")
    counts = np.bincount(owner, minlength=users)
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    rank = np.empty(rows, dtype=np.int64)
    rank[order] = np.arange(rows) - np.repeat(starts, counts)  # the row's place among its user's rows
    per_user = np.maximum(counts[owner], 1)
    local = np.minimum(rank * conversations // per_user, conversations - 1)
    conversation = owner * conversations + local
    first = np.full(users * conversations, np.iinfo(np.int64).max)
    np.minimum.at(first, conversation, rank)
    seq = rank - first[conversation] + 1
    last_seq = np.zeros(users * conversations, dtype=np.int64)
    np.maximum.at(last_seq, conversation, seq)
    walk_from = rng.integers(0, pool, users * conversations)
    pick = (walk_from[conversation] + seq - 1) % pool
    return Layout(owner, conversation, seq, pick, np.arange(users * conversations) // conversations, last_seq)


def copy_chunks(
    plan: Layout,
    pool: Sequence[PoolRow],
    index_id: int,
    conversation_ids: Sequence[bytes],
    per_chunk: int = 50_000,
) -> Iterator[bytes]:
    """The rows as binary COPY data, one chunk of rows at a time."""
    index = struct.pack(">ih", 2, index_id)
    tenant = _field(TENANT.encode())
    users = [_field(f"user{u}".encode()) for u in range(int(plan.owner.max()) + 1)]
    conversations = [_field(c) for c in conversation_ids]
    start_us = int((datetime.now(UTC) - PG_EPOCH).total_seconds() * 1e6) - len(plan.owner) * 1_000_000
    yield COPY_HEADER
    for begin in range(0, len(plan.owner), per_chunk):
        parts = []
        for i in range(begin, min(begin + per_chunk, len(plan.owner))):
            row = pool[plan.pick[i]]
            parts.append(
                b"".join(
                    (
                        b"\x00\x0d",
                        index,
                        tenant,
                        users[plan.owner[i]],
                        conversations[plan.conversation[i]],
                        _field(uuid.uuid4().bytes),
                        struct.pack(">ii", 4, row.chunk_index),
                        struct.pack(">ii", 4, int(plan.seq[i])),
                        row.role,
                        row.name,
                        row.text,
                        row.search_terms,
                        row.embedding,
                        struct.pack(">iq", 8, start_us + i * 1_000_000),
                    )
                )
            )
        yield b"".join(parts)
    yield struct.pack(">h", -1)


async def load(
    dsn: str, plan: Layout, pool: Sequence[PoolRow], index_id: int, skip: Sequence[str] = ()
) -> dict[str, Any]:
    """Conversations, then the rows by COPY with the indexes dropped, then every index rebuilt
    (but those in ``skip``); seconds."""
    timings: dict[str, Any] = {}
    conn = await asyncpg.connect(dsn)
    try:
        conversation_ids = [uuid.uuid4() for _ in range(len(plan.last_seq))]
        started = time.perf_counter()
        await conn.execute(
            CONVERSATIONS,
            conversation_ids,
            [f"user{u}" for u in plan.conversation_users],
            [int(s) for s in plan.last_seq],
        )
        timings["conversations_s"] = round(time.perf_counter() - started, 1)
        indexes = await conn.fetch(TABLE_INDEXES)
        for ix in indexes:
            if ix["constraint_name"]:
                await conn.execute(f"ALTER TABLE memory_items DROP CONSTRAINT {ix['constraint_name']}")
            else:
                await conn.execute(f"DROP INDEX {ix['name']}")
        print(f"copying (load {os.getloadavg()[0]:.1f})", flush=True)
        started = time.perf_counter()

        async def source() -> AsyncIterator[bytes]:
            for chunk in copy_chunks(plan, pool, index_id, [c.bytes for c in conversation_ids]):
                yield chunk

        await conn.copy_to_table("memory_items", source=source(), columns=COPY_COLUMNS, format="binary")
        timings["copy_s"] = round(time.perf_counter() - started, 1)
        await conn.execute("SET maintenance_work_mem = '2GB'")
        builds = {}
        for ix in indexes:
            if ix["name"] in skip:
                builds[ix["name"]] = "skipped"
                continue
            print(f"building {ix['name']} (load {os.getloadavg()[0]:.1f})", flush=True)
            started = time.perf_counter()
            if ix["constraint_name"]:
                await conn.execute(
                    f"ALTER TABLE memory_items ADD CONSTRAINT {ix['constraint_name']} {ix['constraint_ddl']}"
                )
            else:
                await conn.execute(ix["ddl"])
            builds[ix["name"]] = round(time.perf_counter() - started, 1)
        timings["index_build_s"] = builds
        started = time.perf_counter()
        await conn.execute("VACUUM (ANALYZE) memory_items")
        await conn.execute("VACUUM (ANALYZE) conversations")
        timings["vacuum_s"] = round(time.perf_counter() - started, 1)
    finally:
        await conn.close()
    return timings


async def storage(dsn: str) -> dict[str, Any]:
    conn = await asyncpg.connect(dsn)
    try:
        row = await conn.fetchrow(STORAGE)
    finally:
        await conn.close()
    mb = 1024 * 1024
    return {
        "total_mb": round(row["total"] / mb),
        "heap_mb": round(row["heap"] / mb),
        "indexes_mb": {k: round(v / mb) for k, v in json.loads(row["indexes"]).items()},
    }


async def time_dense(
    db: Database, asked: Sequence[tuple[str, str]], vectors: dict[str, np.ndarray], index_id: int, depth: int
) -> list[float]:
    """Seconds per dense top list (the search statement's `vector_kinds`), each in its own transaction."""
    out = []
    for user, question in asked:
        started = time.perf_counter()
        async with db.transaction() as session:
            await session.execute(
                DENSE_TOP,
                {
                    "tenant_id": TENANT,
                    "user_id": user,
                    "index_id": index_id,
                    "exclude_turn_ids": [],
                    "embedding": vectors[question].tolist(),
                    "candidates": depth,
                },
            )
        out.append(time.perf_counter() - started)
    return out


async def time_search(
    recaller: Recaller, asked: Sequence[tuple[str, str]], k: int
) -> tuple[list[float], list[int]]:
    """Seconds per `Recaller.search` (what POST /v1/memory/search runs), and memories found per search."""
    out, found = [], []
    for user, question in asked:
        started = time.perf_counter()
        result = await recaller.search(Owner(TENANT, user), question, k=k)
        out.append(time.perf_counter() - started)
        found.append(len(result.memories))
    return out, found


async def dense_plan(dsn: str, user: str, vector: np.ndarray, index_id: int, depth: int) -> str:
    conn = await asyncpg.connect(dsn)
    try:
        await register_vector(conn)
        sql = DENSE_TOP.text
        for name, n in (
            ("tenant_id", 1),
            ("user_id", 2),
            ("index_id", 3),
            ("exclude_turn_ids", 4),
            ("embedding", 5),
            ("candidates", 6),
        ):
            sql = sql.replace(f":{name}", f"${n}")
        rows = await conn.fetch(
            "EXPLAIN (ANALYZE, BUFFERS) " + sql, TENANT, user, index_id, [], vector, depth
        )
    finally:
        await conn.close()
    return "\n".join(r[0].split(" <=> ")[0][:150] for r in rows)


async def search_plan(db: Database, recaller: Recaller, user: str, question: str) -> str:
    """EXPLAIN (ANALYZE, BUFFERS) of the candidate statement one search runs (captured as it runs)."""
    captured: list[tuple[str, Any]] = []

    def capture(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
        if "keyword_ranked" in statement:
            captured.append((statement, parameters))

    event.listen(db.engine.sync_engine, "before_cursor_execute", capture)
    try:
        await recaller.search(Owner(TENANT, user), question, k=recaller.settings.memory_top_k)
    finally:
        event.remove(db.engine.sync_engine, "before_cursor_execute", capture)
    statement, parameters = captured[0]
    async with db.transaction() as session:
        raw = (await (await session.connection()).get_raw_connection()).driver_connection
        rows = await raw.fetch("EXPLAIN (ANALYZE, BUFFERS) " + statement, *parameters)
    return "\n".join(r[0].split(" <=> ")[0][:170] for r in rows)


async def measure(
    url: str,
    args: argparse.Namespace,
    settings: Settings,
    known: KnownQuestions,
    vectors: dict[str, np.ndarray],
    asked: Sequence[tuple[str, str]],
) -> dict[str, Any]:
    """One configuration: warm up, then the dense part and the full search over every question."""
    load_before = os.getloadavg()
    db = Database(url, pool_size=2)
    try:
        index = MemoryIndex(db, known)
        generation = await index.start()
        recaller = Recaller(
            db, index, complete=None, prompts=load_prompts(settings.prompt_language), settings=settings
        )
        depth = max(recaller.fusion.candidates, settings.memory_top_k + 5)
        warm = asked[: args.warmup]
        await time_dense(db, warm, vectors, generation.id, depth)
        await time_search(recaller, warm, settings.memory_top_k)
        dense = await time_dense(db, asked, vectors, generation.id, depth)
        full, found = await time_search(recaller, asked, settings.memory_top_k)
        plan = await search_plan(db, recaller, *asked[0]) if args.explain else ""
    finally:
        await db.dispose()
    dense_explained = await dense_plan(
        asyncpg_dsn(url), asked[0][0], vectors[asked[0][1]], generation.id, depth
    )
    return {
        "queries": len(asked),
        "search_p50_ms": round(1000 * percentile(full, 50), 1),
        "search_p95_ms": round(1000 * percentile(full, 95), 1),
        "dense_p50_ms": round(1000 * percentile(dense, 50), 1),
        "dense_p95_ms": round(1000 * percentile(dense, 95), 1),
        "found_mean": round(float(np.mean(found)), 2),
        "load_avg_1m": [round(load_before[0], 1), round(os.getloadavg()[0], 1)],
        "dense_plan": dense_explained,
        "search_plan": plan,
    }


# The configurations that keep one column in the row (STORAGE MAIN), the table rewritten.
IN_ROW = {"inline": "embedding", "terms_inline": "search_terms"}


async def set_config(url: str, name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Apply one configuration's change; returns what it did (and how long an index took)."""
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        if name == "shared_buffers":
            await conn.execute(f"ALTER SYSTEM SET shared_buffers = '{args.shared_buffers}'")
            return {"shared_buffers": args.shared_buffers, "restart": True}
        # pgvector's type is stored `external`, the tsvector `extended`: a row over ~2 KB (nearly
        # all: the tsvector carries the previous turn's words) has them moved out to the TOAST
        # table, and each read costs a TOAST index probe and page. MAIN keeps a column in the row.
        if name in IN_ROW:
            column = IN_ROW[name]
            await conn.execute(f"ALTER TABLE memory_items ALTER COLUMN {column} SET STORAGE MAIN")
            started = time.perf_counter()
            await conn.execute("SET maintenance_work_mem = '2GB'")
            await conn.execute("VACUUM (FULL) memory_items")  # rewrites every row (and rebuilds the indexes)
            rewrite = round(time.perf_counter() - started, 1)
            await conn.execute("VACUUM (ANALYZE) memory_items")
            return {f"{column}_storage": "main", "rewrite_s": rewrite}
        if name == "clustered":
            # Rows in owner order: a user's rows share heap pages instead of one page per row.
            await conn.execute("SET maintenance_work_mem = '2GB'")
            started = time.perf_counter()
            await conn.execute("CLUSTER memory_items USING ix_memory_owner")
            rewrite = round(time.perf_counter() - started, 1)
            await conn.execute("VACUUM (ANALYZE) memory_items")
            return {"clustered_by": "ix_memory_owner", "rewrite_s": rewrite}
        if name == "covering":
            await conn.execute("SET maintenance_work_mem = '2GB'")
            started = time.perf_counter()
            await conn.execute(COVERING_INDEX)
            build = round(time.perf_counter() - started, 1)
            await conn.execute("VACUUM (ANALYZE) memory_items")
            return {"index_build_s": build}
        return {}
    finally:
        await conn.close()


async def prepare(
    url: str, args: argparse.Namespace, settings: Settings
) -> tuple[KnownQuestions, dict, list, dict]:
    """Encode the pool and the questions, load the rows; what `measure` needs, and the load figures."""
    started = time.perf_counter()
    encoder = await load_embedder(settings, threads=1)
    turns = slice_turns(args.locomo, args.longmemeval)
    if args.pool_turns:
        turns = turns[: args.pool_turns]
    chunks = remembered_chunks(turns, settings)
    questions = slice_questions(args.locomo, args.longmemeval)
    store = Vectors(encoder, args.vector_cache)
    chunk_vectors = await store.of([c[3] for c in chunks])
    question_vectors = dict(zip(questions, await store.of(questions), strict=True))
    encode_s = round(time.perf_counter() - started, 1)
    known = KnownQuestions(encoder, dict(question_vectors))
    db = Database(url, pool_size=1)
    try:
        generation = await MemoryIndex(db, known).start()
    finally:
        await db.dispose()
    dsn = asyncpg_dsn(url)
    conn = await asyncpg.connect(dsn)
    try:
        pool = await build_pool(conn, chunks, chunk_vectors)
    finally:
        await conn.close()
    rng = np.random.default_rng(args.seed)
    plan = layout(args.rows, args.users, args.conversations, len(pool), rng)
    started = time.perf_counter()
    if args.reuse_data:
        timings: dict[str, Any] = {"reused": str(args.data_dir)}
    else:
        timings = await load(dsn, plan, pool, generation.id, args.skip_indexes)
    timings["load_total_s"] = round(time.perf_counter() - started, 1)
    users = rng.integers(0, args.users, args.queries)
    asked = [
        (f"user{u}", questions[int(q)])
        for u, q in zip(users, rng.integers(0, len(questions), args.queries), strict=True)
    ]
    facts = {"pool_chunks": len(pool), "questions": len(questions), "encode_s": encode_s, **timings}
    return known, question_vectors, asked, facts


def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = get_settings()
    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="chatmem-retrieval-"))
    server = EmbeddedPostgres(data_dir)
    url = server.start()
    result: dict[str, Any] = {
        "rows": args.rows,
        "users": args.users,
        "conversations_per_user": args.conversations,
    }
    try:
        upgrade(url)
        print(
            f"loading {args.rows:,} rows for {args.users:,} users (load {os.getloadavg()[0]:.1f})", flush=True
        )
        known, vectors, asked, facts = asyncio.run(prepare(url, args, settings))
        result["load"] = facts
        print("loaded", facts, flush=True)
        result["configs"] = {}
        for name in args.configs:
            change = asyncio.run(set_config(url, name, args))
            if change.get("restart"):
                server.stop()
                server = EmbeddedPostgres(data_dir)
                url = server.start()
            figures = asyncio.run(measure(url, args, settings, known, vectors, asked))
            figures["storage"] = asyncio.run(storage(asyncpg_dsn(url)))
            figures["change"] = change
            result["configs"][name] = figures
            print(name, {k: v for k, v in figures.items() if not k.endswith("plan")}, flush=True)
        result["encoder_misses"] = known.misses
    finally:
        server.stop()
        if not args.keep_data and not args.reuse_data:
            shutil.rmtree(data_dir, ignore_errors=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--users", type=int, default=1_000)
    parser.add_argument("--conversations", type=int, default=20, help="conversations per user")
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument(
        "--configs",
        nargs="+",
        default=["today", "shared_buffers", "inline", "covering"],
        choices=["today", "shared_buffers", "inline", "terms_inline", "covering", "clustered"],
    )
    parser.add_argument("--shared-buffers", default="4GB")
    parser.add_argument(
        "--skip-indexes", nargs="*", default=[], help="schema indexes not rebuilt after the load"
    )
    parser.add_argument("--pool-turns", type=int, default=0, help="use only the first N turns of the slices")
    parser.add_argument(
        "--small", action="store_true", help="CI: 3,000 rows, 30 users, 200 turns, 10 questions"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--explain", action="store_true", help="print the search statement's plan")
    parser.add_argument("--locomo", type=Path, default=BENCH / "locomo_dev.json")
    parser.add_argument("--longmemeval", type=Path, default=BENCH / "longmemeval_dev.json")
    parser.add_argument(
        "--vector-cache", type=Path, default=Path(tempfile.gettempdir()) / "chatmem-bench-vectors"
    )
    parser.add_argument(
        "--data-dir", type=Path, help="the embedded Postgres' directory (default: a temp dir)"
    )
    parser.add_argument("--keep-data", action="store_true", help="keep the data directory afterwards")
    parser.add_argument(
        "--reuse-data",
        action="store_true",
        help="--data-dir already holds the rows of a --keep-data run with the same --rows/--users/--seed:"
        " measure them again without loading (a statement's before/after on the same rows)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/retrieval_latency.json"))
    args = parser.parse_args()
    if args.reuse_data and args.data_dir is None:
        parser.error("--reuse-data needs --data-dir")
    if args.small:
        args.rows, args.users, args.conversations = 3_000, 30, 5
        args.pool_turns, args.queries, args.warmup = args.pool_turns or 200, 10, 2
    result = run(args)
    rows = [
        {
            "config": name,
            "rows": f"{args.rows:,}",
            "users": args.users,
            "search p50/p95 ms": f"{c['search_p50_ms']} / {c['search_p95_ms']}",
            "dense p50/p95 ms": f"{c['dense_p50_ms']} / {c['dense_p95_ms']}",
            "load avg": " → ".join(str(x) for x in c["load_avg_1m"]),
            "storage MB": c["storage"]["total_mb"],
        }
        for name, c in result["configs"].items()
    ]
    print_table(
        "memory search, one at a time (Recaller.search; dense = its vector top list alone)",
        rows,
        ["config", "rows", "users", "search p50/p95 ms", "dense p50/p95 ms", "load avg", "storage MB"],
    )
    load = result["load"]
    if "reused" in load:
        print(f"\nrows reused from {load['reused']}; encode {load['encode_s']} s")
    else:
        print(
            f"\nload: copy {load['copy_s']} s, index builds {load['index_build_s']},"
            f" vacuum {load['vacuum_s']} s, total {load['load_total_s']} s; encode {load['encode_s']} s"
        )
    for name, c in result["configs"].items():
        print(f"\n{name}: dense plan (first question)\n{c['dense_plan']}")
        if c["search_plan"]:
            print(f"\n{name}: search statement plan (first question)\n{c['search_plan']}")
    write_json(args.out, result)


if __name__ == "__main__":
    main()
