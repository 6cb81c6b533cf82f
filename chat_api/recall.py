"""Long-term memory for each reply: rewrite the question, search the user's memory.

(Being filled in: see `build_recall`.)
"""

from __future__ import annotations

from typing import Any


def build_recall(services: Any) -> Any:
    """The recall function the prompter calls before each reply, or None when memory is off."""
    return None
