"""The memory API: search the caller's memory as the chat would, and forget all of it."""

from __future__ import annotations

import uuid
from typing import Any, Literal

from fastapi import Response
from pydantic import BaseModel, Field

from chat_api.admission import check_text, door_router
from chat_api.deps import OwnerDep, ServicesDep
from chat_api.replies.recall import observe_rewrite_of, recalled_item
from chat_api.schemas import Strict
from memory.errors import InvalidInput
from memory.recall.access import MAX_QUERY_CHARS
from memory.recall.forgetting import forget_user_memory
from memory.record.conversations import get_conversation

router = door_router(prefix="/v1/memory", tags=["memory"])


class MemorySearch(Strict):
    query: str = Field(description="What to look for; rewritten with the conversation's recent turns.")
    k: int | None = Field(None, ge=1, le=100, description="How many items. Default: MEMORY_TOP_K.")
    conversation_id: uuid.UUID | None = Field(
        None, description="Rewrite with this conversation's recent turns (and search only it if scoped)."
    )
    scope: Literal["user", "conversation"] | None = Field(
        None, description="All the user's conversations, or only `conversation_id`. Default: MEMORY_SCOPE."
    )


class MemoryItemOut(BaseModel):
    turn_id: uuid.UUID
    conversation_id: uuid.UUID | None
    conversation_title: str | None
    chunk_index: int
    role: str
    name: str | None
    text: str
    created_at: str
    score: float
    external_id: str | None
    metadata: dict[str, Any] | None


class MemorySearchOut(BaseModel):
    query: str
    rewritten_query: str
    rewrite: str = Field(description="model, heuristic, or skipped (no conversation history).")
    items: list[MemoryItemOut]


@router.post("/search")
async def search_memory(body: MemorySearch, owner: OwnerDep, services: ServicesDep) -> MemorySearchOut:
    """The rewritten query and the items the chat's retrieval would find, with scores."""
    check_text(body.query, field="query", max_chars=MAX_QUERY_CHARS)
    scope = body.scope or services.settings.memory_scope
    if scope == "conversation" and body.conversation_id is None:
        raise InvalidInput("scope 'conversation' needs conversation_id", field="conversation_id")
    if body.conversation_id is not None:
        async with services.db.session() as session:
            await get_conversation(session, owner, body.conversation_id)  # 404 unless it is the caller's
    found = await services.recaller.search(
        owner,
        body.query,
        k=body.k or services.settings.memory_top_k,
        scope_conversation=body.conversation_id if scope == "conversation" else None,
        history_conversation=body.conversation_id,
    )
    observe_rewrite_of(found)
    return MemorySearchOut(
        query=body.query,
        rewritten_query=found.query,
        rewrite=found.rewrite.method,
        items=[MemoryItemOut.model_validate(recalled_item(m, chunk_index=True)) for m in found.memories],
    )


@router.delete("", status_code=204)
async def forget_memory(owner: OwnerDep, services: ServicesDep) -> Response:
    """Forget all of the caller's long-term memory (conversations stay); immediate for retrieval."""
    async with services.db.transaction() as session:
        await forget_user_memory(session, owner)
    return Response(status_code=204)
