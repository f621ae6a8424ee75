"""Batch-invariant mode's Gluon decode split programs that fold their own request's splits
(`SWITCHES.invariant_self_fold`; `gluon_decode_invariant.py`'s SELF_FOLD).

A split program stores its split's partial state where `invariant.fold_splits_kernel` would
read it, then takes a ticket from its (request, KV head)'s counter; the program that draws
the last ticket of the request's cdiv(seq_len, SPLIT_KEYS) folds the partials split 0 first
by `fold_split` (the fold kernel's operations, so the fold launch's bits whichever program
folds), stores the rows as the unsplit programs do and sets the counter back to 0 for the
next launch. Memory order: the consumer warpgroup's barrier puts its four warps' stores
before the ticket's atomic, whose release publishes them at GPU scope; its acquire (in the
folder) and the .cg loads (from L2) show the folder every split's. Imports nothing but
Triton, so it compiles for sm_90 on a machine without torch (tools/gluon_decode_sass.py).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

try:
    from pagedattn.ops.triton.gluon_args import store_partial, store_rows
    from pagedattn.ops.triton.gluon_invariant_fold import fold_split
except ImportError:  # compiled standalone, without torch (tools/gluon_decode_sass.py)
    from gluon_args import store_partial, store_rows
    from gluon_invariant_fold import fold_split

LN2 = gl.constexpr(0.6931471805599453)


@gluon.jit
def publish_and_fold(output, PartOut, PartLse, ticket, part, token, head, d, row_ok, ok,
                     out, lse2, seq_len, SPLIT_KEYS: gl.constexpr, NUM_HEADS: gl.constexpr,
                     o_layout: gl.constexpr):
    """This split's state (out [ROWS, Dv] in o_layout, lse2 in log2 units) stored at its
    partial rows `part` (PartOut [splits, total_q, H, Dv] / PartLse [splits, total_q, H]
    float32), a ticket drawn from `ticket` (int32), and where it is the last, the request's
    splits folded into output's rows (token, head; d the columns, ok the rows' mask)."""
    HEAD_DV: gl.constexpr = out.shape[1]
    store_partial(PartOut, PartLse, part, d, row_ok, ok, out, lse2)
    splits = gl.cdiv(seq_len, SPLIT_KEYS)
    gl.thread_barrier()  # the warpgroup's stores, before the release
    if gl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu") == splits - 1:
        _fold_all(output, PartOut, PartLse, token, head, d, row_ok, ok, splits, NUM_HEADS,
                  HEAD_DV, o_layout)
        gl.store(ticket, 0)  # every ticket is drawn: no program of this launch reads it


@gluon.jit
def _fold_all(output, PartOut, PartLse, token, head, d, row_ok, ok, splits,
              NUM_HEADS: gl.constexpr, HEAD_DV: gl.constexpr, o_layout: gl.constexpr):
    """`fold_splits_kernel`'s fold of the rows' splits 0 .. splits - 1 and its stores (out
    + 0.0 in the output's dtype, the LSE in natural log), as an unsplit program stores."""
    rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    out = gl.zeros([token.shape[0], HEAD_DV], gl.float32, layout=o_layout)
    lse2 = gl.full([token.shape[0]], float("-inf"), gl.float32, layout=rows)
    for s in range(0, splits):
        part = (s * output.total_q + token) * NUM_HEADS + head
        o = gl.load(PartOut + gl.expand_dims(part * HEAD_DV, 1) + gl.expand_dims(d, 0),
                    mask=ok, other=0.0, cache_modifier=".cg")
        o_lse2 = gl.load(PartLse + part, mask=row_ok, other=float("-inf"),
                         cache_modifier=".cg")
        out, lse2 = fold_split(out, lse2, o, o_lse2)
    # + 0.0: -0.0 -> 0.0 (`invariant.fold_splits_kernel` says why)
    store_rows(output, token, head, d, row_ok, ok, out + 0.0, lse2 * LN2)
