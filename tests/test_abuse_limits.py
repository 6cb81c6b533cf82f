"""Limits on what one client can make the server do, and headers every API response carries.

Found: failed authentication was not limited at all (tokens could be guessed at full
speed); an import of thousands of turns had no quota; API responses had neither
`X-Content-Type-Options: nosniff` nor `Cache-Control: no-store`; and `/docs` loaded
Swagger UI from a CDN, so it was blank offline.
"""

from __future__ import annotations

import re
from typing import Any

import httpx

from tests.conftest import LiveServer
from tests.sse import collect
from tests.support import new_conversation

BAD_TOKEN = {"Authorization": "Bearer not-a-token"}


def from_address(server: LiveServer, address: str, **kwargs: Any) -> httpx.AsyncClient:
    """A client whose connections come from `address` (any 127.x.y.z reaches the loopback server)."""
    transport = httpx.AsyncHTTPTransport(local_address=address)
    return httpx.AsyncClient(base_url=server.base_url, transport=transport, timeout=30, **kwargs)


async def test_failed_authentication_is_rate_limited_per_client_address(start_server: Any) -> None:
    server: LiveServer = await start_server(auth_failures_per_minute=5)
    good = server.client().headers
    async with from_address(server, "127.0.0.2") as guesser, from_address(server, "127.0.0.3") as bystander:
        for _ in range(5):
            assert (await guesser.get("/v1/conversations", headers=BAD_TOKEN)).status_code == 401
        assert (await guesser.get("/v1/conversations")).status_code == 429  # no token at all counts too
        refused = await guesser.get("/v1/conversations", headers=BAD_TOKEN)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "rate_limited"
        assert 1 <= int(refused.headers["Retry-After"]) <= 60
        # Refused before the token is looked at: a right guess does not get through either.
        assert (await guesser.get("/v1/conversations", headers=good)).status_code == 429
        # Another address is not held by it, and its successes cost nothing.
        for _ in range(20):
            assert (await bystander.get("/v1/conversations", headers=good)).status_code == 200
        assert (await bystander.get("/v1/conversations", headers=BAD_TOKEN)).status_code == 401
        # Public routes stay open.
        assert (await guesser.get("/healthz")).status_code == 200


async def test_imports_are_held_to_a_quota_of_turns_per_hour(start_server: Any) -> None:
    server: LiveServer = await start_server(import_turns_per_hour=10)

    def batch(n: int, start: int = 0) -> dict[str, Any]:
        return {
            "turns": [{"role": "user", "content": f"t{i}", "external_id": f"e{i}"} for i in range(start, n)]
        }

    async with server.client() as client:
        cid = await new_conversation(client)
        url = f"/v1/conversations/{cid}/import"
        assert (await client.post(url, json=batch(6))).status_code == 201
        over = await client.post(url, json=batch(11, 6))  # 5 more: only 4 left this hour
        assert over.status_code == 429, over.text
        assert over.json()["error"]["code"] == "rate_limited"
        assert int(over.headers["Retry-After"]) == 360  # one turn comes back every 6 minutes
        # What is re-sent and skipped costs nothing: the 4 left are still there.
        assert (await client.post(url, json=batch(4))).json()["skipped"] == 4
        assert (await client.post(url, json=batch(10, 6))).json()["created"] == 4
        assert (await client.post(url, json=batch(11, 10))).status_code == 429
        too_big = await client.post(url, json=batch(11, 0))
        assert too_big.status_code == 422 and too_big.json()["error"]["details"]["field"] == "turns"
        turns = (await client.get(f"/v1/conversations/{cid}/turns")).json()["items"]
        assert len(turns) == 10
        # The quota is each user's own.
        async with server.client(user="u2") as other:
            mine = await new_conversation(other)
            assert (await other.post(f"/v1/conversations/{mine}/import", json=batch(10))).status_code == 201


async def test_api_responses_carry_nosniff_and_no_store(server: LiveServer) -> None:
    async with server.client() as client:
        cid = await new_conversation(client)
        responses = [
            await client.get("/v1/conversations"),
            await client.get(f"/v1/conversations/{cid}/turns"),
            await client.get("/v1/conversations/00000000-0000-0000-0000-000000000000"),  # 404
            await client.post("/v1/conversations", json={"title": 5}),  # 422
            await client.get("/v1/conversations", headers=BAD_TOKEN),  # 401
            await client.get("/ui/config"),
            await client.get("/healthz"),
            await client.get("/openapi.json"),
        ]
        async with client.stream("POST", f"/v1/conversations/{cid}/messages", json={"content": "hi"}) as r:
            await collect(r)
            responses.append(r)
        for response in responses:
            assert response.headers["x-content-type-options"] == "nosniff", response.request.url
            assert response.headers.get_list("cache-control") == ["no-store"], response.request.url
        # The page keeps its own caching (revalidate), with nosniff.
        page = await client.get("/static/app.js")
        assert page.status_code == 200
        assert (
            page.headers["cache-control"] == "no-cache"
            and page.headers["x-content-type-options"] == "nosniff"
        )


async def test_every_doors_event_stream_tells_a_proxy_not_to_buffer_it(server: LiveServer) -> None:
    """Each door kept its own copy of the stream headers, and one AG-UI answer sent none."""
    user = {"id": "m1", "role": "user", "parts": [{"type": "text", "text": "hi"}]}
    openai = {"model": "chatmem-demo", "stream": True}
    async with server.client() as client:
        cid = await new_conversation(client)
        streams = [
            (f"/v1/conversations/{cid}/messages", {"content": "hi"}),
            ("/v1/ai-sdk/chat", {"id": "headers-chat", "trigger": "submit-message", "messages": [user]}),
            (
                "/v1/ag-ui",
                {
                    "threadId": "headers-thread",
                    "runId": "r1",
                    "messages": [{"id": "m1", "role": "user", "content": "hi"}],
                },
            ),
            ("/openai/v1/chat/completions", {**openai, "messages": [{"role": "user", "content": "hi"}]}),
            ("/openai/v1/responses", {**openai, "input": "hi"}),
        ]
        for path, body in streams:
            async with client.stream("POST", path, json=body) as r:
                await r.aread()
            assert r.status_code == 200, (path, r.text)
            assert r.headers["content-type"].startswith("text/event-stream"), path
            assert r.headers["x-accel-buffering"] == "no", path
            assert r.headers.get_list("cache-control") == ["no-store"], path


async def test_docs_work_offline_with_no_outside_host(server: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=server.base_url) as client:
        for page in ("/docs", "/redoc"):
            r = await client.get(page)
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
            assert "://" not in r.text, re.findall(r"\w+://[^\s\"']+", r.text)
            assets = re.findall(r"""(?:src|href)=["']([^"']+)["']""", r.text)
            assert assets, r.text
            for asset in assets:
                assert asset.startswith("/"), asset
                fetched = await client.get(asset)
                assert fetched.status_code == 200 and len(fetched.content) > 1000, asset
        swagger = await client.get("/docs")
        assert "validatorUrl" in swagger.text  # off: Swagger UI would ask validator.swagger.io
        assert (await client.get("/docs-assets/../../pyproject.toml")).status_code == 404
        assert (await client.get("/docs-assets/core.py")).status_code == 404
