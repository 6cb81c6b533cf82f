"""The Vercel AI SDK's chat endpoints: what `DefaultChatTransport` and `useChat` call.

- `POST /v1/ai-sdk/chat`: a new message, an edit, a regenerate, or approval responses,
  answered as a UI message stream (`chat_api/protocols/ai_sdk/stream.py` translates).
- `GET /v1/ai-sdk/chat/{id}/stream`: the streaming reply from its start (204: none).
- `POST /v1/ai-sdk/chat/{id}/stop`: stop it, once the ending is stored.
- `GET /v1/ai-sdk/chat/{id}/messages`: the active branch as `UIMessage[]`, the newest
  `limit` messages; the `X-Chatmem-Next-Cursor` header, when there are older ones, is the
  `cursor` that reads them (the body stays a plain `UIMessage[]` for `useChat`).

The stored history is the truth: of the `messages` the SDK sends, only the last one (and
the ids it names) is read. Everything that can be refused is refused before the stream
starts, in chatmem's error body; nothing is stored for a refused request.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Annotated, Any, Literal

from fastapi import Path, Query, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, SkipValidation
from sqlalchemy import Row
from sqlalchemy.ext.asyncio import AsyncSession

from chat_api.admission import (
    Admission,
    AdmissionDep,
    AdmittedReply,
    check_prompt_room_off_loop,
    check_text,
    checked,
    door_router,
)
from chat_api.admission.prompt_room import longest_field
from chat_api.deps import OwnerDep, ServicesDep, StopOwnerDep
from chat_api.protocols.ai_sdk.stream import (
    CLIENT_MESSAGE_ID,
    DONE,
    HEADERS,
    MEDIA_TYPE,
    ApprovalResponse,
    Chunk,
    UIMessageStream,
    approval_responses,
    encode,
    message_id_of,
    message_key,
    text_of,
    ui_messages,
)
from chat_api.services import Services
from memory.errors import InvalidInput, NotAwaitingApproval, NotFound, NotOnActiveBranch
from memory.events import ToolCallState, TurnStatus
from memory.record.ai_sdk_chats import (
    CHAT_ID,
    chat_conversation,
    find_chat,
    memory_payloads,
    remember_message_id,
    stop_of_chat,
)
from memory.record.approvals import Decision
from memory.record.branches import (
    NO_LIMIT,
    conversation_branch,
    decode_history_cursor,
    encode_history_cursor,
    fork_branch,
    history_newest_first,
    load_branch,
    message_rows_newest_first,
    newest_turn,
    on_lineage,
)
from memory.record.conversations import Owner
from memory.record.turns import get_turn
from memory.storage.models import Branch, Conversation, Turn

# isort: split
# The reply lifecycle's public seam (start, follow, stop and approve a reply), in this one
# block so that a move of those modules is one edit here.
from chat_api.replies import (
    Accepted,
    OnDisconnect,
    ReplyKind,
    Started,
    Stopped,
    accept_message,
    answer_again,
    decide,
    edit_message,
    follow_reply,
    hand_over,
    hung_up,
    reply_streaming,
    start_reply,
    stop_conversation,
)

router = door_router(prefix="/v1/ai-sdk/chat", tags=["ai-sdk"])

ChatId = Annotated[str, Path(min_length=1, max_length=128, pattern=CHAT_ID.pattern)]
# The `cursor` of a messages page's older messages: a header, so that the body stays `UIMessage[]`.
NEXT_CURSOR_HEADER = "X-Chatmem-Next-Cursor"
STREAM_RESPONSE: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "UI message stream v1 (SSE: `data: {chunk}` … `data: [DONE]`)",
        "content": {MEDIA_TYPE: {}},
    }
}


class UIMessageIn(BaseModel):
    """One message as the SDK sends it; only the last one's text, id and tool parts are read."""

    model_config = ConfigDict(extra="allow")

    id: str = Field(min_length=1, max_length=200)  # "" names no message (the AG-UI door refuses it too)
    role: Literal["system", "user", "assistant"]
    parts: list[dict[str, Any]]


class ChatRequest(BaseModel):
    """What `DefaultChatTransport` posts, plus chatmem's options (other extra keys are ignored)."""

    model_config = ConfigDict(extra="allow")

    id: str = Field(
        min_length=1, max_length=128, pattern=CHAT_ID.pattern, description="The client's chat id."
    )
    # Validated by `checked`, off the event loop: only the last messages are read.
    messages: SkipValidation[list[UIMessageIn]] = Field(min_length=1)
    trigger: Literal["submit-message", "regenerate-message"]
    messageId: str | None = Field(None, max_length=200)  # the SDK's name
    on_busy: Literal["reject", "interrupt", "enqueue"] | None = None
    on_disconnect: Literal["continue", "stop"] = Field(
        "continue", description="`stop`: a client that goes away (useChat's stop()) stops the reply."
    )
    memory_scope: Literal["user", "conversation", "none"] | None = None


