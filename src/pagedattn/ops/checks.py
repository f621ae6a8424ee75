"""Argument checks shared by the public ops: cheap (shape and dtype only, no host sync)."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, Optional

import torch

from pagedattn import envs
from pagedattn.ops.index_checks import check_attention_indices

INDEX_DTYPES = (torch.int32,)


def check_tensor(name: str, x: Optional[torch.Tensor], ndim: Optional[int] = None,
                 dtypes: Optional[tuple[torch.dtype, ...]] = None,
                 device: Optional[torch.device] = None) -> None:
    if x is None:
        return
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    if dtypes is not None and x.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {x.dtype}; allowed: {[str(d) for d in dtypes]}")
    if device is not None and x.device != device:
        raise ValueError(f"{name} is on {x.device} but the inputs are on {device}")


def require_tensor(name: str, x: Any, ndim: Optional[int] = None,
                   dtypes: Optional[tuple[torch.dtype, ...]] = None,
                   device: Optional[torch.device] = None) -> None:
    """`check_tensor` for an argument that must be given."""
    if x is None:
        raise TypeError(f"{name} must be a torch.Tensor, got None")
    check_tensor(name, x, ndim, dtypes, device)


def check_int(name: str, value: Any, low: int = 0) -> int:
    """An int-like argument (int, numpy integer) >= low, returned as an int."""
    try:
        result = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}={value!r} must be an int >= {low}") from None
    if result < low:
        raise ValueError(f"{name}={value!r} must be >= {low}")
    return result


def check_float(name: str, value: Any, low: Optional[float] = None) -> float:
    """A number (>= low when given; NaN never is), returned as a float."""
    try:
        result = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name}={value!r} must be a number") from None
    if low is not None and not result >= low:
        raise ValueError(f"{name}={value!r} must be >= {low}")
    return result


def check_varlen_scalars(max_seqlen_q: Any, max_seqlen_k: Any, softmax_scale: Any,
                         softcap: Any, num_splits: Any, head_size: int) -> tuple:
    """flash_attn_varlen_func's host numbers, as (max_seqlen_q, max_seqlen_k, scale, softcap,
    num_splits); the scale defaults to head_size ** -0.5, a softcap of None or 0 disables."""
    scale = head_size ** -0.5 if softmax_scale is None else check_float(
        "softmax_scale", softmax_scale)
    return (check_int("max_seqlen_q", max_seqlen_q), check_int("max_seqlen_k", max_seqlen_k),
            scale, check_float("softcap", softcap or 0.0, 0.0), check_int("num_splits",
                                                                          num_splits))


def check_dim(name: str, x: torch.Tensor, dim: int, expected: int, what: str) -> None:
    if x.shape[dim] != expected:
        raise ValueError(
            f"{name} has shape {tuple(x.shape)}; dimension {dim} must be {expected} ({what})")


def check_shape(name: str, x: Optional[torch.Tensor], shape: tuple[int, ...],
                dtypes: Optional[tuple[torch.dtype, ...]] = None,
                device: Optional[torch.device] = None) -> None:
    """An optional tensor that, when given, must have exactly `shape`."""
    check_tensor(name, x, len(shape), dtypes, device)
    if x is not None and tuple(x.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)}; expected {shape}")


def check_descales(descales: Sequence[Optional[torch.Tensor]], shape: tuple[int, int],
                   device: torch.device) -> None:
    """fp8 descales (q, k, v): flash-attn's [num_seqs, num_kv_heads], or one value ((1,) or
    0-d, as vLLM's Triton backend passes them), which broadcasts."""
    for name, d in zip(("q_descale", "k_descale", "v_descale"), descales):
        check_tensor(name, d, None, (torch.float32,), device)
        if d is not None and tuple(d.shape) not in (shape, (1,), ()):
            raise ValueError(f"{name} has shape {tuple(d.shape)}; expected {shape}, (1,) or "
                             "() (one value for every sequence and KV head)")


def check_flash_attn_only(q_v, dropout_p: float, return_attn_probs: bool) -> None:
    """flash-attn arguments pagedattn accepts only at their defaults."""
    if q_v is not None:
        raise ValueError("q_v (MLA-style split value queries) is not supported; pass q_v=None")
    if dropout_p != 0.0:
        raise ValueError(f"dropout_p={dropout_p}: attention dropout is not supported at inference")
    if return_attn_probs:
        raise ValueError("return_attn_probs=True is not supported; use return_softmax_lse=True")


def check_window(window_size: Optional[Sequence[int]]) -> tuple[int, int]:
    """flash-attn's (left, right) window; None or -1 on a side means unbounded."""
    if window_size is None:
        return -1, -1
    if len(window_size) != 2:
        raise ValueError(f"window_size={window_size!r} must be (left, right); -1 = unbounded")
    left, right = (int(w) for w in window_size)
    if left < -1 or right < -1:
        raise ValueError(f"window_size={window_size!r}: each side must be >= -1")
    return left, right


