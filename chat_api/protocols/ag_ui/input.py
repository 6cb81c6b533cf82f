"""What an AG-UI `RunAgentInput` asks of chatmem, read and bounded before anything is stored.

The stored history is the truth: of `messages` only the last one is read (a user message,
or the results of client tool calls), with the id of the message before it (where the
client's history ends, which tells a continuation from an edit). `resume` answers the
interrupts of a parked reply; cancelling them all beside a new user message sends that
message instead (assistant-ui's "steer away"). `tools` are the client's tools, offered to the model as
OpenAI function tools. The app's `system` and `developer` messages and its `context` entries
(CopilotKit's instructions and readables) are this run's instructions: shown after chatmem's own
system prompt, for this run only, never stored as turns. `state` is accepted and not used
(chatmem keeps no agent state). `forwardedProps` carries chatmem's options.

Every refusal here is an `InvalidInput` (422 with chatmem's error body), raised before any
stream starts.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from ag_ui import core
from ag_ui.core import DeveloperMessage, Message, SystemMessage, ToolMessage, UserMessage
from pydantic import SkipValidation

from chat_api.admission import check_text, check_tools
from chat_api.admission.prompt_room import longest_field
from chat_api.protocols.ag_ui.run import speaks_1_0
from chat_api.protocols.approvals import parse_approval_id
from memory.errors import InvalidInput
from memory.json_bounds import check_json
from memory.record.ai_sdk_chats import CHAT_ID

MAX_ID_CHARS = 200
MAX_TOOLS = 128
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# Free-form JSON the client sends beside its messages (tool schemas, state, forwardedProps).
MAX_FREE_JSON_BYTES = 200_000

OnBusy = Literal["reject", "interrupt", "enqueue"]


@dataclass(frozen=True)
class Answer:
    """One resume entry: the decision on one waiting tool call."""

    interrupt_id: str
    turn_id: Any  # uuid.UUID
    call_id: str
    cancelled: bool  # status "cancelled": the person abandoned the question (a refusal)
    approved: bool
    reason: str | None
    arguments: str | None  # edited arguments (a JSON object), approvals only


@dataclass(frozen=True)
class ToolResult:
    """A client tool's result: the client's message id, the call it answers and its content."""

    message_id: str
    tool_call_id: str
    content: str


@dataclass(frozen=True)
class RunRequest:
    """A validated run input, reduced to what chatmem acts on."""

    thread_id: str
    run_id: str
    modern: bool  # declared protocol 1.0 or later
    user_message: tuple[str, str] | None  # (client's id, text) when the last message is the user's
    previous_id: str | None  # the id of the message before it, if any
    tool_results: tuple[ToolResult, ...]
    answers: tuple[Answer, ...]
    tools: tuple[dict[str, Any], ...]  # OpenAI function tools
    on_disconnect: Literal["continue", "stop"]
    on_busy: OnBusy | None
    memory_scope: Literal["user", "conversation", "none"] | None
    instructions: str | None = None  # the app's system messages and context, for this run
    instructions_field: str = "messages"  # the input's name of (the longest part of) them


class RunAgentInput(core.RunAgentInput):
    # AG-UI's, its lists validated by `chat_api.admission.checked` (LISTS), slice by slice, off the
    # event loop (of a whole history, only the last messages are read; at the body's value cap,
    # `context` or `tools` held the loop ~100 ms in one call). Its name, doc and schema are AG-UI's.
    __doc__ = core.RunAgentInput.__doc__

    messages: SkipValidation[list[Message]]
    tools: SkipValidation[list[core.Tool] | None] = None
    context: SkipValidation[list[core.Context] | None] = None
    resume: SkipValidation[list[core.ResumeEntry] | None] = None


# The lists of a RunAgentInput, in the order a refusal names the first of them.
LISTS = ("messages", "tools", "context", "resume")


def check_ids(thread_id: str, run_id: str) -> None:
    """InvalidInput unless the thread id is a chat id and the run id a short printable string."""
    if not CHAT_ID.fullmatch(thread_id):
        raise InvalidInput(
            "threadId must be 1-128 characters of A-Z, a-z, 0-9, _ and -",
            field="threadId",
            value=thread_id[:200],
        )
    if not run_id or len(run_id) > MAX_ID_CHARS or not run_id.isprintable():
        raise InvalidInput(f"runId must be 1-{MAX_ID_CHARS} printable characters", field="runId")


def read_run(body: RunAgentInput, *, max_message_chars: int) -> RunRequest:
    """What this input asks (see the module doc); InvalidInput says what is wrong."""
    check_ids(body.thread_id, body.run_id)
    parts = _instruction_parts(body)
    for field, value in (("state", body.state), ("forwardedProps", body.forwarded_props)):
        if value is not None:
            check_json(value, field=field, max_bytes=MAX_FREE_JSON_BYTES)
    options = body.forwarded_props if isinstance(body.forwarded_props, dict) else {}
    tools = _tools(body)
    answers = tuple(_answer(i, entry) for i, entry in enumerate(body.resume or []))
    user_message: tuple[str, str] | None = None
    previous_id: str | None = None
    results: tuple[ToolResult, ...] = ()
    if not answers and not body.messages:
        raise InvalidInput("messages is empty: there is nothing to answer", field="messages")
    if body.messages and (not answers or isinstance(body.messages[-1], UserMessage)):
        # With `resume`, a last user message is the one sent instead of answering (steer away).
        last = body.messages[-1]
        _check_message_id(last, len(body.messages) - 1)
        if isinstance(last, UserMessage):
            text = _text(last, len(body.messages) - 1)
            check_text(text, field=f"messages[{len(body.messages) - 1}].content", max_chars=max_message_chars)
            user_message = (last.id, text)
            if len(body.messages) > 1:
                previous_id = body.messages[-2].id
        elif isinstance(last, ToolMessage):
            results = _tool_results(body.messages, max_message_chars)
        else:
            raise InvalidInput(
                f"the last message must be the user's or a tool result (got role {last.role!r})",
                field=f"messages[{len(body.messages) - 1}].role",
            )
    return RunRequest(
        thread_id=body.thread_id,
        run_id=body.run_id,
        modern=speaks_1_0(body.protocol_version),
        user_message=user_message,
        previous_id=previous_id,
        tool_results=results,
        answers=answers,
        tools=tools,
        on_disconnect=_option(options, "on_disconnect", ("continue", "stop")) or "continue",
        on_busy=_option(options, "on_busy", ("reject", "interrupt", "enqueue")),
        memory_scope=_option(options, "memory_scope", ("user", "conversation", "none")),
        instructions=_instructions(body, parts, max_message_chars),
        instructions_field=longest_field(parts, "messages"),
    )


def _instruction_parts(body: RunAgentInput) -> list[tuple[str, str]]:
    """The (field, text) of the app's system and developer messages, then of its context entries."""
    said = [
        (f"messages[{i}].content", m.content.strip())
        for i, m in enumerate(body.messages)
        if isinstance(m, SystemMessage | DeveloperMessage) and isinstance(m.content, str)
    ]
    parts = [(field, text) for field, text in said if text]
    context = [(f"context[{i}]", f"{c.description}: {c.value}") for i, c in enumerate(body.context or ())]
    return parts + context


