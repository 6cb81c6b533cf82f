"""A tool call inside an assistant turn, as stored in `turns.tool_calls`, and how an ending settles it.

The stored form is JSON (a list of objects in a jsonb column), so a call is a `TypedDict`:
typed for the code, the same dict for the database and the event log. Everything the
model sent is kept as received (`arguments` may be half a JSON object while the call
streams); the context builder decides what the model sees again.
"""

from __future__ import annotations

from typing import Any, TypedDict

from memory.events import ToolCallState, TurnStatus


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
