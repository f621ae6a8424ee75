"""The float64 oracle: the numerics contract of DESIGN.md, written for clarity, not speed.

Every provider and backend is checked against these functions. They never mutate their
inputs and share no code with `pagedattn` itself, so a bug there cannot hide here.

Score features are small named functions of (head, query position, key position), composed
in `_scores`; positions are absolute within the sequence (query token i of a sequence with
context length c sits at position c + i).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

import torch

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
# Where the float64 arithmetic runs: a GPU's float64 units when there is one (real-size cases
# there would take minutes on the host), the CPU otherwise. Results always come back on the CPU.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


# --- score and mask features -------------------------------------------------------------
def causal_visible(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    return k_pos <= q_pos


def window_visible(q_pos, k_pos, left: int, right: int) -> torch.Tensor:
    """flash-attn's window_size=(left, right); -1 means unbounded on that side."""
    ok = torch.ones_like(q_pos - k_pos, dtype=torch.bool)
    if left >= 0:
        ok &= q_pos - k_pos <= left
    if right >= 0:
        ok &= k_pos - q_pos <= right
    return ok


def alibi_bias(slope: float, q_pos, k_pos) -> torch.Tensor:
    return slope * (k_pos - q_pos).to(torch.float64)


def soft_cap(s: torch.Tensor, cap: float) -> torch.Tensor:
    return cap * torch.tanh(s / cap)


def blocksparse_visible(q_pos, k_pos, *, offset: int, block_size: int, local_blocks: int,
                        vert_stride: int) -> torch.Tensor:
    """vLLM's local + vertical-stride pattern for one head (causality applied separately):
    key block kb is seen from query block qb iff qb - kb < local_blocks or
    (kb + offset) % vert_stride == 0."""
    qb, kb = q_pos // block_size, k_pos // block_size
    return (qb - kb < local_blocks) | ((kb + offset) % vert_stride == 0)


def blocksparse_offset(global_head: int, group: int, head_sliding_step: int) -> int:
    """g * |step| + 1: g is the global query head, or its KV head when step < 0."""
    g = global_head if head_sliding_step >= 0 else global_head // group
    return g * abs(head_sliding_step) + 1


