"""The door every authenticated request passes: who it is, before any work, in the protocol's own shape.

Found: a body was read and parsed before its token was checked (a 24 MB unauthenticated
body cost a second of event-loop CPU); the 25 MB import limit applied to any path ending
in `/import`; an API key could mint keys that outlived its revocation, revoke its
owner's other keys and delete the user; and odd inputs (JSON nested 1,000 levels, a
4,300-digit integer, NUL or lone surrogates in ids, a time before year one in UTC)
answered bare 500s, on the OpenAI adapter in chatmem's shape instead of OpenAI's.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from fastapi import APIRouter
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute
from openai import AsyncOpenAI

from chat_api.admission import OwnerDep, door_router, unguarded_routes
from tests.conftest import LiveServer, auth, token_for
from tests.support import new_conversation

MODEL = "chatmem-demo"


async def raw_request(server: LiveServer, head: bytes, body_part: bytes = b"") -> bytes:
    """Send a request head (and part of its body), then read what the server answers before the rest."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        writer.write(head + body_part)
        await writer.drain()
        async with asyncio.timeout(5):
            return await reader.read(65536)
    finally:
        writer.close()


def head(method: str, path: str, length: int, token: str | None = None) -> bytes:
    lines = [
        f"{method} {path} HTTP/1.1",
        "Host: 127.0.0.1",
        "Content-Type: application/json",
        f"Content-Length: {length}",
    ]
    if token is not None:
        lines.append(f"Authorization: Bearer {token}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def test_unauthenticated_body_is_refused_before_it_is_read(server: LiveServer) -> None:
    path = "/v1/conversations/00000000-0000-0000-0000-000000000000/messages"
    # 900 kB announced, 10 bytes sent: the answer comes without waiting for the rest.
    answer = await raw_request(server, head("POST", path, 900_000), b'{"content"')
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    answer = await raw_request(server, head("POST", path, 900_000, "not-a-token"), b'{"content"')
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    openai_path = "/openai/v1/chat/completions"
    answer = await raw_request(server, head("POST", openai_path, 900_000), b'{"model"')
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    assert b'"invalid_api_key"' in answer  # OpenAI's shape on OpenAI's door


async def test_the_large_body_limit_is_the_import_routes_only(start_server: Any) -> None:
    server: LiveServer = await start_server(max_body_bytes=10_000, import_max_body_bytes=100_000)
    big = {"text": "x" * 50_000}
    async with server.client() as api:
        # A path that merely ends in /import gets the ordinary limit.
        for method, path in (("PATCH", "/v1/memory/items/import"), ("POST", "/v1/memory/items/import")):
            r = await api.request(method, path, json=big)
            assert r.status_code == 413, (method, path, r.status_code, r.text)
        # Announced over the limit and not sent: refused before it is read, too.
        answer = await raw_request(server, head("PATCH", "/v1/memory/items/import", 50_000, token_for()))
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        cid = await new_conversation(api)
        turns = [{"role": "user", "content": "y" * 1000} for _ in range(40)]
        imported = await api.post(f"/v1/conversations/{cid}/import", json={"turns": turns})
        assert imported.status_code == 201, imported.text


async def test_an_api_key_cannot_mint_revoke_keys_or_delete_its_user(server: LiveServer) -> None:
    async with server.client() as api:
        first = (await api.post("/v1/keys", json={"name": "first"})).json()
        second = (await api.post("/v1/keys", json={"name": "second"})).json()
        cid = await new_conversation(api)
    with_key = {"Authorization": f"Bearer {first['key']}"}
    async with httpx.AsyncClient(base_url=server.base_url, headers=with_key) as keyed:
        for method, path, body in (
            ("POST", "/v1/keys", {"name": "minted by a key"}),
            ("DELETE", f"/v1/keys/{second['id']}", None),
            ("DELETE", "/v1/users/me", None),
        ):
            r = await keyed.request(method, path, json=body)
            assert r.status_code == 403, (method, path, r.text)
            assert r.json()["error"]["code"] == "session_token_required"
        # Everything else works with the key as before.
        assert (await keyed.get(f"/v1/conversations/{cid}")).status_code == 200
        assert (await keyed.get("/v1/keys")).status_code == 200
    async with server.client() as api:
        keys = {k["name"]: k for k in (await api.get("/v1/keys")).json()["items"]}
        assert set(keys) == {"first", "second"} and keys["second"]["revoked_at"] is None
        assert (await api.delete(f"/v1/keys/{first['id']}")).status_code == 200
    async with httpx.AsyncClient(base_url=server.base_url, headers=with_key) as keyed:
        assert (await keyed.get(f"/v1/conversations/{cid}")).status_code == 401


# --- odd inputs: a 4xx in the protocol's own shape, never a 500 ---------------------------

DEEP = "[" * 1100 + "]" * 1100
HUGE_INT = "1" * 4301


def openai_bodies() -> list[tuple[str, bytes]]:
    """The inputs that answered 500 at /openai/v1/chat/completions."""
    ask = '{"model": "%s", "messages": [{"role": "user", "content": "hi"}]%s}'
    tool = (
        '{"model": "%s", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", '
        '"tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, '
        '{"role": "tool", "tool_call_id": "%s", "content": "ok"}]}'
    )
    return [
        ("deep json", (ask % (MODEL, ', "metadata": {"x": ' + DEEP + "}")).encode()),
        ("huge integer", (ask % (MODEL, ', "n": ' + HUGE_INT)).encode()),
        ("lone surrogate chat key", (ask % (MODEL, ', "metadata": {"chat_key": "\\udc00"}')).encode()),
        ("lone surrogate user", (ask % (MODEL, ', "user": "chat:\\ud800"')).encode()),
        ("nul in tool_call_id", (tool % (MODEL, "c\\u0000")).encode()),
        ("lone surrogate tool_call_id", (tool % (MODEL, "\\udfff")).encode()),
        ("nul in content", (ask % (MODEL, "")).replace('"hi"', '"h\\u0000i"').encode()),
    ]


@pytest.mark.parametrize("name", [name for name, _ in openai_bodies()])
async def test_odd_openai_bodies_are_openai_shaped_4xx_not_500(server: LiveServer, name: str) -> None:
    body = dict(openai_bodies())[name]
    async with httpx.AsyncClient(base_url=server.base_url, headers=auth()) as http:
        r = await http.post(
            "/openai/v1/chat/completions", content=body, headers={"Content-Type": "application/json"}
        )
        assert 400 <= r.status_code < 500, (r.status_code, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert error["type"] == "invalid_request_error"
        assert r.headers.get("connection") != "close"
        # Nothing was stored.
        assert (await http.get("/v1/conversations")).json()["items"] == []


async def test_the_openai_sdk_reads_a_refused_odd_input_as_its_own_error(server: LiveServer) -> None:
    async with AsyncOpenAI(base_url=f"{server.base_url}/openai/v1", api_key=token_for(), max_retries=0) as c:
        for extra in ({"metadata": {"chat_key": "k\x00"}}, {"user": "chat:\x00"}):
            with pytest.raises(openai.BadRequestError) as refused:
                await c.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}], extra_body=extra
                )
            assert refused.value.body["type"] == "invalid_request_error"  # type: ignore[index]


