"""`chatmem up` and `chatmem serve`: the API process, with the indexer in it where asked.

With `--workers N` (N > 1), N API processes share the port (uvicorn's supervisor), each with
its own encoder, database pools and LISTEN connection; they are replicas, so stop, resume and
approvals work whichever one holds the stream. Per-user limits (rate, streams, running
replies) are per process, as they are per replica: a user may get up to N times them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from chat_api.auth import KeyFileError, TokenVerifier, issue_token
from chat_api.cli.installation import (
    DEFAULT_TENANT,
    DEFAULT_USER,
    CommandError,
    check_address_free,
    check_database,
    installation_secret,
    load_settings,
    migrate,
)
from memory.config import Settings


def embedded_workers(settings: Settings) -> list[Any]:
    """The relay or Postgres consumer and the indexer, run inside the API process."""
    from chat_api.app import fact_asker
    from indexer.worker import IndexerWorker, OutboxRelay
    from memory.recall.embeddings import SentenceTransformerEmbedder
    from memory.recall.index import MemoryIndex, open_index

    async def indexer(services: Any, stop: asyncio.Event) -> None:
        index: MemoryIndex = services.embedder
        encoder = index.generation_encoder()
        if isinstance(encoder, SentenceTransformerEmbedder):
            # A second copy of the weights (~90 MB): otherwise a reply's query waits for the
            # indexer's batch to finish encoding (search p95 5x its idle figure while importing).
            encoder = encoder.twin()
            await asyncio.to_thread(encoder.load)
        twin = await open_index(services.db, settings, encoder, threads=0)
        facts = fact_asker(settings, services.provider)
        # The recall's cache of turn vectors: a turn recall encoded while unindexed is not encoded again.
        vectors = services.recaller.turn_vectors
        await IndexerWorker(services.db, settings, twin, facts=facts, vectors=vectors).run(stop)

    async def relay(services: Any, stop: asyncio.Event) -> None:
        await OutboxRelay(services.db, settings).run(stop)

    return [indexer, relay] if settings.kafka_bootstrap_servers else [indexer]


# Handed from `serve --workers N` to its API processes (spawned: they cannot receive objects).
WORKER_UI_TOKEN_ENV = "CHATMEM_WORKER_UI_TOKEN"


def app_from_environment() -> Any:
    """One API process of `serve --workers N` (uvicorn's factory; settings from the environment)."""
    from chat_api.app import create_app
    from chat_api.observability import configure_logging
    from memory.config import get_settings

    settings = get_settings()
    configure_logging(settings)
    return create_app(settings, ui_token=os.environ.get(WORKER_UI_TOKEN_ENV), freeze_startup_objects=True)


def _serve_processes(
    settings: Settings, processes: int, with_indexer: bool, banner: str | None, ui_token: str | None
) -> None:
    """N API processes on one port (uvicorn's supervisor restarts one that dies), and the indexer
    (and relay) in one more process, not in every API process: one indexer encoder, not N."""
    from chat_api.replies.drain import graceful_shutdown_seconds

    assert settings.database_url is not None
    os.environ["DATABASE_URL"] = settings.database_url
    os.environ["DATA_DIR"] = str(settings.data_dir)  # where the encoder export is cached
    if settings.jwt_secret is not None:
        os.environ["JWT_SECRET"] = settings.jwt_secret.get_secret_value()
    if ui_token:
        os.environ[WORKER_UI_TOKEN_ENV] = ui_token
    # Every process of the server writes its metrics where a scrape of any worker reads them all.
    metrics_dir = _shared_metrics_dir(settings)
    children: list[subprocess.Popen[bytes]] = []
    if with_indexer:
        command = [sys.executable, "-m", "chat_api.cli"]
        children.append(subprocess.Popen([*command, "indexer"]))
        if settings.kafka_bootstrap_servers:
            children.append(subprocess.Popen([*command, "relay"]))
    if banner:
        threading.Thread(target=_announce_when_ready, args=(settings, banner), daemon=True).start()
    try:
        uvicorn.run(
            "chat_api.cli.serve:app_from_environment",
            factory=True,
            workers=processes,
            host=settings.host,
            port=settings.port,
            log_level=settings.log_level.lower(),
            lifespan="on",
            timeout_graceful_shutdown=graceful_shutdown_seconds(settings),
            ws=DrainedWebSocketProtocol,
            log_config=None,
            access_log=False,
        )
    finally:
        for child in children:
            child.terminate()
        for child in children:
            try:
                child.wait(20)
            except subprocess.TimeoutExpired:
                child.kill()
        if metrics_dir.owned:
            shutil.rmtree(metrics_dir.path, ignore_errors=True)


@dataclass(frozen=True)
class _MetricsDir:
    path: Path
    owned: bool  # made for this run (removed at exit), not the operator's own directory


def _shared_metrics_dir(settings: Settings) -> _MetricsDir:
    """PROMETHEUS_MULTIPROC_DIR for the server's processes, emptied of an earlier run's files.

    An operator's own directory is used and kept; otherwise one is made under DATA_DIR for
    this run. Set before the processes start: prometheus_client reads it at import.
    """
    from chat_api.metrics import MULTIPROCESS_DIR_ENV

    given = os.environ.get(MULTIPROCESS_DIR_ENV)
    if given:
        path = Path(given)
        path.mkdir(parents=True, exist_ok=True)
        for stale in path.glob("*.db"):
            stale.unlink(missing_ok=True)
        return _MetricsDir(path, owned=False)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix="metrics-", dir=settings.data_dir))
    os.environ[MULTIPROCESS_DIR_ENV] = str(path)
    return _MetricsDir(path, owned=True)


