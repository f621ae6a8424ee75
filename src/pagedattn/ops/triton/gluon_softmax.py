"""The online softmax of the Gluon prefill kernel's consumers (`gluon_consumer.py`).

A consumer's scores arrive as a wgmma accumulator [64, BLOCK_N] in log2 units; this module
masks them where a tile needs it (`mask_scores`), takes the tile's exponentials against the
running row max (`softmax_tile`, `exp_rows`) and keeps each row's sum as 8 partials in the
accumulator's own registers (`row_parts`), reduced across the quad once an item
(`row_sum`), as FA3's softmax does. P_SHIFT: P leaves as 2^P_SHIFT times its weight (8 for
an fp8 P V: weights up to 256 fill e4m3's range, 448, instead of its bottom; the row sums
carry the same factor, which the epilogue's division cancels and the LSE subtracts).
Imports nothing but Triton.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

try:
    from pagedattn.ops.triton.gluon_args import MaybeTensor, aggregate, maybe
except ImportError:  # compiled standalone, without torch (tools/gluon_sass.py)
    from gluon_args import MaybeTensor, aggregate, maybe

LOG2E = gl.constexpr(1.4426950408889634)


@gluon.constexpr_function
def scores_layout(cols, operand_dtype):
    """The layout of a consumer's [64, cols] scores, the accumulator of a Q K^T wgmma with
    `operand_dtype` operands (an fp8 product's instruction is k32; its registers are laid
    out as a 16-bit product's)."""
    k = 32 if operand_dtype.is_fp8() else 16
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                     instr_shape=[16, cols, k])


@aggregate
class ItemRows:
    """A consumer's rows of an item as its softmax sees them: their query positions q_pos
    and ALiBi slopes (log2 units) [rows], the keys all of them see [full_lo, full_hi), the
    item's score scale qk (the launch's, times its descales), and P_SHIFT (P's weights are
    2^P_SHIFT times the softmax's; see above). LANE_COLUMNS: masks compare each column
    less its lane's offset against the row's limit less it (`mask_scores`), and q_pos is
    the first row's position alone, a scalar (`positions` adds each thread's rows where a
    mask uses them: kept across the item, three consumers' 160 registers spilled them)."""

    q_pos: gl.tensor
    slope: gl.tensor
    full_lo: MaybeTensor
    full_hi: MaybeTensor
    qk: gl.tensor
    P_SHIFT: gl.constexpr
    LANE_COLUMNS: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, q_pos, slope, full_lo, full_hi, qk, P_SHIFT, LANE_COLUMNS=False):
        self.q_pos = q_pos
        self.slope = slope
        self.full_lo = maybe(full_lo)  # 0 without a left window
        self.full_hi = maybe(full_hi)
        self.qk = qk
        self.P_SHIFT = gl.constexpr(P_SHIFT)
        self.LANE_COLUMNS = gl.constexpr(LANE_COLUMNS)

    @gluon.jit
    def positions(self, ROWS: gl.constexpr, layout: gl.constexpr):
        """The rows' query positions [ROWS] in `layout` (a slice of an accumulator's rows)."""
        if self.LANE_COLUMNS:
            pos = self.q_pos + gl.arange(0, ROWS, layout=layout)
        else:
            pos = self.q_pos
        return pos

    @gluon.jit
    def in_layout(self, layout: gl.constexpr):
        """These rows with their vectors in `layout` (another tile width's rows)."""
        q_pos = self.q_pos
        if not self.LANE_COLUMNS:
            q_pos = gl.convert_layout(q_pos, layout)
        return ItemRows(q_pos, gl.convert_layout(self.slope, layout), self.full_lo,
                        self.full_hi, self.qk, self.P_SHIFT, self.LANE_COLUMNS)


@gluon.constexpr_function
def p_shift(p_dtype, max_slack=-1):
    """P_SHIFT for P V operands of `p_dtype`: 8 for fp8 (weights up to 2^8 = 256 < 448, e4m3's
    largest), 0 for 16-bit operands. With a stale max (`stale_max`, max_slack > 0) P reaches
    2^(P_SHIFT + max_slack): fp8 then takes 8 - max_slack (max_slack at most 8)."""
    if p_dtype.is_fp8():
        return 8 - max(max_slack, 0)
    return 0


