"""Bearer JWT verification: the token's tenant and subject are the only source of identity."""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path
from typing import Any

import jwt
from jwt.algorithms import RSAAlgorithm

from memory.accounts.keys import looks_like_key, owner_of_key
from memory.config import Settings
from memory.json_bounds import text_problem
from memory.record.conversations import Owner
from memory.storage.db import Database
from memory.storage.tenancy import unscoped

TENANT_CLAIM = "tenant"
# The longest tenant or user id a token may carry.
MAX_IDENTITY_CHARS = 128  # the tenant_id and user_id columns are String(128)


class AuthError(Exception):
    """The request has no valid token (401)."""


class KeyFileError(Exception):
    """JWT_PUBLIC_KEY_FILE cannot be read as a public key (the server refuses to start)."""


class TokenVerifier:
    """Verifies HS256 tokens with the configured secret, or RS256 with a PEM/JWKS public key."""

    def __init__(self, settings: Settings) -> None:
        self.leeway = settings.jwt_leeway_seconds
        self.audience = settings.jwt_audience
        self._keys: dict[str, Any] = {}
        self._default_key: Any = None
        if settings.jwt_public_key_file is not None:
            self.algorithms = ["RS256"]
            self._load_public_keys(settings.jwt_public_key_file)
        else:
            if settings.jwt_secret is None:
                raise ValueError("JWT_SECRET is not set")
            self.algorithms = ["HS256"]
            self._default_key = settings.jwt_secret.get_secret_value()

    def _load_public_keys(self, path: Path) -> None:
        # Checked here, at start: a key that cannot be read would otherwise answer 401 to everyone.
        try:
            raw = path.read_text()
            if raw.lstrip().startswith("{"):
                for jwk in json.loads(raw).get("keys", []):
                    key = jwt.PyJWK(jwk).key
                    self._keys[jwk.get("kid", "")] = key
                    self._default_key = self._default_key or key
                if self._default_key is None:
                    raise ValueError("the JWKS holds no key")
            else:
                self._default_key = RSAAlgorithm(RSAAlgorithm.SHA256).prepare_key(raw)
        except (OSError, ValueError, jwt.PyJWTError) as exc:
            raise KeyFileError(f"JWT_PUBLIC_KEY_FILE {path}: {exc}".splitlines()[0]) from None

    def accepts(self, token: str) -> bool:
        """True when `verify` would accept the token now."""
        try:
            self.verify(token)
        except AuthError:
            return False
        return True

    def verify(self, token: str) -> Owner:
        """Return the owner named by a valid token, or raise AuthError."""
        try:
            header = jwt.get_unverified_header(token)
            key = self._keys.get(header.get("kid", ""), self._default_key)
            claims = jwt.decode(
                token,
                key,
                algorithms=self.algorithms,
                leeway=self.leeway,
                audience=self.audience,
                options={"require": ["sub", "exp"], "verify_aud": self.audience is not None},
            )
        except jwt.ExpiredSignatureError as exc:
            raise AuthError("token expired") from exc
        except jwt.PyJWTError as exc:
            raise AuthError(f"invalid token: {exc}") from exc
        tenant, user = claims.get(TENANT_CLAIM), claims.get("sub")
        if not isinstance(tenant, str) or not tenant or not isinstance(user, str) or not user:
            raise AuthError("token lacks tenant or sub")
        for name, value in ((TENANT_CLAIM, tenant), ("sub", user)):
            # Signed is not the same as storable: these become query parameters and row values.
            if len(value) > MAX_IDENTITY_CHARS:
                raise AuthError(f"token's {name} is longer than {MAX_IDENTITY_CHARS} characters")
            if text_problem(value) is not None or not value.isprintable():
                raise AuthError(f"token's {name} holds characters an identity cannot have")
        return Owner(tenant_id=tenant, user_id=user)


async def verify_api_key(db: Database, key: str) -> Owner:
    """The owner of a live API key, or AuthError; looked up per request, so a revocation holds at once."""
    with unscoped():  # no tenant is known yet: the lookup by hash sees every tenant's keys
        async with db.session() as session:
            owner = await owner_of_key(session, key)
    if owner is None:
        raise AuthError("invalid, revoked or expired api key")
    return owner


def is_api_key(token: str) -> bool:
    """An API key (`cmk_…`) rather than a JWT."""
    return looks_like_key(token)


def issue_token(secret: str, tenant: str, user: str, *, ttl_seconds: int = 30 * 24 * 3600) -> str:
    """An HS256 token for (tenant, user), as the embedded installation hands out."""
    now = int(time.time())
    return jwt.encode(
        {TENANT_CLAIM: tenant, "sub": user, "iat": now, "exp": now + ttl_seconds}, secret, algorithm="HS256"
    )


def load_or_create_secret(data_dir: Path) -> str:
    """The embedded installation's local secret, created on first use (mode 0600)."""
    path = data_dir / "jwt_secret"
    if path.exists():
        return path.read_text().strip()
    data_dir.mkdir(parents=True, exist_ok=True)
    secret = secrets.token_urlsafe(48)
    path.touch(mode=0o600)
    path.write_text(secret)
    return secret
