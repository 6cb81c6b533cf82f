"""The standalone workers' METRICS_PORT: /metrics, /healthz, and the indexer's /readyz.

Shapes as the API's (chat_api/routes/health.py): /healthz says the process is up; /readyz is
200 `{"status": "ready", ...}` or 503 `{"status": "unavailable" | "shutting_down" | "starting",
...}`. An API process that refuses memory is still ready (replies go on without it); an indexer
that refuses memory, or has lost its queue (the Postgres outbox, or the Kafka broker), indexes
nothing, so it is not: `"memory"` and `"queue"` say `"ok"` or `"unavailable: why"`.

Served from a daemon thread (as prometheus_client's own server): a check that needs the
database runs on the worker's event loop.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app

# (HTTP status, body) of /readyz; None: this worker answers no /readyz (the relay).
Readiness = Callable[[], tuple[int, dict[str, str]]]

STATUS_LINES = {200: "200 OK", 404: "404 Not Found", 503: "503 Service Unavailable"}


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # a healthcheck every few seconds
        pass


def health_app(readiness: Readiness | None) -> Callable[..., Iterable[bytes]]:
    """/healthz, /readyz (when `readiness` is given), and everything else to Prometheus."""
    metrics = make_wsgi_app()

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/healthz":
            return _json(start_response, 200, {"status": "ok"})
        if path == "/readyz" and readiness is not None:
            status, body = readiness()
            return _json(start_response, status, body)
        return metrics(environ, start_response)  # type: ignore[no-any-return]

    return app


def _json(start_response: Callable[..., Any], status: int, body: dict[str, str]) -> list[bytes]:
    data = json.dumps(body).encode()
    headers = [("Content-Type", "application/json"), ("Content-Length", str(len(data)))]
    if status == 503 and body.get("status") == "shutting_down":
        headers.append(("Retry-After", "1"))
    start_response(STATUS_LINES[status], headers)
    return [data]


def serve_health(host: str, port: int, readiness: Readiness | None) -> None:
    """Serve `health_app` on host:port from a daemon thread."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]  # "::" too

    class Server(_Server):
        address_family = family

    server = make_server(host, port, health_app(readiness), Server, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, daemon=True, name="metrics").start()
