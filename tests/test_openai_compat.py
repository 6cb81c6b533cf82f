"""The OpenAI-compatible API (`/openai/v1`) with the official `openai` Python SDK, on a live `chatmem serve`.

One server process for the module (the demo model at 40 tokens/s); each test is its own
user, so tests never see each other's conversations. What was stored is read back
through chatmem's own API.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from memory.config import Settings
from tests.conftest import auth
from tests.openai_support import (
    MODEL,
    TENANT,
    WEATHER_TOOL,
    async_sdk,
    conversations,
    ended_turns,
    make_key,
    new_user,
    sdk,
    turns,
)
from tests.procs import ServerProcess, server_process

# The bound the live server runs with (MAX_OUTPUT_TOKENS, by default).
MAX_OUTPUT_TOKENS: int = Settings.model_fields["max_output_tokens"].default


@pytest.fixture(scope="module")
async def live(pg_url: str) -> AsyncIterator[ServerProcess]:
    async with server_process(pg_url, demo_tokens_per_second=40) as proc:
        yield proc


# --- endpoints -----------------------------------------------------------------------


async def test_models_lists_the_running_demo_model(live: ServerProcess) -> None:
    client = sdk(live, await make_key(live, new_user()))
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


async def test_sync_non_streaming_completion_is_stored(live: ServerProcess) -> None:
    user = new_user()
    client = sdk(live, await make_key(live, user))
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}],
    )
    completion = raw.parse()
    conversation_id = raw.headers["x-chatmem-conversation-id"]
    assert raw.headers["x-chatmem-memory-count"] == "0"
    assert completion.object == "chat.completion"
    assert completion.choices[0].finish_reason == "stop"
    text = completion.choices[0].message.content or ""
    assert "You said" in text and "hello there" in text
    assert completion.usage is not None and completion.usage.completion_tokens > 0
    stored = await turns(live, user, conversation_id)
    assert [(t["role"], t["status"]) for t in stored] == [("user", "completed"), ("assistant", "completed")]
    assert stored[0]["content"] == "hello there"
    assert stored[1]["content"] == text


async def test_async_streaming_with_usage_ends_with_done(live: ServerProcess) -> None:
    user = new_user()
    client = async_sdk(live, await make_key(live, user))
    response = await client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "stream this please"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    conversation_id = response.headers["x-chatmem-conversation-id"]
    stream = response.parse()
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens > 0
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    stored = await ended_turns(live, user, conversation_id)
    assert stored[-1]["status"] == "completed" and stored[-1]["content"] == text


async def test_raw_stream_ends_with_data_done(live: ServerProcess) -> None:
    user = new_user()
    key = await make_key(live, user)
    async with httpx.AsyncClient(base_url=live.base_url, timeout=30) as http:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "raw"}], "stream": True}
        async with http.stream(
            "POST", "/openai/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        ) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "stop"


# --- client tools ----------------------------------------------------------------------


async def test_client_tool_call_streams_back_and_its_result_is_stored(live: ServerProcess) -> None:
    user = new_user()
    client = async_sdk(live, await make_key(live, user))
    question = {"role": "user", "content": '/tool get_weather {"city": "Paris"}'}
    response = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[question], tools=[WEATHER_TOOL], stream=True
    )
    conversation_id = response.headers["x-chatmem-conversation-id"]
    chunks = [chunk async for chunk in response.parse()]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["tool_calls"]
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    call_id = deltas[0].id
    assert call_id and deltas[0].function and deltas[0].function.name == "get_weather"
    arguments = "".join((d.function.arguments or "") for d in deltas if d.function)
    assert json.loads(arguments) == {"city": "Paris"}
    assert all(d.index == 0 for d in deltas)

    # The client runs the tool and sends the result (no conversation header: the call id says where).
    answer = await client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[
            question,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call_id, "content": "sunny, 21 degrees"},
        ],
        tools=[WEATHER_TOOL],
    )
    assert answer.headers["x-chatmem-conversation-id"] == conversation_id
    completion = answer.parse()
    assert "The tool answered: sunny, 21 degrees" in (completion.choices[0].message.content or "")
    stored = await ended_turns(live, user, conversation_id)
    assert [t["role"] for t in stored] == ["user", "assistant", "tool", "assistant"]
    assert stored[1]["tool_calls"][0]["id"] == call_id and stored[1]["tool_calls"][0]["state"] == "ready"
    assert stored[2]["tool_call_id"] == call_id and stored[2]["content"] == "sunny, 21 degrees"
    # The model saw the call and its result, in order.
    async with live.client(TENANT, user) as api:
        context = (await api.get(f"/v1/conversations/{conversation_id}/context")).json()
    roles = [m["role"] for m in context["messages"] if m["role"] != "system"]
    assert roles[-4:] == ["user", "assistant", "tool", "assistant"] or roles[-3:] == [
        "user",
        "assistant",
        "tool",
    ]


# --- stop ------------------------------------------------------------------------------


async def test_closing_the_stream_stops_the_reply_with_the_text_received(live: ServerProcess) -> None:
    user = new_user()
    client = sdk(live, await make_key(live, user))
    question = {"role": "user", "content": "/long tell me everything"}
    response = client.chat.completions.with_raw_response.create(model=MODEL, messages=[question], stream=True)
    conversation_id = response.headers["x-chatmem-conversation-id"]
    stream = response.parse()
    received = ""
    for chunk in stream:
        received += chunk.choices[0].delta.content or "" if chunk.choices else ""
        if len(received.split()) >= 12:
            break
    stream.close()  # the client's stop: the connection closes

    stored = await ended_turns(live, user, conversation_id)
    reply = stored[-1]
    assert reply["status"] == "interrupted_by_user"
    assert reply["interrupt_reason"] == "client_disconnected"
    assert reply["content"].startswith(received)
    # What the server sent after the client's last read, before it noticed the close: at most a word or two.
    assert len(reply["content"].split()) - len(received.split()) <= 2, (reply["content"], received)
    full = len(("x " * 300).split())
    assert len(reply["content"].split()) < full

    # The frontend sends the stopped reply back as it has it; the next request is accepted,
    # continues the same conversation, and the prompt is valid.
    again = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[question, {"role": "assistant", "content": received}, {"role": "user", "content": "go on"}],
    )
    assert again.headers["x-chatmem-conversation-id"] == conversation_id
    assert "go on" in (again.parse().choices[0].message.content or "")
    stored = await ended_turns(live, user, conversation_id)
    assert [(t["role"], t["status"]) for t in stored] == [
        ("user", "completed"),
        ("assistant", "interrupted_by_user"),
        ("user", "completed"),
        ("assistant", "completed"),
    ]


async def test_async_stream_closed_mid_tool_arguments_then_next_request(live: ServerProcess) -> None:
    user = new_user()
    client = async_sdk(live, await make_key(live, user))
    long_args = json.dumps({"city": "Paris " * 60})
    question = {"role": "user", "content": f"/tool get_weather {long_args}"}
    response = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[question], tools=[WEATHER_TOOL], stream=True
    )
    conversation_id = response.headers["x-chatmem-conversation-id"]
    stream = response.parse()
    pieces = 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.tool_calls:
            pieces += 1
            if pieces >= 5:
                break
    await stream.close()
    stored = await ended_turns(live, user, conversation_id)
    assert stored[-1]["status"] == "interrupted_by_user"
    assert stored[-1]["tool_calls"][0]["state"] == "streaming"  # half its JSON, kept as received
    follow_up = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "never mind, hi"}],
        extra_headers={"X-Chatmem-Conversation-Id": conversation_id},
    )
    assert "never mind" in (follow_up.choices[0].message.content or "")


# --- keys ------------------------------------------------------------------------------


def chatmem_cli(live: ServerProcess, *args: str) -> str:
    env = {**os.environ, "DATABASE_URL": live.env["DATABASE_URL"], "JWT_SECRET": live.env["JWT_SECRET"]}
    done = subprocess.run(
        [sys.executable, "-m", "chat_api.cli", *args], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


async def test_cli_key_create_use_revoke(live: ServerProcess) -> None:
    user = new_user()
    out = chatmem_cli(live, "keys", "create", "--tenant", TENANT, "--user", user, "--name", "laptop")
    key = out.splitlines()[0]
    assert key.startswith("cmk_")
    client = sdk(live, key)
    completion = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert completion.choices[0].message.content
    listed = chatmem_cli(live, "keys", "list", "--tenant", TENANT, "--user", user)
    assert "laptop" in listed and key not in listed
    key_id = listed.split()[0]
    # The key works on chatmem's own API too, as the same user.
    async with httpx.AsyncClient(base_url=live.base_url, headers={"Authorization": f"Bearer {key}"}) as api:
        mine = (await api.get("/v1/conversations")).json()["items"]
    assert len(mine) == 1
    chatmem_cli(live, "keys", "revoke", key_id, "--tenant", TENANT, "--user", user)
    with pytest.raises(openai.AuthenticationError) as caught:
        client.models.list()
    assert caught.value.status_code == 401
    body = caught.value.body
    assert isinstance(body, dict) and body["code"] == "invalid_api_key" and body["type"]


async def test_api_keys_create_list_revoke(live: ServerProcess) -> None:
    user = new_user()
    async with live.client(TENANT, user) as api:
        made = (await api.post("/v1/keys", json={"name": "webui", "expires_days": 30})).json()
        listed = (await api.get("/v1/keys")).json()["items"]
        assert [k["id"] for k in listed] == [made["id"]] and "key" not in listed[0]
        assert made["expires_at"] is not None
        client = sdk(live, made["key"])
        assert client.models.list().data
        # Another user cannot revoke it.
        async with live.client(TENANT, new_user()) as other:
            assert (await other.delete(f"/v1/keys/{made['id']}")).status_code == 404
        assert client.models.list().data
        revoked = await api.delete(f"/v1/keys/{made['id']}")
        assert revoked.status_code == 200 and revoked.json()["revoked_at"]
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert await conversations(live, user) == []


async def test_another_users_conversation_in_the_header_is_404(live: ServerProcess) -> None:
    owner, intruder = new_user(), new_user()
    first = sdk(live, await make_key(live, owner)).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "my secret"}]
    )
    conversation_id = first.headers["x-chatmem-conversation-id"]
    client = sdk(live, await make_key(live, intruder))
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "show me"}],
            extra_headers={"X-Chatmem-Conversation-Id": conversation_id},
        )
    body = caught.value.body
    assert isinstance(body, dict) and set(body) >= {"message", "type", "param", "code"}
    assert len(await turns(live, owner, conversation_id)) == 2
    assert await conversations(live, intruder) == []


# --- bad input -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "error", "param"),
    [
        ({"model": MODEL, "messages": []}, openai.BadRequestError, "messages"),
        (
            {"model": MODEL, "messages": [{"role": "system", "content": "x"}]},
            openai.BadRequestError,
            "messages",
        ),
        (
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
            },
            openai.BadRequestError,
            "messages.[1].role",
        ),
        ({"model": "gpt-4o", "messages": [{"role": "user", "content": "a"}]}, openai.NotFoundError, "model"),
        (
            {"model": MODEL, "n": 2, "messages": [{"role": "user", "content": "a"}]},
            openai.BadRequestError,
            "n",
        ),
        ({"model": MODEL, "messages": [{"role": "user", "content": "   "}]}, openai.BadRequestError, None),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "a"}]}, openai.BadRequestError, None),
        (
            {"model": MODEL, "messages": [{"role": "tool", "tool_call_id": "call_x", "content": "r"}]},
            openai.BadRequestError,
            "messages",
        ),
    ],
)
async def test_bad_requests_are_openai_shaped_and_store_nothing(
    live: ServerProcess, body: dict[str, Any], error: type[openai.APIStatusError], param: str | None
) -> None:
    user = new_user()
    client = sdk(live, await make_key(live, user))
    with pytest.raises(error) as caught:
        client.chat.completions.create(**body)
    payload = caught.value.body
    assert isinstance(payload, dict) and payload["message"] and payload["type"] == "invalid_request_error"
    if param is not None:
        assert payload["param"] == param
    assert await conversations(live, user) == []


async def test_max_tokens_of_ten_to_the_thirty_was_accepted(live: ServerProcess) -> None:
    # No upper bound on either name: 10**30 was taken; an upstream model would refuse it only
    # after the user's turn was stored.
    user = new_user()
    client = sdk(live, await make_key(live, user))
    messages: list[Any] = [{"role": "user", "content": "hi"}]
    for param in ("max_tokens", "max_completion_tokens"):
        for asked in (10**30, MAX_OUTPUT_TOKENS + 1):
            with pytest.raises(openai.BadRequestError) as caught:
                client.chat.completions.create(model=MODEL, messages=messages, **{param: asked})
            payload = caught.value.body
            assert isinstance(payload, dict) and payload["param"] == param, payload
            assert payload["type"] == "invalid_request_error" and str(MAX_OUTPUT_TOKENS) in payload["message"]
    assert await conversations(live, user) == []


@pytest.mark.parametrize(
    ("sent", "param"),
    [
        ({"stream": "yes"}, "stream"),
        ({"stream": 1}, "stream"),
        ({"stream": True, "stream_options": {"include_usage": "true"}}, "stream_options.include_usage"),
        ({"n": "1"}, "n"),
        ({"n": True}, "n"),
        ({"temperature": "0.5"}, "temperature"),
        ({"top_p": "1"}, "top_p"),
        ({"max_tokens": "64"}, "max_tokens"),
        ({"max_completion_tokens": 64.0}, "max_completion_tokens"),
    ],
)
async def test_a_flag_or_a_number_of_the_wrong_json_type_was_read_as_its_value(
    live: ServerProcess, sent: dict[str, Any], param: str
) -> None:
    """`"stream": "yes"` answered a stream, `"max_tokens": "64"` was 64, `"n": true` was 1: a
    value of the wrong JSON type is a 400 naming it, before any stream, with nothing stored."""
    user = new_user()
    client = sdk(live, await make_key(live, user))
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], extra_body=sent
        )
    payload = caught.value.body
    assert isinstance(payload, dict) and payload["type"] == "invalid_request_error", payload
    assert payload["param"] == param and payload["code"] == "invalid_type", payload
    # As the API words it.
    assert payload["message"].startswith(f"Invalid type for '{param}': expected "), payload
    assert caught.value.response.headers["content-type"].startswith("application/json")
    assert await conversations(live, user) == []


@pytest.mark.parametrize(
    ("sent", "param"),
    [
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"tool_choice": {}}, "tool_choice.type"),
        ({"tool_choice": {"type": "function"}}, "tool_choice.function"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
    ],
)
async def test_a_wrong_value_was_named_by_pydantics_location_not_the_field(
    live: ServerProcess, sent: dict[str, Any], param: str
) -> None:
    """param was `messages.0.content.str` or `tool_choice.literal['none','auto','required']`: the
    names of a union's members, which no client can find in its request."""
    user = new_user()
    client = sdk(live, await make_key(live, user))
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], extra_body=sent
        )
    payload = caught.value.body
    assert isinstance(payload, dict) and payload["param"] == param, payload
    assert f"'{param}'" in payload["message"] or payload["message"].startswith(f"{param}: "), payload
    assert await conversations(live, user) == []


