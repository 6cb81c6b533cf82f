"""What the real OpenAI Chat Completions API accepts as `messages`, as a pure function.

The fake OpenAI server answers 400 with these messages, and property tests of the context
builder assert that every prompt it builds passes them. The rules are the ones the real
API enforces on message sequences (tool-call pairing above all), written from its 400
answers; the wording imitates them so a failing test reads like a production error.
Where the real API is lenient in ways our prompts never need (content-part arrays outside
user messages, `developer` and `function` roles), this is deliberately stricter. User
messages may be content parts (text, image_url, file), as those with attachments are.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

ROLES = ("system", "user", "assistant", "tool")

ALLOWED_KEYS: dict[str, frozenset[str]] = {
    "system": frozenset({"role", "content", "name"}),
    "user": frozenset({"role", "content", "name"}),
    "assistant": frozenset({"role", "content", "name", "tool_calls", "refusal"}),
    "tool": frozenset({"role", "content", "tool_call_id"}),
}


@dataclass(frozen=True, slots=True)
class MessageError:
    """Why a message list would be refused: the API's message, parameter path and code."""

    message: str
    param: str | None = None
    code: str | None = None


def check_chat_messages(messages: list[dict]) -> str | None:
    """Return None if the real API would accept `messages`, else its 400 error message."""
    error = find_message_error(messages)
    return None if error is None else error.message


def find_message_error(messages: Any) -> MessageError | None:
    """Return the first rule `messages` breaks, with the parameter it concerns, or None."""
    if not isinstance(messages, list):
        return _wrong_type("messages", "an array", messages)
    if not messages:
        return MessageError("[] is too short - 'messages'", "messages", "empty_array")

    seen_ids: set[str] = set()
    # Tool-call ids of the last assistant message that still need a tool message.
    pending: list[str] = []
    # Tool-call ids of the current assistant group (answered or not), and the group's index.
    group_ids: set[str] = set()
    group_index: int | None = None
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        error = _check_shape(message, where)
        if error is not None:
            return error
        role = message["role"]
        if role == "tool":
            call_id = message["tool_call_id"]
            if group_index is None:
                return MessageError(
                    "Invalid parameter: messages with role 'tool' must be a response to a preceeding "
                    "message with 'tool_calls'.",
                    f"{where}.role",
                    None,
                )
            if call_id not in group_ids:
                return MessageError(
                    f"Invalid parameter: 'tool_call_id' of '{call_id}' not found in 'tool_calls' of "
                    f"previous message.",
                    f"{where}.tool_call_id",
                    None,
                )
            if call_id not in pending:
                return MessageError(
                    f"Invalid parameter: duplicate tool message for 'tool_call_id' of '{call_id}'.",
                    f"{where}.tool_call_id",
                    None,
                )
            pending.remove(call_id)
            continue

        if pending:
            return _unanswered(pending, group_index)
        group_ids, group_index = set(), None
        if role == "assistant" and message.get("tool_calls"):
            for j, call in enumerate(message["tool_calls"]):
                call_id = call["id"]
                if call_id in seen_ids:
                    return MessageError(
                        f"Invalid parameter: duplicate 'tool_calls' id '{call_id}'.",
                        f"{where}.tool_calls[{j}].id",
                        "duplicate_id",
                    )
                seen_ids.add(call_id)
                pending.append(call_id)
            group_ids, group_index = set(pending), i
    if pending:
        return _unanswered(pending, group_index)
    return None


def check_tools(tools: Any) -> str | None:
    """Return None if `tools` is a valid list of function tools, else an error message."""
    if tools is None:
        return None
    if not isinstance(tools, list) or not tools:
        return "Invalid 'tools': expected a non-empty array of tool objects."
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            return f"Invalid value for 'tools[{i}].type': expected 'function'."
        function = tool.get("function")
        if (
            not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not function["name"]
        ):
            return f"Missing required parameter: 'tools[{i}].function.name'."
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            return f"Invalid type for 'tools[{i}].function.parameters': expected an object."
    return None


def _check_shape(message: Any, where: str) -> MessageError | None:
    if not isinstance(message, dict):
        return _wrong_type(where, "an object", message)
    role = message.get("role")
    if role is None:
        return _missing(f"{where}.role")
    if role not in ROLES:
        supported = ", ".join(f"'{r}'" for r in ROLES)
        return MessageError(
            f"Invalid value: '{role}'. Supported values are: {supported}.", f"{where}.role", "invalid_value"
        )
    extra = sorted(set(message) - ALLOWED_KEYS[role])
    if extra:
        return MessageError(
            f"Additional properties are not allowed ('{extra[0]}' was unexpected) - '{where}'", where, None
        )
    content = message.get("content")
    if role == "user" and isinstance(content, list):
        return _check_parts(content, f"{where}.content")
    if role in ("system", "user"):
        return _check_text(content, f"{where}.content")
    if role == "tool":
        if not isinstance(message.get("tool_call_id"), str) or not message["tool_call_id"]:
            return _missing(f"{where}.tool_call_id")
        if not isinstance(content, str):
            return _wrong_type(f"{where}.content", "a string", content)
        return None
    return _check_assistant(message, where)


