"""Batch-invariant mode's decodes on Hopper: the launch of `gluon_decode_invariant.py`.

`invariant_decode_refusal(...)` says why the kernel cannot give a batch's decodes the `tl`
invariant pass's bits ([] = it can); `InvariantDecodeLaunch` is the Gluon decode pass's
launch (`gluon_decode_launch.GluonDecodeLaunch`: the same runtime arguments, scratch and
descales) with the invariant kernel, its constexprs and no fused multiply-adds.
`invariant_plan.plan_invariant_decode` decides where it serves and makes it.
"""

from __future__ import annotations

from typing import Optional

import torch

from pagedattn.ops.triton import attention_gluon, invariant_config, launch
from pagedattn.ops.triton.gluon_decode_launch import GluonDecodeLaunch, decode_window
from pagedattn.ops.triton.tile_math import pow2_at_least

try:  # Triton 3.6's Gluon (the refusal says where it cannot run)
    from pagedattn.ops.triton import gluon_decode_invariant
except Exception:  # noqa: BLE001 - any import failure means "this install cannot serve"
    gluon_decode_invariant = None

HEAD_SIZES = (64, 128)  # the `tl` pass's bits; 256 (FOLD_HEAD_SIZES) its own
FOLD_HEAD_SIZES = (256,)  # split states in memory (`gluon_decode_invariant.py`)
ROWS = 64  # the kernel's one wgmma tile of rows
BLOCK_NS = (64, 128)  # the key tiles it is built for (`gluon_decode_invariant.TILES`)
_16BIT = {torch.float16: "fp16", torch.bfloat16: "bf16"}
_DOTS = {"fp16": torch.float16, "bf16": torch.bfloat16}


def products_dtype(q_dtype: torch.dtype, kv_dtype: torch.dtype, out_dtype: torch.dtype,
                   device: torch.device) -> Optional[torch.dtype]:
    """The `tl` invariant pass's operand dtype of both products (`launch.dot_dtype`) as a
    torch dtype, or None where it is not 16 bits."""
    return _DOTS.get(str(launch.dot_dtype(q_dtype, kv_dtype, out_dtype, device)))


def invariant_decode_refusal(*, device: torch.device, paged: bool, page_size: int,
                             num_heads: int, num_kv_heads: int, head_size: int,
                             head_size_v: int, q_dtype: torch.dtype, kv_dtype: torch.dtype,
                             out_dtype: torch.dtype, use_alibi: bool, use_q_descale: bool,
                             use_kv_descale: bool, tl_tiles: list[str],
                             head_sizes: tuple = HEAD_SIZES) -> list[str]:
    """Why the invariant decode kernel cannot give decodes the `tl` invariant pass's bits
    ([] = it can): `SWITCHES.invariant_gluon_decode` off, fused multiply-adds in the `tl`
    pass, the Gluon pass's device and dtype limits (`attention_gluon.why_not`), a 16-bit q
    over a cache of its dtype or over e4m3 (the e5m2 cache is not built), products of 16
    bits (`launch.dot_dtype`), one of head_sizes (64 / 128: the `tl` pass's; 256 for a
    layer on the Gluon kernels alone) for K and V alike, no ALiBi (its slopes do not reach
    the decode launch), and `tl_tiles`: why the `tl` pass's tiles are not the kernel's
    (`invariant_plan.tl_tiles_refusal`)."""
    reasons = invariant_config.invariant_switch_refusal("invariant_gluon_decode")
    if gluon_decode_invariant is None:
        reasons.append("the invariant decode kernel does not import (no Gluon)")
    reasons += attention_gluon.why_not(
        device=device, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
        head_size_v=head_size_v, q_dtype=q_dtype, kv_dtype=kv_dtype, out_dtype=out_dtype,
        paged=paged, page_size=page_size, use_q_descale=use_q_descale,
        use_kv_descale=use_kv_descale)
    if not paged:
        reasons.append("dense varlen keys: the kernel reads a paged cache")
    if q_dtype not in _16BIT:
        reasons.append(f"q {q_dtype}: the kernel is served a 16-bit q, as the prompts' "
                       "consumer (an fp8 q compiles but has not been checked on the GPU)")
    elif kv_dtype not in (q_dtype, torch.float8_e4m3fn):
        reasons.append(f"kv {kv_dtype} under a {q_dtype} q: needs a cache of q's dtype or e4m3")
    else:
        dot = products_dtype(q_dtype, kv_dtype, out_dtype, device)
        if dot is None or (kv_dtype in _16BIT and dot != kv_dtype):
            reasons.append(f"the `tl` pass's products in "
                           f"{launch.dot_dtype(q_dtype, kv_dtype, out_dtype, device)}: the "
                           "kernel multiplies in fp16 or bf16, a 16-bit cache in its own")
    if head_size != head_size_v or head_size not in head_sizes:
        reasons.append(f"head sizes {head_size}/{head_size_v}: needs one of {head_sizes} "
                       "for both")
    if use_alibi:
        reasons.append("ALiBi: the `tl` pass keeps it (the decode launch takes no slopes)")
    return reasons + tl_tiles


