"""Retrieval latency (p50/p95) and dense recall@10 against exact search, on synthetic memory rows.

Rows are random unit vectors around 64 cluster centres with short random texts, spread
over 10,000 users; each query is filtered to one user, as in production. With
``--distribution heavy`` the first ``HEAVY_USERS`` users hold half of all rows (thousands
each at 100k rows, tens of thousands at 1M): a query for such a user can no longer take
the owner btree and sort, so the planner uses the HNSW index with iterative scans, the
path that ``hnsw.iterative_scan`` exists for. Latency is reported for heavy and light
users separately. The query
embedding is precomputed (no model, no rewrite). Loading uses COPY into a staging table
and builds the HNSW and GIN indexes after the load, which is far faster than inserting
into indexed tables.

    .venv/bin/python bench/retrieval_latency.py --rows 100000 --queries 200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
import uuid
from pathlib import Path

import asyncpg
import numpy as np
from pgvector.asyncpg import register_vector

from memory.recall.index_search import SET_SEARCH_SETTINGS, search_index
from memory.storage.db import Database, asyncpg_dsn, upgrade
from memory.storage.embedded import EmbeddedPostgres
from memory.storage.models import EMBEDDING_DIM

REPO_ROOT = Path(__file__).resolve().parent.parent
TENANT = "bench"
USERS = 10_000
CLUSTERS = 64
HEAVY_USERS = 100
VOCABULARY = [f"word{i}" for i in range(2000)]

CREATE_STAGING = """
CREATE UNLOGGED TABLE IF NOT EXISTS bench_staging (
    user_id text, conversation_id uuid, turn_id uuid, seq int, body text, embedding vector(384)
)
"""
MOVE_STAGING = """
INSERT INTO memory_items (index_id, tenant_id, user_id, conversation_id, turn_id, chunk_index, turn_seq,
                          role, text, search_terms, embedding, turn_created_at)
SELECT 1, 'bench', user_id, conversation_id, turn_id, 0, seq, 'user', body,
       to_tsvector('simple', body), embedding, now()
