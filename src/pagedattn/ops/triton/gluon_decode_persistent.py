"""The Gluon decode kernel's persistent form for Hopper (sm_90a): programs that walk units.

The same partitions, tiles and arithmetic as `gluon_decode.py` (one unit is that kernel's
program: request, KV head, split), on a grid of `programs` programs (at most per_sm x SM
count: `gluon_decode_units.persistent_programs`), each walking its units in the order of
`Units.at`. What a program pays once rather than per unit: the producer builds the
cache's tensor descriptors once, and the K / V rings (and the fp8 staging ring) keep their
slots and barrier phases across units, counted by a running tile number: the producer
loads the next unit's first tiles while the consumer still finishes this one's, so only
the first unit of a program waits for a ring to fill. Per unit, as in the other form: the
consumer loads its Q rows (into the one Q buffer: the previous unit's wgmmas have all
been waited for), starts its state (sinks on split 0) and stores its rows or partials
(`gluon_decode.decode_unit`). Every partition walks the same units and counts the same
tiles (`gluon_decode.unit_keys`), or a barrier waits forever. Imports nothing but Triton.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

try:
    from pagedattn.ops.triton.gluon_args import Descales, Output, Pages, Scores, aggregate
    from pagedattn.ops.triton.gluon_convert import convert_v
    from pagedattn.ops.triton.gluon_decode import UNSPECIALIZED, decode_unit, unit_keys
    from pagedattn.ops.triton.gluon_decode_rings import ROWS, decode_buffers
    from pagedattn.ops.triton.gluon_producer import load_unit_tiles, page_descriptors
    from pagedattn.ops.triton.gluon_schedule import KeyTiles
except ImportError:  # compiled standalone, without torch (tools/gluon_decode_sass.py)
    from gluon_args import Descales, Output, Pages, Scores, aggregate
    from gluon_convert import convert_v
    from gluon_decode import UNSPECIALIZED, decode_unit, unit_keys
    from gluon_decode_rings import ROWS, decode_buffers
    from gluon_producer import load_unit_tiles, page_descriptors
    from gluon_schedule import KeyTiles


@aggregate
class Units:
    """The launch's units: batch x NUM_KV x num_splits of them on `programs` programs
    (runtime ints: gl.num_programs() read in every partition is a value each keeps across
    the partition switch, as the prefill pass found)."""

    batch: gl.tensor
    num_splits: gl.tensor
    programs: gl.tensor
    NUM_KV: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, batch, num_splits, programs, NUM_KV):
        self.batch = batch
        self.num_splits = num_splits
        self.programs = programs
        self.NUM_KV = gl.constexpr(NUM_KV)

    @gluon.jit
    def rounds(self):
        """Rounds of the walk: every program takes one unit a round (the last round's may
        be past the units: then none)."""
        return gl.cdiv(self.batch * self.NUM_KV * self.num_splits, self.programs)

    @gluon.jit
    def at(self, k):
        """This program's unit of round k: (valid, request, KV head, split). Round k takes
        units k x programs + pid (even rounds) or + programs - 1 - pid (odd: the prefill
        pass's alternation, `gluon_schedule.Items.round`), so a pair whose every split falls
        in the same position of its round is not all one program's. KV heads vary fastest,
        then requests, splits slowest: a round's units are different (request, KV head)
        pairs where the batch has as many as programs, and a request's splits spread over
        programs (`gluon_decode_units.unit_order`). A unit past the last reads request 0."""
        pid = gl.program_id(0)
        pairs = self.batch * self.NUM_KV
        u = k * self.programs + gl.where(k % 2 == 0, pid, self.programs - 1 - pid)
        valid = u < pairs * self.num_splits
        u = gl.where(valid, u, 0)
        return valid, (u // self.NUM_KV) % self.batch, u % self.NUM_KV, u // pairs


# (its tiles by head size: `gluon_decode_tiles.py`, as the other form's)
@gluon.jit(do_not_specialize=UNSPECIALIZED + ["batch", "programs"])
def gluon_decode_persistent_kernel(
    Q, KC, VC, Out, Lse, cu_seqlens_q, seqused_k, block_table, sinks, q_descale, k_descale,
    v_descale, qk_scale, softcap, left, right, total_q, num_splits, stride_qt, kv_rows,
    stride_kc, stride_vc, page_rows, head_rows, head_cols_k, head_cols_v, stride_bt,
    stride_ot, stride_oh, stride_ds_b, stride_ds_h, batch, programs,
    NUM_KV: gl.constexpr, GROUP: gl.constexpr, GROUP_PAD: gl.constexpr, QUERIES: gl.constexpr,
    HEAD_D: gl.constexpr, HEAD_DV: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr,
    NUM_BUF: gl.constexpr, STAGES: gl.constexpr, WINDOW_LEFT: gl.constexpr,
    WINDOW_RIGHT: gl.constexpr, USE_SOFTCAP: gl.constexpr, USE_SINKS: gl.constexpr,
    WRITE_LSE: gl.constexpr, SPLIT_KV: gl.constexpr, KV_FP8: gl.constexpr,
    KV_DESCALE: gl.constexpr, Q_DESCALE: gl.constexpr, SCALE_IN_EXP: gl.constexpr,
    WORKER_REGS: gl.constexpr, PV_FP8: gl.constexpr = False, MAX_SLACK: gl.constexpr = -1,
):
    """`gluon_decode.gluon_decode_kernel`'s arguments, plus batch (requests) and programs
    (the grid). Grid (programs,), num_warps=4, a global scratch allocator (the producer's
    two tensor descriptors, once a program)."""
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
    units = Units(batch, num_splits, programs, NUM_KV)
    gl.warp_specialize(
        [(_consumer, (Q, output, cu_seqlens_q, seqused_k, descales, stride_qt, q_smem,
                      k_ring, v_ring, keys, scores, units, NUM_KV, GROUP, GROUP_PAD, QUERIES,
                      SPLIT_KV)),
         (_producer, (pages, cu_seqlens_q, seqused_k, k_ring, v8_ring, v_fix, keys, units,
                      NUM_KV, QUERIES)),
         (_converter, (cu_seqlens_q, seqused_k, v8_ring, v_ring, keys, units, QUERIES))],
        [1, 2], [WORKER_REGS, WORKER_REGS])


@gluon.jit
def _unit(cu_seqlens_q, seqused_k, keys, units, k, QUERIES: gl.constexpr):
    """Round k's unit as every partition walks it: (valid, kv_head, split, `unit_keys`'
    tuple), n 0 past the last unit (no tile counted, nothing stored)."""
    valid, seq, kv_head, split = units.at(k)
    seq, q_start, q_len, seq_len, context, lo, hi, n, full_lo, full_hi = unit_keys(
        cu_seqlens_q, seqused_k, units.num_splits, keys, seq, split, QUERIES)
    n = gl.where(valid, n, 0)
    valid = valid & (q_len <= QUERIES) & (q_len > 0)
    return (valid, kv_head, split, seq, q_start, q_len, seq_len, context, lo, hi, n, full_lo,
            full_hi)


@gluon.jit
def _producer(pages, cu_seqlens_q, seqused_k, k_ring, v_ring, v_fix, keys, units,
              NUM_KV: gl.constexpr, QUERIES: gl.constexpr):
    """The descriptors once, then each unit's tiles (`load_unit_tiles`) as the rings' next
    tiles: a unit's first loads wait only for the slots the consumer frees."""
    desc_k, desc_v = page_descriptors(pages, k_ring.smem, v_ring.smem, NUM_KV)
    tile = 0
    fixes = 0
    for k in range(units.rounds()):
        (valid, kv_head, split, seq, q_start, q_len, seq_len, context, lo, hi, n, full_lo,
         full_hi) = _unit(cu_seqlens_q, seqused_k, keys, units, k, QUERIES)
        fixes = load_unit_tiles(desc_k, desc_v, pages, k_ring, v_ring, v_fix, fixes, tile, seq,
                                kv_head, seq_len, lo, hi, n)
        tile += n


