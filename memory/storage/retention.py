"""Per-tenant retention: expired rows are soft-deleted first, and purged after a grace period.

Phase 1 (expire), for each tenant's age (``RETENTION_TENANT_DAYS``, else ``RETENTION_DAYS``;
0 keeps forever): turns older than the age get ``deleted_at`` and so do their memory rows;
conversations idle longer than the age (every turn expired) are soft-deleted too. Every
read filters ``deleted_at``, so expired data vanishes at once.

Phase 2 (purge): conversations soft-deleted longer than the grace period (expired, or
deleted by their user with DELETE /v1/conversations/{id}) go with everything hanging off
them; soft-deleted turns go with their events, tool invocations, memory and outbox rows;
outbox rows already published or consumed go once older than the tenant's age; and stops
kept for a chat id no run came for go once stale (memory/record/pending_stops.py), whatever
the tenant's age.

Every statement works on at most ``batch_size`` rows (or conversations) in its own
transaction, claimed ``FOR UPDATE SKIP LOCKED``: a big purge never holds long locks, and
the job runs on every API process at once without two processes touching the same rows.
Ages are compared with the database's ``now()``: tests move rows back in time by SQL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import bindparam, text
from sqlalchemy.dialects.postgresql import ARRAY, UUID
from sqlalchemy.ext.asyncio import AsyncSession

from memory.config import Settings
from memory.record.pending_stops import NEW_CHAT_STOP_SECONDS, PURGE_STALE_CHAT_STOPS
from memory.storage.db import Database

log = logging.getLogger(__name__)

DAY_SECONDS = 86_400.0

# One tenant (:tenant set), or every tenant without an override (:tenant NULL, :others the overridden).
_TENANT_FILTER = (
    "(tenant_id = CAST(:tenant AS text)"
    " OR (CAST(:tenant AS text) IS NULL AND tenant_id <> ALL(CAST(:others AS text[]))))"
)
_OLDER_THAN_AGE = "now() - make_interval(secs => CAST(:age AS float8))"
_OLDER_THAN_GRACE = "now() - make_interval(secs => CAST(:grace AS float8))"


def _ids(statement: str) -> Any:
    return text(statement).bindparams(bindparam("ids", type_=ARRAY(UUID(as_uuid=True))))


# --- phase 1: expire ----------------------------------------------------------------------

EXPIRE_TURNS = text(
    f"""
    WITH expired AS (
        SELECT id FROM turns
        WHERE deleted_at IS NULL AND created_at < {_OLDER_THAN_AGE}
          -- a reply in progress (or waiting for a person) ends first; the next run takes it
          AND status NOT IN ('streaming', 'awaiting_approval')
          AND {_TENANT_FILTER}
        ORDER BY created_at
        LIMIT :limit
        FOR UPDATE SKIP LOCKED
    )
    UPDATE turns t SET deleted_at = now() FROM expired e WHERE t.id = e.id
    RETURNING t.id
    """
)
EXPIRE_MEMORY_OF_TURNS = _ids(
    "UPDATE memory_items SET deleted_at = now() WHERE turn_id = ANY(:ids) AND deleted_at IS NULL"
)
EXPIRE_CONVERSATIONS = text(
    f"""
    WITH idle AS (
        SELECT id FROM conversations
        WHERE deleted_at IS NULL AND active_reply_id IS NULL AND updated_at < {_OLDER_THAN_AGE}
          AND {_TENANT_FILTER}
        LIMIT :limit
        FOR UPDATE SKIP LOCKED
    )
    UPDATE conversations c SET deleted_at = now() FROM idle i WHERE c.id = i.id
    RETURNING c.id
    """
)
EXPIRE_MEMORY_OF_CONVERSATIONS = _ids(
    "UPDATE memory_items SET deleted_at = now() WHERE conversation_id = ANY(:ids) AND deleted_at IS NULL"
)
# Memory the indexer wrote for a turn that had just expired (its outbox message was still
# queued); only recently expired turns are looked at, through ix_turns_deleted.
EXPIRE_LATE_MEMORY = text(
    """
    UPDATE memory_items m SET deleted_at = now()
    FROM turns t
    WHERE t.deleted_at >= now() - make_interval(secs => CAST(:lookback AS float8))
      AND m.turn_id = t.id AND m.deleted_at IS NULL
    """
)

# --- phase 2: purge -----------------------------------------------------------------------

# A conversation whose turns a fork still shares (a branch of another conversation has one
# of its branches in its lineage) stays, hidden, until that fork is gone: purging it would
# cut the fork's history. Its own soft delete already hid it from its owner.
PURGEABLE_CONVERSATIONS = text(
    f"""
    SELECT c.id FROM conversations c
    WHERE c.deleted_at < {_OLDER_THAN_GRACE}
      AND NOT EXISTS (
          SELECT 1 FROM branches fork
          WHERE fork.conversation_id <> c.id
            AND fork.lineage_ids && ARRAY(SELECT b.id FROM branches b WHERE b.conversation_id = c.id)
      )
    ORDER BY c.deleted_at LIMIT :limit FOR UPDATE OF c SKIP LOCKED
    """
)
# Everything that hangs off a set of conversations, children first (also used to delete a user).
DELETE_CONVERSATIONS_CASCADE = [
    (
        "turn_events",
        _ids(
            "DELETE FROM turn_events WHERE reply_id IN"
            " (SELECT coalesce(reply_id, id) FROM turns WHERE conversation_id = ANY(:ids))"
        ),
    ),
    (
        "tool_invocations",
        _ids(
            "DELETE FROM tool_invocations WHERE turn_id IN"
            " (SELECT id FROM turns WHERE conversation_id = ANY(:ids))"
        ),
    ),
    ("memory_items", _ids("DELETE FROM memory_items WHERE conversation_id = ANY(:ids)")),
    ("outbox", _ids("DELETE FROM outbox WHERE conversation_id = ANY(:ids)")),
    ("turns", _ids("DELETE FROM turns WHERE conversation_id = ANY(:ids)")),
    ("conversations", _ids("DELETE FROM conversations WHERE id = ANY(:ids)")),
]

PURGEABLE_TURNS = text(
    f"""
    SELECT id, coalesce(reply_id, id) AS reply_id, conversation_id FROM turns
    WHERE deleted_at < {_OLDER_THAN_GRACE}
    ORDER BY deleted_at LIMIT :limit FOR UPDATE SKIP LOCKED
    """
)
_TURN_IDS = bindparam("ids", type_=ARRAY(UUID(as_uuid=True)))
_REPLY_IDS = bindparam("reply_ids", type_=ARRAY(UUID(as_uuid=True)))
_CONVERSATION_IDS = bindparam("conversation_ids", type_=ARRAY(UUID(as_uuid=True)))
DELETE_TURNS_CASCADE = [
    ("turn_events", text("DELETE FROM turn_events WHERE reply_id = ANY(:reply_ids)").bindparams(_REPLY_IDS)),
    ("tool_invocations", _ids("DELETE FROM tool_invocations WHERE turn_id = ANY(:ids)")),
    ("memory_items", _ids("DELETE FROM memory_items WHERE turn_id = ANY(:ids)")),
    (
        "outbox",
        text(
            "DELETE FROM outbox WHERE conversation_id = ANY(:conversation_ids) AND turn_id = ANY(:ids)"
        ).bindparams(_CONVERSATION_IDS, _TURN_IDS),
    ),
    ("turns", _ids("DELETE FROM turns WHERE id = ANY(:ids)")),
]
PURGE_MEMORY = text(
    f"""
    DELETE FROM memory_items WHERE id IN (
        SELECT id FROM memory_items WHERE deleted_at < {_OLDER_THAN_GRACE}
          -- a forgotten item's tombstone stays while its turn does (memory/recall/items.py)
          AND forgotten_at IS NULL
        LIMIT :limit FOR UPDATE SKIP LOCKED
    )
    """
)
# Delivered rows only: one still waiting for the relay or the indexer stays until it is delivered.
PURGE_OUTBOX = text(
    f"""
    DELETE FROM outbox WHERE id IN (
        SELECT id FROM outbox
        WHERE created_at < {_OLDER_THAN_AGE}
          AND (published_at IS NOT NULL OR consumed_at IS NOT NULL OR dead_at IS NOT NULL)
          AND {_TENANT_FILTER}
        ORDER BY created_at LIMIT :limit FOR UPDATE SKIP LOCKED
    )
    """
)


@dataclass(frozen=True)
class RetentionPolicy:
    """How long each tenant's data is kept, and how long deleted data waits before the purge."""

    default_days: float = 0.0
    tenant_days: Mapping[str, float] = field(default_factory=dict)
    grace_days: float = 7.0
    batch_size: int = 500

    @classmethod
    def from_settings(cls, settings: Settings) -> RetentionPolicy:
        """The policy the settings describe."""
        return cls(
            default_days=settings.retention_days,
            tenant_days=dict(settings.retention_tenant_days),
            grace_days=settings.retention_grace_days,
            batch_size=settings.retention_batch_size,
        )

    def groups(self) -> list[dict[str, Any]]:
        """Statement parameters per age: each overridden tenant, then everyone else (ages > 0 only)."""
        others = sorted(self.tenant_days)
        groups = [
            {"tenant": tenant, "others": others, "age": days * DAY_SECONDS}
            for tenant, days in sorted(self.tenant_days.items())
            if days > 0
        ]
        if self.default_days > 0:
            groups.append({"tenant": None, "others": others, "age": self.default_days * DAY_SECONDS})
        return groups


