"""Reads an SSE response the way a browser's EventSource does."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass
class SSEEvent:
    id: int | None
    event: str
    data: Any


async def iter_sse(response: httpx.Response) -> AsyncIterator[SSEEvent]:
    """Yield events as they arrive; comments (pings) are skipped."""
    event_id: int | None = None
    name = "message"
    data: list[str] = []
    async for line in response.aiter_lines():
        if line == "":
            if data:
                raw = "\n".join(data)
                try:
                    payload: Any = json.loads(raw)
                except json.JSONDecodeError:
                    payload = raw
                yield SSEEvent(event_id, name, payload)
            event_id, name, data = None, "message", []
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "id":
            event_id = int(value)
        elif field == "event":
            name = value
        elif field == "data":
            data.append(value)


async def collect(response: httpx.Response) -> list[SSEEvent]:
    return [event async for event in iter_sse(response)]


def parse_sse(raw: bytes) -> list[SSEEvent]:
    """The events in raw SSE bytes (complete frames), split on CR, LF or CRLF as EventSource does."""
    events: list[SSEEvent] = []
    event_id: int | None = None
    name = "message"
    data: list[str] = []
    for line in re.split(r"\r\n|\r|\n", raw.decode()):
        if line == "":
            if data:
                raw_data = "\n".join(data)
                try:
                    payload: Any = json.loads(raw_data)
                except json.JSONDecodeError:
                    payload = raw_data
                events.append(SSEEvent(event_id, name, payload))
            event_id, name, data = None, "message", []
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "id":
            event_id = int(value)
        elif field == "event":
            name = value
        elif field == "data":
            data.append(value)
    return events
