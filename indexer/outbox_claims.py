"""Claiming outbox rows as committed leases, fairly across tenants and users.

The consumers of the outbox (the Postgres-queue indexer and the Kafka relay) claim a batch
in one short transaction that stamps the rows with a lease (``claimed_until``,
``claim_token``) and commits. No lock is held while the batch is embedded or published,
so no user action (deleting a user or a conversation, the retention purge) ever waits on
slow work, and no cycle through the application can form: the indexer used to hold its
claim as row locks while it embedded, and an erasure waiting on those rows while holding
the conversation locks the indexer needed next never returned.

A lease that runs out (the worker crashed, or stalled past it) makes the rows claimable
again; the indexer's upsert is idempotent, so a second delivery changes nothing. A worker
renews its leases while it works (`LeaseKeeper`), so a slow batch is not taken twice.

Fairness: within each priority (0 live turns, 1 imported history; every live turn first),
rows are taken round-robin over (tenant, user), oldest first within each: a 5,000-turn
import of one user takes one place per round, like everybody else. A conversation's turns still
go in order: a live turn behind its own conversation's queued history takes its place with
that history (the indexer's watermark, every turn up to it indexed, must not pass a queued
turn; the relay sends such a turn to the history topic behind it). The ranking reads the
pending rows through the partial index ``ix_outbox_pending_fair``; for a backlog of
millions it is a full pass per claim, which the batch size amortises.

Lock order (every writer; see ARCHITECTURE.md): conversations (in id order) → branches →
turns → turn events / tool invocations → outbox → memory items. Claims touch outbox rows
only, in their own transaction.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text
from sqlalchemy.sql.elements import TextClause

from memory.storage.db import Database

log = logging.getLogger(__name__)

# What each consumer still has to do with a row ({t}: the table's alias and a dot, or nothing).
INDEXER_PENDING = "{t}consumed_at IS NULL AND {t}dead_at IS NULL"
RELAY_PENDING = "{t}published_at IS NULL AND {t}consumed_at IS NULL AND {t}dead_at IS NULL"
_CLAIMABLE = "({t}claimed_until IS NULL OR {t}claimed_until < now())"


def _fair_claim(pending: str) -> TextClause:
    # The conditions are repeated on the locked row: a row claimed and committed by another
    # consumer after this statement's snapshot is re-checked on its newest version and skipped.
    # A row's place is taken at the priority of its conversation's earlier rows still pending (the
    # highest of them): a live turn behind its conversation's queued import waits with that import,
    # so one consumer sees a conversation's turns in order and the indexer's watermark (every turn
    # up to it indexed) never passes a turn still queued.
    return text(
        f"""
        WITH queued AS (
            SELECT id, tenant_id, user_id, claimed_until,
                   max(priority) OVER (PARTITION BY conversation_id ORDER BY id) AS priority
            FROM outbox
            WHERE {pending.format(t="")}
        ),
        ranked AS (
            SELECT id, priority,
                   row_number() OVER (PARTITION BY tenant_id, user_id, priority ORDER BY id) AS place
            FROM queued
            WHERE {_CLAIMABLE.format(t="")}
        ),
        chosen AS (
            SELECT o.id, r.priority FROM ranked r JOIN outbox o ON o.id = r.id
            WHERE {pending.format(t="o.")} AND {_CLAIMABLE.format(t="o.")}
            ORDER BY r.priority, r.place, r.id
            LIMIT :limit
            FOR UPDATE OF o SKIP LOCKED
        )
        UPDATE outbox o
        SET claimed_until = now() + make_interval(secs => CAST(:lease AS float8)),
            claim_token = CAST(:token AS uuid),
            attempts = o.attempts + 1
        FROM chosen c WHERE o.id = c.id
        RETURNING o.id, o.conversation_id, o.payload, c.priority, o.attempts - 1 AS attempts
        """
    )


CLAIM_FOR_INDEXER = _fair_claim(INDEXER_PENDING)
CLAIM_FOR_RELAY = _fair_claim(RELAY_PENDING)

RENEW = text(
    """
    UPDATE outbox SET claimed_until = now() + make_interval(secs => CAST(:lease AS float8))
    WHERE id = ANY(:ids) AND claim_token = CAST(:token AS uuid)
    """
)
RELEASE = text(
    """
    UPDATE outbox SET claimed_until = NULL, claim_token = NULL
    WHERE id = ANY(:ids) AND claim_token = CAST(:token AS uuid)
    """
)


@dataclass(frozen=True, slots=True)
class ClaimedRow:
    """One leased outbox row."""

    id: int
    conversation_id: uuid.UUID
    payload: dict[str, Any]
    # 0: a live turn; 1: imported history, or a live turn behind its conversation's queued history.
    priority: int
    # Claims of this row before this one (crashes, abandoned batches).
    attempts: int


class OutboxClaims:
    """One consumer's leases on outbox rows: claim, renew, release (each its own transaction)."""

    def __init__(self, db: Database, *, lease_seconds: float, lock_timeout_ms: int) -> None:
        self._db = db
        self.lease_seconds = lease_seconds
        self._lock_timeout_ms = lock_timeout_ms
        self.token = uuid.uuid4()

    async def claim(self, statement: TextClause, limit: int) -> list[ClaimedRow]:
        """Lease up to `limit` pending rows, fairly; committed before returning."""
        async with self._db.transaction(lock_timeout_ms=self._lock_timeout_ms) as session:
            rows = (
                await session.execute(
                    statement, {"limit": limit, "lease": self.lease_seconds, "token": str(self.token)}
                )
            ).all()
        claimed = [ClaimedRow(r.id, r.conversation_id, r.payload, r.priority, r.attempts) for r in rows]
        claimed.sort(key=lambda r: r.id)  # RETURNING has no order; a conversation's turns go in order
        return claimed

    async def renew(self, ids: Iterable[int]) -> None:
        """Extend the leases this consumer still holds on `ids`."""
        wanted = list(ids)
        if not wanted:
            return
        async with self._db.transaction(lock_timeout_ms=self._lock_timeout_ms) as session:
            await session.execute(
                RENEW, {"ids": wanted, "lease": self.lease_seconds, "token": str(self.token)}
            )

    async def release(self, ids: Iterable[int]) -> None:
        """Give leased rows back: claimable again at once."""
        wanted = list(ids)
        if not wanted:
            return
        async with self._db.transaction(lock_timeout_ms=self._lock_timeout_ms) as session:
            await session.execute(RELEASE, {"ids": wanted, "token": str(self.token)})


class LeaseKeeper:
    """Renews the leases of the rows a worker holds, every third of the lease, until stopped."""

    def __init__(self, claims: OutboxClaims) -> None:
        self._claims = claims
        self.held: set[int] = set()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start renewing (owned by the consumer: `stop` cancels and awaits it)."""
        if self._task is None:
            self._task = asyncio.create_task(self._renew_forever(), name="outbox-lease-keeper")

    async def stop(self) -> None:
        """Stop renewing."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self._claims.lease_seconds / 3)
            try:
                await self._claims.renew(sorted(self.held))
            except Exception:  # the database is away; the lease may lapse, and a redelivery is harmless
                log.warning("outbox: renewing leases failed", exc_info=True)
