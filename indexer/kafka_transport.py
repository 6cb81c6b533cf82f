"""The Kafka transport: a consumer group on the turns topics, offsets committed by hand.

Two topics: live turns, and imported history (see indexer/relay.py). Each poll takes live
turns first and reads history only when no live turn is waiting, so a big import never
sits between a user and their new turn's memory.

Offsets are committed only after the batch's memory rows are committed in Postgres. When
a rebalance takes partitions away mid-batch, the revocation waits (bounded) for the batch
to be committed, so the next owner starts after it; if the wait runs out or the commit
is refused, the next owner gets the batch again and the idempotent upsert absorbs it.
Either way no batch is lost and no row is written twice.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError

from memory.config import Settings

from .transport import Message

log = logging.getLogger(__name__)

# How long a revocation waits for the in-flight batch; past it, redelivery is absorbed.
REVOKE_WAIT_SECONDS = 30.0


def decode_record(record: ConsumerRecord[bytes, bytes]) -> Message:
    """A Kafka record as a Message; bytes that are not a JSON object give a poison message."""
    handle = (record.topic, record.partition, record.offset)
    key = record.key.decode("utf-8", "replace") if record.key else None
    try:
        payload = json.loads(record.value or b"")
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raw = (record.value or b"")[:2000].decode("utf-8", "replace")
        return Message(payload={"raw": raw}, handle=handle, key=key, decode_error=f"undecodable: {exc}")
    if not isinstance(payload, dict):
        return Message(payload={"raw": payload}, handle=handle, key=key, decode_error="not a JSON object")
    return Message(payload=payload, handle=handle, key=key)


def _next_offsets(messages: Sequence[Message]) -> dict[TopicPartition, int]:
    offsets: dict[TopicPartition, int] = {}
    for message in messages:
        topic, partition, offset = message.handle
        tp = TopicPartition(topic, partition)
        offsets[tp] = max(offsets.get(tp, 0), offset + 1)
    return offsets


class _WaitForBatch(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, transport: KafkaQueueConsumer) -> None:
        self._transport = transport

    async def on_partitions_revoked(self, revoked: Any) -> None:
        await self._transport._wait_for_batch(set(revoked))

    async def on_partitions_assigned(self, assigned: Any) -> None:
        log.info("indexer partitions assigned: %s", sorted((tp.topic, tp.partition) for tp in assigned))


class KafkaQueueConsumer:
    """The indexer's Kafka transport (aiokafka, auto-commit off, dead letters to a topic)."""

    def __init__(self, settings: Settings, *, bootstrap_servers: str | None = None) -> None:
        self._bootstrap = bootstrap_servers or settings.kafka_bootstrap_servers
        if not self._bootstrap:
            raise ValueError("KafkaQueueConsumer needs KAFKA_BOOTSTRAP_SERVERS")
        self._topic = settings.kafka_topic
        self._history_topic = settings.history_topic
        self._dlq_topic = settings.kafka_dlq_topic
        self._group = settings.kafka_group_id
        self._consumer: AIOKafkaConsumer | None = None
        self._producer: AIOKafkaProducer | None = None
        self._in_flight: list[Message] = []
        self._batch_done = asyncio.Event()
        self._batch_done.set()

    async def start(self) -> None:
        """Join the consumer group and open the dead-letter producer."""
        self._producer = AIOKafkaProducer(
            bootstrap_servers=self._bootstrap, enable_idempotence=True, acks="all"
        )
        await self._producer.start()
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=self._bootstrap,
            group_id=self._group,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
        )
        self._consumer.subscribe([self._topic, self._history_topic], listener=_WaitForBatch(self))
        try:
            await self._consumer.start()
        except BaseException:
            await self.stop()
            raise

    async def poll_batch(self, max_records: int, timeout: float) -> list[Message]:
        """Up to `max_records` records, live turns first, waiting at most `timeout` seconds in all."""
        assert self._consumer is not None, "start() first"
        deadline = time.monotonic() + timeout
        batch: list[Message] = []
        while len(batch) < max_records:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            live = [tp for tp in self._consumer.assignment() if tp.topic == self._topic]
            fetched = await self._consumer.getmany(*live, timeout_ms=0, max_records=max_records - len(batch))
            if not any(fetched.values()):
                # Nothing live is waiting: history, or whatever arrives first.
                fetched = await self._consumer.getmany(
                    timeout_ms=max(1, int(remaining * 1000)), max_records=max_records - len(batch)
                )
            for records in fetched.values():
                batch.extend(decode_record(r) for r in records)
            if batch and any(m.handle[0] == self._history_topic for m in batch):
                break  # a batch of history goes as it is, so a live turn waits at most one batch
        if batch:
            self._in_flight = batch
            self._batch_done.clear()
        return batch

    async def commit(self, messages: Sequence[Message]) -> None:
        """Commit the offsets after the batch (the rows are already durable)."""
        assert self._consumer is not None
        try:
            if messages:
                await self._consumer.commit(_next_offsets(messages))
        except (CommitFailedError, IllegalStateError) as exc:
            # The partitions moved to another member, which will deliver these again.
            log.warning("offset commit refused after a rebalance; redelivery will be absorbed: %s", exc)
        finally:
            self._finish_batch()

    async def abandon(self, messages: Sequence[Message]) -> None:
        """Seek back to the batch's first offsets so it is fetched again."""
        assert self._consumer is not None
        firsts: dict[TopicPartition, int] = {}
        for message in messages:
            topic, partition, offset = message.handle
            tp = TopicPartition(topic, partition)
            firsts[tp] = min(firsts.get(tp, offset), offset)
        assigned = self._consumer.assignment()
        for tp, offset in firsts.items():
            if tp in assigned:
                self._consumer.seek(tp, offset)
        self._finish_batch()

    async def dead_letter(self, message: Message, error: str) -> None:
        """Publish the message and its error to the dead-letter topic (acknowledged)."""
        assert self._producer is not None
        topic, partition, offset = message.handle
        envelope = {
            "error": error,
            "payload": message.payload,
            "source": {"topic": topic, "partition": partition, "offset": offset},
            "attempts": message.attempts,
        }
        key = message.key.encode() if message.key else None
        await self._producer.send_and_wait(self._dlq_topic, json.dumps(envelope).encode(), key=key)

    async def stop(self) -> None:
        """Leave the group without committing the in-flight batch; close the producer."""
        self._finish_batch()
        try:
            if self._consumer is not None:
                await self._consumer.stop()
        finally:
            if self._producer is not None:
                await self._producer.stop()

    def _finish_batch(self) -> None:
        self._in_flight = []
        self._batch_done.set()

    async def _wait_for_batch(self, revoked: set[TopicPartition]) -> None:
        touched = {TopicPartition(m.handle[0], m.handle[1]) for m in self._in_flight}
        if not touched & revoked:
            return
        try:
            await asyncio.wait_for(self._batch_done.wait(), REVOKE_WAIT_SECONDS)
        except TimeoutError:
            log.warning("rebalance did not wait for the in-flight batch; it will be redelivered")


def is_kafka_error(exc: BaseException) -> bool:
    """True for broker-side failures worth retrying with backoff."""
    return isinstance(exc, KafkaError | OSError | asyncio.TimeoutError)
