"""Deleting a user: every row of theirs in one tenant, for good, in one transaction.

The user's conversations (deleted ones too) are locked first, in id order, as the indexer
locks them: an indexer batch either committed before (its memory rows are deleted here)
or runs after and finds no conversation, so it writes nothing. That also covers a turn
still queued in the outbox or in Kafka: its conversation is gone, so it is skipped.

A reply streaming at that moment would write again after the delete, so the deletion is
refused (``UserBusy``) while one streams; the API stops the user's replies first. A reply
parked for a tool approval runs nowhere and is deleted with the rest.
"""

from __future__ import annotations

import uuid
from collections import Counter

from sqlalchemy import bindparam, text
from sqlalchemy.dialects.postgresql import ARRAY, UUID
from sqlalchemy.ext.asyncio import AsyncSession

from memory.accounts.keys import delete_keys
from memory.errors import Conflict
from memory.record.conversations import Owner
from memory.storage.retention import delete_conversations

LOCK_USER_CONVERSATIONS = text(
    """
    SELECT id, active_reply_id FROM conversations
    WHERE tenant_id = :tenant_id AND user_id = :user_id
    ORDER BY id
    FOR UPDATE
    """
)
ACTIVE_REPLIES = text(
    """
    SELECT active_reply_id FROM conversations
    WHERE tenant_id = :tenant_id AND user_id = :user_id AND active_reply_id IS NOT NULL
    """
)
STREAMING_REPLIES = text(
    "SELECT DISTINCT reply_id FROM turns WHERE reply_id = ANY(:reply_ids) AND status = 'streaming'"
).bindparams(bindparam("reply_ids", type_=ARRAY(UUID(as_uuid=True))))
# Memory rows are found by owner too, in case one outlived its conversation.
DELETE_USER_MEMORY = text("DELETE FROM memory_items WHERE tenant_id = :tenant_id AND user_id = :user_id")
# dead_letters has no tenant column (and no RLS): run it unscoped. A small table.
DELETE_USER_DEAD_LETTERS = text(
    "DELETE FROM dead_letters WHERE payload->>'tenant_id' = :tenant_id AND payload->>'user_id' = :user_id"
)


# Stops kept for chat ids the user had not used yet (memory.record.pending_stops).
DELETE_USER_CHAT_STOPS = text("DELETE FROM chat_stops WHERE tenant_id = :tenant_id AND user_id = :user_id")


class UserBusy(Conflict):
    """A reply of the user is streaming; stop it before deleting the user."""

    code = "user_busy"


async def active_replies(session: AsyncSession, owner: Owner) -> list[uuid.UUID]:
    """Replies holding one of the user's conversations (streaming or waiting for approval)."""
    rows = await session.execute(ACTIVE_REPLIES, {"tenant_id": owner.tenant_id, "user_id": owner.user_id})
    return [row.active_reply_id for row in rows]


async def delete_user(session: AsyncSession, owner: Owner) -> Counter[str]:
    """Delete all of the user's data in the tenant; returns rows deleted per table. Idempotent."""
    params = {"tenant_id": owner.tenant_id, "user_id": owner.user_id}
    locked = list(await session.execute(LOCK_USER_CONVERSATIONS, params))
    holding = [row.active_reply_id for row in locked if row.active_reply_id is not None]
    if holding:
        streaming = [row.reply_id for row in await session.execute(STREAMING_REPLIES, {"reply_ids": holding})]
        if streaming:
            raise UserBusy(
                "a reply is streaming; stop it before deleting the user",
                running_turn_ids=[str(r) for r in streaming],
            )
    counts = await delete_conversations(session, [row.id for row in locked])
    result = await session.execute(DELETE_USER_MEMORY, params)
    counts["memory_items"] += int(getattr(result, "rowcount", 0) or 0)
    counts["api_keys"] += await delete_keys(session, owner)
    kept_stops = int(getattr(await session.execute(DELETE_USER_CHAT_STOPS, params), "rowcount", 0) or 0)
    if kept_stops:
        counts["chat_stops"] += kept_stops
    return counts


async def delete_user_dead_letters(session: AsyncSession, owner: Owner) -> int:
    """Dead-lettered payloads of the user (call unscoped: the table is not under RLS)."""
    result = await session.execute(
        DELETE_USER_DEAD_LETTERS, {"tenant_id": owner.tenant_id, "user_id": owner.user_id}
    )
    return int(getattr(result, "rowcount", 0) or 0)
