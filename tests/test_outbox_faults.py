"""Invariant 4 under faults: Kafka away, indexer or relay killed, poison messages.

"Killed" means a real subprocess and SIGKILL. The kill point is made deterministic with a
table lock held by the test: the victim blocks on it exactly where the fault matters
(the indexer's upsert, the relay's mark), the test sees it waiting in pg_stat_activity,
and kills it there.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from sqlalchemy import text

from indexer.relay import OutboxRelay
from indexer.worker import IndexerWorker
from memory.config import Settings
from memory.recall.embeddings import HashEmbedder
from memory.storage.db import Database
from tests.kafka_mock import MockKafkaCluster, TcpGate
from tests.kafka_mock import topic_size as kafka_topic_size
from tests.support import wait_until
from tests.test_indexer import chat_turns, memorable, run_worker_until, scalar, test_settings
from tests.test_transport_contract import kafka_test_settings, publish_once

# The mock Kafka fixtures (`kafka_bootstrap`); conftest may register them for every module instead.

# librdkafka's mock cluster creates topics with this many partitions.
MOCK_PARTITIONS = 4

CHILD = """
import asyncio, sys
from memory.config import get_settings
from memory.recall.embeddings import HashEmbedder
from indexer.worker import run_indexer_main, run_relay_main
settings = get_settings()
if sys.argv[1] == "relay":
    asyncio.run(run_relay_main(settings))
else:
    asyncio.run(run_indexer_main(settings, embedder=HashEmbedder(dim=384)))
