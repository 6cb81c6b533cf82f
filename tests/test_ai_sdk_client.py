"""The Vercel AI SDK's own client against a live `chatmem serve`.

`tests/js/ai_sdk.test.mjs` drives `/v1/ai-sdk/chat` with the pinned `ai` package
(`DefaultChatTransport`, `AbstractChat`, which `useChat` wraps, `readUIMessageStream`,
`validateUIMessages`): its parser reads every chunk, so nothing here parses SSE by hand.
This module starts the server (demo model, an approval-gated tool) and runs the suite
with node's test runner, failing with node's output.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from memory.storage.db import Database
from tests.conftest import token_for
from tests.procs import server_process
from tests.support import run_node_tests

JS_DIR = Path(__file__).parent / "js"
SUITE = "ai_sdk.test.mjs"
NODE = shutil.which("node")
# The whole suite; each of its tests has its own, shorter bound.
SUITE_TIMEOUT_SECONDS = 240


@pytest.mark.skipif(NODE is None, reason="node is not installed")
async def test_the_ai_sdk_client_speaks_to_chatmem(pg_url: str, db: Database) -> None:
    assert (JS_DIR / "node_modules" / "ai").is_dir(), "run `npm ci` in tests/js (make js-deps)"
    async with server_process(
        pg_url,
        tool_modules='["tests.approval_tools"]',
        tools_requiring_approval='["transfer_funds"]',
        demo_tokens_per_second=40,
        rate_limit_per_minute=0,
        max_streams_per_user=0,
    ) as server:
        env = {
            **os.environ,
            "CHATMEM_URL": server.base_url,
            "CHATMEM_TOKEN": token_for("t1", "u1"),
            "CHATMEM_OTHER_USER_TOKEN": token_for("t1", "u2"),
            "CHATMEM_OTHER_TENANT_TOKEN": token_for("t2", "u1"),
        }
        await run_node_tests(JS_DIR, SUITE, env, timeout=SUITE_TIMEOUT_SECONDS)
