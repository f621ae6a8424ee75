"""Batch-invariant attention on the device: every query row by one sequence of operations,
whatever else its batch holds.

The portable pass (`attention.py` with INVARIANT_SPLIT set) serves every request, decodes
included, with one tile configuration (`invariant_plan.py`), so each row goes through the
same products, reductions and MMA instructions. Its keys are cut into splits of
INVARIANT_SPLIT keys at absolute positions (split s holds keys [s * SPLIT, (s + 1) * SPLIT)),
each split walked in key tiles on the grid anchored at key 0; a row's state restarts at every
split (`finish_split`) and the splits are folded into one result in increasing order
(`fold_split`). A program may fold all of its rows' splits itself, or (few programs for the
GPU: small decode batches) each program computes one split and `fold_splits_kernel` folds
them in the same order with the same function: the same bits either way; or
(`SWITCHES.invariant_self_fold`) the split programs of a query block and KV head take tickets
once their partials are stored, and the last folds them all (`fold_own_splits`), again in
the same order with the same function. What makes a row's bits independent of its
neighbours:

- tiles a row does not see (past its causal diagonal, before its window, a split it has no
  key in) leave its state exactly as it was: masked scores weigh exactly 0 and the rescale of
  an unchanged maximum is exactly 1 (`tile_math.exact_softmax_step`); an empty split folds
  as a no-op (`fold_split` keeps the other side untouched);
- the sink joins the state of split 0 only, folded first even where none of the rows' keys
  lie in split 0 (a sliding window);
- the kernels compile without fused multiply-adds (`enable_fp_fusion=False`, a launch
  option): a masked tile's code and an unmasked tile's, an in-program fold's and the
  reduce's, round each operation alike.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagedattn import envs
from pagedattn.ops.triton.tile_loop import attend, init_state, store_rows, tile_ranges
from pagedattn.ops.triton.tile_math import LN2, safe_max, tile_width


@triton.constexpr_function
def _interpreted():
    """Whether the kernel runs in Triton's CPU interpreter, whose tl.dot rounds a row by its
    position in the tile (`tile_loop._product`)."""
    return envs.TRITON_INTERPRET


@triton.jit
def finish_split(acc, m_i, l_i, v_scale):
    """One split's softmax state as its output rows and their LSEs in log2 units (-inf for a
    row that saw no key in it): `tile_math.finish_rows` without the change of base, which
    the fold would otherwise round into its subtraction."""
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    if v_scale is None:
        out = acc / l_safe[:, None]
    else:
        out = acc * (v_scale / l_safe)[:, None]
    return out, tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))


@triton.jit
def fold_split(out, lse2, o, o_lse2):
    """The splits so far (out [M, Dv], lse2 [M] in log2 units; -inf: none yet) with the next
    split's (o, o_lse2) folded in. A side that saw no key leaves the other exactly as it is:
    no rounding, whatever the approximate exp2 gives for 0."""
    top = safe_max(tl.maximum(lse2, o_lse2))
    w = tl.exp2(lse2 - top)
    w_o = tl.exp2(o_lse2 - top)
    total = w + w_o
    total = tl.where(total == 0.0, 1.0, total)  # both empty: the where below keeps `out`
    merged = (out * w[:, None] + o * w_o[:, None]) / total[:, None]
    keep = o_lse2 == float("-inf")
    take = (lse2 == float("-inf")) & (o_lse2 != float("-inf"))
    out = tl.where(keep[:, None], out, tl.where(take[:, None], o, merged))
    lse2 = tl.where(keep, lse2, tl.where(take, o_lse2, top + tl.log2(total)))
    return out, lse2


@triton.jit
def attend_fixed_splits(q, q_pos, qk_scale, softcap, slope, window_left, window_right, keys,
                        sinks, head, row_ok, v_scale, key_lo, key_hi, full_lo, full_hi,
                        seq_len, split, SPLIT_KEYS: tl.constexpr, SPLIT_KV: tl.constexpr,
                        ONE_KEY_LOOP: tl.constexpr, PAGED_KEYS: tl.constexpr,
                        PAGE: tl.constexpr, HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        FP8_V_IN_REGS: tl.constexpr, SCALE_IN_EXP: tl.constexpr = False,
                        MAX_SLACK: tl.constexpr = 0):
    """The rows' output and log2 LSE over keys [key_lo, key_hi) (`tile_loop.attend`'s
    arguments), split by SPLIT_KEYS keys at absolute positions and folded in order; with
    SPLIT_KV only split `split`'s state (a partial for `fold_splits_kernel`). SCALE_IN_EXP
    (`launch.SWITCHES.invariant_scale_in_exp`; only where neither soft cap nor ALiBi is
    given): the score scale rides in the exponent's fma (`tile_math.exact_scaled_step`).
    MAX_SLACK (`launch.SWITCHES.invariant_max_slack`): the running max's slack
    (`tile_math.invariant_max`)."""
    out = tl.zeros([BLOCK_M, tile_width(HEAD_DV)], dtype=tl.float32)
    lse2 = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    if SPLIT_KV:
        first = split
        last = split + 1
    else:
        first = key_lo // SPLIT_KEYS
        last = tl.cdiv(key_hi, SPLIT_KEYS)
        if sinks is not None:
            if first > 0:  # split 0 holds the sink and none of these rows' keys
                acc, l_i, m_i = init_state(sinks, head, row_ok, True, BLOCK_M, HEAD_DV)
                o, o_lse2 = finish_split(acc, m_i, l_i, v_scale)
                out, lse2 = fold_split(out, lse2, o, o_lse2)
    for s in range(first, last):
        acc, l_i, m_i = init_state(sinks, head, row_ok, s == 0, BLOCK_M, HEAD_DV)
        # Tiles on the grid of key 0: the split's start and key_lo rounded down to it.
        lo = tl.maximum(s * SPLIT_KEYS, key_lo // BLOCK_N * BLOCK_N)
        hi = tl.minimum(key_hi, (s + 1) * SPLIT_KEYS)
        tile_lo, unmasked_lo, unmasked_hi = tile_ranges(lo, hi, full_lo, full_hi, 0, BLOCK_N)
        acc, l_i, m_i = attend(
            acc, l_i, m_i, q, q_pos, qk_scale, softcap, slope, window_left, window_right,
            keys, tile_lo, unmasked_lo, unmasked_hi, hi, seq_len, ONE_KEY_LOOP=ONE_KEY_LOOP,
            PAGED_KEYS=PAGED_KEYS, DESCRIPTOR_KEYS=False, KEY_ROWS=False, PAGE=PAGE,
            HEAD_D=HEAD_D, HEAD_DV=HEAD_DV, BLOCK_N=BLOCK_N, FP8_V_IN_REGS=FP8_V_IN_REGS,
            BATCH_INVARIANT=2 if SCALE_IN_EXP else True, ELEMENTWISE_DOTS=_interpreted(),
            INVARIANT_SLACK=MAX_SLACK)
        o, o_lse2 = finish_split(acc, m_i, l_i, v_scale)
        out, lse2 = fold_split(out, lse2, o, o_lse2)
    return out, lse2


@triton.jit
def fold_splits_kernel(Out, Lse, PartOut, PartLse, cu_seqlens_q, seqused_k, num_seqs, total_q,
                       stride_ot, stride_oh, NUM_HEADS: tl.constexpr, HEAD_DV: tl.constexpr,
                       SPLIT_KEYS: tl.constexpr, BLOCK_T: tl.constexpr):
    """Fold the partial states of the split programs, split 0 first: PartOut [splits,
    total_q, NUM_HEADS, HEAD_DV] float32 and PartLse [splits, total_q, NUM_HEADS] (log2
    units) into Out [total_q, NUM_HEADS, HEAD_DV] and Lse [NUM_HEADS, total_q] (natural
    log; None: none). A request of seq_len keys has cdiv(seq_len, SPLIT_KEYS) splits; a
    program folds BLOCK_T tokens of one head, rows as in the attention kernel's tiles."""
    BLOCK_DV: tl.constexpr = tile_width(HEAD_DV)
    head = tl.program_id(1)
    token = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    num_tokens = tl.load(cu_seqlens_q + num_seqs)  # past it: a graph's padding rows
    # Each token's sequence: the cu_seqlens_q entries at or before it, counted.
    seq = tl.zeros([BLOCK_T], dtype=tl.int32) - 1
    for base in range(0, num_seqs, 64):
        s = base + tl.arange(0, 64)
        first = tl.load(cu_seqlens_q + s, mask=s < num_seqs, other=0)
        seen = (first[None, :] <= token[:, None]) & (s < num_seqs)[None, :]
        seq += tl.sum(seen.to(tl.int32), 1)
    ok = token < num_tokens
    splits = tl.where(ok, tl.cdiv(tl.load(seqused_k + seq, mask=ok, other=0), SPLIT_KEYS), 0)
    offs_dv = tl.arange(0, BLOCK_DV)
    token = token.to(tl.int64)
    out = tl.zeros([BLOCK_T, BLOCK_DV], dtype=tl.float32)
    lse2 = tl.full([BLOCK_T], float("-inf"), dtype=tl.float32)
    for split in range(0, tl.max(splits, 0)):
        has = split < splits  # a row without this split folds an empty part: a no-op
        part = (split * total_q + token) * NUM_HEADS + head
        o = tl.load(PartOut + part[:, None] * HEAD_DV + offs_dv[None, :],
                    mask=has[:, None] & (offs_dv[None, :] < HEAD_DV), other=0.0)
        o_lse2 = tl.load(PartLse + part, mask=has, other=float("-inf"))
        out, lse2 = fold_split(out, lse2, o, o_lse2)
    # + 0.0 turns -0.0 into 0.0, nothing else: an output that is exactly zero (every visible
    # value 0, as fp8 rounds small ones) sums p = 0 against the other keys of its tiles, and
    # those keys (the next request's chunk, or the last key re-read past the end) and so the
    # zero's sign depend on the batch.
    tl.store(Out + token[:, None] * stride_ot + head * stride_oh + offs_dv[None, :],
             (out + 0.0).to(Out.dtype.element_ty),
             mask=ok[:, None] & (offs_dv[None, :] < HEAD_DV))
    if Lse is not None:
        tl.store(Lse + head * total_q + token, lse2 * LN2, mask=ok)


