"""Never a bare 500: every error answers chatmem's JSON error body, with no internal detail.

Found: `/static/%00` (no token needed), a NUL or lone surrogate in a signed `tenant` or
`sub` claim, and `Last-Event-ID` or `?after=` at 2^31 or more (the stream broke off
mid-body on an integer overflow) answered 500; an oversized chunked body (no
Content-Length) answered 400 where one with a Content-Length answers 413.
"""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import jwt
from fastapi import APIRouter

from chat_api.app import create_app
from memory.recall.embeddings import HashEmbedder
from tests.conftest import TEST_SECRET, LiveServer
from tests.support import new_conversation
from tests.test_api_contract import assert_error


def signed(claims: dict[str, Any]) -> dict[str, str]:
    token = jwt.encode({"exp": int(time.time()) + 600, **claims}, TEST_SECRET, algorithm="HS256")
    return {"Authorization": f"Bearer {token}"}


async def finished_turn(client: httpx.AsyncClient) -> str:
    cid = await new_conversation(client)
    r = await client.post(f"/v1/conversations/{cid}/messages", json={"content": "hello", "stream": False})
    assert r.status_code == 200, r.text
    return str(r.json()["turns"][-1]["id"])


async def test_static_path_with_a_nul_is_a_404_not_a_500(server: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=server.base_url) as anonymous:
        for path in ("/static/%00", "/static/a%00b.js", "/static/" + "x" * 5000):
            body = assert_error(await anonymous.get(path), 404, "not_found")
            assert "%00" not in body["message"] and "\x00" not in body["message"]


async def test_unstorable_characters_in_signed_identity_claims_are_a_401(server: LiveServer) -> None:
    bad_values = ["a\x00b", "a\ud800b", "tab\there", "x" * 129]
    async with httpx.AsyncClient(base_url=server.base_url) as client:
        for value in bad_values:
            for claims in ({"tenant": value, "sub": "u1"}, {"tenant": "t1", "sub": value}):
                r = await client.get("/v1/conversations", headers=signed(claims))
                assert_error(r, 401, "unauthorized")
                r = await client.post("/v1/conversations", headers=signed(claims), json={})
                assert_error(r, 401, "unauthorized")
        # The longest allowed identity works end to end.
        longest = signed({"tenant": "t" * 128, "sub": "ü" * 128})
        assert (await client.post("/v1/conversations", headers=longest, json={})).status_code == 201


async def test_event_positions_past_int32_are_a_422_before_the_stream(server: LiveServer) -> None:
    async with server.client() as client:
        turn_id = await finished_turn(client)
        url = f"/v1/turns/{turn_id}/events"
        for params, headers in (
            ({"after": 2**31}, {}),
            ({"after": 10**30}, {}),
            ({}, {"Last-Event-ID": str(2**31)}),
            ({}, {"Last-Event-ID": "9" * 32}),
            ({}, {"Last-Event-ID": b"\xb2"}),  # "²": str.isdigit() says yes, int() says no
        ):
            r = await client.get(url, params=params, headers=headers)
            assert r.status_code == 422, (params, headers, r.text)
            assert r.headers["content-type"].startswith("application/json")
        # The largest position is fine: nothing after it, the stream ends cleanly.
        r = await client.get(url, headers={"Last-Event-ID": str(2**31 - 1)})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")


async def test_oversized_chunked_body_answers_413_like_one_with_content_length(start_server: Any) -> None:
    server: LiveServer = await start_server(max_body_bytes=4096, import_max_body_bytes=4096)
    async with server.client() as client:
        cid = await new_conversation(client)

        async def chunks() -> AsyncIterator[bytes]:
            yield b'{"content": "'
            for _ in range(10):
                yield b"x" * 1000
            yield b'"}'

        for path in (f"/v1/conversations/{cid}/messages", f"/v1/conversations/{cid}/import"):
            sized = await client.post(path, content=b"{" + b" " * 5000 + b"}")
            chunked = await client.post(path, content=chunks(), headers={"Content-Type": "application/json"})
            assert "content-length" not in chunked.request.headers
            assert_error(sized, 413, "payload_too_large")
            assert_error(chunked, 413, "payload_too_large")


async def test_a_naive_or_out_of_range_cursor_is_a_422(server: LiveServer) -> None:
    async with server.client() as client:
        for when in ("2020-01-01T00:00:00", "0001-01-01T00:00:00+14:00"):
            raw = f'["{when}", "{uuid.uuid4()}"]'.encode()
            cursor = base64.urlsafe_b64encode(raw).decode()
            r = await client.get("/v1/conversations", params={"cursor": cursor})
            assert_error(r, 422)


async def test_an_unexpected_error_answers_the_json_body_with_no_detail(make_settings: Any) -> None:
    app = create_app(make_settings(), embedder=HashEmbedder())
    broken = APIRouter()

    @broken.get("/v1/broken")
    async def fail() -> None:
        raise RuntimeError("secret detail: SELECT * FROM turns")

    app.include_router(broken)
    server = LiveServer(app)
    await server.start()
    try:
        async with server.client() as client:
            r = await client.get("/v1/broken")
    finally:
        await server.stop()
    body = assert_error(r, 500, "internal_error")
    assert "secret" not in r.text and "SELECT" not in r.text and "Traceback" not in r.text
    assert body["message"] == "internal server error"
