"""The batch-invariant Gluon kernels' per-tile step: one key tile's scores into a row's
state by the `tl` batch-invariant pass's operations, in their order (S * qk, soft cap, ALiBi,
the mask as a select to -inf, `tile_math.exact_softmax_step`).

Both invariant consumers call it, the prompt consumer (`gluon_invariant.py`) and the decode
kernel's (`gluon_decode_invariant.py`): a token computed inside a prompt and the same token as
a decode step then take the same operations per tile, so the same bits. It changes with the
mode's arithmetic (the scale in the exponent, the max slack), never with a consumer's
schedule. Imports nothing but Triton.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

try:
    from pagedattn.ops.triton.gluon_softmax import LOG2E
except ImportError:  # compiled standalone, without torch (tools/gluon_sass.py)
    from gluon_softmax import LOG2E


@gluon.jit
def exact_tile(s, m_i, l_i, start, offs_n, q_pos, slope, qk, full_lo, full_hi, seq_len,
               scores, keys, LEAN: gl.constexpr = False):
    """One key tile's scores S (Q K^T) into the state (m_i, l_i): `tile_loop._scores`, the
    mask where the tile leaves the keys every row sees (`tile_loop._mask`: a select, so a
    tile masked or not gives the same bits), `tile_math.exact_softmax_step`. LEAN: the
    mask's booleans from one compare a key against per-row limits (`_visible`). Returns (p,
    alpha, l_i, m_i). scores.SCALE_IN_EXP: the scale qk in the exponent's fma
    (`tile_math.exact_scaled_step`; neither soft cap nor ALiBi then)."""
    if not scores.SCALE_IN_EXP:
        s = s * qk
    if scores.USE_SOFTCAP:  # tanh(x) = 1 - 2 / (e^{2x} + 1); softcap carries log2(e)
        s = scores.softcap * (1.0 - 2.0 / (gl.exp2(s * (2.0 * LOG2E)) + 1.0))
    k_pos = start + offs_n
    if scores.USE_ALIBI:
        s += gl.expand_dims(slope, 1) * (gl.expand_dims(k_pos, 0)
                                         - gl.expand_dims(q_pos, 1)).to(gl.float32)
    # The step sits inside both branches: after a join ptxas moves the P V wait above it
    # (`gluon_softmax.softmax_tile` says so too), and the exponentials would not overlap it.
    if (start < full_lo) | (start + keys.BLOCK_N > full_hi):
        if LEAN:
            visible = _visible(start, offs_n, q_pos, seq_len, keys)
        else:
            rel = gl.expand_dims(k_pos, 0) - gl.expand_dims(q_pos, 1)
            visible = rel < seq_len - gl.expand_dims(q_pos, 1)  # k_pos < seq_len, every row
            if keys.WINDOW_LEFT:
                visible = visible & (rel >= -keys.left)
            if keys.WINDOW_RIGHT:
                visible = visible & (rel <= keys.right)
        p, alpha, l_new, m_new = _exact_step(gl.where(visible, s, float("-inf")), m_i, l_i,
                                             qk, scores.SCALE_IN_EXP, scores.MAX_SLACK)
    else:
        p, alpha, l_new, m_new = _exact_step(s, m_i, l_i, qk, scores.SCALE_IN_EXP,
                                             scores.MAX_SLACK)
    return p, alpha, l_new, m_new


@gluon.jit
def _visible(start, offs_n, q_pos, seq_len, keys):
    """`exact_tile`'s mask, the same booleans by fewer operations: key k = start + c is
    visible to the row at q_pos iff c <= q_pos + min(seq_len - 1 - q_pos, right) - start (k <
    seq_len and k - q_pos <= right, over integers), and with a left window iff c >= q_pos -
    min(left, q_pos) - start (k - q_pos >= -left; a window reaching past key 0 admits every
    k >= 0): one or two compares a key against per-row limits, no sum near int32's ends."""
    rel_hi = seq_len - 1 - q_pos
    if keys.WINDOW_RIGHT:
        rel_hi = gl.minimum(rel_hi, keys.right)
    c = gl.expand_dims(offs_n, 0)
    visible = c <= gl.expand_dims(q_pos + rel_hi - start, 1)
    if keys.WINDOW_LEFT:
        visible = visible & (c >= gl.expand_dims(q_pos - gl.minimum(keys.left, q_pos) - start,
                                                 1))
    return visible


@gluon.jit
def _exact_step(s, m_i, l_i, qk, SCALE_IN_EXP: gl.constexpr, SLACK: gl.constexpr = -1):
    """`tile_math.exact_softmax_step`: the rescale exactly 1 where the running max holds,
    the row sum of this tile's weights added to l_i * alpha; SCALE_IN_EXP: over raw scores,
    `tile_math.exact_scaled_step` (2^fma(s, qk, -m), the max of raw scores times qk).
    SLACK > 0: the max by `tile_math.invariant_max` (`SWITCHES.invariant_max_slack`)."""
    if SCALE_IN_EXP:
        tile_max = gl.max(s, axis=1) * qk
    else:
        tile_max = gl.max(s, axis=1)
    if SLACK > 0:
        m_new = gl.where(tile_max > m_i + SLACK, tile_max, m_i)
    else:
        m_new = gl.maximum(m_i, tile_max)
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    if SCALE_IN_EXP:
        # fma takes operands of one shape: qk and -m spread over the tile (no arithmetic)
        s, neg_m = gl.broadcast(s, -gl.expand_dims(m_safe, 1))
        p = gl.exp2(gl.fma(s, gl.full(s.shape, qk, gl.float32, layout=s.type.layout), neg_m))
    else:
        p = gl.exp2(s - gl.expand_dims(m_safe, 1))
    alpha = gl.where(m_new == m_i, 1.0, gl.exp2(m_i - m_safe))
    return p, alpha, l_i * alpha + gl.sum(p, axis=1), m_new
