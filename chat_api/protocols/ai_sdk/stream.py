"""The Vercel AI SDK's UI Message Stream protocol (v1), translated from chatmem's reply events.

Pure translation, no database and no HTTP: `UIMessageStream` turns a reply's event log
(live or stored, from any position) into the SDK's chunks, and `ui_messages` turns stored
turns into the `UIMessage[]` that `validateUIMessages` accepts. The two agree: a client
that kept what the stream sent holds the message that a reload reads back.

| chatmem event | chunks |
| --- | --- |
| `turn.started` | `start` (messageId = reply id), `start-step` |
| `memory.retrieved` | `data-memory` (kept in the message, not transient) |
| `message.delta` | `text-start` once, `text-delta` |
| `tool_call.delta` | `tool-input-start` once, `tool-input-delta` |
| (the step's arguments are complete) | `tool-input-available` (or `tool-input-error` if not JSON) |
| `tool_call.approval_required` | `tool-approval-request` (approvalId names turn and call) |
| `turn.awaiting_approval` | `finish-step`, and `finish` (tool-calls) if the stream ends there |
| `tool_call.rejected` | `tool-output-denied` |
| `tool.result` | `tool-output-available` / `tool-output-error` |
| `step.started` | `finish-step`, `start-step` |
| `turn.completed` | `finish-step`, `finish` (stop) |
| `turn.interrupted` by the user | open parts closed, `abort` |
| `turn.interrupted` by an error, `turn.failed`, `error` | open parts closed, `error` |

The SDK's chunk schema is strict about types, so every chunk is built here and nowhere
else. A tool call cut off by a stop ends as `output-error` with its partial arguments as
`rawInput` (the SDK's `tool-input-error`): the stored call keeps them byte for byte, and a
part left `input-streaming` would spin forever in a UI.
"""

from __future__ import annotations

import itertools
import json
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from chat_api.protocols.approvals import approval_id, parse_approval_id
from chat_api.response_headers import STREAM_HEADERS
from memory.events import (
    ApprovalRequiredData,
    Event,
    EventName,
    StopReason,
    ToolCallDecidedData,
    ToolCallDeltaData,
    ToolCallState,
    ToolResultData,
    TurnEndedData,
    TurnStatus,
)

Chunk = dict[str, Any]

HEADERS = {"x-vercel-ai-ui-message-stream": "v1", **STREAM_HEADERS}
MEDIA_TYPE = "text/event-stream"
DONE = b"data: [DONE]\n\n"
MEMORY_PART = "data-memory"
STOPPED_ARGUMENTS = "the reply was stopped before this call's arguments were complete"
CANCELLED = "the reply was stopped while this tool ran"
NOT_AN_OBJECT = "the arguments are not a JSON object"


def encode(chunk: Chunk) -> bytes:
    """One chunk as an SSE frame: `data: {json}` and a blank line (JSON never holds a newline)."""
    return b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n"


def _json_or_text(raw: str) -> Any:
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, TypeError):
        return raw


def _arguments(raw: str) -> tuple[bool, Any]:
    """(complete, value) of a call's raw arguments: a JSON object, or not (yet)."""
    try:
        value = json.loads(raw or "{}")
    except json.JSONDecodeError:
        return False, None
    return isinstance(value, dict), value


def _error_text(result: Any, default: str) -> str:
    if isinstance(result, dict) and isinstance(result.get("error"), str):
        return str(result["error"])
    return default


@dataclass
class _Call:
    name: str
    raw: str = ""
    available: bool = False  # tool-input-available (or -error) sent
    ended: bool = False  # an output (or denial) sent


