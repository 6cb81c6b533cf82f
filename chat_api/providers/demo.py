"""The offline demo model: deterministic, clearly labelled, no network.

It streams a fixed-shape reply word by word at a configurable rate, quotes the memories
it was given, and emits a tool call on cue, so every path of the backend runs offline.

Cues in the user's last message:
- ``/tool NAME {json}`` calls tool NAME with those arguments;
- a question about the time (``what time``, ``current time``, ``几点``) calls ``current_time``;
- ``/remember QUESTION`` calls ``recall_memory``;
- ``/fail`` fails before the first token, ``/fail-mid`` fails after a few words;
- ``/long`` gives a reply five times as long.

Pace: token i is due at ``start + i / tokens_per_second`` on the loop's clock, like a real
model whose tokens keep arriving on its socket at its own rate whatever our process is
doing. When the event loop wakes it late, the tokens already due are emitted at once
(as a socket read would return them), instead of each waiting a full interval after
the previous one: sleeping a fixed interval between tokens would let every late wake-up
slow the model down for the rest of the reply, and a busy server would see its own
lateness as a slower model rather than as delivery lag.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from chat_api.providers.base import Delta, ProviderError, StreamEnd, TextDelta, ToolCallDelta

LABEL = "[demo model]"
FILLER = (
    "This reply comes from chatmem's built-in demo model, which runs offline and streams "
    "deterministic text so that every part of the backend can be tried without a real model. "
    "Point LLM_PROVIDER, LLM_BASE_URL and LLM_MODEL at any OpenAI-compatible endpoint for real answers."
)
TOOL_CUE = re.compile(r"/tool\s+([A-Za-z_][\w-]*)\s*(\{.*\})?", re.DOTALL)
TIME_CUE = re.compile(r"what time|current time|time is it|几点|现在时间", re.IGNORECASE)


def _last(messages: Sequence[dict[str, Any]], role: str) -> dict[str, Any] | None:
    return next((m for m in reversed(messages) if m.get("role") == role), None)


def _memories(messages: Sequence[dict[str, Any]]) -> list[str]:
    """Lines of the memory block the context builder put in the system messages."""
    lines: list[str] = []
    for message in messages:
        if message.get("role") == "system":
            lines += [
                ln[2:].strip() for ln in str(message.get("content") or "").splitlines() if ln.startswith("- ")
            ]
    return lines


class _Pace:
    """Token i is due `i * interval` after the first; waits only for tokens not yet due."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.loop = asyncio.get_running_loop()
        self.due = self.loop.time()

    async def next_token(self) -> None:
        self.due += self.interval
        delay = self.due - self.loop.time()
        if delay > 0:
            await asyncio.sleep(delay)


class DemoProvider:
    """Streams deterministic text at `tokens_per_second`; emits tool calls on cue."""

    name = "demo"

    def __init__(self, *, tokens_per_second: float = 40.0, first_token_delay: float = 0.0) -> None:
        self.model = "chatmem-demo"
        self.interval = 1.0 / tokens_per_second
        self.first_token_delay = first_token_delay

    def _plan(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None
    ) -> tuple[list[str], tuple[str, str] | None]:
        last = messages[-1] if messages else {}
        user = _last(messages, "user")
        user_text = str(user.get("content") or "") if user else ""
        tool_names = {t["function"]["name"] for t in tools or ()}
        if last.get("role") == "tool":
            result = str(last.get("content") or "")
            words = f"{LABEL} The tool answered: {result[:400]}".split(" ")
            return words, None
        if tools:
            if (cue := TOOL_CUE.search(user_text)) and cue.group(1) in tool_names:
                return [], (cue.group(1), cue.group(2) or "{}")
            if TIME_CUE.search(user_text) and "current_time" in tool_names:
                return [], ("current_time", json.dumps({"timezone": "UTC"}))
            if user_text.startswith("/remember") and "recall_memory" in tool_names:
                query = user_text.removeprefix("/remember").strip() or user_text
                return [], ("recall_memory", json.dumps({"query": query}, ensure_ascii=False))
        text = f"{LABEL} You said: “{user_text[:200]}”."
        memories = _memories(messages)
        if memories:
            text += " I remember: " + " | ".join(memories[:3]) + "."
        filler = FILLER * (5 if "/long" in user_text else 1)
        return (text + " " + filler).split(" "), None

    async def stream(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None
    ) -> AsyncGenerator[Delta, None]:
        """Stream the demo reply; one word (or argument fragment) per tick."""
        words, call = self._plan(messages, tools)
        user = _last(messages, "user")
        user_text = str(user.get("content") or "") if user else ""
        if "/fail" in user_text and not any(m.get("role") == "tool" for m in messages[-1:]):
            if "/fail-mid" not in user_text:
                message = "demo model failure (asked for by /fail)"
                raise ProviderError(message, retryable=False, status=500, public=message)
        if self.first_token_delay:
            await asyncio.sleep(self.first_token_delay)
        emitted = 0
        pace = _Pace(self.interval)
        if call is not None:
            name, arguments = call
            yield ToolCallDelta(index=0, id=f"call_{uuid.uuid4().hex[:16]}", name=name)
            for start in range(0, len(arguments), 4):
                await pace.next_token()
                yield ToolCallDelta(index=0, arguments=arguments[start : start + 4])
            yield StreamEnd(finish_reason="tool_calls", usage={"completion_tokens": len(arguments) // 4 + 1})
            return
        for i, word in enumerate(words):
            if i:
                await pace.next_token()
            if "/fail-mid" in user_text and i == 5:
                message = "demo model failure mid-stream (asked for by /fail-mid)"
                raise ProviderError(message, status=500, public=message)
            yield TextDelta(word if i == 0 else " " + word)
            emitted += 1
        prompt_tokens = sum(len(str(m.get("content") or "").split()) for m in messages)
        yield StreamEnd(
            finish_reason="stop",
            usage={
                "prompt_tokens": prompt_tokens,
                "completion_tokens": emitted,
                "total_tokens": prompt_tokens + emitted,
            },
        )

    async def complete(
        self, messages: Sequence[dict[str, Any]], *, model: str | None = None, timeout: float | None = None
    ) -> str:
        """The demo model does not rewrite; callers use their heuristic."""
        raise ProviderError("the demo model has no completion endpoint", retryable=False)

    async def aclose(self) -> None:
        return None
