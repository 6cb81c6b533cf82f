"""Whether the process that owns a streaming turn is alive, as Postgres sees it.

Every API process holds a session-level advisory lock named after itself (its
`process_id`, the `owner` of the turns it streams) on its one dedicated connection, the
one that LISTENs. Postgres releases the lock when that session ends: at once when the
process dies (the kernel closes its socket, crash or SIGKILL alike); when the network to
its host is cut, only once Postgres notices (TCP keepalives), and until then the lock
looks held and the reaper's timeout decides, as without it. So a free lock is positive
word that the owner is gone, without waiting the whole `HEARTBEAT_TIMEOUT_SECONDS` of
silence the reaper needs when it has no such word.

A free lock alone is not enough: a live process whose listening connection was lost
(Postgres restarting) is without its lock until it reconnects. Its heartbeat goes on
meanwhile, from other connections, once every checkpoint interval; so the owner counts
as gone only when its lock is free and its heartbeat has been silent for a few intervals.
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

STREAMING_OWNER = text(
    """
    SELECT owner, EXTRACT(EPOCH FROM now() - heartbeat_at) AS silent
    FROM turns
    WHERE coalesce(reply_id, id) = :reply_id AND status = 'streaming' AND owner IS NOT NULL
    """
)
# Free when this transaction can take it shared (until its commit): the owner holds it
# exclusively while it lives, and any number of lookers take it shared at once.
LOCK_IS_FREE = text(f"SELECT pg_try_advisory_xact_lock_shared(hashtextextended(:owner, {LIFE_SEED}))")


async def gone_owner_silence(session: AsyncSession, reply_id: uuid.UUID) -> float | None:
    """How long (seconds) the heartbeat of the reply's streaming turn has been silent, if the
    process that owns it holds no life lock; None while a live process holds it, or when no
    turn of the reply streams.
    """
    row = (await session.execute(STREAMING_OWNER, {"reply_id": reply_id})).first()
    if row is None:
        return None
    if not (await session.execute(LOCK_IS_FREE, {"owner": row.owner})).scalar_one():
        return None
    return float(row.silent or 0.0)
