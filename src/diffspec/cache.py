"""KV-cache rollback. A cache is indexed by position, so rolling back is cutting it to a length.

transformers 5.23 changed `DynamicCache.crop` to take a non-positive count of tokens to remove
(older versions took the length to keep); this module is the one place that knows.
"""

from __future__ import annotations

from transformers import DynamicCache


def new_cache(config) -> DynamicCache:
    return DynamicCache(config=config)


def cache_length(cache: DynamicCache) -> int:
    return int(cache.get_seq_length())


def truncate_cache(cache: DynamicCache, length: int) -> None:
    """Keep the first `length` positions of `cache` (no-op if it is not longer)."""
    current = cache_length(cache)
    if length < 0:
        raise ValueError(f"cache length must be >= 0, got {length}")
    if current > length:
        cache.crop(-(current - length))
    assert cache_length(cache) == min(current, length)
