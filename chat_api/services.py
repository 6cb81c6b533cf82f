"""The long-lived parts of one API process, opened in the lifespan and closed in `finally`."""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field

from chat_api.admission.limits import Admission
from chat_api.auth import TokenVerifier
from chat_api.providers.base import ChatProvider
from chat_api.replies.checkpoint import Checkpointer
from chat_api.replies.drain import Drain
from chat_api.replies.prompt import Prompter
from chat_api.replies.queue import ReplyQueues
from chat_api.replies.reaper import Reaper
from chat_api.replies.registry import ReplyRegistry
from chat_api.replies.run import ReplyRunner
from chat_api.replies.signals import Signals
from chat_api.tools import ToolRegistry
from memory.config import Settings
from memory.recall.access import MemoryAccess
from memory.recall.embeddings import Embedder
from memory.recall.recaller import Recaller
from memory.storage.db import Database


def process_id() -> str:
    """Names this process in turns it owns (host, pid and a random part)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


@dataclass
class Services:
    """Everything a request or a background loop of this process may use, typed."""

    settings: Settings
    db: Database
    verifier: TokenVerifier
    provider: ChatProvider
    tools: ToolRegistry
    registry: ReplyRegistry
    signals: Signals
    checkpointer: Checkpointer
    reaper: Reaper
    prompter: Prompter
    runner: ReplyRunner
    process_id: str
    admission: Admission  # every door that costs work asks it first (chat_api.admission)
    embedder: Embedder  # retrieval's encoder; an in-process indexer encodes with its twin
    recaller: Recaller  # long-term memory: every search of this process goes through it
    memory_access: MemoryAccess  # the memory items a person sees and edits (items API, MCP)
    drain: Drain  # the shutdown: begun by SIGTERM, ends every reply of this process with its streams
    queues: ReplyQueues = field(default_factory=ReplyQueues)  # on_busy=enqueue, per conversation