PART_FIELDS = {"text": "text", "image_url": "image_url", "file": "file"}


def _check_parts(parts: list[Any], where: str) -> MessageError | None:
    """A user message's content parts: each `{"type": t, t: …}` of text, image_url or file."""
    if not parts:
        return MessageError(
            f"Invalid '{where}': empty array. Expected an array with minimum length 1.", where, None
        )
    for index, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        field = PART_FIELDS.get(str(kind))
        if field is None or field not in part:
            return MessageError(
                f"Invalid value: '{kind}'. Supported values are: 'text', 'image_url' and 'file'.",
                f"{where}[{index}].type",
                None,
            )
    return None


def _check_assistant(message: dict[str, Any], where: str) -> MessageError | None:
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        return _wrong_type(f"{where}.content", "a string", content)
    if "tool_calls" not in message or message["tool_calls"] is None:
        if not content:
            return MessageError(
                f"Invalid value for '{where}.content': an assistant message must have 'content' "
                f"or 'tool_calls'.",
                f"{where}.content",
                "invalid_value",
            )
        return None
    calls = message["tool_calls"]
    if not isinstance(calls, list):
        return _wrong_type(f"{where}.tool_calls", "an array", calls)
    if not calls:
        return MessageError(
            f"Invalid '{where}.tool_calls': empty array. Expected an array with minimum length 1, "
            f"but got an empty array instead.",
            f"{where}.tool_calls",
            "empty_array",
        )
    ids_here: set[str] = set()
    for j, call in enumerate(calls):
        error = _check_tool_call(call, f"{where}.tool_calls[{j}]")
        if error is not None:
            return error
        if call["id"] in ids_here:
            return MessageError(
                f"Invalid parameter: duplicate 'tool_calls' id '{call['id']}'.",
                f"{where}.tool_calls[{j}].id",
                "duplicate_id",
            )
        ids_here.add(call["id"])
    return None


def _check_tool_call(call: Any, where: str) -> MessageError | None:
    if not isinstance(call, dict):
        return _wrong_type(where, "an object", call)
    if not isinstance(call.get("id"), str) or not call["id"]:
        return _missing(f"{where}.id")
    if call.get("type") != "function":
        return MessageError(
            f"Invalid value: '{call.get('type')}'. Supported values are: 'function'.",
            f"{where}.type",
            "invalid_value",
        )
    function = call.get("function")
    if not isinstance(function, dict):
        return _missing(f"{where}.function")
    if not isinstance(function.get("name"), str) or not function["name"]:
        return _missing(f"{where}.function.name")
    arguments = function.get("arguments")
    if not isinstance(arguments, str):
        return _wrong_type(f"{where}.function.arguments", "a string", arguments)
    try:
        parsed = json.loads(arguments)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        return MessageError(
            f"Invalid value for '{where}.function.arguments': expected a JSON object string.",
            f"{where}.function.arguments",
            "invalid_value",
        )
    return None


def _check_text(content: Any, where: str) -> MessageError | None:
    if not isinstance(content, str):
        return _wrong_type(where, "a string", content)
    if not content:
        return MessageError(
            f"Invalid '{where}': string too short. Expected a string with minimum length 1, but got an empty "
            f"string instead.",
            where,
            "string_below_min_length",
        )
    return None


def _unanswered(pending: list[str], group_index: int | None) -> MessageError:
    return MessageError(
        "An assistant message with 'tool_calls' must be followed by tool messages responding to each "
        f"'tool_call_id'. The following tool_call_ids did not have response messages: {', '.join(pending)}",
        f"messages[{group_index}].tool_calls",
        None,
    )


def _missing(path: str) -> MessageError:
    return MessageError(f"Missing required parameter: '{path}'.", path, "missing_required_parameter")


def _wrong_type(path: str, expected: str, value: Any) -> MessageError:
    return MessageError(
        f"Invalid type for '{path}': expected {expected}, but got {_type_name(value)} instead.",
        path,
        "invalid_type",
    )


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {str: "a string", bool: "a boolean", int: "an integer", float: "a number", list: "an array"}.get(
        type(value), "an object"
    )
