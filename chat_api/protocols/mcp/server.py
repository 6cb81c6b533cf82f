"""MCP: a person's chatmem memory as tools for other clients (Claude Desktop, IDE agents, LibreChat).

Three tools, defined once on the official SDK's ``MCPServer`` over a ``MemoryTools``
backend, so both transports expose exactly the same thing:

- ``search_memory(query, k)``: the best remembered items, as the chat's retrieval ranks them;
- ``remember(fact)``: store a fact the person states ("I'm vegetarian");
- ``forget(item_id)``: forget one item (ids come from ``search_memory``).

Transports:

- streamable HTTP at ``/mcp`` inside the API process (``McpEndpoint``). It passes the
  same door as every API route (``chat_api.admission.pass_door``): the failed-auth
  throttle, a session token or an API key, the request rate, all before the SDK sees
  the request; a held stream (``GET /mcp``) takes a stream slot like any other; a body
  is held to the same input bounds (a JSON-RPC parse error otherwise), and one not declared
  JSON is a JSON-RPC error too (415), as is one over the body size limit (413). Every tool call
  acts for the caller the door found (in that tenant's row-level-security scope) through
  ``memory.recall.access``. Stateless, so any replica answers any request, and JSON
  responses (each call is one short answer).
- stdio: ``chatmem mcp`` (``chat_api/cli/mcp.py``), which talks to a running chatmem
  over the same HTTP API.

A domain failure (unknown item, empty fact) is a tool error the model can read
(``is_error``), not a protocol error.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Protocol, TypeVar

from fastapi import FastAPI
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.streamable_http_manager import StreamableHTTPASGIApp
from mcp.server.transport_security import TransportSecuritySettings
from pydantic import Field
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from chat_api.admission.body import BodyTooLarge
from chat_api.admission.door import credential_of, pass_door
from chat_api.admission.inputs import parse_json
from chat_api.auth import AuthError
from chat_api.errors import RateLimited, error_body
from chat_api.routes.memory_items import MemoryItemRecord
from chat_api.services import Services
from memory.errors import DomainError, InvalidInput
from memory.recall.items import MAX_ITEM_ID
from memory.record.conversations import Owner
from memory.storage.tenancy import tenant_scope

T = TypeVar("T")

MCP_PATH = "/mcp"
DEFAULT_K = 8
MAX_K = 50

# Held to the items API's bounds, strictly typed (a JSON true is no 1), and published in the
# tools' input schemas, so a bad argument is a tool error before any work.
ResultCount = Annotated[int, Field(ge=1, le=MAX_K, strict=True, description="How many items, best first.")]
ItemId = Annotated[int, Field(ge=1, le=MAX_ITEM_ID, strict=True, description="An id from search_memory.")]

INSTRUCTIONS = (
    "The user's long-term memory from chatmem: what they said in past conversations and facts they "
    "asked to be remembered. search_memory before answering questions about the user; remember "
    "only what the user states about themselves; forget takes an id from search_memory."
)


class MemoryTools(Protocol):
    """What the MCP tools need: one person's memory, as the items API shows it (JSON objects)."""

    async def search(self, query: str, k: int) -> list[dict[str, Any]]: ...

    async def remember(self, fact: str) -> dict[str, Any]: ...

    async def forget(self, item_id: int) -> None: ...


def _quiet_server(name: str, instructions: str) -> MCPServer:
    # MCPServer() calls logging.basicConfig(), which would install its own root handler and
    # level in a process that has none yet (tests, `chatmem mcp`): a handler here makes it a no-op.
    root = logging.getLogger()
    guard = logging.NullHandler()
    root.addHandler(guard)
    try:
        return MCPServer(name, instructions=instructions, version="0.1.0")
    finally:
        root.removeHandler(guard)


def memory_mcp_server(backend: Callable[[Context], Awaitable[MemoryTools]]) -> MCPServer:
    """The MCP server with chatmem's memory tools; ``backend`` gives the caller's memory per call."""
    server = _quiet_server("chatmem", INSTRUCTIONS)

    @server.tool()
    async def search_memory(query: str, ctx: Context, k: ResultCount = DEFAULT_K) -> dict[str, Any]:
        """Search the user's long-term memory; returns the best items (id, text, date, score), best first."""
        memory = await backend(ctx)
        return {"query": query, "items": await _tool_call(memory.search(query, k))}

    @server.tool()
    async def remember(fact: str, ctx: Context) -> dict[str, Any]:
        """Remember a fact the user states about themselves (e.g. "I'm vegetarian"); returns the new item."""
        memory = await backend(ctx)
        return await _tool_call(memory.remember(fact))

    @server.tool()
    async def forget(item_id: ItemId, ctx: Context) -> dict[str, Any]:
        """Forget one memory item for good (its id comes from search_memory)."""
        memory = await backend(ctx)
        await _tool_call(memory.forget(item_id))
        return {"forgotten": item_id}

    return server


async def _tool_call(call: Awaitable[T]) -> T:
    """The call's result; a domain error becomes a tool error with the same message."""
    try:
        return await call
    except DomainError as exc:
        raise ToolError(f"{exc.code}: {exc.message}") from exc


