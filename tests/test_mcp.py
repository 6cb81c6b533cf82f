"""The MCP memory tools through the official SDK's own client: streamable HTTP and `chatmem mcp` (stdio).

A live server, the real Postgres; the stdio server is the real `chatmem mcp` command in a
subprocess, talking to that server over HTTP.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TextIO

import httpx
import httpx2
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.stdio import stdio_client as stdio_client_transport
from mcp.client.streamable_http import streamable_http_client

from tests.conftest import LiveServer, token_for
from tests.test_memory_recall import new_conversation, retrieved, say

STATED = "I'm vegetarian and I keep bees on the roof."


@asynccontextmanager
async def http_client(server: LiveServer, tenant: str = "t1", user: str = "u1") -> AsyncIterator[Client]:
    """The SDK's client over streamable HTTP, with the user's bearer token."""
    headers = {"Authorization": f"Bearer {token_for(tenant, user)}"}
    async with httpx2.AsyncClient(headers=headers, timeout=30) as http:
        async with Client(streamable_http_client(f"{server.base_url}/mcp", http_client=http)) as client:
            yield client


@asynccontextmanager
async def stdio_client(server: LiveServer, *extra: str, errlog: TextIO = sys.stderr) -> AsyncIterator[Client]:
    """The SDK's client launching `chatmem mcp` as a subprocess (this worktree's code)."""
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "chat_api.cli", "mcp", "--url", server.base_url, *extra],
        env={k: v for k, v in os.environ.items() if k in ("PYTHONPATH", "HF_HUB_OFFLINE", "JWT_SECRET")},
        cwd=os.getcwd(),
    )
    async with Client(stdio_client_transport(params, errlog=errlog), read_timeout_seconds=60) as client:
        yield client


async def call(client: Client, tool: str, **arguments: Any) -> dict[str, Any]:
    result = await client.call_tool(tool, arguments)
    assert not result.is_error, result.content
    assert isinstance(result.structured_content, dict)
    return result.structured_content


async def error_of(client: Client, tool: str, **arguments: Any) -> str:
    result = await client.call_tool(tool, arguments)
    assert result.is_error, result
    return " ".join(getattr(c, "text", "") for c in result.content)


async def exercise(client: Client, server: LiveServer) -> None:
    """remember → search_memory finds it → the chat recalls it → forget → gone everywhere."""
    tools = await client.list_tools()
    assert {t.name for t in tools.tools} == {"search_memory", "remember", "forget"}
    item = await call(client, "remember", fact=STATED)
    assert item["text"] == STATED and item["source"] == "stated" and item["id"]
    found = await call(client, "search_memory", query="vegetarian bees", k=3)
    assert found["items"][0]["id"] == item["id"] and found["items"][0]["score"] > 0
    async with server.client() as api:
        events = await say(api, await new_conversation(api), "Am I vegetarian? Bees?")
        assert STATED in [i["text"] for i in retrieved(events)["items"]]
    assert await call(client, "forget", item_id=item["id"]) == {"forgotten": item["id"]}
    assert (await call(client, "search_memory", query="vegetarian bees"))["items"] == []
    assert "not_found" in await error_of(client, "forget", item_id=item["id"])
    assert "invalid_input" in await error_of(client, "remember", fact="   ")
    assert "greater than or equal to 1" in await error_of(client, "search_memory", query="bees", k=0)
    async with server.client() as api:
        assert (await api.get("/v1/memory/items")).json()["items"] == []


async def test_tools_over_streamable_http(server: LiveServer) -> None:
    async with http_client(server) as client:
        await exercise(client, server)


async def test_tools_over_stdio_with_an_api_key_and_no_query_in_its_log(
    server: LiveServer, tmp_path: Path
) -> None:
    """Found: `chatmem mcp --token cmk_…` said the key was not a JWT, and its stderr (which MCP
    hosts keep in log files) held every search query, from the HTTP client's INFO request log."""
    async with server.client() as api:
        key = (await api.post("/v1/keys", json={"name": "claude desktop"})).json()["key"]
    with (tmp_path / "stderr.log").open("w") as errlog:
        async with stdio_client(server, "--token", key, errlog=errlog) as client:
            await exercise(client, server)
    log = (tmp_path / "stderr.log").read_text()
    assert "vegetarian" not in log and "bees" not in log, log


async def test_stdio_mints_its_token_from_the_installation_secret(server: LiveServer) -> None:
    os.environ["JWT_SECRET"] = server.services.settings.jwt_secret.get_secret_value()
    try:
        async with stdio_client(server, "--tenant", "t1", "--user", "u7") as client:
            item = await call(client, "remember", fact=STATED)
    finally:
        del os.environ["JWT_SECRET"]
    async with server.client("t1", "u7") as api:
        assert (await api.get(f"/v1/memory/items/{item['id']}")).json()["text"] == STATED


