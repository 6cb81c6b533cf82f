"""`chatmem import FILE`: bring a ChatGPT data export or a JSON Lines file of turns into chatmem.

It talks to a running chatmem over HTTP (``--url``) rather than writing to the database:
the import then takes exactly the path a customer's data takes (the same validation,
tenant checks, outbox rows and indexer), it works against a remote deployment without
database credentials, and nothing here can drift from what the API guarantees. For an
embedded install, ``--data-dir`` (or the default one) gives the local secret to mint a
token with; ``--token`` takes an API key (``cmk_…``) or a token instead.

Formats:

- ChatGPT ``conversations.json`` (or the export's ``.zip``): a message tree per
  conversation; only the active branch (from ``current_node`` up to the root) is
  imported, and only visible user and assistant text. Message ids become external ids.
- JSON Lines: one turn per line in the API's shape (``role``, ``content``, optional
  ``created_at``, ``name``, ``external_id``, ``metadata``) plus ``conversation_id`` (the
  source's id, any string) and optionally ``conversation_title``. One chatmem
  conversation per distinct ``conversation_id``.

Re-running is safe: the chatmem conversation made for each source conversation is
remembered in a small state file beside the input, and turns with external ids that are
already there are skipped by the server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import jwt

from chat_api.auth import is_api_key
from chat_api.cli.installation import (
    DEFAULT_TENANT,
    DEFAULT_USER,
    CommandError,
    bearer,
    default_url,
    identity,
    positive_int,
)
from memory.record.imports import DEFAULT_MAX_TURNS

DEFAULT_BATCH_TURNS = 1000
# Under the server's default 1 MB body limit, with room for the JSON around the turns.
DEFAULT_BATCH_BYTES = 900_000
DEFAULT_MAX_CHARS = 32_000
CHATGPT_TEXT_TYPES = frozenset({"text", "multimodal_text"})


@dataclass
class SourceConversation:
    """One conversation read from the input, as API-shaped turns, with where each came from."""

    source_id: str
    title: str
    turns: list[dict[str, Any]] = field(default_factory=list)
    origins: list[str] = field(default_factory=list)
    truncated: int = 0


@dataclass
class ConversationReport:
    """What one source conversation became."""

    source_id: str
    title: str
    conversation_id: str
    new_conversation: bool
    created: int = 0
    skipped: int = 0
    truncated: int = 0
    last_seq: int = 0


# --- reading the input ----------------------------------------------------------------


def _iso(epoch: object) -> str | None:
    if isinstance(epoch, int | float) and not isinstance(epoch, bool):
        return datetime.fromtimestamp(float(epoch), UTC).isoformat()
    return None


def active_branch(conversation: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages of a ChatGPT conversation's active branch, root first.

    The branch ends at ``current_node``; without one, at the newest leaf (last children).
    """
    mapping: dict[str, Any] = conversation.get("mapping") or {}
    node_id = conversation.get("current_node")
    if node_id not in mapping:
        roots = [k for k, v in mapping.items() if not v.get("parent") or v.get("parent") not in mapping]
        node_id = roots[0] if roots else None
        while node_id is not None and mapping[node_id].get("children"):
            node_id = mapping[node_id]["children"][-1]
    path: list[dict[str, Any]] = []
    seen: set[str] = set()
    while node_id is not None and node_id in mapping and node_id not in seen:
        seen.add(node_id)
        node = mapping[node_id]
        if node.get("message"):
            path.append(node["message"])
        node_id = node.get("parent")
    return list(reversed(path))


def _chatgpt_text(message: dict[str, Any]) -> str:
    content = message.get("content") or {}
    if content.get("content_type") not in CHATGPT_TEXT_TYPES:
        return ""
    pieces: list[str] = []
    for part in content.get("parts") or []:
        if isinstance(part, str):
            pieces.append(part)
        elif isinstance(part, dict) and isinstance(part.get("text"), str):
            pieces.append(part["text"])  # e.g. voice transcriptions
    return "\n".join(p for p in pieces if p.strip())


def _is_visible(message: dict[str, Any]) -> bool:
    role = (message.get("author") or {}).get("role")
    if role not in ("user", "assistant"):
        return False  # system prompts and tool output
    if message.get("recipient", "all") != "all":
        return False  # an assistant message addressed to a tool (browsing, code)
    meta = message.get("metadata") or {}
    return not meta.get("is_visually_hidden_from_conversation")


