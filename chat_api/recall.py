"""Long-term memory for each reply: rewrite the question, search the user's memory.

Before the first token of every reply the prompter calls ``MemoryRecaller.recall_for_reply``
with the reply's prompt window (read once, and sent to the first model step too: the
rewriter's history, and the turns retrieval must not return again). It rewrites the
message into a standalone query inside the rewrite time box, then searches in one transaction that also stores
the query on the reply's first assistant turn, so every retrieval can be audited later.

The same ``MemoryRecaller`` serves the ``recall_memory`` tool and ``/v1/memory/search``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from chat_api.metrics import observe_recall, observe_retrieval, observe_rewrite
from chat_api.replies.reply import Reply
from chat_api.tools import ToolContext
from memory.context import MemoryItemView, PromptWindow
from memory.conversations import Owner
from memory.json_bounds import readable_json
from memory.json_values import JsonObject
from memory.recall.embeddings import Embedder
from memory.recall.index_search import Fusion
from memory.recall.remembering import remembered_text
from memory.recall.rewrite import HistoryLine, Rewrite, rewrite_query
from memory.recall.search import (
    RecalledMemory,
    recall_memories,
)
from memory.recall.vector_cache import VectorCache

if TYPE_CHECKING:
    from chat_api.services import Services

log = logging.getLogger(__name__)

STORE_REWRITTEN_QUERY = text("UPDATE turns SET rewritten_query = :query WHERE id = :turn_id")
# A crash may lose the audited query; that is acceptable.
ASYNC_COMMIT = text("SET LOCAL synchronous_commit = off")

TOOL_RESULT_ITEMS = 8


def memory_item_json(memory: RecalledMemory, *, chunk_index: bool = False) -> JsonObject:
    """One recalled memory as the `memory.retrieved` event and the memory API show it."""
    hit = memory.hit
    item: JsonObject = {
        "turn_id": str(hit.turn_id),
        "conversation_id": str(hit.conversation_id) if hit.conversation_id else None,
        "conversation_title": memory.conversation_title,
        "role": hit.role,
        "name": hit.name,
        "text": hit.text,
        "created_at": hit.turn_created_at.isoformat(),
        "score": round(hit.score, 4),
        "external_id": hit.external_id,
        "metadata": readable_json(hit.metadata, what="metadata"),
    }
    if chunk_index:
        item["chunk_index"] = hit.chunk_index
    return item


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


@dataclass
class RecallResult:
    """What one search found, and how the query was made."""

    query: str
    rewrite: Rewrite
    memories: list[RecalledMemory]
    latency_ms: dict[str, float]


class MemoryRecaller:
    """Rewrites queries and searches one user's memory, as every caller in this process does."""

    def __init__(self, services: Services, embedder: Embedder) -> None:
        self.services = services
        self.settings = services.settings
        self.embedder = embedder
        # Unindexed turns come back in every recall until the indexer reaches them.
        self.turn_vectors = VectorCache()

    def _prepare_text(self, body: str) -> str | None:
        # A turn the indexer would skip is not recalled before indexing either.
        return remembered_text(
            body, redact_pii=self.settings.redact_pii, extra_phrases=self.settings.low_information_extra
        )

    async def _rewrite(self, message: str, history: Sequence[HistoryLine]) -> Rewrite:
        provider = self.services.provider
        complete = partial(
            provider.complete,
            model=self.settings.rewrite_model,
            timeout=self.settings.rewrite_timeout_seconds,
        )
        started = time.monotonic()
        result = await rewrite_query(
            message,
            history,
            prompts=self.services.prompter.prompts,
            complete=complete,
            timeout=self.settings.rewrite_timeout_seconds,
        )
        observe_rewrite(time.monotonic() - started, _rewrite_outcome(result))
        return result

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
        store_query_on: uuid.UUID | None = None,
        window: PromptWindow | None = None,
    ) -> RecallResult:
        """Rewrite (with the history of ``history_conversation``) and search the owner's memory."""
        started = time.perf_counter()
        latency: dict[str, float] = {}
        history: list[HistoryLine] = []
        exclude: set[uuid.UUID] = set(extra_exclude)
        if window is None and history_conversation is not None:
            window = await self.services.prompter.window_for(history_conversation)
        if window is not None:  # the reply's own window, read once and shared with its first step
            history = history_lines(window.messages)
            if exclude_window:
                exclude.update(window.turn_ids)
        latency["context"] = _ms_since(started)
        mark = time.perf_counter()
        if rewrite:
            result = await self._rewrite(message, history)
        else:
            result = Rewrite(message.strip(), "skipped")
        latency["rewrite"] = _ms_since(mark)
        mark = time.perf_counter()

        async def store_query(session: AsyncSession) -> None:
            # The stored query is for auditing: no reply should wait for its WAL flush.
            await session.execute(ASYNC_COMMIT)
            await session.execute(STORE_REWRITTEN_QUERY, {"query": result.query, "turn_id": store_query_on})

        recalled = await recall_memories(
            self.services.db,
            self.embedder,
            tenant_id=owner.tenant_id,
            user_id=owner.user_id,
            query_text=result.query,
            k=k,
            conversation_id=scope_conversation,
            exclude_turn_ids=exclude,
            min_score=self.settings.memory_min_score,
            prepare_text=self._prepare_text,
            in_search_transaction=store_query if store_query_on is not None else None,
            fusion=Fusion(
                method=self.settings.memory_fusion,
                keyword_weight=self.settings.memory_keyword_weight,
                rrf_k=self.settings.memory_rrf_k,
                candidates=self.settings.memory_candidates,
            ),
            cache=self.turn_vectors,
        )
        memories = recalled.memories
        latency["embed"] = recalled.latency_ms.get("embed", 0.0)
        latency["search"] = _ms_since(mark)
        latency["total"] = _ms_since(started)
        return RecallResult(result.query, result, memories, latency)

    async def recall_for_reply(
        self, reply: Reply, user_text: str, scope: str, window: PromptWindow
    ) -> tuple[str, list[MemoryItemView], JsonObject]:
        """The prompter's recall: memories for the reply's prompt and the `memory.retrieved` payload.

        Time-boxed by RECALL_TIMEOUT_SECONDS: memory is an aid, and a reply that waits for it
        behind an overloaded encoder or database is worse than one without it.
        """
        timeout = self.settings.recall_timeout_seconds
        try:
            async with asyncio.timeout(timeout):
                found = await self.search(
                    reply.owner,
                    user_text,
                    k=self.settings.memory_top_k,
                    scope_conversation=reply.conversation_id if scope == "conversation" else None,
                    exclude_window=True,
                    extra_exclude=[reply.user_turn_id],
                    store_query_on=reply.id,
                    window=window,
                )
        except TimeoutError:
            observe_recall("timeout")
            log.warning(
                "memory recall for reply %s took longer than %gs; replying without it", reply.id, timeout
            )
            message = f"memory recall took longer than {timeout:g}s; the reply goes on without memory"
            return user_text, [], _without_memory(user_text, scope, "memory_timeout", message)
        except Exception as exc:
            # Memory is an aid: the reply goes on without it, and the client is told why.
            log.exception("memory recall failed for reply %s", reply.id)
            observe_recall("error")
            return user_text, [], _without_memory(user_text, scope, "memory_unavailable", type(exc).__name__)
        observe_recall("ok")
        observe_retrieval(found.latency_ms["search"] / 1000)
        items = [
            MemoryItemView(
                text=m.hit.text,
                created_at=m.hit.turn_created_at,
                conversation_id=m.hit.conversation_id,
                conversation_title=m.conversation_title,
                role=m.hit.role,
                score=m.hit.score,
            )
            for m in found.memories
        ]
        payload: JsonObject = {
            "query": user_text,
            "rewritten_query": found.query,
            "rewrite": found.rewrite.method,
            "scope": scope,
            "items": [memory_item_json(m) for m in found.memories],
            "latency_ms": {step: ms for step, ms in found.latency_ms.items()},
        }
        if found.rewrite.fallback_reason and found.rewrite.method == "heuristic":
            payload["rewrite_fallback"] = found.rewrite.fallback_reason
        return found.query, items, payload

    async def tool_search(self, ctx: ToolContext, query: str) -> JsonObject:
        """The `recall_memory` tool: the model's own query, the user's whole memory, minus the window."""
        if not query.strip():
            return {"query": query, "items": [], "note": "empty query"}
        found = await self.search(
            ctx.owner,
            query,
            k=TOOL_RESULT_ITEMS,
            history_conversation=ctx.conversation_id,
            exclude_window=True,
            rewrite=False,
        )
        return {
            "query": query,
            "items": [
                {
                    "text": m.hit.text,
                    "date": m.hit.turn_created_at.date().isoformat(),
                    "conversation_title": m.conversation_title,
                    "role": m.hit.role,
                    "score": round(m.hit.score, 4),
                }
                for m in found.memories
            ],
        }


def _without_memory(user_text: str, scope: str, code: str, message: str) -> JsonObject:
    """The `memory.retrieved` payload of a reply that goes on without memory, saying why."""
    return {
        "query": user_text,
        "rewritten_query": user_text,
        "rewrite": "skipped",
        "scope": scope,
        "items": [],
        "error": {"code": code, "message": message},
    }


def _ms_since(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 2)


def _rewrite_outcome(result: Rewrite) -> str:
    """The metric label: model, skipped, or why the heuristic was used (timeout / fallback)."""
    if result.method == "heuristic":
        return "timeout" if "timeout" in (result.fallback_reason or "").lower() else "fallback"
    return result.method
