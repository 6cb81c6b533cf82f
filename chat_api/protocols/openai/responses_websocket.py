"""The Responses API's WebSocket mode: `response.create` messages on one connection at `…/responses`.

Each `{"type": "response.create", ...}` message is a `POST /responses` with `stream: true`
(`stream` and `background` are refused, as the specification says), answered with the
same events, as JSON text messages, one response after another. The connection keeps the
responses it made, so `previous_response_id` can name a `store: false` response made on
it; a stored response is found as over HTTP. A failed continuation forgets the response
it named, so naming it again is `previous_response_not_found`. Failures are error
envelopes, `{"type": "error", "status", "error": {"type", "code", "message", "param"}}`,
and the connection stays open (a binary message too). A handshake without a valid
credential, or over its rate limit, is refused as the HTTP door answers: 401, or 429 with
Retry-After. A connection is a stream held open: it holds one of its user's stream slots
(MAX_STREAMS_PER_USER) for its life (429 at the handshake past the cap), and its responses
stream in it without taking another. Closing the connection while a response streams is a
stop, like closing a foreground stream. The server closes a connection at its time limit
(RESPONSES_WEBSOCKET_SECONDS, OpenAI's 60 minutes), idle or not, with the specification's
`websocket_connection_limit_reached` envelope; a response streaming then ends first.

At a deploy's SIGTERM (chat_api/replies/drain.py) the connection stays open through the
drain: its response ends as a stream's would (completed, or `error` and `response.failed`
with `server_shutdown`), a `response.create` meanwhile is refused with an error envelope
(503, `shutting_down`), and once the drain is over the connection is closed with 1001
(going away), after any response's ending has been sent.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from enum import Enum
from typing import Any

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse

from chat_api.admission import parse_json, pass_door
from chat_api.auth import AuthError
from chat_api.errors import RateLimited
from chat_api.protocols.openai.chat import ChatRequest, OpenAIError
from chat_api.protocols.openai.responses import ResponseEvent, ResponseTranslator
from chat_api.protocols.openai.responses_request import ResponsesRequest, parse_request
from chat_api.protocols.openai.responses_routes import response_base, start_response
from chat_api.protocols.openai.routes import ON_DISCONNECT, openai_error, read_request
from chat_api.services import Services
from memory.config import HttpSettings
from memory.record.conversations import Owner
from memory.record.responses import StoredResponse

# isort: split
from chat_api.replies import ReplyKind, follow_reply, hung_up

router = APIRouter(prefix="/openai/v1", tags=["openai"])

# The close code once a shutdown's drain is over: the server is going away (RFC 6455 7.4.1).
GOING_AWAY = 1001


def _envelope(error: OpenAIError) -> dict[str, Any]:
    return {
        "type": "error",
        "status": error.status,
        "error": {
            "type": error.type,
            "code": error.code or "invalid_request",
            "message": error.message,
            "param": error.param,
        },
    }


@router.websocket("/responses")
async def responses_socket(websocket: WebSocket) -> None:
    """One WebSocket-mode connection: each `response.create` streams its response's events."""
    services: Services = websocket.app.state.services
    try:
        # The one door, as for every route (the connection's headers carry the credential).
        owner = (await pass_door(services, websocket.scope)).owner
        # A connection held open is a stream, as a follower's SSE or a GET /mcp: it holds a
        # stream slot for its life, and its responses stream in it without taking another.
        slot = services.admission.admit_stream(owner)
    except (AuthError, RateLimited) as exc:
        await _refuse(websocket, exc)
        return
    try:
        await _connection(websocket, services, owner)
    finally:
        slot.release()


class _Ended(Enum):
    """Why no message came: the connection's time limit passed, or a shutdown's drain is over."""

    TIME_LIMIT = "time_limit"
    DRAINED = "drained"


async def _connection(websocket: WebSocket, services: Services, owner: Owner) -> None:
    """The accepted connection's `response.create` messages, one after another, until it closes."""
    await websocket.accept()
    limit_seconds = services.settings.responses_websocket_seconds
    deadline = asyncio.get_running_loop().time() + limit_seconds
    known: dict[uuid.UUID, StoredResponse] = {}
    try:
        while True:
            text = await _next_message(websocket, services, deadline)
            if text is _Ended.DRAINED:
                break
            if not isinstance(text, str) or asyncio.get_running_loop().time() >= deadline:
                limit = OpenAIError(
                    400,
                    f"this connection has reached its limit of {limit_seconds:g} seconds; open a new one",
                    code="websocket_connection_limit_reached",
                )
                await websocket.send_json(_envelope(limit))
                await websocket.close()
                return
            try:
                # Each message passes the door again, as a request would: a key revoked (or a
                # token expired) since the connection opened stops working at once.
                owner = (await pass_door(services, websocket.scope)).owner
            except (AuthError, RateLimited) as exc:
                refused = openai_error(exc)
                assert refused is not None
                await websocket.send_json(_envelope(refused))
                if isinstance(exc, AuthError):
                    await websocket.close(code=1008)
                    return
                continue
            await _turn(websocket, services, owner, text, known)
    except WebSocketDisconnect:
        return
    await websocket.close(code=GOING_AWAY, reason="the server is shutting down")


