"""Per-user limits: requests per minute, and SSE streams open at once.

Both are kept in this process's memory, so with N API replicas a user gets up to N
times the configured numbers (a load balancer with sticky users, or a shared store,
would be needed for a global limit). That is the intended trade: no extra moving part,
no network hop on every request, and the limits still stop one client from exhausting a
replica. Both answer 429 with `Retry-After` through `chat_api.errors.RateLimited`.

Requests per minute is a token bucket: `RATE_LIMIT_PER_MINUTE` tokens, refilled evenly
over a minute, so a burst of a minute's allowance is fine and a steady stream is held to
the rate. The clock is injectable so tests move time instead of sleeping.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Annotated, TypeVar

from fastapi import Depends, FastAPI, Request

from chat_api import metrics
from chat_api.auth_throttle import FailedAuthLimit
from chat_api.deps import OwnerDep
from chat_api.errors import RateLimited
from chat_api.quotas import ImportQuota
from memory.config import Settings
from memory.conversations import Owner

Key = tuple[str, str]
T = TypeVar("T")

# Forget full buckets once this many users are tracked: memory stays bounded by active users.
PRUNE_AT = 10_000
# A client refused a stream slot is told to try again after this many seconds.
STREAM_RETRY_AFTER_SECONDS = 5


@dataclass(slots=True)
class _Bucket:
    tokens: float
    updated: float


class RequestRate:
    """A token bucket per user: `per_minute` requests, refilled evenly; 0 turns the limit off."""

    def __init__(self, per_minute: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_minute = per_minute
        self.clock = clock
        self._buckets: dict[Key, _Bucket] = {}

    def check(self, owner: Owner) -> None:
        """Take one request from the user's allowance, or raise RateLimited with the wait in seconds."""
        if self.per_minute <= 0:
            return
        now = self.clock()
        rate = self.per_minute / 60.0
        key = (owner.tenant_id, owner.user_id)
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= PRUNE_AT:
                self._prune(now, rate)
            bucket = self._buckets[key] = _Bucket(float(self.per_minute), now)
        bucket.tokens = min(float(self.per_minute), bucket.tokens + (now - bucket.updated) * rate)
        bucket.updated = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return
        metrics.observe_rate_limited("requests_per_minute")
        wait = math.ceil((1.0 - bucket.tokens) / rate)
        raise RateLimited(f"more than {self.per_minute} requests per minute", retry_after=max(wait, 1))

    def _prune(self, now: float, rate: float) -> None:
        full = [
            key
            for key, bucket in self._buckets.items()
            if bucket.tokens + (now - bucket.updated) * rate >= self.per_minute
        ]
        for key in full:
            del self._buckets[key]


class StreamSlot:
    """One open stream of one user; `release` gives the slot back (idempotent)."""

    def __init__(self, limit: StreamLimit, key: Key) -> None:
        self._limit = limit
        self._key = key
        self._held = True

    def release(self) -> None:
        """Give the slot back; calling it again does nothing."""
        if self._held:
            self._held = False
            self._limit.give_back(self._key)


class StreamLimit:
    """At most `per_user` SSE streams open at once per user; 0 turns the limit off (still counted)."""

    def __init__(self, per_user: int) -> None:
        self.per_user = per_user
        self._open: dict[Key, int] = {}

    def open_count(self, owner: Owner) -> int:
        """Streams this user has open in this process."""
        return self._open.get((owner.tenant_id, owner.user_id), 0)

    def acquire(self, owner: Owner) -> StreamSlot:
        """A slot for one more stream, or RateLimited; check this before the response starts."""
        key = (owner.tenant_id, owner.user_id)
        count = self._open.get(key, 0)
        if self.per_user > 0 and count >= self.per_user:
            metrics.observe_rate_limited("concurrent_streams")
            raise RateLimited(
                f"more than {self.per_user} streams open at once", retry_after=STREAM_RETRY_AFTER_SECONDS
            )
        self._open[key] = count + 1
        metrics.OPEN_STREAMS.inc()
        return StreamSlot(self, key)

    def give_back(self, key: Key) -> None:
        """Count one stream of `key` as closed (called by its StreamSlot)."""
        metrics.OPEN_STREAMS.dec()
        left = self._open.get(key, 0) - 1
        if left > 0:
            self._open[key] = left
        else:
            self._open.pop(key, None)


def held_while_streaming(slot: StreamSlot, items: AsyncIterator[T]) -> AsyncIterator[T]:
    """The stream's items; the slot is released when the stream ends, fails or is cancelled.

    Also when the response is dropped before it ever started iterating (the client left
    early): a generator that never ran has no `finally` to run, so a finalizer covers it.
    """
    stream = _release_after(slot, items)
    weakref.finalize(stream, slot.release)
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


@dataclass(frozen=True)
class RateLimits:
    """This process's limits, kept on `app.state.rate_limits`."""

    requests: RequestRate
    streams: StreamLimit
    imports: ImportQuota
    auth_failures: FailedAuthLimit

    @classmethod
    def from_settings(cls, settings: Settings) -> RateLimits:
        """The limits configured by RATE_LIMIT_PER_MINUTE, MAX_STREAMS_PER_USER, IMPORT_TURNS_PER_HOUR
        and AUTH_FAILURES_PER_MINUTE."""
        return cls(
            RequestRate(settings.rate_limit_per_minute),
            StreamLimit(settings.max_streams_per_user),
            ImportQuota(settings.import_turns_per_hour),
            FailedAuthLimit(settings.auth_failures_per_minute),
        )


def install_rate_limits(app: FastAPI, settings: Settings) -> RateLimits:
    """Create the process's limits and keep them on the app."""
    limits = RateLimits.from_settings(settings)
    app.state.rate_limits = limits
    return limits


def get_rate_limits(request: Request) -> RateLimits:
    """The limits of the app serving this request."""
    return request.app.state.rate_limits  # type: ignore[no-any-return]


RateLimitsDep = Annotated[RateLimits, Depends(get_rate_limits)]


async def enforce_request_rate(owner: OwnerDep, limits: RateLimitsDep) -> None:
    """Dependency: 429 when the caller is over their requests per minute."""
    limits.requests.check(owner)
