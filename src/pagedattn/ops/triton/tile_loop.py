"""The key-tile loop of the attention passes (decode, portable prefill, Hopper prefill).

A program owns rows of queries (a block of tokens, times the query heads of a KV head or one
head) and a softmax state (acc, l, m; `tile_math`). `attend` walks keys [tile_lo, hi) in
tiles of BLOCK_N and folds each into the state. Where the keys come from is a switch:

- PAGED_KEYS: a paged cache, one block-table lookup per key row (a tile may span pages);
  else dense rows, key j of the sequence at row `row0 + j`.
- DESCRIPTOR_KEYS: dense rows read by tensor-descriptor boxes (TMA; the Hopper pass), else
  gathered through pointers.
- KEY_ROWS: gather K as [N, D] rows and transpose them (the Hopper pass: the layout of its
  descriptor boxes), else as [D, N] columns (the portable passes). The two forms compile to
  different copies on sm_90 (a 64-row portable prefill: 80 cp.async vs 56, 8 registers
  apart); each pass keeps the form it was measured with.

Only boundary tiles need the visibility mask (sequence end, causal diagonal, window edges):
with ONE_KEY_LOOP one loop masks a tile at run time when it leaves [unmasked_lo,
unmasked_hi) (one pipeline fill; short programs), else three loops run masked / unmasked
(half the instructions per tile) / masked tiles, each with its own fill (long programs; the
first only with a left window).
Keys of a masked tile past `bound` re-read the last key (no load predicate) and get p = 0.
Windows are None when off; causal attention is the right window 0 (the plan folds it in,
as flash-attn does).
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagedattn.ops.triton.tile_math import (
    LOG2E,
    dot_precision,
    exact_scaled_step,
    exact_softmax_step,
    softmax_step,
    tile_width,
)


@triton.jit
def key_ranges(min_pos, max_pos, seq_len, window_left, window_right):
    """For queries at positions [min_pos, max_pos]: the keys some of them may see,
    [key_lo, key_hi), and the keys all of them see, [full_lo, full_hi)."""
    key_lo = 0
    full_lo = 0
    if window_left is not None:
        key_lo = tl.maximum(min_pos - window_left, 0)
        full_lo = tl.maximum(max_pos - window_left, 0)
    key_hi = seq_len
    full_hi = seq_len
    if window_right is not None:
        key_hi = tl.maximum(tl.minimum(seq_len, max_pos + window_right + 1), 0)
        full_hi = tl.maximum(tl.minimum(seq_len, min_pos + window_right + 1), 0)
    return key_lo, key_hi, full_lo, full_hi


@triton.jit
def tile_ranges(lo, hi, full_lo, full_hi, origin, BLOCK_N: tl.constexpr):
    """Keys [lo, hi) in tiles of BLOCK_N on a grid anchored at `origin` (<= lo): the first
    tile's start, and [unmasked_lo, unmasked_hi), the tiles inside the keys every row sees,
    [full_lo, full_hi)."""
    tile_lo = origin + (lo - origin) // BLOCK_N * BLOCK_N
    f_lo = tl.maximum(full_lo, lo)
    f_hi = tl.minimum(full_hi, hi)
    unmasked_lo = tl.minimum(tl.maximum(origin + tl.cdiv(f_lo - origin, BLOCK_N) * BLOCK_N,
                                        tile_lo), hi)
    unmasked_hi = tl.maximum(tl.minimum(origin + (f_hi - origin) // BLOCK_N * BLOCK_N, hi),
                             unmasked_lo)
    return tile_lo, unmasked_lo, unmasked_hi


@triton.jit
def _mask(s, k_pos, q_pos, bound, window_left, window_right):
    rel = k_pos[None, :] - q_pos[:, None]  # key minus query position
    visible = tl.broadcast_to(k_pos[None, :] < bound, rel.shape)
    if window_left is not None:
        visible = visible & (rel >= -window_left)
    if window_right is not None:
        visible = visible & (rel <= window_right)
    return tl.where(visible, s, float("-inf"))


@triton.jit
def _elementwise_dot(a, b):
    """a [M, K] x b [K, N] as float32 products summed over K in an order that depends on K
    alone. The interpreter's tl.dot is numpy's matmul, whose BLAS rounds a row by its
    position in the tile; the batch-invariant tests under the interpreter use this (a GPU's
    MMA computes every row alike)."""
    return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], 1)


@triton.jit
def _scores(q, k_t, k_pos, q_pos, qk_scale, softcap, slope, ELEMENTWISE_DOTS: tl.constexpr):
    """q [M, D] x k_t [D, N] -> scores [M, N] in log2 units, soft-capped (softcap carries
    log2(e), qk_scale 1/softcap), with ALiBi (slope [M], log2 units); qk_scale None: the
    raw products (neither soft cap nor ALiBi then)."""
    if ELEMENTWISE_DOTS:
        s = _elementwise_dot(q, k_t)
    else:
        s = tl.dot(q, k_t, input_precision=dot_precision(q.dtype))
    if qk_scale is not None:
        s = s * qk_scale
    if softcap is not None:  # tanh(x) = 1 - 2 / (e^{2x} + 1)
        s = softcap * (1.0 - 2.0 / (tl.exp2(s * (2.0 * LOG2E)) + 1.0))
    if slope is not None:
        s += slope[:, None] * (k_pos[None, :] - q_pos[:, None]).to(tl.float32)
    return s


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
def _attend_tiles(acc, l_i, m_i, q, q_pos, qk_scale, softcap, slope, window_left,
                  window_right, keys, lo, hi, unmasked_lo, unmasked_hi, bound,
                  MASKED_TILES: tl.constexpr, EDGES_ONLY: tl.constexpr,
                  PAGED_KEYS: tl.constexpr, DESCRIPTOR_KEYS: tl.constexpr,
                  KEY_ROWS: tl.constexpr, PAGE: tl.constexpr, HEAD_D: tl.constexpr,
                  HEAD_DV: tl.constexpr, BLOCK_N: tl.constexpr, FP8_V_IN_REGS: tl.constexpr,
                  BATCH_INVARIANT: tl.constexpr, ELEMENTWISE_DOTS: tl.constexpr,
                  INVARIANT_SLACK: tl.constexpr = 0):
    """Keys [lo, hi) into the state. MASKED_TILES: the tiles get the mask (with EDGES_ONLY,
    only those outside [unmasked_lo, unmasked_hi), decided at run time). BATCH_INVARIANT: a
    fully masked tile leaves the state exactly as it was (`exact_softmax_step`); 2: the same
    with the score scale in the exponent (`exact_scaled_step`; no soft cap, no ALiBi).
    INVARIANT_SLACK: their running max's slack (`tile_math.invariant_max`)."""
    BLOCK_D: tl.constexpr = tile_width(HEAD_D)
    BLOCK_DV: tl.constexpr = tile_width(HEAD_DV)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for start_n in range(lo, hi, BLOCK_N):
        k_pos = start_n + offs_n
        if DESCRIPTOR_KEYS:
            desc_k, desc_v, row0, col_k, col_v = keys
            k_t = desc_k.load([row0 + start_n, col_k]).T  # [D, N]
        else:
            k_idx = k_pos
            if MASKED_TILES:
                k_idx = tl.minimum(k_pos, bound - 1)
            if PAGED_KEYS:
                K, V, bt_row, stride_kb, stride_ks, stride_vb, stride_vs = keys
                page = tl.load(bt_row + k_idx // PAGE).to(tl.int64)
                k_off = page * stride_kb + (k_idx % PAGE) * stride_ks
                v_off = page * stride_vb + (k_idx % PAGE) * stride_vs
            else:
                K, V, row0, stride_kb, stride_vb = keys
                k_off = (row0 + k_idx).to(tl.int64) * stride_kb
                v_off = (row0 + k_idx).to(tl.int64) * stride_vb
            if KEY_ROWS:
                k_t = _load_tile(K + k_off[:, None] + offs_d[None, :], offs_d[None, :] < HEAD_D,
                                 HEAD_D != BLOCK_D).T
            else:
                k_t = _load_tile(K + k_off[None, :] + offs_d[:, None], offs_d[:, None] < HEAD_D,
                                 HEAD_D != BLOCK_D)
        if BATCH_INVARIANT == 2:  # raw scores: the scale rides in the exponent
            s = _scores(q, k_t.to(q.dtype), k_pos, q_pos, None, softcap, slope,
                        ELEMENTWISE_DOTS)
        else:
            s = _scores(q, k_t.to(q.dtype), k_pos, q_pos, qk_scale, softcap, slope,
                        ELEMENTWISE_DOTS)
        if MASKED_TILES:
            if EDGES_ONLY:
                if (start_n < unmasked_lo) | (start_n + BLOCK_N > unmasked_hi):
                    s = _mask(s, k_pos, q_pos, bound, window_left, window_right)
            else:
                s = _mask(s, k_pos, q_pos, bound, window_left, window_right)
        if BATCH_INVARIANT == 2:
            p, alpha, l_i, m_i = exact_scaled_step(s, m_i, l_i, qk_scale, INVARIANT_SLACK)
        elif BATCH_INVARIANT:
            p, alpha, l_i, m_i = exact_softmax_step(s, m_i, l_i, INVARIANT_SLACK)
        else:
            p, alpha, l_i, m_i = softmax_step(s, m_i, l_i)
        if DESCRIPTOR_KEYS:
            v = desc_v.load([row0 + start_n, col_v])  # [N, Dv]
        else:
            v = _load_tile(V + v_off[:, None] + offs_dv[None, :], offs_dv[None, :] < HEAD_DV,
                           HEAD_DV != BLOCK_DV)
        if FP8_V_IN_REGS:
            v = _fp8_to_f16(v)
        acc = acc * alpha[:, None]
        if ELEMENTWISE_DOTS:
            acc = acc + _elementwise_dot(p.to(q.dtype), v.to(q.dtype))
        else:
            acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc,
                         input_precision=dot_precision(q.dtype))
    return acc, l_i, m_i


