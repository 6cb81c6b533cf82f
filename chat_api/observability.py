"""Structured JSON logs, request ids, and the /metrics endpoint.

Log lines are one JSON object each, carrying the ids of whatever is being worked on:
the request id (taken from `X-Request-ID` when the client sends a sane one, else made
up, and always returned), and the tenant, user, conversation and turn ids that code
binds with `bind_log_context` or `log_context`. The ids live in one mutable dict per
request held by a context variable: a sync dependency runs in a worker thread on a
*copy* of the context, and a reply task copies the context when it starts, but both
copies point at the same dict, so an id bound there still reaches the request's log line.

Message text never reaches a log unless LOG_MESSAGE_TEXT is on: code that wants to log
text passes it through `loggable_text`.

The request log is pure ASGI middleware rather than `BaseHTTPMiddleware`, which would
buffer responses through a task and break SSE cancellation.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import re
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from sqlalchemy import text
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from chat_api import metrics
from memory.config import Settings
from memory.recall.reindex import build_running
from memory.storage.models import OUTBOX_SEQ

log = logging.getLogger("chatmem.access")

REQUEST_ID_HEADER = "x-request-id"
# A client's request id is echoed into logs and headers: keep it short and printable.
SAFE_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")

_context: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "chatmem_log_context", default=None
)
_allow_message_text = False

OUTBOX_STATE_KAFKA = text(
    """
    SELECT count(*) AS backlog, coalesce(extract(epoch FROM now() - min(created_at)), 0) AS age,
           (SELECT count(*) FROM dead_letters) AS dead
    FROM outbox WHERE published_at IS NULL AND consumed_at IS NULL AND dead_at IS NULL
    """
)
OUTBOX_STATE_PG = text(
    """
    SELECT count(*) AS backlog, coalesce(extract(epoch FROM now() - min(created_at)), 0) AS age,
           (SELECT count(*) FROM dead_letters) AS dead
    FROM outbox WHERE consumed_at IS NULL AND dead_at IS NULL
    """
)
# Kafka: rows published but not consumed by the indexer (its consumer lag), newest first and at
# most UNCONSUMED_CAP of them, over ix_outbox_unconsumed. Rows at or below their conversation's
# watermark are not counted: the Kafka path consumed rows before it marked them consumed, and
# those stay unmarked.
UNCONSUMED_CAP = 100_000
OUTBOX_UNCONSUMED_KAFKA = text(
    f"""
    SELECT count(*) AS unconsumed, coalesce(extract(epoch FROM now() - min(o.created_at)), 0) AS age
    FROM (
        SELECT id, conversation_id, created_at, payload FROM outbox
        WHERE consumed_at IS NULL AND dead_at IS NULL AND published_at IS NOT NULL
        ORDER BY id DESC LIMIT {UNCONSUMED_CAP}
    ) o
    JOIN conversations c ON c.id = o.conversation_id
    WHERE {OUTBOX_SEQ.format(t="o.")} > c.indexed_seq
    """
)
# A scrape must stay cheap even with a huge backlog: give up rather than hold a connection.
OUTBOX_QUERY_TIMEOUT = "SET LOCAL statement_timeout = '2s'"
# /metrics needs no token, so the outbox is read at most this often however often it is asked.
OUTBOX_REFRESH_SECONDS = 5.0


# --- log context -------------------------------------------------------------------


def bind_log_context(**ids: object) -> None:
    """Add ids (tenant_id, conversation_id, turn_id, …) to the current request's or task's log lines."""
    bound = _context.get()
    values = {key: str(value) for key, value in ids.items() if value is not None}
    if bound is None:
        _context.set(values)
    else:
        bound.update(values)


@contextlib.contextmanager
def log_context(**ids: object) -> Iterator[dict[str, str]]:
    """Within the block, log lines carry these ids on top of the current ones (a fresh scope)."""
    values = {**(_context.get() or {}), **{k: str(v) for k, v in ids.items() if v is not None}}
    token = _context.set(values)
    try:
        yield values
    finally:
        _context.reset(token)


def loggable_text(value: str | None) -> str:
    """The text itself when LOG_MESSAGE_TEXT allows it, else only its length."""
    if value is None:
        return ""
    return value if _allow_message_text else f"<{len(value)} chars>"


# --- logging setup -----------------------------------------------------------------


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, bound ids and `extra=` fields."""

    # Attributes every LogRecord has; anything else on a record came from `extra=`.
    RESERVED = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        entry.update(_context.get() or {})
        for key, value in vars(record).items():
            if key not in self.RESERVED and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def configure_logging(settings: Settings, *, stream: Any = None) -> None:
    """Route every log record (ours, uvicorn's, libraries') to one JSON-lines handler on stderr."""
    global _allow_message_text
    _allow_message_text = settings.log_message_text
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.log_level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        # uvicorn installs its own handlers; ours on the root logger is the only one.
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    # The request log below replaces uvicorn's access log (it has ids and durations).
    logging.getLogger("uvicorn.access").disabled = True
    # HTTP clients log each request's URL at INFO, and a URL can carry user content (the
    # query of a memory search `chatmem mcp` makes): no user content in logs at INFO.
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)