def _announce_when_ready(settings: Settings, banner: str) -> None:
    import httpx

    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://{host}:{settings.port}/readyz", timeout=2).status_code == 200:
                print(banner, flush=True)
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


def _serve(
    settings: Settings,
    workers: list[Any],
    banner: str | None,
    ui_token: str | None = None,
    *,
    processes: int = 1,
) -> None:
    if processes > 1:
        _serve_processes(settings, processes, bool(workers), banner, ui_token)
        return
    from chat_api.app import create_app
    from chat_api.replies.drain import graceful_shutdown_seconds
    from chat_api.tools import ToolConfigError

    try:
        app = create_app(settings, workers=workers, ui_token=ui_token, freeze_startup_objects=True)
    except ToolConfigError as exc:
        raise CommandError(str(exc)) from None
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        lifespan="on",
        timeout_graceful_shutdown=graceful_shutdown_seconds(settings),
        ws=DrainedWebSocketProtocol,
        log_config=None,  # JSON logs from configure_logging; one line per request from RequestLog
        access_log=False,
    )
    server = AnnouncingServer(config, banner)
    server.run()


class DrainedWebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's WebSocket protocol, except that a stop signal leaves an open connection to the app.

    uvicorn closes every WebSocket at the signal (1012), before the drain has ended the
    connection's response (chat_api/replies/drain.py). The app closes it instead, once the
    drain is over and the response's ending has been sent; uvicorn's graceful-shutdown timeout
    still bounds the wait (it cancels the connection's task, and the connection closes).
    """

    def shutdown(self) -> None:
        if self.handshake_complete and not self.close_sent:
            return
        super().shutdown()


class AnnouncingServer(uvicorn.Server):
    """A uvicorn server that prints its banner once it is really listening."""

    def __init__(self, config: uvicorn.Config, banner: str | None) -> None:
        super().__init__(config)
        self.banner = banner

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.started and self.banner:
            print(self.banner, flush=True)


def check_data_dir(data_dir: Path) -> None:
    """Fail in one line if the installation's directory cannot be made or written."""
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=data_dir):
            pass
    except OSError as exc:
        raise CommandError(f"cannot use the data directory {data_dir}: {exc.strerror or exc}") from None


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def cmd_up(args: argparse.Namespace) -> None:
    from memory.storage.embedded import EmbeddedPostgres

    # `kill` and service managers send SIGTERM: it stops `up` as Ctrl-C does. uvicorn re-raises
    # the signal once it has shut down, and Python's default action for SIGTERM would end the
    # process there, before the embedded Postgres below is stopped.
    signal.signal(signal.SIGTERM, _interrupt)
    base = load_settings(host=args.host, port=args.port, data_dir=args.data_dir)
    check_address_free(base.host, base.port)
    data_dir = base.data_dir.expanduser()
    check_data_dir(data_dir)
    secret = installation_secret(base, create=True)
    postgres = EmbeddedPostgres(data_dir)
    print(f"chatmem: starting the embedded Postgres in {data_dir / 'pg'} …", flush=True)
    try:
        url = postgres.start()
        migrate(url)
        settings = load_settings(
            host=args.host, port=args.port, data_dir=data_dir, database_url=url, jwt_secret=secret
        )
        token = issue_token(secret, DEFAULT_TENANT, DEFAULT_USER)
        shown_host = "localhost" if settings.host in ("127.0.0.1", "0.0.0.0") else settings.host
        banner = (
            f"chatmem is up: http://{shown_host}:{settings.port}  (API docs: /docs)\n"
            f"model: {model_name(settings)}\n"
            f"access token (tenant {DEFAULT_TENANT!r}, user {DEFAULT_USER!r}):\n{token}\n"
            "Ctrl-C stops everything, including the embedded Postgres."
        )
        # The page picks the token up by itself only when nobody else can reach the port.
        loopback = settings.host in ("127.0.0.1", "localhost", "::1")
        _serve(
            settings,
            embedded_workers(settings),
            banner,
            ui_token=token if loopback else None,
            processes=args.workers,
        )
    finally:
        postgres.stop()
        print("chatmem: stopped.", flush=True)


def cmd_serve(args: argparse.Namespace) -> None:
    settings = load_settings(host=args.host, port=args.port)
    if not settings.database_url:
        raise CommandError("DATABASE_URL is not set (chatmem serve needs an external Postgres with pgvector)")
    if settings.jwt_secret is None and settings.jwt_public_key_file is None:
        raise CommandError("JWT_SECRET (or JWT_PUBLIC_KEY_FILE) is not set")
    try:
        TokenVerifier(settings)  # a public key file that cannot be read stops the start here
    except KeyFileError as exc:
        raise CommandError(str(exc)) from None
    check_address_free(settings.host, settings.port)
    check_database(settings.database_url)
    migrate(settings.database_url)
    workers = embedded_workers(settings) if args.with_workers else []
    _serve(
        settings,
        workers,
        f"chatmem serving on http://{settings.host}:{settings.port} (model: {model_name(settings)})",
        processes=args.workers,
    )


def model_name(settings: Settings) -> str:
    """The model replies come from, as the banner names it."""
    if settings.llm_provider == "demo":
        return "demo (offline demo model, not a real LLM)"
    return f"{settings.llm_model} at {settings.llm_base_url or 'the OpenAI API'}"
