"""AG-UI's own client and its conformance validator against live `chatmem serve` processes.

`tests/js/ag_ui.test.mjs` drives `/v1/ag-ui` with the pinned `@ag-ui/client` (HttpAgent:
runAgent, abortRun, connect; its strict event verifier is always on), against two
replicas on one database, and saves every response body it reads. Each saved stream is
then checked by the official validator, `ag-ui-validate` (what its command line does with
a recorded file), and its command line is pointed at the live endpoint once, which adds its
transport rules (content type, incremental flushing).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from ag_ui_validate import Report
from ag_ui_validate.transport import TransportOptions, validate_body

from chat_api.protocols.ag_ui.run import MEDIA_TYPE
from memory.storage.db import Database
from tests.conftest import token_for
from tests.procs import server_processes
from tests.support import run_node_tests

JS_DIR = Path(__file__).parent / "js"
SUITE = "ag_ui.test.mjs"
NODE = shutil.which("node")
VALIDATOR = Path(sys.executable).parent / "ag-ui-validate"
SUITE_TIMEOUT_SECONDS = 300
SERVER = {
    "tool_modules": '["tests.approval_tools"]',
    "tools_requiring_approval": '["transfer_funds"]',
    "demo_tokens_per_second": 40,
    "rate_limit_per_minute": 0,
    "max_streams_per_user": 0,
    "max_running_replies_per_user": 0,  # the suite's tests run at once, as one user
}
# The findings allowed in a saved stream, by the name the suite gave it; none for the others.
ALLOWED = {
    # A stop that cuts a call mid-arguments closes it (TOOL_CALL_END) with the partial
    # arguments the client was sent, as AG-UI's cancelled outcome asks; the validator does
    # not know that outcome and reports the arguments as not JSON.
    "stop-cut-arguments": {"AGUI204"},
    # The client aborted this one (abortRun): the capture ends where the client hung up.
    "abort": {"AGUI003", "AGUI103"},
}


async def _validate(path: Path) -> Report:
    """The validator's report on a saved stream: what `ag-ui-validate FILE` prints, in process."""
    body = path.read_bytes()  # noqa: ASYNC240 (a small local file)

    async def chunks() -> AsyncIterator[bytes]:
        yield body

    result = await validate_body(chunks(), MEDIA_TYPE, TransportOptions(recorded=True))
    return result.report


def _findings(report: Report) -> set[str]:
    return {d.rule for d in report.diagnostics if d.severity != "info"}


@pytest.mark.skipif(NODE is None, reason="node is not installed")
async def test_the_ag_ui_client_and_validator_accept_chatmem(
    pg_url: str, db: Database, tmp_path: Path
) -> None:
    assert (JS_DIR / "node_modules" / "@ag-ui" / "client").is_dir(), "run `npm ci` in tests/js (make js-deps)"
    captures = tmp_path / "captures"
    async with server_processes(pg_url, 2, **SERVER) as (server, replica):
        env = {
            **os.environ,
            "CHATMEM_URL": server.base_url,
            "CHATMEM_REPLICA_URL": replica.base_url,
            "CHATMEM_TOKEN": token_for("t1", "u1"),
            "CHATMEM_OTHER_USER_TOKEN": token_for("t1", "u2"),
            "CHATMEM_CAPTURES": str(captures),
        }
        await run_node_tests(JS_DIR, SUITE, env, timeout=SUITE_TIMEOUT_SECONDS)

        live = await asyncio.create_subprocess_exec(
            str(VALIDATOR),
            f"{server.base_url}/v1/ag-ui",
            "--header",
            f"Authorization: Bearer {token_for('t1', 'u3')}",
            "--json",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        live_out, live_err = await asyncio.wait_for(live.communicate(), timeout=60)
    report = json.loads(live_out)
    assert report["summary"]["errors"] == 0, live_out.decode()
    assert report["summary"]["warnings"] == 0, live_out.decode()
    assert live.returncode == 0, live_err.decode()

    files = sorted(captures.glob("*.sse"))
    assert len(files) >= 20, [f.name for f in files]
    for path in files:
        findings = _findings(await _validate(path))
        assert findings <= ALLOWED.get(path.stem.split("-", 1)[1], set()), (path.name, findings)
