"""Paged / varlen attention in plain PyTorch: the CPU path, and the reference-speed baseline.

Batched tensor code with no host synchronisation: requests are grouped and padded (on the
CPU each group only to its own longest query and key range), keys are gathered through the
block table, and the work is cut into chunks of requests and queries so that one chunk's
score matrix stays under `_CHUNK_ELEMENTS`. What depends on the batch alone (the groups,
their gather indices, each chunk's token rows and mask: `paged_batch.py`) a plan
(`TorchAttentionPlan`) makes once for all its layers; `varlen_attention` makes it per call.
Scores and the softmax run in float32 whatever the input dtype.

On the CPU each chunk runs torch's fused flash-attention kernel
(`aten._scaled_dot_product_flash_attention_for_cpu`, what `F.scaled_dot_product_attention`
calls there, used directly because it also returns the LSE) with an explicit additive mask:
padding, causal offset and sliding window as -inf, ALiBi as the bias itself. The query heads
of one KV head are stacked along the query axis, so each key tile serves the whole group.
Sinks and the LSE output come from the kernel's LSE. Soft capping (a tanh of the scores,
which no fused kernel takes), values with another head size than keys (the kernel wants one)
and other devices run the padded einsum path below. Batch-invariant mode runs `invariant.py`.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from pagedattn.ops.torch.invariant import invariant_varlen_attention
from pagedattn.ops.torch.paged_batch import QueryChunk, RequestGroup, gather, paged_batch
from pagedattn.ops.torch.paged_rows import named_index_errors, spare_rows, write_rows

_CHUNK_ELEMENTS = 1 << 25  # float32 scores per chunk (128 MiB)
# torch's fused CPU attention that also returns the LSE (None on a torch without it)
_FUSED_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def varlen_attention(
    q: torch.Tensor,  # [total_q, num_heads, head_size]
    k: torch.Tensor,  # paged [num_blocks, block_size, Hkv, head_size] or dense [total_k, Hkv, ...]
    v: torch.Tensor,  # like k, with head_size_v
    out: torch.Tensor,  # [total_q, num_heads, head_size_v], written
    *,
    cu_seqlens_q: torch.Tensor,  # [batch + 1] int32
    seqused_k: torch.Tensor,  # [batch] int32: keys per request
    cu_seqlens_k: Optional[torch.Tensor],  # [batch + 1] int32, dense keys only
    block_table: Optional[torch.Tensor],  # [batch, max_blocks] int32, paged keys only
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    window_left: int,  # -1: unbounded
    window_right: int,
    softcap: float,  # 0: off
    alibi_slopes: Optional[torch.Tensor],  # [num_heads] float32
    sinks: Optional[torch.Tensor],  # [num_heads] float32
    q_descale: Optional[torch.Tensor],  # [batch, num_kv_heads] float32
    k_descale: Optional[torch.Tensor],
    v_descale: Optional[torch.Tensor],
    softmax_lse: Optional[torch.Tensor],  # [num_heads, total_q] float32, written
    num_splits: int = 0,  # split-KV is a kernel schedule; the result does not depend on it
    batch_invariant: bool = False,  # each row's bits independent of its batch (invariant.py)
) -> None:
    if batch_invariant:
        invariant_varlen_attention(
            q, k, v, out, cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k,
            cu_seqlens_k=cu_seqlens_k, block_table=block_table, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
            window_left=window_left, window_right=window_right, softcap=softcap,
            alibi_slopes=alibi_slopes, sinks=sinks, q_descale=q_descale, k_descale=k_descale,
            v_descale=v_descale, softmax_lse=softmax_lse)
        return
    with named_index_errors(q, k, cu_seqlens_q, seqused_k, cu_seqlens_k, block_table,
                            max_seqlen_q, max_seqlen_k):
        shapes = batch_shape(q.device, q.shape[0], q.shape[1], k.shape[-2], k.shape[1],
                             k.shape[-1], v.shape[-1], softcap)
        batch = paged_batch(cu_seqlens_q, seqused_k, cu_seqlens_k, block_table, **shapes,
                            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                            causal=causal, window_left=window_left,
                            window_right=window_right, chunk_elements=_CHUNK_ELEMENTS)
        attend_batch(batch, q, k, v, out, softmax_scale, softcap, alibi_slopes, sinks,
                     q_descale, k_descale, v_descale, softmax_lse)


def batch_shape(device: torch.device, total_q: int, num_heads: int, num_kv_heads: int,
                block_size: int, head_size: int, head_size_v: int, softcap: float) -> dict:
    """`paged_batch`'s arguments that come from the call's tensors and soft cap (block_size:
    the paged cache's; anything for dense keys)."""
    return dict(total_q=total_q, num_heads=num_heads, num_kv_heads=num_kv_heads,
                block_size=block_size,
                fused=(softcap <= 0 and device.type == "cpu" and _FUSED_CPU is not None
                       and head_size == head_size_v))


def attend_batch(batch: list[RequestGroup], q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, out: torch.Tensor, softmax_scale: float, softcap: float,
                 alibi_slopes: Optional[torch.Tensor], sinks: Optional[torch.Tensor],
                 q_descale: Optional[torch.Tensor], k_descale: Optional[torch.Tensor],
                 v_descale: Optional[torch.Tensor], softmax_lse: Optional[torch.Tensor]
                 ) -> None:
    """`varlen_attention` of one layer's tensors over a batch's groups (`paged_batch`, made
    for tensors of these shapes); the other arguments are `varlen_attention`'s. An IndexError
    is the caller's to name (`named_index_errors`)."""
    if not batch:
        return
    num_kv_heads = k.shape[-2]
    out_rows, lse_rows = spare_rows(q, out)
    fused = batch[0].chunks[0].rule.fused
    attend = _attend_chunk_fused if fused else _attend_chunk
    for group in batch:
        # The fused kernel adds the mask to the scores: a NaN key past the end (an
        # uninitialised block) would survive it, so keys are zeroed there too.
        keys = gather(k, group, k_descale, fused)
        values = gather(v, group, v_descale, True)
        for chunk in group.chunks:
            o, lse = attend(q, keys, values, group.reqs, chunk, softmax_scale, softcap,
                            alibi_slopes, sinks, q_descale, num_kv_heads)
            out_rows[chunk.tokens] = o.to(out.dtype)
            lse_rows[chunk.tokens] = lse
    write_rows(out, softmax_lse, out_rows, lse_rows)


class TorchAttentionPlan:
    """One batch's `varlen_attention` arguments, planned (`ops.plan.plan_varlen_attention`):
    `run` adds a layer's tensors. It takes [T, heads, D] tensors only (no 2-D rows).

    With `shapes` (`batch_shape`'s arguments but the tensors: the planned shapes, device and
    head sizes) the batch's groups, gather indices and masks (`paged_batch`) are made here,
    from the lengths and block table as they are now, and every `run` reads them: the plan
    then serves this batch only. Without (a CUDA-graph plan, which later batches replay, and
    batch-invariant mode) each run makes them again."""

    takes_rows = False

    def __init__(self, descale_shape: tuple[int, int], shapes: Optional[dict] = None,
                 **batch):
        self.descale_shape, self.batch = descale_shape, batch
        self.groups = None
        if shapes is not None and not batch["batch_invariant"]:
            # No tensor yet to name an index error against: ones of the planned shapes, with
            # every block and key row allowed.
            q = torch.empty((shapes["total_q"], 0))
            k = torch.empty((1 << 40, shapes["block_size"], 0, 0))
            with self._named_index_errors(q, k):
                self.groups = paged_batch(
                    batch["cu_seqlens_q"], batch["seqused_k"], batch["cu_seqlens_k"],
                    batch["block_table"], **shapes, max_seqlen_q=batch["max_seqlen_q"],
                    max_seqlen_k=batch["max_seqlen_k"], causal=batch["causal"],
                    window_left=batch["window_left"], window_right=batch["window_right"],
                    chunk_elements=_CHUNK_ELEMENTS)

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
            softmax_lse: Optional[torch.Tensor] = None,
            alibi_slopes: Optional[torch.Tensor] = None, sinks: Optional[torch.Tensor] = None,
            q_descale: Optional[torch.Tensor] = None, k_descale: Optional[torch.Tensor] = None,
            v_descale: Optional[torch.Tensor] = None, k_new: Optional[torch.Tensor] = None,
            v_new: Optional[torch.Tensor] = None) -> None:
        """`varlen_attention` of the planned batch, out of autograd as the op is. k_new /
        v_new (the new tokens' rows, which the Triton provider may read densely) are not
        needed here: the cache holds them."""
        shape = self.descale_shape
        q_descale, k_descale, v_descale = (broadcast_descale(d, shape)
                                           for d in (q_descale, k_descale, v_descale))
        with torch.no_grad():
            if self.groups is None:
                varlen_attention(q, k, v, out, **self.batch, alibi_slopes=alibi_slopes,
                                 sinks=sinks, q_descale=q_descale, k_descale=k_descale,
                                 v_descale=v_descale, softmax_lse=softmax_lse)
                return
            with self._named_index_errors(q, k):
                attend_batch(self.groups, q, k, v, out, self.batch["softmax_scale"],
                             self.batch["softcap"], alibi_slopes, sinks, q_descale, k_descale,
                             v_descale, softmax_lse)

    def _named_index_errors(self, q: torch.Tensor, k: torch.Tensor):
        b = self.batch
        return named_index_errors(q, k, b["cu_seqlens_q"], b["seqused_k"], b["cu_seqlens_k"],
                                  b["block_table"], b["max_seqlen_q"], b["max_seqlen_k"])


