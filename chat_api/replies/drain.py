"""A deploy's SIGTERM: stop taking replies, let the running ones end, then stop the rest.

uvicorn on SIGTERM closes its listening socket and waits (`timeout_graceful_shutdown`) for
open connections; only then does the app's lifespan end. The drain starts at the signal
itself, not at the lifespan's end, so that every open stream is still connected when its
reply ends:

1. at once: `draining` is set, so every door refuses a new reply with 503 and `Retry-After`
   (in its protocol's shape) and `/readyz` answers 503: a load balancer sends work elsewhere;
2. the replies this process runs go on for up to SHUTDOWN_DRAIN_SECONDS; one that ends
   meanwhile ends as it would have (completed, stopped);
3. then the rest are stopped with `StopReason.SHUTDOWN` (`ReplyRunner.shutdown`): each ending
   is stored (`interrupted_by_error` / `server_shutdown`, with every delta) and sent to the
   reply's live streams in their protocol's shape before their connections close, so a
   client sees a clean end, and a resume on another replica replays the same ending.

A second signal cuts the wait short (step 3 at once). uvicorn gives the connections
SHUTDOWN_DRAIN_SECONDS + ENDING_SECONDS (`graceful_shutdown_seconds`) before it cancels them.
Streams that follow a reply another replica runs have no ending here: once this process's
replies have ended, the SSE ones are closed (sse-starlette's exit, held back until then), and
their clients resume elsewhere; the AI SDK and AG-UI ones are cut when uvicorn's wait ends.
uvicorn would close every WebSocket at the signal; `chatmem serve` leaves them open
(chat_api/cli/serve.py), and a Responses WebSocket closes itself once the drain is over.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from sse_starlette.sse import AppStatus

from chat_api.replies.registry import ReplyRegistry
from chat_api.replies.run import ReplyRunner
from memory.config import Settings

log = logging.getLogger(__name__)

# After the drain: time to store the stopped replies' endings and send them to their streams.
ENDING_SECONDS = 5
# A refused client is told to try again after this many seconds (on another replica, by then).
RETRY_AFTER_SECONDS = 1
# The signals a server stops on (uvicorn's own).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def graceful_shutdown_seconds(settings: Settings) -> int:
    """uvicorn's `timeout_graceful_shutdown`: the drain, then time for the endings to reach clients."""
    return math.ceil(settings.shutdown_drain_seconds) + ENDING_SECONDS


class Drain:
    """This process's drain: begun once (by a stop signal, or `begin()`), done when no reply runs here."""

    def __init__(
        self,
        runner: ReplyRunner,
        registry: ReplyRegistry,
        *,
        seconds: float,
        refuse_replies: Callable[[int], None],
    ) -> None:
        self.runner = runner
        self.refuse_replies = refuse_replies  # the admission's `close`: new replies get 503
        self.registry = registry
        self.seconds = seconds
        self.draining = False
        self._cut_short = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._signalled = False  # begun by a stop signal: the process is exiting
        self._over = asyncio.Event()

    def begin(self, *, now: bool = False) -> None:
        """Stop taking replies and start the drain; called again (or `now`), stop the running replies now."""
        if self._task is not None or now:
            self._cut_short.set()
        if self._task is not None:
            return
        self.draining = True
        self.refuse_replies(RETRY_AFTER_SECONDS)
        if not now:
            log.warning("shutting down: new replies refused; running ones get %.0f s to end", self.seconds)
        self._task = asyncio.create_task(self._run(), name="drain")

    async def wait(self) -> None:
        """Until the drain (if begun) is over: every reply of this process ended and stored."""
        if self._task is not None:
            await asyncio.shield(self._task)

    async def over(self) -> None:
        """Until a drain has begun and is over (waiting for one to begin): for connections that
        outlive their replies, such as a Responses WebSocket, which close then."""
        await self._over.wait()

    async def _run(self) -> None:
        deadline = time.monotonic() + self.seconds
        cut_short = asyncio.create_task(self._cut_short.wait())
        try:
            while running := [r for r in self.registry.all() if not r.finished.is_set()]:
                left = deadline - time.monotonic()
                if left <= 0 or self._cut_short.is_set():
                    break
                ends = [asyncio.create_task(r.finished.wait()) for r in running]
                try:
                    await asyncio.wait([*ends, cut_short], timeout=left, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for end in ends:
                        end.cancel()
        finally:
            cut_short.cancel()
        if any(not r.finished.is_set() for r in self.registry.all()):
            log.warning("shutting down: stopping the replies still running")
        await self.runner.shutdown()
        if self._signalled:
            # Every reply of this process has ended and its streams with it. The SSE streams still
            # open follow replies other replicas run: sse-starlette closes them now (their clients
            # resume elsewhere) rather than uvicorn holding the exit until its timeout. Only on a
            # signal: the flag is process-wide, and the process is exiting.
            AppStatus.should_exit = True
        self._over.set()

    def on_stop_signals(self) -> Callable[[], None]:
        """Begin the drain on SIGTERM/SIGINT, then let the server's own handler run; returns the undo.

        Only in the main thread (where signals are handled); elsewhere this does nothing and
        the drain begins at the lifespan's end.
        """
        # sse-starlette would end every EventSourceResponse at the signal, before its reply's
        # ending is sent; the drain ends them instead, through their replies.
        AppStatus.disable_automatic_graceful_drain()
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        loop = asyncio.get_running_loop()
        previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}

        def handle(sig: int, frame: FrameType | None) -> None:
            self._signalled = True
            # A process that made the app more than once (an embedding, the tests) can keep this
            # handler after the app's loop closed (undo only removes it while it is the current
            # one): that app has nothing left to drain, the handler before it still runs.
            if not loop.is_closed():
                # In a fresh context: the signal interrupts whatever ran, often a request, whose
                # context (request id, tenant, user) the drain's logs and task must not carry.
                loop.call_soon_threadsafe(self.begin, context=contextvars.Context())
            before: Any = previous[signal.Signals(sig)]
            if callable(before):
                before(sig, frame)

        for sig in STOP_SIGNALS:
            signal.signal(sig, handle)

        def undo() -> None:
            for sig, before in previous.items():
                if signal.getsignal(sig) is handle:
                    signal.signal(sig, before)

        return undo
