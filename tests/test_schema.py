import asyncio
import hashlib
import uuid

import asyncpg
from sqlalchemy import make_url, text

from memory.recall.embeddings import HashEmbedder
from memory.recall.index_search import search_index
from memory.storage.db import Database, async_url, asyncpg_dsn, upgrade


async def test_migrations_create_pgvector_tables(db: Database) -> None:
    async with db.transaction() as session:
        version = (
            await session.execute(text("SELECT extversion FROM pg_extension WHERE extname='vector'"))
        ).scalar()
        tables = set(
            (
                await session.execute(text("SELECT tablename FROM pg_tables WHERE schemaname='public'"))
            ).scalars()
        )
    assert version is not None
    assert {"conversations", "turns", "turn_events", "outbox", "memory_items", "tool_invocations"} <= tables


def fresh_database(pg_url: str, name: str) -> str:
    """The URL of a new, empty database `name` beside the test database (dropped first if left over)."""
    asyncio.run(admin(pg_url, f"DROP DATABASE IF EXISTS {name}"))
    asyncio.run(admin(pg_url, f"CREATE DATABASE {name}"))
    return make_url(async_url(pg_url)).set(database=name).render_as_string(hide_password=False)


async def admin(pg_url: str, statement: str) -> None:
    conn = await asyncpg.connect(asyncpg_dsn(pg_url))
    try:
        await conn.execute(statement)
    finally:
        await conn.close()


def test_an_installation_before_0020_upgrades_to_keyword_search_without_the_gin_index(pg_url: str) -> None:
    # Migration 0020 drops the GIN index of memory search terms (the search matches terms on the
    # owner's rows): an existing installation keeps its rows, its key, its upsert and its keyword
    # search.
    url = fresh_database(pg_url, "upgrade_0020")
    upgrade(url, "0019")  # the revision 0020 follows
    turn_id = uuid.uuid4()
    asyncio.run(_remember_and_search(url, turn_id, before=True))
    upgrade(url, "head")
    asyncio.run(_remember_and_search(url, turn_id, before=False))
    asyncio.run(admin(pg_url, "DROP DATABASE upgrade_0020"))


UPSERT_ROW = text(
    "INSERT INTO memory_items (index_id, tenant_id, user_id, conversation_id, turn_id, chunk_index,"
    " turn_seq, role, text, search_terms, embedding, turn_created_at)"
    " VALUES (1, 't1', 'u1', :conversation_id, :turn_id, 0, 1, 'user', :text,"
    " to_tsvector('simple', :text), CAST(:vector AS vector), now())"
    " ON CONFLICT (index_id, turn_id, kind, chunk_index, key_index) DO UPDATE SET text = EXCLUDED.text"
)
MEMORY_INDEXES = text(
    "SELECT indexname FROM pg_indexes WHERE tablename = 'memory_items' AND indexdef LIKE '%USING gin%'"
)


async def _remember_and_search(url: str, turn_id: uuid.UUID, *, before: bool) -> None:
    db = Database(url, pool_size=1)
    text_now = "My sister Anna lives in Lisbon." if before else "My sister Anna moved to Porto."
    (vector,) = await HashEmbedder().embed([text_now])
    try:
        async with db.transaction() as session:
            gin = list((await session.execute(MEMORY_INDEXES)).scalars())
            assert gin == (["ix_memory_terms"] if before else [])
            params = {
                "conversation_id": uuid.uuid4(),
                "turn_id": turn_id,
                "text": text_now,
                "vector": str(vector),
            }
            await session.execute(UPSERT_ROW, params)
        async with db.transaction() as session:
            rows = (await session.execute(text("SELECT turn_id, text FROM memory_items"))).all()
            hits = await search_index(
                session,
                tenant_id="t1",
                user_id="u1",
                query_text="Where does Anna live?",
                query_embedding=vector,
                index_id=1,
                k=5,
            )
        assert rows == [(turn_id, text_now)]  # one row: the second write hit the unique key
        assert [(h.turn_id, h.keyword_rank) for h in hits] == [(turn_id, 1)]
    finally:
        await db.dispose()


TERMS_ROW = text(
    "INSERT INTO memory_items (index_id, tenant_id, user_id, conversation_id, turn_id, chunk_index,"
    " turn_seq, role, text, search_terms, embedding, turn_created_at)"
    " VALUES (1, 't1', 'u1', :conversation_id, :turn_id, 0, 1, 'user', :text,"
    " to_tsvector('simple', :text), CAST(:vector AS vector), now())"
)
TERMS_OUT_OF_LINE = text(
    "SELECT pg_column_toast_chunk_id(search_terms) IS NOT NULL FROM memory_items WHERE turn_id = :turn_id"
)


