"""Recall: rewrite the question into a standalone query, then search the user's memory.

Before the first token of every reply (``chat_api.replies.recall``), for
``POST /v1/memory/search``, for the ``recall_memory`` tool and for the memory items API
and MCP (``memory.recall.access``). A ``Recaller`` is built once per process from what it
needs (database, embedder, the rewrite model's completion function, prompts, settings),
before the prompter and the runner, which receive it.

The query a reply's recall searched is stored with the reply's first step
(``memory.record.turns.note_reply_memory``), so every retrieval can be audited later.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from memory.config import Settings
from memory.prompt.context import ContextBudget, PromptWindow, read_window
from memory.prompt.templates import PromptSet
from memory.recall.embeddings import Embedder
from memory.recall.excerpts import cut_relative, fetch_count, focus
from memory.recall.found import FoundMemory, RecallResult
from memory.recall.fusion import Fusion
from memory.recall.index import current_generation, generation_of
from memory.recall.prepared_queries import PreparedQueries
from memory.recall.remembering import remembered_text
from memory.recall.rewrite import Complete, HistoryLine, Rewrite, rewrite_query, stands_alone
from memory.recall.search import Recalled, recall_memories
from memory.recall.stored import NothingStored, Remembering, nothing_stored
from memory.recall.vector_cache import VectorCache
from memory.record.conversations import Owner
from memory.storage.db import Database


def history_lines(messages: Sequence[dict[str, Any]]) -> list[HistoryLine]:
    """The user and assistant texts of a prompt window, without the message being answered."""
    lines = [
        HistoryLine(m["role"], str(m["content"]))
        for m in messages
        if m.get("role") in ("user", "assistant")
        and isinstance(m.get("content"), str)
        and m["content"].strip()
    ]
    if messages and messages[-1].get("role") == "user" and lines:
        lines.pop()
    return lines


class Recaller:
    """Rewrites queries and searches one user's memory, as every caller in this process does."""

    def __init__(
        self,
        db: Database,
        embedder: Embedder,
        *,
        complete: Complete | None,
        prompts: PromptSet,
        settings: Settings,
    ) -> None:
        self.db = db
        self.embedder = embedder
        self.complete = complete  # the rewrite model; None: the heuristic rewrite only
        self.prompts = prompts
        self.settings = settings
        self.budget = ContextBudget.from_settings(settings)
        self.fusion = Fusion(
            method=settings.memory_fusion,
            keyword_weight=settings.memory_keyword_weight,
            rrf_k=settings.memory_rrf_k,
            candidates=settings.memory_candidates,
        )
        # Unindexed turns come back in every recall until the indexer reaches them.
        self.turn_vectors = VectorCache()
        # Replies' queries encoded while the replies are accepted, until their recall takes them.
        self.prepared = PreparedQueries()
        # Users seen with memory: not checked for it again (memory.recall.stored).
        self.remembering = Remembering()

    def _prepare_text(self, body: str) -> str | None:
        # A turn the indexer would skip is not recalled before indexing either.
        return remembered_text(
            body, redact_pii=self.settings.redact_pii, extra_phrases=self.settings.low_information_extra
        )

    def prepare_query(self, key: uuid.UUID, message: str) -> bool:
        """Start encoding ``message`` as the query of the search ``key`` will make, if it will be.

        Only a message that stands alone: the rewrite leaves it as it is, whatever the rewrite
        mode, so its vector is the one the search would encode. The search takes it with
        ``search(prepared=key)``; ``forget_query(key)`` drops it if that search never comes.
        True if an encode was started.
        """
        query = message.strip()
        generation = current_generation(self.embedder)
        if generation is None or not query or not stands_alone(query):
            return False
        self.prepared.prepare(key, query, generation, box_seconds=self.settings.recall_timeout_seconds)
        return True

    async def nothing_stored(self, session: AsyncSession, owner: Owner) -> NothingStored | None:
        """Whether ``owner`` has nothing recall could find now (``memory.recall.stored``), in ``session``.

        None (search as usual) for a bare encoder, whose generation is only read by the search,
        and, with no statement, for a user this process has seen with memory.
        """
        generation = current_generation(self.embedder)
        if generation is None or owner in self.remembering:
            return None
        empty = await nothing_stored(session, owner, generation)
        if empty is None:
            self.remembering.add(owner)
        return empty

    def forget_query(self, key: uuid.UUID) -> None:
        """Drop the query prepared for ``key`` (its reply ended, or will not recall)."""
        self.prepared.drop(key)

    async def search(
        self,
        owner: Owner,
        message: str,
        *,
        k: int,
        scope_conversation: uuid.UUID | None = None,
        history_conversation: uuid.UUID | None = None,
        exclude_window: bool = False,
        extra_exclude: Sequence[uuid.UUID] = (),
        rewrite: bool = True,
        window: PromptWindow | None = None,
        for_block: bool = False,
        prepared: uuid.UUID | None = None,
        nothing_stored: NothingStored | None = None,
    ) -> RecallResult:
        """Rewrite (with the history of ``window``, or of ``history_conversation``) and search.

        ``exclude_window``: never return the turns already in that window.
        ``for_block``: the memories are for a reply's block: shaped by MEMORY_SENTENCES and
        MEMORY_RELATIVE_CUT (memory.recall.excerpts).
        ``prepared``: the key a query was prepared under (``prepare_query``); its vector is
        used if it is the query searched, in the generation searched.
        ``nothing_stored``: the user had nothing to recall when the reply was accepted
        (``nothing_stored``): the search neither encodes nor reads, if it reads that generation.
        """
        ahead = self.prepared.take(prepared) if prepared is not None else None
        try:
            started = time.perf_counter()
            latency: dict[str, float] = {}
            history: list[HistoryLine] = []
            exclude: set[uuid.UUID] = set(extra_exclude)
            if window is None and history_conversation is not None:
                window = await read_window(
                    self.db, history_conversation, prompts=self.prompts, budget=self.budget
                )
            if window is not None:  # the reply's own window, read once and shared with its first step
                history = history_lines(window.messages)
                if exclude_window:
                    exclude.update(window.turn_ids)
            latency["context"] = _ms_since(started)
            mark = time.perf_counter()
            if rewrite:
                result = await rewrite_query(
                    message,
                    history,
                    prompts=self.prompts,
                    complete=self.complete,
                    timeout=self.settings.rewrite_timeout_seconds,
                )
            else:
                result = Rewrite(message.strip(), "skipped")
            latency["rewrite"] = _ms_since(mark)
            mark = time.perf_counter()

            recalled = await recall_memories(
                self.db,
                self.embedder,
                tenant_id=owner.tenant_id,
                user_id=owner.user_id,
                query_text=result.query,
                k=fetch_count(k, self.settings.memory_sentences) if for_block else k,
                conversation_id=scope_conversation,
                exclude_turn_ids=exclude,
                min_score=self.settings.memory_min_score,
                prepare_text=self._prepare_text,
                fusion=self.fusion,
                cache=self.turn_vectors,
                prepared=ahead,
                nothing_stored=nothing_stored,
            )
            if recalled.query_ahead:
                self.prepared.used += 1
            latency["embed"] = recalled.latency_ms.get("embed", 0.0)
            latency["search"] = _ms_since(mark)
            memories = recalled.memories
            if for_block:
                mark = time.perf_counter()
                memories = await self._for_block(result.query, memories, k, recalled)
                latency["excerpts"] = _ms_since(mark)
            latency["total"] = _ms_since(started)
            return RecallResult(
                result.query,
                result,
                memories,
                latency,
                degraded=recalled.degraded,
                query_ahead=recalled.query_ahead,
            )
        finally:
            if ahead is not None:
                ahead.encode.cancel()  # no-op once done; an unused encode stops here

    async def _for_block(
        self, query: str, memories: list[FoundMemory], k: int, recalled: Recalled
    ) -> list[FoundMemory]:
        """The memories a reply's block shows: by best sentence (with excerpts), cut relative to the first."""
        shown, cut = self.settings.memory_sentences, self.settings.memory_relative_cut
        if shown <= 0:
            return cut_relative(memories, cut)[:k]
        # The search's query vector is reused with the generation it was encoded for (never mixed).
        generation = recalled.generation or await generation_of(self.embedder, self.db)
        return await focus(
            generation.embedder,
            query,
            memories,
            k=k,
            sentences_shown=shown,
            cut=cut,
            cache=self.turn_vectors,
            cache_prefix=str(generation.id),
            query_vector=recalled.query_vector if recalled.generation is not None else None,
        )


def _ms_since(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 2)
