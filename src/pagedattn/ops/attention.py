"""`flash_attn_varlen_func`: paged or dense variable-length attention, flash-attn's signature.

One call serves a whole mixed batch: decodes, chunked prefills with cached context, and
full prefills. Keys come from a paged cache (`block_table` + `seqused_k`) or densely packed
(`cu_seqlens_k`). Query i of a request with k keys and q queries sits at position k - q + i
(bottom-right aligned), which is what "causal with a context offset" means.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional, Union

import torch

from pagedattn.ops import custom_ops
from pagedattn.ops.checks import (
    INDEX_DTYPES,
    check_descales,
    check_dim,
    check_flash_attn_only,
    check_keys,
    check_shape,
    check_tensor,
    check_varlen_scalars,
    check_window,
    require_tensor,
)
from pagedattn.ops.index_checks import check_query_lens_if_asked
from pagedattn.ops.plan import plan_varlen_attention
from pagedattn.ops.torch.attention import broadcast_descale

_FLOAT = (torch.float16, torch.bfloat16, torch.float32)
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    max_seqlen_q: int,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_k: int,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    q_v: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Optional[Sequence[int]] = None,
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Optional[torch.Tensor] = None,
    return_softmax_lse: bool = False,
    out: Optional[torch.Tensor] = None,
    scheduler_metadata: Optional[torch.Tensor] = None,
    q_descale: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
    num_splits: int = 0,
    fa_version: Optional[int] = None,
    s_aux: Optional[torch.Tensor] = None,
    batch_invariant: Optional[bool] = None,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Attention of q over (k, v) for a batch of variable-length requests.

    Args:
        q: [total_q, num_heads, head_size], fp16/bf16/fp32, or fp8 with `q_descale`.
        k, v: paged caches [num_blocks, block_size, num_kv_heads, head_size(_v)] (any strides,
            so NHD and HND physical layouts both work) with `block_table` and `seqused_k`; or
            dense [total_k, num_kv_heads, head_size(_v)] with `cu_seqlens_k`. fp8 caches are
            read as x8 * descale.
        cu_seqlens_q: [batch + 1] int32 query offsets. max_seqlen_q: the longest query.
        max_seqlen_k: an upper bound on keys per request.
        seqused_k: [batch] int32 keys per request (paged); cu_seqlens_k: [batch + 1] (dense).
        softmax_scale: defaults to head_size ** -0.5.
        causal: query at position p sees keys j <= p.
        window_size: (left, right): keys with p - left <= j <= p + right; -1 = unbounded.
        softcap: scores become softcap * tanh(scores / softcap); 0 disables.
        alibi_slopes: [num_heads] float32; adds slope * (j - p) to each score.
        block_table: [batch, max_blocks] int32 block ids.
        out: [total_q, num_heads, head_size_v] output buffer, any of fp16/bf16/fp32 (the
            result's dtype). None: a new one in q's dtype, and bf16 for an fp8 q, as vLLM's
            FlashAttention call (FA3) returns it.
        q_descale, k_descale, v_descale: float32 [batch, num_kv_heads], or one value for all
            ((1,) or 0-d, as vLLM's Triton backend passes it; broadcast), for fp8 inputs.
        num_splits: 0 chooses the split-KV schedule automatically (split when the batch
            cannot fill the GPU); n > 0 forces n splits of every request's keys. The result
            does not depend on it.
        s_aux: [num_heads] sink logits, added to each softmax denominator.
        return_softmax_lse: also return the float32 LSE [num_heads, total_q].
        batch_invariant: a request's rows the same bits in any batch (None: the mode of
            `pagedattn.ops.batch_invariant`).

    Rows with no visible key produce 0 and LSE -inf (with sinks, the sink logit). q_v,
    dropout_p, deterministic, return_attn_probs, scheduler_metadata and fa_version are accepted
    for flash-attn compatibility; values pagedattn cannot honour raise ValueError. Each call
    plans (Triton: or reuses an earlier call's plan, `ops/triton/op_plans.py`) and runs; an
    engine plans a batch once for its layers (`pagedattn.ops.plan`), as the builders do.
    """
    check_flash_attn_only(q_v, dropout_p, return_attn_probs)
    require_tensor("q", q, 3, _FLOAT + _FP8)
    device = q.device
    for name, t in (("k", k), ("v", v)):
        require_tensor(name, t, None, _FLOAT + _FP8, device)
    require_tensor("cu_seqlens_q", cu_seqlens_q, 1, INDEX_DTYPES, device)
    for name, t, ndim in (("cu_seqlens_k", cu_seqlens_k, 1), ("seqused_k", seqused_k, 1),
                          ("block_table", block_table, 2)):
        check_tensor(name, t, ndim, INDEX_DTYPES, device)
    batch, (total_q, num_heads, head_size) = cu_seqlens_q.shape[0] - 1, q.shape
    max_seqlen_q, max_seqlen_k, scale, softcap, num_splits = check_varlen_scalars(
        max_seqlen_q, max_seqlen_k, softmax_scale, softcap, num_splits, head_size)
    keep = seqused_k is not None  # one made here is new memory each call: no plan to meet again
    seqused_k = check_keys(k, v, block_table, seqused_k, cu_seqlens_k, batch, max_seqlen_k,
                           (q, cu_seqlens_q, max_seqlen_q))
    check_query_lens_if_asked(cu_seqlens_q, seqused_k, causal)  # PAGEDATTN_CHECK_INDICES=1
    num_kv_heads = k.shape[-2]
    check_dim("k", k, -1, head_size, "head_size of q")
    head_size_v = v.shape[-1]
    if out is None:  # an fp8 q gives bf16, as FlashAttention 3 (vLLM's FA call) returns it
        out = q.new_empty((total_q, num_heads, head_size_v),
                          dtype=torch.bfloat16 if q.dtype in _FP8 else q.dtype)
    check_shape("out", out, (total_q, num_heads, head_size_v), _FLOAT, device)
    left, right = check_window(window_size)
    check_descales((q_descale, k_descale, v_descale), (batch, num_kv_heads), device)
    for name, t in (("alibi_slopes", alibi_slopes), ("s_aux", s_aux)):
        check_shape(name, t, (num_heads,), None, device)
    lse = q.new_empty((num_heads, total_q), dtype=torch.float32) if return_softmax_lse else None
    alibi, sinks = (None if t is None else t.float() for t in (alibi_slopes, s_aux))
    if not torch.compiler.is_compiling():  # plan and run at once (no custom-op dispatch)
        plan = plan_varlen_attention(
            cu_seqlens_q=cu_seqlens_q, num_tokens=total_q, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k, num_heads=num_heads, num_kv_heads=num_kv_heads,
            head_size=head_size, head_size_v=head_size_v, q_dtype=q.dtype, kv_dtype=k.dtype,
            out_dtype=out.dtype, seqused_k=seqused_k, block_table=block_table,
            page_size=k.shape[1] if k.dim() == 4 else 1, cu_seqlens_k=cu_seqlens_k,
            softmax_scale=scale, causal=bool(causal), window_size=(left, right),
            softcap=softcap, use_alibi=alibi is not None, use_sinks=sinks is not None,
            use_q_descale=q_descale is not None, use_kv_descale=any(
                d is not None for d in (k_descale, v_descale)),
            return_softmax_lse=return_softmax_lse, num_splits=num_splits,
            batch_invariant=batch_invariant, keep=keep)
        plan.run(q, k, v, out, softmax_lse=lse, alibi_slopes=alibi, s_aux=sinks,
                 q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
        return (out, lse) if return_softmax_lse else out
    shape = (batch, num_kv_heads)  # compiling: one opaque custom op
    custom_ops.varlen_attention(
        q, k, v, out, cu_seqlens_q, seqused_k, None if k.dim() == 4 else cu_seqlens_k,
        block_table, max_seqlen_q, max_seqlen_k, scale, bool(causal), left, right,
        softcap, alibi, sinks, broadcast_descale(q_descale, shape),
        broadcast_descale(k_descale, shape), broadcast_descale(v_descale, shape), lse, num_splits,
        batch_invariant)  # None is decided when the op runs (tracing cannot read the mode)
    return (out, lse) if return_softmax_lse else out

