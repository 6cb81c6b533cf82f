"""What long-term memory keeps of a turn, and how: the one rule, for the indexer and for recall.

`remembered_text` says it: nothing of a turn that is only small talk, and everything else
with personal identifiers redacted (`memory/recall/redaction.py`) when REDACT_PII is on. Recall
applies it to turns not indexed yet, so they are searched as the index will hold them.

Which turns are not worth remembering: greetings, thanks, acknowledgements, emoji.
A turn is low-information only when *all* of it is such small talk: "thanks!" is,
"thanks, my flight is on May 3" is not. The text is normalised (case, punctuation,
emoji and repeated laughter dropped) and must be covered end to end by known phrases.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence
from functools import lru_cache

from memory.recall.keywords import query_terms
from memory.recall.redaction import redact

# The memory use of an assistant turn whose words are remembered: its reply was made with
# memory. A reply made with memory off (or with recall failed) could not know the user, so
# what it says about them is invented ("The car that you drive is a Honda Accord."); it
# stays in the chat and is never remembered. A reply that only repeats what it was shown
# ("derivative": the user's words, the memories in its prompt) adds nothing memory does not
# hold; remembered, such copies took recall's first places above the user's own statement,
# and they would bring a forgotten fact back. Turns from before this rule have no value (None).
REMEMBERED_MEMORY_USES = frozenset({"on"})
DERIVATIVE = "derivative"
# A reply that was shown a memory the user later forgot or corrected: it may repeat the old
# fact in its own words, so it is no longer remembered (memory/recall/forgetting.py).
FORGOTTEN = "forgotten"
# The share of a reply's content terms found in what it was shown that makes it a copy.
DERIVATIVE_SHARE = 0.9


def is_remembered_reply(role: str, memory_use: str | None) -> bool:
    """False for an assistant turn made without memory (the indexer and recall both ask this)."""
    return role != "assistant" or memory_use is None or memory_use in REMEMBERED_MEMORY_USES


def unremembered_reason(role: str, memory_use: str | None) -> str | None:
    """Why the remembering rule leaves a turn out (the indexer's skip reason), None if it keeps it:
    `repeats_what_it_was_shown` for a derivative reply, `shown_a_forgotten_memory`, else
    `made_without_memory`."""
    if is_remembered_reply(role, memory_use):
        return None
    if memory_use == DERIVATIVE:
        return "repeats_what_it_was_shown"
    return "shown_a_forgotten_memory" if memory_use == FORGOTTEN else "made_without_memory"


def repeats_only(reply_text: str, shown: str) -> bool:
    """True when (nearly) every content term of the reply occurs in `shown` (what its prompt showed:
    the user's messages and the memories with them): a copy, not a new fact."""
    terms = query_terms(reply_text)
    if not terms:
        return False  # no content terms: small talk is the low-information rule's to judge
    seen = set(query_terms(shown))
    return sum(term in seen for term in terms) >= DERIVATIVE_SHARE * len(terms)


# Regex fragments, not plain strings: laughter and drawn-out words come in any length.
ENGLISH_PHRASES = (
    r"hi+",
    r"hey+",
    r"hello+",
    r"yo",
    r"howdy",
    r"good (?:morning|afternoon|evening|night|day)",
    r"morning",
    r"thanks?",
    r"thank you",
    r"thanks a lot",
    r"thank you so much",
    r"thanks so much",
    r"many thanks",
    r"thx",
    r"ty",
    r"tysm",
    r"cheers",
    r"much appreciated",
    r"appreciate it",
    r"ok(?:ay)?",
    r"o?k+",
    r"kk+",
    r"alright",
    r"all right",
    r"sure",
    r"yes+",
    r"yeah+",
    r"yep",
    r"yup",
    r"no",
    r"nope",
    r"got it",
    r"gotcha",
    r"understood",
    r"noted",
    r"sounds good",
    r"cool",
    r"nice",
    r"great",
    r"awesome",
    r"perfect",
    r"wow+",
    r"lol+",
    r"lmao",
    r"ha(?:ha)+h?",
    r"he(?:he)+",
    r"hm+",
    r"um+",
    r"uh+",
    r"oh+",
    r"ah+",
    r"bye+",
    r"goodbye",
    r"see you",
    r"see ya",
    r"later",
    r"you(?:re| are) welcome",
    r"np",
    r"no problem",
    r"no worries",
    r"you too",
    r"me too",
    r"so much",
    r"very much",
    r"a lot",
    r"again",
    r"there",
)
CHINESE_PHRASES = (
    r"你好",
    r"您好",
    r"大家好",
    r"早上好",
    r"晚上好",
    r"下午好",
    r"早安",
    r"晚安",
    r"哈+",
    r"呵+",
    r"嘿+",
    r"嗯+",
    r"哦+",
    r"噢+",
    r"喔+",
    r"啊+",
    r"好的?",
    r"好吧",
    r"好滴",
    r"行",
    r"可以",
    r"没问题",
    r"谢谢(?:你|您)?",
    r"多谢",
    r"感谢",
    r"非常感谢",
    r"辛苦了",
    r"不客气",
    r"不用谢",
    r"收到",
    r"明白了?",
    r"知道了",
    r"了解",
    r"懂了",
    r"对",
    r"是的",
    r"没错",
    r"再见",
    r"拜拜",
    r"ok",
    r"啦",
    r"呀",
    r"了",
    r"吧",
)


def _normalise(text: str) -> str:
    """Lower-case words separated by single spaces; punctuation, symbols and emoji removed."""
    text = unicodedata.normalize("NFKC", text).lower().replace("'", "").replace("’", "")
    kept = [ch if (ch.isalnum() or ch.isspace()) else " " for ch in text]
    return " ".join("".join(kept).split())


@lru_cache(maxsize=32)
def _pattern(extra_phrases: tuple[str, ...]) -> re.Pattern[str]:
    extra = tuple(re.escape(_normalise(p)) for p in extra_phrases if _normalise(p))
    latin = "|".join(sorted(ENGLISH_PHRASES + extra, key=len, reverse=True))
    cjk = "|".join(CHINESE_PHRASES)
    # Latin phrases must end at a word boundary ("hi" must not eat "hiking"); CJK has none.
    return re.compile(rf"(?:(?:(?:{latin})\b|(?:{cjk}))\s*)+")


def is_low_information(text: str, extra_phrases: Sequence[str] = ()) -> bool:
    """True when the turn is only greetings, thanks, acknowledgements, laughter or emoji."""
    normalised = _normalise(text)
    if not normalised:
        return True
    return _pattern(tuple(extra_phrases)).fullmatch(normalised) is not None


def remembered_text(text: str, *, redact_pii: bool, extra_phrases: Sequence[str] = ()) -> str | None:
    """The text as memory keeps it (redacted if `redact_pii`), or None: not worth remembering."""
    if is_low_information(text, extra_phrases=extra_phrases):
        return None
    return redact(text) if redact_pii else text
