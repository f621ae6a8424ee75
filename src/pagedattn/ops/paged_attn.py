"""`PagedAttention`: the v0 paged-cache helper (vLLM's `paged_attn.PagedAttention`) that the
BLOCK_SPARSE_FLASH_ATTN backend uses: cache shape and views, cache write, decode, block moves.

One layer's cache is one tensor (2, num_blocks, block_size * num_kv_heads * head_size); its
views are key_cache [num_blocks, num_kv_heads, head_size // x, block_size, x] (x = 16 bytes
of elements, so a thread reads 16 contiguous bytes of a key) and value_cache [num_blocks,
num_kv_heads, head_size, block_size].
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Optional, Union

import torch

from pagedattn import kv_cache
from pagedattn.ops.blocksparse import Scale, blocksparse_paged_attention
from pagedattn.ops.cache import (
    CacheWritePlan,
    plan_reshape_and_cache_flash,
    reshape_and_cache_flash,
)

BlockMapping = Union[torch.Tensor, Mapping[int, int]]


class PagedAttention:
    @staticmethod
    def get_supported_head_sizes() -> list[int]:
        return [32, 64, 80, 96, 112, 120, 128, 192, 256]

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int, cache_dtype_str: str = "auto") -> tuple[int, ...]:
        for name, value in (("block_size", block_size), ("num_kv_heads", num_kv_heads),
                            ("head_size", head_size)):
            if value <= 0:
                raise ValueError(f"{name}={value} must be positive")
        return (2, num_blocks, block_size * num_kv_heads * head_size)

    @staticmethod
    def split_kv_cache(kv_cache: torch.Tensor, num_kv_heads: int, head_size: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """(key_cache, value_cache) views of one layer's cache; no copy."""
        x = 16 // kv_cache.element_size()
        if kv_cache.dim() != 3 or kv_cache.shape[0] != 2:
            raise ValueError(f"kv_cache has shape {tuple(kv_cache.shape)}; expected (2, "
                             "num_blocks, block_size * num_kv_heads * head_size)")
        if head_size % x or kv_cache.shape[2] % (num_kv_heads * head_size):
            raise ValueError(
                f"kv_cache of shape {tuple(kv_cache.shape)} and dtype {kv_cache.dtype} cannot "
                f"hold num_kv_heads={num_kv_heads} x head_size={head_size} (head_size must be "
                f"a multiple of x = 16 // itemsize = {x})")
        num_blocks = kv_cache.shape[1]
        key_cache = kv_cache[0].view(num_blocks, num_kv_heads, head_size // x, -1, x)
        value_cache = kv_cache[1].view(num_blocks, num_kv_heads, head_size, -1)
        return key_cache, value_cache

    @staticmethod
    def write_to_paged_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                             value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                             kv_cache_dtype: str, k_scale: Scale = 1.0,
                             v_scale: Scale = 1.0) -> None:
        """Write key/value [num_tokens, num_kv_heads, head_size] at slot_mapping (negative:
        skip). Both v0 views are plain strided [num_blocks, block_size, rows, cols] tensors
        when a key row is x elements and a value row one element, so the flash-layout cache
        write serves them (fp8 quantization included). Their row shapes differ, and that
        write takes one shape for K and V, so each goes in its own call (as both operands)."""
        for rows, view, scale in zip(*_rows_and_views(key, value, key_cache, value_cache),
                                     (k_scale, v_scale)):
            scale = 1.0 if scale is None else scale
            reshape_and_cache_flash(rows, rows, view, view, slot_mapping, kv_cache_dtype,
                                    scale, scale)

    @staticmethod
    def plan_write_to_paged_cache(slot_mapping: torch.Tensor, num_kv_heads: int,
                                  head_size: int, block_size: int, cache_dtype: torch.dtype
                                  ) -> PagedCacheWritePlan:
        """`write_to_paged_cache` planned for one batch's slots (caches of storage dtype
        `cache_dtype`, fp8 quantized); `run` it per layer."""
        x = 16 // cache_dtype.itemsize  # a key row: x elements; a value row: one
        rows = dict(page_size=block_size, cache_dtype=cache_dtype)
        return PagedCacheWritePlan(
            plan_reshape_and_cache_flash(slot_mapping, num_kv_heads=num_kv_heads * head_size
                                         // x, head_size=x, **rows),
            plan_reshape_and_cache_flash(slot_mapping, num_kv_heads=num_kv_heads * head_size,
                                         head_size=1, **rows))

    @staticmethod
    def forward_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       block_tables: torch.Tensor, seq_lens: torch.Tensor,
                       max_seq_len: Optional[int], kv_cache_dtype: str, num_kv_heads: int,
                       scale: float, alibi_slopes: Optional[torch.Tensor], k_scale: Scale,
                       v_scale: Scale, tp_rank: int = 0, blocksparse_local_blocks: int = 0,
                       blocksparse_vert_stride: int = 0, blocksparse_block_size: int = 64,
                       blocksparse_head_sliding_step: int = 0, *,
                       out: Optional[torch.Tensor] = None,
                       workspace: Optional[tuple] = None) -> torch.Tensor:
        """Decode over the v0 cache; vert_stride <= 1 (the default 0) is dense attention.
        max_seq_len only bounds the split-KV schedule (clamped to the table's capacity);
        workspace is `ops.blocksparse.decode_workspace`'s split-KV scratch."""
        if blocksparse_vert_stride <= 1:  # dense: one local window that covers everything
            blocksparse_local_blocks, blocksparse_vert_stride = 0, 1
            blocksparse_block_size = key_cache.shape[3]
        capacity = block_tables.shape[1] * key_cache.shape[3]
        bound = capacity if max_seq_len is None else min(int(max_seq_len), capacity)
        return blocksparse_paged_attention(
            query, key_cache, value_cache, block_tables, seq_lens, scale,
            blocksparse_local_blocks, blocksparse_vert_stride, blocksparse_block_size,
            blocksparse_head_sliding_step, max_seq_len=bound, kv_cache_dtype=kv_cache_dtype,
            num_kv_heads=num_kv_heads, alibi_slopes=alibi_slopes, k_scale=k_scale,
            v_scale=v_scale, tp_rank=tp_rank, out=out, workspace=workspace)

    @staticmethod
    def swap_blocks(src_kv_cache: torch.Tensor, dst_kv_cache: torch.Tensor,
                    src_to_dst: BlockMapping) -> None:
        """Copy K and V blocks src -> dst (e.g. GPU <-> CPU); {src: dst} or [n, 2]."""
        kv_cache.swap_blocks(src_kv_cache, dst_kv_cache, _pairs(src_to_dst), dim=1)

    @staticmethod
    def copy_blocks(kv_caches: Sequence[torch.Tensor],
                    src_to_dists: Union[torch.Tensor, Mapping[int, Sequence[int]]]) -> None:
        """Within every layer's cache, copy block src onto each of its dsts (forks)."""
        if isinstance(src_to_dists, Mapping):
            src_to_dists = [(s, d) for s, dsts in src_to_dists.items() for d in dsts]
        kv_cache.copy_blocks(kv_caches, _pairs(src_to_dists), dim=1)


