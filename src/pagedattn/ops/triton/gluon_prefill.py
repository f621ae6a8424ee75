"""The Gluon prefill kernel for Hopper (sm_90a): its shared memory, barriers and partitions.

Written for Triton 3.6's Gluon API (`attention_gluon.py` plans and launches it). This module
lays out the kernel's shared memory (Q buffers, the K / V rings, the fp8 staging ring) and
its mbarriers, and wires the partitions together; each partition is a module of its own, and
the items, key ranges, tiles and register split they share are `gluon_schedule.py`'s. The
entry groups its launch arguments and shared memory into a few structures (Triton
aggregates: `gluon_args.py`'s rings, rows, pages, scores, descales and output,
`gluon_schedule.py`'s items and key tiles), which the partitions take instead of long
argument lists; they compile to the instructions of the loose arguments. It imports nothing
but Triton, so it compiles for sm_90 on a machine without torch.

A persistent program walks work items (request, query head, query block of BLOCK_M = 128
rows, or 192 with three consumers); the query heads of one KV head are consecutive items,
so the programs running side by side read the same K/V tiles from L2. Items go heaviest
causal block first (the last block of each request), and with `LPT_ACROSS` block r of every
request before block r + 1 of any (of every request of its half of the batch, where the
batch's K/V exceeds L2: the halves run one after the other; `gluon_schedule.work_item`),
or, with `DYNAMIC`, as programs free up.

Partitions (`gl.warp_specialize`), all walking the same item sequence:
- the producer (`gluon_producer.py`; 1 warp, 40 registers, 24 for head 256) builds the
  tensor descriptors on the device, then TMA-loads the item's two 64-row Q halves and the
  key tiles into a NUM_BUF-slot ring of K and of V tiles, each slot guarded by a ready
  barrier (TMA bytes landed) and an empty barrier (both consumers done with it). Dense keys
  come as [BLOCK_N, D] boxes; the cached context as one [BOX, D] box per page.
- two consumers (`gluon_consumer.py`; 4 warps, 232 registers, 240 for head 256) own 64 query
  rows each and share every K/V tile, their softmax overlapping each other's wgmmas
  (ping-pong) and their own P V in flight. With BLOCK_M = 192 (head 64 alone, a 16-bit q
  over 16-bit K/V or an fp8 q over an fp8 cache: `SWITCHES.gluon_consumers`,
  `gluon_fp8_three_consumers`) three consumers at 160 registers take turns in a ring, and
  the producer's warpgroup (with the converter's warps) runs at 32.
- the converter (`gluon_convert.py`; 2 warps, with the producer's registers) turns an fp8
  cache's staged tiles into the consumers' 16-bit tiles; without an fp8 cache it idles.

Keys fall in two phases, as in the Hopper `tl` pass: phase A [0, a_end) with tiles anchored
at 0 (the cached context: pages, or dense rows), phase B [a_end, seq_len) anchored at a_end
(the new tokens' dense rows), so the causal diagonal is the same square for every chunk.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

try:
    from pagedattn.ops.triton.gluon_args import (
        Descales,
        Output,
        Pages,
        Ring,
        Rows,
        Scores,
        barriers,
    )
    from pagedattn.ops.triton.gluon_consumer import consumer
    from pagedattn.ops.triton.gluon_convert import converter
    from pagedattn.ops.triton.gluon_invariant import invariant_consumer
    from pagedattn.ops.triton.gluon_producer import producer
    from pagedattn.ops.triton.gluon_schedule import (
        CONSUMER_ROWS,
        ID_SLOTS,
        Items,
        KeyTiles,
        row_stores,
    )
except ImportError:  # compiled standalone, without torch (tools/gluon_sass.py)
    from gluon_args import Descales, Output, Pages, Ring, Rows, Scores, barriers
    from gluon_consumer import consumer
    from gluon_convert import converter
    from gluon_invariant import invariant_consumer
    from gluon_producer import producer
    from gluon_schedule import CONSUMER_ROWS, ID_SLOTS, Items, KeyTiles, row_stores


# Batch and layer ints are not specialised (1 or a multiple of 16 would each compile anew); the
# output strides are (the epilogue's stores), and the launcher keys them.
@gluon.jit(do_not_specialize=[
    "left", "right", "batch", "total_q", "num_items", "grid", "skip_q_len", "stride_q",
    "kv_rows", "stride_k", "stride_v", "stride_kc", "stride_vc", "page_rows", "head_rows",
    "head_cols_k", "head_cols_v", "stride_bt", "stride_ds_b", "stride_ds_h"])
def gluon_prefill_kernel(
    Q, K, V, KC, VC, Out, Lse, cu_seqlens_q, seqused_k, kv_index, alibi_slopes, sinks,
    q_descale, k_descale, v_descale, Work, qk_scale, softcap, left, right, batch, total_q,
    num_items, grid, skip_q_len, stride_q, kv_rows, stride_k, stride_v, stride_kc, stride_vc,
    page_rows, head_rows, head_cols_k, head_cols_v, stride_bt, stride_ot, stride_oh,
    stride_ds_b, stride_ds_h,
    NUM_HEADS: gl.constexpr, GROUP: gl.constexpr, HEAD_D: gl.constexpr,
    HEAD_DV: gl.constexpr, PAGE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    NUM_BUF: gl.constexpr, NUM_QBUF: gl.constexpr, STAGES: gl.constexpr,
    WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr, USE_ALIBI: gl.constexpr,
    USE_SOFTCAP: gl.constexpr, USE_SINKS: gl.constexpr, WRITE_LSE: gl.constexpr,
    PAGED: gl.constexpr, DENSE_ROWS: gl.constexpr, KV_FP8: gl.constexpr,
    KV_DESCALE: gl.constexpr, QK_FP8: gl.constexpr, Q_DESCALE: gl.constexpr,
    LPT_ACROSS: gl.constexpr, SCALE_IN_EXP: gl.constexpr, FP16_DOTS: gl.constexpr,
    DYNAMIC: gl.constexpr, PV_FP8: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, LANE_MASKS: gl.constexpr, INVARIANT_SPLIT: gl.constexpr = 0,
    INVARIANT_LEAN: gl.constexpr = False, FOLD_AT: gl.constexpr = -1,
    MAX_SLACK: gl.constexpr = -1, V_PRMT: gl.constexpr = False,
    P_WORDS: gl.constexpr = False, VT_COLS: gl.constexpr = 64,
    RESCALE_AFTER_PV: gl.constexpr = False, VT_PREFETCH: gl.constexpr = False,
    INVARIANT_SKIP: gl.constexpr = False,
):
    """Q [total_q, H, D] (heads packed, row stride stride_q); dense keys K / V [rows, H_kv,
    D(v)] (every key of a dense varlen batch, kv_rows rows; or with PAGED the new tokens',
    total_q rows: rows past them read as zeros; None without DENSE_ROWS); the paged caches
    KC / VC as kv_rows rows of consecutive slots per block and KV head (None without PAGED;
    fp8 with KV_FP8, then every key comes from them); kv_index: where each request's keys
    are, the block table [batch, pages] with PAGED, else cu_seqlens_k [batch + 1] (never
    both: one argument); Out [total_q, H, Dv] (strides stride_ot, stride_oh); Lse [H,
    total_q] float32 with WRITE_LSE; alibi_slopes / sinks [H] float32 or None; q_descale
    (Q_DESCALE), k_descale and v_descale (KV_DESCALE) float32 at seq * stride_ds_b + kv_head
    * stride_ds_h, else None. Work: the plan's float32 work area (`gluon_launch.work_words`),
    one argument for its two buffers (the entry stays at 40 runtime arguments), None where
    the launch uses neither: with DYNAMIC, words 0-1 are the item counters (int32 [next item,
    programs done], zero at launch, zero again after it: the last program resets them),
    padded to 128 bytes; from word FOLD_AT where >= 0 (`gluon_launch.fold_at`: batch-invariant
    mode above head 128, and at head 128 over 128-key tiles), the fold state [grid, BLOCK_M,
    Dv], a program's rows (`gluon_invariant.py`'s FOLD).
    QK_FP8 (with KV_FP8): Q K^T is an fp8 wgmma straight from the staging ring, and only V
    goes through the converter: q is fp8, or 16-bit over an fp8 cache, each consumer then
    splitting its rows in two e4m3 terms (`gluon_consumer`). PV_FP8 (with an fp8 q): P V
    is an fp8 wgmma too, P quantised to e4m3 per tile (`gluon_softmax`'s P_SHIFT), over V^T
    tiles the converter transposes in shared memory. DYNAMIC: programs take items
    from the counter in Work, else the static round-robin order. LANE_MASKS: masked tiles
    compare columns as per-lane constants (`gluon_softmax.mask_scores`; three consumers
    always do). INVARIANT_SPLIT > 0: batch-invariant mode's consumers
    (`gluon_invariant.py`: the `tl` invariant pass's operations per row, state restarted
    every INVARIANT_SPLIT keys; paged keys alone, two consumers, 16-bit products; compile
    with enable_fp_fusion=False); INVARIANT_LEAN: their work that cannot change a bit
    dropped (`gluon_invariant.py`'s LEAN); INVARIANT_SKIP: a consumer passes the tiles past
    the last key its rows see without their products (its SKIP). MAX_SLACK: the consumers' O rescale
    (`gluon_args.Scores`; -1: every tile).
    V_PRMT (with PV_FP8): the converter pairs V's bytes by PRMT (`gluon_convert.pair_bytes`;
    2: over the words ldmatrix delivered, `gluon_convert.word_bytes`).
    P_WORDS (with PV_FP8): P crosses the tile loop as words of four e4m3 keys
    (`gluon_operands.p_words`). VT_COLS (with PV_FP8): V's columns in each slab the
    converter transposes (64, or 128 with HEAD_DV >= 128: half its barriers a tile);
    VT_PREFETCH (VT_COLS 128): each of those slabs loaded a slab ahead.
    RESCALE_AFTER_PV: the consumers rescale O after the previous tile's P V wait, outside
    their ping-pong turn (FA3's fp8 order; `gluon_consumer`).
    Launch with num_warps=4 on `grid` programs (an argument: gl.num_programs() read in every
    partition is one value ptxas keeps across the partition switch, spilled where the
    producer is tight) and a global scratch allocator (the producer's tensor descriptors)."""
    ROWS: gl.constexpr = CONSUMER_ROWS
    # Consumer warpgroups of ROWS query rows each: two (BLOCK_M 128), or three (192: head 64
    # alone, where three accumulators fit the registers; `gluon_schedule.config_for`)
    PARTS: gl.constexpr = BLOCK_M // ROWS
    # P V's operand type: q's, or fp16 over an fp8 cache (FP16_DOTS: the converter's fp8 ->
    # fp16 is one instruction a pair; with a converted K the consumers convert a bf16 Q to
    # fp16 once an item; an fp8 or split q keeps Q K^T in fp8 and takes fp16 for P V).
    dtype: gl.constexpr = (gl.float16 if FP16_DOTS or Q.dtype.element_ty.is_fp8()
                           else Q.dtype.element_ty)
    q_smem = gl.allocate_shared_memory(  # [buffer * PARTS + consumer], q's dtype (TMA lands it)
        Q.dtype.element_ty, [NUM_QBUF * PARTS, ROWS, HEAD_D],
        gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_D], Q.dtype.element_ty))
    if PV_FP8:  # V^T [Dv, BLOCK_N] in the cache's fp8, keys contiguous: P V's fp8 B operand
        v_smem = gl.allocate_shared_memory(
            VC.dtype.element_ty, [NUM_BUF, HEAD_DV, BLOCK_N],
            gl.NVMMASharedLayout.get_default_for([HEAD_DV, BLOCK_N], VC.dtype.element_ty))
    else:
        v_smem = gl.allocate_shared_memory(
            dtype, [NUM_BUF, BLOCK_N, HEAD_DV],
            gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DV], dtype))
    q_ready = barriers(NUM_QBUF * PARTS, 1)
    q_empty = barriers(NUM_QBUF * PARTS, 1)
    turn = barriers(PARTS, 1)
    # Item ids from the producer to the consumers (and the converter, over an fp8 cache)
    ids = None
    id_ready = None
    id_empty = None
    if DYNAMIC:
        ids = gl.allocate_shared_memory(gl.int32, [ID_SLOTS, 32],
                                        gl.SwizzledSharedLayout(1, 1, 1, [0]))
        id_ready = barriers(ID_SLOTS, 1)
        id_empty = barriers(ID_SLOTS, PARTS + 1 if KV_FP8 else PARTS)
    v_ready = barriers(NUM_BUF, 1)
    v_empty = barriers(NUM_BUF, PARTS)  # every consumer releases each tile
    # A barrier exists only where a partition uses it: the allocator places an unused one
    # over live data (the fp8 staging ring's first bytes), where TMA writes would land on an
    # initialised mbarrier. A worker's argument cannot be None (aggregates' fields can): the
    # producer takes a placeholder, behind the constexpr that keeps it unread.
    if PAGED and not KV_FP8:  # the producer zeroes V page tails (the converter, fp8 ones)
        v_fix = barriers(1, 1).index(0)
    else:
        v_fix = q_ready.index(0)
    v_ring = Ring(v_smem, v_ready, v_empty, NUM_BUF, V_PRMT, VT_COLS, VT_PREFETCH)
    if KV_FP8:  # TMA -> fp8 staging ring -> converter -> the consumers' 16-bit ring
        k8_smem = gl.allocate_shared_memory(
            KC.dtype.element_ty, [STAGES, BLOCK_N, HEAD_D],
            gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_D], KC.dtype.element_ty))
        v8_smem = gl.allocate_shared_memory(
            VC.dtype.element_ty, [STAGES, BLOCK_N, HEAD_DV],
            gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DV], VC.dtype.element_ty))
        k8_ready = barriers(STAGES, 1)
        v8_ready = barriers(STAGES, 1)
        k8_empty = barriers(STAGES, PARTS if QK_FP8 else 1)  # QK_FP8: the consumers read K8
        v8_empty = barriers(STAGES, 1)
        k8_ring = Ring(k8_smem, k8_ready, k8_empty, STAGES)
        v8_ring = Ring(v8_smem, v8_ready, v8_empty, STAGES)
    if QK_FP8:  # the consumers read K from the fp8 ring; the converter does V alone
        k_ring = k8_ring
    else:
        k_smem = gl.allocate_shared_memory(
            dtype, [NUM_BUF, BLOCK_N, HEAD_D],
            gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_D], dtype))
        k_ring = Ring(k_smem, barriers(NUM_BUF, 1), barriers(NUM_BUF, PARTS), NUM_BUF)
    if not KV_FP8:  # the producer loads straight into the consumers' ring; the converter idles
        k8_ring = k_ring
        v8_ring = v_ring
    q_bufs = Ring(q_smem, q_ready, q_empty, NUM_QBUF)
    # Work's parts, each where the launch uses it (both compile-time facts)
    queue = None
    fold = None
    if DYNAMIC:  # the counters head Work
        queue = Work.to(gl.pointer_type(gl.int32), bitcast=True)
    if FOLD_AT >= 0:
        fold = Work + FOLD_AT
    items = Items(cu_seqlens_q, seqused_k, batch, num_items, grid, skip_q_len, queue, ids,
                  id_ready, id_empty, NUM_HEADS, GROUP, BLOCK_M, LPT_ACROSS, DYNAMIC)
    keys = KeyTiles(left, right, WINDOW_LEFT, WINDOW_RIGHT, BLOCK_M, BLOCK_N, DENSE_ROWS)
    scores = Scores(qk_scale, softcap, alibi_slopes, sinks, USE_ALIBI, USE_SOFTCAP, USE_SINKS,
                    SCALE_IN_EXP, LANE_MASKS or PARTS == 3, MAX_SLACK, P_WORDS,
                    RESCALE_AFTER_PV)
    descales = Descales(q_descale, k_descale, v_descale, stride_ds_b, stride_ds_h, Q_DESCALE,
                        KV_DESCALE)
    # The 4 KB O staging of 16-byte stores, where shared memory has room (`row_stores`)
    output = Output(Out, Lse, total_q, stride_ot, stride_oh, WRITE_LSE,
                    row_stores(QK_FP8, KV_FP8, PV_FP8, HEAD_DV, BLOCK_N), fold)
    # Dense rows: every key's (kv_rows of them, request s from row cu_seqlens_k[s]), or
    # beside the cache the new tokens' (one per query)
    rows = Rows(Q, total_q, stride_q, K, V, total_q if PAGED else kv_rows, stride_k, stride_v,
                None if PAGED else kv_index, DENSE_ROWS)
    pages = Pages(KC, VC, kv_index if PAGED else None, kv_rows, stride_kc, stride_vc,
                  page_rows, head_rows, head_cols_k, head_cols_v, stride_bt, PAGE, PAGED)
    consumer_args = (q_bufs, k_ring, v_ring, turn, items, keys, scores, descales, output)
    producer_args = (rows, pages, q_bufs, k8_ring, v8_ring, v_fix, items, keys)
    converter_args = (k8_ring, v8_ring, k_ring, v_ring, items, keys)
    # Consumer 0 is the default partition. (A list of partitions cannot be a variable, nor
    # be joined with `+` without losing its constexprs, so each form's list is written out;
    # a tuple variable turns constexprs into tensors: the arguments above hold none.)
    if INVARIANT_SPLIT:
        gl.warp_specialize(
            [(invariant_consumer, (0, INVARIANT_SPLIT, INVARIANT_LEAN, INVARIANT_SKIP)
              + consumer_args),
             (invariant_consumer, (1, INVARIANT_SPLIT, INVARIANT_LEAN, INVARIANT_SKIP)
              + consumer_args),
             (producer, producer_args), (converter, converter_args)],
            [4, 1, 2], [CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS])
    elif PARTS == 3:
        gl.warp_specialize(
            [(consumer, (0, ) + consumer_args), (consumer, (1, ) + consumer_args),
             (consumer, (2, ) + consumer_args), (producer, producer_args),
             (converter, converter_args)],
            [4, 4, 1, 2], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize(
            [(consumer, (0, ) + consumer_args), (consumer, (1, ) + consumer_args),
             (producer, producer_args), (converter, converter_args)],
            [4, 1, 2], [CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS])
