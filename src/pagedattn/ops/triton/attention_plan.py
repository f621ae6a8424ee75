"""The attention kernels' host side: plan a batch's launches once, run them per layer.

`plan_attention` turns the host ints of one batch (token and request counts, the longest
query and key range, head shapes, dtypes, features) into at most four fixed launches: the
decode pass, a prefill pass (portable, or Hopper's) and the split-KV reduces, with grids,
tiles, split counts and the partial-state scratch decided and allocated here, and the
batch's kernel arguments filled by name (`attention_args`). `TritonAttentionPlan.run` fills
only the layer's tensors and their strides and launches (`fast_launch`), so every layer of a
step reuses the plan.

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
from triton.tools.tensor_descriptor import TensorDescriptor

from pagedattn.ops.triton import launch
from pagedattn.ops.triton.attention import attention_kernel
from pagedattn.ops.triton.attention_args import (
    HopperLayerArgs,
    LayerArgs,
    Outputs,
    ReduceBatch,
    batch_section,
)
from pagedattn.ops.triton.attention_gluon import FP8, GluonPrefillLaunch, plan_gluon_prefill
from pagedattn.ops.triton.attention_hopper import hopper_prefill_kernel
from pagedattn.ops.triton.fast_launch import aligned
from pagedattn.ops.triton.gluon_decode_launch import (
    GluonDecodeLaunch,
    persistent_decode_splits,
    plan_gluon_decode,
    takes_decodes,
)
from pagedattn.ops.triton.invariant_plan import (
    invariant_gluon_max_q,
    plan_invariant_decode,
    plan_invariant_gluon,
    plan_invariant_launches,
)
from pagedattn.ops.triton.launch import (
    AttnConfig,
    decode_config,
    hopper_prefill_config,
    prefill_config,
)
from pagedattn.ops.triton.layer_plan import GluonLayerPlans, LayerAttention
from pagedattn.ops.triton.pass_launch import PassLaunch
from pagedattn.ops.triton.reduce import reduce_splits_kernel
from pagedattn.ops.triton.tile_math import decode_query_count, pow2_at_least
from pagedattn.ops.triton.tma_views import tma_ready

_F32 = torch.float32


@dataclass
class TritonAttentionPlan:
    """Launches of one batch; `run` takes a layer's q, caches, output and per-layer tensors."""

    total_q: int
    num_heads: int
    head_size: int
    head_size_v: int
    write_lse: bool  # run() writes the LSE it is given (else never)
    paged: bool
    descale_shape: tuple  # (num_seqs, num_kv_heads)
    dtypes: tuple  # (q, kv, out): a call with others goes through Triton's own launch
    launches: tuple = ()  # PassLaunch, in order
    ones: Optional[torch.Tensor] = None  # the descale of a missing k or v descale
    # The Gluon prefill pass, where it serves this batch's long requests (else a PassLaunch);
    # with gluon_new_rows its keys are run()'s k_new / v_new alone (prompts, no context)
    gluon: Optional[GluonPrefillLaunch] = None
    gluon_new_rows: bool = False
    # Planned with sinks or an LSE left to each run(): the Gluon launch of each choice,
    # by (LSE given, sinks given); the Gluon kernel fixes both when it compiles.
    gluon_choices: Optional[dict] = None
    # Whether run() also takes the layer's 2-D rows (q [T, H * D], out [T, H * Dv], dense
    # k / v [keys, H_kv * D(v)]): the portable passes read them through strides, the Gluon
    # pass through the row strides its descriptors are built from; the Hopper `tl` pass
    # builds host descriptors of [T, H, D] tensors and takes those only.
    takes_rows: bool = True
    # The Gluon decode pass, where `SWITCHES.gluon_decode` puts it in place of the `tl`
    # decode pass (launched before `launches`, whose reduce then merges its splits)
    gluon_decode: Optional[GluonDecodeLaunch] = None

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
            softmax_lse: Optional[torch.Tensor] = None,
            alibi_slopes: Optional[torch.Tensor] = None, sinks: Optional[torch.Tensor] = None,
            q_descale: Optional[torch.Tensor] = None, k_descale: Optional[torch.Tensor] = None,
            v_descale: Optional[torch.Tensor] = None, k_new: Optional[torch.Tensor] = None,
            v_new: Optional[torch.Tensor] = None) -> None:
        """k_new / v_new [total_q, num_kv_heads, head_size(_v)]: the new tokens' keys and
        values (already written to the cache), read as dense rows by the Hopper prefill pass
        of a paged plan made with `dense_new_kv`; other plans ignore them. With `takes_rows`,
        q, out and dense k / v may be 2-D rows instead (each tensor either way)."""
        if not self.launches and self.gluon is None and self.gluon_decode is None:
            return
        qs = q.stride()
        if qs[-1] != 1 or (len(qs) == 3 and qs[1] != self.head_size):
            q = q.contiguous()  # the kernels take the heads packed (a unit-stride row is)
            qs = q.stride()
        target = out
        if not out.is_contiguous():  # the kernels write rows with their heads packed
            target = out.contiguous()  # (a copy: rows the plan does not write keep their values)
        lse = softmax_lse if self.write_lse else None
        if alibi_slopes is not None and alibi_slopes.dtype != torch.float32:
            alibi_slopes = alibi_slopes.float()
        if sinks is not None and sinks.dtype != torch.float32:
            sinks = sinks.float()
        descale_head = 0
        if q_descale is not None or k_descale is not None or v_descale is not None:
            q_descale, k_descale, v_descale, descale_head = self._descales(
                q_descale, k_descale, v_descale)
        gluon = self.gluon
        if self.gluon_choices is not None:
            gluon = self.gluon_choices[(lse is not None, sinks is not None)]
        if self.gluon_new_rows:  # prompts alone: the new rows are every key
            if k_new is None or v_new is None:
                raise ValueError("this plan reads the new tokens' keys and values as its "
                                 "only keys: pass k_new and v_new to run()")
            gluon.run(q, k_new, v_new, target, lse, alibi_slopes, sinks)
        elif gluon is not None:  # its own launcher; the tokens are disjoint from decode's
            gluon.run(q, k, v, target, lse, alibi_slopes, sinks, k_new, v_new, k_descale,
                      v_descale, q_descale)
        if self.gluon_decode is not None:  # before the launches: their reduce merges its splits
            self.gluon_decode.run(q, k, v, target, lse, sinks, q_descale, k_descale, v_descale,
                                  descale_head)
        ks, vs = k.stride(), v.stride()
        if ks[-1] != 1 or vs[-1] != 1:
            raise ValueError("Triton attention needs unit stride on the head_size dimension of "
                             f"k {ks} and v {vs}")
        if not self.paged:  # dense keys [keys, num_kv_heads, d] or rows: no slot stride
            ks = (ks[0], 0, ks[1] if len(ks) == 3 else self.head_size)
            vs = (vs[0], 0, vs[1] if len(vs) == 3 else self.head_size_v)
        # The call key: what the kernels specialise on beyond the plan (strides, which
        # optional tensors are given, 16-byte alignment). Dtypes are the plan's, checked by
        # identity (the launches' static keys hold them); any other dtype or an unaligned
        # tensor gets Triton's own launch, which specialises on it.
        q_dtype, kv_dtype, out_dtype = self.dtypes
        exact = q.dtype is q_dtype and k.dtype is kv_dtype and v.dtype is kv_dtype and \
            target.dtype is out_dtype
        ptrs = q.data_ptr() | k.data_ptr() | v.data_ptr() | target.data_ptr()
        if lse is not None:
            ptrs |= lse.data_ptr()
            exact = exact and lse.dtype is _F32
        if alibi_slopes is not None:  # float32 here
            ptrs |= alibi_slopes.data_ptr()
        if sinks is not None:
            ptrs |= sinks.data_ptr()
        if q_descale is not None:
            ptrs |= q_descale.data_ptr()
            exact = exact and q_descale.dtype is _F32
        if k_descale is not None:  # with v_descale (_descales gives both or neither)
            ptrs |= k_descale.data_ptr() | v_descale.data_ptr()
            exact = exact and k_descale.dtype is _F32 and v_descale.dtype is _F32
        call_key = None
        if exact and ptrs % 16 == 0:
            call_key = (qs[0], ks, vs, descale_head, lse is None, alibi_slopes is None,
                        sinks is None, q_descale is None, k_descale is None)
        args = None
        for pass_launch in self.launches:
            if pass_launch.name == "hopper":
                inputs = self._hopper_args(pass_launch.boxes, target, lse, q, k, v, k_new, v_new,
                                           alibi_slopes, sinks, ks, vs)
                pass_launch(inputs + pass_launch.batch, None if call_key is None
                            else call_key + (inputs.desc_k.base.dtype,))
                continue
            if args is None:
                args = LayerArgs(
                    Out=target, Lse=lse, Q=q, K=k, V=v, alibi_slopes=alibi_slopes, sinks=sinks,
                    q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                    stride_qt=qs[0], stride_kb=ks[0], stride_ks=ks[1], stride_kh=ks[2],
                    stride_vb=vs[0], stride_vs=vs[1], stride_vh=vs[2],
                    stride_descale_head=descale_head)
            if pass_launch.name == "reduce":  # the layer's outputs, then the plan's partials
                pass_launch(args[:2] + pass_launch.batch, call_key)
            elif pass_launch.partials is None:
                pass_launch(args + pass_launch.batch, call_key)
            else:  # a split pass writes the plan's partial states, not the layer's outputs
                pass_launch(pass_launch.partials + args[2:] + pass_launch.batch, call_key)
        if target is not out:
            out.copy_(target)

    def plan_layer(self, k: torch.Tensor, v: torch.Tensor,
                   alibi_slopes: Optional[torch.Tensor] = None,
                   sinks: Optional[torch.Tensor] = None, q_descale: Optional[torch.Tensor] = None,
                   k_descale: Optional[torch.Tensor] = None,
                   v_descale: Optional[torch.Tensor] = None) -> Optional[LayerAttention]:
        """This plan for one layer's caches k / v and per-layer tensors (`run`'s, as they
        are: float32, aligned, one-value descales), read once (`layer_plan`); None where
        `run` must take every call: dense keys (but for the Gluon pass's prompts), the
        Hopper `tl` pass (it builds host descriptors of each call's tensors), an LSE,
        tensors that `run` would convert or that Triton's own launch would specialise on.
        A prefill plan is a step's own, but steps of one size share their plans, so a layer
        runs them again. The Gluon decode pass is planned so too
        (`GluonDecodeLaunch.plan_layer`), after the Gluon prefill pass where both serve."""
        if not (self.paged or self.gluon_new_rows) or not self.takes_rows or \
                self.write_lse or any(launch.name == "hopper" for launch in self.launches):
            return None
        descale_head = 0
        if q_descale is not None or k_descale is not None or v_descale is not None:
            q_descale, k_descale, v_descale, descale_head = self._descales(
                q_descale, k_descale, v_descale)
        ks, vs = k.stride(), v.stride()
        extras = (alibi_slopes, sinks, q_descale, k_descale, v_descale)
        if descale_head or ks[-1] != 1 or vs[-1] != 1 or k.dtype is not self.dtypes[1] or \
                v.dtype is not self.dtypes[1] or not aligned(k, v, *extras) or \
                any(x is not None and x.dtype is not _F32 for x in extras):
            return None
        gluon = []  # the Gluon passes' layer plans, in run()'s order, before the launches
        if self.gluon is not None:
            cache = (None, None) if self.gluon_new_rows else (k, v)
            gluon.append(self.gluon.plan_layer(*cache, alibi_slopes, sinks, k_descale,
                                               v_descale, *self.dtypes, q_descale=q_descale))
        if self.gluon_decode is not None:
            gluon.append(self.gluon_decode.plan_layer(
                k, v, sinks, q_descale, k_descale, v_descale, q_dtype=self.dtypes[0],
                out_dtype=self.dtypes[2]))
        if None in gluon:
            return None
        args = None
        if self.launches:
            args = LayerArgs(
                Out=None, Lse=None, Q=None, K=k, V=v, alibi_slopes=alibi_slopes, sinks=sinks,
                q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, stride_qt=0,
                stride_kb=ks[0], stride_ks=ks[1], stride_kh=ks[2], stride_vb=vs[0],
                stride_vs=vs[1], stride_vh=vs[2], stride_descale_head=0)
        key_tail = (ks, vs, 0, True, alibi_slopes is None, sinks is None, q_descale is None,
                    k_descale is None)
        return LayerAttention(self.launches, args, key_tail, self.dtypes[0], self.dtypes[2],
                              gluon[0] if len(gluon) == 1 else
                              GluonLayerPlans(*gluon) if gluon else None)

    def _descales(self, q_descale, k_descale, v_descale) -> tuple:
        """The kernels index descales [num_seqs, num_kv_heads] with one head stride for all
        three: 0 when each is one value (a 0-d or one-element tensor, or every stride 0, as
        an expanded scale has), 1 when contiguous; any other mix is made contiguous here. A
        missing k or v descale of an fp8 cache is 1."""
        if (k_descale is None) != (v_descale is None):
            ones = self.ones  # planned for; else (a plan made without descales) made here
            if ones is None:
                other = v_descale if k_descale is None else k_descale
                ones = torch.ones((), dtype=torch.float32, device=other.device)
            k_descale = ones if k_descale is None else k_descale
            v_descale = ones if v_descale is None else v_descale
        given = [d for d in (q_descale, k_descale, v_descale) if d is not None]
        if all(d.numel() == 1 or not any(d.stride()) for d in given):
            return q_descale, k_descale, v_descale, 0
        shape = next((d.shape for d in given if d.dim() == 2), self.descale_shape)

        def contiguous(d):
            if d is None:
                return None
            return (d.reshape(1, 1) if d.numel() == 1 else d).expand(shape).contiguous()
        return contiguous(q_descale), contiguous(k_descale), contiguous(v_descale), 1

    def _hopper_args(self, boxes, out, lse, q, k, v, k_new, v_new, alibi_slopes, sinks, ks,
                     vs) -> HopperLayerArgs:
        dense_k, dense_v = (k_new, v_new) if self.paged else (k, v)
        if dense_k is None or dense_v is None:
            raise ValueError("this plan's prefill pass reads the new tokens' keys and values "
                             "as dense rows: pass k_new and v_new to run()")
        block_q, group, block_n = boxes
        head_size, head_size_v = q.shape[-1], dense_v.shape[-1]
        k2, v2 = _rows(dense_k), _rows(dense_v)
        if group > 1:  # packed GQA: boxes of [tokens, the KV head's query heads, head_size]
            q3 = tma_ready(q)
            desc_q = TensorDescriptor(q3, list(q3.shape), list(q3.stride()),
                                      [block_q, group, head_size])
        else:
            q2 = _rows(q)
            desc_q = TensorDescriptor(q2, list(q2.shape), list(q2.stride()), [block_q, head_size])
        return HopperLayerArgs(
            Out=out, Lse=lse, desc_q=desc_q,
            desc_k=TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [block_n, head_size]),
            desc_v=TensorDescriptor(v2, list(v2.shape), list(v2.stride()),
                                    [block_n, head_size_v]),
            K=k if self.paged else None, V=v if self.paged else None, alibi_slopes=alibi_slopes,
            sinks=sinks, stride_kb=ks[0], stride_ks=ks[1], stride_kh=ks[2], stride_vb=vs[0],
            stride_vs=vs[1], stride_vh=vs[2])


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [rows, heads, d] as the 2-D [rows, heads * d] a descriptor walks."""
    x = tma_ready(x)
    return x.as_strided((x.shape[0], x.shape[1] * x.shape[2]), (x.stride(0), 1))


def plan_attention(*, device: torch.device, cu_seqlens_q: torch.Tensor,
                   seqused_k: torch.Tensor, cu_seqlens_k: Optional[torch.Tensor],
                   block_table: Optional[torch.Tensor], batch: int, total_q: int,
                   max_seqlen_q: int, max_seqlen_k: int, num_heads: int, num_kv_heads: int,
                   head_size: int, head_size_v: int, page_size: int, q_dtype: torch.dtype,
                   kv_dtype: torch.dtype, out_dtype: torch.dtype, softmax_scale: float,
                   causal: bool, window_left: int, window_right: int, softcap: float,
                   use_alibi: bool, use_sinks: Optional[bool], use_q_descale: bool,
                   use_kv_descale: bool, write_lse: Optional[bool], num_splits: int = 0,
                   cuda_graph: bool = False, config: Optional[AttnConfig] = None,
                   dense_new_kv: bool = False, new_keys_only: bool = False,
                   batch_invariant: bool = False) -> TritonAttentionPlan:
    """Decide and allocate everything of one batch's attention launches (see module doc).
    dense_new_kv: run() will pass the new tokens' keys/values (k_new, v_new) of a paged
    batch, so the Hopper prefill pass can read them as dense rows. new_keys_only (with
    dense_new_kv, not for a graph): no request has a cached context, so the Gluon pass reads
    k_new / v_new as dense varlen keys (its paged variant measured ~7% slower on prompts
    alone: docs/dev/KERNEL_NOTES.md v10). use_alibi / use_sinks: whether run() will get those
    tensors (the kernels switch on what they get); use_sinks / write_lse None: run() may get
    them or not (the `tl` passes take either; the Gluon pass is planned for each).
    batch_invariant: one pass and one tile config for every request, keys in fixed splits
    (`invariant_plan.py`; `config` unused)."""
    paged = block_table is not None
    ones = torch.ones((), dtype=torch.float32, device=device) if use_kv_descale else None
    dtypes = (q_dtype, kv_dtype, out_dtype)
    plan = TritonAttentionPlan(total_q, num_heads, head_size, head_size_v,
                               write_lse is not False, paged, (batch, num_kv_heads), dtypes,
                               ones=ones)
    if batch == 0 or total_q == 0 or max_seqlen_q == 0:
        return plan
    if batch_invariant:
        # What the three invariant plans (prompts, decodes, the `tl` pass) all take
        batch_args = dict(
            device=device, cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k,
            block_table=block_table, batch=batch, total_q=total_q, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k, num_heads=num_heads, num_kv_heads=num_kv_heads,
            head_size=head_size, head_size_v=head_size_v, page_size=page_size,
            q_dtype=q_dtype, kv_dtype=kv_dtype, out_dtype=out_dtype,
            softmax_scale=softmax_scale, causal=causal, window_left=window_left,
            window_right=window_right, softcap=softcap)
        gluon_flags = dict(use_alibi=use_alibi, use_q_descale=use_q_descale,
                           use_kv_descale=use_kv_descale)
        # Prompts on the Gluon pass's invariant consumer where it serves (the same bits),
        # the decodes on the `tl` pass over disjoint requests, or on the Gluon decode one
        choices = plan_invariant_gluon(**batch_args, **gluon_flags, use_sinks=use_sinks,
                                       write_lse=write_lse)
        max_q_len = None
        if choices is not None:
            plan.gluon = choices[(bool(write_lse), bool(use_sinks))]
            if len(choices) > 1:
                plan.gluon_choices = choices
            max_q_len = invariant_gluon_max_q(head_size=head_size, head_size_v=head_size_v,
                                              group_pad=pow2_at_least(num_heads // num_kv_heads))
        # The decodes on the Gluon decode layout's invariant kernel where it serves (the same
        # bits): then the `tl` pass has nothing left but the fold of its split programs
        decodes = plan_invariant_decode(**batch_args, **gluon_flags, num_splits=num_splits,
                                        dtypes=dtypes, prompts_elsewhere=choices is not None)
        if decodes is not None:
            plan.gluon_decode, plan.launches = decodes
            return plan
        plan.launches = plan_invariant_launches(
            **batch_args, cu_seqlens_k=cu_seqlens_k, num_splits=num_splits, dtypes=dtypes,
            max_q_len=max_q_len)
        return plan
    group = num_heads // num_kv_heads
    group_pad = pow2_at_least(group)
    # A step of decodes alone (every query within the decode pass's rows) balances its splits
    # over the SMs; its split scratch then holds decode rows only.
    decode_only = max_seqlen_q <= decode_query_count(group)
    dec = decode_config(device=device, batch=batch, max_seqlen_k=max_seqlen_k,
                        num_kv_heads=num_kv_heads, group_pad=group_pad, head_size=head_size,
                        num_splits=num_splits, override=config, kv_bytes=kv_dtype.itemsize,
                        decode_only=decode_only)
    pre = None
    if max_seqlen_q > max(1, dec.block_m // group_pad):  # some request needs a prefill pass
        pre = prefill_config(max_seqlen_q=max_seqlen_q, head_size=head_size,
                             group_pad=group_pad, override=config)
        if config is not None:  # an override sets the prefill tiles; decodes keep their own
            dec = decode_config(device=device, batch=batch, max_seqlen_k=max_seqlen_k,
                                num_kv_heads=num_kv_heads, group_pad=group_pad,
                                head_size=head_size, num_splits=num_splits,
                                kv_bytes=kv_dtype.itemsize)
    decode_max_q = max(1, dec.block_m // group_pad)
    assert pre is None or decode_max_q == decode_query_count(group), \
        "the prefill passes leave requests of decode_query_count(group) queries to decode"
    # The shortest request has >= total_q - (batch - 1) * max_seqlen_q queries (ints known here);
    # a graph replays batches of any lengths, so it always launches the decode pass.
    has_short = cuda_graph or total_q - (batch - 1) * max_seqlen_q <= decode_max_q
    splits = dec.num_splits if has_short else 1
    if has_short and decode_only and config is None and num_splits == 0:
        # Decodes alone on the persistent Gluon decode form split for its programs (no
        # prefill shares the split scratch); elsewhere the `tl` pass's count stays.
        splits = persistent_decode_splits(
            max_seqlen_k=max_seqlen_k, num_splits=splits, batch=batch, device=device,
            num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
            head_size_v=head_size_v, q_dtype=q_dtype, kv_dtype=kv_dtype, out_dtype=out_dtype,
            paged=paged, page_size=page_size, decode_queries=decode_max_q,
            use_alibi=use_alibi, use_q_descale=use_q_descale, use_kv_descale=use_kv_descale)
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
        # 2048 after 30720 cached, 372 vs 330 TFLOP/s; docs/dev/KERNEL_NOTES.md v5).
        if hopper is not None and paged and not has_short and \
                max_seqlen_k >= launch.CONTEXT_HEAVY * max_seqlen_q:
            hopper = None
        if hopper is not None:
            pre_splits = 1
    gluon = None
    if pre is not None and config is None and launch.SWITCHES.gluon_prefill is not False \
            and num_splits == 0 and not (
                pre_splits > 1 and num_heads * triton.cdiv(total_q, 128)
                < launch.sm_count(device)):
        # Where the portable pass would split the keys because too few query blocks fill
        # the GPU (a cascade's prefix pass, a short chunk over a long context), it stays;
        # elsewhere the Gluon pass serves every long request, paged context included.
        # Prompts alone: their new rows are every key (cu_seqlens_k is cu_seqlens_q), but
        # over an fp8 cache, whose pass reads every key from the cache (quantised, as the
        # portable pass reads them; an fp8 q's product needs fp8 keys).
        new_rows = paged and dense_new_kv and new_keys_only and not cuda_graph and \
            kv_dtype not in FP8
        gluon_args = dict(
            device=device, cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k,
            cu_seqlens_k=cu_seqlens_q if new_rows else None if paged else cu_seqlens_k,
            block_table=None if new_rows else block_table,
            batch=batch, total_q=total_q, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
            num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
            head_size_v=head_size_v, q_dtype=q_dtype, kv_dtype=kv_dtype, causal=causal,
            window_left=window_left, window_right=window_right, softcap=softcap,
            use_alibi=use_alibi, page_size=page_size,
            dense_new_kv=paged and dense_new_kv and not new_rows,
            softmax_scale=softmax_scale, out_dtype=out_dtype, use_q_descale=use_q_descale,
            use_kv_descale=use_kv_descale, skip_q_len=decode_max_q if has_short else 0,
            cuda_graph=cuda_graph)
        # One launch per choice run() may make (sinks and an LSE, or not: None leaves it to
        # run()), the first the plan's own.
        choices = {(lse, sinks): plan_gluon_prefill(**gluon_args, use_sinks=sinks,
                                                    write_lse=lse)
                   for lse in ((False, True) if write_lse is None else (bool(write_lse),))
                   for sinks in ((False, True) if use_sinks is None else (bool(use_sinks),))}
        gluon = choices[(bool(write_lse), bool(use_sinks))]
        if gluon is not None:
            hopper, pre, pre_splits = None, None, 1
            plan.gluon, plan.gluon_new_rows = gluon, new_rows
            if len(choices) > 1:
                plan.gluon_choices = choices
    plan.takes_rows = hopper is None

    batch_args = batch_section(cu_seqlens_q, seqused_k, cu_seqlens_k, block_table, batch,
                               total_q, softmax_scale, softcap, window_left)
    # Causal attention is the right window 0 (flash-attn folds it the same way).
    window = dict(WINDOW_RIGHT=0 if causal else window_right if window_right >= 0 else None)
    partials, reduce_batch = None, None
    if max(splits, pre_splits) > 1:  # the passes own disjoint tokens: one scratch for both
        n = max(splits, pre_splits)
        partials = Outputs(
            Out=torch.empty((n, total_q, num_heads, head_size_v), dtype=torch.float32,
                            device=device),
            Lse=torch.empty((n, total_q, num_heads), dtype=torch.float32, device=device))
        reduce_batch = ReduceBatch(
            PartOut=partials.Out, PartLse=partials.Lse, cu_seqlens_q=cu_seqlens_q,
            num_seqs=batch, total_q=total_q, decode_max_q=decode_max_q,
            stride_ot=num_heads * head_size_v, stride_oh=head_size_v)
    dot = launch.dot_dtype(q_dtype, kv_dtype, out_dtype, device)
    portable = dict(window, GROUP=group, PAGE=page_size if paged else 1, HEAD_D=head_size,
                    HEAD_DV=head_size_v, DOT_DTYPE=dot,
                    FP8_V_IN_REGS=launch.fp8_v_in_regs(kv_dtype, dot, device))
    reduce = dict(NUM_HEADS=num_heads, HEAD_DV=head_size_v)
    launches = []
    if has_short and config is None and takes_decodes(
            q_dtype=q_dtype, kv_dtype=kv_dtype, max_seqlen_k=max_seqlen_k, num_splits=splits):
        plan.gluon_decode = plan_gluon_decode(
            device=device, cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k,
            block_table=block_table, batch=batch, total_q=total_q, num_heads=num_heads,
            num_kv_heads=num_kv_heads, head_size=head_size, head_size_v=head_size_v,
            page_size=page_size, q_dtype=q_dtype, kv_dtype=kv_dtype, out_dtype=out_dtype,
            softmax_scale=softmax_scale, causal=causal, window_left=window_left,
            window_right=window_right, softcap=softcap, use_alibi=use_alibi,
            use_q_descale=use_q_descale, use_kv_descale=use_kv_descale,
            decode_queries=decode_max_q, num_splits=splits,
            partials=(partials.Out, partials.Lse) if splits > 1 else None)
    if has_short and plan.gluon_decode is None:
        launches.append(PassLaunch(
            "decode", attention_kernel, (batch, num_kv_heads, splits),
            dict(portable, BLOCK_M=decode_max_q * group_pad, BLOCK_N=dec.block_n,
                 DECODE_PASS=True, SPLIT_KV=splits > 1, ONE_KEY_LOOP=True),
            dec.num_warps, dec.num_stages, batch_args, partials if splits > 1 else None,
            device=device, dtypes=dtypes))
    if has_short and splits > 1:
        launches.append(PassLaunch(
            "reduce", reduce_splits_kernel, (batch, num_heads),
            dict(reduce, NUM_SPLITS=splits, DECODE_PASS=True), 4, 1, reduce_batch,
            device=device, dtypes=dtypes))
    if hopper is not None:
        pack = launch.pack_gqa(group, max(head_size, head_size_v), hopper)
        rows_per_token = group if pack else 1
        block_q = hopper.block_m // rows_per_token
        launches.append(PassLaunch(
            "hopper", hopper_prefill_kernel,
            (num_kv_heads if pack else num_heads, total_q // block_q + batch),
            dict(window, GROUP=group, PAGE=page_size if paged else 1, HEAD_D=head_size,
                 HEAD_DV=head_size_v, BLOCK_M=hopper.block_m, BLOCK_N=hopper.block_n,
                 PACK_GQA=pack),
            hopper.num_warps, hopper.num_stages, batch_args,
            boxes=(block_q, rows_per_token, hopper.block_n), device=device,
            dtypes=dtypes))
    elif pre is not None:
        launches.append(PassLaunch(
            "prefill", attention_kernel, (total_q // block_q + batch, num_kv_heads, pre_splits),
            dict(portable, BLOCK_M=block_q * group_pad, BLOCK_N=pre.block_n,
                 DECODE_PASS=False, SPLIT_KV=pre_splits > 1, ONE_KEY_LOOP=pre.one_key_loop),
            pre.num_warps, pre.num_stages, batch_args, partials if pre_splits > 1 else None,
            device=device, dtypes=dtypes))
        if pre_splits > 1:
            launches.append(PassLaunch(
                "reduce", reduce_splits_kernel, (total_q, num_heads),
                dict(reduce, NUM_SPLITS=pre_splits, DECODE_PASS=False), 4, 1, reduce_batch,
                device=device, dtypes=dtypes))
    plan.launches = tuple(launches)
    return plan

