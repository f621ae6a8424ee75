"""Decode context parallelism (DCP) for the FLASH_ATTN backends: the builder's per-rank plan
and the impl's DCP step (`_forward_with_dcp`, as the FLASH_ATTN_DIFFKV seed calls it).

Each rank of a DCP group stores the positions `(p // interleave) % world == rank` of every
request (`pagedattn.kv_sharding`), so its block table and slot mapping are its own (negative
slots for tokens another rank stores) while `seq_lens` stay global. A step then:
1. all-gathers the query heads of the group (the ranks hold the same KV heads);
2. attends them over the cached context this rank stores (`causal=False`: all of it precedes
   every new token), with `return_softmax_lse`;
3. all-gathers the LSEs, rescales, and reduce-scatters back to this rank's heads
   (`cp_lse_ag_out_rs`, one fused correction kernel);
4. attends this rank's heads over the new tokens' own keys, causally, and merges the two
   parts with `merge_attn_states`. Sinks join the second part only, so they count once.
Sliding windows and ALiBi are in global positions: a shard is not a contiguous run of
positions, so layers with either take step 2 through `sharded_context_attention`, which
gives each key its global position. fp8 caches: step 4 reads the new keys quantized as the
cache holds them, exactly what a single GPU reads back.

Plan once per step, as FLASH_ATTN's plain path does: the step's first layer of each kind
plans the cache write, both attention passes and their scratch (`DCPPlans`, kept in the
metadata's `plans`); every layer then only runs them. With `cuda_graph` metadata the plans
serve any later batch that fits the captured one (key bound: this rank's share of
max_model_len), so a captured DCP step replays with new lengths.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch

from pagedattn.config import FP8_MAX, EngineConfig, is_fp8_kv_cache, kv_cache_torch_dtype
from pagedattn.distributed import (
    ParallelGroupError,
    all_gather,
    get_dcp_group,
    get_tensor_model_parallel_world_size,
)
from pagedattn.kv_sharding import KVSharding
from pagedattn.metadata import CommonAttentionMetadata
from pagedattn.ops import merge_attn_states
from pagedattn.ops._dispatch import provider_name
from pagedattn.ops.cache import plan_reshape_and_cache_flash
from pagedattn.ops.context_parallel import cp_lse_ag_out_rs, sharded_context_attention
from pagedattn.ops.plan import VarlenAttentionPlan, plan_varlen_attention
from pagedattn.types import AttentionType

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass
class DCPMetadata:
    """What one DCP rank needs beyond the paged fields (whose block table and slot mapping
    are already this rank's, and whose seq_lens are global)."""

    sharding: KVSharding
    context_kv_lens: torch.Tensor  # [num_reqs] int32: cached positions this rank stores
    max_context_kv_len: int
    context_lens: torch.Tensor  # [num_reqs] int32: cached positions, all ranks together
    # [num_reqs] int32: new tokens per request, the keys of step 4 (a persistent buffer, so
    # a captured step reads the lengths of the batch it replays). None: from query_start_loc.
    query_lens: Optional[torch.Tensor] = None


class DCPPlanner:
    """Builder side: persistent buffers for the per-rank lengths, filled each build.

    A group of one (decode_context_parallel_size=1) is allowed: the step then runs the DCP
    algorithm without collectives, which is how one GPU checks and times it."""

    def __init__(self, config: EngineConfig, max_num_seqs: int, device: torch.device):
        group = get_dcp_group()
        dcp, tp = config.decode_context_parallel_size, config.tensor_parallel_size
        if (group.world_size, get_tensor_model_parallel_world_size()) != (dcp, tp):
            raise ParallelGroupError(
                f"EngineConfig asks for tensor_parallel_size={tp}, decode_context_parallel_"
                f"size={dcp} but this process has TP {get_tensor_model_parallel_world_size()}, "
                f"DCP {group.world_size}: call pagedattn.distributed.init_parallel_groups("
                f"{tp}, {dcp}) on every rank before building")
        self.sharding = KVSharding(dcp, group.rank_in_group, config.dcp_kv_cache_interleave_size)
        # Rows: this rank's cached lengths, all ranks' cached lengths, new tokens. One buffer:
        # one copy per build; rows past the batch are zeroed so that a captured graph's
        # padded requests read empty lengths.
        self.lens = torch.zeros(3, max_num_seqs, dtype=torch.int32, device=device)

    def plan(self, m: CommonAttentionMetadata) -> DCPMetadata:
        n = m.num_reqs
        context = m.num_computed_tokens_cpu[:n].to(torch.int32)
        local = self.sharding.local_len(context.long()).to(torch.int32)
        query_lens = m.query_lens_cpu[:n].to(torch.int32)
        self.lens[:, :n].copy_(torch.stack([local, context, query_lens]), non_blocking=True)
        self.lens[:, n:].zero_()
        return DCPMetadata(self.sharding, self.lens[0, :n], int(local.max()) if n else 0,
                           self.lens[1, :n], self.lens[2, :n])


def dcp_planner(config: Optional[EngineConfig], max_num_seqs: int, device: torch.device
                ) -> Optional[DCPPlanner]:
    if config is None or config.decode_context_parallel_size == 1:
        return None
    return DCPPlanner(config, max_num_seqs, device)


def check_dcp_layer(impl) -> None:
    """At construction: what a DCP layer cannot be (new keys come only from `key`/`value`)."""
    if impl.attn_type == AttentionType.ENCODER_DECODER:
        raise ValueError("cross-attention (encoder_decoder) is not supported with decode "
                         "context parallelism; run it with decode_context_parallel_size=1")
    if impl.kv_sharing_target_layer_name is not None:
        raise ValueError("KV sharing (kv_sharing_target_layer_name) is not supported with "
                         "decode context parallelism: the new tokens' keys live in another "
                         "layer's sharded cache")


# --- the step, planned -----------------------------------------------------------------------
@dataclass
class DCPPlans:
    """One batch's DCP step for one kind of layer: launches and scratch, shared by layers."""

    write: Callable  # (key, value, key_cache, value_cache, k_scale, v_scale)
    context: Optional[Callable]  # step 2 (None: sharded_context_attention, global masks)
    new: Callable  # step 4
    ctx_out: torch.Tensor  # [T, world * H, Dv] float32
    ctx_lse: torch.Tensor  # [world * H, T] float32
    new_out: torch.Tensor  # [T, H, Dv] float32
    new_lse: torch.Tensor  # [H, T] float32
    fp8_query: bool
    fp8_cache: bool


def run_dcp_step(impl, layer, query: torch.Tensor, key: Optional[torch.Tensor],
                 value: Optional[torch.Tensor], kv_cache: torch.Tensor, m,
                 output: torch.Tensor) -> None:
    """A layer's whole step under DCP (the impl runs in a DCP group, or the metadata carries
    a DCP plan): query [T, H, D], key/value [T, Hkv, D(v)], kv_cache this rank's shard in the
    backend's layout, output [T, H, Dv] written (rows past num_actual_tokens: 0)."""
    n = m.num_actual_tokens
    if impl.attn_type != AttentionType.DECODER:  # encoders: no cache, nothing to shard
        impl._forward(layer, query, key, value, kv_cache, m, output, n)
        return
    if key is None or value is None:
        raise ValueError("decode context parallelism needs the new tokens' key and value")
    views = impl._views
    if views[0] is not kv_cache:
        views = impl._views = impl._bind_cache(kv_cache, layer)
    _, key_cache, value_cache, kind = views
    plans = _plans(impl, m, kind, query, key, output, key_cache, value_cache)
    device = query.device
    plans.write(key, value, key_cache, value_cache, _on(layer._k_scale, device),
                _on(layer._v_scale, device))
    if query.shape[0] != n:
        output[n:].zero_()  # padding rows (the output buffer is torch.empty)
        query, key, value, output = query[:n], key[:n], value[:n], output[:n]
    _attend(impl, layer, plans, query, key, value, key_cache, value_cache, output, m)


def forward_with_dcp(impl, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     key_cache: torch.Tensor, value_cache: torch.Tensor, output: torch.Tensor,
                     m) -> None:
    """Steps 1-4 after the cache write: query [T, H, D], key/value [T, Hkv, D(v)] of the new
    tokens, caches this rank's shard, output [T, H, Dv] written. `m` is the FLASH_ATTN
    metadata with its `dcp` plan."""
    if key is None or value is None:
        raise ValueError("decode context parallelism needs the new tokens' key and value")
    kind = (type(impl), impl.num_heads, impl.head_size, impl.num_kv_heads, impl.scale,
            impl.sliding_window, impl.logits_soft_cap, impl.alibi_slopes is not None,
            impl.sinks is not None, key_cache.dtype, tuple(key_cache.shape[1:]),
            value_cache.shape[-1])
    plans = _plans(impl, m, kind, query, key, output, key_cache, value_cache)
    _attend(impl, layer, plans, query, key, value, key_cache, value_cache, output, m)


def _plans(impl, m, kind, query, key, output, key_cache, value_cache) -> DCPPlans:
    dcp: Optional[DCPMetadata] = getattr(m, "dcp", None)
    # The plans hold the batch's tensors, so their ids and the host ints key them (a caller
    # that edits the metadata in place gets new plans).
    plan_key = ("dcp", kind, query.dtype, output.dtype, m.num_actual_tokens, m.max_query_len,
                m.max_seq_len, m.cuda_graph, id(m.query_start_loc), id(m.block_table),
                id(m.slot_mapping), id(dcp))
    plans = m.plans.get(plan_key)
    if plans is None:
        plans = m.plans[plan_key] = _make_plans(impl, m, dcp, query, key, output, key_cache,
                                                value_cache)
    return plans


def _make_plans(impl, m, dcp: Optional[DCPMetadata], query, key, output, key_cache,
                value_cache) -> DCPPlans:
    if dcp is None:
        raise ValueError(
            f"this layer runs with decode context parallelism (DCP world size "
            f"{impl.dcp_world_size}) but the metadata has no DCP plan: build it with "
            f"EngineConfig(decode_context_parallel_size={impl.dcp_world_size}, ...)")
    check_dcp_layer(impl)  # a group of one reaches here without the constructor's check
    world = get_dcp_group().world_size
    n, heads, dv = m.num_actual_tokens, impl.num_heads, value_cache.shape[-1]
    fp8_query, fp8_cache = query.dtype in _FP8, key_cache.dtype in _FP8
    provider = impl.ops_provider or provider_name(query.device)
    common = dict(num_tokens=n, cu_seqlens_q=m.query_start_loc, max_seqlen_q=m.max_query_len,
                  num_kv_heads=impl.num_kv_heads, head_size=impl.head_size, head_size_v=dv,
                  q_dtype=query.dtype, out_dtype=torch.float32, softmax_scale=impl.scale,
                  softcap=impl.logits_soft_cap, use_q_descale=fp8_query,
                  use_kv_descale=fp8_cache, return_softmax_lse=True, cuda_graph=m.cuda_graph,
                  provider=provider)
    write = plan_reshape_and_cache_flash(
        m.slot_mapping, num_kv_heads=impl.num_kv_heads, head_size=impl.head_size,
        head_size_v=dv, page_size=key_cache.shape[1], cache_dtype=key_cache.dtype,
        provider=provider)
    context = None
    if impl.sliding_window[0] >= 0 or impl.alibi_slopes is not None:
        if m.cuda_graph:
            raise ValueError(
                "a sliding window or ALiBi layer under decode context parallelism cannot be "
                "captured in a CUDA graph: its context pass (sharded_context_attention) reads "
                "lengths on the host; run its steps eagerly")
    else:
        # A captured step serves later batches: bound the keys by this rank's share of the
        # longest sequence the metadata admits (max_model_len for capture metadata).
        max_k = dcp.sharding.local_len(m.max_seq_len) if m.cuda_graph else \
            dcp.max_context_kv_len
        context = _runner(plan_varlen_attention(
            **common, num_heads=world * heads, kv_dtype=key_cache.dtype,
            seqused_k=dcp.context_kv_lens, block_table=m.block_table,
            page_size=key_cache.shape[1], max_seqlen_k=max_k, causal=False,
            num_splits=m.max_num_splits))
    new = _runner(plan_varlen_attention(
        **common, num_heads=heads, kv_dtype=key_cache.dtype if fp8_cache else key.dtype,
        cu_seqlens_k=m.query_start_loc, seqused_k=dcp.query_lens, max_seqlen_k=m.max_query_len,
        causal=impl._causal(m), window_size=impl.sliding_window,
        use_alibi=impl.alibi_slopes is not None, use_sinks=impl.sinks is not None))
    f32 = dict(dtype=torch.float32, device=query.device)
    return DCPPlans(
        write=write._impl.run if write._impl is not None else write.run, context=context,
        new=new, ctx_out=torch.empty((n, world * heads, dv), **f32),
        ctx_lse=torch.empty((world * heads, n), **f32),
        new_out=torch.empty((n, heads, dv), **f32), new_lse=torch.empty((heads, n), **f32),
        fp8_query=fp8_query, fp8_cache=fp8_cache)


def _runner(plan: VarlenAttentionPlan) -> Callable:
    """(q, k, v, out, lse, alibi_slopes, sinks, q/k/v descales) of a plan: the provider's
    launches directly (planning established what the public `run` would check)."""
    if plan._impl is not None:
        return plan._impl.run

    def run(q, k, v, out, lse, alibi_slopes, sinks, q_descale, k_descale, v_descale):
        plan.run(q, k, v, out, softmax_lse=lse, alibi_slopes=alibi_slopes, s_aux=sinks,
                 q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)

    return run


def _attend(impl, layer, plans: DCPPlans, query, key, value, key_cache, value_cache, output,
            m) -> None:
    """Steps 1-4 with the step's plans (see the module docstring)."""
    group = get_dcp_group()
    device = query.device
    q_descale = _on(layer._q_scale, device) if plans.fp8_query else None
    k_descale = _on(layer._k_scale, device) if plans.fp8_cache else None
    v_descale = _on(layer._v_scale, device) if plans.fp8_cache else None
    q_all = all_gather(query, group, dim=1)  # [T, world * H, D]
    if plans.context is not None:
        plans.context(q_all, key_cache, value_cache, plans.ctx_out, plans.ctx_lse, None, None,
                      q_descale, k_descale, v_descale)
    else:
        dcp: DCPMetadata = m.dcp
        sharded_context_attention(
            q_all, key_cache, value_cache, plans.ctx_out, plans.ctx_lse,
            cu_seqlens_q=m.query_start_loc, context_lens=dcp.context_lens,
            local_context_lens=dcp.context_kv_lens, block_table=m.block_table,
            sharding=dcp.sharding, softmax_scale=impl.scale, window_left=impl.sliding_window[0],
            softcap=impl.logits_soft_cap, alibi_slopes=_group_slopes(impl, group),
            **impl._descales(layer, query, m.seq_lens.shape[0]))
    ctx_out, ctx_lse = cp_lse_ag_out_rs(plans.ctx_out, plans.ctx_lse, group, return_lse=True)
    key, value = _as_cached(impl, layer, key, value)
    plans.new(query, key, value, plans.new_out, plans.new_lse, impl.alibi_slopes, impl.sinks,
              q_descale, k_descale, v_descale)
    merge_attn_states(output, ctx_out, ctx_lse, plans.new_out, plans.new_lse)


def _on(scale: torch.Tensor, device: torch.device) -> torch.Tensor:
    return scale if scale.device == device else scale.to(device)


def _group_slopes(impl, group) -> Optional[torch.Tensor]:
    """ALiBi slopes of the gathered heads (every DCP rank's own heads, in rank order)."""
    if impl.alibi_slopes is None:
        return None
    cached = getattr(impl, "_dcp_alibi_slopes", None)
    if cached is None or cached.device != impl.alibi_slopes.device:
        cached = all_gather(impl.alibi_slopes.float().contiguous(), group)
        impl._dcp_alibi_slopes = cached
    return cached


def _as_cached(impl, layer, key: torch.Tensor, value: torch.Tensor):
    """The new keys/values as the cache stores them (what a single GPU reads back): fp8
    caches quantize (x / scale, saturated) and the attention call dequantizes with the same
    descales; a cache of another float dtype rounds them to it."""
    stored = kv_cache_torch_dtype(impl.kv_cache_dtype, key.dtype)
    if not is_fp8_kv_cache(impl.kv_cache_dtype):
        return (key, value) if stored == key.dtype else (key.to(stored).to(key.dtype),
                                                         value.to(stored).to(value.dtype))
    bound = FP8_MAX[stored]
    return ((key.float() / layer._k_scale).clamp(-bound, bound).to(stored),
            (value.float() / layer._v_scale).clamp(-bound, bound).to(stored))
