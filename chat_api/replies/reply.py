"""A reply in flight: its event log, its partial content, and the stop signal.

Events are appended here by the runner, and every follower (the POST's SSE stream, a
resuming GET, the stop endpoint) reads the same list from its own position, so a
stream can be resumed with no gap and no duplicate. The checkpointer persists the
list in chunks; followers on another process read those chunks instead.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator
from dataclasses import asdict, dataclass, fields
from typing import Any, cast

from chat_api.providers.base import ModelOptions
from memory.events import (
    Event,
    EventData,
    EventName,
    MessageDeltaData,
    StopReason,
    ToolCallDeltaData,
    ToolCallState,
)
from memory.json_values import JsonObject
from memory.prompt.context import StoredWindow
from memory.recall.found import FoundMemory
from memory.recall.stored import NothingStored
from memory.record.conversations import Owner
from memory.record.tool_calls import ToolCall

# The key of a parked turn's metadata that keeps what the client asked of the model.
ASKED_OF_MODEL = "asked_of_model"


@dataclass(frozen=True)
class ReplyRequest:
    """What the user asked for, as the runner needs it."""

    user_text: str
    memory_scope: str = "user"


class Reply:
    """The live state of one reply (model → tools → model), owned by this process's runner."""

    def __init__(
        self, reply_id: uuid.UUID, owner: Owner, conversation_id: uuid.UUID, user_turn_id: uuid.UUID
    ) -> None:
        self.id = reply_id
        self.owner = owner
        self.conversation_id = conversation_id
        self.user_turn_id = user_turn_id
        self.turn_id = reply_id  # the assistant turn streaming now
        self.events: list[Event] = []
        self.persisted = 0  # events[:persisted] are in turn_events, or claimed by a write under way
        # Clear while a checkpoint write of this reply's events is under way. The ending waits
        # for it, so that the ending is the reply's last write: a checkpoint that committed
        # after it could outlive a deletion that came after the ending (the user's erasure).
        self.checkpoint_idle = asyncio.Event()
        self.checkpoint_idle.set()
        self.chars_since_checkpoint = 0
        self.content_parts: list[str] = []
        self.tool_calls: list[ToolCall] = []
        self.usage: dict[str, int] = {}
        self.memories: list[FoundMemory] = []  # recalled once per reply, shown to every step
        # A conversation's first reply: the user's statements its part begins with (memory.recall.standing).
        self.standing: list[FoundMemory] = []
        # The window's rows, read by the transaction that stored the reply's turns; taken by its
        # first prompt (None: that prompt reads them itself, as a resumed reply's does).
        self.stored_window: StoredWindow | None = None
        self.rewritten_query: str | None = None  # what recall searched; stored with the first step
        # The user had nothing to recall when the reply was accepted: its recall searches nothing.
        self.nothing_stored: NothingStored | None = None
        # Whether the reply is made with memory: on (recall ran, even if it found nothing), off
        # (the user turned it off), unavailable (recall failed or timed out). Not remembered unless on.
        self.memory_use = "on"
        # What the model's last prompt showed of the user's side (their messages, with the
        # memories and time before their words): a reply that only repeats it is not remembered.
        self.shown_to_model = ""
        self.stop_requested = asyncio.Event()
        self.stop_reason: StopReason | None = None
        self.finished = asyncio.Event()
        self.started_at = 0.0  # monotonic, set when the runner launches it (for metrics)
        self.final_status: str | None = None  # how it ended, once it has
        self.request = ReplyRequest(user_text="")  # set by the runner; kept for parking and resuming
        # Tools the client runs itself (OpenAI `tools`), offered beside the server's; a step
        # that calls one ends the reply, and the client sends the results in its next request.
        self.client_tools: tuple[dict[str, Any], ...] = ()
        # What the client asked of the model (tool_choice, sampling) and its own instructions,
        # added to the system prompt of this reply only.
        self.model_options: ModelOptions | None = None
        self.instructions: str | None = None
        # Stored on a completed turn that still has something to report (code and message).
        self.ending_error: dict[str, str] | None = None
        self._wake = asyncio.Event()

    def asked_of_model(self) -> JsonObject:
        """What the client asked of the model (tools, options, instructions), as a parked turn
        stores it: the reply that resumes after the decision must be made the same way."""
        asked: JsonObject = {}
        if self.client_tools:
            asked["tools"] = list(self.client_tools)
        if self.model_options is not None:
            asked["options"] = cast(JsonObject, asdict(self.model_options))
        if self.instructions:
            asked["instructions"] = self.instructions
        return asked

    def restore_asked_of_model(self, asked: Any) -> None:
        """Take back what `asked_of_model` stored (nothing, for a turn parked before it was stored)."""
        if not isinstance(asked, dict):
            return
        self.client_tools = tuple(asked.get("tools") or ())
        options = asked.get("options")
        if isinstance(options, dict):
            known = {field.name for field in fields(ModelOptions)}
            self.model_options = ModelOptions(**{k: v for k, v in options.items() if k in known})
        self.instructions = asked.get("instructions") or None

    def restore(
        self, events: list[Event], turn_id: uuid.UUID, content: str, tool_calls: list[ToolCall]
    ) -> None:
        """Continue a parked reply: its stored events (ids go on from them) and its last turn."""
        if [event[0] for event in events] != list(range(1, len(events) + 1)):
            raise ValueError(f"reply {self.id} has a gap in its stored events")
        self.events = list(events)
        self.persisted = len(events)
        self.turn_id = turn_id
        self.content_parts = [content] if content else []
        self.tool_calls = [ToolCall(**call) for call in tool_calls]

    # --- what the model produced -----------------------------------------------------

    @property
    def content(self) -> str:
        return "".join(self.content_parts)

    def begin_step(self, turn_id: uuid.UUID) -> None:
        """The next model step streams into a new assistant turn."""
        self.turn_id = turn_id
        self.content_parts = []
        self.tool_calls = []
        self.usage = {}

    def add_text(self, text: str) -> None:
        self.content_parts.append(text)
        self.chars_since_checkpoint += len(text)
        self.publish(EventName.MESSAGE_DELTA, MessageDeltaData(turn_id=str(self.turn_id), text=text))

    def add_tool_delta(self, index: int, call_id: str | None, name: str | None, arguments: str) -> None:
        call = next((c for c in self.tool_calls if c["index"] == index), None)
        if call is None:
            call = ToolCall(
                index=index,
                id=call_id or f"call_{self.turn_id.hex[:8]}_{index}",
                name=name or "",
                arguments="",
                state=ToolCallState.STREAMING,
            )
            self.tool_calls.append(call)
        if call_id:
            call["id"] = call_id
        if name:
            call["name"] = name
        call["arguments"] += arguments
        self.chars_since_checkpoint += len(arguments)
        self.publish(
            EventName.TOOL_CALL_DELTA,
            ToolCallDeltaData(
                turn_id=str(self.turn_id), index=index, id=call["id"], name=call["name"], arguments=arguments
            ),
        )

    # --- events ---------------------------------------------------------------------

    def publish(self, name: EventName, data: EventData) -> Event:
        """Append an event and wake every follower."""
        event = Event(len(self.events) + 1, name, cast(JsonObject, data))
        self.events.append(event)
        self._wake.set()
        self._wake = asyncio.Event()
        return event

    def finish(self, status: str) -> None:
        """Mark the reply over; followers drain the log and end."""
        self.final_status = status
        self.finished.set()
        self._wake.set()

    async def follow(self, after: int = 0) -> AsyncGenerator[Event, None]:
        """Every event with id > after, then each new one until the reply is over."""
        position = max(after, 0)
        while True:
            wake = self._wake
            while position < len(self.events):
                yield self.events[position]
                position += 1
            if self.finished.is_set():
                return
            await wake.wait()

    # --- stop -----------------------------------------------------------------------

    def request_stop(self, reason: StopReason) -> None:
        """Ask the runner to stop; the first reason wins."""
        if not self.stop_requested.is_set():
            self.stop_reason = reason
            self.stop_requested.set()
