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

A crash of one backend ends every session too (Postgres reinitialises) without changing
`pg_postmaster_start_time()`; the start of its checkpointer, started anew each time, counts
as well (`POSTGRES_STARTED_AT`) where the role may see it.

The reaper, which has no lock to look at, counts silence the same way (`silent_longer_than`):
an outage of Postgres longer than the heartbeat timeout leaves every heartbeat stale when it
comes back, and its first pass ended every live reply on every replica before their next tick.
"""

from __future__ import annotations

import uuid
from datetime import datetime

from sqlalchemy import ColumnElement, Select, and_, func, select, text
from sqlalchemy.ext.asyncio import AsyncSession

from memory.events import TurnStatus
from memory.storage.models import Turn

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

# When Postgres last started, or last reinitialised after one of its backends crashed: both end
# every session, but a crash leaves pg_postmaster_start_time() as it was. The checkpointer is
# started anew each time; its start is visible to a superuser or a member of pg_read_all_stats
# (pg_monitor), NULL to other roles, for whom only a restart counts (GREATEST skips NULL).
POSTGRES_STARTED_AT = func.greatest(
    func.pg_postmaster_start_time(),
    select(text("backend_start"))
    .select_from(text("pg_stat_activity"))
    .where(text("backend_type = 'checkpointer'"))
    .scalar_subquery(),
)
# When every live process is back after that: holding its life lock again, and heartbeating
# again (its first tick after reconnecting comes well before the lock).
OWNERS_BACK_AT = POSTGRES_STARTED_AT + func.make_interval(0, 0, 0, 0, 0, 0, LIFE_RETAKEN_SECONDS)


def silent_since() -> ColumnElement[datetime]:
    """Since when the owner of a streaming turn has been silent: its last heartbeat, or the
    moment every live owner is back after Postgres started, whichever is later."""
    return func.greatest(Turn.heartbeat_at, OWNERS_BACK_AT)


def silent_longer_than(seconds: float) -> ColumnElement[bool]:
    """Whether the owner of a streaming turn has been silent (`silent_since`) for longer than
    `seconds`: the reaper's test of a dead owner, for a whole table of turns.

    Written as two comparisons, not one on GREATEST: the index on `heartbeat_at` serves the
    first, and the second is one value for the whole statement (a one-time filter).
    """
    cutoff = func.now() - func.make_interval(0, 0, 0, 0, 0, 0, seconds)
    return and_(Turn.heartbeat_at < cutoff, OWNERS_BACK_AT < cutoff)


def _streaming_owner(reply_id: uuid.UUID) -> Select[str | None, int]:
    """The owner of the reply's streaming turn and how long (seconds) it has been silent
    (negative just after Postgres started)."""
    return select(Turn.owner, func.extract("epoch", func.now() - silent_since()).label("silent")).where(
        func.coalesce(Turn.reply_id, Turn.id) == reply_id,
        Turn.status == TurnStatus.STREAMING,
        Turn.owner.is_not(None),
    )


# Free when this transaction can take it shared (until its commit): the owner holds it
# exclusively while it lives, and any number of lookers take it shared at once.
LOCK_IS_FREE = text(f"SELECT pg_try_advisory_xact_lock_shared(hashtextextended(:owner, {LIFE_SEED}))")


async def gone_owner_silence(session: AsyncSession, reply_id: uuid.UUID) -> float | None:
    """How long (seconds) the owner of the reply's streaming turn has been silent, if it holds
    no life lock; None while a live process holds it, or when no turn of the reply streams.

    Negative just after Postgres started: its owner may not have taken its lock again yet.
    """
    row = (await session.execute(_streaming_owner(reply_id))).first()
    if row is None:
        return None
    if not (await session.execute(LOCK_IS_FREE, {"owner": row.owner})).scalar_one():
        return None
    return float(row.silent or 0.0)