def broadcast_descale(d: Optional[torch.Tensor], shape: tuple[int, int]
                      ) -> Optional[torch.Tensor]:
    """A descale as `varlen_attention` takes it, [num_seqs, num_kv_heads] (`shape`): one
    value ((1,) or 0-d) is expanded to it without a copy; None stays None."""
    if d is None or d.dim() == 2:
        return d
    return d.float().reshape(()).expand(shape)


def _attend_chunk_fused(q, keys, values, reqs, chunk: QueryChunk, scale, softcap,
                        alibi_slopes, sinks, q_descale, num_kv_heads):
    """`_attend_chunk` on torch's fused CPU kernel (no soft cap)."""
    n, lk, _, d = keys.shape
    num_heads, r, dv = q.shape[1], chunk.tokens.shape[1], values.shape[-1]
    group = num_heads // num_kv_heads
    x = _queries(q, reqs, chunk, q_descale, group)
    # [n, Hkv, group * r, D]: a KV head's query heads stacked along the query axis
    x = x.view(n, r, num_kv_heads, group, d).permute(0, 2, 3, 1, 4).reshape(
        n, num_kv_heads, group * r, d)
    masks = chunk.masks()
    mask = masks.mask
    if alibi_slopes is not None:  # [n, Hkv, group, r, lk]: the bias is per head
        bias = alibi_slopes.float().view(1, num_kv_heads, group, 1, 1) * masks.rel[:, None, None]
        mask = bias.masked_fill(~masks.visible[:, None, None], -math.inf).reshape(
            n, -1, group * r, lk)
    o, lse = _FUSED_CPU(x, keys.transpose(1, 2), values.transpose(1, 2), 0.0, False,
                        attn_mask=mask, scale=scale)
    o = o.view(n, num_kv_heads, group, r, dv).permute(0, 3, 1, 2, 4)  # [n, r, Hkv, group, Dv]
    lse = lse.view(n, num_kv_heads, group, r).permute(0, 3, 1, 2)  # [n, r, Hkv, group]
    # The kernel reports LSE 0 for a row that sees no key; the contract says -inf.
    lse = lse.masked_fill(masks.sees_none, -math.inf)
    if sinks is not None:  # the sink joins the denominator: rescale by exp(lse - total)
        total = torch.logaddexp(lse, sinks.float().view(1, 1, num_kv_heads, group))
        o = o * torch.exp(lse - total)[..., None]
        lse = total
    return o.reshape(n, r, num_heads, dv), lse.reshape(n, r, num_heads)


