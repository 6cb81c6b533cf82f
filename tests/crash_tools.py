"""A side-effecting tool that never returns, loadable by `TOOL_MODULES` in a real server process.

It appends one line to the file named by `CRASH_TOOL_LOG` as it starts (the side effect), then
waits until its process is killed, so a test can crash a server while the tool runs.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

from chat_api.tools import Tool, ToolContext, ToolRegistry


async def _send_invoice(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    path = os.environ.get("CRASH_TOOL_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as log:
            log.write(json.dumps({"turn_id": str(ctx.turn_id), "args": args}) + "\n")
    await asyncio.Event().wait()
    return {"sent": True}


SEND_INVOICE = Tool(
    name="send_invoice",
    description="Sends an invoice to a customer.",
    parameters={"type": "object", "properties": {"to": {"type": "string"}}, "required": ["to"]},
    func=_send_invoice,
    side_effects=True,
)


def register(registry: ToolRegistry) -> None:
    registry.register(SEND_INVOICE)
