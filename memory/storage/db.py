"""Engine, sessions and migrations.

The caller owns the transaction: repository functions take a session and never commit;
routes, the runner and the consumers open ``async with db.transaction() as session``.

A transaction that begins while a tenant is set (``memory.storage.tenancy``) runs as the
``chatmem_tenant`` role with that tenant, so row-level security hides other tenants'
rows; one extra statement per transaction, none when no tenant is set.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from sqlalchemy import Connection, event, make_url, text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session, SessionTransaction

from memory.json_bounds import tolerant_loads
from memory.storage.tenancy import TENANT_ROLE, TENANT_SETTING, current_tenant

MIGRATIONS_DIR = Path(__file__).parent / "migrations"

# Transaction-local (`true`): both revert at commit or rollback, so a pooled connection
# never hands one request's tenant to the next transaction.
SCOPE_TRANSACTION = text(
    f"SELECT set_config('role', '{TENANT_ROLE}', true), set_config('{TENANT_SETTING}', :tenant, true)"
)
# Transaction-local too: a background transaction never waits for a lock forever.
SET_LOCK_TIMEOUT = text("SELECT set_config('lock_timeout', :timeout, true)")


class TenantScopedSession(Session):
    """The sessions of every Database: scoped to the current tenant when one is set."""


@event.listens_for(TenantScopedSession, "after_begin")
def _scope_to_tenant(session: Session, transaction: SessionTransaction, connection: Connection) -> None:
    tenant = current_tenant()
    if tenant is not None:
        connection.execute(SCOPE_TRANSACTION, {"tenant": tenant})


def asyncpg_dsn(database_url: str) -> str:
    """The same database as a plain asyncpg DSN (for LISTEN/NOTIFY connections)."""
    url = make_url(database_url).set(drivername="postgresql")
    return url.render_as_string(hide_password=False)


def async_url(database_url: str) -> str:
    """Normalise any postgres URL to the asyncpg driver."""
    url = make_url(database_url)
    if url.drivername in ("postgresql", "postgres", "postgresql+psycopg", "postgresql+psycopg2"):
        url = url.set(drivername="postgresql+asyncpg")
    return url.render_as_string(hide_password=False)


class Database:
    """One engine and its session factory, opened in a lifespan and closed in ``finally``."""

    def __init__(self, database_url: str, *, pool_size: int = 10) -> None:
        self.url = async_url(database_url)
        self.engine: AsyncEngine = create_async_engine(
            # Overflow connections are closed on return; each new one costs a backend fork and
            # loses asyncpg's prepared statements, so keep the steady state inside the pool.
            self.url,
            pool_size=pool_size,
            max_overflow=max(2, pool_size // 4),
            pool_pre_ping=False,
            # A stored value too deep to parse reads as null for its row, not an error for the query.
            json_deserializer=tolerant_loads,
        )
        self.sessions = async_sessionmaker(
            self.engine, expire_on_commit=False, sync_session_class=TenantScopedSession
        )

    @asynccontextmanager
    async def transaction(self, *, lock_timeout_ms: int | None = None) -> AsyncIterator[AsyncSession]:
        """A session inside one transaction: committed on success, rolled back on error.

        With `lock_timeout_ms`, a statement that waits longer for a lock fails with
        ``lock_not_available`` (background work retries its batch; see indexer/worker.py).
        """
        async with self.sessions() as session, session.begin():
            if lock_timeout_ms is not None:
                await session.execute(SET_LOCK_TIMEOUT, {"timeout": f"{int(lock_timeout_ms)}ms"})
            yield session

    @asynccontextmanager
    async def session(self) -> AsyncIterator[AsyncSession]:
        """A session with no transaction opened yet (for callers that open several)."""
        async with self.sessions() as session:
            yield session

    async def ping(self) -> None:
        """Raise if the database cannot answer."""
        async with self.engine.connect() as conn:
            await conn.execute(text("SELECT 1"))

    async def dispose(self) -> None:
        await self.engine.dispose()


def schema_behind(revision: str | None) -> str | None:
    """Why a database at `revision` (None: never migrated) is behind these migrations, or None.

    A revision these migrations do not know was made by a newer chatmem: not behind.
    """
    from alembic.script import ScriptDirectory

    script = ScriptDirectory(str(MIGRATIONS_DIR))
    head = script.get_current_head()
    if revision is None:
        return f"the database has no chatmem schema (this version needs revision {head})"
    known = {rev.revision for rev in script.walk_revisions()}
    if revision in known and revision != head:
        return f"the database is at revision {revision}, this version needs {head}"
    return None


def upgrade(database_url: str, revision: str = "head") -> None:
    """Apply Alembic migrations (synchronous; call it before the event loop serves)."""
    from alembic import command
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", async_url(database_url).replace("%", "%%"))
    command.upgrade(cfg, revision)
