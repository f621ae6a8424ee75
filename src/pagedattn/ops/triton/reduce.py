"""Split-KV reduce: merge the partial states that the attention kernel's split programs wrote.

Partial outputs are [splits, total_q, num_heads, head_size_v] float32 and their LSEs
[splits, total_q, num_heads] (natural log); a split that saw no key has LSE -inf. The result
is exact: out = sum_s e^(lse_s - m) out_s / sum_s e^(lse_s - m), against the largest LSE m.
Sinks need no term here: the kernel's split 0 already starts its softmax from the sink.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def find_seq(cu_seqlens_q, pid, num_seqs, BLOCK_Q: tl.constexpr, SLOT_PER_SEQ: tl.constexpr):
    """The last s with cu_seqlens_q[s] // BLOCK_Q (+ s with SLOT_PER_SEQ) <= pid, by counting:
    one vector load per 64 sequences, not a binary search's chain of dependent loads. With
    BLOCK_Q = 1 and no slot per sequence it is the sequence that holds token `pid`."""
    count = 0
    for base in range(0, num_seqs, 64):
        s = base + tl.arange(0, 64)
        first = tl.load(cu_seqlens_q + s, mask=s < num_seqs, other=0) // BLOCK_Q
        if SLOT_PER_SEQ:
            first += s
        count += tl.sum(((first <= pid) & (s < num_seqs)).to(tl.int32), 0)
    return count - 1


@triton.jit
def _reduce_splits_kernel(Out, Lse, PartOut, PartLse, cu_seqlens_q, num_seqs, total_q,
                          decode_max_q, stride_ot, stride_oh, NUM_HEADS: tl.constexpr,
                          HEAD_DV: tl.constexpr, BLOCK_DV: tl.constexpr,
                          NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
                          DECODE_PASS: tl.constexpr, WRITE_LSE: tl.constexpr):
    """Decode pass: one program per (sequence, head), its few tokens in a loop. Prefill pass:
    one program per (token, head), so a long query is merged in parallel. Tokens of the other
    pass were written directly (or by its own reduce) and are left alone."""
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
        if q_len <= decode_max_q:
            return
        lo = tl.program_id(0)
        hi = lo + 1
    splits = tl.arange(0, SPLITS_PAD)
    offs_dv = tl.arange(0, BLOCK_DV)
    for i in range(0, hi - lo):
        token = (lo + i).to(tl.int64)
        part = (splits * total_q + token) * NUM_HEADS + head
        lse = tl.load(PartLse + part, mask=splits < NUM_SPLITS, other=float("-inf"))
        m = tl.max(lse, 0)
        m = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp(lse - m)
        total = tl.sum(w, 0)
        mask = (splits[:, None] < NUM_SPLITS) & (offs_dv[None, :] < HEAD_DV)
        o = tl.load(PartOut + part[:, None] * HEAD_DV + offs_dv[None, :], mask=mask, other=0.0)
        total_safe = tl.where(total == 0.0, 1.0, total)
        o = tl.sum(o * w[:, None], 0) / total_safe
        tl.store(Out + token * stride_ot + head * stride_oh + offs_dv,
                 o.to(Out.dtype.element_ty), mask=offs_dv < HEAD_DV)
        if WRITE_LSE:
            tl.store(Lse + head * total_q + token,
                     tl.where(total == 0.0, float("-inf"), tl.log(total_safe) + m))


def reduce_splits(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor,
                  part_lse: torch.Tensor, cu_seqlens_q: torch.Tensor, batch: int,
                  decode_max_q: int, num_splits: int, decode_pass: bool,
                  write_lse: bool) -> None:
    """Merge one pass's `num_splits` partial states into out [total_q, num_heads, head_size_v]
    (and lse [num_heads, total_q] when write_lse); part_* may hold more splits (shared scratch)."""
    total_q, num_heads, head_size_v = out.shape
    _reduce_splits_kernel[(batch if decode_pass else total_q, num_heads)](
        out, lse, part_out, part_lse, cu_seqlens_q, batch, total_q, decode_max_q,
        out.stride(0), out.stride(1), NUM_HEADS=num_heads, HEAD_DV=head_size_v,
        BLOCK_DV=triton.next_power_of_2(head_size_v), NUM_SPLITS=num_splits,
        SPLITS_PAD=triton.next_power_of_2(num_splits), DECODE_PASS=decode_pass,
        WRITE_LSE=write_lse, num_warps=4)
