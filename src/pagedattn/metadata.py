"""Batch metadata shared by every backend, and the block bookkeeping that produces it.

`CommonAttentionMetadata` is what an engine hands each backend's builder once per batch (it
is defined beside `MetadataStager` in `metadata_staging`, since `from_lengths` is the stager).
`AttentionSpec` describes a layer group's cache. `BlockAllocator` and `BlockTable` are the
minimal paged-memory bookkeeping an engine (or a test, or the demo) needs to produce it: a
free list of cache blocks and per-request block ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from pagedattn.kv_sharding import KVSharding
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


class OutOfBlocksError(RuntimeError):
    """The KV cache has no free block left for a request."""


class BlockAllocator:
    """A free list of cache block ids with reference counts.

    Allocation is LIFO, so freed blocks are reused first. A block can be held by several
    requests at once (a shared prompt prefix): `share` adds a holder, `free` drops one, and the
    block returns to the free list when its last holder lets go.
    """

    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks={num_blocks} must be positive")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._refs: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refcount(self, block: int) -> int:
        return self._refs.get(block, 0)

    def allocate(self, n: int = 1) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocksError(
                f"asked for {n} KV-cache blocks but only {len(self._free)} of "
                f"{self.num_blocks} are free; allocate a larger cache or run fewer requests")
        blocks = [self._free.pop() for _ in range(n)]
        self._refs.update(dict.fromkeys(blocks, 1))
        return blocks

    def share(self, blocks: Sequence[int]) -> None:
        """One more holder for each of `blocks`, which must be allocated."""
        for b in blocks:
            if b not in self._refs:
                raise ValueError(f"block {b} is not allocated, so it cannot be shared")
        for b in blocks:
            self._refs[b] += 1

    def free(self, blocks: Sequence[int]) -> list[int]:
        """Drop one holder of each block; returns the blocks that became free."""
        released = []
        for b in blocks:
            if b not in self._refs:
                raise ValueError(f"block {b} is not allocated (double free?)")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                del self._refs[b]
                self._free.append(b)
                released.append(b)
        return released


class BlockTable:
    """Per-request block ids, grown as sequences grow; produces block tables and slots.

    Under DCP each rank keeps its own table and allocator over its own cache (`sharding`):
    blocks hold only this rank's positions, `num_tokens` counts the whole request.
    """

    def __init__(self, allocator: BlockAllocator, block_size: int,
                 sharding: Optional[KVSharding] = None):
        if block_size <= 0:
            raise ValueError(f"block_size={block_size} must be positive")
        self.allocator = allocator
        self.block_size = block_size
        self.sharding = sharding or KVSharding()
        self.blocks: dict[object, list[int]] = {}
        self.num_tokens: dict[object, int] = {}

    def add_request(self, req_id: object, prefix_blocks: Sequence[int] = ()) -> None:
        """Start a request; `prefix_blocks` are full blocks it shares with earlier requests
        (their tokens are already cached, so the request starts with them computed)."""
        if req_id in self.blocks:
            raise ValueError(f"request {req_id!r} is already in the block table")
        if prefix_blocks and self.sharding.world_size > 1:
            raise ValueError("prefix_blocks (prefix caching) are not supported with decode "
                             "context parallelism: a shared block holds one rank's positions")
        self.allocator.share(prefix_blocks)
        self.blocks[req_id] = list(prefix_blocks)
        self.num_tokens[req_id] = len(prefix_blocks) * self.block_size

    def append_tokens(self, req_id: object, n: int) -> torch.Tensor:
        """Reserve cache slots for n new tokens of a request; returns their slots (int64)."""
        blocks = self.blocks[req_id]
        start = self.num_tokens[req_id]
        need = -(-self.sharding.local_len(start + n) // self.block_size) - len(blocks)
        if need > 0:
            blocks.extend(self.allocator.allocate(need))
        self.num_tokens[req_id] = start + n
        ids = torch.tensor(blocks or [0], dtype=torch.int64)[None]
        return slots_for_positions(ids, torch.tensor([start]), torch.tensor([n]),
                                   self.block_size, self.sharding)

    def free_request(self, req_id: object) -> list[int]:
        """Drop the request; returns the blocks that became free (not still shared)."""
        del self.num_tokens[req_id]
        return self.allocator.free(self.blocks.pop(req_id))

    def common_prefix_len(self, req_ids: Sequence[object]) -> int:
        """Tokens at the start of every request that sit in the very same full blocks: what
        cascade attention can read once for the whole batch."""
        if not req_ids or self.sharding.world_size > 1:  # no cascade under DCP
            return 0
        tables = [self.blocks[r] for r in req_ids]
        full = min(self.num_tokens[r] for r in req_ids) // self.block_size
        shared = 0
        while shared < full and all(t[shared] == tables[0][shared] for t in tables):
            shared += 1
        return shared * self.block_size

    def tensor(self, req_ids: Sequence[object], max_blocks: Optional[int] = None) -> torch.Tensor:
        """[len(req_ids), max_blocks] int32 block table; unused entries are 0 (never read)."""
        width = max_blocks or max((len(self.blocks[r]) for r in req_ids), default=0) or 1
        table = torch.zeros(len(req_ids), width, dtype=torch.int32)
        for i, r in enumerate(req_ids):
            ids = self.blocks[r]
            if len(ids) > width:
                raise ValueError(f"request {r!r} has {len(ids)} blocks > max_blocks={width}")
            table[i, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
        return table