def _attend_chunk(q, keys, values, reqs, chunk: QueryChunk, scale, softcap, alibi_slopes,
                  sinks, q_descale, num_kv_heads):
    n, lk, _, d = keys.shape
    num_heads = q.shape[1]
    group = num_heads // num_kv_heads
    x = _queries(q, reqs, chunk, q_descale, group).view(n, -1, num_kv_heads, group, d)
    # scores [n, Hkv, group, r, lk]
    s = torch.einsum("nrkgd,nlkd->nkgrl", x, keys) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    masks = chunk.masks()
    if alibi_slopes is not None:
        slopes = alibi_slopes.float().view(1, num_kv_heads, group, 1, 1)
        s = s + slopes * masks.rel[:, None, None].float()
    s = s.masked_fill(~masks.visible[:, None, None], -math.inf)
    row_max = s.amax(dim=-1)
    if sinks is not None:
        sink = sinks.float().view(1, num_kv_heads, group, 1).expand_as(row_max)
        row_max = torch.maximum(row_max, sink)
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    p = torch.exp(s - row_max[..., None])
    denom = p.sum(dim=-1)
    if sinks is not None:
        denom = denom + torch.exp(sink - row_max)
    o = torch.einsum("nkgrl,nlkd->nrkgd", p, values)
    o = o / torch.where(denom == 0, torch.ones_like(denom), denom).permute(0, 3, 1, 2)[..., None]
    lse = (torch.log(denom) + row_max).permute(0, 3, 1, 2)  # [n, r, Hkv, group]
    return o.reshape(n, -1, num_heads, values.shape[-1]), lse.reshape(n, -1, num_heads)


def _queries(q, reqs, chunk: QueryChunk, q_descale, group) -> torch.Tensor:
    """The chunk's queries, padded: [n, r, H, D] float32 (descaled)."""
    n, r = chunk.tokens.shape
    x = q.index_select(0, chunk.q_index).view(n, r, *q.shape[1:]).float()
    if q_descale is not None:
        x = x * q_descale[reqs].repeat_interleave(group, dim=1)[:, None, :, None]
    return x
