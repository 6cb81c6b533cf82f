"""The OpenAI-compatible API with the official `openai` npm package (pinned in tests/js), on `chatmem serve`.

Runs `node --test` on the chat-completions and the Responses suites (`tests/js/openai_chat.test.mjs`,
`tests/js/openai_responses.test.mjs`) against one server process with an API key
of a fresh user; the Node tests read back what was stored through chatmem's own API with
the same key. Skipped only when Node or the installed packages are missing (`make test`
installs them with `npm ci`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.openai_support import make_key, new_user
from tests.procs import server_process
from tests.support import run_node_tests

JS = Path(__file__).parent / "js"
NODE = shutil.which("node")


@pytest.mark.skipif(
    NODE is None or not (JS / "node_modules" / "openai").is_dir(),
    reason="node or tests/js/node_modules missing (cd tests/js && npm ci)",
)
async def test_openai_npm_package_streams_and_aborts(pg_url: str) -> None:
    assert NODE is not None
    async with server_process(pg_url, demo_tokens_per_second=40) as live:
        key = await make_key(live, new_user())
        env = {"PATH": str(Path(NODE).parent), "CHATMEM_URL": live.base_url, "CHATMEM_KEY": key}
        suites = ["openai_chat.test.mjs", "openai_responses.test.mjs"]
        report = await run_node_tests(JS, suites, env, timeout=180, reporter="tap")
    assert "# fail 0" in report and "# pass 9" in report, report
