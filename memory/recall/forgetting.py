"""Forgetting a user's long-term memory, effective for retrieval the moment it commits.

The chat history stays visible in its conversations; only what memory search may return
changes. Two things make that hold against the asynchronous indexer:

- each of the user's conversations gets ``memory_forgotten_seq = next_seq - 1``: retrieval
  of not-yet-indexed turns starts above it, and the indexer skips any turn at or below
  it, so a turn finished before the delete but still in the queue is never indexed later;
- the conversations are locked in id order (as the indexer locks them) before the rows
  are deleted, so an indexer batch either committed before (its rows are deleted here)
  or runs after (and sees the new mark).
"""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

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
