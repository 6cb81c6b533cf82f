"""Cross-process signals over Postgres LISTEN/NOTIFY: no extra infrastructure.

The channels are named in `memory/record/reply_state.py`, which also sends on them. One
dedicated connection per process, reconnected on loss; it also holds the process's life
lock (`memory/record/process_life.py`), so the process counts as alive while it listens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import TypeAlias

import asyncpg

from chat_api.replies.registry import ReplyRegistry
from memory.events import StopReason
from memory.record.process_life import HOLD_LIFE, RECONNECT_MAX_SECONDS
from memory.record.reply_state import CHECKPOINT_CHANNEL, DONE_CHANNEL, STOP_CHANNEL
from memory.storage.db import asyncpg_dsn

log = logging.getLogger(__name__)

# What asyncpg hands a notification callback as its first argument.
Listener: TypeAlias = "asyncpg.Connection[asyncpg.Record] | asyncpg.pool.PoolConnectionProxy[asyncpg.Record]"


class Signals:
    """Listens for stop requests and reply endings; lets coroutines wait for either."""

    def __init__(self, database_url: str, registry: ReplyRegistry, process_id: str) -> None:
        self.dsn = asyncpg_dsn(database_url)
        self.process_id = process_id
        self.registry = registry
        self._done_waiters: dict[uuid.UUID, list[asyncio.Event]] = {}
        self._wake = asyncio.Event()
        self.connected = asyncio.Event()

    # --- waiting --------------------------------------------------------------------

    def done_waiter(self, reply_id: uuid.UUID) -> asyncio.Event:
        """An event set when a `chatmem_turn_done` for this reply arrives."""
        event = asyncio.Event()
        self._done_waiters.setdefault(reply_id, []).append(event)
        return event

    def forget_waiter(self, reply_id: uuid.UUID, event: asyncio.Event) -> None:
        waiters = self._done_waiters.get(reply_id, [])
        with contextlib.suppress(ValueError):
            waiters.remove(event)
        if not waiters:
            self._done_waiters.pop(reply_id, None)

    def wake_event(self) -> asyncio.Event:
        """An event set at the next checkpoint or ending written by any process."""
        return self._wake

    # --- receiving ------------------------------------------------------------------

    def _on_stop(self, _conn: Listener, _pid: int, _channel: str, payload: str) -> None:
        ident, _, reason = payload.partition(":")
        with contextlib.suppress(ValueError):
            reply = self.registry.get(uuid.UUID(ident))
            if reply is not None:
                reply.request_stop(StopReason(reason or StopReason.USER))

    def _on_done(self, _conn: Listener, _pid: int, _channel: str, payload: str) -> None:
        with contextlib.suppress(ValueError):
            for event in self._done_waiters.pop(uuid.UUID(payload), []):
                event.set()
        self._on_checkpoint(_conn, _pid, _channel, payload)

    def _on_checkpoint(self, _conn: Listener, _pid: int, _channel: str, _payload: str) -> None:
        self._wake.set()
        self._wake = asyncio.Event()

    async def run(self, stop: asyncio.Event) -> None:
        """Keep a LISTEN connection open until `stop` is set."""
        delay = 0.2
        while not stop.is_set():
            conn: asyncpg.Connection | None = None
            try:
                conn = await asyncpg.connect(self.dsn)
                lost = asyncio.Event()
                conn.add_termination_listener(lambda _c, lost=lost: lost.set())
                await conn.add_listener(STOP_CHANNEL, self._on_stop)
                await conn.add_listener(DONE_CHANNEL, self._on_done)
                await conn.add_listener(CHECKPOINT_CHANNEL, self._on_checkpoint)
                # Released when this session ends; waits only for an earlier session of this
                # process that Postgres has not yet seen go.
                await conn.execute(HOLD_LIFE, self.process_id)
                self.connected.set()
                delay = 0.2
                stop_wait = asyncio.create_task(stop.wait())
                lost_wait = asyncio.create_task(lost.wait())
                try:
                    await asyncio.wait({stop_wait, lost_wait}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    stop_wait.cancel()
                    lost_wait.cancel()
            except (OSError, asyncpg.PostgresError) as exc:
                log.warning("signal connection failed (%s); retrying in %.1fs", exc, delay)
            finally:
                self.connected.clear()
                if conn is not None and not conn.is_closed():
                    await conn.close()
            if not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=delay)
                delay = min(delay * 2, RECONNECT_MAX_SECONDS)
