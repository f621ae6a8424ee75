"""The Gluon decode kernel for Hopper (sm_90a): decodes over a paged cache at TMA speed.

Written for Triton 3.6's Gluon API (`gluon_decode_launch.py` plans and launches it). One
program per (request, KV head, split), as the `tl` decode pass (`attention.py`, DECODE_PASS):
its 64 wgmma rows are the request's decode queries x the KV head's query heads, GQA packed
(row = q_tok * GROUP_PAD + g, the `tl` pass's order; QUERIES = `decode_query_count(group)`
tokens at most), so each K/V tile is read once per KV head. Padding rows (g >= GROUP, or a
token past the request's queries) hold a zero q and are never stored. A request of more
than QUERIES queries is another pass's (its programs do nothing).

Partitions (`gl.warp_specialize`):
- the producer (1 warp) builds the cache's tensor descriptors on the device and TMA-loads
  each BLOCK_N-key tile of K and of V as one [PAGE, D] box per page (`gluon_producer`'s
  `load_pages` over `tma_views.paged_rows`' rows) into rings of ready / empty mbarriers. A
  16-bit V tile that ends past the sequence has its tail rows zeroed (`load_v_pages`): a
  page's unwritten slots may hold NaN, which P = 0 does not cancel in P V.
- the consumer (4 warps, the default partition) loads its Q rows once, then per tile issues
  S = Q K^T (a 16-bit wgmma, or an fp8 one: an e4m3 q over the e4m3 tile as TMA landed it,
  K-major, no conversion), the P V of the tile before, and the online softmax of
  `gluon_softmax` while that P V runs (the prefill consumer's order).
- the converter (2 warps; idle over a 16-bit cache) turns each staged fp8 V tile into the
  fp16 tile P V reads (`gluon_convert.convert_v`, zeroing rows past the sequence), or with
  PV_FP8 into V^T, fp8 still, by byte permutes over the words ldmatrix delivers (the
  prefill's `gluon_convert.transpose_tile` with `word_bytes`): P V is then an fp8 wgmma,
  P = 2^8 2^(s - m) rounded to e4m3 as words of four keys (`gluon_operands.p_words`), the
  prefill's fp8 P V and its numerics (DESIGN.md).

Split-KV: split z of `num_splits` takes the `tl` pass's key range (tiles_per_split tiles of
the request's range from its first tile); with SPLIT_KV the program writes float32 partials
[splits, total_q, H, Dv] / [splits, total_q, H] as `tile_loop.store_partials` does, which
`reduce.py` merges; else Out [total_q, H, Dv] and Lse [H, total_q] as `store_rows`. Sinks
join split 0 only (`tile_loop.init_state`). The Q load, the rows' store arithmetic and the
unspecialised arguments (`load_q`, `out_rows`, `UNSPECIALIZED`) serve batch-invariant mode's
decode kernel too (`gluon_decode_invariant.py`). A program's one unit (request, KV head,
split) is `unit_keys` + `decode_unit` + `gluon_producer.load_unit_tiles` from the rings'
first tiles; the persistent form (`gluon_decode_persistent.py`) runs the same over several
units a program, counting ring tiles across them. Imports nothing but Triton, so it
compiles for sm_90 on a machine without torch.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

try:
    from pagedattn.ops.triton.gluon_args import (
        Descales,
        Output,
        Pages,
        Scores,
        store_partial,
        store_rows,
    )
    from pagedattn.ops.triton.gluon_convert import convert_v
    from pagedattn.ops.triton.gluon_decode_rings import ROWS, decode_buffers
    from pagedattn.ops.triton.gluon_operands import (
        p_as_a,
        p_dtype,
        p_operand,
        p_operand_layout,
        pv_wait,
        v_operand,
    )
    from pagedattn.ops.triton.gluon_producer import load_page_tiles
    from pagedattn.ops.triton.gluon_schedule import KeyTiles
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
except ImportError:  # compiled standalone, without torch (tools/gluon_decode_sass.py)
    from gluon_args import Descales, Output, Pages, Scores, store_partial, store_rows
    from gluon_convert import convert_v
    from gluon_decode_rings import ROWS, decode_buffers
    from gluon_operands import p_as_a, p_dtype, p_operand, p_operand_layout, pv_wait, v_operand
    from gluon_producer import load_page_tiles
    from gluon_schedule import KeyTiles
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
# The runtime ints no launch specialises on (a value of 1 or a multiple of 16 would compile
# a kernel apart); the invariant decode kernel takes the same arguments.
UNSPECIALIZED = [
    "left", "right", "total_q", "num_splits", "stride_qt", "kv_rows", "stride_kc", "stride_vc",
    "page_rows", "head_rows", "head_cols_k", "head_cols_v", "stride_bt", "stride_ds_b",
    "stride_ds_h"]


# (its tiles by head size: `gluon_decode_tiles.py`)
@gluon.jit(do_not_specialize=UNSPECIALIZED)
def gluon_decode_kernel(
    Q, KC, VC, Out, Lse, cu_seqlens_q, seqused_k, block_table, sinks, q_descale, k_descale,
    v_descale, qk_scale, softcap, left, right, total_q, num_splits, stride_qt, kv_rows,
    stride_kc, stride_vc, page_rows, head_rows, head_cols_k, head_cols_v, stride_bt,
    stride_ot, stride_oh, stride_ds_b, stride_ds_h,
    NUM_KV: gl.constexpr, GROUP: gl.constexpr, GROUP_PAD: gl.constexpr, QUERIES: gl.constexpr,
    HEAD_D: gl.constexpr, HEAD_DV: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr,
    NUM_BUF: gl.constexpr, STAGES: gl.constexpr, WINDOW_LEFT: gl.constexpr,
    WINDOW_RIGHT: gl.constexpr, USE_SOFTCAP: gl.constexpr, USE_SINKS: gl.constexpr,
    WRITE_LSE: gl.constexpr, SPLIT_KV: gl.constexpr, KV_FP8: gl.constexpr,
    KV_DESCALE: gl.constexpr, Q_DESCALE: gl.constexpr, SCALE_IN_EXP: gl.constexpr,
    WORKER_REGS: gl.constexpr, PV_FP8: gl.constexpr = False, MAX_SLACK: gl.constexpr = -1,
):
    """Q [total_q, H, D] (heads packed, token stride stride_qt); KC / VC the paged caches as
    kv_rows rows of consecutive slots per block and KV head (`tma_views.CacheRows`: row
    strides stride_kc / stride_vc, page_rows rows a block, head_rows / head_cols_k(v) a KV
    head's row / column offset); block_table [batch, pages] (row stride stride_bt); sinks
    [H] float32 or None; descales float32 at seq * stride_ds_b + kv_head * stride_ds_h
    (q's with Q_DESCALE, k's and v's with KV_DESCALE) or None. qk_scale / softcap: the score
    scale and soft cap with log2(e) folded in (`gluon_decode_launch`); left / right: the
    windows (right 0: causal) where WINDOW_LEFT / WINDOW_RIGHT. SPLIT_KV: Out / Lse are the
    float32 partials [num_splits, total_q, H, Dv] / [num_splits, total_q, H]; else Out
    [total_q, H, Dv] (strides stride_ot, stride_oh; unread with SPLIT_KV) and, with
    WRITE_LSE, Lse [H, total_q] float32.
    KV_FP8: an e4m3 cache under an e4m3 q (Q K^T in fp8; V converted to fp16 for P V, or
    with PV_FP8 transposed to fp8 V^T for an fp8 P V). MAX_SLACK: O's rescale every tile
    (-1), or skipped by the warps none of whose rows moved its max (0: exact; 1-8: the max
    kept within that slack, `gluon_softmax.stale_max`).
    Grid (batch, NUM_KV, num_splits), num_warps=4, a global scratch allocator (the producer's
    two tensor descriptors)."""
    q_smem, k_ring, v_ring, v8_ring, v_fix = decode_buffers(
        Q, KC, VC, HEAD_D, HEAD_DV, BLOCK_N, NUM_BUF, STAGES, KV_FP8, PV_FP8)
    pages = Pages(KC, VC, block_table, kv_rows, stride_kc, stride_vc, page_rows, head_rows,
                  head_cols_k, head_cols_v, stride_bt, PAGE, True)
    keys = KeyTiles(left, right, WINDOW_LEFT, WINDOW_RIGHT, ROWS, BLOCK_N, False)
    scores = Scores(qk_scale, softcap, None, sinks, False, USE_SOFTCAP, USE_SINKS, SCALE_IN_EXP,
                    False, MAX_SLACK)
    descales = Descales(q_descale, k_descale, v_descale, stride_ds_b, stride_ds_h, Q_DESCALE,
                        KV_DESCALE)
    output = Output(Out, Lse, total_q, stride_ot, stride_oh, WRITE_LSE, False)
    # The argument tuples are written out in the call: a tuple variable turns constexprs into
    # tensors, and None travels only as an aggregate's field (descales, output, scores).
    gl.warp_specialize(
        [(_consumer, (Q, output, cu_seqlens_q, seqused_k, descales, stride_qt, num_splits,
                      q_smem, k_ring, v_ring, keys, scores, NUM_KV, GROUP, GROUP_PAD,
                      QUERIES, SPLIT_KV)),
         (_producer, (pages, cu_seqlens_q, seqused_k, num_splits, k_ring, v8_ring, v_fix, keys,
                      NUM_KV, QUERIES)),
         (_converter, (cu_seqlens_q, seqused_k, num_splits, v8_ring, v_ring, keys, QUERIES))],
        [1, 2], [WORKER_REGS, WORKER_REGS])


@gluon.jit
def split_keys(cu_seqlens_q, seqused_k, num_splits, keys, QUERIES: gl.constexpr):
    """This program's request and work, as every partition computes it: (seq, q_len,
    seq_len, context, lo, hi, n, full_lo, full_hi): keys [lo, hi) in n tiles of BLOCK_N
    (the `tl` decode pass's split of the request's key range, tiles anchored at its first
    tile), and the keys all its queries see, [full_lo, full_hi). n is 0 for a request of
    more than QUERIES queries (another pass's)."""
    seq = gl.program_id(0)
    split = gl.program_id(2)
    return unit_keys(cu_seqlens_q, seqused_k, num_splits, keys, seq, split, QUERIES)


@gluon.jit
def unit_keys(cu_seqlens_q, seqused_k, num_splits, keys, seq, split, QUERIES: gl.constexpr):
    """`split_keys` of the unit (request seq, split `split`): the persistent form's
    partitions take each unit's from it (`gluon_decode_persistent.py`)."""
    BLOCK_N: gl.constexpr = keys.BLOCK_N
    q_start = gl.load(cu_seqlens_q + seq)
    q_len = gl.load(cu_seqlens_q + seq + 1) - q_start
    seq_len = gl.load(seqused_k + seq)
    context = seq_len - q_len  # query i sits at position context + i
    key_lo, key_hi, full_lo, full_hi = keys.ranges(context, context + q_len - 1, seq_len)
    first_tile = key_lo // BLOCK_N * BLOCK_N
    tiles_per_split = gl.cdiv(gl.cdiv(gl.maximum(key_hi - first_tile, 0), BLOCK_N),
                              num_splits)
    lo = first_tile + split * tiles_per_split * BLOCK_N
    hi = gl.minimum(key_hi, lo + tiles_per_split * BLOCK_N)
    n = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N)
    n = gl.where((q_len <= QUERIES) & (q_len > 0), n, 0)
    return seq, q_start, q_len, seq_len, context, lo, hi, n, full_lo, full_hi


@gluon.jit
def _producer(pages, cu_seqlens_q, seqused_k, num_splits, k_ring, v_ring, v_fix, keys,
              NUM_KV: gl.constexpr, QUERIES: gl.constexpr):
    """TMA loads of the program's K and V tiles, one [min(PAGE, BLOCK_N), D] box a page, into
    k_ring and v_ring (the consumer's 16-bit V ring, zeroing tails on the private barrier
    v_fix; or the fp8 staging ring, whose converter zeroes them). K and V go in step."""
    seq, q_start, q_len, seq_len, context, lo, hi, n, full_lo, full_hi = split_keys(
        cu_seqlens_q, seqused_k, num_splits, keys, QUERIES)
    if n > 0:
        load_page_tiles(pages, k_ring, v_ring, v_fix, seq, seq_len, lo, hi, n, NUM_KV)


@gluon.jit
def _converter(cu_seqlens_q, seqused_k, num_splits, v8_ring, v_ring, keys,
               QUERIES: gl.constexpr):
    """The staged fp8 V tiles into the consumer's ring (fp16, or fp8 V^T; rows past the
    sequence zeroed); over a 16-bit cache (v8_ring is the consumer's ring) the partition
    idles."""
    if v8_ring.smem.dtype.is_fp8():
        BLOCK_N: gl.constexpr = keys.BLOCK_N
        seq, q_start, q_len, seq_len, context, lo, hi, n, full_lo, full_hi = split_keys(
            cu_seqlens_q, seqused_k, num_splits, keys, QUERIES)
        for j in range(n):
            convert_v(v8_ring, v_ring, j, lo + j * BLOCK_N, seq_len, BLOCK_N)


@gluon.jit
def load_q(Q, q_smem, q_start, q_len, kv_head, stride_qt, GROUP: gl.constexpr,
           GROUP_PAD: gl.constexpr):
    """The program's Q rows (row r: token r // GROUP_PAD, head kv_head * GROUP + r %
    GROUP_PAD; padding rows zero) into q_smem, ready for the wgmma: converted to q_smem's
    dtype in registers where it is not Q's (one rounding to nearest, as a `tl` `.to`)."""
    HEAD_D: gl.constexpr = q_smem.shape[1]
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, blk))
    d = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, blk))
    q_tok = r // GROUP_PAD
    g = r % GROUP_PAD
    ok = (g < GROUP) & (q_tok < q_len)
    off = (q_start + q_tok).to(gl.int64) * stride_qt + (kv_head * GROUP + g) * HEAD_D
    q = gl.load(Q + gl.expand_dims(off, 1) + gl.expand_dims(d, 0),
                mask=gl.expand_dims(ok, 1) & gl.expand_dims(d < HEAD_D, 0), other=0.0)
    q_smem.store(q.to(q_smem.dtype))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _consumer(Q, output, cu_seqlens_q, seqused_k, descales, stride_qt, num_splits, q_smem,
              k_ring, v_ring, keys, scores, NUM_KV: gl.constexpr, GROUP: gl.constexpr,
              GROUP_PAD: gl.constexpr, QUERIES: gl.constexpr, SPLIT_KV: gl.constexpr):
    """The program's unit (`decode_unit`), from the rings' first slots."""
    seq, q_start, q_len, seq_len, context, lo, hi, n, full_lo, full_hi = split_keys(
        cu_seqlens_q, seqused_k, num_splits, keys, QUERIES)
    if (q_len <= QUERIES) & (q_len > 0):
        kv_head = gl.program_id(1)
        split = gl.program_id(2)
        decode_unit(Q, output, descales, stride_qt, q_smem, k_ring, v_ring, keys, scores, seq,
                    q_start, q_len, context, lo, hi, n, full_lo, full_hi, kv_head, split, 0,
                    NUM_KV, GROUP, GROUP_PAD, SPLIT_KV)


