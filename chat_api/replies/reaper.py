"""Ends replies left `streaming` by a process that died, so none stays streaming forever.

Any number of API processes run this safely at once: the ending is
`memory.record.reply_endings.end_stale_replies`, which claims rows with `FOR UPDATE SKIP LOCKED`
and touches only turns whose heartbeat is older than the timeout. It spares the replies its
own process is running (the registry), not every turn the process owns: a reply whose
ending could not be stored (Postgres down for a moment) has left the registry, and on a
one-process deployment this reaper is the only one that can end it. The turn keeps its last
checkpointed content; the stored event log gets its terminal event, so a client resuming
the stream sees it end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from chat_api.replies.registry import ReplyRegistry
from memory.record.reply_endings import end_stale_replies
from memory.storage.db import Database

log = logging.getLogger(__name__)


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
