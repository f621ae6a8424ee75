"""Paged / varlen attention: one Triton kernel family for decodes, prefills and mixed batches.

A program owns one (query block of one sequence, KV head, KV split); its tile rows are
block_q query tokens x the GQA group padded to a power of 2, so every query head of a KV head
uses each K/V tile it loads. A call makes up to two launches of the same kernel: the decode
pass (one program per short request, few rows, wide key steps) and the prefill pass (query
blocks of long requests, heaviest causal block first; the grid is an upper bound,
total_q // block_q + batch, and a program finds its sequence by counting cu_seqlens_q
entries). Either pass may split the key range when its programs cannot fill the GPU; its
partial states are merged by `reduce.py`. No launch reads a device tensor on the host.
Scores are in log2 units; descales are per (sequence, KV head), folded into the score scale
and the epilogue. Keys are walked in one pipelined loop that masks boundary tiles at run time,
or (long prefills) three loops: masked, lean unmasked, masked. fp8 caches run fp16 dots.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagedattn.ops.triton.reduce import find_seq

LOG2E = 1.4426950408889634


@triton.jit
def _load_tile(ptrs, dim_ok, MASK_DIM: tl.constexpr):
    # Key indices are clamped in range, so only a padded head dimension needs a predicate.
    if MASK_DIM:
        return tl.load(ptrs, mask=dim_ok, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _fp8_to_f16(x):
    """fp8 -> fp16 by the native cvt (sm_89+) as opaque asm: Triton moves a plain cast after
    the shared-memory load, where V, a transposed 8-bit operand, is read byte by byte."""
    if x.dtype == tl.float8e5:
        return tl.inline_asm_elementwise("cvt.rn.f16x2.e5m2x2 $0, $1;", "=r,h", [x],
                                         dtype=tl.float16, is_pure=False, pack=2)
    else:
        return tl.inline_asm_elementwise("cvt.rn.f16x2.e4m3x2 $0, $1;", "=r,h", [x],
                                         dtype=tl.float16, is_pure=False, pack=2)


@triton.jit
def _mask(s, k_pos, q_pos, seq_len, window_left, window_right, IS_CAUSAL: tl.constexpr):
    rel = k_pos[None, :] - q_pos[:, None]  # key minus query position
    visible = tl.broadcast_to(k_pos[None, :] < seq_len, rel.shape)
    if IS_CAUSAL:
        visible = visible & (rel <= 0)
    if window_left >= 0:
        visible = visible & (rel >= -window_left)
    if window_right >= 0:
        visible = visible & (rel <= window_right)
    return tl.where(visible, s, float("-inf"))


@triton.jit
def _key_ranges(min_pos, max_pos, seq_len, window_left, window_right, IS_CAUSAL: tl.constexpr):
    """For queries at positions [min_pos, max_pos]: the keys some of them may see,
    [key_lo, key_hi), and the keys all of them see, [full_lo, full_hi)."""
    right = window_right
    if IS_CAUSAL:
        right = tl.where(right >= 0, tl.minimum(right, 0), 0)
    key_lo = 0
    full_lo = 0
    if window_left >= 0:
        key_lo = tl.maximum(min_pos - window_left, 0)
        full_lo = tl.maximum(max_pos - window_left, 0)
    key_hi = seq_len
    full_hi = seq_len
    if right >= 0:
        key_hi = tl.maximum(tl.minimum(seq_len, max_pos + right + 1), 0)
        full_hi = tl.maximum(tl.minimum(seq_len, min_pos + right + 1), 0)
    return key_lo, key_hi, full_lo, full_hi


@triton.jit
def _loop_range(r: tl.constexpr, tile_lo, unmasked_lo, unmasked_hi, hi):
    """Key loop r of three: masked tiles before the unmasked ones, the tiles every row sees
    whole (no mask), masked tiles after them."""
    if r == 0:
        return tile_lo, unmasked_lo
    elif r == 1:
        return unmasked_lo, unmasked_hi
    else:
        return unmasked_hi, hi


@triton.jit
def _scores(q, k_t, k_pos, q_pos, slope, qk_scale, softcap, USE_SOFTCAP: tl.constexpr,
            USE_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """q [M, D] x k_t [D, N] -> scores [M, N] in log2 units, soft-capped, with ALiBi."""
    s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * qk_scale
    if USE_SOFTCAP:
        # softcap already carries log2(e); tanh(x) = 1 - 2 / (e^{2x} + 1)
        s = softcap * (1.0 - 2.0 / (tl.exp2(s * (2.0 * 1.4426950408889634)) + 1.0))
    if USE_ALIBI:
        s += slope[:, None] * (k_pos[None, :] - q_pos[:, None]).to(tl.float32)
    return s


@triton.jit
def _online_softmax(s, m_i, l_i):
    """Scores s [M, N] against the running max m_i and sum l_i: the probabilities p, the
    factor alpha that rescales the accumulator, and the new l_i and m_i."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no visible key keeps m = -inf; subtract 0 there, not -inf.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    return p, alpha, l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def _attend(acc, l_i, m_i, q, K, V, bt_row, kv_row0, lo, hi, unmasked_lo, unmasked_hi,
            seq_len, q_pos, slope, qk_scale, softcap, window_left, window_right,
            stride_kb, stride_ks, stride_vb, stride_vs,
            IS_CAUSAL: tl.constexpr, USE_ALIBI: tl.constexpr, USE_SOFTCAP: tl.constexpr,
            IS_PAGED: tl.constexpr, PAGE: tl.constexpr, HEAD_D: tl.constexpr,
            HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
            BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
            FP8_V_IN_REGS: tl.constexpr, MASK: tl.constexpr):
    """MASK: 0 never, 1 every tile, 2 decided per tile (boundary tiles only) at run time."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for start_n in range(lo, hi, BLOCK_N):
        k_pos = start_n + offs_n
        k_idx = k_pos
        if MASK != 0:  # keys past the end re-read the last key (no load predicate); p = 0
            k_idx = tl.minimum(k_pos, seq_len - 1)
        if IS_PAGED:  # rows of one tile may span several pages: look each row's page up
            page = tl.load(bt_row + k_idx // PAGE).to(tl.int64)
            k_off = page * stride_kb + (k_idx % PAGE) * stride_ks
            v_off = page * stride_vb + (k_idx % PAGE) * stride_vs
        else:
            k_off = (kv_row0 + k_idx).to(tl.int64) * stride_kb
            v_off = (kv_row0 + k_idx).to(tl.int64) * stride_vb
        k = _load_tile(K + k_off[None, :] + offs_d[:, None], offs_d[:, None] < HEAD_D,
                       HEAD_D != BLOCK_D)  # [D, N]
        s = _scores(q, k.to(DOT_DTYPE), k_pos, q_pos, slope, qk_scale, softcap, USE_SOFTCAP,
                    USE_ALIBI, DOT_PRECISION)
        if MASK == 1:
            s = _mask(s, k_pos, q_pos, seq_len, window_left, window_right, IS_CAUSAL)
        elif MASK == 2:
            if (start_n < unmasked_lo) | (start_n + BLOCK_N > unmasked_hi):
                s = _mask(s, k_pos, q_pos, seq_len, window_left, window_right, IS_CAUSAL)
        p, alpha, l_i, m_i = _online_softmax(s, m_i, l_i)
        v = _load_tile(V + v_off[:, None] + offs_dv[None, :], offs_dv[None, :] < HEAD_DV,
                       HEAD_DV != BLOCK_DV)  # [N, Dv]
        if FP8_V_IN_REGS:
            v = _fp8_to_f16(v)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def _attention_kernel(
    Q, K, V, Out, Lse, PartOut, PartLse,
    cu_seqlens_q, seqused_k, cu_seqlens_k, block_table,
    alibi_slopes, sinks, q_descale, k_descale, v_descale,
    softmax_scale, softcap, window_left, window_right, num_seqs, total_q, decode_max_q,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh, stride_bt, stride_qd_b, stride_qd_h, stride_kvd_b, stride_kvd_h,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    PAGE: tl.constexpr, HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DECODE_PASS: tl.constexpr, SPLIT_KV: tl.constexpr, IS_CAUSAL: tl.constexpr,
    USE_ALIBI: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_SINKS: tl.constexpr,
    IS_PAGED: tl.constexpr,
    Q_DESCALE: tl.constexpr, KV_DESCALE: tl.constexpr, WRITE_LSE: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, FP8_V_IN_REGS: tl.constexpr,
    LONGEST_FIRST: tl.constexpr, ONE_KEY_LOOP: tl.constexpr,
):
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD
    LOG2E: tl.constexpr = 1.4426950408889634
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    if DECODE_PASS:  # one program per sequence of at most decode_max_q (<= BLOCK_Q) queries
        seq = tl.program_id(0)
    else:
        seq = find_seq(cu_seqlens_q, tl.program_id(0), num_seqs, BLOCK_Q, True)
    q_start = tl.load(cu_seqlens_q + seq)
    q_len = tl.load(cu_seqlens_q + seq + 1) - q_start
    # Short requests belong to the decode pass, long ones to the prefill pass.
    if DECODE_PASS:
        q_block = 0
        if q_len > decode_max_q:
            return
    else:
        if q_len <= decode_max_q:
            return
        q_block = tl.program_id(0) - (q_start // BLOCK_Q + seq)  # slot within the sequence
        if LONGEST_FIRST:  # causal blocks grow with q_block: start the heavy ones first
            q_block = tl.cdiv(q_len, BLOCK_Q) - 1 - q_block
    if (q_block < 0) | (q_block * BLOCK_Q >= q_len):
        return
    seq_len = tl.load(seqused_k + seq)
    context = seq_len - q_len  # query i sits at position context + i

    offs_m = tl.arange(0, BLOCK_M)
    q_tok = q_block * BLOCK_Q + offs_m // GROUP_PAD  # token index within the sequence
    head = kv_head * GROUP + offs_m % GROUP_PAD
    row_ok = (offs_m % GROUP_PAD < GROUP) & (q_tok < q_len)
    q_pos = context + q_tok
    token = (q_start + q_tok).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(Q + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & (offs_d[None, :] < HEAD_D), other=0.0).to(DOT_DTYPE)

    qk_scale = softmax_scale  # the launcher folded log2(e) (or 1/softcap) in already
    v_scale = 1.0
    if Q_DESCALE:
        qk_scale *= tl.load(q_descale + seq * stride_qd_b + kv_head * stride_qd_h)
    if KV_DESCALE:
        qk_scale *= tl.load(k_descale + seq * stride_kvd_b + kv_head * stride_kvd_h)
        v_scale = tl.load(v_descale + seq * stride_kvd_b + kv_head * stride_kvd_h)
    slope = tl.zeros([BLOCK_M], dtype=tl.float32)
    if USE_ALIBI:
        slope = tl.load(alibi_slopes + head, mask=row_ok, other=0.0) * LOG2E

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if USE_SINKS:
        if split == 0:  # the sink joins the denominator once, in the first split
            m_i = tl.load(sinks + head, mask=row_ok, other=0.0) * LOG2E
            l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    key_lo, key_hi, full_lo, full_hi = _key_ranges(
        context + q_block * BLOCK_Q, context + tl.minimum((q_block + 1) * BLOCK_Q, q_len) - 1,
        seq_len, window_left, window_right, IS_CAUSAL)
    tile_lo = key_lo // BLOCK_N * BLOCK_N
    tiles_per_split = tl.cdiv(tl.cdiv(tl.maximum(key_hi - tile_lo, 0), BLOCK_N), num_splits)
    lo = tile_lo + split * tiles_per_split * BLOCK_N
    hi = tl.minimum(key_hi, lo + tiles_per_split * BLOCK_N)
    unmasked_lo = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_N) * BLOCK_N, lo), hi)
    unmasked_hi = tl.maximum(tl.minimum(full_hi // BLOCK_N * BLOCK_N, hi), unmasked_lo)

    K += kv_head * stride_kh
    V += kv_head * stride_vh
    bt_row = block_table + seq.to(tl.int64) * stride_bt
    kv_row0 = 0
    if not IS_PAGED:
        kv_row0 = tl.load(cu_seqlens_k + seq)
    # One loop: one pipeline fill per program (decodes, short prefills). Three: a lean unmasked
    # loop (half the instructions per tile) between masked ones, each with its own fill.
    for r in tl.static_range(1 if ONE_KEY_LOOP else 3):
        r_lo, r_hi = lo, hi
        if not ONE_KEY_LOOP:
            r_lo, r_hi = _loop_range(r, lo, unmasked_lo, unmasked_hi, hi)
        acc, l_i, m_i = _attend(
            acc, l_i, m_i, q, K, V, bt_row, kv_row0, r_lo, r_hi, unmasked_lo, unmasked_hi,
            seq_len, q_pos, slope, qk_scale, softcap, window_left, window_right, stride_kb,
            stride_ks, stride_vb, stride_vs, IS_CAUSAL, USE_ALIBI, USE_SOFTCAP, IS_PAGED, PAGE,
            HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, BLOCK_N, DOT_DTYPE, DOT_PRECISION,
            FP8_V_IN_REGS, 2 if ONE_KEY_LOOP else 1 - r % 2)

    # Empty rows (l = 0) give 0 and LSE -inf, never NaN.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc * (v_scale / l_safe)[:, None]
    lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv[None, :] < HEAD_DV
    if not SPLIT_KV:
        tl.store(Out + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_dv[None, :],
                 out.to(Out.dtype.element_ty), mask=row_ok[:, None] & dv_ok)
        if WRITE_LSE:
            tl.store(Lse + head.to(tl.int64) * total_q + token, lse, mask=row_ok)
    else:
        part = (split * total_q + token) * NUM_HEADS + head  # [split, token, head] row
        tl.store(PartOut + part[:, None] * HEAD_DV + offs_dv[None, :], out,
                 mask=row_ok[:, None] & dv_ok)
        tl.store(PartLse + part, lse, mask=row_ok)
