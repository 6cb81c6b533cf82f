"""A Kafka-protocol mock cluster for tests: librdkafka's, bundled with confluent-kafka.

No Apache Kafka broker can be installed on the development machines. librdkafka can
start an in-process mock cluster (`test.mock.num.brokers`) that speaks the Kafka
protocol; its bootstrap address appears in the client's `mock` debug log. aiokafka
produces (idempotent, acks=all), consumes in a group and commits offsets against it.
What the mock is not: a real broker's durability, retention and transaction handling.

`TcpGate` stands in for "Kafka unreachable": a forwarding port in front of one broker
that can be closed (connection refused) and opened again.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import re
import time
from collections.abc import Iterator

import pytest

_BOOTSTRAP = re.compile(r"Mock cluster \S+ bootstrap\.servers=(\S+)")


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: queue.Queue[str] = queue.Queue()

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.put(record.getMessage())


class MockKafkaCluster:
    """One librdkafka mock cluster, alive as long as this object is."""

    def __init__(self, brokers: int = 3, *, rtt_ms: int = 0) -> None:
        import confluent_kafka

        self._handler = _Lines()
        self._logger = logging.getLogger(f"chatmem.tests.kafka_mock.{id(self)}")
        self._logger.addHandler(self._handler)
        self._logger.setLevel(logging.DEBUG)
        self._logger.propagate = False
        config = {"test.mock.num.brokers": brokers, "debug": "mock", "logger": self._logger}
        if rtt_ms:
            # Every broker answers this much later: a window the tests can act in, deterministically.
            config["test.mock.broker.rtt"] = rtt_ms
        self._client = confluent_kafka.Producer(config)
        self.bootstrap_servers = self._find_bootstrap(timeout=15.0)

    def _find_bootstrap(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._client.poll(0.1)  # delivers queued log lines to the logger
            while True:
                try:
                    line = self._handler.lines.get_nowait()
                except queue.Empty:
                    break
                match = _BOOTSTRAP.search(line)
                if match:
                    # The mock keeps logging every request; nobody needs those lines.
                    self._logger.setLevel(logging.WARNING)
                    return match.group(1)
        raise RuntimeError("librdkafka mock cluster did not log its bootstrap address")

    def close(self) -> None:
        """Shut the cluster down."""
        self._client.flush(1)
        self._logger.removeHandler(self._handler)
        del self._client


@pytest.fixture(scope="session")
def kafka_cluster() -> Iterator[MockKafkaCluster]:
    """The session's mock cluster (tests isolate themselves with their own topics and groups)."""
    cluster = MockKafkaCluster()
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture(scope="session")
def kafka_bootstrap(kafka_cluster: MockKafkaCluster) -> str:
    """The mock cluster's bootstrap.servers."""
    return kafka_cluster.bootstrap_servers


@pytest.fixture(scope="session")
def slow_kafka_bootstrap() -> Iterator[str]:
    """A second mock cluster whose brokers answer 1.5 s late (a publish takes that long at least)."""
    cluster = MockKafkaCluster(brokers=1, rtt_ms=1500)
    try:
        yield cluster.bootstrap_servers
    finally:
        cluster.close()


class TcpGate:
    """A local port forwarding to `target` ("host:port") while open; refused while closed."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def reserve(self) -> None:
        """Pick the port, then close it again: clients get 'connection refused'."""
        await self.open()
        await self.close()

    async def open(self) -> None:
        """Accept and forward connections on the gate's port."""
        self._server = await asyncio.start_server(self._forward, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        """Refuse new connections and cut the open ones."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for writer in list(self._writers):
            writer.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.close()
            return
        self._writers.update({writer, up_writer})

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (OSError, asyncio.CancelledError):
                pass
            finally:
                dst.close()

        for task in (
            asyncio.ensure_future(pipe(reader, up_writer)),
            asyncio.ensure_future(pipe(up_reader, writer)),
        ):
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)


def topic_size(bootstrap: str, topic: str) -> int:
    """Records ever written to `topic` (sum of its partitions' high watermarks); blocking."""
    import confluent_kafka

    client = confluent_kafka.Consumer({"bootstrap.servers": bootstrap, "group.id": "chatmem-tests-size"})
    try:
        partitions = client.list_topics(topic, timeout=10).topics[topic].partitions
        return sum(
            client.get_watermark_offsets(confluent_kafka.TopicPartition(topic, p), timeout=10)[1]
            for p in partitions
        )
    finally:
        client.close()