@router.post("", response_model=None, responses=STREAM_RESPONSE)
async def chat(
    body: ChatRequest, owner: OwnerDep, services: ServicesDep, admission: AdmissionDep
) -> Response:
    """Answer the chat's last message (or edit, regenerate, or approve) as a UI message stream."""
    body = await checked(body, "messages")
    last = body.messages[-1]
    instructions = _instructions(body, services.settings.max_message_chars)
    if body.trigger == "regenerate-message":
        await _check_room(services, body, instructions, None)
        return await _regenerate(body, owner, services, admission, instructions)
    if last.role == "assistant":
        try:
            responses = approval_responses(last.model_dump())
        except ValueError as exc:
            raise InvalidInput(str(exc), field="messages") from exc
        if responses is None:
            raise InvalidInput(
                "the last message is an assistant message with no approval response", field="messages"
            )
        return await _approve(body, responses, owner, services, admission)
    if last.role != "user":
        raise InvalidInput("the last message must be the user's", field="messages")
    content = _text(last)
    check_text(content, field="messages", max_chars=services.settings.max_message_chars)
    await _check_room(services, body, instructions, content)
    if body.messageId is not None:
        if body.messageId != last.id:
            raise InvalidInput("messageId must name the last message (the one edited)", field="messageId")
        return await _edit(body, content, owner, services, admission, instructions)

    # Admitted before anything is stored (the chat's conversation included), so a 429 leaves nothing.
    with admission.admit_reply(owner, stream=True) as admitted:
        async with services.db.transaction() as session:
            conversation = await chat_conversation(session, owner, body.id)
        accepted = await accept_message(
            services,
            owner,
            conversation.id,
            content,
            admitted=admitted,
            on_busy=_on_busy(services, body),
            on_disconnect=body.on_disconnect,
            # Without a policy of its own, new input replaces a reply that waits for an approval.
            parked_gives_way=body.on_busy is None,
            # A retried request (same message id) reattaches to the reply it started.
            idempotency_key=f"ai-sdk:{last.id}",
            memory_scope=body.memory_scope or services.settings.memory_scope,
        )
        hand_over(services, accepted, instructions=instructions)
        await _remember_client_id(services, accepted, last.id)
    return _reply_stream(services, admitted, accepted, body)


def _text(message: UIMessageIn) -> str:
    """The message's text; a part that cannot be taken as text is a 422 (see ``text_of``)."""
    try:
        return text_of(message.model_dump())
    except ValueError as exc:
        raise InvalidInput(str(exc), field="messages") from exc


def _on_busy(services: Services, body: ChatRequest) -> str:
    """The client's `on_busy`, else the server's default (beside which a parked reply gives way)."""
    return body.on_busy or services.settings.on_busy_default


def _instructions(body: ChatRequest, max_chars: int) -> str | None:
    """The client's system messages: this reply's instructions, after chatmem's own system prompt."""
    instructions = "\n\n".join(text for _, text in _system_texts(body))
    if not instructions:
        return None
    check_text(instructions, field="messages", max_chars=max_chars)
    return instructions


def _system_texts(body: ChatRequest) -> list[tuple[str, str]]:
    """The (field, text) of each of the client's system messages that says something."""
    system = [(i, m) for i, m in enumerate(body.messages) if m.role == "system"]
    said = [(f"messages[{i}].parts", _text(m).strip()) for i, m in system]
    return [(field, text) for field, text in said if text]


async def _check_room(
    services: Services, body: ChatRequest, instructions: str | None, user_text: str | None
) -> None:
    """422 when the new message, or the system messages beside it, leave the reply no room."""
    await check_prompt_room_off_loop(
        services.prompter,
        instructions,
        user_text,
        instructions_field=longest_field(_system_texts(body), "messages"),
        message_field=f"messages[{len(body.messages) - 1}].parts",
    )


