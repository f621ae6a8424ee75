"""Decode context parallelism (DCP) ops: merging the ranks' partial attention states exactly.

Each rank of a DCP group attends all the group's query heads over the KV positions it stores
and gets a partial output and LSE per (token, head). `cp_lse_ag_out_rs` all-gathers the LSEs,
rescales this rank's partial output by its share of the full softmax (`correct_attn_out`: one
fused kernel, Triton on CUDA, PyTorch elsewhere) and reduce-scatters the outputs so each rank
ends with the full result of its own heads. LSEs use flash-attn's [num_heads, num_tokens].
"""

from __future__ import annotations

from typing import Optional

import torch

from pagedattn.distributed import ParallelGroup, all_gather, reduce_scatter
from pagedattn.kv_sharding import KVSharding
from pagedattn.ops.checks import check_shape, check_tensor
from pagedattn.ops.providers import provider_name
from pagedattn.ops.torch import context_parallel as torch_cp

_FLOAT = (torch.float16, torch.bfloat16, torch.float32)


def correct_attn_out(out: torch.Tensor, lses: torch.Tensor, rank: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rescale one rank's partial attention state to its share of the merged softmax.

    Args:
        out: [num_tokens, num_heads, head_size_v] this rank's partial output.
        lses: [world_size, num_heads, num_tokens] float32, every rank's LSE (+-inf: empty).
        rank: which entry of `lses` is this rank's.
    Returns:
        (corrected [num_heads, num_tokens, head_size_v] float32, head-major; the merged LSE
        [num_heads, num_tokens] float32). Summing `corrected` over the ranks gives the output.
    """
    check_tensor("out", out, 3, _FLOAT)
    check_tensor("lses", lses, 3, (torch.float32,), out.device)
    world = lses.shape[0]
    check_shape("lses", lses, (world, out.shape[1], out.shape[0]))
    if not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"rank={rank!r} must be in [0, {world}) (lses has {world} entries)")
    if provider_name(out.device) == "triton":
        from pagedattn.ops.triton import context_parallel as triton_cp
        return triton_cp.correct_attn_out(out, lses, rank)
    return torch_cp.correct_attn_out(out, lses, rank)


def cp_lse_ag_out_rs(cp_attn_out: torch.Tensor, cp_attn_lse: torch.Tensor,
                     group: ParallelGroup, return_lse: bool = False
                     ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """All-gather LSEs, correct, reduce-scatter outputs over the heads (vLLM's name).

    Args:
        cp_attn_out: [num_tokens, world * num_heads, head_size_v]: this rank's partial output
            for the query heads of every rank of `group` (rank order).
        cp_attn_lse: [world * num_heads, num_tokens] float32, its LSE.
        group: the DCP group (`pagedattn.distributed.get_dcp_group()`).
    Returns:
        [num_tokens, num_heads, head_size_v] float32 for this rank's heads (and its LSE
        [num_heads, num_tokens] with return_lse).
    """
    world, rank = group.world_size, group.rank_in_group
    check_tensor("cp_attn_lse", cp_attn_lse, 2, (torch.float32,), cp_attn_out.device)
    num_heads = cp_attn_out.shape[1]
    if num_heads % world:
        raise ValueError(f"cp_attn_out has {num_heads} heads, not a multiple of the DCP group "
                         f"size {world}")
    lses = all_gather(cp_attn_lse.contiguous(), group).view(world, *cp_attn_lse.shape)
    corrected, lse = correct_attn_out(cp_attn_out, lses, rank)
    out = reduce_scatter(corrected, group, dim=0).transpose(0, 1)  # [T, H / world, Dv]
    if not return_lse:
        return out
    local = num_heads // world
    return out, lse[rank * local:(rank + 1) * local]


def sharded_context_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, *, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
    local_context_lens: torch.Tensor, block_table: torch.Tensor, sharding: KVSharding,
    softmax_scale: float, window_left: int = -1, softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None, q_descale: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None, v_descale: Optional[torch.Tensor] = None,
) -> None:
    """Attention of q over the cached context this rank stores, with the sliding window and
    ALiBi in global positions (PyTorch on every device; see ops/torch/context_parallel.py).

    q [T, H, D]; caches [num_blocks, block_size, Hkv, D(v)]; out [T, H, Dv] and lse [H, T]
    float32 are written (rows with no visible key: 0 and -inf). `context_lens` [B] are the
    requests' cached lengths (seq_len - query_len, all ranks together), `local_context_lens`
    [B] how many of those this rank stores, `block_table` [B, max_blocks] this rank's.
    """
    check_tensor("q", q, 3, None)
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("context_lens", context_lens),
                    ("local_context_lens", local_context_lens), ("block_table", block_table)):
        check_tensor(name, t, None, (torch.int32,), q.device)
    check_shape("out", out, (q.shape[0], q.shape[1], v_cache.shape[-1]), (torch.float32,))
    check_shape("lse", lse, (q.shape[1], q.shape[0]), (torch.float32,))
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"q has {q.shape[1]} heads, not a multiple of the cache's "
                         f"{k_cache.shape[2]} KV heads")
    torch_cp.sharded_context_attention(
        q, k_cache, v_cache, out, lse, cu_seqlens_q=cu_seqlens_q, context_lens=context_lens,
        local_context_lens=local_context_lens, block_table=block_table, sharding=sharding,
        softmax_scale=softmax_scale, window_left=window_left, softcap=softcap,
        alibi_slopes=alibi_slopes, q_descale=q_descale, k_descale=k_descale,
        v_descale=v_descale)
