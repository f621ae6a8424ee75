"""KV-cache writes in plain PyTorch (any device)."""

from __future__ import annotations

from typing import Optional

import torch

from pagedattn.config import FP8_MAX
from pagedattn.ops.index_checks import check_slot_mapping


class CacheSlots:
    """Where a batch's tokens go in a cache of `block_size` slots a block: the token rows
    written (negative slots are padding) and their slots, found once for every layer."""

    def __init__(self, slot_mapping: torch.Tensor, block_size: int):
        slots = slot_mapping.long()
        self.num_tokens = slot_mapping.shape[0]
        keep = slots >= 0
        # [m] int64 rows of key / value written; None: all of the first num_tokens
        self.rows = None if bool(keep.all()) else keep.nonzero().view(-1)
        self.slots = slots if self.rows is None else slots[self.rows]  # [m] int64
        self.blocks, self.offsets = self.slots // block_size, self.slots % block_size

    def write(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
              value_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        """key/value [T, Hkv, D] into their slots of the caches (`reshape_and_cache`)."""
        for x, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
            x = x[:self.num_tokens] if self.rows is None else x.index_select(0, self.rows)
            x = _to_cache(x, cache.dtype, scale)
            try:  # a cache whose slots are rows of one view (NHD): one row copy per slot
                cache.view(-1, *cache.shape[2:]).index_copy_(0, self.slots, x)
            except RuntimeError:  # HND: a slot's heads are strided
                cache[self.blocks, self.offsets] = x


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      k_scale: torch.Tensor, v_scale: torch.Tensor,
                      slots: Optional[CacheSlots] = None) -> None:
    """Write token t of key/value [T, Hkv, D] into slot slot_mapping[t] of each cache.

    Caches are logical [num_blocks, block_size, Hkv, D] views with any strides, already in
    their storage dtype; fp8 caches receive x / scale saturated to the format's range.
    `slots`: slot_mapping's `CacheSlots`, made beforehand (a plan's).
    """
    try:
        (slots or CacheSlots(slot_mapping, key_cache.shape[1])).write(
            key, value, key_cache, value_cache, k_scale, v_scale)
    except IndexError as e:  # a slot past the cache: name the argument, not torch's index
        check_slot_mapping(slot_mapping, key_cache)
        raise ValueError(f"slot_mapping indexes past the cache: {e}") from e


class TorchCacheWritePlan:
    """One batch's `reshape_and_cache` slots (`ops.cache.plan_reshape_and_cache_flash`), found
    when planned from the slot mapping as it is then (with `cuda_graph`, at every run: later
    batches replay the plan): `run` adds a layer's tensors. It takes [T, heads, D] keys and
    values only (no 2-D rows)."""

    takes_rows = False

    def __init__(self, slot_mapping: torch.Tensor, block_size: int, cuda_graph: bool = False):
        self.slot_mapping = slot_mapping
        self.slots = None if cuda_graph else CacheSlots(slot_mapping, block_size)

    def run(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
            value_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        """The write, out of autograd as the op is (keys that require grad must not tie the
        cache to a graph)."""
        with torch.no_grad():
            reshape_and_cache(key, value, key_cache, value_cache, self.slot_mapping, k_scale,
                              v_scale, self.slots)


def _to_cache(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    if dtype in FP8_MAX:
        bound = FP8_MAX[dtype]
        return (x.float() / scale.float()).clamp(-bound, bound).to(dtype)
    return x.to(dtype)
