"""The OpenAI Responses API (Open Responses) at `/openai/v1/responses`, beside chat completions.

- `POST /responses`: a response is a chatmem reply. Without `previous_response_id` or
  `conversation` the request is mapped onto a conversation exactly as a chat completion is
  (`conversations.py` beside it); with `previous_response_id` it continues that
  response's branch (a new branch when the branch has moved on since); with
  `conversation` it appends to that conversation. Streamed (the spec's semantic events
  with `sequence_number`), whole, or in the background.
- `GET /responses/{id}` (`?stream=true&starting_after=N` replays the events after N from
  the reply's log and follows live, on any replica), `DELETE /responses/{id}`,
  `GET /responses/{id}/input_items`, `POST /responses/{id}/cancel` (chatmem's stop).

A client closing a foreground stream (or a whole request) stops the reply: it ends
`interrupted_by_user` with what was sent, and reads `incomplete`. Background responses
run on whatever the client does; cancel stops them (`cancelled`). Errors before the
stream are OpenAI-shaped 4xx (`OpenAIRoute`); after it, an `error` event and
`response.failed`. `responses_request.py` reads requests and
`responses.py` translates the reply's events.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Annotated, Any, Literal

from fastapi import Query, Request, Response
from fastapi.responses import JSONResponse
from sqlalchemy.ext.asyncio import AsyncSession
from sse_starlette import EventSourceResponse
from starlette.requests import HTTPConnection

from chat_api.admission import Admission, AdmissionDep, AdmittedReply, door_router
from chat_api.deps import OwnerDep, ServicesDep, StopOwnerDep
from chat_api.protocols.openai.chat import ChatRequest, ClientMessage, OpenAIError
from chat_api.protocols.openai.conversations import (
    admit_history,
    choose_conversation,
    start_chat_reply,
)
from chat_api.protocols.openai.responses import ResponseEvent, ResponseTranslator
from chat_api.protocols.openai.responses_request import (
    ResponsesRequest,
    conversation_not_found,
    conversation_ref,
    parse_request,
    parse_response_id,
    response_ref,
)
from chat_api.protocols.openai.retries import start_or_answer_retry
from chat_api.protocols.openai.routes import (
    ON_DISCONNECT,
    OpenAIRoute,
    chat_target,
    fold_reply,
    idempotency_key,
    read_request,
    reply_head,
)
from chat_api.replies import OnDisconnect, ReplyKind, hung_up
from chat_api.response_headers import STREAM_HEADERS
from chat_api.services import Services
from memory.errors import InvalidInput, NotFound
from memory.events import Event, EventName, StopReason, TurnStatus
from memory.record.branches import conversation_branch, fork_branch, load_branch, newest_turn
from memory.record.conversations import Owner, get_conversation
from memory.record.imports import import_turns
from memory.record.reply_state import reply_state
from memory.record.responses import StoredResponse, delete_response, find_response, record_response
from memory.record.turns import get_turn, load_events, reply_turns
from memory.storage.models import Conversation, Turn

# isort: split
# The reply lifecycle's public seam, in this one block so that a move of those modules is one edit here.
from chat_api.replies import (
    Accepted,
    BeginReply,
    Started,
    answer_tool_results,
    follow_reply,
    stop_reply,
    store_message,
)

router = door_router(prefix="/openai/v1", tags=["openai"], route_class=OpenAIRoute)

STREAM_RESPONSE: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "a `response` object, or its semantic events as SSE (`event: <type>`, `data: {...}`)"
    }
}


@router.post("/responses", response_model=None, responses=STREAM_RESPONSE)
async def create_response(
    request: Request, owner: OwnerDep, services: ServicesDep, admission: AdmissionDep
) -> Response:
    """Answer with a chatmem reply (memory, the sanitized window, server tools); every turn stored."""
    asked = await read_request(await request.json(), services, parse_request, _chat_of)
    # Admitted before anything is stored, so a 429 leaves nothing behind.
    with admission.admit_reply(owner, stream=asked.chat.stream) as admitted:
        accepted, conversation_id, previous = await start_response(
            request, services, admission, owner, asked, admitted, key=idempotency_key(request)
        )
    if accepted.reattached and asked.store:
        # Sent again with its Idempotency-Key: the response as it was created (its created_at).
        translator = _translator(await _stored(services, owner, response_ref(accepted.reply_id)))
    else:
        translator = ResponseTranslator(
            response_base(accepted.reply_id, asked.echo, previous, asked.conversation_id),
            frozenset(tool["function"]["name"] for tool in asked.chat.tools),
        )
    if asked.background and not asked.chat.stream:
        translator.status = "queued"
        return JSONResponse(translator.response(), headers=_headers(conversation_id, accepted.reply_id))
    batches = follow_reply(services, accepted.reply_id, 0)
    head = await reply_head(batches)
    for event in head:
        if event.name == EventName.MEMORY_RETRIEVED:
            translator.feed(event)
    headers = _headers(conversation_id, accepted.reply_id, translator)
    if asked.chat.stream:
        # A background response goes on without its client, as the protocol says.
        on_disconnect: OnDisconnect = "continue" if asked.background else ON_DISCONNECT
        events = _sse(
            services,
            accepted.reply_id,
            translator,
            head,
            batches,
            on_disconnect=on_disconnect,
            kind=ReplyKind.STARTED,
        )
        return EventSourceResponse(
            admitted.stream(events), headers={**STREAM_HEADERS, **headers}, ping=15, sep="\n"
        )
    await fold_reply(
        request,
        services,
        accepted.reply_id,
        translator,
        head,
        batches,
        on_disconnect=ON_DISCONNECT,
        kind=ReplyKind.STARTED,
    )
    translator.end_of_log()
    return JSONResponse(translator.response(), headers=headers)


def _chat_of(asked: ResponsesRequest) -> ChatRequest:
    return asked.chat


async def start_response(
    connection: HTTPConnection,
    services: Services,
    admission: Admission,
    owner: Owner,
    asked: ResponsesRequest,
    admitted: AdmittedReply,
    known: Mapping[uuid.UUID, StoredResponse] | None = None,
    key: str | None = None,
) -> tuple[Accepted, uuid.UUID, uuid.UUID | None]:
    """Store what the request adds and start its reply (HTTP and WebSocket mode alike).

    `known`: responses this connection made, which `previous_response_id` may name even
    when they were not stored (`store: false` over one WebSocket). `key`: the request's
    Idempotency-Key (HTTP only: a WebSocket's headers are those of its whole session);
    sent again, the request reattaches to the reply it started. Returns the accepted
    reply, its conversation and the response it continues (if any).
    """
    chat = asked.chat
    previous: StoredResponse | None = None
    if asked.previous_response_id is not None:
        previous = (known or {}).get(asked.previous_response_id)
        if previous is None:
            previous = await previous_response(services, owner, asked.previous_response_id)
        conversation_id = previous.conversation_id
        begin = _continue(services, admission, owner, asked, after_response(previous), key)
    elif asked.compacted is not None:
        async with services.db.session() as session:
            conversation_id = (
                await get_turn(session, owner, asked.compacted)
            ).conversation_id  # 404 unless theirs
        begin = _continue(services, admission, owner, asked, after_turn(owner, asked.compacted), key)
    elif asked.conversation_id is not None:
        conversation_id = asked.conversation_id
        try:
            async with services.db.session() as session:
                await get_conversation(session, owner, conversation_id)  # 404 unless the caller's
        except NotFound:
            raise conversation_not_found(conversation_ref(conversation_id)) from None
        begin = _continue(services, admission, owner, asked, None, key)
    else:
        # Mapped exactly as a chat completion is (its admission of imported history included).
        explicit, chat_key = chat_target(connection, chat)
        target = await choose_conversation(
            services, owner, chat, conversation_id=explicit, chat_key=chat_key, idempotency_key=key
        )
        conversation_id, accepted = await start_chat_reply(
            services,
            admission,
            owner,
            chat,
            target,
            admitted=admitted,
            memory_scope=services.settings.memory_scope,
            recorded=lambda begin: _recorded(owner, asked, begin),
            idempotency_key=key,
        )
        return accepted, conversation_id, None
    accepted = await start_or_answer_retry(
        services,
        owner,
        conversation_id,
        begin,
        chat,
        admitted=admitted,
        on_busy="reject",
        parked_gives_way=True,  # new input replaces a reply that waits for an approval
        idempotency_key=key,
        memory_scope=services.settings.memory_scope,
        recorded=lambda begin: _recorded(owner, asked, begin),
    )
    return accepted, conversation_id, previous.id if previous is not None else None


async def previous_response(services: Services, owner: Owner, reply_id: uuid.UUID) -> StoredResponse:
    try:
        async with services.db.session() as session:
            return await find_response(session, owner, reply_id)
    except NotFound:
        raise OpenAIError(
            404,
            f"Previous response with id '{response_ref(reply_id)}' not found.",
            param="previous_response_id",
            code="previous_response_not_found",
        ) from None


def _recorded(owner: Owner, asked: ResponsesRequest, begin: BeginReply) -> BeginReply:
    """`begin`, then the attachments and (with `store`) the response row, in the same transaction."""

    async def recorded(session: AsyncSession, conversation: Conversation, reply_id: uuid.UUID) -> Started:
        user_turn, text = await begin(session, conversation, reply_id)
        if asked.attachments and asked.chat.prompt is not None:
            user_turn.meta = {**(user_turn.meta or {}), "attachments": list(asked.attachments)}
        if asked.store:
            await record_response(
                session,
                owner,
                reply_id=reply_id,
                conversation_id=conversation.id,
                previous_response_id=asked.previous_response_id,
                request={**asked.echo, "conversation": asked.conversation_id is not None},
                input_items_json=asked.input_items_json,
            )
        return user_turn, text

    return recorded


# Where a continuation starts: the last turn of what it continues, read under the conversation's lock.
LastTurn = Callable[[AsyncSession], Awaitable[Turn]]


def after_response(previous: StoredResponse) -> LastTurn:
    async def last_turn(session: AsyncSession) -> Turn:
        turns = await reply_turns(session, previous.id)
        if not turns or any(turn.status == TurnStatus.STREAMING for turn in turns):
            raise InvalidInput("the previous response has not finished", field="previous_response_id")
        return turns[-1]

    return last_turn


def after_turn(owner: Owner, turn_id: uuid.UUID) -> LastTurn:
    async def last_turn(session: AsyncSession) -> Turn:
        return await get_turn(session, owner, turn_id)

    return last_turn


async def continue_after(session: AsyncSession, conversation: Conversation, last: Turn) -> None:
    """Make the active branch end at `last`: as it is when `last` is its newest turn, else a new branch."""
    newest = await newest_turn(session, await conversation_branch(session, conversation))
    if newest is None or newest.id != last.id:
        parent = await load_branch(session, last.branch_id)
        await fork_branch(session, conversation, parent=parent, fork_seq=last.seq)


def import_rows(messages: Sequence[ClientMessage]) -> tuple[list[dict[str, Any]], list[int | None]]:
    """The messages a client has and chatmem has not, as import rows (user and assistant text),
    and the client's index of each."""
    kept = [m for m in messages if m.role in ("user", "assistant") and m.text.strip()]
    return [{"role": m.role, "content": m.text} for m in kept], [m.index for m in kept]


async def import_history(
    admission: Admission,
    session: AsyncSession,
    owner: Owner,
    conversation: Conversation,
    messages: Sequence[ClientMessage],
) -> None:
    """Store those messages as turns, within the import admission (refused before anything is stored)."""
    rows, indices = import_rows(messages)
    if rows:
        with await admit_history(admission, owner, rows, indices, param="input") as imported:
            result = await import_turns(session, owner, conversation.id, imported.turns)
            imported.settle(result.created)


def _continue(
    services: Services,
    admission: Admission,
    owner: Owner,
    asked: ResponsesRequest,
    after: LastTurn | None,
    key: str | None,
) -> BeginReply:
    """Add the input after a turn (a new branch if its branch moved on), or after the active branch."""
    chat = asked.chat

    async def begin(session: AsyncSession, conversation: Conversation, reply_id: uuid.UUID) -> Started:
        if after is not None:
            await continue_after(session, conversation, await after(session))
        if chat.tool_results:
            return await answer_tool_results(
                services, session, conversation, reply_id, chat.tool_answers, idempotency_key=key
            )
        await import_history(admission, session, owner, conversation, chat.history)
        return await store_message(services, session, conversation, reply_id, chat.prompt or "", key)

    return begin


def response_base(
    reply_id: uuid.UUID, echo: dict[str, Any], previous: uuid.UUID | None, conversation: uuid.UUID | None
) -> dict[str, Any]:
    """The response object's fields that never change: id, creation time, the request echoed."""
    base = {
        "id": response_ref(reply_id),
        "object": "response",
        "previous_response_id": response_ref(previous) if previous is not None else None,
        **echo,
    }
    if conversation is not None:
        base["conversation"] = {"id": conversation_ref(conversation)}
    return base


def _headers(
    conversation_id: uuid.UUID, reply_id: uuid.UUID, translator: ResponseTranslator | None = None
) -> dict[str, str]:
    memories = translator.memories if translator is not None else []
    return {
        "X-Chatmem-Conversation-Id": str(conversation_id),
        "X-Chatmem-Reply-Id": str(reply_id),
        "X-Chatmem-Memory-Count": str(len(memories)),
        "X-Chatmem-Memory-Turn-Ids": ",".join(str(m.get("turn_id")) for m in memories),
    }


def _frames(events: list[ResponseEvent], after: int) -> bytes:
    """SSE frames (`event:` and `data:` lines, `\\n` line ends) of the events numbered after `after`."""
    return b"".join(
        f"event: {e['type']}\ndata: {json.dumps(e, ensure_ascii=False)}\n\n".encode()
        for e in events
        if e["sequence_number"] > after
    )


async def _sse(
    services: Services,
    reply_id: uuid.UUID,
    translator: ResponseTranslator,
    head: list[Event],
    batches: AsyncIterator[list[Event]],
    *,
    on_disconnect: OnDisconnect,
    kind: ReplyKind,
    after: int = -1,
) -> AsyncIterator[bytes]:
    """The reply as Responses events after `after`; a client leaving early is `hang_up.hung_up`.

    The ending is always sent whole, numbered as stored: the terminal event, and a failure's
    `error` event with it, as a live stream sends them. A process that crashed lost the events
    after its last checkpoint, which the client may have seen, and the reaper stored the ending
    with lower numbers than the client's last: a client resuming at or past the ending, or
    between its `error` and terminal events, would otherwise get an empty stream, or the
    terminal event without the `error` event its SDK raises on.
    """

    def frames(events: list[ResponseEvent]) -> bytes:
        if not translator.ended:
            return _frames(events, after)
        ending = 2 if len(events) > 1 and events[-2]["type"] == "error" else 1
        return _frames(events[:-ending], after) + _frames(events[-ending:], -1)

    try:
        events = translator.opening() + [e for event in head for e in translator.feed(event)]
        yield frames(events)
        if translator.ended:
            return
        async for batch in batches:
            out = frames([e for event in batch for e in translator.feed(event)])
            if out:
                yield out
            if translator.ended:
                return
        yield frames(translator.end_of_log())
    finally:
        if not translator.ended:
            hung_up(services, reply_id, on_disconnect, kind)
        aclose = getattr(batches, "aclose", None)
        if aclose is not None:
            await aclose()


# --- reading, resuming, deleting, cancelling ----------------------------------------------


def _reply_of(value: str) -> uuid.UUID:
    found = parse_response_id(value)
    if found is None:
        raise OpenAIError(
            404, f"Response with id '{value}' not found.", param="response_id", code="not_found"
        )
    return found


async def _stored(services: Services, owner: Owner, value: str) -> StoredResponse:
    reply_id = _reply_of(value)
    try:
        async with services.db.session() as session:
            return await find_response(session, owner, reply_id)
    except NotFound:
        raise OpenAIError(
            404, f"Response with id '{value}' not found.", param="response_id", code="not_found"
        ) from None


def _translator(stored: StoredResponse) -> ResponseTranslator:
    request = dict(stored.request)
    conversation = stored.conversation_id if request.pop("conversation", False) else None
    tools = frozenset(str(tool.get("name")) for tool in request.get("tools") or [])
    request.setdefault("created_at", int(stored.created_at.timestamp()))
    base = response_base(stored.id, request, stored.previous_response_id, conversation)
    return ResponseTranslator(base, tools)


async def _as_it_stands(services: Services, stored: StoredResponse) -> ResponseTranslator:
    """The response folded from the reply's log as far as it goes now (live here, or stored)."""
    translator = _translator(stored)
    live = services.registry.get(stored.id)
    async with services.db.session() as session:
        if live is not None:
            events, running = list(live.events), True
        else:
            events = await load_events(session, stored.id, 0)
            running = await reply_state(session, stored.id) == TurnStatus.STREAMING
        ended_at = [t.completed_at for t in await reply_turns(session, stored.id) if t.completed_at]
    for event in events:
        translator.feed(event)
    if not running:
        translator.completed_at = int(max(ended_at).timestamp()) if ended_at else None
        translator.end_of_log()  # a log that ends parked (awaiting approval) ends here
    return translator


@router.get("/responses/{response_id}", response_model=None, responses=STREAM_RESPONSE)
async def get_response(
    response_id: str,
    owner: OwnerDep,
    services: ServicesDep,
    admission: AdmissionDep,
    stream: bool = False,
    starting_after: Annotated[int, Query(ge=-1)] = -1,
) -> Response:
    """The response as it stands; with `stream=true`, its events after `starting_after`, then live."""
    stored = await _stored(services, owner, response_id)
    if not stream:
        translator = await _as_it_stands(services, stored)
        return JSONResponse(
            translator.response(), headers=_headers(stored.conversation_id, stored.id, translator)
        )
    slot = admission.admit_stream(owner)
    events = _sse(
        services,
        stored.id,
        _translator(stored),
        [],
        follow_reply(services, stored.id, 0),
        on_disconnect="continue",
        kind=ReplyKind.FOLLOWED,
        after=starting_after,
    )
    return EventSourceResponse(
        slot.hold(events),
        headers={**STREAM_HEADERS, **_headers(stored.conversation_id, stored.id)},
        ping=15,
        sep="\n",
    )


@router.delete("/responses/{response_id}")
async def delete(response_id: str, owner: OwnerDep, services: ServicesDep) -> dict[str, Any]:
    """Forget the response (404 from then on); the conversation's turns stay."""
    stored = await _stored(services, owner, response_id)
    async with services.db.transaction() as session:
        await delete_response(session, owner, stored.id)
    return {"id": response_id_of(stored), "object": "response", "deleted": True}


def response_id_of(stored: StoredResponse) -> str:
    return response_ref(stored.id)


@router.post("/responses/{response_id}/cancel")
async def cancel(response_id: str, owner: StopOwnerDep, services: ServicesDep) -> JSONResponse:
    """Stop a background response wherever it runs (chatmem's stop); it then reads `cancelled`."""
    stored = await _stored(services, owner, response_id)
    if not stored.request.get("background"):
        raise OpenAIError(400, "Only background responses can be cancelled.", param="response_id")
    await stop_reply(services, stored.id, reason=StopReason.USER)
    translator = await _as_it_stands(services, stored)
    return JSONResponse(
        translator.response(), headers=_headers(stored.conversation_id, stored.id, translator)
    )


@router.get("/responses/{response_id}/input_items")
async def input_items(
    response_id: str,
    owner: OwnerDep,
    services: ServicesDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> dict[str, Any]:
    """The items this response was sent as input (newest first by default), paged by `after`."""
    stored = await _stored(services, owner, response_id)
    items = list(stored.input_items)
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item.get("id") for item in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0].get("id") if page else None,
        "last_id": page[-1].get("id") if page else None,
        "has_more": len(items) > limit,
    }
