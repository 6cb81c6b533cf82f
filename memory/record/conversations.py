"""Conversation repository: every function is scoped to one tenant and user, and never commits."""

from __future__ import annotations

import base64
import json
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import and_, delete, func, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from memory.errors import InvalidInput, NotFound
from memory.recall.forgetting import forget_replies_shown_in
from memory.storage.models import Conversation, MemoryItem


@dataclass(frozen=True, slots=True)
class Owner:
    """Who is asking: the only source of identity is the verified token."""

    tenant_id: str
    user_id: str


def _owned(owner: Owner):  # type: ignore[no-untyped-def]
    return and_(
        Conversation.tenant_id == owner.tenant_id,
        Conversation.user_id == owner.user_id,
        Conversation.deleted_at.is_(None),
    )


async def create_conversation(
    session: AsyncSession,
    owner: Owner,
    *,
    title: str = "",
    memory_mode: str = "persistent",
    use_memory: bool = True,
) -> Conversation:
    """Create a conversation owned by `owner`."""
    conversation = Conversation(
        id=uuid.uuid4(),
        tenant_id=owner.tenant_id,
        user_id=owner.user_id,
        title=title,
        memory_mode=memory_mode,
        use_memory=use_memory,
    )
    session.add(conversation)
    await session.flush()  # the model's eager defaults read its times back in the same statement
    return conversation


async def get_conversation(
    session: AsyncSession, owner: Owner, conversation_id: uuid.UUID, *, for_update: bool = False
) -> Conversation:
    """The owner's live conversation, or NotFound (also for other tenants' ids)."""
    query = select(Conversation).where(Conversation.id == conversation_id, _owned(owner))
    if for_update:
        query = query.with_for_update()
    conversation = (await session.execute(query)).scalar_one_or_none()
    if conversation is None:
        raise NotFound("conversation not found", conversation_id=str(conversation_id))
    return conversation


def encode_cursor(created_at: datetime, conversation_id: uuid.UUID) -> str:
    raw = json.dumps([created_at.isoformat(), str(conversation_id)]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, uuid.UUID]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        created, ident = json.loads(raw)
        at = datetime.fromisoformat(created)
        # Our cursors carry UTC times; a naive or out-of-range one would fail in the query.
        if at.tzinfo is None:
            raise ValueError("cursor time has no zone")
        return at.astimezone(UTC), uuid.UUID(ident)
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        raise InvalidInput("malformed cursor", field="cursor") from exc


async def list_conversations(
    session: AsyncSession, owner: Owner, *, limit: int, cursor: str | None = None
) -> tuple[list[Conversation], str | None]:
    """Newest first; returns the page and the cursor of the next page (None at the end)."""
    query = select(Conversation).where(_owned(owner))
    if cursor:
        created_at, ident = decode_cursor(cursor)
        query = query.where(
            or_(
                Conversation.created_at < created_at,
                and_(Conversation.created_at == created_at, Conversation.id < ident),
            )
        )
    query = query.order_by(Conversation.created_at.desc(), Conversation.id.desc()).limit(limit + 1)
    rows = list((await session.execute(query)).scalars())
    next_cursor = None
    if len(rows) > limit:
        rows = rows[:limit]
        next_cursor = encode_cursor(rows[-1].created_at, rows[-1].id)
    return rows, next_cursor


async def update_conversation(
    session: AsyncSession,
    owner: Owner,
    conversation_id: uuid.UUID,
    *,
    title: str | None = None,
    memory_mode: str | None = None,
    use_memory: bool | None = None,
) -> Conversation:
    """Rename and/or change whether the chat is remembered (memory_mode) and uses memory.

    Turned on again, the chat is remembered from then on: what was said while it was off stays
    out, though the indexer may not have reached it yet (the indexer and the not-yet-indexed
    search read the switch as it is when they run, and skip every turn at or below
    ``memory_forgotten_seq``, as after a forget).
    """
    conversation = await get_conversation(session, owner, conversation_id)
    turned_off = memory_mode == "none" and conversation.memory_mode != "none"
    if turned_off:
        # Nor are the replies elsewhere that retold its words; this locks it (with theirs).
        await forget_replies_shown_in(session, owner, conversation.id)
    conversation = await get_conversation(session, owner, conversation_id, for_update=not turned_off)
    if title is not None:
        conversation.title = title
    if memory_mode is not None:
        if conversation.memory_mode == "none" and memory_mode != "none":
            conversation.memory_forgotten_seq = func.greatest(
                Conversation.memory_forgotten_seq, Conversation.next_seq - 1
            )
        conversation.memory_mode = memory_mode
    if use_memory is not None:
        conversation.use_memory = use_memory
    conversation.updated_at = func.now()
    await session.flush()
    await session.refresh(conversation)
    return conversation


async def delete_conversation(session: AsyncSession, owner: Owner, conversation_id: uuid.UUID) -> None:
    """Soft-delete the conversation (hidden everywhere) and forget its memory now, with the replies
    elsewhere that were shown its words as memories."""
    conversation = await get_conversation(session, owner, conversation_id)
    await forget_replies_shown_in(session, owner, conversation.id)  # locks it (with theirs)
    conversation = await get_conversation(session, owner, conversation_id)  # deleted meanwhile: 404
    conversation.deleted_at = func.now()
    await session.execute(delete(MemoryItem).where(MemoryItem.conversation_id == conversation.id))


async def active_reply_of(
    session: AsyncSession, conversation_id: uuid.UUID, *, for_update: bool = False
) -> uuid.UUID | None:
    """The conversation's running (or parked) reply as committed now: a fresh read, not the
    identity map's copy (`for_update`: once the conversation's lock is ours, so a reply being
    started has been stored or has not begun)."""
    query = select(Conversation.active_reply_id).where(Conversation.id == conversation_id)
    if for_update:
        query = query.with_for_update()
    found: uuid.UUID | None = await session.scalar(query)
    return found


async def allocate_seq(session: AsyncSession, conversation_id: uuid.UUID, count: int = 1) -> int:
    """Reserve `count` consecutive sequence numbers; returns the first (row lock until commit)."""
    result = await session.execute(
        update(Conversation)
        .where(Conversation.id == conversation_id)
        .values(next_seq=Conversation.next_seq + count, updated_at=func.now())
        .returning(Conversation.next_seq)
    )
    return int(result.scalar_one()) - count
