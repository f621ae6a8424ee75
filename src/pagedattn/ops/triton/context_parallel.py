"""The DCP correction as one Triton kernel: one program per (token, head) reads every rank's
LSE, forms the full LSE, and writes this rank's partial output rescaled by
e^(lse_rank - lse_full), head-major so that the reduce-scatter over heads needs no copy."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedattn.ops.triton.tile_math import empty_as_neg_inf, merge_weights, pow2_at_least


@triton.jit
def _correct_kernel(
    Out, Lses, Corrected, Lse, rank, world, num_tokens,
    stride_ot, stride_oh, stride_lw, stride_lh, stride_ch, stride_ct,
    HEAD_DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_W: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    offs_w = tl.arange(0, BLOCK_W)
    lses = tl.load(Lses + offs_w * stride_lw + head * stride_lh + token, mask=offs_w < world,
                   other=float("-inf"))
    w, total, lse = merge_weights(empty_as_neg_inf(lses))
    factor = tl.sum(tl.where(offs_w == rank, w, 0.0), 0) / total  # 0 when this part is empty
    offs_d = tl.arange(0, BLOCK_DV)
    dv_ok = offs_d < HEAD_DV
    o = tl.load(Out + token * stride_ot + head * stride_oh + offs_d, mask=dv_ok, other=0.0)
    tl.store(Corrected + head * stride_ch + token * stride_ct + offs_d,
             o.to(tl.float32) * factor, mask=dv_ok)
    tl.store(Lse + head * num_tokens + token, lse)


def correct_attn_out(out: torch.Tensor, lses: torch.Tensor, rank: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `pagedattn.ops.torch.context_parallel.correct_attn_out`."""
    num_tokens, num_heads, head_size_v = out.shape
    world = lses.shape[0]
    corrected = out.new_empty((num_heads, num_tokens, head_size_v), dtype=torch.float32)
    lse = lses.new_empty((num_heads, num_tokens))
    if num_tokens == 0:
        return corrected, lse
    if out.stride(-1) != 1:
        out = out.contiguous()
    lses = lses if lses.stride(-1) == 1 else lses.contiguous()
    _correct_kernel[(num_tokens, num_heads)](
        out, lses, corrected, lse, rank, world, num_tokens,
        out.stride(0), out.stride(1), lses.stride(0), lses.stride(1),
        corrected.stride(0), corrected.stride(1),
        HEAD_DV=head_size_v, BLOCK_DV=pow2_at_least(head_size_v),
        BLOCK_W=max(2, pow2_at_least(world)), num_warps=1 if head_size_v <= 128 else 2)
    return corrected, lse
