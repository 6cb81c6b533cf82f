"""Per-user quotas on work a request starts: running replies, and imported turns per hour.

The stream limit (chat_api.ratelimit) counts open connections, and a disconnect is not a
stop: a user could start any number of replies and hang up on each, and they all ran.
`check_running_replies` counts the replies themselves, so MAX_RUNNING_REPLIES_PER_USER
holds however the client behaves. (It is checked before a reply starts; two requests
racing past the check at once can both start, so the bound may be passed by the number
of simultaneous requests, never by a client that simply repeats.)

An import is accepted in a second and costs minutes of embedding; `ImportQuota` holds
each user to IMPORT_TURNS_PER_HOUR turns, a token bucket refilled evenly over the hour.
A whole batch must fit in what is left; the turns it did not create (skipped as already
imported, or the request failed) are given back afterwards, so resending an interrupted
import is charged only for what it adds.

Like the other limits these are per API process (see chat_api.ratelimit for why), and
both answer 429 with `Retry-After` through `chat_api.errors.RateLimited`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from chat_api import metrics
from chat_api.errors import RateLimited
from chat_api.replies.registry import ReplyRegistry
from memory.conversations import Owner
from memory.errors import InvalidInput

# A user at the running-replies cap is told to try again after this many seconds.
RUNNING_RETRY_AFTER_SECONDS = 5
HOUR = 3600.0


def running_replies(registry: ReplyRegistry, owner: Owner) -> int:
    """Replies of this user running in this process now."""
    return sum(1 for reply in registry.all() if reply.owner == owner and not reply.finished.is_set())


def check_running_replies(registry: ReplyRegistry, owner: Owner, limit: int) -> None:
    """RateLimited when the user already has `limit` replies running (0: no limit)."""
    if limit > 0 and running_replies(registry, owner) >= limit:
        metrics.observe_rate_limited("running_replies")
        raise RateLimited(
            f"more than {limit} replies running at once; stop one or wait for it to end",
            retry_after=RUNNING_RETRY_AFTER_SECONDS,
        )


@dataclass(slots=True)
class _Allowance:
    turns: float
    updated: float


class ImportQuota:
    """Turns per hour per user for imports; 0 turns the quota off."""

    def __init__(self, per_hour: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_hour = per_hour
        self.clock = clock
        self._allowances: dict[tuple[str, str], _Allowance] = {}

    def _current(self, owner: Owner) -> _Allowance:
        now = self.clock()
        key = (owner.tenant_id, owner.user_id)
        allowance = self._allowances.setdefault(key, _Allowance(float(self.per_hour), now))
        refilled = allowance.turns + (now - allowance.updated) * self.per_hour / HOUR
        allowance.turns = min(float(self.per_hour), refilled)
        allowance.updated = now
        return allowance

    def take(self, owner: Owner, turns: int) -> None:
        """Charge `turns` to the user, or raise RateLimited (Retry-After: when they fit) / InvalidInput."""
        if self.per_hour <= 0:
            return
        if turns > self.per_hour:
            raise InvalidInput(
                f"{turns} turns is more than the import quota of {self.per_hour} an hour; send fewer",
                field="turns",
                turns_per_hour=self.per_hour,
            )
        allowance = self._current(owner)
        if allowance.turns >= turns:
            allowance.turns -= turns
            return
        metrics.observe_rate_limited("import_turns_per_hour")
        wait = math.ceil((turns - allowance.turns) * HOUR / self.per_hour)
        raise RateLimited(f"more than {self.per_hour} imported turns an hour", retry_after=max(wait, 1))

    def give_back(self, owner: Owner, turns: int) -> None:
        """Return `turns` the user was charged for but did not create."""
        if self.per_hour <= 0 or turns <= 0:
            return
        allowance = self._current(owner)
        allowance.turns = min(float(self.per_hour), allowance.turns + turns)