@dataclass
class UIMessageStream:
    """Translates one reply's events, in order, into UI message stream chunks.

    `continuing`: the stream picks the reply up after a tool approval (from the decision
    on): the client already holds the message, so no `start-step` is opened and calls are
    known only by their ids.
    """

    message_id: str | None = None
    continuing: bool = False
    _text_id: str | None = None
    _text_count: int = 0
    _calls: dict[str, _Call] = field(default_factory=dict)
    _parked: bool = False
    _ended: bool = False

    def start(self, message_id: str) -> list[Chunk]:
        """The `start` chunk of a stream that does not begin with `turn.started` (a continuation)."""
        self.message_id = message_id
        return [{"type": "start", "messageId": message_id}]

    @property
    def ended(self) -> bool:
        """True once a terminal chunk (`finish`, `abort`, `error`) was produced."""
        return self._ended

    def translate(self, event: Event) -> list[Chunk]:
        """The chunks for one event (none for events the protocol has no place for)."""
        _, name, data = event
        out: list[Chunk] = []
        if self._parked and name != EventName.TURN_AWAITING_APPROVAL:
            self._parked = False  # the reply went on after its approvals: one timeline
        if name == EventName.TURN_STARTED:
            self.message_id = str(data.get("reply_id"))
            out += [{"type": "start", "messageId": self.message_id}, {"type": "start-step"}]
        elif name == EventName.MEMORY_RETRIEVED:
            out.append({"type": MEMORY_PART, "id": "memory", "data": data})
        elif name == EventName.MESSAGE_DELTA:
            out += self._text(str(data.get("turn_id")), str(data.get("text") or ""))
        elif name == EventName.TOOL_CALL_DELTA:
            out += self._tool_delta(cast(ToolCallDeltaData, data))
        elif name == EventName.TOOL_CALL_APPROVAL_REQUIRED:
            out += self._inputs_complete()
            required = cast(ApprovalRequiredData, data)
            call_id = str(required["call_id"])
            out.append(
                {
                    "type": "tool-approval-request",
                    "approvalId": approval_id(str(required["turn_id"]), call_id),
                    "toolCallId": call_id,
                }
            )
        elif name == EventName.TURN_AWAITING_APPROVAL:
            out += [*self._inputs_complete(), {"type": "finish-step"}]
            self._parked = True
        elif name == EventName.TOOL_CALL_REJECTED:
            rejected = cast(ToolCallDecidedData, data)
            call = self._call(str(rejected["call_id"]), str(rejected.get("name") or ""))
            call.ended = True
            out.append({"type": "tool-output-denied", "toolCallId": str(rejected["call_id"])})
        elif name == EventName.TOOL_STARTED:
            out += self._inputs_complete()
        elif name == EventName.TOOL_RESULT:
            out += [*self._inputs_complete(), *self._tool_result(cast(ToolResultData, data))]
        elif name == EventName.STEP_STARTED:
            out += [*self._close_text(), *self._inputs_complete(), {"type": "finish-step"}]
            out.append({"type": "start-step"})
            self._calls = {}
        elif name == EventName.TURN_COMPLETED:
            out += [*self._close_text(), *self._inputs_complete(), {"type": "finish-step"}]
            out.append({"type": "finish", "finishReason": "stop"})
            self._ended = True
        elif name == EventName.TURN_INTERRUPTED:
            out += self._interrupted(cast(TurnEndedData, data))
        elif name == EventName.TURN_FAILED:
            out += [
                *self._close_open(),
                {"type": "error", "errorText": _ending_error(cast(TurnEndedData, data), "the reply failed")},
            ]
            self._ended = True
        elif name == EventName.ERROR:
            out += [*self._close_open(), {"type": "error", "errorText": str(data.get("message") or "error")}]
            self._ended = True
        return out

    def end(self) -> list[Chunk]:
        """Chunks that close a stream whose events ran out: a reply parked for approval finishes."""
        if self._parked and not self._ended:
            self._ended = True
            return [{"type": "finish", "finishReason": "tool-calls"}]
        return []

    # --- parts ------------------------------------------------------------------------

    def _text(self, turn_id: str, delta: str) -> list[Chunk]:
        if not delta:
            return []
        out: list[Chunk] = []
        if self._text_id is None:
            self._text_count += 1
            self._text_id = f"text-{turn_id}-{self._text_count}"
            out.append({"type": "text-start", "id": self._text_id})
        out.append({"type": "text-delta", "id": self._text_id, "delta": delta})
        return out

    def _close_text(self) -> list[Chunk]:
        if self._text_id is None:
            return []
        chunk = {"type": "text-end", "id": self._text_id}
        self._text_id = None
        return [chunk]

    def _call(self, call_id: str, name: str) -> _Call:
        call = self._calls.get(call_id)
        if call is None:
            # Known only by id (a continuation after approval): its input was sent before.
            call = self._calls[call_id] = _Call(name=name, available=True)
        return call

    def _tool_delta(self, data: ToolCallDeltaData) -> list[Chunk]:
        out = self._close_text()
        call_id = str(data["id"])
        call = self._calls.get(call_id)
        if call is None:
            call = self._calls[call_id] = _Call(name=str(data.get("name") or "tool"))
            out.append({"type": "tool-input-start", "toolCallId": call_id, "toolName": call.name})
        arguments = str(data.get("arguments") or "")
        if arguments:
            call.raw += arguments
            out.append({"type": "tool-input-delta", "toolCallId": call_id, "inputTextDelta": arguments})
        return out

    def _inputs_complete(self) -> list[Chunk]:
        """The step's arguments stopped arriving: each call's input is available, or an error."""
        out: list[Chunk] = []
        for call_id, call in self._calls.items():
            if call.available:
                continue
            call.available = True
            complete, value = _arguments(call.raw)
            if complete:
                out.append(
                    {
                        "type": "tool-input-available",
                        "toolCallId": call_id,
                        "toolName": call.name,
                        "input": value,
                    }
                )
            else:
                out.append(
                    {
                        "type": "tool-input-error",
                        "toolCallId": call_id,
                        "toolName": call.name,
                        "input": call.raw,
                        "errorText": "the arguments are not a JSON object",
                    }
                )
                call.ended = True
        return out

    def _tool_result(self, data: ToolResultData) -> list[Chunk]:
        call_id = str(data["call_id"])
        call = self._call(call_id, str(data.get("name") or ""))
        if call.ended:
            return []  # denied (its refusal is the model's result, not the user's output) or input error
        call.ended = True
        result = _json_or_text(str(data.get("result") or ""))
        if data.get("state") == ToolCallState.SUCCEEDED:
            return [{"type": "tool-output-available", "toolCallId": call_id, "output": result}]
        return [
            {
                "type": "tool-output-error",
                "toolCallId": call_id,
                "errorText": _error_text(result, f"the tool call {data.get('state') or 'failed'}"),
            }
        ]

    def _close_open(self) -> list[Chunk]:
        """Close what a stop or failure cut off: the text, half-streamed and running calls."""
        out = self._close_text()
        for call_id, call in self._calls.items():
            if not call.available:
                call.available = call.ended = True
                out.append(
                    {
                        "type": "tool-input-error",
                        "toolCallId": call_id,
                        "toolName": call.name,
                        "input": call.raw,
                        "errorText": STOPPED_ARGUMENTS,
                    }
                )
            elif not call.ended:
                call.ended = True
                out.append({"type": "tool-output-error", "toolCallId": call_id, "errorText": CANCELLED})
        return out

    def _interrupted(self, data: TurnEndedData) -> list[Chunk]:
        self._ended = True
        out = self._close_open()
        if data.get("status") == TurnStatus.INTERRUPTED_BY_USER:
            return [*out, {"type": "abort", "reason": str(data.get("reason") or StopReason.USER)}]
        return [*out, {"type": "error", "errorText": _ending_error(data, "the reply was interrupted")}]