@gluon.jit
def decode_unit(Q, output, descales, stride_qt, q_smem, k_ring, v_ring, keys, scores, seq,
                q_start, q_len, context, lo, hi, n, full_lo, full_hi, kv_head, split, tile,
                NUM_KV: gl.constexpr, GROUP: gl.constexpr, GROUP_PAD: gl.constexpr,
                SPLIT_KV: gl.constexpr):
    """One unit (request seq, KV head, split; keys as `unit_keys` gives them) of a request
    the pass serves: S = Q K^T, the online softmax and O += P V over its n tiles (the prefill
    consumer's pipeline: tile j's S is issued beside tile j - 1's P V, whose wait follows
    tile j's softmax), then the epilogue: Out / Lse rows, or split partials. Its tiles are
    the rings' tiles tile .. tile + n - 1 (the persistent form counts its earlier units'
    tiles; a program of one unit starts at 0). An fp8 V ring holds V^T: P V is then an fp8
    wgmma whose P (`p_words`) carries 2^P_SHIFT, as do the row sums (the division cancels
    it, the LSE subtracts it)."""
    BLOCK_N: gl.constexpr = keys.BLOCK_N
    PV_FP8: gl.constexpr = v_ring.smem.dtype.is_fp8()
    HEAD_DV: gl.constexpr = v_ring.smem.shape[1 if PV_FP8 else 2]
    NUM_HEADS: gl.constexpr = NUM_KV * GROUP
    s_layout: gl.constexpr = scores_layout(BLOCK_N, k_ring.smem.dtype)
    dtype: gl.constexpr = p_dtype(v_ring.smem.dtype)
    P_SHIFT: gl.constexpr = p_shift(dtype, scores.MAX_SLACK)
    LAZY: gl.constexpr = scores.MAX_SLACK >= 0  # O rescaled only where a row's max moved
    # One P tile live (the next tile's words made after this P V's wait): made before it,
    # as the 16-bit P is, ptxas serialised every wgmma (C7513, sm_90 SASS of the 64-key
    # tiles; the prefill's head 256 likewise, KERNEL_NOTES v35)
    ONE_P: gl.constexpr = PV_FP8
    o_layout: gl.constexpr = scores_layout(HEAD_DV, dtype)
    p_layout: gl.constexpr = p_operand_layout(o_layout, dtype)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    qk = scores.qk_scale
    v_scale = 1.0
    ds = seq.to(gl.int64) * descales.stride_b + kv_head * descales.stride_h
    if descales.KV_DESCALE:
        qk = qk * gl.load(descales.k + ds)
        v_scale = gl.load(descales.v + ds)
    if descales.Q_DESCALE:
        qk = qk * gl.load(descales.q + ds)
    offs_m = gl.arange(0, ROWS, layout=s_rows)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    rows = ItemRows(context + offs_m // GROUP_PAD, gl.zeros([ROWS], gl.float32, s_rows),
                    full_lo, full_hi, qk, P_SHIFT)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=s_rows)
    l_parts = gl.zeros([ROWS, 8], gl.float32, layout=parts_layout(8))
    if scores.USE_SINKS:  # split 0's state starts from the sink (it counts once)
        g = offs_m % GROUP_PAD
        sink = gl.load(scores.sinks + kv_head * GROUP + g, mask=g < GROUP, other=0.0)
        m_i = gl.where(split == 0, sink * LOG2E, m_i)
        l_parts = l_parts + gl.where(split == 0, (1 << P_SHIFT) / 8, 0.0)
    acc = gl.zeros([ROWS, HEAD_DV], gl.float32, layout=o_layout)
    load_q(Q, q_smem, q_start, q_len, kv_head, stride_qt, GROUP, GROUP_PAD)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    if n > 0:
        first = tile % k_ring.SLOTS
        k_s = k_ring.smem.index(first)
        mbarrier.wait(k_ring.ready.index(first), (tile // k_ring.SLOTS) & 1)
        s = warpgroup_mma(q_smem, k_s.permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)
        s = warpgroup_mma_wait(0, deps=[s, q_smem, k_s])[0]
        mbarrier.arrive(k_ring.empty.index(first))
        p, alpha, l_parts, m_i = softmax_tile(s, m_i, l_parts, lo, hi, offs_n, rows,
                                               scores, keys)
        p16 = p_operand(p, dtype, p_layout, PV_FP8)  # PV_FP8: e4m3 words (`p_words`)
        for j in range(1, n):
            ks = (tile + j) % k_ring.SLOTS
            prev = (tile + j - 1) % v_ring.SLOTS
            k_s = k_ring.smem.index(ks)
            v_s = v_ring.smem.index(prev)
            mbarrier.wait(k_ring.ready.index(ks), ((tile + j) // k_ring.SLOTS) & 1)
            s = warpgroup_mma(q_smem, k_s.permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)
            if LAZY:  # `lazy_rescale`: skipped by warps whose rows kept their max
                acc = lazy_rescale(acc, alpha)
            else:
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
            mbarrier.wait(v_ring.ready.index(prev), ((tile + j - 1) // v_ring.SLOTS) & 1)
            if PV_FP8:  # P's e4m3 words over V^T seen transposed (K-major)
                acc = warpgroup_mma(p_as_a(p16, p_layout), v_operand(v_s, BLOCK_N), acc,
                                    is_async=True)
            else:
                acc = warpgroup_mma(p16, v_s, acc, is_async=True)
            s = warpgroup_mma_wait(1, deps=[s, q_smem, k_s])[0]
            mbarrier.arrive(k_ring.empty.index(ks))
            p, alpha, l_parts, m_i = softmax_tile(s, m_i, l_parts, lo + j * BLOCK_N, hi,
                                                   offs_n, rows, scores, keys)
            if ONE_P:
                acc = pv_wait(acc, v_s, p16)
                mbarrier.arrive(v_ring.empty.index(prev))
                p16 = p_operand(p, dtype, p_layout, PV_FP8)
            else:
                p_next = p_operand(p, dtype, p_layout, PV_FP8)
                acc = pv_wait(acc, v_s, p16)
                mbarrier.arrive(v_ring.empty.index(prev))
                p16 = p_next
        last = (tile + n - 1) % v_ring.SLOTS
        v_s = v_ring.smem.index(last)
        if LAZY:
            acc = lazy_rescale(acc, alpha)
        else:
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
        mbarrier.wait(v_ring.ready.index(last), ((tile + n - 1) // v_ring.SLOTS) & 1)
        if PV_FP8:
            acc = warpgroup_mma(p_as_a(p16, p_layout), v_operand(v_s, BLOCK_N), acc,
                                is_async=True)
        else:
            acc = warpgroup_mma(p16, v_s, acc, is_async=True)
        acc = pv_wait(acc, v_s, p16)
        mbarrier.arrive(v_ring.empty.index(last))
    # Rows that saw no key (l = 0) give 0 and LSE -inf, never NaN.
    l_o = row_sum(l_parts, o_rows)
    l_safe = gl.where(l_o == 0.0, 1.0, l_o)
    out = acc * gl.expand_dims(v_scale / l_safe, 1)
    m_o = gl.convert_layout(m_i, o_rows)
    if P_SHIFT != 0:  # l carries P's 2^P_SHIFT
        m_o = m_o - P_SHIFT
    lse = gl.where(l_o == 0.0, float("-inf"), (m_o + gl.log2(l_safe)) * LN2)
    token, head, d, row_ok, ok = out_rows(q_start, q_len, kv_head, GROUP, GROUP_PAD,
                                          HEAD_DV, o_layout)
    if SPLIT_KV:
        store_partial(output.out, output.lse, (split * output.total_q + token) * NUM_HEADS
                      + head, d, row_ok, ok, out, lse)
    else:
        store_rows(output, token, head, d, row_ok, ok, out, lse)


@gluon.jit
def out_rows(q_start, q_len, kv_head, GROUP: gl.constexpr, GROUP_PAD: gl.constexpr,
             HEAD_DV: gl.constexpr, o_layout: gl.constexpr):
    """Where the program's rows go (row r: token r // GROUP_PAD, head kv_head * GROUP + r %
    GROUP_PAD): (token, head, d, row_ok, ok), d the columns and ok the [ROWS, HEAD_DV] mask
    of the rows stored (no padding row)."""
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
    d = gl.arange(0, HEAD_DV, layout=gl.SliceLayout(0, o_layout))
    q_tok = r // GROUP_PAD
    g = r % GROUP_PAD
    row_ok = (g < GROUP) & (q_tok < q_len)
    token = (q_start + q_tok).to(gl.int64)
    head = kv_head * GROUP + g
    ok = gl.expand_dims(row_ok, 1) & gl.expand_dims(d < HEAD_DV, 0)
    return token, head, d, row_ok, ok
