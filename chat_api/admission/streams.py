"""Streams held open: at most MAX_STREAMS_PER_USER per user, each slot given back when its stream ends.

A slot is taken before the response starts (so a refusal is a plain 429) and handed to
the response body, which gives it back when the stream ends, fails or is cancelled, or
when the response is dropped before it ever started (a finalizer covers the generator
that never ran and so has no `finally` to run).
"""

from __future__ import annotations

import weakref
from collections.abc import AsyncIterator
from typing import TypeVar

from chat_api import metrics
from chat_api.errors import RateLimited
from memory.record.conversations import Owner

T = TypeVar("T")

# A client refused a stream slot is told to try again after this many seconds.
STREAM_RETRY_AFTER_SECONDS = 5


class StreamSlot:
    """One open stream of one user; `release` gives the slot back (idempotent)."""

    def __init__(self, limit: StreamLimit, owner: Owner) -> None:
        self._limit = limit
        self._owner = owner
        self._held = True

    def release(self) -> None:
        """Give the slot back; calling it again does nothing."""
        if self._held:
            self._held = False
            self._limit.give_back(self._owner)

    def hold(self, items: AsyncIterator[T]) -> AsyncIterator[T]:
        """The stream's items; the slot is given back when the stream ends, however it ends."""
        stream = _release_after(self, items)
        weakref.finalize(stream, self.release)
        return stream


async def _release_after(slot: StreamSlot, items: AsyncIterator[T]) -> AsyncIterator[T]:
    try:
        async for item in items:
            yield item
    finally:
        slot.release()
        aclose = getattr(items, "aclose", None)
        if aclose is not None:
            await aclose()


class StreamLimit:
    """At most `per_user` streams open at once per user; 0 turns the limit off (still counted)."""

    def __init__(self, per_user: int) -> None:
        self.per_user = per_user
        self._open: dict[Owner, int] = {}

    def open_count(self, owner: Owner) -> int:
        """Streams this user has open in this process."""
        return self._open.get(owner, 0)

    def acquire(self, owner: Owner) -> StreamSlot:
        """A slot for one more stream, or RateLimited; take it before the response starts."""
        count = self._open.get(owner, 0)
        if self.per_user > 0 and count >= self.per_user:
            metrics.observe_rate_limited("concurrent_streams")
            raise RateLimited(
                f"more than {self.per_user} streams open at once", retry_after=STREAM_RETRY_AFTER_SECONDS
            )
        self._open[owner] = count + 1
        metrics.OPEN_STREAMS.inc()
        return StreamSlot(self, owner)

    def give_back(self, owner: Owner) -> None:
        """Count one stream of `owner` as closed (called by its StreamSlot)."""
        metrics.OPEN_STREAMS.dec()
        left = self._open.get(owner, 0) - 1
        if left > 0:
            self._open[owner] = left
        else:
            self._open.pop(owner, None)
