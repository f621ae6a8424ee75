"""Plan once per batch, run per layer: `plan_varlen_attention(...)` then `plan.run(...)`.

`flash_attn_varlen_func` decides everything on every call. A model step calls attention once
per layer on the same batch, so an engine plans the batch once (a metadata builder does it in
`build`) and each layer only runs the plan. Planning reads host ints only (never a device
tensor): counts, the longest query and key range, shapes, dtypes and which features are on.
It picks the provider, the kernels' launch configs, grids and split-KV counts, and allocates
the scratch. `run` does O(1) checks and launches; the output is the caller's buffer or a
`torch.empty`, never a memset. Numerics are `flash_attn_varlen_func`'s.

    plan = plan_varlen_attention(cu_seqlens_q=cu_q, seqused_k=seq_lens, block_table=table,
                                 num_tokens=T, max_seqlen_q=max_q, max_seqlen_k=max_k,
                                 num_heads=32, num_kv_heads=8, head_size=128, page_size=16,
                                 q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, causal=True)
    for layer in layers:
        plan.run(q, k_cache, v_cache, out)

With `cuda_graph=True` the plan serves any later batch of at most `num_tokens` tokens and as
many requests as `cu_seqlens_q` has rows (a captured graph replays it with new lengths).
Without, it serves the batch its tensors hold when it is made: the PyTorch provider reads
them then (on the CPU, where lengths are host values, without a sync) to group the requests
and build their gather indices and masks once for every layer.

`plan_layer` plans a step's attention and cache write once more, for one layer's caches and
per-layer tensors (what a backend's layer runs every step): its `run` then reads only the
call's query, keys, values and output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional, Protocol

import torch

from pagedattn.ops.batch_invariant import batch_invariant_enabled
from pagedattn.ops.cache import CacheWritePlan
from pagedattn.ops.checks import check_window
from pagedattn.ops.providers import provider_name
from pagedattn.ops.torch.attention import TorchAttentionPlan, batch_shape


class VarlenAttentionPlan:
    """One batch's attention, planned; `run` it once per layer (any number of times).

    `run` checks a layer's tensors against the plan, then runs `provider_plan`: the provider's
    own plan (`TritonAttentionPlan`, `TorchAttentionPlan`), whose `run` takes the same tensors
    positionally and checks nothing, for a caller that made the plan for exactly its tensors,
    as the backends' builders do."""

    def __init__(self, provider: str, provider_plan, q_shape: tuple, out_shape: tuple,
                 q_dtype: torch.dtype, out_dtype: torch.dtype, write_lse: Optional[bool]):
        self.provider, self.provider_plan = provider, provider_plan
        self.q_shape, self.out_shape, self.q_dtype, self.out_dtype = (
            q_shape, out_shape, q_dtype, out_dtype)
        self.return_softmax_lse = write_lse  # None: each run() says, by passing softmax_lse
        # Whether the provider plan's run also takes 2-D rows (q [T, H * D], out [T, H * Dv],
        # dense k / v [keys, H_kv * D(v)]); else [T, heads, D] only.
        self.takes_rows = provider_plan.takes_rows

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            out: Optional[torch.Tensor] = None, *, softmax_lse: Optional[torch.Tensor] = None,
            alibi_slopes: Optional[torch.Tensor] = None, s_aux: Optional[torch.Tensor] = None,
            q_descale: Optional[torch.Tensor] = None, k_descale: Optional[torch.Tensor] = None,
            v_descale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """q [num_tokens, num_heads, head_size]; k, v: the caches (or dense keys) the plan was
        made for; out [num_tokens, num_heads, head_size_v] (default: torch.empty); with
        return_softmax_lse, softmax_lse [num_heads, num_tokens] float32 (default: empty; a
        plan made with return_softmax_lse=None writes it where given). alibi_slopes / s_aux
        [num_heads]; descales [num_seqs, num_kv_heads], (1,) or 0-d."""
        if q.shape != self.q_shape or q.dtype != self.q_dtype:
            raise ValueError(f"q is {tuple(q.shape)} {q.dtype}; this plan was made for "
                             f"{self.q_shape} {self.q_dtype}")
        if out is None:
            out = torch.empty(self.out_shape, dtype=self.out_dtype, device=q.device)
        elif out.shape != self.out_shape or out.dtype != self.out_dtype:
            raise ValueError(f"out is {tuple(out.shape)} {out.dtype}; this plan writes "
                             f"{self.out_shape} {self.out_dtype}")
        if self.return_softmax_lse is False:
            softmax_lse = None
        elif self.return_softmax_lse and softmax_lse is None:
            softmax_lse = torch.empty((self.q_shape[1], self.q_shape[0]), dtype=torch.float32,
                                      device=q.device)
        self.provider_plan.run(q, k, v, out, softmax_lse, alibi_slopes, s_aux, q_descale,
                               k_descale, v_descale)
        return out


