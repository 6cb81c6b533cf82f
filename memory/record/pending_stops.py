"""Stops kept for a reply that is not stored yet: one per conversation, on its row; and one per
chat id nobody has used yet, for that chat's first run.

A stop that finds no reply running (or, naming a run by its key, finds the run not stored)
is kept here, under the conversation's lock, with the database's time of the stop. The
transaction that stores a reply holds that lock too: it takes the stop if it names the
reply's key, or if it names none and came after the reply's request arrived (it was on its
way when the person stopped; chat_api.admission.arrival). A keyless stop from before then is
stale: it meant a reply that had already ended, and the next message must not die of it.
Every start clears the kept stop, taken or not; a newer stop replaces it.

A client that picks its chat (thread) id can stop the chat's first run before the request
that creates its conversation is served, on any process. That stop is kept by (tenant, user,
chat id) in `chat_stops` (`keep_new_chat_stop`, under the lock that creating the chat takes:
memory.record.ai_sdk_chats), and the transaction that creates the chat's conversation (or a
conversation made under an id chosen for it, as the OpenAI doors' chat keys choose theirs)
moves it onto the conversation's row (`take_new_chat_stop`) as if made then: nothing of that chat
ran before it, so it can only mean the first run. It is kept NEW_CHAT_STOP_SECONDS: a stop of
an id no run comes for is not taken after that (a chat started later is answered in full),
and the next stop kept in the tenant deletes it; the retention job's purge deletes the rest
(a tenant's last stop too), in batches: the table holds little more than the stops of the last
NEW_CHAT_STOP_SECONDS plus one retention interval.
Functions here take a session and never commit.
"""

from __future__ import annotations

import uuid

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from memory.record.conversations import Owner
from memory.storage.models import Conversation

# A run's request reaches the server moments after its stop at most; a stop of a chat id is
# kept this long for the chat's first run. Longer would start stopped a chat the person began
# after stopping nothing (a stop of an id whose first request never came).
NEW_CHAT_STOP_SECONDS = 30.0

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

_STALE = "clock_timestamp() - make_interval(secs => CAST(:ttl AS float8))"

# Stale stops of chat ids no run came for (the tenant's, under its policy).
FORGET_STALE_CHAT_STOPS = text(f"DELETE FROM chat_stops WHERE requested_at < {_STALE}")

# The same, for every tenant, at most :limit rows a time (memory.storage.retention runs it as
# the tables' owner, beside its other purges).
PURGE_STALE_CHAT_STOPS = text(
    f"""
    DELETE FROM chat_stops WHERE (tenant_id, user_id, chat_id) IN (
        SELECT tenant_id, user_id, chat_id FROM chat_stops WHERE requested_at < {_STALE}
        ORDER BY requested_at LIMIT :limit FOR UPDATE SKIP LOCKED
    )
    """
)

KEEP_FOR_NEW_CHAT = text(
    """
    INSERT INTO chat_stops (tenant_id, user_id, chat_id, requested_at, run_key)
    VALUES (:tenant_id, :user_id, :chat_id, clock_timestamp(), :key)
    ON CONFLICT (tenant_id, user_id, chat_id)
    DO UPDATE SET requested_at = excluded.requested_at, run_key = excluded.run_key
    """
)

TAKE_FOR_NEW_CHAT = text(
    f"""
    DELETE FROM chat_stops
    WHERE tenant_id = :tenant_id AND user_id = :user_id AND chat_id = :chat_id
    RETURNING requested_at >= {_STALE} AS fresh, run_key
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


async def keep_new_chat_stop(session: AsyncSession, owner: Owner, chat_id: str, key: str | None) -> None:
    """Keep a stop of the owner's chat id that names no conversation yet, for the chat's first
    run (`key`: only the run with that key); the caller holds the lock that creating it takes."""
    await session.execute(FORGET_STALE_CHAT_STOPS, {"ttl": NEW_CHAT_STOP_SECONDS})
    params = {"tenant_id": owner.tenant_id, "user_id": owner.user_id, "chat_id": chat_id, "key": key}
    await session.execute(KEEP_FOR_NEW_CHAT, params)


async def take_new_chat_stop(
    session: AsyncSession, owner: Owner, chat_id: str, conversation_id: uuid.UUID
) -> None:
    """The chat's conversation was just created: a fresh stop kept for the chat id is kept on it
    now (its first run's start takes it), a stale one is dropped."""
    params = {"tenant_id": owner.tenant_id, "user_id": owner.user_id, "chat_id": chat_id}
    kept = (await session.execute(TAKE_FOR_NEW_CHAT, {**params, "ttl": NEW_CHAT_STOP_SECONDS})).one_or_none()
    if kept is not None and kept.fresh:
        await keep_stop(session, conversation_id, kept.run_key)
