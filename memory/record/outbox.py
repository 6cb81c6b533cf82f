"""The transactional outbox: a finished turn and its outbox row commit together, or neither does.

Only user and assistant turns are recorded. Tool turns are machine output (search
results, API responses, file contents): indexing them would fill a user's long-term
memory with third-party text the user never said, and whatever of it mattered reaches
the user through the assistant turn that follows, which is recorded. Turns that are
still streaming or `failed` are never recorded: nothing usable was shown.

The payload carries the visible text only. Tool call arguments, complete or partial,
stay in the turns table; they are not something anyone said.

``pg_notify`` is transactional: the relay or the Postgres consumer is woken at commit,
never for a row it cannot see yet, and not at all when the caller rolls back.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, cast

from sqlalchemy import Table, bindparam, func, insert, literal_column, select, text
from sqlalchemy.ext.asyncio import AsyncSession

from memory.events import TurnStatus
from memory.storage.models import OutboxRow, Turn

PAYLOAD_VERSION = 1
NOTIFY_CHANNEL = "chatmem_outbox"

RECORDED_ROLES = frozenset({"user", "assistant"})
RECORDED_STATUSES = frozenset(
    {TurnStatus.COMPLETED, TurnStatus.INTERRUPTED_BY_USER, TurnStatus.INTERRUPTED_BY_ERROR}
)

NOTIFY = text(f"SELECT pg_notify('{NOTIFY_CHANNEL}', '')")


def _iso(value: object) -> str | None:
    # A column set to func.now() and not yet refreshed is an SQL expression, not a time.
    return value.isoformat() if isinstance(value, datetime) else None


def is_recorded(turn: Turn) -> bool:
    """True when this turn belongs in the memory index (role and status allow it)."""
    return turn.role in RECORDED_ROLES and turn.status in RECORDED_STATUSES


def turn_payload(turn: Turn) -> dict[str, Any]:
    """The versioned outbox message of a finished turn (visible text only)."""
    return {
        "v": PAYLOAD_VERSION,
        "tenant_id": turn.tenant_id,
        "user_id": turn.user_id,
        "conversation_id": str(turn.conversation_id),
        "turn_id": str(turn.id),
        "seq": turn.seq,
        "role": turn.role,
        "status": turn.status,
        "text": turn.content or "",
        "name": turn.name,
        "created_at": _iso(turn.created_at),
        "completed_at": _iso(turn.completed_at),
        "external_id": turn.external_id,
        "metadata": turn.meta,
        "memory_use": turn.memory_use,
    }


def _row(turn: Turn) -> dict[str, Any]:
    return {
        "tenant_id": turn.tenant_id,
        "user_id": turn.user_id,
        "conversation_id": turn.conversation_id,
        "turn_id": turn.id,
        "payload": turn_payload(turn),
    }


# The row and the relay's wake-up in one statement (one round trip, not an INSERT and a
# `SELECT pg_notify`): a data-modifying WITH runs whether or not the query reads it. A plain
# INSERT, not an ORM flush: it runs twice for every message (its user turn and its reply), and
# nothing reads the row back in the transaction that writes it. The defaults are written out:
# the INSERT inside a SELECT gets no client-side column defaults.
_OUTBOX = cast(Table, OutboxRow.__table__)
_RECORDED = (
    insert(_OUTBOX)
    .values({name: bindparam(name) for name in ("tenant_id", "user_id", "conversation_id", "turn_id")})
    .values(payload=bindparam("payload"), attempts=0, priority=0)
    .cte("recorded")
)
_WAKE = func.pg_notify(literal_column(f"'{NOTIFY_CHANNEL}'"), literal_column("''"))
RECORD_AND_NOTIFY = select(_WAKE).add_cte(_RECORDED)


async def record_finished_turn(session: AsyncSession, turn: Turn) -> None:
    """Add the turn's outbox row to the caller's transaction and notify (no-op for turns not recorded)."""
    if is_recorded(turn):
        await session.execute(RECORD_AND_NOTIFY, _row(turn))