def read_chatgpt(conversations: list[Any]) -> list[SourceConversation]:
    """The active-branch user and assistant turns of each conversation of a ChatGPT export."""
    out = []
    for position, raw in enumerate(conversations):
        if not isinstance(raw, dict) or "mapping" not in raw:
            raise CommandError(f"conversations.json item {position} is not a ChatGPT conversation")
        source_id = str(raw.get("conversation_id") or raw.get("id") or f"#{position}")
        source = SourceConversation(source_id, str(raw.get("title") or "")[:500])
        previous_time = _iso(raw.get("create_time"))
        for message in active_branch(raw):
            text = _chatgpt_text(message)
            if not _is_visible(message) or not text.strip():
                continue
            created_at = _iso(message.get("create_time")) or previous_time
            previous_time = created_at
            turn: dict[str, Any] = {"role": message["author"]["role"], "content": text}
            if created_at:
                turn["created_at"] = created_at
            if message.get("id"):
                turn["external_id"] = str(message["id"])[:256]
            name = (message.get("author") or {}).get("name")
            if isinstance(name, str) and name:
                turn["name"] = name[:200]
            model = (message.get("metadata") or {}).get("model_slug")
            if isinstance(model, str):
                turn["metadata"] = {"source": "chatgpt", "model": model}
            source.turns.append(turn)
            source.origins.append(f"conversation {source_id} message {message.get('id')}")
        out.append(source)
    return out


def read_jsonl(lines: Iterable[str]) -> list[SourceConversation]:
    """Turns grouped by their ``conversation_id``, in first-seen order."""
    by_id: dict[str, SourceConversation] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except ValueError as exc:
            raise CommandError(f"line {number}: not JSON ({exc})") from None
        if not isinstance(raw, dict):
            raise CommandError(f"line {number}: not a JSON object")
        source_id = str(raw.pop("conversation_id", "") or "")
        title = str(raw.pop("conversation_title", "") or "")
        source = by_id.setdefault(source_id, SourceConversation(source_id, title[:500]))
        source.turns.append(raw)
        source.origins.append(f"line {number}")
    return list(by_id.values())


def _open_text(path: Path) -> str:
    if path.suffix == ".zip":
        with zipfile.ZipFile(path) as archive:
            names = [n for n in archive.namelist() if n.rsplit("/", 1)[-1] == "conversations.json"]
            if not names:
                raise CommandError(f"{path} has no conversations.json")
            return archive.read(names[0]).decode("utf-8")
    return path.read_text(encoding="utf-8")


def load_source(
    path: Path, fmt: str = "auto", *, max_chars: int = DEFAULT_MAX_CHARS
) -> list[SourceConversation]:
    """Read FILE as a ChatGPT export or JSON Lines; long texts are cut to ``max_chars``."""
    try:
        raw = _open_text(path)
    except (OSError, UnicodeDecodeError, zipfile.BadZipFile) as exc:
        raise CommandError(f"cannot read {path}: {exc}") from None
    if fmt == "auto":
        fmt = "chatgpt" if raw.lstrip().startswith("[") else "jsonl"
    if fmt == "chatgpt":
        try:
            document = json.loads(raw)
        except ValueError as exc:
            raise CommandError(f"{path} is not JSON: {exc}") from None
        if not isinstance(document, list):
            raise CommandError(f"{path} is not a ChatGPT conversations.json (expected a list)")
        sources = read_chatgpt(document)
    else:
        sources = read_jsonl(raw.splitlines())
    for source in sources:
        _prepare(source, max_chars)
    return [s for s in sources if s.turns]


def _prepare(source: SourceConversation, max_chars: int) -> None:
    # The server caps a turn's text; a cut text with a note keeps more memory than a refused batch.
    for turn in source.turns:
        content = turn.get("content")
        if isinstance(content, str) and len(content) > max_chars:
            turn["content"] = content[:max_chars]
            meta = turn.get("metadata")
            kept = meta if isinstance(meta, dict) else {}
            turn["metadata"] = {**kept, "truncated_from_chars": len(content)}
            source.truncated += 1
    # Whole-conversation time order, so batches arrive in order (each batch is sorted by the server).
    order = sorted(range(len(source.turns)), key=lambda i: _sort_time(source.turns, i))
    source.turns = [source.turns[i] for i in order]
    source.origins = [source.origins[i] for i in order]


def _sort_time(turns: list[dict[str, Any]], index: int) -> datetime:
    # The server's rule: an undated turn takes the time of the nearest dated turn before it.
    for turn in reversed(turns[: index + 1]):
        value = turn.get("created_at")
        if isinstance(value, str):
            try:
                parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
            except ValueError:
                break
            return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)
    return datetime.min.replace(tzinfo=UTC)


