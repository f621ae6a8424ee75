"""Batch-invariant paged attention in plain PyTorch: a query row's arithmetic depends on its
own inputs only, never on the rows beside it.

torch's fused CPU kernel and BLAS products choose their blocking from a call's shapes, so a
row's low bits change with its batch (on a CPU here a float32 matmul's rows differed with M,
and `exp2` / `sigmoid` round a vector's tail elements differently from its body). Here every
sum is a halving tree of elementwise adds over a power-of-two length: q.k over the head
dimension, the weights and the weighted values over the keys, key j in slot j. Both are
zero-padded, and halving a tree padded to 2L adds exact zeros first and leaves the tree of L,
so a row's sums do not depend on how far its batch pads it. Products, adds and divides are
exactly rounded elementwise ops, maxima are exact, and `exp`, `log` and `tanh` give an element
the same bits wherever it sits in a tensor (tests/test_batch_invariant.py checks that, and
the mode's results). The softmax is over all of a row's keys at once, in float32.

The price: twice a matmul's multiply-adds without BLAS, and products [rows, heads, keys, D]
bounded by `_CHUNK_ELEMENTS` per chunk.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from pagedattn.ops.torch.paged_rows import (
    gather_keys,
    named_index_errors,
    query_rows,
    request_groups,
    spare_rows,
    visible_keys,
    write_rows,
)

_CHUNK_ELEMENTS = 1 << 24  # float32 products per chunk (64 MiB)


def invariant_varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, *,
    cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor, cu_seqlens_k: Optional[torch.Tensor],
    block_table: Optional[torch.Tensor], max_seqlen_q: int, max_seqlen_k: int,
    softmax_scale: float, causal: bool, window_left: int, window_right: int, softcap: float,
    alibi_slopes: Optional[torch.Tensor], sinks: Optional[torch.Tensor],
    q_descale: Optional[torch.Tensor], k_descale: Optional[torch.Tensor],
    v_descale: Optional[torch.Tensor], softmax_lse: Optional[torch.Tensor],
) -> None:
    """`ops.torch.varlen_attention`'s contract (its argument comments), batch-invariant."""
    batch = seqused_k.shape[0]
    if batch == 0 or max_seqlen_q == 0:
        return
    total_q, num_heads, head_size = q.shape
    head_size_v = v.shape[-1]
    width = _pow2(max(head_size, head_size_v))
    out_rows, lse_rows = spare_rows(q, out)
    features = (softmax_scale, softcap, alibi_slopes, sinks)
    with named_index_errors(q, k, cu_seqlens_q, seqused_k, cu_seqlens_k, block_table,
                            max_seqlen_q, max_seqlen_k):
        for reqs, group_q, group_k in request_groups(
                cu_seqlens_q, seqused_k, batch, max_seqlen_q, max(max_seqlen_k, 1), num_heads,
                _CHUNK_ELEMENTS // width):
            slots = _pow2(group_k)
            pairs = max(1, _CHUNK_ELEMENTS // (num_heads * slots * width))  # (request, row)
            n = max(1, min(len(reqs), pairs))
            for r0 in range(0, len(reqs), n):
                sub = reqs[r0:r0 + n]
                lens = seqused_k[sub]
                keys, values = (_padded(gather_keys(
                    cache, sub, lens, cu_seqlens_k, block_table, group_k, descale, True),
                    slots, width) for cache, descale in ((k, k_descale), (v, v_descale)))
                step = max(1, min(group_q, pairs // len(sub)))
                for i0 in range(0, group_q, step):
                    rows = torch.arange(i0, min(group_q, i0 + step), device=q.device)
                    x, tokens, valid_row, q_pos, k_len = query_rows(
                        q, sub, rows, cu_seqlens_q, seqused_k, total_q, q_descale,
                        num_heads // keys.shape[2])
                    visible, rel = visible_keys(valid_row, q_pos, k_len, slots, causal,
                                                window_left, window_right)
                    o, lse = _attend(F.pad(x, (0, width - head_size)), keys, values,
                                     visible[:, :, None, None], rel, *features)
                    out_rows[tokens] = o[..., :head_size_v].to(out.dtype)
                    lse_rows[tokens] = lse
    write_rows(out, softmax_lse, out_rows, lse_rows)


def attend_rows(x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                visible: torch.Tensor, scale: float, rel: Optional[torch.Tensor] = None,
                alibi_slopes: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Batch-invariant attention of queries x [n, r, H, D] over keys [n, Lk, Hkv, D] and
    values [n, Lk, Hkv, Dv] (float32, values zero where never visible) where visible
    [n, r, H, Lk] (per head: a block-sparse pattern); rel [n, r, Lk] key minus query
    position for ALiBi (slopes [H]). Outputs [n, r, H, Dv] float32."""
    n, lk, num_kv_heads, head_size_v = values.shape
    num_heads = x.shape[2]
    width, slots = _pow2(max(x.shape[-1], head_size_v)), _pow2(lk)
    pad = slots - lk
    visible = F.pad(visible, (0, pad)).view(n, -1, num_kv_heads, num_heads // num_kv_heads,
                                            slots)
    rel = None if rel is None else F.pad(rel, (0, pad))
    o, _ = _attend(F.pad(x, (0, width - x.shape[-1])), _padded(keys, slots, width),
                   _padded(values, slots, width), visible, rel, scale, 0.0, alibi_slopes, None)
    return o[..., :head_size_v]


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _padded(x: torch.Tensor, slots: int, width: int) -> torch.Tensor:
    """Gathered keys or values [n, keys, Hkv, D] as [n, Hkv, slots, width], zero-padded."""
    return F.pad(x, (0, width - x.shape[-1], 0, 0, 0, slots - x.shape[1])).permute(0, 2, 1, 3)


def _tree_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over `dim` (a power-of-two length) by halving: slot i + slot i + n / 2."""
    n = x.shape[dim]
    while n > 1:
        n //= 2
        x = x.narrow(dim, 0, n) + x.narrow(dim, n, n)
    return x.squeeze(dim)


def _attend(x, keys, values, visible, rel, scale, softcap, alibi_slopes, sinks):
    """Queries x [n, r, H, width] over keys / values [n, Hkv, slots, width] where visible
    [n, r, Hkv, group, slots] (or broadcast to it; rel [n, r, slots]: key minus query
    position): outputs [n, r, H, width], LSEs [n, r, H]."""
    n, r, num_heads, width = x.shape
    num_kv_heads = keys.shape[1]
    group = num_heads // num_kv_heads
    x = x.view(n, r, num_kv_heads, group, 1, width)
    s = _tree_sum(x * keys[:, None, :, None], -1) * scale  # [n, r, Hkv, group, slots]
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        slopes = alibi_slopes.float().view(1, 1, num_kv_heads, group, 1)
        s = s + slopes * rel[:, :, None, None].float()
    s = s.masked_fill(~visible, -math.inf)
    m = s.amax(-1)  # exact whatever the order
    if sinks is not None:
        sink = sinks.float().view(1, 1, num_kv_heads, group).expand_as(m)
        m = torch.maximum(m, sink)
    m = m.masked_fill(m == -math.inf, 0.0)  # a row that sees nothing: e^(-inf - 0) = 0
    p = torch.exp(s - m[..., None])
    denom = _tree_sum(p, -1)
    if sinks is not None:
        denom = denom + torch.exp(sink - m)
    o = _tree_sum(p[..., None] * values[:, None, :, None], -2)  # [n, r, Hkv, group, width]
    # + 0.0 turns a -0.0 into 0.0 and leaves every other value as it is: a sum that is exactly
    # zero (a row that sees nothing: p = 0 against negative values) takes its sign from the
    # +0.0 padding, whose length follows the batch's longest request.
    o = o / denom.masked_fill(denom == 0, 1.0)[..., None] + 0.0
    lse = (torch.log(denom) + m).masked_fill(denom == 0, -math.inf)
    return o.view(n, r, num_heads, width), lse.view(n, r, num_heads)
