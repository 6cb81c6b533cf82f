"""A scripted OpenAI-compatible server over real HTTP, for tests of anything that calls a model.

It is a process edge, so it is faked here rather than mocked: uvicorn serves a small
Starlette app on 127.0.0.1 in a background thread, and clients talk to it through the
real `openai` SDK and a real socket. It speaks the Chat Completions wire format
(`data: {chunk}` events ending with `data: [DONE]`, a final usage chunk, tool-call
arguments split over many chunks), refuses invalid message lists with the API's 400
body (see `tests/openai_rules.py`), and plays scripted failures: an HTTP error status
(429 with Retry-After, 500, ...), a connection dropped after N chunks, slow chunks.

Every request is recorded with its body, and for streams whether the client went away
before the end, which is how tests prove that "stop" closes the upstream connection.
The server thread has its own event loop, so recorded state is guarded by a lock and
signalled with `threading.Event`s that tests await through `asyncio.to_thread`.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from tests.openai_rules import check_tools, find_message_error

DEFAULT_TEXT = "Hello from the fake model."
ERROR_TYPES = {429: "rate_limit_error", 401: "authentication_error", 404: "not_found_error"}


@dataclass(frozen=True)
class ToolCall:
    """A tool call the fake model makes; `arguments` is sent verbatim when it is a string."""

    name: str
    arguments: str | dict[str, Any] = "{}"
    id: str | None = None

    def arguments_text(self) -> str:
        return self.arguments if isinstance(self.arguments, str) else json.dumps(self.arguments)


@dataclass(frozen=True)
class Reply:
    """One scripted answer.

    `fail_status` answers with that HTTP error instead (with `Retry-After: retry_after`
    when given). `drop_after_chunks` closes the connection after that many `data:` events
    (the first event is the role chunk, so 2 means "after the first text piece").
    `chunk_delay` is waited before every event, or before a non-streamed answer.
    Text is split every `text_chunk_chars` characters and tool arguments every
    `args_chunk_chars`. `usage` overrides the computed token counts.
    """

    text: str = ""
    tool_calls: tuple[ToolCall, ...] | list[ToolCall] = ()
    chunk_delay: float = 0.0
    fail_status: int | None = None
    fail_message: str | None = None
    retry_after: float | None = None
    drop_after_chunks: int | None = None
    text_chunk_chars: int = 4
    args_chunk_chars: int = 3
    finish_reason: str | None = None
    usage: dict[str, int] | None = None


@dataclass
class RecordedRequest:
    """One request the fake received, and what became of its response."""

    body: dict[str, Any]
    status: int = 200
    chunks_sent: int = 0
    finished: threading.Event = field(default_factory=threading.Event)
    client_disconnected: threading.Event = field(default_factory=threading.Event)
    completed: bool = False

    @property
    def messages(self) -> list[dict[str, Any]]:
        return list(self.body.get("messages") or [])

    @property
    def tools(self) -> list[dict[str, Any]] | None:
        return self.body.get("tools")

    @property
    def model(self) -> str | None:
        return self.body.get("model")

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    async def wait_disconnected(self, within: float = 5.0) -> bool:
        """Wait until the client left this stream before its end; False if not within `within` seconds."""
        return await asyncio.to_thread(self.client_disconnected.wait, within)

    async def wait_finished(self, within: float = 5.0) -> bool:
        """Wait until the server is done with this request, however it ended."""
        return await asyncio.to_thread(self.finished.wait, within)


class FakeOpenAI:
    """A real HTTP server speaking the OpenAI Chat Completions API from a script of replies."""

    def __init__(self, *, model_name: str = "fake-model") -> None:
        self.model_name = model_name
        self._script: deque[Reply] = deque()
        self._requests: list[RecordedRequest] = []
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port: int = self._sock.getsockname()[1]
        app = Starlette(routes=[Route("/v1/chat/completions", self._chat_completions, methods=["POST"])])
        config = uvicorn.Config(
            app, log_level="critical", lifespan="off", timeout_graceful_shutdown=1, access_log=False
        )
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def requests(self) -> list[RecordedRequest]:
        with self._lock:
            return list(self._requests)

    def script(self, *replies: Reply) -> None:
        """Queue replies, answered in order; once they are used up, a short default text is answered."""
        with self._lock:
            self._script.extend(replies)

    def start(self) -> FakeOpenAI:
        """Serve in a background thread; return once the socket accepts requests."""
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("fake OpenAI server did not start")
            time.sleep(0.005)
        return self

    def stop(self) -> None:
        """Shut the server down, cutting streams still open."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._sock.close()

    def __enter__(self) -> FakeOpenAI:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _next_reply(self) -> Reply:
        with self._lock:
            return self._script.popleft() if self._script else Reply(text=DEFAULT_TEXT)

    async def _chat_completions(self, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return _error(400, "We could not parse the JSON body of your request.", code=None)
        record = RecordedRequest(body=body)
        with self._lock:
            self._requests.append(record)
        response = self._answer(record, body)
        if not isinstance(response, _StreamedReply | _NonStreamedReply):
            record.status = response.status_code
            record.completed = True
            record.finished.set()
        return response

    def _answer(self, record: RecordedRequest, body: dict[str, Any]) -> Response:
        if not isinstance(body.get("model"), str) or not body["model"]:
            return _error(400, "you must provide a model parameter", code=None, param="model")
        problem = find_message_error(body.get("messages"))
        if problem is not None:
            return _error(400, problem.message, code=problem.code, param=problem.param)
        tools_problem = check_tools(body.get("tools"))
        if tools_problem is not None:
            return _error(400, tools_problem, code="invalid_value", param="tools")
        reply = self._next_reply()
        if reply.fail_status is not None:
            headers = {"retry-after": f"{reply.retry_after:g}"} if reply.retry_after is not None else {}
            message = reply.fail_message or f"The fake server answers {reply.fail_status} as scripted."
            return _error(reply.fail_status, message, code=None, headers=headers)
        usage = reply.usage or _usage(body, reply)
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return _StreamedReply(record, reply, body["model"], usage if include_usage else None)
        return _NonStreamedReply(record, _completion(reply, body["model"], usage), reply.chunk_delay)


class _NonStreamedReply(JSONResponse):
    """Answers after `delay`, unless the client gives up first (a timed-out caller)."""

    def __init__(self, record: RecordedRequest, content: dict[str, Any], delay: float) -> None:
        super().__init__(content)
        self._record = record
        self._delay = delay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            if self._delay:
                try:
                    async with asyncio.timeout(self._delay):
                        await _wait_disconnect(receive)
                    self._record.client_disconnected.set()
                    return
                except TimeoutError:
                    pass
            self._record.completed = True
            await super().__call__(scope, receive, send)
        finally:
            self._record.finished.set()


class _StreamedReply(Response):
    """Sends the chunks while watching for the client to go away; records which happened first."""

    def __init__(
        self, record: RecordedRequest, reply: Reply, model: str, usage: dict[str, int] | None
    ) -> None:
        super().__init__(media_type="text/event-stream")
        self._record = record
        self._reply = reply
        self._model = model
        self._usage = usage

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        record = self._record
        try:
            async with asyncio.TaskGroup() as group:
                sender = group.create_task(self._send_events(send))
                watcher = group.create_task(_wait_disconnect(receive))
                done, _ = await asyncio.wait({sender, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if watcher in done and not record.completed:
                    record.client_disconnected.set()
                sender.cancel()
                watcher.cancel()
        finally:
            record.finished.set()

    async def _send_events(self, send: Send) -> None:
        record, reply = self._record, self._reply
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for event in _stream_events(reply, self._model, self._usage):
            if reply.drop_after_chunks is not None and record.chunks_sent >= reply.drop_after_chunks:
                # Returning without the final empty body makes uvicorn close the socket mid-body:
                # the client sees an incomplete chunked response, as when a proxy drops it.
                return
            if reply.chunk_delay:
                await asyncio.sleep(reply.chunk_delay)
            await send({"type": "http.response.body", "body": event, "more_body": True})
            record.chunks_sent += 1
        record.completed = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _stream_events(reply: Reply, model: str, usage: dict[str, int] | None) -> Iterator[bytes]:
    """The `data:` events of a streamed reply, in the order the real API sends them."""
    base = {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": "fp_fake",
    }

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        data = {**base, "choices": [choice]}
        if usage is not None:
            data["usage"] = None
        return _event(data)

    yield chunk({"role": "assistant", "content": "", "refusal": None})
    step = max(1, reply.text_chunk_chars)
    for start in range(0, len(reply.text), step):
        yield chunk({"content": reply.text[start : start + step]})
    for index, call in enumerate(reply.tool_calls):
        head = {"index": index, "id": _call_id(call, index), "type": "function"}
        yield chunk({"tool_calls": [{**head, "function": {"name": call.name, "arguments": ""}}]})
        arguments = call.arguments_text()
        step = max(1, reply.args_chunk_chars)
        for start in range(0, len(arguments), step):
            piece = arguments[start : start + step]
            yield chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
    yield chunk({}, _finish_reason(reply))
    if usage is not None:
        yield _event({**base, "choices": [], "usage": usage})
    yield b"data: [DONE]\n\n"


def _completion(reply: Reply, model: str, usage: dict[str, int]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.text or None, "refusal": None}
    if reply.tool_calls:
        message["tool_calls"] = [
            {
                "id": _call_id(call, i),
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments_text()},
            }
            for i, call in enumerate(reply.tool_calls)
        ]
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": "fp_fake",
        "choices": [
            {"index": 0, "message": message, "logprobs": None, "finish_reason": _finish_reason(reply)}
        ],
        "usage": usage,
    }


def _usage(body: dict[str, Any], reply: Reply) -> dict[str, int]:
    """Token counts that tests can predict: one token per whitespace-separated word."""
    prompt = sum(len(str(m.get("content") or "").split()) for m in body.get("messages") or [])
    completion = len(reply.text.split()) + sum(len(c.arguments_text().split()) + 1 for c in reply.tool_calls)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _finish_reason(reply: Reply) -> str:
    return reply.finish_reason or ("tool_calls" if reply.tool_calls else "stop")


def _call_id(call: ToolCall, index: int) -> str:
    return call.id or f"call_fake_{index}"


def _event(data: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def _error(
    status: int,
    message: str,
    *,
    code: str | None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    error_type = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    body = {"error": {"message": message, "type": error_type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


@pytest.fixture
def fake_openai() -> Iterator[FakeOpenAI]:
    """A running fake OpenAI server, fresh for each test."""
    with FakeOpenAI() as server:
        yield server


async def collect(stream: AsyncIterator[Any]) -> list[Any]:
    """Drain an async iterator into a list."""
    return [item async for item in stream]
