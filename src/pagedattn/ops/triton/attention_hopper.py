"""The Hopper prefill pass: tensor-descriptor (TMA) tiles and wgmma, same tile loop.

A program owns one (query block of BLOCK_M tokens of one sequence, query head): Q comes in by
one tensor-descriptor box, keys and values by boxes of BLOCK_N rows, and both products are
warpgroup MMAs. A prompt's keys fall in two phases:
- the cached context [0, context): page by page from the paged cache (one page lookup per
  key row, as the portable passes do), or from dense varlen keys by descriptor;
- the new tokens [context, seq_len): by descriptor from the layer's own `key`/`value` (dense
  rows: the causal square of a prompt over itself never reads back the pages it just wrote).
Each phase walks its key range in three loops (`tile_loop.attend`): masked boundary tiles
(window start), lean unmasked tiles, masked boundary tiles (the causal diagonal, the sequence
end). Phase B's tiles start at `context`, so the diagonal is the same square for every chunk
of a prompt. With PACK_GQA a program's rows are tokens x the query heads of one KV head, which
then share every K/V tile.

Programs take the heaviest causal block of each sequence first. Results go straight to `out`
(no split-KV: the plan uses the portable pass when too few programs would fill the GPU).
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagedattn.ops.triton.tile_loop import attend, init_state, key_ranges, store_rows, tile_ranges
from pagedattn.ops.triton.tile_math import LOG2E, decode_queries, find_seq, finish_rows


@triton.jit
def hopper_prefill_kernel(
    Out, Lse,
    desc_q, desc_k, desc_v, K, V, alibi_slopes, sinks,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    cu_seqlens_q, seqused_k, cu_seqlens_k, block_table, stride_bt, num_seqs, total_q,
    softmax_scale, softcap, window_left,
    WINDOW_RIGHT: tl.constexpr, GROUP: tl.constexpr, PAGE: tl.constexpr,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PACK_GQA: tl.constexpr,
):
    """desc_q: [total_q, H * D] boxes [BLOCK_M, D], or with PACK_GQA [total_q, H, D] boxes
    [BLOCK_M / GROUP, GROUP, D]; desc_k / desc_v: dense key rows, [rows, H_kv * D] boxes
    [BLOCK_N, D]: the new tokens (row of token i = its query row) when the context is paged
    (block_table, K and V: the cache), else every key of a dense varlen batch (rows from
    cu_seqlens_k; K, V and block_table None). The rest as `attention_kernel`'s. Grid: (H, or
    H_kv with PACK_GQA; the query-block bound)."""
    ROWS_PER_TOKEN: tl.constexpr = GROUP if PACK_GQA else 1
    BLOCK_Q: tl.constexpr = BLOCK_M // ROWS_PER_TOKEN  # query tokens per program
    offs_m = tl.arange(0, BLOCK_M)
    if PACK_GQA:
        kv_head = tl.program_id(0)
        head = kv_head * GROUP + offs_m % GROUP  # [M]
        num_heads = tl.num_programs(0) * GROUP
    else:
        head = tl.program_id(0) + offs_m * 0  # [M]
        kv_head = tl.program_id(0) // GROUP
        num_heads = tl.num_programs(0)
    seq = find_seq(cu_seqlens_q, tl.program_id(1), num_seqs, BLOCK_Q, True)
    q_start = tl.load(cu_seqlens_q + seq)
    q_len = tl.load(cu_seqlens_q + seq + 1) - q_start
    if q_len <= decode_queries(GROUP):  # the decode pass's request
        return
    # Causal blocks grow with the block index: start the heaviest ones first.
    q_block = tl.cdiv(q_len, BLOCK_Q) - 1 - (tl.program_id(1) - (q_start // BLOCK_Q + seq))
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
    slope = None
    if alibi_slopes is not None:
        slope = tl.load(alibi_slopes + head) * LOG2E
    acc, l_i, m_i = init_state(sinks, head, None, True, BLOCK_M, HEAD_DV)

    key_lo, key_hi, full_lo, full_hi = key_ranges(
        context + q_block * BLOCK_Q, context + tl.minimum((q_block + 1) * BLOCK_Q, q_len) - 1,
        seq_len, window_left, WINDOW_RIGHT)
    col_k = kv_head * HEAD_D
    col_v = kv_head * HEAD_DV
    # Phase A: the cached context [0, context).
    a_hi = tl.minimum(context, key_hi)
    if key_lo < a_hi:
        t_lo, u_lo, u_hi = tile_ranges(key_lo, a_hi, full_lo, full_hi, 0, BLOCK_N)
        paged: tl.constexpr = block_table is not None  # the context from the cache's pages
        if paged:
            keys = (K + kv_head * stride_kh, V + kv_head * stride_vh,
                    block_table + seq.to(tl.int64) * stride_bt, stride_kb, stride_ks,
                    stride_vb, stride_vs)
        else:  # a dense batch: every key by descriptor
            keys = (desc_k, desc_v, tl.load(cu_seqlens_k + seq), col_k, col_v)
        acc, l_i, m_i = attend(
            acc, l_i, m_i, q, q_pos, softmax_scale, softcap, slope, window_left, WINDOW_RIGHT,
            keys, t_lo, u_lo, u_hi, a_hi, context, ONE_KEY_LOOP=False, PAGED_KEYS=paged,
            DESCRIPTOR_KEYS=not paged, KEY_ROWS=True, PAGE=PAGE, HEAD_D=HEAD_D,
            HEAD_DV=HEAD_DV, BLOCK_N=BLOCK_N, FP8_V_IN_REGS=False)
    # Phase B: the new tokens [context, seq_len), tiles anchored at `context`. Dense keys
    # may be fewer than the queries (context < 0): no key lies before position 0, and the
    # grid starts there, so no tile reads the rows before the sequence's first key.
    anchor = tl.maximum(context, 0)
    b_lo = tl.maximum(key_lo, anchor)
    if b_lo < key_hi:
        if block_table is not None:
            row_base = q_start - context  # position p (>= context) is at row q_start + p - context
        else:
            row_base = tl.load(cu_seqlens_k + seq)
        t_lo, u_lo, u_hi = tile_ranges(b_lo, key_hi, full_lo, full_hi, anchor, BLOCK_N)
        acc, l_i, m_i = attend(
            acc, l_i, m_i, q, q_pos, softmax_scale, softcap, slope, window_left, WINDOW_RIGHT,
            (desc_k, desc_v, row_base, col_k, col_v), t_lo, u_lo, u_hi, key_hi, seq_len,
            ONE_KEY_LOOP=False, PAGED_KEYS=False, DESCRIPTOR_KEYS=True, KEY_ROWS=True,
            PAGE=PAGE, HEAD_D=HEAD_D, HEAD_DV=HEAD_DV, BLOCK_N=BLOCK_N, FP8_V_IN_REGS=False)

    out, lse = finish_rows(acc, m_i, l_i, None)
    token = (q_start + q_tok).to(tl.int64)
    store_rows(Out, Lse, out, lse, token, head, row_ok, total_q, num_heads, HEAD_DV)
