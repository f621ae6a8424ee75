"""The Gluon prefill kernel's arguments as structures: what its partitions take.

The kernel entry (`gluon_prefill.py`) receives flat launch arguments and groups them here
into a few named structures, so a partition takes a handful of them, not 50 loose values
(FA3 passes a `Params` struct; Triton's Gluon examples, `aggregate` objects). A structure
is Triton's aggregate: a Python-side grouping of IR values and constexprs, flattened where
it crosses `gl.warp_specialize`, so it costs no instruction (the sm_90 SASS is the loose
arguments'). The item walk and the key tiles are `gluon_schedule.Items` / `Tiles`.

- `Ring`: shared-memory slots with their ready / empty barriers (the K / V rings, the fp8
  staging rings, the Q buffers); `release_unread`: a slot given back unread; `barriers`: a
  set of initialised mbarriers, as the kernel entries (`gluon_prefill.py`,
  `gluon_decode.py`) allocate them for their rings; `tile_ring`: a ring of key tiles and
  its one-arrival barriers, as the decode kernels' entries (`gluon_decode.py`,
  `gluon_decode_invariant.py`) allocate theirs.
- `Rows`: what TMA reads as rows [rows, heads * d]: q, and dense keys / values.
- `Pages`: a paged cache as rows of consecutive slots per block and KV head (the host's
  `tma_views.CacheRows`) and its block table.
- `Scores`: how a consumer turns raw scores into softmax weights (scale, soft cap, ALiBi,
  sinks); `Descales`: the fp8 descales per (sequence, KV head); `Output`: O and the LSE;
  `store_rows` / `store_partial`: the decode kernels' rows into an `Output` or a split's
  float32 partials (`gluon_decode.py`, `gluon_decode_invariant.py`, `gluon_decode_fold.py`).

An absent tensor (a None launch argument) is a constexpr None field, left unread behind
the constexpr switch that says it is absent. Imports nothing but Triton.
"""

from __future__ import annotations

import typing

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier
from triton.language.core import _aggregate, base_value

# Fields holding a tensor or shared memory, or a constexpr (None where it is absent)
MaybeTensor = gl.tensor | gl.constexpr
MaybeSmem = gl.shared_memory_descriptor | gl.constexpr


def aggregate(cls):
    """Triton 3.6's aggregate decorator (`gluon.aggregate` from 3.7) on a class of this
    package, whose annotations are strings (`from __future__ import annotations`): they are
    evaluated first, as its field checks need the types."""
    cls.__annotations__ = typing.get_type_hints(cls)
    return _aggregate(cls)


@gluon.constexpr_function
def maybe(x):
    """A field's value: an IR value (a tensor, shared memory) as it is, anything else (None,
    a Python number) as a constexpr. (A constexpr function: Triton lets an aggregate's
    constructor call only those.)"""
    return x if isinstance(x, base_value) else gl.constexpr(x)


