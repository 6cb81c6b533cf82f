"""Tool calls a model wrote as text: parsed into real calls, or kept out of the answer.

Small local models (and some servers' parsers) return a tool call as the reply's text:
a fenced ```json block, a bare `{"name": …, "arguments": …}` object, or Qwen's
`<tool_call>` tags. Shown to the user it is noise; stored, it is later recalled as if
the assistant had said it. This filter sits between the provider's stream and the runner:

- text is held back only while the step's text, from its start, can still be a call;
  an ordinary answer (its first visible character is not `` ` ``, `{` or `<`) passes at once;
- a complete call to a tool offered in this step becomes a `ToolCallDelta`;
- a call to a tool not offered (tools off, the last step, an unknown name), or one cut off
  by the end of the stream, is dropped and counted in `dropped`;
- text that stops looking like a call is released, in order, at once.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Collection
from dataclasses import dataclass, field
from typing import Literal

from chat_api.providers.base import Delta, StreamEnd, TextDelta, ToolCallDelta

# The ways a call opens; after the opener comes a JSON object whose first key is "name".
_OPENERS = ("```json", "```", "<tool_call>")
_FUNCTION_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")
_CUT_OFF_CALL = re.compile(r'\{\s*"name"\s*:\s*"[A-Za-z_][\w.-]*"\s*,\s*"(?:arguments|parameters)"\s*:')
_CALL_START = re.compile(r'\{\s*"name"\s*:')
_CLOSER = {"```json": "```", "```": "```", "<tool_call>": "</tool_call>"}


@dataclass
class TextualCalls:
    """What the filter did in one step (for the runner's events and the turn's record)."""

    parsed: int = 0
    dropped: list[str] = field(default_factory=list)  # names (or "?") of calls kept out of the answer


def _could_start_call(text: str) -> bool:
    """True while `text` (stripped of leading whitespace) is still a possible start of a call."""
    s = text.lstrip()
    if not s:
        return True
    for opener in _OPENERS:
        if opener.startswith(s):  # a prefix of the opener itself
            return True
        if s.startswith(opener):
            rest = s[len(opener) :].lstrip()
            return _could_be_object_start(rest)
    return _could_be_object_start(s)


def _could_be_object_start(s: str) -> bool:
    if not s:
        return True
    if not s.startswith("{"):
        return False
    if _CALL_START.match(s):
        return True
    # `{`, `{ "`, `{"na` … still possibly `{"name":`
    compact = re.sub(r"\s+", "", s)
    return '{"name":'.startswith(compact)


def _object_end(s: str, start: int) -> int | None:
    """Index just past the JSON object starting at `start`, or None while it is incomplete."""
    depth = 0
    in_string = False
    escaped = False
    for i in range(start, len(s)):
        ch = s[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


@dataclass(frozen=True)
class _Call:
    name: str
    arguments: str
    end: int  # index in the text just past the call (closer included)


def _parse_call(text: str, *, final: bool = False) -> _Call | Literal[False] | None:
    """The call at the start of `text`; None: not complete yet; False: not a call after all.

    `final`: the stream has ended, so a missing closing fence or tag is no longer awaited.
    """
    s = text
    i = len(s) - len(s.lstrip())
    opener = next((o for o in _OPENERS if s.startswith(o, i)), None)
    if opener is not None:
        i += len(opener)
        while i < len(s) and s[i].isspace():
            i += 1
    if i >= len(s):
        return None
    end = _object_end(s, i)
    if end is None:
        return None
    try:
        value = json.loads(s[i:end])
    except ValueError:
        return False
    # Call-shaped: a function-like name and its arguments, nothing else. A JSON answer that
    # merely has a "name" field ({"name": "John", "age": 39}) is data, and is shown.
    if not (
        isinstance(value, dict)
        and isinstance(value.get("name"), str)
        and _FUNCTION_NAME.match(value["name"])
        and set(value) in ({"name", "arguments"}, {"name", "parameters"})
    ):
        return False
    arguments = value.get("arguments", value.get("parameters"))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return False
    if not isinstance(arguments, dict):
        return False
    closer = _CLOSER.get(opener) if opener else None
    if closer is not None:
        j = end
        while j < len(s) and s[j].isspace():
            j += 1
        rest = s[j:]
        if rest.startswith(closer):
            end = j + len(closer)
        elif closer.startswith(rest) and not final:
            return None  # the closer may still come
    return _Call(value["name"], json.dumps(arguments, ensure_ascii=False), end)


async def textual_tool_calls(
    stream: AsyncIterator[Delta], offered: Collection[str], record: TextualCalls
) -> AsyncGenerator[Delta, None]:
    """`stream` with tool calls written as text turned into calls, or dropped; see the module doc.

    Closing this generator closes `stream` (the upstream connection) too.
    """
    held = ""
    deciding = True  # at the start of the step's text (or right after a parsed call)
    next_index = 0

    def decided(call: _Call) -> ToolCallDelta | None:
        nonlocal next_index
        if call.name not in offered:
            record.dropped.append(call.name)
            return None
        record.parsed += 1
        next_index += 1
        return ToolCallDelta(next_index - 1, _call_id(), call.name, call.arguments)

    try:
        async for delta in stream:
            if isinstance(delta, ToolCallDelta):
                next_index = max(next_index, delta.index + 1)
                yield delta
                continue
            if isinstance(delta, StreamEnd):
                while held:
                    parsed = _parse_call(held, final=True) if deciding else False
                    if isinstance(parsed, _Call):
                        held = held[parsed.end :]
                        if (call := decided(parsed)) is not None:
                            yield call
                        if not held.strip():
                            held = ""
                        continue
                    if deciding and _looks_like_call(held):
                        record.dropped.append(_name_of(held))  # cut off by the token cap
                    else:
                        yield TextDelta(held)
                    held = ""
                yield delta
                continue
            if not deciding:
                yield delta
                continue
            held += delta.text
            while deciding and held:
                parsed = _parse_call(held) if _could_start_call(held) else False
                if parsed is None:
                    break  # wait for more
                if parsed is False:
                    deciding = False
                    text, held = held, ""
                    yield TextDelta(text)
                    break
                held = held[parsed.end :]
                if (call := decided(parsed)) is not None:
                    yield call
                if not held.strip():
                    held = ""
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()


def _looks_like_call(text: str) -> bool:
    """Held text at the end of a stream that began as a call (cut off): never shown."""
    s = text.lstrip()
    for opener in _OPENERS:
        if s.startswith(opener):
            s = s[len(opener) :].lstrip()
            break
    return bool(_CUT_OFF_CALL.match(s))


def _name_of(text: str) -> str:
    found = re.search(r'"name"\s*:\s*"([^"]*)"', text)
    return found.group(1) if found else "?"


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
