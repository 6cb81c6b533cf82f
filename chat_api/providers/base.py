"""What a chat model provider streams, and the errors it raises.

A provider turns a list of OpenAI-format messages (and tool schemas) into an async
stream of small deltas. The runner owns everything else: persistence, stop, tools.
Closing the stream (``aclose``) must close the upstream connection, so a stopped
reply stops costing tokens.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class TextDelta:
    """A piece of visible assistant text."""

    text: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of a tool call: id and name arrive first, arguments in fragments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True, slots=True)
class StreamEnd:
    """The model finished this step."""

    finish_reason: str | None = None
    usage: dict[str, int] = field(default_factory=dict)


Delta = TextDelta | ToolCallDelta | StreamEnd


@dataclass(frozen=True, slots=True)
class ModelOptions:
    """What a client asked of the model for one reply (OpenAI `tool_choice`, sampling, length).

    `tool_choice` is "auto", "none", "required" or `{"type": "function", "name": ...}`;
    None everywhere means the provider's defaults.
    """

    tool_choice: str | dict[str, Any] | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None


def public_message(status: int | None) -> str:
    """What a user is told when the model failed with this HTTP status (None: no answer at all)."""
    if status is None:
        return "the model did not answer (unreachable or too slow); try again"
    if status == 429:
        return "the model is over its rate limit; try again shortly"
    if status in (401, 403):
        return "the model endpoint refused chatmem's credentials; an operator must check them"
    if 400 <= status < 500:
        return "the model endpoint refused the request"
    return "the model failed; try again"


class ProviderError(Exception):
    """The model failed; ``retryable`` says whether a retry before the first token may help.

    The message is the provider's own account, for operators (the server log): it can
    carry a masked operator key, organisation and project ids. Users see ``public``, a
    fixed sentence chosen by the status, with the code ``provider_error``.
    """

    def __init__(
        self, message: str, *, retryable: bool = False, status: int | None = None, public: str | None = None
    ) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.status = status
        self.public = public or public_message(status)


class ChatProvider(Protocol):
    """Streams one model step."""

    name: str
    model: str

    def stream(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        options: ModelOptions | None = None,
    ) -> AsyncGenerator[Delta, None]:
        """Stream the model's reply to ``messages`` as deltas, ending with one StreamEnd."""
        ...

    async def complete(
        self, messages: Sequence[dict[str, Any]], *, model: str | None = None, timeout: float | None = None
    ) -> str:
        """Return a short non-streamed completion (used by the query rewriter)."""
        ...

    async def aclose(self) -> None:
        """Release connections."""
        ...
