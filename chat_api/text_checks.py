"""Checks on user text that JSON schema cannot express."""

from __future__ import annotations

from memory.errors import InvalidInput


def check_text(value: str, *, field: str, allow_empty: bool = False, max_chars: int | None = None) -> None:
    """Reject text Postgres cannot store (NUL, lone surrogates), blank text, and text over the limit."""
    if "\x00" in value:
        raise InvalidInput(f"{field} contains a NUL character", field=field)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidInput(f"{field} is not valid Unicode (lone surrogate)", field=field) from exc
    if not allow_empty and not value.strip():
        raise InvalidInput(f"{field} is empty", field=field)
    if max_chars is not None and len(value) > max_chars:
        raise InvalidInput(f"{field} is longer than {max_chars} characters", field=field, max_chars=max_chars)