def decode_constexprs(*, num_heads: int, num_kv_heads: int, head_size: int, page_size: int,
                      decode_queries: int, kv_fp8: bool, q_fp8: bool, dot_f16: bool,
                      causal: bool, window_left: int, window_right: int, softcap: float,
                      split: bool, split_keys: int, block_n: int = 64,
                      scale_in_exp: bool = False, fold_mem: bool = False,
                      fold_by_program: bool = False, self_fold: bool = False,
                      max_slack: int = -1) -> dict:
    """The kernel's constexprs (host ints alone; LSE and sinks are fixed per run, as the
    Gluon decode launch compiles them); block_n: the `tl` pass's key tiles (64 or 128);
    scale_in_exp: its score scale in the exponent
    (`invariant_config.invariant_scale_in_exp`); fold_mem: an unsplit program's fold state
    in the launch's `fold` (FOLD_MEM); fold_by_program: that state's rows the programs'
    (`fold_shape`); self_fold: split programs that fold their own splits (SELF_FOLD,
    `SWITCHES.invariant_self_fold`); max_slack: MAX_SLACK, as the prompts' consumer takes it
    (`invariant_config.invariant_gluon_slack`: the running max's slack, 0 O's rescale
    skipped where no row of a warp moved its max, -1 O rescaled every tile)."""
    if block_n not in BLOCK_NS:
        raise ValueError(f"block_n={block_n}: the kernel is built for key tiles of {BLOCK_NS}")
    if isinstance(max_slack, bool) or not isinstance(max_slack, int) or not -1 <= max_slack <= 8:
        raise ValueError(f"max_slack={max_slack!r}: -1 (O rescaled every tile), 0 (skipped "
                         "where no row moved its max) or a slack of 1-8")
    group = num_heads // num_kv_heads
    num_buf, stages, worker_regs = gluon_decode_invariant.TILES[(head_size, kv_fp8, block_n)]
    return dict(
        NUM_KV=num_kv_heads, GROUP=group, GROUP_PAD=pow2_at_least(group),
        QUERIES=decode_queries, HEAD_D=head_size, HEAD_DV=head_size, PAGE=page_size,
        BLOCK_N=block_n, NUM_BUF=num_buf, STAGES=stages, WINDOW_LEFT=window_left >= 0,
        WINDOW_RIGHT=causal or window_right >= 0, USE_SOFTCAP=softcap > 0, USE_SINKS=False,
        WRITE_LSE=False, SPLIT_KV=split, KV_FP8=kv_fp8, KV_DESCALE=kv_fp8, Q_DESCALE=q_fp8,
        DOT_F16=dot_f16, SPLIT_KEYS=split_keys, WORKER_REGS=worker_regs,
        SCALE_IN_EXP=scale_in_exp, FOLD_MEM=fold_mem, FOLD_BY_PROGRAM=fold_by_program,
        SELF_FOLD=self_fold, MAX_SLACK=max_slack)


class InvariantDecodeLaunch(GluonDecodeLaunch):
    """One batch's launch of the invariant decode kernel: grid (batch, KV heads, splits),
    partials where splits > 1 (`invariant.fold_splits_kernel` folds them), compiled per
    (LSE given, sinks given) without fused multiply-adds. fold: the fold state
    (`fold_shape`) float32 of an unsplit launch at heads above 128 or with FOLD_MEM
    (`gluon_decode_invariant.py`), else None; made by the plan, once a step. self_fold:
    the (PartOut, PartLse, Tickets) of split programs that fold their own splits (the
    launch then writes the outputs as an unsplit one: `invariant_plan.self_fold_scratch`),
    else None."""

    fold: Optional[torch.Tensor] = None
    self_fold: Optional[tuple] = None

    def kernel(self):
        """The invariant decode kernel (the launches are the base class's)."""
        return gluon_decode_invariant.gluon_decode_invariant_kernel

    def form_args(self) -> tuple:
        """The kernel's arguments after the descale strides: the fold state, or None, and
        the self-folding split programs' partials and tickets, or three None."""
        return (self.fold, *(self.self_fold or (None, None, None)))


