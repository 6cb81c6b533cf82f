"""`chatmem up` and `chatmem serve`: the API process, with the indexer in it where asked."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import uvicorn

from chat_api.auth import issue_token
from chat_api.cli.installation import (
    DEFAULT_TENANT,
    DEFAULT_USER,
    CommandError,
    check_database,
    installation_secret,
    load_settings,
    migrate,
)
from memory.config import Settings


def embedded_workers(settings: Settings) -> list[Any]:
    """The relay or Postgres consumer and the indexer, run inside the API process."""
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
        await IndexerWorker(services.db, settings, twin).run(stop)

    async def relay(services: Any, stop: asyncio.Event) -> None:
        await OutboxRelay(services.db, settings).run(stop)

    return [indexer, relay] if settings.kafka_bootstrap_servers else [indexer]


def _serve(settings: Settings, workers: list[Any], banner: str | None, ui_token: str | None = None) -> None:
    from chat_api.app import create_app
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
        timeout_graceful_shutdown=10,
        log_config=None,  # JSON logs from configure_logging; one line per request from RequestLog
        access_log=False,
    )
    server = AnnouncingServer(config, banner)
    server.run()


class AnnouncingServer(uvicorn.Server):
    """A uvicorn server that prints its banner once it is really listening."""

    def __init__(self, config: uvicorn.Config, banner: str | None) -> None:
        super().__init__(config)
        self.banner = banner

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.started and self.banner:
            print(self.banner, flush=True)


def cmd_up(args: argparse.Namespace) -> None:
    from memory.storage.embedded import EmbeddedPostgres

    base = load_settings(host=args.host, port=args.port, data_dir=args.data_dir)
    data_dir = base.data_dir.expanduser()
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
        model_note = " (offline demo model, not a real LLM)" if settings.llm_provider == "demo" else ""
        banner = (
            f"chatmem is up: http://{shown_host}:{settings.port}  (API docs: /docs)\n"
            f"model: {settings.llm_provider}{model_note}\n"
            f"access token (tenant {DEFAULT_TENANT!r}, user {DEFAULT_USER!r}):\n{token}\n"
            "Ctrl-C stops everything, including the embedded Postgres."
        )
        # The page picks the token up by itself only when nobody else can reach the port.
        loopback = settings.host in ("127.0.0.1", "localhost", "::1")
        _serve(settings, embedded_workers(settings), banner, ui_token=token if loopback else None)
    finally:
        postgres.stop()
        print("chatmem: stopped.", flush=True)


def cmd_serve(args: argparse.Namespace) -> None:
    settings = load_settings(host=args.host, port=args.port)
    if not settings.database_url:
        raise CommandError("DATABASE_URL is not set (chatmem serve needs an external Postgres with pgvector)")
    if settings.jwt_secret is None and settings.jwt_public_key_file is None:
        raise CommandError("JWT_SECRET (or JWT_PUBLIC_KEY_FILE) is not set")
    check_database(settings.database_url)
    migrate(settings.database_url)
    workers = embedded_workers(settings) if args.with_workers else []
    _serve(settings, workers, f"chatmem serving on http://{settings.host}:{settings.port}")
