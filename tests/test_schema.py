from sqlalchemy import text

from memory.storage.db import Database


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
