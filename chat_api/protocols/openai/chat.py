"""OpenAI chat completions, spoken from a chatmem reply: requests in, chunks and completions out.

One reply is one sequence of chatmem events (`message.delta`, `tool_call.delta`, …, a
terminal event). This module turns that sequence into what OpenAI's API sends, and
turns an OpenAI request into what chatmem needs; it touches no database and no HTTP
framework, so the same translation serves the stream and the whole completion.

- Text of every model step goes out as one assistant message, steps separated by a
  blank line (the client sees one answer; the server's own tool steps in between are
  chatmem's business).
- Calls of the client's tools (the request's `tools`) go out as `tool_calls`, with
  `finish_reason: "tool_calls"`; the server's own tool calls are not shown.
- A reply that fails after the stream started ends with an `error` chunk, which the
  SDKs raise as an APIError; before the stream, errors are OpenAI-shaped 4xx bodies.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, cast

from pydantic import BaseModel, ConfigDict, Field, SkipValidation, ValidationError

from chat_api.admission.lists import in_slices, list_adapter
from chat_api.admission.prompt_room import longest_field
from chat_api.providers.base import ModelOptions
from memory.events import TERMINAL_NAMES, Event, EventName, ToolCallDeltaData, TurnEndedData

MAX_TOOLS = 128
# The API's `metadata`: at most 16 string keys of at most 64 characters, each to a string of at most 512.
MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
# Between the texts of two model steps (a server tool ran in between): one answer to the client.
STEP_SEPARATOR = "\n\n"

BodyT = TypeVar("BodyT", bound=BaseModel)


class OpenAIError(Exception):
    """An error in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with its status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    """A 400 in OpenAI's shape, naming the parameter at fault."""
    return OpenAIError(400, message, param=param, code=code)


