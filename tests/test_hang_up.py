"""What a client leaving a reply's stream early does to the reply: one decision for every door."""

from __future__ import annotations

import pytest

from chat_api.replies import OnDisconnect, ReplyKind
from chat_api.replies.hang_up import stops_on_hang_up


@pytest.mark.parametrize("kind", [ReplyKind.STARTED, ReplyKind.RESUMED])
def test_a_reply_resumed_by_a_decision_stops_on_a_hang_up_exactly_as_a_started_one(kind: ReplyKind) -> None:
    """Found: a door streamed a reply resumed after an approval with stop-on-disconnect off."""
    assert stops_on_hang_up("stop", kind)
    assert not stops_on_hang_up("continue", kind)


@pytest.mark.parametrize("on_disconnect", ["continue", "stop"])
def test_a_request_only_following_a_reply_never_stops_it_by_leaving(on_disconnect: OnDisconnect) -> None:
    assert not stops_on_hang_up(on_disconnect, ReplyKind.FOLLOWED)
