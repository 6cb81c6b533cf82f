"""A side-effecting tool for approval tests, loadable by `TOOL_MODULES` in a real server process.

Every run appends one line to the file named by `APPROVAL_TOOL_LOG`, so a test can count
runs across processes that were killed and restarted.
"""

from __future__ import annotations

import json
import os
from typing import Any

from chat_api.tools import Tool, ToolContext, ToolRegistry


async def _transfer(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    path = os.environ.get("APPROVAL_TOOL_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as log:
            log.write(json.dumps({"turn_id": str(ctx.turn_id), "args": args}) + "\n")
    return {"transferred": args.get("amount"), "to": args.get("to")}


TRANSFER = Tool(
    name="transfer_funds",
    description="Moves money to another account.",
    parameters={
        "type": "object",
        "properties": {"amount": {"type": "number"}, "to": {"type": "string"}},
        "required": ["amount", "to"],
    },
    func=_transfer,
    side_effects=True,
)


def register(registry: ToolRegistry) -> None:
    registry.register(TRANSFER)
