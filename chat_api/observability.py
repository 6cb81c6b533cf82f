"""Metrics and structured logs. (Being filled in: see `install_observability`.)"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI


def install_observability(app: FastAPI, settings: Any) -> None:
    """Add /metrics and request logging to the app."""
    return None