@gluon.jit
def _converter(cu_seqlens_q, seqused_k, v8_ring, v_ring, keys, units, QUERIES: gl.constexpr):
    """Each unit's staged fp8 V tiles into the consumer's ring (fp16, or fp8 V^T), counted
    as the producer counts them; over a 16-bit cache the partition idles."""
    if v8_ring.smem.dtype.is_fp8():
        BLOCK_N: gl.constexpr = keys.BLOCK_N
        tile = 0
        for k in range(units.rounds()):
            (valid, kv_head, split, seq, q_start, q_len, seq_len, context, lo, hi, n, full_lo,
             full_hi) = _unit(cu_seqlens_q, seqused_k, keys, units, k, QUERIES)
            for j in range(n):
                convert_v(v8_ring, v_ring, tile + j, lo + j * BLOCK_N, seq_len, BLOCK_N)
            tile += n


@gluon.jit
def _consumer(Q, output, cu_seqlens_q, seqused_k, descales, stride_qt, q_smem, k_ring, v_ring,
              keys, scores, units, NUM_KV: gl.constexpr, GROUP: gl.constexpr,
              GROUP_PAD: gl.constexpr, QUERIES: gl.constexpr, SPLIT_KV: gl.constexpr):
    """Each unit of a request the pass serves (`decode_unit`) from the rings' next tiles."""
    tile = 0
    for k in range(units.rounds()):
        (valid, kv_head, split, seq, q_start, q_len, seq_len, context, lo, hi, n, full_lo,
         full_hi) = _unit(cu_seqlens_q, seqused_k, keys, units, k, QUERIES)
        if valid:
            decode_unit(Q, output, descales, stride_qt, q_smem, k_ring, v_ring, keys, scores,
                        seq, q_start, q_len, context, lo, hi, n, full_lo, full_hi, kv_head,
                        split, tile, NUM_KV, GROUP, GROUP_PAD, SPLIT_KV)
        tile += n
