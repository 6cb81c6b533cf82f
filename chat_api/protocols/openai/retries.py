"""Starting an OpenAI door's reply; and a retried request (the same `Idempotency-Key`): its answer.

The SDKs retry a request whose answer did not reach them. Cases that look alike to the
server's key check and are not:

- the answer was made and lost on the way (a gateway's 502 or 504 after chatmem finished,
  a connection dropped at the very end): the retry gets that same reply, replayed from its
  log, or followed live while it still runs;
- the client left while the reply ran (its own timeout, a dropped connection). On these
  doors closing the connection is the stop, so that reply ended `interrupted_by_user`
  (`client_disconnected`) with part of an answer the client never got. Replaying it would
  hand over a cut-off answer as if it were whole; the retry gets the same stored message
  answered again instead, on a new branch, as a regenerate (the stopped reply stays, as
  every stopped reply does). No second user message is stored.
- the reply failed (the model's server refused or broke off, or the replica running it
  died): the SDK retries the 5xx or the dropped connection, and the retry gets a new
  answer rather than the same failure again.

The reply a retry is measured against is the newest one to the key's message on the
active branch (a retry after an answer-again follows that one); once the conversation
has moved on past the message, the key's own reply is replayed.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from chat_api.admission import AdmittedReply
from chat_api.protocols.openai.chat import ChatRequest
from chat_api.replies import Accepted, BeginReply, hand_over, regenerate_reply, start_reply
from chat_api.services import Services
from memory.errors import NotLastReply, NotOnActiveBranch, TurnNotFinished
from memory.events import StopReason, TurnStatus
from memory.record.branches import conversation_branch, newest_turn
from memory.record.conversations import Owner, get_conversation
from memory.storage.models import Turn


async def start_or_answer_retry(
    services: Services,
    owner: Owner,
    conversation_id: uuid.UUID,
    begin: BeginReply,
    chat: ChatRequest,
    *,
    admitted: AdmittedReply,
    on_busy: str,
    idempotency_key: str | None,
    memory_scope: str,
    parked_gives_way: bool = False,
    recorded: Callable[[BeginReply], BeginReply] | None = None,
) -> Accepted:
    """Start the reply `begin` stores (`recorded` wraps it with the door's own rows) and hand
    it what `chat` asks of the model; sent again with the same Idempotency-Key, the reply
    that answers the retry (see the module's docstring). Both OpenAI doors start replies here;
    their busy policies differ (`on_busy`, `parked_gives_way`).
    """
    accepted = await start_reply(
        services,
        owner,
        conversation_id,
        recorded(begin) if recorded is not None else begin,
        admitted=admitted,
        on_busy=on_busy,
        on_disconnect="continue",  # its busy policies never wait in line
        parked_gives_way=parked_gives_way,
        idempotency_key=idempotency_key,
        memory_scope=memory_scope,
        # The new message's text: its recall query is encoded while the turns are stored.
        content=None if chat.tool_results else chat.prompt,
    )
    accepted = await _retried_reply(
        services,
        owner,
        conversation_id,
        accepted,
        admitted=admitted,
        on_busy=on_busy,
        memory_scope=memory_scope,
        parked_gives_way=parked_gives_way,
        recorded=recorded,
        tool_results=bool(chat.tool_results),
    )
    hand_over(services, accepted, tools=chat.tools, options=chat.options, instructions=chat.instructions)
    return accepted


async def _retried_reply(
    services: Services,
    owner: Owner,
    conversation_id: uuid.UUID,
    accepted: Accepted,
    *,
    admitted: AdmittedReply,
    on_busy: str,
    memory_scope: str,
    parked_gives_way: bool = False,
    recorded: Callable[[BeginReply], BeginReply] | None = None,
    tool_results: bool = False,
) -> Accepted:
    """`accepted` as it is, unless it is a retry's reattachment to a reply its client left:
    then the key's message answered again (see the module's docstring).

    `recorded` wraps what the answer again stores, as it wrapped the first attempt's (the
    Responses door's response row). A request of tool results is not answered again
    (that would answer the message before them, the calls made again): its reply is replayed.
    """
    if not accepted.reattached or tool_results:
        return accepted
    async with services.db.session() as session:
        conversation = await get_conversation(session, owner, conversation_id)
        active = await conversation_branch(session, conversation)
        newest = await newest_turn(session, active)
        message = await newest_turn(session, active, role="user")
    if newest is None or message is None or message.id != accepted.user_turn_id or newest.role == "user":
        return accepted  # the conversation moved on (or the reply has no turn of its own yet)
    if not _answer_again(newest):
        return Accepted(newest.reply_id or newest.id, message.id, reattached=True)
    try:
        return await regenerate_reply(
            services,
            owner,
            newest,
            admitted=admitted,
            conversation_id=conversation_id,
            on_busy=on_busy,
            on_disconnect="continue",
            idempotency_key=None,
            memory_scope=memory_scope,
            parked_gives_way=parked_gives_way,
            recorded=recorded,
        )
    except (NotLastReply, NotOnActiveBranch, TurnNotFinished):
        return accepted  # something else happened in the conversation since: the key's reply, as it is


def _answer_again(ended: Turn) -> bool:
    """Whether a retry gets a new answer rather than this reply (see the module's docstring)."""
    if ended.status == TurnStatus.INTERRUPTED_BY_USER:
        return ended.interrupt_reason == StopReason.CLIENT_DISCONNECTED
    return ended.status in (TurnStatus.FAILED, TurnStatus.INTERRUPTED_BY_ERROR)