def _ending_error(data: TurnEndedData, default: str) -> str:
    error = data.get("error")
    if isinstance(error, dict) and error.get("message"):
        return f"{error.get('code') or 'error'}: {error['message']}"
    return default


# --- stored history → UIMessage[] -------------------------------------------------------


class StoredTurn(Protocol):
    """What a stored turn offers the translation (memory.storage.models.Turn has it)."""

    id: uuid.UUID
    role: str
    status: str
    content: str
    tool_calls: list[dict[str, Any]]
    tool_call_id: str | None
    reply_id: uuid.UUID | None
    interrupt_reason: str | None
    error: dict[str, Any] | None
    meta: dict[str, Any] | None


# Where the client's own id of a user message is kept, so edits and reloads use the same id.
CLIENT_MESSAGE_ID = "ai_sdk_message_id"


def message_id_of(turn: StoredTurn) -> str:
    """The UIMessage id of a stored user turn: the client's id if it sent one, else the turn id."""
    client_id = (turn.meta or {}).get(CLIENT_MESSAGE_ID)
    return str(client_id) if isinstance(client_id, str) and client_id else str(turn.id)


def message_key(turn: StoredTurn) -> tuple[str, uuid.UUID]:
    """Which UIMessage a turn is part of: a user turn is one; the turns of a reply, next to each
    other (its assistant turns, one per model step, and its tool turns), are one."""
    if turn.role == "user":
        return ("user", turn.id)
    return ("reply", turn.reply_id) if turn.reply_id is not None else ("turn", turn.id)


