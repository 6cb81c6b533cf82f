"""The OpenAI-compatible API at `/openai/v1`: `GET /models`, `POST /chat/completions`.

A client's `base_url` is `http(s)://HOST/openai/v1`; its API key is a chatmem API key
(`chatmem keys create`, `POST /v1/keys`) or a chatmem token. Every error is OpenAI's
shape (`{"error": {"message", "type", "param", "code"}}`) with the status OpenAI uses,
so the SDKs raise their usual exceptions. Closing the connection is the stop: the reply
ends `interrupted_by_user` with what was sent.

A request with an `Idempotency-Key` header (at most 200 characters) is done once: sent again
(the SDKs retry a dropped connection, a 408, 409, 429 or 5xx), it is answered from the reply
the first attempt started, streamed live or replayed from its log, on any replica. The SDKs
send no key unless the caller sets one (`extra_headers={"Idempotency-Key": ...}`, kept
across the SDK's own retries).

Response headers say what chatmem did: `X-Chatmem-Conversation-Id`, `X-Chatmem-Reply-Id`,
`X-Chatmem-Memory-Count` and `X-Chatmem-Memory-Turn-Ids` (the remembered turns the
prompt quoted). Streaming responses send them once the memories are known, before the
first token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, Protocol, TypeVar

from anyio import to_thread
from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse
from starlette.requests import HTTPConnection

from chat_api.admission import (
    AdmissionDep,
    DoorRoute,
    check_prompt_room,
    check_text,
    check_tools,
    door_router,
)
from chat_api.admission.body import BodyTooLarge
from chat_api.auth import AuthError
from chat_api.deps import OwnerDep, ServicesDep
from chat_api.errors import Forbidden, RateLimited, ShuttingDown
from chat_api.protocols.openai.chat import (
    DONE,
    REQUEST_SCHEMA,
    ChatRequest,
    Event,
    OpenAIError,
    ReplyTranslator,
    Served,
    model_entry,
    models_list,
    parse_request,
    sse_data,
)
from chat_api.protocols.openai.conversations import choose_conversation, start_chat_reply
from chat_api.replies import OnDisconnect, ReplyKind, follow_reply, hung_up
from chat_api.response_headers import STREAM_HEADERS
from chat_api.services import Services
from memory.errors import Conflict, DomainError, InvalidInput, NotFound
from memory.events import TERMINAL_NAMES, EventName, TurnStatus

log = logging.getLogger(__name__)

Asked = TypeVar("Asked")

CONVERSATION_HEADER = "x-chatmem-conversation-id"
CHAT_KEY_HEADERS = ("x-chatmem-chat-key", "x-openwebui-chat-id")
IDEMPOTENCY_HEADER = "idempotency-key"
# The OpenAI protocols have no such option: a client that leaves a streamed answer means it
# stopped (the SDKs' abort). A retry with the Idempotency-Key is the same request again.
ON_DISCONNECT: OnDisconnect = "stop"
MAX_IDEMPOTENCY_KEY_CHARS = 200  # as on chatmem's own routes
# Events after which the response's headers can say which memories the reply uses.
HEAD_EVENTS = (
    frozenset(
        {EventName.MEMORY_RETRIEVED, EventName.MESSAGE_DELTA, EventName.TOOL_CALL_DELTA, EventName.ERROR}
    )
    | TERMINAL_NAMES
)


def openai_error(exc: Exception) -> OpenAIError | None:
    """The OpenAI-shaped form of an error raised by a route or its dependencies (None: not ours)."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, AuthError):
        return OpenAIError(401, str(exc), code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    if isinstance(exc, Forbidden):
        return OpenAIError(403, str(exc), type="permission_error", code=exc.code)
    if isinstance(exc, ShuttingDown):  # the openai SDKs retry a 503 after Retry-After
        return OpenAIError(
            503, str(exc), type="server_error", code=exc.code, headers={"Retry-After": str(exc.retry_after)}
        )
    if isinstance(exc, RateLimited):
        return OpenAIError(
            429,
            str(exc),
            type="requests",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(exc.retry_after)},
        )
    if isinstance(exc, BodyTooLarge):  # a body with no Content-Length, past the limit as it arrived
        return OpenAIError(413, exc.detail, code="payload_too_large")
    if isinstance(exc, RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return OpenAIError(400, "We could not parse the JSON body of your request.")
        param = ".".join(str(p) for p in first.get("loc", ()))
        return OpenAIError(400, f"{param}: {first.get('msg', 'invalid')}", param=param or None)
    if isinstance(exc, NotFound):
        return OpenAIError(404, exc.message, code=exc.code)
    if isinstance(exc, InvalidInput):
        field = exc.details.get("field")
        return OpenAIError(400, exc.message, param=str(field) if field else None, code=exc.code)
    if isinstance(exc, Conflict):
        return OpenAIError(409, exc.message, code=exc.code)
    if isinstance(exc, DomainError):
        return OpenAIError(400, exc.message, code=exc.code)
    return None


class OpenAIRoute(DoorRoute):
    """A route behind the door whose every error (the door's, the route's, a bug's) is in OpenAI's shape."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def run(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as exc:
                error = openai_error(exc)
                if error is None:
                    log.exception("%s %s failed", request.method, request.url.path)
                    error = OpenAIError(500, "internal server error", type="server_error")
                return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

        return run


router = door_router(prefix="/openai/v1", tags=["openai"], route_class=OpenAIRoute)


def served_models(services: Services) -> list[str]:
    """The models a request may name: the one this process runs (the demo model when it runs)."""
    return [services.provider.model]


@router.get("/models")
async def list_models(_owner: OwnerDep, services: ServicesDep) -> dict[str, Any]:
    """The models this server answers with, in OpenAI's format."""
    return models_list(served_models(services), int(time.time()))


@router.get("/models/{model_id}")
async def get_model(model_id: str, _owner: OwnerDep, services: ServicesDep) -> dict[str, Any]:
    """One served model, or 404 `model_not_found`."""
    if model_id not in served_models(services):
        raise OpenAIError(
            404, f"The model `{model_id}` does not exist", param="model", code="model_not_found"
        )
    return model_entry(model_id, int(time.time()))


@router.post(
    "/chat/completions",
    response_model=None,
    openapi_extra={
        "requestBody": {"required": True, "content": {"application/json": {"schema": REQUEST_SCHEMA}}}
    },
    responses={
        200: {"description": "chat.completion, or chat.completion.chunk SSE ending `data: [DONE]`"},
        400: {"description": "OpenAI's error object: {error: {message, type, param, code}}"},
    },
)
async def chat_completions(
    request: Request, owner: OwnerDep, services: ServicesDep, admission: AdmissionDep
) -> Response:
    """Answer with chatmem's reply: memory, the sanitized window, server tools; every turn stored."""
    chat = await read_request(await request.json(), services, parse_request, _itself)
    conversation_id, chat_key = chat_target(request, chat)
    key = idempotency_key(request)
    # Admitted before anything is stored, so a 429 leaves nothing behind.
    with admission.admit_reply(owner, stream=chat.stream) as admitted:
        target = await choose_conversation(
            services, owner, chat, conversation_id=conversation_id, chat_key=chat_key, idempotency_key=key
        )
        conversation, accepted = await start_chat_reply(
            services,
            admission,
            owner,
            chat,
            target,
            admitted=admitted,
            memory_scope=services.settings.memory_scope,
            idempotency_key=key,
        )
    translator = ReplyTranslator(
        f"chatcmpl-{accepted.reply_id.hex}",
        services.provider.model,
        chat.tool_names,
        include_usage=chat.include_usage,
    )
    batches = follow_reply(services, accepted.reply_id, 0)
    head = await reply_head(batches)
    for event in head:
        if event[1] == EventName.MEMORY_RETRIEVED:
            translator.feed(event)
    headers = {
        "X-Chatmem-Conversation-Id": str(conversation),
        "X-Chatmem-Reply-Id": str(accepted.reply_id),
        "X-Chatmem-Memory-Count": str(len(translator.memories)),
        "X-Chatmem-Memory-Turn-Ids": ",".join(str(m.get("turn_id")) for m in translator.memories),
    }
    if chat.stream:
        stream = _stream(services, accepted.reply_id, translator, head, batches)
        return EventSourceResponse(admitted.stream(stream), headers={**STREAM_HEADERS, **headers}, ping=15)
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
    # A reply that waits for a person's approval has not failed: answered as far as it goes (a 200,
    # as the Responses API's `incomplete`). A 5xx made the SDKs send it again, and each retry
    # interrupted the waiting reply, its approval cancelled.
    error = translator.error if translator.status != TurnStatus.AWAITING_APPROVAL else None
    if error is not None and not translator.text and not translator.calls:
        raise OpenAIError(
            500,
            error["message"],
            type="server_error",
            code=error.get("code"),
            headers=headers,
        )
    headers["X-Chatmem-Status"] = translator.status or TurnStatus.FAILED
    return JSONResponse(translator.completion(), headers=headers)


async def read_request(
    document: object,
    services: Services,
    parse: Callable[[object, Served], Asked],
    chat_of: Callable[[Asked], ChatRequest] | None = None,
) -> Asked:
    """A door's request read from its JSON body (`parse`: the protocol's reader) and the texts of
    its chat-completions form (`chat_of`, when it has one) checked, in a worker thread: a body may
    hold a history of megabytes, and reading it on the event loop would hold up every other
    stream of the process. Every OpenAI door that takes a history (chat completions; Responses
    create over HTTP and WebSocket, compact) reads here."""
    served = Served(served_models(services), services.settings.max_output_tokens)
    max_chars = services.settings.max_message_chars

    def read() -> Asked:
        asked = parse(document, served)
        if chat_of is not None:
            chat = chat_of(asked)
            check_texts(chat, max_chars)
            check_prompt_room(
                services.prompter,
                chat.instructions,
                chat.prompt,
                instructions_field=chat.instructions_field,
                message_field=chat.param(chat.prompt_index),
            )
        return asked

    return await to_thread.run_sync(read)


def _itself(chat: ChatRequest) -> ChatRequest:
    return chat


def check_texts(chat: ChatRequest, max_chars: int) -> None:
    """Unstorable text, a prompt, a tool result or a tool definition over its limit: refused before
    anything is stored, naming the message as the client sent it (`messages[3].content`,
    `input[2].output`)."""
    if chat.prompt is not None:
        check_text(chat.prompt, field=chat.param(chat.prompt_index), max_chars=max_chars)
    if chat.instructions is not None:
        # Shown before every reply's history: held to what one message may hold.
        check_text(chat.instructions, field=chat.instructions_field, max_chars=max_chars)
    for message in chat.history:
        check_text(message.text, field=chat.param(message.index), allow_empty=True)
    # Stored as tool turns and shown to the model: held to what a message may hold, as on AG-UI.
    output = "output" if chat.messages_field == "input" else "content"
    for result in chat.tool_results:
        check_text(result.text, field=chat.param(result.index, output), allow_empty=True, max_chars=max_chars)
    check_tools(chat.tools)


def chat_target(request: HTTPConnection, chat: ChatRequest) -> tuple[uuid.UUID | None, str | None]:
    """(an explicit conversation id, a frontend's chat key): headers, then metadata, then `user`."""
    explicit = request.headers.get(CONVERSATION_HEADER) or chat.metadata.get("conversation_id")
    user = chat.user or ""
    if explicit is None and user.startswith("conversation:"):
        explicit = user.removeprefix("conversation:")
    if explicit is not None:
        try:
            return uuid.UUID(str(explicit)), None
        except ValueError:
            raise OpenAIError(
                404, "conversation not found", param="conversation_id", code="not_found"
            ) from None
    key = next((request.headers[h] for h in CHAT_KEY_HEADERS if request.headers.get(h)), None)
    if key is None and isinstance(chat.metadata.get("chat_key"), str):
        key = chat.metadata["chat_key"]
    if key is None and user.startswith("chat:"):
        key = user.removeprefix("chat:")
    return None, key


def idempotency_key(request: HTTPConnection) -> str | None:
    """The request's `Idempotency-Key` (None when absent or empty); over its bound a 400."""
    key = request.headers.get(IDEMPOTENCY_HEADER) or None
    if key is not None and len(key) > MAX_IDEMPOTENCY_KEY_CHARS:
        raise OpenAIError(
            400,
            f"Idempotency-Key must be at most {MAX_IDEMPOTENCY_KEY_CHARS} characters",
            param="Idempotency-Key",
        )
    return key


async def reply_head(batches: AsyncIterator[list[Event]]) -> list[Event]:
    """The reply's first events, up to the memories it uses (or its first output)."""
    head: list[Event] = []
    async for batch in batches:
        head += batch
        if any(event[1] in HEAD_EVENTS for event in batch):
            break
    return head


async def _stream(
    services: Services,
    reply_id: uuid.UUID,
    translator: ReplyTranslator,
    head: list[Event],
    batches: AsyncIterator[list[Event]],
) -> AsyncIterator[bytes]:
    """The reply as chat.completion.chunk SSE; the client leaving stops the reply."""
    try:
        out = _frames(translator, head)
        if out:
            yield out
        if translator.ended:
            return
        async for batch in batches:
            out = _frames(translator, batch)
            if out:
                yield out
            if translator.ended:
                return
    finally:
        if not translator.ended:
            hung_up(services, reply_id, ON_DISCONNECT, ReplyKind.STARTED)
        aclose = getattr(batches, "aclose", None)
        if aclose is not None:
            await aclose()


def _frames(translator: ReplyTranslator, events: list[Event]) -> bytes:
    chunks = [sse_data(chunk) for event in events for chunk in translator.feed(event)]
    if translator.ended:
        chunks.append(DONE)
    return b"".join(chunks)


class Folding(Protocol):
    """A translator that folds a reply's events into one answer (chat completion, response)."""

    @property
    def ended(self) -> bool: ...

    def feed(self, event: Event) -> Any: ...


async def fold_reply(
    request: Request,
    services: Services,
    reply_id: uuid.UUID,
    translator: Folding,
    head: list[Event],
    batches: AsyncIterator[list[Event]],
    *,
    on_disconnect: OnDisconnect,
    kind: ReplyKind,
) -> None:
    """Fold the whole reply into the translator; a client that leaves first is `hang_up.hung_up`."""
    for event in head:
        if event[1] != EventName.MEMORY_RETRIEVED:
            translator.feed(event)
    if translator.ended:
        return

    async def collect() -> None:
        async for batch in batches:
            for event in batch:
                translator.feed(event)
            if translator.ended:
                return

    async def client_left() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    collecting = asyncio.create_task(collect())
    watching = asyncio.create_task(client_left())
    try:
        await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
        if not collecting.done():
            hung_up(services, reply_id, on_disconnect, kind)
        await collecting
    finally:
        for task in (collecting, watching):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(collecting, watching, return_exceptions=True)
