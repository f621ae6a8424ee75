"""The provider calls as `torch.library` custom ops (namespace `pagedattn`).

`torch.compile` sees each op as one opaque node that mutates its output buffers (and, for the
cache write, the caches), so a model using `Attention` compiles without graph breaks. The fake
implementations only declare those mutations: every op returns None and allocates nothing.
The real implementations pick the provider (Triton or PyTorch) at run time, per device.
"""

from __future__ import annotations

from typing import Optional

import torch

from pagedattn.ops._dispatch import provider_for

Tensor = torch.Tensor


@torch.library.custom_op("pagedattn::varlen_attention", mutates_args=("out", "softmax_lse"))
def varlen_attention(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, cu_seqlens_q: Tensor, seqused_k: Tensor,
    cu_seqlens_k: Optional[Tensor], block_table: Optional[Tensor], max_seqlen_q: int,
    max_seqlen_k: int, softmax_scale: float, causal: bool, window_left: int, window_right: int,
    softcap: float, alibi_slopes: Optional[Tensor], sinks: Optional[Tensor],
    q_descale: Optional[Tensor], k_descale: Optional[Tensor], v_descale: Optional[Tensor],
    softmax_lse: Optional[Tensor], num_splits: int,
) -> None:
    provider_for(q.device).varlen_attention(
        q, k, v, out, cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k, cu_seqlens_k=cu_seqlens_k,
        block_table=block_table, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        softmax_scale=softmax_scale, causal=causal, window_left=window_left,
        window_right=window_right, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
        q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, softmax_lse=softmax_lse,
        num_splits=num_splits)


@varlen_attention.register_fake
def _(q, k, v, out, cu_seqlens_q, seqused_k, cu_seqlens_k, block_table, max_seqlen_q,
      max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
      sinks, q_descale, k_descale, v_descale, softmax_lse, num_splits) -> None:
    return None


@torch.library.custom_op("pagedattn::reshape_and_cache",
                         mutates_args=("key_cache", "value_cache"))
def reshape_and_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                      slot_mapping: Tensor, k_scale: Tensor, v_scale: Tensor) -> None:
    provider_for(key.device).reshape_and_cache(key, value, key_cache, value_cache, slot_mapping,
                                               k_scale, v_scale)


@reshape_and_cache.register_fake
def _(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale) -> None:
    return None


@torch.library.custom_op("pagedattn::merge_attn_states", mutates_args=("output", "output_lse"))
def merge_attn_states(output: Tensor, prefix_output: Tensor, prefix_lse: Tensor,
                      suffix_output: Tensor, suffix_lse: Tensor,
                      output_lse: Optional[Tensor]) -> None:
    provider_for(output.device).merge_attn_states(output, prefix_output, prefix_lse,
                                                  suffix_output, suffix_lse, output_lse)


@merge_attn_states.register_fake
def _(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse) -> None:
    return None