def batches(
    turns: list[dict[str, Any]], *, max_turns: int = DEFAULT_BATCH_TURNS, max_bytes: int = DEFAULT_BATCH_BYTES
) -> Iterator[tuple[int, list[dict[str, Any]]]]:
    """(start index, turns) slices under both the turn and the byte limit."""
    start, size = 0, 0
    current: list[dict[str, Any]] = []
    for index, turn in enumerate(turns):
        length = len(json.dumps(turn, ensure_ascii=False).encode()) + 1
        if current and (len(current) >= max_turns or size + length > max_bytes):
            yield start, current
            start, size, current = index, 0, []
        current.append(turn)
        size += length
    if current:
        yield start, current


# --- talking to the API -----------------------------------------------------------------


class ImportApiError(Exception):
    """The API refused a request; ``body`` is its error body."""

    def __init__(self, status: int, body: Any) -> None:
        error = body.get("error", {}) if isinstance(body, dict) else {}
        super().__init__(f"HTTP {status}: {error.get('message') or body}")
        self.status = status
        self.details = error.get("details") or {}


async def _call(client: httpx.AsyncClient, method: str, path: str, headers: dict[str, str], **kw: Any) -> Any:
    response = await client.request(method, path, headers=headers, **kw)
    if response.status_code >= 400:
        try:
            body = response.json()
        except ValueError:
            body = response.text
        raise ImportApiError(response.status_code, body)
    return response.json()


async def create_conversation(client: httpx.AsyncClient, headers: dict[str, str], title: str) -> str:
    """A new conversation's id."""
    return str((await _call(client, "POST", "/v1/conversations", headers, json={"title": title}))["id"])


async def post_turns(
    client: httpx.AsyncClient, headers: dict[str, str], conversation_id: str, turns: list[dict[str, Any]]
) -> dict[str, Any]:
    """One import request; returns the API's answer (created, skipped, last_seq, items)."""
    path = f"/v1/conversations/{conversation_id}/import"
    return await _call(client, "POST", path, headers, json={"turns": turns})  # type: ignore[no-any-return]


async def wait_until_indexed(
    client: httpx.AsyncClient, headers: dict[str, str], targets: dict[str, int], *, timeout: float
) -> bool:
    """Poll until each conversation's indexed_seq reaches its target seq; False on timeout."""
    pending = dict(targets)
    try:
        async with asyncio.timeout(timeout):
            while pending:
                for conversation_id, seq in list(pending.items()):
                    found = await _call(client, "GET", f"/v1/conversations/{conversation_id}", headers)
                    if found["indexed_seq"] >= seq:
                        del pending[conversation_id]
                if pending:
                    await asyncio.sleep(0.25)
    except TimeoutError:
        return False
    return True


async def _existing(client: httpx.AsyncClient, headers: dict[str, str], conversation_id: str | None) -> bool:
    if conversation_id is None:
        return False
    try:
        await _call(client, "GET", f"/v1/conversations/{conversation_id}", headers)
    except ImportApiError as exc:
        if exc.status == 404:
            return False
        raise
    return True


async def import_sources(
    client: httpx.AsyncClient,
    headers: dict[str, str],
    sources: list[SourceConversation],
    *,
    state: dict[str, str],
    state_key: Callable[[SourceConversation], str],
    save_state: Callable[[], None] = lambda: None,
    batch_turns: int = DEFAULT_BATCH_TURNS,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
    progress: Callable[[int], object] = lambda _: None,
) -> list[ConversationReport]:
    """Import each source conversation, reusing the conversation recorded in ``state``."""
    reports = []
    for source in sources:
        key = state_key(source)
        known = state.get(key)
        new = not await _existing(client, headers, known)
        if new:
            known = await create_conversation(client, headers, source.title)
            state[key] = known
            save_state()  # before any turn: a re-run after a crash resumes into this conversation
        assert known is not None
        report = ConversationReport(source.source_id, source.title, known, new, truncated=source.truncated)
        for start, chunk in batches(source.turns, max_turns=batch_turns, max_bytes=batch_bytes):
            try:
                answer = await post_turns(client, headers, known, chunk)
            except ImportApiError as exc:
                index = exc.details.get("index")
                if isinstance(index, int) and 0 <= index < len(chunk):
                    raise CommandError(f"{source.origins[start + index]}: {exc}") from None
                raise CommandError(f"conversation {source.source_id!r}: {exc}") from None
            report.created += answer["created"]
            report.skipped += answer["skipped"]
            report.last_seq = max(report.last_seq, answer["last_seq"])
            progress(len(chunk))
        reports.append(report)
    return reports


# --- the command ---------------------------------------------------------------------------


