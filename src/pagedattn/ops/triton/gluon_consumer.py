"""The consumer partition of the Gluon prefill kernel: warpgroups of 64 query rows each.

Consumer C of a program owns rows [C * 64, C * 64 + 64) of each work item's query block
(128 rows: two consumers; 192: three, head 64 only); all share every K/V tile of the
producer's rings (`gluon_producer.py`, or the fp8 converter's 16-bit ring,
`gluon_convert.py`). Each tile: issue S = Q K^T of this tile, rescale O, issue O += P V of
the previous tile (P from registers), then the online softmax of S while that P V runs
(FA3's intra-warpgroup overlap; with `Scores.MAX_SLACK` >= 0 a warp skips O's rescale
where none of its rows moved its max, `gluon_softmax.lazy_rescale`; with
`Scores.RESCALE_AFTER_PV` O is rescaled once that P V is waited for instead, FA3's fp8
order). The `turn` barriers order the consumers' issues in a ring (ping-pong with two:
consumer C waits on turn C and hands the next turn to C + 1), so one consumer's softmax
runs while the tensor cores work for another. A consumer's rows that see at most the first
half of the item's last tile take it at half width (`_half_tile`).

The online softmax is `gluon_softmax.py`'s; how Q, P and V enter the wgmmas (Q split in two
e4m3 terms over fp8 K, an fp8 P over V^T) is `gluon_operands.py`'s. The epilogue stores O
(16-byte stores through a 4 KB staging buffer where shared memory has room) and the LSE.
Imports nothing but Triton.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

try:
    from pagedattn.ops.triton.gluon_operands import (
        QOperand,
        p_as_a,
        p_dtype,
        p_operand,
        p_operand_layout,
        pv_wait,
        q_in_place,
        q_split,
        qk_issue,
        v_operand,
    )
    from pagedattn.ops.triton.gluon_softmax import (
        LOG2E,
        ItemRows,
        lazy_rescale,
        p_shift,
        parts_layout,
        row_sum,
        scores_layout,
        softmax_tile,
    )
except ImportError:  # compiled standalone, without torch (tools/gluon_sass.py)
    from gluon_operands import (
        QOperand,
        p_as_a,
        p_dtype,
        p_operand,
        p_operand_layout,
        pv_wait,
        q_in_place,
        q_split,
        qk_issue,
        v_operand,
    )
    from gluon_softmax import (
        LOG2E,
        ItemRows,
        lazy_rescale,
        p_shift,
        parts_layout,
        row_sum,
        scores_layout,
        softmax_tile,
    )

LN2 = gl.constexpr(0.6931471805599453)


@gluon.constexpr_function
def o_store_layout(rows, cols):
    """The layout O is stored from: the accumulator's rows (4 warps of 16 rows, a lane's rows r
    and r + 8) with each thread's 8 consecutive columns in registers instead of the
    accumulator's 2-column pairs, so every store moves 16 bytes. The change stays inside each
    warp; Triton's layout conversion stages it through 4 KB of shared memory (STS.128, then
    LDSM)."""
    col_reps = [[0, 32 << i] for i in range((cols // 32).bit_length() - 1)]
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0]] + col_reps,
        lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[rows, cols])


@gluon.jit
def consumer(C: gl.constexpr, q_bufs, k_ring, v_ring, turn, items, keys, scores, descales,
             output):
    """Consumer C of a program: rows [C * 64, C * 64 + 64) of each item's query block.
    q_bufs: the Q buffers (`gluon_args.Ring`: SLOTS items deep, buffer 2 slot + C this
    consumer's); K tiles come from k_ring (the 16-bit ring, or with an fp8 q the fp8 staging
    ring itself, Q K^T then an fp8 wgmma), V tiles from the 16-bit v_ring; turn: the two
    consumers' ping-pong barriers. items / keys: the walk (`gluon_schedule.Items`,
    `KeyTiles`); DYNAMIC: items as the producer publishes them. scores, descales, output:
    `gluon_args`' (with KV_DESCALE the (sequence, KV head)'s k descale joins the score
    scale, its v descale the epilogue: x8 * scale, folded, one multiply a row, not an
    element; with Q_DESCALE its q descale joins the score scale too; ROW_STORES: O leaves by
    16-byte stores through a 4 KB staging buffer, where shared memory has room for it)."""
    BLOCK_M: gl.constexpr = keys.BLOCK_M
    BLOCK_N: gl.constexpr = keys.BLOCK_N
    ROWS: gl.constexpr = q_bufs.smem.shape[1]
    PARTS: gl.constexpr = BLOCK_M // ROWS  # consumers: each waits for its turn from the one before
    LEAD: gl.constexpr = 1 if C == 0 else 0  # consumer 0's first turn needs no arrival
    NUM_QBUF: gl.constexpr = q_bufs.SLOTS
    q_smem = q_bufs.smem
    s_layout: gl.constexpr = scores_layout(BLOCK_N, k_ring.smem.dtype)
    # P's dtype: V's (q's, or fp16 over a converted fp8 V), or e4m3 over an fp8 V^T ring
    dtype: gl.constexpr = p_dtype(v_ring.smem.dtype)
    HEAD_DV: gl.constexpr = v_ring.smem.shape[1 if dtype.is_fp8() else 2]
    o_layout: gl.constexpr = scores_layout(HEAD_DV, dtype)
    p_layout: gl.constexpr = p_operand_layout(o_layout, dtype)
    P_SHIFT: gl.constexpr = p_shift(dtype, scores.MAX_SLACK)
    LAZY: gl.constexpr = scores.MAX_SLACK >= 0  # O rescaled only where a row's max moved
    # One P tile live with P words at head 256 too: with the next tile's words made before
    # the P V wait (two tiles of words live beside O's 128 registers and S's 32 at 240),
    # ptxas serialised every wgmma of the kernel (note C7513: a non-wgmma instruction
    # defines a wgmma's input registers inside its pipeline stage; `tools/gluon_sass.py`).
    # Wider tiles than 128 keys (head 128's 256: S alone 128 registers) keep one too.
    ONE_P: gl.constexpr = PARTS == 3 or (scores.P_WORDS and (HEAD_DV > 128 or BLOCK_N > 128))
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    # A 16-bit q over K tiles as the fp8 cache holds them: q in two e4m3 terms.
    SPLIT_Q: gl.constexpr = k_ring.smem.dtype.is_fp8() and not q_smem.dtype.is_fp8()
    offs_m = gl.arange(0, ROWS, layout=s_rows)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    offs_mo = gl.arange(0, ROWS, layout=o_rows)
    offs_d = gl.arange(0, HEAD_DV, layout=gl.SliceLayout(0, o_layout))
    st_layout: gl.constexpr = o_store_layout(ROWS, HEAD_DV)
    offs_ms = gl.arange(0, ROWS, layout=gl.SliceLayout(1, st_layout))
    offs_ds = gl.arange(0, HEAD_DV, layout=gl.SliceLayout(0, st_layout))
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    # Row-sum partials a row (`parts_layout`): 4 where the registers are tight, three
    # consumers' 160 and the wide tiles' S and O, 192 of 240 (`gluon_schedule.wide_config_for`)
    WIDE: gl.constexpr = (BLOCK_N + HEAD_DV) // 2 >= 192
    L_PARTS: gl.constexpr = 4 if PARTS == 3 or WIDE else 8
    # Head 128's 256-key tiles: S (128 registers) beside O (64) and the P words in flight
    # (32) left 16 for the rest; ptxas spilled the words and serialised every wgmma (C7512).
    # So a tile's P V runs (and is waited for) before its S is issued, and the softmax
    # overlaps no product of its own consumer: ping-pong alone keeps the tensor cores busy
    # (the other consumer's products run under this one's softmax).
    PV_FIRST: gl.constexpr = WIDE and BLOCK_N > 128
    # FA3's fp8 order (`Scores.RESCALE_AFTER_PV`, one P tile live): O is rescaled by tile j's
    # alpha once P_{j-1} V_{j-1} is waited for, so the turn holds S's and P V's issues alone
    # (head 256: O's 128 multiplies sat between them, the S wgmmas spread over ~140
    # instructions; KERNEL_NOTES v46). O then carries tile j's max when P_j V_j is issued,
    # as before; tile 0's alpha would only scale O's zeros.
    LATE: gl.constexpr = scores.RESCALE_AFTER_PV
    gl.static_assert(not LATE or (ONE_P and not PV_FIRST),
                     "O's rescale after the P V wait takes the one-P order of S, P V")
    tile = 0
    item = 0  # valid items (Q buffer turns)
    item_n = 0  # items taken, valid or not
    turns = 0
    # The next item's metadata is loaded one item ahead: its loads land while this item runs
    # instead of stalling the item's start (the loop carries the values).
    w_n = items.next(0)
    item_info = items.info(w_n)
    while w_n < items.num_items:
        if PARTS == 3:
            item_info = items.info(w_n)
        valid, seq, head, q_start, q_len, q_block, seq_len = item_info
        item_n += 1
        w_n = items.next(item_n)
        if PARTS == 2:
            item_info = items.info(w_n)
        if valid:
            context = seq_len - q_len
            qk = scores.qk_scale
            v_scale = 1.0
            ds = seq.to(gl.int64) * descales.stride_b + (head // items.GROUP) * descales.stride_h
            if descales.KV_DESCALE:
                qk = qk * gl.load(descales.k + ds)
                v_scale = gl.load(descales.v + ds)
            if descales.Q_DESCALE:
                qk = qk * gl.load(descales.q + ds)
            a_end, t_a, n_a, t_b, n_b = keys.of_block(q_block, q_len, seq_len)
            n = n_a + n_b
            row0 = q_block * BLOCK_M + C * ROWS  # this consumer's first query of the request
            rows_lo, rows_hi, full_lo, full_hi = keys.ranges(
                context + row0, context + gl.minimum(row0 + ROWS, q_len) - 1, seq_len)
            if scores.LANE_MASKS:  # the rows' positions where a mask uses them (`ItemRows`)
                q_pos = context + row0
            else:
                q_pos = context + row0 + offs_m
            slope = gl.zeros([ROWS], gl.float32, layout=s_rows)
            if scores.USE_ALIBI:
                slope = gl.load(scores.alibi_slopes + head + offs_m * 0) * LOG2E
            m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=s_rows)
            l_parts = gl.zeros([ROWS, L_PARTS], gl.float32, layout=parts_layout(L_PARTS))
            if scores.USE_SINKS:  # the sink joins the denominator with weight e^sink
                m_i = gl.load(scores.sinks + head + offs_m * 0) * LOG2E
                l_parts = l_parts + (1.0 / L_PARTS) * (1 << P_SHIFT)
            acc = gl.zeros([ROWS, HEAD_DV], gl.float32, layout=o_layout)
            qb = (item % NUM_QBUF) * PARTS + C
            q_s = q_smem.index(qb)
            mbarrier.wait(q_bufs.ready.index(qb), (item // NUM_QBUF) & 1)
            q_lo = q_s
            if SPLIT_Q:
                # Buffer qb's two halves: buffers 2 qb and 2 qb + 1 of the allocation viewed
                # as e4m3 (the consumers' buffers never overlap).
                q8 = q_smem._reinterpret(
                    gl.float8e4nv, [q_smem.shape[0] * 2, ROWS, q_smem.shape[2]],
                    gl.NVMMASharedLayout.get_default_for([ROWS, q_smem.shape[2]],
                                                         gl.float8e4nv))
                q_hi = q8.index(2 * qb)
                q_lo = q8.index(2 * qb + 1)
                qk = qk * q_split(q_s, q_hi, q_lo)
                q_s = q_hi
            elif q_smem.dtype != k_ring.smem.dtype and not q_smem.dtype.is_fp8():
                # a bf16 q over fp16 products (an fp8 q takes fp8 K of either kind as it is)
                q_s = q_in_place(q_s, k_ring.smem.dtype, ROWS, q_smem.shape[2])
            q = QOperand(q_s, q_lo, SPLIT_Q)
            rows = ItemRows(q_pos, slope, full_lo, full_hi, qk, P_SHIFT, scores.LANE_MASKS)
            # The last tile runs at half width where this consumer's rows see at most its
            # first half of keys (the causal diagonal's upper rows, a ragged end): S and
            # P V of the other half would only be masked away. 128-key tiles only: a
            # 32-key half of head 256's tiles measured slower than the full tile.
            n_pipe = n
            if (BLOCK_N >= 128) & (n > 0):
                start, bound, in_a = keys.at(n - 1, a_end, t_a, n_a, t_b, seq_len)
                if gl.minimum(rows_hi, bound) - start <= BLOCK_N // 2:
                    n_pipe = n - 1
            if n_pipe > 0:
                # Tile 0: S only; its P V is issued beside the next tile's S.
                ks = tile % k_ring.SLOTS
                k_s = k_ring.smem.index(ks)
                mbarrier.wait(k_ring.ready.index(ks), (tile // k_ring.SLOTS) & 1)
                mbarrier.wait(turn.index(C), (turns & 1) ^ LEAD)
                s0 = qk_issue(q, k_s, s_zero)
                mbarrier.arrive(turn.index((C + 1) % PARTS))
                turns += 1
                s0 = warpgroup_mma_wait(0, deps=[s0, q.hi, q.lo, k_s])[0]
                mbarrier.arrive(k_ring.empty.index(ks))
                start, bound, in_a = keys.at(0, a_end, t_a, n_a, t_b, seq_len)
                p, alpha, l_parts, m_i = softmax_tile(s0, m_i, l_parts, start, bound, offs_n,
                                                       rows, scores, keys)
                p16 = p_operand(p, dtype, p_layout, scores.P_WORDS)
                for j in range(1, n_pipe):
                    t = tile + j
                    ks = t % k_ring.SLOTS
                    prev = (t - 1) % v_ring.SLOTS
                    k_s = k_ring.smem.index(ks)
                    v_s = v_operand(v_ring.smem.index(prev), BLOCK_N)
                    if PV_FIRST:
                        # P V done before S is issued: the P words die before S's 128
                        # accumulator registers are written (both in flight spilled them)
                        if LAZY:
                            acc = lazy_rescale(acc, alpha)
                        else:
                            acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
                        mbarrier.wait(turn.index(C), (turns & 1) ^ LEAD)
                        mbarrier.wait(v_ring.ready.index(prev), ((t - 1) // v_ring.SLOTS) & 1)
                        acc = warpgroup_mma(p_as_a(p16, p_layout), v_s, acc, is_async=True)
                        acc = pv_wait(acc, v_s, p16)
                        mbarrier.arrive(v_ring.empty.index(prev))
                        mbarrier.wait(k_ring.ready.index(ks), (t // k_ring.SLOTS) & 1)
                        s = qk_issue(q, k_s, s_zero)
                        mbarrier.arrive(turn.index((C + 1) % PARTS))
                        turns += 1
                        s = warpgroup_mma_wait(0, deps=[s, q.hi, q.lo, k_s])[0]
                    else:
                        mbarrier.wait(k_ring.ready.index(ks), (t // k_ring.SLOTS) & 1)
                        mbarrier.wait(turn.index(C), (turns & 1) ^ LEAD)
                        s = qk_issue(q, k_s, s_zero)
                        if not LATE:
                            if LAZY:
                                acc = lazy_rescale(acc, alpha)
                            else:
                                acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
                        mbarrier.wait(v_ring.ready.index(prev), ((t - 1) // v_ring.SLOTS) & 1)
                        acc = warpgroup_mma(p_as_a(p16, p_layout), v_s, acc, is_async=True)
                        mbarrier.arrive(turn.index((C + 1) % PARTS))
                        turns += 1
                        s = warpgroup_mma_wait(1, deps=[s, q.hi, q.lo, k_s])[0]
                    mbarrier.arrive(k_ring.empty.index(ks))
                    start, bound, in_a = keys.at(j, a_end, t_a, n_a, t_b, seq_len)
                    p, alpha, l_parts, m_i = softmax_tile(s, m_i, l_parts, start, bound,
                                                           offs_n, rows, scores, keys)
                    if PV_FIRST:
                        p16 = p_operand(p, dtype, p_layout, scores.P_WORDS)
                    elif ONE_P:
                        # One P tile live (FA3's order): the next P is made once this P V is
                        # done, so S, O and one P fit three consumers' 160 registers, and
                        # head 256's O, S and P words fit 240 without a copy of the words.
                        acc = pv_wait(acc, v_s, p16)
                        mbarrier.arrive(v_ring.empty.index(prev))
                        if LATE:
                            if LAZY:
                                acc = lazy_rescale(acc, alpha)
                            else:
                                acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
                        p16 = p_operand(p, dtype, p_layout, scores.P_WORDS)
                    else:
                        p_next = p_operand(p, dtype, p_layout, scores.P_WORDS)
                        acc = pv_wait(acc, v_s, p16)
                        mbarrier.arrive(v_ring.empty.index(prev))
                        p16 = p_next
                if n_pipe == n:
                    mbarrier.arrive(q_bufs.empty.index(qb))  # every QK^T of this item is done
                t = tile + n_pipe - 1
                last = t % v_ring.SLOTS
                v_s = v_operand(v_ring.smem.index(last), BLOCK_N)
                if not LATE:  # (LATE: the loop's last trip applied it; one tile: O is 0)
                    if LAZY:
                        acc = lazy_rescale(acc, alpha)
                    else:
                        acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
                mbarrier.wait(v_ring.ready.index(last), (t // v_ring.SLOTS) & 1)
                acc = warpgroup_mma(p_as_a(p16, p_layout), v_s, acc, is_async=True)
                acc = pv_wait(acc, v_s, p16)
                mbarrier.arrive(v_ring.empty.index(last))
            if n_pipe < n:
                start, bound, in_a = keys.at(n - 1, a_end, t_a, n_a, t_b, seq_len)
                acc, m_i, l_parts = _half_tile(
                    C, tile + n - 1, turns, q, k_ring, v_ring, turn, q_bufs.empty.index(qb),
                    acc, m_i, l_parts, start, bound, rows, scores, keys)
                turns += 1
            if n == 0:
                mbarrier.arrive(q_bufs.empty.index(qb))
            tile += n
            # Empty rows (l = 0) give 0 and LSE -inf, never NaN.
            l_o = row_sum(l_parts, o_rows)
            l_safe = gl.where(l_o == 0.0, 1.0, l_o)
            out = (acc * gl.expand_dims(v_scale / l_safe, 1)).to(output.out.dtype.element_ty)
            # Stored 8 consecutive columns a thread (16-byte stores): the accumulator's
            # 2-column pairs made 4x the store instructions, and their queue stalled the
            # consumers at every item's end (ncu: 8-9% of the samples on short items;
            # KERNEL_NOTES v11). The fp8 variants have no room for the 4 KB staging.
            if output.ROW_STORES:
                out = gl.convert_layout(out, st_layout)
                o_r, o_c = offs_ms, offs_ds
            else:
                o_r, o_c = offs_mo, offs_d
            token = (q_start + row0 + o_r).to(gl.int64)
            ptrs = (output.out + gl.expand_dims(token * output.stride_t + head * output.stride_h,
                                                1) + gl.expand_dims(o_c, 0))
            ok = gl.expand_dims(row0 + o_r < q_len, 1) & gl.expand_dims(o_c < HEAD_DV, 0)
            gl.store(ptrs, out, mask=ok)
            if output.WRITE_LSE:
                row_ok = row0 + offs_mo < q_len
                token = (q_start + row0 + offs_mo).to(gl.int64)
                m_o = gl.convert_layout(m_i, o_rows)
                lse = gl.where(l_o == 0.0, float("-inf"),
                               (m_o + gl.log2(l_safe) - P_SHIFT) * LN2)
                gl.store(output.lse + head.to(gl.int64) * output.total_q + token, lse,
                         mask=row_ok)
            item += 1


@gluon.jit
def _half_tile(C: gl.constexpr, t, turns, q, k_ring, v_ring, turn, q_free, acc, m_i, l_parts,
               start, bound, rows, scores, keys):
    """Tile t (the item's last) over its first BLOCK_N / 2 keys only: S, the softmax and P V
    one after the other (the other consumer's products fill the tensor cores meanwhile), in
    the same turn order and with the same barrier arrivals as a full tile (and q_free, the
    item's last QK^T). q: the item's `QOperand`. Returns (acc, m_i, l_parts)."""
    HALF: gl.constexpr = keys.BLOCK_N // 2
    ROWS: gl.constexpr = acc.shape[0]
    PARTS: gl.constexpr = keys.BLOCK_M // ROWS
    LEAD: gl.constexpr = 1 if C == 0 else 0
    o_layout: gl.constexpr = acc.type.layout
    s_layout: gl.constexpr = scores_layout(HALF, k_ring.smem.dtype)
    dtype: gl.constexpr = p_dtype(v_ring.smem.dtype)
    p_layout: gl.constexpr = p_operand_layout(o_layout, dtype)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_layout: gl.constexpr = m_i.type.layout
    slot = t % v_ring.SLOTS
    phase = (t // v_ring.SLOTS) & 1
    ks = t % k_ring.SLOTS
    k_s = k_ring.smem.index(ks).slice(0, HALF)
    v_s = v_operand(v_ring.smem.index(slot), HALF)
    mbarrier.wait(k_ring.ready.index(ks), (t // k_ring.SLOTS) & 1)
    mbarrier.wait(turn.index(C), (turns & 1) ^ LEAD)
    s = qk_issue(q, k_s, gl.zeros([ROWS, HALF], gl.float32, layout=s_layout))
    mbarrier.arrive(turn.index((C + 1) % PARTS))
    s = warpgroup_mma_wait(0, deps=[s, q.hi, q.lo, k_s])[0]
    mbarrier.arrive(k_ring.empty.index(ks))
    mbarrier.arrive(q_free)
    offs_n = gl.arange(0, HALF, layout=gl.SliceLayout(0, s_layout))
    m_half = gl.convert_layout(m_i, s_rows)
    p, alpha, l_new, m_new = softmax_tile(s, m_half, l_parts, start, bound, offs_n,
                                           rows.in_layout(s_rows), scores, keys)
    if scores.MAX_SLACK >= 0:
        acc = lazy_rescale(acc, alpha)
    else:
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    p16 = p_operand(p, dtype, p_layout, scores.P_WORDS)
    mbarrier.wait(v_ring.ready.index(slot), phase)
    acc = warpgroup_mma(p_as_a(p16, p_layout), v_s, acc, is_async=True)
    acc = pv_wait(acc, v_s, p16)
    mbarrier.arrive(v_ring.empty.index(slot))
    return acc, gl.convert_layout(m_new, row_layout), l_new