def validated(schema: type[BodyT], raw: object) -> BodyT:
    """A request body read as `schema`; its first problem is a 400 naming the parameter.

    A field declared `SkipValidation[list[…]]` (a history) is validated slice by slice
    (`chat_api.admission.lists`): one pydantic call over 49,000 messages held the GIL, in the
    door's worker thread too, 50-150 ms. The first problem is the one a single call gives: the
    fields' in their declared order, a list's by index."""
    if not isinstance(raw, dict):
        raise bad_request("the request body must be a JSON object")
    errors: list[dict[str, Any]] = []
    request: BodyT | None = None
    try:
        request = schema.model_validate(raw)
    except ValidationError as exc:
        errors += [dict(error) for error in exc.errors(include_url=False)]
    order = list(schema.model_fields)
    for name in order:
        if not _is_skipped_list(schema, name) or name not in raw:
            continue
        adapter, _ = list_adapter(schema, name)
        items, problems = in_slices(adapter, raw[name])
        errors += [{**error, "loc": (name, *error["loc"])} for error in problems]
        if request is not None and not problems:
            request = request.model_copy(update={name: items})
    if errors:
        field = min(
            errors,
            key=lambda e: order.index(e["loc"][0]) if e["loc"] and e["loc"][0] in order else len(order),
        )["loc"][:1]
        named = [(error, *_path(error, raw)) for error in errors if error["loc"][:1] == field]
        # Of that field's refusals, the one deepest in the body: of a union's members, the one
        # that got furthest (`input[0]` is not an object, rather than `input` is not a string).
        first, param, _depth = max(named, key=lambda n: n[2])
        expected = [TYPE_NAMES[e["type"]] for e, p, _ in named if p == param and e["type"] in TYPE_NAMES]
        if first["type"] in TYPE_NAMES and param:
            # As the API words it: "Invalid type for 'stream': expected a boolean, but got a string instead."
            wanted = expected[0] if len(expected) == 1 else "one of " + " or ".join(dict.fromkeys(expected))
            got = _json_type(first["input"])
            raise bad_request(
                f"Invalid type for '{param}': expected {wanted}, but got {got} instead.",
                param,
                "invalid_type",
            )
        if first["type"] == "missing" and param:
            raise bad_request(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")
        raise bad_request(f"{param}: {first.get('msg', 'invalid')}", param or None)
    assert request is not None
    return request


def _path(error: dict[str, Any], raw: object) -> tuple[str, int]:
    """The value a refusal is about, named as the API names it (`messages[2].content`), and how
    deep in the body it is. Pydantic's location also holds a union's member names (`str`,
    `literal['none','auto','required']`), which are no step in the body; a missing field is named."""
    loc = error.get("loc", ())
    missing = error.get("type") == "missing"
    param, value, depth = "", raw, 0
    for step, name in enumerate(loc):
        if isinstance(name, int) and isinstance(value, list) and 0 <= name < len(value):
            param, value, depth = f"{param}[{name}]", value[name], depth + 1
        elif (
            isinstance(name, str)
            and isinstance(value, dict)
            and (name in value or (missing and step == len(loc) - 1))
        ):
            param, value, depth = f"{param}.{name}" if param else name, value.get(name), depth + 1
    return param, depth


# Pydantic's refusals of a value's JSON type, and the type each asked for.
TYPE_NAMES = {
    "bool_type": "a boolean",
    "int_type": "an integer",
    "float_type": "a number",
    "string_type": "a string",
    "list_type": "an array",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
}


def _json_type(value: object) -> str:
    """How the API names the JSON type of a value it refused."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a decimal number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


def _is_skipped_list(schema: type[BaseModel], name: str) -> bool:
    # SkipValidation is a class at run time (an Annotated alias to type checkers).
    return any(isinstance(m, SkipValidation) for m in schema.model_fields[name].metadata)  # type: ignore[misc]


@dataclass(frozen=True, slots=True)
class Served:
    """What this server offers a request: the models it answers with, and the most output tokens
    one request may ask for (MAX_OUTPUT_TOKENS)."""

    models: Sequence[str]
    max_output_tokens: int


def check_served(model: str, served: Served) -> None:
    """A model this server does not serve is a 404 `model_not_found`, as OpenAI answers it."""
    if model not in served.models:
        raise OpenAIError(
            404,
            f"The model `{model}` does not exist; this server serves: {', '.join(served.models)}",
            param="model",
            code="model_not_found",
        )


def check_output_tokens(asked: int | None, served: Served, param: str) -> None:
    """More output tokens than MAX_OUTPUT_TOKENS is a 400 naming `param`, before anything is stored
    (a model would refuse it only after the user's message was)."""
    if asked is not None and asked > served.max_output_tokens:
        raise bad_request(
            f"{param}: at most {served.max_output_tokens} output tokens may be asked for (got {asked})", param
        )


def check_metadata(metadata: dict[str, str] | None) -> None:
    """`metadata` over the API's bounds is a 400 naming it (its JSON types are the body's to check)."""
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_KEYS:
        raise bad_request(f"metadata holds at most {MAX_METADATA_KEYS} keys", "metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
            raise bad_request(
                f"metadata keys hold at most {MAX_METADATA_KEY_CHARS} characters and values "
                f"{MAX_METADATA_VALUE_CHARS}",
                "metadata",
            )


def error_body(
    message: str, *, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# --- the request ------------------------------------------------------------------------

# Every part of the body is read strictly, as the API reads it: a value of the wrong JSON type
# is a 400 naming it, not read as another ("yes" as stream: true, "64" as 64, true as n: 1);
# an integer still stands for a number. Fields chatmem does not know are accepted (frontends
# such as Open WebUI add their own).
STRICT = ConfigDict(extra="allow", strict=True)


class _Function(BaseModel):
    model_config = STRICT

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


FUNCTION_FIELDS = {"name", "description", "parameters", "strict"}  # what a function tool is to the model


class _Tool(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    function: _Function


class _CalledFunction(BaseModel):
    model_config = STRICT

    name: str
    arguments: str = ""


class _ToolCall(BaseModel):
    model_config = STRICT

    id: str
    type: Literal["function"] = "function"
    function: _CalledFunction


class _Message(BaseModel):
    model_config = STRICT

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[_ToolCall] | None = None
    tool_call_id: str | None = None


class _NamedFunction(BaseModel):
    model_config = ConfigDict(strict=True)

    name: str


class _NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["function"]
    function: _NamedFunction


class _StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


class _Request(BaseModel):
    # Options chatmem does not act on (logprobs, seed, response_format, …) are accepted and ignored.
    model_config = STRICT

    model: str = Field(min_length=1)
    messages: SkipValidation[list[_Message]]  # validated in slices (see `validated`)
    stream: bool = False
    stream_options: _StreamOptions | None = None
    n: int | None = None
    tools: list[_Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | _NamedToolChoice | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    max_tokens: int | None = Field(None, ge=1)  # at most MAX_OUTPUT_TOKENS (`_options`)
    max_completion_tokens: int | None = Field(None, ge=1)
    metadata: dict[str, str] | None = None  # within the API's bounds (`check_metadata`)
    user: str | None = None


def _inlined(schema: dict[str, Any]) -> dict[str, Any]:
    """A pydantic JSON schema with its `$defs` references inlined (OpenAPI resolves refs from its root)."""
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {key: inline(value) for key, value in node.items()}
        if isinstance(node, list):
            return [inline(item) for item in node]
        return node

    return dict(inline(schema))


# The request body as the OpenAPI document describes it (and schemathesis generates it).
REQUEST_SCHEMA = _inlined(_Request.model_json_schema())


@dataclass(frozen=True, slots=True)
class ClientMessage:
    """A message of the client's history, reduced to what chatmem keeps of it."""

    role: Literal["user", "assistant", "tool"]
    text: str
    tool_calls: tuple[dict[str, str], ...] = ()  # assistant: {"id", "name", "arguments"}
    tool_call_id: str | None = None  # tool: the call it answers
    # Its index in the client's list (`messages[i]`, `input[i]`): what a refusal of it names.
    index: int | None = None


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """A validated chat completion request.

    `history` is what came before the new input. The new input is either a user
    message (`prompt`) or the results of the client's tool calls (`tool_results`).
    `instructions` (the client's system and developer messages) and `options` are what the
    client asked of the model for this reply: chatmem puts the instructions after its own
    system prompt and passes the options to the model.
    """

    model: str
    history: tuple[ClientMessage, ...]
    prompt: str | None
    tool_results: tuple[ClientMessage, ...]
    stream: bool
    include_usage: bool
    tools: tuple[dict[str, Any], ...]
    metadata: dict[str, str] = field(default_factory=dict)
    user: str | None = None
    instructions: str | None = None
    # The request's name of (the longest part of) the instructions: what a refusal of them names.
    instructions_field: str = "instructions"
    options: ModelOptions = field(default_factory=ModelOptions)
    # The request's field holding the messages (`input` on the Responses API), and the client's
    # index of the new user message in it: what a refusal names.
    messages_field: Literal["messages", "input"] = "messages"
    prompt_index: int | None = None

    def param(self, index: int | None, leaf: str = "content") -> str:
        """The request's name of a message's text (`messages[3].content`), or of the whole field."""
        return self.messages_field if index is None else f"{self.messages_field}[{index}].{leaf}"

    @property
    def tool_names(self) -> frozenset[str]:
        return frozenset(tool["function"]["name"] for tool in self.tools)

    @property
    def tool_answers(self) -> list[tuple[str, str]]:
        """The client's tool results as (call id, content): what `answer_tool_results` stores."""
        return [(str(result.tool_call_id), result.text) for result in self.tool_results]


def _text(message: _Message, index: int) -> str:
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") not in ("text", "input_text") or not isinstance(part.get("text"), str):
            raise OpenAIError(
                400,
                f"messages[{index}]: only text content is supported (got {part.get('type')!r})",
                param=f"messages.[{index}].content",
            )
        parts.append(part["text"])
    return "".join(parts)


def parse_request(raw: object, served: Served) -> ChatRequest:
    """Validate a request body; OpenAIError (400/404) says what is wrong, before anything is stored."""
    request = validated(_Request, raw)
    check_served(request.model, served)
    check_metadata(request.metadata)
    if request.n is not None and request.n != 1:
        raise OpenAIError(400, "only n=1 is supported", param="n")
    options = _options(request, served)
    system = [
        (f"messages[{i}].content", text)
        for i, m in enumerate(request.messages)
        if m.role in ("system", "developer") and (text := _text(m, i).strip())
    ]
    instructions = "\n\n".join(text for _, text in system)
    kept = [(i, m) for i, m in enumerate(request.messages) if m.role not in ("system", "developer")]
    if not kept:
        raise OpenAIError(400, "messages must contain a user message", param="messages")
    messages = [_client_message(m, i) for i, m in kept]
    last = messages[-1]
    if last.role == "user":
        history, prompt, results = messages[:-1], last.text, []
        if not prompt.strip():
            raise OpenAIError(
                400, "the last user message is empty", param=f"messages.[{kept[-1][0]}].content"
            )
    elif last.role == "tool":
        start = len(messages)
        while start > 0 and messages[start - 1].role == "tool":
            start -= 1
        history, prompt, results = messages[:start], None, messages[start:]
        if not history or history[-1].role != "assistant" or not history[-1].tool_calls:
            raise OpenAIError(
                400, "tool messages must follow the assistant message that called the tools", param="messages"
            )
    else:
        raise OpenAIError(
            400,
            "the last message must be the user's or a tool result",
            param=f"messages.[{kept[-1][0]}].role",
        )
    include_usage = bool(request.stream and request.stream_options and request.stream_options.include_usage)
    return ChatRequest(
        model=request.model,
        history=tuple(history),
        prompt=prompt,
        tool_results=tuple(results),
        stream=request.stream,
        include_usage=include_usage,
        # What the model is given of each tool: the API's fields, as the Responses door gives them
        # (another key of the client's was sent on to the model, which may refuse it).
        tools=tuple(
            {
                "type": "function",
                "function": tool.function.model_dump(include=FUNCTION_FIELDS, exclude_none=True),
            }
            for tool in request.tools or ()
        ),
        metadata=dict(request.metadata or {}),
        user=request.user,
        instructions=instructions or None,
        instructions_field=longest_field(system, "instructions"),
        options=options,
        prompt_index=kept[-1][0] if prompt is not None else None,
    )


def _options(request: _Request, served: Served) -> ModelOptions:
    """The request's tool choice, sampling and length, in the form every door gives the model."""
    check_output_tokens(request.max_tokens, served, "max_tokens")
    check_output_tokens(request.max_completion_tokens, served, "max_completion_tokens")
    names = {tool.function.name for tool in request.tools or ()}
    choice: str | dict[str, Any] | None
    if isinstance(request.tool_choice, _NamedToolChoice):
        name = request.tool_choice.function.name
        if name not in names:
            raise OpenAIError(400, f"tool_choice names `{name}`, which is not in tools", param="tool_choice")
        choice = {"type": "function", "name": name}
    else:
        choice = request.tool_choice
    if choice == "required" and not names:
        raise OpenAIError(400, "tool_choice `required` needs at least one tool", param="tool_choice")
    return ModelOptions(
        tool_choice=choice,
        temperature=request.temperature,
        top_p=request.top_p,
        # `max_tokens` is the older name of `max_completion_tokens`.
        max_output_tokens=request.max_completion_tokens or request.max_tokens,
    )


def _client_message(message: _Message, index: int) -> ClientMessage:
    text = _text(message, index)
    if message.role == "tool":
        if not message.tool_call_id:
            raise OpenAIError(
                400, "a tool message needs tool_call_id", param=f"messages.[{index}].tool_call_id"
            )
        return ClientMessage("tool", text, tool_call_id=message.tool_call_id, index=index)
    if message.role == "assistant":
        calls = tuple(
            {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in message.tool_calls or ()
        )
        return ClientMessage("assistant", text, tool_calls=calls, index=index)
    return ClientMessage("user", text, index=index)


# --- the answer -------------------------------------------------------------------------


@dataclass
class _Call:
    index: int  # the client's index: client calls of this reply, in order
    id: str
    name: str
    arguments: str = ""


class ReplyTranslator:
    """Folds a reply's events into OpenAI chunks (streaming) or one completion (not streaming)."""

    def __init__(
        self, completion_id: str, model: str, client_tools: frozenset[str], *, include_usage: bool = False
    ) -> None:
        self.id = completion_id
        self.model = model
        self.created = int(time.time())
        self.client_tools = client_tools
        self.include_usage = include_usage
        self.text: list[str] = []
        self.calls: dict[tuple[str, int], _Call] = {}
        self._pending: dict[tuple[str, int], str] = {}  # arguments that came before the call's name
        self.finish_reason: str | None = None
        self.status: str | None = None
        self.error: dict[str, Any] | None = None
        self.usage: dict[str, int] = {}
        self.memories: list[dict[str, Any]] = []
        self._role_sent = False
        self._text_turn = ""

    @property
    def ended(self) -> bool:
        return self.status is not None or self.error is not None

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
        }
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def _opening(self, delta: dict[str, Any]) -> dict[str, Any]:
        if not self._role_sent:
            self._role_sent = True
            return {"role": "assistant", **delta}
        return delta

    def feed(self, event: Event) -> list[dict[str, Any]]:
        """The chunks (possibly none) this event adds to the stream; also folds it into the completion."""
        _id, name, data = event
        if name == EventName.MEMORY_RETRIEVED:
            items = data.get("items")
            self.memories = (
                [item for item in items if isinstance(item, dict)] if isinstance(items, list) else []
            )
        elif name == EventName.MESSAGE_DELTA:
            text = str(data.get("text") or "")
            turn_id = str(data.get("turn_id"))
            if text and self.text and turn_id != self._text_turn:
                text = STEP_SEPARATOR + text  # the next model step's text, after a server tool ran
            if text:
                self._text_turn = turn_id
                self.text.append(text)
                return [self._chunk(self._opening({"content": text}))]
        elif name == EventName.TOOL_CALL_DELTA:
            return self._tool_delta(cast(ToolCallDeltaData, data))
        elif name in TERMINAL_NAMES:
            return self._end(name, cast(TurnEndedData, data))
        elif name == EventName.ERROR:
            self.error = {"message": str(data.get("message") or "the reply failed"), "code": data.get("code")}
            return [
                {
                    "error": error_body(self.error["message"], type="server_error", code=self.error["code"])[
                        "error"
                    ]
                }
            ]
        return []

    def _tool_delta(self, data: ToolCallDeltaData) -> list[dict[str, Any]]:
        key = (str(data.get("turn_id")), int(data.get("index") or 0))
        call = self.calls.get(key)
        arguments = str(data.get("arguments") or "")
        if call is None:
            name = str(data.get("name") or "")
            if not name:
                self._pending[key] = self._pending.get(key, "") + arguments
                return []
            if name not in self.client_tools:
                return []  # the server's own tool: chatmem runs it, the client never sees it
            call = _Call(len(self.calls), str(data.get("id") or ""), name)
            self.calls[key] = call
            arguments = self._pending.pop(key, "") + arguments
            call.arguments += arguments
            entry = {
                "index": call.index,
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": arguments},
            }
            return [self._chunk(self._opening({"content": None, "tool_calls": [entry]}))]
        if not arguments:
            return []
        call.arguments += arguments
        return [self._chunk({"tool_calls": [{"index": call.index, "function": {"arguments": arguments}}]})]

    def _end(self, name: str, data: TurnEndedData) -> list[dict[str, Any]]:
        self.status = str(data.get("status") or name)
        usage = data.get("usage") or {}
        prompt = int(usage.get("prompt_tokens") or 0)
        completion = int(usage.get("completion_tokens") or 0)
        self.usage = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": int(usage.get("total_tokens") or prompt + completion),
        }
        if name == EventName.TURN_FAILED or (name == EventName.TURN_INTERRUPTED and data.get("error")):
            error: dict[str, Any] = dict(data.get("error") or {})
            self.error = {
                "message": str(error.get("message") or "the model failed"),
                "code": error.get("code"),
            }
            return [
                {
                    "error": error_body(self.error["message"], type="server_error", code=self.error["code"])[
                        "error"
                    ]
                }
            ]
        if name == EventName.TURN_AWAITING_APPROVAL:
            self.error = {
                "message": "the reply waits for a person to approve a tool call in chatmem",
                "code": "awaiting_approval",
            }
            return [
                {
                    "error": error_body(self.error["message"], type="server_error", code="awaiting_approval")[
                        "error"
                    ]
                }
            ]
        self.finish_reason = "tool_calls" if self.calls else "stop"
        chunks = [self._chunk(self._opening({}), self.finish_reason)]
        if self.include_usage:
            chunks.append({**self._chunk({}), "choices": [], "usage": self.usage})
        return chunks

    def completion(self) -> dict[str, Any]:
        """The whole answer as a `chat.completion` (after the terminal event was fed)."""
        message: dict[str, Any] = {
            "role": "assistant",
            "content": "".join(self.text) or None,
            "refusal": None,
        }
        if self.calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in sorted(self.calls.values(), key=lambda c: c.index)
            ]
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": self.finish_reason or "stop",
                }
            ],
            "usage": self.usage or {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
        }


def sse_data(payload: dict[str, Any] | str) -> bytes:
    """One `data:` line as OpenAI's stream sends it (`[DONE]` ends the stream)."""
    text = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {text}\n\n".encode()


DONE = sse_data("[DONE]")


def models_list(models: Sequence[str], created: int) -> dict[str, Any]:
    """`GET /models` in OpenAI's format."""
    return {"object": "list", "data": [model_entry(m, created) for m in models]}


def model_entry(model: str, created: int) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": created, "owned_by": "chatmem"}
