"""The chat provider for any OpenAI-compatible endpoint (OpenAI, DeepSeek, Qwen, vLLM, Ollama, ...).

Retries are ours, not the SDK's (its `max_retries` is 0), because only we know whether a
delta has already been handed to the caller: before the first delta a failed attempt is
invisible and may be retried with backoff (429, 408, 409, 5xx, timeouts, connection
errors; `Retry-After` is honoured); after it, the user has seen part of a reply, and a
retry would show a different second half, so the failure is final (`retryable=False`).

Closing the stream — `aclose()` by the runner on stop, or cancellation of the task that
iterates it — closes the HTTP response in `finally`, which closes the socket; the
endpoint sees the disconnect and stops generating, so a stopped reply stops costing.
"""

from __future__ import annotations

import asyncio
import email.utils
import random
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import openai
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionChunk

from chat_api.providers.base import Delta, ModelOptions, ProviderError, StreamEnd, TextDelta, ToolCallDelta

if TYPE_CHECKING:
    from memory.config import Settings

RETRYABLE_STATUSES = frozenset({408, 409, 429})
# A server asking us to wait longer than this is not going to answer a waiting user in time.
MAX_RETRY_AFTER_SECONDS = 20.0
# Local servers (Ollama, llama.cpp, vLLM) take no key, but the SDK insists on one.
PLACEHOLDER_API_KEY = "not-needed"

Sleep = Callable[[float], Awaitable[None]]


