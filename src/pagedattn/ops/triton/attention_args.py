"""The attention kernels' runtime arguments by name: one structure per signature section.

`attention_kernel` (`attention.py`) and `hopper_prefill_kernel` (`attention_hopper.py`) take
their runtime arguments in two sections, then their constexprs: the layer's (filled per
call: its output, its tensors and their strides) and the batch's (filled once by the plan).
`reduce_splits_kernel` takes the layer's outputs, then its own batch section. Each
NamedTuple below has its section's parameter names in the kernel's order (a test checks
every kernel against them), so a launch is `layer_args + batch`, each built by name; a
split pass puts the plan's partial states (`Outputs`) in place of the layer's outputs. A
feature that is off passes None (a pointer, `softcap`, `window_left`): Triton compiles it out.
"""

from __future__ import annotations

import inspect
from typing import NamedTuple, Optional

import torch

from pagedattn.ops.triton.tile_math import LOG2E


class Outputs(NamedTuple):
    """The first two arguments of every kernel here."""
    # [total_q, num_heads, head_size_v], heads packed; with SPLIT_KV float32 partial outputs
    # [splits, total_q, num_heads, head_size_v]
    Out: torch.Tensor
    # [num_heads, total_q] float32, or None; with SPLIT_KV [splits, total_q, num_heads]
    Lse: Optional[torch.Tensor]


class LayerArgs(NamedTuple):
    """attention_kernel's per-call section: Outputs, then the layer's inputs."""
    Out: torch.Tensor
    Lse: Optional[torch.Tensor]
    Q: torch.Tensor  # [total_q, num_heads, head_size], heads packed
    K: torch.Tensor  # paged [blocks, page, num_kv_heads, head_size] or dense [keys, ...]
    V: torch.Tensor  # as K, head_size_v
    alibi_slopes: Optional[torch.Tensor]  # [num_heads] float32
    sinks: Optional[torch.Tensor]  # [num_heads] float32
    q_descale: Optional[torch.Tensor]  # [num_seqs, num_kv_heads] float32, all three alike:
    k_descale: Optional[torch.Tensor]  # contiguous, or one value broadcast
    v_descale: Optional[torch.Tensor]
    stride_qt: int
    stride_kb: int  # a block (paged) or a row (dense)
    stride_ks: int  # a slot within the block (0 for dense keys)
    stride_kh: int
    stride_vb: int
    stride_vs: int
    stride_vh: int
    stride_descale_head: int  # 1: contiguous descales, 0: one value


class HopperLayerArgs(NamedTuple):
    """hopper_prefill_kernel's per-call section (TensorDescriptors of the dense rows)."""
    Out: torch.Tensor
    Lse: Optional[torch.Tensor]
    desc_q: object  # [total_q, num_heads * head_size], or 3-D with packed GQA rows
    desc_k: object  # the new tokens' (or a dense batch's) keys [rows, num_kv_heads * head_size]
    desc_v: object
    K: Optional[torch.Tensor]  # the paged cache (context keys), None for dense batches
    V: Optional[torch.Tensor]
    alibi_slopes: Optional[torch.Tensor]
    sinks: Optional[torch.Tensor]
    stride_kb: int
    stride_ks: int
    stride_kh: int
    stride_vb: int
    stride_vs: int
    stride_vh: int


class Batch(NamedTuple):
    """The plan's section of both attention kernels."""
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    seqused_k: torch.Tensor  # [num_seqs] int32
    cu_seqlens_k: Optional[torch.Tensor]  # [num_seqs + 1] int32, dense keys only
    block_table: Optional[torch.Tensor]  # [num_seqs, max_blocks] int32, paged keys only
    stride_bt: int
    num_seqs: int
    total_q: int
    softmax_scale: float  # log2(e) folded in (or 1/softcap)
    softcap: Optional[float]  # times log2(e); None: no soft cap
    window_left: Optional[int]  # None: no window (the right window is a constexpr)


def batch_section(cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor,
                  cu_seqlens_k: Optional[torch.Tensor], block_table: Optional[torch.Tensor],
                  num_seqs: int, total_q: int, softmax_scale: float, softcap: float,
                  window_left: int) -> Batch:
    """The `Batch` section of a plan (dense keys when block_table is None): log2(e), or
    1/softcap where the scores are capped, folded into the score scale; softcap and
    window_left None when off."""
    paged = block_table is not None
    return Batch(
        cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k,
        cu_seqlens_k=None if paged else cu_seqlens_k, block_table=block_table,
        stride_bt=block_table.stride(0) if paged else 0, num_seqs=num_seqs, total_q=total_q,
        softmax_scale=softmax_scale * (1.0 / softcap if softcap > 0 else LOG2E.value),
        softcap=softcap * LOG2E.value if softcap > 0 else None,
        window_left=window_left if window_left >= 0 else None)


class ReduceBatch(NamedTuple):
    """reduce_splits_kernel's section after Outputs (the layer's out and LSE)."""
    PartOut: torch.Tensor
    PartLse: torch.Tensor
    cu_seqlens_q: torch.Tensor
    num_seqs: int
    total_q: int
    decode_max_q: int
    stride_ot: int
    stride_oh: int


class FoldBatch(NamedTuple):
    """invariant.fold_splits_kernel's section after Outputs (the layer's out and LSE)."""
    PartOut: torch.Tensor  # [splits, total_q, num_heads, head_size_v] float32
    PartLse: torch.Tensor  # [splits, total_q, num_heads] float32, log2 units
    cu_seqlens_q: torch.Tensor
    seqused_k: torch.Tensor
    num_seqs: int
    total_q: int
    stride_ot: int
    stride_oh: int


class SelfFold(NamedTuple):
    """attention.invariant_self_fold_kernel's section after `Batch`."""
    PartOut: torch.Tensor  # [splits, total_q, num_heads, head_size_v] float32
    PartLse: torch.Tensor  # [splits, total_q, num_heads] float32, log2 units
    Tickets: torch.Tensor  # [query blocks, num_kv_heads] int32, zero between launches


def runtime_parameters(kernel) -> tuple[str, ...]:
    """A Triton kernel's parameters before its constexprs (compiled or interpreted)."""
    params = inspect.signature(kernel.fn).parameters.values()
    return tuple(p.name for p in params if "constexpr" not in str(p.annotation))


def check_signature(kernel, *sections) -> None:
    """Raise if `kernel`'s runtime parameters are not the sections' fields, in order."""
    names = tuple(name for section in sections for name in section._fields)
    params = runtime_parameters(kernel)
    if params != names:
        raise TypeError(f"{kernel.fn.__name__} takes {params}; its argument structures give "
                        f"{names}")
