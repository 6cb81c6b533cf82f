"""Idempotency-Key: the same request sent again replays; the same key on another request is refused.

A key names one request. Sent again with the same body (a retry after a timeout), it
reattaches to the reply that request started. Sent with a different body it used to
answer 200 with the earlier reply and silently drop the new text; now it is a 422
(`idempotency_key_reused`), as payment APIs do, and nothing is stored.

What "the same body" means is what the request stores: a message's (or an edit's) text
on its user turn, and for a regenerate, that the key was a regenerate's (on the reply's
assistant turn). A message a client sends whole with its history (the OpenAI doors) may
find its text already stored and be answered again: its key is then on the reply's
assistant turn, and the same body is that the message answered has the same text.
Options that only shape delivery (`stream`, `on_busy`, …) may differ.
"""

from __future__ import annotations

from memory.errors import InvalidInput
from memory.storage.models import Turn


class IdempotencyKeyReused(InvalidInput):
    """An Idempotency-Key already used by a request with a different body."""

    code = "idempotency_key_reused"


def check_replay(earlier: Turn, answered: Turn | None, content: str | None) -> None:
    """Raise IdempotencyKeyReused unless `earlier` was stored by this same request.

    `answered` is the user turn the earlier request's reply answers; `content` is the
    request's message text, or None for a regenerate (or tool results).
    """
    if content is None:
        same = earlier.role == "assistant"
    else:
        same = answered is not None and answered.content == content
    if not same:
        raise IdempotencyKeyReused(
            "this Idempotency-Key was used for a request with a different body; use a new key",
            field="Idempotency-Key",
        )
