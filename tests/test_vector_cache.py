"""The recall's vector cache: bounded, least recently used out, exact vectors back."""

from __future__ import annotations

from memory.recall.vector_cache import VectorCache


def test_the_cache_keeps_at_most_its_bound_and_drops_the_least_recently_used() -> None:
    cache = VectorCache(max_entries=2)
    cache.keep(["a", "b"], [[0.1, 0.2], [0.3, 0.4]])
    assert cache.take(["a"]) == [[0.1, 0.2]]  # "a" is now the most recently used
    cache.keep(["c"], [[0.5, 0.6]])
    assert len(cache) == 2
    assert cache.take(["b", "a", "c", "ünïcode \ud800"]) == [None, [0.1, 0.2], [0.5, 0.6], None]
    assert (cache.hits, cache.misses) == (3, 2)


def test_a_cache_bounded_at_zero_keeps_nothing() -> None:
    cache = VectorCache(max_entries=0)
    cache.keep(["a"], [[1.0]])
    assert cache.take(["a"]) == [None] and len(cache) == 0
