"""The text a memory is stored as, and its keyword terms (words plus CJK bigrams).

Postgres' 'simple' text search configuration only lower-cases and splits on
non-letters: it neither stems nor segments Chinese. So the terms are produced here,
in Python, and fed to ``to_tsvector('simple', :terms)`` on the index side and to an OR
``tsquery`` on the query side. Both sides go through the same ``_normalise_word``, so
the light English stemming below only has to be consistent, not linguistically right.
Chinese runs become overlapping character bigrams (plus the character itself for a
one-character run), which finds Chinese keywords without a segmenter.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Mapping
from datetime import datetime
from typing import Any

# Han, Hiragana/Katakana and Hangul are written without spaces: index them as bigrams.
_CJK_CLASS = (
    "\u3040-\u30ff"  # Hiragana, Katakana
    "\u3400-\u4dbf"  # CJK extension A
    "\u4e00-\u9fff"  # CJK unified ideographs
    "\uf900-\ufaff"  # CJK compatibility ideographs
    "\uac00-\ud7af"  # Hangul syllables
)
_TOKEN = re.compile(rf"[{_CJK_CLASS}]+|[^\W_{_CJK_CLASS}]+(?:['’][^\W_{_CJK_CLASS}]+)*")
_CJK_RUN = re.compile(rf"[{_CJK_CLASS}]+")

ENGLISH_STOPWORDS = frozenset(
    """
    a about above after again against all am an and any are aren't as at be because been
    before being below between both but by can can't cannot could couldn't did didn't do does
    doesn't doing don't down during each few for from further had hadn't has hasn't have
    haven't having he he'd he'll he's her here here's hers herself him himself his how how's
    i i'd i'll i'm i've if in into is isn't it it's its itself let's me more most mustn't my
    myself no nor not of off on once only or other ought our ours ourselves out over own same
    shan't she she'd she'll she's should shouldn't so some such than that that's the their
    theirs them themselves then there there's these they they'd they'll they're they've this
    those through to too under until up very was wasn't we we'd we'll we're we've were weren't
    what what's when when's where where's which while who who's whom why why's with won't would
    wouldn't you you'd you'll you're you've your yours yourself yourselves
    also just will may might must shall get got gets s t d ll m re ve
    kind type sort ever yet likely
    """.split()
)
# Common function words and their bigrams as the bigram tokeniser emits them.
CHINESE_STOPWORDS = frozenset(
    """
    的 了 是 在 我 你 他 她 它 们 这 那 有 和 与 就 都 也 还 吗 呢 吧 啊 嗯 哦 呀 么 个 之
    我们 你们 他们 她们 什么 怎么 哪里 哪个 为什 怎样 如何 多少 是不 不是 一个 这个 那个 时候
    有没 没有 可以 因为 所以 但是 而且 然后 已经 还是 或者 请问 的是 了吗 是什 么时
    """.split()
)
STOPWORDS = ENGLISH_STOPWORDS | CHINESE_STOPWORDS

_APOSTROPHES = str.maketrans({"’": "'"})


def _stem(word: str) -> str:
    """Strip a few English inflections the same way on both sides (paint/paints/painted/painting)."""
    if not word.isascii() or len(word) <= 3:
        return word
    if word.endswith("'s"):
        word = word[:-2]
    if word.endswith("ies") and len(word) > 4:
        word = word[:-3] + "y"
    elif word.endswith("sses"):
        word = word[:-2]
    elif word.endswith("s") and not word.endswith(("ss", "us", "is")):
        word = word[:-1]
    for suffix in ("ing", "ed"):
        if word.endswith(suffix) and len(word) - len(suffix) >= 3:
            word = word[: -len(suffix)]
            if len(word) > 3 and word[-1] == word[-2] and word[-1] not in "lsz":
                word = word[:-1]  # running -> runn -> run
            break
    if word.endswith("e") and len(word) > 3:
        word = word[:-1]  # make/making/made-ish: make -> mak, making -> mak
    return word


def _words(text: str) -> list[tuple[str, bool]]:
    """(token, is_cjk) pairs in order; lower-cased, NFKC-normalised, punctuation dropped."""
    normalised = unicodedata.normalize("NFKC", text).lower().translate(_APOSTROPHES)
    return [(m.group(0), bool(_CJK_RUN.fullmatch(m.group(0)))) for m in _TOKEN.finditer(normalised)]


def _cjk_terms(run: str) -> list[str]:
    if len(run) == 1:
        return [run]
    return [run[i : i + 2] for i in range(len(run) - 1)]


def _terms(text: str, *, drop_stopwords: bool) -> list[str]:
    terms: list[str] = []
    for token, is_cjk in _words(text):
        if is_cjk:
            terms.extend(t for t in _cjk_terms(token) if not (drop_stopwords and t in STOPWORDS))
            continue
        if drop_stopwords and token in STOPWORDS:
            continue
        # tsvector splits on apostrophes too; keep the term a single lexeme.
        terms.append(_stem(token).replace("'", ""))
    return [t for t in terms if t]


def search_terms(text: str) -> str:
    """Space-separated lower-cased terms of ``text`` for ``to_tsvector('simple', ...)``."""
    return " ".join(_terms(text, drop_stopwords=False))


def query_terms(text: str) -> list[str]:
    """The distinct keyword terms of a query, stopwords removed, in first-seen order."""
    return list(dict.fromkeys(_terms(text, drop_stopwords=True)))


def memory_date(created_at: datetime) -> str:
    """The date as written in front of a memory: ``8 May 2023``."""
    return f"{created_at.day} {created_at:%B %Y}"


# Metadata keys holding the caption of a shared image (LoCoMo's ``blip_caption``).
CAPTION_KEYS = ("image_caption", "blip_caption")


def photo_caption(metadata: Mapping[str, Any] | None) -> str | None:
    """``photo: <caption>`` when the turn's metadata carries an image caption, else None."""
    for key in CAPTION_KEYS:
        value = (metadata or {}).get(key)
        if isinstance(value, str) and value.strip():
            return f"photo: {value.strip()}"
    return None


def memory_text(content: str, *, name: str | None, created_at: datetime, extra: str | None = None) -> str:
    """The text a turn is remembered (embedded and keyword-indexed) as.

    ``[8 May 2023] Caroline: I went to a support group. [photo: a photo of a rainbow flag]``.
    The date makes "when did ..." answerable from the memory alone, and the caption of a
    shared image carries words the message itself does not say (measured on LoCoMo).
    """
    head = f"[{memory_date(created_at)}] "
    body = f"{name}: {content.strip()}" if name else content.strip()
    tail = f" [{extra.strip()}]" if extra and extra.strip() else ""
    return head + body + tail


def memory_search_terms(text: str, *, previous: str | None = None) -> str:
    """The keyword terms of a memory: its own text plus the turn before it in the conversation.

    A reply is often findable only through the question it answers ("What did you
    research?" / "Adoption agencies."), so the previous turn's words are indexed with
    it. Only the keywords get this context; the embedding stays on the turn's own text
    (on LoCoMo, context in the embedded text hurt dense recall while it lifted keyword
    recall@10 from 0.63 to 0.70).
    """
    if previous and previous.strip():
        return search_terms(previous) + " " + search_terms(text)
    return search_terms(text)
