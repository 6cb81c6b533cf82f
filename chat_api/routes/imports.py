"""Importing past turns into a conversation: `POST /v1/conversations/{id}/import`.

A route with a body limit of its own (IMPORT_MAX_BODY_BYTES). The body is parsed by
the door's decoder and the turns validated and charged by the import admission
(`chat_api.admission`), both in a worker thread when large: a batch of thousands of
turns is megabytes of JSON, too much CPU for the event loop. Validation is the domain's
(``memory.record.imports``), so every error names the offending item's ``index``; the OpenAPI
schema below documents the same shape.
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import Request
from pydantic import BaseModel, Field

from chat_api.admission import AdmissionDep, door_router
from chat_api.deps import OwnerDep, ServicesDep
from chat_api.schemas import ErrorOut
from memory.errors import InvalidInput
from memory.record.imports import DEFAULT_MAX_TURNS, ImportResult, ImportTurn, import_turns

router = door_router(prefix="/v1/conversations", tags=["import"])

REQUEST_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["turns"],
    "additionalProperties": False,
    "properties": {
        "turns": {
            "type": "array",
            "minItems": 1,
            "description": f"Past turns (at most {DEFAULT_MAX_TURNS} a request by default).",
            "items": ImportTurn.model_json_schema(),
        }
    },
}


class ImportedItemOut(BaseModel):
    index: int = Field(description="Position of the item in the request.")
    turn_id: uuid.UUID
    seq: int
    external_id: str | None
    status: str = Field(description="created, or skipped (its external_id was already imported).")


class ImportOut(BaseModel):
    conversation_id: uuid.UUID
    created: int
    skipped: int
    last_seq: int = Field(
        description="The batch is searchable once GET /v1/conversations/{id} shows indexed_seq >= last_seq."
    )
    turn_count: int
    indexed_seq: int
    items: list[ImportedItemOut]

    @classmethod
    def of(cls, result: ImportResult) -> ImportOut:
        return cls(
            conversation_id=result.conversation_id,
            created=result.created,
            skipped=result.skipped,
            last_seq=result.last_seq,
            turn_count=result.turn_count,
            indexed_seq=result.indexed_seq,
            items=[
                ImportedItemOut(
                    index=i.index,
                    turn_id=i.turn_id,
                    seq=i.seq,
                    external_id=i.external_id,
                    status="created" if i.created else "skipped",
                )
                for i in result.items
            ],
        )


@router.post(
    "/{conversation_id}/import",
    status_code=201,
    openapi_extra={
        "requestBody": {"required": True, "content": {"application/json": {"schema": REQUEST_SCHEMA}}}
    },
    responses={
        404: {"model": ErrorOut, "description": "No such conversation (or not the caller's)."},
        409: {"model": ErrorOut, "description": "A reply is streaming in this conversation."},
        429: {"model": ErrorOut, "description": "Over the user's IMPORT_TURNS_PER_HOUR (see Retry-After)."},
        413: {"model": ErrorOut, "description": "The body is over the size limit."},
        422: {"model": ErrorOut, "description": "A bad item; details.index names it. Nothing was stored."},
    },
)
async def import_conversation_turns(
    conversation_id: uuid.UUID,
    request: Request,
    owner: OwnerDep,
    services: ServicesDep,
    admission: AdmissionDep,
) -> ImportOut:
    """Append past turns atomically; items whose external_id is already there are skipped."""
    document = await request.json()
    if not isinstance(document, dict):
        raise InvalidInput("the body must be an object with `turns`", field="body")
    unknown = sorted(set(document) - {"turns"})
    if unknown:
        raise InvalidInput(f"unknown fields: {', '.join(unknown)}", field=unknown[0])
    if "turns" not in document:
        raise InvalidInput("turns is required", field="turns")
    # 422 for a bad item, 429 with Retry-After past IMPORT_TURNS_PER_HOUR.
    with await admission.admit_import(owner, document["turns"]) as admitted:
        async with services.db.transaction() as session:
            result = await import_turns(session, owner, conversation_id, admitted.turns)
        admitted.settle(result.created)  # skipped items are given back
    return ImportOut.of(result)
