"""The offline demo model: deterministic, clearly labelled, no network.

It streams a fixed-shape reply word by word at a configurable rate, quotes the memories
it was given, and emits a tool call on cue, so every path of the backend runs offline.

Cues in the user's last message:
- ``/tool NAME {json}`` calls tool NAME with those arguments;
- a question about the time (``what time``, ``current time``, ``几点``) calls ``current_time``;
- ``/remember QUESTION`` calls ``recall_memory``;
- ``/fail`` fails before the first token, ``/fail-mid`` fails after a few words;
- ``/long`` gives a reply five times as long;
- a tool named VERB_NOUN (``get_weather``, ``search_docs``; verbs in ``CALL_VERBS``) is
  called when the message names its NOUN, with arguments made from its JSON schema.

It follows the client's `ModelOptions` as a real model would: a forced `tool_choice` (a
named function, or `required`: the tool the message names, else the last one offered,
which is the client's own) is called, `none` calls nothing, and `max_output_tokens` cuts
the reply. Images and files in the user's message are acknowledged ("I see 1 image …").

`reply_words` (DEMO_REPLY_WORDS) > 0 makes every text reply exactly that many words: the
filler is repeated or cut after what the reply says and quotes. A reply that quotes memories
is otherwise two to three times as long as one that does not, so a benchmark comparing
memory on and off would charge every per-token cost to memory more than once.

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

from chat_api.providers.base import Delta, ModelOptions, ProviderError, StreamEnd, TextDelta, ToolCallDelta

LABEL = "[demo model]"
FILLER = (
    "This reply comes from chatmem's built-in demo model, which runs offline and streams "
    "deterministic text so that every part of the backend can be tried without a real model. "
    "Point LLM_PROVIDER, LLM_BASE_URL and LLM_MODEL at any OpenAI-compatible endpoint for real answers."
)
TOOL_CUE = re.compile(r"/tool\s+([A-Za-z_][\w-]*)\s*(\{.*\})?", re.DOTALL)
TIME_CUE = re.compile(r"what time|current time|time is it|几点|现在时间", re.IGNORECASE)
# A tool named VERB_NOUN is called when the message names the noun ("weather" → get_weather).
CALL_VERBS = frozenset({"get", "fetch", "find", "lookup", "search", "list", "send", "create", "check"})


def _last(messages: Sequence[dict[str, Any]], role: str) -> dict[str, Any] | None:
    return next((m for m in reversed(messages) if m.get("role") == role), None)


def _text(message: dict[str, Any] | None) -> str:
    """The text of a message whose content is a string or chat-completions parts."""
    content = message.get("content") if message else None
    if isinstance(content, list):
        return "".join(
            str(p.get("text") or "") for p in content if isinstance(p, dict) and p.get("type") == "text"
        )
    return str(content or "")


def _attachments(message: dict[str, Any] | None) -> str:
    """ " I see 1 image and the file a.pdf." for the parts of a user message, or ""."""
    content = message.get("content") if message else None
    if not isinstance(content, list):
        return ""
    images = [p for p in content if isinstance(p, dict) and p.get("type") == "image_url"]
    files = [
        str((p.get("file") or {}).get("filename") or "file")
        for p in content
        if isinstance(p, dict) and p.get("type") == "file"
    ]
    seen = []
    if images:
        seen.append(f"{len(images)} image{'s' if len(images) > 1 else ''}")
    if files:
        seen.append(("the file " if len(files) == 1 else "the files ") + ", ".join(files))
    return f" I see {' and '.join(seen)}." if seen else ""


def _named_tool(user_text: str, tools: Sequence[dict[str, Any]]) -> str | None:
    """The VERB_NOUN tool whose noun the message names, if any."""
    words = set(re.findall(r"[a-z0-9]+", user_text.lower()))
    for tool in tools:
        name = str(tool["function"]["name"])
        verb, _, noun = name.lower().partition("_")
        if verb in CALL_VERBS and noun and set(noun.split("_")) <= words:
            return name
    return None


def _arguments_for(tool: dict[str, Any], user_text: str) -> str:
    """Arguments that satisfy the tool's JSON schema: its required properties, filled plainly."""
    schema = tool["function"].get("parameters") or {}
    properties = schema.get("properties") or {}
    required = schema.get("required") or list(properties)
    values: dict[str, Any] = {}
    for key in required:
        spec = properties.get(key) or {}
        kind = spec.get("type")
        if spec.get("enum"):
            values[key] = spec["enum"][0]
        elif kind in ("integer", "number"):
            values[key] = spec.get("minimum", 1)
        elif kind == "boolean":
            values[key] = True
        elif kind == "array":
            values[key] = []
        elif kind == "object":
            values[key] = {}
        else:
            values[key] = user_text[:100]
    return json.dumps(values, ensure_ascii=False)


