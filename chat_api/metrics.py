"""The API's Prometheus metrics, each defined once, and the functions that observe them.

Metric objects live in prometheus_client's default registry, as the library intends:
a collector registered twice raises, so they are created here, once per process, and
every other module calls the `observe_*` functions instead of touching them. Labels are
small closed sets (statuses, outcomes, route templates), never ids or user text, so the
series count stays bounded.

The outbox gauges are read from the database when /metrics is scraped (see
`chat_api/observability.py`); the indexer's own metrics are in `indexer/metrics.py`.

Under `serve --workers N` every process writes its samples to prometheus_client's
multiprocess files (PROMETHEUS_MULTIPROC_DIR), and a scrape of any worker sums them, so one
port answers for all of its processes (`exposition`). Gauges of this process's own state
declare how they combine; the state read from the database is not per process and is kept
out of those files (`DatabaseState`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

MULTIPROCESS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

# Seconds; from a fast in-process demo reply to a slow model with tools.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
DURATION_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)

TIME_TO_FIRST_TOKEN = Histogram(
    "chatmem_time_to_first_token_seconds",
    "From the message being accepted to the first text or tool-call delta of the reply.",
    buckets=LATENCY_BUCKETS,
)
STREAM_DURATION = Histogram(
    "chatmem_reply_duration_seconds",
    "From the message being accepted to the reply's terminal state being stored.",
    ["status"],
    buckets=DURATION_BUCKETS,
)
STOP_LATENCY = Histogram(
    "chatmem_stop_latency_seconds",
    "From a stop request arriving to the reply's terminal state being stored (any process).",
    ["outcome"],
    buckets=LATENCY_BUCKETS,
)
TURNS = Counter("chatmem_turns_total", "Replies ended, by terminal status.", ["status"])
TOKENS = Counter("chatmem_tokens_total", "Model tokens, as reported by the provider's usage.", ["kind"])
RETRIEVAL_LATENCY = Histogram(
    "chatmem_retrieval_seconds",
    "Memory search before a reply (embedding the query and the hybrid search).",
    buckets=LATENCY_BUCKETS,
)
REWRITE_LATENCY = Histogram(
    "chatmem_rewrite_seconds",
    "Query rewriting before retrieval, by outcome (model, fallback, timeout, skipped).",
    ["outcome"],
    buckets=LATENCY_BUCKETS,
)
RECALLS = Counter(
    "chatmem_recalls_total",
    "Memory recalls before a reply, by outcome (ok, timeout: past RECALL_TIMEOUT_SECONDS, error, "
    "keywords_only: the embedding service did not answer).",
    ["outcome"],
)
QUERIES_AHEAD = Counter(
    "chatmem_queries_encoded_ahead_total",
    "Recall queries encoded while their reply was accepted (started), and of them the vectors a "
    "recall used (used); the rest were encoded again or their reply never recalled.",
    ["outcome"],
)
APPROVAL_DECISIONS = Counter(
    "chatmem_tool_approval_decisions_total",
    "Decisions on tool calls that waited for a person, by decision and by whom (user/timeout).",
    ["decision", "by"],
)
OPEN_STREAMS = Gauge(
    "chatmem_open_streams", "SSE responses open (over the live processes).", multiprocess_mode="livesum"
)
RATE_LIMITED = Counter("chatmem_rate_limited_total", "Requests answered 429, by limit.", ["limit"])
HTTP_REQUESTS = Counter(
    "chatmem_http_requests_total",
    "HTTP requests answered, by route template and status.",
    ["route", "status"],
)
HTTP_LATENCY = Histogram(
    "chatmem_http_request_seconds",
    "Time to the end of the response body (for SSE: the whole stream).",
    ["route"],
    buckets=LATENCY_BUCKETS,
)
ENCODER = Gauge(
    "chatmem_encoder_info",
    "1 for the runtime this process encodes text with; `requested` differs from `runtime` after a fallback.",
    ["requested", "runtime"],
    multiprocess_mode="livemax",
)
MEMORY_REFUSED = Gauge(
    "chatmem_memory_index_refused",
    "1 while this process refuses memory: the active generation is made by an encoder it cannot load "
    "(taken over or switched to by a reindex; or it loads the encoder of one taken over); replies go on "
    "without memory, `chatmem indexer` retries its batches. Summed over the live processes.",
    multiprocess_mode="livesum",
)

# Token kinds copied from the provider's usage; anything else a provider reports is ignored.
USAGE_KINDS = ("prompt_tokens", "completion_tokens")


def observe_encoder(embedder: object) -> None:
    """Record which runtime encodes (an OpenVINO encoder that fell back to torch shows it here)."""
    runtime = str(getattr(embedder, "runtime", type(embedder).__name__))
    ENCODER.labels(requested=str(getattr(embedder, "requested_runtime", runtime)), runtime=runtime).set(1)


def observe_memory_refused(reason: str | None) -> None:
    """Record whether this process refuses memory now (``MemoryIndex.refused``: why, or None)."""
    MEMORY_REFUSED.set(0 if reason is None else 1)


def observe_first_token(seconds: float) -> None:
    """Record the time to the first delta of a reply."""
    TIME_TO_FIRST_TOKEN.observe(max(seconds, 0.0))


def observe_reply_end(status: str, seconds: float, usage: Mapping[str, int] | None = None) -> None:
    """Record one ended reply: its terminal status, how long it ran, and its token usage."""
    TURNS.labels(status=status).inc()
    STREAM_DURATION.labels(status=status).observe(max(seconds, 0.0))
    for kind in USAGE_KINDS:
        value = (usage or {}).get(kind)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            TOKENS.labels(kind=kind.removesuffix("_tokens")).inc(value)


def observe_approval(decision: str, by: str) -> None:
    APPROVAL_DECISIONS.labels(decision, by).inc()


def observe_stop(seconds: float, *, ended: bool) -> None:
    """Record how long a stop request took to see the reply ended (or to give up waiting)."""
    STOP_LATENCY.labels(outcome="ended" if ended else "pending").observe(max(seconds, 0.0))


def observe_retrieval(seconds: float) -> None:
    """Record one memory search."""
    RETRIEVAL_LATENCY.observe(max(seconds, 0.0))


def observe_recall(outcome: str) -> None:
    """Count one recall before a reply; `outcome` is ok, timeout, error or keywords_only."""
    RECALLS.labels(outcome=outcome).inc()


def observe_query_ahead(outcome: str) -> None:
    """Count a recall query encoded ahead; `outcome` is started or used."""
    QUERIES_AHEAD.labels(outcome=outcome).inc()


def observe_rewrite(seconds: float, outcome: str) -> None:
    """Record one query rewrite; `outcome` is model, fallback, timeout or skipped."""
    REWRITE_LATENCY.labels(outcome=outcome).observe(max(seconds, 0.0))


def observe_rate_limited(limit: str) -> None:
    """Count one 429; `limit` names the limit (requests_per_minute, concurrent_streams, …)."""
    RATE_LIMITED.labels(limit=limit).inc()


def observe_request(route: str, status: int, seconds: float) -> None:
    """Record one answered HTTP request under its route template."""
    HTTP_REQUESTS.labels(route=route, status=str(status)).inc()
    HTTP_LATENCY.labels(route=route).observe(max(seconds, 0.0))


class DatabaseState(Collector):
    """Gauges of the whole deployment, read from the database when /metrics is scraped.

    They are the same whichever process reads them, so they are kept in this process's
    memory and reported by the scraped process, never summed over workers.
    """

    def __init__(self) -> None:
        self.backlog = 0
        self.oldest_age = 0.0
        self.dead_letters = 0
        self.unconsumed = 0
        self.unconsumed_age = 0.0
        self.generations: list[tuple[int, str, str | None, int, int, bool]] = []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(
            "chatmem_outbox_backlog",
            "Finished turns not yet handed on (unpublished to Kafka, or unconsumed).",
            value=self.backlog,
        )
        yield GaugeMetricFamily(
            "chatmem_outbox_oldest_age_seconds",
            "Age of the oldest outbox row not yet handed on (0 when empty).",
            value=self.oldest_age,
        )
        yield GaugeMetricFamily(
            "chatmem_outbox_unconsumed",
            "Kafka: finished turns published but not yet consumed by the indexer (0 on Postgres).",
            value=self.unconsumed,
        )
        yield GaugeMetricFamily(
            "chatmem_outbox_unconsumed_oldest_age_seconds",
            "Kafka: age of the oldest turn published but not yet consumed by the indexer (0 when none).",
            value=self.unconsumed_age,
        )
        yield GaugeMetricFamily(
            "chatmem_dead_letters", "Rows in the dead_letters table.", value=self.dead_letters
        )
        active = GaugeMetricFamily(
            "chatmem_memory_index_active",
            "1 for the searched generation of the memory index.",
            labels=["generation", "runtime"],
        )
        build = GaugeMetricFamily(
            "chatmem_memory_index_build_rows",
            "A rebuild of the memory index (`chatmem memory reindex`): rows to copy (total), copied (done).",
            labels=["generation", "runtime", "kind"],
        )
        running = GaugeMetricFamily(
            "chatmem_memory_index_build_running",
            "1 while a run of `chatmem memory reindex` builds the generation, 0 when none does (killed).",
            labels=["generation", "runtime"],
        )
        for generation, state, runtime, done, total, is_running in self.generations:
            labels = [str(generation), runtime or ""]
            if state == "active":
                active.add_metric(labels, 1)
            else:
                build.add_metric([*labels, "total"], total)
                build.add_metric([*labels, "done"], done)
                running.add_metric(labels, 1 if is_running else 0)
        yield active
        yield build
        yield running


DATABASE_STATE = DatabaseState()
REGISTRY.register(DATABASE_STATE)


def set_memory_indexes(generations: list[tuple[int, str, str | None, int, int, bool]]) -> None:
    """Publish the active and building generations: (id, state, runtime, rows done, rows total,
    whether a run builds it)."""
    DATABASE_STATE.generations = list(generations)


def set_outbox_state(backlog: int, oldest_age_seconds: float, dead_letters: int) -> None:
    """Publish the outbox backlog, its oldest row's age and the dead-letter count read at scrape time."""
    DATABASE_STATE.backlog = backlog
    DATABASE_STATE.oldest_age = max(oldest_age_seconds, 0.0)
    DATABASE_STATE.dead_letters = dead_letters


def set_outbox_unconsumed(unconsumed: int, oldest_age_seconds: float) -> None:
    """Publish the turns published to Kafka the indexer has not consumed, and the oldest one's age."""
    DATABASE_STATE.unconsumed = unconsumed
    DATABASE_STATE.unconsumed_age = max(oldest_age_seconds, 0.0)


def exposition() -> bytes:
    """The text a scrape returns: this process's metrics, or under `serve --workers N` those of
    every process of the server (summed as each metric declares) and the database state."""
    if not os.environ.get(MULTIPROCESS_DIR_ENV):
        return generate_latest()
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    registry.register(DATABASE_STATE)
    return generate_latest(registry)


def process_exited() -> None:
    """Drop this process's live gauges from the shared files (its open streams, its encoder, its
    memory refusal)."""
    if os.environ.get(MULTIPROCESS_DIR_ENV):
        multiprocess.mark_process_dead(os.getpid())
