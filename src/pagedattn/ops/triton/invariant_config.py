"""Batch-invariant mode's configs: which tiles, splits and arithmetic its passes run, from
`launch.SWITCHES` and the layer's head sizes (the largest of head_size and head_size_v).

Some answers decide a row's bits (the split keys, the one tile config, the score scale in
the exponent, the max slack), others only its schedule (the decode tiles, which must agree
with the one config, the split threshold, the self fold, the lazy rescale). The switches
themselves are `launch.Switches`'s fields, beside every other pass's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

# `launch.interpreting` is read through its module at every call: tests patch it to plan a
# GPU's tiles on the CPU.
from pagedattn.ops.triton import launch
from pagedattn.ops.triton.launch import SWITCHES, AttnConfig, per_head_size

# Batch-invariant mode's tiles for steps of decodes alone, by largest head size, where
# `invariant_config` gives that head size 128-row, 8-warp tiles (both wgmma warpgroup
# stacks of 16 rows a warp: `invariant_tiles_agree`). Decodes keep the 64-row tiles' speed.
INVARIANT_DECODE_TILES = {128: (64, 4, 3)}
# `SWITCHES.invariant_tiles_128`'s tiles by largest head size: 128-key tiles for every pass
# (the one config, and beside it the decode tiles of steps of decodes alone: both wgmma
# warpgroups of 16 rows a warp over the same key tiles, `invariant_tiles_agree`).
INVARIANT_TILES_128 = {64: (64, 128, 4, 3), 128: (128, 128, 8, 2)}
INVARIANT_DECODE_TILES_128 = {128: (64, 4, 3)}
# `SWITCHES.invariant_split_below`'s default by largest head size: head 256's unsplit decode
# programs keep their fold state in memory and ran 1.54x the default mode at 32 x 8192,
# split programs 1.11x (KERNEL_NOTES v47); splitting below 8 x the SMs' programs also takes
# 128 x 8192 from 1.51x to 1.09x and leaves 32 and 64 x 8192 at 1.11x (16 x: 64 x 8192
# 1.16x; KERNEL_NOTES v49); heads 64 and 128 lose by splitting there (1.08 -> 1.65x, 1.09 ->
# 1.24x), so they keep 1.0.
INVARIANT_SPLIT_BELOW = {256: 8.0}


def invariant_switch_refusal(switch: str) -> list[str]:
    """Why the switches keep batch-invariant mode's Gluon kernel that `SWITCHES.<switch>`
    turns on from serving ([] = they let it): that switch off, or fused multiply-adds in the
    `tl` pass (`invariant_fp_fusion`), whose bits no other kernel's code repeats."""
    reasons = []
    if not getattr(SWITCHES, switch):
        reasons.append(f"SWITCHES.{switch} is off")
    if SWITCHES.invariant_fp_fusion:
        reasons.append("SWITCHES.invariant_fp_fusion: the `tl` pass fuses multiply-adds where "
                       "its own code has them, which no other kernel's code repeats")
    return reasons


def invariant_scale_in_exp(softmax_scale: float, softcap: float, use_alibi: bool) -> bool:
    """Whether batch-invariant mode's passes take the score scale into the exponent's fma
    (`SWITCHES.invariant_scale_in_exp`): not with a soft cap or ALiBi (they need scaled
    scores), nor a scale <= 0 (the running max of raw scores would not scale to it). The
    `tl` pass learns ALiBi from its arguments, so its planner passes use_alibi False and the
    kernel drops the form where slopes are given."""
    return bool(SWITCHES.invariant_scale_in_exp) and softcap <= 0 and not use_alibi \
        and softmax_scale > 0


def invariant_self_fold() -> bool:
    """Whether batch-invariant split programs fold their own splits
    (`SWITCHES.invariant_self_fold`); refuses a switch that is not a bool."""
    switch = SWITCHES.invariant_self_fold
    if not isinstance(switch, bool):
        raise ValueError(f"SWITCHES.invariant_self_fold={switch!r} must be True or False")
    return switch


def invariant_lazy_rescale() -> bool:
    """Whether batch-invariant prompts' Gluon consumer skips O's rescale where no row of a
    warp moved its max (`SWITCHES.invariant_lazy_rescale`); refuses a switch that is not a
    bool."""
    switch = SWITCHES.invariant_lazy_rescale
    if not isinstance(switch, bool):
        raise ValueError(f"SWITCHES.invariant_lazy_rescale={switch!r} must be True or False")
    return switch


