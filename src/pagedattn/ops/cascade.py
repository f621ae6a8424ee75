"""Cascade attention: a prefix shared by every request of a batch is attended once for all.

Plain paged attention streams the shared prefix's keys once per request. Cascade attention
splits each request's keys into the common prefix and its own suffix: one non-causal pass
of all the batch's queries (as one sequence) over the prefix, one causal pass of each request
over its suffix, then `merge_attn_states` combines the two partial states exactly.

`cascade_attention` plans and runs at once; a builder plans a batch once
(`cascade_plan.plan_cascade_attention`) and each layer runs the plan. Whether cascade pays
for a batch is `use_cascade_attention` (`cascade_choice.py`).
"""

from __future__ import annotations

from typing import Optional

import torch

from pagedattn.ops.attention import flash_attn_varlen_func
from pagedattn.ops.cascade_choice import use_cascade_attention  # noqa: F401 - the op's pair
from pagedattn.ops.checks import check_cascade_args
from pagedattn.ops.merge import merge_attn_states


def cascade_attention(
    output: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    cu_query_lens: torch.Tensor,
    max_query_len: int,
    cu_prefix_query_lens: torch.Tensor,
    prefix_kv_lens: torch.Tensor,
    suffix_kv_lens: torch.Tensor,
    max_kv_len: int,
    softmax_scale: float,
    alibi_slopes: Optional[torch.Tensor],
    sliding_window: tuple[int, int],
    logits_soft_cap: float,
    block_table: torch.Tensor,
    common_prefix_len: int,
    fa_version: Optional[int] = None,
    prefix_scheduler_metadata: Optional[torch.Tensor] = None,
    suffix_scheduler_metadata: Optional[torch.Tensor] = None,
    q_descale: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
    max_num_splits: int = 0,
    s_aux: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention of a batch whose requests all begin with the same `common_prefix_len` keys.

    Args:
        output: [num_tokens, num_heads, head_size_v], written. query: [num_tokens, H, D].
        key_cache, value_cache: paged [num_blocks, block_size, num_kv_heads, head_size(_v)].
        cu_query_lens: [num_reqs + 1] int32; max_query_len: the longest query.
        cu_prefix_query_lens: [0, num_tokens] int32 (all queries form one prefix sequence).
        prefix_kv_lens: [common_prefix_len] int32; suffix_kv_lens: [num_reqs] int32, the keys
            of each request after the prefix. max_kv_len: the longest sequence (prefix included).
        block_table: [num_reqs, max_blocks] int32; the first common_prefix_len // block_size
            columns are the same for every request.
        common_prefix_len: a multiple of block_size, at most every request's context length
            (the prefix precedes every query, so no query needs a causal mask over it).
        q/k/v_descale: fp8 descales, a scalar tensor (expanded here) or [num_reqs, num_kv_heads].
        s_aux: [num_heads] sink logits, given to the prefix pass only: its LSE then carries the
            sink term into the merge, which keeps the result exact.
    fa_version and the scheduler metadata are accepted for flash-attn compatibility.
    """
    if alibi_slopes is not None:  # position-dependent, like sliding windows
        raise ValueError("cascade attention does not support ALiBi; run plain attention")
    if sliding_window is not None and tuple(sliding_window) != (-1, -1):
        raise ValueError(f"cascade attention does not support sliding_window={sliding_window}; "
                         "run plain attention")
    common_prefix_len, prefix_blocks = check_cascade_args(
        output, query, key_cache, value_cache, cu_query_lens, cu_prefix_query_lens,
        prefix_kv_lens, suffix_kv_lens, block_table, common_prefix_len, max_kv_len)
    num_kv_heads = key_cache.shape[2]
    num_reqs = cu_query_lens.shape[0] - 1
    common = dict(softmax_scale=softmax_scale, softcap=logits_soft_cap,
                  return_softmax_lse=True, num_splits=max_num_splits, fa_version=fa_version)
    prefix, suffix = cascade_passes(cu_query_lens, max_query_len, cu_prefix_query_lens,
                                    prefix_kv_lens, suffix_kv_lens, max_kv_len, block_table,
                                    common_prefix_len, query.shape[0], prefix_blocks)
    prefix_output, prefix_lse = flash_attn_varlen_func(
        q=query, k=key_cache, v=value_cache, out=torch.empty_like(output), **prefix,
        scheduler_metadata=prefix_scheduler_metadata, s_aux=s_aux,
        **cascade_descales(q_descale, k_descale, v_descale, 1, num_kv_heads), **common)
    suffix_output, suffix_lse = flash_attn_varlen_func(
        q=query, k=key_cache, v=value_cache, out=torch.empty_like(output), **suffix,
        scheduler_metadata=suffix_scheduler_metadata,
        **cascade_descales(q_descale, k_descale, v_descale, num_reqs, num_kv_heads), **common)
    merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse)
    return output


def cascade_passes(cu_query_lens: torch.Tensor, max_query_len: int,
                   cu_prefix_query_lens: torch.Tensor, prefix_kv_lens: torch.Tensor,
                   suffix_kv_lens: torch.Tensor, max_kv_len: int, block_table: torch.Tensor,
                   common_prefix_len: int, num_tokens: int, prefix_blocks: int
                   ) -> tuple[dict, dict]:
    """The batch arguments of the two passes (flash-attn's names): every query as one
    sequence over the prefix, not causal (the prefix precedes every query); each request
    over its own keys after the prefix, causal."""
    prefix = dict(cu_seqlens_q=cu_prefix_query_lens, max_seqlen_q=num_tokens,
                  seqused_k=prefix_kv_lens, max_seqlen_k=common_prefix_len, causal=False,
                  block_table=block_table[:1, :prefix_blocks])
    suffix = dict(cu_seqlens_q=cu_query_lens, max_seqlen_q=max_query_len,
                  seqused_k=suffix_kv_lens, max_seqlen_k=max_kv_len - common_prefix_len,
                  causal=True, block_table=block_table[:, prefix_blocks:])
    return prefix, suffix


def cascade_descales(q: Optional[torch.Tensor], k: Optional[torch.Tensor],
                     v: Optional[torch.Tensor], rows: int, num_kv_heads: int) -> dict:
    """flash-attn's [rows, num_kv_heads] descales, from scalars (expanded) or per-request rows."""
    out = {}
    for name, d in (("q_descale", q), ("k_descale", k), ("v_descale", v)):
        if d is not None:
            out[name] = d[:rows] if d.dim() == 2 else d.reshape(()).expand(rows, num_kv_heads)
    return out