def _instructions(body: RunAgentInput, parts: list[tuple[str, str]], max_chars: int) -> str | None:
    """The app's system and developer messages, then its context entries (`description: value`)."""
    if not parts:
        return None
    instructions = "\n\n".join(text for _, text in parts)
    check_text(instructions, field="context" if body.context else "messages", max_chars=max_chars)
    return instructions


def _option(options: dict[str, Any], name: str, allowed: tuple[str, ...]) -> Any:
    value = options.get(name)
    if value is None:
        return None
    if value not in allowed:
        raise InvalidInput(
            f"forwardedProps.{name} must be one of {', '.join(allowed)}", field=f"forwardedProps.{name}"
        )
    return value


def _check_message_id(message: Message, index: int) -> None:
    if not message.id or len(message.id) > MAX_ID_CHARS or not message.id.isprintable():
        raise InvalidInput(
            f"messages[{index}].id must be 1-{MAX_ID_CHARS} printable characters",
            field=f"messages[{index}].id",
        )


def _text(message: UserMessage | ToolMessage, index: int) -> str:
    content = message.content
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if getattr(part, "type", None) != "text":
            raise InvalidInput(
                f"messages[{index}]: only text content is supported (got {getattr(part, 'type', '?')!r})",
                field=f"messages[{index}].content",
            )
        texts.append(str(part.text))  # type: ignore[union-attr]
    return "".join(texts)


