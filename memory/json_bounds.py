"""Bounds on free-form JSON and on text: checked once at the door, and tolerated on the way out.

Every free-form JSON value the API accepts (import metadata, edited tool arguments, …)
goes through `check_json` before it is stored: at most `MAX_DEPTH` levels of nesting,
at most a given size as UTF-8 JSON, and no string Postgres or asyncpg would refuse (NUL,
lone surrogates). A value past these bounds is an `InvalidInput` naming the field.

Why a depth bound at all: a value nested 256 levels deep was stored fine, and then every
read that serialized it (the turn list, the turn, memory search) failed, because
pydantic refuses to serialize past ~255 levels and Python's `json` past ~1,000. The
bound at the door is far below both, so what is accepted can always be read back.

Values stored before the bound existed (or written by other means) are read with
`readable_json`: a value too deep to serialize becomes None for that one item instead of
failing the whole list. The walks here are iterative, so a deep value cannot exhaust
the interpreter's stack while being checked.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from memory.errors import InvalidInput

log = logging.getLogger(__name__)

# Deep enough for any real metadata or tool arguments; far below what serializers refuse.
MAX_DEPTH = 32
# A stored value deeper than this is not shown (pydantic's own limit is ~255 in total).
MAX_READABLE_DEPTH = 128


class JsonOutOfBounds(InvalidInput):
    """A free-form JSON value is nested too deep, too large, or holds unstorable text."""

    code = "json_out_of_bounds"


def text_problem(value: str) -> str | None:
    """Why Postgres could not store this string, or None if it can."""
    # Postgres text and jsonb refuse NUL; asyncpg cannot encode lone surrogates.
    if "\x00" in value:
        return "contains a NUL character"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "is not valid Unicode (lone surrogate)"
    return None


def check_text(value: str, *, field: str, allow_empty: bool = False, max_chars: int | None = None) -> None:
    """Reject text Postgres cannot store (NUL, lone surrogates), blank text, and text over the limit."""
    problem = text_problem(value)
    if problem is not None:
        raise InvalidInput(f"{field} {problem}", field=field)
    if not allow_empty and not value.strip():
        raise InvalidInput(f"{field} is empty", field=field)
    if max_chars is not None and len(value) > max_chars:
        raise InvalidInput(f"{field} is longer than {max_chars} characters", field=field, max_chars=max_chars)


def depth_over(value: Any, limit: int) -> bool:
    """True when `value` nests containers more than `limit` levels deep (a scalar is depth 0)."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        if depth + 1 > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def _first_text_problem(value: Any) -> str | None:
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            problem = text_problem(item)
            if problem is not None:
                return problem
        elif isinstance(item, dict):
            for key, inner in item.items():
                if isinstance(key, str) and (problem := text_problem(key)) is not None:
                    return problem
                stack.append(inner)
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return None


def json_problem(value: Any, *, max_bytes: int, max_depth: int = MAX_DEPTH) -> str | None:
    """Why `value` may not be stored as free-form JSON, or None if it may."""
    if depth_over(value, max_depth):
        return f"is nested more than {max_depth} levels deep"
    problem = _first_text_problem(value)
    if problem is not None:
        return problem
    size = len(json.dumps(value, ensure_ascii=False).encode())
    if size > max_bytes:
        return f"is over {max_bytes} bytes as JSON ({size})"
    return None


def check_json(value: Any, *, field: str, max_bytes: int, max_depth: int = MAX_DEPTH, **details: Any) -> None:
    """Raise JsonOutOfBounds naming `field` unless `value` is within the bounds (see module doc)."""
    problem = json_problem(value, max_bytes=max_bytes, max_depth=max_depth)
    if problem is not None:
        raise JsonOutOfBounds(
            f"{field} {problem}", field=field, max_depth=max_depth, max_bytes=max_bytes, **details
        )


def readable_json(value: Any, *, what: str = "value") -> Any:
    """`value` if it can be serialized for a response, else None (logged): one item degrades, not the list."""
    if value is None or not depth_over(value, MAX_READABLE_DEPTH):
        return value
    log.warning("a stored %s is nested deeper than %d levels; shown as null", what, MAX_READABLE_DEPTH)
    return None


def tolerant_loads(raw: str | bytes) -> Any:
    """`json.loads` for values read from the database: a value too deep to parse reads as None.

    Used as the engine's JSON deserializer, so one such row cannot fail a whole query.
    """
    try:
        return json.loads(raw)
    except RecursionError:
        log.warning("a stored JSON value is nested too deep to parse; read as null")
        return None
