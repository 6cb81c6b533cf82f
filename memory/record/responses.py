"""Stored Responses API responses: which chatmem reply each one is, and what was asked of it.

A response is a chatmem reply (the row's id is the reply id), so its turns, status and
event log are the reply's. What the Responses API also returns and chatmem's turns do
not hold is kept here: the request's options, echoed back on every read (instructions,
tools, tool_choice, metadata, sampling), the response it continued, and the input items
it was sent (for `GET /responses/{id}/input_items`). `store: false` writes no row, so
such a response cannot be read back or continued, while its turns stay in the
conversation like any other. Deleting a response hides the row; the conversation's turns
stay. Rows go with their conversation (ON DELETE CASCADE). Functions take a session and
never commit.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from memory.errors import NotFound
from memory.record.conversations import Owner

INSERT_RESPONSE = text(
    """
    INSERT INTO responses
        (id, tenant_id, user_id, conversation_id, previous_response_id, request, input_items)
    VALUES (:id, :tenant_id, :user_id, :conversation_id, :previous_response_id,
            CAST(:request AS jsonb), CAST(:input_items AS jsonb))
    """
)

FIND_RESPONSE = text(
    """
    SELECT r.id, r.conversation_id, r.previous_response_id, r.request, r.input_items, r.created_at
    FROM responses r JOIN conversations c ON c.id = r.conversation_id
    WHERE r.id = :id AND r.tenant_id = :tenant_id AND r.user_id = :user_id
      AND r.deleted_at IS NULL AND c.deleted_at IS NULL
    """
)

DELETE_RESPONSE = text(
    """
    UPDATE responses SET deleted_at = now()
    WHERE id = :id AND tenant_id = :tenant_id AND user_id = :user_id AND deleted_at IS NULL
    RETURNING id
    """
)


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """One stored response: its reply, conversation, and the request it answered."""

    id: uuid.UUID
    conversation_id: uuid.UUID
    previous_response_id: uuid.UUID | None
    request: dict[str, Any]
    input_items: list[dict[str, Any]]
    created_at: datetime


async def record_response(
    session: AsyncSession,
    owner: Owner,
    *,
    reply_id: uuid.UUID,
    conversation_id: uuid.UUID,
    previous_response_id: uuid.UUID | None,
    request: dict[str, Any],
    input_items_json: str,
) -> None:
    """Keep the request beside the reply it started (in the caller's transaction). The input
    items come as JSON text: a request's history may be megabytes, encoded off the event loop."""
    await session.execute(
        INSERT_RESPONSE,
        {
            "id": reply_id,
            "tenant_id": owner.tenant_id,
            "user_id": owner.user_id,
            "conversation_id": conversation_id,
            "previous_response_id": previous_response_id,
            "request": json.dumps(request, ensure_ascii=False),
            "input_items": input_items_json,
        },
    )


async def find_response(session: AsyncSession, owner: Owner, response_id: uuid.UUID) -> StoredResponse:
    """The owner's stored response; NotFound for an unknown, deleted or someone else's id."""
    row = (
        await session.execute(
            FIND_RESPONSE, {"id": response_id, "tenant_id": owner.tenant_id, "user_id": owner.user_id}
        )
    ).one_or_none()
    if row is None:
        raise NotFound("response not found", response_id=str(response_id))
    return StoredResponse(
        id=row.id,
        conversation_id=row.conversation_id,
        previous_response_id=row.previous_response_id,
        request=dict(row.request),
        input_items=list(row.input_items),
        created_at=row.created_at,
    )


async def delete_response(session: AsyncSession, owner: Owner, response_id: uuid.UUID) -> None:
    """Hide the owner's response from every read (its turns stay); NotFound if there is none."""
    row = await session.execute(
        DELETE_RESPONSE, {"id": response_id, "tenant_id": owner.tenant_id, "user_id": owner.user_id}
    )
    if row.scalar_one_or_none() is None:
        raise NotFound("response not found", response_id=str(response_id))
