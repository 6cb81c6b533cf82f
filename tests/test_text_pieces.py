"""Redaction, keyword terms, the low-information filter and chunking."""

from __future__ import annotations

import random
import string
from datetime import UTC, datetime

import pytest

from indexer.chunking import chunk_text
from memory.recall.embeddings import HashEmbedder
from memory.recall.keywords import memory_search_terms, memory_text, query_terms, search_terms
from memory.recall.redaction import cn_id_checksum_ok, luhn_ok, redact
from memory.recall.remembering import is_low_information

VALID_CN_ID = "11010519491231002X"  # checksum X is right for these 17 digits
INVALID_CN_ID = "110105194912310021"


def test_cn_id_checksum() -> None:
    assert cn_id_checksum_ok(VALID_CN_ID)
    assert cn_id_checksum_ok("110101199003074477")
    assert not cn_id_checksum_ok(INVALID_CN_ID)


def test_redacts_valid_cn_id_and_keeps_invalid_one() -> None:
    assert redact(f"我的身份证号是{VALID_CN_ID}。") == "我的身份证号是[CN_ID]。"
    assert redact(f"id {INVALID_CN_ID} here") == f"id {INVALID_CN_ID} here"


def test_redacts_luhn_valid_cards_only() -> None:
    assert luhn_ok("4111111111111111")
    assert redact("card 4111 1111 1111 1111 exp 12/27") == "card [CARD] exp 12/27"
    assert redact("card 4111-1111-1111-1111.") == "card [CARD]."
    assert redact("order 4111111111111112 shipped") == "order 4111111111111112 shipped"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("mail me at jane.doe+x@example.co.uk!", "mail me at [EMAIL]!"),
        ("call +1 415 555 0132 tomorrow", "call [PHONE] tomorrow"),
        ("call +44 20 7946 0958", "call [PHONE]"),
        ("US: (415) 555-0132 or 415-555-0132", "US: [PHONE] or [PHONE]"),
        ("手机13812345678，打我", "手机[PHONE]，打我"),
        ("手机 138-1234-5678", "手机 [PHONE]"),
        ("+86 138 1234 5678", "[PHONE]"),
    ],
)
def test_redacts_emails_and_phones(text: str, expected: str) -> None:
    assert redact(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "I was born in 1987 and moved on 2023-05-08.",
        "The meeting is on 8/5/2023 at 10:30, room 12345.",
        "We raised $1,250,000 in 2021; ticket 20230508.",
        "version 3.11.4, port 5432, id 12345678901234",
    ],
)
def test_ordinary_numbers_are_kept(text: str) -> None:
    assert redact(text) == text


def test_search_terms_make_cjk_bigrams() -> None:
    assert search_terms("我喜欢北京烤鸭") == "我喜 喜欢 欢北 北京 京烤 烤鸭"
    assert search_terms("猫") == "猫"
    assert search_terms("Hello, 世界! Café") == "hello 世界 café"


def test_stemming_is_the_same_on_both_sides() -> None:
    indexed = set(search_terms("Melanie painted sunsets while running").split())
    assert {"paint", "sunset", "run"} <= indexed
    assert set(query_terms("When does she paint a sunset? Runs?")) == {"paint", "sunset", "run"}


def test_query_terms_drop_stopwords_and_duplicates() -> None:
    assert query_terms("What did Caroline do with the the adoption agencies?") == [
        "carolin",
        "adoption",
        "agency",
    ]
    assert "什么" not in query_terms("你喜欢什么运动")
    assert "运动" in query_terms("你喜欢什么运动")


def test_memory_text_has_date_name_and_extra() -> None:
    when = datetime(2023, 5, 8, 13, 56, tzinfo=UTC)
    text = memory_text(" I went hiking. ", name="Caroline", created_at=when, extra="photo: a mountain")
    assert text == "[8 May 2023] Caroline: I went hiking. [photo: a mountain]"
    assert memory_text("hi", name=None, created_at=when) == "[8 May 2023] hi"