@gluon.jit
def mask_scores(s, start, offs_n, rows, bound, keys):
    """Keys start + offs_n: -inf where a row of `rows` (`ItemRows`) does not see them
    (`keys`' windows). Per-row limits relative to the tile, so each element costs one or
    two compares against a register. LANE_COLUMNS: each column less its lane's offset
    (bits 1-2 of an accumulator column: 2 (lane % 4)) is a constant of the register, which
    the compares take as an immediate, against the limits less that offset; else the
    columns live in registers (32 of them a thread at 128 keys: more than three consumers'
    160 registers spare)."""
    q_pos = rows.positions(s.shape[0], gl.SliceLayout(1, s.type.layout))
    hi = gl.zeros_like(q_pos) + bound
    if keys.WINDOW_RIGHT:
        if rows.LANE_COLUMNS:
            # right + 1 first: the other grouping lets the compiler keep rows + right + 1
            # across the item (loop invariants), one more register three consumers spill
            hi = gl.minimum(hi, q_pos + (keys.right + 1))
        else:
            hi = gl.minimum(hi, q_pos + keys.right + 1)
    k = gl.expand_dims(offs_n, 0)
    hi = gl.expand_dims(hi - start, 1)
    if rows.LANE_COLUMNS:
        lane = gl.expand_dims(offs_n & 6, 0)
        k = k - lane
        hi = hi - lane
    visible = k < hi
    if keys.WINDOW_LEFT:
        lo = gl.expand_dims(q_pos - keys.left - start, 1)
        if rows.LANE_COLUMNS:
            lo = lo - lane
        visible = visible & (k >= lo)
    return gl.where(visible, s, float("-inf"))


@gluon.jit
def softmax_tile(s, m_i, l_parts, start, bound, offs_n, rows, scores, keys):
    """Raw scores s [M, N] of keys start + offs_n -> (p, alpha, l_parts, m_i) in log2 units,
    for `rows` (`ItemRows`) as `scores` (`gluon_args.Scores`) says. With SCALE_IN_EXP the
    score scale rides in exp2's FMA (max commutes with a positive scale); soft cap and
    ALiBi need scaled scores first."""
    ROWS: gl.constexpr = s.shape[0]
    BLOCK_N: gl.constexpr = s.shape[1]
    k_pos = start + offs_n
    if scores.SCALE_IN_EXP:
        exp_scale = rows.qk
    else:
        exp_scale = 1.0
        s = s * rows.qk
        if scores.USE_SOFTCAP:  # softcap carries log2(e); tanh(x) = 1 - 2 / (e^{2x} + 1)
            s = scores.softcap * (1.0 - 2.0 / (gl.exp2(s * (2.0 * LOG2E)) + 1.0))
        if scores.USE_ALIBI:
            q_pos = rows.positions(ROWS, gl.SliceLayout(1, s.type.layout))
            rel = gl.expand_dims(k_pos, 0) - gl.expand_dims(q_pos, 1)
            s = s + gl.expand_dims(rows.slope, 1) * rel.to(gl.float32)
    # The exponentials sit inside both branches: after a join, ptxas moves the P V wait
    # (WARPGROUP.DEPBAR) to the top of the joined block, above them, and the softmax would no
    # longer overlap the P V in flight (sm_90 SASS, docs/dev/KERNEL_NOTES.md v6).
    if (start < rows.full_lo) | (start + BLOCK_N > gl.minimum(rows.full_hi, bound)):
        s = mask_scores(s, start, offs_n, rows, bound, keys)
        p, alpha, l_new, m_new = exp_rows(s, m_i, l_parts, exp_scale, rows.P_SHIFT,
                                          scores.MAX_SLACK)
    else:
        p, alpha, l_new, m_new = exp_rows(s, m_i, l_parts, exp_scale, rows.P_SHIFT,
                                          scores.MAX_SLACK)
    return p, alpha, l_new, m_new


@gluon.jit
def exp_rows(s, m_i, l_parts, exp_scale, P_SHIFT: gl.constexpr, MAX_SLACK: gl.constexpr = -1):
    """Online softmax of one tile's (masked) scores against the running m_i and row-sum
    partials l_parts; P and the partials 2^P_SHIFT times the weights. MAX_SLACK > 0: a row's
    max moves only where the tile's exceeds it by more than MAX_SLACK (log2 units;
    `stale_max`)."""
    if MAX_SLACK > 0:
        m_new = stale_max(m_i, gl.max(s, axis=1) * exp_scale, MAX_SLACK)
    else:
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * exp_scale)
    # A row that has seen no visible key keeps m = -inf; subtract 0 there, not -inf.
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    if P_SHIFT != 0:  # one subtraction a row, not an element
        x = s * exp_scale - gl.expand_dims(m_safe - P_SHIFT, 1)
    else:
        x = s * exp_scale - gl.expand_dims(m_safe, 1)
    p = gl.exp2(x)
    alpha = gl.exp2(m_i - m_safe)
    a = gl.convert_layout(alpha, gl.SliceLayout(1, l_parts.type.layout), assert_trivial=True)
    return p, alpha, l_parts * gl.expand_dims(a, 1) + row_parts(p, l_parts.shape[1]), m_new


