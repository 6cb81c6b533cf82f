"""Free-form JSON is bounded at the door, and a stored value that cannot be shown never breaks a read.

Found: an import whose turn metadata nested 256 levels deep was stored (201), and from
then on the turn list, the turn and memory search answered 500; at 1,000 levels the
import itself answered 500.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import text

from memory.json_bounds import MAX_DEPTH
from memory.storage.db import Database
from tests.conftest import LiveServer, token_for
from tests.support import new_conversation
from tests.test_approvals import approve_url, park, required, transfer_tools


def nested(depth: int) -> dict[str, Any]:
    """An object `depth` levels deep: {"a": {"a": … {}}}."""
    value: dict[str, Any] = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


def nested_text(depth: int) -> str:
    """The same as JSON text, built without json.dumps (which cannot go past ~1,000 levels)."""
    return '{"a":' * (depth - 1) + "{}" + "}" * (depth - 1)


async def import_raw(client: httpx.AsyncClient, cid: str, turn_json: str) -> httpx.Response:
    body = '{"turns": [' + turn_json + "]}"
    return await client.post(
        f"/v1/conversations/{cid}/import", content=body, headers={"Content-Type": "application/json"}
    )


async def turn_count(db: Database) -> int:
    async with db.transaction() as session:
        return int((await session.execute(text("SELECT count(*) FROM turns"))).scalar_one())


async def test_deep_metadata_import_is_refused_not_stored(server: LiveServer, db: Database) -> None:
    async with server.client() as client:
        cid = await new_conversation(client)
        for depth in (MAX_DEPTH + 1, 256):
            metadata = json.dumps(nested(depth))
            r = await import_raw(client, cid, f'{{"role": "user", "content": "hi", "metadata": {metadata}}}')
            assert r.status_code == 422, r.text
            error = r.json()["error"]
            # Named by the import's rules, or (past what any request may nest) by the door's path.
            assert "metadata" in error["details"]["field"].split(".") and error["details"]["index"] == 0
            assert "levels deep" in error["message"]
        # Within the bound is fine, and reads back as sent.
        r = await import_raw(
            client, cid, json.dumps({"role": "user", "content": "ok", "metadata": nested(MAX_DEPTH)})
        )
        assert r.status_code == 201, r.text
        turns = (await client.get(f"/v1/conversations/{cid}/turns")).json()["items"]
        assert turns[0]["metadata"] == nested(MAX_DEPTH)
    assert await turn_count(db) == 1


async def test_metadata_too_deep_to_parse_is_a_422_not_a_500(server: LiveServer, db: Database) -> None:
    async with server.client() as client:
        cid = await new_conversation(client)
        for depth in (1000, 20_000):
            r = await import_raw(
                client, cid, f'{{"role": "user", "content": "hi", "metadata": {nested_text(depth)}}}'
            )
            assert r.status_code == 422, r.text
            assert r.json()["error"]["code"] == "json_out_of_bounds"
            assert r.json()["error"]["details"]["field"] == "body"
        # The same through a body FastAPI parses: the message endpoint.
        body = '{"content": "hi", "on_busy": ' + "[" * 5000 + "]" * 5000 + "}"
        r = await client.post(
            f"/v1/conversations/{cid}/messages", content=body, headers={"Content-Type": "application/json"}
        )
        assert r.status_code == 422, r.text
        assert r.json()["error"]["details"]["field"] == "body"
    assert await turn_count(db) == 0


async def test_import_with_a_time_before_year_one_in_utc_is_a_422(server: LiveServer, db: Database) -> None:
    # 0001-01-01 at +14:00 is in year 0 in UTC: Python cannot convert it, and that was a 500.
    async with server.client() as client:
        cid = await new_conversation(client)
        item = {"role": "user", "content": "hi", "created_at": "0001-01-01T00:00:00+14:00"}
        r = await import_raw(client, cid, json.dumps(item))
        assert r.status_code == 422, r.text
        assert r.json()["error"]["details"]["field"] == "created_at"
    assert await turn_count(db) == 0


async def test_a_stored_value_too_deep_to_show_does_not_break_reads(server: LiveServer, db: Database) -> None:
    async with server.client() as client:
        cid = await new_conversation(client)
        items = [
            {"role": "user", "content": f"Ingrid keeps honeybees, note {i}", "metadata": {"n": i}}
            for i in range(3)
        ]
        r = await client.post(f"/v1/conversations/{cid}/import", json={"turns": items})
        assert r.status_code == 201, r.text
        ids = [item["turn_id"] for item in r.json()["items"]]
        # Written as an older server (or another tool) could have: past every bound, even
        # past what Python's json module can parse (turn 1).
        async with db.transaction() as session:
            for turn_id, depth in ((ids[0], 256), (ids[1], 5000)):
                await session.execute(
                    text("UPDATE turns SET metadata = CAST(:v AS jsonb) WHERE id = CAST(:id AS uuid)"),
                    {"v": nested_text(depth), "id": turn_id},
                )
        listed = await client.get(f"/v1/conversations/{cid}/turns")
        assert listed.status_code == 200, listed.text
        by_id = {t["id"]: t for t in listed.json()["items"]}
        assert by_id[ids[0]]["metadata"] is None and by_id[ids[1]]["metadata"] is None
        assert by_id[ids[2]]["metadata"] == {"n": 2}  # the others read as stored
        for turn_id in ids[:2]:
            one = await client.get(f"/v1/turns/{turn_id}")
            assert one.status_code == 200, one.text
            assert one.json()["content"].startswith("Ingrid")
        found = await client.post("/v1/memory/search", json={"query": "Ingrid honeybees", "k": 5})
        assert found.status_code == 200, found.text
        hits = {item["turn_id"]: item for item in found.json()["items"]}
        assert set(ids) <= set(hits)
        assert hits[ids[2]]["metadata"] == {"n": 2}


async def test_deep_edited_tool_arguments_are_refused_naming_the_field(start_server: Any) -> None:
    runs: list[dict[str, Any]] = []
    server: LiveServer = await start_server(tools=transfer_tools(runs))
    async with server.client() as client:
        cid = await new_conversation(client)
        ask = required(await park(client, cid))
        for arguments in (nested(256), {"amount": 1, "to": "x" * 70_000}, {"to": "nul \u0000"}):
            r = await client.post(approve_url(ask), json={"arguments": arguments, "stream": False})
            assert r.status_code == 422, r.text
            details = r.json()["error"]["details"]
            # The schema's own check names it in `errors`; the door's (a NUL, past any depth) in `field`.
            field = details["field"] if "field" in details else ".".join(details["errors"][0]["loc"][1:])
            assert field == "arguments" or field.startswith("arguments."), details
        # The call still waits: the refusal decided nothing.
        fine = {"arguments": {"amount": 1, "to": "bob"}, "stream": False}
        r = await client.post(approve_url(ask), json=fine)
        assert r.status_code == 200, r.text
    assert runs == [{"amount": 1, "to": "bob"}]


async def test_nul_in_a_rejection_reason_is_a_422_not_a_500(start_server: Any) -> None:
    runs: list[dict[str, Any]] = []
    server: LiveServer = await start_server(tools=transfer_tools(runs))
    async with server.client() as client:
        cid = await new_conversation(client)
        ask = required(await park(client, cid))
        for reason in ('"a\\u0000b"', '"a\\ud800b"'):
            r = await client.post(
                approve_url(ask, "reject"),
                content='{"reason": ' + reason + ', "stream": false}',
                headers={"Content-Type": "application/json"},
            )
            assert r.status_code == 422, r.text
        # Still waiting: the refused rejection decided nothing.
        r = await client.post(approve_url(ask, "reject"), json={"reason": "no", "stream": False})
        assert r.status_code == 200, r.text
    assert runs == []


@pytest.mark.parametrize("door", ["chat.completions", "responses"])
async def test_instructions_longer_than_a_message_are_refused_before_anything_is_stored(
    start_server: Any, db: Database, door: str
) -> None:
    server: LiveServer = await start_server(max_message_chars=1000)
    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/openai/v1", api_key=token_for(), max_retries=0)
    long = "Always answer in French. " * 41  # 1,025 characters
    with pytest.raises(openai.BadRequestError) as refused:
        if door == "responses":
            await client.responses.create(model="chatmem-demo", instructions=long, input="hi")
        else:
            await client.chat.completions.create(
                model="chatmem-demo",
                messages=[{"role": "system", "content": long}, {"role": "user", "content": "hi"}],
            )
    # Named as the client sent it: the field of the Responses API, the message of chat completions.
    assert refused.value.param == ("instructions" if door == "responses" else "messages[0].content")
    assert await turn_count(db) == 0
