"""Chats of AI SDK frontends: the client's chat id of a conversation, and what its message list shows.

A `useChat` frontend names a chat with an id it made (`generateId()`: letters, digits,
`_` and `-`). `ai_sdk_chats` (migration 0010) maps (tenant, user, chat id) to one of that
user's conversations, created on first use. A chatmem conversation id works as a chat id
too, but only for its owner. Any other id, unused or naming another user's (or tenant's)
conversation, is a chat this user has not used yet: the two answer exactly alike, so a
chat id can neither reach another user's conversation nor tell whether it exists (the
404 one got and the empty list the other got were such an oracle). A conversation made under
an id chosen for it (`made_under_id`: the OpenAI doors' chat keys name theirs so) is such a
chat id before it exists, and takes a stop kept for it as a new chat does. Functions here take
a session and never commit.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from sqlalchemy import text
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from memory.errors import InvalidInput, NotFound
from memory.events import EventName
from memory.record.conversations import Owner, create_conversation, get_conversation
from memory.record.pending_stops import keep_new_chat_stop, take_new_chat_stop
from memory.storage.models import Conversation

CHAT_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")

FIND_CHAT = text(
    """
    SELECT conversation_id FROM ai_sdk_chats
    WHERE tenant_id = :tenant_id AND user_id = :user_id AND chat_id = :chat_id
    """
)

ADD_CHAT = text(
    """
    INSERT INTO ai_sdk_chats (tenant_id, user_id, chat_id, conversation_id)
    VALUES (:tenant_id, :user_id, :chat_id, :conversation_id)
    """
)

# Two first requests of one new chat racing each other: the second waits, then finds the first's.
LOCK_NEW_CHAT = text("SELECT pg_advisory_xact_lock(hashtextextended(:key, 0))")

# The `memory.retrieved` payloads of each reply, straight from the stored event log, in the
# order they were sent (a reply that goes on after an approval recalls again: the last one is
# what its stream's client shows).
MEMORY_PAYLOADS = text(
    """
    SELECT te.reply_id, e.event -> 2 AS payload
    FROM turn_events te CROSS JOIN LATERAL jsonb_array_elements(te.events) WITH ORDINALITY AS e(event, n)
    WHERE te.reply_id = ANY(:reply_ids) AND e.event ->> 1 = :name
    ORDER BY te.first_id, e.n
    """
)


def check_chat_id(chat_id: str) -> None:
    """InvalidInput unless `chat_id` is 1-128 characters of [A-Za-z0-9_-]."""
    if not CHAT_ID.fullmatch(chat_id):
        raise InvalidInput("chat id must be 1-128 characters of A-Z, a-z, 0-9, _ and -", field="id")


def _as_uuid(chat_id: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(chat_id) if len(chat_id) == 36 else None
    except ValueError:
        return None


async def find_chat(session: AsyncSession, owner: Owner, chat_id: str) -> Conversation | None:
    """The owner's conversation for this chat id, or None if the owner never used it.

    NotFound when the owner's chat names a conversation of theirs that was deleted.
    """
    check_chat_id(chat_id)
    params = {"tenant_id": owner.tenant_id, "user_id": owner.user_id, "chat_id": chat_id}
    mapped = (await session.execute(FIND_CHAT, params)).scalar_one_or_none()
    if mapped is not None:
        return await get_conversation(session, owner, mapped)
    as_uuid = _as_uuid(chat_id)
    if as_uuid is None:
        return None
    try:
        return await get_conversation(session, owner, as_uuid)
    except NotFound:
        return None  # unused, or anyone else's: the same answer


async def _found_or_locked(session: AsyncSession, owner: Owner, chat_id: str) -> Conversation | None:
    """The chat's conversation; if it has none, the lock that creating it takes is taken first, and
    then the conversation if one was created meanwhile (None: none, and this session holds the lock)."""
    found = await find_chat(session, owner, chat_id)
    if found is not None:
        return found
    await _lock_new_chat(session, owner, chat_id)
    return await find_chat(session, owner, chat_id)


async def _lock_new_chat(session: AsyncSession, owner: Owner, chat_id: str) -> None:
    """Take the lock that making the owner's conversation for this chat id takes (and keeping a
    stop for it): held until this transaction ends."""
    key = f"ai-sdk-chat:{owner.tenant_id}:{owner.user_id}:{chat_id}"
    await session.execute(LOCK_NEW_CHAT, {"key": key})


async def chat_conversation(session: AsyncSession, owner: Owner, chat_id: str) -> Conversation:
    """The owner's conversation for this chat id, created (and mapped) on first use; a stop
    kept for the chat id before then (`stop_of_chat`) is kept on the new conversation."""
    found = await _found_or_locked(session, owner, chat_id)
    if found is not None:
        return found
    conversation = await create_conversation(session, owner)
    params = {
        "tenant_id": owner.tenant_id,
        "user_id": owner.user_id,
        "chat_id": chat_id,
        "conversation_id": conversation.id,
    }
    await session.execute(ADD_CHAT, params)
    await take_new_chat_stop(session, owner, chat_id, conversation.id)
    return conversation


async def made_under_id(
    session: AsyncSession, owner: Owner, conversation_id: uuid.UUID, *, title: str
) -> Conversation:
    """The owner's conversation with this chosen id, made now unless a request racing this one
    made it (NotFound if it was deleted since); a stop kept for the id as a chat id before then
    (`stop_of_chat`) is kept on the conversation made."""
    await _lock_new_chat(session, owner, str(conversation_id))
    made = await session.scalar(
        insert(Conversation)
        .values(id=conversation_id, tenant_id=owner.tenant_id, user_id=owner.user_id, title=title)
        .on_conflict_do_nothing(index_elements=["id"])
        .returning(Conversation.id)
    )
    if made is not None:
        await take_new_chat_stop(session, owner, str(conversation_id), conversation_id)
    return await get_conversation(session, owner, conversation_id)


async def stop_of_chat(
    session: AsyncSession, owner: Owner, chat_id: str, key: str | None
) -> Conversation | None:
    """The owner's conversation for this chat id, to stop; None if the owner has not used the id
    yet: then the stop is kept for the chat's first run (memory.record.pending_stops), under the
    lock that creating the chat takes, so a chat created meanwhile is found instead. None too
    if the id names a conversation of theirs that was deleted: nothing runs there, and a stop
    (sent blind, on a button or an unmount) answers as for an id never used."""
    try:
        found = await _found_or_locked(session, owner, chat_id)
    except NotFound:
        return None  # deleted: no run can start under this id, so nothing is kept for one
    if found is not None:
        return found
    await keep_new_chat_stop(session, owner, chat_id, key)
    return None


async def memory_payloads(
    session: AsyncSession, reply_ids: list[uuid.UUID]
) -> dict[uuid.UUID, dict[str, Any]]:
    """The last `memory.retrieved` payload of each of these replies that recalled memory, by reply id."""
    if not reply_ids:
        return {}
    rows = await session.execute(
        MEMORY_PAYLOADS, {"reply_ids": reply_ids, "name": EventName.MEMORY_RETRIEVED}
    )
    return {row.reply_id: row.payload for row in rows}


# The client's id of a user message, beside the turn: its edits and reloads name it by that id.
REMEMBER_MESSAGE_ID = text(
    """
    UPDATE turns
    SET metadata = COALESCE(metadata, '{}'::jsonb)
        || jsonb_build_object(CAST(:key AS text), CAST(:message_id AS text))
    WHERE id = :turn_id AND role = 'user'
    """
)


async def remember_message_id(session: AsyncSession, turn_id: uuid.UUID, key: str, message_id: str) -> None:
    """Keep the client's id of a stored user message in the turn's metadata under `key`."""
    await session.execute(REMEMBER_MESSAGE_ID, {"turn_id": turn_id, "key": key, "message_id": message_id})


# Whether a client's id names something of the conversation: a user turn that keeps it under
# `key`, or a turn stored under the idempotency key it gave (a read for a stop: no index needed).
NAMES_A_TURN = text(
    """
    SELECT EXISTS (
        SELECT 1 FROM turns
        WHERE conversation_id = :conversation_id
          AND (idempotency_key = :idempotency_key OR metadata ->> CAST(:key AS text) = :client_id)
    )
    """
)


async def names_a_turn(
    session: AsyncSession, conversation_id: uuid.UUID, key: str, client_id: str, idempotency_key: str
) -> bool:
    """Whether `client_id` is a client's id (metadata `key`) of a turn of the conversation, or
    `idempotency_key` the key one was stored under."""
    found = await session.scalar(
        NAMES_A_TURN,
        {
            "conversation_id": conversation_id,
            "key": key,
            "client_id": client_id,
            "idempotency_key": idempotency_key,
        },
    )
    return bool(found)
