"""Compile each variant of the Gluon prefill kernel for sm_90a without a GPU and count its SASS.

    /work/venv36/bin/python tools/gluon_sass.py [--tool PATH] [--only NAME] [--dump DIR]

Runs with a Python whose Triton is 3.6.0 (the GPU's; no torch or driver needed) and the
compile tool `gluon_compile_sm90.py` (shared tools folder by default). Prints one markdown row
per variant: shared memory, registers, HGMMA / QGMMA (the fp8 wgmma, which the compile tool
does not count) / UTMALDG / SYNCS / USETMAXREG counts, spills
(STL/LDL), whether ptxas serialised the wgmma pipeline (C7512) and how many exponentials
(MUFU.EX2) sit between the S wait and the P V wait of a loop body (the softmax that overlaps
P V in flight), and how many mbarriers the allocator placed outside the barrier block at the
end of shared memory, i.e. over data (an unused barrier; should be 0). Variants mirror what
`attention_gluon.plan_gluon_prefill` launches (tiles from `gluon_schedule.config_for`).
"""

from __future__ import annotations

import os
import re
import sys

from gluon_compile import compile_variant, serialised, variant_table

HERE = os.path.dirname(os.path.abspath(__file__))
KERNEL = os.path.join(HERE, "..", "src", "pagedattn", "ops", "triton", "gluon_prefill.py")

