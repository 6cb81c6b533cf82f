"""Index generations: vectors of different encoders are never compared, and a reindex under
live traffic loses no memory and never answers from a half-built index.

Two deterministic encoders that differ (HashEmbedder seeds 0 and 1) stand for two encoder
runtimes: a vector of one compared with rows of the other finds nothing useful, so a mix
would show.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import pytest
from sqlalchemy import text

from indexer.pipeline import IndexPipeline
from indexer.worker import IndexerWorker
from memory.recall import reindex
from memory.recall.embedding_service import EmbeddingUnavailable
from memory.recall.embeddings import HashEmbedder
from memory.recall.index import ForeignGeneration, IndexChanged, MemoryIndex, spec_key, spec_of
from memory.recall.items import Embedded, correct_item, forget_item, items_by_key
from memory.recall.keywords import memory_text
from memory.recall.search import recall_memories
from memory.record.conversations import Owner
from memory.record.outbox import turn_payload
from memory.storage.db import Database
from tests.support import new_conversation, wait_until
from tests.test_indexer import chat_turns, test_settings
from tests.test_memory_recall import retrieved, say

OWNER = Owner("tenant-a", "user-a")
OLD, NEW = HashEmbedder(seed=0), HashEmbedder(seed=1)


def fact(i: int) -> str:
    return f"Fact number {i}: my locker code at the climbing gym number {i} is {1000 + i}."


def loader(spec: dict[str, Any]) -> HashEmbedder | None:
    """This process can make either encoder's vectors (as a process loads torch or OpenVINO)."""
    for encoder in (OLD, NEW):
        if spec_key(spec_of(encoder)) == spec_key(spec):
            return encoder
    return None


async def index_turns(db: Database, pipeline: IndexPipeline, texts: list[str]) -> list[uuid.UUID]:
    _, turns = await chat_turns(db, texts)
    for attempt in range(50):
        try:
            await pipeline.index([turn_payload(t) for t in turns])
            break
        except IndexChanged:  # the indexer redelivers the batch after a switch
            await asyncio.sleep(0.05 * (attempt + 1))
    return [t.id for t in turns]


async def rows(db: Database, generation: int) -> set[tuple[Any, ...]]:
    async with db.session() as session:
        result = await session.execute(
            text(
                "SELECT turn_id, chunk_index, text, deleted_at IS NULL AS live FROM memory_items "
                "WHERE index_id = :g"
            ),
            {"g": generation},
        )
        return {tuple(r) for r in result}


async def found_turns(db: Database, index: MemoryIndex, query: str) -> list[uuid.UUID]:
    recalled = await recall_memories(
        db, index, tenant_id=OWNER.tenant_id, user_id=OWNER.user_id, query_text=query, k=3, unindexed_limit=0
    )
    return [m.turn_id for m in recalled.memories]


async def test_a_query_vector_is_only_compared_with_rows_of_its_own_generation(
    db: Database, pg_url: str
) -> None:
    index = MemoryIndex(db, OLD)
    assert (await index.start()).id == 1  # the empty first generation is taken by the first encoder
    pipeline = IndexPipeline(db, index, test_settings(pg_url))
    [turn_id, *_] = await index_turns(db, pipeline, [fact(7)])
    # A process with another encoder refuses to answer from vectors it did not make...
    with pytest.raises(RuntimeError, match="reindex"):
        await MemoryIndex(db, NEW).start()
    # ...and with a loader for the index's encoder it answers with that one, saying why.
    other = MemoryIndex(db, NEW, loader=loader)
    generation = await other.start()
    assert generation.embedder is OLD and other.mismatch and "reindex" in other.mismatch
    assert (await found_turns(db, other, "locker code climbing gym 7"))[0] == turn_id


async def test_two_encoders_that_started_on_one_empty_generation_both_wrote_their_vectors_into_it(
    db: Database, pg_url: str
) -> None:
    # Regression: a process starting on the empty first generation with another encoder took it
    # over (its spec rewritten to that encoder's) while a process already running on it checked
    # only the generation's id when it wrote: each wrote its own encoder's vectors into generation 1.
    settings = test_settings(pg_url)
    first = MemoryIndex(db, OLD, check_seconds=3600)  # it has not looked again since it started
    following = MemoryIndex(db, OLD, loader=loader, check_seconds=0.0)  # it can load the other encoder
    assert (await first.start()).id == (await following.start()).id == 1
    second = MemoryIndex(db, NEW)
    assert (await second.start()).id == 1  # still empty: the second encoder takes it over
    [theirs] = await index_turns(db, IndexPipeline(db, second, settings), [fact(1)])

    _, turns = await chat_turns(db, [fact(2)])
    with pytest.raises(IndexChanged, match="not by the encoder of this write"):
        await IndexPipeline(db, first, settings).index([turn_payload(turns[0])])
    assert {r[0] for r in await rows(db, 1)} == {theirs}  # the second encoder's vectors only
    # Looking again, the first process neither searches nor writes a generation it cannot encode for.
    with pytest.raises(ForeignGeneration, match="memory reindex"):
        await found_turns(db, first, "locker code climbing gym number 1")
    assert first.refused is not None and "memory reindex" in first.refused
    # One that can load the new encoder moves to it, as after a reindex's switch, and answers from it.
    assert (await following.generation()).embedder is NEW and following.refused is None
    assert (await found_turns(db, following, "locker code climbing gym number 1")) == [theirs]


