"""What every `chatmem` command acts on: the installation's settings, secret and database.

An installation is either configured (JWT_SECRET, DATABASE_URL) or the one `chatmem up`
made in its data directory (DATA_DIR, `--data-dir`): its own secret in `jwt_secret` and
its embedded Postgres in `pg`. Each command finds them here, the same way, and reports a
problem in one line (`CommandError`).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import jwt

from chat_api.auth import MAX_IDENTITY_CHARS, is_api_key, issue_token, load_or_create_secret
from memory.config import Settings, SettingsError, get_settings
from memory.json_bounds import text_problem

DEFAULT_TENANT = "local"
DEFAULT_USER = "me"
SECRET_FILE = "jwt_secret"


class CommandError(Exception):
    """A problem to report to the person in one line, without a traceback."""


def identity(text: str) -> str:
    """argparse type of --tenant and --user: what a token may carry, as the server checks it."""
    if not text or len(text) > MAX_IDENTITY_CHARS or text_problem(text) is not None or not text.isprintable():
        raise argparse.ArgumentTypeError(f"must be 1 to {MAX_IDENTITY_CHARS} printable characters")
    return text


def positive_int(text: str) -> int:
    """argparse type of a count or a duration that must be at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def load_settings(**overrides: Any) -> Settings:
    """The settings, with the command's options (None: not given) over the environment."""
    clean = {k: v for k, v in overrides.items() if v is not None}
    try:
        return get_settings(**clean)
    except SettingsError as exc:
        raise CommandError(str(exc)) from None


def installation_secret(settings: Settings, *, create: bool = False) -> str:
    """JWT_SECRET, or the secret of the `chatmem up` installation in DATA_DIR (made if `create`)."""
    if settings.jwt_secret is not None:
        return settings.jwt_secret.get_secret_value()
    data_dir = settings.data_dir.expanduser()
    if not create and not (data_dir / SECRET_FILE).exists():
        raise CommandError(
            f"no installation in {data_dir}: set JWT_SECRET, pass --data-dir of a `chatmem up`, or --token"
        )
    return load_or_create_secret(data_dir)


def check_database(url: str) -> None:
    """Fail in one line if the database cannot be reached."""
    import asyncpg

    from memory.storage.db import asyncpg_dsn

    async def probe() -> None:
        conn = await asyncpg.connect(asyncpg_dsn(url), timeout=5)
        await conn.close()

    try:
        asyncio.run(probe())
    except Exception as exc:
        raise CommandError(
            f"cannot reach DATABASE_URL: {type(exc).__name__}: {exc}".splitlines()[0]
        ) from None


def check_schema(url: str, *, remedy: str = "run `chatmem db upgrade` first") -> None:
    """Fail in one line if the database was not migrated to this version's schema."""
    import asyncpg

    from memory.storage.db import asyncpg_dsn, schema_behind

    async def revision() -> str | None:
        conn = await asyncpg.connect(asyncpg_dsn(url), timeout=5)
        try:
            return await conn.fetchval("SELECT version_num FROM alembic_version")  # type: ignore[no-any-return]
        except asyncpg.UndefinedTableError:
            return None
        finally:
            await conn.close()

    behind = schema_behind(asyncio.run(revision()))
    if behind:
        raise CommandError(f"{behind}: {remedy}")


def check_address_free(host: str, port: int, *, other: str = "choose another --port") -> None:
    """Fail in one line, before anything starts, if the server could not listen there."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind(address)
    except OSError as exc:
        raise CommandError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc} "
            f"(is another server running there? {other})"
        ) from None


def migrate(url: str) -> None:
    """Bring the database's schema up to date, or fail in one line."""
    from memory.storage.db import upgrade

    try:
        upgrade(url)
    except Exception as exc:
        raise CommandError(f"database migration failed: {exc}".splitlines()[0]) from None


@contextmanager
def installation_database(settings: Settings) -> Iterator[str]:
    """DATABASE_URL; or else the embedded Postgres of the installation in DATA_DIR.

    A `chatmem up` running there keeps its server (this only attaches); otherwise the
    server is started for the command and stopped after it.
    """
    if settings.database_url:
        check_database(settings.database_url)
        check_schema(settings.database_url)
        yield settings.database_url
        return
    from memory.storage.embedded import EmbeddedPostgres

    data_dir = settings.data_dir.expanduser()
    if not (data_dir / "pg").is_dir():
        raise CommandError(f"DATABASE_URL is not set and there is no `chatmem up` installation in {data_dir}")
    postgres = EmbeddedPostgres(data_dir)
    try:
        url = postgres.start()
        check_schema(url, remedy="start `chatmem up` once with this version (it migrates)")
        yield url
    finally:
        postgres.stop()


def bearer(args: argparse.Namespace, *, ttl_seconds: int) -> Callable[[], str]:
    """The bearer credential for each request to a chatmem's API.

    `--token` as given (an API key `cmk_…`, or a token); otherwise a token minted from the
    installation's secret for `--tenant`/`--user` (default local/me), fresh for every request.
    """
    if args.token:
        token = str(args.token)
        if not is_api_key(token):
            try:
                jwt.decode(token, options={"verify_signature": False})
            except jwt.PyJWTError as exc:
                raise CommandError(f"--token is neither an API key (cmk_…) nor a JWT: {exc}") from None
        return lambda: token
    secret = installation_secret(load_settings(data_dir=args.data_dir))
    tenant, user = args.tenant or DEFAULT_TENANT, args.user or DEFAULT_USER
    return lambda: issue_token(secret, tenant, user, ttl_seconds=ttl_seconds)


def default_url() -> str:
    """The chatmem this machine serves (PORT), for commands that talk to its API."""
    return f"http://localhost:{load_settings().port}"