async def _edit(
    body: ChatRequest,
    content: str,
    owner: Owner,
    services: Services,
    admission: Admission,
    instructions: str | None,
) -> Response:
    """The client replaced an earlier user message (and cut what followed): chatmem's edit."""
    assert body.messageId is not None
    conversation = await _existing_chat(services, owner, body.id)
    async with services.db.session() as session:
        turn = await _user_turn_named(session, conversation, body.messageId)

    with admission.admit_reply(owner, stream=True) as admitted:
        accepted = await edit_message(
            services,
            owner,
            turn,
            content,
            admitted=admitted,
            conversation_id=conversation.id,
            on_busy=_on_busy(services, body),
            on_disconnect=body.on_disconnect,
            # Without a policy of its own, new input replaces a reply that waits for an approval.
            parked_gives_way=body.on_busy is None,
            idempotency_key=None,
            memory_scope=body.memory_scope or services.settings.memory_scope,
        )
        hand_over(services, accepted, instructions=instructions)
        await _remember_client_id(services, accepted, body.messageId)
    return _reply_stream(services, admitted, accepted, body)


async def _regenerate(
    body: ChatRequest, owner: Owner, services: Services, admission: Admission, instructions: str | None
) -> Response:
    """Answer again the user message before the named reply (default: the last reply)."""
    conversation = await _existing_chat(services, owner, body.id)
    target: uuid.UUID | None = None
    if body.messageId is not None:
        try:
            target = uuid.UUID(body.messageId)
        except ValueError as exc:
            raise NotFound("message not found", message_id=body.messageId) from exc
        async with services.db.session() as session:
            turn = await get_turn(session, owner, target)
        if turn.role != "assistant":
            raise InvalidInput("regenerate takes an assistant message", field="messageId")

    async def begin(session: AsyncSession, locked: Conversation, reply_id: uuid.UUID) -> Started:
        return await _begin_regenerate(services, owner, session, locked, reply_id, target)

    with admission.admit_reply(owner, stream=True) as admitted:
        accepted = await start_reply(
            services,
            owner,
            conversation.id,
            begin,
            admitted=admitted,
            on_busy=_on_busy(services, body),
            on_disconnect=body.on_disconnect,
            # Without a policy of its own, new input replaces a reply that waits for an approval.
            parked_gives_way=body.on_busy is None,
            idempotency_key=None,
            memory_scope=body.memory_scope or services.settings.memory_scope,
        )
        hand_over(services, accepted, instructions=instructions)
    return _reply_stream(services, admitted, accepted, body)


async def _begin_regenerate(
    services: Services,
    owner: Owner,
    session: AsyncSession,
    conversation: Conversation,
    reply_id: uuid.UUID,
    target: uuid.UUID | None,
) -> Started:
    """chatmem's regenerate, of any reply of the active branch: the SDK cuts everything after it.

    A new active branch forks just after the reply's user message, as for the last reply.
    """
    active = await conversation_branch(session, conversation)
    if target is None:
        turn = await newest_turn(session, active, role="assistant")
        if turn is None:
            raise InvalidInput("there is no reply to regenerate", field="messageId")
    else:
        turn = await get_turn(session, owner, target)  # re-read under the conversation's lock
        if not on_lineage(active, turn):
            raise NotOnActiveBranch(
                "the message is not on the chat's active branch",
                turn_id=str(turn.id),
                active_branch_id=str(active.id),
            )
    user_turn = await newest_turn(session, active, role="user", max_seq=turn.seq - 1)
    if user_turn is None:
        raise InvalidInput("the reply answers no user message", field="messageId")
    parent = await load_branch(session, user_turn.branch_id)
    await fork_branch(session, conversation, parent=parent, fork_seq=user_turn.seq)
    return await answer_again(services, session, conversation, reply_id, user_turn)