@gluon.jit
def barriers(n: gl.constexpr, count: gl.constexpr):
    """n mbarriers [n, 1] in shared memory, initialised to `count` arrivals, fenced."""
    bars = gl.allocate_shared_memory(gl.int64, [n, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(n):
        mbarrier.init(bars.index(i), count=count)
    fence_async_shared()
    return bars


@aggregate
class Ring:
    """SLOTS slots `smem` [SLOTS * k, ...], slot s guarded by ready.index(s) (its data landed)
    and empty.index(s) (its readers are done with it). PRMT (an fp8 V^T ring): the converter
    pairs V's bytes by `gluon_convert.pair_bytes`' PRMT on packed words (2: by
    `gluon_convert.word_bytes`' on the words ldmatrix delivered); VT_COLS: V's columns in
    each of its slabs (64, or 128: half the barriers, `gluon_convert.transpose_tile`);
    VT_PREFETCH: those 128-column slabs loaded a slab ahead."""

    smem: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor
    SLOTS: gl.constexpr
    PRMT: gl.constexpr
    VT_COLS: gl.constexpr
    VT_PREFETCH: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, smem, ready, empty, SLOTS, PRMT=False, VT_COLS=64, VT_PREFETCH=False):
        self.smem = smem
        self.ready = ready
        self.empty = empty
        self.SLOTS = gl.constexpr(SLOTS)
        self.PRMT = gl.constexpr(PRMT)
        self.VT_COLS = gl.constexpr(VT_COLS)
        self.VT_PREFETCH = gl.constexpr(VT_PREFETCH)


@gluon.jit
def release_unread(ring, t):
    """Tile t's slot of `ring` released unread (a consumer that needs none of its keys), once
    the producer has filled it: an arrival before would count toward the slot's last use."""
    slot = t % ring.SLOTS
    mbarrier.wait(ring.ready.index(slot), (t // ring.SLOTS) & 1)
    mbarrier.arrive(ring.empty.index(slot))


@gluon.jit
def tile_ring(dtype: gl.constexpr, SLOTS: gl.constexpr, BLOCK_N: gl.constexpr,
              D: gl.constexpr):
    """A Ring of SLOTS [BLOCK_N, D] tiles of dtype in the NVMMA layout TMA and wgmma take,
    each slot's ready and empty barriers expecting one arrival (one producer, one reader)."""
    smem = gl.allocate_shared_memory(dtype, [SLOTS, BLOCK_N, D],
                                     gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dtype))
    return Ring(smem, barriers(SLOTS, 1), barriers(SLOTS, 1), SLOTS)


@aggregate
class Rows:
    """q [total_q, H * D] rows (row stride stride_q), and with DENSE the dense keys k / v as
    [kv_rows, H_kv * D(v)] rows (every key of a dense batch, request s from row
    cu_seqlens_k[s]; or beside a paged cache the new tokens', total_q rows, cu_seqlens_k
    absent)."""

    q: gl.tensor
    total_q: gl.tensor
    stride_q: gl.tensor
    k: MaybeTensor
    v: MaybeTensor
    kv_rows: gl.tensor
    stride_k: gl.tensor
    stride_v: gl.tensor
    cu_seqlens_k: MaybeTensor
    DENSE: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, q, total_q, stride_q, k, v, kv_rows, stride_k, stride_v, cu_seqlens_k,
                 DENSE):
        self.q = q
        self.total_q = total_q
        self.stride_q = stride_q
        self.k = maybe(k)
        self.v = maybe(v)
        self.kv_rows = kv_rows
        self.stride_k = stride_k
        self.stride_v = stride_v
        self.cu_seqlens_k = maybe(cu_seqlens_k)
        self.DENSE = gl.constexpr(DENSE)


@aggregate
class Pages:
    """With PAGED, the caches k / v as `rows` rows of consecutive slots per block and KV
    head (row strides stride_k / stride_v): block b, KV head h, slot s at row
    b * page_rows + h * head_rows + s, column h * cols_k (cols_v); block_table [batch,
    pages] (row stride stride_bt); PAGE slots a block."""

    k: MaybeTensor
    v: MaybeTensor
    block_table: MaybeTensor
    rows: gl.tensor
    stride_k: gl.tensor
    stride_v: gl.tensor
    page_rows: gl.tensor
    head_rows: gl.tensor
    cols_k: gl.tensor
    cols_v: gl.tensor
    stride_bt: gl.tensor
    PAGE: gl.constexpr
    PAGED: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, k, v, block_table, rows, stride_k, stride_v, page_rows, head_rows,
                 cols_k, cols_v, stride_bt, PAGE, PAGED):
        self.k = maybe(k)
        self.v = maybe(v)
        self.block_table = maybe(block_table)
        self.rows = rows
        self.stride_k = stride_k
        self.stride_v = stride_v
        self.page_rows = page_rows
        self.head_rows = head_rows
        self.cols_k = cols_k
        self.cols_v = cols_v
        self.stride_bt = stride_bt
        self.PAGE = gl.constexpr(PAGE)
        self.PAGED = gl.constexpr(PAGED)


@aggregate
class Scores:
    """Scores in log2 units: qk_scale (log2(e) folded in), softcap (soft cap, log2(e) folded
    in), per-head ALiBi slopes and sinks [H] float32 (USE_ALIBI, USE_SINKS). SCALE_IN_EXP:
    the scale rides in exp2's FMA (no soft cap, no ALiBi). LANE_MASKS: masks compare
    columns as per-lane constants (`gluon_softmax.ItemRows`). MAX_SLACK: -1 updates each
    row's max every tile and rescales O every tile; 0 the same max, O's rescale skipped where
    no row of the warpgroup moved; > 0 a row's max moves only past that slack
    (`gluon_softmax.stale_max`), O's rescale skipped likewise. P_WORDS: an fp8 P carried
    between tiles as words of four keys (`gluon_operands.p_words`). RESCALE_AFTER_PV: the
    prompt consumer rescales O once the previous tile's P V is waited for, not between
    its S and P V issues (`gluon_consumer`)."""

    qk_scale: gl.tensor
    softcap: gl.tensor
    alibi_slopes: MaybeTensor
    sinks: MaybeTensor
    USE_ALIBI: gl.constexpr
    USE_SOFTCAP: gl.constexpr
    USE_SINKS: gl.constexpr
    SCALE_IN_EXP: gl.constexpr
    LANE_MASKS: gl.constexpr
    MAX_SLACK: gl.constexpr
    P_WORDS: gl.constexpr
    RESCALE_AFTER_PV: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, qk_scale, softcap, alibi_slopes, sinks, USE_ALIBI, USE_SOFTCAP,
                 USE_SINKS, SCALE_IN_EXP, LANE_MASKS=False, MAX_SLACK=-1, P_WORDS=False,
                 RESCALE_AFTER_PV=False):
        self.qk_scale = qk_scale
        self.softcap = softcap
        self.alibi_slopes = maybe(alibi_slopes)
        self.sinks = maybe(sinks)
        self.USE_ALIBI = gl.constexpr(USE_ALIBI)
        self.USE_SOFTCAP = gl.constexpr(USE_SOFTCAP)
        self.USE_SINKS = gl.constexpr(USE_SINKS)
        self.SCALE_IN_EXP = gl.constexpr(SCALE_IN_EXP)
        self.LANE_MASKS = gl.constexpr(LANE_MASKS)
        self.MAX_SLACK = gl.constexpr(MAX_SLACK)
        self.P_WORDS = gl.constexpr(P_WORDS)
        self.RESCALE_AFTER_PV = gl.constexpr(RESCALE_AFTER_PV)


