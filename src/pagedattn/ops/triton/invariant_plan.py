"""Batch-invariant mode's launches: the portable prefill pass over every request with one
tile config, keys in fixed splits (`invariant.py` says why each choice keeps the bits).

The schedule may follow the batch, the arithmetic never does: a batch whose programs fill the
GPU folds each row's splits inside its program; a batch that cannot (a few decodes over long
contexts) runs a program per (query block, KV head, split) and `fold_splits_kernel` folds the
partial states in the same order with the same function, which gives the same bits. The
Hopper and Gluon passes, the decode pass's own tiles and cascade are never used.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton

from pagedattn.ops.triton import launch
from pagedattn.ops.triton.attention import invariant_attention_kernel
from pagedattn.ops.triton.attention_args import FoldBatch, Outputs, batch_section
from pagedattn.ops.triton.invariant import fold_splits_kernel
from pagedattn.ops.triton.pass_launch import PassLaunch
from pagedattn.ops.triton.tile_math import pow2_at_least

FOLD_TOKENS = 16  # tokens per program of the fold


def plan_invariant_launches(
    *, device: torch.device, cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor,
    cu_seqlens_k: Optional[torch.Tensor], block_table: Optional[torch.Tensor], batch: int,
    total_q: int, max_seqlen_q: int, max_seqlen_k: int, num_heads: int, num_kv_heads: int,
    head_size: int, head_size_v: int, page_size: int, q_dtype: torch.dtype, kv_dtype: torch.dtype,
    out_dtype: torch.dtype, softmax_scale: float, causal: bool, window_left: int,
    window_right: int, softcap: float, num_splits: int, dtypes: tuple,
) -> tuple[PassLaunch, ...]:
    """The launches of one batch in batch-invariant mode (`plan_attention`'s arguments).
    num_splits: 0 splits programs where the batch cannot fill the GPU
    (`launch.SWITCHES.invariant_split_below`), 1 never, n > 1 always; the fixed splits
    themselves are `launch.SWITCHES.invariant_split_keys` keys. A batch whose queries all fit
    `launch.invariant_decode_config`'s rows (decodes alone) runs those tiles."""
    group = num_heads // num_kv_heads
    group_pad = pow2_at_least(group)
    cfg = launch.invariant_config(head_size=head_size, head_size_v=head_size_v,
                                  group_pad=group_pad)
    widest = max(head_size, head_size_v)  # what the per-head-size switches are keyed by
    split_keys = launch.invariant_split_keys(cfg.block_n, widest)
    decode_cfg = launch.invariant_decode_config(cfg, group_pad, widest)
    if max_seqlen_q * group_pad <= decode_cfg.block_m:  # decodes alone: their own tiles
        cfg = decode_cfg
    block_q = cfg.block_m // group_pad
    q_blocks = total_q // block_q + batch  # a bound on the (query block) programs
    splits = triton.cdiv(max(max_seqlen_k, 1), split_keys)
    split_programs = splits > 1 and (
        num_splits > 1 or (num_splits == 0 and q_blocks * num_kv_heads
                           < launch.SWITCHES.invariant_split_below * launch.sm_count(device)))
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
        FP8_V_IN_REGS=launch.fp8_v_in_regs(kv_dtype, dot, device), SPLIT_KEYS=split_keys)
    grid = (q_blocks, num_kv_heads, splits if split_programs else 1)
    if not split_programs:
        return (PassLaunch("prefill", invariant_attention_kernel, grid, constexprs, cfg.num_warps,
                           cfg.num_stages, batch_args, device=device, dtypes=dtypes,
                           options=options),)
    partials = Outputs(
        Out=torch.empty((splits, total_q, num_heads, head_size_v), dtype=torch.float32,
                        device=device),
        Lse=torch.empty((splits, total_q, num_heads), dtype=torch.float32, device=device))
    fold = FoldBatch(PartOut=partials.Out, PartLse=partials.Lse, cu_seqlens_q=cu_seqlens_q,
                     seqused_k=seqused_k, num_seqs=batch, total_q=total_q,
                     stride_ot=num_heads * head_size_v, stride_oh=head_size_v)
    return (
        PassLaunch("prefill", invariant_attention_kernel, grid, constexprs, cfg.num_warps,
                   cfg.num_stages, batch_args, partials, device=device, dtypes=dtypes,
                   options=options),
        PassLaunch("reduce", fold_splits_kernel, (triton.cdiv(total_q, FOLD_TOKENS), num_heads),
                   dict(NUM_HEADS=num_heads, HEAD_DV=head_size_v, SPLIT_KEYS=split_keys,
                        BLOCK_T=FOLD_TOKENS), 4, 1, fold, device=device, dtypes=dtypes,
                   options=options))