"""


@contextmanager
def child(role: str, settings: Settings) -> Iterator[subprocess.Popen[bytes]]:
    """`chatmem relay` or `chatmem indexer` (with the test embedder) in a real subprocess."""
    env = dict(os.environ)
    for field in (
        "database_url",
        "kafka_bootstrap_servers",
        "kafka_topic",
        "kafka_dlq_topic",
        "kafka_group_id",
        "outbox_lease_seconds",
    ):
        value = getattr(settings, field)
        if value:
            env[field.upper()] = str(value)
    env["INDEXER_BATCH_WAIT_MS"] = "50"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, role], env=env)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


@asynccontextmanager
async def table_locked(db: Database, table: str) -> AsyncIterator[None]:
    """Hold SHARE on `table`: reads and row locks go on, inserts and updates wait."""
    async with db.transaction() as session:
        await session.execute(text(f"LOCK TABLE {table} IN SHARE MODE"))
        yield


async def waiting_on_lock(db: Database, statement_start: str) -> bool:
    return bool(
        await scalar(
            db,
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE :q",
            q=f"%{statement_start}%",
        )
    )


async def test_indexer_killed_mid_batch_loses_nothing_and_duplicates_nothing(
    db: Database, pg_url: str
) -> None:
    # A short lease: the killed indexer's rows come back once it runs out.
    settings = test_settings(pg_url, outbox_lease_seconds=2)
    _, turns = await chat_turns(db, [memorable(i) for i in range(50)])
    async with table_locked(db, "memory_items"):
        with child("indexer", settings) as proc:
            await wait_until(
                lambda: waiting_on_lock(db, "INSERT INTO memory_items"), 60, "the indexer's upsert"
            )
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
    # The killed batch left nothing behind; its lease stays until it runs out.
    assert await scalar(db, "SELECT count(*) FROM memory_items") == 0
    assert await scalar(db, "SELECT count(*) FROM outbox WHERE claimed_until IS NOT NULL") > 0
    worker = IndexerWorker(db, settings, HashEmbedder(dim=384))

    async def all_consumed() -> bool:
        return await scalar(db, "SELECT count(*) FROM outbox WHERE consumed_at IS NULL") == 0

    await run_worker_until(worker, all_consumed)
    assert await scalar(db, "SELECT count(*) FROM memory_items") == 50
    assert await scalar(db, "SELECT count(DISTINCT turn_id) FROM memory_items") == 50
    assert await scalar(db, "SELECT indexed_seq FROM conversations") == turns[-1].seq


async def test_sigterm_finishes_the_batch_in_hand(db: Database, pg_url: str) -> None:
    settings = test_settings(pg_url)
    await chat_turns(db, [memorable(i) for i in range(20)])
    with child("indexer", settings) as proc:
        async with table_locked(db, "memory_items"):
            await wait_until(
                lambda: waiting_on_lock(db, "INSERT INTO memory_items"), 60, "the indexer's upsert"
            )
            proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 30) == 0
    assert await scalar(db, "SELECT count(*) FROM memory_items") == 20
    assert await scalar(db, "SELECT count(*) FROM outbox WHERE consumed_at IS NULL") == 0


async def test_poison_messages_are_dead_lettered_and_the_rest_indexed(db: Database, pg_url: str) -> None:
    settings = test_settings(pg_url, indexer_max_attempts=2)
    conversation_id, _ = await chat_turns(db, [memorable(i) for i in range(10)])
    good = await scalar(db, "SELECT payload FROM outbox ORDER BY id LIMIT 1")
    wrong_version = good | {"v": 99, "turn_id": str(uuid.uuid4())}
    # Valid by schema, refused by the database (tenant ids are at most 128 characters).
    too_long = good | {"tenant_id": "t" * 300, "turn_id": str(uuid.uuid4())}
    async with db.transaction() as session:
        for payload in (wrong_version, too_long):
            await session.execute(
                text(
                    "INSERT INTO outbox (tenant_id, user_id, conversation_id, turn_id, payload) "
                    "VALUES ('tenant-a', 'user-a', :c, :t, CAST(:p AS jsonb))"
                ),
                {"c": conversation_id, "t": uuid.uuid4(), "p": json.dumps(payload)},
            )
    worker = IndexerWorker(db, settings, HashEmbedder(dim=384), backoff_base_seconds=0.01)

    async def settled() -> bool:
        return (
            await scalar(db, "SELECT count(*) FROM outbox WHERE consumed_at IS NULL AND dead_at IS NULL") == 0
        )

    await run_worker_until(worker, settled)
    assert await scalar(db, "SELECT count(*) FROM memory_items") == 10
    async with db.transaction() as session:
        errors = sorted((await session.execute(text("SELECT error FROM dead_letters"))).scalars())
        attempts = (
            await session.execute(text("SELECT attempts FROM outbox WHERE dead_at IS NOT NULL"))
        ).all()
    assert len(errors) == 2
    assert any("unsupported payload version 99" in e for e in errors)
    assert any(e.startswith("StringDataRightTruncationError: value too long") for e in errors)
    assert sorted(a for (a,) in attempts) == [0, 2]
    assert worker.stats["dead_lettered"] == 2


async def topic_size(bootstrap: str, topic: str) -> int:
    return await asyncio.to_thread(kafka_topic_size, bootstrap, topic)


@asynccontextmanager
async def running(*runners: Any) -> AsyncIterator[None]:
    """Run relays/workers in the background; stop them on exit (their batches finished)."""
    stop = asyncio.Event()
    tasks = [asyncio.ensure_future(r.run(stop)) for r in runners]
    try:
        yield
        for task in tasks:
            if task.done():
                task.result()
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 30)


async def test_kafka_unreachable_while_100_turns_are_chatted(
    db: Database, pg_url: str, kafka_bootstrap: str
) -> None:
    settings = kafka_test_settings(pg_url, kafka_bootstrap)
    broker = kafka_bootstrap.split(",")[0]
    gate = TcpGate(broker)
    await gate.reserve()  # the relay's Kafka: connection refused
    relay_settings = settings.model_copy(update={"kafka_bootstrap_servers": gate.address})
    relay = OutboxRelay(db, relay_settings, backoff_base_seconds=0.1, backoff_max_seconds=0.5)
    worker = IndexerWorker(db, settings, HashEmbedder(dim=384))
    try:
        async with running(relay, worker):
            _, turns = await asyncio.wait_for(
                chat_turns(db, [memorable(i) for i in range(100)], one_transaction_per_turn=True), 30
            )
            assert await scalar(db, "SELECT count(*) FROM outbox WHERE published_at IS NULL") == 100
            await gate.open()  # Kafka is back

            async def all_indexed() -> bool:
                return await scalar(db, "SELECT count(*) FROM memory_items") >= 100

            await wait_until(all_indexed, 60, "the backlog to drain")
            await wait_until(lambda: _none_unpublished(db), 20, "every row marked published")
    finally:
        await gate.close()
    assert await scalar(db, "SELECT count(*) FROM memory_items") == 100
    assert await scalar(db, "SELECT count(DISTINCT turn_id) FROM memory_items") == 100
    assert await scalar(db, "SELECT indexed_seq FROM conversations") == turns[-1].seq


async def _none_unpublished(db: Database) -> bool:
    return await scalar(db, "SELECT count(*) FROM outbox WHERE published_at IS NULL") == 0


async def test_relay_killed_between_publish_and_mark(
    db: Database, pg_url: str, slow_kafka: MockKafkaCluster
) -> None:
    # The relay's claim is a committed lease, so the kill point is set after it: the brokers
    # answer 1.5 s late, the test locks the table while the relay waits for its acks, and the
    # relay's mark then waits on that lock. The lease is short, so the rows come back soon.
    kafka_bootstrap = slow_kafka.bootstrap_servers
    settings = kafka_test_settings(pg_url, kafka_bootstrap, outbox_lease_seconds=2)
    await chat_turns(db, [memorable(i) for i in range(30)])
    with child("relay", settings) as proc:
        await wait_until(
            lambda: _claimed(db, 30), 60, "the relay's lease on every row (committed before it publishes)"
        )
        async with table_locked(db, "outbox"):
            await wait_until(
                lambda: waiting_on_lock(db, "UPDATE outbox SET published_at"), 60, "the relay's mark"
            )
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
    # The kill point is passed: the brokers answer at once again for the rest.
    slow_kafka.set_rtt(0)
    assert await topic_size(kafka_bootstrap, settings.kafka_topic) == 30  # published and acknowledged
    assert await scalar(db, "SELECT count(*) FROM outbox WHERE published_at IS NULL") == 30  # never marked

    async with running(OutboxRelay(db, settings), IndexerWorker(db, settings, HashEmbedder(dim=384))):
        await wait_until(lambda: _none_unpublished(db), 60, "the rows published again")
        await wait_until(
            lambda: _topic_consumed(db, kafka_bootstrap, settings), 60, "the duplicates consumed"
        )
    assert await topic_size(kafka_bootstrap, settings.kafka_topic) == 60  # every turn delivered twice
    assert await scalar(db, "SELECT count(*) FROM memory_items") == 30
    assert await scalar(db, "SELECT count(DISTINCT turn_id) FROM memory_items") == 30


async def _claimed(db: Database, count: int) -> bool:
    return await scalar(db, "SELECT count(*) FROM outbox WHERE claim_token IS NOT NULL") == count


async def _topic_consumed(db: Database, bootstrap: str, settings: Settings) -> bool:
    reader = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=settings.kafka_group_id)
    await reader.start()
    try:
        partitions = [TopicPartition(settings.kafka_topic, p) for p in range(MOCK_PARTITIONS)]
        committed = [await reader.committed(tp) or 0 for tp in partitions]
    finally:
        await reader.stop()
    return sum(committed) == await topic_size(bootstrap, settings.kafka_topic) == 60


async def test_undecodable_kafka_message_is_dead_lettered_and_the_rest_indexed(
    db: Database, pg_url: str, kafka_bootstrap: str
) -> None:
    settings = kafka_test_settings(pg_url, kafka_bootstrap)
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, enable_idempotence=True, acks="all")
    await producer.start()
    try:
        await producer.send_and_wait(settings.kafka_topic, b"\xff not json", key=b"k")
    finally:
        await producer.stop()
    await chat_turns(db, [memorable(i) for i in range(5)])
    async with running(OutboxRelay(db, settings), IndexerWorker(db, settings, HashEmbedder(dim=384))):
        await wait_until(
            lambda: _count_is(db, "SELECT count(*) FROM memory_items", 5), 30, "the good turns indexed"
        )
    reader = AIOKafkaConsumer(
        settings.kafka_dlq_topic, bootstrap_servers=kafka_bootstrap, auto_offset_reset="earliest"
    )
    await reader.start()
    try:
        record = await asyncio.wait_for(reader.getone(), 20)
    finally:
        await reader.stop()
    envelope = json.loads(record.value)
    assert envelope["error"].startswith("PoisonPayload: undecodable")
    assert envelope["source"]["topic"] == settings.kafka_topic


async def _count_is(db: Database, sql: str, expected: int) -> bool:
    return await scalar(db, sql) == expected


async def test_a_claim_failing_while_a_batch_fills_does_not_keep_the_rows_already_leased_forever(
    db: Database, pg_url: str
) -> None:
    # Regression: the Postgres consumer fills a batch with several claims; when a later claim
    # failed (here its lock timeout, as with any database error), the rows of the earlier ones
    # were dropped from the batch but stayed in the consumer's leases, renewed for as long as the
    # process lived: those turns never reached memory until the indexer was restarted.
    settings = test_settings(
        pg_url,
        indexer_batch_size=64,
        indexer_batch_wait_ms=3_000,  # the batch is still filling when the table is locked
        background_lock_timeout_ms=300,
        outbox_lease_seconds=3,
    )
    await chat_turns(db, [memorable(i) for i in range(3)])
    worker = IndexerWorker(db, settings, HashEmbedder(dim=384), backoff_base_seconds=0.1)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        await wait_until(
            lambda: scalar(db, "SELECT count(*) = 3 FROM outbox WHERE claimed_until IS NOT NULL"),
            30,
            "the first claim of the batch",
        )
        async with db.transaction() as session:
            # The next claim of the filling batch waits on the table and gives up (lock timeout).
            await session.execute(text("LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE"))
            await wait_until(lambda: worker.stats["retried_batches"] >= 1, 30, "the lock to stop the worker")

        async def all_consumed() -> bool:
            if task.done():
                task.result()
            return bool(await scalar(db, "SELECT count(*) = 0 FROM outbox WHERE consumed_at IS NULL"))

        await wait_until(all_consumed, 20, "the three turns to be indexed")
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
    assert await scalar(db, "SELECT count(DISTINCT turn_id) FROM memory_items") == 3


async def test_a_relay_whose_mark_failed_does_not_keep_the_published_rows_leased_forever(
    db: Database, pg_url: str, slow_kafka: MockKafkaCluster
) -> None:
    # Regression: when marking a published batch failed (here its lock timeout, as with any
    # database error), the relay kept the rows in the leases it renews: they stayed unpublished
    # for as long as it lived, never sent again, and /metrics showed them as a backlog growing older.
    settings = kafka_test_settings(
        pg_url, slow_kafka.bootstrap_servers, background_lock_timeout_ms=300, outbox_lease_seconds=3
    )
    await chat_turns(db, [memorable(i) for i in range(10)])
    async with running(OutboxRelay(db, settings)):
        await wait_until(lambda: _claimed(db, 10), 60, "the relay's lease on every row")
        async with table_locked(db, "outbox"):
            # The brokers answer 1.5 s late: the mark comes after the lock, waits, and gives up.
            await wait_until(
                lambda: waiting_on_lock(db, "UPDATE outbox SET published_at"), 60, "the relay's mark"
            )
            await wait_until(
                lambda: _not(waiting_on_lock(db, "UPDATE outbox SET published_at")), 30, "its lock timeout"
            )
            slow_kafka.set_rtt(0)  # the mark has failed: the brokers may answer at once again
        await wait_until(lambda: _none_unpublished(db), 30, "the rows published again and marked")
    assert await topic_size(slow_kafka.bootstrap_servers, settings.kafka_topic) == 20  # each sent twice


async def _not(condition: Awaitable[bool]) -> bool:
    return not await condition


async def test_a_kafka_dead_letter_whose_mark_failed_does_not_pin_its_conversations_watermark(
    db: Database, pg_url: str, kafka_bootstrap: str
) -> None:
    # Regression: a Kafka dead letter's outbox row was marked dead (and the watermark moved past it)
    # only after the offsets were committed, best effort. When that mark failed (here its lock
    # timeout, as with any database error) the row stayed pending for good: the conversation's
    # watermark stayed below it, over turns indexed since, until retention purged the row.
    settings = kafka_test_settings(pg_url, kafka_bootstrap, background_lock_timeout_ms=300)
    conversation_id, turns = await chat_turns(db, [memorable(i) for i in range(3)])
    poisoned = turns[1].id
    async with db.transaction() as session:
        await session.execute(
            text("""UPDATE outbox SET payload = payload || '{"v": 99}' WHERE turn_id = :id"""),
            {"id": poisoned},
        )
    assert await publish_once(db, settings) == 3
    worker = IndexerWorker(db, settings, HashEmbedder(dim=384), backoff_base_seconds=0.05)
    async with running(worker):
        async with db.transaction() as session:
            # The dead letter's row is locked: marking it dead waits, and gives up.
            await session.execute(
                text("SELECT 1 FROM outbox WHERE turn_id = :id FOR UPDATE"), {"id": poisoned}
            )
            await wait_until(
                lambda: waiting_on_lock(db, "UPDATE outbox o SET dead_at"), 30, "the dead letter's mark"
            )
            await wait_until(
                lambda: _not(waiting_on_lock(db, "UPDATE outbox o SET dead_at")), 30, "its lock timeout"
            )
        await wait_until(lambda: worker.stats["batches"] >= 1, 30, "the batch committed")
    assert await topic_size(kafka_bootstrap, settings.kafka_dlq_topic) >= 1
    dead = await scalar(
        db, "SELECT count(*) FROM outbox WHERE dead_at IS NOT NULL AND turn_id = :id", id=poisoned
    )
    assert dead == 1, "the dead letter's outbox row is still pending"
    watermark = await scalar(db, "SELECT indexed_seq FROM conversations WHERE id = :id", id=conversation_id)
    assert watermark == turns[2].seq
