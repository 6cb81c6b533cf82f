"""Recall is time-boxed: a reply whose memory is late starts without it, and says so."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from memory.recall.embeddings import HashEmbedder
from tests.conftest import LiveServer
from tests.support import new_conversation
from tests.test_memory_recall import FACT, QUESTION, reply_text, retrieved, say


class GatedEmbedder(HashEmbedder):
    """The deterministic embedder, except that while `held` is set nothing comes back until `gate` opens.

    Stands in for an encoder stuck behind a queue (the process edge), not for our own classes.
    """

    def __init__(self) -> None:
        super().__init__()
        self.held = False
        self.gate = asyncio.Event()
        self.waiting = 0

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        if self.held:
            self.waiting += 1
            await self.gate.wait()
        return await super().embed(texts)


async def test_late_recall_replies_without_memory_and_says_so(start_server: Any) -> None:
    embedder = GatedEmbedder()
    # The time box is wide enough for a recall in time on a loaded machine.
    server: LiveServer = await start_server(embedder=embedder, recall_timeout_seconds=1.5)
    async with server.client() as client:
        await say(client, await new_conversation(client, "Family"), FACT)
        embedder.held = True
        loop = asyncio.get_running_loop()
        started = loop.time()
        late = await say(client, await new_conversation(client, "Travel"), QUESTION)
        elapsed = loop.time() - started
        assert embedder.waiting == 1  # the recall really was stuck in the encoder
        memory = retrieved(late)
        assert memory["items"] == []
        assert memory["error"]["code"] == "memory_timeout"
        assert "1.5s" in memory["error"]["message"]
        assert "I remember" not in reply_text(late)  # the prompt had no memory block
        assert elapsed < 5.0  # not held until the encoder came back
        # The encoder recovers: the next reply gets its memory again.
        embedder.held = False
        embedder.gate.set()
        found = retrieved(await say(client, await new_conversation(client), QUESTION))
        assert "error" not in found
        assert FACT in [item["text"] for item in found["items"]]
        metrics = (await client.get("/metrics")).text
    assert 'chatmem_recalls_total{outcome="timeout"}' in metrics
