"""Whether the process that owns a streaming turn is alive, as Postgres sees it.

Every API process holds a session-level advisory lock named after itself (its
`process_id`, the `owner` of the turns it streams) on its one dedicated connection, the
one that LISTENs. Postgres releases the lock when that session ends: at once when the
process dies (the kernel closes its socket, crash or SIGKILL alike); when the network to
its host is cut, only once Postgres notices (TCP keepalives), and until then the lock
looks held and the reaper's timeout decides, as without it. So a free lock is positive
word that the owner is gone, without waiting the whole `HEARTBEAT_TIMEOUT_SECONDS` of
silence the reaper needs when it has no such word.

A free lock alone is not enough: a live process whose listening connection was lost is
without its lock until it reconnects. Its heartbeat goes on meanwhile, from other
connections, once every checkpoint interval; so the owner counts as gone only when its lock
is free and its heartbeat has been silent for a few intervals.

A restart of Postgres ends every session at once: every life lock is free, and every
heartbeat is as old as the outage until its process's next tick. A live process takes its
lock again when its listening connection reconnects, which backs off up to
`RECONNECT_MAX_SECONDS` between attempts; a request retried in that moment ended a reply
still streaming as `process_died`. So silence is counted from the heartbeat, or from the
moment Postgres has been up long enough for every live process to have its lock again
(`LIFE_RETAKEN_SECONDS` after `pg_postmaster_start_time()`), whichever is later: until
then a free lock says nothing. A process that died with the restart is still found gone a
few seconds after it, not after the heartbeat timeout.
"""

from __future__ import annotations

import uuid

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

# The lock's key: the process's name hashed into advisory-lock space, with a seed of its
# own so that no other advisory key of chatmem (hashed names too) can be the same lock.
LIFE_SEED = 0x6C696665  # "life"

# asyncpg's placeholder: taken on the listening connection, which is raw asyncpg.
HOLD_LIFE = f"SELECT pg_advisory_lock(hashtextextended($1, {LIFE_SEED}))"

# The longest wait of a listening connection between two attempts to reconnect
# (chat_api/replies/signals.py), and how soon after Postgres starts every live process holds
# its life lock again: that wait, then a connection and the lock's statement.
RECONNECT_MAX_SECONDS = 5.0
LIFE_RETAKEN_SECONDS = RECONNECT_MAX_SECONDS + 1.0

# Silent: since the last heartbeat, or since every live owner would hold its lock again after
# Postgres started (negative until then), whichever is later.
STREAMING_OWNER = text(
    f"""
    SELECT owner,
           EXTRACT(EPOCH FROM now() - GREATEST(
               heartbeat_at,
               pg_postmaster_start_time() + make_interval(secs => {LIFE_RETAKEN_SECONDS})
           )) AS silent
    FROM turns
    WHERE coalesce(reply_id, id) = :reply_id AND status = 'streaming' AND owner IS NOT NULL
    """
)
# Free when this transaction can take it shared (until its commit): the owner holds it
# exclusively while it lives, and any number of lookers take it shared at once.
LOCK_IS_FREE = text(f"SELECT pg_try_advisory_xact_lock_shared(hashtextextended(:owner, {LIFE_SEED}))")


async def gone_owner_silence(session: AsyncSession, reply_id: uuid.UUID) -> float | None:
    """How long (seconds) the owner of the reply's streaming turn has been silent, if it holds
    no life lock; None while a live process holds it, or when no turn of the reply streams.

    Negative just after Postgres started: its owner may not have taken its lock again yet.
    """
    row = (await session.execute(STREAMING_OWNER, {"reply_id": reply_id})).first()
    if row is None:
        return None
    if not (await session.execute(LOCK_IS_FREE, {"owner": row.owner})).scalar_one():
        return None
    return float(row.silent or 0.0)
