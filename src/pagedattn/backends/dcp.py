"""Decode context parallelism (DCP) for the FLASH_ATTN backends: the builder's per-rank
lengths (`DCPPlanner`), a step's plans per kind of layer (`DCPPlans`) and the layer's side of
the step (`DCPAttention`, which the impl owns as `impl.dcp`; the seeds' `_forward_with_dcp`).

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

Planned in `build()`, as FLASH_ATTN's plain path is: a builder with a `DCPPlanner` plans
the cache write, both attention passes and their scratch per kind of decoder layer
(`DCPPlans`, in the metadata's `plans`); every layer then only launches them. With
`cuda_graph` metadata the plans serve any later batch that fits the captured one (key bound:
this rank's share of max_model_len), so a captured DCP step replays with new lengths.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pagedattn.backends.paged_plans import LayerKind, check_cache
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
from pagedattn.ops.cache import CacheWritePlan
from pagedattn.ops.context_parallel import cp_lse_ag_out_rs, sharded_context_attention
from pagedattn.ops.plan import plan_varlen_attention
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
    check_dcp_kind(impl.attn_type, impl.kv_sharing_target_layer_name is None)


def check_dcp_kind(attn_type: str, writes_cache: bool) -> None:
    if attn_type == AttentionType.ENCODER_DECODER:
        raise ValueError("cross-attention (encoder_decoder) is not supported with decode "
                         "context parallelism; run it with decode_context_parallel_size=1")
    if not writes_cache:
        raise ValueError("KV sharing (kv_sharing_target_layer_name) is not supported with "
                         "decode context parallelism: the new tokens' keys live in another "
                         "layer's sharded cache")


# --- the step, planned -----------------------------------------------------------------------
class DCPPlans:
    """One batch's DCP step for one kind of layer: launches, scratch and the batch's DCP
    tensors, shared by the kind's layers; `run` hands them to the layer's `impl.dcp`."""

    dcp = True
    takes_rows = False  # the impl views the layer's rows as [T, heads, D] for it

    def __init__(self, kind: LayerKind, m, provider: str, write: Optional[CacheWritePlan]):
        dcp: DCPMetadata = m.dcp
        check_dcp_kind(kind.attn_type, kind.writes_cache)
        world = get_dcp_group().world_size
        n, heads, dv = m.num_actual_tokens, kind.num_heads, kind.head_size_v
        self.kind, self.num_tokens, self.dcp_metadata = kind, n, dcp
        self.q_dtype, self.out_dtype = kind.q_dtype, kind.out_dtype
        self.fp8_query, self.fp8_cache = kind.q_dtype in _FP8, kind.cache_dtype in _FP8
        self.cu_seqlens_q, self.block_table = m.query_start_loc, m.block_table
        self.num_reqs = m.seq_lens.shape[0]
        common = dict(num_tokens=n, cu_seqlens_q=m.query_start_loc, max_seqlen_q=m.max_query_len,
                      num_kv_heads=kind.num_kv_heads, head_size=kind.head_size, head_size_v=dv,
                      q_dtype=kind.q_dtype, out_dtype=torch.float32, softmax_scale=kind.scale,
                      softcap=kind.softcap, use_q_descale=self.fp8_query,
                      use_kv_descale=self.fp8_cache, return_softmax_lse=True,
                      cuda_graph=m.cuda_graph, provider=provider)
        self.write = write.provider_plan  # a DCP layer writes its own cache
        # Step 2 over the context. Windows and ALiBi are in global positions, which a shard
        # does not keep: those layers take sharded_context_attention (context None).
        self.context = None  # the provider's plan, or None
        if kind.window[0] >= 0 or kind.use_alibi:
            if m.cuda_graph:
                raise ValueError(
                    "a sliding window or ALiBi layer under decode context parallelism cannot "
                    "be captured in a CUDA graph: its context pass (sharded_context_attention) "
                    "reads lengths on the host; run its steps eagerly")
        else:
            # A captured step serves later batches: bound the keys by this rank's share of
            # the longest sequence the metadata admits (max_model_len for capture metadata).
            max_k = dcp.sharding.local_len(m.max_seq_len) if m.cuda_graph else \
                dcp.max_context_kv_len
            self.context = plan_varlen_attention(
                **common, num_heads=world * heads, kv_dtype=kind.cache_dtype,
                seqused_k=dcp.context_kv_lens, block_table=m.block_table,
                page_size=kind.block_size, max_seqlen_k=max_k, causal=False,
                num_splits=m.max_num_splits).provider_plan
        self.new = plan_varlen_attention(
            **common, num_heads=heads,
            kv_dtype=kind.cache_dtype if self.fp8_cache else kind.out_dtype,
            cu_seqlens_k=m.query_start_loc, seqused_k=dcp.query_lens,
            max_seqlen_k=m.max_query_len, causal=m.causal and kind.causal,
            window_size=kind.window, use_alibi=kind.use_alibi,
            use_sinks=kind.use_sinks).provider_plan
        f32 = dict(dtype=torch.float32, device=m.query_start_loc.device)
        self.ctx_out = torch.empty((n, world * heads, dv), **f32)
        self.ctx_lse = torch.empty((world * heads, n), **f32)
        self.new_out = torch.empty((n, heads, dv), **f32)
        self.new_lse = torch.empty((heads, n), **f32)

    def run(self, impl, layer, query, key, value, key_cache, value_cache, output) -> None:
        impl.dcp.run(self, layer, query, key, value, key_cache, value_cache, output,
                     impl.alibi_slopes, impl.sinks)

    def plan_layer(self, impl, layer, key_cache, value_cache) -> None:
        """ValueError where the layer's cache is not the one planned for; `run` takes every
        call (no provider plan of the layer: a DCP step gathers, merges and scatters)."""
        check_cache(self.kind, layer, key_cache, value_cache)


class DCPAttention:
    """A layer's side of the DCP step (`impl.dcp`, made with the impl): runs a step's
    `DCPPlans` with the layer's tensors, and keeps what is the layer's own: its cache dtype
    (the new keys are read as the cache stores them) and the ALiBi slopes of the group's
    heads (gathered once)."""

    def __init__(self, kv_cache_dtype: str, scale: float, window_left: int, softcap: float):
        self.kv_cache_dtype, self.scale = kv_cache_dtype, scale
        self.window_left, self.softcap = window_left, softcap
        self._group_slopes: Optional[torch.Tensor] = None

    def run(self, plans: DCPPlans, layer, query: torch.Tensor, key: Optional[torch.Tensor],
            value: Optional[torch.Tensor], key_cache: torch.Tensor, value_cache: torch.Tensor,
            output: torch.Tensor, alibi_slopes: Optional[torch.Tensor],
            sinks: Optional[torch.Tensor]) -> None:
        """query [T, H, D], key/value [T, Hkv, D(v)] of the new tokens, caches this rank's
        shard, output [T, H, Dv] written (rows past the batch's tokens: 0)."""
        if key is None or value is None:
            raise ValueError("decode context parallelism needs the new tokens' key and value")
        with torch.no_grad():  # the plans' scratch must not join a graph (a few us: DCP)
            self._run(plans, layer, query, key, value, key_cache, value_cache, output,
                      alibi_slopes, sinks)

    def _run(self, plans, layer, query, key, value, key_cache, value_cache, output,
             alibi_slopes, sinks) -> None:
        plans.write.run(key, value, key_cache, value_cache, layer._k_scale, layer._v_scale)
        n = plans.num_tokens
        if query.shape[0] != n:
            output[n:].zero_()  # padding rows (the output buffer is torch.empty)
            query, key, value, output = query[:n], key[:n], value[:n], output[:n]
        group = get_dcp_group()
        q_descale = layer._q_scale if plans.fp8_query else None
        k_descale = layer._k_scale if plans.fp8_cache else None
        v_descale = layer._v_scale if plans.fp8_cache else None
        q_all = all_gather(query, group, dim=1)  # step 1: [T, world * H, D]
        if plans.context is not None:  # step 2
            plans.context.run(q_all, key_cache, value_cache, plans.ctx_out, plans.ctx_lse,
                                 None, None, q_descale, k_descale, v_descale)
        else:
            dcp = plans.dcp_metadata
            expand = (plans.num_reqs, plans.kind.num_kv_heads)
            sharded_context_attention(
                q_all, key_cache, value_cache, plans.ctx_out, plans.ctx_lse,
                cu_seqlens_q=plans.cu_seqlens_q, context_lens=dcp.context_lens,
                local_context_lens=dcp.context_kv_lens, block_table=plans.block_table,
                sharding=dcp.sharding, softmax_scale=self.scale, window_left=self.window_left,
                softcap=self.softcap, alibi_slopes=self.group_slopes(alibi_slopes, group),
                q_descale=None if q_descale is None else q_descale.expand(expand),
                k_descale=None if k_descale is None else k_descale.expand(expand),
                v_descale=None if v_descale is None else v_descale.expand(expand))
        ctx_out, ctx_lse = cp_lse_ag_out_rs(plans.ctx_out, plans.ctx_lse, group,
                                            return_lse=True)  # step 3
        key, value = self.as_cached(layer, key, value)
        plans.new.run(query, key, value, plans.new_out, plans.new_lse, alibi_slopes, sinks,
                         q_descale, k_descale, v_descale)  # step 4
        merge_attn_states(output, ctx_out, ctx_lse, plans.new_out, plans.new_lse)

    def group_slopes(self, alibi_slopes: Optional[torch.Tensor], group
                     ) -> Optional[torch.Tensor]:
        """ALiBi slopes of the gathered heads (every DCP rank's own heads, in rank order)."""
        if alibi_slopes is None:
            return None
        gathered = self._group_slopes
        if gathered is None or gathered.device != alibi_slopes.device:
            gathered = self._group_slopes = all_gather(alibi_slopes.float().contiguous(), group)
        return gathered

    def as_cached(self, layer, key: torch.Tensor, value: torch.Tensor):
        """The new keys/values as the cache stores them (what a single GPU reads back): fp8
        caches quantize (x / scale, saturated) and the attention call dequantizes with the
        same descales; a cache of another float dtype rounds them to it."""
        stored = kv_cache_torch_dtype(self.kv_cache_dtype, key.dtype)
        if not is_fp8_kv_cache(self.kv_cache_dtype):
            return (key, value) if stored == key.dtype else (key.to(stored).to(key.dtype),
                                                             value.to(stored).to(value.dtype))
        bound = FP8_MAX[stored]
        return ((key.float() / layer._k_scale).clamp(-bound, bound).to(stored),
                (value.float() / layer._v_scale).clamp(-bound, bound).to(stored))