# --- attention over one sequence ----------------------------------------------------------
def attend_one_sequence(q, k, v, *, scale: float, causal: bool = True,
                        window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                        alibi_slopes: Optional[Sequence[float]] = None,
                        sinks: Optional[Sequence[float]] = None, head_mask=None):
    """q [Lq, H, D], k [Lk, Hkv, D], v [Lk, Hkv, Dv] -> (out [Lq, H, Dv], lse [H, Lq]), float64.

    Queries are the last Lq positions of the sequence (bottom-right aligned, like flash-attn).
    head_mask(h, q_pos, k_pos) -> bool, if given, further restricts what head h sees.
    """
    q, k, v = (t.to(DEVICE, torch.float64) for t in (q, k, v))
    lq, num_heads, _ = q.shape
    lk, num_kv_heads, head_size_v = v.shape
    group = num_heads // num_kv_heads
    q_pos = torch.arange(lk - lq, lk, device=DEVICE).view(-1, 1)
    k_pos = torch.arange(lk, device=DEVICE).view(1, -1)
    visible = window_visible(q_pos, k_pos, *window)
    if causal:
        visible &= causal_visible(q_pos, k_pos)
    out = torch.zeros(lq, num_heads, head_size_v, dtype=torch.float64, device=DEVICE)
    lse = torch.full((num_heads, lq), -math.inf, dtype=torch.float64, device=DEVICE)
    if lq == 0 or (lk == 0 and sinks is None):  # nothing to attend to: 0 and LSE -inf
        return out.cpu(), lse.cpu()
    for h in range(num_heads):
        kh, vh = k[:, h // group], v[:, h // group]
        s = scale * (q[:, h] @ kh.T)  # [Lq, Lk]
        if softcap > 0:
            s = soft_cap(s, softcap)
        if alibi_slopes is not None:
            s = s + alibi_bias(float(alibi_slopes[h]), q_pos, k_pos)
        seen = visible if head_mask is None else visible & head_mask(h, q_pos, k_pos)
        s = s.masked_fill(~seen, -math.inf)
        if sinks is not None:  # the sink is one more logit, in the denominator only
            s = torch.cat([s, torch.full((lq, 1), float(sinks[h]), dtype=torch.float64,
                                         device=DEVICE)], 1)
        row_max = s.max(dim=1, keepdim=True).values
        safe_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
        p = torch.exp(s - safe_max)
        denom = p.sum(dim=1, keepdim=True)
        p = p[:, :lk] / torch.where(denom == 0, torch.ones_like(denom), denom)
        out[:, h] = p @ vh
        lse[h] = (torch.log(denom) + safe_max).squeeze(1)
    return out.cpu(), lse.cpu()


# --- paged / varlen batches ---------------------------------------------------------------
def dequantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    return x.double() * scale


def gather_paged(cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """cache [num_blocks, block_size, Hkv, D] (logical view) -> [length, Hkv, D]."""
    block_size = cache.shape[1]
    pos = torch.arange(length)
    return cache[block_ids[pos // block_size].long(), pos % block_size]


def paged_attention(q, k_cache, v_cache, query_lens: Sequence[int], seq_lens: Sequence[int],
                    block_table: torch.Tensor, *, q_scale: float = 1.0, k_scale: float = 1.0,
                    v_scale: float = 1.0, **features):
    """A batch over a paged cache. q [sum(query_lens), H, D]; caches in logical NHD view.

    Returns float64 (out [total_q, H, Dv], lse [H, total_q]).
    """
    outs, lses, start = [], [], 0
    for b, (lq, lk) in enumerate(zip(query_lens, seq_lens)):
        k = dequantize(gather_paged(k_cache, block_table[b], lk), k_scale)
        v = dequantize(gather_paged(v_cache, block_table[b], lk), v_scale)
        o, lse = attend_one_sequence(dequantize(q[start:start + lq], q_scale), k, v, **features)
        outs.append(o)
        lses.append(lse)
        start += lq
    return torch.cat(outs), torch.cat(lses, dim=1)


def varlen_attention(q, k, v, query_lens: Sequence[int], key_lens: Sequence[int], **features):
    """Dense (non-paged) keys: k, v [sum(key_lens), Hkv, D]."""
    outs, lses, qs, ks = [], [], 0, 0
    for lq, lk in zip(query_lens, key_lens):
        o, lse = attend_one_sequence(q[qs:qs + lq], k[ks:ks + lk], v[ks:ks + lk], **features)
        outs.append(o)
        lses.append(lse)
        qs, ks = qs + lq, ks + lk
    return torch.cat(outs), torch.cat(lses, dim=1)


# --- cache write and state merge ----------------------------------------------------------
def quantize_for_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """What a cache of `cache_dtype` must hold for x: x / scale saturated, for fp8 dtypes."""
    if cache_dtype in FP8_MAX:
        bound = FP8_MAX[cache_dtype]
        return (x.double() / scale).clamp(-bound, bound).to(cache_dtype)
    return x.to(cache_dtype)


def cache_after_write(cache: torch.Tensor, x: torch.Tensor, slot_mapping: torch.Tensor,
                      scale: float = 1.0) -> torch.Tensor:
    """A copy of cache [num_blocks, block_size, Hkv, D] with token t written at slot_mapping[t]."""
    expected = cache.clone()
    block_size = cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            expected[slot // block_size, slot % block_size] = quantize_for_cache(
                x[t], cache.dtype, scale)
    return expected


def merge_states(prefix_out, prefix_lse, suffix_out, suffix_lse):
    """Exact merge of two partial softmax states; an LSE of +-inf marks an empty part.

    outputs [T, H, D], lse [H, T] -> (out float64 [T, H, D], lse float64 [H, T]).
    """
    pl = prefix_lse.double().T.clone()  # [T, H]
    sl = suffix_lse.double().T.clone()
    pl[torch.isinf(pl)] = -math.inf
    sl[torch.isinf(sl)] = -math.inf
    m = torch.maximum(pl, sl)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    wp, ws = torch.exp(pl - m), torch.exp(sl - m)
    total = wp + ws
    safe = torch.where(total == 0, torch.ones_like(total), total)
    out = (prefix_out.double() * (wp / safe)[..., None]
           + suffix_out.double() * (ws / safe)[..., None])
    return out, (torch.log(total) + m).T
