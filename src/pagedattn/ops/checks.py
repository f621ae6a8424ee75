"""Argument checks shared by the public ops: cheap (shape and dtype only, no host sync)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

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
