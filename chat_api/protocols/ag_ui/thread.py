"""A thread's stored turns as the AG-UI messages its runs sent, under the same ids (MESSAGES_SNAPSHOT).

What `RunTranslator` builds from a reply's events, this builds from the turns stored for it:
user messages keep the client's id, an assistant message is one model step (its turn id), a
tool result is its tool turn (or the client's id), and a call whose reply ended without its
result gets the result the stream gave it.
"""

from __future__ import annotations

from collections.abc import Sequence

from ag_ui.core import (
    AssistantMessage,
    FunctionCall,
    Interrupt,
    Message,
    MessagesSnapshotEvent,
    ToolCall,
    ToolMessage,
    UserMessage,
)

from chat_api.protocols.ag_ui.run import FAILED, STOPPED, error_json, interrupt_of, now_ms, stopped_result_id
from memory.events import ToolCallState, TurnStatus
from memory.storage.models import Turn

# Where the client's own id of a user message is kept, so snapshots return the id it has.
CLIENT_MESSAGE_ID = "ag_ui_message_id"
# The AG-UI run that drives a reply now (kept on its user turn): what connect's RUN_STARTED says.
RUN_ID = "ag_ui_run_id"

# A reply that ended before a call had its result: the stream answered the call for it.
_ENDED_WITHOUT_RESULT: dict[str, str] = {
    TurnStatus.INTERRUPTED_BY_USER: STOPPED,
    TurnStatus.INTERRUPTED_BY_ERROR: FAILED,
    TurnStatus.FAILED: FAILED,
}


def user_message_id(turn: Turn) -> str:
    """The AG-UI id of a user turn or client tool result: the client's id if it sent one, else the turn id."""
    client_id = (turn.meta or {}).get(CLIENT_MESSAGE_ID)
    return str(client_id) if isinstance(client_id, str) and client_id else str(turn.id)


def thread_messages(turns: Sequence[Turn]) -> list[Message]:
    """Stored turns (oldest first) as the AG-UI messages the stream sent for them, under the same ids."""
    messages: list[Message] = []
    answered = {t.tool_call_id for t in turns if t.role == "tool" and t.tool_call_id}
    for turn in turns:
        if turn.role == "user":
            messages.append(UserMessage(id=user_message_id(turn), content=turn.content or ""))
        elif turn.role == "tool" and turn.tool_call_id:
            messages.append(
                ToolMessage(id=user_message_id(turn), tool_call_id=turn.tool_call_id, content=turn.content)
            )
        elif turn.role == "assistant":
            messages += _assistant_messages(turn, answered)
    return messages


def _assistant_messages(turn: Turn, answered: set[str]) -> list[Message]:
    calls = [
        ToolCall(
            id=str(call.get("id")),
            function=FunctionCall(
                name=str(call.get("name") or "tool"), arguments=str(call.get("arguments") or "")
            ),
        )
        for call in turn.tool_calls or []
    ]
    if not turn.content and not calls:
        return []
    out: list[Message] = [
        AssistantMessage(id=str(turn.id), content=turn.content or None, tool_calls=calls or None)
    ]
    why = _ENDED_WITHOUT_RESULT.get(turn.status)
    if why is not None:
        for call in calls:
            if call.id not in answered:
                out.append(
                    ToolMessage(id=stopped_result_id(call.id), tool_call_id=call.id, content=error_json(why))
                )
    return out


def snapshot(messages: Sequence[Message]) -> MessagesSnapshotEvent:
    """A MESSAGES_SNAPSHOT of these messages."""
    return MessagesSnapshotEvent(messages=list(messages), timestamp=now_ms())


def waiting_interrupts(turn: Turn) -> list[Interrupt]:
    """The interrupts of a parked turn: one per call that waits for a person."""
    out = []
    for call in turn.tool_calls or []:
        if call.get("state") != ToolCallState.AWAITING_APPROVAL:
            continue
        approval = call.get("approval") or {}
        out.append(
            interrupt_of(
                str(turn.id),
                str(call.get("id")),
                call.get("name"),
                call.get("arguments"),
                approval.get("expires_at"),
            )
        )
    return out
