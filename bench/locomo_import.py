"""Load the LoCoMo slice through the import API, the path a customer's history takes.

Each LoCoMo conversation (sample) is one user (tenant ``locomo`` by default, user = the
sample id) and, in the ``session`` layout, each of its sessions one chat conversation; in
the ``conversation`` layout all its sessions form one chat conversation, in order. Turns keep their session's
date as ``created_at`` (30 seconds apart inside a session, so their order survives), the
speaker as ``name``, the dia id as ``external_id`` and, in ``metadata``, ``dia_id`` and
the photo's ``blip_caption`` when one was shared. ``speaker_a`` is the ``user`` role,
``speaker_b`` the ``assistant``. Importing twice creates new conversations but no
duplicate turns within one.

    result = await import_locomo("http://127.0.0.1:8000", path, token_for=lambda t, u: ...)
    await wait_until_searchable(client, result, token_for=..., timeout=600)
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal

import httpx

from chat_api.cli.imports import create_conversation, post_turns, wait_until_indexed

TENANT = "locomo"
SESSION_DATE_FORMAT = "%I:%M %p on %d %B, %Y"
TURN_SPACING = timedelta(seconds=30)

TokenFor = Callable[[str, str], str]
# One chat conversation per LoCoMo session, or one per LoCoMo conversation.
Layout = Literal["session", "conversation"]


@dataclass
class LocomoUserImport:
    """What one LoCoMo sample became: its user, conversations and turns."""

    sample_id: str
    tenant_id: str
    user_id: str
    # session number -> chatmem conversation id (the same one for every session in the
    # conversation layout)
    conversations: dict[int, str] = field(default_factory=dict)
    # chatmem turn id -> dia id
    dia_ids: dict[str, str] = field(default_factory=dict)
    # chatmem conversation id -> the seq its indexed_seq must reach
    last_seqs: dict[str, int] = field(default_factory=dict)
    created: int = 0
    skipped: int = 0


def session_turns(conversation: dict[str, Any], session: int) -> list[dict[str, Any]]:
    """One LoCoMo session as API-shaped import turns."""
    started = datetime.strptime(conversation[f"session_{session}_date_time"], SESSION_DATE_FORMAT)
    started = started.replace(tzinfo=UTC)
    speaker_a = conversation["speaker_a"]
    out = []
    for i, raw in enumerate(conversation[f"session_{session}"]):
        metadata: dict[str, Any] = {"dia_id": raw["dia_id"]}
        if raw.get("blip_caption"):
            metadata["blip_caption"] = raw["blip_caption"]
        out.append(
            {
                "role": "user" if raw["speaker"] == speaker_a else "assistant",
                "content": raw["text"],
                "created_at": (started + TURN_SPACING * i).isoformat(),
                "name": raw["speaker"],
                "external_id": raw["dia_id"],
                "metadata": metadata,
            }
        )
    return out


def _sessions(conversation: dict[str, Any]) -> list[int]:
    numbers = []
    n = 1
    while f"session_{n}" in conversation:
        numbers.append(n)
        n += 1
    return numbers


async def import_locomo(
    client_or_base_url: httpx.AsyncClient | str,
    data_path: Path,
    *,
    token_for: TokenFor,
    tenant: str = TENANT,
    sample_ids: list[str] | None = None,
    batch_turns: int = 1000,
    layout: Layout = "session",
) -> list[LocomoUserImport]:
    """Import every (or the named) LoCoMo sample as one user each; returns what was created.

    ``token_for(tenant, user)`` gives a bearer token for that user (e.g.
    ``lambda t, u: chat_api.auth.issue_token(secret, t, u)``): each sample is its own user,
    so one client token cannot serve them all.
    """
    samples = json.loads(await asyncio.to_thread(Path(data_path).read_text))
    if isinstance(client_or_base_url, str):
        async with httpx.AsyncClient(base_url=client_or_base_url, timeout=120) as client:
            return await _import_all(client, samples, token_for, tenant, sample_ids, batch_turns, layout)
    return await _import_all(client_or_base_url, samples, token_for, tenant, sample_ids, batch_turns, layout)


async def _import_all(
    client: httpx.AsyncClient,
    samples: list[dict[str, Any]],
    token_for: TokenFor,
    tenant: str,
    sample_ids: list[str] | None,
    batch_turns: int,
    layout: Layout,
) -> list[LocomoUserImport]:
    results = []
    for sample in samples:
        sample_id = str(sample["sample_id"])
        if sample_ids is not None and sample_id not in sample_ids:
            continue
        headers = {"Authorization": f"Bearer {token_for(tenant, sample_id)}"}
        result = LocomoUserImport(sample_id, tenant, sample_id)
        conversation = sample["conversation"]
        parts = [(session, session_turns(conversation, session)) for session in _sessions(conversation)]
        if layout == "conversation":
            # One conversation holding every session in order (a chat that went on for months).
            whole = [turn for _, turns in parts for turn in turns]
            conversation_id = await create_conversation(client, headers, sample_id)
            await _post_all(client, headers, conversation_id, whole, batch_turns, result)
            result.conversations = {session: conversation_id for session, _ in parts}
        else:
            for session, turns in parts:
                if not turns:
                    continue
                title = f"{sample_id} session {session} ({conversation[f'session_{session}_date_time']})"
                conversation_id = await create_conversation(client, headers, title)
                result.conversations[session] = conversation_id
                await _post_all(client, headers, conversation_id, turns, batch_turns, result)
        results.append(result)
    return results


async def _post_all(
    client: httpx.AsyncClient,
    headers: dict[str, str],
    conversation_id: str,
    turns: list[dict[str, Any]],
    batch_turns: int,
    result: LocomoUserImport,
) -> None:
    for start in range(0, len(turns), batch_turns):
        answer = await post_turns(client, headers, conversation_id, turns[start : start + batch_turns])
        result.created += answer["created"]
        result.skipped += answer["skipped"]
        result.last_seqs[conversation_id] = answer["last_seq"]
        for item in answer["items"]:
            result.dia_ids[item["turn_id"]] = str(item["external_id"])


async def wait_until_searchable(
    client: httpx.AsyncClient, imports: list[LocomoUserImport], *, token_for: TokenFor, timeout: float
) -> bool:
    """Wait, at most ``timeout`` seconds in all, until every imported conversation is indexed."""
    deadline = time.monotonic() + timeout
    for result in imports:
        headers = {"Authorization": f"Bearer {token_for(result.tenant_id, result.user_id)}"}
        remaining = max(deadline - time.monotonic(), 0.001)
        if not await wait_until_indexed(client, headers, result.last_seqs, timeout=remaining):
            return False
    return True
