"""The split fold of batch-invariant mode's Gluon kernels: a split's finished rows
(`finish_split`) folded into the splits before it in split order (`fold_split`), by the
operations of the `tl` pass's `invariant.finish_split` / `invariant.fold_split`, so the prompt
consumer (`gluon_invariant.py`) and the decode kernel (`gluon_decode_invariant.py`,
`gluon_decode_fold.py`) keep that pass's bits; the forms that drop work which cannot change
a bit (`fold_next`: an item's first fold as the select it reduces to; `fold_sink`,
`first_fold_of_sink`: split 0 holding the sink alone); and the fold state in float32 memory
where O and a second state do not fit a consumer's registers (`fold_in_memory`,
`fold_rows`). Imports nothing but Triton.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def fold_in_memory(fold, fold_row, fold_ok, lse2, folded, o, o_lse2,
                   FRESH: gl.constexpr = False):
    """`fold_next(out, lse2, o, o_lse2, folded)` with `out` in memory: fold, float32 rows of
    o.shape[1] at fold_row (element offsets, in o's row layout; fold_ok: the rows to keep)
    read where something was folded, the result written back. Each element is read and
    written by the thread that holds it in o's layout, so its own earlier write is what it
    reads. FRESH: the columns made here (`fold_rows`). Returns (lse2, True)."""
    layout: gl.constexpr = o.type.layout
    HEAD_DV: gl.constexpr = o.shape[1]
    ptrs = fold_rows(fold, fold_row, layout, HEAD_DV, FRESH)
    ok = gl.expand_dims(fold_ok, 1)
    if folded:
        o, lse2 = fold_split(gl.load(ptrs, mask=ok, other=0.0), lse2, o, o_lse2)
    else:
        o = gl.where(gl.expand_dims(o_lse2 == float("-inf"), 1), 0.0, o)
        lse2 = o_lse2
    gl.store(ptrs, o, mask=ok)
    return lse2, True


@gluon.jit
def fold_rows(fold, fold_row, layout: gl.constexpr, HEAD_DV: gl.constexpr,
              FRESH: gl.constexpr = False):
    """The [rows, HEAD_DV] pointers of `fold_in_memory`'s rows in `layout` (the columns made
    here, where they are used: live across a split's tiles they would take a register each).
    FRESH: the columns through an instruction the compiler cannot see through, so that they
    are made here indeed (else, loop-invariant, they may be made once before a loop of
    splits and held across its tiles), with their contiguity restated for wide accesses."""
    offs_d = gl.arange(0, HEAD_DV, layout=gl.SliceLayout(0, layout))
    if FRESH:
        offs_d = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [offs_d],
                                           dtype=gl.int32, is_pure=False, pack=1)
        offs_d = gl.max_contiguous(gl.multiple_of(offs_d, HEAD_DV), HEAD_DV)
    return fold + gl.expand_dims(fold_row, 1) + gl.expand_dims(offs_d, 0)


@gluon.jit
def finish_split(acc, m_i, l_i, v_scale):
    """`invariant.finish_split`: a split's rows (acc * (v_scale / l)) and log2 LSEs (-inf
    for a row that saw no key in it)."""
    l_safe = gl.where(l_i == 0.0, 1.0, l_i)
    out = acc * gl.expand_dims(v_scale / l_safe, 1)
    return out, gl.where(l_i == 0.0, float("-inf"), m_i + gl.log2(l_safe))


@gluon.jit
def fold_sink(out, lse2, sink, v_scale, o_layout: gl.constexpr):
    """(out, lse2) with split 0 folded in where it holds the sink alone (none of the rows'
    keys): its state (m = sink, l = 1, acc = 0) finished as any split's."""
    ROWS: gl.constexpr = out.shape[0]
    HEAD_DV: gl.constexpr = out.shape[1]
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    o, o_lse2 = finish_split(gl.zeros([ROWS, HEAD_DV], gl.float32, layout=o_layout),
                             gl.convert_layout(sink, o_rows),
                             gl.full([ROWS], 1.0, gl.float32, layout=o_rows), v_scale)
    return fold_split(out, lse2, o, o_lse2)


@gluon.jit
def first_fold_of_sink(fold, fold_row, fold_ok, sink, v_scale, take, o_layout: gl.constexpr,
                       HEAD_DV: gl.constexpr, FRESH: gl.constexpr = False):
    """`fold_in_memory` of `fold_sink`'s split as the first fold (nothing folded before: its
    select) where `take` (a scalar: split 0 holds the sink and none of the rows' keys): the
    split's rows (acc 0 over l = 1) stored at fold_row where fold_ok. Returns (lse2, folded):
    its log2 LSEs and take, or -inf and False. No branch: under a runtime `if`, the decode
    kernel's store over an fp8 cache at head 256 tripped an LLVM assertion in Triton 3.6's
    lowering to LLVM (sm_90), and the same store masked by `take` compiles in both kernels."""
    ROWS: gl.constexpr = sink.shape[0]
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    o, lse2 = finish_split(gl.zeros([ROWS, HEAD_DV], gl.float32, layout=o_layout),
                           gl.convert_layout(sink, o_rows),
                           gl.full([ROWS], 1.0, gl.float32, layout=o_rows), v_scale)
    o = gl.where(gl.expand_dims(lse2 == float("-inf"), 1), 0.0, o)
    gl.store(fold_rows(fold, fold_row, o_layout, HEAD_DV, FRESH), o,
             mask=gl.expand_dims(fold_ok & take, 1))
    return gl.where(take, lse2, float("-inf")), take


@gluon.jit
def fold_next(out, lse2, o, o_lse2, folded):
    """`fold_split(out, lse2, o, o_lse2)`, bit for bit, where `folded` is False (nothing folded
    yet: out zeros, lse2 -inf) as what it reduces to: every row keeps its zero and -inf where
    o_lse2 is -inf, else takes (o, o_lse2); the merge's exponentials and division only where
    something was folded before."""
    if folded:
        out, lse2 = fold_split(out, lse2, o, o_lse2)
    else:
        out = gl.where(gl.expand_dims(o_lse2 == float("-inf"), 1), 0.0, o)
        lse2 = o_lse2
    return out, lse2


@gluon.jit
def fold_split(out, lse2, o, o_lse2):
    """`invariant.fold_split`: the splits so far with the next one folded in, a side that
    saw no key leaving the other exactly as it is."""
    top = gl.maximum(lse2, o_lse2)
    top = gl.where(top == float("-inf"), 0.0, top)
    w = gl.exp2(lse2 - top)
    w_o = gl.exp2(o_lse2 - top)
    total = w + w_o
    total = gl.where(total == 0.0, 1.0, total)
    merged = (out * gl.expand_dims(w, 1) + o * gl.expand_dims(w_o, 1)) / gl.expand_dims(total, 1)
    keep = o_lse2 == float("-inf")
    take = (lse2 == float("-inf")) & (o_lse2 != float("-inf"))
    out = gl.where(gl.expand_dims(keep, 1), out,
                   gl.where(gl.expand_dims(take, 1), o, merged))
    lse2 = gl.where(keep, lse2, gl.where(take, o_lse2, top + gl.log2(total)))
    return out, lse2
