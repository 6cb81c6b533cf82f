"""Request and response bodies. Requests forbid unknown fields."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Any, Literal, Self

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from memory.json_bounds import json_problem, readable_json
from memory.storage.models import Conversation, Turn

MemoryMode = Literal["persistent", "none"]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# Free-form JSON in a request body: bounded in depth and size at the door (memory.json_bounds).
MAX_FREE_JSON_BYTES = 65_536


def _within_bounds(value: dict[str, Any]) -> dict[str, Any]:
    problem = json_problem(value, max_bytes=MAX_FREE_JSON_BYTES)
    if problem is not None:
        raise ValueError(f"the value {problem}")
    return value


BoundedJsonObject = Annotated[dict[str, Any], AfterValidator(_within_bounds)]


class _ConversationSwitches(Strict):
    """The two memory switches of a conversation: remembered (write) and using memory (read)."""

    remember: bool | None = Field(
        None,
        description="Remember this chat: what is said here reaches long-term memory. "
        "The same switch as `memory_mode` (true = persistent, false = none), under its plain name.",
    )
    memory_mode: MemoryMode | None = Field(
        None, description="Remember this chat (persistent) or not (none); `remember` is the same switch."
    )
    use_memory: bool | None = Field(
        None, description="Use memory in this chat: its replies recall long-term memory."
    )

    @model_validator(mode="after")
    def _one_answer_for_remember(self) -> Self:
        if self.remember is not None and self.memory_mode is not None:
            if self.memory_mode != _memory_mode(self.remember):
                raise ValueError("remember and memory_mode disagree: send one of them")
        return self

    def remembered_mode(self) -> MemoryMode | None:
        """`memory_mode` as sent directly or through `remember`; None when neither was sent."""
        if self.remember is not None:
            return _memory_mode(self.remember)
        return self.memory_mode


def _memory_mode(remember: bool) -> MemoryMode:
    return "persistent" if remember else "none"


class ConversationCreate(_ConversationSwitches):
    title: str = Field("", max_length=500)


class ConversationUpdate(_ConversationSwitches):
    title: str | None = Field(None, max_length=500)


class ConversationOut(BaseModel):
    id: uuid.UUID
    title: str
    remember: bool = Field(description="Remember this chat (write); `memory_mode` says the same.")
    memory_mode: str
    use_memory: bool = Field(description="Use memory in this chat (read).")
    created_at: datetime
    updated_at: datetime
    turn_count: int = Field(description="Turns stored so far (the last sequence number).")
    indexed_seq: int = Field(description="Turns up to this sequence number are in long-term memory.")
    active_reply_id: uuid.UUID | None
    active_branch_id: uuid.UUID = Field(description="The branch new messages go to (see …/branches).")

    @classmethod
    def of(cls, c: Conversation) -> ConversationOut:
        return cls(
            id=c.id,
            title=c.title,
            remember=c.memory_mode != "none",
            memory_mode=c.memory_mode,
            use_memory=c.use_memory,
            created_at=c.created_at,
            updated_at=c.updated_at,
            turn_count=c.next_seq - 1,
            indexed_seq=c.indexed_seq,
            active_reply_id=c.active_reply_id,
            active_branch_id=c.active_branch_id,
        )


class ConversationPage(BaseModel):
    items: list[ConversationOut]
    next_cursor: str | None


class ReplyOptions(Strict):
    """How a reply is started and delivered (a message, a regenerate, an edit)."""

    stream: bool = Field(True, description="Stream the reply as SSE (true) or return the finished turns.")
    on_busy: Literal["reject", "interrupt", "enqueue"] | None = Field(
        None, description="While a reply streams: 409, stop it, or wait for it. Default: ON_BUSY_DEFAULT."
    )
    on_disconnect: Literal["continue", "stop"] = Field(
        "continue", description="When the client goes away: keep generating (default) or stop."
    )
    memory_scope: Literal["user", "conversation", "none"] | None = Field(
        None, description="Where long-term memory is searched. Default: MEMORY_SCOPE."
    )


class MessageCreate(ReplyOptions):
    content: str = Field(description="The user's message.")


class RegenerateIn(ReplyOptions):
    conversation_id: uuid.UUID | None = Field(
        None, description="The conversation to branch (a fork sharing the turn). Default: the turn's own."
    )


class EditIn(RegenerateIn):
    content: str = Field(description="The new text of the user message.")


class ForkIn(Strict):
    turn_id: uuid.UUID = Field(description="The fork's history is the conversation's up to this turn.")
    title: str | None = Field(None, max_length=500, description="Default: the original's title.")


class BranchOut(BaseModel):
    id: uuid.UUID
    active: bool
    parent_branch_id: uuid.UUID | None = Field(description="Null for a conversation's first branch.")
    fork_seq: int = Field(description="Its history starts with the parent's turns up to this seq.")
    own_turns: int = Field(description="Turns stored on this branch itself.")
    head_turn_id: uuid.UUID | None = Field(description="The newest turn of the branch's history.")
    head_seq: int | None
    head_role: str | None
    head_status: str | None
    created_at: datetime


class BranchList(BaseModel):
    active_branch_id: uuid.UUID
    items: list[BranchOut]


class TurnOut(BaseModel):
    id: uuid.UUID
    conversation_id: uuid.UUID
    seq: int
    role: str
    status: str
    content: str
    tool_calls: list[dict[str, Any]]
    tool_call_id: str | None
    name: str | None
    reply_id: uuid.UUID | None
    model: str | None
    usage: dict[str, Any] | None
    error: dict[str, Any] | None
    interrupt_reason: str | None
    rewritten_query: str | None
    prompt_version: str | None
    external_id: str | None
    metadata: dict[str, Any] | None
    created_at: datetime
    completed_at: datetime | None

    @classmethod
    def of(cls, t: Turn) -> TurnOut:
        return cls(
            id=t.id,
            conversation_id=t.conversation_id,
            seq=t.seq,
            role=t.role,
            status=t.status,
            content=t.content,
            tool_calls=readable_json(t.tool_calls, what="tool_calls") or [],
            tool_call_id=t.tool_call_id,
            name=t.name,
            reply_id=t.reply_id,
            model=t.model,
            usage=readable_json(t.usage, what="usage"),
            error=readable_json(t.error, what="error"),
            interrupt_reason=t.interrupt_reason,
            rewritten_query=t.rewritten_query,
            prompt_version=t.prompt_version,
            external_id=t.external_id,
            metadata=readable_json(t.meta, what="metadata"),
            created_at=t.created_at,
            completed_at=t.completed_at,
        )


class TurnList(BaseModel):
    items: list[TurnOut]
    next_cursor: str | None


class ReplyOut(BaseModel):
    """A finished reply (non-streaming mode)."""

    status: str
    user_turn: TurnOut
    turns: list[TurnOut]


class StopOut(BaseModel):
    status: str = Field(description="The reply's status after the stop (terminal unless still settling).")
    turn: TurnOut


class ApproveIn(Strict):
    arguments: BoundedJsonObject | None = Field(
        None, description="Run the tool with these arguments instead of the model's (a JSON object)."
    )
    stream: bool = Field(True, description="Stream the resumed reply as SSE (true) or return it finished.")


class RejectIn(Strict):
    reason: str = Field("", max_length=2000, description="Given to the model as the tool's result.")
    stream: bool = Field(True, description="Stream the resumed reply as SSE (true) or return it finished.")


class DecisionOut(BaseModel):
    """A decision taken, when the reply is not streamed back."""

    status: str = Field(description="The reply's status now: awaiting_approval while other calls wait.")
    resumed: bool = Field(description="True when this was the last decision and the reply went on.")
    turns: list[TurnOut] = Field(description="The reply's assistant and tool turns.")


class ContextOut(BaseModel):
    messages: list[dict[str, Any]]
    prompt_version: str
    token_count: int
    window_turn_ids: list[uuid.UUID]
    dropped: dict[str, Any]


class ErrorBody(BaseModel):
    code: str
    message: str
    details: dict[str, Any] | None = None


class ErrorOut(BaseModel):
    error: ErrorBody
