"""How the Gluon prefill kernel's operands enter the consumers' wgmmas (`gluon_consumer.py`).

Q K^T reads Q from shared memory: as it landed, converted in place to the products' dtype
(`q_in_place`), or, a 16-bit q over an fp8 cache, as two e4m3 terms (`q_split`) issued as two
wgmmas into one accumulator (`qk_issue`; `QOperand` holds which). P V takes P from registers
(`p_operand`: 16-bit, or e4m3 in V^T's key order for an fp8 P V) and V from its ring
(`v_operand`: [keys, Dv] as a 16-bit ring holds it, or an fp8 ring's V^T seen transposed);
`pv_wait` waits for it. Imports nothing but Triton.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

try:
    from pagedattn.ops.triton.gluon_args import aggregate
except ImportError:  # compiled standalone, without torch (tools/gluon_sass.py)
    from gluon_args import aggregate


@aggregate
class QOperand:
    """This consumer's Q of an item as Q K^T's operand in shared memory: `hi`, q itself (or
    converted to the products' dtype), or with SPLIT q's two e4m3 terms `hi` and `lo` (`lo`
    is `hi` without SPLIT)."""

    hi: gl.shared_memory_descriptor
    lo: gl.shared_memory_descriptor
    SPLIT: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, hi, lo, SPLIT):
        self.hi = hi
        self.lo = lo
        self.SPLIT = gl.constexpr(SPLIT)


@gluon.constexpr_function
def p_dtype(v_dtype):
    """P V's A operand dtype over V tiles of `v_dtype`: V's own, or e4m3 over fp8 V^T tiles
    (P's weights, 2^P_SHIFT times the softmax's, are at most 256: e4m3 keeps 4 significant
    bits of each over e5m2's 3; wgmma takes e4m3 x e5m2)."""
    return gl.float8e4nv if v_dtype.is_fp8() else v_dtype


@gluon.constexpr_function
def p_operand_layout(acc_layout, dtype):
    """P as the register A operand of the P V wgmma accumulating into `acc_layout`: 32 bits
    of consecutive keys a thread (2 16-bit values, 4 fp8 ones)."""
    return gl.DotOperandLayout(operand_index=0, parent=acc_layout,
                               k_width=4 if dtype.is_fp8() else 2)


@gluon.jit
def p_operand(p, dtype: gl.constexpr, layout: gl.constexpr, WORDS: gl.constexpr = False):
    """The softmax's P [rows, N] (a wgmma accumulator) as P V's register A operand of `dtype`
    in `layout`. An fp8 P takes V^T's key order (`gluon_convert.transpose_tile`: columns
    2k, 2k + 1, 2k + 8, 2k + 9 of each 16 side by side), in which every thread already
    holds the 4 consecutive keys of its A fragment: a relabelling, no data moves (asserted
    at compile time). WORDS (an e4m3 P): `p_words` instead, which `p_as_a` makes the
    operand where the wgmma takes it."""
    if WORDS and dtype == gl.float8e4nv:
        x = p_words(p)
    else:
        x = _p_operand(p, dtype, layout)
    return x


@gluon.jit
def _p_operand(p, dtype: gl.constexpr, layout: gl.constexpr):
    x = p.to(dtype)
    if dtype.is_fp8():
        ROWS: gl.constexpr = p.shape[0]
        N: gl.constexpr = p.shape[1]
        x = gl.permute(gl.reshape(x, [ROWS, N // 16, 2, 4, 2]), (0, 1, 3, 2, 4))
        x = gl.convert_layout(gl.reshape(x, [ROWS, N]), layout, assert_trivial=True)
    else:
        x = gl.convert_layout(x, layout)
    return x


@gluon.constexpr_function
def e4m3x4_asm():
    """PTX: four float32 -> one register of four e4m3 (byte i the i-th operand), two
    conversions of pairs (cvt's first source lands in the upper byte) into its halves."""
    return ("{ .reg .b16 lz_lo, lz_hi;\n"
            "cvt.rn.satfinite.e4m3x2.f32 lz_lo, $2, $1;\n"
            "cvt.rn.satfinite.e4m3x2.f32 lz_hi, $4, $3;\n"
            "mov.b32 $0, {lz_lo, lz_hi}; }")


@gluon.jit
def p_words(p):
    """P [rows, N] (float32, a wgmma accumulator) as int32 words [rows, N / 4], word w four
    e4m3 keys 4w..4w + 3 of V^T's key order (`p_operand`), byte i key 4w + i (the same
    rounding as Triton's conversion). P crosses the tile loop (made in tile j, multiplied in
    j + 1): as 64 8-bit values it lives in 16-bit registers and is taken apart and packed
    again around every wgmma (per tile and thread at head 128: 32 conversions, 105 PRMT, 64
    LOP3, 32 SHF); as words, 32 conversions and 16 PRMT (sm_90 SASS)."""
    ROWS: gl.constexpr = p.shape[0]
    N: gl.constexpr = p.shape[1]
    x = gl.permute(gl.reshape(p, [ROWS, N // 16, 2, 4, 2]), (0, 1, 3, 2, 4))
    lo, hi = gl.split(gl.reshape(x, [ROWS, N // 4, 2, 2]))  # keys 4w + 2a + b: b = 0, 1
    e0, e2 = gl.split(lo)
    e1, e3 = gl.split(hi)
    return gl.inline_asm_elementwise(e4m3x4_asm(), "=r,f,f,f,f", [e0, e1, e2, e3],
                                     dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def p_as_a(p, layout: gl.constexpr):
    """P V's A operand in `layout` from `p_operand`'s result: itself, or from `p_words` the
    e4m3 tensor those words are, in the wgmma's block (each word copied to its 4 keys and
    re-read as 4 bytes: no instruction once compiled, LLVM folding the bytes back into the
    word the wgmma takes)."""
    if p.dtype == gl.int32:
        ROWS: gl.constexpr = p.shape[0]
        N: gl.constexpr = p.shape[1] * 4
        w2 = gl.join(p, p)
        x = gl.convert_layout(gl.reshape(gl.join(w2, w2), [ROWS, N]), layout,
                              assert_trivial=True)
        a = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r,r,r", [x],
                                      dtype=gl.float8e4nv, is_pure=True, pack=4)
    else:
        a = p
    return a


@gluon.jit
def v_operand(v_s, N: gl.constexpr):
    """A V slot as P V's B operand over its first N keys: [N, Dv] as a 16-bit ring holds it,
    or an fp8 ring's V^T [Dv, BLOCK_N] seen transposed, keys contiguous (K-major: an fp8
    wgmma reads B no other way)."""
    if v_s.dtype.is_fp8():
        b = v_s.slice(0, N, dim=1).permute((1, 0))
    else:
        b = v_s.slice(0, N)
    return b


@gluon.jit
def pv_wait(acc, v_s, p):
    """Waits for the P V in flight; returns its accumulator. A 16-bit P's registers are a
    dependency of the wait, so they stay untouched until the wgmma has read them; Triton
    3.6 cannot pass 8-bit registers through the wait, and an fp8 P relies on ptxas, which
    keeps a wgmma's register operands until their wait (or serialises the pipeline:
    C7512, which `tools/gluon_sass.py` reports)."""
    if p.dtype.is_fp8():
        out = warpgroup_mma_wait(0, deps=[acc, v_s])[0]
    else:
        out = warpgroup_mma_wait(0, deps=[acc, v_s, p])[0]
    return out


@gluon.jit
def q_in_place(q_s, dtype: gl.constexpr, ROWS: gl.constexpr, HEAD_D: gl.constexpr):
    """This consumer's Q rows converted to `dtype` in their own buffer (same size; exact for
    bf16 -> fp16 within fp16's range, as the other passes' fp8-cache products): a barrier
    of the warpgroup between the loads and the overwrite, a proxy fence and a barrier
    before the wgmma reads it. Returns the buffer as `dtype`."""
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    q = q_s.load(blk)
    gl.thread_barrier()
    q16 = q_s._reinterpret(dtype, [ROWS, HEAD_D],
                           gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_D], dtype))
    q16.store(q.to(dtype))
    fence_async_shared()
    gl.thread_barrier()
    return q16


@gluon.jit
def q_split(q_s, q_hi, q_lo):
    """This consumer's 16-bit Q rows q_s as two e4m3 terms in the same bytes (q_hi, q_lo:
    the buffer's halves viewed as e4m3): y = q 2^(7 - e), 2^e the largest |q| of the rows
    (so |y| < 256, inside e4m3's 448), hi = y to 4 significant bits, lo = e4m3(y - hi).
    hi + lo keeps ~8 significant bits of q (a bf16's own) for rows within 2^-10 of the
    largest; Q K^T is then two fp8 products over K as the cache holds it, times 2^(e - 7).
    Barriers as `q_in_place`. Returns 2^(e - 7)."""
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    q = q_s.load(blk).to(gl.float32)
    amax = gl.max(gl.max(gl.abs(q), axis=1), axis=0)
    # e from the exponent bits; clamped so both powers stay normal floats (q = 0, inf, NaN)
    e = ((amax.to(gl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = gl.minimum(gl.maximum(e, -100), 120)
    y = q * ((134 - e) << 23).to(gl.float32, bitcast=True)
    # hi: y rounded to e4m3's 4 significant bits on its float32 bits (half away from zero),
    # exact in e4m3 but for y under e4m3's 2^-6 normal floor (< 2^-14 of the largest |y|).
    # Not e4m3(y) converted back to float32: that round trip gave wrong lo terms on sm_90
    # (Triton 3.6; KERNEL_NOTES v19).
    hi = ((y.to(gl.int32, bitcast=True) + 0x80000) & -0x100000).to(gl.float32, bitcast=True)
    lo = (y - hi).to(gl.float8e4nv)
    hi = hi.to(gl.float8e4nv)
    gl.thread_barrier()
    q_hi.store(hi)
    q_lo.store(lo)
    fence_async_shared()
    gl.thread_barrier()
    return ((120 + e) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def qk_issue(q, k_s, s_zero):
    """Issues S = Q K^T of the K tile k_s (async): one wgmma, or with q.SPLIT one over each
    of q's two e4m3 terms into the same accumulator."""
    s = warpgroup_mma(q.hi, k_s.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    if q.SPLIT:
        s = warpgroup_mma(q.lo, k_s.permute((1, 0)), s, is_async=True)
    return s