async def _approve(
    body: ChatRequest,
    responses: list[ApprovalResponse],
    owner: Owner,
    services: Services,
    admission: Admission,
) -> Response:
    """Record the client's approval responses; the last decision resumes the reply, streamed from there."""
    conversation = await _existing_chat(services, owner, body.id)
    # Every response is checked before any is recorded: a refused request decides nothing.
    async with services.db.session() as session:
        for response in responses:
            turn = await get_turn(session, owner, response.turn_id)
            if turn.conversation_id != conversation.id:
                raise NotFound("tool call not found in this chat", call_id=response.call_id)
            call = next((c for c in turn.tool_calls or [] if c.get("id") == response.call_id), None)
            if call is None:
                raise NotFound("tool call not found in this chat", call_id=response.call_id)
            if (
                turn.status != TurnStatus.AWAITING_APPROVAL
                or call.get("state") != ToolCallState.AWAITING_APPROVAL
            ):
                raise NotAwaitingApproval(
                    "this tool call is not waiting for approval",
                    turn_id=str(turn.id),
                    call_id=response.call_id,
                    turn_status=turn.status,
                    call_state=call.get("state"),
                )
    # Admitted before any decision is stored: the last one resumes the reply.
    with admission.admit_reply(owner, stream=True) as admitted:
        first = None
        for response in responses:
            decision = Decision(approved=response.approved, by="user", reason=response.reason)
            decided = await decide(
                services, owner, response.turn_id, response.call_id, decision, admitted=admitted
            )
            first = first or decided
        assert first is not None
    stream = UIMessageStream(continuing=True)
    prefix = stream.start(str(first.reply_id))
    events = _ui_stream(
        services,
        first.reply_id,
        first.after,
        stream,
        prefix,
        on_disconnect=body.on_disconnect,
        kind=ReplyKind.RESUMED,
    )
    return StreamingResponse(admitted.stream(events), media_type=MEDIA_TYPE, headers=HEADERS)


async def _remember_client_id(services: Services, accepted: Accepted, client_message_id: str) -> None:
    """Store the client's id of the message on its user turn, so the chat's history names it so."""
    async with services.db.transaction() as session:
        await remember_message_id(session, accepted.user_turn_id, CLIENT_MESSAGE_ID, client_message_id)


def _reply_stream(
    services: Services, admitted: AdmittedReply, accepted: Accepted, body: ChatRequest
) -> Response:
    """The started reply as a UI message stream, held in the admitted stream slot."""
    events = _ui_stream(
        services,
        accepted.reply_id,
        0,
        UIMessageStream(),
        [],
        on_disconnect=body.on_disconnect,
        kind=ReplyKind.STARTED,
    )
    return StreamingResponse(admitted.stream(events), media_type=MEDIA_TYPE, headers=HEADERS)


async def _ui_stream(
    services: Services,
    reply_id: uuid.UUID,
    after: int,
    stream: UIMessageStream,
    prefix: list[Chunk],
    *,
    on_disconnect: OnDisconnect,
    kind: ReplyKind,
) -> AsyncIterator[bytes]:
    """The reply's events after `after` as UI message stream frames, one write per batch, then [DONE]."""
    ended = False
    try:
        if prefix:
            yield b"".join(encode(chunk) for chunk in prefix)
        async for batch in follow_reply(services, reply_id, after):
            chunks = [chunk for event in batch for chunk in stream.translate(event)]
            if chunks:
                yield b"".join(encode(chunk) for chunk in chunks)
        ended = True
        yield b"".join(encode(chunk) for chunk in stream.end()) + DONE
    finally:
        if not ended:
            hung_up(services, reply_id, on_disconnect, kind)


@router.get(
    "/{chat_id}/stream",
    response_model=None,
    responses={**STREAM_RESPONSE, 204: {"description": "No reply is streaming in this chat"}},
)
async def resume(
    chat_id: ChatId, owner: OwnerDep, services: ServicesDep, admission: AdmissionDep
) -> Response:
    """The streaming reply's whole stream from its `start`, then live; 204 when none streams."""
    async with services.db.session() as session:
        conversation = await find_chat(session, owner, chat_id)
    reply_id = conversation.active_reply_id if conversation is not None else None
    if reply_id is None or not await reply_streaming(services, reply_id):
        return Response(status_code=204)
    slot = admission.admit_stream(owner)
    events = _ui_stream(
        services, reply_id, 0, UIMessageStream(), [], on_disconnect="continue", kind=ReplyKind.FOLLOWED
    )
    return StreamingResponse(slot.hold(events), media_type=MEDIA_TYPE, headers=HEADERS)


class StopResult(BaseModel):
    success: bool = Field(
        description="True once the reply's ending is stored (also when none was streaming)."
    )


