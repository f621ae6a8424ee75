"""Decode context parallelism in plain PyTorch: the LSE correction of a rank's partial state,
and attention over a rank's KV shard with masks in global positions.

`sharded_context_attention` exists because a shard holds every world-th run of positions, so
the paged kernels' masks (which see local key indices) cannot express a sliding window or
ALiBi in global positions; here each key carries its global position. Host-side loop over
requests: it serves the layers with those features, not the hot path of plain layers.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from pagedattn.kv_sharding import KVSharding

_CHUNK_ELEMENTS = 1 << 24  # float32 scores per chunk of queries


def correct_attn_out(out: torch.Tensor, lses: torch.Tensor, rank: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """out [T, H, Dv] (this rank's partial state), lses [world, H, T] float32 (every rank's)
    -> (out rescaled to its share of the full softmax, head-major [H, T, Dv] float32;
    the full LSE [H, T]). An LSE of +-inf marks an empty part; all empty gives 0 and -inf."""
    lses = lses.float().masked_fill(torch.isinf(lses), -math.inf)
    top = lses.amax(dim=0)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    total = torch.exp(lses - top).sum(dim=0)
    lse = torch.log(total) + top  # log(0) = -inf where every part is empty
    factor = torch.exp(lses[rank] - lse).nan_to_num(nan=0.0)  # -inf - -inf: empty, weight 0
    return out.float().transpose(0, 1) * factor[..., None], lse


def sharded_context_attention(
    q: torch.Tensor,  # [T, H, D] (fp8 with q_descale)
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], this rank's shard
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, Dv]
    out: torch.Tensor,  # [T, H, Dv], written
    lse: torch.Tensor,  # [H, T] float32, written
    *,
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    context_lens: torch.Tensor,  # [B] int32: cached positions of each request (all ranks)
    local_context_lens: torch.Tensor,  # [B] int32: how many of them this rank stores
    block_table: torch.Tensor,  # [B, max_blocks] int32, this rank's
    sharding: KVSharding,
    softmax_scale: float,
    window_left: int,  # -1: unbounded
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],  # [H] float32
    q_descale: Optional[torch.Tensor] = None,  # [B, Hkv] float32
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
) -> None:
    """Attention of every query over the cached context this rank stores; the context
    precedes every query, so only the window and ALiBi depend on positions."""
    num_heads, block_size, num_kv_heads = q.shape[1], k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out.zero_()
    lse.fill_(-math.inf)
    starts = cu_seqlens_q.tolist()
    for b, (ctx, local) in enumerate(zip(context_lens.tolist(), local_context_lens.tolist())):
        first = 0 if window_left < 0 else sharding.local_len(max(ctx - window_left, 0))
        if starts[b + 1] == starts[b] or local <= first:
            continue
        idx = torch.arange(first, local, device=q.device)
        blocks = block_table[b, idx // block_size].long()
        keys = _scaled(k_cache[blocks, idx % block_size], k_descale, b)  # [L, Hkv, D]
        values = _scaled(v_cache[blocks, idx % block_size], v_descale, b)
        key_pos = sharding.global_pos(idx)
        step = max(1, _CHUNK_ELEMENTS // (num_heads * idx.shape[0]))
        for t0 in range(starts[b], starts[b + 1], step):
            t1 = min(t0 + step, starts[b + 1])
            x = q[t0:t1].float()
            if q_descale is not None:
                x = x * q_descale[b].repeat_interleave(group)[None, :, None]
            x = x.view(t1 - t0, num_kv_heads, group, -1)
            s = torch.einsum("tkgd,lkd->kgtl", x, keys) * softmax_scale
            if softcap > 0:
                s = softcap * torch.tanh(s / softcap)
            q_pos = ctx + torch.arange(t0 - starts[b], t1 - starts[b], device=q.device)
            rel = (key_pos[None, :] - q_pos[:, None]).float()  # [t, L]
            if alibi_slopes is not None:
                s = s + alibi_slopes.float().view(num_kv_heads, group, 1, 1) * rel
            if window_left >= 0:
                s = s.masked_fill(-rel > window_left, -math.inf)
            top = s.amax(dim=-1, keepdim=True)
            top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
            p = torch.exp(s - top)
            total = p.sum(dim=-1)  # [Hkv, g, t]
            o = torch.einsum("kgtl,lkd->tkgd", p, values)
            safe = torch.where(total == 0, torch.ones_like(total), total)
            out[t0:t1] = (o / safe.permute(2, 0, 1)[..., None]).reshape(t1 - t0, num_heads, -1)
            lse[:, t0:t1] = (torch.log(total) + top[..., 0]).reshape(num_heads, t1 - t0)


def _scaled(x: torch.Tensor, descale: Optional[torch.Tensor], b: int) -> torch.Tensor:
    x = x.float()
    return x if descale is None else x * descale[b][None, :, None]
