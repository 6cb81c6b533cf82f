"""The memory API: search and forget."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter(prefix="/v1/memory", tags=["memory"])
