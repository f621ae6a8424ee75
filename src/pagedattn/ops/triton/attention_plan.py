"""The attention kernel's host side: plan a batch's launches once, run them per layer.

`plan_attention` turns the host ints of one batch (token and request counts, the longest
query and key range, head shapes, dtypes, features) into at most four fixed launches: the
decode pass, the prefill pass and their split-KV reduces, with grids, tiles, split counts and
the partial-state scratch decided and allocated here. `TritonAttentionPlan.run` only reads
the layer's tensors and launches (`fast_launch`), so every layer of a step reuses the plan.

With `cuda_graph=True` the plan serves any batch of at most `total_q` tokens and `batch`
requests, for a graph captured once and replayed with other lengths: both passes are
launched whatever the lengths, grids are sized for the bucket, each program finds its work on
the device (programs without work exit), and split counts are fixed from `max_seqlen_k`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from pagedattn.ops.triton import launch
from pagedattn.ops.triton.attention import LOG2E, _attention_kernel
from pagedattn.ops.triton.attention_hopper import _prefill_kernel
from pagedattn.ops.triton.fast_launch import KernelLaunch, aligned, int_key, tensor_key
from pagedattn.ops.triton.launch import (
    AttnConfig,
    decode_config,
    hopper_prefill_config,
    prefill_config,
)
from pagedattn.ops.triton.reduce import _reduce_splits_kernel


@dataclass
class TritonAttentionPlan:
    """Launches of one batch; `run` takes a layer's q, caches, output and per-layer tensors."""

    total_q: int
    num_heads: int
    head_size_v: int
    write_lse: bool
    launches: tuple  # (KernelLaunch, kind: "attention" | "reduce" | "hopper") in order
    plan_args: tuple  # the runtime arguments that depend only on the batch, by name
    ones: Optional[torch.Tensor]  # the descale of a missing k or v descale
    # The Hopper prefill pass's boxes: (block_q, packed group, block_n, head_size, head_size_v).
    hopper_boxes: Optional[tuple] = None

    def _descriptors(self, q, k, v) -> tuple:
        block_q, group, block_n, head_size, head_size_v = self.hopper_boxes
        k2, v2 = _rows(k), _rows(v)
        if group > 1:  # packed GQA: boxes of [tokens, the KV head's query heads, head_size]
            q3 = _tma_ready(q)
            desc_q = TensorDescriptor(q3, list(q3.shape), list(q3.stride()),
                                      [block_q, group, head_size])
        else:
            q2 = _rows(q)
            desc_q = TensorDescriptor(q2, list(q2.shape), list(q2.stride()), [block_q, head_size])
        return (desc_q,
                TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [block_n, head_size]),
                TensorDescriptor(v2, list(v2.shape), list(v2.stride()), [block_n, head_size_v]))

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
            softmax_lse: Optional[torch.Tensor] = None,
            alibi_slopes: Optional[torch.Tensor] = None, sinks: Optional[torch.Tensor] = None,
            q_descale: Optional[torch.Tensor] = None, k_descale: Optional[torch.Tensor] = None,
            v_descale: Optional[torch.Tensor] = None, k_new: Optional[torch.Tensor] = None,
            v_new: Optional[torch.Tensor] = None) -> None:
        """k_new / v_new [total_q, num_kv_heads, head_size(_v)]: the new tokens' keys and
        values (already written to the cache), read as dense rows by the Hopper prefill pass
        of a paged plan made with `dense_new_kv`; other plans ignore them."""
        if not self.launches:
            return
        if q.stride(-1) != 1:
            q = q.contiguous()
        if k_descale is not None or v_descale is not None:
            k_descale = self.ones if k_descale is None else k_descale
            v_descale = self.ones if v_descale is None else v_descale
            if k_descale.stride() != v_descale.stride():
                k_descale, v_descale = k_descale.contiguous(), v_descale.contiguous()
        if alibi_slopes is not None and alibi_slopes.dtype != torch.float32:
            alibi_slopes = alibi_slopes.float()
        if sinks is not None and sinks.dtype != torch.float32:
            sinks = sinks.float()
        cu_q = self.plan_args[2]
        lse = softmax_lse if self.write_lse else cu_q
        qd_s = _descale_strides(q_descale)
        kd_s = _descale_strides(k_descale)
        tensors = (q, k, v, out, lse, alibi_slopes if alibi_slopes is not None else cu_q,
                   sinks if sinks is not None else cu_q,
                   q_descale if q_descale is not None else cu_q,
                   k_descale if k_descale is not None else cu_q,
                   v_descale if v_descale is not None else cu_q)
        qs, ks, vs, os_ = q.stride(), k.stride(), v.stride(), out.stride()
        if ks[-1] != 1 or vs[-1] != 1 or os_[-1] != 1:
            raise ValueError("Triton attention needs unit stride on the head_size dimension of "
                             f"k {ks}, v {vs} and out {os_}")
        call_key = None
        if aligned(*tensors):
            call_key = (q.dtype, k.dtype, v.dtype, out.dtype, qs, ks, vs, os_, qd_s, kd_s,
                        None if alibi_slopes is None else 1, None if sinks is None else 1,
                        None if q_descale is None else q_descale.dtype,
                        None if k_descale is None else (k_descale.dtype, v_descale.dtype))
        part_out, part_lse, cu_q, seqused, cu_k, table, floats, ints, stride_bt = self.plan_args
        paged = table is not cu_q
        attn_args = (
            q, k, v, out, lse, part_out, part_lse, cu_q, seqused, cu_k, table, *tensors[5:],
            *floats, *ints, qs[0], qs[1], ks[0], ks[1] if paged else 0, ks[-2], vs[0],
            vs[1] if paged else 0, vs[-2], os_[0], os_[1], stride_bt, *qd_s, *kd_s)
        reduce_args = None
        for kernel_launch, kind in self.launches:
            if kind == "attention":
                kernel_launch(attn_args, call_key)
            elif kind == "hopper":
                dense_k, dense_v = (k_new, v_new) if paged else (k, v)
                if dense_k is None or dense_v is None:
                    raise ValueError("this plan's prefill pass reads the new tokens' keys and "
                                     "values as dense rows: pass k_new and v_new to run()")
                hopper_args = (*self._descriptors(q, dense_k, dense_v), out, lse, k, v,
                               cu_q, seqused, cu_k, table, *tensors[5:7], *floats, *ints,
                               os_[0], os_[1], ks[0], ks[1] if paged else 0, ks[-2], vs[0],
                               vs[1] if paged else 0, vs[-2], stride_bt)
                kernel_launch(hopper_args, None if call_key is None else
                              call_key + (dense_k.dtype,))
            else:
                if reduce_args is None:
                    reduce_args = (out, lse, part_out, part_lse, cu_q, ints[2], ints[3],
                                   ints[4], os_[0], os_[1])
                kernel_launch(reduce_args, None if call_key is None else
                              (out.dtype, os_, self.write_lse))


