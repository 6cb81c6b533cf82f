"""Settings as an operator writes them: in the environment, in the form the README shows.

In-process: `chatmem` is called as its console script would be, with the environment set.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from chat_api.cli.main import main
from memory.config import get_settings
from memory.storage.db import upgrade
from tests.conftest import free_port
from tests.test_schema import admin, fresh_database


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("CORS_ORIGINS", "https://app.example.com", ["https://app.example.com"]),
        ("CORS_ORIGINS", "https://a.example, https://b.example", ["https://a.example", "https://b.example"]),
        ("CORS_ORIGINS", '["https://a.example"]', ["https://a.example"]),
        ("TOOL_MODULES", "tests.approval_tools", ["tests.approval_tools"]),
        ("TOOLS_REQUIRING_APPROVAL", "transfer_funds,send_mail", ["transfer_funds", "send_mail"]),
        ("LOW_INFORMATION_EXTRA", "ok then, cheers", ["ok then", "cheers"]),
        ("GC_THRESHOLDS", "5000,10,10", (5000, 10, 10)),
        ("GC_THRESHOLDS", "[5000, 10, 10]", (5000, 10, 10)),
        ("LOG_LEVEL", "debug", "DEBUG"),
    ],
)
def test_list_settings_were_refused_in_the_comma_separated_form_the_readme_documents(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, expected: object
) -> None:
    monkeypatch.setenv(variable, value)
    assert getattr(get_settings(), variable.lower()) == expected


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("TOOL_APPROVAL_TIMEOUTS", "transfer_funds:30"),  # a JSON object setting, not JSON
        ("RETENTION_TENANT_DAYS", "{acme: 30}"),
        ("CORS_ORIGINS", '["https://a.example"'),
        ("LOG_LEVEL", "verbose"),
        ("PORT", "70000"),
        ("PORT", "0"),
        ("RATE_LIMIT_PER_MINUTE", "-1"),
        ("LLM_PROVIDER", "anthropic"),
        ("JWT_SECRET", "changeme"),  # guessable offline from any one token
        ("LLM_BASE_URL", "localhost:8080/v1"),  # every reply failed as provider_error
        ("EMBEDDING_BASE_URL", "htp://embeddings/v1"),
        ("REPLY_RESERVE_TOKENS", "5800"),  # with the default CONTEXT_MAX_TOKENS every message was refused
    ],
)
def test_a_malformed_setting_was_a_traceback_and_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], variable: str, value: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as exited:
        main(["db", "upgrade"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"chatmem: invalid settings: {variable}"), err
    assert err.count("\n") == 1 and "Traceback" not in err, err


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port something else listens on."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        yield other.getsockname()[1]


def test_up_on_a_port_in_use_started_everything_first_and_now_says_so_in_one_line(
    taken_port: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["up", "--port", str(taken_port), "--data-dir", str(tmp_path)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"chatmem: cannot listen on 127.0.0.1:{taken_port}: ") and err.count("\n") == 1, err
    assert not (tmp_path / "pg").exists(), "nothing is started for a server that cannot listen"


def test_serve_on_a_port_in_use_says_so_before_touching_the_database(
    taken_port: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DATABASE_URL", "postgresql+asyncpg://nobody@127.0.0.1:1/none")
    monkeypatch.setenv("JWT_SECRET", "x" * 40)
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--port", str(taken_port)])
    assert exited.value.code == 2
    assert capsys.readouterr().err.startswith(f"chatmem: cannot listen on 127.0.0.1:{taken_port}: ")


def test_up_on_an_unusable_data_directory_was_a_traceback_and_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    not_a_directory = tmp_path / "a-file"
    not_a_directory.write_text("")
    with pytest.raises(SystemExit) as exited:
        main(["up", "--port", str(free_port()), "--data-dir", str(not_a_directory / "chatmem")])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"chatmem: cannot use the data directory {not_a_directory / 'chatmem'}: "), err
    assert err.count("\n") == 1, err


@pytest.mark.parametrize("content", [None, "not a key", '{"keys": []}', "{not json"])
def test_serve_with_an_unreadable_public_key_file_was_a_traceback_or_401_for_everyone(
    content: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    key_file = tmp_path / "public.pem"
    if content is not None:
        key_file.write_text(content)
    monkeypatch.delenv("JWT_SECRET", raising=False)
    monkeypatch.setenv("JWT_PUBLIC_KEY_FILE", str(key_file))
    monkeypatch.setenv("DATABASE_URL", "postgresql+asyncpg://nobody@127.0.0.1:1/none")
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--port", str(free_port())])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"chatmem: JWT_PUBLIC_KEY_FILE {key_file}: ") and err.count("\n") == 1, err


@pytest.mark.parametrize("command", ["indexer", "relay"])
def test_a_worker_whose_metrics_port_is_in_use_was_a_traceback_and_is_one_line(
    command: str, taken_port: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DATABASE_URL", "postgresql+asyncpg://nobody@127.0.0.1:1/none")
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:1")
    monkeypatch.setenv("METRICS_PORT", str(taken_port))
    with pytest.raises(SystemExit) as exited:
        main([command])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"chatmem: cannot listen on 127.0.0.1:{taken_port}: ") and "METRICS_PORT" in err, (
        err
    )


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["token", "--ttl", "-5"], "--ttl"),  # printed a token that had already expired
        (["token", "--tenant", ""], "--tenant"),  # printed a token every door refuses
        (["keys", "create", "--tenant", "", "--user", "ann"], "--tenant"),  # a ValueError traceback
        (["users", "delete", "--tenant", "acme", "--user", "a\x00b"], "--user"),
        (["import", "turns.jsonl", "--batch-size", "0"], "--batch-size"),
        (["mcp", "--user", "x" * 129], "--user"),
        (["up", "--workers", "0"], "--workers"),
        (["memory", "reindex", "--batch", "0"], "--batch"),
    ],
)
def test_an_out_of_range_option_is_refused_before_the_command_runs(
    argv: list[str],
    option: str,
    taken_port: int,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Should the option pass, the command fails fast here instead of touching a real installation.
    monkeypatch.setenv("DATA_DIR", str(tmp_path))
    monkeypatch.setenv("DATABASE_URL", "postgresql+asyncpg://nobody@127.0.0.1:1/none")
    monkeypatch.setenv("PORT", str(taken_port))
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert f"error: argument {option}: " in capsys.readouterr().err


@pytest.mark.parametrize("revision", [None, "0019"])
@pytest.mark.parametrize("argv", [["indexer"], ["keys", "list"], ["memory", "reindex", "--status"]])
def test_a_command_on_a_database_never_migrated_or_behind_was_a_traceback(
    pg_url: str,
    revision: str | None,
    argv: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = fresh_database(pg_url, "operator_unmigrated")
    try:
        if revision is not None:
            upgrade(url, revision)
        monkeypatch.setenv("DATABASE_URL", url)
        with pytest.raises(SystemExit) as exited:
            main(argv)
    finally:
        asyncio.run(admin(pg_url, "DROP DATABASE operator_unmigrated"))
    assert exited.value.code == 2
    err = capsys.readouterr().err.splitlines()[-1]
    behind = "has no chatmem schema" if revision is None else f"is at revision {revision}"
    assert err.startswith(f"chatmem: the database {behind}") and "chatmem db upgrade" in err, err
