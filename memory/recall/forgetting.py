"""Forgetting a user's long-term memory, effective for retrieval the moment it commits.

The chat history stays visible in its conversations; only what memory search may return
changes. Two things make that hold against the asynchronous indexer:

- each of the user's conversations gets ``memory_forgotten_seq = next_seq - 1``: retrieval
  of not-yet-indexed turns starts above it, and the indexer skips any turn at or below
  it, so a turn finished before the delete but still in the queue is never indexed later;
- the conversations are locked in id order (as the indexer locks them) before the rows
  are deleted, so an indexer batch either committed before (its rows are deleted here)
  or runs after (and sees the new mark).

Forgetting one item, correcting it, or deleting a conversation also stops remembering the
assistant replies that were shown those words (``forget_replies_shown``): a reply may retell
them, and remembered, it brought them back.

A reply in flight may have recalled the old words before such a change committed and store
what it was shown (its prompt part, or its recall tool's turn) only after the change looked for
the replies shown them.
Neither would see the other, and the reply stayed remembered: replies started after the
change recalled it, old words and all. So the two are serialized per user
(``lock_shown_memories``): the change holds the lock while it looks, and a reply storing its
part holds it shared and checks, under it, that every memory it lists is still there as it
was shown (memory/prompt/context.py ``memories_still_shown``, or ``unless_still_shown`` inside
the prompt part's own note); one that is not makes the reply ``forgotten``. The lock comes
first in both transactions, before any row lock.
"""

from __future__ import annotations

import uuid
import zlib
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy import func, null, text, update
from sqlalchemy.ext.asyncio import AsyncSession

from memory.events import TurnStatus
from memory.recall.remembering import FORGOTTEN
from memory.storage.models import MemoryItem, MemoryItemKind

if TYPE_CHECKING:
    from memory.record.conversations import Owner

LOCK_USER_CONVERSATIONS = text(
    """
    SELECT id FROM conversations
    WHERE tenant_id = :tenant_id AND user_id = :user_id
    ORDER BY id
    FOR NO KEY UPDATE
    """
)

MARK_FORGOTTEN = text(
    """
    UPDATE conversations SET memory_forgotten_seq = GREATEST(memory_forgotten_seq, next_seq - 1)
    WHERE tenant_id = :tenant_id AND user_id = :user_id
    """
)

DELETE_USER_MEMORY = text("DELETE FROM memory_items WHERE tenant_id = :tenant_id AND user_id = :user_id")


async def forget_user_memory(session: AsyncSession, owner: Owner) -> int:
    """Forget everything the user said so far; returns how many memory rows were deleted."""
    params = {"tenant_id": owner.tenant_id, "user_id": owner.user_id}
    await session.execute(LOCK_USER_CONVERSATIONS, params)
    await session.execute(MARK_FORGOTTEN, params)
    result = await session.execute(DELETE_USER_MEMORY, params)
    return int(getattr(result, "rowcount", 0) or 0)


# A reply that was shown a memory can repeat it in its own words ("Noted: a green 2009 Volvo,
# a fine estate for family trips."); remembered, it would bring a forgotten or corrected fact
# back. A reply was shown a turn when the turn is the message it answered (the user turn's
# `reply_id`; the part's `asked` for a regenerated answer too), a memory its prompt part listed
# (`turns.prompt_part`, which every reply's first turn stores), or one a tool of the reply showed
# (the recall tool: its tool turn's metadata, SHOWN_MEMORIES). Followed a few steps: a reply
# shown such a reply saw the fact too.
SHOWN_MEMORIES = "shown_memories"
REPLIES_SHOWN = text(
    f"""
    SELECT DISTINCT r.id, r.conversation_id
    FROM turns r
    WHERE r.role = 'assistant' AND r.tenant_id = :tenant_id AND r.user_id = :user_id
      AND r.id <> ALL(CAST(:seen AS uuid[]))
      AND r.reply_id IN (
        SELECT t.reply_id FROM turns t
        WHERE t.id = ANY(CAST(:turn_ids AS uuid[])) AND t.reply_id IS NOT NULL
          AND t.tenant_id = :tenant_id AND t.user_id = :user_id
        UNION ALL
        SELECT p.id FROM conversations c JOIN turns p ON p.conversation_id = c.id
        WHERE c.tenant_id = :tenant_id AND c.user_id = :user_id
          AND p.role = 'assistant' AND p.prompt_part IS NOT NULL
          AND (p.prompt_part ->> 'asked' = ANY(CAST(:turn_id_texts AS text[]))
               OR EXISTS (SELECT 1 FROM jsonb_array_elements(p.prompt_part -> 'memories') AS m
                          WHERE m ->> 'turn_id' = ANY(CAST(:turn_id_texts AS text[]))))
        UNION ALL
        SELECT o.reply_id FROM turns o
        WHERE o.tenant_id = :tenant_id AND o.user_id = :user_id AND o.role = 'tool'
          AND jsonb_exists_any(o.metadata -> '{SHOWN_MEMORIES}', CAST(:turn_id_texts AS text[]))
      )
    """
)
# How many steps of "shown a reply that was shown it" are followed.
SHOWN_DEPTH = 4

