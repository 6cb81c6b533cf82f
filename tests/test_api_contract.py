"""Conversations, auth and bad input: clear 4xx bodies, nothing half-written, exact unicode."""

from __future__ import annotations

import time
import uuid
from typing import Any

import httpx
import jwt
import pytest
from sqlalchemy import func, select

from memory.storage.db import Database
from memory.storage.models import OutboxRow, Turn
from tests.conftest import TEST_SECRET, LiveServer


async def count_rows(db: Database) -> tuple[int, int]:
    async with db.transaction() as session:
        turns = (await session.execute(select(func.count()).select_from(Turn))).scalar_one()
        outbox = (await session.execute(select(func.count()).select_from(OutboxRow))).scalar_one()
    return turns, outbox


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()["error"]
    assert isinstance(body["code"], str) and isinstance(body["message"], str) and body["message"]
    if code:
        assert body["code"] == code
    return body  # type: ignore[no-any-return]


async def test_conversation_lifecycle_and_cursor_pagination(server: LiveServer) -> None:
    async with server.client() as client:
        ids = []
        for i in range(5):
            r = await client.post("/v1/conversations", json={"title": f"c{i}"})
            ids.append(r.json()["id"])
        seen, cursor = [], None
        while True:
            params = {"limit": 2, **({"cursor": cursor} if cursor else {})}
            page = (await client.get("/v1/conversations", params=params)).json()
            seen += [c["id"] for c in page["items"]]
            cursor = page["next_cursor"]
            if not cursor:
                break
        assert seen == list(reversed(ids))  # newest first, each exactly once

        renamed = await client.patch(
            f"/v1/conversations/{ids[0]}", json={"title": "新的名字 ✨", "memory_mode": "none"}
        )
        assert renamed.json()["title"] == "新的名字 ✨" and renamed.json()["memory_mode"] == "none"
        assert (await client.delete(f"/v1/conversations/{ids[0]}")).status_code == 204
        assert_error(await client.get(f"/v1/conversations/{ids[0]}"), 404, "not_found")
        assert_error(await client.delete(f"/v1/conversations/{ids[0]}"), 404)
        assert ids[0] not in [c["id"] for c in (await client.get("/v1/conversations")).json()["items"]]
        msg = await client.post(f"/v1/conversations/{ids[0]}/messages", json={"content": "hi"})
        assert_error(msg, 404)


async def test_other_tenants_and_users_get_404_everywhere(server: LiveServer) -> None:
    async with server.client("t1", "u1") as owner, server.client("t2", "u1") as other_tenant:
        cid = (await owner.post("/v1/conversations", json={})).json()["id"]
        reply = await owner.post(
            f"/v1/conversations/{cid}/messages", json={"content": "secret", "stream": False}
        )
        turn_id = reply.json()["turns"][-1]["id"]
        async with server.client("t1", "u2") as other_user:
            for intruder in (other_tenant, other_user):
                assert_error(await intruder.get(f"/v1/conversations/{cid}"), 404)
                assert_error(await intruder.get(f"/v1/conversations/{cid}/turns"), 404)
                assert_error(await intruder.get(f"/v1/conversations/{cid}/context"), 404)
                assert_error(await intruder.patch(f"/v1/conversations/{cid}", json={"title": "x"}), 404)
                assert_error(await intruder.delete(f"/v1/conversations/{cid}"), 404)
                assert_error(
                    await intruder.post(f"/v1/conversations/{cid}/messages", json={"content": "x"}), 404
                )
                assert_error(await intruder.get(f"/v1/turns/{turn_id}"), 404)
                assert_error(await intruder.post(f"/v1/turns/{turn_id}/stop"), 404)
                assert_error(await intruder.get(f"/v1/turns/{turn_id}/events"), 404)
                assert (await intruder.get("/v1/conversations")).json()["items"] == []
        assert (await owner.get(f"/v1/conversations/{cid}")).status_code == 200


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer"},
        {"Authorization": "Basic abc"},
        {"Authorization": "Bearer not-a-jwt"},
        {"Authorization": "Bearer " + jwt.encode({"tenant": "t", "sub": "u", "exp": 1}, TEST_SECRET)},
        {
            "Authorization": "Bearer "
            + jwt.encode({"tenant": "t", "sub": "u", "exp": 2**33}, "wrong-secret-" * 4)
        },
        {"Authorization": "Bearer " + jwt.encode({"sub": "u", "exp": 2**33}, TEST_SECRET)},
        {"Authorization": "Bearer " + jwt.encode({"tenant": "t", "sub": "u"}, TEST_SECRET)},
    ],
    ids=["missing", "empty", "basic", "garbage", "expired", "wrong-key", "no-tenant", "no-exp"],
)
async def test_bad_tokens_are_401(server: LiveServer, headers: dict[str, str]) -> None:
    async with httpx.AsyncClient(base_url=server.base_url) as client:
        assert_error(await client.get("/v1/conversations", headers=headers), 401, "unauthorized")


