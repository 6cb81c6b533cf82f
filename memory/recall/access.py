"""The memory items a person sees and edits, for every surface that shows them: the items API and MCP.

Each operation acts for one owner and commits its own transaction before it returns, so
the next reply, on any replica, already sees the change (recall reads Postgres).

Search goes through the chat's own recall (``Recaller.search``, what ``POST
/v1/memory/search`` and the ``recall_memory`` tool use), so a new retrieval composition
reaches the items list and the MCP ``search_memory`` tool without a change here.

A stated fact or a correction is stored the way the indexer stores a turn's chunk:
redacted when ``REDACT_PII`` is on, embedded and keyword-indexed as ``memory_text``
(date in front), so it ranks like any other memory.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import NamedTuple

from memory.config import Settings
from memory.json_bounds import check_text
from memory.recall.embeddings import Embedder
from memory.recall.index import Generation, generation_of, write_guard
from memory.recall.items import (
    MAX_ITEM_CHARS,
    Embedded,
    StoredMemory,
    correct_item,
    forget_item,
    get_item,
    items_by_key,
    remember_fact,
)
from memory.recall.keywords import memory_search_terms, memory_text
from memory.recall.recaller import Recaller
from memory.recall.redaction import redact
from memory.record.conversations import Owner
from memory.storage.db import Database

MAX_QUERY_CHARS = 2000


class ScoredItem(NamedTuple):
    """A memory item a search found, and its score."""

    item: StoredMemory
    score: float


class MemoryAccess:
    """Search, remember, correct and forget one owner's memory items."""

    def __init__(self, db: Database, embedder: Embedder, recaller: Recaller, settings: Settings) -> None:
        self.db = db
        self.embedder = embedder
        self.recaller = recaller
        self.redact_pii = settings.redact_pii

    async def _embedded(
        self, text: str, *, name: str | None, created_at: datetime
    ) -> tuple[Embedded, Generation]:
        body = redact(text) if self.redact_pii else text
        searched = memory_text(body, name=name, created_at=created_at)
        generation = await generation_of(self.embedder, self.db)
        [vector] = await generation.embedder.embed([searched])
        embedded = Embedded(
            text=body, vector=list(vector), terms=memory_search_terms(searched), index_id=generation.id
        )
        return embedded, generation

    async def search(
        self, owner: Owner, query: str, *, k: int, conversation_id: uuid.UUID | None = None
    ) -> list[ScoredItem]:
        """The owner's ``k`` best memory items for ``query`` with their scores, as the chat ranks them.

        Turns the indexer has not reached yet are not items: they are left out.
        """
        check_text(query, field="query", max_chars=MAX_QUERY_CHARS)
        found = await self.recaller.search(
            owner, query, k=k, scope_conversation=conversation_id, rewrite=False
        )
        indexed = [m for m in found.memories if m.indexed]
        async with self.db.session() as session:
            stored = await items_by_key(session, owner, [(m.turn_id, m.chunk_index) for m in indexed])
        # An item forgotten or switched off between the search and this read is left out.
        return [
            ScoredItem(item, memory.score)
            for memory in indexed
            if (item := stored.get((memory.turn_id, memory.chunk_index))) is not None
        ]

    async def remember(
        self, owner: Owner, text: str, *, conversation_id: uuid.UUID | None = None
    ) -> StoredMemory:
        """Store a fact the user states directly; recalled from the next reply on."""
        check_text(text, field="text", max_chars=MAX_ITEM_CHARS)
        now = datetime.now(UTC)
        embedded, generation = await self._embedded(text.strip(), name=None, created_at=now)
        async with self.db.transaction() as session:
            await write_guard(session, self.embedder, generation)
            return await remember_fact(
                session, owner, embedded, created_at=now, conversation_id=conversation_id
            )

    async def correct(self, owner: Owner, item_id: int, text: str) -> StoredMemory:
        """Replace an item's text (re-embedded); its turn stays as it was said."""
        check_text(text, field="text", max_chars=MAX_ITEM_CHARS)
        async with self.db.session() as session:
            item = await get_item(session, owner, item_id)
        # Embedded with no connection held: the encoder may be busy with replies.
        embedded, generation = await self._embedded(text.strip(), name=item.name, created_at=item.created_at)
        async with self.db.transaction() as session:
            await write_guard(session, self.embedder, generation)
            return await correct_item(session, owner, item_id, embedded)

    async def forget(self, owner: Owner, item_id: int) -> None:
        """Forget one item for good (NotFound unless it is the owner's and visible)."""
        async with self.db.transaction() as session:
            await forget_item(session, owner, item_id)