def test_0021_keeps_a_long_turns_search_terms_in_its_row(pg_url: str) -> None:
    # A search reads every one of the user's tsvectors: out of line, each cost a TOAST probe and
    # page. Rows written after 0021 keep it in the row; rows written before move in on a rewrite.
    async def write_long_turn(url: str) -> uuid.UUID:
        # ~4 KB of tsvector that compresses little: the row is over 2 KB, but fits a page
        words = " ".join(hashlib.sha256(str(i).encode()).hexdigest()[:12] for i in range(250))
        (vector,) = await HashEmbedder().embed([words])
        turn_id = uuid.uuid4()
        db = Database(url, pool_size=1)
        try:
            async with db.transaction() as session:
                params = {"conversation_id": uuid.uuid4(), "turn_id": turn_id, "text": words}
                await session.execute(TERMS_ROW, params | {"vector": str(vector)})
        finally:
            await db.dispose()
        return turn_id

    async def out_of_line(url: str, turn_id: uuid.UUID) -> bool:
        db = Database(url, pool_size=1)
        try:
            async with db.transaction() as session:
                return bool((await session.execute(TERMS_OUT_OF_LINE, {"turn_id": turn_id})).scalar())
        finally:
            await db.dispose()

    url = fresh_database(pg_url, "upgrade_0021")
    upgrade(url, "0020")  # the revision 0021 follows
    before = asyncio.run(write_long_turn(url))
    assert asyncio.run(out_of_line(url, before))
    upgrade(url, "head")
    after = asyncio.run(write_long_turn(url))
    assert not asyncio.run(out_of_line(url, after))
    assert asyncio.run(out_of_line(url, before))  # moved in only when the table is rewritten
    asyncio.run(admin(pg_url, "DROP DATABASE upgrade_0021"))


HNSW_INDEXES = text(
    "SELECT indexname FROM pg_indexes WHERE tablename = 'memory_items' AND indexdef LIKE '%USING hnsw%'"
)


def test_0022_drops_the_unread_hnsw_index_and_a_search_still_ranks_by_vector(pg_url: str) -> None:
    # No search reads the HNSW index (the dense list is exact, in the owner pass): 0022 drops it,
    # so inserts stop paying for its graph. The vector itself stays and still ranks.
    async def hnsw_then_search(url: str) -> tuple[list[str], list[tuple[uuid.UUID, int | None]]]:
        db = Database(url, pool_size=1)
        (vector,) = await HashEmbedder().embed(["My sister Anna lives in Lisbon."])
        turn_id = uuid.uuid4()
        try:
            async with db.transaction() as session:
                indexes = list((await session.execute(HNSW_INDEXES)).scalars())
                params = {"conversation_id": uuid.uuid4(), "turn_id": turn_id, "text": "Anna, Lisbon."}
                await session.execute(TERMS_ROW, params | {"vector": str(vector)})
                hits = await search_index(
                    session,
                    tenant_id="t1",
                    user_id="u1",
                    query_text="unrelated words",
                    query_embedding=vector,
                    index_id=1,
                    k=5,
                )
                await session.execute(text("DELETE FROM memory_items"))
        finally:
            await db.dispose()
        return indexes, [(h.turn_id, h.vector_rank) for h in hits if h.turn_id == turn_id]

    url = fresh_database(pg_url, "upgrade_0022")
    upgrade(url, "0021")  # the revision 0022 follows
    before, found_before = asyncio.run(hnsw_then_search(url))
    upgrade(url, "head")
    after, found_after = asyncio.run(hnsw_then_search(url))
    assert (before, after) == (["ix_memory_embedding"], [])
    assert [rank for _, rank in found_before] == [rank for _, rank in found_after] == [1]
    asyncio.run(admin(pg_url, "DROP DATABASE upgrade_0022"))


# The leading column of every index on memory_items.
MEMORY_INDEX_LEADS = text(
    """
    SELECT c.relname, a.attname
    FROM pg_index i
    JOIN pg_class c ON c.oid = i.indexrelid
    JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
    WHERE i.indrelid = 'memory_items'::regclass
    """
)