def check_keys(k: torch.Tensor, v: torch.Tensor, block_table: Optional[torch.Tensor],
               seqused_k: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
               batch: int, max_seqlen_k: int, queries: Optional[tuple] = None) -> torch.Tensor:
    """Paged (block_table + seqused_k) or dense (cu_seqlens_k) keys; returns keys per request.
    With PAGEDATTN_CHECK_INDICES=1 and `queries` = (q, cu_seqlens_q, max_seqlen_q), also the
    index values (a host sync: debugging only)."""
    if batch < 0:
        raise ValueError("cu_seqlens_q has shape (0,); it needs batch + 1 >= 1 entries")
    if k.dtype != v.dtype:
        raise TypeError(f"k has dtype {k.dtype} but v {v.dtype}; keys and values share a dtype")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ beyond head size")
    if block_table is not None:
        if k.dim() != 4 or v.dim() != 4:
            raise ValueError(
                "with block_table, k and v must be paged caches [num_blocks, block_size, "
                f"num_kv_heads, head_size]; got k {tuple(k.shape)}, v {tuple(v.shape)}")
        if seqused_k is None:
            raise ValueError("paged attention (block_table given) needs seqused_k")
        check_dim("block_table", block_table, 0, batch, "batch size from cu_seqlens_q")
        blocks_needed = -(-max_seqlen_k // k.shape[1])
        if block_table.shape[1] < blocks_needed:
            raise ValueError(
                f"block_table has {block_table.shape[1]} columns but max_seqlen_k="
                f"{max_seqlen_k} needs {blocks_needed} blocks of {k.shape[1]}")
    else:
        if k.dim() != 3 or v.dim() != 3:
            raise ValueError(
                "without block_table, k and v must be dense [total_k, num_kv_heads, head_size]; "
                f"got k {tuple(k.shape)}, v {tuple(v.shape)}")
        if cu_seqlens_k is None:
            raise ValueError("dense attention (no block_table) needs cu_seqlens_k")
        check_dim("cu_seqlens_k", cu_seqlens_k, 0, batch + 1, "batch size + 1")
        if seqused_k is None:
            seqused_k = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    check_dim("seqused_k", seqused_k, 0, batch, "batch size from cu_seqlens_q")
    if queries is not None and envs.PAGEDATTN_CHECK_INDICES:
        q, cu_seqlens_q, max_seqlen_q = queries
        check_attention_indices(q, k, cu_seqlens_q, seqused_k, cu_seqlens_k, block_table,
                                max_seqlen_q, max_seqlen_k)
    return seqused_k


def check_cascade_args(output: Any, query: Any, key_cache: Any, value_cache: Any,
                       cu_query_lens: Any, cu_prefix_query_lens: Any, prefix_kv_lens: Any,
                       suffix_kv_lens: Any, block_table: Any, common_prefix_len: Any,
                       max_kv_len: Any) -> tuple[int, int]:
    """cascade_attention's own arguments (the two passes check the rest, under their names);
    returns (common_prefix_len, prefix_blocks)."""
    require_tensor("query", query, 3)
    device = query.device
    require_tensor("output", output, 3, None, device)
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        require_tensor(name, cache, 4, None, device)
    require_tensor("cu_query_lens", cu_query_lens, 1, INDEX_DTYPES, device)
    num_reqs = cu_query_lens.shape[0] - 1
    for name, t, shape in (("cu_prefix_query_lens", cu_prefix_query_lens, (2,)),
                           ("prefix_kv_lens", prefix_kv_lens, (1,)),
                           ("suffix_kv_lens", suffix_kv_lens, (num_reqs,))):
        require_tensor(name, t)
        check_shape(name, t, shape, INDEX_DTYPES, device)
    require_tensor("block_table", block_table, 2, INDEX_DTYPES, device)
    check_dim("block_table", block_table, 0, num_reqs, "requests in cu_query_lens")
    block_size = key_cache.shape[1]
    prefix_len = check_int("common_prefix_len", common_prefix_len, 1)
    if prefix_len % block_size:
        raise ValueError(f"common_prefix_len={prefix_len} must be a positive multiple of "
                         f"block_size={block_size}")
    if block_table.shape[1] < prefix_len // block_size:
        raise ValueError(f"block_table has shape {tuple(block_table.shape)}; the prefix of "
                         f"{prefix_len} keys needs {prefix_len // block_size} columns")
    if check_int("max_kv_len", max_kv_len) < prefix_len:
        raise ValueError(f"max_kv_len={max_kv_len} is below common_prefix_len={prefix_len}; "
                         "it bounds whole sequences, the prefix included")
    return prefix_len, prefix_len // block_size
