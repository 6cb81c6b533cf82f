"""Starting a reply for a run and streaming it, or joining one already running (connect), as AG-UI frames."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from ag_ui.core import (
    BaseEvent,
    Message,
)
from fastapi import Response
from fastapi.responses import StreamingResponse

from chat_api.admission import Admission
from chat_api.protocols.ag_ui.input import RunRequest
from chat_api.protocols.ag_ui.run import (
    MEDIA_TYPE,
    MEMORY_EVENT,
    RunTranslator,
    encode,
)
from chat_api.protocols.ag_ui.thread import (
    snapshot,
)
from chat_api.response_headers import STREAM_HEADERS
from chat_api.services import Services
from memory.events import Event
from memory.record.ai_sdk_chats import chat_conversation
from memory.record.conversations import Owner
from memory.storage.models import Conversation

# isort: split
# The reply lifecycle's public seam, in this one block so that a move of those modules is one edit here.
from chat_api.replies import (
    Accepted,
    OnDisconnect,
    ReplyKind,
    follow_reply,
    hand_over,
    hung_up,
    start_reply,
)


def run_key(run_id: str) -> str:
    """The idempotency key of a run: a retried input (the same runId) reattaches to the reply it
    started, and a stop naming the runId finds the run waiting in line by it."""
    return f"ag-ui:{run_id}"


def idempotency_key(request: RunRequest) -> str:
    return run_key(request.run_id)


async def start_and_stream(
    services: Services,
    owner: Owner,
    admission: Admission,
    request: RunRequest,
    conversation: Conversation | None,
    begin: Any,
    content: str | None,
    before: Sequence[BaseEvent] = (),
) -> Response:
    """Start the reply with `begin` and stream it; `before` goes out right after RUN_STARTED."""
    # Admitted before anything is stored, so a 429 leaves nothing behind.
    with admission.admit_reply(owner, stream=True) as admitted:
        if conversation is None:
            async with services.db.transaction() as session:
                conversation = await chat_conversation(session, owner, request.thread_id)
        accepted: Accepted = await start_reply(
            services,
            owner,
            conversation.id,
            begin,
            on_busy=request.on_busy or services.settings.on_busy_default,
            on_disconnect=request.on_disconnect,
            idempotency_key=idempotency_key(request) if content is not None else None,
            memory_scope=request.memory_scope or services.settings.memory_scope,
            content=content,
            admitted=admitted,
        )
        hand_over(services, accepted, tools=request.tools, instructions=request.instructions)
    translator = RunTranslator(request.thread_id, request.run_id, modern=request.modern)
    prefix = [translator.run_started(), *before]
    events = run_stream(
        services,
        accepted.reply_id,
        0,
        translator,
        prefix,
        on_disconnect=request.on_disconnect,
        kind=ReplyKind.STARTED,
    )
    return StreamingResponse(admitted.stream(events), media_type=MEDIA_TYPE, headers=STREAM_HEADERS)


async def run_stream(
    services: Services,
    reply_id: uuid.UUID,
    after: int,
    translator: RunTranslator,
    prefix: list[BaseEvent],
    *,
    on_disconnect: OnDisconnect,
    kind: ReplyKind,
    batches: AsyncIterator[list[Any]] | None = None,
) -> AsyncIterator[bytes]:
    """The reply's events after `after` as AG-UI SSE frames, one write per batch, until the run ends."""
    try:
        if prefix:
            yield encode(prefix)
        async for batch in batches or follow_reply(services, reply_id, after):
            out = [event for item in batch for event in translator.translate(item)]
            if out:
                yield encode(out)
            if translator.ended:
                break
        if not translator.ended:
            yield encode(translator.end())
    finally:
        if not translator.ended:
            hung_up(services, reply_id, on_disconnect, kind)


async def joined_stream(
    services: Services, reply_id: uuid.UUID, translator: RunTranslator, history: list[Message]
) -> AsyncIterator[bytes]:
    """Connect's stream: the reply's log so far folded into a snapshot, then the rest live."""
    batches = follow_reply(services, reply_id, 0)
    try:
        first: list[Event] = await anext(batches, [])
        folded = [event for item in first for event in translator.translate(item)]
        prefix: list[BaseEvent] = [
            translator.run_started(),
            snapshot([*history, *translator.settled_messages()]),
        ]
        if translator.ended:
            yield encode([*prefix, folded[-1]])  # it ended meanwhile: its outcome, nothing else
            return
        prefix += [e for e in folded if getattr(e, "name", None) == MEMORY_EVENT][-1:]
        prefix += translator.open_parts()
        frames = run_stream(
            services,
            reply_id,
            0,
            translator,
            prefix,
            on_disconnect="continue",
            kind=ReplyKind.FOLLOWED,
            batches=batches,
        )
        async for frame in frames:
            yield frame
    finally:
        await batches.aclose()  # type: ignore[attr-defined]