@router.post(
    "/{chat_id}/stop",
    response_model=StopResult,
    responses={
        202: {
            "model": StopResult,
            "description": "Accepted, not confirmed: the reply's process did not confirm in time, or the "
            "chat id is one the caller has not used yet (the stop is kept for its first reply), or its "
            "conversation was deleted.",
        },
    },
)
async def stop(
    chat_id: ChatId,
    owner: StopOwnerDep,
    services: ServicesDep,
) -> StopResult | JSONResponse:
    """Stop the chat's streaming (or waiting) reply on whichever process runs it. Idempotent.

    Any body is accepted and not read (`{}`, or `{assistantMessage, activeStreamId}` as the
    SDK's docs show, with or without a JSON content type). The open stream ends with
    `abort`; its stored reply holds exactly what it carried. A chat with no running reply
    answers 200. 202 with `success: false` if the process running it did not confirm within
    STOP_WAIT_SECONDS, and for a chat id the caller has not used yet (the client picks it, so
    the stop may come before the chat's first message is served): the stop is kept for that
    chat's first reply for a short while, and the reply starts stopped (another user's chat
    id answers the same). A chat whose conversation was deleted answers the same too (nothing
    is kept for it): a stop never tells a deleted chat from one never used.
    """
    async with services.db.transaction() as session:
        conversation = await stop_of_chat(session, owner, chat_id, None)
    if conversation is None or await stop_conversation(services, conversation.id) is not Stopped.ENDED:
        return JSONResponse(StopResult(success=False).model_dump(), status_code=202)
    return StopResult(success=True)


@router.get(
    "/{chat_id}/messages",
    response_model=list[dict[str, Any]],
    responses={
        200: {
            "description": "`UIMessage[]`, oldest first",
            "headers": {
                NEXT_CURSOR_HEADER: {
                    "description": "The `cursor` of the older messages (absent: these start the chat).",
                    "schema": {"type": "string"},
                }
            },
        }
    },
)
async def messages(
    chat_id: ChatId,
    owner: OwnerDep,
    services: ServicesDep,
    response: Response,
    limit: int = Query(100, ge=1, le=500, description="Most messages in the page."),
    cursor: str | None = Query(
        None, max_length=512, description=f"`{NEXT_CURSOR_HEADER}` of the newer page."
    ),
) -> list[dict[str, Any]]:
    """The chat's active branch as `UIMessage[]` (empty for a chat id never used), a page at a
    time: the newest `limit` messages (before the cursor), oldest first, each whole (a reply is
    one message however many steps it took). `X-Chatmem-Next-Cursor`, when older messages
    exist, reads them: as `GET …/turns` pages with `next_cursor`, with the body left a plain
    `UIMessage[]` that `useChat({messages})` takes as it is."""
    below = decode_history_cursor(cursor) if cursor else NO_LIMIT
    async with services.db.session() as session:
        conversation = await find_chat(session, owner, chat_id)
        if conversation is None:
            return []
        branch = await conversation_branch(session, conversation)
        turns, first_seq = await _newest_messages(session, branch, limit=limit, below_seq=below)
        reply_ids = sorted({t.reply_id for t in turns if t.reply_id is not None and t.role != "user"})
        memories = await memory_payloads(session, reply_ids)
    if first_seq is not None:
        response.headers[NEXT_CURSOR_HEADER] = encode_history_cursor(first_seq)
    return ui_messages(turns, memories)


async def _newest_messages(
    session: AsyncSession, branch: Branch, *, limit: int, below_seq: int
) -> tuple[list[Row[Any]], int | None]:
    """The turns of the branch's newest `limit` UIMessages below `below_seq`, oldest first, and
    the seq to read the messages before them from (None: they start the history).

    Rows of the columns a message is made of, not Turn objects: reading a page of 500 messages
    as Turns took ~14 ms of the event loop's CPU (as rows ~4 ms), stalling every other stream."""
    turns: list[Row[Any]] = []
    last: tuple[str, uuid.UUID] | None = None
    count = 0
    # A message is whole once the turn before it (another message's) is read.
    async with aclosing(
        message_rows_newest_first(session, branch, page=2 * limit + 1, below_seq=below_seq)
    ) as history:
        async for turn in history:
            key = message_key(turn)
            if key != last:
                if count == limit:
                    turns.reverse()
                    return turns, turns[0].seq
                count, last = count + 1, key
            turns.append(turn)
    turns.reverse()
    return turns, None


async def _existing_chat(services: Services, owner: Owner, chat_id: str) -> Conversation:
    async with services.db.session() as session:
        conversation = await find_chat(session, owner, chat_id)
    if conversation is None:
        raise NotFound("chat not found", chat_id=chat_id)
    return conversation


async def _user_turn_named(session: AsyncSession, conversation: Conversation, message_id: str) -> Turn:
    """The active branch's user turn the client calls `message_id` (its own id, or the turn's)."""
    branch = await conversation_branch(session, conversation)
    async with aclosing(history_newest_first(session, branch)) as history:
        async for turn in history:
            if turn.role == "user" and message_id in (message_id_of(turn), str(turn.id)):
                return turn
    raise NotFound("message not found in this chat", message_id=message_id)
