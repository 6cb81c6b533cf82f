"""Request dependencies: identity from the token, and the services of this process."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from chat_api.auth import AuthError, is_api_key, verify_api_key
from chat_api.auth_throttle import FailedAuthLimit
from chat_api.observability import bind_log_context
from chat_api.services import Services
from memory.conversations import Owner
from memory.tenancy import set_tenant


def get_services(request: Request) -> Services:
    return request.app.state.services  # type: ignore[no-any-return]


async def current_owner(request: Request, services: Annotated[Services, Depends(get_services)]) -> Owner:
    """The tenant and user named by the bearer token (401 otherwise); scopes the request to the tenant.

    Async on purpose: a sync dependency runs in a worker thread, and the tenant it set
    would not reach the request's own task (nor the reply tasks it starts).
    """
    failures: FailedAuthLimit = request.app.state.rate_limits.auth_failures
    address = request.client.host if request.client is not None else ""
    failures.check(address)  # 429 before the token is even looked at, once over the limit
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    try:
        if scheme.lower() != "bearer" or not token.strip():
            raise AuthError("missing bearer token")
        token = token.strip()
        owner = (
            await verify_api_key(services.db, token) if is_api_key(token) else services.verifier.verify(token)
        )
    except AuthError:
        failures.failed(address)
        raise
    bind_log_context(tenant_id=owner.tenant_id, user_id=owner.user_id)
    set_tenant(owner.tenant_id)
    return owner


ServicesDep = Annotated[Services, Depends(get_services)]
OwnerDep = Annotated[Owner, Depends(current_owner)]
