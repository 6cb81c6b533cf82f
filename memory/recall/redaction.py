"""Redaction of personal identifiers before a turn is embedded and indexed.

Numbers are only replaced when they carry their own proof: a Chinese resident ID
number must pass the GB 11643-1999 checksum and a card number the Luhn check, so
order numbers, years, dates and amounts stay as they are. Phone numbers have no
checksum, so their patterns insist on a phone-like shape (a leading ``+``, US
separators, or a Chinese mobile prefix) instead of any run of digits.
"""

from __future__ import annotations

import re

EMAIL = "[EMAIL]"
PHONE = "[PHONE]"
CN_ID = "[CN_ID]"
CARD = "[CARD]"

# No digit (or letter, for IDs) may touch a match: the number must stand on its own.
_NOT_AFTER_DIGIT = r"(?<![\d])"
_NOT_BEFORE_DIGIT = r"(?![\d])"

_EMAIL_RE = re.compile(r"(?<![\w.+-])[\w.+-]+@[\w-]+(?:\.[\w-]+)*\.[A-Za-z]{2,}(?![\w-])")
_CN_ID_RE = re.compile(r"(?<![0-9A-Za-z])[1-9]\d{16}[\dXx](?![0-9A-Za-z])")
_CARD_RE = re.compile(_NOT_AFTER_DIGIT + r"\d(?:[ -]?\d){12,18}" + _NOT_BEFORE_DIGIT)
_INTL_PHONE_RE = re.compile(
    r"(?<![0-9A-Za-z+])\+\d{1,3}(?:[ .-]?\(\d{1,4}\))?(?:[ .-]?\d{1,5}){1,5}" + _NOT_BEFORE_DIGIT
)
_CN_MOBILE_RE = re.compile(
    r"(?<![0-9A-Za-z+])(?:(?:\+?86|0086)[ -]?)?1[3-9]\d(?:[ -]?\d{4}){2}" + _NOT_BEFORE_DIGIT
)
_US_PHONE_RE = re.compile(
    r"(?<![0-9A-Za-z+])(?:1[ .-])?(?:\(\d{3}\)[ .-]?|\d{3}[.-])\d{3}[.-]\d{4}" + _NOT_BEFORE_DIGIT
)

_CN_ID_WEIGHTS = (7, 9, 10, 5, 8, 4, 2, 1, 6, 3, 7, 9, 10, 5, 8, 4, 2)
_CN_ID_CHECK = "10X98765432"


def cn_id_checksum_ok(number: str) -> bool:
    """True when an 18-character resident ID number has the right GB 11643 check character."""
    if len(number) != 18 or not number[:17].isdigit():
        return False
    total = sum(int(d) * w for d, w in zip(number[:17], _CN_ID_WEIGHTS, strict=True))
    return _CN_ID_CHECK[total % 11] == number[17].upper()


def luhn_ok(digits: str) -> bool:
    """True when a string of digits passes the Luhn check."""
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch)
        if i % 2 == 1:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def _digits(text: str) -> str:
    return "".join(ch for ch in text if ch.isdigit())


def _cn_id(match: re.Match[str]) -> str:
    return CN_ID if cn_id_checksum_ok(match.group(0)) else match.group(0)


def _card(match: re.Match[str]) -> str:
    digits = _digits(match.group(0))
    # All-same digits pass Luhn for some lengths (0000...), and are never real cards.
    if 13 <= len(digits) <= 19 and luhn_ok(digits) and len(set(digits)) > 1:
        return CARD
    return match.group(0)


def _intl_phone(match: re.Match[str]) -> str:
    return PHONE if 8 <= len(_digits(match.group(0))) <= 15 else match.group(0)


def redact(text: str) -> str:
    """``text`` with emails, phone numbers, valid Chinese ID numbers and valid card numbers replaced."""
    text = _EMAIL_RE.sub(EMAIL, text)
    # A leading "+" makes a phone number, whatever its digits would pass as a card.
    text = _INTL_PHONE_RE.sub(_intl_phone, text)
    text = _CN_ID_RE.sub(_cn_id, text)
    text = _CARD_RE.sub(_card, text)
    text = _CN_MOBILE_RE.sub(PHONE, text)
    return _US_PHONE_RE.sub(PHONE, text)