async def test_a_process_that_had_not_looked_again_after_a_take_over_ranked_the_other_encoders_rows(
    db: Database, pg_url: str
) -> None:
    # Regression: writes were refused at once after a take-over, but a process that had not read
    # the generation again (up to check_seconds) still searched it, ranking the new encoder's rows
    # by its own query vector.
    first = MemoryIndex(db, OLD, check_seconds=3600)  # it has not looked again since it started
    assert (await first.start()).id == 1
    second = MemoryIndex(db, NEW)
    assert (await second.start()).id == 1  # still empty: the second encoder takes it over
    await index_turns(db, IndexPipeline(db, second, test_settings(pg_url)), [fact(1)])

    with pytest.raises(ForeignGeneration, match="taken over"):
        await found_turns(db, first, "locker code climbing gym number 1")
    # The search made it look again at once: it knows now it cannot encode for that generation.
    with pytest.raises(ForeignGeneration, match="memory reindex"):
        await first.generation()
    assert first.refused is not None


class Unreachable(HashEmbedder):
    """The old encoder, as an embedding service that stops answering (recall goes keyword-only)."""

    def __init__(self) -> None:
        super().__init__(seed=0)
        self.down = False

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        if self.down:
            raise EmbeddingUnavailable("the embedding service did not answer")
        return await super().embed(texts)


async def test_a_keyword_only_recall_of_a_generation_taken_over_makes_the_process_look_again(
    db: Database, pg_url: str
) -> None:
    # The keyword search (no query vector) finds the take-over as the vector search does, and the
    # process reads the generation again at once rather than after check_seconds.
    encoder = Unreachable()
    first = MemoryIndex(db, encoder, check_seconds=3600)  # it has not looked again since it started
    assert (await first.start()).id == 1
    second = MemoryIndex(db, NEW)
    assert (await second.start()).id == 1  # still empty: the second encoder takes it over
    await index_turns(db, IndexPipeline(db, second, test_settings(pg_url)), [fact(1)])

    encoder.down = True
    with pytest.raises(ForeignGeneration, match="taken over"):
        await found_turns(db, first, "locker code climbing gym number 1")
    with pytest.raises(ForeignGeneration, match="memory reindex"):
        await first.generation()
    assert first.refused is not None


