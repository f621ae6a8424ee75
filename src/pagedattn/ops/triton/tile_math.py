"""The math every Triton kernel of the provider shares (imports nothing but Triton).

Attention scores live in log2 units: the launcher folds log2(e) into the score scale, so the
softmax is `exp2` (one MUFU.EX2 per score). A row's softmax state is (acc, l, m): its
unnormalised output, the sum of its weights and its running maximum, in log2 units. A row
that sees no key keeps m = -inf and l = 0 and ends as output 0 with LSE -inf, never NaN.

Merged states (the split-KV reduce, `merge_attn_states`, the DCP correction) carry natural-log
LSEs, where -inf (and, from other kernels, +inf) marks a part that saw no key.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # host code: LOG2E.value
LN2 = tl.constexpr(0.6931471805599453)


@triton.constexpr_function
def tile_width(n):
    """Tile width of a head dimension of n elements: a power of 2, at least tl.dot's 16."""
    return max(16, triton.next_power_of_2(n))


def pow2_at_least(n: int) -> int:
    """The smallest power of 2 >= n (1 for n <= 1): `triton.next_power_of_2` in plain Python,
    for planners on the host, where each call through Triton's constexpr wrapper costs 1.4-2
    us (and our own constexpr functions ~5 us)."""
    return 1 << max(0, n - 1).bit_length()


