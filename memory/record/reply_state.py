"""Where a reply stands, and the Postgres channels that announce its changes.

A reply is the assistant and tool turns sharing one `reply_id`. It is live while one of
them is `streaming` (a process runs it) or `awaiting_approval` (parked: no process runs
it until a person decides); otherwise it is over. Each change is announced with
`pg_notify`, which is transactional: a listener is woken at commit, never for a row it
cannot see yet.

Channels:
- `chatmem_stop` (payload `reply_id:reason`): whichever process runs the reply stops it;
- `chatmem_turn_done` (payload `reply_id`): the reply ended or parked; stop requests and
  followers waiting elsewhere wake up;
- `chatmem_checkpoint`: new events were stored; followers on other processes read them.
"""

from __future__ import annotations

import uuid

from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncSession

from memory.events import TurnStatus
from memory.storage.models import Turn

STOP_CHANNEL = "chatmem_stop"
DONE_CHANNEL = "chatmem_turn_done"
CHECKPOINT_CHANNEL = "chatmem_checkpoint"

NOTIFY_STOP = text(f"SELECT pg_notify('{STOP_CHANNEL}', :payload)")
NOTIFY_DONE = text(f"SELECT pg_notify('{DONE_CHANNEL}', :reply_id)")
NOTIFY_CHECKPOINT = text(f"SELECT pg_notify('{CHECKPOINT_CHANNEL}', '')")


LIVE_STATUSES = (TurnStatus.STREAMING, TurnStatus.AWAITING_APPROVAL)


async def reply_state(session: AsyncSession, reply_id: uuid.UUID) -> str | None:
    """`streaming` or `awaiting_approval` while the reply is live; None once it is over."""
    rows = await session.execute(
        select(Turn.status).where(Turn.reply_id == reply_id, Turn.status.in_(LIVE_STATUSES)).limit(1)
    )
    return rows.scalar_one_or_none()


async def notify_stop(session: AsyncSession, reply_id: uuid.UUID, reason: str) -> None:
    """Ask whichever process runs the reply to stop it (sent at commit)."""
    await session.execute(NOTIFY_STOP, {"payload": f"{reply_id}:{reason}"})


async def notify_done(session: AsyncSession, reply_id: uuid.UUID) -> None:
    """Wake everyone waiting for this reply to end or park (sent at commit)."""
    await session.execute(NOTIFY_DONE, {"reply_id": str(reply_id)})
