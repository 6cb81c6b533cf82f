"""`chatmem mcp`: chatmem's memory tools over stdio, for MCP clients that launch a command.

It serves the same tools as ``/mcp`` (``chat_api/protocols/mcp/server.py``) and acts through a
running chatmem's HTTP API (``--url``), as ``chatmem import`` does: the tools then take
exactly the path the API guarantees (validation, tenant and user scope, the same search),
and it works against a remote deployment without database credentials.

Identity: ``--token`` takes an API key (``cmk_…``) or a token; otherwise one is minted from
the installation's secret (``JWT_SECRET``, or the ``chatmem up`` data directory) for
``--tenant``/``--user``, fresh for every request, so a client that keeps this process for
days never holds an expired token. Standard output carries only the protocol; logs go to
standard error, which MCP hosts keep in files: the HTTP client's request lines (whose
URLs hold the search queries) stay below INFO (``chat_api.observability.configure_logging``).
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError

from chat_api.cli.installation import DEFAULT_TENANT, DEFAULT_USER, bearer, default_url, identity
from chat_api.protocols.mcp.server import MemoryTools, memory_mcp_server

# Minted tokens live this long: each request gets a new one.
MINTED_TOKEN_SECONDS = 300


class ApiMemory:
    """One person's memory through a chatmem's HTTP API (the items routes)."""

    def __init__(self, client: httpx.AsyncClient, token: Callable[[], str]) -> None:
        self.client = client
        self.token = token

    async def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        headers = {"Authorization": f"Bearer {self.token()}"}
        try:
            response = await self.client.request(method, path, headers=headers, **kwargs)
        except httpx.HTTPError as exc:
            raise ToolError(f"chatmem is not reachable at {self.client.base_url}: {exc}") from exc
        if response.status_code >= 400:
            try:
                error = response.json()["error"]
                message = f"{error['code']}: {error['message']}"
            except (ValueError, KeyError, TypeError):
                message = f"HTTP {response.status_code}"
            raise ToolError(message)
        return response.json() if response.content else None

    async def search(self, query: str, k: int) -> list[dict[str, Any]]:
        page = await self._call("GET", "/v1/memory/items", params={"q": query, "limit": k})
        return list(page["items"])

    async def remember(self, fact: str) -> dict[str, Any]:
        item: dict[str, Any] = await self._call("POST", "/v1/memory/items", json={"text": fact})
        return item

    async def forget(self, item_id: int) -> None:
        await self._call("DELETE", f"/v1/memory/items/{item_id}")


async def serve_stdio(url: str, token: Callable[[], str]) -> None:
    """Serve the memory tools on stdin/stdout until the client closes them."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        memory = ApiMemory(client, token)

        async def backend(_: Context) -> MemoryTools:
            return memory

        await memory_mcp_server(backend).run_stdio_async()


def run_mcp_command(args: argparse.Namespace) -> None:
    """The `chatmem mcp` command."""
    url = (args.url or default_url()).rstrip("/")
    asyncio.run(serve_stdio(url, bearer(args, ttl_seconds=MINTED_TOKEN_SECONDS)))


def add_mcp_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `chatmem mcp` (for chat_api.cli.build_parser)."""
    parser.add_argument("--url", help="a running chatmem (default http://localhost:PORT)")
    parser.add_argument(
        "--token", help="an API key (cmk_…) or token (otherwise one is minted from the installation's secret)"
    )
    parser.add_argument("--data-dir", type=Path, help="the `chatmem up` installation to mint a token for")
    parser.add_argument(
        "--tenant", type=identity, help=f"tenant of a minted token (default {DEFAULT_TENANT!r})"
    )
    parser.add_argument("--user", type=identity, help=f"user of a minted token (default {DEFAULT_USER!r})")