@gluon.constexpr_function
def parts_layout(width=8):
    """[rows, width] row-sum partials where a wgmma accumulator keeps them, rows as the
    accumulator's. 8: each thread's 2 of every 8 consecutive columns (column bit 0 in a
    register, bits 1-2 across a quad of lanes); 4: a thread's 2 of every 8 columns summed
    in one register a row, the quad's 4 lanes the 4 partials (half the registers: three
    consumers' 160 hold no more)."""
    if width == 8:
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                         instr_shape=[16, 8, 16])
    return gl.DistributedLinearLayout(
        reg_bases=[[8, 0]], lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 4])


@gluon.jit
def row_parts(p, WIDTH: gl.constexpr):
    """p [rows, N] (an accumulator layout) -> [rows, WIDTH] (8 or 4): column c adds into
    partial c % 8 (8), or (c % 8) // 2 (4). The sum runs within each thread: the row sum's
    shuffles across the quad wait for the item's end (`row_sum`), once instead of every
    tile, as FA3's softmax does."""
    ROWS: gl.constexpr = p.shape[0]
    N: gl.constexpr = p.shape[1]
    if WIDTH == 8:
        parts = gl.sum(gl.reshape(p, [ROWS, N // 8, 8]), axis=1)
    else:
        parts = gl.sum(gl.sum(gl.reshape(p, [ROWS, N // 8, 4, 2]), axis=3), axis=1)
    return gl.convert_layout(parts, parts_layout(WIDTH), assert_trivial=True)


@gluon.jit
def row_sum(l_parts, layout: gl.constexpr):
    """The row sums of the partials, in `layout` (a slice of an accumulator layout's rows)."""
    return gl.convert_layout(gl.sum(l_parts, axis=1), layout, assert_trivial=True)


@gluon.jit
def stale_max(m_i, tile_max, MAX_SLACK: gl.constexpr):
    """The running max kept unless the tile's exceeds it by more than MAX_SLACK (FA4's rule):
    the result is exact after the final division, which cancels whatever max P was taken
    against, as long as P stays in its dtype's range: every P is then at most
    2^(P_SHIFT + MAX_SLACK) (a tile past the slack moves the max to its own). A row at -inf
    (no key seen) takes any finite tile max (-inf + slack is -inf)."""
    return gl.where(tile_max > m_i + MAX_SLACK, tile_max, m_i)


@gluon.constexpr_function
def rescale_asm(n, rn=False):
    """PTX for `lazy_rescale` over n accumulator elements a thread: operands $0..n-1 O's
    elements (tied to inputs n..2n-1), 2n..3n-1 their rows' alpha. Elements 0 and 2 are a
    thread's two rows (r, r + 8) in a wgmma accumulator's register order (column bit 0,
    then row bit 3, then the column bits from 3 up). rn: `mul.rn.f32`, which ptxas never
    fuses into an fma (a plain `mul.f32` it may), as batch-invariant kernels compile it."""
    a, b = 2 * n, 2 * n + 2
    lines = ["{", ".reg .pred %lz_a, %lz_b;",
             f"setp.neu.f32 %lz_a, ${a}, 0f3F800000;",
             f"setp.neu.f32 %lz_b, ${b}, 0f3F800000;",
             "or.pred %lz_a, %lz_a, %lz_b;",
             "vote.sync.any.pred %lz_a, %lz_a, 0xffffffff;",
             "@!%lz_a bra.uni $$lz_done${:uid};"]
    mul = "mul.rn.f32" if rn else "mul.f32"
    lines += [f"{mul} ${i}, ${i}, ${2 * n + i};" for i in range(n)]
    lines += ["$$lz_done${:uid}:", "}"]
    return "\n".join(lines)


@gluon.constexpr_function
def _rescale_constraints(n):
    return ",".join(["=f"] * n + [str(i) for i in range(n)] + ["f"] * n)


@gluon.jit
def lazy_rescale(acc, alpha, RN: gl.constexpr = False):
    """O [rows, Dv] (a wgmma accumulator) times its rows' alpha [rows], skipped by every warp
    none of whose 16 rows moved its max (alpha 1 on each: a warp-uniform branch around the
    multiplies, which a branch on a Triton scalar would need a cross-warp reduction for). A
    row at -inf (alpha 0) counts as moved: its O is 0 either way. RN: the multiplies as
    `mul.rn.f32` (`rescale_asm`): then skipping one by alpha exactly 1 keeps O's bits
    (x * 1 rounds to x; no flush of subnormals)."""
    a = gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout)), 1)
    N: gl.constexpr = acc.shape[0] * acc.shape[1] // (32 * gl.num_warps())
    return gl.inline_asm_elementwise(rescale_asm(N, RN), _rescale_constraints(N), [acc, a],
                                     dtype=gl.float32, is_pure=True, pack=N)
