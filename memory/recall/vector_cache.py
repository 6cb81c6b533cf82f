"""The vectors of recently embedded turn texts, so that recall encodes each unindexed turn once.

Before each reply, recall embeds the user's finished turns the indexer has not reached
yet (up to ``UNINDEXED_LIMIT`` of them, each up to 2,000 characters). While the indexer
lags, or is down, the same turns come back in every recall and were encoded again each
time. Measured with ``bench/capacity.py`` (no indexer, 5 messages/s, memory on): 105 CPU
ms per message before, 90 with this cache (TTFT p99 3,008 -> 651 ms); what remains is
encoding each new turn once. A vector depends only on the text embedded, so it is kept by
a digest of that text; queries are not cached (they rarely repeat).

A turn's vector is kept under ``turn_key``: the index generation and the text it is
embedded as. The indexer running inside the API process (``serve --with-workers``) shares
the recall's cache: a turn recall already encoded while it was unindexed is written to the
index with that vector instead of being encoded again, and a turn the indexer encodes first
is found here by a recall that runs before the batch commits. Measured with
``bench/capacity.py --with-indexer`` (10 messages/s, a user's conversations overlapping):
the indexer had encoded again two thirds of the characters recall had already encoded.
Vectors never cross generations: the key carries the generation's id.

Bounded by a count of entries, least recently used first out; one entry holds 384
doubles (~3 KB), so the default bound keeps ~12 MB per process.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from memory.recall.embeddings import Embedder

DEFAULT_MAX_ENTRIES = 4096


def turn_key(generation_id: int, text: str) -> str:
    """The key of a turn's vector: the index generation it is for and the text embedded."""
    return f"{generation_id}\x00{text}"


def _key(text: str) -> bytes:
    # surrogatepass: a text the encoder accepts must never fail here.
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class VectorCache:
    """Remembers the vectors of the last ``max_entries`` distinct texts embedded through it."""

    def __init__(self, *, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._vectors: OrderedDict[bytes, array[float]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._vectors)

    def take(self, texts: Sequence[str]) -> list[list[float] | None]:
        """The kept vector of each text, or None where it must be encoded."""
        taken: list[list[float] | None] = []
        for text in texts:
            key = _key(text)
            kept = self._vectors.get(key)
            if kept is None:
                self.misses += 1
                taken.append(None)
            else:
                self.hits += 1
                self._vectors.move_to_end(key)
                taken.append(kept.tolist())
        return taken

    def keep(self, texts: Sequence[str], vectors: Sequence[Sequence[float]]) -> None:
        """Remember the vectors just encoded for ``texts`` (the oldest go beyond the bound)."""
        if self.max_entries <= 0:
            return
        for text, vector in zip(texts, vectors, strict=True):
            key = _key(text)
            self._vectors[key] = array("d", vector)
            self._vectors.move_to_end(key)
        while len(self._vectors) > self.max_entries:
            self._vectors.popitem(last=False)


async def embed_with_query(
    embedder: Embedder,
    query: str,
    texts: Sequence[str],
    keys: Sequence[str],
    cache: VectorCache | None,
    *,
    query_vector: list[float] | None = None,
) -> tuple[list[float], list[list[float]]]:
    """One encode call for the query and the texts ``cache`` does not keep (by ``keys``); their vectors.

    One call, because the encoder runs one at a time; queries are never kept. A
    ``query_vector`` the caller already has (from ``embedder``) is used as it is: then only
    the missing texts are encoded, and nothing at all when the cache keeps them all.
    """
    kept = cache.take(keys) if cache is not None else [None] * len(texts)
    missing = [i for i, vector in enumerate(kept) if vector is None]
    if query_vector is not None:
        encoded = await embedder.embed([texts[i] for i in missing]) if missing else []
    else:
        query_vector, *encoded = await embedder.embed([query, *(texts[i] for i in missing)])
    if cache is not None:
        cache.keep([keys[i] for i in missing], encoded)
    fresh = iter(encoded)
    return query_vector, [vector if vector is not None else next(fresh) for vector in kept]
