"""Which chatmem conversation an OpenAI-style request continues, and starting its reply there.

The client owns the history it sends; chatmem keeps its own. A request is mapped to one
of the caller's conversations:

1. explicitly: a chatmem conversation id (header `X-Chatmem-Conversation-Id` or
   `metadata.conversation_id`; someone else's id is 404), or a frontend's own chat id
   (header `X-Chatmem-Chat-Key`, Open WebUI's `X-OpenWebUI-Chat-Id`), which names one
   conversation per caller, made on first use;
2. tool results: the conversation whose reply made those tool calls;
3. by the history itself: the caller's conversation whose active history shares the
   longest prefix with the one sent (at least a question and its answer, or the whole
   stored history when its last reply was stopped before any text);
4. otherwise a new conversation (with an `Idempotency-Key`, one whose id comes from the
   key, so that a retry of the request lands in it; see below).

In the chosen conversation, under its row lock (`chat_api.replies.start_reply`), the sent
history is compared with the stored one (`memory.record.history_match`; the comparison that
chose the conversation, when nothing has happened in it since, is not made again): the same history → the
new message continues it; the new message already stored after the same history → its
answer is generated again on a new branch (regenerate); a history that agrees only up
to an earlier point → a new branch from there (edit), where the messages the client has
and chatmem has not are imported as ordinary turns (so they reach memory too).

A request with an `Idempotency-Key` (a header the SDKs send only when the caller sets it)
stores the key with what it adds; the same request sent again (the SDK's retry after a
dropped connection, a 5xx, 408 or 429) finds it under the conversation's lock and
reattaches to the reply the first attempt started, wherever it runs: no second user
message, no second reply. The same key with another message is a 400
`idempotency_key_reused`.

Those imported messages are an import like any other: they pass the import admission
(`chat_api.admission`: turns per request, characters per message, the hourly quota) and
a request over it is refused before anything is stored. A new conversation is made only
once its whole history (all of it new to chatmem) has been admitted, so a refused request
leaves no empty conversation behind.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from anyio import to_thread
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from chat_api.admission import Admission, AdmittedImport, AdmittedReply
from chat_api.protocols.openai.chat import ChatRequest, ClientMessage, OpenAIError
from chat_api.protocols.openai.retries import start_or_answer_retry

# The reply seam (one block, so it can be re-pointed when the lifecycle modules move).
from chat_api.replies import (
    Accepted,
    BeginReply,
    Started,
    answer_again,
    answer_tool_results,
    store_message,
)
from chat_api.services import Services
from memory.errors import InvalidInput, NotFound
from memory.record.ai_sdk_chats import made_under_id
from memory.record.branches import conversation_branch, fork_branch, history_oldest_first
from memory.record.conversations import Owner, create_conversation, get_conversation
from memory.record.history_match import Unit, sent_units, shared_prefix
from memory.record.imports import import_turns
from memory.storage.models import Branch, Conversation, Turn

# Chat keys name conversations through uuid5(namespace, tenant, user, key): no table needed,
# and two callers' keys can never name the same conversation.
CHAT_KEY_NAMESPACE = uuid.UUID("8f4a2b1e-5d1c-4c36-9a57-2a0d6f1c9b3e")
# The new conversation a keyed request makes is named the same way, in its own namespace.
IDEMPOTENCY_NAMESPACE = uuid.UUID("c3b1e7a4-2f60-4d8e-9b55-7e0a4f9d2c61")
MAX_CHAT_KEY_CHARS = 256
CANDIDATES = 20
TITLE_CHARS = 80
# A history must agree on a question and its answer before it counts as the same conversation
# (or be all of the stored one, when that ends with a reply stopped before any text).
MIN_MATCHED_UNITS = 2

CANDIDATE_CONVERSATIONS = text(
    """
    SELECT c.id FROM conversations c
    WHERE c.tenant_id = :tenant_id AND c.user_id = :user_id AND c.deleted_at IS NULL
      AND EXISTS (
        SELECT 1 FROM turns t
        WHERE t.conversation_id = c.id AND t.role = 'user' AND t.deleted_at IS NULL AND t.content = :first
      )
    ORDER BY c.updated_at DESC
    LIMIT :limit
    """
)
KEY_CONVERSATION = text("SELECT deleted_at FROM conversations WHERE id = :id")
CONVERSATION_OF_CALL = text(
    """
    SELECT t.conversation_id FROM turns t JOIN conversations c ON c.id = t.conversation_id
    WHERE t.tenant_id = :tenant_id AND t.user_id = :user_id AND t.role = 'assistant'
      AND t.deleted_at IS NULL AND c.deleted_at IS NULL AND t.tool_calls @> CAST(:probe AS jsonb)
    ORDER BY t.created_at DESC
    LIMIT 1
    """
)


def chat_key_conversation(owner: Owner, key: str, namespace: uuid.UUID = CHAT_KEY_NAMESPACE) -> uuid.UUID:
    """The conversation a frontend's chat id (or a request's Idempotency-Key) names for this caller."""
    return uuid.uuid5(namespace, f"{owner.tenant_id}\x1f{owner.user_id}\x1f{key}")


@dataclass(frozen=True, slots=True)
class Seen:
    """A conversation's history as compared when it was chosen: how much it shares with the
    sent one, its units, and what shows that nothing has happened in it since."""

    matched: int
    stored: list[Unit]
    branch_id: uuid.UUID
    next_seq: int
    updated_at: datetime

    @classmethod
    def of(cls, conversation: Conversation, matched: int, stored: list[Unit]) -> Seen | None:
        """What was seen, or None when a reply was running (its turns still change)."""
        if conversation.active_reply_id is not None:
            return None
        return cls(
            matched, stored, conversation.active_branch_id, conversation.next_seq, conversation.updated_at
        )

    def still(self, conversation: Conversation) -> bool:
        """Whether the conversation (read again under its lock) has not changed since: every new
        turn, finished reply and branch switch moves one of these."""
        return (
            conversation.active_reply_id is None
            and conversation.active_branch_id == self.branch_id
            and conversation.next_seq == self.next_seq
            and conversation.updated_at == self.updated_at
        )


@dataclass(frozen=True, slots=True)
class Target:
    """The conversation a request goes to; `new`: not made yet (made once the request is admitted).

    `sent`: the sent history as units (made once, in a worker thread); `seen`: the chosen
    conversation's history as compared to choose it."""

    conversation_id: uuid.UUID | None
    new: bool = False
    sent: list[Unit] | None = None
    seen: Seen | None = None


