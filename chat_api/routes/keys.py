"""API keys of the signed-in user: `POST/GET /v1/keys`, `DELETE /v1/keys/{id}`.

A key made here authenticates as the same tenant and user, everywhere a token does; it
is in the answer to POST only, never again. Making and revoking keys needs a signed-in
session token (403 `session_token_required` for an API key): a key that could mint keys
would live on in them after its own revocation. Listing works with either.
"""

from __future__ import annotations

import uuid
from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

from chat_api.admission import door_router
from chat_api.deps import OwnerDep, ServicesDep, SessionOwnerDep
from chat_api.schemas import ErrorOut
from memory.accounts.keys import MAX_EXPIRES_DAYS, MAX_NAME_CHARS, KeyInfo, create_key, list_keys, revoke_key

router = door_router(prefix="/v1/keys", tags=["keys"])


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field("", max_length=MAX_NAME_CHARS, description="A label to tell keys apart.")
    expires_days: float | None = Field(
        None, gt=0, le=MAX_EXPIRES_DAYS, description="Lifetime in days; none: until revoked."
    )


class KeyOut(BaseModel):
    id: uuid.UUID
    name: str
    prefix: str = Field(description="The key's first characters, to recognise it.")
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None

    @classmethod
    def of(cls, info: KeyInfo) -> KeyOut:
        return cls(
            id=info.id,
            name=info.name,
            prefix=info.prefix,
            created_at=info.created_at,
            expires_at=info.expires_at,
            revoked_at=info.revoked_at,
        )


class KeyCreated(KeyOut):
    key: str = Field(description="The key itself: shown this once, only its hash is stored.")


class KeyList(BaseModel):
    items: list[KeyOut]


@router.post(
    "",
    status_code=201,
    response_model=KeyCreated,
    responses={
        403: {"model": ErrorOut, "description": "An API key may not make keys."},
        422: {"model": ErrorOut},
    },
)
async def create(body: KeyCreate, owner: SessionOwnerDep, services: ServicesDep) -> KeyCreated:
    """Make a key for the caller; the answer is the only place it ever appears."""
    async with services.db.transaction() as session:
        info, key = await create_key(session, owner, name=body.name, expires_days=body.expires_days)
    return KeyCreated(**KeyOut.of(info).model_dump(), key=key)


@router.get("", response_model=KeyList)
async def list_(owner: OwnerDep, services: ServicesDep) -> KeyList:
    """The caller's keys, newest first (revoked ones too, with `revoked_at`)."""
    async with services.db.session() as session:
        keys = await list_keys(session, owner)
    return KeyList(items=[KeyOut.of(k) for k in keys])


@router.delete(
    "/{key_id}",
    response_model=KeyOut,
    responses={
        403: {"model": ErrorOut, "description": "An API key may not revoke keys."},
        404: {"model": ErrorOut},
    },
)
async def revoke(key_id: uuid.UUID, owner: SessionOwnerDep, services: ServicesDep) -> KeyOut:
    """Revoke one of the caller's keys: requests with it get 401 from now on, on every replica."""
    async with services.db.transaction() as session:
        info = await revoke_key(session, owner, key_id)
    return KeyOut.of(info)
