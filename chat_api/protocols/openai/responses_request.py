"""OpenAI Responses API (Open Responses) requests, read into what chatmem needs.

Pure: no database, no HTTP framework. `parse_request` validates a `POST /responses` body
and turns its `input` (a string, or typed items: `message`, `function_call`,
`function_call_output`) into the same `ChatRequest` the chat-completions adapter maps
onto conversations, so both doors share one mapping: history, the new user message (or
tool results), the client's function tools. What only the Responses API has (its options,
echoed back on every read; the input items, listed by `/input_items`; the attachments of
the new message) rides beside it in `ResponsesRequest`.

- `system` and `developer` messages of the input join `instructions`: chatmem puts them
  in the system prompt of this response only (not carried over by `previous_response_id`,
  as the API says).
- `input_image` and `input_file` parts of the new user message are kept as attachments
  (stored with the turn, passed to the model); in earlier messages only their text counts.
- `reasoning` items sent back by a client are accepted and skipped (chatmem's models
  produce none); anything else unknown is a 400 naming the item.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError

from chat_api.admission.prompt_room import longest_field
from chat_api.protocols.openai.chat import (
    MAX_TOOLS,
    STRICT,
    ChatRequest,
    ClientMessage,
    OpenAIError,
    Served,
    bad_request,
    check_metadata,
    check_output_tokens,
    check_served,
    validated,
)
from chat_api.protocols.openai.responses_input import (
    compaction_point,
    input_items,
    input_messages,
    listed_item,
)
from chat_api.providers.base import ModelOptions

RESPONSE_PREFIX = "resp_"
CONVERSATION_PREFIX = "conv_"


def response_ref(reply_id: uuid.UUID) -> str:
    """The Responses API id of a chatmem reply."""
    return f"{RESPONSE_PREFIX}{reply_id.hex}"


def parse_response_id(value: str) -> uuid.UUID | None:
    """The reply id named by `resp_<hex>` (or a bare uuid); None if it names none."""
    raw = value.removeprefix(RESPONSE_PREFIX)
    try:
        return uuid.UUID(raw)
    except ValueError:
        return None


def conversation_ref(conversation_id: uuid.UUID) -> str:
    """The Responses API id of a chatmem conversation."""
    return f"{CONVERSATION_PREFIX}{conversation_id.hex}"


def parse_conversation_ref(value: str) -> uuid.UUID | None:
    """The conversation named by `conv_<hex>` (or a bare uuid); None if it names none."""
    try:
        return uuid.UUID(value.removeprefix(CONVERSATION_PREFIX))
    except ValueError:
        return None


# --- the body ---------------------------------------------------------------------------


class _FunctionTool(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class _NamedChoice(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    name: str


class _Conversation(BaseModel):
    model_config = STRICT

    id: str


class _Format(BaseModel):
    model_config = STRICT

    type: str
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class _Text(BaseModel):
    model_config = STRICT

    format: _Format | None = None
    verbosity: str | None = None


class _Reasoning(BaseModel):
    model_config = STRICT

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class _StreamOptions(BaseModel):
    model_config = STRICT

    include_obfuscation: bool | None = None


class _Body(BaseModel):
    # Options chatmem does not act on (include, text, reasoning, service_tier, …) are accepted and
    # echoed where a response repeats them, but held to their JSON types as the API holds them: a
    # wrong one is the 400 `invalid_type` naming it, not a value echoed back. Their values are not
    # (the API adds effort levels and verbosities; a server that ignores them need not know them).
    model_config = STRICT

    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | _NamedChoice | None = None
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    conversation: str | _Conversation | None = None
    metadata: dict[str, str] | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    max_output_tokens: int | None = Field(None, ge=16)  # at most MAX_OUTPUT_TOKENS (`parse_request`)
    max_tool_calls: int | None = Field(None, ge=1)
    parallel_tool_calls: bool = True
    truncation: Literal["auto", "disabled"] = "disabled"
    text: _Text | None = None
    reasoning: _Reasoning | None = None
    include: list[str] | None = None
    stream_options: _StreamOptions | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    """A validated `POST /responses`: the chat it adds to, and what the Responses API echoes."""

    chat: ChatRequest  # its `instructions` and `options` too
    store: bool
    background: bool
    previous_response_id: uuid.UUID | None
    conversation_id: uuid.UUID | None
    attachments: tuple[dict[str, Any], ...]
    # As stored: JSON text, encoded with the request in its worker thread (megabytes of history).
    input_items_json: str
    compacted: uuid.UUID | None = None  # a leading compaction item: continue after this turn
    echo: dict[str, Any] = field(default_factory=dict)  # the request fields a response object repeats


def _previous_response(value: str | None) -> uuid.UUID | None:
    """The reply a `previous_response_id` names; 404 in OpenAI's words when it names none."""
    if value is None:
        return None
    previous = parse_response_id(value)
    if previous is None:
        raise OpenAIError(
            404,
            f"Previous response with id '{value}' not found.",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    return previous


def parse_request(raw: object, served: Served) -> ResponsesRequest:
    """Validate a body; OpenAIError (400/404) says what is wrong, before anything is stored."""
    body = validated(_Body, raw)
    check_served(body.model, served)
    check_output_tokens(body.max_output_tokens, served, "max_output_tokens")
    check_metadata(body.metadata)
    tools = _function_tools(body.tools or [])
    names = {tool["name"] for tool in tools}
    if isinstance(body.tool_choice, _NamedChoice) and body.tool_choice.name not in names:
        raise bad_request(
            f"tool_choice names `{body.tool_choice.name}`, which is not in tools", "tool_choice"
        )
    if body.tool_choice == "required" and not names:
        raise bad_request("tool_choice `required` needs at least one function tool", "tool_choice")
    previous = _previous_response(body.previous_response_id)
    conversation = _conversation(body.conversation)
    if previous is not None and conversation is not None:
        raise bad_request("previous_response_id and conversation cannot be used together", "conversation")
    if body.background and not body.store:
        raise bad_request("background responses must be stored (store: true)", "background")
    items = input_items(body.input)
    compacted = compaction_point(items)
    if compacted is not None and (previous is not None or conversation is not None):
        raise bad_request(
            "a compaction item starts a chain: send it without previous_response_id", "input[0]"
        )
    messages, system, attachments = input_messages(*_after_compaction(items, compacted))
    system = [("instructions", body.instructions or ""), *system]
    instructions = "\n\n".join(text for _, text in system if text) or None
    continuing = previous is not None or conversation is not None or compacted is not None
    choice: str | dict[str, Any] | None = (
        body.tool_choice.model_dump() if isinstance(body.tool_choice, _NamedChoice) else body.tool_choice
    )
    options = ModelOptions(
        tool_choice=choice,
        temperature=body.temperature,
        top_p=body.top_p,
        max_output_tokens=body.max_output_tokens,
    )
    chat = _chat(body, messages, tools, continuing=continuing, instructions=instructions, options=options)
    chat = replace(chat, instructions_field=longest_field(system, "instructions"))
    return ResponsesRequest(
        chat=chat,
        store=body.store,
        background=body.background,
        previous_response_id=previous,
        conversation_id=conversation,
        attachments=attachments,
        input_items_json=json.dumps([listed_item(item) for item in items], ensure_ascii=False),
        compacted=compacted,
        echo=_echo(body, tools, choice),
    )


def _after_compaction(
    items: list[dict[str, Any]], compacted: uuid.UUID | None
) -> tuple[list[dict[str, Any]], int]:
    """The items after a leading compaction item (all of them without one), and where they start."""
    return (items[1:], 1) if compacted is not None else (items, 0)


def _function_tools(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    tools = []
    for index, tool in enumerate(raw):
        if tool.get("type") != "function":
            raise bad_request(
                f"tools[{index}]: only function tools are supported (got {tool.get('type')!r})",
                f"tools[{index}].type",
                "unsupported_tool",
            )
        try:
            parsed = _FunctionTool.model_validate(tool)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            raise bad_request(
                f"tools[{index}].{where}: {first.get('msg')}", f"tools[{index}].{where}"
            ) from None
        tools.append(
            {
                "type": "function",
                "name": parsed.name,
                "description": parsed.description,
                "parameters": parsed.parameters,
                "strict": parsed.strict,
            }
        )
    return tools


def _conversation(value: str | _Conversation | None) -> uuid.UUID | None:
    if value is None:
        return None
    ref = value if isinstance(value, str) else value.id
    found = parse_conversation_ref(ref)
    if found is None:
        raise conversation_not_found(ref)
    return found


def conversation_not_found(ref: str) -> OpenAIError:
    """The 404 for a `conversation` that names none of the caller's (or none at all)."""
    message = f"Conversation with id '{ref}' not found."
    return OpenAIError(404, message, param="conversation", code="not_found")


def _chat(
    body: _Body,
    messages: list[ClientMessage],
    tools: list[dict[str, Any]],
    *,
    continuing: bool,
    instructions: str | None,
    options: ModelOptions,
) -> ChatRequest:
    """The chat-completions form of the input: history, then a user message or tool results."""
    if not messages:
        raise bad_request("input must hold a user message or function_call_output items", "input")
    last = messages[-1]
    if last.role == "user":
        history, prompt, results = messages[:-1], last.text, []
        if not prompt.strip():
            # Continuing or not, an image or a file alone included: the check of the chat's
            # texts would refuse it later, as `messages`, a field the Responses API has not.
            raise bad_request(
                "the last user message has no text (send the question with any image or file)", "input"
            )
    elif last.role == "tool":
        start = len(messages)
        while start > 0 and messages[start - 1].role == "tool":
            start -= 1
        history, prompt, results = messages[:start], None, messages[start:]
        if not continuing and (not history or not history[-1].tool_calls):
            raise bad_request(
                "function_call_output items must follow the function_call they answer "
                "(or name the response that made it in previous_response_id)",
                "input",
            )
    else:
        raise bad_request("the last input item must be a user message or a function_call_output", "input")
    return ChatRequest(
        model=body.model,
        history=tuple(history),
        prompt=prompt,
        tool_results=tuple(results),
        stream=body.stream,
        include_usage=False,
        tools=tuple(
            {"type": "function", "function": {k: v for k, v in tool.items() if k != "type" and v is not None}}
            for tool in tools
        ),
        metadata=dict(body.metadata or {}),
        user=body.user,
        instructions=instructions,
        options=options,
        messages_field="input",
        # A string input is the message itself.
        prompt_index=last.index if prompt is not None and not isinstance(body.input, str) else None,
    )


def _echo(body: _Body, tools: list[dict[str, Any]], choice: str | dict[str, Any] | None) -> dict[str, Any]:
    """The request fields every response object repeats, with the API's defaults."""
    return {
        "created_at": int(time.time()),
        "model": body.model,
        "instructions": body.instructions,
        "tools": tools,
        "tool_choice": choice if choice is not None else "auto",
        "truncation": body.truncation,
        "parallel_tool_calls": body.parallel_tool_calls,
        "text": _as_sent(body.text) or {"format": {"type": "text"}},
        "top_p": body.top_p if body.top_p is not None else 1.0,
        "temperature": body.temperature if body.temperature is not None else 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "top_logprobs": body.top_logprobs or 0,
        "reasoning": _as_sent(body.reasoning),
        "max_output_tokens": body.max_output_tokens,
        "max_tool_calls": body.max_tool_calls,
        "store": body.store,
        "background": body.background,
        "service_tier": body.service_tier or "default",
        "metadata": dict(body.metadata or {}),
        "safety_identifier": body.safety_identifier,
        "prompt_cache_key": body.prompt_cache_key,
        "user": body.user,
    }


def _as_sent(option: BaseModel | None) -> dict[str, Any] | None:
    """An option as the client sent it (its keys chatmem does not know too), to echo."""
    return option.model_dump(by_alias=True, exclude_unset=True) if option is not None else None


@dataclass(frozen=True, slots=True)
class CompactionRequest:
    """A validated `POST /responses/compact`: the history to keep, and where it continues from."""

    model: str
    messages: tuple[ClientMessage, ...]
    previous_response_id: uuid.UUID | None
    compacted: uuid.UUID | None


def parse_compaction(raw: object, served: Served) -> CompactionRequest:
    """Validate a compaction body (the create body's `model`, `input`, `previous_response_id`)."""
    if not isinstance(raw, dict):
        raise bad_request("the request body must be a JSON object")
    if "model" not in raw:
        raise bad_request("model: Field required", "model")
    asked = {key: raw[key] for key in ("model", "previous_response_id", "instructions") if key in raw}
    body = validated(_Body, asked)
    check_served(body.model, served)
    previous = _previous_response(body.previous_response_id)
    value = raw.get("input")
    items = input_items(value) if value is not None else []
    compacted = compaction_point(items)
    messages, _system, _attachments = input_messages(*_after_compaction(items, compacted))
    if previous is None and compacted is None and not messages:
        raise bad_request("there is nothing to compact: send input or previous_response_id", "input")
    return CompactionRequest(body.model, tuple(messages), previous, compacted)
