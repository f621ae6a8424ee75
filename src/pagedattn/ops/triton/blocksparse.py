"""Block-sparse attention (local + vertical stride): the varlen prefill kernel here, the paged
decode kernel over the v0 cache layout in `blocksparse_decode.py` (re-exported).

The pattern (vLLM's): query position p sees key j iff j <= p and, with qb = p // SBS and
kb = j // SBS, qb - kb < LOCAL or (kb + offset) % VERT == 0; `offset` is per query head
(or per KV head). Both kernels visit only attended key blocks: the "vertical" blocks before
the local window sit at a fixed stride (kb0, kb0 + VERT, ...), and the local window is one
contiguous range, so time falls with density instead of masking a dense sweep. A prefill
program owns one query head (heads differ in their vertical blocks; GQA heads share K/V
through L2); a decode program owns a KV head's query heads and reads the union of their
blocks once. Scores are in log2 units (log2(e) folded into the scale).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from pagedattn.ops.triton import launch
from pagedattn.ops.triton.blocksparse_decode import (  # noqa: F401 (the provider API)
    decode_workspace,
    paged_decode,
)
from pagedattn.ops.triton.tile_math import (
    LOG2E,
    find_seq,
    finish_rows,
    pow2_at_least,
    softmax_step,
)


@triton.jit
def _pattern(head_base, head, step_size, GROUP: tl.constexpr, PER_KV_HEAD: tl.constexpr,
             VERT: tl.constexpr):
    """(offset, kb0): the head's vertical offset and its first vertical key block."""
    g = head_base + head
    if PER_KV_HEAD:  # homo_head_group: the heads of one KV group share their blocks
        g = g // GROUP
    offset = g * step_size + 1
    return offset, (VERT - offset % VERT) % VERT


