"""`POST /openai/v1/responses/compact`: the Responses API's compaction, done the chatmem way.

chatmem's prompt is already compact (the sanitized recent window and recalled memory), so
compacting is storing: the input goes into a conversation, after the response or
compaction item it follows (a new branch if that branch moved on) or into a new one, and
the answer is one compaction item naming where that history ends. A response whose input
starts with that item goes on from there (`responses_routes.py`). Only
user and assistant text is kept as turns; the item is opaque to clients and names a turn
only its owner can continue from.

It is not held to the prompt's room (`chat_api.admission.prompt_room`): nothing here goes to a
model, and the turns it keeps are history, which a prompt's window leaves out when it does not
fit. The response that goes on from the item is held to the room like any other.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import Request

from chat_api.admission import AdmissionDep, door_router
from chat_api.deps import OwnerDep, ServicesDep
from chat_api.protocols.openai.responses import usage_object
from chat_api.protocols.openai.responses_input import compaction_token
from chat_api.protocols.openai.responses_request import parse_compaction
from chat_api.protocols.openai.responses_routes import (
    LastTurn,
    after_response,
    after_turn,
    continue_after,
    import_history,
    previous_response,
)
from chat_api.protocols.openai.routes import OpenAIRoute, read_request
from memory.errors import InvalidInput
from memory.record.branches import conversation_branch, newest_turn
from memory.record.conversations import create_conversation, get_conversation

router = door_router(prefix="/openai/v1", tags=["openai"], route_class=OpenAIRoute)


@router.post("/responses/compact")
async def compact(
    request: Request, owner: OwnerDep, services: ServicesDep, admission: AdmissionDep
) -> dict[str, Any]:
    """Keep the history in a chatmem conversation and answer one compaction item that continues it."""
    asked = await read_request(await request.json(), services, parse_compaction)
    after: LastTurn | None = None
    if asked.previous_response_id is not None:
        after = after_response(await previous_response(services, owner, asked.previous_response_id))
    elif asked.compacted is not None:
        after = after_turn(owner, asked.compacted)
    async with services.db.transaction() as session:
        if after is not None:
            last = await after(session)
            conversation = await get_conversation(session, owner, last.conversation_id, for_update=True)
            await continue_after(session, conversation, last)
        else:
            first = next((m.text for m in asked.messages if m.role == "user"), "")
            conversation = await create_conversation(session, owner, title=" ".join(first.split())[:80])
        # Within the import admission; a refusal rolls back the new conversation too.
        await import_history(admission, session, owner, conversation, asked.messages)
        end = await newest_turn(session, await conversation_branch(session, conversation))
        if end is None:
            raise InvalidInput("there is nothing to compact", field="input")
    item = {
        "id": f"cmp_{uuid.uuid4().hex}",
        "type": "compaction",
        "encrypted_content": compaction_token(end.id),
        "created_by": "chatmem",
    }
    words = sum(len(m.text.split()) for m in asked.messages)
    return {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response.compaction",
        "created_at": int(time.time()),
        "output": [item],
        "usage": usage_object({"prompt_tokens": words, "completion_tokens": 0}),
    }
