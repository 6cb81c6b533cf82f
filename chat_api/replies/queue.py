"""Messages sent with `on_busy=enqueue`: one line per conversation, served in arrival order.

Before this, every waiting request polled the conversation on its own and whichever
re-locked it first after a reply ended went next: five messages sent a second apart were
stored as 1, 2, 4, 0, 3. Now a request that may wait joins its conversation's line first
(even when nothing runs, so it cannot overtake earlier ones that are about to start),
and only the request at the front of the line tries to start its reply; it leaves the
line once its reply is stored (or it failed, or its client left), and the next one
moves up.

Bounds and departures:

- A line holds at most MAX_QUEUED_PER_CONVERSATION requests; one more is a 429 with
  `Retry-After`, so a client cannot pile up unbounded waiting requests (each holds a
  connection and a task).
- A client that goes away while its message waits: with `on_disconnect=stop` the message
  is dropped before anything is stored (there is nothing to stop yet), and the request
  leaves the line; with `on_disconnect=continue` (the default) it stays and runs in turn,
  as a streaming reply whose client left goes on: a disconnect is not a stop, and the
  person finds the message and its reply in the conversation when they come back.
- A stop aimed at a waiting request (`stop_waiting`, by the key it was sent with: AG-UI's
  stop with the run's `runId`) drops that request before anything is stored (409
  `stopped_while_waiting`); the reply ahead of it goes on: it is not the one stopped.
  Only a request that waits is dropped here. One that has stopped waiting (its turns are
  being stored) is the database's to stop, on any process: the stop waits for the
  conversation's lock and stops the stored reply, or is kept for it
  (chat_api.replies.stop.stop_conversation).

The lines live in this process. Requests for one conversation that reach different API
processes are ordered within each process only (a sticky load balancer keeps a
conversation on one process).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextvars import ContextVar

from fastapi import Request

from chat_api import metrics
from chat_api.errors import RateLimited
from memory.errors import Conflict, DomainError

log = logging.getLogger(__name__)

# How often a waiting request checks whether its client is still there.
CLIENT_CHECK_SECONDS = 0.25
# A client refused a place in a full line is told to try again after this many seconds.
FULL_RETRY_AFTER_SECONDS = 2

ClientGone = Callable[[], Awaitable[bool]]

# The request being served: "has its client gone?" (set by the `watch_client` dependency),
# and whether its message is dropped if so (set from the request's on_disconnect).
_client_gone: ContextVar[ClientGone | None] = ContextVar("client_gone", default=None)
_drop_if_client_leaves: ContextVar[bool] = ContextVar("drop_if_client_leaves", default=False)
# The request's place in its line, while it holds one (a stop may drop it).
_place: ContextVar[Place | None] = ContextVar("place", default=None)


async def watch_client(request: Request) -> None:
    """Dependency: lets a request waiting in a line notice that its client has gone."""
    _client_gone.set(request.is_disconnected)


def drop_if_client_leaves(drop: bool) -> None:
    """For this request: drop its waiting message if the client leaves (on_disconnect=stop)."""
    _drop_if_client_leaves.set(drop)


class ClientLeft(DomainError):
    """The client went away while its message waited, and asked for a stop on disconnect."""

    code = "client_left"


class StoppedWhileWaiting(Conflict):
    """A stop dropped the request while its message waited in line; nothing was stored."""

    code = "stopped_while_waiting"


class Place:
    """One request's place in its conversation's line."""

    def __init__(self, queues: ReplyQueues, conversation_id: uuid.UUID, key: str | None) -> None:
        self._queues = queues
        self.conversation_id = conversation_id
        self.key = key  # the request's idempotency key, by which a stop finds it
        self.at_front = asyncio.Event()
        self.stopped = asyncio.Event()
        self.waiting = False  # in `until`: a stop drops it (it checks `stopped` first when it wakes)
        self._left = False

    async def wait_front(self) -> None:
        """Return once this is the first place in its line (see `until` for a client that leaves)."""
        await until(self.at_front.wait())

    def leave(self) -> None:
        """Give the place up (idempotent); the next request moves to the front."""
        if not self._left:
            self._left = True
            self._queues.remove(self)


class ReplyQueues:
    """The lines of this process, by conversation id."""

    def __init__(self) -> None:
        self._lines: dict[uuid.UUID, deque[Place]] = {}

    def waiting(self, conversation_id: uuid.UUID) -> int:
        """Requests in this conversation's line (the front one included)."""
        return len(self._lines.get(conversation_id, ()))

    def join(self, conversation_id: uuid.UUID, *, limit: int, key: str | None = None) -> Place:
        """A place at the end of the line, or RateLimited when `limit` requests already wait (0: no bound)."""
        line = self._lines.setdefault(conversation_id, deque())
        if limit > 0 and len(line) >= limit:
            metrics.observe_rate_limited("queued_messages")
            raise RateLimited(
                f"more than {limit} messages wait in this conversation", retry_after=FULL_RETRY_AFTER_SECONDS
            )
        place = Place(self, conversation_id, key)
        line.append(place)
        if len(line) == 1:
            place.at_front.set()
        return place

    def stop_waiting(self, conversation_id: uuid.UUID, key: str) -> bool:
        """Drop the request in this conversation's line with `key` if it waits (it answers 409,
        nothing stored); False if none with that key waits here."""
        for place in self._lines.get(conversation_id, ()):
            if place.key == key and place.waiting:
                place.stopped.set()
                return True
        return False

    def remove(self, place: Place) -> None:
        """Take `place` out of its line; the new front is woken."""
        line = self._lines.get(place.conversation_id)
        if line is None:
            return
        with contextlib.suppress(ValueError):
            line.remove(place)
        if line:
            line[0].at_front.set()
        else:
            del self._lines[place.conversation_id]


@contextlib.asynccontextmanager
async def in_line(
    queues: ReplyQueues, conversation_id: uuid.UUID, *, limit: int, key: str | None = None
) -> AsyncIterator[None]:
    """Join the conversation's line, wait to be at its front, and leave the line on exit."""
    place = queues.join(conversation_id, limit=limit, key=key)
    token = _place.set(place)
    try:
        await place.wait_front()
        yield
    finally:
        _place.reset(token)
        place.leave()


async def until(waiting: Awaitable[object]) -> None:
    """Await `waiting`; raise ClientLeft once the client is gone, if the request asked for a stop then,
    and StoppedWhileWaiting once a stop drops the request's place in its line."""
    client_gone = _client_gone.get() if _drop_if_client_leaves.get() else None
    place = _place.get()
    task = asyncio.ensure_future(waiting)
    stopped = asyncio.ensure_future(place.stopped.wait()) if place is not None else None
    watched = {task} if stopped is None else {task, stopped}
    if place is not None:
        place.waiting = True
    try:
        while True:
            done, _ = await asyncio.wait(watched, timeout=CLIENT_CHECK_SECONDS, return_when="FIRST_COMPLETED")
            # A stop that found it waiting was answered "dropped": it wins over its turn coming.
            if place is not None and place.stopped.is_set():
                log.info("a queued message was dropped: a stop named it before its turn")
                raise StoppedWhileWaiting("the run was stopped while it waited; it was not stored")
            if task in done:
                task.result()
                return
            if client_gone is not None and await client_gone():
                log.info("a queued message was dropped: its client left before its turn")
                raise ClientLeft("the client left while the message waited; it was not stored")
    finally:
        if place is not None:
            place.waiting = False
        for pending in watched:
            if not pending.done():
                pending.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pending