async def choose_conversation(
    services: Services,
    owner: Owner,
    chat: ChatRequest,
    *,
    conversation_id: uuid.UUID | None,
    chat_key: str | None,
    idempotency_key: str | None = None,
) -> Target:
    """The caller's conversation this request goes to, or a new one (NotFound for another's id).

    A keyed request's new conversation is the one its key names: made by the first attempt,
    found by a retry.
    """
    if conversation_id is not None:
        async with services.db.session() as session:
            await get_conversation(session, owner, conversation_id)  # 404 unless the caller's
        return Target(conversation_id)
    if chat_key is not None:
        if not chat_key.strip() or len(chat_key) > MAX_CHAT_KEY_CHARS:
            raise InvalidInput(f"a chat key must be 1 to {MAX_CHAT_KEY_CHARS} characters", field="chat_key")
        return await _target_of_key(services, owner, chat_key_conversation(owner, chat_key))
    async with services.db.session() as session:
        if chat.tool_results:
            found = await _conversation_of_call(session, owner, chat.tool_results[0])
            if found is None:
                raise InvalidInput(
                    "the tool results answer no tool call of yours that chatmem knows", field="messages"
                )
            return Target(found)
        sent = await sent_of(chat)
        best = await _best_match(session, owner, chat, sent)
    if best is not None:
        return Target(best[0], sent=sent, seen=best[1])
    if idempotency_key is not None:
        keyed = chat_key_conversation(owner, idempotency_key, IDEMPOTENCY_NAMESPACE)
        target = await _target_of_key(services, owner, keyed)
        return replace(target, sent=sent)
    return Target(None, new=True, sent=sent)


def _title(chat: ChatRequest) -> str:
    first = next((m.text for m in chat.history if m.role == "user"), chat.prompt or "")
    line = " ".join(first.split())
    return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1] + "…"


async def _target_of_key(services: Services, owner: Owner, conversation_id: uuid.UUID) -> Target:
    """The conversation a key names: new until the first request with the key makes it."""
    async with services.db.session() as session:
        found = (await session.execute(KEY_CONVERSATION, {"id": conversation_id})).first()
    if found is None:
        return Target(conversation_id, new=True)
    if found.deleted_at is not None:
        raise NotFound("conversation not found", conversation_id=str(conversation_id))
    return Target(conversation_id)


