"""RS256 verification with a PEM public key or a JWKS file (keys picked by `kid`)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from chat_api.auth import AuthError, TokenVerifier
from memory.config import get_settings


def rsa_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def claims(**extra: object) -> dict[str, object]:
    return {"tenant": "acme", "sub": "ann", "exp": int(time.time()) + 60, **extra}


def test_rs256_with_a_pem_public_key(tmp_path: Path) -> None:
    key = rsa_key()
    pem = tmp_path / "public.pem"
    pem.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    verifier = TokenVerifier(get_settings(jwt_public_key_file=pem))
    owner = verifier.verify(jwt.encode(claims(), key, algorithm="RS256"))
    assert (owner.tenant_id, owner.user_id) == ("acme", "ann")
    with pytest.raises(AuthError):  # another key's signature
        verifier.verify(jwt.encode(claims(), rsa_key(), algorithm="RS256"))
    with pytest.raises(AuthError):  # an HS256 token must not pass as RS256 (algorithm confusion)
        verifier.verify(jwt.encode(claims(), "secret-" * 8, algorithm="HS256"))


def test_rs256_with_a_jwks_file_chooses_the_key_by_kid(tmp_path: Path) -> None:
    old, new = rsa_key(), rsa_key()
    keys = []
    for kid, key in (("old", old), ("new", new)):
        jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key()))
        keys.append({**jwk, "kid": kid, "alg": "RS256", "use": "sig"})
    jwks = tmp_path / "jwks.json"
    jwks.write_text(json.dumps({"keys": keys}))
    verifier = TokenVerifier(get_settings(jwt_public_key_file=jwks))
    for kid, key in (("old", old), ("new", new)):
        token = jwt.encode(claims(), key, algorithm="RS256", headers={"kid": kid})
        assert verifier.verify(token).user_id == "ann"
    wrong = jwt.encode(claims(), old, algorithm="RS256", headers={"kid": "new"})
    with pytest.raises(AuthError):
        verifier.verify(wrong)