def plan_varlen_attention(
    *, cu_seqlens_q: torch.Tensor, num_tokens: int, max_seqlen_q: int, max_seqlen_k: int,
    num_heads: int, num_kv_heads: int, head_size: int, q_dtype: torch.dtype,
    kv_dtype: torch.dtype, head_size_v: Optional[int] = None,
    out_dtype: Optional[torch.dtype] = None, seqused_k: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None, page_size: int = 1,
    cu_seqlens_k: Optional[torch.Tensor] = None, softmax_scale: Optional[float] = None,
    causal: bool = False, window_size: Optional[Sequence[int]] = None, softcap: float = 0.0,
    use_alibi: bool = False, use_sinks: Optional[bool] = False, use_q_descale: bool = False,
    use_kv_descale: bool = False, return_softmax_lse: Optional[bool] = False,
    num_splits: int = 0,
    cuda_graph: bool = False, provider: Optional[str] = None, dense_new_kv: bool = False,
    new_keys_only: bool = False, batch_invariant: Optional[bool] = None, keep: bool = False,
) -> VarlenAttentionPlan:
    """Plan `flash_attn_varlen_func` for one batch (the arguments are its own, as host ints,
    dtypes and feature flags). Paged keys: `block_table` [num_seqs, max_blocks] + `seqused_k`
    [num_seqs] + `page_size`; dense keys: `cu_seqlens_k` [num_seqs + 1]. `provider` defaults
    to the device's (`PAGEDATTN_OPS_PROVIDER`, or a backend's pinned one), read here once.
    dense_new_kv: the caller's `launch` will get the new tokens' keys and values as `k_new` /
    `v_new` (the Triton provider's Hopper prefill pass reads them). new_keys_only (with
    dense_new_kv): no request has a cached context, so those rows are every key a prefill
    pass needs (the Gluon pass then reads them as dense varlen keys). use_sinks /
    return_softmax_lse None: each run() says, by passing sinks / softmax_lse or not (the
    FlashInfer wrappers' plans, whose run() takes either; a Gluon prefill pass is then
    planned once per choice). batch_invariant: each request's rows the same bits whatever
    the batch (`ops.batch_invariant`; None: the enclosing `batch_invariant()` block's
    choice, else PAGEDATTN_BATCH_INVARIANT). keep: a per-call plan (`flash_attn_varlen_func`'s):
    the Triton provider's plan is the one an earlier call with the same arguments, tensors
    and switches made where it kept it (`ops/triton/op_plans.py`); a caller that keeps its
    plan itself (a builder) leaves it False."""
    device = cu_seqlens_q.device
    batch = cu_seqlens_q.shape[0] - 1
    if block_table is None and cu_seqlens_k is None:
        raise ValueError("plan_varlen_attention needs block_table (paged) or cu_seqlens_k")
    if seqused_k is None:
        if cu_seqlens_k is None:
            raise ValueError("paged attention (block_table given) needs seqused_k")
        seqused_k = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    if num_splits < 0:
        raise ValueError(f"num_splits={num_splits} must be >= 0 (0 chooses automatically)")
    head_size_v = head_size if head_size_v is None else head_size_v
    out_dtype = out_dtype or (torch.bfloat16 if q_dtype.itemsize == 1 else q_dtype)
    left, right = check_window(window_size)
    scale = float(head_size ** -0.5 if softmax_scale is None else softmax_scale)
    provider = provider or provider_name(device)
    invariant = batch_invariant_enabled(batch_invariant)
    if provider == "triton":
        from pagedattn.ops.triton.attention_plan import plan_attention
        from pagedattn.ops.triton.op_plans import plan_for

        provider_plan = (plan_for if keep else plan_attention)(
            device=device, cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k,
            cu_seqlens_k=None if block_table is not None else cu_seqlens_k,
            block_table=block_table, batch=batch, total_q=num_tokens, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k, num_heads=num_heads, num_kv_heads=num_kv_heads,
            head_size=head_size, head_size_v=head_size_v, page_size=page_size,
            q_dtype=q_dtype, kv_dtype=kv_dtype, out_dtype=out_dtype, softmax_scale=scale,
            causal=causal, window_left=left, window_right=right, softcap=float(softcap or 0.0),
            use_alibi=use_alibi, use_sinks=use_sinks, use_q_descale=use_q_descale,
            use_kv_descale=use_kv_descale, write_lse=return_softmax_lse,
            num_splits=num_splits, cuda_graph=cuda_graph,
            dense_new_kv=dense_new_kv and block_table is not None,
            new_keys_only=new_keys_only, batch_invariant=invariant)
    else:
        # A plan for this batch (not a graph's, which later batches replay) makes what
        # depends on the batch alone now, for every layer's run to read.
        shapes = None if cuda_graph else batch_shape(
            device, num_tokens, num_heads, num_kv_heads, page_size, head_size, head_size_v,
            float(softcap or 0.0))
        provider_plan = TorchAttentionPlan(
            (batch, num_kv_heads), shapes, cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k,
            cu_seqlens_k=None if block_table is not None else cu_seqlens_k,
            block_table=block_table, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
            softmax_scale=scale, causal=causal, window_left=left, window_right=right,
            softcap=float(softcap or 0.0), num_splits=num_splits, batch_invariant=invariant)
    return VarlenAttentionPlan(
        provider, provider_plan, torch.Size((num_tokens, num_heads, head_size)),
        torch.Size((num_tokens, num_heads, head_size_v)), q_dtype, out_dtype,
        return_softmax_lse)


