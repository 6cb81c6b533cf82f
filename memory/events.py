"""The reply's vocabulary: its events and their payloads, turn statuses, tool-call states, stop reasons.

A reply is one sequence of events (``Event``: id, name, data), kept in its log
(``turn_events``) and followed live or from a checkpoint. Every protocol a client speaks
(chatmem's own SSE, the AI SDK stream, OpenAI chat completions, and any adapter added
later) is a translation of this sequence: an adapter imports the names and payload types
below, never copies a string. The chat page gets the same names from
``chat_api/static/events.js`` (a test holds the two together).

The log of one reply, in order:

    turn.started · memory.retrieved? · (message.delta | tool_call.delta)*
      · (tool.started? tool.result)* · step.started · …
      · one ending: turn.completed | turn.interrupted | turn.failed
        (or turn.awaiting_approval, after tool_call.approval_required per waiting call;
         tool_call.approved | tool_call.rejected later resume the same log)
    error: something failed after the stream started (the reply may still end normally)

Names and statuses are ``StrEnum``s: each member *is* its string, so it compares, hashes,
serialises and is stored exactly as the string it stands for.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, NamedTuple, NotRequired, TypedDict

from memory.json_values import JsonObject


class TurnStatus(StrEnum):
    """Where a turn stands (`turns.status`)."""

    STREAMING = "streaming"
    COMPLETED = "completed"
    INTERRUPTED_BY_USER = "interrupted_by_user"
    INTERRUPTED_BY_ERROR = "interrupted_by_error"
    FAILED = "failed"
    AWAITING_APPROVAL = "awaiting_approval"


# The statuses a reply ends in (awaiting_approval parks it; it is not an ending).
TERMINAL_STATUSES = frozenset(
    {
        TurnStatus.COMPLETED,
        TurnStatus.INTERRUPTED_BY_USER,
        TurnStatus.INTERRUPTED_BY_ERROR,
        TurnStatus.FAILED,
    }
)
INTERRUPTED_STATUSES = frozenset({TurnStatus.INTERRUPTED_BY_USER, TurnStatus.INTERRUPTED_BY_ERROR})


class ToolCallState(StrEnum):
    """States of one tool call inside an assistant turn."""

    STREAMING = "streaming"
    READY = "ready"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    AWAITING_APPROVAL = "awaiting_approval"
    # A person (or the approval timeout) said no; the model is given the rejection as the result.
    REJECTED = "rejected"


class StopReason(StrEnum):
    """Why a reply was asked to stop (`turns.interrupt_reason` when the user's)."""

    USER = "user"
    NEW_MESSAGE = "new_message"  # a message sent with on_busy=interrupt
    CLIENT_DISCONNECTED = "client_disconnected"  # with on_disconnect=stop, or a protocol that means it
    SHUTDOWN = "shutdown"  # the server is stopping: an error ending, not the user's
    ENDED_ELSEWHERE = "ended_elsewhere"  # another process stored its ending (it found this one silent)


# Stop reasons that count as the user's decision (interrupted_by_user); any other is an error ending.
USER_STOP_REASONS = frozenset({StopReason.USER, StopReason.NEW_MESSAGE, StopReason.CLIENT_DISCONNECTED})


class RecallError(StrEnum):
    """Why a reply's recall went on without (part of) memory: `memory.retrieved`'s `error.code`."""

    MEMORY_TIMEOUT = "memory_timeout"  # past RECALL_TIMEOUT_SECONDS: no items
    MEMORY_UNAVAILABLE = "memory_unavailable"  # recall failed: no items
    EMBEDDING_UNAVAILABLE = "embedding_unavailable"  # the embedding service did not answer: keyword hits only


class EventName(StrEnum):
    """The name of each event a reply's log can hold."""

    TURN_STARTED = "turn.started"
    MEMORY_RETRIEVED = "memory.retrieved"
    MESSAGE_DELTA = "message.delta"
    TOOL_CALL_DELTA = "tool_call.delta"
    STEP_STARTED = "step.started"
    TOOL_STARTED = "tool.started"
    TOOL_RESULT = "tool.result"
    TOOL_CALL_APPROVAL_REQUIRED = "tool_call.approval_required"
    TOOL_CALL_APPROVED = "tool_call.approved"
    TOOL_CALL_REJECTED = "tool_call.rejected"
    TURN_AWAITING_APPROVAL = "turn.awaiting_approval"
    TURN_COMPLETED = "turn.completed"
    TURN_INTERRUPTED = "turn.interrupted"
    TURN_FAILED = "turn.failed"
    ERROR = "error"


# The event that ends a reply's log, by the status it ended in. `turn.awaiting_approval`
# ends a stream too, but not the reply: a decision resumes it and the log goes on.
TERMINAL_EVENT: dict[str, EventName] = {
    TurnStatus.COMPLETED: EventName.TURN_COMPLETED,
    TurnStatus.INTERRUPTED_BY_USER: EventName.TURN_INTERRUPTED,
    TurnStatus.INTERRUPTED_BY_ERROR: EventName.TURN_INTERRUPTED,
    TurnStatus.FAILED: EventName.TURN_FAILED,
    TurnStatus.AWAITING_APPROVAL: EventName.TURN_AWAITING_APPROVAL,
}
# Every event that ends a stream, and those that end the reply itself.
TERMINAL_NAMES = frozenset(TERMINAL_EVENT.values())
ENDING_NAMES = frozenset({EventName.TURN_COMPLETED, EventName.TURN_INTERRUPTED, EventName.TURN_FAILED})
PARKED_EVENT = EventName.TURN_AWAITING_APPROVAL


class Event(NamedTuple):
    """One event of a reply's log: its id (1, 2, … with no gap), name and JSON data."""

    id: int
    name: str
    data: JsonObject


# --- payloads, one per event name ------------------------------------------------------


class ErrorData(TypedDict):
    """`error`, and the `error` of an ending or of a recall that failed: a code and a message."""

    code: str
    message: str


class TurnStartedData(TypedDict):
    """`turn.started`: the reply and its turns exist."""

    reply_id: str
    user_turn_id: str
    assistant_turn_id: str
    conversation_id: str
    model: str


class RecalledItem(TypedDict):
    """One memory in `memory.retrieved` (and in `POST /v1/memory/search`, with `chunk_index`)."""

    turn_id: str
    conversation_id: str | None
    conversation_title: str | None
    role: str
    name: str | None
    text: str
    created_at: str
    score: float
    external_id: str | None
    metadata: Any
    chunk_index: NotRequired[int]


class MemoryRetrievedData(TypedDict):
    """`memory.retrieved`: what recall searched for and found before the first token."""

    query: str
    rewritten_query: str
    rewrite: str  # model | heuristic | skipped
    scope: str
    items: list[RecalledItem]
    # A conversation's first reply, with MEMORY_STANDING_TOKENS: the user's statements its prompt
    # opens with, oldest first (memory.recall.standing); the items leave out what these show.
    standing: NotRequired[list[RecalledItem]]
    latency_ms: NotRequired[dict[str, float]]
    rewrite_fallback: NotRequired[str]
    error: NotRequired[ErrorData]  # the reply goes on without memory, and says why


class MessageDeltaData(TypedDict):
    """`message.delta`: text of the current step's assistant turn."""

    turn_id: str
    text: str


class ToolCallDeltaData(TypedDict):
    """`tool_call.delta`: a piece of one call's arguments (``id`` is the call's id)."""

    turn_id: str
    index: int
    id: str
    name: str
    arguments: str


class StepStartedData(TypedDict):
    """`step.started`: the next model step streams into a new assistant turn."""

    reply_id: str
    turn_id: str


class ToolStartedData(TypedDict):
    """`tool.started`: a server tool runs."""

    turn_id: str
    call_id: str
    name: str


class ToolResultData(TypedDict):
    """`tool.result`: a call's result (JSON text), stored as a tool turn."""

    turn_id: str
    call_id: str
    name: str
    state: str  # a ToolCallState
    result: str


class ApprovalRequiredData(TypedDict):
    """`tool_call.approval_required`: a call waits for a person."""

    reply_id: str
    turn_id: str
    call_id: str
    index: int
    name: str
    arguments: str
    expires_at: str | None


class ToolCallDecidedData(TypedDict):
    """`tool_call.approved` (with the arguments that run) or `tool_call.rejected` (with why)."""

    reply_id: str
    turn_id: str
    call_id: str
    name: Any
    by: str
    arguments: NotRequired[Any]
    arguments_edited: NotRequired[bool]
    reason: NotRequired[str]


class TurnEndedData(TypedDict):
    """`turn.completed`, `turn.interrupted`, `turn.failed`: the reply's one ending."""

    reply_id: str
    turn_id: str
    status: str  # a TurnStatus of TERMINAL_STATUSES
    usage: NotRequired[dict[str, int]]
    reason: NotRequired[str]  # a StopReason, when interrupted by the user
    error: NotRequired[ErrorData]


class TurnParkedData(TypedDict):
    """`turn.awaiting_approval`: the stream ends; a decision resumes the reply."""

    reply_id: str
    turn_id: str
    status: str
    call_ids: list[str]
    usage: NotRequired[dict[str, int]]


EventData = (
    TurnStartedData
    | MemoryRetrievedData
    | MessageDeltaData
    | ToolCallDeltaData
    | StepStartedData
    | ToolStartedData
    | ToolResultData
    | ApprovalRequiredData
    | ToolCallDecidedData
    | TurnEndedData
    | TurnParkedData
    | ErrorData
)