async def _make(services: Services, owner: Owner, chat: ChatRequest, target: Target) -> uuid.UUID:
    """Make the target's new conversation (a key's: unless a request racing this one just did;
    it takes a stop that named it before it was made, so the first reply starts stopped)."""
    async with services.db.transaction() as session:
        if target.conversation_id is None:
            return (await create_conversation(session, owner, title=_title(chat))).id
        await made_under_id(session, owner, target.conversation_id, title=_title(chat))  # deleted since: 404
    return target.conversation_id


async def _conversation_of_call(
    session: AsyncSession, owner: Owner, result: ClientMessage
) -> uuid.UUID | None:
    probe = json.dumps([{"id": result.tool_call_id}])
    row = await session.execute(
        CONVERSATION_OF_CALL, {"tenant_id": owner.tenant_id, "user_id": owner.user_id, "probe": probe}
    )
    found = row.scalar_one_or_none()
    return found if isinstance(found, uuid.UUID) else None


async def _best_match(
    session: AsyncSession, owner: Owner, chat: ChatRequest, sent: list[Unit]
) -> tuple[uuid.UUID, Seen | None] | None:
    """The conversation whose active history shares the longest prefix with the sent one, and
    that history as compared."""
    first = next((m.text for m in chat.history if m.role == "user"), None)
    if first is None:
        return None  # a first message: nothing to continue
    rows = await session.execute(
        CANDIDATE_CONVERSATIONS,
        {"tenant_id": owner.tenant_id, "user_id": owner.user_id, "first": first, "limit": CANDIDATES},
    )
    best: tuple[int, uuid.UUID, Seen | None] | None = None
    for conversation_id in rows.scalars():
        conversation = await get_conversation(session, owner, conversation_id)
        branch = await conversation_branch(session, conversation)
        matched, stored = await _shared_prefix(session, sent, branch)
        enough = matched >= MIN_MATCHED_UNITS or (matched == len(stored) and _ends_unanswered(stored))
        if enough and (best is None or matched > best[0]):
            best = (matched, conversation_id, Seen.of(conversation, matched, stored))
    return None if best is None else best[1:]


async def _shared_prefix(session: AsyncSession, sent: list[Unit], branch: Branch) -> tuple[int, list[Unit]]:
    """How many leading units the sent history shares with the branch's, and the branch's units
    read: all of them when they end within the shared part, else at least one past it (a
    long stored history is read only as far as it can match)."""
    async with contextlib.aclosing(history_oldest_first(session, branch)) as pages:
        return await shared_prefix(sent, pages)


def _ends_unanswered(stored: list[Unit]) -> bool:
    """Whether a stored history ends with a user message whose reply showed nothing (stopped or
    failed before any text).

    A client sends such a history back without that reply (there was nothing to show), so
    all it has in common with the conversation may be the one message: that whole history
    sent back, and a new message after it, continues the conversation rather than starting
    a copy of it. (Its empty reply's turns are in the message's unit: `last_seq` is past it.)
    """
    return bool(stored) and stored[-1].role == "user" and stored[-1].last_seq > stored[-1].turn.seq


async def sent_of(chat: ChatRequest) -> list[Unit]:
    """The sent history and new message as units, made in a worker thread (megabytes of text to
    normalise would hold up every other stream of the process)."""
    prompt = [ClientMessage("user", chat.prompt)] if chat.prompt is not None else []
    return await to_thread.run_sync(sent_units, [*chat.history, *prompt])


async def start_chat_reply(
    services: Services,
    admission: Admission,
    owner: Owner,
    chat: ChatRequest,
    target: Target,
    *,
    admitted: AdmittedReply,
    memory_scope: str,
    recorded: Callable[[BeginReply], BeginReply] | None = None,
    idempotency_key: str | None = None,
) -> tuple[uuid.UUID, Accepted]:
    """Store what the request adds to the conversation and start its reply (interrupting a running one).

    Returns the conversation (made here for a new target) and the started reply.
    `recorded` wraps what is stored (another adapter's own rows go in the same
    transaction). With `idempotency_key`, a request already started reattaches to its reply.
    A refused import names the request's field holding the history (`chat.messages_field`).
    """
    history: AdmittedImport | None = None
    if target.sent is None and not chat.tool_results:
        target = replace(target, sent=await sent_of(chat))
    units = target.sent[:-1] if target.new and target.sent else []
    if units:
        # A new conversation: all the client sent before its new message is history to import.
        history = await admit_history(admission, owner, *_turn_rows(units), param=chat.messages_field)
    with history or contextlib.nullcontext():
        conversation_id = await _make(services, owner, chat, target) if target.new else target.conversation_id
        assert conversation_id is not None
        if chat.tool_results:
            begin = _begin_tool_answer(services, chat, idempotency_key)
        else:
            assert target.sent is not None
            begin = _begin_prompt(services, admission, owner, chat, target, history, idempotency_key)
        accepted = await start_or_answer_retry(
            services,
            owner,
            conversation_id,
            begin,
            chat,
            admitted=admitted,
            on_busy="interrupt",
            idempotency_key=idempotency_key,
            memory_scope=memory_scope,
            recorded=recorded,
        )
    return conversation_id, accepted


