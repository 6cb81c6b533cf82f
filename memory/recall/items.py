"""Memory items a user can see and change: list, read, correct, forget one, state a fact.

An item is one chunk row of ``memory_items`` (never a search key, which only helps search
find its chunk: memory/recall/sentence_keys.py, fact_keys.py): a chunk of a finished turn
(``source = 'turn'``, written by the indexer) or a fact the user stated directly (``source =
'stated'``, no turn behind it: its ``turn_id`` is its own random id, and it has a conversation
only if one was named). Every function is scoped to one owner and never commits; the caller
owns the transaction, and whatever it commits is what the next search sees, on every replica.

Visible items are the ones retrieval may return: not deleted (retention) or forgotten,
on their conversation's active branch, and of a live conversation whose memory mode is
not ``none`` (or of no conversation). Everything else answers NotFound, as another
user's item does.

Changes outlive the indexer reprocessing a turn (a redelivered message, a reindex):

- a correction sets ``edited_at``; the indexer's upsert skips rows that have it, so the
  corrected text and its vector stay. The turn itself is never changed.
- correcting or forgetting an item deletes the search keys of its turn (in every
  generation), so the old words are not found through them; the indexer writes no keys
  for a turn with a corrected or forgotten item.
- forgetting a turn's item leaves a tombstone: ``forgotten_at`` and ``deleted_at`` set,
  text, keywords and vector emptied. The upsert conflicts with it and skips it (so the
  item does not come back), and the retention purge leaves it while its turn exists.
  A stated fact has nothing to come back from: forgetting it deletes the row.
- correcting or forgetting an item also stops remembering every assistant reply that was
  shown it (the reply to its message, a reply whose prompt listed it or whose recall tool
  returned it), indexed or still queued: such a reply may repeat the old fact in new words
  (memory/recall/forgetting.py).
"""

from __future__ import annotations

import base64
import json
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import and_, delete, func, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.sql.elements import ColumnElement

from memory.errors import Conflict, InvalidInput, NotFound
from memory.recall.forgetting import TOMBSTONE, forget_replies_shown
from memory.recall.found import FoundMemory
from memory.record.conversations import Owner, get_conversation
from memory.storage.models import Conversation, MemoryIndex, MemoryItem, MemoryItemKind, MemoryItemSource

# The longest text a stated fact or a correction may have (a turn's chunk is ~1,200).
MAX_ITEM_CHARS = 2000
# Ids are bigints: every door refuses one outside 1..MAX_ITEM_ID before it asks the database.
MAX_ITEM_ID = 2**63 - 1


class ConversationMemoryOff(Conflict):
    """The conversation's memory mode is `none`: nothing is remembered from it."""

    code = "conversation_memory_off"


@dataclass(frozen=True, slots=True)
class StoredMemory:
    """One visible memory item, as the items API and the MCP tools show it."""

    id: int
    source: str
    conversation_id: uuid.UUID | None
    conversation_title: str | None
    # None for a stated fact (no turn behind it).
    turn_id: uuid.UUID | None
    chunk_index: int
    role: str
    name: str | None
    text: str
    created_at: datetime
    indexed_at: datetime
    edited_at: datetime | None


@dataclass(frozen=True, slots=True)
class ItemFilter:
    """Which of the owner's items a listing covers."""

    conversation_id: uuid.UUID | None = None
    since: datetime | None = None
    until: datetime | None = None


@dataclass(frozen=True, slots=True)
class Embedded:
    """A text as it is searched: the stored text, its vector and its keyword terms."""

    text: str
    vector: list[float]
    terms: str
    index_id: int  # the generation whose encoder made ``vector`` (memory/recall/index.py)


_COLUMNS = (
    MemoryItem.id,
    MemoryItem.source,
    MemoryItem.conversation_id,
    Conversation.title,
    MemoryItem.turn_id,
    MemoryItem.chunk_index,
    MemoryItem.role,
    MemoryItem.name,
    MemoryItem.text,
    MemoryItem.turn_created_at,
    MemoryItem.indexed_at,
    MemoryItem.edited_at,
)


# Items are the rows of the searched generation; a generation being rebuilt holds copies.
_ACTIVE_INDEX = select(MemoryIndex.id).where(MemoryIndex.state == "active").scalar_subquery()


def _visible(owner: Owner) -> ColumnElement[bool]:
    return and_(
        MemoryItem.tenant_id == owner.tenant_id,
        MemoryItem.user_id == owner.user_id,
        MemoryItem.index_id == _ACTIVE_INDEX,
        MemoryItem.kind == MemoryItemKind.CHUNK,
        MemoryItem.deleted_at.is_(None),
        MemoryItem.on_active_branch.is_(True),
        or_(
            MemoryItem.conversation_id.is_(None),
            and_(
                Conversation.id.is_not(None),
                Conversation.deleted_at.is_(None),
                Conversation.memory_mode != "none",
            ),
        ),
    )