def invariant_skip_unseen() -> bool:
    """Whether batch-invariant prompts' Gluon consumer passes the key tiles past the last key
    its rows see (`SWITCHES.invariant_skip_unseen`); refuses a switch that is not a bool."""
    switch = SWITCHES.invariant_skip_unseen
    if not isinstance(switch, bool):
        raise ValueError(f"SWITCHES.invariant_skip_unseen={switch!r} must be True or False")
    return switch


def invariant_max_slack() -> int:
    """Batch-invariant mode's max slack (`SWITCHES.invariant_max_slack`), refused unless an
    int of 0-8 (P's weights reach 2^slack: 8 keeps fp16's P within 256)."""
    slack = SWITCHES.invariant_max_slack
    if isinstance(slack, bool) or not isinstance(slack, int) or not 0 <= slack <= 8:
        raise ValueError(f"SWITCHES.invariant_max_slack={slack!r} must be an int of 0-8 "
                         "(powers of 2 a row's max may lag; 0: none)")
    return slack


def invariant_gluon_slack() -> int:
    """The Gluon invariant kernels' MAX_SLACK, the prompt consumer's and the decode kernel's
    alike: the slack of `SWITCHES.invariant_max_slack` where it gives one, else 0 where
    `SWITCHES.invariant_lazy_rescale` skips O's rescale (exact: alpha is 1 where a row's max
    held), else -1 (O rescaled every tile). Both switches checked as their readers do, the
    lazy one also where the slack decides."""
    slack, lazy = invariant_max_slack(), invariant_lazy_rescale()
    return slack or (0 if lazy else -1)


def invariant_tiles_128(widest: int) -> bool:
    """Whether `SWITCHES.invariant_tiles_128` gives a layer of largest head size `widest`
    128-key tiles for every pass (True: heads 64 and 128, None: head 64; others keep their
    tiles). Refuses a switch that is not None or a bool, and an `invariant_tiles` naming
    other key tiles for such a head size (a request's passes would not agree)."""
    switch = SWITCHES.invariant_tiles_128
    if switch is not None and not isinstance(switch, bool):
        raise ValueError(f"SWITCHES.invariant_tiles_128={switch!r} must be None, True or "
                         "False")
    if switch is None:
        switch = widest == 64
    if not switch or widest not in INVARIANT_TILES_128:
        return False
    own = per_head_size(SWITCHES.invariant_tiles, widest)
    if own is not None and (not isinstance(own, tuple) or len(own) != 4 or own[1] != 128):
        raise ValueError(f"SWITCHES.invariant_tiles={SWITCHES.invariant_tiles!r} names "
                         f"{own!r} for head size {widest}, beside invariant_tiles_128 (key "
                         "tiles of 128 for every pass): name tiles of block_n 128, or none")
    return True


def invariant_config(*, head_size: int, head_size_v: int, group_pad: int) -> AttnConfig:
    """Batch-invariant mode's tiles: one config for every row of every batch (decodes and
    prompts alike), so a function of the layer's shapes only. Rows hold block_m //
    group_pad tokens of a KV head's query heads, as the portable prefill pass's do. The
    split folds keep a second [block_m, head_size_v] float32 state live, so head 256 takes 8
    warps."""
    widest = max(head_size, head_size_v)
    tiles = per_head_size(SWITCHES.invariant_tiles, widest)
    if invariant_tiles_128(widest) and tiles is None:  # on the interpreter too (CPU tests)
        tiles = INVARIANT_TILES_128[widest]
    if tiles is not None:
        cfg = AttnConfig(*tiles, num_splits=1)
    elif launch.interpreting():
        cfg = AttnConfig(16, 16, 4, 1, 1)
    elif widest in INVARIANT_DECODE_TILES:
        # Two m64 warpgroups: prefill 12% faster than (64, 64, 4, 3) at head 128 on the H200
        # (tools/sweep_invariant.py; KERNEL_NOTES v27); decodes alone keep 64-row tiles.
        cfg = AttnConfig(128, 64, 8, 2, 1)
    elif widest <= 128:
        cfg = AttnConfig(64, 64, 4, 3, 1)
    else:
        cfg = AttnConfig(64, 64, 8, 2, 1)
    return replace(cfg, block_m=max(cfg.block_m, group_pad))