def _tma_ready(x: torch.Tensor) -> torch.Tensor:
    """x [rows, heads, d] with the layout a descriptor needs (TMA: heads packed, unit stride,
    16-byte aligned rows and base); a layout that does not fit is copied once."""
    if x.stride(2) != 1 or x.stride(1) != x.shape[2] or \
            (x.stride(0) * x.element_size()) % 16 or x.data_ptr() % 16:
        x = x.contiguous()
    return x


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [rows, heads, d] as the 2-D [rows, heads * d] a descriptor walks."""
    x = _tma_ready(x)
    return x.as_strided((x.shape[0], x.shape[1] * x.shape[2]), (x.stride(0), 1))


def _descale_strides(d: Optional[torch.Tensor]) -> tuple[int, int]:
    """Per (sequence, KV head) descales; a 0-d or one-element tensor broadcasts (strides 0)."""
    if d is None or d.dim() == 0 or d.numel() == 1:
        return (0, 0)
    return (d.stride(0), d.stride(1))


def plan_attention(*, device: torch.device, cu_seqlens_q: torch.Tensor,
                   seqused_k: torch.Tensor, cu_seqlens_k: Optional[torch.Tensor],
                   block_table: Optional[torch.Tensor], batch: int, total_q: int,
                   max_seqlen_q: int, max_seqlen_k: int, num_heads: int, num_kv_heads: int,
                   head_size: int, head_size_v: int, page_size: int, q_dtype: torch.dtype,
                   kv_dtype: torch.dtype, out_dtype: torch.dtype, softmax_scale: float,
                   causal: bool, window_left: int, window_right: int, softcap: float,
                   use_alibi: bool, use_sinks: bool, use_q_descale: bool,
                   use_kv_descale: bool, write_lse: bool, num_splits: int = 0,
                   cuda_graph: bool = False, config: Optional[AttnConfig] = None,
                   dense_new_kv: bool = False) -> TritonAttentionPlan:
    """Decide and allocate everything of one batch's attention launches (see module doc).
    dense_new_kv: run() will pass the new tokens' keys/values (k_new, v_new) of a paged
    batch, so the Hopper prefill pass can read them as dense rows."""
    ones = torch.ones((), dtype=torch.float32, device=device) if use_kv_descale else None
    plan = TritonAttentionPlan(total_q, num_heads, head_size_v, write_lse, (), (), ones)
    if batch == 0 or total_q == 0 or max_seqlen_q == 0:
        return plan
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    paged = block_table is not None
    kv_bytes = kv_dtype.itemsize
    dec = decode_config(device=device, batch=batch, max_seqlen_k=max_seqlen_k,
                        num_kv_heads=num_kv_heads, group_pad=group_pad, head_size=head_size,
                        num_splits=num_splits, override=config, kv_bytes=kv_bytes)
    pre = None
    if max_seqlen_q > max(1, dec.block_m // group_pad):  # some request needs the prefill pass
        pre = prefill_config(max_seqlen_q=max_seqlen_q, head_size=head_size,
                             group_pad=group_pad, override=config)
        if config is not None:  # an override sets the prefill tiles; decodes keep their own
            dec = decode_config(device=device, batch=batch, max_seqlen_k=max_seqlen_k,
                                num_kv_heads=num_kv_heads, group_pad=group_pad,
                                head_size=head_size, num_splits=num_splits, kv_bytes=kv_bytes)
    decode_max_q = max(1, dec.block_m // group_pad)
    # The shortest request has >= total_q - (batch - 1) * max_seqlen_q queries (ints known here);
    # a graph replays batches of any lengths, so it always launches the decode pass.
    has_short = cuda_graph or total_q - (batch - 1) * max_seqlen_q <= decode_max_q
    splits = dec.num_splits if has_short else 1
    pre_splits, block_q = 1, 1
    if pre is not None:
        block_q = max(1, pre.block_m // group_pad)
        # At most total_q // block_q blocks plus one partial block per long request.
        q_blocks = total_q // block_q + min(batch, total_q // (decode_max_q + 1))
        pre_splits = launch.prefill_splits(device=device, q_blocks=q_blocks,
                                           block_m=block_q * group_pad, max_seqlen_k=max_seqlen_k,
                                           num_kv_heads=num_kv_heads, num_splits=num_splits)
    hopper = None
    if pre is not None and config is None:
        hopper = hopper_prefill_config(
            device=device, q_dtype=q_dtype, kv_dtype=kv_dtype, head_size=head_size,
            head_size_v=head_size_v, dense_keys=not paged or dense_new_kv,
            features_ok=not (use_q_descale or use_kv_descale))
        # Per-head programs: a pass the portable kernel would split may still fill the GPU.
        if hopper is not None and pre_splits > 1 and num_splits == 0 and \
                num_heads * (total_q // hopper.block_m) < launch.sm_count(device):
            hopper = None
        # Chunks over a long cached context and nothing else: the keys are mostly gathered
        # pages, which the portable pass's GQA-packed 256-row tiles stream faster (H100:
        # 2048 after 30720 cached, 372 vs 330 TFLOP/s; docs/KERNEL_NOTES.md v5).
        if hopper is not None and paged and not has_short and \
                max_seqlen_k >= launch.CONTEXT_HEAVY * max_seqlen_q:
            hopper = None
        if hopper is not None:
            pre_splits = 1
    dot = launch.dot_dtype(q_dtype, kv_dtype, out_dtype, device)
    n = max(splits, pre_splits)
    if n > 1:  # [splits, total_q, num_heads, head_size_v]; the passes own disjoint tokens
        part_out = torch.empty((n, total_q, num_heads, head_size_v), dtype=torch.float32,
                               device=device)
        part_lse = torch.empty((n, total_q, num_heads), dtype=torch.float32, device=device)
    else:
        part_out = part_lse = cu_seqlens_q  # unused placeholders
    log2e_or_cap = 1.0 / softcap if softcap > 0 else LOG2E
    floats = (softmax_scale * log2e_or_cap, softcap * LOG2E)
    ints = (window_left, window_right, batch, total_q, decode_max_q)
    stride_bt = block_table.stride(0) if paged else 0
    plan.plan_args = (part_out, part_lse, cu_seqlens_q, seqused_k,
                      cu_seqlens_k if cu_seqlens_k is not None else cu_seqlens_q,
                      block_table if paged else cu_seqlens_q, floats, ints, stride_bt)
    features = dict(
        NUM_HEADS=num_heads, GROUP=group, GROUP_PAD=group_pad, PAGE=page_size if paged else 1,
        HEAD_D=head_size, HEAD_DV=head_size_v, BLOCK_D=max(16, triton.next_power_of_2(head_size)),
        BLOCK_DV=max(16, triton.next_power_of_2(head_size_v)), IS_CAUSAL=causal,
        USE_ALIBI=use_alibi, USE_SOFTCAP=softcap > 0, USE_SINKS=use_sinks, IS_PAGED=paged,
        Q_DESCALE=use_q_descale, KV_DESCALE=use_kv_descale, WRITE_LSE=write_lse,
        DOT_DTYPE=dot, DOT_PRECISION="ieee" if dot == tl.float32 else "tf32",
        FP8_V_IN_REGS=launch.fp8_v_in_regs(kv_dtype, dot, device),
        LONGEST_FIRST=launch.SWITCHES.longest_first)
    plan_tensors = plan.plan_args[:6]
    if not aligned(*plan_tensors):
        plan_key = None
    else:
        plan_key = (tensor_key(plan_tensors), int_key(ints + (stride_bt,)), str(device))
    launches = []

    def add(fn, grid, constexprs, warps, stages, kind):
        launches.append((_Launch(fn, grid, constexprs, warps, stages, plan_key), kind))

    reduce = dict(NUM_HEADS=num_heads, HEAD_DV=head_size_v,
                  BLOCK_DV=triton.next_power_of_2(head_size_v), WRITE_LSE=write_lse)
    if has_short:
        add(_attention_kernel, (batch, num_kv_heads, splits),
            dict(features, BLOCK_M=decode_max_q * group_pad, BLOCK_N=dec.block_n,
                 DECODE_PASS=True, SPLIT_KV=splits > 1, ONE_KEY_LOOP=True),
            dec.num_warps, dec.num_stages, "attention")
        if splits > 1:
            add(_reduce_splits_kernel, (batch, num_heads),
                dict(reduce, NUM_SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits),
                     DECODE_PASS=True), 4, 1, "reduce")
    if hopper is not None:
        pack = launch.pack_gqa(group, max(head_size, head_size_v), hopper)
        rows_per_token = group if pack else 1
        block_q = hopper.block_m // rows_per_token
        plan.hopper_boxes = (block_q, rows_per_token, hopper.block_n, head_size, head_size_v)
        add(_prefill_kernel, (num_kv_heads if pack else num_heads, total_q // block_q + batch),
            dict(GROUP=group, HEAD_D=head_size, HEAD_DV=head_size_v,
                 PAGE=page_size if paged else 1, BLOCK_M=hopper.block_m, BLOCK_N=hopper.block_n,
                 IS_CAUSAL=causal, USE_ALIBI=use_alibi, USE_SOFTCAP=softcap > 0,
                 USE_SINKS=use_sinks, PAGED_CONTEXT=paged, WRITE_LSE=write_lse,
                 DOT_PRECISION="tf32", LONGEST_FIRST=launch.SWITCHES.longest_first,
                 PACK_GQA=pack),
            hopper.num_warps, hopper.num_stages, "hopper")
    elif pre is not None:
        add(_attention_kernel, (total_q // block_q + batch, num_kv_heads, pre_splits),
            dict(features, BLOCK_M=block_q * group_pad, BLOCK_N=pre.block_n, DECODE_PASS=False,
                 SPLIT_KV=pre_splits > 1, ONE_KEY_LOOP=pre.one_key_loop),
            pre.num_warps, pre.num_stages, "attention")
        if pre_splits > 1:
            add(_reduce_splits_kernel, (total_q, num_heads),
                dict(reduce, NUM_SPLITS=pre_splits,
                     SPLITS_PAD=triton.next_power_of_2(pre_splits), DECODE_PASS=False),
                4, 1, "reduce")
    plan.launches = tuple(launches)
    return plan


class _Launch(KernelLaunch):
    """A KernelLaunch whose plan-side tensors may be unaligned (then: Triton's own launch)."""

    def __init__(self, fn, grid, constexprs, num_warps, num_stages, plan_key):
        super().__init__(fn, grid, constexprs, num_warps, num_stages, plan_key)
        self.unkeyed = plan_key is None

    def __call__(self, args: tuple, call_key: Optional[tuple]) -> None:
        super().__call__(args, None if self.unkeyed else call_key)


def varlen_attention(q, k, v, out, *, cu_seqlens_q, seqused_k, cu_seqlens_k, block_table,
                     max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
                     window_right, softcap, alibi_slopes, sinks, q_descale, k_descale,
                     v_descale, softmax_lse, num_splits=0,
                     config: Optional[AttnConfig] = None) -> None:
    """Same contract as `pagedattn.ops.torch.varlen_attention`; `config` overrides the tiles.

    Plans the batch (`attention_plan.plan_attention`) and runs the plan once. num_splits: 0
    chooses each pass's split-KV count (`launch.decode_config`, `launch.prefill_splits`:
    split only where the pass's programs cannot fill the SMs); n > 0 forces n splits in both
    the decode and the prefill pass. The result does not depend on it.
    """
    paged = block_table is not None
    plan = plan_attention(
        device=q.device, cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k,
        cu_seqlens_k=cu_seqlens_k, block_table=block_table, batch=seqused_k.shape[0],
        total_q=q.shape[0], max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        num_heads=q.shape[1], num_kv_heads=k.shape[-2], head_size=q.shape[2],
        head_size_v=v.shape[-1], page_size=k.shape[1] if paged else 1, q_dtype=q.dtype,
        kv_dtype=k.dtype, out_dtype=out.dtype, softmax_scale=softmax_scale, causal=causal,
        window_left=window_left, window_right=window_right, softcap=softcap,
        use_alibi=alibi_slopes is not None, use_sinks=sinks is not None,
        use_q_descale=q_descale is not None,
        use_kv_descale=k_descale is not None or v_descale is not None,
        write_lse=softmax_lse is not None, num_splits=num_splits, config=config)
    plan.run(q, k, v, out, softmax_lse, alibi_slopes, sinks, q_descale, k_descale, v_descale)

