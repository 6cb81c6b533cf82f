"""When the request being served arrived: the moment it passed the door (`pass_door`).

A stop of a conversation that finds no reply running is kept for a reply whose request had
arrived before it (memory.record.pending_stops). Every door that starts a reply passes the
door first, so this one note serves them all. It is this process's monotonic clock; the
statement that takes a kept stop turns "seconds since arrival" into the database's time
(`clock_timestamp()` minus them), so the comparison with the stop's time, which the
database wrote, needs no extra round trip and does not depend on this host's wall clock
agreeing with the database's.
"""

from __future__ import annotations

import time
from contextvars import ContextVar

_arrived: ContextVar[float | None] = ContextVar("arrived", default=None)


def note_arrival() -> None:
    """For the request being served: it arrives now."""
    _arrived.set(time.monotonic())


def seconds_since_arrival() -> float | None:
    """How long ago the request being served arrived (None outside a request: work of the server's own)."""
    arrived = _arrived.get()
    return None if arrived is None else time.monotonic() - arrived