async def delete_conversations(session: AsyncSession, conversation_ids: Sequence[uuid.UUID]) -> Counter[str]:
    """Delete conversations and every row hanging off them; returns rows deleted per table."""
    counts: Counter[str] = Counter()
    if not conversation_ids:
        return counts
    for table, statement in DELETE_CONVERSATIONS_CASCADE:
        result = await session.execute(statement, {"ids": list(conversation_ids)})
        counts[table] += int(getattr(result, "rowcount", 0) or 0)
    return counts


class RetentionJob:
    """Expires and purges in batches; `run` repeats it every interval until stopped."""

    def __init__(
        self,
        db: Database,
        policy: RetentionPolicy,
        *,
        interval_seconds: float,
        lock_timeout_ms: int | None = 5000,
    ) -> None:
        self.db = db
        self.policy = policy
        self.interval = interval_seconds
        # No batch waits for a lock forever; one that times out is retried at the next pass.
        self.lock_timeout_ms = lock_timeout_ms

    async def _batches(self, statement: Any, params: dict[str, Any]) -> int:
        """Run a batch statement until a batch comes back short; returns rows touched."""
        total = 0
        while True:
            async with self.db.transaction(lock_timeout_ms=self.lock_timeout_ms) as session:
                result = await session.execute(statement, {**params, "limit": self.policy.batch_size})
                count = int(getattr(result, "rowcount", 0) or 0)
            total += count
            if count < self.policy.batch_size:
                return total

    async def _expiring(self, statement: Any, follow_up: Any, params: dict[str, Any]) -> int:
        """Soft-delete a batch of rows and the memory rows of those rows, in one transaction, until done."""
        total = 0
        while True:
            async with self.db.transaction(lock_timeout_ms=self.lock_timeout_ms) as session:
                rows = await session.execute(statement, {**params, "limit": self.policy.batch_size})
                ids = [row.id for row in rows]
                if ids:
                    await session.execute(follow_up, {"ids": ids})
            total += len(ids)
            if len(ids) < self.policy.batch_size:
                return total

    async def expire(self) -> Counter[str]:
        """Phase 1: soft-delete what is older than its tenant's age."""
        counts: Counter[str] = Counter()
        for group in self.policy.groups():
            counts["turns"] += await self._expiring(EXPIRE_TURNS, EXPIRE_MEMORY_OF_TURNS, group)
            counts["conversations"] += await self._expiring(
                EXPIRE_CONVERSATIONS, EXPIRE_MEMORY_OF_CONVERSATIONS, group
            )
        lookback = 2 * self.interval + DAY_SECONDS
        async with self.db.transaction(lock_timeout_ms=self.lock_timeout_ms) as session:
            result = await session.execute(EXPIRE_LATE_MEMORY, {"lookback": lookback})
            counts["memory_items"] += int(getattr(result, "rowcount", 0) or 0)
        return counts

    async def purge(self) -> Counter[str]:
        """Phase 2: delete what was soft-deleted longer than the grace period, delivered outbox rows,
        and stale stops of chat ids."""
        counts: Counter[str] = Counter()
        grace = {"grace": self.policy.grace_days * DAY_SECONDS, "limit": self.policy.batch_size}
        while True:
            async with self.db.transaction(lock_timeout_ms=self.lock_timeout_ms) as session:
                ids = [row.id for row in await session.execute(PURGEABLE_CONVERSATIONS, grace)]
                counts += await delete_conversations(session, ids)
            if len(ids) < self.policy.batch_size:
                break
        while True:
            async with self.db.transaction(lock_timeout_ms=self.lock_timeout_ms) as session:
                rows = list(await session.execute(PURGEABLE_TURNS, grace))
                if rows:
                    params = {
                        "ids": [r.id for r in rows],
                        "reply_ids": list({r.reply_id for r in rows}),
                        "conversation_ids": list({r.conversation_id for r in rows}),
                    }
                    for table, statement in DELETE_TURNS_CASCADE:
                        result = await session.execute(statement, params)
                        counts[table] += int(getattr(result, "rowcount", 0) or 0)
            if len(rows) < self.policy.batch_size:
                break
        counts["memory_items"] += await self._batches(PURGE_MEMORY, {"grace": grace["grace"]})
        for group in self.policy.groups():
            counts["outbox"] += await self._batches(PURGE_OUTBOX, group)
        counts["chat_stops"] += await self._batches(PURGE_STALE_CHAT_STOPS, {"ttl": NEW_CHAT_STOP_SECONDS})
        return counts

    async def run_once(self) -> dict[str, Counter[str]]:
        """One pass of both phases; returns what each did, per table."""
        expired = await self.expire()
        purged = await self.purge()
        if +expired or +purged:
            log.info("retention expired %s, purged %s", dict(+expired), dict(+purged))
        return {"expired": expired, "purged": purged}

    async def run(self, stop: asyncio.Event) -> None:
        """Run a pass every interval until `stop` is set (a failed pass is retried next time)."""
        while not stop.is_set():
            try:
                await self.run_once()
            except Exception:
                log.exception("retention pass failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.interval)
