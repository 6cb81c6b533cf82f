"""Importing past turns into a conversation."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter(tags=["import"])