@triton.jit
def fold_own_splits(Out, Lse, PartOut, PartLse, Tickets, token, head, row_ok, seq_len,
                    total_q, num_heads, SPLIT_KEYS: tl.constexpr, HEAD_DV: tl.constexpr,
                    BLOCK_M: tl.constexpr):
    """After a split program stored its partial (PartOut / PartLse as `fold_splits_kernel`
    reads them): its ticket from the counter Tickets (int32, this query block and KV head's)
    and, for the program that draws the last of the request's cdiv(seq_len, SPLIT_KEYS),
    the rows (token, head) folded split 0 first into Out / Lse (`store_rows`' layout) by
    `fold_splits_kernel`'s operations, and the counter set back to 0 for the next launch.
    The release half of the ticket's atomic publishes the stores before it (the barrier
    first puts every thread's there), its acquire half shows the folder every split's."""
    splits = tl.cdiv(seq_len, SPLIT_KEYS)
    tl.debug_barrier()
    ticket = tl.atomic_add(Tickets, 1, sem="acq_rel", scope="gpu")
    if ticket == splits - 1:
        offs_dv = tl.arange(0, tile_width(HEAD_DV))
        mask = row_ok[:, None] & (offs_dv[None, :] < HEAD_DV)
        out = tl.zeros([BLOCK_M, tile_width(HEAD_DV)], dtype=tl.float32)
        lse2 = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        for split in range(0, splits):
            part = (split * total_q + token) * num_heads + head
            # .cg: from L2, where the other programs' stores are (never a stale L1 line)
            o = tl.load(PartOut + part[:, None] * HEAD_DV + offs_dv[None, :], mask=mask,
                        other=0.0, cache_modifier=".cg")
            o_lse2 = tl.load(PartLse + part, mask=row_ok, other=float("-inf"),
                             cache_modifier=".cg")
            out, lse2 = fold_split(out, lse2, o, o_lse2)
        # + 0.0: `fold_splits_kernel`'s last operations, for its bits
        store_rows(Out, Lse, out + 0.0, lse2 * LN2, token, head, row_ok, total_q, num_heads,
                   HEAD_DV)
        tl.store(Tickets, 0)  # every ticket is drawn: no program of this launch reads it
