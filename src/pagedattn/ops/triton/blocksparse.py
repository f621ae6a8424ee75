"""Block-sparse attention (local + vertical stride): a varlen prefill kernel and a paged
decode kernel over the v0 cache layout.

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

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from pagedattn.ops.triton import launch
from pagedattn.ops.triton.reduce import find_seq, reduce_splits

LOG2E = 1.4426950408889634


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
def _softmax_step(acc, l_i, m_i, s, v, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet stays empty
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), acc * alpha[:, None],
                 input_precision=DOT_PRECISION)
    return acc, l_i, m_new


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
    return _softmax_step(acc, l_i, m_i, s, v, DOT_DTYPE, DOT_PRECISION)


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

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # a row that sees nothing gives 0
    tl.store(Out + token[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < HEAD_D))


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, *,
                     cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, sm_scale: float,
                     head_base: int, head_sliding_step: int, block_size: int,
                     local_blocks: int, vert_stride: int,
                     q_block_size: Optional[int] = None) -> None:
    """Same contract as `pagedattn.ops.torch.blocksparse.varlen_attention`."""
    total_q, num_heads, head_size = q.shape
    batch = cu_seqlens_q.shape[0] - 1
    if total_q == 0 or batch == 0:
        return
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    if out.stride(-1) != 1:
        raise ValueError(f"out needs unit stride on head_size; got strides {out.stride()}")
    block_m, block_n, warps, stages = _prefill_tiles(block_size, head_size, q_block_size,
                                                     total_q // batch)
    dot = launch.dot_dtype(q.dtype, k.dtype, out.dtype, q.device)
    grid = (total_q // block_m + batch, num_heads)
    _prefill_kernel[grid](
        q, k, v, out, cu_seqlens_q, cu_seqlens_k, batch, sm_scale * LOG2E, head_base,
        abs(head_sliding_step), q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), out.stride(0), out.stride(1), GROUP=num_heads // k.shape[1],
        PER_KV_HEAD=head_sliding_step < 0, SBS=block_size, LOCAL=local_blocks,
        VERT=max(1, vert_stride), HEAD_D=head_size,
        BLOCK_D=max(16, triton.next_power_of_2(head_size)), BLOCK_M=block_m, BLOCK_N=block_n,
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


@triton.jit
def _decode_kernel(
    Q, KC, VC, Out, PartOut, PartLse, block_tables, seq_lens, alibi_slopes, k_scale, v_scale,
    qk_scale, head_base, step_size, num_seqs,
    stride_qs, stride_qh, stride_kb, stride_kh, stride_kx, stride_vb, stride_vh, stride_bt,
    stride_os, stride_oh, GROUP: tl.constexpr, PER_KV_HEAD: tl.constexpr,
    NUM_RESIDUES: tl.constexpr, BLOCK_M: tl.constexpr, PAGE: tl.constexpr, X: tl.constexpr,
    SBS: tl.constexpr, LOCAL: tl.constexpr, VERT: tl.constexpr, HEAD_D: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_KV: tl.constexpr,
    USE_ALIBI: tl.constexpr, KV_SCALE: tl.constexpr, DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One program per (sequence, KV head, split); its rows are the KV head's query heads, so
    each K/V tile is read once for the group. Heads whose offsets differ attend different
    vertical blocks: the program walks their union, NUM_RESIDUES block classes mod VERT
    (rows r < NUM_RESIDUES have distinct ones), and masks per row. Its tiles are one flat
    range: the vertical blocks' tiles, then the local window's, split evenly."""
    TILES_PER_BLOCK: tl.constexpr = (SBS + BLOCK_N - 1) // BLOCK_N
    WINDOW: tl.constexpr = LOCAL if LOCAL > 0 else 1
    ROW_MASK: tl.constexpr = (NUM_RESIDUES > 1) | (LOCAL == 0)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    head0 = kv_head * GROUP
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    head = head0 + offs_m
    row_ok = offs_m < GROUP
    d_ok = offs_d < HEAD_D
    seq_len = tl.load(seq_lens + seq)
    q_pos = tl.maximum(seq_len - 1, 0)
    q = tl.load(Q + seq.to(tl.int64) * stride_qs + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    scale = qk_scale
    if KV_SCALE:
        scale *= tl.load(k_scale)
    q = (q.to(tl.float32) * scale).to(DOT_DTYPE)
    slope = tl.zeros([BLOCK_M], dtype=tl.float32)
    if USE_ALIBI:
        slope = tl.load(alibi_slopes + head, mask=row_ok, other=0.0) * 1.4426950408889634
    row_offset, _ = _pattern(head_base, head, step_size, GROUP, PER_KV_HEAD, VERT)  # [M]
    offset0, _ = _pattern(head_base, head0, step_size, GROUP, PER_KV_HEAD, VERT)
    local_lo = tl.maximum(q_pos // SBS - WINDOW + 1, 0)
    if VERT == 1:  # dense: one range
        local_lo = 0
    num_vert = tl.cdiv(local_lo, VERT) * NUM_RESIDUES * TILES_PER_BLOCK
    num_tiles = tl.where(seq_len > 0, num_vert + tl.cdiv(seq_len - local_lo * SBS, BLOCK_N), 0)
    per_split = tl.cdiv(num_tiles, tl.num_programs(2))
    t_lo = split * per_split
    t_hi = tl.minimum(num_tiles, t_lo + per_split)

    KC += kv_head * stride_kh
    VC += kv_head * stride_vh
    bt_row = block_tables + seq.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for t in range(t_lo, t_hi):
        is_vert = t < num_vert
        block = t // TILES_PER_BLOCK  # (period, residue class) of a vertical tile
        residue = (VERT - (offset0 + (block % NUM_RESIDUES) * step_size) % VERT) % VERT
        block_start = ((block // NUM_RESIDUES) * VERT + residue) * SBS
        start = tl.where(is_vert, block_start + (t % TILES_PER_BLOCK) * BLOCK_N,
                         local_lo * SBS + (t - num_vert) * BLOCK_N)
        k_pos = start + offs_n
        # A vertical tile ends with its block (and the last period may pass the window).
        limit = tl.where(is_vert, tl.minimum(block_start + SBS, local_lo * SBS), seq_len)
        ok = tl.broadcast_to((k_pos < limit)[None, :], [BLOCK_M, BLOCK_N])
        if ROW_MASK:  # rows see a block by their own offset (the window: all, at LOCAL > 0)
            seen = ((k_pos[None, :] // SBS + row_offset[:, None]) % VERT) == 0
            if LOCAL > 0:
                seen = seen | (t >= num_vert)
            ok = ok & seen
        k_idx = tl.minimum(k_pos, seq_len - 1)
        page = tl.load(bt_row + k_idx // PAGE).to(tl.int64)
        slot = k_idx % PAGE
        # v0 layout: key (page, kv_head, d // X, slot, d % X); value (page, kv_head, d, slot).
        k = tl.load(KC + page[None, :] * stride_kb + (offs_d[:, None] // X) * stride_kx
                    + slot[None, :] * X + offs_d[:, None] % X,
                    mask=d_ok[:, None], other=0.0)
        s = tl.dot(q, k.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        if USE_ALIBI:
            s += slope[:, None] * (k_pos - q_pos).to(tl.float32)[None, :]
        s = tl.where(ok, s, float("-inf"))
        v = tl.load(VC + page[:, None] * stride_vb + offs_d[None, :] * PAGE + slot[:, None],
                    mask=d_ok[None, :], other=0.0)
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, s, v, DOT_DTYPE, DOT_PRECISION)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    if KV_SCALE:
        out *= tl.load(v_scale)
    mask = row_ok[:, None] & d_ok[None, :]
    if SPLIT_KV:
        num_heads = GROUP * tl.num_programs(1)
        part = (split * num_seqs + seq) * num_heads + head  # [split, seq, head] rows
        lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
        tl.store(PartOut + part[:, None] * HEAD_D + offs_d[None, :], out, mask=mask)
        tl.store(PartLse + part, lse, mask=row_ok)
    else:
        tl.store(Out + seq.to(tl.int64) * stride_os + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=mask)


def paged_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 out: torch.Tensor, *, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 scale: float, head_base: int, head_sliding_step: int, block_size: int,
                 local_blocks: int, vert_stride: int, alibi_slopes: Optional[torch.Tensor],
                 k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor],
                 max_seq_len: int, num_splits: int = 0,
                 tiles: Optional[tuple[int, int, int]] = None) -> None:
    """Same contract as `pagedattn.ops.torch.blocksparse.paged_decode`; `tiles` = (BLOCK_N,
    warps, stages) overrides the launch (benchmarks)."""
    num_seqs, num_heads, head_size = query.shape
    if num_seqs == 0:
        return
    num_kv_heads, page, x = key_cache.shape[1], key_cache.shape[3], key_cache.shape[4]
    group = num_heads // num_kv_heads
    vert = max(1, vert_stride)
    # Distinct vertical block classes among a group's heads (offsets step apart, mod vert).
    residues = 1 if head_sliding_step <= 0 else min(
        group, vert // math.gcd(head_sliding_step, vert))
    # Keys one program attends, at most: the local window plus its classes' blocks.
    keys = min(max_seq_len, (max(local_blocks, 1) + 1) * block_size
               + max_seq_len * residues // vert)
    splits = num_splits or launch.auto_splits(query.device, num_seqs, keys, num_kv_heads)
    dot = launch.dot_dtype(query.dtype, key_cache.dtype, out.dtype, query.device)
    if splits > 1:
        part_out = torch.empty((splits, num_seqs, num_heads, head_size), dtype=torch.float32,
                               device=query.device)
        part_lse = torch.empty((splits, num_seqs, num_heads), dtype=torch.float32,
                               device=query.device)
    else:
        part_out = part_lse = out
    query = query if query.stride(-1) == 1 else query.contiguous()
    # Within a block the v0 views are packed: key (d // x, slot, d % x), value (d, slot).
    if key_cache.stride()[2:] != (page * x, x, 1) or value_cache.stride()[2:] != (page, 1):
        raise ValueError("the v0 caches must be packed within a block (as split_kv_cache's "
                         f"views are); got strides {key_cache.stride()} and "
                         f"{value_cache.stride()}")
    kv_scale = key_cache.dtype.itemsize == 1
    placeholder = seq_lens
    block_n, warps, stages = tiles or (_key_tile(block_size), 4,
                                       1 if launch.interpreting() else 3)
    _decode_kernel[(num_seqs, num_kv_heads, splits)](
        query, key_cache, value_cache, out, part_out, part_lse, block_tables, seq_lens,
        alibi_slopes if alibi_slopes is not None else placeholder,
        k_scale if kv_scale else placeholder, v_scale if kv_scale else placeholder,
        scale * LOG2E, head_base, abs(head_sliding_step), num_seqs, query.stride(0),
        query.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), block_tables.stride(0), out.stride(0),
        out.stride(1),
        GROUP=group, PER_KV_HEAD=head_sliding_step < 0,
        NUM_RESIDUES=residues, BLOCK_M=max(16, triton.next_power_of_2(group)), PAGE=page,
        X=x, SBS=block_size, LOCAL=local_blocks, VERT=vert, HEAD_D=head_size,
        BLOCK_D=max(16, triton.next_power_of_2(head_size)),
        BLOCK_N=block_n, SPLIT_KV=splits > 1,
        USE_ALIBI=alibi_slopes is not None, KV_SCALE=kv_scale, DOT_DTYPE=dot,
        DOT_PRECISION="ieee" if dot == tl.float32 else "tf32", num_warps=warps,
        num_stages=stages)
    if splits > 1:
        cu = torch.arange(num_seqs + 1, dtype=torch.int32, device=query.device)
        reduce_splits(out, part_lse, part_out, part_lse, cu, num_seqs, 1, splits,
                      decode_pass=True, write_lse=False)
