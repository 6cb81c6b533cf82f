"""Persists every live reply's partial content and events, in one transaction per tick.

One loop per process, not one per reply: at 1,000 concurrent streams a per-reply writer
would be 4,000 transactions a second; batched, it is four. The same write is the
heartbeat the reaper watches. A tick comes every `checkpoint_interval_ms`, or sooner
when a reply has gathered `checkpoint_chars` new characters.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

from sqlalchemy import text

from chat_api.replies.registry import ReplyRegistry
from chat_api.replies.reply import Reply
from memory.events import TERMINAL_STATUSES, StopReason
from memory.record.reply_state import NOTIFY_CHECKPOINT
from memory.record.turns import CHECKPOINT_TURN, HEARTBEAT
from memory.storage.db import Database

log = logging.getLogger(__name__)

# Run after CHECKPOINT_TURN: its row lock makes another process's ending of the turn wait for
# this commit (its terminal event then follows these); an ending committed first makes the
# update match nothing, and this chunk starts at that ending's id, so conflicts and is dropped.
INSERT_EVENTS = text(
    """
    INSERT INTO turn_events (reply_id, first_id, last_id, tenant_id, user_id, events)
    VALUES (:reply_id, :first_id, :last_id, :tenant_id, :user_id, CAST(:events AS jsonb))
    ON CONFLICT (reply_id, first_id) DO NOTHING
    """
)
# Of the turns this process streams, those another process ended (the reaper, or a stop, finding
# this process silent). A turn ended by its own step change is followed by the next step's
# streaming turn in the same commit; a reply not committed yet has no turn: neither is listed.
ENDED_ELSEWHERE = text(
    """
    SELECT t.id FROM turns t
    WHERE t.id = ANY(CAST(:ids AS uuid[]))
      AND t.status = ANY(CAST(:endings AS text[]))
      AND NOT EXISTS (
          SELECT 1 FROM turns s WHERE s.reply_id = t.reply_id AND s.status = 'streaming'
      )
    """
)
# A checkpoint is lossy by design (one interval); waiting for its WAL flush buys nothing and
# would queue every tick behind the disk. Turn endings and accepted messages stay synchronous.
ASYNC_COMMIT = text("SET LOCAL synchronous_commit = off")


@dataclass(frozen=True)
class Claimed:
    """A run of a reply's events, claimed for one write: `events[start:end]`."""

    start: int
    end: int
    last_id: int
    chunk: dict[str, object]  # the INSERT_EVENTS parameters


def take_unpersisted(reply: Reply) -> Claimed | None:
    """Claim the reply's events not yet persisted (synchronously, so two writers never overlap)."""
    start, end = reply.persisted, len(reply.events)
    if start == end:
        return None
    reply.persisted = end
    batch = reply.events[start:end]
    chunk: dict[str, object] = {
        "reply_id": reply.id,
        "first_id": batch[0].id,
        "last_id": batch[-1].id,
        "tenant_id": reply.owner.tenant_id,
        "user_id": reply.owner.user_id,
        "events": json.dumps(batch, ensure_ascii=False),
    }
    return Claimed(start, end, batch[-1].id, chunk)


def give_back(reply: Reply, claimed: Claimed) -> None:
    """A write failed: let the next tick retry the range, unless a later write already went on."""
    if reply.persisted == claimed.end:
        reply.persisted = claimed.start


class Checkpointer:
    """The per-process checkpoint and heartbeat loop."""

    def __init__(self, db: Database, registry: ReplyRegistry, *, interval_ms: int, chars: int) -> None:
        self.db = db
        self.registry = registry
        self.interval = interval_ms / 1000
        self.chars = chars
        self._early = asyncio.Event()

    def note_progress(self, reply: Reply) -> None:
        """Called after each delta: wake the loop early when a reply gathered enough text."""
        if reply.chars_since_checkpoint >= self.chars:
            self._early.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Tick until `stop` is set."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(self._early.wait(), timeout=self.interval)
            except TimeoutError:
                pass
            self._early.clear()
            try:
                await self.flush()
            except Exception:  # a failed tick is retried by the next one
                log.exception("checkpoint failed")

    async def flush(self) -> None:
        """Write every live reply's new events and content, and heartbeat the rest (one statement each)."""
        # A reply ended elsewhere writes nothing more: its stored log ends with that ending.
        replies = [
            r
            for r in self.registry.all()
            if not r.finished.is_set() and r.stop_reason is not StopReason.ENDED_ELSEWHERE
        ]
        if not replies:
            return
        turns, chunks, owners = [], [], []
        for reply in replies:
            claimed = take_unpersisted(reply)
            if claimed is not None:
                chunks.append(claimed)
                owners.append(reply)
                reply.chars_since_checkpoint = 0
                turns.append(
                    {
                        "turn_id": reply.turn_id,
                        "content": reply.content,
                        "tool_calls": json.dumps(reply.tool_calls, ensure_ascii=False),
                        "last_event_id": claimed.last_id,
                    }
                )
        checkpointed = set(owners)
        for reply in owners:
            reply.checkpoint_idle.clear()
        try:
            async with self.db.transaction() as session:
                await session.execute(ASYNC_COMMIT)
                if chunks:
                    await session.execute(CHECKPOINT_TURN, turns)
                    await session.execute(INSERT_EVENTS, [c.chunk for c in chunks])
                    await session.execute(NOTIFY_CHECKPOINT)
                # A checkpointed turn's write is its heartbeat too: only the others need one.
                idle = [r.turn_id for r in replies if r not in checkpointed]
                if idle:
                    await session.execute(HEARTBEAT, {"ids": idle})
                streaming = {reply.turn_id: reply for reply in replies}
                ended = await session.execute(
                    ENDED_ELSEWHERE, {"ids": list(streaming), "endings": sorted(TERMINAL_STATUSES)}
                )
                ended_ids = list(ended.scalars())
        except BaseException:
            for reply, claimed in zip(owners, chunks, strict=True):
                give_back(reply, claimed)
            raise
        finally:
            for reply in owners:
                reply.checkpoint_idle.set()
        for turn_id in ended_ids:
            # Its ending is stored: generating on is for nobody. The runner sends followers that ending.
            streaming[turn_id].request_stop(StopReason.ENDED_ELSEWHERE)