def _tool_results(messages: list[Message], max_chars: int) -> tuple[ToolResult, ...]:
    """The trailing tool messages: the results of the client's calls."""
    start = len(messages)
    while start > 0 and isinstance(messages[start - 1], ToolMessage):
        start -= 1
    results = []
    for index in range(start, len(messages)):
        message = messages[index]
        assert isinstance(message, ToolMessage)
        _check_message_id(message, index)
        text = _text(message, index)
        check_text(text, field=f"messages[{index}].content", allow_empty=True, max_chars=max_chars)
        check_text(message.tool_call_id, field=f"messages[{index}].toolCallId", max_chars=MAX_ID_CHARS)
        results.append(ToolResult(message.id, message.tool_call_id, text))
    return tuple(results)


def _tools(body: RunAgentInput) -> tuple[dict[str, Any], ...]:
    tools = body.tools or []
    if len(tools) > MAX_TOOLS:
        raise InvalidInput(f"at most {MAX_TOOLS} tools", field="tools")
    out = []
    for index, tool in enumerate(tools):
        if not TOOL_NAME.fullmatch(tool.name):
            raise InvalidInput(
                "a tool name is 1-64 characters of A-Z, a-z, 0-9, _ and -", field=f"tools[{index}].name"
            )
        parameters = tool.parameters if tool.parameters is not None else {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise InvalidInput(
                "tool parameters must be a JSON schema object", field=f"tools[{index}].parameters"
            )
        function = {"name": tool.name, "description": tool.description, "parameters": parameters}
        out.append({"type": "function", "function": function})
    check_tools(out)
    return tuple(out)


def _answer(index: int, entry: Any) -> Answer:
    field = f"resume[{index}]"
    parsed = parse_approval_id(entry.interrupt_id)
    if parsed is None:
        raise InvalidInput(
            "unknown interrupt id", field=f"{field}.interruptId", interrupt_id=entry.interrupt_id[:200]
        )
    turn_id, call_id = parsed
    if entry.status == "cancelled":
        return Answer(
            entry.interrupt_id, turn_id, call_id, True, False, "the user cancelled this tool call", None
        )
    payload = entry.payload
    if not isinstance(payload, dict) or not isinstance(payload.get("approved"), bool):
        raise InvalidInput(
            "a resolved tool-call interrupt needs payload {approved: true|false}", field=f"{field}.payload"
        )
    reason = payload.get("reason")
    if reason is not None:
        if not isinstance(reason, str):
            raise InvalidInput("payload.reason must be a string", field=f"{field}.payload.reason")
        check_text(reason, field=f"{field}.payload.reason", allow_empty=True, max_chars=2000)
    arguments = None
    edited = payload.get("editedArgs")
    if edited is not None:
        if not payload["approved"] or not isinstance(edited, dict):
            raise InvalidInput(
                "payload.editedArgs is an object, and only with approved: true",
                field=f"{field}.payload.editedArgs",
            )
        check_json(edited, field=f"{field}.payload.editedArgs", max_bytes=MAX_FREE_JSON_BYTES)
        arguments = json.dumps(edited, ensure_ascii=False)
    return Answer(entry.interrupt_id, turn_id, call_id, False, payload["approved"], reason, arguments)