def _pairs(mapping) -> torch.Tensor:
    if isinstance(mapping, torch.Tensor):
        return mapping
    items = list(mapping.items()) if isinstance(mapping, Mapping) else list(mapping)
    return torch.tensor(items, dtype=torch.int64).reshape(-1, 2)


class PagedCacheWritePlan:
    """`PagedAttention.write_to_paged_cache` of one batch, planned: the K and the V rows'
    cache-write plans (`plan_write_to_paged_cache`); `run` per layer."""

    def __init__(self, key_plan: CacheWritePlan, value_plan: CacheWritePlan):
        self.plans = (key_plan, value_plan)

    def run(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
            value_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        """`write_to_paged_cache`'s tensors; scales 0-d float32 tensors on the device."""
        for plan, rows, view, scale in zip(
                self.plans, *_rows_and_views(key, value, key_cache, value_cache),
                (k_scale, v_scale)):
            plan.run(rows, rows, view, view, scale, scale)


def _rows_and_views(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor) -> tuple[tuple, tuple]:
    """((key rows, value rows), (key cache view, value cache view)): both v0 views are plain
    strided [num_blocks, block_size, rows, cols] tensors when a key row is x elements and a
    value row one element, so the flash-layout cache write serves them (each in its own
    call, as both operands: their row shapes differ)."""
    num_blocks, num_kv_heads, chunks, page, x = key_cache.shape
    head_size = value_cache.shape[2]
    if key.dim() != 3 or tuple(key.shape[1:]) != (num_kv_heads, chunks * x):
        raise ValueError(f"key has shape {tuple(key.shape)}; the cache holds "
                         f"[num_tokens, {num_kv_heads}, {chunks * x}]")
    if value.shape != key.shape:
        raise ValueError(f"value {tuple(value.shape)} must match key {tuple(key.shape)}")
    tokens = key.shape[0]
    rows = (key.reshape(tokens, num_kv_heads * chunks, x),
            value.reshape(tokens, num_kv_heads * head_size, 1))
    views = (key_cache.view(num_blocks, num_kv_heads * chunks, page, x).transpose(1, 2),
             value_cache.view(num_blocks, num_kv_heads * head_size, page, 1).transpose(1, 2))
    return rows, views
