"""Shared fixtures: one real embedded Postgres per test session, clean tables per test."""

from __future__ import annotations

import os
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

from memory.db import Database, upgrade
from memory.embedded_pg import EmbeddedPostgres
from memory.models import Base

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A migrated Postgres with pgvector: the embedded server, or TEST_DATABASE_URL."""
    external = os.environ.get("TEST_DATABASE_URL")
    if external:
        upgrade(external)
        yield external
        return
    tmp = Path(tempfile.mkdtemp(prefix="chatmem-test-"))
    server = EmbeddedPostgres(tmp, delete_on_stop=True)
    url = server.start()
    upgrade(url)
    try:
        yield url
    finally:
        server.stop()


async def truncate_all(db: Database) -> None:
    names = ", ".join(t.name for t in Base.metadata.sorted_tables)
    async with db.transaction() as session:
        await session.execute(text(f"TRUNCATE {names} RESTART IDENTITY CASCADE"))


@pytest.fixture
async def db(pg_url: str) -> AsyncIterator[Database]:
    """A Database on empty tables."""
    database = Database(pg_url, pool_size=5)
    await truncate_all(database)
    try:
        yield database
    finally:
        await database.dispose()
