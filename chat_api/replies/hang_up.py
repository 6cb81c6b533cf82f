"""What a client that leaves a reply's stream before the reply ends does to that reply.

One decision for every door, so that a door cannot pass its own answer: each stream of a
reply names what its request did to the reply (started it, resumed it with a decision, or
only follows it) and the request's `on_disconnect`, and calls `hung_up` when its client
leaves early. A request that started or resumed the reply stops it by leaving only when it
asked to (`on_disconnect=stop`; the OpenAI doors ask for it, as their protocol means it);
a request that only follows a reply started by another (a resume, a reconnect, AG-UI connect)
never stops it by leaving.
"""

from __future__ import annotations

import uuid
from enum import StrEnum
from typing import TYPE_CHECKING, Literal

from memory.events import StopReason

if TYPE_CHECKING:
    from chat_api.services import Services

OnDisconnect = Literal["continue", "stop"]


class ReplyKind(StrEnum):
    """What the request whose stream this is did to the reply."""

    STARTED = "started"  # a message, a regenerate, an edit, a run: the request started the reply
    RESUMED = "resumed"  # the request's approval decision resumed the parked reply
    FOLLOWED = "followed"  # the reply was started by another request; this one only follows it


def stops_on_hang_up(on_disconnect: OnDisconnect, kind: ReplyKind) -> bool:
    """Whether the client leaving the stream before the reply ends stops the reply."""
    return kind is not ReplyKind.FOLLOWED and on_disconnect == "stop"


def hung_up(services: Services, reply_id: uuid.UUID, on_disconnect: OnDisconnect, kind: ReplyKind) -> None:
    """The stream's client left before the reply ended: stop the reply if `stops_on_hang_up` says so.

    Synchronous, so a stream's `finally` calls it before any await: a cancelled stream may not
    get to await again. A reply this request started or resumed runs in this process.
    """
    if not stops_on_hang_up(on_disconnect, kind):
        return
    reply = services.registry.get(reply_id)
    if reply is not None:
        reply.request_stop(StopReason.CLIENT_DISCONNECTED)
