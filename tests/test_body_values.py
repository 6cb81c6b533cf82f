"""Bodies of very many tiny values are refused before they are parsed, on every door.

Found: 100,000 to 200,000 one-letter messages, well within MAX_HISTORY_BODY_BYTES, held every
stream of the process for 0.2 to 1.8 s while the door parsed and validated them (the JSON
parse and pydantic hold the GIL, in a worker thread too): the AG-UI and AI SDK doors bound no
message count and answered them, chat completions and Responses refused more than 5,000 turns
only once they had read them all. Every body is now held to MAX_BODY_VALUES, counted on its
bytes before it is parsed, and refused in the door's own error shape before any stream, with
nothing stored. Each client is the real one: the openai SDK and the mcp SDK here, `ai` and
@ag-ui/client in tests/js/body_values.test.mjs.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from openai.types.chat import ChatCompletionMessageParam

from chat_api.admission.inputs import SCAN_WINDOW, count_values
from memory.config import HttpSettings
from tests.conftest import LiveServer, token_for
from tests.support import new_conversation, run_node_tests
from tests.test_history_bodies import MODEL, openai_client

MAX_VALUES: int = HttpSettings.model_fields["max_body_values"].default
TINY = 100_000  # one-letter messages: 500,000 values as chat completions messages
JS_DIR = Path(__file__).parent / "js"
NODE = shutil.which("node")


def values_in(document: Any) -> int:
    """What `count_values` counts, from the parsed document: every value and key, empty
    arrays and objects twice."""
    if isinstance(document, dict):
        return 1 + (not document) + sum(1 + values_in(v) for v in document.values())
    if isinstance(document, list):
        return 1 + (not document) + sum(values_in(v) for v in document)
    return 1


def test_values_are_counted_outside_strings_whatever_the_strings_hold() -> None:
    # Strings full of what starts a value outside them, escaped quotes and backslashes, strings
    # longer than a scan window and strings the window cuts (at an escape too).
    awkward = 'a, b: [c] {d} \\" \\\\ "'
    documents: list[Any] = [
        {"messages": [{"role": "user", "content": awkward * n} for n in range(200)]},
        {"long": ["x,:[{" * SCAN_WINDOW, '\\"' * SCAN_WINDOW, "\\" * (SCAN_WINDOW + 1)], "after": [1, 2, {}]},
        [["", {}], {"": []}, [[[]]], None, True, -1.5e3],
        "a lone string, with: [every] {mark}",
    ]
    for document in documents:
        for separators in ((",", ":"), (", ", ": ")):
            body = json.dumps(document, separators=separators, ensure_ascii=False).encode()
            values = values_in(document)
            # Counted exactly when the strings must be skipped to tell (just under and at the count).
            assert count_values(body, up_to=values - 1) > values - 1
            assert count_values(body, up_to=values) <= values


def tiny_messages(n: int = TINY) -> list[dict[str, str]]:
    """Sent by the SDK as `extra_body`, which replaces what its typed argument gave: its own
    transform of 100,000 typed messages takes ~30 s."""
    return [{"role": "user", "content": "a"}] * n


SENT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


def assert_refused_as_openai(refused: openai.APIStatusError) -> None:
    assert refused.status_code == 400, refused
    body: dict[str, Any] = refused.body  # type: ignore[assignment]
    assert body["type"] == "invalid_request_error" and body["param"] == "body", body
    assert body["code"] == "json_out_of_bounds", body
    assert f"more than {MAX_VALUES} JSON values" in body["message"], body


async def stored_conversations(server: LiveServer) -> list[Any]:
    async with server.client() as api:
        return list((await api.get("/v1/conversations")).json()["items"])


async def test_100k_tiny_chat_completions_messages_are_openais_400_before_they_are_read(
    server: LiveServer,
) -> None:
    async with openai_client(server) as client:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as refused:
                await client.chat.completions.create(
                    model=MODEL, messages=SENT, stream=stream, extra_body={"messages": tiny_messages()}
                )
            assert_refused_as_openai(refused.value)
    assert await stored_conversations(server) == []


async def test_100k_tiny_responses_input_items_are_openais_400_before_they_are_read(
    server: LiveServer,
) -> None:
    async with openai_client(server) as client:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as refused:
                await client.responses.create(
                    model=MODEL, input="hi", stream=stream, extra_body={"input": tiny_messages()}
                )
            assert_refused_as_openai(refused.value)
    assert await stored_conversations(server) == []


async def test_a_native_message_and_an_import_past_the_value_cap_are_422_and_store_nothing(
    server: LiveServer,
) -> None:
    async with server.client() as api:
        cid = await new_conversation(api)
        # 260,000 values in 520 KB, within MAX_BODY_BYTES.
        answer = await api.post(
            f"/v1/conversations/{cid}/messages", json={"content": "hi", "padding": [0] * 260_000}
        )
        assert answer.status_code == 422, answer.text
        error = answer.json()["error"]
        assert error["code"] == "json_out_of_bounds" and error["details"]["max_values"] == MAX_VALUES
        # 325,000 values in 1.4 MB, within IMPORT_MAX_BODY_BYTES.
        turns = [{"role": "user", "content": "a", "metadata": {"n": i, "tags": [1, 2]}} for i in range(5000)]
        answer = await api.post(f"/v1/conversations/{cid}/import", json={"turns": turns * 5})
        assert answer.status_code == 422, answer.text
        assert answer.json()["error"]["code"] == "json_out_of_bounds"
        assert (await api.get(f"/v1/conversations/{cid}/turns")).json()["items"] == []


async def test_a_full_import_is_well_within_the_value_cap(start_server: Any) -> None:
    server: LiveServer = await start_server(import_turns_per_hour=0)
    turns = [
        {
            "role": "assistant" if i % 2 else "user",
            "content": f"turn {i}",
            "created_at": "2024-05-01T10:00:00Z",
            "name": "someone",
            "external_id": f"chatgpt-{i}",
            "metadata": {"source": "chatgpt", "model": "gpt-4o", "tags": ["a", "b"], "rating": 1},
        }
        for i in range(5000)  # IMPORT_MAX_TURNS
    ]
    assert values_in({"turns": turns}) < MAX_VALUES / 2
    async with server.client() as api:
        cid = await new_conversation(api)
        answer = await api.post(f"/v1/conversations/{cid}/import", json={"turns": turns})
        assert answer.status_code == 201, answer.text[:300]
        assert len(answer.json()["items"]) == 5000


async def test_an_mcp_call_past_the_value_cap_is_a_json_rpc_error_before_it_is_read(
    server: LiveServer,
) -> None:
    headers = {"Authorization": f"Bearer {token_for()}"}
    async with httpx2.AsyncClient(headers=headers, timeout=30) as http:
        async with Client(streamable_http_client(f"{server.base_url}/mcp", http_client=http)) as client:
            with pytest.raises(MCPError) as refused:
                await client.call_tool("search_memory", {"query": "bees", "padding": [0] * 260_000})
            assert f"more than {MAX_VALUES} JSON values" in str(refused.value)
            # The session goes on.
            assert (await client.call_tool("search_memory", {"query": "bees"})).is_error is False


@pytest.mark.skipif(NODE is None, reason="node is not installed")
async def test_the_ai_sdk_and_ag_ui_clients_sending_100k_tiny_messages_are_refused_before_any_stream(
    server: LiveServer,
) -> None:
    assert (JS_DIR / "node_modules" / "ai").is_dir(), "run `npm ci` in tests/js (make js-deps)"
    env = {
        **os.environ,
        "CHATMEM_URL": server.base_url,
        "CHATMEM_TOKEN": token_for("t1", "u1"),
        "CHATMEM_MAX_BODY_VALUES": str(MAX_VALUES),
    }
    await run_node_tests(JS_DIR, "body_values.test.mjs", env, timeout=120)
