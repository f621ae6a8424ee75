"""Batch metadata shared by every backend, and the block bookkeeping that produces it.

`CommonAttentionMetadata` is what an engine hands each backend's builder once per batch (it
is defined beside `MetadataStager` in `metadata_staging`, since `from_lengths` is the stager).
`AttentionSpec` describes a layer group's cache. `BlockAllocator` and `BlockTable` (defined in
`block_table`) are the minimal paged-memory bookkeeping an engine (or a test, or the demo)
needs to produce it: a free list of cache blocks and per-request block ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pagedattn.block_table import BlockAllocator, BlockTable, OutOfBlocksError
from pagedattn.metadata_staging import CommonAttentionMetadata, slots_for_positions

__all__ = ["AttentionSpec", "BlockAllocator", "BlockTable", "CommonAttentionMetadata",
           "OutOfBlocksError", "slots_for_positions"]


@dataclass(frozen=True)
class AttentionSpec:
    """The shape of one layer group's KV cache, as builders need to know it."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    kv_cache_dtype: str = "auto"
    sliding_window: Optional[int] = None
    head_size_v: Optional[int] = None
