"""A Kafka-protocol mock cluster for tests: librdkafka's, bundled with confluent-kafka.

No Apache Kafka broker can be installed on the development machines. librdkafka can
start an in-process mock cluster that speaks the Kafka protocol; aiokafka produces
(idempotent, acks=all), consumes in a group and commits offsets against it. The cluster is
made through librdkafka's mock API (`rd_kafka_mock_cluster_new`), called with ctypes on the
library confluent-kafka ships, because that API also sets the brokers' round-trip time while
they run (`rd_kafka_mock_broker_set_rtt`), which `test.mock.*` settings cannot: a test opens
a slow window exactly where it needs one and does the rest at full speed.
What the mock is not: a real broker's durability, retention and transaction handling.

`TcpGate` stands in for "Kafka unreachable": a forwarding port in front of one broker
that can be closed (connection refused) and opened again.
"""

from __future__ import annotations

import asyncio
import ctypes
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

_RD_KAFKA_PRODUCER = 0
_ALL_BROKERS = -1


@cache
def _librdkafka() -> ctypes.CDLL:
    """The librdkafka that confluent-kafka loads (its wheel bundles it), typed for the mock API."""
    import confluent_kafka

    libs = Path(confluent_kafka.__file__).resolve().parent.parent / "confluent_kafka.libs"
    lib = ctypes.CDLL(str(next(libs.glob("librdkafka*.so*"))))
    lib.rd_kafka_conf_new.restype = ctypes.c_void_p
    lib.rd_kafka_new.restype = ctypes.c_void_p
    lib.rd_kafka_new.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
    lib.rd_kafka_destroy.argtypes = [ctypes.c_void_p]
    lib.rd_kafka_mock_cluster_new.restype = ctypes.c_void_p
    lib.rd_kafka_mock_cluster_new.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.rd_kafka_mock_cluster_bootstraps.restype = ctypes.c_char_p
    lib.rd_kafka_mock_cluster_bootstraps.argtypes = [ctypes.c_void_p]
    lib.rd_kafka_mock_cluster_destroy.argtypes = [ctypes.c_void_p]
    lib.rd_kafka_mock_broker_set_rtt.restype = ctypes.c_int
    lib.rd_kafka_mock_broker_set_rtt.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int]
    return lib


class MockKafkaCluster:
    """One librdkafka mock cluster, alive until `close()`."""

    def __init__(self, brokers: int = 3, *, rtt_ms: int = 0) -> None:
        lib = _librdkafka()
        error = ctypes.create_string_buffer(512)
        # The mock cluster lives in a client handle of its own (a producer nobody produces with).
        self._handle = lib.rd_kafka_new(_RD_KAFKA_PRODUCER, lib.rd_kafka_conf_new(), error, len(error))
        if not self._handle:
            raise RuntimeError(f"librdkafka client: {error.value.decode()}")
        self._cluster = lib.rd_kafka_mock_cluster_new(self._handle, brokers)
        if not self._cluster:
            lib.rd_kafka_destroy(self._handle)
            raise RuntimeError("librdkafka mock cluster could not be created")
        self.bootstrap_servers: str = lib.rd_kafka_mock_cluster_bootstraps(self._cluster).decode()
        if rtt_ms:
            self.set_rtt(rtt_ms)

    def set_rtt(self, rtt_ms: int) -> None:
        """Every broker answers `rtt_ms` later from now on (0: at once)."""
        if _librdkafka().rd_kafka_mock_broker_set_rtt(self._cluster, _ALL_BROKERS, rtt_ms):
            raise RuntimeError("librdkafka refused the mock brokers' round-trip time")

    def close(self) -> None:
        """Shut the cluster down."""
        lib = _librdkafka()
        lib.rd_kafka_mock_cluster_destroy(self._cluster)
        lib.rd_kafka_destroy(self._handle)


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


@pytest.fixture
def slow_kafka() -> Iterator[MockKafkaCluster]:
    """A mock cluster of the test's own whose broker answers 1.5 s late (a publish takes that long
    at least) until the test calls `set_rtt(0)`."""
    cluster = MockKafkaCluster(brokers=1, rtt_ms=1500)
    try:
        yield cluster
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
