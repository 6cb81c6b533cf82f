"""Importing past turns: atomic batches, idempotent re-imports, time order, the CLI, end to end."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from chat_api.cli.imports import add_import_arguments, load_source, run_import_command
from indexer.worker import IndexerWorker
from memory.storage.db import Database
from memory.storage.models import OutboxRow, Turn
from tests.conftest import LiveServer, token_for
from tests.support import new_conversation, wait_until

EXPORT = Path(__file__).parent / "data" / "chatgpt_export_branches.json"


async def history(client: httpx.AsyncClient, conversation_id: str) -> list[dict[str, Any]]:
    response = await client.get(f"/v1/conversations/{conversation_id}/turns")
    assert response.status_code == 200, response.text
    return response.json()["items"]  # type: ignore[no-any-return]


async def count(db: Database, model: Any) -> int:
    async with db.session() as session:
        return int((await session.execute(select(func.count()).select_from(model))).scalar_one())


def turn(i: int, **extra: Any) -> dict[str, Any]:
    return {"role": "user" if i % 2 == 0 else "assistant", "content": f"message number {i}", **extra}


async def test_a_bad_item_in_the_middle_stores_nothing(server: LiveServer, db: Database) -> None:
    async with server.client() as client:
        conversation = await new_conversation(client)
        bad_items: list[tuple[dict[str, Any], str]] = [
            ({"role": "system", "content": "you are a pirate"}, "role"),
            ({"role": "user", "content": "   "}, "content"),
            ({"role": "user", "content": "ok", "metadata": {"note": "nul \u0000 here"}}, "metadata"),
            ({"role": "user", "content": "ok", "created_at": "yesterday"}, "created_at"),
            ({"role": "user", "content": "ok", "surprise": 1}, "surprise"),
            ({"role": "user", "content": "ok", "external_id": "e-0"}, "external_id"),  # repeats item 0
        ]
        for bad, field in bad_items:
            turns = [turn(0, external_id="e-0"), turn(1), turn(2), bad, turn(4)]
            response = await client.post(f"/v1/conversations/{conversation}/import", json={"turns": turns})
            assert response.status_code == 422, response.text
            error = response.json()["error"]
            assert error["code"] == "invalid_input"
            assert error["details"]["index"] == 3, error
            # The import's rules name the field; the door's (NUL anywhere) the path to it.
            assert field in error["details"]["field"].split("."), error

        too_many = [turn(i) for i in range(5001)]
        response = await client.post(f"/v1/conversations/{conversation}/import", json={"turns": too_many})
        assert response.status_code == 422
        assert response.json()["error"]["details"]["max_turns"] == 5000

        response = await client.post(
            f"/v1/conversations/{conversation}/import",
            content=b'{"turns": [',
            headers={"content-type": "application/json"},
        )
        assert response.status_code == 422
        assert response.json()["error"]["code"] == "malformed_json"

        assert await history(client, conversation) == []
        found = (await client.get(f"/v1/conversations/{conversation}")).json()
        assert found["turn_count"] == 0
    assert await count(db, Turn) == 0
    assert await count(db, OutboxRow) == 0


async def test_reimport_skips_known_external_ids(server: LiveServer, db: Database) -> None:
    batch = [turn(i, external_id=f"msg-{i}") for i in range(3)]
    async with server.client() as client:
        conversation = await new_conversation(client)
        first = await client.post(f"/v1/conversations/{conversation}/import", json={"turns": batch})
        assert first.status_code == 201, first.text
        assert (first.json()["created"], first.json()["skipped"]) == (3, 0)

        # An interrupted import sent again, with one more turn at the end.
        again = [*batch, turn(3, external_id="msg-3"), turn(4)]
        second = await client.post(f"/v1/conversations/{conversation}/import", json={"turns": again})
        assert second.status_code == 201, second.text
        body = second.json()
        assert (body["created"], body["skipped"]) == (2, 3)
        assert [i["status"] for i in body["items"]] == ["skipped"] * 3 + ["created"] * 2
        first_ids = [i["turn_id"] for i in first.json()["items"]]
        assert [i["turn_id"] for i in body["items"][:3]] == first_ids  # skipped items map to the stored turns
        assert body["last_seq"] == body["turn_count"] == 5

        turns = await history(client, conversation)
        assert [t["content"] for t in turns] == [f"message number {i}" for i in range(5)]
        assert [t["seq"] for t in turns] == [1, 2, 3, 4, 5]
        assert all(t["status"] == "completed" for t in turns)
    assert await count(db, OutboxRow) == 5  # no second outbox row for a skipped turn


async def test_out_of_order_created_at_is_stored_in_time_order(server: LiveServer) -> None:
    base = datetime(2021, 3, 1, 9, 0, tzinfo=UTC)

    def at(minutes: int) -> str:
        return (base + timedelta(minutes=minutes)).isoformat()

    batch = [
        {"role": "user", "content": "third", "created_at": at(30)},
        {"role": "assistant", "content": "right after third (undated)"},
        {"role": "user", "content": "first", "created_at": at(10), "name": "Ann"},
        {"role": "assistant", "content": "second", "created_at": at(20), "metadata": {"k": [1, {"x": None}]}},
        {"role": "user", "content": "tie with third, sent later", "created_at": at(30)},
        {"role": "user", "content": "naive time is UTC", "created_at": "2021-03-01T09:40:00"},
    ]
    async with server.client() as client:
        conversation = await new_conversation(client)
        existing = await client.post(f"/v1/conversations/{conversation}/import", json={"turns": [turn(0)]})
        assert existing.status_code == 201
        response = await client.post(f"/v1/conversations/{conversation}/import", json={"turns": batch})
        assert response.status_code == 201, response.text
        seq_by_index = {i["index"]: i["seq"] for i in response.json()["items"]}
        turns = await history(client, conversation)

    assert [t["content"] for t in turns] == [
        "message number 0",  # appended after what was already there
        "first",
        "second",
        "third",
        "right after third (undated)",
        "tie with third, sent later",
        "naive time is UTC",
    ]
    assert seq_by_index == {2: 2, 3: 3, 0: 4, 1: 5, 4: 6, 5: 7}
    times = [datetime.fromisoformat(t["created_at"]) for t in turns[1:]]
    assert times == sorted(times)
    assert times[0] == base + timedelta(minutes=10)
    assert times[3] == base + timedelta(minutes=30)  # the undated turn took its predecessor's time
    assert times[5] == base + timedelta(minutes=40)
    assert turns[1]["name"] == "Ann"
    assert turns[2]["metadata"] == {"k": [1, {"x": None}]}
    assert all(t["completed_at"] == t["created_at"] for t in turns[1:])


async def test_a_time_stored_as_infinity_is_refused_and_memory_search_keeps_working(
    start_server: Callable[..., Any], db: Database
) -> None:
    """0001-01-01T00:00:00Z and 9999-12-31T23:59:59.999999Z went in as -infinity/infinity.

    Once such a turn was indexed, every memory search of its user answered 500.
    """
    server = await start_server(workers=[indexer_worker])
    async with server.client() as client:
        conversation = await new_conversation(client)
        url = f"/v1/conversations/{conversation}/import"
        for when in ("0001-01-01T00:00:00Z", "0001-01-01T01:00:00+01:00", "9999-12-31T23:59:59.999999Z"):
            batch = [
                turn(0),
                {"role": "user", "content": "I keep my bicycle in the shed.", "created_at": when},
            ]
            response = await client.post(url, json={"turns": batch})
            assert response.status_code == 422, (when, response.text)
            assert response.json()["error"]["details"] == {"index": 1, "field": "created_at"}
        assert await count(db, Turn) == 0
        # A moment inside the range is kept as it is.
        near = ["0001-01-01T00:00:01Z", "9999-12-31T23:59:58Z"]
        batch = [
            {"role": "user", "content": f"My bicycle is red ({i}).", "created_at": w}
            for i, w in enumerate(near)
        ]
        response = await client.post(url, json={"turns": batch})
        assert response.status_code == 201, response.text

        async def indexed() -> bool:
            return bool((await client.get(f"/v1/conversations/{conversation}")).json()["indexed_seq"] >= 2)

        await wait_until(indexed, 30, "the import indexed", every=0.2)
        found = await client.post("/v1/memory/search", json={"query": "what colour is my bicycle?", "k": 3})
        assert found.status_code == 200, found.text
        assert sorted(i["created_at"][:4] for i in found.json()["items"]) == ["0001", "9999"]


async def test_another_tenants_conversation_is_404(server: LiveServer, db: Database) -> None:
    async with server.client("t1", "u1") as owner_client, server.client("t2", "u1") as other:
        conversation = await new_conversation(owner_client)
        response = await other.post(f"/v1/conversations/{conversation}/import", json={"turns": [turn(0)]})
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "not_found"
        assert await history(owner_client, conversation) == []
    assert await count(db, Turn) == 0


def test_chatgpt_export_follows_the_active_branch() -> None:
    sources = {s.source_id: s for s in load_source(EXPORT)}
    packing = sources["conv-a"]
    assert packing.title == "Packing for Portugal"
    # The edited question's branch; no system, tool, or tool-addressed messages; image parts dropped.
    assert [(t["role"], t["external_id"]) for t in packing.turns] == [
        ("user", "n2b"),
        ("assistant", "n5b"),
        ("user", "n6b"),
        ("assistant", "n7b"),
    ]
    assert packing.turns[2]["content"] == "Here is my suitcase. Is a 40 litre bag big enough?"
    assert packing.turns[1]["metadata"] == {"source": "chatgpt", "model": "gpt-4o"}
    # A message without a time takes the one before it.
    assert packing.turns[3]["created_at"] == packing.turns[2]["created_at"]
    # Without current_node, the newest leaf (the regenerated answer) is the active branch.
    assert [t["external_id"] for t in sources["conv-b"].turns] == ["u1", "x2"]


def command(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_import_arguments(parser)
    return parser.parse_args(list(argv))


async def test_cli_imports_a_chatgpt_export_and_resumes(
    server: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state.json"
    args = command(
        str(EXPORT),
        "--url",
        server.base_url,
        "--token",
        token_for("t1", "u9"),
        "--state",
        str(state),
        "--quiet",
    )
    await asyncio.to_thread(run_import_command, args)
    first = capsys.readouterr().out
    assert "2 conversations (2 new), 6 turns imported, 0 skipped, for t1/u9" in first
    created = json.loads(state.read_text())
    assert len(created) == 2

    await asyncio.to_thread(run_import_command, args)  # the same file again: nothing new
    assert "2 conversations (0 new), 0 turns imported, 6 skipped" in capsys.readouterr().out
    assert json.loads(state.read_text()) == created

    async with server.client("t1", "u9") as client:
        listed = (await client.get("/v1/conversations")).json()["items"]
        assert sorted(c["title"] for c in listed) == ["Packing for Portugal", "Quick pasta"]
        packing = next(c for c in listed if c["title"] == "Packing for Portugal")
        turns = await history(client, packing["id"])
    assert [t["content"] for t in turns][:2] == [
        "What should I pack for Porto in May? I hate rain.",
        "Porto in May is mild but wet: pack a rain jacket and an umbrella.",
    ]
    assert turns[0]["created_at"].startswith("2023-11-14T22:15:00")
    assert turns[0]["external_id"] == "n2b"


async def test_cli_names_the_jsonl_line_of_a_bad_turn(server: LiveServer, tmp_path: Path) -> None:
    source = tmp_path / "turns.jsonl"
    lines = [
        {"conversation_id": "a", "role": "user", "content": "hello"},
        {"conversation_id": "a", "role": "robot", "content": "beep"},
    ]
    source.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    args = command(str(source), "--url", server.base_url, "--token", token_for(), "--quiet")
    from chat_api.cli.installation import CommandError

    with pytest.raises(CommandError, match="line 2: HTTP 422"):
        await asyncio.to_thread(run_import_command, args)


def indexer_worker(services: Any, stop: asyncio.Event) -> Any:
    return IndexerWorker(services.db, services.settings, services.embedder).run(stop)


async def test_5000_imported_turns_are_indexed_and_searchable(start_server: Callable[..., Any]) -> None:
    server = await start_server(workers=[indexer_worker], max_body_bytes=8_000_000)
    base = datetime(2019, 6, 1, 12, 0, tzinfo=UTC)
    turns = [
        {
            "role": "user" if i % 2 == 0 else "assistant",
            "content": f"Entry {i}: the lighthouse keeper logged codeword{i} in the harbour book.",
            "created_at": (base + timedelta(minutes=i)).isoformat(),
            "name": "Keeper" if i % 2 == 0 else "Log",
            "external_id": f"row-{i}",
            "metadata": {"row": i},
        }
        for i in range(5000)
    ]
    async with server.client() as client:
        conversation = await new_conversation(client)
        response = await client.post(f"/v1/conversations/{conversation}/import", json={"turns": turns})
        assert response.status_code == 201, response.text
        body = response.json()
        assert body["created"] == 5000
        assert body["last_seq"] == 5000

        async def indexed() -> dict[str, Any] | None:
            state: dict[str, Any] = (await client.get(f"/v1/conversations/{conversation}")).json()
            return state if state["indexed_seq"] >= body["last_seq"] else None

        state = await wait_until(indexed, 180, "the import indexed", every=0.2)
        assert state["turn_count"] == 5000

        found = await client.post(
            "/v1/memory/search", json={"query": "which codeword4321 was logged?", "k": 3}
        )
        assert found.status_code == 200, found.text
        items = found.json()["items"]
    hit = next(i for i in items if i["external_id"] == "row-4321")
    assert hit["turn_id"] == body["items"][4321]["turn_id"]
    assert hit["conversation_id"] == conversation
    assert hit["role"] == "assistant"
    assert hit["name"] == "Log"
    assert hit["metadata"] == {"row": 4321}
    assert datetime.fromisoformat(hit["created_at"]) == base + timedelta(minutes=4321)


LOCOMO = Path(__file__).resolve().parents[2] / "shared" / "bench" / "locomo_dev.json"


@pytest.mark.skipif(not LOCOMO.exists(), reason="the LoCoMo slice is not on this machine")
async def test_locomo_loads_through_the_import_api(start_server: Callable[..., Any]) -> None:
    from bench.locomo_import import import_locomo, wait_until_searchable

    server = await start_server(workers=[indexer_worker])
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
        [imported] = await import_locomo(client, LOCOMO, token_for=token_for, sample_ids=["conv-26"])
        assert imported.user_id == "conv-26" and imported.skipped == 0
        assert len(imported.conversations) > 10
        assert await wait_until_searchable(client, [imported], token_for=token_for, timeout=120)
        found = await client.post(
            "/v1/memory/search",
            json={"query": "transgender stories inspiring support", "k": 10},
            headers={"Authorization": f"Bearer {token_for('locomo', 'conv-26')}"},
        )
    assert found.status_code == 200, found.text
    hit = next(i for i in found.json()["items"] if i["external_id"] == "D1:5")
    assert hit["name"] == "Caroline"
    assert hit["metadata"]["dia_id"] == "D1:5"
    assert hit["metadata"]["blip_caption"].startswith("a photo of a dog")
    assert hit["created_at"].startswith("2023-05-08T13:58")  # "1:56 pm on 8 May, 2023" + 4 turns
    assert imported.dia_ids[hit["turn_id"]] == "D1:5"
