"""An OpenAI-compatible embedding service as the encoder (``EMBEDDING_BASE_URL``).

Larger deployments keep the model out of the API and indexer processes: every query and
every indexer batch is sent to ``POST {EMBEDDING_BASE_URL}/embeddings`` (text-embeddings-
inference, vLLM, infinity, llama-server ``--embeddings``, Ollama, OpenAI) through the
``openai`` SDK, which brings the error types, ``Retry-After`` and connection pooling.

Why the unusual choices:

- Retries are ours, not the SDK's (``max_retries=0``), because the two callers need
  different policies. The indexer retries a request up to ``EMBEDDING_SERVICE_RETRIES``
  times (exponential backoff with full jitter, at least ``Retry-After``); a reply's recall
  retries at most once and only inside its time box (``embedding_budget``), after which
  it goes on with keyword search. Connection errors, timeouts, 408/409/429 and 5xx are
  retried; any other 4xx is a configuration error (a wrong key, a model the service does
  not serve): never retried, logged loudly once.
- Every response is checked (one vector per text, each of ``dim`` finite floats) and the
  vectors are L2-normalised here, since servers differ on whether they normalise. A
  wrong dimension is refused, never truncated or padded.
- A call is whole or fails: its requests run at most ``CONCURRENT_REQUESTS`` at a time,
  and if one fails for good the call raises and nothing of it is returned, so the indexer
  never writes part of a batch.
- The vectors form their own index generation: the spec records ``runtime: service`` and
  the model (``service_model``, part of the key), so they are never compared with a local
  encoder's, even of the same weights (moving between the two is a reindex). The address
  is recorded but not part of the key: several replicas of one service are one encoder.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import email.utils
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import openai
from openai import AsyncOpenAI

from memory.storage.models import EMBEDDING_DIM

if TYPE_CHECKING:
    from memory.config import Settings

log = logging.getLogger(__name__)

RETRYABLE_STATUS = frozenset({408, 409, 429})
CONCURRENT_REQUESTS = 4
BACKOFF_BASE_SECONDS = 0.25
BACKOFF_MAX_SECONDS = 8.0
# A Retry-After longer than this is not waited for in one go (the indexer gives the batch back).
RETRY_AFTER_MAX_SECONDS = 60.0


class EmbeddingServiceError(RuntimeError):
    """The embedding service gave no usable vectors."""


class EmbeddingUnavailable(EmbeddingServiceError):
    """The service did not answer in time (down, overloaded, or out of retries or time box)."""


class EmbeddingRefused(EmbeddingServiceError):
    """The service refused the request (a 4xx other than 408/409/429) or answered wrongly."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class EmbeddingBudget:
    """How long an encode may take and how often it may retry (a reply's recall)."""

    deadline: float  # on the event loop's clock
    retries: int


_BUDGET: contextvars.ContextVar[EmbeddingBudget | None] = contextvars.ContextVar(
    "embedding_budget", default=None
)


@contextlib.contextmanager
def embedding_budget(seconds: float, *, retries: int = 1) -> Iterator[None]:
    """Inside: a service encode gives up (EmbeddingUnavailable) after ``seconds`` and ``retries``.

    A reply's recall sets it so that a service that does not answer leaves time in the
    recall's box for keyword search. Local encoders ignore it.
    """
    token = _BUDGET.set(EmbeddingBudget(asyncio.get_running_loop().time() + seconds, retries))
    try:
        yield
    finally:
        _BUDGET.reset(token)


def budget_seconds_left() -> float | None:
    """The seconds left in the embedding budget set around the caller (None: no budget)."""
    budget = _BUDGET.get()
    if budget is None:
        return None
    return max(0.0, budget.deadline - asyncio.get_running_loop().time())


def _retry_after(exc: openai.APIStatusError) -> float | None:
    """The server's Retry-After in seconds (delta-seconds or an HTTP date), if it sent one."""
    value = exc.response.headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        parsed = email.utils.parsedate_to_datetime(value) if value else None
        return max(0.0, parsed.timestamp() - time.time()) if parsed is not None else None


def backoff_seconds(attempt: int, retry_after: float | None, rng: random.Random) -> float:
    """The wait before retry ``attempt`` (0-based): full jitter, at least ``Retry-After``."""
    jitter = rng.uniform(0, min(BACKOFF_MAX_SECONDS, BACKOFF_BASE_SECONDS * 2**attempt))
    if retry_after is None:
        return jitter
    return max(jitter, min(retry_after, RETRY_AFTER_MAX_SECONDS))