def ui_messages(
    turns: Sequence[StoredTurn], memories: dict[uuid.UUID, dict[str, Any]]
) -> list[dict[str, Any]]:
    """The history (oldest first: user, assistant and tool turns) as UIMessages.

    A reply (its assistant turns, one per model step, and its tool turns) is one
    assistant message whose id is the reply id, as the stream's `start` said.
    """
    messages: list[dict[str, Any]] = []
    for (kind, _), run in itertools.groupby(turns, key=message_key):
        if kind == "user":
            turn = next(run)
            messages.append(
                {"id": message_id_of(turn), "role": "user", "parts": [{"type": "text", "text": turn.content}]}
            )
        else:
            messages.append(_assistant_message(list(run), memories))
    return messages


def _assistant_message(turns: list[StoredTurn], memories: dict[uuid.UUID, dict[str, Any]]) -> dict[str, Any]:
    reply_id = turns[0].reply_id or turns[0].id
    results = {t.tool_call_id: t for t in turns if t.role == "tool" and t.tool_call_id}
    steps = [t for t in turns if t.role == "assistant"]
    parts: list[dict[str, Any]] = []
    for index, step in enumerate(steps):
        parts.append({"type": "step-start"})
        if index == 0 and reply_id in memories:
            parts.append({"type": MEMORY_PART, "id": "memory", "data": memories[reply_id]})
        if step.content:
            state = "streaming" if step.status == TurnStatus.STREAMING else "done"
            parts.append({"type": "text", "text": step.content, "state": state})
        parts += [_tool_part(step, call, results.get(str(call.get("id")))) for call in step.tool_calls or []]
    last = steps[-1] if steps else turns[-1]
    metadata: dict[str, Any] = {"status": last.status}
    if last.interrupt_reason:
        metadata["interrupt_reason"] = last.interrupt_reason
    if last.error:
        metadata["error"] = last.error
    return {"id": str(reply_id), "role": "assistant", "metadata": metadata, "parts": parts}


