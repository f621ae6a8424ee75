"""Batch-invariant mode's decodes on the Gluon decode pass's layout (Hopper, sm_90a): each row
by the operations of the `tl` batch-invariant pass, in their order, so its output and LSE
have that pass's bits.

The program is the Gluon decode pass's (`gluon_decode.py`): a request's decode queries x a
KV head's query heads as one 64-row wgmma tile (row = q_tok * GROUP_PAD + g, GQA packed), a
producer warp TMA-loading a [PAGE, D] box per page into mbarrier rings, two converter warps
for an fp8 cache (both in `gluon_decode_invariant_loads.py`, with the keys each program
reads). What a row's bits depend on is the `tl` invariant pass's
(`invariant.attend_fixed_splits`), and the Gluon prefill pass's invariant consumer already
performs it per row (`gluon_invariant.py`, bit-equal on the H200); this consumer calls its
steps:
- key tiles of BLOCK_N (the `tl` pass's block_n) anchored at key 0; splits of SPLIT_KEYS
  keys at absolute positions, the state restarted at each (`finish_split`) and the splits
  folded in increasing order (`fold_split`), the sink in split 0's state, or folded alone
  first where the keys start past split 0;
- the products in the `tl` pass's operand dtype (DOT_F16: fp16, else bf16): q converted in
  registers (an e4m3 or bf16 q to fp16 as `.to(DOT_DTYPE)` does), fp8 K AND V converted to
  16 bits by the converter (never an fp8 wgmma: its sums may round apart); wgmma
  m64nBLOCK_Nk16 for Q K^T, m64nDVk16 for P V into the accumulator itself (acc * alpha
  first, as `tl.dot(p, v, acc)`);
- per tile `gluon_invariant_tile.exact_tile` (S * qk, soft cap, the mask as a select, the exact
  softmax step with the row sum over the wgmma accumulator's layout); qk is the launch's
  scale times the q descale, then the k descale;
- SPLIT_KV False: every split folded in the program, then lse * ln 2 and out + 0.0, as
  `attention._attention_program`; SPLIT_KV: program z computes split z alone and writes its
  state (log2 units) where `invariant.fold_splits_kernel` folds it, as the `tl` pass's split
  programs do;
- no fused multiply-adds: the launch compiles with enable_fp_fusion=False;
- head 256 (`SWITCHES.invariant_gluon_256`; Fold given): O and a second float32 state do not
  fit the consumer's registers, so each split's state goes to memory as
  `gluon_invariant_fold.fold_in_memory` has it (SPLIT_KV: the split's partial; else the fold
  state in Fold, read back for the rows), the prompts' consumer doing the same: these
  rows are not the `tl` pass's, which such a layer never runs.
- FOLD_MEM (`SWITCHES.invariant_tiles_128`, heads 64 / 128, unsplit programs): the fold
  state in Fold as at head 256, which frees the registers the running fold held (at
  128-key tiles it spilled beside a split's O, S and P), its columns made at each use
  (`gluon_invariant_fold.fold_rows`' FRESH: made once before the split loop, they spilled).
  `fold_in_memory` performs `fold_split`'s operations in split order (a first fold: the
  select an empty fold reduces to), so these rows keep the `tl` pass's bits.
- Fold's rows (unsplit programs): a row's element is written and read back by the thread
  holding it in the accumulator's layout, so any place of its own serves; the plan takes
  the smaller of two: a token's (Fold [total_q, H, Dv], row token * H + head: a step of
  decodes alone) or, FOLD_BY_PROGRAM, a program's (Fold [batch, NUM_KV, QUERIES * GROUP_PAD,
  Dv], its rows r: a step whose prompts' tokens outnumber the decodes' padded rows).
The schedule (rings, P V beside the next S) does not enter a row's bits. Imports nothing but
Triton, so it compiles for sm_90 on a machine without torch (tools/gluon_decode_sass.py).
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
    from pagedattn.ops.triton.gluon_args import (
        Descales,
        Output,
        Pages,
        Scores,
        barriers,
        store_partial,
        store_rows,
        tile_ring,
    )
    from pagedattn.ops.triton.gluon_decode import UNSPECIALIZED, load_q, out_rows
    from pagedattn.ops.triton.gluon_decode_fold import publish_and_fold
    from pagedattn.ops.triton.gluon_decode_invariant_loads import (
        converter,
        live_program,
        producer,
        program_keys,
    )
    from pagedattn.ops.triton.gluon_invariant_fold import (
        finish_split,
        first_fold_of_sink,
        fold_in_memory,
        fold_rows,
        fold_sink,
        fold_split,
    )
    from pagedattn.ops.triton.gluon_invariant_tile import exact_tile
    from pagedattn.ops.triton.gluon_operands import p_operand, p_operand_layout, pv_wait
    from pagedattn.ops.triton.gluon_schedule import KeyTiles
    from pagedattn.ops.triton.gluon_softmax import LOG2E, lazy_rescale, scores_layout
except ImportError:  # compiled standalone, without torch (tools/gluon_decode_sass.py)
    from gluon_args import (
        Descales,
        Output,
        Pages,
        Scores,
        barriers,
        store_partial,
        store_rows,
        tile_ring,
    )
    from gluon_decode import UNSPECIALIZED, load_q, out_rows
    from gluon_decode_fold import publish_and_fold
    from gluon_decode_invariant_loads import converter, live_program, producer, program_keys
    from gluon_invariant_fold import (
        finish_split,
        first_fold_of_sink,
        fold_in_memory,
        fold_rows,
        fold_sink,
        fold_split,
    )
    from gluon_invariant_tile import exact_tile
    from gluon_operands import p_operand, p_operand_layout, pv_wait
    from gluon_schedule import KeyTiles
    from gluon_softmax import LOG2E, lazy_rescale, scores_layout

LN2 = gl.constexpr(0.6931471805599453)
ROWS = gl.constexpr(64)  # one wgmma tile of rows: the consumer warpgroup's

# (NUM_BUF, STAGES, WORKER_REGS) by (head size, fp8 cache, BLOCK_N: the `tl` pass's block_n),
# one program a SM (the fold's second float32 state leaves no registers for two): 16-bit K/V
# rings filling most of the shared memory (h128: 6 slots of 64 keys, 192 KB); over an fp8
# cache, fp8 staging slots beside the 16-bit rings the converter fills (h128: 4 + 4, 192
# KB). 128-key tiles: half the slots, the same bytes. Head 256 (64-key tiles alone, the
# prompts' consumer's): 16-bit rings of 2 slots (160 KB with Q), over fp8 2 + 1 (192 KB).
TILES = {(256, False, 64): (2, 1, 40), (256, True, 64): (2, 1, 72),
         (64, False, 64): (8, 1, 40), (128, False, 64): (6, 1, 40),
         (64, True, 64): (6, 6, 72), (128, True, 64): (4, 4, 72),
         (64, False, 128): (4, 1, 40), (128, False, 128): (3, 1, 40),
         (64, True, 128): (3, 3, 72), (128, True, 128): (2, 2, 72)}


@gluon.jit(do_not_specialize=UNSPECIALIZED)
def gluon_decode_invariant_kernel(
    Q, KC, VC, Out, Lse, cu_seqlens_q, seqused_k, block_table, sinks, q_descale, k_descale,
    v_descale, qk_scale, softcap, left, right, total_q, num_splits, stride_qt, kv_rows,
    stride_kc, stride_vc, page_rows, head_rows, head_cols_k, head_cols_v, stride_bt,
    stride_ot, stride_oh, stride_ds_b, stride_ds_h, Fold, PartOut, PartLse, Tickets,
    NUM_KV: gl.constexpr, GROUP: gl.constexpr, GROUP_PAD: gl.constexpr, QUERIES: gl.constexpr,
    HEAD_D: gl.constexpr, HEAD_DV: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr,
    NUM_BUF: gl.constexpr, STAGES: gl.constexpr, WINDOW_LEFT: gl.constexpr,
    WINDOW_RIGHT: gl.constexpr, USE_SOFTCAP: gl.constexpr, USE_SINKS: gl.constexpr,
    WRITE_LSE: gl.constexpr, SPLIT_KV: gl.constexpr, KV_FP8: gl.constexpr,
    KV_DESCALE: gl.constexpr, Q_DESCALE: gl.constexpr, DOT_F16: gl.constexpr,
    SPLIT_KEYS: gl.constexpr, WORKER_REGS: gl.constexpr, SCALE_IN_EXP: gl.constexpr = False,
    FOLD_MEM: gl.constexpr = False, FOLD_BY_PROGRAM: gl.constexpr = False,
    SELF_FOLD: gl.constexpr = False, MAX_SLACK: gl.constexpr = -1,
):
    """`gluon_decode.gluon_decode_kernel`'s arguments (the launcher fills both alike), with
    qk_scale / softcap as the `tl` invariant pass takes them (`attention_args.batch_section`:
    softmax_scale * log2(e), or softmax_scale * (1 / softcap) and softcap * log2(e)).
    DOT_F16: the products' dtype is fp16 (else bf16): a 16-bit cache is of that dtype, an
    fp8 one (KV_FP8, e4m3) is converted to it. SPLIT_KEYS: the fixed split's keys, a multiple
    of BLOCK_N. SPLIT_KV: grid (batch, NUM_KV, splits), Out / Lse the fold's partials
    [splits, total_q, H, Dv] / [splits, total_q, H] float32 in log2 units; else grid (batch,
    NUM_KV, 1), Out [total_q, H, Dv] and with WRITE_LSE Lse [H, total_q] float32.
    SCALE_IN_EXP: the score scale in the exponent's fma (`gluon_invariant_tile.exact_tile`; the
    `tl` pass's form under `SWITCHES.invariant_scale_in_exp`, never with a soft cap).
    Fold: the fold state (float32, FOLD_BY_PROGRAM's rows) of unsplit programs at heads above 128
    and of FOLD_MEM's (`gluon_invariant_fold.fold_in_memory`; split programs at heads above 128
    write their partials so too), else None. FOLD_MEM: an unsplit program at heads 64 / 128
    keeps its fold there too (`SWITCHES.invariant_tiles_128`: at 128-key tiles the running
    fold beside a split's O, S and P spills), by the same operations in the same order, so
    the rows keep the `tl` pass's bits; False leaves today's code untouched.
    FOLD_BY_PROGRAM: Fold [batch, NUM_KV, QUERIES * GROUP_PAD, Dv], the unsplit programs'
    rows, else [total_q, H, Dv] (see above).
    SELF_FOLD (SPLIT_KV, heads 64 / 128; `SWITCHES.invariant_self_fold`): Out / Lse are the
    outputs as an unsplit launch's, PartOut / PartLse the partials, Tickets [batch, NUM_KV]
    int32 (zero between launches): the last split program of a request folds
    (`gluon_decode_fold.py`); else the three are None.
    MAX_SLACK > 0: the running max's slack (`SWITCHES.invariant_max_slack`, as every pass:
    `gluon_invariant_tile.exact_tile`); >= 0: O's rescale skipped by a warp none of whose rows
    moved its max (`gluon_softmax.lazy_rescale`, round-to-nearest multiplies; 0:
    `SWITCHES.invariant_lazy_rescale`, the same bits); -1 none, O rescaled every tile.
    num_warps=4, a global scratch allocator (the producer's two tensor descriptors), compiled
    with enable_fp_fusion=False."""
    dtype: gl.constexpr = gl.float16 if DOT_F16 else gl.bfloat16
    q_smem = gl.allocate_shared_memory(dtype, [ROWS, HEAD_D],
                                       gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_D],
                                                                            dtype))
    k_ring = tile_ring(dtype, NUM_BUF, BLOCK_N, HEAD_D)
    v_ring = tile_ring(dtype, NUM_BUF, BLOCK_N, HEAD_DV)
    if KV_FP8:  # TMA -> fp8 staging rings -> converter -> the consumer's 16-bit rings
        k8_ring = tile_ring(KC.dtype.element_ty, STAGES, BLOCK_N, HEAD_D)
        v8_ring = tile_ring(VC.dtype.element_ty, STAGES, BLOCK_N, HEAD_DV)
        v_fix = v8_ring.ready.index(0)  # unread placeholder (the converter zeroes tails)
    else:
        k8_ring = k_ring  # the producer loads straight into the consumer's rings
        v8_ring = v_ring
        # the producer's private barrier for V tiles it zeroes the tail of (a barrier
        # exists only where a partition uses it: `gluon_decode.py` says why)
        v_fix = barriers(1, 1).index(0)
    pages = Pages(KC, VC, block_table, kv_rows, stride_kc, stride_vc, page_rows, head_rows,
                  head_cols_k, head_cols_v, stride_bt, PAGE, True)
    keys = KeyTiles(left, right, WINDOW_LEFT, WINDOW_RIGHT, ROWS, BLOCK_N, False)
    scores = Scores(qk_scale, softcap, None, sinks, False, USE_SOFTCAP, USE_SINKS, SCALE_IN_EXP,
                    MAX_SLACK=MAX_SLACK)
    descales = Descales(q_descale, k_descale, v_descale, stride_ds_b, stride_ds_h, Q_DESCALE,
                        KV_DESCALE)
    output = Output(Out, Lse, total_q, stride_ot, stride_oh, WRITE_LSE, False, Fold)
    # The argument tuples are written out in the call (`gluon_decode.py` says why).
    gl.warp_specialize(
        [(_consumer, (Q, output, cu_seqlens_q, seqused_k, descales, stride_qt, q_smem, k_ring,
                      v_ring, keys, scores, NUM_KV, GROUP, GROUP_PAD, QUERIES, SPLIT_KEYS,
                      SPLIT_KV, FOLD_MEM, FOLD_BY_PROGRAM, PartOut, PartLse, Tickets,
                      SELF_FOLD)),
         (producer, (pages, cu_seqlens_q, seqused_k, k8_ring, v8_ring, v_fix, keys, NUM_KV,
                     QUERIES, SPLIT_KEYS, SPLIT_KV)),
         (converter, (cu_seqlens_q, seqused_k, k8_ring, v8_ring, k_ring, v_ring, keys,
                      QUERIES, SPLIT_KEYS, SPLIT_KV))],
        [1, 2], [WORKER_REGS, WORKER_REGS])


@gluon.jit
def _consumer(Q, output, cu_seqlens_q, seqused_k, descales, stride_qt, q_smem, k_ring, v_ring,
              keys, scores, NUM_KV: gl.constexpr, GROUP: gl.constexpr,
              GROUP_PAD: gl.constexpr, QUERIES: gl.constexpr, SPLIT_KEYS: gl.constexpr,
              SPLIT_KV: gl.constexpr, FOLD_MEM: gl.constexpr,
              FOLD_BY_PROGRAM: gl.constexpr = False, PartOut=None, PartLse=None, Tickets=None,
              SELF_FOLD: gl.constexpr = False):
    """The program's splits in order, each a fresh softmax state over its tiles (tile j's S
    issued beside tile j - 1's P V), finished and folded (FOLD_MEM, or a head above 128:
    into output.fold, or a split program's partial); then the rows (or the split's partial
    state) stored."""
    BLOCK_N: gl.constexpr = keys.BLOCK_N
    HEAD_DV: gl.constexpr = v_ring.smem.shape[2]
    NUM_HEADS: gl.constexpr = NUM_KV * GROUP
    dtype: gl.constexpr = v_ring.smem.dtype
    s_layout: gl.constexpr = scores_layout(BLOCK_N, dtype)
    o_layout: gl.constexpr = scores_layout(HEAD_DV, dtype)
    p_layout: gl.constexpr = p_operand_layout(o_layout, dtype)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    seq, q_start, q_len, seq_len, context, key_lo, key_hi, full_lo, full_hi, lo, hi, n = \
        program_keys(cu_seqlens_q, seqused_k, keys, QUERIES, SPLIT_KEYS, SPLIT_KV)
    if live_program(q_len, seq_len, QUERIES, SPLIT_KEYS, SPLIT_KV):
        kv_head = gl.program_id(1)
        split = gl.program_id(2)
        # The `tl` pass's order: the launch's scale, times the q descale, times the k's.
        qk = scores.qk_scale
        v_scale = 1.0
        ds = seq.to(gl.int64) * descales.stride_b + kv_head * descales.stride_h
        if descales.Q_DESCALE:
            qk = qk * gl.load(descales.q + ds)
        if descales.KV_DESCALE:
            qk = qk * gl.load(descales.k + ds)
            v_scale = gl.load(descales.v + ds)
        offs_m = gl.arange(0, ROWS, layout=s_rows)
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        q_pos = context + offs_m // GROUP_PAD
        slope = gl.zeros([ROWS], gl.float32, layout=s_rows)  # no ALiBi (refused)
        sink = gl.full([ROWS], float("-inf"), gl.float32, layout=s_rows)
        if scores.USE_SINKS:  # `tile_loop.init_state`'s value
            g = offs_m % GROUP_PAD
            sink = gl.load(scores.sinks + kv_head * GROUP + g, mask=g < GROUP,
                           other=0.0) * LOG2E
        load_q(Q, q_smem, q_start, q_len, kv_head, stride_qt, GROUP, GROUP_PAD)
        s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
        # Head 256: the split states in memory (split programs: their partials; else Fold);
        # FOLD_MEM: an unsplit program's fold in Fold at heads 64 / 128 (128-key tiles)
        FOLD: gl.constexpr = HEAD_DV > 128 or FOLD_MEM
        lse2 = gl.full([ROWS], float("-inf"), gl.float32, layout=o_rows)
        if FOLD:  # the rows of the fold state (unsplit) or of this split's partial
            token, head, _, row_ok, _ = out_rows(q_start, q_len, kv_head, GROUP, GROUP_PAD,
                                                 HEAD_DV, o_layout)
            if SPLIT_KV:
                fold_mem = output.out
                fold_row = ((split * output.total_q + token) * NUM_HEADS + head) * HEAD_DV
            elif FOLD_BY_PROGRAM:  # the program's own rows r (padding rows never stored)
                fold_mem = output.fold
                r = gl.arange(0, ROWS, layout=o_rows)
                fold_row = ((seq.to(gl.int64) * NUM_KV + kv_head) * (QUERIES * GROUP_PAD) + r) \
                    * HEAD_DV
            else:
                fold_mem = output.fold
                fold_row = (token * NUM_HEADS + head) * HEAD_DV
            folded = False
        else:
            out = gl.zeros([ROWS, HEAD_DV], gl.float32, layout=o_layout)
        if SPLIT_KV:
            first = split
            last = split + 1
        else:  # `invariant.attend_fixed_splits`' range of splits
            first = key_lo // SPLIT_KEYS
            last = gl.cdiv(key_hi, SPLIT_KEYS)
            if scores.USE_SINKS:
                if FOLD:  # `fold_sink`'s split as the first fold where first > 0, unbranched
                    lse2, folded = first_fold_of_sink(fold_mem, fold_row, row_ok, sink,
                                                      v_scale, first > 0, o_layout, HEAD_DV,
                                                      FOLD_MEM)
                elif first > 0:  # split 0 holds the sink and none of these rows' keys
                    out, lse2 = fold_sink(out, lse2, sink, v_scale, o_layout)
        for s in range(first, last):
            # `gluon_invariant`'s split start, copied: shared, it changed that kernel's SASS
            m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=s_rows)
            l_i = gl.zeros([ROWS], gl.float32, layout=s_rows)
            if scores.USE_SINKS:  # `tile_loop.init_state` of split 0
                m_i = gl.where(s == 0, sink, m_i)
                l_i = gl.where(s == 0, 1.0, l_i)
            acc = gl.zeros([ROWS, HEAD_DV], gl.float32, layout=o_layout)
            # the split's tiles [j0, j1) of the program's (tiles never cross a split's edge)
            j0 = (gl.maximum(s * SPLIT_KEYS, lo) - lo) // BLOCK_N
            j1 = gl.cdiv(gl.maximum(gl.minimum((s + 1) * SPLIT_KEYS, hi) - lo, 0), BLOCK_N)
            if j1 > j0:
                acc, l_i, m_i = _split_tiles(acc, l_i, m_i, j0, j1, lo, q_smem, k_ring, v_ring,
                                             s_zero, offs_n, q_pos, slope, qk, full_lo,
                                             full_hi, seq_len, scores, keys, p_layout,
                                             o_rows)
            o, o_lse2 = finish_split(acc, gl.convert_layout(m_i, o_rows),
                                     gl.convert_layout(l_i, o_rows), v_scale)
            if FOLD:
                lse2, folded = fold_in_memory(fold_mem, fold_row, row_ok, lse2, folded, o,
                                              o_lse2, FOLD_MEM)
            else:
                out, lse2 = fold_split(out, lse2, o, o_lse2)
        token, head, d, row_ok, ok = out_rows(q_start, q_len, kv_head, GROUP, GROUP_PAD,
                                              HEAD_DV, o_layout)
        if FOLD:
            if SPLIT_KV:  # the partial is in place (its one split's select); its LSE next
                gl.store(output.lse + (split * output.total_q + token) * NUM_HEADS + head,
                         lse2, mask=row_ok)
            else:  # the folded rows back (zeros where nothing was folded: lse2 is -inf)
                out = gl.load(fold_rows(fold_mem, fold_row, o_layout, HEAD_DV, FOLD_MEM),
                              mask=gl.expand_dims(row_ok & folded, 1), other=0.0)
                # + 0.0: -0.0 -> 0.0 (`invariant.fold_splits_kernel` says why)
                store_rows(output, token, head, d, row_ok, ok, out + 0.0, lse2 * LN2)
        elif SELF_FOLD:  # the partial, then the last split program folds them all
            publish_and_fold(output, PartOut, PartLse, Tickets + seq * NUM_KV + kv_head,
                             (split * output.total_q + token) * NUM_HEADS + head, token,
                             head, d, row_ok, ok, out, lse2, seq_len, SPLIT_KEYS, NUM_HEADS,
                             o_layout)
        elif SPLIT_KV:  # log2 units, for the fold
            store_partial(output.out, output.lse, (split * output.total_q + token) * NUM_HEADS
                          + head, d, row_ok, ok, out, lse2)
        else:  # after `_attention_program`'s last two operations (+ 0.0: -0.0 -> 0.0,
            # `invariant.fold_splits_kernel` says why)
            store_rows(output, token, head, d, row_ok, ok, out + 0.0, lse2 * LN2)


@gluon.jit
def _split_tiles(acc, l_i, m_i, j0, j1, lo, q_smem, k_ring, v_ring, s_zero, offs_n, q_pos,
                 slope, qk, full_lo, full_hi, seq_len, scores, keys, p_layout: gl.constexpr,
                 o_rows: gl.constexpr):
    """One split's tiles j0 .. j1 - 1 (j1 > j0) of the program's (tile j: keys from lo + j *
    BLOCK_N, ring slot j) into its state (acc, l_i, m_i): the prefill invariant consumer's
    pipeline with one consumer. Returns (acc, l_i, m_i)."""
    BLOCK_N: gl.constexpr = keys.BLOCK_N
    dtype: gl.constexpr = v_ring.smem.dtype
    # O's rescale skipped by a warp none of whose rows moved its max: alpha is then exactly 1
    # on each (`exact_tile`), and the RN multiplies make O * 1 O, so the bits hold
    LAZY: gl.constexpr = scores.MAX_SLACK >= 0
    # `gluon_decode._consumer`'s loop but for the exact step and the P V wait (the bits need both)
    # Tile j0: S only; its P V is issued beside the next tile's S.
    ks = j0 % k_ring.SLOTS
    k_s = k_ring.smem.index(ks)
    mbarrier.wait(k_ring.ready.index(ks), (j0 // k_ring.SLOTS) & 1)
    s = warpgroup_mma(q_smem, k_s.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=[s, q_smem, k_s])[0]
    mbarrier.arrive(k_ring.empty.index(ks))
    p, alpha, l_i, m_i = exact_tile(s, m_i, l_i, lo + j0 * BLOCK_N, offs_n, q_pos, slope, qk,
                                    full_lo, full_hi, seq_len, scores, keys)
    p16 = p_operand(p, dtype, p_layout)
    for j in range(j0 + 1, j1):
        ks = j % k_ring.SLOTS
        prev = (j - 1) % v_ring.SLOTS
        k_s = k_ring.smem.index(ks)
        v_s = v_ring.smem.index(prev)
        mbarrier.wait(k_ring.ready.index(ks), (j // k_ring.SLOTS) & 1)
        s = warpgroup_mma(q_smem, k_s.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        if LAZY:
            acc = lazy_rescale(acc, alpha, True)
        else:
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
        mbarrier.wait(v_ring.ready.index(prev), ((j - 1) // v_ring.SLOTS) & 1)
        acc = warpgroup_mma(p16, v_s, acc, is_async=True)
        s = warpgroup_mma_wait(1, deps=[s, q_smem, k_s])[0]
        mbarrier.arrive(k_ring.empty.index(ks))
        p, alpha, l_i, m_i = exact_tile(s, m_i, l_i, lo + j * BLOCK_N, offs_n, q_pos, slope,
                                        qk, full_lo, full_hi, seq_len, scores, keys)
        p_next = p_operand(p, dtype, p_layout)
        # The next P a dependency of the wait: its exponentials run under this P V
        # (`gluon_invariant.invariant_consumer` says why)
        done = warpgroup_mma_wait(0, deps=[acc, v_s, p16, p_next])
        acc = done[0]
        p16 = done[3]
        mbarrier.arrive(v_ring.empty.index(prev))
    last = (j1 - 1) % v_ring.SLOTS
    v_s = v_ring.smem.index(last)
    if LAZY:
        acc = lazy_rescale(acc, alpha, True)
    else:
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
    mbarrier.wait(v_ring.ready.index(last), ((j1 - 1) // v_ring.SLOTS) & 1)
    acc = warpgroup_mma(p16, v_s, acc, is_async=True)
    acc = pv_wait(acc, v_s, p16)
    mbarrier.arrive(v_ring.empty.index(last))
    return acc, l_i, m_i
