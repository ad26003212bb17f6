"""KV-cache rollback. A cache is indexed by position, so rolling back is cutting it to a length.

transformers 5.23 builds one cache layer per decoder layer from the model's config
(`DynamicCache(config=...)`), and this module is the one place that knows how each kind rolls back:

- full attention (`DynamicLayer`, also DSA's indexed layer): every position is kept; cutting to
  any length is exact.
- sliding window / chunked attention (`DynamicSlidingWindowLayer`: Gemma 2/3, Mistral, Llama 4):
  once the window is full the layer keeps only its last `window - 1` positions, so a rejected draft
  could not be taken back. `new_cache` switches on its past recording: a forward pass keeps the
  positions it added until the next `crop` trims the layer back to its window. Cutting back within
  what the last passes added is then exact; cutting further than what the layer still holds
  raises `RollbackError` (never a silently shorter window). The engine only ever removes rejected
  drafts of the pass just made, which is always within reach.
- linear attention / convolution / hybrid layers (Mamba-style, Qwen3-Next, LFM2, ...): a recurrent
  state cannot be cut back to an earlier position; such models are refused by name (`check_rollback`).

transformers 5.23 also changed `DynamicCache.crop` to take a non-positive count of tokens to remove
(older versions took the length to keep); `truncate_cache` is the one caller.
"""

from __future__ import annotations

from transformers import DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer, get_layer_types_and_kwargs

from .errors import DiffspecError

# layer types whose state diffspec can cut back to an earlier position (transformers' names)
ROLLBACK_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "indexed_attention", "dummy")


class RollbackError(DiffspecError):
    """The cache no longer holds what is needed to go back to the requested length."""


def check_rollback(config, name: str = "model") -> None:
    """Refuse, by name, a model whose cache layers cannot be rolled back (recurrent-state layers)."""
    layer_types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    bad = sorted({t for t in layer_types if t not in ROLLBACK_LAYER_TYPES})
    if bad:
        raise DiffspecError(
            f"{name} has cache layers of type {', '.join(bad)} (a recurrent state, as in linear-attention or "
            f"Mamba-style layers), which cannot be rolled back to an earlier position after a rejected draft; "
            f"diffspec supports models whose layers are {', '.join(ROLLBACK_LAYER_TYPES[:-1])}")


def new_cache(config) -> DynamicCache:
    """An empty cache for a model with `config`, able to roll back (see the module docstring)."""
    check_rollback(config)
    cache = DynamicCache(config=config)
    for layer in cache.layers:
        if isinstance(layer, DynamicSlidingWindowLayer):
            layer.activate_past_recording()
    return cache


def common_prefix_length(a, b) -> int:
    """How many leading tokens two sequences share: the part of a cache keyed by `a` still valid for `b`."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def full_cache() -> DynamicCache:
    """A cache whose every layer keeps every position: for drafters that pass their own attention
    masks (block diffusion), which transformers applies to every layer as given, window or not."""
    return DynamicCache()


def cache_length(cache: DynamicCache) -> int:
    return int(cache.get_seq_length())


def earliest_length(cache: DynamicCache) -> int:
    """The shortest length `truncate_cache` can still cut `cache` back to exactly."""
    earliest = 0
    for layer in cache.layers:
        if isinstance(layer, DynamicSlidingWindowLayer) and layer.is_initialized:
            held = int(layer.keys.shape[-2])
            first_held = layer.cumulative_length - held      # position of the oldest key the layer holds
            if first_held > 0:                               # it needs positions [L - (window - 1), L)
                earliest = max(earliest, first_held + layer.sliding_window - 1)
    return earliest


def truncate_cache(cache: DynamicCache, length: int) -> None:
    """Keep the first `length` positions of `cache` (no-op if it is not longer).

    Raises RollbackError when a sliding-window layer has already dropped positions that the
    shorter cache would need (cutting back further than the passes since the last cut added)."""
    if length < 0:
        raise ValueError(f"cache length must be >= 0, got {length}")
    current = cache_length(cache)
    if current > length and length < earliest_length(cache):
        raise RollbackError(f"cannot roll the cache back from {current} to {length} positions: its sliding-window "
                            f"layers only hold positions from {earliest_length(cache)} on")
    for layer in cache.layers:  # crop(0) still trims a sliding layer back to its window
        if layer.is_initialized:  # (transformers' sliding crop fails on a layer that saw no pass yet)
            layer.crop(-max(0, current - length))
    assert cache_length(cache) == min(current, length)
