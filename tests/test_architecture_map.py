"""ARCHITECTURE.md's map names every module of the folders it lists module by module.

A module added to one of these folders and left off the map (the SIGTERM drain, the OpenAI
doors' retries, the indexer's transport interface) leaves a newcomer reading the map with
a part they cannot find. Folders the map draws as a path instead (admission/, cli/,
routes/, providers/) are not held to it.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "ARCHITECTURE.md"
# (folder, whether its subfolders count too)
LISTED = (
    ("chat_api", False),
    ("chat_api/replies", False),
    ("chat_api/protocols", True),
    ("indexer", False),
    ("memory", False),
    ("memory/storage", False),
    ("memory/prompt", False),
    ("memory/recall", False),
    ("memory/accounts", False),
)


def _modules() -> list[Path]:
    found = []
    for folder, deep in LISTED:
        paths = (ROOT / folder).rglob("*.py") if deep else (ROOT / folder).glob("*.py")
        found += [p for p in paths if not p.name.startswith("__")]
    return sorted(found)


def test_architecture_map_names_every_module_of_its_listed_folders() -> None:
    text = ARCHITECTURE.read_text(encoding="utf-8")
    missing = [
        str(path.relative_to(ROOT))
        for path in _modules()
        if not re.search(rf"(?<![\w.]){re.escape(path.name)}", text)
    ]
    assert missing == [], f"ARCHITECTURE.md's map does not name: {missing}"
