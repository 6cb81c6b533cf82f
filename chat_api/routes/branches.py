"""Forks, branches, regenerate and edit: other lines of a conversation's history.

Regenerate and edit start a reply exactly like `POST …/messages` (same SSE events, same
`stream`, `on_busy`, `on_disconnect`, `memory_scope` and `Idempotency-Key`), on a new
branch that becomes the conversation's active one.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from fastapi import Body, Header
from sse_starlette import EventSourceResponse

from chat_api.admission import AdmissionDep, check_prompt_room_off_loop, check_text, door_router
from chat_api.deps import OwnerDep, ServicesDep
from chat_api.replies import edit_message, regenerate_reply
from chat_api.routes.messages import admit, reply_response
from chat_api.schemas import (
    BranchList,
    BranchOut,
    ConversationOut,
    EditIn,
    ForkIn,
    RegenerateIn,
    ReplyOut,
)
from memory.record.branches import activate_branch, conversation_branch, fork_conversation, list_branches
from memory.record.conversations import get_conversation
from memory.record.turns import get_turn

router = door_router(tags=["branches"])

IdempotencyKey = Annotated[str | None, Header(alias="Idempotency-Key", max_length=200)]
REPLY_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "SSE stream (text/event-stream) or the reply (stream=false)"}
}


@router.post("/v1/conversations/{conversation_id}/fork", status_code=201)
async def fork(
    conversation_id: uuid.UUID, body: ForkIn, owner: OwnerDep, services: ServicesDep
) -> ConversationOut:
    """A new conversation whose history is this one's up to `turn_id` (shared, not copied).

    404 for a conversation or turn that is not yours or not in this conversation;
    409 `turn_not_finished` for a turn still streaming or waiting for an approval.
    """
    if body.title is not None:
        check_text(body.title, field="title", allow_empty=True)
    async with services.db.transaction() as session:
        source = await get_conversation(session, owner, conversation_id)
        turn = await get_turn(session, owner, body.turn_id)
        created = await fork_conversation(session, owner, source, turn, title=body.title)
    return ConversationOut.of(created)


@router.get("/v1/conversations/{conversation_id}/branches")
async def branches(conversation_id: uuid.UUID, owner: OwnerDep, services: ServicesDep) -> BranchList:
    """The conversation's branches, oldest first, each with its fork point and newest turn."""
    async with services.db.session() as session:
        conversation = await get_conversation(session, owner, conversation_id)
        summaries = await list_branches(session, conversation)
    active = conversation.active_branch_id
    items = [
        BranchOut(
            id=s.id,
            active=s.id == active,
            parent_branch_id=s.parent_branch_id,
            fork_seq=s.fork_seq,
            own_turns=s.own_turns,
            head_turn_id=s.head_turn_id,
            head_seq=s.head_seq,
            head_role=s.head_role,
            head_status=s.head_status,
            created_at=s.created_at,
        )
        for s in summaries
    ]
    return BranchList(active_branch_id=active, items=items)


@router.post("/v1/conversations/{conversation_id}/branches/{branch_id}/activate")
async def activate(
    conversation_id: uuid.UUID, branch_id: uuid.UUID, owner: OwnerDep, services: ServicesDep
) -> ConversationOut:
    """Make this branch the active one: new messages, prompts and memory follow it (409 while busy)."""
    async with services.db.transaction() as session:
        conversation = await get_conversation(session, owner, conversation_id, for_update=True)
        branch = await conversation_branch(session, conversation, branch_id)
        await activate_branch(session, conversation, branch)
    return ConversationOut.of(conversation)


@router.post("/v1/turns/{turn_id}/regenerate", response_model=None, responses=REPLY_RESPONSES)
async def regenerate(
    turn_id: uuid.UUID,
    owner: OwnerDep,
    services: ServicesDep,
    admission: AdmissionDep,
    idempotency_key: IdempotencyKey = None,
    body: Annotated[RegenerateIn | None, Body()] = None,
) -> EventSourceResponse | ReplyOut:
    """Answer the last reply's user message again, on a new active branch (the old reply stays readable).

    `turn_id` is any turn of the active branch's last reply; 409 `not_last_reply` otherwise,
    409 `conversation_busy` while a reply streams (see `on_busy`).
    """
    options = body or RegenerateIn.model_validate({})
    async with services.db.session() as session:
        turn = await get_turn(session, owner, turn_id)
    with admit(admission, owner, options) as admitted:
        accepted = await regenerate_reply(
            services,
            owner,
            turn,
            admitted=admitted,
            conversation_id=options.conversation_id or turn.conversation_id,
            on_busy=options.on_busy or services.settings.on_busy_default,
            on_disconnect=options.on_disconnect,
            idempotency_key=idempotency_key,
            memory_scope=options.memory_scope or services.settings.memory_scope,
        )
    return await reply_response(services, owner, options, admitted, accepted)


@router.post("/v1/turns/{turn_id}/edit", response_model=None, responses=REPLY_RESPONSES)
async def edit(
    turn_id: uuid.UUID,
    body: EditIn,
    owner: OwnerDep,
    services: ServicesDep,
    admission: AdmissionDep,
    idempotency_key: IdempotencyKey = None,
) -> EventSourceResponse | ReplyOut:
    """Replace a user message of the active branch: a new active branch with the new text, and its reply."""
    check_text(body.content, field="content", max_chars=services.settings.max_message_chars)
    await check_prompt_room_off_loop(services.prompter, None, body.content, message_field="content")
    async with services.db.session() as session:
        turn = await get_turn(session, owner, turn_id)
    with admit(admission, owner, body) as admitted:
        accepted = await edit_message(
            services,
            owner,
            turn,
            body.content,
            admitted=admitted,
            conversation_id=body.conversation_id or turn.conversation_id,
            on_busy=body.on_busy or services.settings.on_busy_default,
            on_disconnect=body.on_disconnect,
            idempotency_key=idempotency_key,
            memory_scope=body.memory_scope or services.settings.memory_scope,
        )
    return await reply_response(services, owner, body, admitted, accepted)
