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

For passes of fixed shapes (CUDA graphs), `new_fixed_cache` gives transformers' StaticCache instead: the
whole capacity is allocated once and every pass attends over it under a causal mask, so rolling back is
setting the layers' length (`set_fixed_length`) and the rows past it, stale, are never read.

transformers 5.23 also changed `DynamicCache.crop` to take a non-positive count of tokens to remove
(older versions took the length to keep); `truncate_cache` is the one caller.
"""

from __future__ import annotations

from typing import Optional

import torch
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, StaticLayer, get_layer_types_and_kwargs

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


class PositionalLayer(DynamicLayer):
    """A full-attention layer's cache indexed by position (gpt-fast's design): keys and values live
    in buffers preallocated for `capacity` positions, a pass writes its rows in place at positions
    [length, length + n), attention reads the view [:length + n], and rolling back is moving the
    length. No copy of the cache per pass, unlike DynamicLayer's concatenation (whose cost grows
    with the context). Past the capacity the buffers double (a copy, amortised over as many passes).
    Keys and values are views into the buffers: they are valid until the next pass."""

    def __init__(self, capacity: int = 256, storage: Optional[torch.dtype] = None, **kwargs):
        self._viewed = None  # the length `keys`/`values` were last cut (or assigned) at; None: cut when next read
        super().__init__(**kwargs)
        self.capacity = max(1, int(capacity))
        self.length = 0
        # the buffers' dtype where it is not the passes' own (None: theirs): float16 under --kernels q8, as llama.cpp
        # keeps its cache; the fused call writes and reads it directly, `update` hands the passes' dtype back
        self.storage = storage

    # Keys and values are cut from the buffers when read, not at every length change: the fused layers'
    # one C call advances all 30 layers a step and reads none of these views (cutting 60 of them a step
    # cost ~0.28 ms of a ~9 ms step on a 2-core AVX-512 CPU). A direct assignment (as some transformers
    # helpers make) holds until the length next changes, as an assigned view did before.
    @property
    def keys(self):
        if self._viewed != self.length:
            self._view()
        return self._keys_view

    @keys.setter
    def keys(self, value):
        self._keys_view, self._viewed = value, getattr(self, "length", None)

    @property
    def values(self):
        if self._viewed != self.length:
            self._view()
        return self._values_view

    @values.setter
    def values(self, value):
        self._values_view, self._viewed = value, getattr(self, "length", None)

    def lazy_initialization(self, key_states, value_states) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, d = key_states.shape
        self._keys = key_states.new_empty((b, h, self.capacity, d), dtype=self.storage or key_states.dtype)
        self._values = value_states.new_empty((b, h, self.capacity, value_states.shape[-1]),
                                              dtype=self.storage or value_states.dtype)
        self.length = 0
        self._view()
        self.is_initialized = True

    def _view(self) -> None:
        if getattr(self, "_keys", None) is None:  # no buffers yet (before the first pass)
            self._keys_view = self._values_view = None
        else:
            self._keys_view = self._keys[:, :, :self.length]
            self._values_view = self._values[:, :, :self.length]
        self._viewed = self.length

    def reserve(self, positions: int) -> None:
        """Make room for `positions` positions (doubling), keeping what is held."""
        if positions <= self.capacity:
            return
        self.capacity = max(positions, 2 * self.capacity)
        if self.is_initialized:
            grown_k = self._keys.new_empty(self._keys.shape[:2] + (self.capacity, self._keys.shape[-1]))
            grown_v = self._values.new_empty(self._values.shape[:2] + (self.capacity, self._values.shape[-1]))
            grown_k[:, :, :self.length] = self._keys[:, :, :self.length]
            grown_v[:, :, :self.length] = self._values[:, :, :self.length]
            self._keys, self._values = grown_k, grown_v
            self._view()

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        self.reserve(self.length + n)
        self._keys[:, :, self.length:self.length + n] = key_states  # (rounded to nearest even into a float16 store)
        self._values[:, :, self.length:self.length + n] = value_states
        self.length += n
        self._view()
        if self._keys.dtype != key_states.dtype:  # a float16 store: the held values, in the pass's dtype
            return self.keys.to(key_states.dtype), self.values.to(value_states.dtype)
        return self.keys, self.values

    def advance(self, n: int) -> None:
        """Record `n` positions written into the buffers in place after `length` by a caller (fused_layers.py),
        room for them made first (`reserve`)."""
        if self.length + n > self.capacity:
            raise ValueError(f"{n} positions written past a capacity of {self.capacity} (length {self.length})")
        self.length += n  # the views are cut when next read (keys, values)

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a non-positive count of tokens to remove, got {tokens_to_remove}")
        if self.is_initialized and tokens_to_remove:
            self.length = max(0, self.length + tokens_to_remove)
            self._viewed = None  # cut when next read (a pass back to this length must not find an assigned view)

    def reset(self) -> None:
        self.length = 0
        self._viewed = None


def new_cache(config, capacity: Optional[int] = None, storage: Optional[torch.dtype] = None) -> DynamicCache:
    """An empty cache for a model with `config`, able to roll back (see the module docstring): its
    full-attention layers are position-indexed (`PositionalLayer`, preallocated for `capacity`
    positions, default 256, growing as needed; holding keys and values as `storage` where given); its
    sliding-window layers record their past."""
    check_rollback(config)
    cache = DynamicCache(config=config)
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, DynamicSlidingWindowLayer):
            layer.activate_past_recording()
        elif type(layer) is DynamicLayer:
            cache.layers[i] = PositionalLayer(capacity or 256, storage=storage)
    return cache


def reserve_cache(cache: DynamicCache, positions: int) -> None:
    """Preallocate the position-indexed layers of `cache` for `positions` positions (a request's
    prompt, new tokens and widest draft), so none grows mid-request."""
    for layer in cache.layers:
        if isinstance(layer, PositionalLayer):
            layer.reserve(positions)


#: the smallest capacity of a fixed-capacity cache (`new_fixed_cache`): a request's positions are rounded
#: up to a power of two from here (then capped at the model's context), so a process records few shapes
FIXED_CAPACITY_MIN = 2048


def fixed_capacity(positions: int, max_context: int) -> int:
    """The capacity of the fixed-capacity cache that holds `positions` positions: the next power of two
    from FIXED_CAPACITY_MIN, at most the model's context."""
    capacity = FIXED_CAPACITY_MIN
    while capacity < positions:
        capacity *= 2
    return max(1, min(capacity, int(max_context)))


