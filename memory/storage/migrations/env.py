"""Alembic environment: runs migrations over the async engine."""

import asyncio
from concurrent.futures import ThreadPoolExecutor

from alembic import context
from sqlalchemy.ext.asyncio import create_async_engine

from memory.storage.models import Base

config = context.config
target_metadata = Base.metadata


def _run(connection) -> None:  # type: ignore[no-untyped-def]
    context.configure(connection=connection, target_metadata=target_metadata, compare_type=True)
    with context.begin_transaction():
        context.run_migrations()


async def _main() -> None:
    engine = create_async_engine(config.get_main_option("sqlalchemy.url") or "")
    try:
        async with engine.connect() as conn:
            await conn.run_sync(_run)
            await conn.commit()
    finally:
        await engine.dispose()


try:
    asyncio.get_running_loop()
except RuntimeError:
    asyncio.run(_main())
else:
    # Called from inside a running event loop: migrate on a helper thread with its own loop.
    with ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(asyncio.run, _main()).result()
