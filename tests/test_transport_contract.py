"""One contract, two transports: the Postgres outbox queue and Kafka (librdkafka's mock cluster).

On Kafka, "publish" is the real path: outbox rows moved by a running `OutboxRelay`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer

from indexer.kafka_transport import KafkaQueueConsumer
from indexer.pg_queue import PgQueueConsumer
from indexer.relay import OutboxRelay
from indexer.transport import Consumer, Message
from indexer.worker import IndexerWorker
from memory.config import Settings
from memory.recall.embeddings import HashEmbedder
from memory.storage.db import Database
from tests.kafka_mock import topic_size as kafka_topic_size
from tests.test_indexer import chat_turns, memorable, scalar, test_settings

# The mock Kafka fixtures (`kafka_bootstrap`); conftest may register them for every module instead.


def kafka_test_settings(pg_url: str, bootstrap: str, **overrides: Any) -> Settings:
    """Settings with a topic, dead-letter topic and group of the test's own."""
    name = uuid.uuid4().hex[:10]
    return test_settings(
        pg_url,
        kafka_bootstrap_servers=bootstrap,
        kafka_topic=f"turns-{name}",
        kafka_dlq_topic=f"turns-{name}.dlq",
        kafka_group_id=f"indexer-{name}",
        **overrides,
    )


async def publish_once(db: Database, settings: Settings) -> int:
    """One pass of the relay over the outbox (its own producer): how many turns it published."""
    relay = OutboxRelay(db, settings)
    producer = await relay._open_producer()
    try:
        return await relay.publish_once(producer)
    finally:
        await producer.stop()


async def index_through(db: Database, settings: Settings, consumer: Consumer, count: int) -> IndexerWorker:
    """Index `count` turns as `consumer` delivers them (an indexer's loop); the worker, for its stats."""
    worker = IndexerWorker(db, settings, HashEmbedder(dim=384), consumer=consumer)
    await consumer.start()
    try:
        consumed = 0
        while consumed < count:
            batch = await consumer.poll_batch(count - consumed, 10.0)
            assert batch, "the indexer got nothing within 10 s"
            await worker.process(batch)
            consumed += len(batch)
    finally:
        await consumer.stop()
    return worker


@dataclass
class Transport:
    name: str
    db: Database
    settings: Settings

    def consumer(self) -> Consumer:
        if self.name == "kafka":
            return KafkaQueueConsumer(self.settings)
        return PgQueueConsumer(self.db, self.settings)

    async def publish(self, n: int) -> set[str]:
        _, turns = await chat_turns(self.db, [memorable(i) for i in range(n)])
        return {str(t.id) for t in turns}


@pytest.fixture(params=["postgres", "kafka"])
async def transport(request: pytest.FixtureRequest, db: Database, pg_url: str) -> AsyncIterator[Transport]:
    if request.param == "postgres":
        yield Transport("postgres", db, test_settings(pg_url))
        return
    settings = kafka_test_settings(pg_url, request.getfixturevalue("kafka_bootstrap"))
    stop = asyncio.Event()
    relay = asyncio.ensure_future(OutboxRelay(db, settings).run(stop))
    try:
        yield Transport("kafka", db, settings)
    finally:
        stop.set()
        await asyncio.wait_for(relay, 30)


async def poll_until(consumer: Consumer, count: int, timeout: float = 30.0) -> list[Message]:
    """Poll batches (without committing) until `count` messages arrived."""
    got: list[Message] = []
    deadline = time.monotonic() + timeout
    while len(got) < count:
        assert time.monotonic() < deadline, f"only {len(got)} of {count} messages arrived"
        got.extend(await consumer.poll_batch(count - len(got), 0.5))
    return got


def turn_ids(messages: list[Message]) -> list[str]:
    return [m.payload["turn_id"] for m in messages]


