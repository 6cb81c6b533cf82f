"""Input bounds at the door: what any request may carry, checked before a handler sees it.

Postgres stores no NUL in text or jsonb and asyncpg encodes no lone surrogate, Python
refuses integers of more than 4,300 digits and JSON nested ~1,000 levels deep, and
Python's datetimes end at year 1 and 9999 whatever the zone. Each of these, met
anywhere past the door (an id, a chat key, a metadata value, a time filter), was a
500. So every JSON body is parsed here, once, and refused whole when any string in it
(key or value) could not be stored or it nests deeper than MAX_JSON_DEPTH; query and
path strings are held to the same rule; times are checked where a route takes them
(`check_time`). Each refusal is `InvalidInput` naming the field, which each protocol
answers in its own error shape.
"""

from __future__ import annotations

import asyncio
import json
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


def _parse(body: bytes) -> Any:
    try:
        document = json.loads(body)
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


async def parse_json(body: bytes) -> Any:
    """The body as JSON, checked (see the module doc); large bodies are parsed off the event loop."""
    if len(body) > INLINE_PARSE_BYTES:
        return await asyncio.to_thread(_parse, body)
    return _parse(body)


def check_url_strings(pairs: Iterable[tuple[str, Any]]) -> None:
    """InvalidInput when a query or path string (name or value) holds a character that cannot be stored."""
    for name, value in pairs:
        _check_string(name, (name,), what="the name ")
        if isinstance(value, str):
            _check_string(value, (name,))
