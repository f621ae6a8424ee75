"""Block-sparse attention (local + vertical stride) in plain PyTorch: the CPU path.

The pattern is applied as a dense boolean mask (`sparse_mask`), so this path does the dense
work; the Triton kernels are the ones that skip blocks. Scores and softmax in float32.
Batch-invariant mode attends with `invariant.attend_rows` (each row's bits its own, prompt
rows and decodes alike).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from pagedattn.ops.torch.invariant import attend_rows

_CHUNK_ELEMENTS = 1 << 24  # float32 scores per chunk (64 MiB)


def head_offsets(num_heads: int, group: int, head_base: int, head_sliding_step: int,
                 device: torch.device) -> torch.Tensor:
    """[num_heads] vertical offsets: g * |step| + 1, g the query head's global index (step
    >= 0) or its KV head's (step < 0); head_base is the rank's first global query head."""
    g = torch.arange(head_base, head_base + num_heads, device=device)
    if head_sliding_step < 0:
        g = g // group
    return g * abs(head_sliding_step) + 1


def sparse_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, offsets: torch.Tensor,
                block_size: int, local_blocks: int, vert_stride: int) -> torch.Tensor:
    """[..., H, Lq, Lk] visibility for q_pos [..., Lq] and k_pos [Lk], offsets [H]."""
    qb = (q_pos // block_size)[..., None, :, None]
    kb = k_pos // block_size
    near = qb - kb < local_blocks  # [..., 1, Lq, Lk]
    strided = ((kb + offsets[:, None]) % max(1, vert_stride) == 0)[:, None, :]  # [H, 1, Lk]
    return (k_pos <= q_pos[..., None])[..., None, :, :] & (near | strided)


def _softmax_attend(s: torch.Tensor, visible: torch.Tensor, values: torch.Tensor,
                    equation: str) -> torch.Tensor:
    s = s.masked_fill(~visible, -math.inf)
    row_max = s.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    p = torch.exp(s - row_max)
    denom = p.sum(dim=-1, keepdim=True)
    return torch.einsum(equation, p / torch.where(denom == 0, torch.ones_like(denom), denom),
                        values)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, *,
                     cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, sm_scale: float,
                     head_base: int, head_sliding_step: int, block_size: int,
                     local_blocks: int, vert_stride: int,
                     q_block_size: Optional[int] = None, batch_invariant: bool = False) -> None:
    """Packed varlen prefill: q [total_q, H, D], k/v [total_k, Hkv, D]; queries are the last
    q_len positions of each sequence. Writes out [total_q, H, D] (q_block_size: a kernel
    tile, no effect here)."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_heads // num_kv_heads
    offsets = head_offsets(num_heads, group, head_base, head_sliding_step, q.device)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()  # host lengths: the CPU path
    for b in range(len(cq) - 1):
        lq, lk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        if lq == 0:
            continue
        k_pos = torch.arange(lk, device=q.device)
        if batch_invariant:
            keys, values = k[ck[b]:ck[b + 1]].float()[None], v[ck[b]:ck[b + 1]].float()[None]
            chunk = max(1, _CHUNK_ELEMENTS // (num_heads * 2 * lk * 2 * q.shape[-1]))
            for i0 in range(0, lq, chunk):
                i1 = min(lq, i0 + chunk)
                q_pos = torch.arange(lk - lq + i0, lk - lq + i1, device=q.device)
                visible = sparse_mask(q_pos, k_pos, offsets, block_size, local_blocks,
                                      vert_stride).transpose(0, 1)[None]  # [1, rows, H, Lk]
                o = attend_rows(q[cq[b] + i0:cq[b] + i1].float()[None], keys, values, visible,
                                sm_scale)
                out[cq[b] + i0:cq[b] + i1] = o[0].to(out.dtype)
            continue
        keys = k[ck[b]:ck[b + 1]].float().repeat_interleave(group, dim=1)  # [Lk, H, D]
        values = v[ck[b]:ck[b + 1]].float().repeat_interleave(group, dim=1)
        chunk = max(1, _CHUNK_ELEMENTS // max(1, num_heads * lk))
        for i0 in range(0, lq, chunk):
            i1 = min(lq, i0 + chunk)
            x = q[cq[b] + i0:cq[b] + i1].float()
            s = torch.einsum("chd,khd->hck", x, keys) * sm_scale
            q_pos = torch.arange(lk - lq + i0, lk - lq + i1, device=q.device)
            visible = sparse_mask(q_pos, k_pos, offsets, block_size, local_blocks, vert_stride)
            o = _softmax_attend(s, visible, values, "hck,khd->chd")
            out[cq[b] + i0:cq[b] + i1] = o.to(out.dtype)


def paged_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 out: torch.Tensor, *, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 scale: float, head_base: int, head_sliding_step: int, block_size: int,
                 local_blocks: int, vert_stride: int, alibi_slopes: Optional[torch.Tensor],
                 k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor],
                 max_seq_len: int, num_splits: int = 0,
                 workspace: Optional[tuple[torch.Tensor, ...]] = None,
                 batch_invariant: bool = False) -> None:
    """One query per sequence over the v0 cache: query [S, H, D], key_cache [num_blocks,
    Hkv, D // x, page, x], value_cache [num_blocks, Hkv, D, page]; the query sits at position
    seq_len - 1. fp8 caches are read as x8 * scale. Writes out [S, H, D]. `workspace`
    (the Triton kernel's split-KV scratch) and num_splits do not apply here."""
    num_seqs, num_heads, head_size = query.shape
    num_kv_heads, page = key_cache.shape[1], key_cache.shape[3]
    group = num_heads // num_kv_heads
    offsets = head_offsets(num_heads, group, head_base, head_sliding_step, query.device)
    width = block_tables.shape[1] * page
    pos = torch.arange(width, device=query.device)
    chunk = max(1, _CHUNK_ELEMENTS // max(1, width * num_kv_heads * head_size))
    if batch_invariant:  # products [n, H, keys, D] padded to powers of two
        chunk = max(1, _CHUNK_ELEMENTS // (num_heads * 2 * width * 2 * head_size))
    for s0 in range(0, num_seqs, chunk):
        s1 = min(num_seqs, s0 + chunk)
        blocks = block_tables[s0:s1].long()  # [n, max_blocks]
        n = s1 - s0
        keys = key_cache[blocks].permute(0, 1, 4, 2, 3, 5).reshape(n, width, num_kv_heads,
                                                                    head_size).float()
        values = value_cache[blocks].permute(0, 1, 4, 2, 3).reshape(n, width, num_kv_heads,
                                                                    head_size).float()
        if k_scale is not None:
            keys, values = keys * k_scale.float(), values * v_scale.float()
        lens = seq_lens[s0:s1].long()
        unused = (pos[None, :] >= lens[:, None])[..., None, None]
        keys, values = keys.masked_fill(unused, 0.0), values.masked_fill(unused, 0.0)
        q_pos = (lens - 1).clamp(min=0)[:, None]  # [n, 1]
        visible = sparse_mask(q_pos, pos, offsets, block_size, local_blocks, vert_stride)
        visible = visible & (lens > 0)[:, None, None, None]
        if batch_invariant:
            o = attend_rows(query[s0:s1].float()[:, None], keys, values,
                            visible.transpose(1, 2), scale,
                            (pos[None, :] - q_pos)[:, None], alibi_slopes)
            out[s0:s1] = o[:, 0].to(out.dtype)
            continue
        x = query[s0:s1].float().view(n, num_kv_heads, group, head_size)
        s = torch.einsum("nkgd,nlkd->nkgl", x, keys).reshape(n, num_heads, 1, width) * scale
        if alibi_slopes is not None:
            rel = (pos[None, :] - q_pos).float()  # [n, width]
            s = s + alibi_slopes.float()[None, :, None, None] * rel[:, None, None, :]
        o = _softmax_attend(s.view(n, num_kv_heads, group, 1, width),
                            visible.view(n, num_kv_heads, group, 1, width), values,
                            "nkgql,nlkd->nqkgd")
        out[s0:s1] = o.reshape(n, num_heads, head_size).to(out.dtype)
