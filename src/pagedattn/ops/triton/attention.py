"""The portable attention passes (decode and prefill): one Triton kernel, any NVIDIA GPU.

A program owns one (query block of one sequence, KV head, KV split); its tile rows are
block_q query tokens x the GQA group padded to a power of 2, so every query head of a KV head
uses each K/V tile it loads. The decode pass (DECODE_PASS) has one program per request of at
most `decode_queries(GROUP)` queries (few rows, wide key steps); the prefill pass has query
blocks of the longer requests, heaviest causal block first (the grid is an upper bound,
total_q // block_q + batch, and a program finds its sequence by counting cu_seqlens_q
entries). Either pass may split the key range when its programs cannot fill the GPU
(SPLIT_KV: Out and Lse are then the float32 partial states `reduce.py` merges). Keys walk
`tile_loop.attend`; descales are per (sequence, KV head), folded into the score scale and
the epilogue; fp8 caches run fp16 dots. The host side is `attention_plan.py`.

`invariant_attention_kernel` is batch-invariant mode's pass: the prefill pass alone over
every request, its keys in fixed splits folded in order (`invariant.py`); its host side is
`invariant_plan.py`. Both kernels run one program body.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagedattn.ops.triton.invariant import attend_fixed_splits, fold_own_splits
from pagedattn.ops.triton.tile_loop import (
    attend,
    init_state,
    key_ranges,
    store_partials,
    store_rows,
    tile_ranges,
)
from pagedattn.ops.triton.tile_math import (
    LN2,
    LOG2E,
    decode_queries,
    find_seq,
    finish_rows,
    tile_width,
)


@triton.jit
def attention_kernel(
    Out, Lse,
    Q, K, V, alibi_slopes, sinks, q_descale, k_descale, v_descale,
    stride_qt, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_descale_head,
    cu_seqlens_q, seqused_k, cu_seqlens_k, block_table, stride_bt, num_seqs, total_q,
    softmax_scale, softcap, window_left,
    WINDOW_RIGHT: tl.constexpr, GROUP: tl.constexpr, PAGE: tl.constexpr,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DECODE_PASS: tl.constexpr, SPLIT_KV: tl.constexpr, ONE_KEY_LOOP: tl.constexpr,
    DOT_DTYPE: tl.constexpr, FP8_V_IN_REGS: tl.constexpr,
):
    """Out [total_q, H, HEAD_DV] (heads packed), Lse [H, total_q] or None; Q [total_q, H,
    HEAD_D] (heads packed); K, V: a paged cache [blocks, PAGE, H_kv, d] with block_table
    [num_seqs, >= blocks per sequence], or dense rows [keys, H_kv, d] from cu_seqlens_k;
    alibi_slopes / sinks [H] float32 or None; descales [num_seqs, H_kv] or None, contiguous
    (stride_descale_head 1) or one value (0). softcap and window_left are None when off.
    WINDOW_RIGHT: keys after its query a row sees, None (any) or n; 0 is causal attention.
    It is a constexpr (the old IS_CAUSAL: the mask and key ranges fold it in; sm_90
    registers 230 vs 255 and no spills in the Hopper pass), window_left a run-time value (one
    compile for every window size). Grid: (num_seqs (decode) or the query-block bound, H_kv,
    splits)."""
    _attention_program(
        Out, Lse, Q, K, V, alibi_slopes, sinks, q_descale, k_descale, v_descale, stride_qt,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_descale_head,
        cu_seqlens_q, seqused_k, cu_seqlens_k, block_table, stride_bt, num_seqs, total_q,
        softmax_scale, softcap, window_left, WINDOW_RIGHT=WINDOW_RIGHT, GROUP=GROUP, PAGE=PAGE,
        HEAD_D=HEAD_D, HEAD_DV=HEAD_DV, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        DECODE_PASS=DECODE_PASS, SPLIT_KV=SPLIT_KV, ONE_KEY_LOOP=ONE_KEY_LOOP,
        DOT_DTYPE=DOT_DTYPE, FP8_V_IN_REGS=FP8_V_IN_REGS, INVARIANT_SPLIT=None, MAX_Q_LEN=None)


@triton.jit
def invariant_attention_kernel(
    Out, Lse,
    Q, K, V, alibi_slopes, sinks, q_descale, k_descale, v_descale,
    stride_qt, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_descale_head,
    cu_seqlens_q, seqused_k, cu_seqlens_k, block_table, stride_bt, num_seqs, total_q,
    softmax_scale, softcap, window_left,
    WINDOW_RIGHT: tl.constexpr, GROUP: tl.constexpr, PAGE: tl.constexpr,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT_KV: tl.constexpr, ONE_KEY_LOOP: tl.constexpr, DOT_DTYPE: tl.constexpr,
    FP8_V_IN_REGS: tl.constexpr, SPLIT_KEYS: tl.constexpr, MAX_Q_LEN: tl.constexpr,
    SCALE_IN_EXP: tl.constexpr = False, MAX_SLACK: tl.constexpr = 0,
):
    """Batch-invariant mode's one pass: `attention_kernel`'s prefill pass over every request,
    its keys in splits of SPLIT_KEYS keys at absolute positions folded in order
    (`invariant.py`); with SPLIT_KV, program z computes split z alone (a partial state for
    `invariant.fold_splits_kernel`). MAX_Q_LEN: requests of more queries are left to the
    Gluon pass's invariant consumer (None: none). SCALE_IN_EXP: the score scale in the
    exponent's fma where neither soft cap nor ALiBi is given (`invariant.attend_fixed_splits`).
    MAX_SLACK: the running max's slack (`tile_math.invariant_max`). Arguments as
    `attention_kernel`'s."""
    _attention_program(
        Out, Lse, Q, K, V, alibi_slopes, sinks, q_descale, k_descale, v_descale, stride_qt,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_descale_head,
        cu_seqlens_q, seqused_k, cu_seqlens_k, block_table, stride_bt, num_seqs, total_q,
        softmax_scale, softcap, window_left, WINDOW_RIGHT=WINDOW_RIGHT, GROUP=GROUP, PAGE=PAGE,
        HEAD_D=HEAD_D, HEAD_DV=HEAD_DV, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        DECODE_PASS=False, SPLIT_KV=SPLIT_KV, ONE_KEY_LOOP=ONE_KEY_LOOP, DOT_DTYPE=DOT_DTYPE,
        FP8_V_IN_REGS=FP8_V_IN_REGS, INVARIANT_SPLIT=SPLIT_KEYS, MAX_Q_LEN=MAX_Q_LEN,
        SCALE_IN_EXP=SCALE_IN_EXP and softcap is None and alibi_slopes is None,
        MAX_SLACK=MAX_SLACK)