class ServiceEmbedder:
    """Encodes through an OpenAI-compatible ``/v1/embeddings`` endpoint (an ``Embedder``)."""

    runtime = "service"

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        batch_size: int = 32,
        timeout_seconds: float = 30.0,
        retries: int = 4,
        dim: int = EMBEDDING_DIM,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rng: random.Random | None = None,
    ) -> None:
        self.base_url = base_url
        self.model = model
        self.batch_size = batch_size
        self.timeout_seconds = timeout_seconds
        self.retries = retries
        self.dim = dim
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._client = AsyncOpenAI(
            base_url=base_url, api_key=api_key or "none", max_retries=0, timeout=timeout_seconds
        )
        self.reported_model: str | None = None  # the model name the service answers with
        self._refusals_logged: set[int | None] = set()
        self.requests = 0  # requests sent, retries included (tests and metrics)

    @property
    def spec(self) -> dict[str, Any]:
        """What makes this embedder's vectors (recorded with every generation it writes)."""
        spec: dict[str, Any] = {
            "runtime": self.runtime,
            "service_model": self.model,
            "model": self.model,
            "dim": self.dim,
            "base_url": self.base_url,
        }
        if self.reported_model and self.reported_model != self.model:
            spec["reported_model"] = self.reported_model
        return spec

    async def aclose(self) -> None:
        await self._client.close()

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        """L2-normalised vectors of ``texts``, all of them or an EmbeddingServiceError."""
        if not texts:
            return []
        budget = _BUDGET.get()
        retries = self.retries if budget is None else min(self.retries, budget.retries)
        slices = [list(texts[i : i + self.batch_size]) for i in range(0, len(texts), self.batch_size)]
        limit = asyncio.Semaphore(CONCURRENT_REQUESTS)

        async def one(batch: list[str]) -> list[list[float]]:
            async with limit:
                return await self._request(batch, retries)

        try:
            async with contextlib.AsyncExitStack() as stack:
                if budget is not None:
                    await stack.enter_async_context(asyncio.timeout_at(budget.deadline))
                async with asyncio.TaskGroup() as group:
                    tasks = [group.create_task(one(batch)) for batch in slices]
        except TimeoutError:
            raise EmbeddingUnavailable("the embedding service did not answer inside the time box") from None
        except BaseExceptionGroup as group_error:
            # One failed request fails the call; report the first (they share a cause).
            raise group_error.exceptions[0] from None
        return [vector for task in tasks for vector in task.result()]

    async def _request(self, texts: list[str], retries: int) -> list[list[float]]:
        attempt = 0
        while True:
            self.requests += 1
            try:
                response = await self._client.embeddings.create(
                    model=self.model, input=texts, encoding_format="float"
                )
                return self._checked(response, len(texts))
            except openai.APIStatusError as exc:
                if exc.status_code not in RETRYABLE_STATUS and exc.status_code < 500:
                    raise self._refused(
                        f"the embedding service refused the request: HTTP {exc.status_code} "
                        f"{_short(exc.message)}",
                        status=exc.status_code,
                    ) from None
                failure: Exception = exc
                retry_after = _retry_after(exc)
            except openai.APIConnectionError as exc:  # APITimeoutError included
                failure, retry_after = exc, None
            except openai.APIError as exc:  # an answer the SDK could not read: not an outage
                raise self._refused(f"the embedding service answered something unreadable: {exc}") from None
            if attempt >= retries:
                raise EmbeddingUnavailable(
                    f"the embedding service at {self.base_url} did not answer after {attempt + 1} "
                    f"attempt(s): {type(failure).__name__}: {_short(str(failure))}"
                ) from failure
            delay = backoff_seconds(attempt, retry_after, self._rng)
            log.info("embedding service: %s; retrying in %.2fs", type(failure).__name__, delay)
            await self._sleep(delay)
            attempt += 1

    def _checked(self, response: Any, count: int) -> list[list[float]]:
        data = sorted(response.data, key=lambda item: item.index)
        if len(data) != count or [item.index for item in data] != list(range(count)):
            raise self._refused(f"the embedding service answered {len(data)} vectors for {count} texts")
        try:
            vectors = np.asarray([item.embedding for item in data], dtype=np.float64)
        except (TypeError, ValueError):  # ragged, or not numbers (e.g. base64 despite "float")
            vectors = np.empty((count, 0))
        if vectors.ndim != 2 or vectors.shape[1] != self.dim:
            got = f"{vectors.shape[1]}-d" if vectors.ndim == 2 and vectors.size else "unreadable"
            raise self._refused(
                f"the embedding service answered {got} vectors; the memory index holds {self.dim}-d "
                f"(model {self.model!r})"
            )
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        if not np.isfinite(vectors).all() or not (norms > 0).all():
            raise self._refused("the embedding service answered a vector that is not finite or is zero")
        if getattr(response, "model", None):
            self.reported_model = str(response.model)
        return (vectors / norms).tolist()

    def _refused(self, message: str, *, status: int | None = None) -> EmbeddingRefused:
        # A configuration error repeats on every call: say it loudly, once per kind.
        if status not in self._refusals_logged:
            self._refusals_logged.add(status)
            log.error(
                "%s (not retried; check EMBEDDING_BASE_URL, EMBEDDING_API_KEY, EMBEDDING_SERVICE_MODEL)",
                message,
            )
        return EmbeddingRefused(message, status=status)

    async def probe(self) -> None:
        """One request at start: a configuration error (key, model, dimension) stops the start.

        A service that is down only logs: recall goes on with keyword search and the indexer
        retries until it is back.
        """
        try:
            await self.embed(["chatmem start-up check"])
        except EmbeddingUnavailable as exc:
            log.warning("%s; memory recall uses keyword search until it answers", exc)


def _short(text: str) -> str:
    return " ".join(text.split())[:300]


def service_embedder(settings: Settings) -> ServiceEmbedder:
    """The embedding service the settings name (EMBEDDING_BASE_URL must be set)."""
    if not settings.embedding_base_url or not settings.embedding_service_model:
        raise ValueError("EMBEDDING_BASE_URL and EMBEDDING_SERVICE_MODEL must be set")
    key = settings.embedding_api_key
    return ServiceEmbedder(
        settings.embedding_base_url,
        settings.embedding_service_model,
        api_key=key.get_secret_value() if key is not None else None,
        batch_size=settings.embedding_service_batch_size,
        timeout_seconds=settings.embedding_service_timeout_seconds,
        retries=settings.embedding_service_retries,
    )


async def open_service(settings: Settings) -> ServiceEmbedder:
    """The configured embedding service, checked with one request (see ``ServiceEmbedder.probe``)."""
    embedder = service_embedder(settings)
    await embedder.probe()
    return embedder
