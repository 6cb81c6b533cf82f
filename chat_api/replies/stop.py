"""Stopping a reply, or waiting for its end, on whichever process runs it.

A reply running here is stopped in memory; one running on another process is asked over
`chatmem_stop`; a parked one (no process runs it) is ended right here, and so is one whose
process is gone (`reaper.reap_if_owner_gone`: its life lock is free). Each of those
endings is `memory.record.reply_endings.end_reply`; if the owner does not answer within
STOP_WAIT_SECONDS and its heartbeat is stale, it is dead, and the stop ends the reply itself.

A stop that names a conversation rather than a reply (`stop_conversation`) may come while
the reply it means is being started, on any process: it takes the conversation's lock, so
a reply whose turns are being stored is stored first and then stopped, and one not stored
yet finds the stop kept on the conversation (memory.record.pending_stops) and starts stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from sqlalchemy.ext.asyncio import AsyncSession

from chat_api.metrics import observe_stop
from chat_api.replies.reaper import reap_if_owner_gone
from memory.events import StopReason, TurnStatus
from memory.record.conversations import active_reply_of
from memory.record.pending_stops import keep_stop
from memory.record.reply_endings import Ending, end_parked_reply, end_stale_replies
from memory.record.reply_state import notify_stop, reply_state

if TYPE_CHECKING:
    from chat_api.services import Services

POLL_SECONDS = 0.25


async def _state(services: Services, reply_id: uuid.UUID) -> str | None:
    async with services.db.session() as session:
        return await reply_state(session, reply_id)


async def reply_streaming(services: Services, reply_id: uuid.UUID) -> bool:
    """True while the reply generates (not parked, not over)."""
    return await _state(services, reply_id) == TurnStatus.STREAMING


async def reply_parked(services: Services, reply_id: uuid.UUID) -> bool:
    """True while the reply waits for a tool approval."""
    return await _state(services, reply_id) == TurnStatus.AWAITING_APPROVAL


async def wait_reply_done(services: Services, reply_id: uuid.UUID, timeout: float | None) -> bool:
    """Wait until the reply has ended (any process); False if the timeout passed first."""
    local = services.registry.get(reply_id)
    if local is not None:
        try:
            await asyncio.wait_for(local.finished.wait(), timeout)
        except TimeoutError:
            return False
        return True
    deadline = None if timeout is None else time.monotonic() + timeout
    waiter = services.signals.done_waiter(reply_id)
    try:
        while await _state(services, reply_id) == TurnStatus.STREAMING:
            remaining = POLL_SECONDS if deadline is None else min(POLL_SECONDS, deadline - time.monotonic())
            if remaining <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(waiter.wait(), remaining)
        return True
    finally:
        services.signals.forget_waiter(reply_id, waiter)


async def stop_reply(
    services: Services, reply_id: uuid.UUID, *, reason: StopReason = StopReason.USER
) -> bool:
    """Stop the reply wherever it runs; True once it has ended (by this stop or before it)."""
    started = time.monotonic()
    ended = await _stop_reply(services, reply_id, reason)
    observe_stop(time.monotonic() - started, ended=ended)
    return ended


async def _stop_reply(services: Services, reply_id: uuid.UUID, reason: StopReason) -> bool:
    local = services.registry.get(reply_id)
    if local is not None:
        local.request_stop(reason)
    elif await reap_if_owner_gone(services, reply_id, Ending(TurnStatus.INTERRUPTED_BY_USER, reason=reason)):
        return True  # its process is gone: nobody would have answered the stop
    else:
        async with services.db.transaction() as session:
            # A parked reply has no process: its ending is written here, under the row lock.
            if await end_parked_reply(session, reply_id, reason) is not None:
                return True
            if await reply_state(session, reply_id) != TurnStatus.STREAMING:
                return True
            await notify_stop(session, reply_id, reason)  # sent at commit
    if await wait_reply_done(services, reply_id, services.settings.stop_wait_seconds):
        return True
    # Nobody answered: if the owner stopped heartbeating it is dead, and the stop is ours to store.
    async with services.db.transaction() as session:
        await end_stale_replies(
            session,
            older_than_seconds=services.settings.heartbeat_timeout_seconds,
            ending=Ending(TurnStatus.INTERRUPTED_BY_USER, reason=reason),
            reply_id=reply_id,
        )
    return await _state(services, reply_id) != TurnStatus.STREAMING


class Stopped(enum.Enum):
    """What a stop of a conversation's reply did."""

    ENDED = "ended"  # its reply has ended (by this stop or before), or none runs (a keyless stop is kept)
    UNCONFIRMED = "unconfirmed"  # its process did not confirm within STOP_WAIT_SECONDS
    KEPT = "kept"  # the run named is not stored yet: it starts stopped


class NamedRun(enum.Enum):
    """Where the run a stop names (by its key) stands."""

    RUNNING = "running"  # it drives the conversation's running (or waiting) reply
    ENDED = "ended"  # stored, and not what runs now: an earlier run of the conversation
    NOT_STORED = "not_stored"  # not stored yet: the stop is kept for it


# (session, the running reply or None) -> where the run a stop names stands.
RunNamed = Callable[[AsyncSession, uuid.UUID | None], Awaitable[NamedRun]]


async def stop_conversation(
    services: Services, conversation_id: uuid.UUID, *, key: str | None = None, named: RunNamed | None = None
) -> Stopped:
    """Stop the conversation's running reply, or the run with idempotency key `key` (`named`
    says where it stands), wherever it runs; or keep the stop for the reply being started.

    Read under the conversation's lock: a start storing its reply holds it, so this waits for
    it and then stops that reply. If no reply runs, the stop is kept for one whose request
    had arrived and is not stored yet (`take_stop`); a stop naming by `key` a run not stored
    yet is kept for that run, and one naming an earlier run (stored, not the one running)
    stops nothing: that run has ended.
    """
    async with services.db.transaction() as session:
        running = await active_reply_of(session, conversation_id, for_update=True)
        if key is not None and named is not None:
            where = await named(session, running)
            if where is NamedRun.NOT_STORED:
                await keep_stop(session, conversation_id, key)
                return Stopped.KEPT
            if where is NamedRun.ENDED:
                return Stopped.ENDED
        if running is None:
            if key is None:  # a run named by its key and stored has ended: nothing is kept
                await keep_stop(session, conversation_id, None)
            return Stopped.ENDED
    ended = await stop_reply(services, running, reason=StopReason.USER)
    return Stopped.ENDED if ended else Stopped.UNCONFIRMED