FROM bench_staging
"""
DENSE_TOP = """
SELECT id FROM memory_items m
WHERE m.tenant_id = 'bench' AND m.user_id = $1
ORDER BY m.embedding <=> $2 LIMIT $3
"""


def owners(rows: int, distribution: str, rng: np.random.Generator) -> np.ndarray:
    """The user number of each row: round robin, or half of the rows on the heavy users."""
    if distribution == "uniform":
        return np.arange(rows) % USERS
    heavy = rng.random(rows) < 0.5
    return np.where(heavy, rng.integers(0, HEAVY_USERS, rows), rng.integers(HEAVY_USERS, USERS, rows))


def synthetic_rows(
    rows: int, rng: np.random.Generator, distribution: str = "uniform"
) -> tuple[np.ndarray, list[tuple]]:
    """Cluster centres and the staging records (user, conversation, turn, seq, text, vector)."""
    centres = rng.standard_normal((CLUSTERS, EMBEDDING_DIM)).astype(np.float32)
    vectors = centres[rng.integers(0, CLUSTERS, rows)] + 0.6 * rng.standard_normal((rows, EMBEDDING_DIM))
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    conversations = [uuid.uuid4() for _ in range(USERS)]
    words = rng.integers(0, len(VOCABULARY), (rows, 8))
    users = owners(rows, distribution, rng)
    records = [
        (
            f"user{users[i]}",
            conversations[users[i]],
            uuid.uuid4(),
            i + 1,
            " ".join(VOCABULARY[w] for w in words[i]),
            vectors[i].astype(np.float32),
        )
        for i in range(rows)
    ]
    return centres, records


async def load(dsn: str, records: list[tuple]) -> dict[str, float]:
    """Bulk-load the rows and rebuild the indexes; returns the seconds each step took."""
    timings: dict[str, float] = {}
    conn = await asyncpg.connect(dsn)
    try:
        await register_vector(conn)
        await conn.execute(CREATE_STAGING)
        await conn.execute("DROP INDEX IF EXISTS ix_memory_embedding; DROP INDEX IF EXISTS ix_memory_terms")
        started = time.perf_counter()
        await conn.copy_records_to_table("bench_staging", records=records)
        await conn.execute(MOVE_STAGING)
        await conn.execute("DROP TABLE bench_staging")
        timings["copy_s"] = time.perf_counter() - started
        # The whole graph in memory (1M x 384-d needs ~2.5 GB); beyond it the build slows down badly.
        await conn.execute("SET maintenance_work_mem = '4GB'; SET max_parallel_maintenance_workers = 1")
        started = time.perf_counter()
        await conn.execute(
            "CREATE INDEX ix_memory_embedding ON memory_items USING hnsw (embedding vector_cosine_ops)"
            " WITH (m = 16, ef_construction = 64)"
        )
        timings["hnsw_build_s"] = time.perf_counter() - started
        started = time.perf_counter()
        await conn.execute("CREATE INDEX ix_memory_terms ON memory_items USING gin (search_terms)")
        timings["gin_build_s"] = time.perf_counter() - started
        await conn.execute("ANALYZE memory_items")
    finally:
        await conn.close()
    return {k: round(v, 1) for k, v in timings.items()}


async def dense_recall(dsn: str, queries: list[tuple[str, np.ndarray]], k: int = 10) -> float:
    """Mean recall@k of the filtered index scan (search settings) against an exact scan."""
    conn = await asyncpg.connect(dsn)
    total = 0.0
    try:
        await register_vector(conn)
        for user, vector in queries:
            async with conn.transaction():
                await conn.execute(
                    "SELECT set_config('hnsw.iterative_scan', 'relaxed_order', true),"
                    " set_config('hnsw.ef_search', '100', true)"
                )
                approx = {r["id"] for r in await conn.fetch(DENSE_TOP, user, vector, k)}
            async with conn.transaction():
                await conn.execute("SET LOCAL enable_indexscan = off; SET LOCAL enable_bitmapscan = on")
                exact = {r["id"] for r in await conn.fetch(DENSE_TOP, user, vector, k)}
            total += len(approx & exact) / max(len(exact), 1)
    finally:
        await conn.close()
    return total / len(queries)


async def measure(url: str, queries: list[tuple[str, np.ndarray, str]]) -> list[float]:
    """Seconds per ``search_index`` call, each in its own transaction."""
    db = Database(url, pool_size=2)
    latencies = []
    try:
        async with db.transaction() as session:  # warm the pool and the plan cache
            await session.execute(SET_SEARCH_SETTINGS, {"ef_search": "100"})
        for user, vector, query in queries:
            started = time.perf_counter()
            async with db.transaction() as session:
                await search_index(
                    session,
                    tenant_id=TENANT,
                    user_id=user,
                    query_text=query,
                    query_embedding=vector.tolist(),
                    index_id=1,  # the loaded rows' generation
                    k=10,
                )
            latencies.append(time.perf_counter() - started)
    finally:
        await db.dispose()
    return latencies


def _summary(latencies: list[float]) -> dict[str, float]:
    latencies = sorted(latencies)
    return {
        "p50_ms": round(1000 * latencies[len(latencies) // 2], 2),
        "p95_ms": round(1000 * latencies[int(len(latencies) * 0.95)], 2),
    }


async def run(url: str, rows: int, n_queries: int, distribution: str = "uniform") -> dict:
    rng = np.random.default_rng(0)
    started = time.perf_counter()
    centres, records = synthetic_rows(rows, rng, distribution)
    generate_s = time.perf_counter() - started
    timings = await load(asyncpg_dsn(url), records)
    queries = []
    for i in range(n_queries):
        vector = centres[rng.integers(0, CLUSTERS)] + 0.6 * rng.standard_normal(EMBEDDING_DIM)
        vector /= np.linalg.norm(vector)
        words = " ".join(VOCABULARY[w] for w in rng.integers(0, len(VOCABULARY), 3))
        # Heavy distribution: every other query is for a heavy user.
        user = (
            rng.integers(0, HEAVY_USERS) if distribution == "heavy" and i % 2 == 0 else rng.integers(0, USERS)
        )
        queries.append((f"user{user}", vector.astype(np.float32), words))
    latencies = await measure(url, queries)
    recall = await dense_recall(asyncpg_dsn(url), [(u, v) for u, v, _ in queries])
    result: dict = {
        "rows": rows,
        "users": USERS,
        "distribution": distribution,
        "queries": n_queries,
        "generate_s": round(generate_s, 1),
        **timings,
        **_summary(latencies),
        "dense_recall_at_10_vs_exact": round(recall, 4),
    }
    if distribution == "heavy":
        heavy = [t for (u, _, _), t in zip(queries, latencies, strict=True) if int(u[4:]) < HEAVY_USERS]
        light = [t for (u, _, _), t in zip(queries, latencies, strict=True) if int(u[4:]) >= HEAVY_USERS]
        result["heavy_users"] = {**_summary(heavy), "queries": len(heavy)}
        result["light_users"] = {**_summary(light), "queries": len(light)}
        result["heavy_dense_recall_at_10_vs_exact"] = round(
            await dense_recall(asyncpg_dsn(url), [(u, v) for u, v, _ in queries if int(u[4:]) < HEAVY_USERS]),
            4,
        )
    async with asyncpg_pool_free(url) as conn:
        await register_vector(conn)
        plans = {}
        for name, (owner, vector, _) in {"first_query": queries[0], "light_user": queries[-1]}.items():
            async with conn.transaction():
                await conn.execute("SELECT set_config('hnsw.iterative_scan', 'relaxed_order', true)")
                explain = await conn.fetch("EXPLAIN " + DENSE_TOP, owner, vector, 10)
            plans[name] = "\n".join(r[0].split(" <=> ")[0] for r in explain)
    result["dense_plans"] = plans
    return result


class asyncpg_pool_free:
    """One plain asyncpg connection for an EXPLAIN."""

    def __init__(self, url: str) -> None:
        self.dsn = asyncpg_dsn(url)

    async def __aenter__(self) -> asyncpg.Connection:
        self.conn = await asyncpg.connect(self.dsn)
        return self.conn

    async def __aexit__(self, *exc: object) -> None:
        await self.conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--distribution", choices=["uniform", "heavy"], default="uniform")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench/results/retrieval_latency.json")
    parser.add_argument(
        "--database-url", help="An empty migrated Postgres; default: a temporary embedded one."
    )
    args = parser.parse_args()
    server = None
    if args.database_url:
        url = args.database_url
    else:
        server = EmbeddedPostgres(Path(tempfile.mkdtemp(prefix="chatmem-latency-")), delete_on_stop=True)
        url = server.start()
    try:
        upgrade(url)
        result = asyncio.run(run(url, args.rows, args.queries, args.distribution))
    finally:
        if server is not None:
            server.stop()
    print(f"{'rows':>10}{'p50 ms':>10}{'p95 ms':>10}{'recall@10':>11}{'copy s':>9}{'hnsw s':>9}")
    print(
        f"{result['rows']:>10}{result['p50_ms']:>10}{result['p95_ms']:>10}"
        f"{result['dense_recall_at_10_vs_exact']:>11}{result['copy_s']:>9}{result['hnsw_build_s']:>9}"
    )
    for name, plan in result["dense_plans"].items():
        print(f"{name}:\n{plan}")
    for group in ("heavy_users", "light_users"):
        if group in result:
            print(group, result[group])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