def other_than_full_attention(config) -> list:
    """The layer types of a model other than full attention (sorted; empty when every layer is full attention)."""
    layer_types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    return sorted({t for t in layer_types if t != "full_attention"})


def new_fixed_cache(config, capacity: int) -> StaticCache:
    """A fixed-capacity cache (transformers' StaticCache) for passes of fixed shapes, which CUDA graphs
    need: every pass writes its rows in place at the layer's length (a tensor, read inside the graph)
    and attends over the whole capacity under a causal mask, so positions past the length, stale
    after a rollback, are never read. Rolling back is setting the length (`set_fixed_length`).
    Full-attention layers only (a sliding window's ring buffer cannot be rolled back this way)."""
    check_rollback(config)
    other = other_than_full_attention(config)
    if other:
        raise DiffspecError(f"a fixed-capacity cache supports full-attention layers only; this model has "
                            f"{', '.join(other)} layers")
    return StaticCache(config=config, max_cache_len=int(capacity))


def fixed_cache_capacity(cache: StaticCache) -> int:
    return int(cache.layers[0].max_cache_len)


def set_fixed_length(cache: StaticCache, length: int) -> None:
    """Move every layer of a fixed-capacity cache to `length` positions (a rollback, or the cut after a
    padded pass): in place, so the tensor a compiled graph reads keeps its address. (Under inference
    mode: the passes made these tensors under it.)"""
    with torch.inference_mode():
        _set_lengths(cache, length)


def _set_lengths(cache: StaticCache, length: int) -> None:
    assert all(isinstance(layer, StaticLayer) for layer in cache.layers)
    lengths = [layer.cumulative_length for layer in cache.layers if layer.is_initialized]
    if lengths:  # two fused kernels for all layers (on CUDA, not one launch per layer)
        torch._foreach_zero_(lengths)
        torch._foreach_add_(lengths, int(length))


def copy_fixed_cache(source: StaticCache, target: StaticCache, length: int) -> None:
    """Copy the first `length` positions of one fixed-capacity cache into another (a larger one)."""
    with torch.inference_mode():
        for old, new in zip(source.layers, target.layers):
            if old.is_initialized:
                new.lazy_initialization(old.keys[:, :, :1], old.values[:, :, :1])
                new.keys[:, :, :length] = old.keys[:, :, :length]
                new.values[:, :, :length] = old.values[:, :, :length]
        _set_lengths(target, length)


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
    masks (block diffusion), which transformers applies to every layer as given, window or not.
    Its layers are position-indexed (`PositionalLayer`), made as the first pass reaches them."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = PositionalLayer
    return cache


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
