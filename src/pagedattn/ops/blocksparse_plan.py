"""Block-sparse decode planned once per batch and pattern
(`plan_blocksparse_paged_attention`), run per layer: `blocksparse_paged_attention`'s split
count and the kernels' batch arguments, decided once (what BLOCK_SPARSE_FLASH_ATTN's builder
plans for its decodes)."""

from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch

from pagedattn.ops.batch_invariant import batch_invariant_enabled
from pagedattn.ops.blocksparse import check_pattern, provider
from pagedattn.ops.checks import check_float
from pagedattn.ops.providers import provider_name


class BlocksparseDecodePlan:
    """One decode batch's block-sparse attention for one pattern, planned
    (`plan_blocksparse_paged_attention`): `run` per layer."""

    def __init__(self, kernels: ModuleType, splits: int, fp8: bool, **batch):
        self.kernels, self.splits, self.fp8, self.batch = kernels, splits, fp8, batch

    def run(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
            out: torch.Tensor, k_scale: Optional[torch.Tensor] = None,
            v_scale: Optional[torch.Tensor] = None,
            alibi_slopes: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`blocksparse_paged_attention`'s tensors for the planned batch, as the plan has
        them: query [num_seqs, num_heads, head_size], the v0 caches in their storage dtype,
        out (written); an fp8 cache's scales 0-d float32 tensors on the device."""
        self.kernels.paged_decode(
            query, key_cache, value_cache, out, **self.batch, alibi_slopes=alibi_slopes,
            k_scale=k_scale if self.fp8 else None, v_scale=v_scale if self.fp8 else None,
            num_splits=self.splits)
        return out


def plan_blocksparse_paged_attention(
    *, block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int, num_heads: int,
    num_kv_heads: int, page_size: int, kv_dtype: torch.dtype, scale: float,
    blocksparse_local_blocks: int, blocksparse_vert_stride: int, blocksparse_block_size: int,
    blocksparse_head_sliding_step: int, tp_rank: int = 0,
    workspace: Optional[tuple[torch.Tensor, ...]] = None, ops_provider: Optional[str] = None,
    batch_invariant: Optional[bool] = None, head_size: int = 128,
) -> BlocksparseDecodePlan:
    """Plan `blocksparse_paged_attention` for one batch (block_tables [num_seqs, max_blocks]
    and seq_lens [num_seqs] int32, read when it runs) and one pattern: the split-KV count and
    the kernels' batch arguments, decided once. vert_stride <= 1 is dense attention (one
    local window of every key, as `PagedAttention.forward_decode` runs it). batch_invariant:
    a sequence's rows the same bits in any batch (one split, whatever the batch; None: the
    mode of `pagedattn.ops.batch_invariant`). head_size: the layer's, whose tiles the split
    count models (`blocksparse_schedule.decode_splits`)."""
    check_pattern(blocksparse_block_size, blocksparse_local_blocks, blocksparse_vert_stride,
                  "blocksparse_")
    local, vert, sparse_block = (blocksparse_local_blocks, blocksparse_vert_stride,
                                 blocksparse_block_size)
    if vert <= 1:
        local, vert, sparse_block = 0, 1, page_size
    if sparse_block % page_size:
        raise ValueError(f"blocksparse_block_size={sparse_block} must be a multiple of the "
                         f"cache block size {page_size}")
    device = seq_lens.device
    ops_provider = ops_provider or provider_name(device)
    bound = min(max_seq_len, block_tables.shape[1] * page_size)
    invariant = batch_invariant_enabled(batch_invariant)
    splits = 0
    if ops_provider == "triton" and invariant:
        splits = 1  # a split count that follows the batch would move a row's merge
    elif ops_provider == "triton":
        from pagedattn.ops.triton.blocksparse_decode import split_count

        splits = split_count(device, seq_lens.shape[0], num_heads, num_kv_heads, bound,
                             blocksparse_head_sliding_step, sparse_block, local, vert,
                             kv_dtype.itemsize, head_size)
    return BlocksparseDecodePlan(
        provider(device, ops_provider), splits, kv_dtype.itemsize == 1,
        block_tables=block_tables, seq_lens=seq_lens,
        scale=check_float("scale", scale), head_base=tp_rank * num_heads,
        head_sliding_step=blocksparse_head_sliding_step, block_size=sparse_block,
        local_blocks=local, vert_stride=vert, max_seq_len=bound, workspace=workspace,
        batch_invariant=invariant)
