"""Long-term memory before a reply: the time box, the `memory.retrieved` event, the metrics.

The finding itself is ``memory.recall`` (``Recaller.search``); this is only its glue into
a reply. The prompter calls ``recall_for_reply`` with the reply's prompt window (read
once, and sent to the first model step too: the rewriter's history, and the turns
retrieval must not return again).
"""

from __future__ import annotations

import asyncio
import logging

from chat_api.metrics import observe_query_ahead, observe_recall, observe_retrieval, observe_rewrite
from chat_api.replies.reply import Reply
from memory.events import ErrorData, EventName, MemoryRetrievedData, RecalledItem, RecallError
from memory.json_bounds import readable_json
from memory.prompt.context import PromptWindow
from memory.recall.embedding_service import embedding_budget
from memory.recall.found import FoundMemory, RecallResult
from memory.recall.index import ForeignGeneration
from memory.recall.recaller import Recaller

log = logging.getLogger(__name__)

# The part of RECALL_TIMEOUT_SECONDS an embedding service may take (its retry included); the
# rest is left to keyword search when it does not answer.
EMBEDDING_SHARE_OF_BOX = 0.6


def recalls(memory_scope: str, use_memory: bool) -> bool:
    """Whether a reply recalls long-term memory: its scope asks for it and its conversation uses memory."""
    return memory_scope != "none" and use_memory


def recalled_item(memory: FoundMemory, *, chunk_index: bool = False) -> RecalledItem:
    """One recalled memory as the `memory.retrieved` event and the memory API show it."""
    item = RecalledItem(
        turn_id=str(memory.turn_id),
        conversation_id=str(memory.conversation_id) if memory.conversation_id else None,
        conversation_title=memory.conversation_title,
        role=memory.role,
        name=memory.name,
        text=memory.text,
        created_at=memory.created_at.isoformat(),
        score=round(memory.score, 4),
        external_id=memory.external_id,
        metadata=readable_json(memory.metadata, what="metadata"),
    )
    if chunk_index:
        item["chunk_index"] = memory.chunk_index
    return item


def observe_rewrite_of(found: RecallResult) -> None:
    """Record how the query of one search was rewritten and how long that took."""
    rewrite = found.rewrite
    outcome: str = rewrite.method
    if rewrite.method == "heuristic":
        outcome = "timeout" if "timeout" in (rewrite.fallback_reason or "").lower() else "fallback"
    observe_rewrite(found.latency_ms["rewrite"] / 1000, outcome)


async def recall_for_reply(
    recaller: Recaller, reply: Reply, user_text: str, scope: str, window: PromptWindow
) -> None:
    """Set the reply's memories and publish `memory.retrieved` (also when it goes on without them).

    Time-boxed by RECALL_TIMEOUT_SECONDS: memory is an aid, and a reply that waits for it
    behind an overloaded encoder or database is worse than one without it.
    """
    settings = recaller.settings
    timeout = settings.recall_timeout_seconds
    try:
        # An embedding service that does not answer gets at most one retry and part of the box,
        # so that keyword search still has time to find something.
        async with asyncio.timeout(timeout):
            with embedding_budget(timeout * EMBEDDING_SHARE_OF_BOX, retries=1):
                found = await recaller.search(
                    reply.owner,
                    user_text,
                    k=settings.memory_top_k,
                    scope_conversation=reply.conversation_id if scope == "conversation" else None,
                    exclude_window=True,
                    extra_exclude=[reply.user_turn_id],
                    window=window,
                    for_block=True,
                    prepared=reply.id,  # the query encoded while the reply was accepted, if it was
                    nothing_stored=reply.nothing_stored,
                )
    except TimeoutError:
        observe_recall("timeout")
        log.warning("memory recall for reply %s took longer than %gs; replying without it", reply.id, timeout)
        message = f"memory recall took longer than {timeout:g}s; the reply goes on without memory"
        reply.memory_use = "unavailable"
        _announce(reply, _without_memory(user_text, scope, RecallError.MEMORY_TIMEOUT, message))
        return
    except Exception as exc:
        # Memory is an aid: the reply goes on without it, and the client is told why.
        if isinstance(exc, ForeignGeneration):
            # The index logged why once, when it began refusing; not a traceback per reply.
            log.debug("memory refused for reply %s: %s", reply.id, exc)
        else:
            log.exception("memory recall failed for reply %s", reply.id)
        observe_recall("error")
        reply.memory_use = "unavailable"
        reason = type(exc).__name__
        _announce(reply, _without_memory(user_text, scope, RecallError.MEMORY_UNAVAILABLE, reason))
        return
    observe_rewrite_of(found)
    observe_recall("ok" if found.degraded is None else "keywords_only")
    if found.query_ahead:
        observe_query_ahead("used")
    observe_retrieval(found.latency_ms["search"] / 1000)
    # What the prompt's standing block shows is not shown again (nor listed twice).
    standing = {(m.turn_id, m.chunk_index) for m in reply.standing}
    memories = [m for m in found.memories if (m.turn_id, m.chunk_index) not in standing]
    payload = MemoryRetrievedData(
        query=user_text,
        rewritten_query=found.query,
        rewrite=found.rewrite.method,
        scope=scope,
        items=[recalled_item(m) for m in memories],
        latency_ms=dict(found.latency_ms),
    )
    if found.rewrite.fallback_reason and found.rewrite.method == "heuristic":
        payload["rewrite_fallback"] = found.rewrite.fallback_reason
    if found.degraded is not None:
        # The embedding service did not answer: the items come from keyword search alone.
        code, reason = found.degraded
        log.warning("memory recall for reply %s used keyword search only: %s", reply.id, reason)
        payload["error"] = ErrorData(code=code, message=f"keyword search only: {reason}"[:500])
    reply.memories = memories
    reply.rewritten_query = found.query
    _announce(reply, payload)


def _announce(reply: Reply, payload: MemoryRetrievedData) -> None:
    """Publish `memory.retrieved`, with the statements the prompt opens with if it has any."""
    if reply.standing:
        payload["standing"] = [recalled_item(m) for m in reply.standing]
    reply.publish(EventName.MEMORY_RETRIEVED, payload)


def _without_memory(user_text: str, scope: str, code: str, message: str) -> MemoryRetrievedData:
    """The `memory.retrieved` payload of a reply that goes on without memory, saying why."""
    return MemoryRetrievedData(
        query=user_text,
        rewritten_query=user_text,
        rewrite="skipped",
        scope=scope,
        items=[],
        error=ErrorData(code=code, message=message),
    )
