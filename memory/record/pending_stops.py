"""Stops kept for a reply that is not stored yet: one per conversation, on its row.

A stop that finds no reply running (or, naming a run by its key, finds the run not stored)
is kept here, under the conversation's lock, with the database's time of the stop. The
transaction that stores a reply holds that lock too: it takes the stop if it names the
reply's key, or if it names none and came after the reply's request arrived (it was on its
way when the person stopped; chat_api.admission.arrival). A keyless stop from before then is stale: it meant
a reply that had already ended, and the next message must not die of it. Every start clears
the kept stop, taken or not; a newer stop replaces it. Functions here take a session and never commit.
"""

from __future__ import annotations

import uuid

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from memory.storage.models import Conversation

# clock_timestamp(): the time of the write, after the lock was granted, not the time this
# transaction began (it may have waited at the lock behind a reply's start).
KEEP = text(
    "UPDATE conversations SET stop_requested_at = clock_timestamp(), stop_requested_key = :key WHERE id = :id"
)

# A stop named the key, or named none after the request arrived (:waited seconds before
# this statement, on the database's clock; unknown: this transaction's start, now()).
# Either way the kept stop is cleared: a keyless one is stale to any later request too, and
# one naming another key (a run started beside this one, or a runId never sent) does not
# outlive a start.
TAKE = text(
    """
    UPDATE conversations AS c SET stop_requested_at = NULL, stop_requested_key = NULL
    FROM (SELECT stop_requested_at AS at, stop_requested_key AS key FROM conversations WHERE id = :id) AS kept
    WHERE c.id = :id AND kept.at IS NOT NULL
    RETURNING coalesce(kept.key = :key, false)
        OR (
            kept.key IS NULL
            AND kept.at >= coalesce(clock_timestamp() - make_interval(secs => CAST(:waited AS float8)), now())
        )
    """
)


async def keep_stop(session: AsyncSession, conversation_id: uuid.UUID, key: str | None) -> None:
    """Keep a stop for the conversation's next reply (`key`: only the run with that key); the
    caller holds the conversation's lock."""
    await session.execute(KEEP, {"id": conversation_id, "key": key})


async def take_stop(
    session: AsyncSession, conversation: Conversation, key: str | None, waited: float | None
) -> bool:
    """True if a kept stop means the reply being started in this transaction: `key` is its
    idempotency key, `waited` the seconds since its request arrived (None: count from this
    transaction's start). `conversation` was read with its lock in this transaction."""
    if conversation.stop_requested_at is None:
        return False  # nothing kept: no statement
    taken = await session.scalar(TAKE, {"id": conversation.id, "key": key, "waited": waited})
    return bool(taken)