async def test_a_process_refusing_memory_after_a_take_over_said_so_only_in_its_log(
    db: Database, start_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # Regression: a server whose generation was taken over by an encoder it cannot load answered
    # every reply without memory, and only its log said why: /readyz and /metrics looked healthy.
    from tests.test_observability import sample

    server = await start_server(embedder=OLD)  # it takes the empty first generation

    async def health() -> tuple[dict[str, Any], float | None]:
        async with httpx.AsyncClient(base_url=server.base_url) as anonymous:
            ready = await anonymous.get("/readyz")
            assert ready.status_code == 200, ready.text  # ready for chat either way
            scrape = (await anonymous.get("/metrics")).text
        return ready.json(), sample(scrape, "chatmem_memory_index_refused")

    ready, refused = await health()
    assert (ready["status"], ready["memory"], refused) == ("ready", "ok", 0)
    assert (await MemoryIndex(db, NEW).start()).id == 1  # still empty: another encoder takes it over

    async def memory_refused() -> tuple[dict[str, Any], float | None] | None:
        ready, refused = await health()  # "unavailable: ...: loading" while it tries to load it
        return (ready, refused) if "memory reindex" in ready["memory"] else None

    # The server reads the generation again within check_seconds, idle or not (MemoryIndex.follow).
    ready, refused = await wait_until(memory_refused, 15, "the server to refuse memory")
    assert ready["status"] == "ready" and ready["memory"].startswith("unavailable: the memory index")
    assert refused == 1
    # A reply goes on without memory and says so; the log said why once, not a traceback a reply.
    caplog.clear()
    async with server.client() as client:
        memory = retrieved(await say(client, await new_conversation(client), "what did I say?"))
    assert memory["items"] == [] and memory["error"]["code"] == "memory_unavailable"
    assert [r.exc_info for r in caplog.records if r.exc_info] == []


async def test_reindex_under_live_traffic_loses_no_memory_and_never_answers_from_a_half_built_index(
    db: Database, pg_url: str
) -> None:
    settings = test_settings(pg_url)
    serving = MemoryIndex(db, OLD, loader=loader, check_seconds=0.0)
    await serving.start()
    pipeline = IndexPipeline(db, serving, settings)
    before = await index_turns(db, pipeline, [fact(i) for i in range(40)])
    async with db.session() as session:
        items = await items_by_key(session, OWNER, [(before[2], 0), (before[4], 0)])
    edited, forgotten = items[(before[2], 0)], items[(before[4], 0)]

    old, new = await reindex.begin(db, NEW) or (0, 0)
    assert (old, new) == (1, 2)
    answered_from: list[int] = []
    during: list[uuid.UUID] = []
    copying, traffic_done = asyncio.Event(), asyncio.Event()

    class Gated(HashEmbedder):
        """The new encoder, held after its first batch until the traffic below has run."""

        async def embed(self, texts: Any) -> list[list[float]]:
            if copying.is_set():
                await traffic_done.wait()
            copying.set()
            return await NEW.embed(texts)

    gated = Gated(seed=1)

    async def traffic() -> None:
        # Memory keeps arriving, a user corrects and forgets items, and searches keep answering.
        await copying.wait()
        during.extend(await index_turns(db, pipeline, [fact(100 + i) for i in range(6)]))
        generation = await serving.generation()
        [vector] = await generation.embedder.embed(["my locker code is 4242 now"])
        async with db.transaction() as session:
            embedded = Embedded("my locker code is 4242 now", list(vector), "locker code 4242", generation.id)
            await correct_item(session, OWNER, edited.id, embedded)
            await forget_item(session, OWNER, forgotten.id)
        for i in (0, 20, 38):  # user turns: a model's reply ranks below what the user said
            generation = await serving.generation()
            answered_from.append(generation.id)
            assert (await found_turns(db, serving, f"locker code climbing gym number {i}"))[0] == before[i]
        async with db.session() as session:
            building = (
                await session.execute(text("SELECT rows_done FROM memory_indexes WHERE id = 2"))
            ).scalar()
        assert 0 < building < len(before)  # it was half built meanwhile
        traffic_done.set()

    await asyncio.gather(reindex.build(db, gated, old, new, batch=8), traffic())
    assert answered_from == [old] * 3  # the half-built generation was never searched

    # The switch: the serving process moves to the new generation and its encoder.
    after = await index_turns(db, pipeline, [fact(200)])
    generation = await serving.generation()
    assert generation.id == new and generation.embedder is NEW
    # Every memory of the old generation is in the new one, edits and forgets included.
    old_rows, new_rows = await rows(db, old), await rows(db, new)
    assert old_rows <= new_rows and {r[0] for r in new_rows} >= {*before, *during, *after}
    assert (edited.turn_id, 0, "my locker code is 4242 now", True) in new_rows
    assert (forgotten.turn_id, 0, "", False) in new_rows
    # User turns (a model's reply ranks below what the user said).
    for i, turn_id in [(0, before[0]), (38, before[38]), (102, during[2]), (200, after[0])]:
        assert (await found_turns(db, serving, f"locker code climbing gym number {i}"))[0] == turn_id
    # The old generation's rows go after the grace period.
    assert await reindex.purge_retired(db, older_than_seconds=0) == len(old_rows)
    assert await rows(db, old) == set()


async def test_a_write_encoded_for_a_generation_that_was_switched_away_is_refused(
    db: Database, pg_url: str
) -> None:
    stale = MemoryIndex(db, OLD, check_seconds=3600)
    await stale.start()
    await index_turns(db, IndexPipeline(db, stale, test_settings(pg_url)), [fact(1)])
    old, new = await reindex.begin(db, NEW) or (0, 0)
    await reindex.build(db, NEW, old, new)
    # This process has not looked again yet: its write is refused, not put in the wrong generation.
    _, turns = await chat_turns(db, [fact(2)])
    with pytest.raises(IndexChanged):
        await IndexPipeline(db, stale, test_settings(pg_url)).index([turn_payload(turns[0])])
    assert reindex.begin  # the refused batch is retried by the indexer (is_transient)


async def test_a_process_with_no_search_during_the_grace_period_kept_the_deleted_generation(
    db: Database, pg_url: str
) -> None:
    """An idle worker moves to the new generation by itself, before the old one's rows go."""
    idle = MemoryIndex(db, OLD, loader=loader, check_seconds=0.05)
    await idle.start()
    [turn_id] = await index_turns(db, IndexPipeline(db, idle, test_settings(pg_url)), [fact(3)])
    stop = asyncio.Event()
    following = asyncio.create_task(idle.follow(stop))
    try:
        old, new = await reindex.begin(db, NEW) or (0, 0)
        await reindex.build(db, NEW, old, new)

        def moved_over() -> bool:
            current = idle.current()
            return current is not None and current.id == new

        # No search reaches the idle process; it still moves over within the grace period.
        await wait_until(moved_over, 10, "the idle process on the new generation")
        assert idle.generation_encoder() is NEW
    finally:
        stop.set()
        await following
    await reindex.purge_retired(db, older_than_seconds=0)
    assert await found_turns(db, idle, "locker code climbing gym number 3") == [turn_id]


async def test_a_process_that_could_not_load_a_reindexs_encoder_kept_searching_the_retired_generation(
    db: Database, pg_url: str
) -> None:
    # Regression: a process that could not load the encoder of the generation a reindex switched to
    # kept searching the retired generation without refusing memory (not in /readyz, not in
    # chatmem_memory_index_refused), then found nothing, silently, once the grace period deleted its
    # rows; and it loaded that encoder again at every look (check_seconds), a model load each time.
    tried: list[str] = []

    def old_only(spec: dict[str, Any]) -> HashEmbedder | None:
        tried.append(spec_key(spec))
        return OLD if spec_key(spec) == spec_key(spec_of(OLD)) else None

    said: list[str | None] = []  # what /readyz and the gauge are told (chat_api/metrics.py)
    serving = MemoryIndex(db, OLD, loader=old_only, check_seconds=0.0, on_refused=said.append)
    await serving.start()
    settings = test_settings(pg_url)
    await index_turns(db, IndexPipeline(db, serving, settings), [fact(3)])
    old, new = await reindex.begin(db, NEW) or (0, 0)
    await reindex.build(db, NEW, old, new)

    # It answers from the retired generation while it loads the new encoder (in the background)...
    assert (await serving.generation()).id == old
    # ...and, finding it cannot, refuses memory as after a take-over, and says why.
    await wait_until(
        lambda: serving.refused is not None, 10, "the process to find it cannot load the encoder"
    )
    assert said[-1] is not None and "memory reindex" in said[-1]
    with pytest.raises(ForeignGeneration, match="memory reindex"):
        await found_turns(db, serving, "locker code climbing gym number 3")
    _, turns = await chat_turns(db, [fact(4)])
    with pytest.raises(IndexChanged):
        await IndexPipeline(db, serving, settings).index([turn_payload(turns[0])])
    # Each look (here every call) does not load the encoder again: it tries again later, less often.
    for _ in range(3):
        with pytest.raises(ForeignGeneration):
            await serving.generation()
    assert tried == [spec_key(spec_of(NEW))]
    # The retired rows gone, it still says it refuses memory rather than find nothing.
    await reindex.purge_retired(db, older_than_seconds=0)
    with pytest.raises(ForeignGeneration, match="memory reindex"):
        await found_turns(db, serving, "locker code climbing gym number 3")


async def test_a_process_refusing_memory_tries_the_encoder_again_later_and_moves_to_it_once_loaded(
    db: Database, pg_url: str
) -> None:
    tried: list[str] = []
    loadable = asyncio.Event()  # say, the disk its export needed was full

    def later(spec: dict[str, Any]) -> HashEmbedder | None:
        tried.append(spec_key(spec))
        return loader(spec) if loadable.is_set() or spec_key(spec) == spec_key(spec_of(OLD)) else None

    said: list[str | None] = []
    serving = MemoryIndex(db, OLD, loader=later, check_seconds=0.0, retry_seconds=0.2, on_refused=said.append)
    await serving.start()
    [turn_id] = await index_turns(db, IndexPipeline(db, serving, test_settings(pg_url)), [fact(5)])
    old, new = await reindex.begin(db, NEW) or (0, 0)
    await reindex.build(db, NEW, old, new)
    await serving.generation()
    await wait_until(lambda: serving.refused is not None, 10, "the process to refuse memory")
    loadable.set()

    async def moved_over() -> bool:
        with contextlib.suppress(ForeignGeneration):
            return (await serving.generation()).id == new
        return False

    await wait_until(moved_over, 10, "the process to load the encoder on a later try")
    assert serving.refused is None and said[-1] is None and serving.generation_encoder() is NEW
    assert tried == [spec_key(spec_of(NEW))] * 2  # once refused, once loaded: not at each look
    assert await found_turns(db, serving, "locker code climbing gym number 5") == [turn_id]


# `chatmem indexer` as run, with the deterministic encoder in place of the model (seconds to load).
STANDALONE_INDEXER = """
import indexer.worker
from chat_api.cli.main import main
from memory.recall.embeddings import HashEmbedder


async def test_encoder(settings, *, threads=None):
    return HashEmbedder(seed=0)


indexer.worker.load_embedder = test_encoder
main(["indexer"])
"""


@contextlib.contextmanager
def standalone_indexer(pg_url: str, tmp_path: Any) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """A `chatmem indexer` process on the Postgres queue, and its METRICS_PORT."""
    from tests.conftest import free_port

    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("KAFKA_BOOTSTRAP_SERVERS", "FACT_KEYS")}
    env |= {"DATABASE_URL": pg_url, "METRICS_PORT": str(port), "INDEXER_BATCH_WAIT_MS": "50"}
    env["DATA_DIR"] = str(tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", STANDALONE_INDEXER], env=env)
    try:
        yield proc, port
    finally:
        proc.terminate()
        proc.wait(10)


async def test_the_standalone_indexer_refusing_memory_showed_nothing_on_its_metrics_port(
    db: Database, pg_url: str, tmp_path: Any
) -> None:
    # Regression: `chatmem indexer` whose generation was switched to an encoder it cannot load retried
    # its batches forever while its /metrics (METRICS_PORT) said chatmem_memory_index_refused 0.
    from tests.test_indexer import scalar
    from tests.test_observability import sample

    async def indexed(count: int) -> bool:
        return await scalar(db, "SELECT count(DISTINCT turn_id) FROM memory_items") >= count

    with standalone_indexer(pg_url, tmp_path) as (proc, port):

        async def refused() -> float | None:
            async with httpx.AsyncClient() as scraper:
                metrics = (await scraper.get(f"http://127.0.0.1:{port}/metrics")).text
                return sample(metrics, "chatmem_memory_index_refused")

        async def refusing() -> bool:
            return await refused() == 1

        await chat_turns(db, [fact(1)])
        await wait_until(lambda: indexed(1), 30, "the indexer to index a turn")  # generation 1, its encoder
        assert await refused() == 0
        old, new = await reindex.begin(db, NEW) or (0, 0)
        await reindex.build(db, NEW, old, new)
        await chat_turns(db, [fact(2)])  # its next batch reads the index again: it cannot load NEW's encoder
        await wait_until(refusing, 15, "the indexer's gauge to say it refuses memory")
        assert proc.poll() is None and not await indexed(2)  # retrying its batch, writing nothing


async def test_the_standalone_indexer_had_no_readiness_endpoint_to_say_it_refuses_memory(
    db: Database, pg_url: str, tmp_path: Any
) -> None:
    # Regression: an indexer that could not load its generation's encoder indexed nothing, and
    # nothing an orchestrator's probe reads said so: METRICS_PORT served /metrics at every path.
    from tests.test_indexer import scalar

    with standalone_indexer(pg_url, tmp_path) as (proc, port):
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as probe:

            async def ready() -> bool:
                try:
                    return (await probe.get("/readyz")).status_code == 200
                except httpx.TransportError:
                    return False  # not listening yet

            await wait_until(ready, 30, "the indexer to be ready")
            assert (await probe.get("/healthz")).json() == {"status": "ok"}
            answer = await probe.get("/readyz")
            assert answer.headers["content-type"] == "application/json"
            assert answer.json() == {"status": "ready", "database": "ok", "queue": "ok", "memory": "ok"}

            old, new = await reindex.begin(db, NEW) or (0, 0)
            await reindex.build(db, NEW, old, new)
            await chat_turns(db, [fact(1)])  # its next batch reads the index again: it cannot load NEW's

            async def not_ready() -> bool:
                return (await probe.get("/readyz")).status_code == 503

            await wait_until(not_ready, 15, "the indexer's /readyz to say it refuses memory")
            body = (await probe.get("/readyz")).json()
            assert body["status"] == "unavailable" and body["database"] == "ok" and body["queue"] == "ok"
            assert body["memory"].startswith("unavailable: ") and len(body["memory"]) > len("unavailable: ")
            assert (await probe.get("/healthz")).status_code == 200  # up: restarting it would not help
            assert proc.poll() is None
            assert await scalar(db, "SELECT count(*) FROM memory_items") == 0


def test_the_reindex_command_rebuilds_with_the_configured_runtime_and_switches(pg_url: str) -> None:
    """`chatmem memory reindex` (a real process, the real torch encoder) over an index OpenVINO made."""
    import json
    import os
    import subprocess
    import sys

    from memory.recall.encoder_cache import PACKAGED_WEIGHTS_SHA256

    made_by = {"runtime": "openvino", "source_sha256": PACKAGED_WEIGHTS_SHA256, "dim": 384, "pipeline": "1"}

    async def seed() -> None:
        db = Database(pg_url, pool_size=2)
        try:
            from tests.conftest import truncate_all

            await truncate_all(db)
            async with db.transaction() as session:
                await session.execute(
                    text("UPDATE memory_indexes SET spec = CAST(:s AS jsonb), spec_key = :k WHERE id = 1"),
                    {"s": json.dumps(made_by), "k": spec_key(made_by)},
                )
            index = MemoryIndex(db, OLD)  # stands in for the OpenVINO encoder's vectors
            index.configured_key = spec_key(made_by)
            index._encoders = {index.configured_key: OLD}
            await index_turns(
                db, IndexPipeline(db, index, test_settings(pg_url)), [fact(i) for i in range(5)]
            )
        finally:
            await db.dispose()

    asyncio.run(seed())
    env = {**os.environ, "DATABASE_URL": pg_url, "EMBEDDING_RUNTIME": "torch", "LOG_LEVEL": "WARNING"}
    command = [sys.executable, "-m", "chat_api.cli", "memory", "reindex"]
    done = subprocess.run(
        [*command, "--grace-seconds", "0"], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "building memory index generation 2 with torch" in done.stdout
    assert "5/5 rows" in done.stdout and "generation 2 is active" in done.stdout
    status = subprocess.run([*command, "--status"], env=env, capture_output=True, text=True, timeout=120)
    assert [line.split()[:2] for line in status.stdout.splitlines()[1:]] == [
        ["1", "retired"],
        ["2", "active"],
    ]

    async def check() -> None:
        db = Database(pg_url, pool_size=2)
        try:
            assert len(await rows(db, 2)) == 5 and await rows(db, 1) == set()
            async with db.session() as session:
                norms = (
                    await session.execute(text("SELECT vector_norm(embedding) FROM memory_items"))
                ).scalars()
                assert all(abs(n - 1) < 1e-4 for n in norms)

        finally:
            await db.dispose()

    asyncio.run(check())
    again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert "already built by torch" in again.stdout


async def test_the_indexer_worker_records_its_encoder_not_its_timing_wrapper_as_the_generation(
    db: Database, pg_url: str
) -> None:
    # Regression: the worker wrapped the MemoryIndex in a timing wrapper, so the pipeline did not
    # see the index: the first batch took the empty generation over in the wrapper's name, and a
    # restarted process then refused an index "built by TimedEmbedder".
    index = MemoryIndex(db, NEW)
    await index.start()
    await chat_turns(db, [fact(i) for i in range(4)])
    worker = IndexerWorker(db, test_settings(pg_url), index)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        await wait_until(lambda: worker.stats["indexed_turns"] == 4, 30, "the turns to be indexed")
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
    async with db.transaction() as session:
        key = (
            await session.execute(text("SELECT spec_key FROM memory_indexes WHERE state = 'active'"))
        ).scalar()
    assert key == spec_key(spec_of(NEW))
    assert (await MemoryIndex(db, NEW).start()).id == (await index.generation()).id  # a restart takes it


async def generation_states(db: Database) -> dict[int, str]:
    async with db.session() as session:
        result = await session.execute(text("SELECT id, state FROM memory_indexes ORDER BY id"))
        return {int(r.id): r.state for r in result}


async def test_a_second_reindex_run_ending_after_the_first_switched_keeps_the_active_index(
    db: Database, pg_url: str
) -> None:
    # Regression: the same command run twice joins one build; the run that came second went on
    # copying the retired generation over the active one: the memories indexed since the switch
    # were deleted as orphans and a memory forgotten since came back (after the first run's
    # grace period, with the retired rows gone, the whole active index was deleted).
    serving = MemoryIndex(db, OLD, loader=loader, check_seconds=0.0)
    await serving.start()
    pipeline = IndexPipeline(db, serving, test_settings(pg_url))
    before = await index_turns(db, pipeline, [fact(i) for i in range(6)])
    first = await reindex.begin(db, NEW)
    second = await reindex.begin(db, NEW)  # started while the first one runs: the same build
    assert first == second == (1, 2)
    old, new = first or (0, 0)
    assert (await reindex.build(db, NEW, old, new)).switched
    # Served from the new generation now: memory keeps arriving and a user forgets an item.
    after = await index_turns(db, pipeline, [fact(100 + i) for i in range(4)])
    assert (await serving.generation()).id == new
    async with db.transaction() as session:
        item = (await items_by_key(session, OWNER, [(before[2], 0)]))[(before[2], 0)]
        await forget_item(session, OWNER, item.id)
    kept = await rows(db, new)

    # The second run gets to its next pass only now.
    progress = await reindex.build(db, NEW, old, new)
    assert progress.switched and progress.generation == new
    assert await rows(db, new) == kept
    assert {r[0] for r in kept} >= {*before, *after}
    assert (before[2], 0, "", False) in kept  # still forgotten
    assert await generation_states(db) == {old: "retired", new: "active"}
    assert (await found_turns(db, serving, "locker code climbing gym number 100"))[0] == after[0]


async def test_a_reindex_replaced_by_another_run_stops_saying_so_not_with_a_traceback(
    db: Database, pg_url: str
) -> None:
    # Regression: `reindex --replace` dropped the building generation under a run still building
    # it; that run's next batch failed on the missing generation row (NoResultFound, a traceback
    # and its batch rolled back) instead of saying that its build was abandoned.
    serving = MemoryIndex(db, OLD, loader=loader, check_seconds=0.0)
    await serving.start()
    before = await index_turns(
        db, IndexPipeline(db, serving, test_settings(pg_url)), [fact(i) for i in range(6)]
    )
    old, abandoned = await reindex.begin(db, NEW) or (0, 0)
    third = HashEmbedder(seed=2)
    assert await reindex.begin(db, third, replace=True) == (old, abandoned + 1)

    with pytest.raises(reindex.ReindexRefused, match="abandoned"):
        await reindex.build(db, NEW, old, abandoned)
    assert await rows(db, abandoned) == set()
    assert await generation_states(db) == {old: "active", abandoned + 1: "building"}
    assert (await found_turns(db, serving, "locker code climbing gym number 4"))[0] == before[4]


def test_a_generation_left_by_a_reindex_interrupted_in_its_grace_period_is_deleted_by_the_next_run(
    pg_url: str,
) -> None:
    # Regression: the command deletes the retired generation at the end of its grace period, and
    # nothing else does. Interrupted while it waited (Ctrl-C after "generation 2 is active"), it
    # left every row of the old generation in memory_items for good: a run after found the index
    # built and returned before deleting anything.
    import json
    import os
    import subprocess
    import sys

    from memory.recall.encoder_cache import PACKAGED_WEIGHTS_SHA256
    from memory.recall.index import PIPELINE

    built_by = {
        "runtime": "torch",
        "source_sha256": PACKAGED_WEIGHTS_SHA256,
        "dim": 384,
        "pipeline": PIPELINE,
    }

    async def seed() -> None:
        db = Database(pg_url, pool_size=2)
        try:
            from tests.conftest import truncate_all

            await truncate_all(db)
            index = MemoryIndex(db, OLD)
            await index.start()
            await index_turns(
                db, IndexPipeline(db, index, test_settings(pg_url)), [fact(i) for i in range(3)]
            )
            # The switch happened an hour ago; the command that made it was stopped in its grace period.
            async with db.transaction() as session:
                await session.execute(
                    text(
                        "UPDATE memory_indexes SET state = 'retired', retired_at = now() - interval '1 hour'"
                    )
                )
                await session.execute(
                    text(
                        "INSERT INTO memory_indexes (spec, spec_key, state, activated_at) "
                        "VALUES (CAST(:s AS jsonb), :k, 'active', now() - interval '1 hour')"
                    ),
                    {"s": json.dumps(built_by), "k": spec_key(built_by)},
                )
        finally:
            await db.dispose()

    async def rows_of_generation_1() -> int:
        db = Database(pg_url, pool_size=2)
        try:
            return len(await rows(db, 1))
        finally:
            await db.dispose()

    asyncio.run(seed())
    assert asyncio.run(rows_of_generation_1()) > 0
    env = {**os.environ, "DATABASE_URL": pg_url, "EMBEDDING_RUNTIME": "torch", "LOG_LEVEL": "WARNING"}
    command = [sys.executable, "-m", "chat_api.cli", "memory", "reindex"]
    again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "already built by torch" in again.stdout
    assert asyncio.run(rows_of_generation_1()) == 0


async def test_a_resumed_reindex_shows_the_rate_of_this_run_not_of_the_rows_an_earlier_run_copied(
    db: Database, pg_url: str
) -> None:
    # Regression: the command's rate and time left divided every row of the generation (those of
    # the run that was stopped too) by this run's time: a resumed build showed a rate inflated by
    # them and "about 0 s left".
    from chat_api.cli.memory_index import pace_of

    index = MemoryIndex(db, OLD)
    await index.start()
    await index_turns(db, IndexPipeline(db, index, test_settings(pg_url)), [fact(i) for i in range(6)])
    ids = await reindex.begin(db, NEW)
    assert ids is not None
    old, new = ids

    class Stopped(Exception):
        pass

    def stop(progress: reindex.Progress) -> None:
        raise Stopped  # the command killed after its first batch

    with pytest.raises(Stopped):
        await reindex.build(db, NEW, old, new, batch=2, on_progress=stop)
    now = [100.0]
    pace = await pace_of(db, new, clock=lambda: now[0])
    assert pace.done_before == 2
    now[0] += 1.0  # this run copies 2 rows in a second
    assert pace.line(reindex.Progress(new, 4, 6)) == "\r4/6 rows, 2 rows/s, about 1 s left"


class GatedEncoder(HashEmbedder):
    """Another encoder (its own seed) whose first batch waits until the test opens the gate."""

    def __init__(self) -> None:
        super().__init__(seed=2)
        self.entered = asyncio.Event()
        self.gate = asyncio.Event()

    async def embed(self, texts: Any) -> list[list[float]]:
        self.entered.set()
        await self.gate.wait()
        return await super().embed(texts)


async def test_a_building_generation_no_run_builds_any_more_says_so_in_status_and_metrics(
    db: Database, pg_url: str, start_server: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    # Regression: a generation whose command was killed stayed `building`, with its last rows
    # done, in `--status` and chatmem_memory_index_build_rows: nothing told it from a build under way.
    from chat_api.cli.memory_index import _print_generations
    from tests.test_observability import sample

    index = MemoryIndex(db, OLD)
    await index.start()
    await index_turns(db, IndexPipeline(db, index, test_settings(pg_url)), [fact(i) for i in range(3)])
    encoder = GatedEncoder()
    ids = await reindex.begin(db, encoder)  # as the killed run left it: registered, no run
    assert ids is not None
    old, new = ids

    def status() -> str:
        _print_generations(generations)
        return next(line for line in capsys.readouterr().out.splitlines() if line.split()[0] == str(new))

    generations = await reindex.generations(db)
    assert "no run is building it" in status()
    server = await start_server()
    async with httpx.AsyncClient(base_url=server.base_url) as anonymous:
        scrape = (await anonymous.get("/metrics")).text
    assert sample(scrape, "chatmem_memory_index_build_running", generation=str(new)) == 0
    await server.stop()

    build = asyncio.create_task(reindex.build(db, encoder, old, new, batch=2))
    try:
        await asyncio.wait_for(encoder.entered.wait(), 10)  # a run is building it
        generations = await reindex.generations(db)
        line = status()
        assert "building" in line and "no run" not in line
    finally:
        build.cancel()  # Ctrl-C; a killed process's session ends and Postgres frees the lock alike
        with contextlib.suppress(asyncio.CancelledError):
            await build
    generations = await reindex.generations(db)
    assert "no run is building it" in status()


class WritingEncoder(HashEmbedder):
    """Another encoder (its own seed) during live traffic: with each of its first calls, the first
    or the last memory (not in the batch) is corrected, and it counts the calls made while the
    switch holds the index lock exclusively."""

    def __init__(self, db: Database, item_ids: list[int], said: list[str], writes: int) -> None:
        super().__init__(seed=3)
        self.db, self.item_ids, self.said, self.writes = db, item_ids, said, writes
        self.under_lock = 0

    async def embed(self, texts: Any) -> list[list[float]]:
        from memory.recall.index import INDEX_LOCK

        async with self.db.transaction() as session:
            free = (
                await session.execute(text(f"SELECT pg_try_advisory_xact_lock_shared({INDEX_LOCK})"))
            ).scalar_one()
        if not free:
            self.under_lock += 1  # a writer of memory would wait for this encode
        elif self.writes > 0:
            self.writes -= 1
            # The lowest row goes stale behind the pass; with it in the batch, the highest ahead of it.
            target = 0 if not any(self.said[0] in t for t in texts) else 1
            self.said[target] = f"my locker code is {4000 + self.writes} now"
            [vector] = await OLD.embed([self.said[target]])
            embedded = Embedded(self.said[target], list(vector), self.said[target], 1)
            async with self.db.transaction() as session:
                await correct_item(session, OWNER, self.item_ids[target], embedded)
        return await super().embed(texts)


async def test_the_switch_of_a_reindex_encodes_nothing_while_memory_writers_wait_for_it(
    db: Database, pg_url: str
) -> None:
    # Regression: the last pass encoded the rows written since the pass before while holding the
    # index lock exclusively: an embedding service hanging then held every memory correction and
    # stated fact (which wait on that lock with no timeout) for as long as it hung.
    index = MemoryIndex(db, OLD)
    await index.start()
    pipeline = IndexPipeline(db, index, test_settings(pg_url))
    await index_turns(db, pipeline, [fact(i) for i in range(3)])
    async with db.session() as session:
        chunks = (
            await session.execute(
                text("SELECT id, text FROM memory_items WHERE index_id = 1 AND kind = 'chunk' ORDER BY id")
            )
        ).all()
    # Every pass finds a memory corrected during the one before (the passes settle at none), the
    # last one (under the lock) too, and one is corrected between its encoding and the lock.
    ends = [chunks[0], chunks[-1]]
    encoder = WritingEncoder(db, [r.id for r in ends], [r.text for r in ends], writes=16)
    ids = await reindex.begin(db, encoder)
    assert ids is not None
    old, new = ids
    progress = await reindex.build(db, encoder, old, new, batch=1, settle_batches=0)
    assert encoder.under_lock == 0
    assert progress.switched and encoder.writes == 0
    assert await rows(db, new) == await rows(db, old)


async def test_a_memory_corrected_or_forgotten_while_a_reindex_encoded_it_kept_its_old_vector_there(
    db: Database, pg_url: str
) -> None:
    # Regression: a batch of the build read its rows, encoded their texts with no lock held, then
    # copied the rows as they were by then with the vectors of what it had read: a memory corrected
    # meanwhile got its old text's vector in the new generation (found by what it no longer says,
    # for good: its copy's columns matched, so no later pass copied it again), and one forgotten
    # meanwhile kept a vector of what the user had asked to forget.
    index = MemoryIndex(db, OLD)
    await index.start()
    said = await index_turns(db, IndexPipeline(db, index, test_settings(pg_url)), [fact(i) for i in range(3)])
    async with db.session() as session:
        items = await items_by_key(session, OWNER, [(said[0], 0), (said[2], 0)])
    corrected, forgotten = items[(said[0], 0)], items[(said[2], 0)]
    encoder = GatedEncoder()
    ids = await reindex.begin(db, encoder)
    assert ids is not None
    old, new = ids
    build = asyncio.create_task(reindex.build(db, encoder, old, new, batch=8))
    await asyncio.wait_for(encoder.entered.wait(), 10)  # the first batch read both, and encodes them
    now = "my locker code is 4242 now, at the bouldering hall"
    [vector] = await OLD.embed([now])
    async with db.transaction() as session:
        await correct_item(session, OWNER, corrected.id, Embedded(now, list(vector), now, old))
        await forget_item(session, OWNER, forgotten.id)
    encoder.gate.set()
    assert (await asyncio.wait_for(build, 30)).switched

    async with db.session() as session:
        copies = {
            r.turn_id: r
            for r in await session.execute(
                text(
                    "SELECT turn_id, text, name, turn_created_at, embedding::text AS embedding "
                    "FROM memory_items WHERE index_id = :g AND kind = 'chunk'"
                ),
                {"g": new},
            )
        }
    copy = copies[corrected.turn_id]
    assert copy.text == now
    [expected] = await encoder.embed([memory_text(now, name=copy.name, created_at=copy.turn_created_at)])
    stored = [float(x) for x in copy.embedding.strip("[]").split(",")]
    assert max(abs(a - b) for a, b in zip(stored, expected, strict=True)) < 1e-6
    assert copies[forgotten.turn_id].text == "" and copies[forgotten.turn_id].embedding is None
    # Searched with the new encoder, the correction is found by what it says now.
    assert (await found_turns(db, MemoryIndex(db, encoder), "locker code 4242 bouldering hall"))[0] == said[0]
