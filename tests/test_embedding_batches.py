"""Concurrent embed calls share encode calls, and each caller still gets its own vectors."""

from __future__ import annotations

import asyncio
import threading

import pytest

from memory.config import default_embedding_model
from memory.recall.embeddings import (
    PADDED_CHARS_PER_BATCH,
    EncodeBatcher,
    HashEmbedder,
    SentenceTransformerEmbedder,
    padded_batches,
)
from tests.support import wait_until

QUERIES = [
    "where did I go hiking last summer",
    "what is my sister's name",
    "which restaurant did we talk about",
    "remind me of the book I was reading",
    "what did I say about the weather in Lisbon",
    "my dentist appointment",
    "the name of the cat",
    "what programming language do I use at work",
]


class GatedEncoder:
    """A synchronous batch encoder (the process edge) that can be held and counts its calls."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.release = threading.Event()
        self.entered = threading.Event()
        self.hash = HashEmbedder(dim=16)

    def __call__(self, texts: list[str]) -> list[list[float]]:
        self.calls.append(list(texts))
        self.entered.set()
        if not self.release.wait(10):
            raise TimeoutError("the test never released the encoder")
        return [self.hash.embed_one(text) for text in texts]


async def test_calls_queued_behind_an_encode_share_the_next_one() -> None:
    encoder = GatedEncoder()
    batcher = EncodeBatcher(encoder, max_texts=64)
    first = asyncio.create_task(batcher.embed(["the first call runs alone"]))
    assert await asyncio.to_thread(encoder.entered.wait, 10)
    waiting = [asyncio.create_task(batcher.embed([q, q.upper()])) for q in QUERIES]
    await asyncio.sleep(0)  # let every call reach the queue while the first encode is held
    encoder.release.set()
    results = await asyncio.gather(first, *waiting)
    assert [len(c) for c in encoder.calls] == [1, 2 * len(QUERIES)]
    assert results[0] == [encoder.hash.embed_one("the first call runs alone")]
    for query, vectors in zip(QUERIES, results[1:], strict=True):
        assert vectors == [encoder.hash.embed_one(query), encoder.hash.embed_one(query.upper())]


async def test_batches_never_exceed_max_texts_nor_split_a_call() -> None:
    encoder = GatedEncoder()
    batcher = EncodeBatcher(encoder, max_texts=5)
    first = asyncio.create_task(batcher.embed(["x"]))
    assert await asyncio.to_thread(encoder.entered.wait, 10)
    big = asyncio.create_task(batcher.embed([f"t{i}" for i in range(9)]))  # larger than a batch: alone
    small = [asyncio.create_task(batcher.embed([f"s{i}", f"s{i}!"])) for i in range(4)]
    await asyncio.sleep(0)
    encoder.release.set()
    await asyncio.gather(first, big, *small)
    assert [len(c) for c in encoder.calls] == [1, 9, 4, 4]
    assert (await big) == [encoder.hash.embed_one(f"t{i}") for i in range(9)]


async def test_a_cancelled_caller_is_left_out_and_an_error_reaches_every_caller_of_its_batch() -> None:
    encoder = GatedEncoder()
    batcher = EncodeBatcher(encoder, max_texts=64)
    first = asyncio.create_task(batcher.embed(["held"]))
    assert await asyncio.to_thread(encoder.entered.wait, 10)
    gone = asyncio.create_task(batcher.embed(["nobody waits for this"]))
    kept = asyncio.create_task(batcher.embed(["still wanted"]))
    await asyncio.sleep(0)
    gone.cancel()
    encoder.release.set()
    assert await kept == [encoder.hash.embed_one("still wanted")]
    await first
    assert ["nobody waits for this"] not in encoder.calls

    def failing(texts: list[str]) -> list[list[float]]:
        raise RuntimeError("encoder broke")

    broken = EncodeBatcher(failing, max_texts=64)
    results = await asyncio.gather(*(broken.embed([q]) for q in QUERIES[:3]), return_exceptions=True)
    assert all(isinstance(r, RuntimeError) for r in results)
    assert await broken.embed([]) == []


@pytest.fixture(scope="module")
def real_encoder() -> SentenceTransformerEmbedder:
    model = SentenceTransformerEmbedder(default_embedding_model(), batch_size=64)
    model.load()
    return model


async def test_real_model_concurrent_queries_get_their_own_vectors(
    real_encoder: SentenceTransformerEmbedder,
) -> None:
    alone = [real_encoder.encode_sync([q])[0] for q in QUERIES]
    calls_before = real_encoder.encode_calls
    together = await asyncio.gather(*(real_encoder.embed([q]) for q in QUERIES))
    # Eight concurrent calls: the first encodes at once, the rest share what follows.
    assert real_encoder.encode_calls - calls_before < len(QUERIES)
    for own, (vector,) in zip(alone, together, strict=True):
        assert max(abs(a - b) for a, b in zip(own, vector, strict=True)) < 1e-4
    # And each is closest to its own query, not a neighbour's (no mix-up of slices).
    for i, (vector,) in enumerate(together):
        scores = [sum(a * b for a, b in zip(vector, other, strict=True)) for other in alone]
        assert scores.index(max(scores)) == i


def test_texts_are_batched_shortest_first_within_the_padding_budget() -> None:
    texts = ["x" * 1500, "q", "x" * 300, "qq", "x" * 1400, "x" * 40]
    batches = padded_batches(texts, max_texts=64)
    assert sorted(i for batch in batches for i in batch) == list(range(len(texts)))  # each text once
    lengths = [len(texts[i]) for batch in batches for i in batch]
    assert lengths == sorted(lengths)
    for batch in batches:
        assert len(batch) == 1 or len(batch) * max(len(texts[i]) for i in batch) <= PADDED_CHARS_PER_BATCH
    assert [1500] in [[len(texts[i]) for i in batch] for batch in batches]  # a long text goes alone
    assert all(len(batch) <= 2 for batch in padded_batches(["q"] * 5, max_texts=2))


def test_real_model_mixed_lengths_come_back_in_order_and_as_if_alone(
    real_encoder: SentenceTransformerEmbedder,
) -> None:
    texts = [*QUERIES[:3], "My sister's garden in Reykjavik " * 60, QUERIES[3]]
    mixed = real_encoder.encode_sync(texts)
    for text, vector in zip(texts, mixed, strict=True):
        [alone] = real_encoder.encode_sync([text])
        assert max(abs(a - b) for a, b in zip(alone, vector, strict=True)) < 1e-4


async def test_a_query_does_not_wait_for_a_long_encode_on_the_twin(
    real_encoder: SentenceTransformerEmbedder,
) -> None:
    # The indexer inside an API process encodes with a twin (chat_api/cli/serve.py): a reply's
    # query must not queue behind its batch, as it did when both shared one encoder.
    twin = real_encoder.twin()
    await asyncio.to_thread(twin.load)
    backlog = [f"Turn {i}: " + "the harbour log of a long and windy day at sea. " * 40 for i in range(48)]
    indexing = asyncio.create_task(asyncio.to_thread(twin.encode_sync, backlog))
    await wait_until(twin._encode_lock.locked, 30, "the twin started encoding", every=0.005)
    (query,) = await asyncio.wait_for(real_encoder.embed(["where did the ship go?"]), 30)
    assert not indexing.done(), "the backlog finished first: the test proves nothing"
    vectors = await indexing
    assert len(vectors) == len(backlog)
    (again,) = await twin.embed(["where did the ship go?"])
    assert max(abs(a - b) for a, b in zip(query, again, strict=True)) < 1e-5  # the same weights