# The reply's part the context builder puts before the latest user's words (memories and
# the time, or the time alone, in either shipped language).
REPLY_PART = re.compile(
    r"^(?:<memories>.*?</memories>|\(Current time: [^)]*\)|（当前时间：[^）]*）)\s*", re.DOTALL
)


def _user_words(messages: Sequence[dict[str, Any]]) -> str:
    """The latest user message's own words, without the reply's part."""
    user = _last(messages, "user")
    return REPLY_PART.sub("", _text(user), count=1) if user else ""


def _memories(messages: Sequence[dict[str, Any]]) -> list[str]:
    """Lines of the memory block the context builder put before the latest user's words."""
    user = _last(messages, "user")
    found = REPLY_PART.match(_text(user)) if user else None
    if found is None:
        return []
    return [ln[2:].strip() for ln in found.group(0).splitlines() if ln.startswith("- ")]


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

    def __init__(
        self, *, tokens_per_second: float = 40.0, first_token_delay: float = 0.0, reply_words: int = 0
    ) -> None:
        self.model = "chatmem-demo"
        self.interval = 1.0 / tokens_per_second
        self.first_token_delay = first_token_delay
        self.reply_words = reply_words

    def _plan(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None,
        options: ModelOptions | None = None,
    ) -> tuple[list[str], tuple[str, str] | None]:
        last = messages[-1] if messages else {}
        user = _last(messages, "user")
        user_text = _user_words(messages)
        choice = options.tool_choice if options is not None else None
        if choice == "none":
            tools = None
        tool_names = {t["function"]["name"] for t in tools or ()}
        if last.get("role") == "tool":
            result = str(last.get("content") or "")
            words = f"{LABEL} The tool answered: {result[:400]}".split(" ")
            return words, None
        if tools and choice not in (None, "auto"):
            forced = choice.get("name") if isinstance(choice, dict) else None
            name = forced or _named_tool(user_text, tools) or str(tools[-1]["function"]["name"])
            tool = next(t for t in tools if t["function"]["name"] == name)
            return [], (name, _arguments_for(tool, user_text))
        if tools:
            if (cue := TOOL_CUE.search(user_text)) and cue.group(1) in tool_names:
                return [], (cue.group(1), cue.group(2) or "{}")
            if TIME_CUE.search(user_text) and "current_time" in tool_names:
                return [], ("current_time", json.dumps({"timezone": "UTC"}))
            if user_text.startswith("/remember") and "recall_memory" in tool_names:
                query = user_text.removeprefix("/remember").strip() or user_text
                return [], ("recall_memory", json.dumps({"query": query}, ensure_ascii=False))
            if (named := _named_tool(user_text, tools)) is not None:
                tool = next(t for t in tools if t["function"]["name"] == named)
                return [], (named, _arguments_for(tool, user_text))
        text = f"{LABEL} You said: “{user_text[:200]}”.{_attachments(user)}"
        memories = _memories(messages)
        if memories:
            text += " I remember: " + " | ".join(memories[:3]) + "."
        words = text.split(" ")
        if self.reply_words:
            filler_words = FILLER.split(" ")
            while len(words) < self.reply_words:
                words += filler_words
            return words[: self.reply_words], None
        filler = FILLER * (5 if "/long" in user_text else 1)
        return words + filler.split(" "), None

    async def stream(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        options: ModelOptions | None = None,
    ) -> AsyncGenerator[Delta, None]:
        """Stream the demo reply; one word (or argument fragment) per tick."""
        words, call = self._plan(messages, tools, options)
        user_text = _user_words(messages)
        limit = options.max_output_tokens if options is not None else None
        finish_reason = "stop"
        if limit is not None and len(words) > limit:
            words, finish_reason = words[:limit], "length"
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
        prompt_tokens = sum(len(_text(m).split()) for m in messages)
        yield StreamEnd(
            finish_reason=finish_reason,
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
