"""Tool calls that wait for a person: parking a turn, deciding its calls, and ending it.

A turn whose model step called a tool registered as requiring approval is *parked*: its
status becomes `awaiting_approval`, nothing runs, and the row holds everything needed to
continue on any process later (the calls with their complete arguments, the event log,
`approval_expires_at` for calls with a timeout). Each call is decided exactly once
under the turn's row lock; when the last one is decided the turn goes back to
`streaming`, owned by the process that will run it. A parked turn keeps the conversation
busy (`active_reply_id`), so nothing is appended behind a reply that is not finished.

The call dicts in `turns.tool_calls` carry the decision under `approval`; edited
arguments replace `arguments` (what runs and what the model sees again), and what the
model sent is kept as `received_arguments`.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import func, select, text
from sqlalchemy.ext.asyncio import AsyncSession

from memory.errors import NotAwaitingApproval, NotFound
from memory.events import ToolCallState, TurnStatus
from memory.record.conversations import Owner
from memory.record.tool_calls import Approval, ToolCall, tool_calls_of
from memory.storage.models import Conversation, Turn

APPROVED = "approved"
REJECTED = "rejected"

PARK_TURN = text(
    """
    UPDATE turns SET status = 'awaiting_approval', content = :content,
           tool_calls = CAST(:tool_calls AS jsonb), last_event_id = :last_event_id,
           usage = CAST(:usage AS jsonb), prompt_version = :prompt_version,
           metadata = COALESCE(metadata, '{}'::jsonb) || CAST(:meta AS jsonb),
           approval_expires_at = :expires_at, heartbeat_at = NULL, owner = NULL, updated_at = now()
    WHERE id = :turn_id AND status = 'streaming'
    RETURNING id
    """
)


@dataclass(frozen=True)
class Decision:
    """What a person (or the timeout) decided about one call."""

    approved: bool
    by: str  # "user" or "timeout"
    arguments: str | None = None  # edited arguments (a JSON object), approvals only
    reason: str | None = None  # rejections only


def waiting_calls(tool_calls: Sequence[ToolCall]) -> list[ToolCall]:
    """The calls of a turn that still wait for a decision."""
    return [call for call in tool_calls if call.get("state") == ToolCallState.AWAITING_APPROVAL]


def earliest_expiry(tool_calls: Sequence[ToolCall]) -> datetime | None:
    """When the first waiting call with a timeout runs out (None: no timeout)."""
    times = [
        datetime.fromisoformat(expires)
        for call in waiting_calls(tool_calls)
        if (expires := call.get("approval", {}).get("expires_at"))
    ]
    return min(times) if times else None


async def park_turn(
    session: AsyncSession,
    turn_id: uuid.UUID,
    *,
    content: str,
    tool_calls_json: str,
    last_event_id: int,
    usage_json: str,
    prompt_version: str | None,
    meta_json: str,
    expires_at: datetime | None,
) -> bool:
    """Move a streaming turn to `awaiting_approval`; False if it was no longer streaming."""
    row = await session.execute(
        PARK_TURN,
        {
            "turn_id": turn_id,
            "content": content,
            "tool_calls": tool_calls_json,
            "last_event_id": last_event_id,
            "usage": usage_json,
            "prompt_version": prompt_version,
            "meta": meta_json,
            "expires_at": expires_at,
        },
    )
    return row.first() is not None


async def lock_turn(session: AsyncSession, owner: Owner, turn_id: uuid.UUID) -> Turn:
    """The owner's turn, locked for a decision (NotFound for anyone else's)."""
    turn = (
        await session.execute(
            select(Turn)
            .join(Conversation, Conversation.id == Turn.conversation_id)
            .where(
                Turn.id == turn_id,
                Turn.tenant_id == owner.tenant_id,
                Turn.user_id == owner.user_id,
                Conversation.deleted_at.is_(None),
            )
            .with_for_update(of=Turn)
        )
    ).scalar_one_or_none()
    if turn is None:
        raise NotFound("turn not found", turn_id=str(turn_id))
    return turn


def decide_call(turn: Turn, call_id: str, decision: Decision, now: datetime | None = None) -> ToolCall:
    """Record the decision on a locked, parked turn; returns the decided call."""
    calls = tool_calls_of(turn.tool_calls)
    call = next((c for c in calls if c.get("id") == call_id), None)
    if call is None:
        raise NotFound("tool call not found in this turn", turn_id=str(turn.id), call_id=call_id)
    if turn.status != TurnStatus.AWAITING_APPROVAL or call.get("state") != ToolCallState.AWAITING_APPROVAL:
        raise NotAwaitingApproval(
            "this tool call is not waiting for approval",
            turn_id=str(turn.id),
            call_id=call_id,
            turn_status=turn.status,
            call_state=call.get("state"),
        )
    approval = Approval(**call.get("approval", Approval()))
    approval["decision"] = APPROVED if decision.approved else REJECTED
    approval["by"] = decision.by
    approval["decided_at"] = (now or datetime.now(UTC)).isoformat()
    if decision.approved:
        call["state"] = ToolCallState.READY
        if decision.arguments is not None and decision.arguments != call.get("arguments"):
            call["received_arguments"] = call.get("arguments", "")
            call["arguments"] = decision.arguments
            approval["arguments_edited"] = True
    else:
        call["state"] = ToolCallState.REJECTED
        approval["reason"] = decision.reason or ""
    call["approval"] = approval
    turn.tool_calls = [dict(c) for c in calls]
    turn.approval_expires_at = earliest_expiry(calls)
    turn.updated_at = func.now()
    return call


def take_for_resume(turn: Turn, owner_tag: str) -> None:
    """Every call is decided: the turn streams again, owned (and heartbeated) by this process."""
    turn.status = TurnStatus.STREAMING
    turn.owner = owner_tag
    turn.heartbeat_at = func.now()
    turn.approval_expires_at = None


async def expired_turns(session: AsyncSession, limit: int = 50) -> list[Turn]:
    """Parked turns with a call past its approval timeout, locked (others skip them).

    Not those of a deleted conversation: a rejection resumes the reply, and its other
    calls would run for a conversation nobody can see any more.
    """
    rows = await session.execute(
        select(Turn)
        .join(Conversation, Conversation.id == Turn.conversation_id)
        .where(
            Turn.status == TurnStatus.AWAITING_APPROVAL,
            Turn.approval_expires_at.is_not(None),
            Turn.approval_expires_at <= func.now(),
            Conversation.deleted_at.is_(None),
        )
        .order_by(Turn.approval_expires_at)
        .limit(limit)
        .with_for_update(of=Turn, skip_locked=True)
    )
    return list(rows.scalars())


def expired_call_ids(turn: Turn, now: datetime) -> list[str]:
    """The waiting calls of a turn whose timeout has passed."""
    return [
        call["id"]
        for call in waiting_calls(tool_calls_of(turn.tool_calls))
        if (expires := (call.get("approval") or {}).get("expires_at"))
        and datetime.fromisoformat(expires) <= now
    ]
