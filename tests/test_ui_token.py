"""The page's token stays on the machine.

Found: `/ui/config` handed the access token to any request whatever its `Host`, which a
DNS-rebinding page (evil.example resolving to 127.0.0.1) could read. Now only a request
addressed to a loopback name, from a loopback page when the browser names one, gets it;
UI_TOKEN_HANDOUT=false turns it off; and an RS256 server never hands out an HS256 token
it would refuse.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from chat_api.app import create_app
from chat_api.auth import issue_token
from chat_api.routes.page import loopback_request
from memory.recall.embeddings import HashEmbedder
from tests.conftest import TEST_SECRET, LiveServer


async def started(make_settings: Any, token: str, **overrides: Any) -> LiveServer:
    server = LiveServer(create_app(make_settings(**overrides), ui_token=token, embedder=HashEmbedder()))
    await server.start()
    return server


async def handed_out(server: LiveServer, headers: dict[str, str]) -> Any:
    async with httpx.AsyncClient(base_url=server.base_url) as client:
        r = await client.get("/ui/config", headers=headers)
    assert r.status_code == 200, r.text
    return r.json()["token"]


async def test_ui_token_is_handed_only_to_a_loopback_host_and_origin(make_settings: Any) -> None:
    token = issue_token(TEST_SECRET, "local", "me")
    server = await started(make_settings, token)
    port = server.port
    try:
        for host, origin in (
            (f"127.0.0.1:{port}", None),
            (f"localhost:{port}", f"http://localhost:{port}"),
            (f"[::1]:{port}", f"http://127.0.0.1:{port}"),
        ):
            headers = {"Host": host, **({"Origin": origin} if origin else {})}
            assert await handed_out(server, headers) == token, headers
        for host, origin in (
            (f"evil.example:{port}", None),  # DNS rebinding: the attacker's name, our address
            ("evil.example", None),
            (f"127.0.0.1.evil.example:{port}", None),
            (f"127.0.0.1:{port}", "http://evil.example"),  # a page elsewhere asking by IP
            (f"localhost:{port}", "null"),
            ("[::1", None),
        ):
            headers = {"Host": host, **({"Origin": origin} if origin else {})}
            assert await handed_out(server, headers) is None, headers
        # The request itself is still served, only without the token.
        async with httpx.AsyncClient(base_url=server.base_url) as client:
            config = (await client.get("/ui/config", headers={"Host": "evil.example"})).json()
        assert config["llm_provider"] == "demo" and config["token"] is None
    finally:
        await server.stop()


async def test_ui_token_handout_can_be_turned_off(make_settings: Any) -> None:
    server = await started(make_settings, issue_token(TEST_SECRET, "local", "me"), ui_token_handout=False)
    try:
        assert await handed_out(server, {"Host": f"127.0.0.1:{server.port}"}) is None
    finally:
        await server.stop()


async def test_rs256_server_never_hands_out_an_hs256_token(make_settings: Any, tmp_path: Path) -> None:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    public_key = tmp_path / "public.pem"
    public_key.write_bytes(pem)
    server = await started(
        make_settings, issue_token(TEST_SECRET, "local", "me"), jwt_public_key_file=str(public_key)
    )
    try:
        assert await handed_out(server, {"Host": f"127.0.0.1:{server.port}"}) is None
    finally:
        await server.stop()


def test_loopback_request_reads_host_and_origin_strictly() -> None:
    assert loopback_request("localhost", None)
    assert loopback_request("LOCALHOST:8000", "http://LocalHost:8000")
    assert not loopback_request(None, None)
    assert not loopback_request("", None)
    assert not loopback_request("localhost.", None)
    assert not loopback_request("0.0.0.0:8000", None)
    assert not loopback_request("localhost:8000", "file://")
