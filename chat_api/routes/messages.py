"""Sending a message: the reply streams as SSE, or comes back whole as JSON."""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import Header
from sse_starlette import EventSourceResponse

from chat_api.admission import (
    Admission,
    AdmissionDep,
    AdmittedReply,
    check_prompt_room_off_loop,
    check_text,
    door_router,
)
from chat_api.deps import OwnerDep, ServicesDep
from chat_api.replies import Accepted, ReplyKind, accept_message, sse_stream, wait_reply_done
from chat_api.response_headers import STREAM_HEADERS
from chat_api.schemas import MessageCreate, ReplyOptions, ReplyOut, TurnOut
from chat_api.services import Services
from memory.record.conversations import Owner
from memory.record.turns import get_turn, reply_turns

router = door_router(tags=["messages"])


@router.post(
    "/v1/conversations/{conversation_id}/messages",
    response_model=None,
    responses={200: {"description": "SSE stream (text/event-stream) or the finished reply (stream=false)"}},
)
async def post_message(
    conversation_id: uuid.UUID,
    body: MessageCreate,
    owner: OwnerDep,
    services: ServicesDep,
    admission: AdmissionDep,
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key", max_length=200)] = None,
) -> EventSourceResponse | ReplyOut:
    """Store the message and stream the reply (`turn.started` … `turn.completed|interrupted|failed`)."""
    check_text(body.content, field="content", max_chars=services.settings.max_message_chars)
    await check_prompt_room_off_loop(services.prompter, None, body.content, message_field="content")
    with admit(admission, owner, body) as admitted:
        accepted = await accept_message(
            services,
            owner,
            conversation_id,
            body.content,
            admitted=admitted,
            on_busy=body.on_busy or services.settings.on_busy_default,
            on_disconnect=body.on_disconnect,
            idempotency_key=idempotency_key,
            memory_scope=body.memory_scope or services.settings.memory_scope,
        )
    return await reply_response(services, owner, body, admitted, accepted)


def admit(admission: Admission, owner: Owner, options: ReplyOptions) -> AdmittedReply:
    """Admit the reply a request is about to start: 429 past a cap, before anything is stored."""
    return admission.admit_reply(owner, stream=options.stream)


async def reply_response(
    services: Services, owner: Owner, options: ReplyOptions, admitted: AdmittedReply, accepted: Accepted
) -> EventSourceResponse | ReplyOut:
    """The started reply as SSE (in the admitted stream slot), or awaited and whole (`stream: false`)."""
    if options.stream:
        stream = sse_stream(
            services, accepted.reply_id, 0, on_disconnect=options.on_disconnect, kind=ReplyKind.STARTED
        )
        return EventSourceResponse(admitted.stream(stream), headers=STREAM_HEADERS, ping=15)
    await wait_reply_done(services, accepted.reply_id, timeout=None)
    return await finished_reply(services, owner, accepted.reply_id, accepted.user_turn_id)


async def finished_reply(
    services: Services, owner: Owner, reply_id: uuid.UUID, user_turn_id: uuid.UUID
) -> ReplyOut:
    async with services.db.session() as session:
        user_turn = await get_turn(session, owner, user_turn_id)
        turns = await reply_turns(session, reply_id)
    status = next((t.status for t in reversed(turns) if t.role == "assistant"), "failed")
    return ReplyOut(status=status, user_turn=TurnOut.of(user_turn), turns=[TurnOut.of(t) for t in turns])