@triton.jit
def invariant_self_fold_kernel(
    Out, Lse,
    Q, K, V, alibi_slopes, sinks, q_descale, k_descale, v_descale,
    stride_qt, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_descale_head,
    cu_seqlens_q, seqused_k, cu_seqlens_k, block_table, stride_bt, num_seqs, total_q,
    softmax_scale, softcap, window_left,
    PartOut, PartLse, Tickets,
    WINDOW_RIGHT: tl.constexpr, GROUP: tl.constexpr, PAGE: tl.constexpr,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ONE_KEY_LOOP: tl.constexpr, DOT_DTYPE: tl.constexpr, FP8_V_IN_REGS: tl.constexpr,
    SPLIT_KEYS: tl.constexpr, SCALE_IN_EXP: tl.constexpr = False, MAX_SLACK: tl.constexpr = 0,
):
    """`invariant_attention_kernel`'s split programs (grid: query blocks, H_kv, splits) that
    fold their own splits (`SWITCHES.invariant_self_fold`): program z stores split z's
    partial state in PartOut [splits, total_q, H, Dv] / PartLse [splits, total_q, H]
    (float32, log2 units), then takes a ticket from Tickets [query blocks, H_kv] (int32,
    zero between launches); the last of a request's splits folds them all into Out / Lse
    as `invariant.fold_splits_kernel` would (`invariant.fold_own_splits`): the same bits
    without its launch."""
    _attention_program(
        Out, Lse, Q, K, V, alibi_slopes, sinks, q_descale, k_descale, v_descale, stride_qt,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_descale_head,
        cu_seqlens_q, seqused_k, cu_seqlens_k, block_table, stride_bt, num_seqs, total_q,
        softmax_scale, softcap, window_left, WINDOW_RIGHT=WINDOW_RIGHT, GROUP=GROUP, PAGE=PAGE,
        HEAD_D=HEAD_D, HEAD_DV=HEAD_DV, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        DECODE_PASS=False, SPLIT_KV=True, ONE_KEY_LOOP=ONE_KEY_LOOP, DOT_DTYPE=DOT_DTYPE,
        FP8_V_IN_REGS=FP8_V_IN_REGS, INVARIANT_SPLIT=SPLIT_KEYS, MAX_Q_LEN=None,
        SCALE_IN_EXP=SCALE_IN_EXP and softcap is None and alibi_slopes is None,
        MAX_SLACK=MAX_SLACK, PartOut=PartOut, PartLse=PartLse, Tickets=Tickets)


