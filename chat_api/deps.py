"""Request dependencies: the services of this process, and the caller as the door authenticated them."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from chat_api.admission.door import OwnerDep, SessionOwnerDep, StopOwnerDep
from chat_api.services import Services


async def get_services(request: Request) -> Services:
    # async: FastAPI runs a plain `def` dependency in its thread pool, a thread hop per request.
    return request.app.state.services  # type: ignore[no-any-return]


ServicesDep = Annotated[Services, Depends(get_services)]

__all__ = ["OwnerDep", "ServicesDep", "SessionOwnerDep", "StopOwnerDep", "get_services"]
