"""The Gluon decode kernels' shared memory (`gluon_decode.py`, `gluon_decode_persistent.py`):
the Q rows and the K / V rings.

The V ring the consumer reads is q's 16-bit dtype over a 16-bit cache; over an fp8 cache
fp16 tiles [keys, Dv] the converter makes from the staged fp8 ones (P V an fp16 wgmma), or
with PV_FP8 fp8 V^T tiles [Dv, keys] the converter transposes by byte permutes (P V an fp8
wgmma, whose B operand is K-major only). Imports nothing but Triton.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

try:
    from pagedattn.ops.triton.gluon_args import Ring, barriers, tile_ring
except ImportError:  # compiled standalone, without torch (tools/gluon_decode_sass.py)
    from gluon_args import Ring, barriers, tile_ring

ROWS = gl.constexpr(64)  # one wgmma tile of rows: the consumer warpgroup's


@gluon.jit
def decode_buffers(Q, KC, VC, HEAD_D: gl.constexpr, HEAD_DV: gl.constexpr,
                   BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr, STAGES: gl.constexpr,
                   KV_FP8: gl.constexpr, PV_FP8: gl.constexpr = False):
    """The decode kernels' shared memory and barriers (both forms of the Gluon decode
    kernel): (q_smem, k_ring, v_ring, v8_ring, v_fix): the Q rows, the K ring, the
    consumer's V ring (with PV_FP8 over an fp8 cache: V^T tiles [HEAD_DV, BLOCK_N] in the
    cache's fp8, which the converter pairs by `word_bytes`), the producer's V ring (an fp8
    cache's staging ring, else the consumer's) and the producer's private barrier for V
    tails (a placeholder over fp8)."""
    q_dtype: gl.constexpr = Q.dtype.element_ty
    # P V's operands: q's 16-bit type, or fp16 over an fp8 cache (the `tl` pass's dot type:
    # fp8 -> fp16 is exact and one instruction a pair)
    dtype: gl.constexpr = gl.float16 if KV_FP8 else q_dtype
    q_smem = gl.allocate_shared_memory(q_dtype, [ROWS, HEAD_D],
                                       gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_D],
                                                                            q_dtype))
    k_ring = tile_ring(KC.dtype.element_ty, NUM_BUF, BLOCK_N, HEAD_D)
    if KV_FP8 and PV_FP8:  # V^T keys contiguous: an fp8 wgmma reads B K-major only
        v8: gl.constexpr = VC.dtype.element_ty
        v_ring = Ring(gl.allocate_shared_memory(
            v8, [NUM_BUF, HEAD_DV, BLOCK_N],
            gl.NVMMASharedLayout.get_default_for([HEAD_DV, BLOCK_N], v8)),
            barriers(NUM_BUF, 1), barriers(NUM_BUF, 1), NUM_BUF, 2)
    else:
        v_ring = tile_ring(dtype, NUM_BUF, BLOCK_N, HEAD_DV)
    if KV_FP8:  # TMA -> fp8 staging ring -> converter -> the consumer's V ring
        v8_ring = tile_ring(VC.dtype.element_ty, STAGES, BLOCK_N, HEAD_DV)
        v_fix = v8_ring.ready.index(0)  # unread placeholder (the converter zeroes tails)
    else:
        v8_ring = v_ring  # the producer loads straight into the consumer's ring
        # A barrier exists only where a partition uses it (an unused one may be placed
        # over live data): the producer's private one for V tiles it zeroes the tail of.
        v_fix = barriers(1, 1).index(0)
    return q_smem, k_ring, v_ring, v8_ring, v_fix
