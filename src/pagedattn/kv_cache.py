"""KV-cache tensors: allocation in the backend's physical layout, binding to layers, and
block swaps/copies (for preemption and prefix forking) that work for every backend's layout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Optional, Union

import torch

from pagedattn.config import kv_cache_torch_dtype
from pagedattn.types import AttentionBackend

_PROBE_BLOCKS = 7919  # a prime no other dimension equals, to find the block dimension


def physical_order(backend: type[AttentionBackend]) -> tuple[int, ...]:
    """Permutation from the logical cache shape to the order dimensions sit in memory."""
    try:
        return tuple(backend.get_kv_cache_stride_order())
    except NotImplementedError:
        return ()


def allocate_kv_cache(backend: type[AttentionBackend], num_blocks: int, block_size: int,
                      num_kv_heads: int, head_size: int, dtype: torch.dtype,
                      cache_dtype_str: str = "auto",
                      device: Union[torch.device, str] = "cpu") -> torch.Tensor:
    """One layer's cache: allocated in physical order, returned as the logical-shape view."""
    shape = backend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size,
                                       cache_dtype_str)
    order = physical_order(backend) or tuple(range(len(shape)))
    storage = torch.empty([shape[i] for i in order], dtype=kv_cache_torch_dtype(
        cache_dtype_str, dtype), device=device)
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return storage.permute(*inverse)


def allocate_kv_caches(layers: Mapping[str, torch.nn.Module], num_blocks: int,
                       device: Union[torch.device, str, None] = None,
                       dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """A cache per Attention layer; a layer that shares KV gets its target's tensor."""
    caches: dict[str, torch.Tensor] = {}
    for name, layer in layers.items():
        if layer.kv_sharing_target_layer_name is not None:
            continue
        caches[name] = allocate_kv_cache(
            layer.attn_backend, num_blocks, layer.block_size, layer.num_kv_heads,
            layer.head_size, dtype or layer.dtype, layer.kv_cache_dtype,
            device if device is not None else "cpu")
    for name, layer in layers.items():
        target = layer.kv_sharing_target_layer_name
        if target is not None:
            if target not in caches:
                raise ValueError(f"layer {name!r} shares the KV cache of {target!r}, which is "
                                 "not among the layers given")
            caches[name] = caches[target]
    return caches


def bind_kv_cache(kv_caches: Mapping[str, torch.Tensor],
                  layers: Mapping[str, torch.nn.Module]) -> None:
    """Point each layer's `kv_cache` at its tensor (virtual engine 0), and put the tensors the
    layer reads per call (scales, ranges, ALiBi slopes, sinks) on that tensor's device, once.

    Bind after loading weights: a per-call tensor on another device is copied here, so a later
    in-place load into the original (a sinks parameter, say) would not reach the copy.
    """
    for name, layer in layers.items():
        if name not in kv_caches:
            raise ValueError(f"no KV cache given for layer {name!r}")
        cache = kv_caches[name]
        layer.kv_cache = [cache]
        place_on = getattr(layer, "place_on", None)
        if place_on is not None:
            place_on(cache.device)


def block_dim(backend: type[AttentionBackend]) -> int:
    """Which dimension of the backend's logical cache shape indexes blocks."""
    shape = backend.get_kv_cache_shape(_PROBE_BLOCKS, 16, 1, 8, "auto")
    return list(shape).index(_PROBE_BLOCKS)


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor,
                dim: int = 0) -> None:
    """Copy blocks src[mapping[i, 0]] -> dst[mapping[i, 1]] along `dim` (devices may differ)."""
    pairs = _check_pairs(block_mapping)
    src_ids = pairs[:, 0].to(src.device)
    dst_ids = pairs[:, 1].to(dst.device)
    dst.index_copy_(dim, dst_ids, src.index_select(dim, src_ids).to(dst.device))


def copy_blocks(kv_caches: Sequence[torch.Tensor], block_pairs: torch.Tensor,
                dim: int = 0) -> None:
    """Within each cache, copy block pairs[i, 0] onto block pairs[i, 1] (copy-on-write forks)."""
    for cache in kv_caches:
        swap_blocks(cache, cache, block_pairs, dim)


def _check_pairs(mapping: torch.Tensor) -> torch.Tensor:
    if mapping.dim() != 2 or mapping.shape[1] != 2:
        raise ValueError(f"block mapping must be [n, 2] (src, dst); got {tuple(mapping.shape)}")
    return mapping.long()
