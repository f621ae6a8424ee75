"""What the PyTorch provider's attention derives from a batch alone, made once per batch.

How the requests are grouped, which cache blocks each group gathers and which gathered rows lie
past a request's end, each query chunk's token rows and which keys each row sees (for the fused
CPU kernel, as its additive mask) depend on the lengths and the block table, never on a layer.
A plan (`TorchAttentionPlan`) makes them when the step is planned and every layer only reads
them; the op (`varlen_attention` without a plan) makes them per call.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch

from pagedattn.ops.torch.paged_rows import (
    KeyRows,
    gather_rows,
    key_rows,
    request_groups,
    visible_keys,
)

# Padded scores (query rows x keys x heads) a group may carry before its requests are split
# by key length: below it, another group's calls cost more than the padding.
MIN_PADDING = 1 << 12
# (query row, key) pairs whose masks a batch keeps made for every layer: a long prefill's
# would take gigabytes (each chunk's are then made per run and dropped, as the op does), and
# its kernels dwarf making them anyway.
HELD_PAIRS = 1 << 20


@dataclass(frozen=True)
class MaskRule:
    """What a row sees, besides the batch's lengths; and how the masks are laid out."""

    causal: bool
    window_left: int  # -1: unbounded
    window_right: int
    group: int  # query heads per KV head
    fused: bool  # also the fused CPU kernel's additive mask


@dataclass(frozen=True)
class ChunkMasks:
    """Which keys each row of a query chunk sees (n requests by r rows, lk keys)."""

    visible: torch.Tensor  # [n, r, lk] bool
    rel: torch.Tensor  # [n, r, lk] int64: key minus query position (ALiBi's distance)
    # The fused kernel's additive mask without ALiBi: [n, 1, group * r, lk] float32, 0 where
    # visible, -inf elsewhere (a KV head's query heads stacked along the rows); None: unfused
    mask: Optional[torch.Tensor]
    sees_none: torch.Tensor  # [n, r, 1, 1] bool: rows that see no key (LSE -inf)


@dataclass(frozen=True)
class QueryChunk:
    """A run of query rows of one request group, padded: n requests by r rows."""

    tokens: torch.Tensor  # [n, r] int64: each row's token; padding: total_q (a spare row)
    q_index: torch.Tensor  # [n * r] int64: the query rows read (padding reads the last one)
    valid_row: torch.Tensor  # [n, r] bool: a real row, not padding
    q_pos: torch.Tensor  # [n, r] int64: the row's position among its request's keys
    k_len: torch.Tensor  # [n] int64: keys per request
    num_keys: int  # lk: the padded key length
    rule: MaskRule
    held: Optional[ChunkMasks]  # made with the batch (None: too large to keep)

    def masks(self) -> ChunkMasks:
        """The chunk's masks: those made with the batch, else made now."""
        return self.held if self.held is not None else _masks(self)


@dataclass(frozen=True)
class RequestGroup:
    """Requests whose keys are gathered and attended together."""

    reqs: torch.Tensor  # [n] int64
    keys: KeyRows  # where their keys and values are, padded to keys.num_keys
    chunks: tuple[QueryChunk, ...]


def paged_batch(cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor,
                cu_seqlens_k: Optional[torch.Tensor], block_table: Optional[torch.Tensor], *,
                total_q: int, max_seqlen_q: int, max_seqlen_k: int, num_heads: int,
                num_kv_heads: int, block_size: int, causal: bool, window_left: int,
                window_right: int, fused: bool, chunk_elements: int) -> list[RequestGroup]:
    """The batch's request groups (`request_groups`), each with its gather indices and query
    chunks of at most `chunk_elements` scores, and their masks while the batch's (row, key)
    pairs stay within `HELD_PAIRS`. `fused`: also the fused kernel's masks."""
    batch = seqused_k.shape[0]
    if batch == 0 or max_seqlen_q == 0:
        return []
    device = cu_seqlens_q.device
    max_seqlen_k = max(max_seqlen_k, 1)
    rule = MaskRule(causal, window_left, window_right, num_heads // num_kv_heads, fused)
    groups, held = [], 0
    for reqs, group_q, group_k in request_groups(cu_seqlens_q, seqused_k, batch, max_seqlen_q,
                                                 max_seqlen_k, num_heads, chunk_elements,
                                                 MIN_PADDING):
        reqs = reqs.to(device)
        lens = seqused_k[reqs]
        keys = key_rows(reqs, lens, cu_seqlens_k, block_table, group_k, block_size)
        q_chunk = max(1, min(group_q, chunk_elements // (num_heads * group_k * len(reqs))))
        chunks = []
        for i0 in range(0, group_q, q_chunk):
            rows = torch.arange(i0, min(group_q, i0 + q_chunk), device=device)
            held += len(reqs) * rows.shape[0] * group_k
            chunks.append(_query_chunk(cu_seqlens_q, lens.long(), reqs, rows, total_q, group_k,
                                       rule, held <= HELD_PAIRS))
        groups.append(RequestGroup(reqs, keys, tuple(chunks)))
    return groups


def _query_chunk(cu_seqlens_q, k_len, reqs, rows, total_q, lk, rule, hold) -> QueryChunk:
    q_start = cu_seqlens_q[reqs].long()
    q_len = cu_seqlens_q[reqs + 1].long() - q_start
    valid_row = rows[None, :] < q_len[:, None]  # [n, r]
    tokens = torch.where(valid_row, q_start[:, None] + rows[None, :], total_q)
    q_pos = (k_len - q_len)[:, None] + rows[None, :]  # [n, r]
    chunk = QueryChunk(tokens, tokens.clamp(max=total_q - 1).view(-1), valid_row, q_pos, k_len,
                       lk, rule, None)
    return dataclasses.replace(chunk, held=_masks(chunk)) if hold else chunk


def _masks(chunk: QueryChunk) -> ChunkMasks:
    rule, lk = chunk.rule, chunk.num_keys
    visible, rel = visible_keys(chunk.valid_row, chunk.q_pos, chunk.k_len, lk, rule.causal,
                                rule.window_left, rule.window_right)
    mask = None
    if rule.fused:
        n, r = chunk.tokens.shape
        mask = torch.zeros((n, 1, 1, r, lk), device=visible.device).masked_fill(
            ~visible[:, None, None], -math.inf).expand(n, 1, rule.group, r, lk).reshape(
            n, 1, rule.group * r, lk)
    return ChunkMasks(visible, rel, mask, ~visible.any(-1)[:, :, None, None])


def gather(cache: torch.Tensor, group: RequestGroup, descale: Optional[torch.Tensor],
           zero_past_end: bool) -> torch.Tensor:
    """[n, num_keys, num_kv_heads, D] float32 keys (or values) of the group's requests, with
    their descale ([batch, num_kv_heads] or None) applied (`gather_rows`)."""
    x = gather_rows(cache, group.keys, zero_past_end)
    if descale is not None:
        x = x * descale[group.reqs][:, None, :, None]
    return x