def _select_visible(owner: Owner) -> Any:
    return (
        select(*_COLUMNS)
        .select_from(MemoryItem)
        .outerjoin(Conversation, Conversation.id == MemoryItem.conversation_id)
        .where(_visible(owner))
    )


def _stored(row: Any) -> StoredMemory:
    stated = row.source == MemoryItemSource.STATED
    return StoredMemory(
        id=row.id,
        source=row.source,
        conversation_id=row.conversation_id,
        conversation_title=row.title,
        turn_id=None if stated else row.turn_id,
        chunk_index=row.chunk_index,
        role=row.role,
        name=row.name,
        text=row.text,
        created_at=row.turn_created_at,
        indexed_at=row.indexed_at,
        edited_at=row.edited_at,
    )


def encode_cursor(created_at: datetime, item_id: int) -> str:
    """An opaque cursor for the page after the item (created_at, id)."""
    raw = json.dumps([created_at.isoformat(), item_id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, int]:
    """The (created_at, id) of a cursor, or InvalidInput."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        created, ident = json.loads(raw)
        if not isinstance(ident, int) or isinstance(ident, bool):
            raise TypeError("id")
        return datetime.fromisoformat(created), ident
    except (ValueError, TypeError) as exc:
        raise InvalidInput("malformed cursor", field="cursor") from exc


async def list_items(
    session: AsyncSession,
    owner: Owner,
    *,
    limit: int,
    cursor: str | None = None,
    where: ItemFilter = ItemFilter(),
) -> tuple[list[StoredMemory], str | None]:
    """The owner's visible items, newest first; the page and the next page's cursor (None at the end)."""
    query = _select_visible(owner)
    if where.conversation_id is not None:
        query = query.where(MemoryItem.conversation_id == where.conversation_id)
    if where.since is not None:
        query = query.where(MemoryItem.turn_created_at >= where.since)
    if where.until is not None:
        query = query.where(MemoryItem.turn_created_at < where.until)
    if cursor:
        created_at, ident = decode_cursor(cursor)
        query = query.where(
            or_(
                MemoryItem.turn_created_at < created_at,
                and_(MemoryItem.turn_created_at == created_at, MemoryItem.id < ident),
            )
        )
    query = query.order_by(MemoryItem.turn_created_at.desc(), MemoryItem.id.desc()).limit(limit + 1)
    items = [_stored(row) for row in await session.execute(query)]
    next_cursor = None
    if len(items) > limit:
        items = items[:limit]
        next_cursor = encode_cursor(items[-1].created_at, items[-1].id)
    return items, next_cursor


async def get_item(session: AsyncSession, owner: Owner, item_id: int) -> StoredMemory:
    """The owner's visible item, or NotFound (also for other users' and forgotten items)."""
    row = (await session.execute(_select_visible(owner).where(MemoryItem.id == item_id))).one_or_none()
    if row is None:
        raise NotFound("memory item not found", item_id=item_id)
    return _stored(row)


async def items_by_key(
    session: AsyncSession, owner: Owner, keys: list[tuple[uuid.UUID, int]]
) -> dict[tuple[uuid.UUID, int], StoredMemory]:
    """The visible items with these (turn_id, chunk_index) keys, as search hits name them."""
    if not keys:
        return {}
    turn_ids = list({turn_id for turn_id, _ in keys})
    query = _select_visible(owner).where(MemoryItem.turn_id.in_(turn_ids))
    found = {(row.turn_id, row.chunk_index): _stored(row) for row in await session.execute(query)}
    return {key: found[key] for key in keys if key in found}


async def latest_in_own_words(
    session: AsyncSession,
    owner: Owner,
    *,
    limit: int,
    max_chars: int,
    besides: uuid.UUID | None = None,
) -> list[FoundMemory]:
    """The owner's newest visible items in their own words (a chunk of one of their turns, or a
    fact they stated) of at most `max_chars` characters, outside conversation `besides`; newest
    first, as recall's type (keyed by the row's turn id, a stated fact's own id included)."""
    query = (
        _select_visible(owner)
        .where(MemoryItem.role == "user", func.char_length(MemoryItem.text) <= max_chars)
        .order_by(MemoryItem.turn_created_at.desc(), MemoryItem.id.desc())
        .limit(limit)
    )
    if besides is not None:
        query = query.where(or_(MemoryItem.conversation_id.is_(None), MemoryItem.conversation_id != besides))
    return [
        FoundMemory(
            turn_id=row.turn_id,
            conversation_id=row.conversation_id,
            text=row.text,
            role=row.role,
            created_at=row.turn_created_at,
            score=0.0,
            conversation_title=row.title,
            chunk_index=row.chunk_index,
            name=row.name,
        )
        for row in await session.execute(query)
    ]