async def test_nul_in_an_ai_sdk_message_id_is_a_422_and_stores_nothing(server: LiveServer) -> None:
    message = {"id": "m\x00", "role": "user", "parts": [{"type": "text", "text": "hi"}]}
    body = {"id": "chat-nul", "trigger": "submit-message", "messages": [message]}
    async with server.client() as api:
        r = await api.post("/v1/ai-sdk/chat", json=body)
        assert r.status_code == 422, r.text
        assert r.json()["error"]["code"] in ("invalid_input", "validation_error")
        assert (await api.get("/v1/conversations")).json()["items"] == []


async def test_nul_or_lone_surrogate_in_an_api_key_name_is_a_422(server: LiveServer) -> None:
    async with server.client() as api:
        for name in ("key\\u0000", "key\\udc00"):
            body = ('{"name": "' + name + '"}').encode()
            r = await api.post("/v1/keys", content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == 422, r.text
        assert (await api.get("/v1/keys")).json()["items"] == []


@pytest.mark.parametrize("field", ["since", "until"])
async def test_memory_items_time_outside_utc_range_is_a_422(server: LiveServer, field: str) -> None:
    async with server.client() as api:
        for value in ("0001-01-01T00:00:00+14:00", "9999-12-31T23:59:59-14:00"):
            r = await api.get("/v1/memory/items", params={field: value})
            assert r.status_code == 422, (value, r.text)
            assert r.json()["error"]["details"]["field"] == field
        assert (
            await api.get("/v1/memory/items", params={field: "2024-01-01T00:00:00+14:00"})
        ).status_code == 200


async def test_nul_in_a_query_or_path_string_is_a_4xx(server: LiveServer) -> None:
    async with server.client() as api:
        r = await api.get("/v1/memory/items", params={"q": "bees\x00"})
        assert r.status_code == 422, r.text
        r = await api.get("/v1/ai-sdk/chat/a%00b/messages")
        assert r.status_code == 422, r.text
        r = await api.post("/v1/turns/00000000-0000-0000-0000-000000000000/tool_calls/c%00/approve", json={})
        assert 400 <= r.status_code < 500, r.text


def test_every_json_body_answer_parses(server: LiveServer) -> None:
    """The bodies above are JSON a client could really send (not truncated by a typo in the test)."""
    for _, body in openai_bodies():
        try:
            json.loads(body)
        except ValueError as exc:  # the huge integer: Python refuses to convert it, the text is fine
            assert "digits" in str(exc)
        except RecursionError:
            pass


def test_a_route_that_reads_the_caller_without_the_door_is_refused_at_start() -> None:
    """Every authenticated route passes the door: create_app refuses one that does not."""
    outside = APIRouter()

    @outside.get("/v1/sneaky")
    async def sneaky(owner: OwnerDep) -> str:
        return owner.user_id

    inside = door_router()
    inside.add_api_route("/v1/fine", sneaky)
    assert unguarded_routes([outside, inside]) == ["['GET'] /v1/sneaky"]


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e400"])
async def test_nan_or_infinity_in_a_responses_body_was_a_500_that_left_an_empty_conversation(
    server: LiveServer, number: str
) -> None:
    """Python's JSON reader takes NaN and Infinity (and 1e400 as inf); a tool's parameters
    holding one reached a jsonb column after the conversation was made: a 500, and a
    conversation with no turn left behind. Neither is JSON: refused at the door."""
    tool = {"type": "function", "name": "f", "parameters": {"type": "object", "x": "NUMBER"}}
    body = json.dumps({"model": MODEL, "input": "hi", "tools": [tool]}).replace('"NUMBER"', number)
    async with httpx.AsyncClient(base_url=server.base_url, headers=auth()) as http:
        r = await http.post(
            "/openai/v1/responses", content=body, headers={"Content-Type": "application/json"}
        )
        assert r.status_code == 400, (r.status_code, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
        assert (await http.get("/v1/conversations")).json()["items"] == []


async def test_no_request_dependency_runs_in_the_thread_pool(server: LiveServer) -> None:
    """FastAPI runs a plain `def` dependency in its thread pool: a thread hop per request.

    `get_services` and `get_admission` were such dependencies, two hops for every message sent.
    """

    def calls(dependant: Dependant) -> Iterator[Any]:
        for dependency in dependant.dependencies:
            yield dependency.call
            yield from calls(dependency)

    def api_routes(routes: list[Any]) -> Iterator[APIRoute]:
        # FastAPI keeps an included router as one route that points at it.
        for route in routes:
            if isinstance(route, APIRoute):
                yield route
            elif hasattr(route, "original_router"):
                yield from api_routes(route.original_router.routes)

    routes = list(api_routes(server.app.routes))
    assert "/v1/conversations/{conversation_id}/messages" in {route.path for route in routes}
    in_threads = {
        f"{route.path}: {call.__qualname__}"
        for route in routes
        for call in calls(route.dependant)
        if not (inspect.iscoroutinefunction(call) or inspect.isasyncgenfunction(call))
    }
    assert not in_threads
