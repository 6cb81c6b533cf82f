"""Conversations: create, list, get, rename, delete, and the context the model would see."""

from __future__ import annotations

import uuid

from fastapi import Query, Response

from chat_api.admission import check_text, door_router
from chat_api.deps import OwnerDep, ServicesDep
from chat_api.schemas import (
    ContextOut,
    ConversationCreate,
    ConversationOut,
    ConversationPage,
    ConversationUpdate,
    TurnList,
    TurnOut,
)
from memory.record import conversations as repo
from memory.record.branches import (
    NO_LIMIT,
    branch_history_page,
    conversation_branch,
    decode_history_cursor,
    encode_history_cursor,
)

router = door_router(prefix="/v1/conversations", tags=["conversations"])


@router.post("", status_code=201)
async def create_conversation(
    body: ConversationCreate, owner: OwnerDep, services: ServicesDep
) -> ConversationOut:
    check_text(body.title, field="title", allow_empty=True)
    async with services.db.transaction() as session:
        conversation = await repo.create_conversation(
            session,
            owner,
            title=body.title,
            memory_mode=body.remembered_mode() or "persistent",
            use_memory=True if body.use_memory is None else body.use_memory,
        )
    return ConversationOut.of(conversation)


@router.get("")
async def list_conversations(
    owner: OwnerDep,
    services: ServicesDep,
    limit: int = Query(20, ge=1, le=100),
    cursor: str | None = Query(None, max_length=512),
) -> ConversationPage:
    async with services.db.session() as session:
        rows, next_cursor = await repo.list_conversations(session, owner, limit=limit, cursor=cursor)
    return ConversationPage(items=[ConversationOut.of(c) for c in rows], next_cursor=next_cursor)


@router.get("/{conversation_id}")
async def get_conversation(
    conversation_id: uuid.UUID, owner: OwnerDep, services: ServicesDep
) -> ConversationOut:
    async with services.db.session() as session:
        return ConversationOut.of(await repo.get_conversation(session, owner, conversation_id))


@router.patch("/{conversation_id}")
async def update_conversation(
    conversation_id: uuid.UUID, body: ConversationUpdate, owner: OwnerDep, services: ServicesDep
) -> ConversationOut:
    if body.title is not None:
        check_text(body.title, field="title", allow_empty=True)
    async with services.db.transaction() as session:
        conversation = await repo.update_conversation(
            session,
            owner,
            conversation_id,
            title=body.title,
            memory_mode=body.remembered_mode(),
            use_memory=body.use_memory,
        )
    return ConversationOut.of(conversation)


@router.delete("/{conversation_id}", status_code=204)
async def delete_conversation(conversation_id: uuid.UUID, owner: OwnerDep, services: ServicesDep) -> Response:
    async with services.db.transaction() as session:
        await repo.delete_conversation(session, owner, conversation_id)
    return Response(status_code=204)


@router.get("/{conversation_id}/turns")
async def get_turns(
    conversation_id: uuid.UUID,
    owner: OwnerDep,
    services: ServicesDep,
    branch: uuid.UUID | None = Query(None, description="A branch of the conversation (default: active)."),
    limit: int = Query(100, ge=1, le=500, description="Most turns in the page."),
    cursor: str | None = Query(None, max_length=512, description="`next_cursor` of the newer page."),
) -> TurnList:
    """The display history of a branch, a page at a time: the newest `limit` turns (before the
    cursor), oldest first, every turn with its status and tool calls, whole; `next_cursor` reads
    the turns before them (null: the page starts the history).

    A fork's history starts with the turns it shares with the original (their own
    `conversation_id`); other branches stay readable with `?branch=`.
    """
    below = decode_history_cursor(cursor) if cursor else NO_LIMIT
    async with services.db.session() as session:
        conversation = await repo.get_conversation(session, owner, conversation_id)
        history = await conversation_branch(session, conversation, branch)
        turns, first_seq = await branch_history_page(session, history, limit=limit, below_seq=below)
    return TurnList(
        items=[TurnOut.of(t) for t in turns],
        next_cursor=None if first_seq is None else encode_history_cursor(first_seq),
    )


@router.get("/{conversation_id}/context")
async def get_context(conversation_id: uuid.UUID, owner: OwnerDep, services: ServicesDep) -> ContextOut:
    """What would be sent to the model for the next message (without recalled memory)."""
    async with services.db.session() as session:
        conversation = await repo.get_conversation(session, owner, conversation_id)
    built = await services.prompter.context_for(conversation.id)
    return ContextOut(
        messages=built.messages,
        prompt_version=built.prompt_version,
        token_count=built.token_count,
        window_turn_ids=list(built.window_turn_ids),
        dropped=dict(built.dropped),
    )
