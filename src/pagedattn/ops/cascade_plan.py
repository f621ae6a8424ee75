"""Cascade attention planned once per batch (`plan_cascade_attention`), run per layer: the
two passes of `cascade_attention` and their partial states, decided and allocated once."""

from __future__ import annotations

from typing import Optional

import torch

from pagedattn.ops.cascade import cascade_descales, cascade_passes
from pagedattn.ops.merge import merge_attn_states
from pagedattn.ops.plan import VarlenAttentionPlan, plan_varlen_attention


class CascadeAttentionPlan:
    """One batch's cascade attention, planned (`plan_cascade_attention`): both passes and
    their partial states; `run` once per layer."""

    def __init__(self, prefix: VarlenAttentionPlan, suffix: VarlenAttentionPlan,
                 num_reqs: int, num_kv_heads: int, out_shape: tuple, out_dtype: torch.dtype,
                 device: torch.device):
        self.prefix, self.suffix = prefix, suffix
        self.num_reqs, self.num_kv_heads = num_reqs, num_kv_heads
        # The passes' partial states, in the output's dtype as the op's (one layer at a time
        # uses them: layers run one after another on the stream).
        self.parts = tuple(torch.empty(out_shape, dtype=out_dtype, device=device)
                           for _ in range(2))
        self.lses = tuple(torch.empty((out_shape[1], out_shape[0]), dtype=torch.float32,
                                      device=device) for _ in range(2))

    def run(self, output: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
            value_cache: torch.Tensor, q_descale: Optional[torch.Tensor] = None,
            k_descale: Optional[torch.Tensor] = None, v_descale: Optional[torch.Tensor] = None,
            s_aux: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`cascade_attention`'s tensors for the planned batch: output [num_tokens, H, Dv]
        (written), query [num_tokens, H, D], the paged caches; descales one value each (a
        0-d or (1,) tensor) or [num_reqs, num_kv_heads]; s_aux [H] (the prefix pass's)."""
        (prefix_out, suffix_out), (prefix_lse, suffix_lse) = self.parts, self.lses
        self.prefix.run(query, key_cache, value_cache, prefix_out, softmax_lse=prefix_lse,
                        s_aux=s_aux, **cascade_descales(q_descale, k_descale, v_descale, 1,
                                                 self.num_kv_heads))
        self.suffix.run(query, key_cache, value_cache, suffix_out, softmax_lse=suffix_lse,
                        **cascade_descales(q_descale, k_descale, v_descale, self.num_reqs,
                                    self.num_kv_heads))
        merge_attn_states(output, prefix_out, prefix_lse, suffix_out, suffix_lse)
        return output


def plan_cascade_attention(
    *, cu_query_lens: torch.Tensor, max_query_len: int, cu_prefix_query_lens: torch.Tensor,
    prefix_kv_lens: torch.Tensor, suffix_kv_lens: torch.Tensor, max_kv_len: int,
    block_table: torch.Tensor, common_prefix_len: int, num_tokens: int, num_heads: int,
    num_kv_heads: int, head_size: int, page_size: int, q_dtype: torch.dtype,
    kv_dtype: torch.dtype, softmax_scale: float, logits_soft_cap: float = 0.0,
    head_size_v: Optional[int] = None, out_dtype: Optional[torch.dtype] = None,
    use_sinks: bool = False, use_q_descale: bool = False, use_kv_descale: bool = False,
    max_num_splits: int = 0, provider: Optional[str] = None,
) -> CascadeAttentionPlan:
    """Plan `cascade_attention` for one batch (its batch tensors, as host ints where it takes
    them, and the layers' shapes, dtypes and features); `run` it per layer. The passes are
    the op's, so the result is too."""
    if common_prefix_len <= 0 or common_prefix_len % page_size:
        raise ValueError(f"common_prefix_len={common_prefix_len} must be a positive multiple "
                         f"of the page size {page_size}")
    head_size_v = head_size if head_size_v is None else head_size_v
    out_dtype = out_dtype or (torch.bfloat16 if q_dtype.itemsize == 1 else q_dtype)
    passes = cascade_passes(cu_query_lens, max_query_len, cu_prefix_query_lens,
                            prefix_kv_lens, suffix_kv_lens, max_kv_len, block_table,
                            common_prefix_len, num_tokens, common_prefix_len // page_size)
    common = dict(num_tokens=num_tokens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                  head_size=head_size, head_size_v=head_size_v, q_dtype=q_dtype,
                  kv_dtype=kv_dtype, out_dtype=out_dtype, page_size=page_size,
                  softmax_scale=softmax_scale, softcap=logits_soft_cap,
                  use_q_descale=use_q_descale, use_kv_descale=use_kv_descale,
                  return_softmax_lse=True, num_splits=max_num_splits, provider=provider)
    prefix = plan_varlen_attention(**passes[0], **common, use_sinks=use_sinks)
    suffix = plan_varlen_attention(**passes[1], **common)
    return CascadeAttentionPlan(prefix, suffix, cu_query_lens.shape[0] - 1, num_kv_heads,
                                (num_tokens, num_heads, head_size_v), out_dtype,
                                cu_query_lens.device)
