"""The replies this process is running, by reply id."""

from __future__ import annotations

import uuid

from chat_api.replies.reply import Reply


class ReplyRegistry:
    """The replies this process is running, by reply id."""

    def __init__(self) -> None:
        self._replies: dict[uuid.UUID, Reply] = {}

    def add(self, reply: Reply) -> None:
        self._replies[reply.id] = reply

    def remove(self, reply_id: uuid.UUID) -> None:
        self._replies.pop(reply_id, None)

    def get(self, reply_id: uuid.UUID) -> Reply | None:
        return self._replies.get(reply_id)

    def ids(self) -> list[uuid.UUID]:
        return list(self._replies)

    def all(self) -> list[Reply]:
        return list(self._replies.values())

    def __len__(self) -> int:
        return len(self._replies)
