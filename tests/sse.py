"""Reads an SSE response the way a browser's EventSource does: one parser, live or from raw bytes."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class SSEEvent:
    id: int | None
    event: str
    data: Any


@dataclass
class _Parser:
    """Feeds lines in, hands complete events out; comments (pings) are skipped."""

    event_id: int | None = None
    name: str = "message"
    data: list[str] = field(default_factory=list)

    def feed(self, line: str) -> SSEEvent | None:
        if line == "":
            event = None
            if self.data:
                raw = "\n".join(self.data)
                try:
                    payload: Any = json.loads(raw)
                except json.JSONDecodeError:
                    payload = raw
                event = SSEEvent(self.event_id, self.name, payload)
            self.event_id, self.name, self.data = None, "message", []
            return event
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "id":
            self.event_id = int(value)
        elif name == "event":
            self.name = value
        elif name == "data":
            self.data.append(value)
        return None


async def iter_sse(response: httpx.Response) -> AsyncIterator[SSEEvent]:
    """Yield events as they arrive."""
    parser = _Parser()
    async for line in response.aiter_lines():
        if (event := parser.feed(line)) is not None:
            yield event


async def collect(response: httpx.Response) -> list[SSEEvent]:
    return [event async for event in iter_sse(response)]


def parse_sse(raw: bytes) -> list[SSEEvent]:
    """The events in raw SSE bytes (complete frames), split on CR, LF or CRLF as EventSource does."""
    return _parse_lines(re.split(r"\r\n|\r|\n", raw.decode()))


def _parse_lines(lines: Iterable[str]) -> list[SSEEvent]:
    parser = _Parser()
    return [event for line in lines if (event := parser.feed(line)) is not None]