def test_0023_a_turns_memory_rows_are_found_by_the_turn_on_postgres_without_skip_scan(pg_url: str) -> None:
    # The window's check of the memories it showed (before every reply) and retention look rows
    # up by turn alone. The only index holding turn_id led with index_id: PostgreSQL 18 skip-scans
    # it, 17 (the Compose file's) read all of it for every lookup. An installation at 0022 gains
    # an index that leads with turn_id.
    async def index_leads(url: str) -> dict[str, str]:
        db = Database(url, pool_size=1)
        try:
            async with db.session() as session:
                return {row.relname: row.attname for row in await session.execute(MEMORY_INDEX_LEADS)}
        finally:
            await db.dispose()

    url = fresh_database(pg_url, "upgrade_0023")
    upgrade(url, "0022")  # the revision 0023 follows
    before = asyncio.run(index_leads(url))
    upgrade(url, "head")
    after = asyncio.run(index_leads(url))
    assert "turn_id" not in before.values()
    assert after.get("ix_memory_turn") == "turn_id"
    asyncio.run(admin(pg_url, "DROP DATABASE upgrade_0023"))


OUTBOX_INDEXES = text(
    "SELECT indexname, indexdef FROM pg_indexes"
    " WHERE tablename = 'outbox' AND indexname LIKE 'ix_outbox_conv%'"
)
INSERT_OUTBOX = text(
    "INSERT INTO outbox (tenant_id, user_id, conversation_id, turn_id, payload)"
    " VALUES ('t1', 'u1', :conversation_id, :turn_id, CAST(:payload AS jsonb))"
)


def test_0024_outbox_rows_are_found_by_conversation_and_seq_and_a_poison_row_still_inserts(
    pg_url: str,
) -> None:
    # The indexer's watermark reads a conversation's outbox rows above it by seq (from the
    # payload) every batch. An installation at 0023 gains an index on both, in place of the one on
    # the conversation alone; a payload whose seq is no integer must still insert (the indexer
    # dead-letters it).
    async def indexes_and_insert(url: str) -> dict[str, str]:
        db = Database(url, pool_size=1)
        try:
            async with db.transaction() as session:
                for seq in ("1", '"x"', "99999999999"):
                    await session.execute(
                        INSERT_OUTBOX,
                        {
                            "conversation_id": uuid.uuid4(),
                            "turn_id": uuid.uuid4(),
                            "payload": f'{{"seq": {seq}}}',
                        },
                    )
                return {row.indexname: row.indexdef for row in await session.execute(OUTBOX_INDEXES)}
        finally:
            await db.dispose()

    url = fresh_database(pg_url, "upgrade_0024")
    upgrade(url, "0023")  # the revision 0024 follows
    before = asyncio.run(indexes_and_insert(url))
    upgrade(url, "head")
    after = asyncio.run(indexes_and_insert(url))
    assert set(before) == {"ix_outbox_conversation"}
    assert set(after) == {"ix_outbox_conversation_seq"}
    definition = after["ix_outbox_conversation_seq"]
    assert "(conversation_id, " in definition and "(payload ->> 'seq'::text)" in definition
    asyncio.run(admin(pg_url, "DROP DATABASE upgrade_0024"))


CHAT_STOPS_RLS = text(
    "SELECT c.relrowsecurity, (SELECT count(*) FROM pg_policies p WHERE p.tablename = c.relname) AS policies"
    " FROM pg_class c WHERE c.relname = 'chat_stops'"
)


def test_0026_keeps_stops_of_new_chats_under_the_tenant_policy_and_downgrades_to_0025(pg_url: str) -> None:
    # Stops of chat ids not used yet hold user ids and the client's chat ids: the table is under
    # the tenant policy as every table of user data, and 0026 goes back to 0025 cleanly.
    async def chat_stops(url: str) -> list[tuple[bool, int]]:
        db = Database(url, pool_size=1)
        try:
            async with db.transaction() as session:
                return [(row.relrowsecurity, row.policies) for row in await session.execute(CHAT_STOPS_RLS)]
        finally:
            await db.dispose()

    from alembic import command
    from alembic.config import Config

    from memory.storage.db import MIGRATIONS_DIR

    url = fresh_database(pg_url, "upgrade_0026")
    upgrade(url, "head")
    assert asyncio.run(chat_stops(url)) == [(True, 1)]
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("sqlalchemy.url", async_url(url).replace("%", "%%"))
    command.downgrade(config, "0025")
    assert asyncio.run(chat_stops(url)) == []
    upgrade(url, "head")
    assert asyncio.run(chat_stops(url)) == [(True, 1)]
    asyncio.run(admin(pg_url, "DROP DATABASE upgrade_0026"))