async def test_a_function_tools_strict_flag_of_the_wrong_type_was_sent_on_to_the_model(
    live: ServerProcess,
) -> None:
    """`strict` was no field of the body's function tools: `"strict": "true"` went to the model as
    it was (an upstream refuses it, after the user's message was stored)."""
    user = new_user()
    client = sdk(live, await make_key(live, user))
    hi: list[Any] = [{"role": "user", "content": "hi"}]
    tool: dict[str, Any] = {**WEATHER_TOOL, "function": {**WEATHER_TOOL["function"], "strict": "true"}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=hi, tools=[tool])
    payload = caught.value.body
    assert isinstance(payload, dict) and payload["param"] == "tools[0].function.strict", payload
    assert await conversations(live, user) == []
    tool["function"]["strict"] = True
    assert client.chat.completions.create(model=MODEL, messages=hi, tools=[tool]).choices[0].message.content


@pytest.mark.parametrize(
    ("metadata", "param", "code"),
    [
        ({"chat_key": 5}, "metadata.chat_key", "invalid_type"),
        ({"conversation_id": 5}, "metadata.conversation_id", "invalid_type"),
        ({"tags": ["a", "b"]}, "metadata.tags", "invalid_type"),
        ({"note": None}, "metadata.note", "invalid_type"),
        ({f"k{i}": "v" for i in range(17)}, "metadata", None),
        ({"k" * 65: "v"}, "metadata", None),
        ({"k": "v" * 513}, "metadata", None),
    ],
)
async def test_metadata_that_is_no_map_of_short_strings_was_accepted(
    live: ServerProcess, metadata: dict[str, Any], param: str, code: str | None
) -> None:
    """`metadata` took any JSON (`{"chat_key": 5}` answered as if no key was sent, `{"conversation_id":
    5}` was a 404), and any number of keys of any length: the API's metadata is at most 16 string
    keys of at most 64 characters, each to a string of at most 512; anything else is a 400."""
    user = new_user()
    client = sdk(live, await make_key(live, user))
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], extra_body={"metadata": metadata}
        )
    payload = caught.value.body
    assert isinstance(payload, dict) and payload["type"] == "invalid_request_error", payload
    assert payload["param"] == param and payload["code"] == code, payload
    assert caught.value.status_code == 400
    assert await conversations(live, user) == []
    # At the bounds, it is taken.
    at_most: dict[str, str] = {f"k{i}": "v" for i in range(15)} | {"k" * 64: "v" * 512}
    taken = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], metadata=at_most
    )
    assert taken.choices[0].message.content


