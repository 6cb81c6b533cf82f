"""Prompt templates, read from `prompts/<language>/*.txt` once at start.

Everything the model is told lives in those files, not in code, so wording can change
without a deploy of logic and every turn can record which wording produced its prompt
(`PromptSet.version`, a hash of the whole set). Templates use `string.Template`
placeholders (`$name`) rather than `str.format` braces, so a template may quote JSON
without escaping. The placeholders of the templates the code renders are declared in
`TEMPLATE_FIELDS`: loading fails when a template is missing or its placeholders differ,
so a typo in a file fails the process at start, not a user's reply at run time.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from string import Template
from types import MappingProxyType
from typing import Any

# The templates the code renders, with exactly the placeholders each must contain.
TEMPLATE_FIELDS: Mapping[str, frozenset[str]] = MappingProxyType(
    {
        "system": frozenset(),
        "memory_block": frozenset({"items", "now"}),
        "current_time": frozenset({"now"}),
        "memory_item": frozenset({"date", "conversation", "role", "text"}),
        "memory_today": frozenset(),
        "memory_conversation": frozenset({"title"}),
        "memory_untitled_conversation": frozenset(),
        "memory_this_conversation": frozenset(),
        "memory_role_user": frozenset(),
        "memory_role_assistant": frozenset(),
        "memory_role_tool": frozenset(),
        "standing_block": frozenset({"items"}),
        "standing_item": frozenset({"text"}),
        "query_rewrite": frozenset({"history", "message"}),
        "query_rewrite_history_line": frozenset({"role", "text"}),
        "fact_keys": frozenset({"message"}),
        "history_role_user": frozenset(),
        "history_role_assistant": frozenset(),
        "tool_result_truncated": frozenset({"kept_chars", "total_chars", "omitted_chars"}),
        "tool_result_empty": frozenset(),
        "tool_result_interrupted": frozenset(),
    }
)

LANGUAGES = ("en", "zh")
VERSION_LENGTH = 12


class PromptTemplateError(Exception):
    """A prompt template is missing, malformed, or rendered with the wrong values."""


def _placeholders(template: Template) -> frozenset[str]:
    return frozenset(template.get_identifiers())


@dataclass(frozen=True, slots=True)
class PromptSet:
    """One language's templates, validated; `version` identifies their exact content."""

    language: str
    templates: Mapping[str, str]
    version: str
    _compiled: Mapping[str, Template] = field(repr=False, compare=False)

    @classmethod
    def from_texts(cls, language: str, texts: Mapping[str, str]) -> PromptSet:
        """Validate `texts` (name to template text) and build the set; raise PromptTemplateError."""
        compiled: dict[str, Template] = {}
        for name, text in texts.items():
            template = Template(text)
            if not template.is_valid():
                raise PromptTemplateError(
                    f"prompt template {language}/{name}: malformed placeholder (write $$ for a literal $)"
                )
            compiled[name] = template
        missing = sorted(set(TEMPLATE_FIELDS) - set(compiled))
        if missing:
            raise PromptTemplateError(f"prompt set {language!r} lacks templates: {', '.join(missing)}")
        for name, expected in TEMPLATE_FIELDS.items():
            found = _placeholders(compiled[name])
            if found != expected:
                lacking = ", ".join(sorted(expected - found)) or "-"
                unknown = ", ".join(sorted(found - expected)) or "-"
                raise PromptTemplateError(
                    f"prompt template {language}/{name}: missing placeholders: {lacking}; "
                    f"unknown placeholders: {unknown}"
                )
        digest = hashlib.sha256(language.encode())
        for name in sorted(texts):
            digest.update(b"\0" + name.encode() + b"\0" + texts[name].encode())
        return cls(
            language=language,
            templates=MappingProxyType(dict(texts)),
            version=digest.hexdigest()[:VERSION_LENGTH],
            _compiled=MappingProxyType(compiled),
        )

    def placeholders(self, name: str) -> frozenset[str]:
        """The placeholder names template `name` contains."""
        return _placeholders(self._template(name))

    def render(self, name: str, **values: Any) -> str:
        """Template `name` filled with exactly its placeholders; raise PromptTemplateError otherwise."""
        template = self._template(name)
        expected = _placeholders(template)
        if values.keys() != expected:
            lacking = ", ".join(sorted(expected - values.keys())) or "-"
            unknown = ", ".join(sorted(values.keys() - expected)) or "-"
            raise PromptTemplateError(
                f"prompt template {self.language}/{name}: values missing: {lacking}; unexpected: {unknown}"
            )
        return template.substitute(values)

    def _template(self, name: str) -> Template:
        try:
            return self._compiled[name]
        except KeyError:
            raise PromptTemplateError(f"prompt set {self.language!r} has no template {name!r}") from None


def _read_texts(folder: Any) -> dict[str, str]:
    # One trailing newline is how editors end files, not part of what the model is told.
    return {
        entry.name.removesuffix(".txt"): entry.read_text(encoding="utf-8").removesuffix("\n")
        for entry in folder.iterdir()
        if entry.name.endswith(".txt") and entry.is_file()
    }


def load_prompts(language: str, *, root: Path | None = None) -> PromptSet:
    """Read and validate `prompts/<language>/*.txt` (or `<root>/<language>`); raise PromptTemplateError."""
    folder: Any = (root / language) if root is not None else resources.files("prompts").joinpath(language)
    if not folder.is_dir():
        raise PromptTemplateError(f"no prompt templates for language {language!r} (looked in {folder})")
    return PromptSet.from_texts(language, _read_texts(folder))
