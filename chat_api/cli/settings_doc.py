"""The README's settings table, generated from `memory.config.Settings` so it cannot drift.

`python -m chat_api.cli.settings_doc` prints the Markdown table; `--write README.md` replaces
what sits between the `<!-- settings:start -->` and `<!-- settings:end -->` markers.
`tests/test_settings_doc.py` fails when the README's table and the class disagree.
"""

from __future__ import annotations

import argparse
import enum
import re
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from memory.config import Settings

START_MARKER = "<!-- settings:start -->"
END_MARKER = "<!-- settings:end -->"
BLOCK = re.compile(re.escape(START_MARKER) + r".*?" + re.escape(END_MARKER), re.DOTALL)


class MarkersMissing(Exception):
    """The file has no settings block to replace."""


def env_name(field_name: str) -> str:
    """The environment variable pydantic-settings reads for a field (no prefix, case-insensitive)."""
    return field_name.upper()


def type_name(annotation: Any) -> str:
    """A short, readable name for a field's type (`int`, `str | None`, `demo | openai`)."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin in (list, tuple, set, frozenset):
        inner = ", ".join(type_name(a) for a in args if a is not Ellipsis)
        return f"comma-separated list of {inner}" if origin is list else f"{origin.__name__}[{inner}]"
    if annotation is type(None):
        return "None"
    if annotation is SecretStr:
        return "secret"
    return getattr(annotation, "__name__", str(annotation))


def default_text(info: FieldInfo) -> str:
    """The default as a person would write it in the environment; computed ones are described."""
    if info.default_factory is not None:
        factory: Any = info.default_factory
        if factory in (list, dict, set, tuple):
            return "(empty)"
        doc = (factory.__doc__ or "").strip().splitlines()
        return f"({doc[0].rstrip('.')})" if doc else "(computed)"
    value = info.default
    if value is PydanticUndefined:
        return "(required)"
    if value is None:
        return "(unset)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value) or "(empty)"
    return str(value)


def _cell(text: str, *, code: bool = False) -> str:
    escaped = text.replace("|", "\\|").replace("\n", " ")
    return f"`{escaped}`" if code and text and not text.startswith("(") else escaped


def settings_table(settings_class: type[Settings] = Settings) -> str:
    """Every setting as one Markdown table row: variable, type, default, description."""
    lines = ["| Variable | Type | Default | Description |", "| --- | --- | --- | --- |"]
    for name, info in settings_class.model_fields.items():
        lines.append(
            "| "
            + " | ".join(
                [
                    _cell(env_name(name), code=True),
                    _cell(type_name(info.annotation)),
                    _cell(default_text(info), code=True),
                    _cell(info.description or ""),
                ]
            )
            + " |"
        )
    return "\n".join(lines) + "\n"


def settings_block(settings_class: type[Settings] = Settings) -> str:
    """The table between its markers, as it belongs in the README."""
    return f"{START_MARKER}\n{settings_table(settings_class)}{END_MARKER}"


def replace_block(document: str, block: str) -> str:
    """The document with its settings block replaced; MarkersMissing if it has none."""
    if not BLOCK.search(document):
        raise MarkersMissing(f"no {START_MARKER} … {END_MARKER} block")
    return BLOCK.sub(lambda _: block, document, count=1)


def main(argv: list[str] | None = None) -> None:
    """Print the settings table, or write it into a Markdown file between the markers."""
    parser = argparse.ArgumentParser(prog="python -m chat_api.cli.settings_doc", description=__doc__)
    parser.add_argument("--write", type=Path, metavar="FILE", help="replace the block in FILE")
    args = parser.parse_args(argv)
    if args.write is None:
        print(settings_table(), end="")
        return
    path: Path = args.write
    try:
        updated = replace_block(path.read_text(encoding="utf-8"), settings_block())
    except MarkersMissing as exc:
        parser.exit(2, f"{path}: {exc}\n")
    path.write_text(updated, encoding="utf-8")
    print(f"{path}: settings table updated")


if __name__ == "__main__":
    main()
