"""Batch-invariant mode's launches: the portable prefill pass over every request with one
tile config, keys in fixed splits (`invariant.py` says why each choice keeps the bits).

The schedule may follow the batch, the arithmetic never does: a batch whose programs fill the
GPU folds each row's splits inside its program; a batch that cannot (a few decodes over long
contexts) runs a program per (query block, KV head, split) and `fold_splits_kernel` folds the
partial states in the same order with the same function, which gives the same bits. The
Hopper pass, the decode pass's own tiles and cascade are never used; with
`SWITCHES.invariant_gluon` the prompts of a batch run the Gluon pass's invariant consumer
(`gluon_invariant.py`: the same operations per row, so the same bits; `plan_invariant_gluon`)
and the `tl` pass keeps the decodes; with `SWITCHES.invariant_gluon_decode` too the decodes
run the Gluon decode layout's invariant kernel (`gluon_decode_invariant.py`, the same
operations again; `plan_invariant_decode`) where the `tl` pass would otherwise run decodes
alone or decodes beside Gluon prompts, so the `tl` pass then launches at most its fold.
With `SWITCHES.invariant_gluon_256` a layer above head 128 that `gluon_256_refusal` accepts
(its static facts alone: head size, dtypes, device, features, switches; never the batch)
runs its prompts and decodes on those two kernels and never the `tl` pass: one arithmetic
a row (64-row wgmma tiles, GLUON_256_BLOCK_N-key tiles from key 0, the fixed splits'
states in float32 memory folded in order), not the `tl` pass's head-256 tiles' (a row over
two warps) but the same in every batch.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton

from pagedattn.ops.triton import attention_gluon, invariant_config, launch
from pagedattn.ops.triton.attention import invariant_attention_kernel, invariant_self_fold_kernel
from pagedattn.ops.triton.attention_args import FoldBatch, Outputs, SelfFold, batch_section
from pagedattn.ops.triton.gluon_decode_invariant_launch import (
    BLOCK_NS,
    FOLD_HEAD_SIZES,
    HEAD_SIZES,
    ROWS,
    InvariantDecodeLaunch,
    invariant_decode_refusal,
    make_invariant_decode,
)
from pagedattn.ops.triton.invariant import fold_splits_kernel
from pagedattn.ops.triton.pass_launch import PassLaunch
from pagedattn.ops.triton.tile_math import pow2_at_least

FOLD_TOKENS = 16  # tokens per program of the fold
# The `tl` pass's key tiles (block_n) the Gluon invariant consumers are built for: the prompt
# consumer takes any (`attention_gluon.launch_config`), the decode kernel these
# (`gluon_decode_invariant_launch.BLOCK_NS`).
GLUON_BLOCK_NS = BLOCK_NS
GLUON_256_BLOCK_N = 64  # a head-256 layer's key tiles on the Gluon kernels alone


def gluon_256_refusal(*, device: torch.device, paged: bool, page_size: int, num_heads: int,
                      num_kv_heads: int, head_size: int, head_size_v: int,
                      q_dtype: torch.dtype, kv_dtype: torch.dtype, out_dtype: torch.dtype,
                      use_alibi: bool, use_q_descale: bool, use_kv_descale: bool) -> list[str]:
    """Why a batch-invariant layer does not run on the Gluon kernels alone ([] = it does:
    prompts on `gluon_invariant.py`, decodes on `gluon_decode_invariant.py`, both keeping
    their split states in memory, never the `tl` pass). Static facts alone, so every batch
    of the layer takes the same side: `SWITCHES.invariant_gluon_256` (and the two Gluon
    invariant switches) on without fused multiply-adds, heads above 128 (below, the Gluon
    consumers give the `tl` pass's bits: `invariant_gluon_refusal`) in
    `FOLD_HEAD_SIZES`, and what either kernel cannot serve (`gluon_consumer_refusal`,
    `gluon_decode_invariant_launch.invariant_decode_refusal`: a paged cache, a 16-bit q over
    a cache of its dtype or e4m3, 16-bit products, no ALiBi)."""
    reasons = invariant_config.invariant_switch_refusal("invariant_gluon_256")
    if max(head_size, head_size_v) <= 128:
        reasons.append(f"head sizes {head_size}/{head_size_v}: up to 128 the Gluon consumers "
                       "give the `tl` pass's bits beside it")
    facts = dict(device=device, paged=paged, page_size=page_size, num_heads=num_heads,
                 num_kv_heads=num_kv_heads, head_size=head_size, head_size_v=head_size_v,
                 q_dtype=q_dtype, kv_dtype=kv_dtype, out_dtype=out_dtype,
                 use_q_descale=use_q_descale, use_kv_descale=use_kv_descale)
    reasons += gluon_consumer_refusal(**facts)
    reasons += invariant_decode_refusal(**facts, use_alibi=use_alibi, tl_tiles=[],
                                        head_sizes=FOLD_HEAD_SIZES)
    return list(dict.fromkeys(reasons))  # the two kernels share most limits: each once


def gluon_256(**facts) -> bool:
    """Whether a batch-invariant layer runs on the Gluon kernels alone (`gluon_256_refusal`'s
    keywords; the switch read first, so a layer pays nothing while it is off)."""
    if not launch.SWITCHES.invariant_gluon_256 or \
            max(facts["head_size"], facts["head_size_v"]) <= 128:
        return False
    return not gluon_256_refusal(**facts)


def gluon_256_tiles(*, head_size: int, head_size_v: int, group_pad: int
                    ) -> tuple[int, int, int]:
    """(block_n, split keys, decode queries) of a layer on the Gluon kernels alone: 64-key
    tiles, `invariant_config.invariant_split_keys` at them, and the requests of at most
    ROWS // group_pad queries (one 64-row tile of GQA-packed rows) on the decode kernel."""
    split_keys = invariant_config.invariant_split_keys(GLUON_256_BLOCK_N,
                                                       max(head_size, head_size_v))
    return GLUON_256_BLOCK_N, split_keys, max(ROWS // group_pad, 1)


def gluon_tiles(*, own_tiles: bool, head_size: int, head_size_v: int, group_pad: int
                ) -> tuple[int, int, int]:
    """(block_n, split keys, decode queries) of the Gluon invariant kernels for a layer:
    `gluon_256_tiles` where it runs them alone (own_tiles), else the `tl` pass's tiles they
    repeat (`invariant_config.invariant_config`'s block_n, its split keys,
    `invariant_gluon_max_q`)."""
    if own_tiles:
        return gluon_256_tiles(head_size=head_size, head_size_v=head_size_v,
                               group_pad=group_pad)
    block_n = invariant_config.invariant_config(head_size=head_size, head_size_v=head_size_v,
                                                group_pad=group_pad).block_n
    return (block_n,
            invariant_config.invariant_split_keys(block_n, max(head_size, head_size_v)),
            invariant_gluon_max_q(head_size=head_size, head_size_v=head_size_v,
                                  group_pad=group_pad))


def invariant_scratch_bytes(*, total_q: int, num_heads: int, head_size_v: int,
                            splits: int = 1, fold: tuple[int, ...] = ()) -> int:
    """The float32 scratch of a batch-invariant launch: split programs' partials (splits > 1:
    [splits, total_q, H, Dv] rows and [splits, total_q, H] LSEs, `fold_launch`) or a fold
    state in memory of shape `fold` (a launch that folds in its programs: the prompt
    consumer's `gluon_launch.fold_shape`, the decode kernel's
    `gluon_decode_invariant_launch.fold_shape`); 0 for neither."""
    if splits > 1:
        return 4 * splits * total_q * num_heads * (head_size_v + 1)
    return 4 * math.prod(fold) if fold else 0


def plan_invariant_launches(
    *, device: torch.device, cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor,
    cu_seqlens_k: Optional[torch.Tensor], block_table: Optional[torch.Tensor], batch: int,
    total_q: int, max_seqlen_q: int, max_seqlen_k: int, num_heads: int, num_kv_heads: int,
    head_size: int, head_size_v: int, page_size: int, q_dtype: torch.dtype, kv_dtype: torch.dtype,
    out_dtype: torch.dtype, softmax_scale: float, causal: bool, window_left: int,
    window_right: int, softcap: float, num_splits: int, dtypes: tuple,
    max_q_len: Optional[int] = None,
) -> tuple[PassLaunch, ...]:
    """The launches of one batch in batch-invariant mode (`plan_attention`'s arguments).
    num_splits: 0 splits programs where the batch cannot fill the GPU
    (`launch.SWITCHES.invariant_split_below`), 1 never, n > 1 always; the fixed splits
    themselves are `launch.SWITCHES.invariant_split_keys` keys. A batch whose queries all fit
    `invariant_config.invariant_decode_config`'s rows (decodes alone) runs those tiles.
    max_q_len (`invariant_gluon_max_q`): the requests of more queries are the Gluon pass's;
    the rest fit the decode tiles, which serve them, their splits folded in-program (the
    fold launch would write every token)."""
    group = num_heads // num_kv_heads
    group_pad = pow2_at_least(group)
    cfg = invariant_config.invariant_config(head_size=head_size, head_size_v=head_size_v,
                                            group_pad=group_pad)
    widest = max(head_size, head_size_v)  # what the per-head-size switches are keyed by
    split_keys = invariant_config.invariant_split_keys(cfg.block_n, widest)
    decode_cfg = invariant_config.invariant_decode_config(cfg, group_pad, widest)
    if max_seqlen_q * group_pad <= decode_cfg.block_m or max_q_len is not None:
        cfg = decode_cfg  # decodes alone (or the decodes of a batch): their own tiles
    if max_q_len is not None and max_q_len * group_pad > cfg.block_m:
        raise ValueError(f"max_q_len={max_q_len} queries x {group_pad} heads exceed the "
                         f"decode tiles' {cfg.block_m} rows")
    block_q = cfg.block_m // group_pad
    q_blocks = total_q // block_q + batch  # a bound on the (query block) programs
    splits = triton.cdiv(max(max_seqlen_k, 1), split_keys)
    split_programs = splits > 1 and max_q_len is None and (
        num_splits > 1 or (num_splits == 0 and q_blocks * num_kv_heads
                           < invariant_config.invariant_split_below(widest)
                           * launch.sm_count(device)))
    paged = block_table is not None
    batch_args = batch_section(cu_seqlens_q, seqused_k, cu_seqlens_k, block_table, batch,
                               total_q, softmax_scale, softcap, window_left)
    dot = launch.dot_dtype(q_dtype, kv_dtype, out_dtype, device)
    options = dict(enable_fp_fusion=launch.SWITCHES.invariant_fp_fusion)
    constexprs = dict(
        WINDOW_RIGHT=0 if causal else window_right if window_right >= 0 else None,
        GROUP=group, PAGE=page_size if paged else 1, HEAD_D=head_size, HEAD_DV=head_size_v,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SPLIT_KV=split_programs,
        ONE_KEY_LOOP=cfg.one_key_loop, DOT_DTYPE=dot,
        FP8_V_IN_REGS=launch.fp8_v_in_regs(kv_dtype, dot, device), SPLIT_KEYS=split_keys,
        MAX_Q_LEN=max_q_len,
        # ALiBi's slopes are an argument: the kernel drops the form where they are given
        SCALE_IN_EXP=invariant_config.invariant_scale_in_exp(softmax_scale, softcap, False),
        MAX_SLACK=invariant_config.invariant_max_slack())
    grid = (q_blocks, num_kv_heads, splits if split_programs else 1)
    # no fold launch: the last folds
    if split_programs and invariant_config.invariant_self_fold():
        for name in ("SPLIT_KV", "MAX_Q_LEN"):
            constexprs.pop(name)
        section = self_fold_scratch(device=device, programs=(q_blocks, num_kv_heads),
                                    total_q=total_q, num_heads=num_heads,
                                    head_size_v=head_size_v, splits=splits)
        return (PassLaunch("prefill", invariant_self_fold_kernel, grid, constexprs,
                           cfg.num_warps, cfg.num_stages, batch_args + section, device=device,
                           dtypes=dtypes, options=options),)
    if not split_programs:
        return (PassLaunch("prefill", invariant_attention_kernel, grid, constexprs, cfg.num_warps,
                           cfg.num_stages, batch_args, device=device, dtypes=dtypes,
                           options=options),)
    partials, fold = fold_launch(
        device=device, cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k, batch=batch,
        total_q=total_q, num_heads=num_heads, head_size_v=head_size_v, splits=splits,
        split_keys=split_keys, dtypes=dtypes)
    return (
        PassLaunch("prefill", invariant_attention_kernel, grid, constexprs, cfg.num_warps,
                   cfg.num_stages, batch_args, partials, device=device, dtypes=dtypes,
                   options=options),
        fold)


def fold_launch(*, device: torch.device, cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor,
                batch: int, total_q: int, num_heads: int, head_size_v: int, splits: int,
                split_keys: int, dtypes: tuple) -> tuple[Outputs, PassLaunch]:
    """The split programs' partial states (Out [splits, total_q, H, Dv], Lse [splits,
    total_q, H] float32, log2 units) and the launch of `fold_splits_kernel` over them, which
    writes every token's row (so only where every request ran split programs)."""
    partials = Outputs(
        Out=torch.empty((splits, total_q, num_heads, head_size_v), dtype=torch.float32,
                        device=device),
        Lse=torch.empty((splits, total_q, num_heads), dtype=torch.float32, device=device))
    fold = FoldBatch(PartOut=partials.Out, PartLse=partials.Lse, cu_seqlens_q=cu_seqlens_q,
                     seqused_k=seqused_k, num_seqs=batch, total_q=total_q,
                     stride_ot=num_heads * head_size_v, stride_oh=head_size_v)
    return partials, PassLaunch(
        "reduce", fold_splits_kernel, (triton.cdiv(total_q, FOLD_TOKENS), num_heads),
        dict(NUM_HEADS=num_heads, HEAD_DV=head_size_v, SPLIT_KEYS=split_keys,
             BLOCK_T=FOLD_TOKENS), 4, 1, fold, device=device, dtypes=dtypes,
        options=dict(enable_fp_fusion=launch.SWITCHES.invariant_fp_fusion))


def self_fold_scratch(*, device: torch.device, programs: tuple[int, int], total_q: int,
                      num_heads: int, head_size_v: int, splits: int) -> SelfFold:
    """The scratch of split programs that fold their own splits
    (`launch.SWITCHES.invariant_self_fold`): the partial states as `fold_launch` makes them
    and a ticket counter per (request or query block, KV head) of `programs`, zeroed here,
    once: the program that folds sets its counter back to 0, so a graph replays the launch
    as it is."""
    return SelfFold(
        PartOut=torch.empty((splits, total_q, num_heads, head_size_v), dtype=torch.float32,
                            device=device),
        PartLse=torch.empty((splits, total_q, num_heads), dtype=torch.float32, device=device),
        Tickets=torch.zeros(programs, dtype=torch.int32, device=device))


def invariant_gluon_max_q(*, head_size: int, head_size_v: int, group_pad: int) -> int:
    """The longest request (in queries) the `tl` pass keeps beside the Gluon pass's invariant
    consumer: what the decode tiles' rows hold
    (`invariant_config.invariant_decode_config`)."""
    cfg = invariant_config.invariant_config(head_size=head_size, head_size_v=head_size_v,
                                            group_pad=group_pad)
    widest = max(head_size, head_size_v)
    return (invariant_config.invariant_decode_config(cfg, group_pad, widest).block_m
            // group_pad)


def invariant_gluon_refusal(*, device: torch.device, paged: bool, page_size: int,
                            num_heads: int, num_kv_heads: int, head_size: int,
                            head_size_v: int, q_dtype: torch.dtype, kv_dtype: torch.dtype,
                            out_dtype: torch.dtype, use_q_descale: bool,
                            use_kv_descale: bool) -> list[str]:
    """Why the Gluon pass's invariant consumer cannot give these prompts the `tl` invariant
    pass's bits ([] = it can): the switch, the Gluon pass's own limits
    (`attention_gluon.why_not`), keys from a paged cache (as the `tl` pass reads them in
    this mode; dense varlen keys are refused), a 16-bit q (an fp8 q's product is another
    instruction), no fused multiply-adds in the `tl` pass, and `tl` tiles of wgmma
    warpgroups of 16 rows a warp with 64-key tiles (the consumer's; head 256's 64-row,
    8-warp tiles are not: `invariant_config.invariant_tiles_agree`)."""
    reasons = gluon_consumer_refusal(
        device=device, paged=paged, page_size=page_size, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_size=head_size, head_size_v=head_size_v,
        q_dtype=q_dtype, kv_dtype=kv_dtype, out_dtype=out_dtype, use_q_descale=use_q_descale,
        use_kv_descale=use_kv_descale)
    return reasons + tl_tiles_refusal(num_heads=num_heads, num_kv_heads=num_kv_heads,
                                      head_size=head_size, head_size_v=head_size_v)


def gluon_consumer_refusal(*, device: torch.device, paged: bool, page_size: int,
                           num_heads: int, num_kv_heads: int, head_size: int,
                           head_size_v: int, q_dtype: torch.dtype, kv_dtype: torch.dtype,
                           out_dtype: torch.dtype, use_q_descale: bool,
                           use_kv_descale: bool) -> list[str]:
    """`invariant_gluon_refusal` but for the `tl` tiles: the switch, a paged cache, a 16-bit
    q and the Gluon pass's own limits."""
    reasons = invariant_config.invariant_switch_refusal("invariant_gluon")
    if not paged:
        reasons.append("dense varlen keys: the consumer serves a paged cache")
    if q_dtype not in (torch.float16, torch.bfloat16):
        reasons.append(f"q {q_dtype}: the consumer serves a 16-bit q")
    return reasons + attention_gluon.why_not(
        device=device, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
        head_size_v=head_size_v, q_dtype=q_dtype, kv_dtype=kv_dtype, out_dtype=out_dtype,
        paged=paged, page_size=page_size, use_q_descale=use_q_descale,
        use_kv_descale=use_kv_descale)


def tl_tiles_refusal(*, num_heads: int, num_kv_heads: int, head_size: int,
                     head_size_v: int) -> list[str]:
    """Why the `tl` invariant pass's tiles are not a Gluon invariant consumer's ([] = they
    are): wgmma warpgroups of 16 rows a warp (`invariant_config.invariant_tiles_agree` with a
    64-row, 4-warp tile) over key tiles of GLUON_BLOCK_NS, the tiles both consumers are built
    for (64 keys: the default, checked on the H200; 128: `SWITCHES.invariant_tiles` naming
    them)."""
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        return []  # the Gluon pass's own refusal names the heads
    group_pad = pow2_at_least(num_heads // num_kv_heads)
    cfg = invariant_config.invariant_config(head_size=head_size, head_size_v=head_size_v,
                                            group_pad=group_pad)
    part = launch.AttnConfig(64, cfg.block_n, 4, 1, 1, cfg.one_key_loop)
    why = invariant_config.invariant_tiles_agree(cfg, part)
    if why:
        return [f"the `tl` invariant tiles ({cfg.block_m} rows, {cfg.block_n} keys, "
                f"{cfg.num_warps} warps) and the consumer's 64-row warpgroups: {why}"]
    if cfg.block_n not in GLUON_BLOCK_NS:
        return [f"the `tl` invariant tiles' block_n {cfg.block_n}: the consumers are built "
                f"for key tiles of {GLUON_BLOCK_NS}"]
    return []


def plan_invariant_gluon(
    *, device: torch.device, cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor,
    block_table: Optional[torch.Tensor], batch: int, total_q: int, max_seqlen_q: int,
    max_seqlen_k: int, num_heads: int, num_kv_heads: int, head_size: int, head_size_v: int,
    page_size: int, q_dtype: torch.dtype, kv_dtype: torch.dtype, out_dtype: torch.dtype,
    softmax_scale: float, causal: bool, window_left: int, window_right: int, softcap: float,
    use_alibi: bool, use_sinks: Optional[bool], use_q_descale: bool, use_kv_descale: bool,
    write_lse: Optional[bool],
) -> Optional[dict]:
    """The Gluon pass's invariant launches for the prompts of a batch-invariant batch (its
    requests of more than `invariant_gluon_max_q` queries), by (LSE written, sinks given)
    as `attention_plan` keeps Gluon choices (None: either, planned both ways); None where
    `invariant_gluon_refusal` gives a reason or the batch has no prompt."""
    if not launch.SWITCHES.invariant_gluon:  # the usual case: no host time spent on it
        return None
    group_pad = pow2_at_least(num_heads // max(num_kv_heads, 1))
    facts = dict(device=device, paged=block_table is not None, page_size=page_size,
                 num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                 head_size_v=head_size_v, q_dtype=q_dtype, kv_dtype=kv_dtype,
                 out_dtype=out_dtype, use_q_descale=use_q_descale,
                 use_kv_descale=use_kv_descale)
    own_tiles = gluon_256(**facts, use_alibi=use_alibi)  # the layer's own, no `tl` pass
    if not own_tiles and invariant_gluon_refusal(**facts):
        return None
    block_n, split_keys, max_q = gluon_tiles(own_tiles=own_tiles, head_size=head_size,
                                             head_size_v=head_size_v, group_pad=group_pad)
    if max_seqlen_q <= max_q:
        return None
    args = dict(
        device=device, cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k, block_table=block_table,
        batch=batch, total_q=total_q, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
        head_size_v=head_size_v, q_dtype=q_dtype, kv_dtype=kv_dtype, causal=causal,
        window_left=window_left, window_right=window_right, softcap=softcap,
        use_alibi=use_alibi, page_size=page_size, dense_new_kv=False,
        softmax_scale=softmax_scale, out_dtype=out_dtype, use_q_descale=use_q_descale,
        use_kv_descale=use_kv_descale, skip_q_len=max_q, invariant=(block_n, split_keys))
    choices = {(lse, sinks): attention_gluon.plan_gluon_prefill(**args, use_sinks=sinks,
                                                                write_lse=lse)
               for lse in ((False, True) if write_lse is None else (bool(write_lse),))
               for sinks in ((False, True) if use_sinks is None else (bool(use_sinks),))}
    if any(c is None for c in choices.values()):
        return None
    # One work area (the fold state, a dynamic launch's counters) for every form a call may
    # pick: their schedules differ in lse / sinks alone, so its layout is theirs; the largest.
    works = [c.work for c in choices.values() if c.work is not None]
    for c in choices.values():
        c.work = max(works, key=torch.Tensor.numel) if works else None
    return choices


def invariant_gluon_decode_refusal(*, device: torch.device, paged: bool, page_size: int,
                                   num_heads: int, num_kv_heads: int, head_size: int,
                                   head_size_v: int, q_dtype: torch.dtype,
                                   kv_dtype: torch.dtype, out_dtype: torch.dtype,
                                   use_alibi: bool, use_q_descale: bool,
                                   use_kv_descale: bool) -> list[str]:
    """Why the Gluon invariant decode kernel cannot give decodes the `tl` invariant pass's
    bits ([] = it can): `gluon_decode_invariant_launch.invariant_decode_refusal` (the
    switch, the kernel's devices, dtypes and features), the `tl` pass's tiles
    (`tl_tiles_refusal`) and its decode rows (`invariant_gluon_max_q` tokens x the padded
    group) within the kernel's 64."""
    tiles = tl_tiles_refusal(num_heads=num_heads, num_kv_heads=num_kv_heads,
                             head_size=head_size, head_size_v=head_size_v)
    if not tiles and num_kv_heads > 0 and num_heads % num_kv_heads == 0:
        group_pad = pow2_at_least(num_heads // num_kv_heads)
        max_q = invariant_gluon_max_q(head_size=head_size, head_size_v=head_size_v,
                                      group_pad=group_pad)
        if max_q * group_pad > ROWS:
            tiles = [f"the `tl` decode tiles' {max_q} queries x {group_pad} heads exceed the "
                     f"kernel's {ROWS} rows"]
    return invariant_decode_refusal(
        device=device, paged=paged, page_size=page_size, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_size=head_size, head_size_v=head_size_v,
        q_dtype=q_dtype, kv_dtype=kv_dtype, out_dtype=out_dtype, use_alibi=use_alibi,
        use_q_descale=use_q_descale, use_kv_descale=use_kv_descale, tl_tiles=tiles)


def plan_invariant_decode(
    *, device: torch.device, cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor,
    block_table: Optional[torch.Tensor], batch: int, total_q: int, max_seqlen_q: int,
    max_seqlen_k: int, num_heads: int, num_kv_heads: int, head_size: int, head_size_v: int,
    page_size: int, q_dtype: torch.dtype, kv_dtype: torch.dtype, out_dtype: torch.dtype,
    softmax_scale: float, causal: bool, window_left: int, window_right: int, softcap: float,
    use_alibi: bool, use_q_descale: bool, use_kv_descale: bool, num_splits: int,
    dtypes: tuple, prompts_elsewhere: bool,
) -> Optional[tuple[InvariantDecodeLaunch, tuple[PassLaunch, ...]]]:
    """The Gluon launch of a batch-invariant batch's decodes (its requests of at most
    `invariant_gluon_max_q` queries) and the launches after it (the fold of its split
    programs, or none), or None where the `tl` pass keeps them: a refusal
    (`invariant_gluon_decode_refusal`), or prompts in the batch that the `tl` pass runs
    (prompts_elsewhere False; its launch serves every request of a batch or the decodes
    alone). Split programs, then `fold_splits_kernel`, as the `tl` plan chooses them
    (`plan_invariant_launches`' num_splits), only for a batch of decodes alone: the fold
    writes every token."""
    if not launch.SWITCHES.invariant_gluon_decode:  # the usual case: no host time spent
        return None
    paged = block_table is not None
    facts = dict(device=device, paged=paged, page_size=page_size, num_heads=num_heads,
                 num_kv_heads=num_kv_heads, head_size=head_size, head_size_v=head_size_v,
                 q_dtype=q_dtype, kv_dtype=kv_dtype, out_dtype=out_dtype, use_alibi=use_alibi,
                 use_q_descale=use_q_descale, use_kv_descale=use_kv_descale)
    own_tiles = gluon_256(**facts)  # the layer's own tiles: never the `tl` pass
    if not own_tiles and invariant_gluon_decode_refusal(**facts):
        return None
    group_pad = pow2_at_least(num_heads // num_kv_heads)
    block_n, split_keys, max_q = gluon_tiles(own_tiles=own_tiles, head_size=head_size,
                                             head_size_v=head_size_v, group_pad=group_pad)
    alone = max_seqlen_q <= max_q
    if not alone and not prompts_elsewhere:
        if own_tiles:  # the `tl` pass must not take the decodes beside them
            raise ValueError(f"head {head_size} on the Gluon kernels alone: prompts of "
                             f"{max_seqlen_q} queries found no Gluon launch")
        return None
    splits = triton.cdiv(max(max_seqlen_k, 1), split_keys)
    split_programs = alone and splits > 1 and (
        num_splits > 1 or (num_splits == 0 and batch * num_kv_heads
                           < invariant_config.invariant_split_below(max(head_size, head_size_v))
                           * launch.sm_count(device)))
    after, partials, self_fold = (), None, None
    if split_programs and invariant_config.invariant_self_fold() and head_size in HEAD_SIZES:
        self_fold = tuple(self_fold_scratch(
            device=device, programs=(batch, num_kv_heads), total_q=total_q,
            num_heads=num_heads, head_size_v=head_size_v, splits=splits))
    elif split_programs:
        outputs, fold = fold_launch(
            device=device, cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k, batch=batch,
            total_q=total_q, num_heads=num_heads, head_size_v=head_size_v, splits=splits,
            split_keys=split_keys, dtypes=dtypes)
        after, partials = (fold,), (outputs.Out, outputs.Lse)
    decodes = make_invariant_decode(
        cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k, block_table=block_table, batch=batch,
        total_q=total_q, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
        page_size=page_size, q_dtype=q_dtype, kv_dtype=kv_dtype, out_dtype=out_dtype,
        softmax_scale=softmax_scale, causal=causal, window_left=window_left,
        window_right=window_right, softcap=softcap, decode_queries=max_q,
        split_keys=split_keys, splits=splits if split_programs else 1, partials=partials,
        block_n=block_n, self_fold=self_fold)
    return decodes, after
