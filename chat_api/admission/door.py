"""The door: who is asking, settled before any work, for every authenticated route and for /mcp.

`pass_door` is chatmem's one authentication, in this order (first noting that the request
arrived: chat_api.admission.arrival):

1. the client address's allowance of failed authentications (AUTH_FAILURES_PER_MINUTE):
   once it is spent, 429 before the credential is even looked at, so guessing tokens or
   keys is held to the rate whatever the answers would have been;
2. the bearer credential: an API key (`cmk_…`, looked up by its hash on every request,
   so a revocation holds at once on every replica) or a signed session token (JWT); a
   failure counts against the address and answers 401;
3. one request of the user's RATE_LIMIT_PER_MINUTE, or, for a stop, one of the user's
   STOPS_PER_MINUTE instead: a user who spent their request rate can still stop a reply.
   A route is a stop when it reads its caller with `StopOwnerDep` (every door's stop and
   cancel route does); that one dependency is the whole rule, the route adds nothing;
4. the request is scoped to the tenant (row-level security) and the log context, and its
   `Credential` is kept in the request's state.

FastAPI reads and parses a route's body before it resolves the route's dependencies, so a
dependency comes too late for "no work before authentication": the door is the route
class. `DoorRoute` runs `pass_door` before FastAPI touches the body, then holds query and
path strings and the JSON body to the input bounds (chat_api.admission.inputs), parsing
the body once with the strict decoder. Routers of authenticated routes are made with
`door_router`; `create_app` refuses to start when a route reads the caller without
passing the door (`unguarded_routes`). The MCP endpoint, a plain ASGI app, calls
`pass_door` itself.

The address is the connection's peer as the server sees it (behind a reverse proxy, run
uvicorn with `--proxy-headers` and `--forwarded-allow-ips` so it is the client's).

`Credential.session` tells a signed-in session token from an API key. Key management and
account deletion take `SessionOwnerDep`, which answers an API key 403
`session_token_required`: a key can neither mint keys that would outlive its revocation,
nor revoke its owner's other keys, nor delete the user.
"""

from __future__ import annotations

import email.message
from collections.abc import Callable, Coroutine, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute
from starlette.datastructures import Headers
from starlette.types import Scope

from chat_api.admission.arrival import note_arrival
from chat_api.admission.inputs import check_url_strings, parse_json
from chat_api.auth import AuthError, is_api_key, verify_api_key
from chat_api.errors import Forbidden
from chat_api.observability import bind_log_context
from memory.record.conversations import Owner
from memory.storage.tenancy import set_tenant

if TYPE_CHECKING:
    from chat_api.services import Services

CREDENTIAL = "chatmem_credential"  # the key of the request's Credential in its state


@dataclass(frozen=True, slots=True)
class Credential:
    """Who is asking, and with what: a signed-in session token (`session`) or an API key."""

    owner: Owner
    session: bool


def _address(scope: Scope) -> str:
    client = scope.get("client")
    return str(client[0]) if client else ""


def _bearer(headers: Headers) -> str:
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthError("missing bearer token")
    return token.strip()


async def pass_door(services: Services, scope: Scope, *, stop: bool = False) -> Credential:
    """Authenticate the request and charge it to the caller's request rate, or a `stop` to
    their stop allowance (see the module doc).

    AuthError (401) or RateLimited (429); on success the request's state holds the Credential.
    """
    note_arrival()  # before any wait: a stop sent from now on means what this request starts
    admission = services.admission
    address = _address(scope)
    admission.check_address(address)
    try:
        token = _bearer(Headers(scope=scope))
        if is_api_key(token):
            credential = Credential(await verify_api_key(services.db, token), session=False)
        else:
            credential = Credential(services.verifier.verify(token), session=True)
    except AuthError:
        admission.failed_authentication(address)
        raise
    if stop:
        admission.admit_stop(credential.owner)
    else:
        admission.admit_request(credential.owner)
    owner = credential.owner
    bind_log_context(tenant_id=owner.tenant_id, user_id=owner.user_id)
    set_tenant(owner.tenant_id)
    scope.setdefault("state", {})[CREDENTIAL] = credential
    return credential


def credential_of(scope: Scope) -> Credential:
    """The Credential the door kept for this request (a route outside the door is a bug)."""
    credential = scope.get("state", {}).get(CREDENTIAL)
    if not isinstance(credential, Credential):
        raise RuntimeError("this route does not pass the door (make its router with door_router)")
    return credential


class DoorRequest(Request):
    """A request whose JSON body is parsed, once, by the door's strict decoder."""

    _checked: Any

    async def json(self) -> Any:
        if not hasattr(self, "_checked"):
            max_values = self.app.state.services.settings.max_body_values
            self._checked = await parse_json(await self.body(), max_values=max_values)
        return self._checked


def _sends_json(request: Request) -> bool:
    # FastAPI's own rule (strict content type): only an application/json (or +json) body is JSON.
    content_type = request.headers.get("content-type")
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    is_json = subtype == "json" or subtype.endswith("+json")
    return message.get_content_maintype() == "application" and is_json


class DoorRoute(APIRoute):
    """A route behind the door: authenticated and rate-limited before its body is read, inputs bounded."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        reads_body = self.body_field is not None
        stop = stop_owner in set(_calls(self.dependant))

        async def through_the_door(request: Request) -> Response:
            request = DoorRequest(request.scope, request.receive)
            await pass_door(request.app.state.services, request.scope, stop=stop)
            check_url_strings(request.path_params.items())
            check_url_strings(request.query_params.multi_items())
            if reads_body and _sends_json(request):
                await request.json()  # refused here, in the route's error shape, not as FastAPI's 400
            return await handler(request)

        return through_the_door


def door_router(**kwargs: Any) -> APIRouter:
    """An APIRouter whose routes pass the door (`route_class` may be a subclass of DoorRoute)."""
    kwargs.setdefault("route_class", DoorRoute)
    if not issubclass(kwargs["route_class"], DoorRoute):
        raise TypeError("a door router's route class must be a DoorRoute")
    return APIRouter(**kwargs)


async def current_owner(request: Request) -> Owner:
    """Dependency: the caller, as the door authenticated them."""
    return credential_of(request.scope).owner


async def session_owner(request: Request) -> Owner:
    """Dependency: the caller, who must have signed in with a session token (403 for an API key)."""
    credential = credential_of(request.scope)
    if not credential.session:
        raise Forbidden(
            "session_token_required",
            "this needs a signed-in session token; an API key cannot manage keys or delete the account",
        )
    return credential.owner


async def stop_owner(request: Request) -> Owner:
    """Dependency: the caller of a stop route, charged to STOPS_PER_MINUTE instead of the request rate."""
    return credential_of(request.scope).owner


OwnerDep = Annotated[Owner, Depends(current_owner)]
StopOwnerDep = Annotated[Owner, Depends(stop_owner)]
SessionOwnerDep = Annotated[Owner, Depends(session_owner)]


def _calls(dependant: Dependant) -> Iterator[Any]:
    for dependency in dependant.dependencies:
        yield dependency.call
        yield from _calls(dependency)


def unguarded_routes(routers: Iterable[APIRouter]) -> list[str]:
    """Routes that read the caller but do not pass the door (create_app refuses to start with any)."""
    readers = {current_owner, session_owner, stop_owner}
    return [
        f"{sorted(route.methods or ())} {route.path}"
        for router in routers
        for route in router.routes
        if isinstance(route, APIRoute)
        and not isinstance(route, DoorRoute)
        and readers.intersection(_calls(route.dependant))
    ]
