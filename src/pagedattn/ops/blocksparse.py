"""`blocksparse_paged_attention`: decode attention over the v0 paged cache with vLLM's
local + vertical-stride block-sparse pattern.

A query at position p (= seq_len - 1) sees key j iff j <= p and, with qb = p // block_size and
kb = j // block_size, qb - kb < local_blocks or (kb + offset) % vert_stride == 0, where
offset = g * |head_sliding_step| + 1 and g is the query head's global index (step >= 0) or
its KV head's (step < 0); global indices include tp_rank's offset. vert_stride <= 1 is dense.
"""

from __future__ import annotations

from types import ModuleType
from typing import Optional, Union

import torch

from pagedattn.config import is_fp8_kv_cache, kv_cache_torch_dtype
from pagedattn.ops.checks import (
    INDEX_DTYPES,
    check_dim,
    check_float,
    check_int,
    check_shape,
    check_tensor,
)
from pagedattn.ops.providers import provider_name

_FLOAT = (torch.float16, torch.bfloat16, torch.float32)
Scale = Union[torch.Tensor, float, None]


def provider(device: torch.device, name: Optional[str] = None) -> ModuleType:
    """The block-sparse kernels of provider `name`, by default the one that serves `device`."""
    if (name or provider_name(device)) == "triton":
        from pagedattn.ops.triton import blocksparse
    else:
        from pagedattn.ops.torch import blocksparse
    return blocksparse


def decode_workspace(device: torch.device, max_num_seqs: int, num_heads: int,
                     num_kv_heads: int, head_size: int) -> Optional[tuple[torch.Tensor, ...]]:
    """Split-KV scratch for any decode batch of at most max_num_seqs (None: none needed)."""
    make = getattr(provider(device), "decode_workspace", None)
    return make(device, max_num_seqs, num_heads, num_kv_heads, head_size) if make else None


