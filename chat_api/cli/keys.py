"""`chatmem keys create|list|revoke`: the operator's way to hand out and withdraw API keys.

Against DATABASE_URL, or the `chatmem up` installation in DATA_DIR (`--data-dir`), running
or not (chat_api.cli.installation.installation_database).
"""

from __future__ import annotations

import argparse
import asyncio
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from sqlalchemy.ext.asyncio import AsyncSession

from chat_api.cli.installation import DEFAULT_TENANT, DEFAULT_USER, CommandError, identity
from memory.accounts.keys import KeyInfo, create_key, list_keys, revoke_key
from memory.errors import DomainError
from memory.record.conversations import Owner
from memory.storage.db import Database
from memory.storage.tenancy import tenant_scope

T = TypeVar("T")


def add_keys_arguments(keys: argparse.ArgumentParser) -> None:
    """The `keys` subcommands, each run by `run_keys_command`."""
    sub = keys.add_subparsers(dest="keys_command", required=True)
    create = sub.add_parser("create", help="make a key for one user; it is printed once")
    create.add_argument("--name", default="")
    create.add_argument("--expires", type=float, metavar="DAYS", help="lifetime in days (default: none)")
    listing = sub.add_parser("list", help="a user's keys (never the keys themselves)")
    revoke = sub.add_parser("revoke", help="revoke a key by its id: it stops working at once")
    revoke.add_argument("key_id", type=uuid.UUID)
    for command in (create, listing, revoke):
        command.add_argument(
            "--tenant", type=identity, default=DEFAULT_TENANT, help=f"default {DEFAULT_TENANT!r}"
        )
        command.add_argument("--user", type=identity, default=DEFAULT_USER, help=f"default {DEFAULT_USER!r}")
        command.add_argument(
            "--data-dir", type=Path, help="the `chatmem up` installation (when DATABASE_URL is not set)"
        )


def _line(info: KeyInfo) -> str:
    state = (
        "revoked" if info.revoked_at else f"expires {info.expires_at:%Y-%m-%d}" if info.expires_at else "live"
    )
    return f"{info.id}  {info.prefix}…  {info.created_at:%Y-%m-%d}  {state}  {info.name}"


def run_keys_command(args: argparse.Namespace, database_url: str) -> None:
    """Run one `keys` subcommand against the database and print its outcome."""
    owner = Owner(args.tenant, args.user)
    if args.keys_command == "create":
        info, key = _run(
            database_url, owner, lambda s: create_key(s, owner, name=args.name, expires_days=args.expires)
        )
        print(key)
        print(f"# {_line(info)} (shown once: only its hash is stored)")
    elif args.keys_command == "list":
        for info in _run(database_url, owner, lambda s: list_keys(s, owner)):
            print(_line(info))
    else:
        print(_line(_run(database_url, owner, lambda s: revoke_key(s, owner, args.key_id))))


def _run(database_url: str, owner: Owner, work: Callable[[AsyncSession], Awaitable[T]]) -> T:
    async def main() -> T:
        db = Database(database_url, pool_size=1)
        try:
            with tenant_scope(owner.tenant_id):
                async with db.transaction() as session:
                    return await work(session)
        finally:
            await db.dispose()

    try:
        return asyncio.run(main())
    except DomainError as exc:
        raise CommandError(exc.message) from None