# name -> (head_size, paged, dense_new_kv, features); KV_FP8 in features: an fp8 cache, Q_FP8
# an fp8 q over it (the layer quantises q for an e4m3 cache); a bf16 q over an fp8 cache is
# split in two e4m3 terms at heads up to 128 (`attention_gluon.split_q_for`) unless
# SPLIT_Q=False (the switch off: the converter converts K too)
VARIANTS = {
    "h128 causal": (128, False, False, {}),
    "h128 non-causal": (128, False, False, dict(WINDOW_RIGHT=False)),
    "h64 causal": (64, False, False, {}),
    "h256 causal": (256, False, False, {}),
    "h128 window+alibi+softcap+sinks": (128, False, False, dict(
        WINDOW_LEFT=True, USE_ALIBI=True, USE_SOFTCAP=True, USE_SINKS=True,
        SCALE_IN_EXP=False)),
    "h128 paged context + new rows": (128, True, True, {}),
    "h128 paged only (op path)": (128, True, False, {}),
    "h256 paged context + new rows": (256, True, True, {}),
    "h128 fp8 e4m3 cache + descales": (128, True, False, dict(KV_FP8="fp8e4nv")),
    "h64 fp8 e5m2 cache + descales": (64, True, False, dict(KV_FP8="fp8e5")),
    "h256 fp8 e4m3 cache + descales": (256, True, False, dict(KV_FP8="fp8e4nv")),
    "h128 fp8 e4m3 cache, bf16 products": (128, True, False, dict(KV_FP8="fp8e4nv",
                                                                  FP16_DOTS=False)),
    "h128 fp8 e4m3 cache, K converted": (128, True, False, dict(KV_FP8="fp8e4nv",
                                                                SPLIT_Q=False)),
    "h128 fp8 e4m3 q + cache": (128, True, False, dict(KV_FP8="fp8e4nv", Q_FP8="fp8e4nv")),
    "h64 fp8 e4m3 q + cache": (64, True, False, dict(KV_FP8="fp8e4nv", Q_FP8="fp8e4nv")),
    "h256 fp8 e4m3 q + cache": (256, True, False, dict(KV_FP8="fp8e4nv", Q_FP8="fp8e4nv")),
    "h128 fp8 e4m3 q + cache, 16-bit P V": (128, True, False, dict(
        KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", PV_FP8=False)),
    "h128 fp8 e4m3 q + e5m2 cache": (128, True, False, dict(KV_FP8="fp8e5",
                                                             Q_FP8="fp8e4nv")),
    "h128 fp8 q + cache, sinks+softcap": (128, True, False, dict(
        KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", USE_SINKS=True, USE_SOFTCAP=True,
        SCALE_IN_EXP=False)),
    "h128 causal, dynamic": (128, False, False, dict(DYNAMIC=True)),
    "h256 causal, dynamic": (256, False, False, dict(DYNAMIC=True)),
    "h64 causal, dynamic": (64, False, False, dict(DYNAMIC=True)),
    "h128 fp8 e4m3 cache, dynamic": (128, True, False, dict(KV_FP8="fp8e4nv", DYNAMIC=True)),
    "h256 fp8 e4m3 q + cache, dynamic": (256, True, False, dict(
        KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", DYNAMIC=True)),
    # three consumers of 64 rows (`SWITCHES.gluon_consumers = 3`): 192-row items, head 64
    "h64 causal, 3 consumers": (64, False, False, dict(CONSUMERS=3)),
    "h64 non-causal, 3 consumers": (64, False, False, dict(CONSUMERS=3, WINDOW_RIGHT=False)),
    "h64 paged context + new rows, 3 consumers": (64, True, True, dict(CONSUMERS=3)),
    "h64 causal, dynamic, 3 consumers": (64, False, False, dict(CONSUMERS=3, DYNAMIC=True)),
    # O's rescale skipped where no row's max moved (`SWITCHES.gluon_max_slack`: 0 exact,
    # > 0 FA4's stale max)
    "h128 fp8 e4m3 q + cache, max slack 0": (128, True, False, dict(
        KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", MAX_SLACK=0)),
    "h128 fp8 e4m3 q + cache, max slack 4": (128, True, False, dict(
        KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", MAX_SLACK=4)),
    # the converter's V^T byte pairs by PRMT (`SWITCHES.gluon_fp8_v_prmt`)
    "h128 fp8 e4m3 q + cache, V by PRMT": (128, True, False, dict(
        KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", V_PRMT=True)),
    "h64 fp8 e4m3 q + cache, V by PRMT": (64, True, False, dict(
        KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", V_PRMT=True)),
    "h256 fp8 e4m3 q + cache, V by PRMT": (256, True, False, dict(
        KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", V_PRMT=True)),
    # an fp8 P across the tile loop as words of four keys (`SWITCHES.gluon_fp8_p_words`)
    "h128 fp8 e4m3 q + cache, P words": (128, True, False, dict(
        KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", P_WORDS=True)),
    "h64 fp8 e4m3 q + cache, P words": (64, True, False, dict(
        KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", P_WORDS=True)),
    # (head 256: one P tile live, made after the P V wait; before it, ptxas serialised
    # every consumer wgmma, C7513)
    "h256 fp8 e4m3 q + cache, P words": (256, True, False, dict(
        KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", P_WORDS=True)),
    "h256 fp8 e4m3 q + cache, P words, V by PRMT": (256, True, False, dict(
        KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", P_WORDS=True, V_PRMT=True)),
    "h64 fp8 e4m3 q + cache, P words, V by PRMT": (64, True, False, dict(
        KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", P_WORDS=True, V_PRMT=True)),
    # the converter's V^T by PRMT over the ldmatrix words (`SWITCHES.gluon_fp8_v_words`)
    "h64 fp8 e4m3 q + cache, P words, V words": (64, True, False, dict(
        KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", P_WORDS=True, V_PRMT=2)),
    "h128 fp8 e4m3 q + cache, P words, V words": (128, True, False, dict(
        KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", P_WORDS=True, V_PRMT=2)),
    "h256 fp8 e4m3 q + cache, P words, V words": (256, True, False, dict(
        KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", P_WORDS=True, V_PRMT=2)),
    "h128 fp8 e4m3 q + e5m2 cache, P words, V words": (128, True, False, dict(
        KV_FP8="fp8e5", Q_FP8="fp8e4nv", P_WORDS=True, V_PRMT=2)),
    # the fp16 P V an fp8 q runs by default at head 64 (`attention_gluon.fp8_pv`), and
    # ran at head 256 before V words
    "h64 fp8 e4m3 q + cache, 16-bit P V": (64, True, False, dict(
        KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", PV_FP8=False)),
    "h256 fp8 e4m3 q + cache, 16-bit P V": (256, True, False, dict(
        KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", PV_FP8=False)),
    "h128 fp8 e4m3 q + cache, P words, V by PRMT, max slack 4": (128, True, False, dict(
        KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", P_WORDS=True, V_PRMT=True, MAX_SLACK=4)),
    "h128 fp8 e4m3 q + e5m2 cache, P words, V by PRMT": (128, True, False, dict(
        KV_FP8="fp8e5", Q_FP8="fp8e4nv", P_WORDS=True, V_PRMT=True)),
    "h128 causal, max slack 8": (128, False, False, dict(MAX_SLACK=8)),
    # wider key tiles for the fp8 P V (`SWITCHES.gluon_fp8_wide_tiles`; WIDE:
    # `gluon_schedule.wide_config_for`): head 128 256 keys, head 256 128 keys
    "h128 fp8 e4m3 q + cache, P words, V words, wide": (128, True, False, dict(
        KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", P_WORDS=True, V_PRMT=2, WIDE=True, LANE_MASKS=True)),
    "h256 fp8 e4m3 q + cache, P words, V words, wide": (256, True, False, dict(
        KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", P_WORDS=True, V_PRMT=2, WIDE=True, LANE_MASKS=True)),
    "h128 fp8 e4m3 q + e5m2 cache, P words, V words, wide": (128, True, False, dict(
        KV_FP8="fp8e5", Q_FP8="fp8e4nv", P_WORDS=True, V_PRMT=2, WIDE=True, LANE_MASKS=True)),
    # (a soft cap keeps the default tiles: its temporaries spilled in the wide tile loop)
    "h128 fp8 q + cache, window+sinks, P words, V words, wide": (128, True, False, dict(
        KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", P_WORDS=True, V_PRMT=2, WIDE=True, LANE_MASKS=True,
        WINDOW_LEFT=True, USE_SINKS=True)),
    "h256 fp8 q + cache, window+sinks, P words, V words, wide": (256, True, False, dict(
        KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", P_WORDS=True, V_PRMT=2, WIDE=True, LANE_MASKS=True,
        WINDOW_LEFT=True, USE_SINKS=True)),
    "h128 fp8 e4m3 q + cache, P words, V words, dynamic, wide": (128, True, False, dict(
        KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", P_WORDS=True, V_PRMT=2, DYNAMIC=True, WIDE=True,
        LANE_MASKS=True)),
    "h256 fp8 e4m3 q + cache, P words, V words, dynamic, wide": (256, True, False, dict(
        KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", P_WORDS=True, V_PRMT=2, DYNAMIC=True, WIDE=True,
        LANE_MASKS=True)),
    # the converter's V^T in slabs of 128 columns (`SWITCHES.gluon_fp8_vt_cols`): half
    # its barriers a tile
    "h256 fp8 e4m3 q + cache, P words, V words, V^T 128 columns": (256, True, False, dict(
        KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", P_WORDS=True, V_PRMT=2, VT_COLS=128)),
    "h256 fp8 e4m3 q + cache, P words, V words, wide, V^T 128 columns": (256, True, False, dict(
        KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", P_WORDS=True, V_PRMT=2, WIDE=True, LANE_MASKS=True,
        VT_COLS=128)),
    "h128 fp8 e4m3 q + cache, P words, V words, V^T 128 columns": (128, True, False, dict(
        KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", P_WORDS=True, V_PRMT=2, VT_COLS=128)),
    # and a deeper V^T ring on the default tiles (`SWITCHES.gluon_fp8_vt_slots`)
    "h256 fp8 e4m3 q + cache, P words, V words, V^T 4 slots": (256, True, False, dict(
        KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", P_WORDS=True, V_PRMT=2, NUM_BUF=4)),
    "h256 fp8 e4m3 q + cache, P words, V words, V^T 128 columns, 4 slots": (
        256, True, False, dict(KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", P_WORDS=True, V_PRMT=2,
                               VT_COLS=128, NUM_BUF=4)),
    "h256 fp8 q + cache, window+sinks, P words, V words, wide, V^T 128 columns": (
        256, True, False, dict(KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", P_WORDS=True, V_PRMT=2,
                               WIDE=True, LANE_MASKS=True, WINDOW_LEFT=True, USE_SINKS=True,
                               VT_COLS=128)),
    # O's rescale after the previous tile's P V wait (`SWITCHES.gluon_fp8_rescale_after_pv`;
    # FA3's fp8 order): the consumers' turn holds S's and P V's issues alone
    "h256 fp8 e4m3 q + cache, P words, V words, V^T 128 columns, rescale after P V": (
        256, True, False, dict(KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", P_WORDS=True, V_PRMT=2,
                               VT_COLS=128, RESCALE_AFTER_PV=True)),
    "h256 fp8 e4m3 q + cache, P words, V words, wide, V^T 128 columns, rescale after P V": (
        256, True, False, dict(KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", P_WORDS=True, V_PRMT=2,
                               WIDE=True, LANE_MASKS=True, VT_COLS=128,
                               RESCALE_AFTER_PV=True)),
    "h256 fp8 q + cache, window+sinks, P words, V words, wide, V^T 128 columns, rescale after "
    "P V": (256, True, False, dict(KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", P_WORDS=True, V_PRMT=2,
                                   WIDE=True, LANE_MASKS=True, WINDOW_LEFT=True,
                                   USE_SINKS=True, VT_COLS=128, RESCALE_AFTER_PV=True)),
    "h256 fp8 e4m3 q + cache, P words, V words, dynamic, wide, V^T 128 columns, rescale after "
    "P V": (256, True, False, dict(KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", P_WORDS=True, V_PRMT=2,
                                   DYNAMIC=True, WIDE=True, LANE_MASKS=True, VT_COLS=128,
                                   RESCALE_AFTER_PV=True)),
    # the converter's 128-column V^T slabs each loaded a slab ahead
    # (`SWITCHES.gluon_fp8_vt_prefetch`): its ldmatrix latency under the previous store
    # (planned at head 256 alone; head 128's forms are here for their spills: 32-key slabs)
    "h256 fp8 e4m3 q + cache, P words, V words, V^T 128 columns, prefetch": (
        256, True, False, dict(KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", P_WORDS=True, V_PRMT=2,
                               VT_COLS=128, VT_PREFETCH=True)),
    "h256 fp8 e4m3 q + cache, P words, V words, wide, V^T 128 columns, prefetch": (
        256, True, False, dict(KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", P_WORDS=True, V_PRMT=2,
                               WIDE=True, LANE_MASKS=True, VT_COLS=128, VT_PREFETCH=True)),
    "h256 fp8 q + cache, window+sinks, P words, V words, wide, V^T 128 columns, prefetch": (
        256, True, False, dict(KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", P_WORDS=True, V_PRMT=2,
                               WIDE=True, LANE_MASKS=True, WINDOW_LEFT=True, USE_SINKS=True,
                               VT_COLS=128, VT_PREFETCH=True)),
    "h128 fp8 e4m3 q + cache, P words, V words, wide, V^T 128 columns, prefetch": (
        128, True, False, dict(KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", P_WORDS=True, V_PRMT=2,
                               WIDE=True, LANE_MASKS=True, VT_COLS=128, VT_PREFETCH=True)),
    "h128 fp8 e4m3 q + cache, P words, V words, V^T 128 columns, prefetch": (
        128, True, False, dict(KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", P_WORDS=True, V_PRMT=2,
                               VT_COLS=128, VT_PREFETCH=True)),
    "h256 fp8 e4m3 q + cache, P words, V words, wide, V^T 128 columns, prefetch, rescale "
    "after P V": (256, True, False, dict(KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", P_WORDS=True,
                                         V_PRMT=2, WIDE=True, LANE_MASKS=True, VT_COLS=128,
                                         VT_PREFETCH=True, RESCALE_AFTER_PV=True)),
    # three consumers over an fp8 q (`SWITCHES.gluon_fp8_three_consumers`): FA3's fp8
    # head-64 shape (192 rows; FA3 160 keys a tile, ours 128), the 16-bit P V head 64 runs
    # by default and the fp8 P V (P words, V^T by PRMT over the ldmatrix words)
    "h64 fp8 e4m3 q + cache, 16-bit P V, max slack 8, 3 consumers": (64, True, False, dict(
        KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", PV_FP8=False, MAX_SLACK=8, CONSUMERS=3)),
    "h64 fp8 e4m3 q + cache, P words, V words, 3 consumers": (64, True, False, dict(
        KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", P_WORDS=True, V_PRMT=2, CONSUMERS=3)),
    "h64 fp8 e4m3 q + e5m2 cache, P words, V words, 3 consumers": (64, True, False, dict(
        KV_FP8="fp8e5", Q_FP8="fp8e4nv", P_WORDS=True, V_PRMT=2, CONSUMERS=3)),
    "h64 fp8 q + cache, window+sinks+softcap, P words, V words, 3 consumers": (
        64, True, False, dict(KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", P_WORDS=True, V_PRMT=2,
                              CONSUMERS=3, WINDOW_LEFT=True, USE_SINKS=True,
                              USE_SOFTCAP=True, SCALE_IN_EXP=False)),
    "h64 fp8 q + cache, window+alibi+softcap+sinks, P words, V words, 3 consumers": (
        64, True, False, dict(KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", P_WORDS=True, V_PRMT=2,
                              CONSUMERS=3, WINDOW_LEFT=True, USE_ALIBI=True, USE_SINKS=True,
                              USE_SOFTCAP=True, SCALE_IN_EXP=False)),
    "h64 fp8 e4m3 q + cache, P words, V words, dynamic, 3 consumers": (64, True, False, dict(
        KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", P_WORDS=True, V_PRMT=2, CONSUMERS=3,
        DYNAMIC=True)),
    "h64 fp8 q + cache, window+sinks+softcap, 16-bit P V, max slack 8, 3 consumers": (
        64, True, False, dict(KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", PV_FP8=False, MAX_SLACK=8,
                              CONSUMERS=3, WINDOW_LEFT=True, USE_SINKS=True,
                              USE_SOFTCAP=True, SCALE_IN_EXP=False)),
    # head 64's fp8 P V over 256-key tiles (`SWITCHES.gluon_fp8_wide_tiles_64`)
    "h64 fp8 e4m3 q + cache, P words, V words, wide": (64, True, False, dict(
        KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", P_WORDS=True, V_PRMT=2, WIDE=True, LANE_MASKS=True)),
    "h64 fp8 e4m3 q + e5m2 cache, P words, V words, wide": (64, True, False, dict(
        KV_FP8="fp8e5", Q_FP8="fp8e4nv", P_WORDS=True, V_PRMT=2, WIDE=True, LANE_MASKS=True)),
    "h64 fp8 q + cache, window+sinks, P words, V words, wide": (64, True, False, dict(
        KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", P_WORDS=True, V_PRMT=2, WIDE=True, LANE_MASKS=True,
        WINDOW_LEFT=True, USE_SINKS=True)),
    "h64 fp8 e4m3 q + cache, P words, V words, dynamic, wide": (64, True, False, dict(
        KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", P_WORDS=True, V_PRMT=2, DYNAMIC=True, WIDE=True,
        LANE_MASKS=True)),
    # and the two-consumer forms head 64 runs today (16-bit P V, slack 8) or could
    "h64 fp8 e4m3 q + cache, 16-bit P V, max slack 8": (64, True, False, dict(
        KV_FP8="fp8e4nv", Q_FP8="fp8e4nv", PV_FP8=False, MAX_SLACK=8)),
    # batch-invariant mode's prompts (`SWITCHES.invariant_gluon`; `gluon_invariant.py`):
    # 64-key tiles from the cache alone, fixed splits, no fused multiply-adds
    "h128 invariant, paged": (128, True, False, dict(INVARIANT=True)),
    "h64 invariant, paged": (64, True, False, dict(INVARIANT=True)),
    "h128 invariant, window+alibi+softcap+sinks": (128, True, False, dict(
        INVARIANT=True, WINDOW_LEFT=True, USE_ALIBI=True, USE_SOFTCAP=True, USE_SINKS=True)),
    "h128 invariant, fp8 e4m3 cache + descales": (128, True, False, dict(
        INVARIANT=True, KV_FP8="fp8e4nv", SPLIT_Q=False)),
    # its candidates: LEAN (`SWITCHES.invariant_gluon_lean`), 128-key tiles (INVARIANT=128:
    # the `tl` pass's block_n from `SWITCHES.invariant_tiles`)
    "h128 invariant, paged, lean": (128, True, False, dict(INVARIANT=True, INVARIANT_LEAN=True)),
    "h64 invariant, paged, lean": (64, True, False, dict(INVARIANT=True, INVARIANT_LEAN=True)),
    "h128 invariant, window+alibi+softcap+sinks, lean": (128, True, False, dict(
        INVARIANT=True, WINDOW_LEFT=True, USE_ALIBI=True, USE_SOFTCAP=True, USE_SINKS=True,
        INVARIANT_LEAN=True)),
    "h128 invariant, paged, 128 keys": (128, True, False, dict(INVARIANT=128)),
    "h64 invariant, paged, 128 keys": (64, True, False, dict(INVARIANT=128)),
    "h128 invariant, paged, 128 keys, lean": (128, True, False, dict(
        INVARIANT=128, INVARIANT_LEAN=True)),
    "h64 invariant, paged, 128 keys, lean": (64, True, False, dict(
        INVARIANT=128, INVARIANT_LEAN=True)),
    # the scale in the exponent's fma (`SWITCHES.invariant_scale_in_exp`)
    "h128 invariant, paged, 128 keys, lean, scale in exp": (128, True, False, dict(
        INVARIANT=128, INVARIANT_LEAN=True, SCALE_IN_EXP=True)),
    "h64 invariant, paged, 128 keys, lean, scale in exp": (64, True, False, dict(
        INVARIANT=128, INVARIANT_LEAN=True, SCALE_IN_EXP=True)),
    "h128 invariant, paged, lean, scale in exp": (128, True, False, dict(
        INVARIANT=True, INVARIANT_LEAN=True, SCALE_IN_EXP=True)),
    # O's rescale skipped where no row of a warp moved its max (MAX_SLACK 0:
    # `SWITCHES.invariant_lazy_rescale`; the same bits)
    "h128 invariant, paged, lean, scale in exp, lazy rescale": (128, True, False, dict(
        INVARIANT=True, INVARIANT_LEAN=True, SCALE_IN_EXP=True, MAX_SLACK=0)),
    "h64 invariant, paged, 128 keys, lean, scale in exp, lazy rescale": (64, True, False, dict(
        INVARIANT=128, INVARIANT_LEAN=True, SCALE_IN_EXP=True, MAX_SLACK=0)),
    "h128 invariant, paged, 128 keys, lean, scale in exp, lazy rescale": (128, True, False,
        dict(INVARIANT=128, INVARIANT_LEAN=True, SCALE_IN_EXP=True, MAX_SLACK=0)),
    # the running max's slack in every pass (`SWITCHES.invariant_max_slack`; other bits)
    "h128 invariant, paged, lean, scale in exp, max slack 8": (128, True, False, dict(
        INVARIANT=True, INVARIANT_LEAN=True, SCALE_IN_EXP=True, MAX_SLACK=8)),
    "h64 invariant, paged, 128 keys, lean, scale in exp, max slack 8": (64, True, False, dict(
        INVARIANT=128, INVARIANT_LEAN=True, SCALE_IN_EXP=True, MAX_SLACK=8)),
    "h128 invariant, paged, 128 keys, lean, scale in exp, max slack 8": (128, True, False,
        dict(INVARIANT=128, INVARIANT_LEAN=True, SCALE_IN_EXP=True, MAX_SLACK=8)),
    "h128 invariant, window+alibi+softcap+sinks, lean, max slack 8": (128, True, False, dict(
        INVARIANT=True, WINDOW_LEFT=True, USE_ALIBI=True, USE_SOFTCAP=True, USE_SINKS=True,
        INVARIANT_LEAN=True, MAX_SLACK=8)),
    # the forms of the GPU tests' e4m3 + sinks layer and ALiBi + soft-cap layer under the
    # lazy rescale and the slack (`test_invariant_lazy_rescale`, `test_invariant_max_slack`)
    "h128 invariant, fp8 e4m3 cache + descales, sinks, lean, scale in exp, lazy rescale": (
        128, True, False, dict(INVARIANT=True, KV_FP8="fp8e4nv", SPLIT_Q=False, USE_SINKS=True,
                               INVARIANT_LEAN=True, SCALE_IN_EXP=True, MAX_SLACK=0)),
    "h128 invariant, fp8 e4m3 cache + descales, sinks, lean, scale in exp, max slack 8": (
        128, True, False, dict(INVARIANT=True, KV_FP8="fp8e4nv", SPLIT_Q=False, USE_SINKS=True,
                               INVARIANT_LEAN=True, SCALE_IN_EXP=True, MAX_SLACK=8)),
    "h128 invariant, alibi+softcap, lean, max slack 1": (128, True, False, dict(
        INVARIANT=True, USE_ALIBI=True, USE_SOFTCAP=True, INVARIANT_LEAN=True, MAX_SLACK=1)),
    "h64 invariant, window+sinks, 128 keys, lean, scale in exp, max slack 1": (
        64, True, False, dict(INVARIANT=128, WINDOW_LEFT=True, USE_SINKS=True,
                              INVARIANT_LEAN=True, SCALE_IN_EXP=True, MAX_SLACK=1)),
    "h256 invariant, paged, lean, scale in exp, fold, max slack 8": (256, True, False, dict(
        INVARIANT=True, INVARIANT_LEAN=True, SCALE_IN_EXP=True, FOLD=True, MAX_SLACK=8)),
    "h128 invariant, fp8 e4m3 cache + descales, 128 keys": (128, True, False, dict(
        INVARIANT=128, KV_FP8="fp8e4nv", SPLIT_Q=False)),
    "h128 invariant, fp8 e4m3 cache + descales, 128 keys, lean": (128, True, False, dict(
        INVARIANT=128, KV_FP8="fp8e4nv", SPLIT_Q=False, INVARIANT_LEAN=True)),
    "h128 invariant, window+alibi+softcap+sinks, 128 keys, lean": (128, True, False, dict(
        INVARIANT=128, WINDOW_LEFT=True, USE_ALIBI=True, USE_SOFTCAP=True, USE_SINKS=True,
        INVARIANT_LEAN=True)),
    "h64 invariant, window+alibi+softcap+sinks, 128 keys, lean": (64, True, False, dict(
        INVARIANT=128, WINDOW_LEFT=True, USE_ALIBI=True, USE_SOFTCAP=True, USE_SINKS=True,
        INVARIANT_LEAN=True)),
    # head 256 (`SWITCHES.invariant_gluon_256`): the splits' fold state in memory (FOLD)
    "h256 invariant, paged, lean, scale in exp, fold": (256, True, False, dict(
        INVARIANT=True, INVARIANT_LEAN=True, SCALE_IN_EXP=True, FOLD=True)),
    "h256 invariant, window+softcap+sinks, lean, fold": (256, True, False, dict(
        INVARIANT=True, WINDOW_LEFT=True, USE_SOFTCAP=True, USE_SINKS=True,
        INVARIANT_LEAN=True, FOLD=True)),
    "h256 invariant, fp8 e4m3 cache + descales, lean, scale in exp, fold": (
        256, True, False, dict(INVARIANT=True, KV_FP8="fp8e4nv", INVARIANT_LEAN=True,
                               SCALE_IN_EXP=True, FOLD=True)),
    # the layer whose GPU test did not finish (KERNEL_NOTES v37): e4m3, window + sinks
    "h256 invariant, fp8 e4m3 cache + descales, window+sinks, lean, scale in exp, fold": (
        256, True, False, dict(INVARIANT=True, KV_FP8="fp8e4nv", WINDOW_LEFT=True,
                               USE_SINKS=True, INVARIANT_LEAN=True, SCALE_IN_EXP=True,
                               FOLD=True)),
    # the dynamic hand-out (a program's items still one after the other: its fold rows hold
    # one item at a time, `gluon_launch.fold_shape`)
    "h256 invariant, paged, lean, scale in exp, fold, dynamic": (256, True, False, dict(
        INVARIANT=True, INVARIANT_LEAN=True, SCALE_IN_EXP=True, FOLD=True, DYNAMIC=True)),
    # head 128's 128-key tiles (`SWITCHES.invariant_tiles_128`): the fold state in memory as
    # head 256's (`gluon_launch.fold_at`), the fold in registers beside O, S and P spilled
    "h128 invariant, paged, 128 keys, lean, scale in exp, fold": (128, True, False, dict(
        INVARIANT=128, INVARIANT_LEAN=True, SCALE_IN_EXP=True, FOLD=True)),
    "h128 invariant, paged, 128 keys, lean, scale in exp, lazy rescale, fold": (
        128, True, False, dict(INVARIANT=128, INVARIANT_LEAN=True, SCALE_IN_EXP=True,
                               MAX_SLACK=0, FOLD=True)),
    "h128 invariant, paged, 128 keys, lean, scale in exp, max slack 8, fold": (
        128, True, False, dict(INVARIANT=128, INVARIANT_LEAN=True, SCALE_IN_EXP=True,
                               MAX_SLACK=8, FOLD=True)),
    "h128 invariant, fp8 e4m3 cache + descales, 128 keys, lean, fold": (128, True, False, dict(
        INVARIANT=128, KV_FP8="fp8e4nv", SPLIT_Q=False, INVARIANT_LEAN=True, FOLD=True)),
    "h128 invariant, window+alibi+softcap+sinks, 128 keys, lean, fold": (128, True, False, dict(
        INVARIANT=128, WINDOW_LEFT=True, USE_ALIBI=True, USE_SOFTCAP=True, USE_SINKS=True,
        INVARIANT_LEAN=True, FOLD=True)),
    "h128 invariant, paged, 128 keys, lean, scale in exp, fold, dynamic": (128, True, False,
        dict(INVARIANT=128, INVARIANT_LEAN=True, SCALE_IN_EXP=True, FOLD=True, DYNAMIC=True)),
    # the tiles past a consumer's last seen key passed without products
    # (`SWITCHES.invariant_skip_unseen`; the same bits), today's defaults beside it
    "h128 invariant, paged, lean, scale in exp, max slack 8, skip unseen": (128, True, False,
        dict(INVARIANT=True, INVARIANT_LEAN=True, SCALE_IN_EXP=True, MAX_SLACK=8,
             INVARIANT_SKIP=True)),
    "h64 invariant, paged, 128 keys, lean, scale in exp, max slack 8, skip unseen": (
        64, True, False, dict(INVARIANT=128, INVARIANT_LEAN=True, SCALE_IN_EXP=True,
                              MAX_SLACK=8, INVARIANT_SKIP=True)),
    "h128 invariant, window+alibi+softcap+sinks, lean, max slack 8, skip unseen": (
        128, True, False, dict(INVARIANT=True, WINDOW_LEFT=True, USE_ALIBI=True,
                               USE_SOFTCAP=True, USE_SINKS=True, INVARIANT_LEAN=True,
                               MAX_SLACK=8, INVARIANT_SKIP=True)),
    "h128 invariant, fp8 e4m3 cache + descales, sinks, lean, scale in exp, max slack 8, "
    "skip unseen": (128, True, False, dict(
        INVARIANT=True, KV_FP8="fp8e4nv", SPLIT_Q=False, USE_SINKS=True, INVARIANT_LEAN=True,
        SCALE_IN_EXP=True, MAX_SLACK=8, INVARIANT_SKIP=True)),
    "h256 invariant, paged, lean, scale in exp, fold, max slack 8, skip unseen": (
        256, True, False, dict(INVARIANT=True, INVARIANT_LEAN=True, SCALE_IN_EXP=True,
                               FOLD=True, MAX_SLACK=8, INVARIANT_SKIP=True)),
}


def config_for(head_size: int, kv_fp8: bool, q_fp8: bool, split_q: bool,
               consumers: int, wide: bool = False) -> tuple[int, int, int, int, int, int]:
    sys.path.insert(0, os.path.dirname(KERNEL))
    import gluon_schedule  # noqa: E402 - the kernel's modules import only Triton
    if wide:
        return gluon_schedule.wide_config_for(head_size)
    return gluon_schedule.config_for(head_size, kv_fp8, q_fp8, split_q, consumers)


def spec(head_size: int, paged: bool, dense_new_kv: bool, features: dict) -> dict:
    features = dict(features)
    fp8 = features.pop("KV_FP8", None)
    q8 = features.pop("Q_FP8", None)
    dynamic = features.pop("DYNAMIC", False)
    consumers = features.pop("CONSUMERS", 2)
    invariant = features.pop("INVARIANT", False)
    fold = features.pop("FOLD", False)
    wide = features.pop("WIDE", False)
    split = features.pop("SPLIT_Q", True) and fp8 is not None and not q8 and head_size <= 128
    block_n, num_buf, num_qbuf, stages, consumer_regs, producer_regs = config_for(
        head_size, fp8 is not None, q8 is not None, split, consumers, wide)
    dense_rows = not paged or dense_new_kv
    cache = f"*{fp8}" if fp8 else "*bf16"
    args = {
        "Q": f"*{q8}" if q8 else "*bf16", "K": "*bf16" if dense_rows else None,
        "V": "*bf16" if dense_rows else None, "KC": cache if paged else None,
        "VC": cache if paged else None, "Out": "*bf16", "Lse": "*fp32",
        "cu_seqlens_q": "*i32", "seqused_k": "*i32",
        "kv_index": "*i32",
        "alibi_slopes": None, "sinks": None, "q_descale": "*fp32" if q8 else None,
        "k_descale": "*fp32" if fp8 else None,
        "v_descale": "*fp32" if fp8 else None,
        "Work": "*fp32" if dynamic or fold else None,
        "qk_scale": "fp32", "softcap": "fp32",
        "left": "i32", "right": "i32", "batch": "i32", "total_q": "i32", "num_items": "i32",
        "grid": "i32", "skip_q_len": "i32", "stride_q": "i32", "kv_rows": "i32",
        "stride_k": "i32", "stride_v": "i32", "stride_kc": "i32",
        "stride_vc": "i32", "page_rows": "i32", "head_rows": "i32", "head_cols_k": "i32",
        "head_cols_v": "i32", "stride_bt": "i32", "stride_ot": "i32:16", "stride_oh": "i32:16",
        "stride_ds_b": "i32", "stride_ds_h": "i32",
        "NUM_HEADS": 32, "GROUP": 4, "HEAD_D": head_size, "HEAD_DV": head_size,
        "PAGE": 16 if paged else block_n, "BLOCK_M": 64 * consumers, "BLOCK_N": block_n,
        "NUM_BUF": num_buf, "NUM_QBUF": num_qbuf, "STAGES": stages, "WINDOW_LEFT": False,
        "WINDOW_RIGHT": True, "USE_ALIBI": False, "USE_SOFTCAP": False, "USE_SINKS": False,
        "WRITE_LSE": True, "PAGED": paged, "DENSE_ROWS": dense_rows, "KV_FP8": bool(fp8),
        "KV_DESCALE": bool(fp8), "QK_FP8": bool(q8) or split, "Q_DESCALE": bool(q8),
        "LPT_ACROSS": True,
        "SCALE_IN_EXP": True, "DYNAMIC": dynamic, "PV_FP8": bool(q8),
        "FP16_DOTS": bool(fp8), "PRODUCER_REGS": producer_regs, "CONSUMER_REGS": consumer_regs,
        "LANE_MASKS": consumers == 3,
        # the fold rows in Work past the counters' 128 bytes where dynamic (`gluon_launch.fold_at`)
        "FOLD_AT": (32 if dynamic else 0) if fold else -1,
    }
    options = {}
    if invariant:  # as `invariant_plan.plan_invariant_gluon` launches it
        tile = 64 if invariant is True else invariant  # the `tl` pass's block_n
        args.update(BLOCK_N=tile, INVARIANT_SPLIT=1024, SCALE_IN_EXP=False, LANE_MASKS=False)
        # (SCALE_IN_EXP in features: `SWITCHES.invariant_scale_in_exp`, set below)
        options["enable_fp_fusion"] = False
    for name, value in features.items():
        if name == "USE_ALIBI" and value:
            args["alibi_slopes"] = "*fp32"
        if name == "USE_SINKS" and value:
            args["sinks"] = "*fp32"
        args[name] = value
    return {"num_warps": 4, "args": args, "options": options}


COUNTS = {
    "smem": r"dynamic smem, bytes\) = (\d+)",
    "REG": r"REG:(\d+)",
    "HGMMA": r"HGMMA\s+(\d+)",
    "UTMALDG": r"UTMALDG \(TMA load\)\s+(\d+)",
    "SYNCS": r"SYNCS\.\* \(mbarrier\)\s+(\d+)",
    "USETMAXREG": r"USETMAXREG\s+(\d+)",
    "STL/LDL": r"STL/LDL \(local mem\)\s+(\d+)",
}


def compile_row(tool: str, name: str, dump: str) -> list[str]:
    d, paged, new_kv, features = VARIANTS[name]
    done = compile_variant(tool, KERNEL, "gluon_prefill_kernel", name,
                           spec(d, paged, new_kv, features), dump)
    failed = done.failure_row(name)
    if failed:
        return failed
    row = [name] + [(re.search(rx, done.log) or [None, "?"])[1] for rx in COUNTS.values()]
    with open(done.stage("sass")) as f:
        sass = f.read()
    row.insert(4, str(len(re.findall(r"\bQGMMA\.", sass))))
    row.append(serialised(done.stage("ptx")))
    row.append(_exps_under_pv(sass))
    row.append(_barriers_over_data(done.stage("ptx"), row[1]))
    return row


def _barriers_over_data(ptx_path: str, smem: str) -> str:
    """mbarriers not in the block of barriers at the end of shared memory. The allocator
    places a barrier that no partition uses over live data (TMA then writes over an
    initialised mbarrier: undefined in PTX; KERNEL_NOTES v11). Should be 0."""
    text = open(ptx_path).read()
    offsets = set()
    for reg in re.findall(r"mbarrier\.init\.shared::cta\.b64 \[(%r\d+)\]", text):
        m = re.search(rf"add\.s32\s+{reg}, %r\d+, (\d+);", text)
        if m:
            offsets.add(int(m.group(1)))
    if not offsets or not smem.isdigit():
        return "?"
    block_start = int(smem) - 8 * len(offsets) - 256  # alignment slack
    return str(sum(o < block_start for o in offsets))


def _exps_under_pv(sass: str) -> str:
    """MUFU.EX2 between each S wait (DEPBAR.LE 1) and the next P V wait (DEPBAR.LE 0): the
    softmax work that overlaps the P V in flight (fewest over the loop bodies)."""
    counts, n = [], None
    for line in sass.splitlines():
        if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in line:
            n = 0
        elif "WARPGROUP.DEPBAR.LE gsb0, 0x0" in line and n is not None:
            counts.append(n)
            n = None
        elif "MUFU.EX2" in line and n is not None:
            n += 1
    return str(min(counts)) if counts else "?"


def main() -> int:
    return variant_table(
        __doc__, "gluon_sass_",
        ["| variant | smem B | REG | HGMMA | QGMMA | UTMALDG | SYNCS | USETMAXREG | STL/LDL | "
         "wgmma serialised | EX2 under P V | mbarriers over data |",
         "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"], compile_row, VARIANTS)


if __name__ == "__main__":
    sys.exit(main())
