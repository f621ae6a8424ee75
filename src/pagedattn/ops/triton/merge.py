"""`merge_attn_states` as a Triton kernel: one program per (token, head).

out = (e^lse_p * out_p + e^lse_s * out_s) / (e^lse_p + e^lse_s), computed against the larger
LSE so nothing overflows. An LSE of +inf or -inf marks an empty part (flash-attn kernels report
empty rows either way); both parts empty gives 0 and LSE -inf.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from pagedattn.ops.triton.tile_math import empty_as_neg_inf, merged_lse, safe_max


@triton.jit
def _merge_kernel(
    Out, PrefixOut, PrefixLse, SuffixOut, SuffixLse, OutLse,
    stride_ot, stride_oh, stride_pt, stride_ph, stride_st, stride_sh,
    stride_plh, stride_plt, stride_slh, stride_slt, stride_olh, stride_olt,
    HEAD_D: tl.constexpr,
):
    """OutLse None: no merged LSE."""
    BLOCK_D: tl.constexpr = triton.next_power_of_2(HEAD_D)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    p_lse = empty_as_neg_inf(tl.load(PrefixLse + head * stride_plh + token * stride_plt))
    s_lse = empty_as_neg_inf(tl.load(SuffixLse + head * stride_slh + token * stride_slt))
    m = safe_max(tl.maximum(p_lse, s_lse))
    w_p = tl.exp(p_lse - m)
    w_s = tl.exp(s_lse - m)
    total = w_p + w_s
    total_safe = tl.where(total == 0.0, 1.0, total)
    inv = 1.0 / total_safe
    offs_d = tl.arange(0, BLOCK_D)
    mask = offs_d < HEAD_D
    o_p = tl.load(PrefixOut + token * stride_pt + head * stride_ph + offs_d, mask=mask)
    o_s = tl.load(SuffixOut + token * stride_st + head * stride_sh + offs_d, mask=mask)
    o = o_p.to(tl.float32) * (w_p * inv) + o_s.to(tl.float32) * (w_s * inv)
    tl.store(Out + token * stride_ot + head * stride_oh + offs_d,
             o.to(Out.dtype.element_ty), mask=mask)
    if OutLse is not None:
        tl.store(OutLse + head * stride_olh + token * stride_olt, merged_lse(total, m))


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def merge_attn_states(output: torch.Tensor, prefix_output: torch.Tensor,
                      prefix_lse: torch.Tensor, suffix_output: torch.Tensor,
                      suffix_lse: torch.Tensor, output_lse: Optional[torch.Tensor]) -> None:
    """Same contract as `pagedattn.ops.torch.merge_attn_states`."""
    num_tokens, num_heads, head_size = output.shape
    if num_tokens == 0:
        return
    if output.stride(-1) != 1:
        raise ValueError(f"output must have a unit-stride last dimension; got {output.stride()}")
    prefix_output, suffix_output = _unit_last(prefix_output), _unit_last(suffix_output)
    lse_strides = (0, 0) if output_lse is None else output_lse.stride()
    _merge_kernel[(num_tokens, num_heads)](
        output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse,
        output.stride(0), output.stride(1), prefix_output.stride(0), prefix_output.stride(1),
        suffix_output.stride(0), suffix_output.stride(1),
        prefix_lse.stride(0), prefix_lse.stride(1), suffix_lse.stride(0), suffix_lse.stride(1),
        lse_strides[0], lse_strides[1], HEAD_D=head_size,
        num_warps=1 if head_size <= 128 else 2)