def _tool_part(step: StoredTurn, call: dict[str, Any], result: StoredTurn | None) -> dict[str, Any]:
    call_id = str(call.get("id"))
    raw = str(call.get("arguments") or "")
    complete, value = _arguments(raw)
    part: dict[str, Any] = {"type": f"tool-{call.get('name') or 'tool'}", "toolCallId": call_id}
    state = call.get("state")
    approval = call.get("approval") or {}
    decision = approval.get("decision")
    ident = approval_id(step.id, call_id)
    if state == ToolCallState.STREAMING and step.status == TurnStatus.STREAMING:
        return {**part, "state": "input-streaming", "input": value if complete else None, "rawInput": raw}
    if state == ToolCallState.STREAMING or not complete:
        error = (
            STOPPED_ARGUMENTS if state == ToolCallState.STREAMING else "the arguments are not a JSON object"
        )
        return {**part, "state": "output-error", "input": None, "rawInput": raw, "errorText": error}
    part["input"] = value
    if state == ToolCallState.AWAITING_APPROVAL:
        return {**part, "state": "approval-requested", "approval": {"id": ident}}
    if state == ToolCallState.REJECTED or decision == "rejected":
        denied = {"id": ident, "approved": False}
        if approval.get("reason"):
            denied["reason"] = str(approval["reason"])
        return {**part, "state": "output-denied", "approval": denied}
    if decision == "approved":
        part["approval"] = {"id": ident, "approved": True}
    if state == ToolCallState.SUCCEEDED and result is not None:
        return {**part, "state": "output-available", "output": _json_or_text(result.content)}
    if state in (ToolCallState.FAILED, ToolCallState.SUCCEEDED):
        output = _json_or_text(result.content) if result is not None else None
        return {**part, "state": "output-error", "errorText": _error_text(output, "the tool call failed")}
    if state == ToolCallState.CANCELLED or step.status != TurnStatus.STREAMING:
        return {**part, "state": "output-error", "errorText": CANCELLED}
    if decision == "approved":
        return {**part, "state": "approval-responded"}
    return {**part, "state": "input-available"}


# --- what the client sent ---------------------------------------------------------------


@dataclass(frozen=True)
class ApprovalResponse:
    """One `approval-responded` tool part of the client's last assistant message."""

    turn_id: uuid.UUID
    call_id: str
    approved: bool
    reason: str | None


def text_of(message: dict[str, Any]) -> str:
    """The text of a message's text parts, joined; other parts (data, sources, steps) are not the message.

    ValueError for a text part whose text is not a string, and for a file part: chatmem keeps
    and answers text only, so an attachment would be dropped without the user knowing.
    """
    parts = message.get("parts")
    if not isinstance(parts, list):
        return ""
    texts = []
    for part in parts:
        if not isinstance(part, dict):
            continue
        if part.get("type") == "file":
            raise ValueError("file parts are not supported: chatmem keeps text only (send the file's text)")
        if part.get("type") == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError("a text part's text must be a string")
            texts.append(text)
    return "".join(texts)


def approval_responses(message: dict[str, Any]) -> list[ApprovalResponse] | None:
    """The decisions in an assistant message's `approval-responded` parts; None if it has none.

    ValueError for a responded part whose approval id chatmem did not make.
    """
    parts = message.get("parts")
    if message.get("role") != "assistant" or not isinstance(parts, list):
        return None
    found: list[ApprovalResponse] = []
    for part in _tool_parts(parts):
        if part.get("state") != "approval-responded":
            continue
        approval = part.get("approval")
        if not isinstance(approval, dict) or not isinstance(approval.get("approved"), bool):
            raise ValueError("an approval-responded part needs approval: {id, approved}")
        parsed = parse_approval_id(str(approval.get("id") or ""))
        if parsed is None or parsed[1] != part.get("toolCallId"):
            raise ValueError("unknown approval id")
        reason = approval.get("reason")
        found.append(
            ApprovalResponse(
                parsed[0], parsed[1], approval["approved"], reason if isinstance(reason, str) else None
            )
        )
    return found or None


def _tool_parts(parts: Iterable[Any]) -> Iterable[dict[str, Any]]:
    for part in parts:
        if isinstance(part, dict) and str(part.get("type", "")).startswith(("tool-", "dynamic-tool")):
            yield part
