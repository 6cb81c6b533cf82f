"""The id a protocol gives a tool call that waits for a person: enough to find the turn and the call.

The AI SDK calls it an approvalId, AG-UI an interrupt id; both are `approval:{turn}:{call}`,
so a decision names the waiting call without a lookup table.
"""

from __future__ import annotations

import uuid

APPROVAL_PREFIX = "approval"


def approval_id(turn_id: str | uuid.UUID, call_id: str) -> str:
    """The id of a waiting call: its turn and its call id."""
    return f"{APPROVAL_PREFIX}:{turn_id}:{call_id}"


def parse_approval_id(value: str) -> tuple[uuid.UUID, str] | None:
    """(turn id, call id) of an id made by `approval_id`, or None if it is not one."""
    prefix, _, rest = value.partition(":")
    turn, _, call_id = rest.partition(":")
    if prefix != APPROVAL_PREFIX or not call_id:
        return None
    try:
        return uuid.UUID(turn), call_id
    except ValueError:
        return None
