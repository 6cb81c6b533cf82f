"""AG-UI (the Agent-User Interaction protocol, 1.0), translated from a chatmem reply's events.

Pure translation, no database and no HTTP. One reply is one AG-UI run: `RunTranslator`
folds the reply's event log (live or stored, from any position) into AG-UI events built
with the official SDK's types (`ag-ui-protocol`), and keeps the AG-UI messages it has sent;
`thread.thread_messages` builds the same messages from stored turns (the MESSAGES_SNAPSHOT
of connect and of a resumed run). The two agree: a client that applied the stream holds the
messages a snapshot sends back, under the same ids.

| chatmem event | AG-UI events |
| --- | --- |
| `memory.retrieved` | `CUSTOM` `chatmem.memory` (query, rewritten query, items) |
| `message.delta` | `TEXT_MESSAGE_START` once per model step (id: the step's turn), `..._CONTENT` |
| `tool_call.delta` | text closed; `TOOL_CALL_START` (parent: the step's turn), `TOOL_CALL_ARGS` |
| the step's arguments are complete | `TOOL_CALL_END` |
| `tool.result` | `TOOL_CALL_RESULT` (messageId = the tool turn's id) |
| `tool_call.approval_required`, | `RUN_FINISHED` outcome `interrupt`, |
| `turn.awaiting_approval` | one interrupt per waiting call |
| `step.started` | the previous step's text and calls closed |
| `turn.completed` | `RUN_FINISHED` success (unanswered client calls: `pendingToolCallIds`) |
| `turn.interrupted` by the user | open parts closed, every unanswered call answered, |
| | `RUN_FINISHED` cancelled |
| `turn.interrupted` by an error, | open parts closed, every unanswered call answered, |
| `turn.failed`, `error` | `RUN_ERROR` |

A call cut off by a stop mid-arguments closes like any other (`TOOL_CALL_END`): its
partial arguments are what the client was sent and what is stored. The `cancelled`
outcome and `pendingToolCallIds` exist from protocol 1.0 on; a client that does not
declare 1.0 (the 0.0.x clients parse outcomes strictly and fail on an unknown one) gets a
plain `RUN_FINISHED` for them, which it reads as success.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, cast

from ag_ui.core import (
    PROTOCOL_VERSION,
    AssistantMessage,
    BaseEvent,
    CustomEvent,
    FunctionCall,
    Interrupt,
    Message,
    RunErrorEvent,
    RunFinishedCancelledOutcome,
    RunFinishedEvent,
    RunFinishedInterruptOutcome,
    RunFinishedSuccessOutcome,
    RunStartedEvent,
    TextMessageContentEvent,
    TextMessageEndEvent,
    TextMessageStartEvent,
    ToolCall,
    ToolCallArgsEvent,
    ToolCallEndEvent,
    ToolCallResultEvent,
    ToolCallStartEvent,
    ToolMessage,
)
from ag_ui.encoder import EventEncoder

from chat_api.protocols.approvals import approval_id
from memory.events import (
    ApprovalRequiredData,
    Event,
    EventName,
    MessageDeltaData,
    ToolCallDeltaData,
    ToolResultData,
    TurnEndedData,
    TurnStatus,
)

MEDIA_TYPE = EventEncoder().get_content_type()
MEMORY_EVENT = "chatmem.memory"
# The result a call gets when its reply ended before it had one (AG-UI leaves no call unanswered).
STOPPED = "the reply was stopped before this tool call finished"
FAILED = "the reply failed before this tool call finished"
# What a person answers a tool-call interrupt with (the AG-UI interrupts page's approval shape).
APPROVAL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "approved": {"type": "boolean"},
        "reason": {"type": "string"},
        "editedArgs": {"type": "object", "description": "Full replacement of the tool's arguments."},
    },
    "required": ["approved"],
}

_encoder = EventEncoder()


def encode(events: Iterable[BaseEvent]) -> bytes:
    """Events as SSE frames (`data: {json}` and a blank line), with the SDK's encoder."""
    return "".join(_encoder.encode(event) for event in events).encode()