def test_memory_search_terms_include_the_previous_turn() -> None:
    terms = memory_search_terms("Adoption agencies.", previous="What did you research?").split()
    assert "research" in terms
    assert "adoption" in terms


@pytest.mark.parametrize(
    "text",
    [
        "hi",
        "Thanks!",
        "ok 👍",
        "OK!!",
        "thank you so much",
        "hahaha",
        "👍🎉",
        "  ",
        "好的",
        "谢谢",
        "收到",
        "嗯嗯",
        "好的，谢谢！",
        "哈哈哈哈",
        "Good morning!",
        "lol ok",
    ],
)
def test_low_information(text: str) -> None:
    assert is_low_information(text)


@pytest.mark.parametrize(
    "text",
    [
        "thanks, my flight is on May 3",
        "hiking",
        "ok, I moved to Berlin",
        "好的，明天下午三点开会",
        "谢谢，我的航班是5月3日",
        "no, I prefer tea",
        "hi, I'm allergic to peanuts",
    ],
)
def test_content_is_not_low_information(text: str) -> None:
    assert not is_low_information(text)


def test_extra_low_information_phrases() -> None:
    assert not is_low_information("roger that")
    assert is_low_information("Roger that!", extra_phrases=["roger that"])


def _assert_covers(text: str, chunks: list[str]) -> None:
    """Every chunk is a slice found in order, and consecutive chunks touch or overlap."""
    covered_to = 0
    position = 0
    for chunk in chunks:
        assert chunk.strip()
        start = text.find(chunk, position)
        assert start != -1
        assert text[covered_to:start].strip() == "", "text between chunks was lost"
        covered_to = max(covered_to, start + len(chunk))
        position = start + 1
    assert text[covered_to:].strip() == ""


def test_short_text_is_one_chunk() -> None:
    assert chunk_text("a short note", max_chars=100, overlap=10) == ["a short note"]
    assert chunk_text("   ", max_chars=100, overlap=10) == []


def test_long_english_text_splits_at_sentences_with_overlap() -> None:
    text = " ".join(f"Sentence number {i} talks about topic {i}." for i in range(60))
    chunks = chunk_text(text, max_chars=200, overlap=40)
    assert len(chunks) > 5
    assert all(len(c) <= 200 for c in chunks)
    assert all(c.endswith(".") for c in chunks[:-1])
    _assert_covers(text, chunks)
    assert any(chunks[i][-20:] in chunks[i + 1] for i in range(len(chunks) - 1))


def test_long_chinese_text_splits_without_spaces() -> None:
    text = "".join(f"第{i}句话讲的是一件很重要的事情。" for i in range(80))
    chunks = chunk_text(text, max_chars=100, overlap=20)
    assert all(len(c) <= 100 for c in chunks)
    assert all(c.endswith("。") for c in chunks[:-1])
    _assert_covers(text, chunks)


@pytest.mark.parametrize("max_chars", [6, 7, 50])
def test_text_without_breaks_is_hard_cut_and_kept(max_chars: int) -> None:
    letters = random.Random(7)
    text = "".join(letters.choice(string.ascii_lowercase) for _ in range(333))
    chunks = chunk_text(text, max_chars=max_chars, overlap=max_chars // 3)
    assert all(0 < len(c) <= max_chars for c in chunks)
    _assert_covers(text, chunks)


async def test_hash_embedder_is_normalised_and_similar_for_similar_texts() -> None:
    embedder = HashEmbedder()
    a, b, c = await embedder.embed(
        ["I love hiking in the mountains", "hiking mountains is what I love", "猫"]
    )
    assert len(a) == embedder.dim
    assert abs(sum(x * x for x in a) - 1.0) < 1e-9
    cos_ab = sum(x * y for x, y in zip(a, b, strict=True))
    cos_ac = sum(x * y for x, y in zip(a, c, strict=True))
    assert cos_ab > 0.5 > cos_ac
