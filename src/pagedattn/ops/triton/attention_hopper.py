"""The attention family's Hopper prefill pass: tensor-descriptor (TMA) tiles and wgmma.

A program owns one (query block of BLOCK_M tokens of one sequence, query head): Q comes in by
one tensor-descriptor box, keys and values by boxes of BLOCK_N rows, and both products are
warpgroup MMAs. A prompt's keys fall in two phases:
- the cached context [0, context): page by page from the paged cache (one page lookup per
  key row, as the portable passes do), or from dense varlen keys by descriptor;
- the new tokens [context, seq_len): by descriptor from the layer's own `key`/`value` (dense
  rows: the causal square of a prompt over itself never reads back the pages it just wrote).
Each phase walks its key range in three loops: masked boundary tiles (window start), lean
unmasked tiles, masked boundary tiles (the causal diagonal, the sequence end). Phase B's tiles
start at `context`, so the diagonal is the same square for every chunk of a prompt.

Programs take the heaviest causal block of each sequence first. Results go straight to `out`
(no split-KV: the plan uses the portable pass when too few programs would fill the GPU).
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagedattn.ops.triton.attention import _key_ranges, _loop_range, _mask, _online_softmax, _scores
from pagedattn.ops.triton.reduce import find_seq


@triton.jit
def _attend_rows(acc, l_i, m_i, q, desc_k, desc_v, row_base, col_k, col_v, lo, hi, bound,
                 q_pos, slope, qk_scale, softcap, window_left, window_right,
                 IS_CAUSAL: tl.constexpr, USE_ALIBI: tl.constexpr, USE_SOFTCAP: tl.constexpr,
                 BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, MASK: tl.constexpr):
    """Keys [lo, hi) of dense rows (key j at row row_base + j) read by descriptor boxes;
    MASK: mask every tile (keys >= bound are invisible) or none."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        k = desc_k.load([row_base + start_n, col_k])  # [N, D]
        k_pos = start_n + offs_n
        s = _scores(q, k.T, k_pos, q_pos, slope, qk_scale, softcap, USE_SOFTCAP, USE_ALIBI,
                    DOT_PRECISION)  # [M, N]
        if MASK:
            s = _mask(s, k_pos, q_pos, bound, window_left, window_right, IS_CAUSAL)
        p, alpha, l_i, m_i = _online_softmax(s, m_i, l_i)
        v = desc_v.load([row_base + start_n, col_v])  # [N, Dv]
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def _attend_pages(acc, l_i, m_i, q, K, V, bt_row, lo, hi, bound, q_pos, slope, qk_scale,
                  softcap, window_left, window_right, stride_kb, stride_ks, stride_vb, stride_vs,
                  IS_CAUSAL: tl.constexpr, USE_ALIBI: tl.constexpr, USE_SOFTCAP: tl.constexpr,
                  PAGE: tl.constexpr, HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr,
                  BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, MASK: tl.constexpr):
    """Keys [lo, hi) of the paged cache, gathered as [N, D] rows (one page lookup per row);
    keys past `bound` re-read the last key (no load predicate) and are masked."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_D)
    offs_dv = tl.arange(0, HEAD_DV)
    for start_n in range(lo, hi, BLOCK_N):
        k_pos = start_n + offs_n
        k_idx = k_pos
        if MASK:
            k_idx = tl.minimum(k_pos, bound - 1)
        page = tl.load(bt_row + k_idx // PAGE).to(tl.int64)
        k = tl.load(K + (page * stride_kb + (k_idx % PAGE) * stride_ks)[:, None]
                    + offs_d[None, :])  # [N, D]
        s = _scores(q, k.T, k_pos, q_pos, slope, qk_scale, softcap, USE_SOFTCAP, USE_ALIBI,
                    DOT_PRECISION)
        if MASK:
            s = _mask(s, k_pos, q_pos, bound, window_left, window_right, IS_CAUSAL)
        p, alpha, l_i, m_i = _online_softmax(s, m_i, l_i)
        v = tl.load(V + (page * stride_vb + (k_idx % PAGE) * stride_vs)[:, None]
                    + offs_dv[None, :])  # [N, Dv]
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def _tile_ranges(lo, hi, full_lo, full_hi, origin, BLOCK_N: tl.constexpr):
    """Split keys [lo, hi) into tiles of BLOCK_N on a grid anchored at `origin` (<= lo): the
    first tile's start, and [unmasked_lo, unmasked_hi), the tiles that lie inside the keys
    every row sees, [full_lo, full_hi)."""
    tile_lo = origin + (lo - origin) // BLOCK_N * BLOCK_N
    f_lo = tl.maximum(full_lo, lo)
    f_hi = tl.minimum(full_hi, hi)
    unmasked_lo = tl.minimum(tl.maximum(origin + tl.cdiv(f_lo - origin, BLOCK_N) * BLOCK_N,
                                        tile_lo), hi)
    unmasked_hi = tl.maximum(tl.minimum(origin + (f_hi - origin) // BLOCK_N * BLOCK_N, hi),
                             unmasked_lo)
    return tile_lo, unmasked_lo, unmasked_hi


@triton.jit
def _prefill_kernel(
    desc_q, desc_k, desc_v, Out, Lse, K, V,
    cu_seqlens_q, seqused_k, cu_seqlens_k, block_table, alibi_slopes, sinks,
    softmax_scale, softcap, window_left, window_right, num_seqs, total_q, decode_max_q,
    stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt,
    GROUP: tl.constexpr, HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr,
    USE_ALIBI: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_SINKS: tl.constexpr,
    PAGED_CONTEXT: tl.constexpr, WRITE_LSE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    LONGEST_FIRST: tl.constexpr, PACK_GQA: tl.constexpr,
):
    """desc_q: [total_q, H * D] boxes [BLOCK_M, D], or with PACK_GQA [total_q, H, D] boxes
    [BLOCK_M / GROUP, GROUP, D] (rows: tokens x the query heads of one KV head, which then
    share every K/V tile); desc_k / desc_v: dense key rows, [rows, H_kv * D] boxes
    [BLOCK_N, D]: the new tokens (row of token i = its query row) with PAGED_CONTEXT, else
    every key of a dense varlen batch (rows from cu_seqlens_k)."""
    LOG2E: tl.constexpr = 1.4426950408889634
    ROWS_PER_TOKEN: tl.constexpr = GROUP if PACK_GQA else 1
    BLOCK_Q: tl.constexpr = BLOCK_M // ROWS_PER_TOKEN  # query tokens per program
    offs_m = tl.arange(0, BLOCK_M)
    if PACK_GQA:
        kv_head = tl.program_id(0)
        head = kv_head * GROUP + offs_m % GROUP  # [M]
    else:
        head = tl.program_id(0) + offs_m * 0  # [M]
        kv_head = tl.program_id(0) // GROUP
    seq = find_seq(cu_seqlens_q, tl.program_id(1), num_seqs, BLOCK_Q, True)
    q_start = tl.load(cu_seqlens_q + seq)
    q_len = tl.load(cu_seqlens_q + seq + 1) - q_start
    if q_len <= decode_max_q:  # the decode pass's request
        return
    q_block = tl.program_id(1) - (q_start // BLOCK_Q + seq)
    if LONGEST_FIRST:  # causal blocks grow with q_block: start the heavy ones first
        q_block = tl.cdiv(q_len, BLOCK_Q) - 1 - q_block
    if (q_block < 0) | (q_block * BLOCK_Q >= q_len):
        return
    seq_len = tl.load(seqused_k + seq)
    context = seq_len - q_len  # query i sits at position context + i

    q_tok = q_block * BLOCK_Q + offs_m // ROWS_PER_TOKEN
    row_ok = q_tok < q_len
    q_pos = context + q_tok
    if PACK_GQA:
        q = desc_q.load([q_start + q_block * BLOCK_Q, kv_head * GROUP, 0])
        q = tl.reshape(q, [BLOCK_M, HEAD_D])
    else:
        q = desc_q.load([q_start + q_block * BLOCK_Q, tl.program_id(0) * HEAD_D])  # [M, D]
    qk_scale = softmax_scale  # the launcher folded log2(e) (or 1/softcap) in already
    slope = tl.zeros([BLOCK_M], dtype=tl.float32)
    if USE_ALIBI:
        slope = tl.load(alibi_slopes + head) * LOG2E
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if USE_SINKS:  # the sink joins the denominator with weight e^sink
        m_i = tl.load(sinks + head) * LOG2E
        l_i += 1.0
    acc = tl.zeros([BLOCK_M, HEAD_DV], dtype=tl.float32)

    key_lo, key_hi, full_lo, full_hi = _key_ranges(
        context + q_block * BLOCK_Q, context + tl.minimum((q_block + 1) * BLOCK_Q, q_len) - 1,
        seq_len, window_left, window_right, IS_CAUSAL)

    col_k = kv_head * HEAD_D
    col_v = kv_head * HEAD_DV
    # Phase A: the cached context [0, context).
    a_hi = tl.minimum(context, key_hi)
    if key_lo < a_hi:
        t_lo, u_lo, u_hi = _tile_ranges(key_lo, a_hi, full_lo, full_hi, 0, BLOCK_N)
        if PAGED_CONTEXT:
            Kh = K + kv_head * stride_kh
            Vh = V + kv_head * stride_vh
            bt_row = block_table + seq.to(tl.int64) * stride_bt
            for r in tl.static_range(3):
                r_lo, r_hi = _loop_range(r, t_lo, u_lo, u_hi, a_hi)
                acc, l_i, m_i = _attend_pages(
                    acc, l_i, m_i, q, Kh, Vh, bt_row, r_lo, r_hi, context, q_pos, slope,
                    qk_scale, softcap, window_left, window_right, stride_kb, stride_ks,
                    stride_vb, stride_vs, IS_CAUSAL, USE_ALIBI, USE_SOFTCAP, PAGE, HEAD_D,
                    HEAD_DV, BLOCK_N, DOT_PRECISION, r != 1)
        else:
            k_row0 = tl.load(cu_seqlens_k + seq)
            for r in tl.static_range(3):
                r_lo, r_hi = _loop_range(r, t_lo, u_lo, u_hi, a_hi)
                acc, l_i, m_i = _attend_rows(
                    acc, l_i, m_i, q, desc_k, desc_v, k_row0, col_k, col_v, r_lo, r_hi,
                    context, q_pos, slope, qk_scale, softcap, window_left, window_right,
                    IS_CAUSAL, USE_ALIBI, USE_SOFTCAP, BLOCK_N, DOT_PRECISION, r != 1)
    # Phase B: the new tokens [context, seq_len), tiles anchored at `context`.
    b_lo = tl.maximum(key_lo, context)
    if b_lo < key_hi:
        if PAGED_CONTEXT:
            row_base = q_start - context  # position p (>= context) is at row q_start + p - context
        else:
            row_base = tl.load(cu_seqlens_k + seq)
        t_lo, u_lo, u_hi = _tile_ranges(b_lo, key_hi, full_lo, full_hi, context, BLOCK_N)
        for r in tl.static_range(3):
            r_lo, r_hi = _loop_range(r, t_lo, u_lo, u_hi, key_hi)
            acc, l_i, m_i = _attend_rows(
                acc, l_i, m_i, q, desc_k, desc_v, row_base, col_k, col_v, r_lo, r_hi, seq_len,
                q_pos, slope, qk_scale, softcap, window_left, window_right, IS_CAUSAL,
                USE_ALIBI, USE_SOFTCAP, BLOCK_N, DOT_PRECISION, r != 1)

    # Empty rows (l = 0) give 0 and LSE -inf, never NaN.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    token = (q_start + q_tok).to(tl.int64)
    offs_dv = tl.arange(0, HEAD_DV)
    tl.store(Out + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_dv[None, :],
             out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    if WRITE_LSE:
        lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
        tl.store(Lse + head.to(tl.int64) * total_q + token, lse, mask=row_ok)
