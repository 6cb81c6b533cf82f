"""A tool call inside an assistant turn, as stored in `turns.tool_calls`, and how an ending settles it.

The stored form is JSON (a list of objects in a jsonb column), so a call is a `TypedDict`:
typed for the code, the same dict for the database and the event log. Everything the
model sent is kept as received (`arguments` may be half a JSON object while the call
streams); the context builder decides what the model sees again.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, TypedDict

from sqlalchemy import func, update
from sqlalchemy.ext.asyncio import AsyncSession

from memory.events import ToolCallState, TurnStatus
from memory.storage.models import ToolInvocation


class Approval(TypedDict, total=False):
    """A person's (or the timeout's) decision on a call that needs one."""

    required: bool
    expires_at: str | None
    decision: str  # "approved" or "rejected"
    by: str  # "user" or "timeout"
    decided_at: str
    reason: str
    arguments_edited: bool


class ToolCall(TypedDict, total=False):
    """One call the model made: its position, id, tool, arguments as received, and its state."""

    index: int
    id: str
    name: str
    arguments: str
    state: str
    approval: Approval
    received_arguments: str  # what the model sent, when a person edited `arguments`
    side_effect_may_have_happened: bool


# Calls that had not run when their reply ended: they never will.
NOT_STARTED = frozenset({ToolCallState.READY, ToolCallState.AWAITING_APPROVAL})
# Replies whose calls the model is shown again, each with its result (memory/prompt/context.py):
# a stop or a failure cuts the calls of any other reply off, half-streamed or whole.
CALLS_SHOWN_AGAIN = frozenset({TurnStatus.COMPLETED, TurnStatus.AWAITING_APPROVAL})


def takes_a_result(turn_status: str, call: ToolCall) -> bool:
    """True when a result for `call` (of a turn in `turn_status`) would reach the model: not cut off."""
    return turn_status in CALLS_SHOWN_AGAIN and call.get("state") != ToolCallState.STREAMING


def tool_calls_of(raw: Any) -> list[ToolCall]:
    """The calls stored in a turn row (a copy, so the caller may change them)."""
    return [ToolCall(**call) for call in raw or [] if isinstance(call, dict)]


def settle_open_calls(calls: list[ToolCall], status: str) -> list[ToolCall]:
    """The calls as a reply ending in `status` leaves them: any call still open is cancelled.

    A completed reply has no open call. A call that had not started never ran, so it had
    no side effect; a running one keeps what its runner recorded about that.
    """
    settled = [ToolCall(**call) for call in calls]
    if status == TurnStatus.COMPLETED:
        return settled
    for call in settled:
        state = call.get("state")
        if state in NOT_STARTED:
            call["state"] = ToolCallState.CANCELLED
            call["side_effect_may_have_happened"] = False
        elif state == ToolCallState.RUNNING:
            call["state"] = ToolCallState.CANCELLED
    return settled


async def settle_running_invocations(
    session: AsyncSession, turn_id: uuid.UUID, calls: list[ToolCall]
) -> None:
    """Cancel the turn's invocations still `running`; store their calls in `calls` as cut off while running.

    A process that stops a running tool records this itself; one that died (the reaper ends
    its reply) could not, and its last checkpoint may predate the call's start, even its last
    argument bytes. The invocation row is the truth: the tool started with these arguments,
    and it knows whether the tool has side effects. So the call is stored `cancelled` with
    "may have happened" as the row says (never run again unseen, DESIGN invariant 7), with the
    arguments the tool got if the checkpoint's are not a whole JSON object.
    """
    rows = await session.execute(
        update(ToolInvocation)
        .where(ToolInvocation.turn_id == turn_id, ToolInvocation.state == ToolCallState.RUNNING)
        .values(state=ToolCallState.CANCELLED, updated_at=func.now())
        .returning(
            ToolInvocation.call_index,
            ToolInvocation.call_id,
            ToolInvocation.tool_name,
            ToolInvocation.arguments,
            ToolInvocation.side_effect_may_have_happened,
        )
    )
    by_index = {call.get("index"): call for call in calls}
    for index, call_id, name, arguments, may_have_happened in rows.all():
        call = by_index.get(index)
        if call is None:  # the crash came before any checkpoint held the call
            call = ToolCall(index=index, id=call_id, name=name, arguments="")
            calls.append(call)
        call["state"] = ToolCallState.CANCELLED
        call["side_effect_may_have_happened"] = may_have_happened
        if not _whole_object(call.get("arguments")):
            call["arguments"] = json.dumps(arguments, ensure_ascii=False)
    calls.sort(key=lambda call: call.get("index", 0))


def _whole_object(raw: object) -> bool:
    try:
        return isinstance(raw, str) and isinstance(json.loads(raw), dict)
    except ValueError:
        return False