async def test_published_turns_are_consumed_and_stay_done_once_committed(transport: Transport) -> None:
    published = await transport.publish(12)
    first = transport.consumer()
    await first.start()
    try:
        batch = await poll_until(first, 12)
        assert sorted(turn_ids(batch)) == sorted(published)
        assert all(m.payload["v"] == 1 and m.payload["text"] for m in batch)
        await first.commit(batch)
    finally:
        await first.stop()
    second = transport.consumer()  # same group
    await second.start()
    try:
        assert await second.poll_batch(100, 2.0) == []
    finally:
        await second.stop()


async def test_uncommitted_batch_is_redelivered_after_the_consumer_dies(transport: Transport) -> None:
    published = await transport.publish(8)
    crashed = transport.consumer()
    await crashed.start()
    try:
        assert sorted(turn_ids(await poll_until(crashed, 8))) == sorted(published)
    finally:
        await crashed.stop()  # leaves without committing, as a crash would
    survivor = transport.consumer()
    await survivor.start()
    try:
        again = await poll_until(survivor, 8)
        assert sorted(turn_ids(again)) == sorted(published)
        await survivor.commit(again)
    finally:
        await survivor.stop()


async def test_abandoned_batch_comes_back_to_the_same_consumer(transport: Transport) -> None:
    published = await transport.publish(5)
    consumer = transport.consumer()
    await consumer.start()
    try:
        batch = await poll_until(consumer, 5)
        await consumer.abandon(batch)
        again = await poll_until(consumer, 5)
        assert sorted(turn_ids(again)) == sorted(published)
        await consumer.commit(again)
        assert await consumer.poll_batch(10, 0.5) == []
    finally:
        await consumer.stop()


async def test_dead_lettered_message_is_done_and_kept_with_its_error(transport: Transport) -> None:
    published = await transport.publish(3)
    consumer = transport.consumer()
    await consumer.start()
    try:
        batch = await poll_until(consumer, 3)
        poison = batch[0]
        await consumer.dead_letter(poison, "ValueError: cannot index this")
        await consumer.commit(batch)
        assert await consumer.poll_batch(10, 1.0) == []
    finally:
        await consumer.stop()
    assert poison.payload["turn_id"] in published
    if transport.name == "postgres":
        assert await scalar(transport.db, "SELECT error FROM dead_letters") == "ValueError: cannot index this"
        assert await scalar(transport.db, "SELECT count(*) FROM outbox WHERE dead_at IS NOT NULL") == 1
        assert await scalar(transport.db, "SELECT count(*) FROM outbox WHERE consumed_at IS NOT NULL") == 2
    else:
        envelope = await read_one(
            transport.settings.kafka_bootstrap_servers, transport.settings.kafka_dlq_topic
        )
        assert envelope["error"] == "ValueError: cannot index this"
        assert envelope["payload"]["turn_id"] == poison.payload["turn_id"]


async def test_a_message_dead_lettered_again_after_its_batch_came_back_is_kept_at_least_once(
    transport: Transport,
) -> None:
    # A dead letter is kept at once (the worker marks its outbox row dead before the commit); a
    # batch given back before its commit brings it back, and it is dead-lettered again.
    await transport.publish(2)
    consumer = transport.consumer()
    await consumer.start()
    try:
        batch = await poll_until(consumer, 2)
        await consumer.dead_letter(batch[0], "ValueError: cannot index this")
        await consumer.abandon(batch)
        again = await poll_until(consumer, 2)
        poison = next(m for m in again if m.payload["turn_id"] == batch[0].payload["turn_id"])
        await consumer.dead_letter(poison, "ValueError: cannot index this")
        await consumer.commit(again)
        assert await consumer.poll_batch(10, 1.0) == []
    finally:
        await consumer.stop()
    if transport.name == "postgres":  # one dead_letters row per outbox row
        assert await scalar(transport.db, "SELECT count(*) FROM dead_letters") == 1
        assert await scalar(transport.db, "SELECT count(*) FROM outbox WHERE dead_at IS NOT NULL") == 1
    else:  # the topic has it twice
        size = await asyncio.to_thread(
            kafka_topic_size,
            str(transport.settings.kafka_bootstrap_servers),
            transport.settings.kafka_dlq_topic,
        )
        assert size == 2