def make_invariant_decode(*, cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor,
                          block_table: torch.Tensor, batch: int, total_q: int, num_heads: int,
                          num_kv_heads: int, head_size: int, page_size: int,
                          q_dtype: torch.dtype, kv_dtype: torch.dtype, out_dtype: torch.dtype,
                          softmax_scale: float, causal: bool, window_left: int,
                          window_right: int, softcap: float, decode_queries: int,
                          split_keys: int, splits: int,
                          partials: Optional[tuple] = None, block_n: int = 64,
                          self_fold: Optional[tuple] = None) -> InvariantDecodeLaunch:
    """The launch over a batch's decodes (requests of 1..decode_queries queries; the
    refusal has said it serves) in key tiles of block_n (the `tl` pass's): splits > 1
    programs a request and KV head, each writing its split's state into partials (PartOut,
    PartLse); else one, folding its splits (in float32 memory at heads above 128, and at
    128-key tiles under `SWITCHES.invariant_tiles_128`: `fold_in_memory`). self_fold
    (splits > 1, heads of HEAD_SIZES; partials None): (PartOut, PartLse, Tickets [batch,
    num_kv_heads] int32 zeroed), the split programs' own scratch, the last of a request's
    folding them and writing the outputs (`gluon_decode_fold.py`)."""
    if self_fold is not None and (splits == 1 or partials is not None
                                  or head_size not in HEAD_SIZES):
        raise ValueError(f"self_fold needs split programs at a head size of {HEAD_SIZES} "
                         f"without a fold launch's partials (splits={splits}, head_size="
                         f"{head_size}, partials {'given' if partials else 'None'})")
    if decode_queries * pow2_at_least(num_heads // num_kv_heads) > ROWS:
        raise ValueError(f"decode_queries={decode_queries} x the padded GQA group exceed the "
                         f"kernel's {ROWS} rows")
    device = cu_seqlens_q.device
    dot = products_dtype(q_dtype, kv_dtype, out_dtype, device)
    # 128-key tiles' unsplit programs: the running fold beside O, S and P spilled
    fold_mem = splits == 1 and block_n == 128 and invariant_config.invariant_tiles_128(head_size)
    fold, by_program = None, False
    if (head_size in FOLD_HEAD_SIZES or fold_mem) and splits == 1:  # else through partials
        fold, by_program = fold_shape(batch=batch, total_q=total_q, num_heads=num_heads,
                                      num_kv_heads=num_kv_heads, head_size=head_size,
                                      decode_queries=decode_queries)
    decodes = InvariantDecodeLaunch(
        grid=(batch, num_kv_heads, splits), options={"enable_fp_fusion": False},
        constexprs=decode_constexprs(
            num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
            page_size=page_size, decode_queries=decode_queries,
            kv_fp8=kv_dtype == torch.float8_e4m3fn, q_fp8=q_dtype == torch.float8_e4m3fn,
            dot_f16=dot == torch.float16, causal=causal, window_left=window_left,
            window_right=window_right, softcap=softcap, split=splits > 1,
            split_keys=split_keys, block_n=block_n,
            scale_in_exp=invariant_config.invariant_scale_in_exp(softmax_scale, softcap, False),
            fold_mem=fold_mem, fold_by_program=by_program, self_fold=self_fold is not None,
            max_slack=invariant_config.invariant_gluon_slack()),
        floats=attention_gluon.score_floats(softmax_scale, softcap, tl_rounding=True),
        window=decode_window(causal, window_left, window_right), total_q=total_q,
        cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k, block_table=block_table,
        partials=partials if splits > 1 else None,
        # self-folding split programs write the outputs as one unsplit launch does
        num_splits=1 if self_fold is not None else None)
    decodes.self_fold = self_fold
    if fold is not None:
        decodes.fold = torch.empty(fold, dtype=torch.float32, device=device)
    return decodes


def fold_shape(*, batch: int, total_q: int, num_heads: int, num_kv_heads: int,
               head_size: int, decode_queries: int) -> tuple[tuple[int, ...], bool]:
    """(the shape of an unsplit launch's fold state, whether its rows are the programs'):
    the smaller of a row per (token, head), [total_q, H, Dv], and the rows a program holds,
    [batch, H_kv, decode_queries x the padded GQA group, Dv]. Host ints alone, so a plan
    serves every batch of its sizes; tokens win a step of single-query decodes (a program
    pads them to decode_queries), programs a step whose prompts bring most of its tokens."""
    rows = decode_queries * pow2_at_least(num_heads // num_kv_heads)
    if batch * num_kv_heads * rows < total_q * num_heads:
        return (batch, num_kv_heads, rows, head_size), True
    return (total_q, num_heads, head_size), False