@triton.jit
def _prefill_tile(acc, l_i, m_i, q, K, V, start, k_len, q_pos, offset, masked, block_end,
                  stride_kt, stride_vt, SBS: tl.constexpr, LOCAL: tl.constexpr,
                  VERT: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_N: tl.constexpr, LOCAL_TILE: tl.constexpr, DOT_DTYPE: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k_pos = start + offs_n
    k_idx = tl.minimum(k_pos, k_len - 1).to(tl.int64)  # clamped: no load predicate on keys
    d_ok = offs_d < HEAD_D
    k = tl.load(K + k_idx[None, :] * stride_kt + offs_d[:, None], mask=d_ok[:, None], other=0.0)
    s = tl.dot(q, k.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    if masked:
        if LOCAL_TILE:  # the exact pattern: causal, local window or vertical block
            kb = k_pos // SBS
            near = (q_pos[:, None] // SBS - kb[None, :]) < LOCAL
            strided = ((kb + offset) % VERT) == 0
            ok = (k_pos[None, :] <= q_pos[:, None]) & (near | strided[None, :])
        else:  # a vertical tile running past its sparse block
            ok = tl.broadcast_to((k_pos < block_end)[None, :], s.shape)
        s = tl.where(ok, s, float("-inf"))
    v = tl.load(V + k_idx[:, None] * stride_vt + offs_d[None, :], mask=d_ok[None, :], other=0.0)
    p, alpha, l_i, m_i = softmax_step(s, m_i, l_i)
    acc = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), acc * alpha[:, None],
                 input_precision=DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def _prefill_kernel(
    Q, K, V, Out, cu_seqlens_q, cu_seqlens_k, num_seqs, qk_scale, head_base, step_size,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    GROUP: tl.constexpr, PER_KV_HEAD: tl.constexpr, SBS: tl.constexpr, LOCAL: tl.constexpr,
    VERT: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    TILES_PER_BLOCK: tl.constexpr = (SBS + BLOCK_N - 1) // BLOCK_N
    WINDOW: tl.constexpr = LOCAL if LOCAL > 0 else 1  # blocks handled by the local loop
    head = tl.program_id(1)
    seq = find_seq(cu_seqlens_q, tl.program_id(0), num_seqs, BLOCK_M, True)
    q_start = tl.load(cu_seqlens_q + seq)
    q_len = tl.load(cu_seqlens_q + seq + 1) - q_start
    # Later query blocks attend more blocks: start them first.
    q_block = tl.cdiv(q_len, BLOCK_M) - 1 - (tl.program_id(0) - (q_start // BLOCK_M + seq))
    if (q_block < 0) | (q_block * BLOCK_M >= q_len):
        return
    k_start = tl.load(cu_seqlens_k + seq)
    k_len = tl.load(cu_seqlens_k + seq + 1) - k_start
    context = k_len - q_len  # query i sits at position context + i

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_tok = q_block * BLOCK_M + offs_m
    row_ok = q_tok < q_len
    q_pos = context + q_tok
    token = (q_start + q_tok).to(tl.int64)
    q = tl.load(Q + token[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & (offs_d[None, :] < HEAD_D), other=0.0)
    q = (q.to(tl.float32) * qk_scale).to(DOT_DTYPE)
    kv_head = head // GROUP
    K += k_start.to(tl.int64) * stride_kt + kv_head * stride_kh
    V += k_start.to(tl.int64) * stride_vt + kv_head * stride_vh
    offset, kb0 = _pattern(head_base, head, step_size, GROUP, PER_KV_HEAD, VERT)

    pos_lo = context + q_block * BLOCK_M
    pos_hi = context + tl.minimum((q_block + 1) * BLOCK_M, q_len) - 1
    local_lo = tl.maximum(pos_lo // SBS - WINDOW + 1, 0)  # first block of the local loop
    if VERT == 1:  # dense: one causal range
        local_lo = 0
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Vertical blocks before the local window: every row sees them whole.
    num_vert = tl.cdiv(tl.maximum(local_lo - kb0, 0), VERT) * TILES_PER_BLOCK
    for t in range(0, num_vert):
        block_start = (kb0 + (t // TILES_PER_BLOCK) * VERT) * SBS
        acc, l_i, m_i = _prefill_tile(
            acc, l_i, m_i, q, K, V, block_start + (t % TILES_PER_BLOCK) * BLOCK_N, k_len,
            q_pos, offset, SBS % BLOCK_N != 0, block_start + SBS, stride_kt, stride_vt, SBS,
            LOCAL, VERT, HEAD_D, BLOCK_D, BLOCK_N, False, DOT_DTYPE, DOT_PRECISION)
    # The local window (and, at LOCAL = 0, the diagonal block): masked only where some row
    # of the tile could miss a key (causal edge, rows of an earlier sparse block).
    full_lo = pos_hi + 1  # LOCAL = 0: every tile of the window needs the pattern
    if LOCAL > 0:  # keys from here on are in every row's window
        full_lo = (pos_hi // SBS - LOCAL + 1) * SBS
    if VERT == 1:
        full_lo = 0
    for start in range(local_lo * SBS, pos_hi + 1, BLOCK_N):
        masked = (start < full_lo) | (start + BLOCK_N > pos_lo + 1)
        acc, l_i, m_i = _prefill_tile(
            acc, l_i, m_i, q, K, V, start, k_len, q_pos, offset, masked, 0, stride_kt,
            stride_vt, SBS, LOCAL, VERT, HEAD_D, BLOCK_D, BLOCK_N, True, DOT_DTYPE,
            DOT_PRECISION)

    out, _ = finish_rows(acc, m_i, l_i, None)  # a row that sees nothing gives 0
    tl.store(Out + token[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < HEAD_D))


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, *,
                     cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, sm_scale: float,
                     head_base: int, head_sliding_step: int, block_size: int,
                     local_blocks: int, vert_stride: int,
                     q_block_size: Optional[int] = None, batch_invariant: bool = False) -> None:
    """Same contract as `pagedattn.ops.torch.blocksparse.varlen_attention`. batch_invariant:
    tiles from the layer alone (not the batch's mean query length), so that a row's program
    is the same in any batch (a prompt's query blocks start at its first token)."""
    total_q, num_heads, head_size = q.shape
    batch = cu_seqlens_q.shape[0] - 1
    if total_q == 0 or batch == 0:
        return
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    if out.stride(-1) != 1:
        raise ValueError(f"out needs unit stride on head_size; got strides {out.stride()}")
    block_m, block_n, warps, stages = _prefill_tiles(block_size, head_size, q_block_size,
                                                     0 if batch_invariant else total_q // batch)
    dot = launch.dot_dtype(q.dtype, k.dtype, out.dtype, q.device)
    grid = (total_q // block_m + batch, num_heads)
    _prefill_kernel[grid](
        q, k, v, out, cu_seqlens_q, cu_seqlens_k, batch, sm_scale * LOG2E.value, head_base,
        abs(head_sliding_step), q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), out.stride(0), out.stride(1), GROUP=num_heads // k.shape[1],
        PER_KV_HEAD=head_sliding_step < 0, SBS=block_size, LOCAL=local_blocks,
        VERT=max(1, vert_stride), HEAD_D=head_size,
        BLOCK_D=max(16, pow2_at_least(head_size)), BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_DTYPE=dot, DOT_PRECISION="ieee" if dot == tl.float32 else "tf32",
        num_warps=warps, num_stages=stages)


def _prefill_tiles(block_size: int, head_size: int, q_block_size: Optional[int],
                   mean_q_len: int):
    """(BLOCK_M, BLOCK_N, warps, stages). Key tiles divide the sparse block when they can (no
    mask on vertical tiles). Query tiles of one sparse block keep the local window tight;
    very long sequences run 128 rows, measured faster at 32k and slower at 8k
    (docs/PERFORMANCE.md)."""
    block_n = _key_tile(block_size)
    if launch.interpreting():
        return q_block_size or 16, 16, 4, 1
    wide = block_size % 128 == 0 or mean_q_len >= 24576
    block_m = q_block_size or (128 if wide and head_size <= 128 else 64)
    return block_m, block_n, 8 if block_m >= 128 else 4, 3 if head_size <= 128 else 2


def _key_tile(block_size: int) -> int:
    """Keys per step: the largest of 64/32/16 that divides the sparse block (so vertical
    tiles need no mask), 16 under the interpreter."""
    if launch.interpreting():
        return 16
    return next((n for n in (64, 32, 16) if block_size % n == 0), 16)
