"""Replies running at once: at most MAX_RUNNING_REPLIES_PER_USER per user, however the client behaves.

The stream cap counts open connections, and a disconnect is not a stop: a client could
start any number of replies and hang up on each. This counts the replies themselves:
those this process runs (its registry) plus those being started right now. A start
reserves its place before anything is stored and gives it back if it fails; once the
reply is registered the registry counts it, and the reservation ends in the same step
(no await in between), so the cap holds exactly, also for requests racing each other.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from types import TracebackType
from typing import TypeVar

from chat_api import metrics
from chat_api.admission.streams import StreamSlot
from chat_api.errors import RateLimited
from chat_api.replies.registry import ReplyRegistry
from memory.record.conversations import Owner

T = TypeVar("T")

# A user at the cap is told to try again after this many seconds.
RUNNING_RETRY_AFTER_SECONDS = 5


class RunningReplies:
    """At most `per_user` replies running or starting at once per user (0: no limit)."""

    def __init__(self, per_user: int, registry: ReplyRegistry) -> None:
        self.per_user = per_user
        self.registry = registry
        self._starting: Counter[Owner] = Counter()

    def count(self, owner: Owner) -> int:
        """Replies of this user running in this process, or being started."""
        running = sum(1 for r in self.registry.all() if r.owner == owner and not r.finished.is_set())
        return running + self._starting[owner]

    def reserve(self, owner: Owner) -> None:
        """Count one more reply of `owner` as starting, or RateLimited."""
        if self.per_user > 0 and self.count(owner) >= self.per_user:
            metrics.observe_rate_limited("running_replies")
            raise RateLimited(
                f"more than {self.per_user} replies running at once; stop one or wait for it to end",
                retry_after=RUNNING_RETRY_AFTER_SECONDS,
            )
        self._starting[owner] += 1

    def unreserve(self, owner: Owner) -> None:
        """The start of one reply of `owner` is over (registered, reattached or failed)."""
        self._starting[owner] -= 1
        if self._starting[owner] <= 0:
            del self._starting[owner]


class AdmittedReply:
    """A reply this user may start now: its place under the running cap, and a stream slot when streamed.

    Use it as a context manager around the start, and hand it to the start
    (`start_reply(..., admitted=…)`, `decide(..., admitted=…)`), which calls `registered()`
    the moment the reply is in the registry. Leaving the block ends the reservation in
    any case; leaving it with an exception also gives the stream slot back. A streamed
    reply's response body is `admitted.stream(events)`, which holds the slot until it ends.
    """

    def __init__(self, running: RunningReplies, owner: Owner, slot: StreamSlot | None) -> None:
        self._running = running
        self.owner = owner
        self.slot = slot
        self._reserved = True

    def registered(self) -> None:
        """The reply is in the registry now, which counts it from here on."""
        if self._reserved:
            self._reserved = False
            self._running.unreserve(self.owner)

    def release(self) -> None:
        """Nothing was started: give the place and the stream slot back (idempotent)."""
        self.registered()
        if self.slot is not None:
            self.slot.release()

    def stream(self, items: AsyncIterator[T]) -> AsyncIterator[T]:
        """The response body of a streamed reply, holding its slot until the stream ends."""
        if self.slot is None:
            raise RuntimeError("this reply was admitted without a stream")
        return self.slot.hold(items)

    def __enter__(self) -> AdmittedReply:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if error is not None:
            self.release()
        else:
            self.registered()  # reattached to an earlier reply, or decided without resuming: nothing runs
