"""Domain errors. `chat_api/errors.py` maps each to one HTTP status, in one place."""

from __future__ import annotations

from typing import Any


class DomainError(Exception):
    """Base: `code` is machine-readable and stable."""

    code = "error"

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details


class NotFound(DomainError):
    """The thing does not exist, was deleted, or belongs to someone else (indistinguishable)."""

    code = "not_found"


class InvalidInput(DomainError):
    """The request is well-formed JSON but its content is not acceptable."""

    code = "invalid_input"


class ContextLengthExceeded(InvalidInput):
    """The new message, with what every prompt spends before it, does not fit the prompt's room
    (OpenAI's own code for a prompt over the model's context)."""

    code = "context_length_exceeded"


class Conflict(DomainError):
    """The request conflicts with the current state (e.g. a reply is already streaming)."""

    code = "conflict"


class ConversationBusy(Conflict):
    """A reply is already streaming in this conversation."""

    code = "conversation_busy"


class NotAwaitingApproval(Conflict):
    """The tool call was already decided, or its turn is no longer waiting for a person."""

    code = "tool_call_not_awaiting_approval"


class TurnNotFinished(Conflict):
    """The turn is still streaming or waiting for a tool approval."""

    code = "turn_not_finished"


class NotOnActiveBranch(Conflict):
    """The turn is not part of the conversation's active branch."""

    code = "turn_not_on_active_branch"


class NotLastReply(Conflict):
    """Only the last reply of the active branch can be regenerated."""

    code = "not_last_reply"
