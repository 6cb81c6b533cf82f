"""A chatmem reply spoken as an OpenAI Responses API (Open Responses) response.

Pure translation, no database and no HTTP. `ResponseTranslator` folds a reply's events,
in order, into the Responses API's semantic stream events and into the `response` object
they describe, so the streamed events, a later `GET /responses/{id}` and a resumed stream
always agree. The translation depends only on the event log and the stored request:
translating the log again from its first event gives the same events with the same
`sequence_number`s, which is how `starting_after` resumes a stream on any replica.

| chatmem event | Responses events |
| --- | --- |
| (the start) | `response.created`, `response.in_progress` |
| `message.delta` | once per step `output_item.added` (message), `content_part.added`; |
| | then `output_text.delta` |
| `tool_call.delta` (client tool) | once `output_item.added` (function_call); |
| | then `function_call_arguments.delta` |
| `step.started`, any ending | each open item ends: `output_text.done` + `content_part.done` |
| | (or `function_call_arguments.done`), then `output_item.done` |
| `turn.completed` | `response.completed` |
| `turn.interrupted` by the user | `response.incomplete` (reason: the stop's; `cancelled` for a cancel) |
| `turn.interrupted` (error), `turn.failed`, `error` | `error`, then `response.failed` |
| the log ends at `turn.awaiting_approval` | `response.incomplete` (reason `awaiting_approval`) |

Calls of chatmem's own tools (the server runs them) are not shown, and their results
neither; each model step with text is its own assistant message. Items cut off by a stop
end `incomplete` and keep exactly what was sent, half a JSON argument included.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, cast

from memory.events import (
    PARKED_EVENT,
    ErrorData,
    Event,
    EventName,
    MemoryRetrievedData,
    MessageDeltaData,
    StopReason,
    ToolCallDeltaData,
    TurnEndedData,
)

ResponseEvent = dict[str, Any]

# The stop reason of `POST /responses/{id}/cancel`: the response reads `cancelled`.
CANCEL_REASON = StopReason.USER


def usage_object(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """chatmem's usage (prompt/completion tokens) in the Responses API's shape."""
    if not usage:
        return None
    given = int(usage.get("prompt_tokens") or 0)
    made = int(usage.get("completion_tokens") or 0)
    return {
        "input_tokens": given,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": made,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": int(usage.get("total_tokens") or given + made),
    }


@dataclass
class _Item:
    """One output item being built: an assistant message or a client function call."""

    output_index: int
    body: dict[str, Any]
    open: bool = True


@dataclass
class ResponseTranslator:
    """Translates one reply's events, from its first, into Responses events and the response object.

    `base` holds the response object's fields that do not change (id, created_at, model,
    the echoed request). `client_tools` are the function tools the client runs.
    """

    base: dict[str, Any]
    client_tools: frozenset[str]
    output: list[dict[str, Any]] = field(default_factory=list)
    status: str = "in_progress"
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    usage: dict[str, Any] | None = None
    completed_at: int | None = None
    memories: list[dict[str, Any]] = field(default_factory=list)
    _sequence: int = 0
    _items: list[_Item] = field(default_factory=list)
    _message: dict[str, _Item] = field(default_factory=dict)  # by turn id
    _calls: dict[tuple[str, int], _Item] = field(default_factory=dict)  # by (turn id, index)
    _hidden: set[tuple[str, int]] = field(default_factory=set)  # the server's own calls
    _early: dict[tuple[str, int], str] = field(default_factory=dict)
    _parked: bool = False

    @property
    def ended(self) -> bool:
        """True once the terminal event (`response.completed|incomplete|failed`) was made."""
        return self.status not in ("in_progress", "queued")

    def response(self) -> dict[str, Any]:
        """The response object as it stands (what `GET /responses/{id}` answers)."""
        return {
            **self.base,
            "object": "response",
            "status": self.status,
            "completed_at": self.completed_at,
            "incomplete_details": self.incomplete_details,
            "error": self.error,
            "output": [dict(item) for item in self.output],
            "usage": self.usage,
        }

    def _event(self, kind: str, **fields: Any) -> ResponseEvent:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def opening(self) -> list[ResponseEvent]:
        """`response.created` and `response.in_progress`: the first two events of every stream."""
        return [
            self._event("response.created", response=self.response()),
            self._event("response.in_progress", response=self.response()),
        ]

    def feed(self, event: Event) -> list[ResponseEvent]:
        """The Responses events (possibly none) this chatmem event adds, in order."""
        _id, name, data = event
        if self.ended:
            return []
        if self._parked and name != PARKED_EVENT:
            self._parked = False  # decided and resumed: the same response goes on
        if name == EventName.MEMORY_RETRIEVED:
            items = cast(MemoryRetrievedData, data).get("items")
            self.memories = [dict(i) for i in items if isinstance(i, dict)] if isinstance(items, list) else []
        elif name == EventName.MESSAGE_DELTA:
            delta = cast(MessageDeltaData, data)
            return self._text(str(delta.get("turn_id")), str(delta.get("text") or ""))
        elif name == EventName.TOOL_CALL_DELTA:
            return self._call_delta(cast(ToolCallDeltaData, data))
        elif name == EventName.STEP_STARTED:
            return self._close_all("completed")
        elif name == PARKED_EVENT:
            self._parked = True
            return self._close_all("completed")
        elif name == EventName.TURN_COMPLETED:
            return self._end_completed(cast(TurnEndedData, data))
        elif name == EventName.TURN_INTERRUPTED and not data.get("error"):
            return self._end_stopped(cast(TurnEndedData, data))
        elif name in (EventName.TURN_INTERRUPTED, EventName.TURN_FAILED):
            ending = cast(TurnEndedData, data)
            error = ending.get("error")
            found: dict[str, Any] = dict(error) if isinstance(error, dict) else {}
            return self._end_failed(
                str(found.get("code") or "model_error"), str(found.get("message") or ""), ending
            )
        elif name == EventName.ERROR:
            failure = cast(ErrorData, data)
            return self._end_failed(
                str(failure.get("code") or "server_error"), str(failure.get("message") or ""), {}
            )
        return []

    def end_of_log(self) -> list[ResponseEvent]:
        """The ending of a log that stopped without a terminal event (parked for an approval)."""
        if self.ended:
            return []
        if self._parked:
            out = self._close_all("completed")
            self.status = "incomplete"
            self.incomplete_details = {"reason": "awaiting_approval"}
            return [*out, self._event("response.incomplete", response=self.response())]
        return self._end_failed("server_error", "the reply ended without an ending", {})

    # --- items ---------------------------------------------------------------------------

    def _open(self, body: dict[str, Any]) -> _Item:
        item = _Item(len(self.output), body)
        self.output.append(body)
        self._items.append(item)
        return item

    def _text(self, turn_id: str, text: str) -> list[ResponseEvent]:
        if not text:
            return []
        out: list[ResponseEvent] = []
        item = self._message.get(turn_id)
        if item is None or not item.open:
            item = self._open(
                {
                    "id": f"msg_{turn_id.replace('-', '')}_{len(self.output)}",
                    "type": "message",
                    "status": "in_progress",
                    "role": "assistant",
                    "content": [],
                }
            )
            self._message[turn_id] = item
            out.append(
                self._event(
                    "response.output_item.added", output_index=item.output_index, item=dict(item.body)
                )
            )
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item.body["content"].append(part)
            out.append(
                self._event(
                    "response.content_part.added",
                    item_id=item.body["id"],
                    output_index=item.output_index,
                    content_index=0,
                    part=dict(part),
                )
            )
        item.body["content"][0]["text"] += text
        out.append(
            self._event(
                "response.output_text.delta",
                item_id=item.body["id"],
                output_index=item.output_index,
                content_index=0,
                delta=text,
                logprobs=[],
            )
        )
        return out

    def _call_delta(self, data: ToolCallDeltaData) -> list[ResponseEvent]:
        key = (str(data.get("turn_id")), int(data.get("index") or 0))
        if key in self._hidden:
            return []
        arguments = str(data.get("arguments") or "")
        item = self._calls.get(key)
        if item is None:
            name = str(data.get("name") or "")
            if not name:
                # Arguments before the name: kept until the name says whose call it is.
                self._early[key] = self._early.get(key, "") + arguments
                return []
            if name not in self.client_tools:
                self._hidden.add(key)  # chatmem runs it; the client never sees it
                return []
            call_id = str(data.get("id") or "")
            item = self._open(
                {
                    "id": f"fc_{key[0].replace('-', '')}_{key[1]}",
                    "type": "function_call",
                    "status": "in_progress",
                    "call_id": call_id,
                    "name": name,
                    "arguments": "",
                }
            )
            self._calls[key] = item
            arguments = self._early.pop(key, "") + arguments
            out = [
                self._event(
                    "response.output_item.added", output_index=item.output_index, item=dict(item.body)
                )
            ]
        else:
            out = []
        if arguments:
            item.body["arguments"] += arguments
            out.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item.body["id"],
                    output_index=item.output_index,
                    delta=arguments,
                )
            )
        return out

    def _close_all(self, status: str) -> list[ResponseEvent]:
        out: list[ResponseEvent] = []
        for item in self._items:
            if item.open:
                out += self._close(item, status)
        self._items = [item for item in self._items if item.open]
        return out

    def _close(self, item: _Item, status: str) -> list[ResponseEvent]:
        item.open = False
        body = item.body
        body["status"] = status
        out: list[ResponseEvent] = []
        if body["type"] == "message":
            part = body["content"][0]
            out.append(
                self._event(
                    "response.output_text.done",
                    item_id=body["id"],
                    output_index=item.output_index,
                    content_index=0,
                    text=part["text"],
                    logprobs=[],
                )
            )
            out.append(
                self._event(
                    "response.content_part.done",
                    item_id=body["id"],
                    output_index=item.output_index,
                    content_index=0,
                    part=dict(part),
                )
            )
        else:
            out.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=body["id"],
                    output_index=item.output_index,
                    arguments=body["arguments"],
                )
            )
        out.append(self._event("response.output_item.done", output_index=item.output_index, item=_copy(body)))
        return out

    # --- endings -------------------------------------------------------------------------

    def _finish(self, status: str, data: TurnEndedData | dict[str, Any]) -> None:
        self.status = status
        usage = data.get("usage")
        self.usage = usage_object(dict(usage) if isinstance(usage, dict) else None) or self.usage
        self.completed_at = self.completed_at or int(time.time())

    def _end_completed(self, data: TurnEndedData) -> list[ResponseEvent]:
        out = self._close_all("completed")
        self._finish("completed", data)
        return [*out, self._event("response.completed", response=self.response())]

    def _end_stopped(self, data: TurnEndedData) -> list[ResponseEvent]:
        out = self._close_all("incomplete")
        reason = str(data.get("reason") or "interrupted")
        if reason == CANCEL_REASON:
            self._finish("cancelled", data)
        else:
            self._finish("incomplete", data)
            self.incomplete_details = {"reason": reason}
        return [*out, self._event("response.incomplete", response=self.response())]

    def _end_failed(
        self, code: str, message: str, data: TurnEndedData | dict[str, Any]
    ) -> list[ResponseEvent]:
        out = self._close_all("incomplete")
        message = message or "the model failed"
        self.error = {"code": code, "message": message}
        self._finish("failed", data)
        error = self._event(
            "error", error={"type": "server_error", "code": code, "message": message, "param": None}
        )
        return [*out, error, self._event("response.failed", response=self.response())]


def _copy(body: dict[str, Any]) -> dict[str, Any]:
    out = dict(body)
    if "content" in out:
        out["content"] = [dict(part) for part in out["content"]]
    return out