async def _refuse(websocket: WebSocket, exc: AuthError | RateLimited) -> None:
    """Refuse the handshake as the HTTP door answers: OpenAI's error body, 401 (or 429 with
    Retry-After). A server without the denial-response extension can only close it (1008)."""
    refused = openai_error(exc)
    assert refused is not None
    if "websocket.http.response" not in websocket.scope.get("extensions", {}):
        await websocket.close(code=1008)
        return
    await websocket.send_denial_response(
        JSONResponse(refused.body(), status_code=refused.status, headers=refused.headers)
    )


async def _receive(websocket: WebSocket) -> str:
    """The next text message; a binary one is refused with an envelope (the connection stays open)."""
    while True:
        message = await websocket.receive()
        if message["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(message.get("code", 1000), message.get("reason"))
        if message.get("text") is not None:
            return str(message["text"])
        binary = OpenAIError(
            400, "send each response.create as a text message of JSON", code="invalid_request"
        )
        await websocket.send_json(_envelope(binary))


async def _next_message(websocket: WebSocket, services: Services, deadline: float) -> str | _Ended:
    """The client's next message; or why none will be read: the connection's deadline (loop
    time) passed, or a shutdown's drain is over (every reply of this process ended, and this
    connection's response, if any, sent to its end)."""
    receiving = asyncio.ensure_future(_receive(websocket))
    drained = asyncio.ensure_future(services.drain.over())
    timeout = max(0.0, deadline - asyncio.get_running_loop().time())
    try:
        await asyncio.wait([receiving, drained], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        drained.cancel()
        if not receiving.done():
            receiving.cancel()
    if receiving.done() and not receiving.cancelled():
        return receiving.result()
    return _Ended.DRAINED if drained.done() and not drained.cancelled() else _Ended.TIME_LIMIT


async def _turn(
    websocket: WebSocket, services: Services, owner: Owner, text: str, known: dict[uuid.UUID, StoredResponse]
) -> None:
    """One `response.create`: refused with an envelope, or its events until the response ends."""
    named: uuid.UUID | None = None
    try:
        message = await _message(text, services.settings)

        def chat_of(asked: ResponsesRequest) -> ChatRequest:
            nonlocal named
            named = asked.previous_response_id  # read, so its texts failing forgets it as well
            return asked.chat

        asked = await read_request({**message, "stream": True}, services, parse_request, chat_of)
        admitted = services.admission.admit_reply(owner, stream=False)  # the connection's slot
        with admitted:
            accepted, conversation_id, previous = await start_response(
                websocket, services, services.admission, owner, asked, admitted, known
            )
    except Exception as exc:
        error = openai_error(exc)
        if error is None:
            raise
        if named is not None:
            known.pop(named, None)  # a failed continuation forgets the response it named
        await websocket.send_json(_envelope(error))
        return
    translator = ResponseTranslator(
        response_base(accepted.reply_id, asked.echo, previous, asked.conversation_id),
        frozenset(tool["function"]["name"] for tool in asked.chat.tools),
    )
    known[accepted.reply_id] = StoredResponse(
        id=accepted.reply_id,
        conversation_id=conversation_id,
        previous_response_id=previous,
        request=asked.echo,
        input_items=[],
        created_at=datetime.now(UTC),
    )
    try:
        async for event in _events(services, accepted.reply_id, translator):
            await websocket.send_text(json.dumps(event, ensure_ascii=False))
    finally:
        if not translator.ended:
            hung_up(services, accepted.reply_id, ON_DISCONNECT, ReplyKind.STARTED)
    if translator.status == "failed" and named is not None:
        known.pop(named, None)


async def _message(text: str, settings: HttpSettings) -> dict[str, Any]:
    """A `response.create` message as a create body: read by the door's strict JSON decoder."""
    raw, max_bytes = text.encode(), settings.max_body_bytes
    if len(raw) > max_bytes:
        raise OpenAIError(413, f"a message may hold at most {max_bytes} bytes", code="request_too_large")
    message = await parse_json(raw, max_values=settings.max_body_values)
    if not isinstance(message, dict) or message.get("type") != "response.create":
        raise OpenAIError(400, 'send {"type": "response.create", ...}', param="type")
    for field in ("stream", "background"):
        if field in message:
            raise OpenAIError(400, f"`{field}` is not sent in WebSocket mode", param=field)
    return {key: value for key, value in message.items() if key != "type"}


async def _events(
    services: Services, reply_id: uuid.UUID, translator: ResponseTranslator
) -> AsyncIterator[ResponseEvent]:
    for event in translator.opening():
        yield event
    batches = follow_reply(services, reply_id, 0)
    try:
        async for batch in batches:
            for chatmem_event in batch:
                for event in translator.feed(chatmem_event):
                    yield event
            if translator.ended:
                return
        for event in translator.end_of_log():
            yield event
    finally:
        aclose = getattr(batches, "aclose", None)
        if aclose is not None:
            await aclose()
