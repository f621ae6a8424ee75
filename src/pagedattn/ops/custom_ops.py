"""The provider calls as `torch.library` custom ops (namespace `pagedattn`).

`torch.compile` sees each op as one opaque node that mutates its output buffers (and, for the
cache write, the caches), so a model using `Attention` compiles without graph breaks. The fake
implementations only declare those mutations: every op returns None and allocates nothing.
The real implementations pick the provider (Triton or PyTorch) at run time, per device.

Outside torch.compile the same functions are called directly: a custom op's dispatch costs
tens of microseconds of host time per call, which an eager decode step cannot afford.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Optional

import torch

from pagedattn.ops.providers import provider_for

Tensor = torch.Tensor


def opaque_op(name: str, mutates_args: tuple[str, ...]) -> Callable:
    """Register `fn` as custom op `pagedattn::<name>` (fake: mutates, returns None) and return
    a function that runs the op while compiling and `fn` itself otherwise."""

    def register(fn: Callable[..., None]) -> Callable[..., None]:
        op = torch.library.custom_op(f"pagedattn::{name}", mutates_args=mutates_args)(fn)
        op.register_fake(_declares_mutation_only)

        @functools.wraps(fn)
        def call(*args) -> None:
            if torch.compiler.is_compiling():
                return op(*args)
            if not torch.is_grad_enabled():  # inference: no context to enter
                return fn(*args)
            with torch.no_grad():  # like the op: in-place writes into caches, no autograd
                return fn(*args)

        call.op = op
        return call

    return register


def _declares_mutation_only(*args, **kwargs) -> None:
    return None


@opaque_op("varlen_attention", mutates_args=("out", "softmax_lse"))
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


@opaque_op("reshape_and_cache", mutates_args=("key_cache", "value_cache"))
def reshape_and_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                      slot_mapping: Tensor, k_scale: Tensor, v_scale: Tensor) -> None:
    provider_for(key.device).reshape_and_cache(key, value, key_cache, value_cache, slot_mapping,
                                               k_scale, v_scale)


@opaque_op("merge_attn_states", mutates_args=("output", "output_lse"))
def merge_attn_states(output: Tensor, prefix_output: Tensor, prefix_lse: Tensor,
                      suffix_output: Tensor, suffix_lse: Tensor,
                      output_lse: Optional[Tensor]) -> None:
    provider_for(output.device).merge_attn_states(output, prefix_output, prefix_lse,
                                                  suffix_output, suffix_lse, output_lse)