class OpenAIProvider:
    """Streams chat completions from an OpenAI-compatible endpoint through the official SDK."""

    name = "openai"

    def __init__(
        self,
        *,
        base_url: str | None,
        api_key: str | None,
        model: str,
        timeout: float,
        max_retries: int,
        retry_base_seconds: float,
        rewrite_model: str | None = None,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        self.model = model
        self.rewrite_model = rewrite_model or model
        self._max_retries = max_retries
        self._retry_base_seconds = retry_base_seconds
        self._timeout = timeout
        # Injectable so tests can see the backoff delays without waiting them out.
        self._sleep = sleep
        self._client = AsyncOpenAI(
            base_url=base_url,
            api_key=api_key or PLACEHOLDER_API_KEY,
            timeout=timeout,
            max_retries=0,
        )

    @classmethod
    def from_settings(cls, settings: Settings) -> OpenAIProvider:
        """Build the provider from LLM_* and REWRITE_MODEL settings."""
        return cls(
            base_url=settings.llm_base_url,
            api_key=settings.llm_api_key.get_secret_value() if settings.llm_api_key else None,
            model=settings.llm_model,
            timeout=settings.llm_timeout_seconds,
            max_retries=settings.llm_max_retries,
            retry_base_seconds=settings.llm_retry_base_seconds,
            rewrite_model=settings.rewrite_model,
        )

    async def stream(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        options: ModelOptions | None = None,
    ) -> AsyncGenerator[Delta, None]:
        """Stream one model step as deltas ending with a StreamEnd; retry only before the first delta."""
        attempt = 0
        yielded = False
        while True:
            response: openai.AsyncStream[ChatCompletionChunk] | None = None
            try:
                response = await self._client.chat.completions.create(
                    model=self.model,
                    messages=cast(Any, list(messages)),
                    tools=cast(Any, list(tools)) if tools else openai.omit,
                    **_option_arguments(options, bool(tools)),
                    stream=True,
                    stream_options={"include_usage": True},
                )
                finish_reason: str | None = None
                usage: dict[str, int] = {}
                async for chunk in response:
                    if chunk.usage is not None:
                        usage = _usage_dict(chunk.usage)
                    for choice in chunk.choices[:1]:
                        finish_reason = choice.finish_reason or finish_reason
                        for delta in _deltas(choice.delta):
                            yielded = True
                            yield delta
                if finish_reason is None:
                    raise ProviderError("the model stream ended without a finish_reason", retryable=True)
                yield StreamEnd(finish_reason=finish_reason, usage=usage)
                return
            except (openai.OpenAIError, ValueError, ProviderError) as exc:
                error = exc if isinstance(exc, ProviderError) else provider_error(exc)
                if yielded:
                    raise ProviderError(
                        f"the model stream failed after the first token: {error}",
                        retryable=False,
                        status=error.status,
                    ) from exc
                delay = self._retry_delay(attempt, error, exc)
                if delay is None:
                    raise error from exc
            finally:
                if response is not None:
                    await response.close()
            await self._sleep(delay)
            attempt += 1

    async def complete(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        model: str | None = None,
        timeout: float | None = None,
    ) -> str:
        """Return the text of one non-streamed completion; `timeout` bounds all attempts together."""
        deadline = None if timeout is None else time.monotonic() + timeout
        attempt = 0
        while True:
            remaining = self._timeout if deadline is None else deadline - time.monotonic()
            try:
                if remaining <= 0:
                    raise TimeoutError
                async with asyncio.timeout(remaining):
                    completion = await self._client.chat.completions.create(
                        model=model or self.rewrite_model,
                        messages=cast(Any, list(messages)),
                        timeout=remaining,
                    )
                if not completion.choices:
                    raise ProviderError("the model returned no choices", retryable=True)
                return completion.choices[0].message.content or ""
            except (openai.OpenAIError, ValueError, ProviderError, TimeoutError) as exc:
                if isinstance(exc, TimeoutError):
                    error = ProviderError(f"no completion within {remaining:.3g}s", retryable=True)
                else:
                    error = exc if isinstance(exc, ProviderError) else provider_error(exc)
                delay = self._retry_delay(attempt, error, exc)
                if delay is None or (deadline is not None and time.monotonic() + delay >= deadline):
                    raise error from exc
            await self._sleep(delay)
            attempt += 1

    async def aclose(self) -> None:
        """Close the HTTP client and its connections."""
        await self._client.close()

    def _retry_delay(self, attempt: int, error: ProviderError, exc: BaseException) -> float | None:
        """Seconds to wait before the next attempt, or None when the error is final."""
        if not error.retryable or attempt >= self._max_retries:
            return None
        asked = _retry_after_seconds(exc)
        if asked is not None:
            return asked if asked <= MAX_RETRY_AFTER_SECONDS else None
        # Exponential backoff with up to 25% jitter, so replicas hit by the same outage spread out.
        return self._retry_base_seconds * (2**attempt) * (1 + random.random() / 4)


def provider_error(exc: BaseException) -> ProviderError:
    """Translate an SDK exception into a ProviderError with its HTTP status and retryability."""
    if isinstance(exc, openai.APIStatusError):
        status = exc.status_code
        body = exc.body
        detail = body.get("message") if isinstance(body, dict) else None
        retryable = status in RETRYABLE_STATUSES or status >= 500
        return ProviderError(
            f"model endpoint answered {status}: {detail or exc.message}", retryable=retryable, status=status
        )
    if isinstance(exc, openai.APITimeoutError):
        return ProviderError("model endpoint timed out", retryable=True)
    if isinstance(exc, openai.APIConnectionError):
        cause = exc.__cause__
        return ProviderError(f"model endpoint connection failed: {cause or exc.message}", retryable=True)
    if isinstance(exc, openai.APIError):
        # An `error` object inside an otherwise successful stream.
        return ProviderError(f"model endpoint reported an error: {exc.message}", retryable=False)
    if isinstance(exc, ValueError):
        return ProviderError(f"model endpoint sent malformed data: {exc}", retryable=False)
    return ProviderError(f"model endpoint failed: {exc}", retryable=False)


def _deltas(delta: Any) -> list[Delta]:
    out: list[Delta] = []
    if delta is None:
        return out
    if delta.content:
        out.append(TextDelta(delta.content))
    refusal = getattr(delta, "refusal", None)
    if refusal:
        # A refusal is what the user reads in place of an answer.
        out.append(TextDelta(refusal))
    for call in delta.tool_calls or ():
        function = call.function
        out.append(
            ToolCallDelta(
                index=call.index,
                id=call.id or None,
                name=(function.name or None) if function else None,
                arguments=(function.arguments or "") if function else "",
            )
        )
    return out


def _usage_dict(usage: Any) -> dict[str, int]:
    fields = ("prompt_tokens", "completion_tokens", "total_tokens")
    return {name: value for name in fields if isinstance(value := getattr(usage, name, None), int)}


def _retry_after_seconds(exc: BaseException) -> float | None:
    """The server's requested wait (`retry-after-ms`, or `retry-after` as seconds or HTTP date)."""
    response = getattr(exc, "response", None)
    if response is None:
        return None
    headers = response.headers
    millis = headers.get("retry-after-ms")
    if millis:
        try:
            return max(0.0, float(millis) / 1000)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _option_arguments(options: ModelOptions | None, has_tools: bool) -> dict[str, Any]:
    """The client's choices as chat-completions arguments (only those it made)."""
    if options is None:
        return {}
    out: dict[str, Any] = {}
    if options.temperature is not None:
        out["temperature"] = options.temperature
    if options.top_p is not None:
        out["top_p"] = options.top_p
    if options.max_output_tokens is not None:
        out["max_tokens"] = options.max_output_tokens
    if has_tools and options.tool_choice is not None:
        choice = options.tool_choice
        if isinstance(choice, dict):
            choice = {"type": "function", "function": {"name": choice.get("name")}}
        out["tool_choice"] = choice
    return out
