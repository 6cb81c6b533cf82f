"""This process's limits, and the calls every door that costs work makes: `Admission`.

All of them are kept in this process's memory, so with N API replicas a user gets up to
N times the configured numbers (a load balancer with sticky users, or a shared store,
would be needed for a global limit). That is the intended trade: no extra moving part,
no network hop on every request, and the limits still stop one client from exhausting a
replica. Every refusal is `chat_api.errors.RateLimited` (429 with `Retry-After`, in the
door's protocol shape) or `InvalidInput` for a request no wait would make acceptable. Once
the process shuts down (`close`), every new reply is `ShuttingDown` (503 with `Retry-After`).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

from chat_api import metrics
from chat_api.admission.bucket import TokenBuckets
from chat_api.admission.imports import AdmittedImport
from chat_api.admission.running import AdmittedReply, RunningReplies
from chat_api.admission.streams import StreamLimit, StreamSlot
from chat_api.errors import RateLimited, ShuttingDown
from chat_api.replies.registry import ReplyRegistry
from memory.config import Settings
from memory.errors import InvalidInput
from memory.record.conversations import Owner
from memory.record.imports import ImportTurn, parse_import

MINUTE = 60.0
HOUR = 3600.0
# Batches larger than this are validated in a worker thread (megabytes of JSON).
INLINE_IMPORT_TURNS = 200


def _retry_after(wait: float) -> int:
    return max(math.ceil(wait), 1)


class Admission:
    """Rates, caps and quotas of this process; each door asks it before it does the work."""

    def __init__(
        self, settings: Settings, registry: ReplyRegistry, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings = settings
        self.requests: TokenBuckets[Owner] = TokenBuckets(settings.rate_limit_per_minute, MINUTE, clock=clock)
        self.stops: TokenBuckets[Owner] = TokenBuckets(settings.stops_per_minute, MINUTE, clock=clock)
        self.auth_failures: TokenBuckets[str] = TokenBuckets(
            settings.auth_failures_per_minute, MINUTE, clock=clock
        )
        self.imports: TokenBuckets[Owner] = TokenBuckets(settings.import_turns_per_hour, HOUR, clock=clock)
        self.streams = StreamLimit(settings.max_streams_per_user)
        self.running = RunningReplies(settings.max_running_replies_per_user, registry)
        self.closed_retry_after: int | None = None  # set when the process shuts down

    def close(self, retry_after: int) -> None:
        """Refuse every new reply from now on (the process is shutting down)."""
        self.closed_retry_after = retry_after

    def check_open(self) -> None:
        """ShuttingDown once the process shuts down: also for a request admitted earlier that waited
        (in its conversation's line) and would start its reply only now."""
        if self.closed_retry_after is not None:
            raise ShuttingDown(
                "this server is shutting down; send the request again", retry_after=self.closed_retry_after
            )

    # --- every authenticated request -----------------------------------------------------

    def check_address(self, address: str) -> None:
        """RateLimited when this client address has used up its failed authentications (ask first)."""
        wait = self.auth_failures.wait(address)
        if wait > 0:
            metrics.observe_rate_limited("auth_failures")
            raise RateLimited("too many failed authentications from this address", _retry_after(wait))

    def failed_authentication(self, address: str) -> None:
        """Count one failed authentication from this address."""
        self.auth_failures.drain(address)

    def admit_request(self, owner: Owner) -> None:
        """Charge one request to the user's RATE_LIMIT_PER_MINUTE, or RateLimited."""
        wait = self.requests.take(owner)
        if wait > 0:
            metrics.observe_rate_limited("requests_per_minute")
            raise RateLimited(f"more than {self.requests.capacity} requests per minute", _retry_after(wait))

    def admit_stop(self, owner: Owner) -> None:
        """Charge one stop to the user's STOPS_PER_MINUTE, or RateLimited; never to the request rate.

        A user at RATE_LIMIT_PER_MINUTE can still stop their replies: a stop ends work, it
        starts none, so only its own (generous) allowance bounds it.
        """
        wait = self.stops.take(owner)
        if wait > 0:
            metrics.observe_rate_limited("stops_per_minute")
            raise RateLimited(f"more than {self.stops.capacity} stops per minute", _retry_after(wait))

    # --- work a request starts -----------------------------------------------------------

    def admit_reply(self, owner: Owner, *, stream: bool) -> AdmittedReply:
        """A place for one more running reply (and a stream slot if `stream`), or RateLimited.

        Call it before anything is stored, so a refusal leaves nothing behind.
        """
        self.check_open()
        self.running.reserve(owner)
        try:
            slot = self.streams.acquire(owner) if stream else None
        except BaseException:
            self.running.unreserve(owner)
            raise
        return AdmittedReply(self.running, owner, slot)

    def admit_stream(self, owner: Owner) -> StreamSlot:
        """A slot for one more held stream (following a reply, an MCP stream), or RateLimited."""
        return self.streams.acquire(owner)

    async def admit_import(self, owner: Owner, raw_turns: object) -> AdmittedImport:
        """Validated turns charged to the user's import quota: InvalidInput, or RateLimited past the quota.

        `raw_turns` is the JSON list of turns as an import request holds them; the rules
        are `memory.record.imports.parse_import`'s (IMPORT_MAX_TURNS a request, MAX_MESSAGE_CHARS
        a turn), the quota IMPORT_TURNS_PER_HOUR.
        """
        limits = {"max_turns": self.settings.import_max_turns, "max_chars": self.settings.max_message_chars}
        if isinstance(raw_turns, list) and len(raw_turns) > INLINE_IMPORT_TURNS:
            turns = await asyncio.to_thread(parse_import, raw_turns, **limits)
        else:
            turns = parse_import(raw_turns, **limits)
        self._charge_import(owner, turns)
        return AdmittedImport(self.imports, owner, turns)

    def _charge_import(self, owner: Owner, turns: list[ImportTurn]) -> None:
        per_hour = self.imports.capacity
        if self.imports.limited and len(turns) > per_hour:
            raise InvalidInput(
                f"{len(turns)} turns is more than the import quota of {per_hour} an hour; send fewer",
                field="turns",
                turns_per_hour=per_hour,
            )
        wait = self.imports.take(owner, len(turns))
        if wait > 0:
            metrics.observe_rate_limited("import_turns_per_hour")
            raise RateLimited(f"more than {per_hour} imported turns an hour", _retry_after(wait))