async def admit_history(
    admission: Admission,
    owner: Owner,
    rows: list[dict[str, Any]],
    indices: Sequence[int | None],
    *,
    param: str,
) -> AdmittedImport:
    """`rows` admitted as an import, or a 400 naming `param`, the request's field the history came in.

    The import rules name `turns`, the field of chatmem's own import, and a turn by its index
    among the imported ones; an OpenAI request has no `turns` (`messages` on chat completions,
    `input` on the Responses API), and its client knows a message by its index in that list:
    `indices[i]` is the client's index of `rows[i]`.
    """
    try:
        return await admission.admit_import(owner, rows)
    except InvalidInput as exc:
        field, index = exc.details.get("field"), exc.details.get("index")
        if field == "turns":
            raise OpenAIError(400, exc.message, param=param, code=exc.code) from exc
        if not isinstance(index, int) or not 0 <= index < len(indices) or indices[index] is None:
            raise
        where = f"{param}[{indices[index]}]" + (f".{field}" if field else "")
        # The rule's own words after its `turns[i].` (or `turns[i] `): the same refusal, named as sent.
        reason = exc.message.removeprefix(f"turns[{index}]").removeprefix(f".{field}").lstrip(":. ")
        raise OpenAIError(400, f"{where}: {reason}", param=where, code=exc.code) from exc


def _turn_rows(units: Sequence[Unit]) -> tuple[list[dict[str, Any]], list[int | None]]:
    """Sent units as the turns of an import request, and the client's index of each."""
    return [{"role": unit.role, "content": unit.raw} for unit in units], [unit.index for unit in units]


def _begin_prompt(
    services: Services,
    admission: Admission,
    owner: Owner,
    chat: ChatRequest,
    target: Target,
    history: AdmittedImport | None,
    idempotency_key: str | None = None,
) -> BeginReply:
    """Store the new message after the sent history; what chatmem lacks of it is imported.

    `history` is the new conversation's whole history, admitted before the conversation
    was made; anything else lacking (an edit, a longer history) is admitted here. The
    history compared to choose the conversation is read again only if it may have changed.
    """
    prompt = chat.prompt or ""
    sent = target.sent
    assert sent is not None

    async def begin(session: AsyncSession, conversation: Conversation, reply_id: uuid.UUID) -> Started:
        active = await conversation_branch(session, conversation)
        seen = target.seen
        if seen is not None and seen.still(conversation):
            matched, stored = seen.matched, seen.stored
        else:
            matched, stored = await _shared_prefix(session, sent, active)
        if matched == len(sent):
            # The new message is already stored after the same history: answer it again.
            user_turn = await session.get(Turn, stored[matched - 1].turn.id)  # read by another session
            assert user_turn is not None
            if matched < len(stored):
                await fork_branch(session, conversation, parent=active, fork_seq=user_turn.seq)
            return await answer_again(services, session, conversation, reply_id, user_turn, idempotency_key)
        if matched < len(stored):
            fork_seq = stored[matched - 1].last_seq if matched else 0
            await fork_branch(session, conversation, parent=active, fork_seq=fork_seq)
        missing = sent[matched:-1]
        if missing:
            if history is not None and matched == 0:
                admitted = history  # admitted for exactly these turns before the conversation was made
            else:
                # Refused (422, or 429 past the hourly quota) before this transaction stores anything.
                admitted = await admit_history(
                    admission, owner, *_turn_rows(missing), param=chat.messages_field
                )
            with admitted:
                result = await import_turns(session, owner, conversation.id, admitted.turns)
                admitted.settle(result.created)
        return await store_message(services, session, conversation, reply_id, prompt, idempotency_key)

    return begin


def _begin_tool_answer(services: Services, chat: ChatRequest, idempotency_key: str | None) -> BeginReply:
    results = chat.tool_answers

    async def begin(session: AsyncSession, conversation: Conversation, reply_id: uuid.UUID) -> Started:
        return await answer_tool_results(
            services, session, conversation, reply_id, results, idempotency_key=idempotency_key
        )

    return begin
