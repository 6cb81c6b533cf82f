"""EMBEDDING_BASE_URL: encoding through a real OpenAI-compatible embedding server (infinity-emb).

The server is a real process (tests/embedding_server.py) serving the packaged MiniLM, so its
vectors can be compared with the local encoder's. Faults are real too: the server is killed
in the middle of an indexer batch and started again; a reply's recall meets a port where
nothing listens and one that accepts and never answers (the only stand-in: a silent socket).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import pytest
from sqlalchemy import text

from indexer.pipeline import IndexPipeline
from indexer.worker import IndexerWorker
from memory.config import default_embedding_model
from memory.events import EventName, RecallError
from memory.recall import reindex
from memory.recall.embedding_service import (
    CONCURRENT_REQUESTS,
    EmbeddingRefused,
    ServiceEmbedder,
)
from memory.recall.embeddings import SentenceTransformerEmbedder
from memory.recall.index import MemoryIndex, spec_key, spec_of
from memory.recall.keywords import memory_text, photo_caption
from memory.recall.search import recall_memories
from memory.record.conversations import Owner
from memory.record.outbox import turn_payload
from memory.storage.db import Database
from tests.conftest import LiveServer, free_port
from tests.embedding_server import API_KEY, MODEL_NAME, EmbeddingServer, SilentServer, require_server
from tests.procs import server_process
from tests.sse import SSEEvent, iter_sse
from tests.support import new_conversation, wait_until
from tests.test_indexer import OWNER, chat_turns, memorable, scalar, test_settings
from tests.test_memory_recall import FACT, QUESTION, retrieved, say

pytestmark = pytest.mark.slow

TEXTS = [
    "My sister Ingrid moved to Reykjavik last spring and keeps honeybees there.",
    "Where does my sister live?",
    "I run 10 km every Sunday along the river before breakfast.",
    "[2024-05-01] The dentist appointment moved to Thursday at 3 pm.",
    "Ich habe eine Katze namens Mila.",
    "我每天早上喝一杯绿茶。",
]


@pytest.fixture(scope="module")
async def embedding_server() -> AsyncIterator[EmbeddingServer]:
    require_server()
    server = EmbeddingServer()
    await server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def running(embedding_server: EmbeddingServer) -> EmbeddingServer:
    """The embedding server, started again if an earlier test left it killed."""
    if not embedding_server.running:
        await embedding_server.start()
    return embedding_server


@pytest.fixture(scope="module")
def local_encoder() -> Iterator[SentenceTransformerEmbedder]:
    """The local encoder of the same weights (torch, as the server runs them)."""
    model = SentenceTransformerEmbedder(default_embedding_model(), runtime="torch")
    model.load(threads=1)
    yield model


def service(server: EmbeddingServer, **options: Any) -> ServiceEmbedder:
    options.setdefault("api_key", API_KEY)
    return ServiceEmbedder(server.base_url, MODEL_NAME, **options)


def cosines(a: list[list[float]], b: list[list[float]]) -> np.ndarray:
    return np.sum(np.asarray(a) * np.asarray(b), axis=1)  # both unit length


async def test_service_vectors_agree_with_the_local_encoder_and_are_their_own_generation(
    running: EmbeddingServer, local_encoder: SentenceTransformerEmbedder
) -> None:
    embedder = service(running, batch_size=2)
    vectors = await embedder.embed(TEXTS)
    assert embedder.requests == 3  # in requests of EMBEDDING_SERVICE_BATCH_SIZE texts, in order
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0)
    assert cosines(vectors, local_encoder.encode_sync(TEXTS)).min() > 0.999
    # Same weights, but a service's vectors are never compared with a local encoder's.
    assert spec_of(embedder)["runtime"] == "service"
    assert spec_of(embedder)["service_model"] == MODEL_NAME
    assert spec_key(spec_of(embedder)) != spec_key(spec_of(local_encoder))


async def test_a_wrong_key_is_refused_once_not_retried_and_reported_loudly_once(
    running: EmbeddingServer, caplog: pytest.LogCaptureFixture
) -> None:
    embedder = service(running, api_key="not-the-key", retries=4)
    with caplog.at_level(logging.ERROR, logger="memory.recall.embedding_service"):
        for _ in range(2):
            with pytest.raises(EmbeddingRefused) as refused:
                await embedder.embed(TEXTS[:1])
            assert refused.value.status == 401
    assert embedder.requests == 2  # one request per call: a 401 is never retried
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "401" in errors[0].getMessage()


async def test_vectors_of_another_dimension_are_refused(running: EmbeddingServer) -> None:
    # The server answers 384-d vectors; an index of another width must not take them.
    embedder = service(running, dim=768, retries=4)
    with pytest.raises(EmbeddingRefused, match="384-d"):
        await embedder.embed(TEXTS)
    assert embedder.requests <= CONCURRENT_REQUESTS  # refused, not retried


async def test_chatmem_indexes_and_recalls_through_the_embedding_service(
    db: Database, pg_url: str, running: EmbeddingServer, local_encoder: SentenceTransformerEmbedder
) -> None:
    async with server_process(
        pg_url,
        args=["--with-workers"],
        embedding_base_url=running.base_url,
        embedding_api_key=API_KEY,
        embedding_service_model=MODEL_NAME,
    ) as server:
        async with server.client() as client:
            assert (await client.get("/readyz")).json()["encoder"] == "service"  # no local model
            await say(client, await new_conversation(client, "Family"), FACT)

            async def indexed() -> int:
                return int(await scalar(db, "SELECT count(*) FROM memory_items WHERE role = 'user'"))

            await wait_until(indexed, 60, "the fact to be indexed through the service")
            found = retrieved(await say(client, await new_conversation(client, "Travel"), QUESTION))
    assert "error" not in found
    assert FACT in [item["text"] for item in found["items"]]
    async with db.transaction() as session:
        spec = (
            await session.execute(text("SELECT spec FROM memory_indexes WHERE state = 'active'"))
        ).scalar_one()
        rows = (
            await session.execute(
                text(
                    "SELECT text, name, turn_created_at, metadata, CAST(embedding AS text) AS embedding "
                    "FROM memory_items"
                )
            )
        ).all()
    assert spec["runtime"] == "service" and spec["service_model"] == MODEL_NAME
    assert spec["base_url"] == running.base_url
    # Every stored vector is the one the local encoder makes of the same memory text.
    local = local_encoder.encode_sync(
        [
            memory_text(r.text, name=r.name, created_at=r.turn_created_at, extra=photo_caption(r.metadata))
            for r in rows
        ]
    )
    assert cosines([json.loads(r.embedding) for r in rows], local).min() > 0.999


async def test_the_indexer_writes_a_batch_whole_after_the_server_died_in_the_middle_of_it(
    db: Database, pg_url: str, running: EmbeddingServer
) -> None:
    settings = test_settings(pg_url, indexer_batch_size=64)
    _, turns = await chat_turns(db, [memorable(i) for i in range(64)])
    # Requests of 4 texts: the batch is 16 requests, at most CONCURRENT_REQUESTS in flight.
    embedder = service(running, batch_size=4, retries=2)
    worker = IndexerWorker(
        db, settings, MemoryIndex(db, embedder), backoff_base_seconds=0.2, backoff_max_seconds=2.0
    )
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        # Once a request beyond the first CONCURRENT_REQUESTS went out, one has been answered.
        await wait_until(lambda: embedder.requests > CONCURRENT_REQUESTS, 60, "the batch to start")
        running.kill()
        await wait_until(lambda: worker.stats["retried_batches"] >= 1, 60, "the batch to be given back")
        # Nothing of the batch was written, though part of it had been encoded.
        assert await scalar(db, "SELECT count(*) FROM memory_items") == 0
        await running.start()

        async def all_consumed() -> bool:
            if task.done():
                task.result()
            return await scalar(db, "SELECT count(*) FROM outbox WHERE consumed_at IS NULL") == 0

        await wait_until(all_consumed, 120, "the batch to be indexed after the restart")
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
    assert await scalar(db, "SELECT count(DISTINCT turn_id) FROM memory_items") == len(turns)
    assert await scalar(db, "SELECT count(*) FROM dead_letters") == 0


@pytest.mark.parametrize("outage", ["nothing listening", "never answers"])
async def test_a_reply_recalls_by_keywords_inside_its_time_box_when_the_service_is_down(
    db: Database, pg_url: str, start_server: Any, running: EmbeddingServer, outage: str
) -> None:
    # The memory is indexed through the service while it is up ...
    _, turns = await chat_turns(db, [FACT], owner=Owner("t1", "u1"))  # the API client's user
    worker = IndexerWorker(db, test_settings(pg_url), MemoryIndex(db, service(running)))
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    await wait_until(lambda: scalar(db, "SELECT count(*) FROM memory_items"), 60, "the fact to be indexed")
    stop.set()
    await asyncio.wait_for(task, 30)
    # ... then the API's service is away: the same model's address now leads nowhere.
    async with SilentServer() as silent:
        address = silent.base_url if outage == "never answers" else f"http://127.0.0.1:{free_port()}/v1"
        box = 2.0
        server: LiveServer = await start_server(
            embedder=ServiceEmbedder(address, MODEL_NAME, api_key=API_KEY, timeout_seconds=30),
            recall_timeout_seconds=box,
        )
        async with server.client() as client:
            cid = await new_conversation(client, "Travel")
            loop = asyncio.get_running_loop()
            started = loop.time()
            events: list[SSEEvent] = []
            async with client.stream(
                "POST", f"/v1/conversations/{cid}/messages", json={"content": QUESTION}
            ) as r:
                assert r.status_code == 200
                async for event in iter_sse(r):
                    if event.event == EventName.MEMORY_RETRIEVED:
                        recalled_after = loop.time() - started
                    events.append(event)
            metrics = (await client.get("/metrics")).text
    assert events[-1].event == EventName.TURN_COMPLETED
    found = retrieved(events)
    assert recalled_after < box  # memory.retrieved inside the recall's time box
    assert found["error"]["code"] == RecallError.EMBEDDING_UNAVAILABLE
    assert [item["turn_id"] for item in found["items"]] == [str(turns[0].id)]  # a keyword hit
    assert 'chatmem_recalls_total{outcome="keywords_only"}' in metrics


async def test_moving_a_local_index_to_the_service_is_a_reindex_and_never_mixes_them(
    db: Database, pg_url: str, running: EmbeddingServer, local_encoder: SentenceTransformerEmbedder
) -> None:
    local = MemoryIndex(db, local_encoder)
    await local.start()
    _, turns = await chat_turns(db, [FACT, memorable(1)])
    await IndexPipeline(db, local, test_settings(pg_url)).index([turn_payload(t) for t in turns])
    embedder = service(running)
    # A process configured with the service does not search the local encoder's vectors with its own.
    with pytest.raises(RuntimeError, match="memory reindex"):
        await MemoryIndex(db, embedder).start()
    old, new = await reindex.begin(db, embedder) or (0, 0)
    await reindex.build(db, embedder, old, new)
    generation = await MemoryIndex(db, embedder).start()
    assert generation.id == new and generation.embedder is embedder
    recalled = await recall_memories(
        db, embedder, tenant_id=OWNER.tenant_id, user_id=OWNER.user_id, query_text=QUESTION, k=1
    )
    assert recalled.degraded is None
    assert [m.turn_id for m in recalled.memories] == [turns[0].id]
    # And the local encoder, now the one that differs, is refused in turn.
    with pytest.raises(RuntimeError, match="memory reindex"):
        await MemoryIndex(db, local_encoder).start()


async def test_a_reindex_through_the_service_waits_when_it_dies_mid_build_and_switches_once_it_is_back(
    db: Database, pg_url: str, running: EmbeddingServer, local_encoder: SentenceTransformerEmbedder
) -> None:
    # Regression: the service killed in the middle of `chatmem memory reindex` ended the build with
    # EmbeddingUnavailable (a traceback, the generation half built) although the indexer waits for
    # the service; the build now waits too, and goes on where it was.
    local = MemoryIndex(db, local_encoder)
    await local.start()
    _, turns = await chat_turns(db, [memorable(i) for i in range(24)])
    await IndexPipeline(db, local, test_settings(pg_url)).index([turn_payload(t) for t in turns])
    embedder = service(running, batch_size=4, retries=1)
    old, new = await reindex.begin(db, embedder) or (0, 0)
    killed_at: list[int] = []

    def kill_after_the_first_batch(progress: reindex.Progress) -> None:
        if not killed_at and 0 < progress.done < progress.total:
            running.kill()
            killed_at.append(embedder.requests)

    build = asyncio.create_task(
        reindex.build(db, embedder, old, new, batch=4, on_progress=kill_after_the_first_batch)
    )
    try:
        await wait_until(lambda: bool(killed_at), 120, "the build to be under way")
        # It keeps asking the service (each attempt one request and one retry) instead of ending.
        await wait_until(
            lambda: build.done() or embedder.requests >= killed_at[0] + 4, 60, "attempts at the service"
        )
        assert not build.done()
        await running.start()
        progress = await asyncio.wait_for(build, 120)
    finally:
        build.cancel()
    assert progress.switched
    assert await scalar(db, "SELECT state FROM memory_indexes WHERE id = :id", id=new) == "active"
    chunks = "SELECT count(*) FROM memory_items WHERE index_id = :id AND kind = 'chunk'"
    assert await scalar(db, chunks, id=new) == await scalar(db, chunks, id=old) > 0
