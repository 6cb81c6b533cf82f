"""Prompt templates: both languages load, match each other, and are versioned by content."""

from __future__ import annotations

import shutil
from importlib import resources
from pathlib import Path

import pytest

from memory.prompt.templates import LANGUAGES, TEMPLATE_FIELDS, PromptTemplateError, load_prompts
from memory.prompt.tokens import count_tokens


@pytest.fixture
def prompts_copy(tmp_path: Path) -> Path:
    """A writable copy of the shipped prompt folders."""
    source = Path(str(resources.files("prompts")))
    for language in LANGUAGES:
        shutil.copytree(source / language, tmp_path / language)
    return tmp_path


@pytest.mark.parametrize("language", LANGUAGES)
def test_each_language_loads_every_template_the_code_renders(language: str) -> None:
    prompts = load_prompts(language)
    assert set(TEMPLATE_FIELDS) <= set(prompts.templates)
    for name, fields in TEMPLATE_FIELDS.items():
        assert prompts.placeholders(name) == fields
        # A memory from an untitled conversation says nothing about its conversation.
        if name != "memory_untitled_conversation":
            assert prompts.templates[name].strip(), f"{language}/{name} is empty"


def test_prompts_readme_lists_every_template_the_code_renders() -> None:
    """tool_result_interrupted was rendered and shipped but missing from the README's table."""
    readme = (Path(__file__).resolve().parent.parent / "prompts" / "README.md").read_text(encoding="utf-8")
    assert [name for name in TEMPLATE_FIELDS if f"`{name}`" not in readme] == []


def test_languages_have_the_same_templates_and_placeholders() -> None:
    english, chinese = load_prompts("en"), load_prompts("zh")
    assert set(english.templates) == set(chinese.templates)
    for name in english.templates:
        assert english.placeholders(name) == chinese.placeholders(name), name
    assert english.version != chinese.version


def test_chinese_set_is_written_in_chinese() -> None:
    system = load_prompts("zh").render("system")
    assert sum("\u4e00" <= ch <= "\u9fff" for ch in system) > 50


@pytest.mark.parametrize("language", LANGUAGES)
def test_the_system_prompt_says_how_to_read_the_memory_block(language: str) -> None:
    """What the memory block is, and how to use it, is said once in the system prompt, which a
    model server caches; every reply's block is then only its tags, the time and the memories.
    (It was a 75-token preamble in every block, read again whenever the cache was lost.)"""
    prompts = load_prompts(language)
    system = prompts.render("system")
    block = prompts.render("memory_block", items="", now="")
    lines = block.splitlines()
    assert lines[0] == "<memories>" and lines[-1] == "</memories>" and len(lines) <= 4
    assert "<memories>" in system and prompts.render("memory_role_user") in system
    assert count_tokens(block) <= 16


def test_render_fills_placeholders_and_leaves_no_dollar_names() -> None:
    prompts = load_prompts("en")
    note = prompts.render("tool_result_truncated", kept_chars=10, total_chars=25, omitted_chars=15)
    assert "10" in note and "25" in note and "15" in note
    assert "$" not in note
    # A value that looks like a placeholder is inserted literally, never expanded.
    line = prompts.render("memory_item", date="d", conversation="c", role="r", text="costs $text or ${date}")
    assert line.endswith("costs $text or ${date}")


def test_render_refuses_missing_and_unexpected_values() -> None:
    prompts = load_prompts("en")
    with pytest.raises(PromptTemplateError, match="values missing: now"):
        prompts.render("current_time")
    with pytest.raises(PromptTemplateError, match="unexpected: tone"):
        prompts.render("system", tone="friendly")
    with pytest.raises(PromptTemplateError, match="no template 'nope'"):
        prompts.render("nope")


def test_version_is_stable_and_follows_content(prompts_copy: Path) -> None:
    shipped = load_prompts("en")
    copied = load_prompts("en", root=prompts_copy)
    assert copied.version == shipped.version == load_prompts("en").version
    assert len(shipped.version) == 12

    system = prompts_copy / "en" / "system.txt"
    system.write_text(system.read_text(encoding="utf-8") + "Be brief.\n", encoding="utf-8")
    changed = load_prompts("en", root=prompts_copy)
    assert changed.version != shipped.version
    assert changed.render("system").endswith("Be brief.")


def test_version_changes_when_a_template_is_added(prompts_copy: Path) -> None:
    before = load_prompts("zh", root=prompts_copy).version
    (prompts_copy / "zh" / "greeting.txt").write_text("你好\n", encoding="utf-8")
    after = load_prompts("zh", root=prompts_copy)
    assert after.version != before
    assert after.render("greeting") == "你好"


def test_missing_placeholder_fails_at_load(prompts_copy: Path) -> None:
    (prompts_copy / "en" / "memory_item.txt").write_text("- [$date] $role: $text\n", encoding="utf-8")
    with pytest.raises(PromptTemplateError, match=r"en/memory_item: missing placeholders: conversation"):
        load_prompts("en", root=prompts_copy)


def test_unknown_placeholder_fails_at_load(prompts_copy: Path) -> None:
    (prompts_copy / "zh" / "system.txt").write_text("用户 $username。\n", encoding="utf-8")
    with pytest.raises(PromptTemplateError, match=r"zh/system: .*unknown placeholders: username"):
        load_prompts("zh", root=prompts_copy)


def test_missing_template_fails_at_load(prompts_copy: Path) -> None:
    (prompts_copy / "en" / "query_rewrite.txt").unlink()
    with pytest.raises(PromptTemplateError, match="lacks templates: query_rewrite"):
        load_prompts("en", root=prompts_copy)


def test_malformed_placeholder_fails_at_load(prompts_copy: Path) -> None:
    (prompts_copy / "en" / "tool_result_empty.txt").write_text("costs $5\n", encoding="utf-8")
    with pytest.raises(PromptTemplateError, match="malformed placeholder"):
        load_prompts("en", root=prompts_copy)


def test_unknown_language_fails_clearly(tmp_path: Path) -> None:
    with pytest.raises(PromptTemplateError, match="no prompt templates for language 'fr'"):
        load_prompts("fr")
    with pytest.raises(PromptTemplateError, match="no prompt templates for language 'en'"):
        load_prompts("en", root=tmp_path)
