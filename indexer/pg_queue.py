"""The embedded transport: the indexer claims outbox rows straight from Postgres.

A batch is claimed with ``FOR UPDATE SKIP LOCKED`` in a transaction that stays open until
the batch is committed or abandoned. The row locks are the lease: several indexers never
take the same row, and a crashed indexer's locks vanish with its connection, so its rows
are claimed again at once, with no lease column and no timeout to tune. Marking the rows
consumed happens in that transaction, after the pipeline's own transaction committed the
memory rows; a crash in between redelivers rows that the idempotent upsert absorbs.

Attempt counts are kept in process (see `indexer/worker.py`): a count written in the
claiming transaction would be rolled back by the very crash it should count.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

import asyncpg
from sqlalchemy import bindparam, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncTransaction

from memory.config import Settings
from memory.db import Database, asyncpg_dsn
from memory.outbox import NOTIFY_CHANNEL

from .transport import Message

log = logging.getLogger(__name__)

CLAIM = text(
    """
    SELECT id, conversation_id, payload, attempts FROM outbox
    WHERE consumed_at IS NULL AND dead_at IS NULL AND id <> ALL(:mine)
    ORDER BY id
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
    """
)

MARK_CONSUMED = text(
    """
    UPDATE outbox SET consumed_at = now(), attempts = attempts + 1
    WHERE id = ANY(:ids) AND dead_at IS NULL
    """
)

INSERT_DEAD_LETTER = text(
    "INSERT INTO dead_letters (source, outbox_id, payload, error) "
    "VALUES ('outbox', :outbox_id, :payload, :error)"
).bindparams(bindparam("payload", type_=JSONB))

MARK_DEAD = text(
    "UPDATE outbox SET dead_at = now(), last_error = :error, attempts = :attempts WHERE id = :id"
)


class OutboxListener:
    """LISTEN on the outbox channel over a dedicated connection; `wait` falls back to polling."""

    def __init__(self, database_url: str, channel: str = NOTIFY_CHANNEL) -> None:
        self._dsn = asyncpg_dsn(database_url)
        self._channel = channel
        self._conn: asyncpg.Connection | None = None
        self._woken = asyncio.Event()

    def _on_notify(self, *_: Any) -> None:
        self._woken.set()

    async def _connect(self) -> None:
        try:
            conn = await asyncpg.connect(self._dsn)
            await conn.add_listener(self._channel, self._on_notify)
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            # Without LISTEN the callers still poll; say so once per failure and carry on.
            log.warning("outbox LISTEN unavailable, polling instead: %s", exc)
            return
        self._conn = conn
        # Rows committed while we were not listening must not wait for the next poll.
        self._woken.set()

    async def start(self) -> None:
        """Open the LISTEN connection (failure only degrades to polling)."""
        await self._connect()

    async def wait(self, timeout: float) -> None:
        """Return when a notification arrived since the last wait, or after `timeout` seconds."""
        if self._conn is None or self._conn.is_closed():
            self._conn = None
            await self._connect()
        try:
            await asyncio.wait_for(self._woken.wait(), timeout)
        except TimeoutError:
            pass
        self._woken.clear()

    async def stop(self) -> None:
        """Close the LISTEN connection."""
        conn, self._conn = self._conn, None
        if conn is not None and not conn.is_closed():
            await conn.close()


class PgQueueConsumer:
    """The indexer's Postgres transport over the outbox table."""

    def __init__(self, db: Database, settings: Settings) -> None:
        self._db = db
        self._poll_seconds = settings.relay_poll_seconds
        self._listener = OutboxListener(db.url)
        self._conn: AsyncConnection | None = None
        self._tx: AsyncTransaction | None = None

    async def start(self) -> None:
        """Start listening for new outbox rows."""
        await self._listener.start()

    async def poll_batch(self, max_records: int, timeout: float) -> list[Message]:
        """Claim up to `max_records` unconsumed rows; the claim holds until commit or abandon."""
        if self._conn is not None:
            raise RuntimeError("poll_batch called with a batch still open")
        deadline = time.monotonic() + timeout
        claimed: list[Message] = []
        while True:
            if self._conn is None:
                self._conn = await self._db.engine.connect()
                self._tx = await self._conn.begin()
            # Our own locks do not make SKIP LOCKED skip a row: exclude what this batch holds.
            mine = [m.handle for m in claimed]
            rows = (
                await self._conn.execute(CLAIM, {"limit": max_records - len(claimed), "mine": mine})
            ).all()
            claimed.extend(
                Message(
                    payload=row.payload, handle=row.id, attempts=row.attempts, key=str(row.conversation_id)
                )
                for row in rows
            )
            remaining = deadline - time.monotonic()
            if len(claimed) >= max_records or remaining <= 0:
                break
            if not claimed:
                # Hold no transaction while idle.
                await self._release()
            await self._listener.wait(min(remaining, self._poll_seconds))
        if not claimed:
            await self._release()
        return claimed

    async def commit(self, messages: Sequence[Message]) -> None:
        """Mark the batch consumed and release the claim."""
        if self._conn is None:
            return
        ids = [m.handle for m in messages]
        await self._conn.execute(MARK_CONSUMED, {"ids": ids})
        assert self._tx is not None
        await self._tx.commit()
        await self._release()

    async def abandon(self, messages: Sequence[Message]) -> None:
        """Roll the claim back: the rows are claimable again at once."""
        await self._release()

    async def dead_letter(self, message: Message, error: str) -> None:
        """Copy the row to dead_letters and mark it dead (takes effect at commit)."""
        if self._conn is None:
            raise RuntimeError("dead_letter needs an open batch")
        await self._conn.execute(
            INSERT_DEAD_LETTER, {"outbox_id": message.handle, "payload": message.payload, "error": error}
        )
        await self._conn.execute(
            MARK_DEAD, {"id": message.handle, "error": error, "attempts": message.attempts}
        )

    async def stop(self) -> None:
        """Abandon any open batch and stop listening."""
        try:
            await self._release()
        finally:
            await self._listener.stop()

    async def _release(self) -> None:
        conn, tx = self._conn, self._tx
        self._conn = self._tx = None
        if conn is None:
            return
        try:
            if tx is not None and tx.is_active:
                await tx.rollback()
        except Exception:  # the connection may be the thing that broke; closing is all that is left
            log.debug("rollback of an abandoned claim failed", exc_info=True)
        finally:
            await conn.close()
