"""Query vectors encoded ahead of their search: a reply's message, encoded while the reply is accepted.

Encoding the query is most of what memory adds before a reply's first token (~7.5 ms of
~14 ms on a quiet machine), and it used to start only after the accept transaction and
the prompt window read, both waits on Postgres. When the message stands alone
(``memory.recall.rewrite.stands_alone``) the rewrite leaves it as it is, whatever the
rewrite mode, so its vector can be encoded as soon as the message is known: the door
calls ``Recaller.prepare_query`` while it stores the reply's turns, and the reply's
recall takes the vector instead of encoding the query again. A message that leans on
earlier turns is not encoded ahead (its query depends on the history and the rewrite).

Why the unusual choices:

- An entry is the text, the index generation whose encoder encodes it, and the encode's
  task. The search uses the vector only for the very same text and generation (id, key
  and encoder): after a reindex's switch, a vector of the old encoder is never compared
  with the new generation's rows; it is dropped and the query encoded again.
- Each entry is taken once, by the search of the reply it was prepared for (the key).
  A reply that ends before its recall (stopped, failed, memory off for it) drops its
  entry, and the holder keeps at most ``max_entries``: the oldest goes first, its encode
  cancelled (a cancelled encode that has not started is left out of the encoder's batch).
- The encode runs through the generation's encoder like any other (its worker thread, one
  encode at a time, joined with other waiting calls), with no connection held. Through an
  embedding service it gets no retry and one recall time box at most; if it fails or is
  late, the search encodes as it always did, inside its own budget, and degrades to
  keyword search as before. A failure here never fails a reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import uuid
from collections import OrderedDict
from dataclasses import dataclass

from memory.recall.embedding_service import ServiceEmbedder, budget_seconds_left, embedding_budget
from memory.recall.index import Generation

log = logging.getLogger(__name__)

# Replies accepted but not recalled yet, per process; a few times the replies that run at once.
DEFAULT_MAX_ENTRIES = 256


@dataclass(slots=True)
class PreparedQuery:
    """One query's vector on its way: the text, the generation it is encoded for, the encode."""

    text: str
    generation: Generation
    encode: asyncio.Task[list[float]]

    def matches(self, text: str, generation: Generation) -> bool:
        """The vector is the one this search would encode: same text, same generation and encoder."""
        return (
            self.text == text
            and self.generation.id == generation.id
            and self.generation.key == generation.key
            and self.generation.embedder is generation.embedder
        )

    def ready(self) -> bool:
        """The encode has ended (its vector, or its failure, is known): taking it waits for nothing."""
        return self.encode.done()

    async def vector_for(self, text: str, generation: Generation) -> list[float] | None:
        """The vector, if it is for ``text`` in ``generation`` and came in time; else None (encode it)."""
        try:
            if not self.matches(text, generation):
                return None
            # An embedding service is waited for within the budget a reply's recall sets (what is
            # left of it is what the normal encode would have had, so being late costs nothing
            # more); a local encoder ignores budgets, and its encode is awaited as recall's own is.
            local = not isinstance(generation.embedder, ServiceEmbedder)
            await asyncio.wait({self.encode}, timeout=None if local else budget_seconds_left())
            if not self.encode.done() or self.encode.cancelled():
                return None
            if self.encode.exception() is not None:
                log.debug("query encoded ahead failed (%s); encoding it again", self.encode.exception())
                return None
            return self.encode.result()
        finally:
            self.encode.cancel()  # no-op once done; a late or unused encode stops here


class PreparedQueries:
    """Query vectors being encoded ahead, by the key of the search that will take each (a reply's id)."""

    def __init__(self, *, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[uuid.UUID, PreparedQuery] = OrderedDict()
        self.prepared = 0  # encodes started ahead (tests and metrics)
        self.used = 0  # of them, vectors a search used instead of encoding again

    def __len__(self) -> int:
        return len(self._entries)

    def prepare(self, key: uuid.UUID, text: str, generation: Generation, *, box_seconds: float) -> None:
        """Start encoding ``text`` with ``generation``'s encoder, for the search ``key`` will make."""
        if key in self._entries or self.max_entries <= 0:
            return
        while len(self._entries) >= self.max_entries:
            _, oldest = self._entries.popitem(last=False)
            oldest.encode.cancel()
        # A fresh context: the encode must not carry the request's tenant scope or log ids,
        # nor an embedding budget set around the caller.
        encode = asyncio.get_running_loop().create_task(
            _encode(generation, text, box_seconds), name="query-ahead", context=contextvars.Context()
        )
        encode.add_done_callback(_seen)
        self._entries[key] = PreparedQuery(text, generation, encode)
        self.prepared += 1

    def take(self, key: uuid.UUID) -> PreparedQuery | None:
        """The entry prepared for ``key``, now the caller's (taken once)."""
        return self._entries.pop(key, None)

    def drop(self, key: uuid.UUID) -> None:
        """Forget ``key``'s entry and stop its encode (its search will not come)."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            entry.encode.cancel()


async def _encode(generation: Generation, text: str, box_seconds: float) -> list[float]:
    # An embedding service gets no retry here and no longer than one recall's box; a local
    # encoder ignores the budget.
    with embedding_budget(box_seconds, retries=0):
        (vector,) = await generation.embedder.embed([text])
    return vector


def _seen(task: asyncio.Task[list[float]]) -> None:
    # An encode nobody took may have failed: that is not worth a "never retrieved" warning.
    if not task.cancelled():
        with contextlib.suppress(Exception):
            task.exception()
