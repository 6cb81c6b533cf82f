"""API keys: long-lived bearer keys that authenticate as one tenant and user.

A key is shown once, when it is made; only its SHA-256 is stored. A key is 32 random
bytes, so a plain hash (no salt, no slow KDF) is enough: nobody can guess the preimage,
and the lookup stays one indexed equality per request. Every request looks the hash up,
so a revocation (or an expiry) holds at once on every replica, with no cache to clear.
Functions take the caller's session and never commit.
"""

from __future__ import annotations

import hashlib
import secrets
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import delete, or_, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.sql import func

from memory.errors import InvalidInput, NotFound
from memory.record.conversations import Owner
from memory.storage.models import ApiKey

KEY_PREFIX = "cmk_"
MAX_NAME_CHARS = 200
MAX_EXPIRES_DAYS = 3650


@dataclass(frozen=True, slots=True)
class KeyInfo:
    """What is shown about a key after it was made: never the key itself."""

    id: uuid.UUID
    name: str
    prefix: str
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None

    @classmethod
    def of(cls, row: ApiKey) -> KeyInfo:
        return cls(row.id, row.name, row.prefix, row.created_at, row.expires_at, row.revoked_at)


def looks_like_key(token: str) -> bool:
    """True when a bearer token is an API key rather than a JWT."""
    return token.startswith(KEY_PREFIX)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


async def create_key(
    session: AsyncSession, owner: Owner, *, name: str = "", expires_days: float | None = None
) -> tuple[KeyInfo, str]:
    """Store a new key for `owner`; returns its description and the key (the only time it exists)."""
    if len(name) > MAX_NAME_CHARS:
        raise InvalidInput(f"name is longer than {MAX_NAME_CHARS} characters", field="name")
    if expires_days is not None and not 0 < expires_days <= MAX_EXPIRES_DAYS:
        raise InvalidInput(f"expires must be between 0 and {MAX_EXPIRES_DAYS} days", field="expires_days")
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    now = datetime.now(UTC)
    row = ApiKey(
        id=uuid.uuid4(),
        tenant_id=owner.tenant_id,
        user_id=owner.user_id,
        name=name,
        prefix=key[:12],
        key_hash=hash_key(key),
        created_at=now,
        expires_at=None if expires_days is None else now + timedelta(days=expires_days),
    )
    session.add(row)
    await session.flush()
    return KeyInfo.of(row), key


async def list_keys(session: AsyncSession, owner: Owner) -> list[KeyInfo]:
    """The owner's keys, newest first, revoked ones included (marked)."""
    rows = await session.execute(
        select(ApiKey)
        .where(ApiKey.tenant_id == owner.tenant_id, ApiKey.user_id == owner.user_id)
        .order_by(ApiKey.created_at.desc(), ApiKey.id)
    )
    return [KeyInfo.of(row) for row in rows.scalars()]


async def revoke_key(session: AsyncSession, owner: Owner, key_id: uuid.UUID) -> KeyInfo:
    """Revoke one of the owner's keys (again is fine); NotFound for anyone else's."""
    row = (
        await session.execute(
            select(ApiKey)
            .where(ApiKey.id == key_id, ApiKey.tenant_id == owner.tenant_id, ApiKey.user_id == owner.user_id)
            .with_for_update()
        )
    ).scalar_one_or_none()
    if row is None:
        raise NotFound("api key not found", key_id=str(key_id))
    if row.revoked_at is None:
        row.revoked_at = datetime.now(UTC)
        await session.flush()
    return KeyInfo.of(row)


async def delete_keys(session: AsyncSession, owner: Owner) -> int:
    """Delete every key of the owner (a deleted user keeps no way in); returns how many."""
    result = await session.execute(
        delete(ApiKey).where(ApiKey.tenant_id == owner.tenant_id, ApiKey.user_id == owner.user_id)
    )
    return int(getattr(result, "rowcount", 0) or 0)


async def owner_of_key(session: AsyncSession, key: str) -> Owner | None:
    """The owner a live key authenticates as; None for an unknown, revoked or expired key.

    Runs before any tenant is known, so it must run unscoped (as the connecting role).
    """
    row = (
        await session.execute(
            select(ApiKey.tenant_id, ApiKey.user_id).where(
                ApiKey.key_hash == hash_key(key),
                ApiKey.revoked_at.is_(None),
                or_(ApiKey.expires_at.is_(None), ApiKey.expires_at > func.now()),
            )
        )
    ).first()
    return None if row is None else Owner(tenant_id=row.tenant_id, user_id=row.user_id)
