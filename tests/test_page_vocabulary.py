"""The chat page spells the reply's vocabulary from one module, and it is the server's."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from memory.events import ENDING_NAMES, EventName, StopReason, ToolCallState, TurnStatus

STATIC = Path(__file__).resolve().parent.parent / "chat_api" / "static"
EVENTS_JS = STATIC / "events.js"


def page_vocabulary() -> dict[str, object]:
    """What the page's events.js exports, as Node reads it."""
    script = (
        f"import * as v from {json.dumps(EVENTS_JS.as_uri())};"
        "console.log(JSON.stringify({event: v.EVENT, ending: [...v.ENDING_EVENTS], status: v.STATUS,"
        " callState: v.CALL_STATE, stopReason: v.STOP_REASON}));"
    )
    out = subprocess.run(
        ["node", "--input-type=module", "-e", script], capture_output=True, text=True, check=True, timeout=60
    )
    return json.loads(out.stdout)


def test_the_page_module_holds_the_same_names_as_the_server() -> None:
    page = page_vocabulary()
    assert page["event"] == {member.name: member.value for member in EventName}
    assert sorted(page["ending"]) == sorted(ENDING_NAMES)  # type: ignore[arg-type]
    assert page["status"] == {member.name: member.value for member in TurnStatus}
    assert page["callState"] == {member.name: member.value for member in ToolCallState}
    assert page["stopReason"] == {member.name: member.value for member in StopReason}


def test_no_other_page_module_spells_an_event_name() -> None:
    quoted = re.compile("|".join(rf"[\"'`]{re.escape(name)}[\"'`]" for name in EventName if "." in name))
    spelled = {
        path.name: quoted.findall(path.read_text())
        for path in STATIC.glob("*.js")
        if path != EVENTS_JS and quoted.search(path.read_text())
    }
    assert spelled == {}
