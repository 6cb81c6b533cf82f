"""Memory items: what chatmem remembers of the caller, listed, searched, corrected, forgotten, stated.

Every route is the caller's own: another user's or tenant's item answers 404, exactly as
one that never existed. Each change is committed before the response, so the next reply
on any replica already uses it.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated

from fastapi import Path, Query, Response
from pydantic import BaseModel, Field

from chat_api.admission import check_time, door_router
from chat_api.deps import OwnerDep, ServicesDep
from chat_api.schemas import Strict
from memory.errors import InvalidInput
from memory.recall.access import MAX_QUERY_CHARS
from memory.recall.items import MAX_ITEM_CHARS, MAX_ITEM_ID, ItemFilter, StoredMemory, get_item, list_items
from memory.record.conversations import get_conversation

router = door_router(prefix="/v1/memory/items", tags=["memory"])

ItemId = Annotated[int, Path(ge=1, le=MAX_ITEM_ID, description="The item's id.")]


class MemoryItemRecord(BaseModel):
    id: int
    source: str = Field(description="`turn` (from a finished turn) or `stated` (POST /v1/memory/items).")
    text: str
    role: str
    name: str | None
    conversation_id: uuid.UUID | None
    conversation_title: str | None
    turn_id: uuid.UUID | None = Field(description="The turn it came from (its text stays as it was said).")
    chunk_index: int
    created_at: datetime = Field(description="When it was said (or stated).")
    indexed_at: datetime
    edited_at: datetime | None = Field(description="When the user last corrected it.")
    score: float | None = Field(None, description="Relevance, in a search (`q`) only.")

    @classmethod
    def of(cls, item: StoredMemory, score: float | None = None) -> MemoryItemRecord:
        return cls(
            id=item.id,
            source=item.source,
            text=item.text,
            role=item.role,
            name=item.name,
            conversation_id=item.conversation_id,
            conversation_title=item.conversation_title,
            turn_id=item.turn_id,
            chunk_index=item.chunk_index,
            created_at=item.created_at,
            indexed_at=item.indexed_at,
            edited_at=item.edited_at,
            score=score,
        )


class MemoryItemPage(BaseModel):
    items: list[MemoryItemRecord]
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page; null at the end.")


class MemoryItemCreate(Strict):
    text: str = Field(max_length=MAX_ITEM_CHARS, description='A fact to remember, e.g. "I\'m vegetarian".')
    conversation_id: uuid.UUID | None = Field(
        None, description="Tie it to one of your conversations (forgotten with it); default none."
    )


class MemoryItemUpdate(Strict):
    text: str = Field(max_length=MAX_ITEM_CHARS, description="The corrected text (re-embedded).")


@router.get("")
async def list_memory_items(
    owner: OwnerDep,
    services: ServicesDep,
    limit: int = Query(50, ge=1, le=200),
    cursor: str | None = Query(None, max_length=512),
    conversation_id: uuid.UUID | None = Query(None, description="Only this conversation's items."),
    since: datetime | None = Query(None, description="Said at or after this time (ISO 8601)."),
    until: datetime | None = Query(None, description="Said before this time (ISO 8601)."),
    q: str | None = Query(
        None,
        max_length=MAX_QUERY_CHARS,
        description="Search: the `limit` best matches, best first, one page.",
    ),
) -> MemoryItemPage:
    """The caller's remembered items, newest first and paged by cursor; or, with `q`, the best matches."""
    # A time without a zone means UTC, as every stored time is; one UTC cannot hold is a 422.
    since, until = check_time(since, field="since"), check_time(until, field="until")
    if since is not None and until is not None and since >= until:
        raise InvalidInput("since must be before until", field="since")
    if conversation_id is not None:
        async with services.db.session() as session:
            await get_conversation(session, owner, conversation_id)  # 404 unless it is the caller's
    if q is not None:
        if cursor is not None:
            raise InvalidInput("a search (q) has one page: no cursor", field="cursor")
        found = await services.memory_access.search(owner, q, k=limit, conversation_id=conversation_id)
        records = [
            MemoryItemRecord.of(f.item, round(f.score, 4))
            for f in found
            if (since is None or f.item.created_at >= since) and (until is None or f.item.created_at < until)
        ]
        return MemoryItemPage(items=records, next_cursor=None)
    async with services.db.session() as session:
        items, next_cursor = await list_items(
            session,
            owner,
            limit=limit,
            cursor=cursor,
            where=ItemFilter(conversation_id=conversation_id, since=since, until=until),
        )
    return MemoryItemPage(items=[MemoryItemRecord.of(i) for i in items], next_cursor=next_cursor)


@router.post("", status_code=201)
async def create_memory_item(
    body: MemoryItemCreate, owner: OwnerDep, services: ServicesDep
) -> MemoryItemRecord:
    """Remember a fact the caller states directly (no turn behind it); used from the next reply on."""
    item = await services.memory_access.remember(owner, body.text, conversation_id=body.conversation_id)
    return MemoryItemRecord.of(item)


@router.get("/{item_id}")
async def get_memory_item(item_id: ItemId, owner: OwnerDep, services: ServicesDep) -> MemoryItemRecord:
    """One remembered item of the caller's."""
    async with services.db.session() as session:
        return MemoryItemRecord.of(await get_item(session, owner, item_id))


@router.patch("/{item_id}")
async def correct_memory_item(
    item_id: ItemId, body: MemoryItemUpdate, owner: OwnerDep, services: ServicesDep
) -> MemoryItemRecord:
    """Correct an item's text (re-embedded); the turn it came from stays untouched in the history."""
    return MemoryItemRecord.of(await services.memory_access.correct(owner, item_id, body.text))


@router.delete("/{item_id}", status_code=204)
async def forget_memory_item(item_id: ItemId, owner: OwnerDep, services: ServicesDep) -> Response:
    """Forget one item for good: no reply recalls it, and reprocessing its turn does not bring it back."""
    await services.memory_access.forget(owner, item_id)
    return Response(status_code=204)
