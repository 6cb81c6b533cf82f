"""The one token bucket: every rate and quota of the admission path is one of these, per key.

A bucket holds up to `capacity` tokens and refills evenly, `capacity` per `period` seconds,
so a burst of a whole period's allowance is fine and a steady stream is held to the rate.
Taking is all or nothing and answers how long to wait when the tokens are not there
(what `Retry-After` says). The clock is injectable so tests move time instead of sleeping.

Buckets are kept in this process's memory. Full buckets carry no information, so once
`max_keys` keys are tracked the full ones are forgotten: memory stays bounded by the
clients active within one period.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)

# Forget full buckets once this many keys are tracked.
MAX_KEYS = 10_000


@dataclass(slots=True)
class _Level:
    tokens: float
    updated: float


class TokenBuckets(Generic[K]):
    """One bucket per key: `capacity` tokens, refilled evenly over `period` seconds; capacity 0 = no limit."""

    def __init__(
        self,
        capacity: int,
        period: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_keys: int = MAX_KEYS,
    ) -> None:
        self.capacity = capacity
        self.period = period
        self.clock = clock
        self.max_keys = max_keys
        self._levels: dict[K, _Level] = {}

    @property
    def limited(self) -> bool:
        """False when the limit is off (capacity 0)."""
        return self.capacity > 0

    @property
    def _rate(self) -> float:
        return self.capacity / self.period

    def _level(self, key: K) -> _Level:
        now = self.clock()
        level = self._levels.get(key)
        if level is None:
            if len(self._levels) >= self.max_keys:
                self._forget_full(now)
            level = self._levels[key] = _Level(float(self.capacity), now)
        level.tokens = min(float(self.capacity), level.tokens + (now - level.updated) * self._rate)
        level.updated = now
        return level

    def take(self, key: K, tokens: float = 1.0) -> float:
        """Take `tokens` from `key`'s bucket and return 0, or take nothing and return the seconds to wait."""
        if not self.limited:
            return 0.0
        level = self._level(key)
        if level.tokens >= tokens:
            level.tokens -= tokens
            return 0.0
        return (tokens - level.tokens) / self._rate

    def wait(self, key: K, tokens: float = 1.0) -> float:
        """Seconds until `key` has `tokens` (0: now); takes nothing, and tracks no new key."""
        if not self.limited or key not in self._levels:
            return 0.0
        level = self._level(key)
        return 0.0 if level.tokens >= tokens else (tokens - level.tokens) / self._rate

    def drain(self, key: K, tokens: float = 1.0) -> None:
        """Take up to `tokens`, never below empty (counting events that happen anyway, e.g. failures)."""
        if self.limited:
            level = self._level(key)
            level.tokens = max(0.0, level.tokens - tokens)

    def give_back(self, key: K, tokens: float) -> None:
        """Return `tokens` taken for work that was not done (never above capacity)."""
        if self.limited and tokens > 0:
            level = self._level(key)
            level.tokens = min(float(self.capacity), level.tokens + tokens)

    def _forget_full(self, now: float) -> None:
        full = [
            key
            for key, level in self._levels.items()
            if level.tokens + (now - level.updated) * self._rate >= self.capacity
        ]
        for key in full:
            del self._levels[key]
