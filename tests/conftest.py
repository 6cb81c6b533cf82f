"""Shared fixtures: one real embedded Postgres per test session, clean tables per test."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

from memory.recall.embeddings import HashEmbedder
from memory.recall.index import spec_key, spec_of
from memory.storage.db import Database, upgrade
from memory.storage.embedded import EmbeddedPostgres

pytest_plugins = ["tests.kafka_mock", "tests.browser_support", "tests.real_model"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The OpenVINO export of the packaged model is made once and kept between test runs (every
# test server gets a fresh DATA_DIR; each would otherwise export again). Checked by its
# manifest at every load, so a stale copy is re-exported, never used.
TEST_ENCODER_CACHE = Path(tempfile.gettempdir()) / f"chatmem-test-encoders-{os.getuid()}"
os.environ.setdefault("EMBEDDING_CACHE_DIR", str(TEST_ENCODER_CACHE))


@pytest.fixture(scope="session", autouse=True)
def encoder_export() -> None:
    """The OpenVINO export every real-model server of the session loads, made before any starts.

    Made once (10-70 s) the first time on a machine; afterwards only checked against its
    manifest. Server processes started by tests wait a bounded time for /readyz and must not
    spend it exporting.
    """
    from memory.config import default_embedding_model
    from memory.recall.encoder_cache import openvino_export

    openvino_export(default_embedding_model(), Path(os.environ["EMBEDDING_CACHE_DIR"]))


def _database_of_worker(url: str, worker: str) -> str:
    """`url`'s server, in a database of this pytest-xdist worker's own (made if missing).

    Each test truncates every table: test processes sharing one database would empty each
    other's. The role in `url` must be allowed to create databases.
    """
    import asyncio

    import asyncpg
    from sqlalchemy.engine import make_url

    given = make_url(url)
    name = f"{given.database}_{worker}"

    async def make() -> None:
        plain = given.set(drivername="postgresql").render_as_string(hide_password=False)
        connection = await asyncpg.connect(plain)
        try:
            if not await connection.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name):
                await connection.execute(f'CREATE DATABASE "{name}"')
        finally:
            await connection.close()

    asyncio.run(make())
    return given.set(database=name).render_as_string(hide_password=False)


@pytest.fixture(scope="session")
def pg_url(worker_id: str) -> Iterator[str]:
    """A migrated Postgres with pgvector: the embedded server, or TEST_DATABASE_URL (a database
    of each test process's own on that server when pytest-xdist runs several)."""
    external = os.environ.get("TEST_DATABASE_URL")
    if external:
        if worker_id != "master":
            external = _database_of_worker(external, worker_id)
        upgrade(external)
        yield external
        return
    tmp = Path(tempfile.mkdtemp(prefix="chatmem-test-"))
    server = EmbeddedPostgres(tmp, delete_on_stop=True)
    url = server.start()
    upgrade(url)
    try:
        yield url
    finally:
        server.stop()


# Every table the migrations made (some have no model: dead_letters, ai_sdk_chats), but
# not Alembic's record of which migrations ran.
USER_TABLES = text(
    "SELECT tablename FROM pg_tables WHERE schemaname = current_schema() AND tablename <> 'alembic_version'"
)


SEED_GENERATION = text(
    "INSERT INTO memory_indexes (id, spec, spec_key, state, activated_at) OVERRIDING SYSTEM VALUE "
    "VALUES (1, CAST(:spec AS jsonb), :key, 'active', now())"
)
RESET_GENERATIONS = text("SELECT setval(pg_get_serial_sequence('memory_indexes', 'id'), 1)")


async def truncate_all(db: Database) -> None:
    async with db.transaction() as session:
        names = ", ".join(sorted((await session.execute(USER_TABLES)).scalars()))
        await session.execute(text(f"TRUNCATE {names} RESTART IDENTITY CASCADE"))
        # The memory index's first generation, as the migration makes it; empty, so the first
        # encoder to start takes it over (memory/recall/index.py). Tests that write rows
        # directly put them in generation 1.
        spec = spec_of(HashEmbedder())
        await session.execute(SEED_GENERATION, {"spec": json.dumps(spec), "key": spec_key(spec)})
        await session.execute(RESET_GENERATIONS)


@pytest.fixture
async def db(pg_url: str) -> AsyncIterator[Database]:
    """A Database on empty tables."""
    database = Database(pg_url, pool_size=5)
    await truncate_all(database)
    try:
        yield database
    finally:
        await database.dispose()


# --- the API, served for real ------------------------------------------------------

import asyncio  # noqa: E402
import contextlib  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import httpx  # noqa: E402
import uvicorn  # noqa: E402

from bench.common import free_port  # noqa: E402  (tests import it from here)
from chat_api.app import create_app  # noqa: E402
from chat_api.auth import issue_token  # noqa: E402
from memory.config import Settings, get_settings  # noqa: E402

TEST_SECRET = "test-secret-not-for-production-0123456789"


def token_for(tenant: str = "t1", user: str = "u1") -> str:
    return issue_token(TEST_SECRET, tenant, user)


def auth(tenant: str = "t1", user: str = "u1") -> dict[str, str]:
    return {"Authorization": f"Bearer {token_for(tenant, user)}"}


@pytest.fixture
def make_settings(pg_url: str) -> Callable[..., Settings]:
    """Settings for a test app on the test database; overrides as keyword arguments."""

    def build(**overrides: Any) -> Settings:
        values: dict[str, Any] = {
            "database_url": pg_url,
            "jwt_secret": TEST_SECRET,
            "demo_tokens_per_second": 200.0,
            "checkpoint_interval_ms": 100,
            "reaper_interval_seconds": 0.5,
            "llm_provider": "demo",
            "rate_limit_per_minute": 0,  # tests of the limiter set it themselves
        }
        values.update(overrides)
        return get_settings(**values)

    return build


class LiveServer:
    """A real uvicorn server running the app on a free loopback port, inside the test's loop."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        )
        self._task: asyncio.Task[None] | None = None

    @property
    def services(self) -> Any:
        return self.app.state.services

    async def start(self) -> None:
        self._task = asyncio.create_task(self.server.serve())
        async with asyncio.timeout(20):
            while not self.server.started:
                if self._task.done():
                    self._task.result()
                await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self.server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(self._task, timeout=20)

    def client(self, tenant: str = "t1", user: str = "u1", **kwargs: Any) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.base_url, headers=auth(tenant, user), timeout=30, **kwargs)


@pytest.fixture
async def start_server(db: Any, make_settings: Callable[..., Settings]) -> AsyncIterator[Callable[..., Any]]:
    """Start live servers: `await start_server(**settings_overrides, provider=..., tools=...)`."""
    servers: list[LiveServer] = []

    async def start(
        provider: Any = None, tools: Any = None, workers: Any = None, embedder: Any = None, **overrides: Any
    ) -> LiveServer:
        # The deterministic embedder unless a test asks for the real model (slow to load).
        app = create_app(
            make_settings(**overrides),
            provider=provider,
            tools=tools,
            workers=workers,
            embedder=embedder or HashEmbedder(),
        )
        server = LiveServer(app)
        await server.start()
        servers.append(server)
        return server

    try:
        yield start
    finally:
        for server in servers:
            await server.stop()


@pytest.fixture
async def server(start_server: Callable[..., Any]) -> LiveServer:
    """One live API server on demo defaults."""
    return await start_server()  # type: ignore[no-any-return]


from tests.fake_openai import fake_openai  # noqa: E402, F401  (fixture: a scripted OpenAI-compatible server)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test of the one local model server (tests/real_model.py) carries `real_model`.

    `make test` runs the rest in two processes and these in one after them: they share the
    server's single slot, and one test's reply would evict another's prompt from its cache or
    generate while another checks that a stop left the server idle. Before pytest's own
    selection by marker, which reads it.
    """
    for item in items:
        if "real_model" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.real_model)