def _token(args: argparse.Namespace) -> str:
    token = bearer(args, ttl_seconds=3600)()
    if args.token and not is_api_key(token):
        claims = jwt.decode(token, options={"verify_signature": False})
        for given, claim, label in ((args.tenant, "tenant", "--tenant"), (args.user, "sub", "--user")):
            if given is not None and claims.get(claim) != given:
                raise CommandError(f"{label} {given!r} does not match the token ({claims.get(claim)!r})")
    return token


def _owner(token: str) -> str:
    """Whom the import is for, as far as the client can tell."""
    if is_api_key(token):
        return f"the owner of key {token[:12]}…"
    claims = jwt.decode(token, options={"verify_signature": False})
    return f"{claims.get('tenant')}/{claims.get('sub')}"


async def _run(args: argparse.Namespace, sources: list[SourceConversation], token: str) -> None:
    from tqdm import tqdm

    url = (args.url or default_url()).rstrip("/")
    owner = _owner(token)
    state_path = (
        Path(args.state) if args.state else args.file.with_name(args.file.name + ".chatmem-import.json")
    )
    state: dict[str, str] = json.loads(state_path.read_text()) if state_path.exists() else {}

    def save_state() -> None:
        try:
            state_path.write_text(json.dumps(state, indent=1))
        except OSError as exc:
            print(f"chatmem: cannot write {state_path} ({exc}); a re-run will make new conversations")

    headers = {"Authorization": f"Bearer {token}"}
    total = sum(len(s.turns) for s in sources)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        with tqdm(total=total, unit="turn", desc="importing", disable=args.quiet) as bar:
            try:
                reports = await import_sources(
                    client,
                    headers,
                    sources,
                    state=state,
                    state_key=lambda s: f"{url} {owner} {s.source_id}",
                    save_state=save_state,
                    batch_turns=args.batch_size,
                    progress=bar.update,
                )
            except httpx.HTTPError as exc:
                raise CommandError(f"cannot reach chatmem at {url}: {exc}") from None
        for r in reports:
            made = "created" if r.new_conversation else "reused"
            note = f", {r.truncated} cut to {args.max_chars} characters" if r.truncated else ""
            print(
                f"{made} conversation {r.conversation_id} {r.title!r}: "
                f"{r.created} turns imported, {r.skipped} already there{note}"
            )
        created = sum(r.created for r in reports)
        print(
            f"{len(reports)} conversations ({sum(r.new_conversation for r in reports)} new), "
            f"{created} turns imported, {sum(r.skipped for r in reports)} skipped, for {owner}"
        )
        if args.wait and reports:
            targets = {r.conversation_id: r.last_seq for r in reports}
            done = await wait_until_indexed(client, headers, targets, timeout=args.wait)
            print("all imported turns are searchable" if done else "indexing is still running")


def run_import_command(args: argparse.Namespace) -> None:
    """The `chatmem import` command: read FILE, import it, print what was created."""
    sources = load_source(args.file, args.format, max_chars=args.max_chars)
    if not sources:
        raise CommandError(f"{args.file}: no user or assistant turns found")
    asyncio.run(_run(args, sources, _token(args)))


def add_import_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `chatmem import` (for chat_api.cli.build_parser)."""
    parser.add_argument("file", type=Path, metavar="FILE", help="conversations.json (or the .zip), or .jsonl")
    parser.add_argument("--tenant", type=identity, help=f"tenant to import for (default {DEFAULT_TENANT!r})")
    parser.add_argument("--user", type=identity, help=f"user to import for (default {DEFAULT_USER!r})")
    parser.add_argument("--url", help="a running chatmem (default http://localhost:PORT)")
    parser.add_argument(
        "--token", help="an API key (cmk_…) or token (otherwise one is minted from the installation's secret)"
    )
    parser.add_argument("--data-dir", type=Path, help="the `chatmem up` installation to mint a token for")
    parser.add_argument("--format", choices=("auto", "chatgpt", "jsonl"), default="auto")
    parser.add_argument(
        "--batch-size", type=positive_int, default=DEFAULT_BATCH_TURNS, help="turns per request"
    )
    parser.add_argument(
        "--max-chars", type=positive_int, default=DEFAULT_MAX_CHARS, help="longer texts are cut"
    )
    parser.add_argument("--state", help="resume file (default: FILE.chatmem-import.json)")
    parser.add_argument("--wait", type=float, default=0, help="wait up to this many seconds for indexing")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


__all__ = [
    "DEFAULT_MAX_TURNS",
    "ConversationReport",
    "ImportApiError",
    "SourceConversation",
    "active_branch",
    "add_import_arguments",
    "batches",
    "create_conversation",
    "import_sources",
    "load_source",
    "post_turns",
    "read_chatgpt",
    "read_jsonl",
    "run_import_command",
    "wait_until_indexed",
]