class LocalMemory:
    """One owner's memory in this process (the HTTP transport), in their tenant's scope."""

    def __init__(self, services: Services, owner: Owner) -> None:
        self.access = services.memory_access
        self.owner = owner

    async def search(self, query: str, k: int) -> list[dict[str, Any]]:
        with tenant_scope(self.owner.tenant_id):
            found = await self.access.search(self.owner, query, k=k)
        return [MemoryItemRecord.of(f.item, round(f.score, 4)).model_dump(mode="json") for f in found]

    async def remember(self, fact: str) -> dict[str, Any]:
        with tenant_scope(self.owner.tenant_id):
            item = await self.access.remember(self.owner, fact)
        return MemoryItemRecord.of(item).model_dump(mode="json")

    async def forget(self, item_id: int) -> None:
        with tenant_scope(self.owner.tenant_id):
            await self.access.forget(self.owner, item_id)


def _refusal(exc: AuthError | RateLimited) -> JSONResponse:
    """The door's refusal, as the API answers it (401 with WWW-Authenticate, or 429 with Retry-After)."""
    if isinstance(exc, AuthError):
        body = error_body("unauthorized", str(exc))
        return JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
    body = error_body("rate_limited", str(exc))
    return JSONResponse(body, status_code=429, headers={"Retry-After": str(exc.retry_after)})


def _not_json() -> JSONResponse:
    """A POST whose body is not declared JSON, as the SDK answers one (its transport check would
    answer some of them in plain text)."""
    message = "Unsupported Media Type: Content-Type must be application/json"
    body = {"jsonrpc": "2.0", "id": None, "error": {"code": -32600, "message": message}}
    return JSONResponse(body, status_code=415)


def too_large(limit: int) -> JSONResponse:
    """A body over the size limit, refused as the SDK refuses a request it will not take (413)."""
    message = f"Payload Too Large: request body over {limit} bytes"
    body = {"jsonrpc": "2.0", "id": None, "error": {"code": -32600, "message": message}}
    return JSONResponse(body, status_code=413)


def _sends_json(scope: Scope) -> bool:
    media_type = Headers(scope=scope).get("content-type", "").partition(";")[0]
    return media_type.strip().lower() == "application/json"


def _parse_error(exc: Exception) -> JSONResponse:
    """A body outside the input bounds, as JSON-RPC says a request that cannot be read is answered."""
    message = exc.message if isinstance(exc, InvalidInput) else "the body is not valid JSON"
    body = {"jsonrpc": "2.0", "id": None, "error": {"code": -32700, "message": f"Parse error: {message}"}}
    return JSONResponse(body, status_code=400)


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the body already read once, then the connection's own messages."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class McpEndpoint:
    """The ASGI app at ``/mcp``: the API's 401 without a valid token, else the SDK's streamable HTTP."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self.server = memory_mcp_server(self._memory_of)
        # Builds the session manager. No DNS-rebinding host check: a browser never sends our
        # bearer token by itself, and the API behind a proxy is reached under any host name.
        self.server.streamable_http_app(
            stateless_http=True,
            json_response=True,
            transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False),
        )
        self._asgi = StreamableHTTPASGIApp(self.server.session_manager)

    @property
    def services(self) -> Services:
        services: Services = self.app.state.services
        return services

    async def _memory_of(self, ctx: Context) -> MemoryTools:
        # The SDK runs tools in its own tasks: the caller is read from the request's state,
        # where the door left it, and the tools scope themselves to the tenant.
        scope = getattr(ctx.request_context.request, "scope", None)
        if scope is None:
            raise ToolError("unauthorized: no request")
        return LocalMemory(self.services, credential_of(scope).owner)

    async def run(self, stop: asyncio.Event) -> None:
        """Serve MCP requests until ``stop`` is set (a lifespan task of the API process)."""
        async with self.server.session_manager.run():
            await stop.wait()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._asgi(scope, receive, send)
            return
        slot = None
        try:
            credential = await pass_door(self.services, scope)
            if scope["method"] == "GET":  # a stream the client holds open
                slot = self.services.admission.admit_stream(credential.owner)
        except (AuthError, RateLimited) as exc:
            await _refusal(exc)(scope, receive, send)
            return
        if scope["method"] == "POST":
            if not _sends_json(scope):
                await _not_json()(scope, receive, send)
                return
            try:
                body = await _read_body(receive)
            except BodyTooLarge as exc:  # a body with no Content-Length, past the limit as it arrived
                await too_large(exc.limit)(scope, receive, send)
                return
            try:
                await parse_json(body, max_values=self.services.settings.max_body_values)
            except Exception as exc:  # RequestValidationError or InvalidInput: the body is not readable
                await _parse_error(exc)(scope, receive, send)
                return
            receive = _replay(body, receive)
        try:
            await self._asgi(scope, receive, send)
        finally:
            if slot is not None:
                slot.release()


def install_mcp(app: FastAPI) -> McpEndpoint:
    """Mount the MCP endpoint at /mcp; the caller runs ``endpoint.run(stop)`` in the lifespan."""
    endpoint = McpEndpoint(app)
    app.router.routes.append(Route(MCP_PATH, endpoint, methods=["GET", "POST", "DELETE"]))
    return endpoint
