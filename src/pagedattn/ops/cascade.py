"""Cascade attention: a prefix shared by every request of a batch is attended once for all.

Plain paged attention streams the shared prefix's keys once per request. Cascade attention
splits each request's keys into the common prefix and its own suffix: one non-causal pass
of all the batch's queries (as one sequence) over the prefix, one causal pass of each request
over its suffix, then `merge_attn_states` combines the two partial states exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

from pagedattn.ops.attention import flash_attn_varlen_func
from pagedattn.ops.checks import check_cascade_args
from pagedattn.ops.merge import merge_attn_states

# Cost model (use_cascade_attention), in KV-tile loads per SM; fitted on an H100 (PERFORMANCE.md)
MIN_PREFIX_TOKENS = 256  # a shorter prefix saves less than the extra passes cost
MIN_REQS = 8  # with fewer requests, the prefix is read few times anyway
TILE_ROWS = 64  # query rows (tokens x GQA group) one attention program covers
KV_TILE = 64  # keys one program streams per step
LATENCY_FACTOR = 3  # a program alone on an SM streams a tile ~3x slower than a busy SM does
PLAIN_SPLITS = 64  # plain decodes split each sequence's keys over up to this many programs
PREFIX_KEYS_PER_SPLIT = 512  # the prefix pass splits like ops/triton's prefill pass
EXTRA_PASS_TILES = 16  # the suffix pass, the split reduce and the merge: ~20 us on an H100


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
    num_tokens, num_reqs = query.shape[0], cu_query_lens.shape[0] - 1
    common = dict(softmax_scale=softmax_scale, softcap=logits_soft_cap,
                  return_softmax_lse=True, num_splits=max_num_splits, fa_version=fa_version)
    prefix_output, prefix_lse = flash_attn_varlen_func(
        q=query, k=key_cache, v=value_cache, out=torch.empty_like(output),
        cu_seqlens_q=cu_prefix_query_lens, max_seqlen_q=num_tokens, seqused_k=prefix_kv_lens,
        max_seqlen_k=common_prefix_len, causal=False, block_table=block_table[:1, :prefix_blocks],
        scheduler_metadata=prefix_scheduler_metadata, s_aux=s_aux,
        **_descales(q_descale, k_descale, v_descale, 1, num_kv_heads), **common)
    suffix_output, suffix_lse = flash_attn_varlen_func(
        q=query, k=key_cache, v=value_cache, out=torch.empty_like(output),
        cu_seqlens_q=cu_query_lens, max_seqlen_q=max_query_len, seqused_k=suffix_kv_lens,
        max_seqlen_k=max_kv_len - common_prefix_len, causal=True,
        block_table=block_table[:, prefix_blocks:], scheduler_metadata=suffix_scheduler_metadata,
        **_descales(q_descale, k_descale, v_descale, num_reqs, num_kv_heads), **common)
    merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse)
    return output


def _descales(q: Optional[torch.Tensor], k: Optional[torch.Tensor], v: Optional[torch.Tensor],
              rows: int, num_kv_heads: int) -> dict:
    """flash-attn's [rows, num_kv_heads] descales, from scalars (expanded) or per-request rows."""
    out = {}
    for name, d in (("q_descale", q), ("k_descale", k), ("v_descale", v)):
        if d is not None:
            out[name] = d[:rows] if d.dim() == 2 else d.reshape(()).expand(rows, num_kv_heads)
    return out


def use_cascade_attention(common_prefix_len: int, query_lens: Sequence[int],
                          num_query_heads: int, num_kv_heads: int, use_alibi: bool,
                          use_sliding_window: bool, use_local_attention: bool,
                          num_sms: int) -> bool:
    """Whether cascade attention is both correct and faster for this batch.

    Correct: never with ALiBi, sliding windows or local (chunked) attention, whose masks and
    biases depend on each query's position, which the shared prefix pass gives up.

    Faster: attention over a long prefix is bound by streaming its K/V tiles. A program covers
    TILE_ROWS query rows (tokens x the GQA group) of one KV head, so plain attention loads each
    prefix tile once per (request, query tile, KV head), and the prefix pass of cascade once per
    (query tile of the whole batch, KV head): 64 decodes, 64 programs per KV head vs 4. A
    schedule takes the longer of its throughput time (its tile loads over the SMs) and its
    critical path (a program's share of the prefix, streamed LATENCY_FACTOR times slower alone,
    over its key splits: both passes split when their programs cannot fill the SMs), cascade
    plus EXTRA_PASS_TILES (suffix pass, merge). It wins once enough requests read the prefix
    (8 decodes over 8k keys, 64 over 2k). Prefills gain nothing: a long query already shares
    each tile among its TILE_ROWS rows.
    """
    if use_alibi or use_sliding_window or use_local_attention:
        return False
    lens = [int(q) for q in query_lens]
    if common_prefix_len < MIN_PREFIX_TOKENS or len(lens) < MIN_REQS:
        return False
    group = max(1, num_query_heads // num_kv_heads)
    tiles = -(-common_prefix_len // KV_TILE)
    plain_programs = num_kv_heads * sum(-(-q * group // TILE_ROWS) for q in lens)
    cascade_programs = num_kv_heads * -(-sum(lens) * group // TILE_ROWS)
    prefix_splits = max(1, min(-(-2 * num_sms // cascade_programs), PLAIN_SPLITS,
                               common_prefix_len // PREFIX_KEYS_PER_SPLIT))  # < 2 per SM

    def time(programs: int, splits: int) -> int:
        throughput = -(-programs * tiles // max(1, num_sms))
        return max(throughput, -(-tiles * LATENCY_FACTOR // splits))

    cascade = time(cascade_programs, prefix_splits) + EXTRA_PASS_TILES
    return cascade < time(plain_programs, PLAIN_SPLITS)
