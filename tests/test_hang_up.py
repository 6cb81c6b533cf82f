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


def test_the_non_streamed_openai_path_does_not_decide_on_its_own_that_a_hang_up_stops_the_reply() -> None:
    """Found: chat completions' and Responses' stream=false path (`fold_reply`) stopped the reply on
    a client disconnect with its own `stop_reply(reason=CLIENT_DISCONNECTED)`, beside `hung_up`.
    No module but hang_up.py may pass that reason to anything: a door that did decided on its own."""
    import ast
    from pathlib import Path

    import chat_api

    package = Path(chat_api.__file__).parent
    deciding = []
    for path in sorted(package.rglob("*.py")):
        if path == package / "replies" / "hang_up.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                arguments = [*node.args, *(k.value for k in node.keywords)]
                if any(isinstance(a, ast.Attribute) and a.attr == "CLIENT_DISCONNECTED" for a in arguments):
                    deciding.append(f"{path.relative_to(package)}:{node.lineno}")
    assert deciding == []
