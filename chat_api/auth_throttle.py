"""Failed authentication, limited per client address.

Each request whose token is missing or refused takes one from its address's allowance
(AUTH_FAILURES_PER_MINUTE, a token bucket refilled evenly over a minute). Once the
allowance is spent, every authenticated route answers that address 429 with
`Retry-After` before looking at the token at all, so guessing tokens or keys is held to
the rate whatever the answers would have been. A client that authenticates correctly
spends nothing.

The address is the connection's peer as the server sees it (behind a reverse proxy, run
uvicorn with `--proxy-headers` and `--forwarded-allow-ips` so it is the client's).
Kept in this process's memory, like the other limits (chat_api.ratelimit).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from chat_api import metrics
from chat_api.errors import RateLimited

# Forget full allowances once this many addresses are tracked: memory stays bounded.
PRUNE_AT = 10_000


@dataclass(slots=True)
class _Allowance:
    failures: float
    updated: float


class FailedAuthLimit:
    """At most `per_minute` failed authentications per client address; 0 turns the limit off."""

    def __init__(self, per_minute: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_minute = per_minute
        self.clock = clock
        self._allowances: dict[str, _Allowance] = {}

    def _current(self, address: str) -> _Allowance:
        now = self.clock()
        rate = self.per_minute / 60.0
        allowance = self._allowances.get(address)
        if allowance is None:
            if len(self._allowances) >= PRUNE_AT:
                self._prune(now, rate)
            allowance = self._allowances[address] = _Allowance(float(self.per_minute), now)
        refilled = allowance.failures + (now - allowance.updated) * rate
        allowance.failures = min(float(self.per_minute), refilled)
        allowance.updated = now
        return allowance

    def check(self, address: str) -> None:
        """RateLimited when this address has no failed attempts left (call before verifying)."""
        if self.per_minute <= 0 or address not in self._allowances:
            return
        allowance = self._current(address)
        if allowance.failures < 1.0:
            metrics.observe_rate_limited("auth_failures")
            wait = math.ceil((1.0 - allowance.failures) * 60.0 / self.per_minute)
            raise RateLimited("too many failed authentications from this address", retry_after=max(wait, 1))

    def failed(self, address: str) -> None:
        """Count one failed authentication from this address."""
        if self.per_minute <= 0:
            return
        allowance = self._current(address)
        allowance.failures = max(0.0, allowance.failures - 1.0)

    def _prune(self, now: float, rate: float) -> None:
        full = [
            address
            for address, allowance in self._allowances.items()
            if allowance.failures + (now - allowance.updated) * rate >= self.per_minute
        ]
        for address in full:
            del self._allowances[address]