def check_pattern(block_size: int, local_blocks: int, vert_stride: int,
                  prefix: str = "") -> None:
    """Sparse block size, local window and vertical stride, with errors naming the value."""
    for name, value, low in (("block_size", block_size, 1), ("local_blocks", local_blocks, 0),
                             ("vert_stride", vert_stride, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{prefix}{name}={value!r} must be an int >= {low}")


def blocksparse_paged_attention(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    blocksparse_local_blocks: int, blocksparse_vert_stride: int, blocksparse_block_size: int,
    blocksparse_head_sliding_step: int, *, max_seq_len: Optional[int] = None,
    kv_cache_dtype: str = "auto", num_kv_heads: Optional[int] = None,
    alibi_slopes: Optional[torch.Tensor] = None, k_scale: Scale = None, v_scale: Scale = None,
    tp_rank: int = 0, out: Optional[torch.Tensor] = None,
    workspace: Optional[tuple[torch.Tensor, ...]] = None,
) -> torch.Tensor:
    """Block-sparse decode: one query per sequence over a paged v0 cache.

    Args:
        query: [num_seqs, num_heads, head_size] fp16/bf16/fp32 (this rank's heads).
        key_cache: [num_blocks, num_kv_heads, head_size // x, block_size, x], x = 16 // itemsize.
        value_cache: [num_blocks, num_kv_heads, head_size, block_size].
        block_tables: [num_seqs, max_blocks] int32; seq_lens: [num_seqs] int32 (keys,
            the query's own included).
        blocksparse_block_size: sparse block size, a multiple of the cache block size.
        blocksparse_head_sliding_step: vertical offset step per head (< 0: per KV head).
        max_seq_len: an upper bound on seq_lens (default: the block table's capacity); it
            only sizes the split-KV schedule.
        kv_cache_dtype: the cache's dtype string; fp8 caches (or uint8 storage) are read as
            x8 * k_scale / v_scale. alibi_slopes: [num_heads] float32, adds slope * (j - p).
        tp_rank: this rank's index; heads are offset by tp_rank * num_heads.
        workspace: `decode_workspace`'s scratch, reused by every step (CUDA graphs).
    Returns `out` [num_seqs, num_heads, head_size] in query's dtype.
    """
    check_tensor("query", query, 3, _FLOAT)
    device = query.device
    check_tensor("key_cache", key_cache, 5, None, device)
    check_tensor("value_cache", value_cache, 4, None, device)
    check_tensor("block_tables", block_tables, 2, INDEX_DTYPES, device)
    check_tensor("seq_lens", seq_lens, 1, INDEX_DTYPES, device)
    key_cache, value_cache = _cache_views(key_cache, value_cache, kv_cache_dtype, query.dtype)
    num_seqs, num_heads, head_size = query.shape
    num_blocks, cache_kv_heads, _, page, x = key_cache.shape
    if num_kv_heads is not None and num_kv_heads != cache_kv_heads:
        raise ValueError(f"num_kv_heads={num_kv_heads} but key_cache has {cache_kv_heads} "
                         f"KV heads (shape {tuple(key_cache.shape)})")
    if num_heads % cache_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads="
                         f"{cache_kv_heads}")
    if x != 16 // key_cache.element_size() or key_cache.shape[2] * x != head_size:
        raise ValueError(f"key_cache has shape {tuple(key_cache.shape)}; expected "
                         f"[num_blocks, num_kv_heads, {head_size} // x, block_size, x] with "
                         f"x = 16 // itemsize = {16 // key_cache.element_size()}")
    expected_v = (num_blocks, cache_kv_heads, head_size, page)
    if tuple(value_cache.shape) != expected_v:
        raise ValueError(f"value_cache has shape {tuple(value_cache.shape)}; expected "
                         f"{expected_v} (num_blocks, num_kv_heads, head_size, block_size)")
    check_dim("block_tables", block_tables, 0, num_seqs, "num_seqs of query")
    check_dim("seq_lens", seq_lens, 0, num_seqs, "num_seqs of query")
    check_pattern(blocksparse_block_size, blocksparse_local_blocks, blocksparse_vert_stride,
                  "blocksparse_")
    if blocksparse_block_size % page:
        raise ValueError(f"blocksparse_block_size={blocksparse_block_size} must be a multiple "
                         f"of the cache block size {page}")
    if not isinstance(blocksparse_head_sliding_step, int):
        raise TypeError(f"blocksparse_head_sliding_step={blocksparse_head_sliding_step!r} "
                        "must be an int")
    check_int("tp_rank", tp_rank)
    check_shape("alibi_slopes", alibi_slopes, (num_heads,), None, device)
    capacity = block_tables.shape[1] * page
    if max_seq_len is not None and not check_int("max_seq_len", max_seq_len) <= capacity:
        raise ValueError(f"max_seq_len={max_seq_len} must be in [0, {capacity}] (block_tables "
                         f"has {block_tables.shape[1]} blocks of {page})")
    out = torch.empty_like(query) if out is None else out
    check_shape("out", out, tuple(query.shape), (query.dtype,), device)
    fp8 = key_cache.element_size() == 1
    provider(device).paged_decode(
        query, key_cache, value_cache, out, block_tables=block_tables, seq_lens=seq_lens,
        scale=check_float("scale", scale), head_base=tp_rank * num_heads,
        head_sliding_step=blocksparse_head_sliding_step, block_size=blocksparse_block_size,
        local_blocks=blocksparse_local_blocks, vert_stride=blocksparse_vert_stride,
        alibi_slopes=None if alibi_slopes is None else alibi_slopes.float(),
        k_scale=_scale(k_scale, device) if fp8 else None,
        v_scale=_scale(v_scale, device) if fp8 else None,
        max_seq_len=capacity if max_seq_len is None else int(max_seq_len), workspace=workspace)
    return out


def _cache_views(key_cache: torch.Tensor, value_cache: torch.Tensor, kv_cache_dtype: str,
                 model_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 caches may come as uint8 storage; a non-fp8 cache must hold the model's dtypes."""
    want = kv_cache_torch_dtype(kv_cache_dtype, model_dtype)  # validates the string
    if is_fp8_kv_cache(kv_cache_dtype) and key_cache.dtype == torch.uint8:
        key_cache, value_cache = key_cache.view(want), value_cache.view(want)
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.dtype != want and not (kv_cache_dtype == "auto" and cache.dtype in _FLOAT):
            raise TypeError(f"{name} has dtype {cache.dtype} but kv_cache_dtype="
                            f"{kv_cache_dtype!r} needs {want}")
    return key_cache, value_cache


def _scale(scale: Scale, device: torch.device) -> torch.Tensor:
    if isinstance(scale, torch.Tensor):
        return scale.to(device=device, dtype=torch.float32).reshape(())
    return torch.tensor(1.0 if scale is None else float(scale), dtype=torch.float32,
                        device=device)
