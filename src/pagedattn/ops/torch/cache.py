"""KV-cache writes in plain PyTorch (any device)."""

from __future__ import annotations

import torch

from pagedattn.config import FP8_MAX
from pagedattn.ops.index_checks import check_slot_mapping


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    """Write token t of key/value [T, Hkv, D] into slot slot_mapping[t] of each cache.

    Caches are logical [num_blocks, block_size, Hkv, D] views with any strides, already in
    their storage dtype; fp8 caches receive x / scale saturated to the format's range.
    """
    slots = slot_mapping.long()
    keep = slots >= 0  # negative slots are padding
    slots = slots[keep]
    block_size = key_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    n = slot_mapping.shape[0]
    try:
        key_cache[blocks, offsets] = _to_cache(key[:n][keep], key_cache.dtype, k_scale)
        value_cache[blocks, offsets] = _to_cache(value[:n][keep], value_cache.dtype, v_scale)
    except IndexError as e:  # a slot past the cache: name the argument, not torch's index
        check_slot_mapping(slot_mapping, key_cache)
        raise ValueError(f"slot_mapping indexes past the cache: {e}") from e


class TorchCacheWritePlan:
    """One batch's `reshape_and_cache` slots (`ops.cache.plan_reshape_and_cache_flash`): `run`
    adds a layer's tensors. It takes [T, heads, D] keys and values only (no 2-D rows)."""

    takes_rows = False

    def __init__(self, slot_mapping: torch.Tensor):
        self.slot_mapping = slot_mapping

    def run(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
            value_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        """The write, out of autograd as the op is (keys that require grad must not tie the
        cache to a graph)."""
        with torch.no_grad():
            reshape_and_cache(key, value, key_cache, value_cache, self.slot_mapping, k_scale,
                              v_scale)


def _to_cache(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    if dtype in FP8_MAX:
        bound = FP8_MAX[dtype]
        return (x.float() / scale.float()).clamp(-bound, bound).to(dtype)
    return x.to(dtype)