@aggregate
class Descales:
    """fp8 descales float32 of (sequence, KV head) at seq * stride_b + kv_head * stride_h:
    q's (Q_DESCALE), k's and v's (KV_DESCALE)."""

    q: MaybeTensor
    k: MaybeTensor
    v: MaybeTensor
    stride_b: gl.tensor
    stride_h: gl.tensor
    Q_DESCALE: gl.constexpr
    KV_DESCALE: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, q, k, v, stride_b, stride_h, Q_DESCALE, KV_DESCALE):
        self.q = maybe(q)
        self.k = maybe(k)
        self.v = maybe(v)
        self.stride_b = stride_b
        self.stride_h = stride_h
        self.Q_DESCALE = gl.constexpr(Q_DESCALE)
        self.KV_DESCALE = gl.constexpr(KV_DESCALE)


@aggregate
class Output:
    """out [total_q, H, Dv] (strides stride_t, stride_h); with WRITE_LSE, lse [H, total_q]
    float32. ROW_STORES: O leaves by 16-byte stores staged through 4 KB of shared memory.
    fold: None, or batch-invariant mode's fold state, float32 rows of Dv (contiguous), where
    a consumer with no registers for a second O keeps its rows' splits folded so far: the
    prompt consumer's [grid, BLOCK_M, Dv] (`gluon_invariant.py`), the decode kernel's
    (`gluon_decode_invariant.py`)."""

    out: gl.tensor
    lse: MaybeTensor
    total_q: gl.tensor
    stride_t: gl.tensor
    stride_h: gl.tensor
    WRITE_LSE: gl.constexpr
    ROW_STORES: gl.constexpr
    fold: MaybeTensor

    @gluon.constexpr_function
    def __init__(self, out, lse, total_q, stride_t, stride_h, WRITE_LSE, ROW_STORES,
                 fold=None):
        self.out = out
        self.lse = maybe(lse)
        self.total_q = total_q
        self.stride_t = stride_t
        self.stride_h = stride_h
        self.WRITE_LSE = gl.constexpr(WRITE_LSE)
        self.ROW_STORES = gl.constexpr(ROW_STORES)
        self.fold = maybe(fold)


@gluon.jit
def store_partial(PartOut, PartLse, part, d, row_ok, ok, out, lse):
    """A split's state at its partial rows `part` ((split * total_q + token) * H + head):
    out [ROWS, Dv] into PartOut [splits, total_q, H, Dv] and lse into PartLse [splits,
    total_q, H], float32 (`tile_loop.store_partials`' layout; d the columns, ok and row_ok
    the masks of `gluon_decode.out_rows`)."""
    HEAD_DV: gl.constexpr = out.shape[1]
    gl.store(PartOut + gl.expand_dims(part * HEAD_DV, 1) + gl.expand_dims(d, 0), out, mask=ok)
    gl.store(PartLse + part, lse, mask=row_ok)


@gluon.jit
def store_rows(output, token, head, d, row_ok, ok, out, lse):
    """The rows' output in its dtype at (token, head) of output.out and, with
    output.WRITE_LSE, their natural-log LSE in output.lse [H, total_q] (`tile_loop.store_rows`'
    layout; d the columns, ok and row_ok the masks of `gluon_decode.out_rows`)."""
    row = token * output.stride_t + head * output.stride_h
    gl.store(output.out + gl.expand_dims(row, 1) + gl.expand_dims(d, 0),
             out.to(output.out.dtype.element_ty), mask=ok)
    if output.WRITE_LSE:
        gl.store(output.lse + head.to(gl.int64) * output.total_q + token, lse, mask=row_ok)

