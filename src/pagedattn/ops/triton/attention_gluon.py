"""The Gluon prefill pass on Hopper: plan once per batch, launch per layer.

`plan_gluon_prefill(...)` decides whether the warp-specialised kernel of `gluon_prefill.py`
can serve a batch (sm_90, Triton 3.6's Gluon API, a 16-bit q with K/V of its dtype or an fp8
paged cache with k/v descales, or an fp8 q with a q descale over an fp8 cache, head sizes
64/128/256) and returns a `GluonPrefillLaunch`, or
None where it cannot (the caller then keeps the `tl` passes). Everything that depends on the
batch alone is fixed there: the schedule (`launch_config`: a persistent grid of at most one
program per SM walking (query block, head) work items, heaviest causal block first), the
batch's metadata tensors, the kernel's batch arguments, the global scratch the kernel builds
its tensor descriptors in.

`GluonPrefillLaunch.run(q, k, v, out, ...)` (`gluon_launch.py`) reads the layer's pointers
and strides and launches through `fast_launch` (no re-specialisation per call): the
descriptors are built on the device by the producer warp, so the host encodes none. It
reads no device value, so a step's plan runs for every layer and under CUDA graphs.

Keys: `cu_seqlens_k` rows for a dense varlen batch; for a paged batch the context comes from
the cache page by page and, with `dense_new_kv`, the new tokens from `k_new` / `v_new`
([total_q, num_kv_heads, head_size(_v)], the rows the layer just wrote). Caches in NHD or
HND order both work: a page of one KV head must be PAGE rows of the cache viewed 2-D.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from pagedattn.ops.triton.gluon_launch import (  # noqa: F401 - re-exported: the pass's API
    GluonLayerPlan,
    GluonPrefillLaunch,
    GluonSchedule,
    fold_at,
)
from pagedattn.ops.triton.invariant_config import (
    invariant_gluon_slack,
    invariant_scale_in_exp,
    invariant_skip_unseen,
    invariant_tiles_128,
)
from pagedattn.ops.triton.launch import SWITCHES
from pagedattn.ops.triton.tma_views import CacheRows, paged_rows  # noqa: F401 - as above

try:
    import triton
except ImportError:  # a CPU install without Triton
    triton = None
try:  # Gluon ships with Triton 3.5+; its Hopper API as used here is Triton 3.6's
    from pagedattn.ops.triton import gluon_prefill
    from pagedattn.ops.triton.gluon_schedule import (
        CONSUMER_ROWS,
        config_for,
        three_consumers_refusal,
        wide_config_for,
    )
except Exception:  # noqa: BLE001 - any import failure means "this install cannot serve"
    gluon_prefill = None

LOG2E = 1.4426950408889634
GLUON_TRITON = "3.6."  # the Gluon API the kernel is written for (later releases rename it)
HEAD_SIZES = (64, 128, 256)
# Three consumers (192-row items) by default from this many causal queries a request on
# average (`long_prompts`).
THREE_CONSUMERS_MIN_MEAN_Q = 8192
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def gluon_available() -> bool:
    """True where this install can compile the kernel: Triton 3.6 with Gluon importable."""
    return gluon_prefill is not None and triton.__version__.startswith(GLUON_TRITON)


@functools.lru_cache(maxsize=8)
def _sm90(device: torch.device) -> bool:
    return (device.type == "cuda" and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device)[0] == 9)


@functools.lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan_gluon_prefill(*, device: torch.device, cu_seqlens_q: torch.Tensor,
                       seqused_k: torch.Tensor, cu_seqlens_k: Optional[torch.Tensor] = None,
                       block_table: Optional[torch.Tensor] = None, batch: int, total_q: int,
                       max_seqlen_q: int, max_seqlen_k: int, num_heads: int,
                       num_kv_heads: int, head_size: int, head_size_v: int,
                       q_dtype: torch.dtype, kv_dtype: torch.dtype, causal: bool,
                       window_left: int, window_right: int, softcap: float, use_alibi: bool,
                       use_sinks: bool, write_lse: bool, page_size: int, dense_new_kv: bool,
                       softmax_scale: float, out_dtype: Optional[torch.dtype] = None,
                       use_q_descale: bool = False, use_kv_descale: bool = False,
                       skip_q_len: int = 0, cuda_graph: bool = False,
                       invariant: Optional[tuple[int, int]] = None
                       ) -> Optional[GluonPrefillLaunch]:
    """The Gluon pass's launch for a batch, or None where it cannot serve (`why_not`).

    Keys are paged (from block_table's cache, plus dense k_new / v_new rows with
    dense_new_kv) when block_table is given, else dense rows at cu_seqlens_k.
    skip_q_len: requests of at most this many queries are left to another pass (the plan's
    decode pass). invariant: (block_n, split keys) of batch-invariant mode's `tl` tiles: the
    invariant consumer (`gluon_invariant.py`; `invariant_plan.plan_invariant_gluon` decides
    that it can serve). cuda_graph: the launch serves any later batch of at most `batch` requests
    of at most `max_seqlen_q` queries (grid and items are bounds from these ints and each
    program finds its work on the device), so the flag changes nothing here; it is accepted
    so the caller can pass its planning keywords through.
    """
    paged = block_table is not None
    if why_not(device=device, num_heads=num_heads, num_kv_heads=num_kv_heads,
               head_size=head_size, head_size_v=head_size_v, q_dtype=q_dtype,
               kv_dtype=kv_dtype, out_dtype=out_dtype, paged=paged, page_size=page_size,
               use_q_descale=use_q_descale, use_kv_descale=use_kv_descale):
        return None
    schedule = launch_config(
        sm_count=_sm_count(device), batch=batch, total_q=total_q, max_seqlen_q=max_seqlen_q,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
        head_size_v=head_size_v, causal=causal, window_left=window_left,
        window_right=window_right, softcap=softcap, use_alibi=use_alibi, use_sinks=use_sinks,
        write_lse=write_lse, paged=paged, page_size=page_size, dense_new_kv=dense_new_kv,
        softmax_scale=softmax_scale, skip_q_len=skip_q_len, kv_fp8=kv_dtype in FP8,
        use_kv_descale=use_kv_descale, max_seqlen_k=max_seqlen_k, q_fp8=q_dtype in FP8,
        use_q_descale=use_q_descale, invariant=invariant,
        split_q=not invariant and split_q_for(q_dtype, kv_dtype, max(head_size, head_size_v)))
    return GluonPrefillLaunch(schedule, cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k,
                              cu_seqlens_k=cu_seqlens_k, block_table=block_table)


# The longest-first order across requests (`lpt_group`): a batch of long requests (at least
# LPT_MIN_BLOCKS query blocks each) whose keys and values exceed LPT_L2_BYTES runs in two
# halves, each long enough for LPT_MIN_ROUNDS rounds of the persistent grid. Measured on an
# H100 (KERNEL_NOTES v14): 8 x 2048 halves +1 to +5% at heads 64-256; groups of 3.9 rounds
# lost 3-5%; 32 x 512 (4 blocks a request) halves 0% dense and -3% over the paged cache.
LPT_L2_BYTES = 32 << 20
LPT_MIN_ROUNDS = 6
LPT_MIN_BLOCKS = 8


def lpt_group(batch: int, blocks: int, heads: int, kv_bytes: int, grid: int) -> int:
    """The LPT_ACROSS order for `batch` requests of up to `blocks` query blocks and
    `kv_bytes` of keys and values each, `heads` items a block, on `grid` programs: 1 (block
    r of every request before block r + 1 of any), or batch // 2 (the same within each half
    of the batch, one half after the other: half the K/V in flight competes for L2) where
    the requests are long, their K/V exceeds LPT_L2_BYTES and a half holds LPT_MIN_ROUNDS
    rounds of the grid. `SWITCHES.gluon_lpt_group` overrides it (a group size that divides
    the batch)."""
    forced = SWITCHES.gluon_lpt_group
    if forced is not None:
        return forced if forced >= 1 and batch % forced == 0 else 1
    half = batch // 2
    if batch >= 4 and batch % 2 == 0 and blocks >= LPT_MIN_BLOCKS and \
            batch * kv_bytes > LPT_L2_BYTES and half * blocks * heads >= LPT_MIN_ROUNDS * grid:
        return half
    return 1


# Dynamic item hand-out (`item_order`): programs take items from a counter as they free up,
# in groups of DYNAMIC_GROUP requests, so the items in flight read two requests' K/V (L2
# hits) while the hand-out keeps the balance the static order loses with small groups. It
# pays where L2 is the limit: a batch of at least DYNAMIC_MIN_BATCH long requests (of
# LPT_MIN_BLOCKS blocks) whose K/V exceeds DYNAMIC_KV_BYTES, read by at most
# DYNAMIC_MAX_GROUP query heads per KV head (fewer siblings share each tile in L2: head 256
# at 16 q / 8 KV reads twice head 128's K/V bytes per FLOP). Measured on an H200 against the
# static order, tree beside tree in one call (KERNEL_NOTES v16): 8 x 2048 head 256 0.95-0.97x
# the time; head 128 (GQA 4) 1.00, head 64 0.99, and 32 x 512 1.08-1.16x, so those keep it.
DYNAMIC_MIN_BATCH = 4
DYNAMIC_GROUP = 2
DYNAMIC_KV_BYTES = 48 << 20
DYNAMIC_MAX_GROUP = 2

# The wide fp8 key tiles (`wide_tiles`) pay from this many keys in the longest request: a
# causal query block's diagonal tile masks about half of its keys, and fewer, larger tiles
# balance short requests' items worse (H200, tools/ab_fp8_pv.py, their time against the
# default tiles': head 128 32 x 512 0.80x, 8 x 2048 0.86x, 4 x 4096 0.98x, 1 x 8192 1.03x,
# 4096 after 4096 cached 1.04x, 1 x 16384 1.05x, 2048 after 30720 cached 1.07x; head 256
# 32 x 512 0.78x, 8 x 2048 1.00x, 1 x 8192 1.07x). Between them (2026-12-02, V^T in
# 128-column slabs): head 128 4 x 4096 0.99x, 1 x 6144 and 2 x 6144 1.04x, 2048 after 4096
# cached 1.05x; head 256 8 x 2048 0.96x, 1 x 8192 1.04x.
WIDE_MIN_KEYS = 6144


def item_order(batch: int, blocks: int, heads: int, group: int, kv_bytes: int, grid: int
               ) -> tuple[int, bool]:
    """(LPT_ACROSS, DYNAMIC) for `batch` requests of up to `blocks` query blocks and
    `kv_bytes` of keys and values each, `heads` items a block (`group` of them per KV head),
    on `grid` programs, in the longest-first order across requests: dynamic groups of
    DYNAMIC_GROUP requests where L2 limits (see above), else the static `lpt_group` order.
    `SWITCHES.gluon_dynamic` forces the hand-out either way (with `gluon_lpt_group`'s group
    where forced too)."""
    dynamic = SWITCHES.gluon_dynamic
    if dynamic is None:
        dynamic = batch >= DYNAMIC_MIN_BATCH and batch % DYNAMIC_GROUP == 0 and \
            blocks >= LPT_MIN_BLOCKS and group <= DYNAMIC_MAX_GROUP and \
            batch * kv_bytes > DYNAMIC_KV_BYTES
    if dynamic and SWITCHES.gluon_lpt_group is None:
        return (DYNAMIC_GROUP if batch % DYNAMIC_GROUP == 0 else 1), True
    return lpt_group(batch, blocks, heads, kv_bytes, grid), bool(dynamic)


def launch_config(*, sm_count: int, batch: int, total_q: int, max_seqlen_q: int,
                  num_heads: int, num_kv_heads: int, head_size: int, head_size_v: int,
                  causal: bool, window_left: int, window_right: int, softcap: float,
                  use_alibi: bool, use_sinks: bool, write_lse: bool, paged: bool,
                  page_size: int, dense_new_kv: bool, softmax_scale: float,
                  skip_q_len: int = 0, kv_fp8: bool = False,
                  use_kv_descale: bool = False, max_seqlen_k: int = 0, q_fp8: bool = False,
                  use_q_descale: bool = False, split_q: bool = False,
                  invariant: Optional[tuple[int, int]] = None) -> GluonSchedule:
    """The schedule and switches of a launch, from host ints alone (no device query).
    kv_fp8: the paged cache is fp8; every key then comes from it (the new tokens as the cache
    holds them, quantized, as the portable pass reads them), so dense_new_kv is dropped.
    q_fp8: q is fp8 too (over an fp8 cache only): Q K^T runs as an fp8 product.
    split_q: a 16-bit q over an fp8 cache (`split_q_for`): Q K^T runs as two fp8 products of
    q's two e4m3 terms, and K is not converted.
    max_seqlen_k: the longest request's keys (0: max_seqlen_q), for the order's L2 budget and the
    wide fp8 tiles' rule (`wide_tiles`).
    invariant: (block_n, split keys): batch-invariant mode's consumer over tiles of block_n
    keys from the cache alone (no dense new rows), two consumers, no fp8 product, the score
    scale as the `tl` pass applies it (scaled scores, or with
    `SWITCHES.invariant_scale_in_exp` its explicit fma in the exponent), no lane masks
    (`gluon_invariant.py`); with `SWITCHES.invariant_gluon_lean` its LEAN form."""
    if invariant and (q_fp8 or split_q or dense_new_kv or not paged):
        raise ValueError("the invariant consumer reads a paged cache alone with 16-bit "
                         f"products (q_fp8={q_fp8}, split_q={split_q}, paged={paged}, "
                         f"dense_new_kv={dense_new_kv})")
    if q_fp8 and not kv_fp8:
        raise ValueError("q_fp8 needs kv_fp8: an fp8 q's product reads an fp8 cache")
    pv_fp8 = fp8_pv(head_size, head_size_v) and q_fp8 and not invariant
    max_slack = softmax_switches()
    consumers = 2 if invariant else consumers_for(
        max(head_size, head_size_v), kv_fp8 or q_fp8, long_prompts(batch, total_q, causal),
        q_fp8=q_fp8)
    block_m = CONSUMER_ROWS.value * consumers
    p_words = pv_fp8 and SWITCHES.gluon_fp8_p_words is not False
    # (three consumers hold no 256-key S in their 160 registers: they take the default tiles)
    wide = consumers == 2 and wide_tiles(head_size, head_size_v, p_words, use_alibi, softcap,
                                         max_seqlen_k or max_seqlen_q)
    block_n, num_buf, num_qbuf, stages, consumer_regs, producer_regs = (
        wide_config_for(head_size) if wide else
        config_for(max(head_size, head_size_v), kv_fp8, q_fp8, split_q, consumers))
    vt_cols, num_buf, vt_prefetch = v_transpose(pv_fp8, head_size_v, wide, num_buf)
    if invariant:
        block_n = invariant[0]
    dense_new_kv = paged and dense_new_kv and not kv_fp8
    # Work items: (slot, head). LPT across requests: slot = (r, request), block r of every
    # request before block r + 1 of any (exact longest-first for equal lengths). It spans
    # batch x max blocks slots, most of them empty when one long request rides with many
    # short ones; then the compact slots of the `tl` pass (total_q / 128 + batch).
    compact = total_q // block_m + batch
    lpt_slots = batch * math.ceil(max_seqlen_q / block_m)
    lpt_across = lpt_slots <= 2 * compact and SWITCHES.gluon_lpt_group != 0
    num_items = num_heads * (lpt_slots if lpt_across else compact)
    lpt, dynamic = 0, bool(SWITCHES.gluon_dynamic)  # the compact order: dynamic if forced
    if lpt_across and num_items:
        kv_bytes = (max_seqlen_k or max_seqlen_q) * num_kv_heads * (head_size + head_size_v) \
            * (1 if kv_fp8 else 2)
        lpt, dynamic = item_order(batch, lpt_slots // batch, num_heads,
                                  num_heads // num_kv_heads, kv_bytes, min(num_items, sm_count))
    if batch == 0 or total_q == 0 or max_seqlen_q <= skip_q_len:
        num_items = 0
        dynamic = False
    scale_in_exp = softcap <= 0 and not use_alibi and softmax_scale > 0 and not invariant
    if invariant:  # the `tl` pass's form: the scale in the exponent's fma, or scaled scores
        scale_in_exp = invariant_scale_in_exp(softmax_scale, softcap, use_alibi)
    floats = score_floats(softmax_scale, softcap, tl_rounding=bool(invariant))
    # Causality is a right window of 0 (a wider right window changes nothing then).
    right = (min(window_right, 0) if window_right >= 0 else 0) if causal else window_right
    constexprs = dict(
        NUM_HEADS=num_heads, GROUP=num_heads // num_kv_heads, HEAD_D=head_size,
        HEAD_DV=head_size_v, PAGE=page_size if paged else block_n, BLOCK_M=block_m,
        BLOCK_N=block_n, NUM_BUF=num_buf, NUM_QBUF=num_qbuf, STAGES=stages,
        WINDOW_LEFT=window_left >= 0,
        WINDOW_RIGHT=causal or window_right >= 0, USE_ALIBI=use_alibi,
        USE_SOFTCAP=softcap > 0, USE_SINKS=use_sinks, WRITE_LSE=write_lse, PAGED=paged,
        DENSE_ROWS=not paged or dense_new_kv, KV_FP8=kv_fp8, KV_DESCALE=use_kv_descale,
        QK_FP8=q_fp8 or split_q, Q_DESCALE=use_q_descale, LPT_ACROSS=lpt,
        DYNAMIC=dynamic, PV_FP8=pv_fp8,
        SCALE_IN_EXP=scale_in_exp, FP16_DOTS=kv_fp8 and SWITCHES.fp16_dot_for_fp8_kv,
        PRODUCER_REGS=producer_regs, CONSUMER_REGS=consumer_regs,
        # Three consumers mask by lane (columns in registers took 32 more of their 160 and
        # spilled), and so do the wide fp8 tiles (256 columns in registers would not fit
        # beside S and O); two consumers on their default tiles keep the columns in
        # registers (lane masks there measured within noise: KERNEL_NOTES v27).
        LANE_MASKS=not invariant and (consumers == 3 or wide),
        # batch-invariant mode's consumer and its fixed split's keys (0: the default one)
        INVARIANT_SPLIT=invariant[1] if invariant else 0,
        INVARIANT_LEAN=bool(invariant) and SWITCHES.invariant_gluon_lean,
        # its consumers pass the tiles past their rows' last key (`invariant_skip_unseen`)
        INVARIANT_SKIP=bool(invariant) and invariant_skip_unseen(),
        # where its fold state sits in the kernel's Work (-1: none; above head 128, and head
        # 128 over `SWITCHES.invariant_tiles_128`'s 128-key tiles)
        FOLD_AT=fold_at(invariant_split=invariant[1] if invariant else 0, dynamic=dynamic,
                        head_size=head_size, head_size_v=head_size_v, block_n=block_n,
                        tiles_128=bool(invariant)
                        and invariant_tiles_128(max(head_size, head_size_v))),
        # O's rescale (`softmax_switches`; batch-invariant: its max slack, every pass's; else
        # 0, O's rescale skipped exactly where no row moved, or -1)
        MAX_SLACK=invariant_gluon_slack() if invariant else slack_for(max_slack, pv_fp8),
        # the converter's V^T by PRMT (`SWITCHES.gluon_fp8_v_prmt`; an fp8 P V only), 2:
        # over the ldmatrix words (`SWITCHES.gluon_fp8_v_words`)
        V_PRMT=v_prmt(pv_fp8),
        # P as words of four e4m3 keys (`SWITCHES.gluon_fp8_p_words`; an fp8 P V only; at
        # head 256 the consumers then keep one P tile live, `gluon_consumer`)
        P_WORDS=p_words, VT_COLS=vt_cols, VT_PREFETCH=vt_prefetch,
        # O's rescale after the P V wait (`SWITCHES.gluon_fp8_rescale_after_pv`)
        RESCALE_AFTER_PV=rescale_after_pv(p_words, head_size_v))
    return GluonSchedule(
        grid=min(num_items, sm_count), num_items=num_items, batch=batch, total_q=total_q,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
        head_size_v=head_size_v, page_size=page_size, paged=paged,
        dense_new_kv=dense_new_kv, floats=floats, window=(window_left, right),
        skip_q_len=skip_q_len, constexprs=constexprs)


def fp8_pv(head_size: int, head_size_v: int) -> bool:
    """Whether an fp8 q's launch runs P V as an fp8 wgmma (`SWITCHES.gluon_fp8_pv`; None:
    heads above 64, where the H200 measured it faster than the fp16 P V: 1.16-1.20x at head
    128, 1.05x at head 256 with V^T by PRMT over the ldmatrix words; head 64 0.94x)."""
    switch = SWITCHES.gluon_fp8_pv
    if switch is not None and not isinstance(switch, bool):
        raise TypeError(f"SWITCHES.gluon_fp8_pv must be None, True or False, got {switch!r}")
    if switch is None:
        return 64 < max(head_size, head_size_v) <= 256
    return switch


def wide_tiles(head_size: int, head_size_v: int, p_words: bool, use_alibi: bool,
               softcap: float, keys: int) -> bool:
    """Whether a launch takes `wide_config_for`'s wider key tiles
    (`SWITCHES.gluon_fp8_wide_tiles`; None: where the longest request reads `keys` >=
    WIDE_MIN_KEYS): an fp8 P V with P as words at head 128 or 256 (K
    and V alike), and at head 64 with `SWITCHES.gluon_fp8_wide_tiles_64`, without ALiBi
    (its distances keep the columns in registers, which the wide
    tiles' lane masks free) or a soft cap (its tanh's temporaries spilled 31-61 registers in
    the consumers' tile loop, sm_90 SASS)."""
    switch = SWITCHES.gluon_fp8_wide_tiles
    if switch is not None and not isinstance(switch, bool):
        raise TypeError(f"SWITCHES.gluon_fp8_wide_tiles must be None, True or False, got "
                        f"{switch!r}")
    head_64 = SWITCHES.gluon_fp8_wide_tiles_64
    if not isinstance(head_64, bool):
        raise TypeError(f"SWITCHES.gluon_fp8_wide_tiles_64 must be True or False, got "
                        f"{head_64!r}")
    if switch is None:
        switch = keys >= WIDE_MIN_KEYS
    return (switch and p_words and not use_alibi and softcap <= 0
            and head_size == head_size_v and head_size in ((64, 128, 256) if head_64
                                                           else (128, 256)))


def v_prmt(pv_fp8: bool) -> bool | int:
    """The kernel's V_PRMT: False (V^T by masks and shifts, or no fp8 P V), True (by PRMT
    over int16 halves, `SWITCHES.gluon_fp8_v_prmt` None or True) or 2 (by PRMT over the
    ldmatrix words, `gluon_fp8_v_words` too)."""
    if not isinstance(SWITCHES.gluon_fp8_v_words, bool):
        raise TypeError(f"SWITCHES.gluon_fp8_v_words must be True or False, got "
                        f"{SWITCHES.gluon_fp8_v_words!r}")
    if not pv_fp8 or SWITCHES.gluon_fp8_v_prmt is False:
        return False
    return 2 if SWITCHES.gluon_fp8_v_words else True


def rescale_after_pv(p_words: bool, head_size_v: int) -> bool:
    """The kernel's RESCALE_AFTER_PV: `SWITCHES.gluon_fp8_rescale_after_pv` where the consumers
    keep one P tile live in the order S, P V (`gluon_consumer`'s ONE_P): P as words of an
    fp8 P V at Dv above 128."""
    switch = SWITCHES.gluon_fp8_rescale_after_pv
    if not isinstance(switch, bool):
        raise TypeError(f"SWITCHES.gluon_fp8_rescale_after_pv must be True or False, got "
                        f"{switch!r}")
    return switch and p_words and head_size_v > 128


def v_transpose(pv_fp8: bool, head_size_v: int, wide: bool,
                num_buf: int) -> tuple[int, int, bool]:
    """(VT_COLS, NUM_BUF, VT_PREFETCH) of a launch: the converter's V^T slabs of 128 columns
    where an fp8 P V runs at Dv 128 or 256 and `SWITCHES.gluon_fp8_vt_wide_slabs` is on (else
    64); with an fp8 P V on the default tiles `gluon_fp8_vt_slots` V^T slots (None:
    `num_buf`); those slabs loaded a slab ahead at Dv 256 with `gluon_fp8_vt_prefetch` (its 16
    keys a slab fit the converter's 24 registers twice; head 128's 32-key slabs spilled)."""
    wide_slabs, slots = SWITCHES.gluon_fp8_vt_wide_slabs, SWITCHES.gluon_fp8_vt_slots
    for name in ("gluon_fp8_vt_wide_slabs", "gluon_fp8_vt_prefetch"):
        if not isinstance(getattr(SWITCHES, name), bool):
            raise TypeError(f"SWITCHES.{name} must be True or False, got "
                            f"{getattr(SWITCHES, name)!r}")
    if slots is not None and (isinstance(slots, bool) or not isinstance(slots, int)
                              or slots not in (2, 3, 4)):
        raise ValueError(f"SWITCHES.gluon_fp8_vt_slots must be None, 2, 3 or 4 (V^T slots "
                         f"that fit beside the default tiles' rings), got {slots!r}")
    cols = 128 if pv_fp8 and wide_slabs and head_size_v % 128 == 0 else 64
    return (cols, slots if pv_fp8 and not wide and slots is not None else num_buf,
            SWITCHES.gluon_fp8_vt_prefetch and cols == 128 and head_size_v > 128)


def softmax_switches() -> int | None:
    """The max slack from `SWITCHES.gluon_max_slack` (None: `slack_for` picks, -1: every
    tile, or 0-8), checked (and `gluon_fp8_v_prmt` and `gluon_fp8_p_words` None or bools)."""
    slack = SWITCHES.gluon_max_slack
    for name in ("gluon_fp8_v_prmt", "gluon_fp8_p_words"):
        if getattr(SWITCHES, name) is not None and not isinstance(getattr(SWITCHES, name), bool):
            raise TypeError(f"SWITCHES.{name} must be None, True or False, got "
                            f"{getattr(SWITCHES, name)!r}")
    if slack is not None and (isinstance(slack, bool) or not isinstance(slack, int)
                              or not -1 <= slack <= 8):
        raise ValueError(f"SWITCHES.gluon_max_slack must be None, -1 (every tile) or an int "
                         f"of 0-8 (powers of 2 a row's max may lag), got {slack!r}")
    return slack


def slack_for(slack: int | None, pv_fp8: bool) -> int:
    """A launch's MAX_SLACK from `SWITCHES.gluon_max_slack` (checked by `softmax_switches`):
    None picks 8 with a 16-bit P V (H200, issue 40's bf16 rows: 0.99-1.07x, 1.02x geomean;
    mean errors unchanged, the largest at a bf16 output's half ulp; KERNEL_NOTES v37) and
    -1 with an fp8 P V (there a slack takes e4m3's headroom: 4 put the max error at 1.31x
    FA3 fp8's; v34)."""
    if slack is None:
        return -1 if pv_fp8 else 8
    return slack


def score_floats(softmax_scale: float, softcap: float,
                 tl_rounding: bool = False) -> tuple[float, float]:
    """(qk_scale, softcap) as the Gluon kernels take them, log2(e) folded in: with a soft cap
    scores become softcap * tanh(scale * qk / softcap) in log2 units. tl_rounding (batch-
    invariant mode): the scale as the `tl` pass rounds it (`attention_args.batch_section`:
    softmax_scale * (1 / softcap), which rounds apart from softmax_scale / softcap)."""
    if softcap > 0:
        scale = softmax_scale * (1.0 / softcap) if tl_rounding else softmax_scale / softcap
        return scale, softcap * LOG2E
    return softmax_scale * LOG2E, 0.0


def consumers_for(head_size: int, fp8: bool, long_prompts: bool = False,
                  q_fp8: bool = False) -> int:
    """The pass's consumer warpgroups for the larger head size and an fp8 cache or q (q_fp8:
    an fp8 q over it): `SWITCHES.gluon_consumers` (None: 3 for `long_prompts`, else 2), 3
    only where three consumers can serve (`three_consumers_refusal`) and, for an fp8 q,
    with `SWITCHES.gluon_fp8_three_consumers` on; else 2."""
    wanted = SWITCHES.gluon_consumers
    if wanted not in (None, 2, 3):
        raise ValueError(f"SWITCHES.gluon_consumers must be None, 2 or 3, got {wanted!r}")
    fp8_three = SWITCHES.gluon_fp8_three_consumers
    if not isinstance(fp8_three, bool):
        raise TypeError(f"SWITCHES.gluon_fp8_three_consumers must be True or False, got "
                        f"{fp8_three!r}")
    if wanted is None:
        wanted = 3 if long_prompts else 2
    if q_fp8 and not fp8_three:
        return 2
    return 3 if wanted == 3 and not three_consumers_refusal(head_size, fp8, q_fp8) else 2


def long_prompts(batch: int, total_q: int, causal: bool) -> bool:
    """Whether a launch's requests average THREE_CONSUMERS_MIN_MEAN_Q causal queries, where
    three consumers measured faster (H200, head 64: 1.08x at 1 and 2 x 8192, 1.11x at 1 x
    16384, even at 4 x 4096 and after a cached context, 0.79-0.96x on shorter prompts:
    KERNEL_NOTES v26); a step's decodes count as requests, so a mixed step keeps two."""
    return causal and total_q >= THREE_CONSUMERS_MIN_MEAN_Q * max(batch, 1)


def split_q_for(q_dtype: torch.dtype, kv_dtype: torch.dtype, head_size: int) -> bool:
    """Whether a launch splits a 16-bit q in two e4m3 terms (hi + lo of y = q 2^(7 - e),
    2^e the largest |q| of a consumer's rows): over an fp8 cache its Q K^T is then two fp8
    products over K where TMA lands it (e4m3 x e5m2 over an e5m2 cache), and the converter
    converts V alone. The terms keep ~8 significant bits of q, a bf16's own precision
    (KERNEL_NOTES v19). Heads up to 128: head 256's consumers have no registers for it."""
    return (SWITCHES.gluon_split_q and q_dtype in (torch.float16, torch.bfloat16)
            and kv_dtype in FP8 and head_size <= 128)


def why_not(*, device: torch.device, num_heads: int, num_kv_heads: int, head_size: int,
            head_size_v: int, q_dtype: torch.dtype, kv_dtype: torch.dtype,
            out_dtype: Optional[torch.dtype], paged: bool, page_size: int,
            use_q_descale: bool, use_kv_descale: bool) -> list[str]:
    """Reasons the Gluon pass cannot serve these shapes and features ([] = it can)."""
    reasons = []
    if device.type != "cuda" or not _sm90(device):
        reasons.append(f"device {device} is not an sm_90 GPU")
    if not gluon_available():
        reasons.append(f"Triton {getattr(triton, '__version__', None)} has no Gluon "
                       f"{GLUON_TRITON}x API")
    if not (q_dtype in (torch.float16, torch.bfloat16) and kv_dtype in (q_dtype, *FP8)) and \
            not (q_dtype in FP8 and kv_dtype in FP8):
        reasons.append(f"q {q_dtype} / kv {kv_dtype}: needs a 16-bit q with K/V of its dtype "
                       "or fp8 (e4m3fn / e5m2), or an fp8 q with fp8 K/V")
    if kv_dtype in FP8 and not paged:
        reasons.append(f"kv {kv_dtype}: fp8 keys come from a paged cache only")
    if out_dtype is not None and not out_dtype.is_floating_point:
        reasons.append(f"out dtype {out_dtype} is not a float type")
    if head_size not in HEAD_SIZES or head_size_v not in HEAD_SIZES:
        reasons.append(f"head sizes {head_size}/{head_size_v} not in {HEAD_SIZES}")
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        reasons.append(f"{num_heads} heads over {num_kv_heads} KV heads")
    if paged and (page_size < 8 or page_size & (page_size - 1)):
        reasons.append(f"page size {page_size} is not a power of 2 >= 8 (TMA boxes)")
    if q_dtype in FP8 and (out_dtype is None or out_dtype in FP8):
        reasons.append(f"out dtype {out_dtype}: an fp8 q needs a 16- or 32-bit output")
    if use_q_descale and q_dtype not in FP8:
        reasons.append(f"q descale with a {q_dtype} q")
    if use_kv_descale and kv_dtype not in FP8:
        reasons.append(f"k/v descales with a {kv_dtype} cache")
    return reasons
