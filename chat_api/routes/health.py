"""Liveness and readiness."""

from __future__ import annotations

import hashlib

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from chat_api.deps import ServicesDep

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is up."""
    return {"status": "ok"}


@router.get("/readyz", response_model=None)
async def readyz(services: ServicesDep) -> JSONResponse | dict[str, str]:
    """The database answers, and the process is not shutting down.

    A process that refuses memory (the active index generation, taken over or switched to by a
    reindex, is made by an encoder it cannot load) is still ready: replies go on without memory.
    ``memory`` says so, and why.
    """
    if services.drain.draining:
        # At once on SIGTERM: a load balancer stops sending work here while running replies end.
        return JSONResponse({"status": "shutting_down"}, status_code=503, headers={"Retry-After": "1"})
    try:
        await services.db.ping()
    except Exception as exc:
        return JSONResponse({"status": "unavailable", "database": str(exc)[:200]}, status_code=503)
    # The encoder of the searched generation (a MemoryIndex wraps it; tests may pass a bare one).
    index = services.embedder
    embedder = index.generation_encoder() if hasattr(index, "generation_encoder") else index
    encoder = str(getattr(embedder, "runtime", type(embedder).__name__))
    fallback = getattr(embedder, "fallback_reason", None)
    if fallback:
        # Still ready (torch gives the same vectors), but an operator should see why it is slower.
        encoder += f" (fallback from {getattr(embedder, 'requested_runtime', '?')}: {fallback[:200]})"
    refused = getattr(index, "refused", None)
    memory = "ok" if refused is None else f"unavailable: {refused[:300]}"
    # An opaque name of this process (not its host or pid): tells the workers of one port apart.
    worker = hashlib.sha256(services.process_id.encode()).hexdigest()[:12]
    return {"status": "ready", "database": "ok", "encoder": encoder, "memory": memory, "worker": worker}