async def test_http_endpoint_is_authenticated_like_the_api(server: LiveServer) -> None:
    initialize = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-06-18",
            "capabilities": {},
            "clientInfo": {"name": "t", "version": "1"},
        },
    }
    accept = {"Accept": "application/json, text/event-stream"}
    async with httpx.AsyncClient(base_url=server.base_url) as anonymous:
        missing = await anonymous.post("/mcp", json=initialize, headers=accept)
        forged = await anonymous.post(
            "/mcp", json=initialize, headers={**accept, "Authorization": "Bearer not-a-token"}
        )
    for response in (missing, forged):
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "unauthorized"
        assert response.headers["www-authenticate"] == "Bearer"


async def test_an_argument_of_the_wrong_type_or_out_of_range_is_a_tool_error_that_touches_nothing(
    server: LiveServer,
) -> None:
    """Found: `forget(item_id=true)` forgot item 1 (a JSON true read as the integer 1), `k=true`
    searched for one item, and an id past the bigint range failed in the database (a logged
    failure and a bare "Error executing tool") where the items API answers 422."""
    async with http_client(server, "t1", "u-args") as client:
        item = await call(client, "remember", fact=STATED)
        schemas = {t.name: t.input_schema["properties"] for t in (await client.list_tools()).tools}
        assert schemas["forget"]["item_id"]["maximum"] == 2**63 - 1
        assert schemas["search_memory"]["k"]["minimum"] == 1
        for arguments in ({"item_id": True}, {"item_id": False}, {"item_id": 2**63}, {"item_id": 2**70}):
            message = await error_of(client, "forget", **arguments)
            assert "item_id" in message and "validation error" in message, (arguments, message)
        for k in (True, 10**30, -1, 1.5):
            message = await error_of(client, "search_memory", query="bees", k=k)
            assert "k" in message and "validation error" in message, (k, message)
        found = await call(client, "search_memory", query="vegetarian bees", k=2)
        assert found["items"][0]["id"] == item["id"]
    async with server.client("t1", "u-args") as api:
        assert [i["id"] for i in (await api.get("/v1/memory/items")).json()["items"]] == [item["id"]]


async def test_each_user_sees_and_forgets_only_their_own_memory(server: LiveServer) -> None:
    async with http_client(server, "t2", "u1") as other_tenant:
        theirs = await call(other_tenant, "remember", fact=STATED)
    async with http_client(server, "t1", "u2") as other_user:
        neighbours = await call(other_user, "remember", fact=STATED)
    async with http_client(server) as client:
        assert (await call(client, "search_memory", query="vegetarian bees"))["items"] == []
        for item in (theirs, neighbours):
            assert "not_found" in await error_of(client, "forget", item_id=item["id"])
    async with server.client("t2", "u1") as api:
        assert (await api.get(f"/v1/memory/items/{theirs['id']}")).status_code == 200


async def test_a_post_that_is_not_json_is_refused_in_json_rpc_not_in_plain_text(server: LiveServer) -> None:
    """Found: a POST without a JSON content type was answered 400 `Invalid Content-Type header`,
    plain text with no content type, where the SDK answers others in JSON-RPC."""
    initialize = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}}
    headers = {"Authorization": f"Bearer {token_for()}", "Accept": "application/json, text/event-stream"}
    async with httpx.AsyncClient(base_url=server.base_url, headers=headers) as client:
        for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
            sent = {"content-type": content_type} if content_type else {}
            response = await client.post("/mcp", content=json.dumps(initialize), headers=sent)
            assert response.status_code == 415, (content_type, response.text)
            assert response.headers["content-type"] == "application/json"
            assert response.json()["error"]["code"] == -32600 and response.json()["id"] is None


async def test_a_post_over_the_body_size_limit_was_refused_in_chatmems_shape_not_json_rpc(
    start_server: Any,
) -> None:
    """Found: `/mcp`'s 413 was `{"error": {"code": "payload_too_large", ...}}`, chatmem's (and
    OpenAI's) shape, where an MCP client reads a JSON-RPC error, as for the 415 and -32700."""
    server: LiveServer = await start_server(max_body_bytes=4096)
    ping = {"jsonrpc": "2.0", "id": 1, "method": "ping", "params": {"padding": "x" * 10_000}}
    body = json.dumps(ping).encode()

    async def chunks() -> AsyncIterator[bytes]:
        for start in range(0, len(body), 1000):
            yield body[start : start + 1000]

    headers = {
        "Authorization": f"Bearer {token_for()}",
        "Accept": "application/json, text/event-stream",
        "Content-Type": "application/json",
    }
    async with httpx.AsyncClient(base_url=server.base_url, headers=headers) as client:
        sized = await client.post("/mcp", content=body)
        chunked = await client.post("/mcp", content=chunks())
        assert "content-length" not in chunked.request.headers
        for response in (sized, chunked):
            assert response.status_code == 413, response.text
            assert response.headers["content-type"] == "application/json"
            answer = response.json()
            assert answer["jsonrpc"] == "2.0" and answer["id"] is None, answer
            assert answer["error"]["code"] == -32600, answer
            assert "4096 bytes" in answer["error"]["message"], answer
