"""Input bounds at the door: what any request may carry, checked before a handler sees it.

Postgres stores no NUL in text or jsonb and asyncpg encodes no lone surrogate, Python
refuses integers of more than 4,300 digits and JSON nested ~1,000 levels deep, Python reads
NaN, Infinity and 1e400 (as inf), which are not JSON numbers and which jsonb refuses, and
Python's datetimes end at year 1 and 9999 whatever the zone. Each of these, met
anywhere past the door (an id, a chat key, a metadata value, a time filter), was a
500. So every JSON body is parsed here, once, and refused whole when any string in it
(key or value) could not be stored or it nests deeper than MAX_JSON_DEPTH; query and
path strings are held to the same rule; times are checked where a route takes them
(`check_time`). Each refusal is `InvalidInput` naming the field, which each protocol
answers in its own error shape.

Before it is parsed, a body is held to MAX_BODY_VALUES: the JSON values (and object keys)
it may hold, counted on its bytes. Parsing and validating a body holds the GIL, in a worker
thread too (`json.loads` and pydantic are each one call into C), so every stream of the
process waits for it: 100,000 to 200,000 tiny messages, well within
MAX_HISTORY_BODY_BYTES, held them all for 0.2 to 1.8 s, on the AG-UI and AI SDK doors
(which bound no message count) as on chat completions (which refused more than 5,000 turns
only once it had read them all). The count costs a few C-speed scans of the bytes, and,
when the strings may hold enough commas or colons to matter, a windowed scan that skips
them, ~1 ms of the GIL at a time.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from fastapi.exceptions import RequestValidationError

from memory.errors import InvalidInput
from memory.json_bounds import JsonOutOfBounds, check_json, check_text, text_problem

# Deeper than any request needs (tool schemas, metadata); far below what parsers refuse.
MAX_JSON_DEPTH = 128
# Bodies larger than this are parsed in a worker thread (imports carry megabytes).
INLINE_PARSE_BYTES = 256_000
# A client's tool definitions go to the model with every request of its reply (and a stored
# response repeats them on every read): each is held to these, on every door.
MAX_TOOL_DESCRIPTION_CHARS = 10_000
MAX_TOOL_PARAMETERS_BYTES = 200_000


def check_time(value: datetime | None, *, field: str) -> datetime | None:
    """The time as an aware UTC datetime (no zone means UTC), or InvalidInput when UTC cannot hold it.

    `0001-01-01T00:00:00+14:00` is in year 0 in UTC, `9999-12-31T23:59:59-14:00` in year 10000.
    """
    if value is None:
        return None
    aware = value.replace(tzinfo=UTC) if value.tzinfo is None else value
    try:
        return aware.astimezone(UTC)
    except OverflowError:
        raise InvalidInput(f"{field} is outside the years 1 to 9999 in UTC", field=field) from None


def check_tools(tools: Iterable[Mapping[str, Any]]) -> None:
    """InvalidInput naming the first function tool whose description or parameters schema is too large."""
    for index, tool in enumerate(tools):
        function = tool.get("function")
        if not isinstance(function, Mapping):
            continue
        description = function.get("description")
        if isinstance(description, str):
            check_text(
                description,
                field=f"tools[{index}].description",
                allow_empty=True,
                max_chars=MAX_TOOL_DESCRIPTION_CHARS,
            )
        parameters = function.get("parameters")
        if parameters is not None:
            check_json(parameters, field=f"tools[{index}].parameters", max_bytes=MAX_TOOL_PARAMETERS_BYTES)


# A string's content, up to (without) its closing quote.
_STRING_CONTENT = rb'(?:[^"\\]++|\\.)*+'
_STRINGS = re.compile(rb'"' + _STRING_CONTENT + rb'"')
# Text outside strings and whole strings, up to the first string the scanned window cuts.
_WHOLE_STRINGS = re.compile(rb'(?:[^"]*+"' + _STRING_CONTENT + rb'")*+[^"]*+')
_STRING_REST = re.compile(_STRING_CONTENT)
_QUOTE = ord('"')
# Each scan of a body's strings looks at this much of it: the GIL is held ~1 ms at a time.
SCAN_WINDOW = 32_768
# Every value or key but the first comes after one of these (outside strings); deleting every
# other byte counts them in one pass.
_NOT_VALUE_STARTS = bytes(byte for byte in range(256) if byte not in b",:[{")
# And every string has two quotes, every number a digit, every array or object its bracket.
_NOT_QUOTES_DIGITS_BRACKETS = bytes(byte for byte in range(256) if byte not in b'"0123456789[{')
_LITERALS = (b"true", b"false", b"null")


def _starts(text: bytes) -> int:
    return len(text.translate(None, _NOT_VALUE_STARTS))


def _at_most(body: bytes) -> int:
    """What `count_values` counts, at most, by what begins each value or key (strings included)."""
    kept = body.translate(None, _NOT_QUOTES_DIGITS_BRACKETS)
    quotes, brackets = kept.count(b'"'), kept.count(b"[") + kept.count(b"{")
    digits = len(kept) - quotes - brackets
    literals = sum(body.count(literal) for literal in _LITERALS)
    return quotes // 2 + digits + literals + 2 * brackets


def _scanned_to(pattern: re.Pattern[bytes], body: bytes, start: int) -> int:
    """Where `pattern` (which matches the empty string too) ends, from `start`, within a window."""
    match = pattern.match(body, start, min(start + SCAN_WINDOW, len(body)))
    assert match is not None
    return match.end()


def count_values(body: bytes, *, up_to: int) -> int:
    """The JSON values and object keys in `body` (an empty array or object counts twice), counted
    exactly as far as needed to tell whether there are more than `up_to`, without parsing it.

    Each one but the first comes after a `,`, `:`, `[` or `{` outside the strings. These are
    counted in the whole body first, and, when the strings may hold many of them (prose, code),
    a second bound by what begins each value is tried; only when both are over `up_to` are the
    strings skipped, window by window (~10 ms a MB).
    """
    count = 1 + _starts(body)
    if count > up_to:
        count = min(count, _at_most(body))
    if count <= up_to:
        return count
    count, position, end = 1, 0, len(body)
    while position < end and count <= up_to:
        reached = _scanned_to(_WHOLE_STRINGS, body, position)
        count += _starts(_STRINGS.sub(b"", body[position:reached]))
        position = reached
        if position < end and body[position] == _QUOTE:  # a string the window cut: to its end
            position += 1
            while position < end:
                reached = _scanned_to(_STRING_REST, body, position)
                if reached < end and body[reached] == _QUOTE:
                    position = reached + 1
                    break
                # No way on: an unterminated string (a backslash the body ends with).
                position = reached if reached > position else end
    return count


class _NotJson(Exception):
    """A number Python reads but JSON has not (NaN, Infinity, or a float overflowing to it)."""


def _not_json(constant: str) -> float:
    raise _NotJson(f"{constant} is not a JSON number")


def _finite(number: str) -> float:
    value = float(number)
    if math.isinf(value):
        raise _NotJson(f"{number[:40]} is beyond what a JSON number may hold here")
    return value


def _parse(body: bytes, max_values: int) -> Any:
    if count_values(body, up_to=max_values) > max_values:
        raise JsonOutOfBounds(
            f"the body holds more than {max_values} JSON values; send fewer messages",
            field="body",
            max_values=max_values,
        )
    try:
        # Python reads NaN and Infinity (and 1e400 as inf); Postgres's jsonb stores neither,
        # so one in any stored field (a tool's parameters, an input item) was a 500.
        document = json.loads(body, parse_constant=_not_json, parse_float=_finite)
    except _NotJson as exc:
        raise RequestValidationError(
            [{"type": "json_invalid", "loc": ("body",), "msg": f"JSON decode error: {exc}"}]
        ) from None
    except RecursionError:
        raise JsonOutOfBounds(
            f"the body is nested more than {MAX_JSON_DEPTH} levels deep",
            field="body",
            max_depth=MAX_JSON_DEPTH,
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestValidationError(
            [{"type": "json_invalid", "loc": ("body",), "msg": f"JSON decode error: {exc}"}]
        ) from None
    except ValueError as exc:  # an integer longer than Python converts (4,300 digits)
        raise JsonOutOfBounds(f"the body holds a number too long to read: {exc}", field="body") from None
    check_json_strings(document)
    return document


Path = tuple[str | int, ...]
# A refusal names at most this many steps of the path (a deep value's path is long).
PATH_STEPS = 6


def check_json_strings(document: Any) -> None:
    """InvalidInput naming the first string (key or value) Postgres cannot store, or a nesting too deep.

    The error's `field` is the dotted path to the value (`messages.2.tool_call_id`), and
    `index` the position in the first list on that path (which item of a batch).
    """
    stack: list[tuple[Any, Path]] = [(document, ())]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            _check_string(item, path)
        elif isinstance(item, dict | list):
            if len(path) >= MAX_JSON_DEPTH:
                raise JsonOutOfBounds(
                    f"{_dotted(path)} is nested more than {MAX_JSON_DEPTH} levels deep",
                    **_where(path),
                    max_depth=MAX_JSON_DEPTH,
                )
            pairs = item.items() if isinstance(item, dict) else enumerate(item)
            for key, value in pairs:
                if isinstance(key, str):
                    _check_string(key, (*path, key), what="the name ")
                stack.append((value, (*path, key)))


def _check_string(value: str, path: Path, what: str = "") -> None:
    problem = text_problem(value)
    if problem is not None:
        raise InvalidInput(f"{what}{_dotted(path)} {problem}", **_where(path))


def _where(path: Path) -> dict[str, Any]:
    where: dict[str, Any] = {"field": _dotted(path)}
    index = next((step for step in path if isinstance(step, int)), None)
    if index is not None:
        where["index"] = index
    return where


def _dotted(path: Path) -> str:
    if not path:
        return "body"
    shown = ".".join(str(step) for step in path[:PATH_STEPS]) + ("…" if len(path) > PATH_STEPS else "")
    # The path's own names may hold the bad character: name them without it.
    return shown.encode("utf-8", "backslashreplace").decode().replace("\x00", "\\x00")


async def parse_json(body: bytes, *, max_values: int) -> Any:
    """The body as JSON, checked (see the module doc), with at most `max_values` values
    (MAX_BODY_VALUES); large bodies are counted and parsed off the event loop."""
    if len(body) > INLINE_PARSE_BYTES:
        return await asyncio.to_thread(_parse, body, max_values)
    return _parse(body, max_values)


def check_url_strings(pairs: Iterable[tuple[str, Any]]) -> None:
    """InvalidInput when a query or path string (name or value) holds a character that cannot be stored."""
    for name, value in pairs:
        _check_string(name, (name,), what="the name ")
        if isinstance(value, str):
            _check_string(value, (name,))