def speaks_1_0(protocol_version: str | None) -> bool:
    """True when the client declared protocol 1.0 or later (it reads `cancelled` and `pendingToolCallIds`)."""
    if not protocol_version:
        return False
    major, _, _ = protocol_version.partition(".")
    return major.isdigit() and int(major) >= 1


def stopped_result_id(call_id: str) -> str:
    """The message id of the result a call gets when its reply ended without one (stream and snapshot)."""
    return f"{call_id}-stopped"


def stopped_result() -> str:
    """The content of the result a call gets when a stop ended its reply before it had one."""
    return error_json(STOPPED)


def now_ms() -> int:
    """Milliseconds since the epoch: every event's timestamp."""
    return int(time.time() * 1000)


@dataclass
class _Call:
    id: str
    name: str
    parent: str
    raw: str = ""
    ended: bool = False  # TOOL_CALL_END sent
    answered: bool = False  # TOOL_CALL_RESULT sent (or the client answers it)


@dataclass
class RunTranslator:
    """Translates one reply's events, in order, into the AG-UI events of one run.

    `messages` holds the AG-UI messages of the reply as the events so far built them (what a
    client applying the stream holds), in the order a client keeps them.
    """

    thread_id: str
    run_id: str
    modern: bool = True  # the client speaks protocol 1.0 (see `speaks_1_0`)
    messages: list[Message] = field(default_factory=list)
    memory: dict[str, Any] | None = None
    _text: str | None = None
    _calls: dict[str, _Call] = field(default_factory=dict)
    _interrupts: list[Interrupt] = field(default_factory=list)
    _parked: bool = False
    _ended: bool = False

    @property
    def ended(self) -> bool:
        """True once `RUN_FINISHED` or `RUN_ERROR` was produced: nothing may follow it."""
        return self._ended

    @property
    def parked(self) -> bool:
        """True when the events so far end with the reply waiting for a person."""
        return self._parked

    def run_started(self) -> RunStartedEvent:
        """The event every run begins with."""
        return RunStartedEvent(
            thread_id=self.thread_id,
            run_id=self.run_id,
            protocol_version=PROTOCOL_VERSION,
            timestamp=now_ms(),
        )

    def know_calls(self, calls: Iterable[tuple[str, str, str]]) -> None:
        """Calls (id, name, parent message id) sent by an earlier run: their results may follow."""
        for call_id, name, parent in calls:
            self._calls.setdefault(call_id, _Call(call_id, name, parent, ended=True))

    def translate(self, event: Event) -> list[BaseEvent]:
        """The AG-UI events for one chatmem event (none for what the protocol has no place for)."""
        if self._ended:
            return []
        _, name, data = event
        if self._parked and name != EventName.TURN_AWAITING_APPROVAL:
            self._parked = False  # the reply went on after its approvals: one timeline
            self._interrupts = []
        out: list[BaseEvent] = []
        if name == EventName.MEMORY_RETRIEVED:
            self.memory = dict(data)
            out.append(CustomEvent(name=MEMORY_EVENT, value=self.memory, timestamp=now_ms()))
        elif name == EventName.MESSAGE_DELTA:
            delta = cast(MessageDeltaData, data)
            out += self._text_delta(str(delta["turn_id"]), str(delta.get("text") or ""))
        elif name == EventName.TOOL_CALL_DELTA:
            out += self._tool_delta(cast(ToolCallDeltaData, data))
        elif name == EventName.TOOL_CALL_APPROVAL_REQUIRED:
            out += [*self._close_text(), *self._end_calls()]
            required = cast(ApprovalRequiredData, data)
            self._interrupts.append(
                interrupt_of(
                    str(required["turn_id"]),
                    str(required["call_id"]),
                    required.get("name"),
                    required.get("arguments"),
                    required.get("expires_at"),
                )
            )
        elif name == EventName.TURN_AWAITING_APPROVAL:
            out += [*self._close_text(), *self._end_calls()]
            self._parked = bool(self._interrupts)
        elif name in (EventName.TOOL_STARTED, EventName.TOOL_CALL_APPROVED, EventName.TOOL_CALL_REJECTED):
            out += self._end_calls()
        elif name == EventName.TOOL_RESULT:
            out += [*self._end_calls(), *self._result(cast(ToolResultData, data))]
        elif name == EventName.STEP_STARTED:
            out += [*self._close_text(), *self._end_calls()]
        elif name == EventName.TURN_COMPLETED:
            out += [*self._close_text(), *self._end_calls(), self._finished_success()]
        elif name == EventName.TURN_INTERRUPTED:
            ended = cast(TurnEndedData, data)
            if ended.get("status") == TurnStatus.INTERRUPTED_BY_USER:
                out += [*self._close_open(STOPPED), self._finished_cancelled()]
            else:
                out += [*self._close_open(FAILED), self._run_error(ended.get("error"), "interrupted")]
        elif name == EventName.TURN_FAILED:
            ended = cast(TurnEndedData, data)
            out += [*self._close_open(FAILED), self._run_error(ended.get("error"), "failed")]
        elif name == EventName.ERROR:
            out += [*self._close_open(FAILED), self._run_error(data, "error")]
        return out

    def end(self) -> list[BaseEvent]:
        """What closes a run whose events ran out: a reply waiting for a person ends with its interrupts."""
        if self._ended:
            return []
        if self._parked:
            self._ended = True
            outcome = RunFinishedInterruptOutcome(interrupts=self._interrupts)
            return [self._finished(outcome)]
        return []

    def open_parts(self) -> list[BaseEvent]:
        """Re-open what is streaming now, for a run that joins the reply midway (connect).

        The half-streamed text continues under its id (the snapshot holds its beginning); a
        half-streamed call is not in the snapshot and is sent again whole, start and arguments so far.
        """
        out: list[BaseEvent] = []
        if self._text is not None:
            out.append(TextMessageStartEvent(message_id=self._text, role="assistant", timestamp=now_ms()))
        for call in self._calls.values():
            if call.ended:
                continue
            out.append(self._call_start(call))
            if call.raw:
                out.append(ToolCallArgsEvent(tool_call_id=call.id, delta=call.raw, timestamp=now_ms()))
        return out

    def settled_messages(self) -> list[Message]:
        """`messages` without the calls still streaming (`open_parts` sends those again)."""
        streaming = {c.id for c in self._calls.values() if not c.ended}
        if not streaming:
            return list(self.messages)
        out: list[Message] = []
        for message in self.messages:
            if isinstance(message, AssistantMessage) and message.tool_calls:
                calls = [c for c in message.tool_calls if c.id not in streaming]
                if not calls and message.content is None:
                    continue
                message = message.model_copy(update={"tool_calls": calls or None})
            out.append(message)
        return out

    # --- text ------------------------------------------------------------------------

    def _assistant(self, message_id: str) -> AssistantMessage:
        for message in self.messages:
            if isinstance(message, AssistantMessage) and message.id == message_id:
                return message
        created = AssistantMessage(id=message_id)
        self.messages.append(created)
        return created

    def _text_delta(self, turn_id: str, delta: str) -> list[BaseEvent]:
        if not delta:
            return []
        out: list[BaseEvent] = []
        if self._text != turn_id:
            out += self._close_text()
            self._text = turn_id
            out.append(TextMessageStartEvent(message_id=turn_id, role="assistant", timestamp=now_ms()))
        message = self._assistant(turn_id)
        message.content = (message.content or "") + delta
        out.append(TextMessageContentEvent(message_id=turn_id, delta=delta, timestamp=now_ms()))
        return out

    def _close_text(self) -> list[BaseEvent]:
        if self._text is None:
            return []
        message_id, self._text = self._text, None
        return [TextMessageEndEvent(message_id=message_id, timestamp=now_ms())]

    # --- tool calls ------------------------------------------------------------------

    def _call_start(self, call: _Call) -> ToolCallStartEvent:
        return ToolCallStartEvent(
            tool_call_id=call.id, tool_call_name=call.name, parent_message_id=call.parent, timestamp=now_ms()
        )

    def _tool_delta(self, data: ToolCallDeltaData) -> list[BaseEvent]:
        out = self._close_text()
        call_id = str(data["id"])
        call = self._calls.get(call_id)
        if call is None:
            call = _Call(call_id, str(data.get("name") or "tool"), str(data.get("turn_id")))
            self._calls[call_id] = call
            message = self._assistant(call.parent)
            message.tool_calls = [
                *(message.tool_calls or []),
                ToolCall(id=call_id, function=FunctionCall(name=call.name, arguments="")),
            ]
            out.append(self._call_start(call))
        delta = str(data.get("arguments") or "")
        if delta and not call.ended:
            call.raw += delta
            for stored in self._assistant(call.parent).tool_calls or []:
                if stored.id == call_id:
                    stored.function.arguments = call.raw
            out.append(ToolCallArgsEvent(tool_call_id=call_id, delta=delta, timestamp=now_ms()))
        return out

    def _end_calls(self) -> list[BaseEvent]:
        """The arguments stopped arriving: every open call is closed."""
        out: list[BaseEvent] = []
        for call in self._calls.values():
            if not call.ended:
                call.ended = True
                out.append(ToolCallEndEvent(tool_call_id=call.id, timestamp=now_ms()))
        return out

    def _result(self, data: ToolResultData) -> list[BaseEvent]:
        call_id = str(data["call_id"])
        call = self._calls.get(call_id)
        if call is not None:
            call.answered = True
        return [self._tool_message(str(data.get("turn_id")), call_id, str(data.get("result") or ""))]

    def _tool_message(self, message_id: str, call_id: str, content: str) -> ToolCallResultEvent:
        message = ToolMessage(id=message_id, tool_call_id=call_id, content=content)
        owner = next(
            (
                i
                for i, m in enumerate(self.messages)
                if isinstance(m, AssistantMessage) and any(c.id == call_id for c in m.tool_calls or [])
            ),
            None,
        )
        if owner is None:
            self.messages.append(message)
        else:
            at = owner + 1
            while at < len(self.messages) and isinstance(self.messages[at], ToolMessage):
                at += 1
            self.messages.insert(at, message)
        return ToolCallResultEvent(
            message_id=message_id, tool_call_id=call_id, content=content, role="tool", timestamp=now_ms()
        )

    def _close_open(self, why: str) -> list[BaseEvent]:
        """Close what an ending cut off, and answer every call left without a result."""
        out = [*self._close_text(), *self._end_calls()]
        for call in self._calls.values():
            if not call.answered:
                call.answered = True
                out.append(self._tool_message(stopped_result_id(call.id), call.id, error_json(why)))
        return out

    # --- endings ---------------------------------------------------------------------

    def _finished(self, outcome: Any) -> RunFinishedEvent:
        self._ended = True
        return RunFinishedEvent(
            thread_id=self.thread_id, run_id=self.run_id, outcome=outcome, timestamp=now_ms()
        )

    def _finished_success(self) -> RunFinishedEvent:
        pending = [c.id for c in self._calls.values() if not c.answered]
        if not self.modern:
            return self._finished(None)
        return self._finished(RunFinishedSuccessOutcome(pending_tool_call_ids=pending or None))

    def _finished_cancelled(self) -> RunFinishedEvent:
        return self._finished(RunFinishedCancelledOutcome() if self.modern else None)

    def _run_error(self, error: Any, default_code: str) -> RunErrorEvent:
        self._ended = True
        code = default_code
        message = "the reply failed"
        if isinstance(error, dict):
            code = str(error.get("code") or default_code)
            message = str(error.get("message") or message)
        return RunErrorEvent(message=message, code=code, timestamp=now_ms())


def interrupt_of(turn_id: str, call_id: str, name: Any, arguments: Any, expires_at: Any) -> Interrupt:
    """The interrupt of a call that waits for a person (from its approval_required event, or as stored)."""
    name = str(name or "tool")
    arguments = str(arguments or "{}")
    return Interrupt(
        id=approval_id(turn_id, call_id),
        reason="tool_call",
        message=f"Run {name} with {arguments}?",
        tool_call_id=call_id,
        response_schema=APPROVAL_SCHEMA,
        expires_at=str(expires_at) if expires_at else None,
    )


def error_json(text: str) -> str:
    """The content of a result chatmem gives a call that has none of its own."""
    return json.dumps({"error": text})
