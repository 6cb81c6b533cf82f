"""The one small interface the indexer consumes through: Kafka or the Postgres outbox.

Both transports promise at-least-once delivery: a message is delivered again until it
is committed or dead-lettered, and the indexer's idempotent upsert turns that into
exactly-once in effect. Contract tests in `tests/test_transport_contract.py` hold both
to the same behaviour.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(slots=True)
class Message:
    """One delivered message: its decoded payload and the transport's own handle."""

    payload: dict[str, Any]
    # Kafka: (topic, partition, offset); Postgres: the outbox row id.
    handle: Any
    # Deliveries of this message that ended without a commit, as far as the transport knows.
    attempts: int = 0
    key: str | None = None
    # Set when the bytes could not be decoded to a JSON object (a poison message).
    decode_error: str | None = field(default=None)


class Consumer(Protocol):
    """A member of the indexer's consumer group."""

    async def start(self) -> None:
        """Connect and join the group."""

    async def poll_batch(self, max_records: int, timeout: float) -> list[Message]:
        """Up to `max_records` messages, waiting at most `timeout` seconds to fill the batch."""
        ...

    async def commit(self, messages: Sequence[Message]) -> None:
        """Mark a polled batch done (call only after its effects are durable)."""

    async def abandon(self, messages: Sequence[Message]) -> None:
        """Give a polled batch back uncommitted, so it is delivered again."""

    async def dead_letter(self, message: Message, error: str) -> None:
        """Keep a message that keeps failing, with its error, at once; it is done at the next commit.

        At least once: a batch given back before its commit is delivered again, and its dead
        letters are kept again (the Postgres queue keeps one row per outbox row).
        """

    async def stop(self) -> None:
        """Leave the group; whatever is polled and not committed is delivered again."""