async def remember_fact(
    session: AsyncSession,
    owner: Owner,
    embedded: Embedded,
    *,
    created_at: datetime,
    conversation_id: uuid.UUID | None = None,
) -> StoredMemory:
    """Store a fact the user stated directly; recalled from the moment the caller commits."""
    if conversation_id is not None:
        conversation = await get_conversation(session, owner, conversation_id)
        if conversation.memory_mode == "none":
            raise ConversationMemoryOff(
                "this conversation is not remembered (memory mode none)", conversation_id=str(conversation_id)
            )
    item = MemoryItem(
        index_id=embedded.index_id,
        tenant_id=owner.tenant_id,
        user_id=owner.user_id,
        conversation_id=conversation_id,
        turn_id=uuid.uuid4(),
        chunk_index=0,
        turn_seq=0,
        role="user",
        name=None,
        text=embedded.text,
        search_terms=func.to_tsvector("simple", embedded.terms),
        embedding=embedded.vector,
        turn_created_at=created_at,
        source=MemoryItemSource.STATED,
    )
    session.add(item)
    await session.flush()
    return await get_item(session, owner, item.id)


async def correct_item(session: AsyncSession, owner: Owner, item_id: int, embedded: Embedded) -> StoredMemory:
    """Replace a visible item's text and vector; the indexer never overwrites the correction."""
    await _lock_and_forget_replies_shown(session, owner, await get_item(session, owner, item_id))
    visible = (
        select(MemoryItem.id)
        .select_from(MemoryItem)
        .outerjoin(Conversation, Conversation.id == MemoryItem.conversation_id)
        .where(MemoryItem.id == item_id, _visible(owner))
    )
    result = await session.execute(
        update(MemoryItem)
        .where(MemoryItem.id.in_(visible.scalar_subquery()), MemoryItem.index_id == embedded.index_id)
        .values(
            text=embedded.text,
            embedding=embedded.vector,
            search_terms=func.to_tsvector("simple", embedded.terms),
            edited_at=func.now(),
        )
        .returning(MemoryItem.id)
    )
    if result.scalar_one_or_none() is None:
        raise NotFound("memory item not found", item_id=item_id)
    item = await get_item(session, owner, item_id)
    await _delete_keys(session, owner, item)
    return item


async def _lock_and_forget_replies_shown(session: AsyncSession, owner: Owner, item: StoredMemory) -> None:
    """Lock the item's conversation with those of the replies shown it (in id order); forget those replies.

    Before any memory row is written: the indexer, a deletion, forgetting all memory and a
    branch switch all lock conversations first and memory rows after. A correction that took
    its row first and the conversations after deadlocked with them; and without its own
    conversation locked, an indexer batch that had read the turn as unchanged wrote its
    sentence keys (the old words) again after the correction deleted them.
    """
    own = [item.conversation_id] if item.conversation_id is not None else []
    await forget_replies_shown(session, owner, [await _turn_of(session, item)], lock_also=own)


async def _turn_of(session: AsyncSession, item: StoredMemory) -> uuid.UUID:
    """The turn id the item's row carries (a stated fact's own random id, which prompts list too)."""
    if item.turn_id is not None:
        return item.turn_id
    return (await session.execute(select(MemoryItem.turn_id).where(MemoryItem.id == item.id))).scalar_one()


async def _delete_keys(session: AsyncSession, owner: Owner, item: StoredMemory) -> None:
    """The search keys (sentences, facts) of the item's turn, in every generation (a stated fact has none)."""
    if item.turn_id is None:
        return
    await session.execute(
        delete(MemoryItem).where(
            MemoryItem.tenant_id == owner.tenant_id,
            MemoryItem.user_id == owner.user_id,
            MemoryItem.turn_id == item.turn_id,
            MemoryItem.kind != MemoryItemKind.CHUNK,
        )
    )


async def forget_item(session: AsyncSession, owner: Owner, item_id: int) -> None:
    """Forget one visible item for good: no search finds it, and reprocessing never brings it back."""
    item = await get_item(session, owner, item_id)
    mine = and_(
        MemoryItem.id == item.id,
        MemoryItem.tenant_id == owner.tenant_id,
        MemoryItem.user_id == owner.user_id,
        MemoryItem.deleted_at.is_(None),
    )
    await _lock_and_forget_replies_shown(session, owner, item)
    if item.source == MemoryItemSource.STATED:
        await session.execute(delete(MemoryItem).where(mine))
        return
    await _delete_keys(session, owner, item)
    await session.execute(update(MemoryItem).where(mine).values(TOMBSTONE))