# A reply still streaming is ended by locking its turn and then its conversation (end_reply), so
# its turn is locked here before the conversations, in the same order (the other writers that lock
# conversations and then turns refuse while a reply of that conversation streams). Taken after
# them, a correction at the moment such a reply ended deadlocked with its ending. Only streaming
# turns: a parked one (awaiting_approval) is taken after its conversation by every writer, its stop
# too (end_parked_reply), and a user's deletion deletes it under the conversation locks.
LOCK_STREAMING_REPLIES = text(
    "SELECT id FROM turns WHERE id = ANY(CAST(:ids AS uuid[])) AND status = :streaming"
    " ORDER BY id FOR NO KEY UPDATE"
)
LOCK_CONVERSATIONS = text(
    "SELECT id FROM conversations WHERE id = ANY(CAST(:ids AS uuid[])) ORDER BY id FOR NO KEY UPDATE"
)
# The reply's turns stop being remembered: the indexer reads this under the same conversation
# locks (so a reply still queued is never indexed later), the not-yet-indexed search reads it too.
MARK_REPLIES_FORGOTTEN = text(
    "UPDATE turns SET memory_use = :forgotten WHERE id = ANY(CAST(:ids AS uuid[])) AND role = 'assistant'"
)
# What a forgotten memory row becomes: a tombstone, kept so that the indexer's upsert (which
# skips rows with forgotten_at) never brings it back; text, keywords and vector emptied.
TOMBSTONE: dict[Any, Any] = {
    MemoryItem.forgotten_at: func.now(),
    MemoryItem.deleted_at: func.now(),
    MemoryItem.text: "",
    MemoryItem.name: None,
    MemoryItem.meta: null(),
    MemoryItem.search_terms: func.to_tsvector("simple", ""),
    MemoryItem.embedding: None,
}
DELETE_TURN_KEYS = text(
    """
    DELETE FROM memory_items
    WHERE tenant_id = :tenant_id AND user_id = :user_id AND turn_id = ANY(CAST(:ids AS uuid[]))
      AND kind <> 'chunk'
    """
)


# The advisory lock of one user's shown memories: (this class, a 32-bit key of the owner).
SHOWN_LOCK_CLASS = 0x5_40E
LOCK_SHOWN = text("SELECT pg_advisory_xact_lock(:class_id, :key)")
LOCK_SHOWN_SHARED = text("SELECT pg_advisory_xact_lock_shared(:class_id, :key)")


async def lock_shown_memories(session: AsyncSession, owner: Owner, *, changing: bool) -> None:
    """Serialize a change of the owner's memories with replies storing what they were shown.

    ``changing`` (forget_replies_shown) takes it exclusively; a reply storing its part, shared.
    Taken before any row lock of the transaction.
    """
    key = zlib.crc32(f"{owner.tenant_id}\x1f{owner.user_id}".encode()) - 2**31  # an int4
    await session.execute(
        LOCK_SHOWN if changing else LOCK_SHOWN_SHARED, {"class_id": SHOWN_LOCK_CLASS, "key": key}
    )


async def forget_replies_shown(
    session: AsyncSession,
    owner: Owner,
    turn_ids: Sequence[uuid.UUID],
    *,
    lock_also: Collection[uuid.UUID] = (),
    outside: uuid.UUID | None = None,
) -> list[uuid.UUID]:
    """Stop remembering every assistant reply that was shown these turns' words; returns their turn ids.

    Their rows are tombstoned in every generation, and their turns marked `forgotten`, so the
    indexer skips them if they are still queued and recall never finds them before indexing.
    The conversations in ``lock_also`` are locked with theirs, all in id order (the caller's
    own changes to them come after). Replies in the conversation ``outside`` are followed (a
    reply shown one of them) but left as they are.
    """
    await lock_shown_memories(session, owner, changing=True)
    params = {"tenant_id": owner.tenant_id, "user_id": owner.user_id}
    found: dict[uuid.UUID, uuid.UUID] = {}
    frontier = list(turn_ids)
    for _ in range(SHOWN_DEPTH):
        if not frontier:
            break
        rows = await session.execute(
            REPLIES_SHOWN,
            {
                **params,
                "turn_ids": [str(t) for t in frontier],
                "turn_id_texts": [str(t) for t in frontier],
                "seen": [str(t) for t in (*turn_ids, *found)],
            },
        )
        frontier = []
        for row in rows:
            found[row.id] = row.conversation_id
            frontier.append(row.id)
    found = {reply: conversation for reply, conversation in found.items() if conversation != outside}
    if found:
        await session.execute(
            LOCK_STREAMING_REPLIES, {"ids": sorted(str(t) for t in found), "streaming": TurnStatus.STREAMING}
        )
    locked = sorted({str(c) for c in (*found.values(), *lock_also)})
    if locked:
        await session.execute(LOCK_CONVERSATIONS, {"ids": locked})
    if not found:
        return []
    ids = [str(t) for t in found]
    await session.execute(MARK_REPLIES_FORGOTTEN, {"ids": ids, "forgotten": FORGOTTEN})
    await session.execute(DELETE_TURN_KEYS, {**params, "ids": ids})
    # Rows already indexed, in every generation (a reply's keys, if any, went just above).
    await session.execute(
        update(MemoryItem)
        .where(
            MemoryItem.tenant_id == owner.tenant_id,
            MemoryItem.user_id == owner.user_id,
            MemoryItem.turn_id.in_(list(found)),
            MemoryItem.kind == MemoryItemKind.CHUNK,
            MemoryItem.forgotten_at.is_(None),
        )
        .values(TOMBSTONE)
    )
    return list(found)


CONVERSATION_TURNS = text("SELECT id FROM turns WHERE conversation_id = :conversation_id")


async def forget_replies_shown_in(
    session: AsyncSession, owner: Owner, conversation_id: uuid.UUID
) -> list[uuid.UUID]:
    """Stop remembering the replies elsewhere that were shown any turn of this conversation (it is
    being deleted, or no longer remembered: a reply that retold its words brought them back).

    Locks the conversation with theirs, in id order, as the indexer takes them.
    """
    said = await session.execute(CONVERSATION_TURNS, {"conversation_id": conversation_id})
    return await forget_replies_shown(
        session, owner, list(said.scalars()), lock_also=[conversation_id], outside=conversation_id
    )