async def read_one(bootstrap: str | None, topic: str) -> dict[str, Any]:
    reader = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest")
    await reader.start()
    try:
        record = await asyncio.wait_for(reader.getone(), 20)
        return dict(json.loads(record.value))
    finally:
        await reader.stop()


async def test_two_consumers_in_one_group_share_the_work_without_overlap(transport: Transport) -> None:
    if transport.name == "kafka":
        pytest.skip(
            "librdkafka's mock cluster answers aiokafka's SyncGroup with INVALID_REQUEST when a second "
            "member joins, so a two-member group cannot form against the mock; needs a real broker"
        )
    published = await transport.publish(40)
    seen: list[str] = []
    consumers = [transport.consumer(), transport.consumer()]
    for consumer in consumers:
        await consumer.start()

    async def work(consumer: Consumer) -> None:
        deadline = time.monotonic() + 30
        while len(seen) < 40 and time.monotonic() < deadline:
            batch = await consumer.poll_batch(7, 0.3)
            seen.extend(turn_ids(batch))
            await consumer.commit(batch)

    try:
        await asyncio.gather(*(work(c) for c in consumers))
    finally:
        for consumer in consumers:
            await consumer.stop()
    assert sorted(seen) == sorted(published), "a message was lost or delivered twice"


async def test_a_postgres_queue_batch_writes_each_outbox_row_once_after_its_claim(
    db: Database, pg_url: str
) -> None:
    # Regression: the pipeline marked the batch's rows consumed with their memory, and the
    # queue's commit then wrote every row again (consumed_at once more, the lease cleared): two
    # row versions per turn and batch, each with its index entries, where one does.
    settings = test_settings(pg_url)
    _, turns = await chat_turns(db, [memorable(i) for i in range(5)])
    await index_through(db, settings, PgQueueConsumer(db, settings), 5)
    # Each row's last version is the one written by the transaction that wrote its memory.
    rows = await scalar(
        db,
        """
        SELECT count(*) FROM outbox o
        WHERE o.consumed_at IS NOT NULL AND o.claimed_until IS NULL AND o.claim_token IS NULL
          AND o.xmin::text = (SELECT min(m.xmin::text) FROM memory_items m WHERE m.turn_id = o.turn_id)
        """,
    )
    assert rows == len(turns) == 5


async def test_an_idle_postgres_consumer_claims_only_when_notified(db: Database, pg_url: str) -> None:
    # The indexer's loop calls poll_batch back to back; it claimed at each call's start and end,
    # ~10 claim transactions a second with nothing queued.
    consumer = PgQueueConsumer(db, test_settings(pg_url, relay_poll_seconds=60.0))
    claims: list[int] = []
    claim = consumer._claims.claim

    async def counted(statement: Any, limit: int) -> Any:
        rows = await claim(statement, limit)
        claims.append(len(rows))
        return rows

    consumer._claims.claim = counted  # type: ignore[method-assign]
    await consumer.start()
    try:
        for _ in range(10):  # half a second of an idle indexer's loop
            assert await consumer.poll_batch(10, 0.05) == []
        assert len(claims) <= 2, f"{len(claims)} claims with nothing queued"
        published = await Transport("postgres", db, test_settings(pg_url)).publish(3)
        started = time.monotonic()
        got = await poll_until(consumer, 3)
        # Claimed on the outbox write's notification, not at the next poll a minute later.
        assert time.monotonic() - started < 10
        assert sorted(turn_ids(got)) == sorted(published)
        await consumer.commit(got)
    finally:
        await consumer.stop()
