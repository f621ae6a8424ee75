"""The batch-invariant consumer of the Gluon prefill kernel: each row by the operations of the
`tl` batch-invariant pass, in their order, so its output and LSE have that pass's bits.

`gluon_prefill.py` runs it in place of `gluon_consumer.consumer` with INVARIANT_SPLIT > 0
(the fixed split's keys). What a row's bits depend on, and how this consumer keeps each as
`invariant.attend_fixed_splits` / `tile_loop.attend` (BATCH_INVARIANT) have it:
- key tiles of BLOCK_N (the `tl` pass's block_n) anchored at key 0, every key from the
  paged cache (one phase: the plan never gives dense new rows), splits of SPLIT_KEYS keys
  at absolute positions; a tile or split a row does not see leaves its state exactly as it
  was (the exact softmax step, empty splits folded as no-ops), so which superset of tiles
  an item walks does not enter;
- the products: wgmma m64, the `tl` pass's operand dtype (fp8 K/V converted to 16 bits,
  never an fp8 product), float32 accumulation over k16 steps in order; P V into the
  accumulator itself (acc * alpha first), as `tl.dot(p, v, acc)`;
- per tile: S * qk (the launch scale times the q descale, then the k descale), soft cap,
  ALiBi, the mask as a select to -inf, then `tile_math.exact_softmax_step` with the row
  sum taken every tile (`gl.sum` over the accumulator layout: 4 warps of 16 rows, the
  layout of a `tl.dot` on 64-row multiples, hence the same order of adds);
- per split: `invariant.finish_split`, then `invariant.fold_split` in split order, the sink
  in split 0's state (or folded alone first where split 0 has no tile of the item); at the
  end lse * ln 2 and out + 0.0;
- no fused multiply-adds: the kernel compiles with enable_fp_fusion=False, as the `tl`
  pass does.
LEAN (`SWITCHES.invariant_gluon_lean`) drops work that cannot change a bit: the first fold
of an item (nothing folded yet) as the select it reduces to (`gluon_invariant_fold.fold_next`),
a masked tile's limits as one compare a key (`gluon_invariant_tile.exact_tile`'s LEAN: the
same booleans), and O stored as the default consumer stores it (16-byte stores through its
staging, `gluon_consumer.o_store_layout`).
FOLD (`output.fold` given, `gluon_launch.fold_at`: head 256, `SWITCHES.invariant_gluon_256`;
head 128 over 128-key tiles, `SWITCHES.invariant_tiles_128`): a consumer's O and the splits
folded so far do not fit its registers together (head 128: beside a 128-key tile's S and
two P they spilled at the split edges), so the fold state of its rows
lives in `output.fold` (float32 [grid, BLOCK_M, Dv]: a persistent program's item is folded
and its rows written before the program takes its next, so the program's BLOCK_M rows,
consumer C's at C * 64 + r, hold every item it runs, in the static or the dynamic order;
each element written and read back by the one thread that owns it in the accumulator's
layout: no barrier) and only the row LSEs stay in registers; the same `fold_split` in
split order, the first split as `fold_next`'s select (`gluon_invariant_fold.py`), so the
same bits as the fold in registers or `invariant.fold_splits_kernel`'s (an item's first
fold writes every row it reads back, so what the program's previous item left there is
never read); a head-128 layer's prompts so keep the `tl` pass's bits. Head 256's rows are
nobody's `tl` rows: its `tl` tiles split a row over two warps, so such a layer runs its
prompts here and its decodes on `gluon_decode_invariant.py` alone (one arithmetic a row,
`invariant_plan.gluon_256_refusal`).
LAZY (`Scores.MAX_SLACK` 0, `SWITCHES.invariant_lazy_rescale`): O's rescale skipped by a
warp none of whose rows moved its max (`gluon_softmax.lazy_rescale`, round-to-nearest
multiplies): alpha is then exactly 1 on each (`gluon_invariant_tile.exact_tile`), and x * 1
is x. MAX_SLACK > 0 (`SWITCHES.invariant_max_slack`, every pass alike): the running max
lags by up to that slack (`tile_math.invariant_max`), O's rescale skipped likewise.
SKIP (`SWITCHES.invariant_skip_unseen`; schedule only): a split's tiles after its first that
lie past the last key a consumer's rows see are passed without products (slots released,
turns handed on): causal, consumer 0's last 64-key tile of an item (`gluon_consumer._half_tile`
saves that work in the default consumer).
The schedule (items, rings, ping-pong turns, P V overlapping the next S) is the default
consumer's and does not enter a row's bits. Imports nothing but Triton.
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
    from pagedattn.ops.triton.gluon_args import release_unread
    from pagedattn.ops.triton.gluon_invariant_tile import exact_tile
    from pagedattn.ops.triton.gluon_operands import (
        QOperand,
        p_operand,
        p_operand_layout,
        pv_wait,
        q_in_place,
        qk_issue,
        v_operand,
    )
    from pagedattn.ops.triton.gluon_softmax import LOG2E, lazy_rescale, scores_layout
except ImportError:  # compiled standalone, without torch (tools/gluon_sass.py)
    from gluon_args import release_unread
    from gluon_invariant_tile import exact_tile
    from gluon_operands import (
        QOperand,
        p_operand,
        p_operand_layout,
        pv_wait,
        q_in_place,
        qk_issue,
        v_operand,
    )
    from gluon_softmax import LOG2E, lazy_rescale, scores_layout

try:
    from pagedattn.ops.triton.gluon_consumer import o_store_layout
    from pagedattn.ops.triton.gluon_invariant_fold import (
        finish_split,
        first_fold_of_sink,
        fold_in_memory,
        fold_next,
        fold_rows,
        fold_sink,
        fold_split,
    )
except ImportError:  # compiled standalone, without torch (tools/gluon_sass.py)
    from gluon_consumer import o_store_layout
    from gluon_invariant_fold import (
        finish_split,
        first_fold_of_sink,
        fold_in_memory,
        fold_next,
        fold_rows,
        fold_sink,
        fold_split,
    )

LN2 = gl.constexpr(0.6931471805599453)


@gluon.jit
def invariant_consumer(C: gl.constexpr, SPLIT_KEYS: gl.constexpr, LEAN: gl.constexpr,
                       SKIP: gl.constexpr, q_bufs, k_ring, v_ring, turn, items, keys, scores,
                       descales, output):
    """Consumer C: rows [C * 64, C * 64 + 64) of each item's 128-row query block, over the
    item's key tiles (one phase), state restarted every SPLIT_KEYS keys and the splits
    folded in order. Arguments as `gluon_consumer.consumer`'s (16-bit K / V rings: a 16-bit
    cache, or an fp8 one the converter turned into the products' dtype); LEAN, SKIP: see
    above."""
    BLOCK_M: gl.constexpr = keys.BLOCK_M
    BLOCK_N: gl.constexpr = keys.BLOCK_N
    ROWS: gl.constexpr = q_bufs.smem.shape[1]
    PARTS: gl.constexpr = BLOCK_M // ROWS
    LEAD: gl.constexpr = 1 if C == 0 else 0
    NUM_QBUF: gl.constexpr = q_bufs.SLOTS
    q_smem = q_bufs.smem
    # The default consumer's set-up less row-sum partials and split q: the `tl` pass has neither
    dtype: gl.constexpr = v_ring.smem.dtype
    HEAD_DV: gl.constexpr = v_ring.smem.shape[2]
    s_layout: gl.constexpr = scores_layout(BLOCK_N, k_ring.smem.dtype)
    o_layout: gl.constexpr = scores_layout(HEAD_DV, dtype)
    p_layout: gl.constexpr = p_operand_layout(o_layout, dtype)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    offs_m = gl.arange(0, ROWS, layout=s_rows)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    offs_mo = gl.arange(0, ROWS, layout=o_rows)
    offs_d = gl.arange(0, HEAD_DV, layout=gl.SliceLayout(0, o_layout))
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    FOLD: gl.constexpr = output.fold is not None  # the fold state in memory (`fold_at`)
    LAZY: gl.constexpr = scores.MAX_SLACK >= 0  # O's rescale skipped where no row moved
    tile = 0
    item = 0  # valid items (Q buffer turns)
    item_n = 0  # items taken, valid or not
    turns = 0
    w_n = items.next(0)
    item_info = items.info(w_n)  # the next item's, loaded one item ahead
    while w_n < items.num_items:
        valid, seq, head, q_start, q_len, q_block, seq_len = item_info
        item_n += 1
        w_n = items.next(item_n)
        item_info = items.info(w_n)
        if valid:
            context = seq_len - q_len
            # The `tl` pass's order: the launch's scale, times the q descale, times the k's.
            qk = scores.qk_scale
            v_scale = 1.0
            ds = seq.to(gl.int64) * descales.stride_b + (head // items.GROUP) * descales.stride_h
            if descales.Q_DESCALE:
                qk = qk * gl.load(descales.q + ds)
            if descales.KV_DESCALE:
                qk = qk * gl.load(descales.k + ds)
                v_scale = gl.load(descales.v + ds)
            a_end, t_a, n, t_b, n_b = keys.of_block(q_block, q_len, seq_len)  # n_b = 0
            row0 = q_block * BLOCK_M + C * ROWS
            rows_lo, rows_hi, full_lo, full_hi = keys.ranges(
                context + row0, context + gl.minimum(row0 + ROWS, q_len) - 1, seq_len)
            q_pos = context + row0 + offs_m
            slope = gl.zeros([ROWS], gl.float32, layout=s_rows)
            if scores.USE_ALIBI:
                slope = gl.load(scores.alibi_slopes + head + offs_m * 0) * LOG2E
            sink = gl.full([ROWS], float("-inf"), gl.float32, layout=s_rows)
            if scores.USE_SINKS:
                sink = gl.load(scores.sinks + head + offs_m * 0) * LOG2E
            qb = (item % NUM_QBUF) * PARTS + C
            q_s = q_smem.index(qb)
            mbarrier.wait(q_bufs.ready.index(qb), (item // NUM_QBUF) & 1)
            if q_smem.dtype != k_ring.smem.dtype:  # bf16 q over fp16 products (fp8 cache)
                q_s = q_in_place(q_s, k_ring.smem.dtype, ROWS, q_smem.shape[2])
            q = QOperand(q_s, q_s, False)
            lse2 = gl.full([ROWS], float("-inf"), gl.float32, layout=o_rows)
            if FOLD:  # this consumer's rows of the program's fold state [BLOCK_M, HEAD_DV]
                fold_row = (gl.program_id(0) * BLOCK_M + C * ROWS + offs_mo) * HEAD_DV
                fold_ok = row0 + offs_mo < q_len
            else:
                out = gl.zeros([ROWS, HEAD_DV], gl.float32, layout=o_layout)
            first = t_a // SPLIT_KEYS
            last = gl.where(n > 0, (t_a + n * BLOCK_N - 1) // SPLIT_KEYS + 1, first)
            folded = False  # whether (out, lse2) holds a fold yet
            if scores.USE_SINKS:
                # split 0 holds the sink and no tile of the item: its fold, the first
                if FOLD:  # its select, stored
                    lse2, folded = first_fold_of_sink(output.fold, fold_row, fold_ok, sink,
                                                      v_scale, (first > 0) | (n == 0),
                                                      o_layout, HEAD_DV)
                elif (first > 0) | (n == 0):
                    out, lse2 = fold_sink(out, lse2, sink, v_scale, o_layout)
                    folded = True
            for s in range(first, last):
                j0 = gl.maximum(s * SPLIT_KEYS - t_a, 0) // BLOCK_N
                j1 = gl.minimum((s + 1) * SPLIT_KEYS - t_a, n * BLOCK_N) // BLOCK_N
                if SKIP:  # the split's tiles from jv on: past this consumer's last seen key
                    jv = gl.maximum(gl.minimum(j1, (rows_hi - t_a + BLOCK_N - 1) // BLOCK_N),
                                    j0 + 1)
                else:
                    jv = j1
                m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=s_rows)
                l_i = gl.zeros([ROWS], gl.float32, layout=s_rows)
                if scores.USE_SINKS:  # `tile_loop.init_state` of split 0
                    m_i = gl.where(s == 0, sink, m_i)
                    l_i = gl.where(s == 0, 1.0, l_i)
                acc = gl.zeros([ROWS, HEAD_DV], gl.float32, layout=o_layout)
                # The default consumer's issues, copied: as shared helpers they changed the SASS
                # Tile j0: S only; its P V is issued beside the next tile's S.
                t = tile + j0
                ks = t % k_ring.SLOTS
                k_s = k_ring.smem.index(ks)
                mbarrier.wait(k_ring.ready.index(ks), (t // k_ring.SLOTS) & 1)
                mbarrier.wait(turn.index(C), (turns & 1) ^ LEAD)
                s0 = qk_issue(q, k_s, s_zero)
                mbarrier.arrive(turn.index((C + 1) % PARTS))
                turns += 1
                s0 = warpgroup_mma_wait(0, deps=[s0, q.hi, k_s])[0]
                mbarrier.arrive(k_ring.empty.index(ks))
                p, alpha, l_i, m_i = exact_tile(
                    s0, m_i, l_i, t_a + j0 * BLOCK_N, offs_n, q_pos, slope, qk, full_lo,
                    full_hi, seq_len, scores, keys, LEAN)
                p16 = p_operand(p, dtype, p_layout)
                for j in range(j0 + 1, jv):
                    t = tile + j
                    ks = t % k_ring.SLOTS
                    prev = (t - 1) % v_ring.SLOTS
                    k_s = k_ring.smem.index(ks)
                    v_s = v_operand(v_ring.smem.index(prev), BLOCK_N)
                    mbarrier.wait(k_ring.ready.index(ks), (t // k_ring.SLOTS) & 1)
                    mbarrier.wait(turn.index(C), (turns & 1) ^ LEAD)
                    s_j = qk_issue(q, k_s, s_zero)
                    if LAZY:
                        acc = lazy_rescale(acc, alpha, True)
                    else:
                        acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
                    mbarrier.wait(v_ring.ready.index(prev), ((t - 1) // v_ring.SLOTS) & 1)
                    acc = warpgroup_mma(p16, v_s, acc, is_async=True)
                    mbarrier.arrive(turn.index((C + 1) % PARTS))
                    turns += 1
                    s_j = warpgroup_mma_wait(1, deps=[s_j, q.hi, k_s])[0]
                    mbarrier.arrive(k_ring.empty.index(ks))
                    p, alpha, l_i, m_i = exact_tile(
                        s_j, m_i, l_i, t_a + j * BLOCK_N, offs_n, q_pos, slope, qk, full_lo,
                        full_hi, seq_len, scores, keys, LEAN)
                    p_next = p_operand(p, dtype, p_layout)
                    # The next P a dependency of the wait: its exponentials run under this P
                    # V (plain exp2s are pure, and LLVM sank them past the wait)
                    done = warpgroup_mma_wait(0, deps=[acc, v_s, p16, p_next])
                    acc = done[0]
                    p16 = done[3]
                    mbarrier.arrive(v_ring.empty.index(prev))
                # The default consumer's last P V, copied: as a shared helper it changed the SASS
                t = tile + jv - 1
                last_slot = t % v_ring.SLOTS
                v_s = v_operand(v_ring.smem.index(last_slot), BLOCK_N)
                if LAZY:
                    acc = lazy_rescale(acc, alpha, True)
                else:
                    acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
                mbarrier.wait(v_ring.ready.index(last_slot), (t // v_ring.SLOTS) & 1)
                acc = warpgroup_mma(p16, v_s, acc, is_async=True)
                if SKIP:  # the first passed tile's turn now: the other consumer's S waits on it
                    if jv < j1:
                        turns = _pass_turn(C, PARTS, turns, turn)
                acc = pv_wait(acc, v_s, p16)
                mbarrier.arrive(v_ring.empty.index(last_slot))
                if SKIP:
                    for t_pass in range(tile + jv, tile + j1):
                        if t_pass > tile + jv:
                            turns = _pass_turn(C, PARTS, turns, turn)
                        release_unread(k_ring, t_pass)
                        release_unread(v_ring, t_pass)
                o, o_lse2 = finish_split(acc, gl.convert_layout(m_i, o_rows),
                                         gl.convert_layout(l_i, o_rows), v_scale)
                if FOLD:
                    lse2, folded = fold_in_memory(output.fold, fold_row, fold_ok, lse2,
                                                  folded, o, o_lse2)
                elif LEAN:
                    out, lse2 = fold_next(out, lse2, o, o_lse2, folded)
                    folded = True
                else:
                    out, lse2 = fold_split(out, lse2, o, o_lse2)
            mbarrier.arrive(q_bufs.empty.index(qb))  # every Q K^T of this item is done
            tile += n
            if FOLD:  # the folded rows back (zeros where nothing was folded: lse2 is -inf)
                out = gl.load(fold_rows(output.fold, fold_row, o_layout, HEAD_DV),
                              mask=gl.expand_dims(fold_ok & folded, 1), other=0.0)
            # + 0.0: -0.0 -> 0.0, as the `tl` pass (`invariant.fold_splits_kernel` says why)
            out = (out + 0.0).to(output.out.dtype.element_ty)
            o_r, o_c = offs_mo, offs_d
            if LEAN and output.ROW_STORES:  # the values moved between threads, not changed
                out = gl.convert_layout(out, o_store_layout(ROWS, HEAD_DV))
                o_r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, out.type.layout))
                o_c = gl.arange(0, HEAD_DV, layout=gl.SliceLayout(0, out.type.layout))
            token = (q_start + row0 + o_r).to(gl.int64)
            ptrs = (output.out + gl.expand_dims(token * output.stride_t + head * output.stride_h,
                                                1) + gl.expand_dims(o_c, 0))
            ok = gl.expand_dims(row0 + o_r < q_len, 1) & gl.expand_dims(o_c < HEAD_DV, 0)
            gl.store(ptrs, out, mask=ok)
            if output.WRITE_LSE:
                token = (q_start + row0 + offs_mo).to(gl.int64)
                gl.store(output.lse + head.to(gl.int64) * output.total_q + token, lse2 * LN2,
                         mask=row0 + offs_mo < q_len)
            item += 1


@gluon.jit
def _pass_turn(C: gl.constexpr, PARTS: gl.constexpr, turns, turn):
    """The turn of a tile passed without its products (SKIP: none of this consumer's rows
    sees a key of it, so its exact step would leave the state as it was) taken and handed
    on, so the other consumer's turns keep their order. Returns turns."""
    mbarrier.wait(turn.index(C), (turns & 1) ^ (1 if C == 0 else 0))
    mbarrier.arrive(turn.index((C + 1) % PARTS))
    return turns + 1