async def test_clock_skew_within_leeway_is_accepted(server: LiveServer) -> None:
    token = jwt.encode({"tenant": "t", "sub": "u", "exp": int(time.time()) - 5}, TEST_SECRET)
    async with httpx.AsyncClient(base_url=server.base_url) as client:
        r = await client.get("/v1/conversations", headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 200


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"content": ""}, 422, "invalid_input"),
        ({"content": "   \n\t "}, 422, "invalid_input"),
        ({"content": "x" * 32_001}, 422, "invalid_input"),
        ({"content": "a\x00b"}, 422, "invalid_input"),
        ({"content": "hi", "colour": "red"}, 422, "validation_error"),
        ({"content": 42}, 422, "validation_error"),
        ({"content": "hi", "on_busy": "later"}, 422, "validation_error"),
        ({}, 422, "validation_error"),
        ([], 422, "validation_error"),
    ],
    ids=[
        "empty",
        "whitespace",
        "too-long",
        "nul",
        "unknown-field",
        "wrong-type",
        "bad-enum",
        "missing",
        "array",
    ],
)
async def test_bad_messages_are_rejected_and_leave_nothing(
    server: LiveServer, db: Database, body: Any, status: int, code: str
) -> None:
    async with server.client() as client:
        cid = (await client.post("/v1/conversations", json={})).json()["id"]
        before = await count_rows(db)
        assert_error(await client.post(f"/v1/conversations/{cid}/messages", json=body), status, code)
        assert await count_rows(db) == before
        assert (await client.get(f"/v1/conversations/{cid}")).json()["active_reply_id"] is None


async def test_malformed_json_lone_surrogates_and_huge_bodies(server: LiveServer, db: Database) -> None:
    async with server.client() as client:
        cid = (await client.post("/v1/conversations", json={})).json()["id"]
        url = f"/v1/conversations/{cid}/messages"
        headers = {"Content-Type": "application/json"}
        assert_error(
            await client.post(url, content=b'{"content": "hi"', headers=headers), 422, "malformed_json"
        )
        assert_error(await client.post(url, content=b'{"content": "\\ud800"}', headers=headers), 422)
        assert_error(
            await client.post(url, content=b"x" * 2_000_000, headers=headers), 413, "payload_too_large"
        )
        assert_error(await client.get("/v1/conversations/not-a-uuid"), 422, "validation_error")
        assert_error(await client.get(f"/v1/conversations/{uuid.uuid4()}"), 404, "not_found")
        assert_error(await client.get(f"/v1/turns/{uuid.uuid4()}"), 404, "not_found")
        assert_error(await client.get("/v1/conversations", params={"cursor": "%%%"}), 422, "invalid_input")
        assert_error(await client.get("/v1/conversations", params={"limit": 0}), 422, "validation_error")
        assert await count_rows(db) == (0, 0)


UNICODE_SAMPLES = [
    "emoji 👩‍👩‍👧‍👦 🏳️‍🌈 🇯🇵",
    "中文：你好，世界！日本語：こんにちは",
    "العربية من اليمين إلى اليسار עִבְרִית",
    "combining: e\u0301 a\u0308 Z\u0335\u0321\u0353a\u0336\u0327l\u0334go",
    "zero width\u200b\u200djoiner and \ufeff BOM, tab\tnewline\n",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 astral plane 𐍈",
]


@pytest.mark.parametrize("text", UNICODE_SAMPLES)
async def test_unicode_round_trips_byte_for_byte(server: LiveServer, text: str) -> None:
    async with server.client() as client:
        cid = (await client.post("/v1/conversations", json={"title": text})).json()["id"]
        r = await client.post(f"/v1/conversations/{cid}/messages", json={"content": text, "stream": False})
        assert r.status_code == 200
        turns = (await client.get(f"/v1/conversations/{cid}/turns")).json()["items"]
        assert turns[0]["content"].encode() == text.encode()
        assert (await client.get(f"/v1/conversations/{cid}")).json()["title"] == text
        assert text[:50] in turns[1]["content"]  # the demo echoes it back in its reply


async def test_health_and_openapi(server: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=server.base_url) as client:
        assert (await client.get("/healthz")).json() == {"status": "ok"}
        assert (await client.get("/readyz")).json()["status"] == "ready"
        spec = (await client.get("/openapi.json")).json()
        assert "/v1/conversations/{conversation_id}/messages" in spec["paths"]
        assert (await client.get("/docs")).status_code == 200


async def test_token_command_prints_only_a_token(tmp_path: Any) -> None:
    import subprocess
    import sys

    from chat_api.auth import load_or_create_secret

    secret = load_or_create_secret(tmp_path)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "chat_api.cli",
            "token",
            "--data-dir",
            str(tmp_path),
            "--tenant",
            "acme",
            "--user",
            "ann",
        ],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    token = out.stdout.strip()
    assert "\n" not in token
    claims = jwt.decode(token, secret, algorithms=["HS256"])
    assert claims["tenant"] == "acme" and claims["sub"] == "ann"


async def test_serve_refuses_bad_settings_in_one_line(tmp_path: Any) -> None:
    import subprocess
    import sys

    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    no_db = subprocess.run(
        [sys.executable, "-m", "chat_api.cli", "serve"], capture_output=True, text=True, env=env
    )
    assert no_db.returncode == 2 and no_db.stderr.count("\n") == 1 and "DATABASE_URL" in no_db.stderr
    env |= {"DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none", "JWT_SECRET": "x" * 40}
    unreachable = subprocess.run(
        [sys.executable, "-m", "chat_api.cli", "serve"], capture_output=True, text=True, env=env, timeout=60
    )
    assert unreachable.returncode == 2 and "cannot reach DATABASE_URL" in unreachable.stderr
    assert "Traceback" not in unreachable.stderr
