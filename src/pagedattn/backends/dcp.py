"""Decode context parallelism (DCP) for the FLASH_ATTN backends: the builder's per-rank plan
and the impl's `_forward_with_dcp`, as the FLASH_ATTN_DIFFKV seed calls it.

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
"""

from __future__ import annotations

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
from pagedattn.ops import flash_attn_varlen_func, merge_attn_states
from pagedattn.ops.context_parallel import cp_lse_ag_out_rs, sharded_context_attention
from pagedattn.types import AttentionType


@dataclass
class DCPMetadata:
    """What one DCP rank needs beyond the paged fields (whose block table and slot mapping
    are already this rank's, and whose seq_lens are global)."""

    sharding: KVSharding
    context_kv_lens: torch.Tensor  # [num_reqs] int32: cached positions this rank stores
    max_context_kv_len: int
    context_lens: torch.Tensor  # [num_reqs] int32: cached positions, all ranks together


class DCPPlanner:
    """Builder side: persistent buffers for the per-rank context lengths, filled each build."""

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
        self.context_kv_lens = torch.zeros(max_num_seqs, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(max_num_seqs, dtype=torch.int32, device=device)

    def plan(self, m: CommonAttentionMetadata) -> DCPMetadata:
        n = m.num_reqs
        context = m.num_computed_tokens_cpu[:n]
        local = self.sharding.local_len(context.long()).to(torch.int32)
        self.context_lens[:n].copy_(context, non_blocking=True)
        self.context_kv_lens[:n].copy_(local, non_blocking=True)
        return DCPMetadata(self.sharding, self.context_kv_lens[:n],
                           int(local.max()) if n else 0, self.context_lens[:n])


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


def forward_with_dcp(impl, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     key_cache: torch.Tensor, value_cache: torch.Tensor, output: torch.Tensor,
                     m) -> None:
    """query [T, H, D], key/value [T, Hkv, D(v)] of the new tokens, caches this rank's shard,
    output [T, H, Dv] written. `m` is the FLASH_ATTN metadata with its `dcp` plan."""
    dcp: Optional[DCPMetadata] = getattr(m, "dcp", None)
    if dcp is None:
        raise ValueError(
            f"this layer runs with decode context parallelism (DCP world size "
            f"{impl.dcp_world_size}) but the metadata has no DCP plan: build it with "
            f"EngineConfig(decode_context_parallel_size={impl.dcp_world_size}, ...)")
    if key is None or value is None:
        raise ValueError("decode context parallelism needs the new tokens' key and value")
    group = get_dcp_group()
    num_reqs = m.seq_lens.shape[0]
    descales = impl._descales(layer, query, num_reqs)
    q_all = all_gather(query, group, dim=1)  # [T, world * H, D]
    ctx_out = q_all.new_empty((*q_all.shape[:2], value_cache.shape[-1]), dtype=torch.float32)
    left = impl.sliding_window[0]
    if left >= 0 or impl.alibi_slopes is not None:
        ctx_lse = ctx_out.new_empty(q_all.shape[1], q_all.shape[0])
        sharded_context_attention(
            q_all, key_cache, value_cache, ctx_out, ctx_lse, cu_seqlens_q=m.query_start_loc,
            context_lens=dcp.context_lens, local_context_lens=dcp.context_kv_lens,
            block_table=m.block_table, sharding=dcp.sharding, softmax_scale=impl.scale,
            window_left=left, softcap=impl.logits_soft_cap,
            alibi_slopes=_group_slopes(impl, group), **descales)
    else:
        _, ctx_lse = flash_attn_varlen_func(
            q=q_all, k=key_cache, v=value_cache, out=ctx_out, cu_seqlens_q=m.query_start_loc,
            max_seqlen_q=m.max_query_len, seqused_k=dcp.context_kv_lens,
            max_seqlen_k=dcp.max_context_kv_len, softmax_scale=impl.scale, causal=False,
            block_table=m.block_table, softcap=impl.logits_soft_cap, return_softmax_lse=True,
            num_splits=m.max_num_splits, **descales)
    ctx_out, ctx_lse = cp_lse_ag_out_rs(ctx_out, ctx_lse, group, return_lse=True)
    key, value = _as_cached(impl, layer, key, value)
    new_out = ctx_out.new_empty(ctx_out.shape)
    _, new_lse = flash_attn_varlen_func(
        q=query, k=key, v=value, out=new_out, cu_seqlens_q=m.query_start_loc,
        max_seqlen_q=m.max_query_len, cu_seqlens_k=m.query_start_loc,
        max_seqlen_k=m.max_query_len, softmax_scale=impl.scale, causal=impl._causal(m),
        window_size=impl.sliding_window, softcap=impl.logits_soft_cap,
        alibi_slopes=impl.alibi_slopes, return_softmax_lse=True, s_aux=impl.sinks, **descales)
    merge_attn_states(output, ctx_out, ctx_lse, new_out, new_lse)


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