async def test_integers_for_numbers_and_a_frontends_extra_fields_are_still_accepted(
    live: ServerProcess,
) -> None:
    # What the API takes: an integer where a number is asked, options chatmem ignores, and the
    # fields Open WebUI and LibreChat add to a request.
    client = sdk(live, await make_key(live, new_user()))
    answered = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        temperature=1,
        top_p=1,
        max_tokens=64,
        extra_body={
            "seed": 7,
            "frequency_penalty": 0,
            "logit_bias": {},
            "stop": ["\n\n\n"],
            "user": "someone",
            "params": {"function_calling": "native"},
            "chat_id": "local",
            "features": {"web_search": False},
        },
    )
    assert answered.choices[0].message.content


async def test_huge_body_is_413_in_openai_shape(live: ServerProcess) -> None:
    user = new_user()
    client = sdk(live, await make_key(live, user))
    with pytest.raises(openai.APIStatusError) as caught:
        # Past MAX_HISTORY_BODY_BYTES (8 MB), this door's limit: refused by its length, unread.
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x" * 9_000_000}])
    assert caught.value.status_code == 413
    payload = caught.value.body
    assert isinstance(payload, dict) and payload["type"] == "invalid_request_error" and payload["message"]
    assert await conversations(live, user) == []


async def test_missing_key_is_401(live: ServerProcess) -> None:
    async with httpx.AsyncClient(base_url=live.base_url) as http:
        response = await http.get("/openai/v1/models")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
    async with httpx.AsyncClient(base_url=live.base_url, headers=auth(TENANT, new_user())) as http:
        assert (await http.get("/openai/v1/models")).status_code == 200  # a chatmem token works too


async def test_a_completion_that_waits_for_an_approval_is_no_5xx_for_the_sdk_to_retry(
    start_server: Any,
) -> None:
    # It was a 500: the SDK (2 retries by default) sent the request twice more, and each retry
    # interrupted the reply that waited for the person's decision, its approval cancelled.
    server = await start_server(tools_requiring_approval=["current_time"])
    user = new_user()
    token = auth(TENANT, user)["Authorization"].removeprefix("Bearer ")
    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/openai/v1", api_key=token, max_retries=2)
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "what time is it?"}]
    )
    assert raw.status_code == 200 and raw.headers["x-chatmem-status"] == "awaiting_approval"
    completion = raw.parse()
    assert completion.choices[0].message.content is None and not completion.choices[0].message.tool_calls
    async with server.client(TENANT, user) as api:
        stored = (await api.get(f"/v1/conversations/{raw.headers['x-chatmem-conversation-id']}/turns")).json()
    assert [(t["role"], t["status"]) for t in stored["items"]] == [
        ("user", "completed"),
        ("assistant", "awaiting_approval"),
    ]