@triton.jit
def _loop_range(r: tl.constexpr, tile_lo, unmasked_lo, unmasked_hi, hi):
    if r == 0:
        return tile_lo, unmasked_lo
    elif r == 1:
        return unmasked_lo, unmasked_hi
    else:
        return unmasked_hi, hi


@triton.jit
def attend(acc, l_i, m_i, q, q_pos, qk_scale, softcap, slope, window_left, window_right, keys,
           tile_lo, unmasked_lo, unmasked_hi, hi, bound, ONE_KEY_LOOP: tl.constexpr,
           PAGED_KEYS: tl.constexpr, DESCRIPTOR_KEYS: tl.constexpr, KEY_ROWS: tl.constexpr,
           PAGE: tl.constexpr, HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr,
           BLOCK_N: tl.constexpr, FP8_V_IN_REGS: tl.constexpr,
           BATCH_INVARIANT: tl.constexpr = False, ELEMENTWISE_DOTS: tl.constexpr = False,
           INVARIANT_SLACK: tl.constexpr = 0):
    """Fold keys [tile_lo, hi) into the softmax state (acc [M, Dv], l_i, m_i [M]) of queries
    q [M, D] (the dot operand type) at positions q_pos [M]; keys >= bound are invisible.

    softcap and the ALiBi slope [M] may be None (off). keys: paged, (K, V at the program's
    KV head, the sequence's block-table row, stride_kb, stride_ks, stride_vb, stride_vs);
    dense by pointers, (K, V at the KV head, the sequence's first key row, the row strides
    of K and V); by descriptors, (desc_k, desc_v, that first row, the KV head's column in
    K, in V).

    Callers start their keys on the tile grid (tile_lo is the first key) unless a left
    window cuts them, so without one there are no masked tiles before the unmasked ones and
    that loop is not emitted. Emitted, LLVM proved it empty and deleted its body but kept
    its software pipeline's edges: predicated-off copies, and a wgmma wait holding the
    accumulator while it was still the zero constant. ptxas then serialised every wgmma of
    the Hopper pass (a WARPGROUP.DEPBAR per HGMMA) and at head 256 spilled the accumulator
    (docs/dev/KERNEL_NOTES.md v7)."""
    for r in tl.static_range(1 if ONE_KEY_LOOP else 3):
        if ONE_KEY_LOOP:
            r_lo, r_hi = tile_lo, hi
        else:
            r_lo, r_hi = _loop_range(r, tile_lo, unmasked_lo, unmasked_hi, hi)
        if ONE_KEY_LOOP or r != 0 or window_left is not None:
            acc, l_i, m_i = _attend_tiles(
                acc, l_i, m_i, q, q_pos, qk_scale, softcap, slope, window_left, window_right,
                keys, r_lo, r_hi, unmasked_lo, unmasked_hi, bound,
                MASKED_TILES=ONE_KEY_LOOP or r != 1, EDGES_ONLY=ONE_KEY_LOOP,
                PAGED_KEYS=PAGED_KEYS, DESCRIPTOR_KEYS=DESCRIPTOR_KEYS, KEY_ROWS=KEY_ROWS,
                PAGE=PAGE, HEAD_D=HEAD_D, HEAD_DV=HEAD_DV, BLOCK_N=BLOCK_N,
                FP8_V_IN_REGS=FP8_V_IN_REGS, BATCH_INVARIANT=BATCH_INVARIANT,
                ELEMENTWISE_DOTS=ELEMENTWISE_DOTS, INVARIANT_SLACK=INVARIANT_SLACK)
    return acc, l_i, m_i