# --- request logging ---------------------------------------------------------------


def _route_template(scope: Scope) -> str:
    # Starlette leaves the matched route in the scope; its path template keeps labels bounded.
    route = scope.get("route")
    path = getattr(route, "path", None)
    return str(path) if path else "unmatched"


class RequestLog:
    """Logs one JSON line per request (id, method, path, status, duration) and counts it in metrics."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        offered = headers.get(REQUEST_ID_HEADER.encode(), b"").decode("latin-1")
        request_id = offered if SAFE_REQUEST_ID.match(offered) else uuid.uuid4().hex
        started = time.perf_counter()
        status = 500
        token = _context.set({"request_id": request_id})

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                message = {
                    **message,
                    "headers": [
                        *[(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"],
                        (b"x-request-id", request_id.encode()),
                    ],
                }
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            seconds = time.perf_counter() - started
            route = _route_template(scope)
            metrics.observe_request(route, status, seconds)
            log.info(
                "request",
                extra={
                    "method": scope.get("method"),
                    "path": scope.get("path"),
                    "route": route,
                    "status": status,
                    "duration_ms": round(seconds * 1000, 2),
                },
            )
            _context.reset(token)


# --- /metrics ----------------------------------------------------------------------


# The memory index's generations that are searched or being built (a rebuild's progress).
MEMORY_INDEXES = text(
    "SELECT id, state, spec->>'runtime' AS runtime, rows_done, rows_total, "
    f"state = 'building' AND {build_running('id')} AS running FROM memory_indexes "
    "WHERE state IN ('active', 'building')"
)


class OutboxGauges:
    """The outbox gauges, read from the database at most every OUTBOX_REFRESH_SECONDS.

    `/metrics` is public (scrapers carry no token): a flood of scrapes must not become a
    flood of queries, each holding a pooled connection for up to two seconds. Scrapes
    arriving together share one read; the others answer with the gauges as they are.
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._read_at = -OUTBOX_REFRESH_SECONDS
        self._reading = False

    async def refresh(self, request: Request) -> None:
        """Read the outbox backlogs (relay; indexer on Kafka), ages, dead letters into the gauges when due."""
        services = getattr(request.app.state, "services", None)
        if services is None or self._reading or self.clock() - self._read_at < OUTBOX_REFRESH_SECONDS:
            return
        self._reading, self._read_at = True, self.clock()
        query = OUTBOX_STATE_KAFKA if services.settings.kafka_bootstrap_servers else OUTBOX_STATE_PG
        try:
            async with services.db.transaction() as session:
                await session.execute(text(OUTBOX_QUERY_TIMEOUT))
                row = (await session.execute(query)).one()
                unconsumed = (
                    (await session.execute(OUTBOX_UNCONSUMED_KAFKA)).one()
                    if services.settings.kafka_bootstrap_servers
                    else None
                )
                generations = (await session.execute(MEMORY_INDEXES)).all()
        except Exception as exc:
            # A scrape must not fail because the database is slow; the gauges keep their last values.
            logging.getLogger(__name__).warning("metrics: outbox state unavailable: %r", exc)
            return
        finally:
            self._reading = False
        metrics.set_outbox_state(int(row.backlog), float(row.age), int(row.dead))
        metrics.set_outbox_unconsumed(
            int(unconsumed.unconsumed) if unconsumed else 0, float(unconsumed.age) if unconsumed else 0.0
        )
        metrics.set_memory_indexes(
            [(g.id, g.state, g.runtime, g.rows_done, g.rows_total, g.running) for g in generations]
        )


def install_observability(app: FastAPI, settings: Settings) -> None:
    """Add /metrics (Prometheus text format) and the JSON request log to the app."""

    gauges = OutboxGauges()

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics(request: Request) -> Response:
        await gauges.refresh(request)
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    # Added last, so it is the outermost middleware: it sees every response, 413s and 429s included.
    app.add_middleware(RequestLog)
