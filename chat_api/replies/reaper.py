"""Ends replies left `streaming` by a process that died, so none stays streaming forever.

Any number of API processes run this safely at once: the ending is
`memory.record.reply_endings.end_stale_replies`, which claims rows with `FOR UPDATE SKIP LOCKED`
and touches only turns whose owner has been silent longer than the timeout (silent since its
heartbeat, or since every live process is back after Postgres started, whichever is later:
`memory.record.process_life.silent_longer_than`). It spares the replies its
own process is running (the registry), not every turn the process owns: a reply whose
ending could not be stored (Postgres down for a moment) has left the registry, and on a
one-process deployment this reaper is the only one that can end it. The turn keeps its last
checkpointed content; the stored event log gets its terminal event, so a client resuming
the stream sees it end.

A request that comes back to a reply (a retry with the same Idempotency-Key, a stream that
follows it, a stop, a new message that finds the conversation busy with it) does not wait
for this loop: when Postgres says the process running the reply is gone
(`memory.record.process_life`), `reap_if_owner_gone` ends it now (the stop with its own
ending) through the same conditional function, so the loop and the request never
both end it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import TYPE_CHECKING

from chat_api.replies.registry import ReplyRegistry
from memory.record.process_life import gone_owner_silence
from memory.record.reply_endings import REAPED, Ending, end_stale_replies
from memory.storage.db import Database

if TYPE_CHECKING:
    from chat_api.services import Services

log = logging.getLogger(__name__)

# Heartbeats a gone owner's reply must have missed (besides its life lock being free): a
# live process reconnecting its listening connection still heartbeats (process_life.py).
MISSED_HEARTBEATS = 4
MIN_SILENCE_SECONDS = 1.0


class Reaper:
    """The periodic loop."""

    def __init__(
        self,
        db: Database,
        *,
        timeout_seconds: float,
        interval_seconds: float,
        registry: ReplyRegistry | None = None,
    ) -> None:
        self.db = db
        self.timeout = timeout_seconds
        self.interval = interval_seconds
        self.registry = registry

    async def reap_once(self) -> int:
        """End every stale reply now; returns how many."""
        async with self.db.transaction() as session:
            ended = await end_stale_replies(
                session,
                older_than_seconds=self.timeout,
                spare_replies=self.registry.ids() if self.registry is not None else (),
            )
        if ended:
            log.warning("reaper ended %d turn(s) of dead processes", len(ended))
        return len(ended)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.reap_once()
            except Exception:
                log.exception("reaper pass failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.interval)


async def reap_if_owner_gone(
    services: Services,
    reply_id: uuid.UUID,
    ending: Ending = REAPED,
) -> bool:
    """End the reply with `ending` (the reaper's by default) if the process running it is gone,
    waiting at most a few heartbeats for that to be sure; else leave it. True if it ended it.

    Returns at once when the reply runs here, runs on a live process, or is over.
    """
    if services.registry.get(reply_id) is not None:
        return False
    settings = services.settings
    silence = min(
        settings.heartbeat_timeout_seconds,
        max(MIN_SILENCE_SECONDS, MISSED_HEARTBEATS * settings.checkpoint_interval_ms / 1000),
    )
    while True:
        ended = False
        async with services.db.transaction() as session:
            silent = await gone_owner_silence(session, reply_id)
            if silent is not None and silent >= silence:
                ended = bool(
                    await end_stale_replies(
                        session, older_than_seconds=silence, ending=ending, reply_id=reply_id
                    )
                )
        if ended:
            log.warning("ended reply %s of a process that is gone", reply_id)
        if silent is None or silent >= silence:
            # Over, alive, ended here, or being ended by another ender (the reaper loop, a stop).
            return ended
        # The owner died a moment ago (its heartbeat is recent), or Postgres restarted a moment
        # ago and it may be reconnecting: look again once it could be sure, or sooner (it may take
        # its life lock back meanwhile).
        await asyncio.sleep(min(silence - silent, silence))
