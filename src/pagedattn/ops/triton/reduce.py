"""Split-KV reduce: merge the partial states that the attention kernel's split programs wrote.

Partial outputs are [splits, total_q, num_heads, head_size_v] float32 and their LSEs
[splits, total_q, num_heads] (natural log); a split that saw no key has LSE -inf. The result
is exact: out = sum_s e^(lse_s - m) out_s / sum_s e^(lse_s - m), against the largest LSE m.
Sinks need no term here: the kernel's split 0 already starts its softmax from the sink.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from pagedattn.ops.triton.tile_math import find_seq, merge_weights


@triton.jit
def reduce_splits_kernel(Out, Lse, PartOut, PartLse, cu_seqlens_q, num_seqs, total_q,
                         decode_max_q, stride_ot, stride_oh, NUM_HEADS: tl.constexpr,
                         HEAD_DV: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         DECODE_PASS: tl.constexpr):
    """Decode pass: one program per (sequence, head), its few tokens in a loop. Prefill pass:
    one program per (token, head), so a long query is merged in parallel. Tokens of the other
    pass were written directly (or by its own reduce) and are left alone. Lse None: no LSE."""
    BLOCK_DV: tl.constexpr = triton.next_power_of_2(HEAD_DV)
    SPLITS_PAD: tl.constexpr = triton.next_power_of_2(NUM_SPLITS)
    head = tl.program_id(1)
    if DECODE_PASS:
        seq = tl.program_id(0)
    else:
        seq = find_seq(cu_seqlens_q, tl.program_id(0), num_seqs, 1, False)
    q_start = tl.load(cu_seqlens_q + seq)
    q_len = tl.load(cu_seqlens_q + seq + 1) - q_start
    lo = q_start
    hi = q_start + q_len
    if DECODE_PASS:
        if q_len > decode_max_q:
            return
    else:
        # Rows past the batch's last token (a graph's padding) have no partial state: a
        # program there would merge the scratch's stale values into the caller's padding.
        if q_len <= decode_max_q or tl.program_id(0) >= tl.load(cu_seqlens_q + num_seqs):
            return
        lo = tl.program_id(0)
        hi = lo + 1
    splits = tl.arange(0, SPLITS_PAD)
    offs_dv = tl.arange(0, BLOCK_DV)
    for i in range(0, hi - lo):
        token = (lo + i).to(tl.int64)
        part = (splits * total_q + token) * NUM_HEADS + head
        lse = tl.load(PartLse + part, mask=splits < NUM_SPLITS, other=float("-inf"))
        w, total, merged = merge_weights(lse)
        mask = (splits[:, None] < NUM_SPLITS) & (offs_dv[None, :] < HEAD_DV)
        o = tl.load(PartOut + part[:, None] * HEAD_DV + offs_dv[None, :], mask=mask, other=0.0)
        o = tl.sum(o * w[:, None], 0) / total
        tl.store(Out + token * stride_ot + head * stride_oh + offs_dv,
                 o.to(Out.dtype.element_ty), mask=offs_dv < HEAD_DV)
        if Lse is not None:
            tl.store(Lse + head * total_q + token, merged)


def reduce_splits(out: torch.Tensor, lse: Optional[torch.Tensor], part_out: torch.Tensor,
                  part_lse: torch.Tensor, cu_seqlens_q: torch.Tensor, batch: int,
                  decode_max_q: int, num_splits: int, decode_pass: bool) -> None:
    """Merge one pass's `num_splits` partial states into out [total_q, num_heads, head_size_v]
    (and lse [num_heads, total_q] unless it is None); part_* may hold more splits (shared
    scratch)."""
    total_q, num_heads, head_size_v = out.shape
    reduce_splits_kernel[(batch if decode_pass else total_q, num_heads)](
        out, lse, part_out, part_lse, cu_seqlens_q, batch, total_q, decode_max_q,
        out.stride(0), out.stride(1), NUM_HEADS=num_heads, HEAD_DV=head_size_v,
        NUM_SPLITS=num_splits, DECODE_PASS=decode_pass, num_warps=4)