def decode_query_count(group: int) -> int:
    """Query tokens per decode-pass program: its 16 tile rows (tl.dot's minimum) hold that
    many tokens x the GQA group padded to a power of 2, and at least one token. Requests
    with more queries belong to the prefill passes. The planners call this plain function
    (a call through Triton's constexpr wrapper costs ~5 us on the host); the kernels, the
    same function as `decode_queries` (so it calls no other function of ours: Triton's
    dependency walk of a kernel refuses a plain one)."""
    return max(1, 16 // (1 << max(0, group - 1).bit_length()))


decode_queries = triton.constexpr_function(decode_query_count)


@triton.constexpr_function
def dot_precision(dot_dtype):
    """fp32 operands multiply exactly (fp32 models; bf16 under the interpreter); 16-bit
    operands ignore the setting."""
    return "ieee" if dot_dtype == tl.float32 else "tf32"


@triton.jit
def safe_max(m):
    """A running maximum safe to subtract: 0 where every value was -inf (an empty row or
    part), so that e^(x - m) gives 0 there, not NaN."""
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def softmax_step(s, m_i, l_i):
    """One online-softmax step over scores s [M, N] (log2 units) against the running max m_i
    and sum l_i: the weights p, the factor alpha that rescales the accumulator, the new l_i
    and the new m_i."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = safe_max(m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    return p, alpha, l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def slot_softmax_step(s, m_i, l_slots):
    """`softmax_step` whose sums stay per key slot: l_slots [M, N] rescaled and added to
    elementwise, the rows summed once after the last tile (`tl.sum(l_slots, 1)`). A row's
    sum across the warps that hold its keys then costs no shared-memory round trip and no
    barrier a tile; the max still does."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = safe_max(m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    return p, alpha, l_slots * alpha[:, None] + p, m_new


@triton.jit
def invariant_max(m_i, tile_max, SLACK: tl.constexpr = 0):
    """Batch-invariant mode's new running max: the larger of m_i and the tile's, or with
    SLACK > 0 (`launch.SWITCHES.invariant_max_slack`) m_i kept unless the tile's exceeds it
    by more than SLACK (a row at -inf takes any finite tile max; a masked tile's -inf never
    moves it). Every pass computes it alike: one add and one compare, round to nearest."""
    if SLACK > 0:
        m_new = tl.where(tile_max > m_i + SLACK, tile_max, m_i)
    else:
        m_new = tl.maximum(m_i, tile_max)
    return m_new


@triton.jit
def exact_softmax_step(s, m_i, l_i, SLACK: tl.constexpr = 0):
    """`softmax_step` whose rescale factor is exactly 1 where the running max holds (e^0 by
    the hardware's approximation need not be), so a tile whose scores are all masked leaves
    the state as it was, bit for bit: batch-invariant mode visits such tiles for some rows
    and not for others (a query block's later rows, a decode's row alone). SLACK: the max
    by `invariant_max`."""
    m_new = invariant_max(m_i, tl.max(s, 1), SLACK)
    m_safe = safe_max(m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.where(m_new == m_i, 1.0, tl.exp2(m_i - m_safe))
    return p, alpha, l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def exact_scaled_step(s, m_i, l_i, qk, SLACK: tl.constexpr = 0):
    """`exact_softmax_step` over raw scores s whose scale qk (> 0) rides in the exponent:
    p = 2^fma(s, qk, -m), one rounding where s * qk - m rounds twice (and one instruction a
    score). The running max is the same value: rounding is monotonic, so max(s) * qk rounds
    to the largest of the rounded s * qk. An explicit fma, so every pass that performs it
    rounds it alike (batch-invariant mode's kernels compile without contracting). SLACK: the
    max by `invariant_max`."""
    m_new = invariant_max(m_i, tl.max(s, 1) * qk, SLACK)
    m_safe = safe_max(m_new)
    # fma takes operands of one shape: qk and -m spread over the tile (no arithmetic)
    p = tl.exp2(tl.fma(s, tl.broadcast_to(qk, s.shape), tl.broadcast_to(-m_safe[:, None],
                                                                        s.shape)))
    alpha = tl.where(m_new == m_i, 1.0, tl.exp2(m_i - m_safe))
    return p, alpha, l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def finish_rows(acc, m_i, l_i, v_scale):
    """The epilogue of a softmax state: output rows acc / l (times v_scale, a value descale,
    unless it is None) and their natural-log LSEs; a row with l = 0 gives 0 and -inf."""
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    if v_scale is None:
        out = acc / l_safe[:, None]
    else:
        out = acc * (v_scale / l_safe)[:, None]
    lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)
    return out, lse


@triton.jit
def merged_lse(total, top):
    """The LSE of merged parts whose weights e^(lse - top) sum to `total`: -inf when every
    part is empty (total = 0)."""
    return tl.where(total == 0.0, float("-inf"), tl.log(tl.where(total == 0.0, 1.0, total)) + top)


@triton.jit
def merge_weights(lses):
    """Parts with natural-log LSEs lses [n] (-inf: empty): their weights e^(lse - top)
    against the largest LSE, the weights' sum (1 where every part is empty, so dividing by
    it gives 0) and the merged LSE."""
    top = safe_max(tl.max(lses, 0))
    w = tl.exp(lses - top)
    total = tl.sum(w, 0)
    return w, tl.where(total == 0.0, 1.0, total), merged_lse(total, top)


@triton.jit
def empty_as_neg_inf(lse):
    """Other kernels (flash-attn's among them) report an empty part as +inf as well."""
    return tl.where(lse == float("inf"), float("-inf"), lse)


@triton.jit
def find_seq(cu_seqlens_q, pid, num_seqs, BLOCK_Q: tl.constexpr, SLOT_PER_SEQ: tl.constexpr):
    """The last s with cu_seqlens_q[s] // BLOCK_Q (+ s with SLOT_PER_SEQ) <= pid, by counting:
    one vector load per 64 sequences, not a binary search's chain of dependent loads. With
    BLOCK_Q = 1 and no slot per sequence it is the sequence that holds token `pid`."""
    count = 0
    for base in range(0, num_seqs, 64):
        s = base + tl.arange(0, 64)
        first = tl.load(cu_seqlens_q + s, mask=s < num_seqs, other=0) // BLOCK_Q
        if SLOT_PER_SEQ:
            first += s
        count += tl.sum(((first <= pid) & (s < num_seqs)).to(tl.int32), 0)
    return count - 1