@triton.jit
def _attention_program(
    Out, Lse,
    Q, K, V, alibi_slopes, sinks, q_descale, k_descale, v_descale,
    stride_qt, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_descale_head,
    cu_seqlens_q, seqused_k, cu_seqlens_k, block_table, stride_bt, num_seqs, total_q,
    softmax_scale, softcap, window_left,
    WINDOW_RIGHT: tl.constexpr, GROUP: tl.constexpr, PAGE: tl.constexpr,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DECODE_PASS: tl.constexpr, SPLIT_KV: tl.constexpr, ONE_KEY_LOOP: tl.constexpr,
    DOT_DTYPE: tl.constexpr, FP8_V_IN_REGS: tl.constexpr, INVARIANT_SPLIT: tl.constexpr,
    MAX_Q_LEN: tl.constexpr, SCALE_IN_EXP: tl.constexpr = False, PartOut=None, PartLse=None,
    Tickets=None, MAX_SLACK: tl.constexpr = 0,
):
    """The kernels' program (INVARIANT_SPLIT None: `attention_kernel`'s; Tickets given:
    `invariant_self_fold_kernel`'s, its partials in PartOut / PartLse)."""
    GROUP_PAD: tl.constexpr = triton.next_power_of_2(GROUP)
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    if DECODE_PASS:
        seq = tl.program_id(0)
    else:
        seq = find_seq(cu_seqlens_q, tl.program_id(0), num_seqs, BLOCK_Q, True)
    q_start = tl.load(cu_seqlens_q + seq)
    q_len = tl.load(cu_seqlens_q + seq + 1) - q_start
    # Short requests belong to the decode pass, long ones to the prefill pass.
    if DECODE_PASS:
        q_block = 0
        if q_len > BLOCK_Q:
            return
    else:
        if INVARIANT_SPLIT is None:  # (batch-invariant mode: every request is the pass's)
            if q_len <= decode_queries(GROUP):
                return
        elif MAX_Q_LEN is not None:  # longer ones run the Gluon pass's invariant consumer
            if q_len > MAX_Q_LEN:
                return
        # Causal blocks grow with the block index: start the heaviest ones first.
        q_block = tl.cdiv(q_len, BLOCK_Q) - 1 - (tl.program_id(0) - (q_start // BLOCK_Q + seq))
    if (q_block < 0) | (q_block * BLOCK_Q >= q_len):
        return
    seq_len = tl.load(seqused_k + seq)
    context = seq_len - q_len  # query i sits at position context + i
    if INVARIANT_SPLIT is not None and SPLIT_KV:
        if split * INVARIANT_SPLIT >= seq_len:  # the fold reads only the sequence's splits
            return

    offs_m = tl.arange(0, BLOCK_M)
    q_tok = q_block * BLOCK_Q + offs_m // GROUP_PAD  # token index within the sequence
    head = kv_head * GROUP + offs_m % GROUP_PAD
    row_ok = (offs_m % GROUP_PAD < GROUP) & (q_tok < q_len)
    q_pos = context + q_tok
    token = (q_start + q_tok).to(tl.int64)
    offs_d = tl.arange(0, tile_width(HEAD_D))
    q = tl.load(Q + token[:, None] * stride_qt + head[:, None] * HEAD_D + offs_d[None, :],
                mask=row_ok[:, None] & (offs_d[None, :] < HEAD_D), other=0.0).to(DOT_DTYPE)

    qk_scale = softmax_scale  # the launcher folded log2(e) (or 1/softcap) in already
    v_scale = 1.0
    descale = (seq * tl.num_programs(1) + kv_head) * stride_descale_head
    if q_descale is not None:
        qk_scale *= tl.load(q_descale + descale)
    if k_descale is not None:
        qk_scale *= tl.load(k_descale + descale)
        v_scale = tl.load(v_descale + descale)
    slope = None
    if alibi_slopes is not None:
        slope = tl.load(alibi_slopes + head, mask=row_ok, other=0.0) * LOG2E
    # The default passes' code, in its order; batch-invariant mode replaces the key walk.
    if INVARIANT_SPLIT is None:
        acc, l_i, m_i = init_state(sinks, head, row_ok, split == 0, BLOCK_M, HEAD_DV)

    key_lo, key_hi, full_lo, full_hi = key_ranges(
        context + q_block * BLOCK_Q, context + tl.minimum((q_block + 1) * BLOCK_Q, q_len) - 1,
        seq_len, window_left, WINDOW_RIGHT)
    if INVARIANT_SPLIT is None:
        first_tile = key_lo // BLOCK_N * BLOCK_N
        tiles_per_split = tl.cdiv(tl.cdiv(tl.maximum(key_hi - first_tile, 0), BLOCK_N),
                                  num_splits)
        lo = first_tile + split * tiles_per_split * BLOCK_N
        hi = tl.minimum(key_hi, lo + tiles_per_split * BLOCK_N)
        tile_lo, unmasked_lo, unmasked_hi = tile_ranges(lo, hi, full_lo, full_hi, 0, BLOCK_N)
    K += kv_head * stride_kh
    V += kv_head * stride_vh
    if block_table is not None:
        keys = (K, V, block_table + seq.to(tl.int64) * stride_bt, stride_kb, stride_ks,
                stride_vb, stride_vs)
    else:
        keys = (K, V, tl.load(cu_seqlens_k + seq), stride_kb, stride_vb)
    if INVARIANT_SPLIT is None:
        acc, l_i, m_i = attend(
            acc, l_i, m_i, q, q_pos, qk_scale, softcap, slope, window_left, WINDOW_RIGHT, keys,
            tile_lo, unmasked_lo, unmasked_hi, hi, seq_len, ONE_KEY_LOOP=ONE_KEY_LOOP,
            PAGED_KEYS=block_table is not None, DESCRIPTOR_KEYS=False, KEY_ROWS=False,
            PAGE=PAGE, HEAD_D=HEAD_D, HEAD_DV=HEAD_DV, BLOCK_N=BLOCK_N,
            FP8_V_IN_REGS=FP8_V_IN_REGS)
        out, lse = finish_rows(acc, m_i, l_i, v_scale)
    else:
        out, lse = attend_fixed_splits(
            q, q_pos, qk_scale, softcap, slope, window_left, WINDOW_RIGHT, keys, sinks, head,
            row_ok, v_scale, key_lo, key_hi, full_lo, full_hi, seq_len, split,
            SPLIT_KEYS=INVARIANT_SPLIT, SPLIT_KV=SPLIT_KV, ONE_KEY_LOOP=ONE_KEY_LOOP,
            PAGED_KEYS=block_table is not None, PAGE=PAGE, HEAD_D=HEAD_D, HEAD_DV=HEAD_DV,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, FP8_V_IN_REGS=FP8_V_IN_REGS,
            SCALE_IN_EXP=SCALE_IN_EXP, MAX_SLACK=MAX_SLACK)
        if not SPLIT_KV:  # the fold's log2 units; a partial stays in them for the reduce
            lse = lse * LN2
            out = out + 0.0  # -0.0 -> 0.0 (`invariant.fold_splits_kernel` says why)

    num_heads = GROUP * tl.num_programs(1)
    if Tickets is not None:  # this split's partial, then the last split program folds
        store_partials(PartOut, PartLse, out, lse, token, head, row_ok, split, total_q,
                       num_heads, HEAD_DV)
        fold_own_splits(Out, Lse, PartOut, PartLse,
                        Tickets + tl.program_id(0) * tl.num_programs(1) + kv_head, token,
                        head, row_ok, seq_len, total_q, num_heads, SPLIT_KEYS=INVARIANT_SPLIT,
                        HEAD_DV=HEAD_DV, BLOCK_M=BLOCK_M)
    elif SPLIT_KV:
        store_partials(Out, Lse, out, lse, token, head, row_ok, split, total_q, num_heads,
                       HEAD_DV)
    else:
        store_rows(Out, Lse, out, lse, token, head, row_ok, total_q, num_heads, HEAD_DV)