class LayerPlan(Protocol):
    """A step's cache write and attention planned for one layer's caches and tensors
    (`plan_layer`)."""

    def run(self, query: torch.Tensor, key: Optional[torch.Tensor],
            value: Optional[torch.Tensor], output: torch.Tensor) -> bool:
        """Write key / value, attend query into output: True where the call was the planned
        one (see `plan_layer`), else False, having launched nothing."""


def plan_layer(attend: VarlenAttentionPlan, write: Optional[CacheWritePlan],
               key_cache: torch.Tensor, value_cache: torch.Tensor, k_scale: torch.Tensor,
               v_scale: torch.Tensor, alibi_slopes: Optional[torch.Tensor],
               sinks: Optional[torch.Tensor], q_descale: Optional[torch.Tensor],
               k_descale: Optional[torch.Tensor], v_descale: Optional[torch.Tensor],
               num_tokens: int) -> Optional[LayerPlan]:
    """A step's paged attention and its cache write (None: the layer writes nothing) planned
    for one layer: its caches [num_blocks, block_size, num_kv_heads, head_size(_v)], its
    scales (0-d float32), ALiBi slopes and sinks ([num_heads] float32) and descales, read
    here once. Its `run(query, key, value, output)` takes a call of `num_tokens` 2-D rows
    (query [T, H * D], key / value [T, H_kv * D(v)], output [T, H * Dv]) and reads only
    those; any other call it leaves to the plans' own `run`. None where the provider has no
    such plan (PyTorch), or these tensors need the plans' own `run`."""
    if attend.provider != "triton" or (write is not None and write.provider != "triton"):
        return None
    from pagedattn.ops.triton.layer_plan import plan_layer as plan_triton_layer

    return plan_triton_layer(attend.provider_plan, None if write is None else
                             write.provider_plan, key_cache, value_cache, k_scale, v_scale,
                             alibi_slopes, sinks, q_descale, k_descale, v_descale, num_tokens)