@triton.jit
def init_state(sinks, head, row_ok, with_sink, BLOCK_M: tl.constexpr, HEAD_DV: tl.constexpr):
    """An empty softmax state for rows of query heads `head` [M]; with sinks (and with_sink:
    split 0 of a split pass, so the sink counts once) the sink logit joins the denominator."""
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if sinks is not None:
        if with_sink:
            if row_ok is None:
                m_i = tl.load(sinks + head) * LOG2E
            else:
                m_i = tl.load(sinks + head, mask=row_ok, other=0.0) * LOG2E
            l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, tile_width(HEAD_DV)], dtype=tl.float32)
    return acc, l_i, m_i


@triton.jit
def store_rows(Out, Lse, out, lse, token, head, row_ok, total_q, num_heads,
               HEAD_DV: tl.constexpr):
    """Rows (token, head) of Out [total_q, num_heads, HEAD_DV] (heads packed) and, unless
    Lse is None, of Lse [num_heads, total_q]."""
    offs_dv = tl.arange(0, tile_width(HEAD_DV))
    tl.store(Out + token[:, None] * (num_heads * HEAD_DV) + head[:, None] * HEAD_DV
             + offs_dv[None, :], out.to(Out.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DV))
    if Lse is not None:
        tl.store(Lse + head.to(tl.int64) * total_q + token, lse, mask=row_ok)


@triton.jit
def store_partials(PartOut, PartLse, out, lse, token, head, row_ok, split, total_q,
                   num_heads, HEAD_DV: tl.constexpr):
    """Split `split`'s rows of the float32 partial states, PartOut [splits, total_q,
    num_heads, HEAD_DV] and PartLse [splits, total_q, num_heads] (`reduce.py` merges them)."""
    offs_dv = tl.arange(0, tile_width(HEAD_DV))
    part = (split * total_q + token) * num_heads + head
    tl.store(PartOut + part[:, None] * HEAD_DV + offs_dv[None, :], out,
             mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DV))
    tl.store(PartLse + part, lse, mask=row_ok)