def invariant_tiles_agree(a: AttnConfig, b: AttnConfig) -> str:
    """Why a row may get other bits from batch-invariant tiles `b` than from `a` ('' where
    it cannot): on sm_90 tiles of 64-row multiples with 16 rows a warp run wgmma warpgroups
    stacked along M, the same instruction and per-warp order of adds whatever the row
    count; other shapes run mma.sync or split a row's keys over warps."""
    for c in (a, b):
        if c.block_m % 64 or c.block_m != 16 * c.num_warps:
            return (f"{c.block_m} rows x {c.num_warps} warps are not wgmma warpgroups of 16 "
                    "rows a warp (block_m a multiple of 64, num_warps = block_m / 16)")
    if (a.block_n, a.one_key_loop) != (b.block_n, b.one_key_loop):
        return f"the key tiles differ (block_n {a.block_n} and {b.block_n})"
    return ""


def invariant_decode_config(cfg: AttnConfig, group_pad: int,
                            head_size: Optional[int] = None) -> AttnConfig:
    """The tiles of a batch-invariant step of decodes alone: `SWITCHES.invariant_decode_tiles`
    (for the largest head size `head_size` where a dict) over the one config `cfg`, its
    block_n and loop form kept, rows at least the padded GQA group; with both switches None,
    `INVARIANT_DECODE_TILES` on a GPU where a group fits their rows; with
    `SWITCHES.invariant_tiles_128` (and `invariant_decode_tiles` None)
    `INVARIANT_DECODE_TILES_128` so, on the interpreter too; `cfg` itself elsewhere. Tiles
    that could change a row's bits are refused on a GPU (the interpreter's dots and sums do
    not depend on the tiles)."""
    tiles = per_head_size(SWITCHES.invariant_decode_tiles, head_size)
    own = None
    if tiles is None and SWITCHES.invariant_decode_tiles is None:
        if head_size is not None and invariant_tiles_128(head_size):
            own = INVARIANT_DECODE_TILES_128  # beside INVARIANT_TILES_128
        elif SWITCHES.invariant_tiles is None and not launch.interpreting():
            own = INVARIANT_DECODE_TILES  # beside invariant_config's own
    if own is not None:
        tiles = own.get(head_size)
        if tiles is not None and group_pad > tiles[0]:
            tiles = None  # a group wider than their rows keeps the one config
    if tiles is None:
        return cfg
    if not (isinstance(tiles, tuple) and len(tiles) == 3
            and all(isinstance(t, int) and t > 0 for t in tiles)):
        raise ValueError(f"SWITCHES.invariant_decode_tiles={tiles!r} must be None, "
                         "(block_m, num_warps, num_stages) of positive ints, or a dict of them")
    block_m, warps, stages = tiles
    dec = replace(cfg, block_m=max(block_m, group_pad), num_warps=warps, num_stages=stages)
    why = "" if launch.interpreting() else invariant_tiles_agree(cfg, dec)
    if why:
        raise ValueError(f"SWITCHES.invariant_decode_tiles={tiles!r} beside the tiles "
                         f"({cfg.block_m}, {cfg.block_n}, {cfg.num_warps} warps) would change "
                         f"a row's bits: {why}")
    return dec


def invariant_split_below(head_size: Optional[int] = None) -> float:
    """The batch-invariant schedule's threshold in SMs (`SWITCHES.invariant_split_below`; a
    dict by largest head size, 1.0 for a head size it does not name; None:
    `INVARIANT_SPLIT_BELOW`)."""
    value = SWITCHES.invariant_split_below
    below = per_head_size(INVARIANT_SPLIT_BELOW if value is None else value, head_size, 1.0)
    if isinstance(below, bool) or not isinstance(below, (int, float)) or not below >= 0:
        raise ValueError(f"SWITCHES.invariant_split_below={below!r} must be a number >= 0 (a "
                         f"batch's programs below it times the SMs run split programs)")
    return float(below)


def invariant_split_keys(block_n: int, head_size: Optional[int] = None) -> int:
    """Keys per fixed split of batch-invariant mode (`SWITCHES.invariant_split_keys`; a dict
    by largest head size, 1024 for a head size it does not name)."""
    keys = per_head_size(SWITCHES.invariant_split_keys, head_size, 1024)
    if not isinstance(keys, int) or keys <= 0 or keys % block_n:
        raise ValueError(f"SWITCHES.invariant_split_keys={keys!r} must be a positive multiple "
                         f"of the batch-invariant tiles' block_n={block_n}")
    return keys
