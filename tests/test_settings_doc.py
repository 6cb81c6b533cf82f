"""The README's settings table is the one generated from the Settings class."""

from __future__ import annotations

from pathlib import Path

import pytest

from chat_api.cli.settings_doc import END_MARKER, START_MARKER, replace_block, settings_block, settings_table
from memory.config import Settings

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_settings_block_matches_the_settings_class() -> None:
    text = README.read_text(encoding="utf-8") if README.exists() else ""
    if START_MARKER not in text or END_MARKER not in text:
        pytest.skip(f"README.md has no {START_MARKER} … {END_MARKER} block yet")
    start = text.index(START_MARKER)
    end = text.index(END_MARKER) + len(END_MARKER)
    if not text[start + len(START_MARKER) : end - len(END_MARKER)].strip():
        pytest.skip("README settings block is empty: run `make docs`")
    assert text[start:end] == settings_block(), (
        "README settings table is stale: run `python -m chat_api.cli.settings_doc --write README.md`"
    )


def test_every_setting_has_a_row_and_a_description() -> None:
    table = settings_table()
    for name, info in Settings.model_fields.items():
        assert f"| `{name.upper()}` |" in table
        assert info.description, f"{name} has no description (the README would show an empty cell)"


def test_write_replaces_only_the_block() -> None:
    document = f"# Title\n\nbefore\n{START_MARKER}\nold table\n{END_MARKER}\nafter\n"
    updated = replace_block(document, settings_block())
    assert updated.startswith("# Title\n\nbefore\n")
    assert updated.endswith("\nafter\n")
    assert "old table" not in updated
    assert "| `DATABASE_URL` |" in updated
    # Writing twice changes nothing.
    assert replace_block(updated, settings_block()) == updated
