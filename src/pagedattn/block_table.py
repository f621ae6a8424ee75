"""The block bookkeeping of a paged KV cache: `BlockAllocator` (free block ids, reference
counted) and `BlockTable` (each request's block ids, grown as the request grows).

An engine calls them for every request of every step, so both keep their state in numpy
arrays and take a whole step in one call: `append_tokens_batch` hands out the step's new
blocks with one allocation and writes them into the requests' rows in place, and `tensor`
gathers the step's rows with one indexing operation. A 256-request decode step then costs a
few dozen array operations, not a few Python calls per request. The slots of the new tokens
are computed once per step, from the table, by `MetadataStager.make` (`from_lengths`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Optional, Union

import numpy as np
import torch

from pagedattn.kv_sharding import KVSharding

__all__ = ["BlockAllocator", "BlockTable", "OutOfBlocksError"]

Ints = Union[Sequence[int], np.ndarray]
# How many tensors share a storage (torch's own count; a view or `.numpy()` array adds one):
# `BlockTable.tensor` refills its buffer only while nobody holds the last table it returned.
_use_count = getattr(torch._C, "_storage_Use_Count", None)


class OutOfBlocksError(RuntimeError):
    """The KV cache has no free block left for a request."""


class BlockAllocator:
    """A free list of cache block ids with reference counts.

    Allocation is LIFO, so freed blocks are reused first. A block can be held by several
    requests at once (a shared prompt prefix): `share` adds a holder, `free` drops one, and the
    block returns to the free list when its last holder lets go.
    """

    def __init__(self, num_blocks: int):
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks={num_blocks!r} must be a positive int")
        self.num_blocks = num_blocks
        # A stack of free ids whose top (the end) goes out first: 0, 1, 2, ... at the start
        self._stack = np.arange(num_blocks - 1, -1, -1, dtype=np.int32)
        self._top = num_blocks
        self._refs = np.zeros(num_blocks, dtype=np.int32)

    @property
    def num_free(self) -> int:
        return self._top

    def refcount(self, block: int) -> int:
        return int(self._refs[block]) if 0 <= block < self.num_blocks else 0

    def allocate(self, n: int = 1) -> list[int]:
        return self.allocate_array(n).tolist()

    def allocate_array(self, n: int) -> np.ndarray:
        """n free blocks (int32), each with one holder; all or none."""
        if n > self._top:
            raise OutOfBlocksError(
                f"asked for {n} KV-cache blocks but only {self._top} of "
                f"{self.num_blocks} are free; allocate a larger cache or run fewer requests")
        if n < 0:
            raise ValueError(f"n={n} blocks: must be >= 0")
        blocks = self._stack[self._top - n:self._top][::-1].copy()
        self._top -= n
        self._refs[blocks] = 1
        return blocks

    def share(self, blocks: Ints) -> None:
        """One more holder for each of `blocks`, which must be allocated."""
        ids = self._checked(blocks, "is not allocated, so it cannot be shared")
        np.add.at(self._refs, ids, 1)

    def free(self, blocks: Ints) -> list[int]:
        """Drop one holder of each block (all or none); returns the blocks that became free,
        in the order given."""
        ids = self._checked(blocks, "is not allocated (double free?)")
        np.subtract.at(self._refs, ids, 1)
        left = self._refs[ids]
        if ids.size and left[left.argmin()] < 0:  # a block listed more often than held
            np.add.at(self._refs, ids, 1)
            raise ValueError(f"block {int(ids[np.flatnonzero(left < 0)[0]])} is not "
                             "allocated (double free?)")
        released = ids[left == 0]
        if released.size > 1:  # a block listed twice and freed: return it once
            _, first = np.unique(released, return_index=True)
            if first.size < released.size:
                released = released[np.sort(first)]
        self._stack[self._top:self._top + released.size] = released
        self._top += released.size
        return released.tolist()

    def _checked(self, blocks: Ints, not_held: str) -> np.ndarray:
        ids = np.asarray(blocks)
        if ids.size and ids.dtype.kind not in "iu":
            raise TypeError(f"block ids must be integers; got dtype {ids.dtype}")
        ids = ids.astype(np.int64, copy=False).reshape(-1)
        if ids.size:
            bad = (ids < 0) | (ids >= self.num_blocks)
            bad[~bad] = self._refs[ids[~bad]] == 0
            if bad.any():
                raise ValueError(f"block {int(ids[np.flatnonzero(bad)[0]])} {not_held}")
        return ids


class BlockTable:
    """Per-request block ids, grown as sequences grow; produces block tables and slots.

    Each request owns one row of a persistent int32 array (rows and columns grow by
    doubling; a finished request's row is reused), so a step's bookkeeping is one call:
    `append_tokens_batch(req_ids, num_tokens)` reserves the new tokens' blocks,
    `tensor(req_ids)` gathers the block table, and the slots come from
    `CommonAttentionMetadata.from_lengths` (or an engine's `MetadataStager`). `blocks` and
    `num_tokens` read a request's block ids (a list) and length, as mappings by request id.

    Under DCP each rank keeps its own table and allocator over its own cache (`sharding`):
    blocks hold only this rank's positions, `num_tokens` counts the whole request.
    """

    def __init__(self, allocator: BlockAllocator, block_size: int,
                 sharding: Optional[KVSharding] = None):
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size={block_size!r} must be a positive int")
        self.allocator = allocator
        self.block_size = block_size
        self.sharding = sharding or KVSharding()
        self._rows: dict[object, int] = {}  # request id -> its row
        self._spare_rows: list[int] = []  # rows of finished requests
        self._ids = np.zeros((8, 8), dtype=np.int32)  # [rows, blocks]; unused entries 0
        self._num_blocks = np.zeros(8, dtype=np.int64)  # per row
        self._num_tokens = np.zeros(8, dtype=np.int64)  # per row: the whole request's
        self._buffer: Optional[torch.Tensor] = None  # what `tensor` fills, reused
        self.blocks: Mapping[object, list[int]] = _BlockIds(self)
        self.num_tokens: Mapping[object, int] = _NumTokens(self)

    # --- requests ------------------------------------------------------------------------
    def add_request(self, req_id: object, prefix_blocks: Ints = ()) -> None:
        """Start a request; `prefix_blocks` are full blocks it shares with earlier requests
        (their tokens are already cached, so the request starts with them computed)."""
        if req_id in self._rows:
            raise ValueError(f"request {req_id!r} is already in the block table")
        n = len(prefix_blocks)
        if n and self.sharding.world_size > 1:
            raise ValueError("prefix_blocks (prefix caching) are not supported with decode "
                             "context parallelism: a shared block holds one rank's positions")
        self.allocator.share(prefix_blocks)
        row = self._spare_rows.pop() if self._spare_rows else len(self._rows)
        self._reserve(row + 1, n)
        self._ids[row, :n] = prefix_blocks
        self._num_blocks[row] = n
        self._num_tokens[row] = n * self.block_size
        self._rows[req_id] = row

    def free_request(self, req_id: object) -> list[int]:
        """Drop the request; returns the blocks that became free (not still shared)."""
        row = self._row(req_id)
        n = int(self._num_blocks[row])
        released = self.allocator.free(self._ids[row, :n])
        del self._rows[req_id]
        self._ids[row, :n] = 0
        self._num_blocks[row] = self._num_tokens[row] = 0
        self._spare_rows.append(row)
        return released

    # --- one step ------------------------------------------------------------------------
    def append_tokens_batch(self, req_ids: Sequence[object], num_tokens: Ints) -> np.ndarray:
        """Reserve cache room for num_tokens[i] new tokens of request req_ids[i], every
        request at once (one allocation for the whole step; nothing changes if it fails);
        returns the requests' new lengths (int64 [len(req_ids)], the step's seq_lens)."""
        rows = self._row_array(req_ids)
        n = _counts("num_tokens", num_tokens, rows.shape[0])
        if len(set(req_ids)) != rows.shape[0]:
            raise ValueError("req_ids lists a request twice; give each request's tokens once")
        seq_lens = self._num_tokens[rows] + n
        stored = seq_lens if self.sharding.world_size == 1 else \
            self.sharding.local_len(seq_lens)
        need = -(-stored // self.block_size)  # blocks each request holds after this step
        have = self._num_blocks[rows]
        grow = need - have
        total = int(grow.sum())
        if total:
            new = self.allocator.allocate_array(total)
            self._reserve(0, int(need[need.argmax()]))
            # new block k goes to the request it falls to, in the column after its last one
            skip = np.repeat(np.add.accumulate(grow) - grow - have, grow)
            self._ids[np.repeat(rows, grow), np.arange(total) - skip] = new
            self._num_blocks[rows] = need
        self._num_tokens[rows] = seq_lens
        return seq_lens

    def append_tokens(self, req_id: object, n: int) -> torch.Tensor:
        """Reserve cache slots for n new tokens of one request; returns their slots (int64;
        -1 for positions another DCP rank stores). A step of many requests is one
        `append_tokens_batch` call, its slots `from_lengths`'."""
        row = self._row(req_id)
        start = int(self._num_tokens[row])
        self.append_tokens_batch((req_id,), (n,))
        pos = np.arange(start, start + n)
        ids, bs = self._ids[row], self.block_size  # (after the append: it may grow _ids)
        if self.sharding.world_size == 1:
            return torch.from_numpy(ids[pos // bs].astype(np.int64) * bs + pos % bs)
        here = self.sharding.owner(pos) == self.sharding.rank
        local = np.where(here, self.sharding.local_len(pos), 0)  # index among this rank's
        slots = ids[local // bs].astype(np.int64) * bs + local % bs
        slots[~here] = -1
        return torch.from_numpy(slots)

    def tensor(self, req_ids: Sequence[object], max_blocks: Optional[int] = None
               ) -> torch.Tensor:
        """[len(req_ids), max_blocks] int32 block table (default width: the longest
        request's); unused entries are 0 (never read). One gather into a buffer this table
        reuses (pinned where CUDA is available) once nothing holds the table it last
        returned: a caller uploading it with non_blocking holds it until the copy is done."""
        rows = self._row_array(req_ids)
        counts = self._num_blocks[rows]
        longest = int(counts[counts.argmax()]) if rows.shape[0] else 0
        width = max_blocks or longest or 1
        if longest > width:
            i = int(np.flatnonzero(counts > width)[0])
            raise ValueError(f"request {req_ids[i]!r} has {int(counts[i])} blocks > "
                             f"max_blocks={width}")
        table, out = self._table_buffer(rows.shape[0], width)
        cols = min(width, self._ids.shape[1])  # columns past every row's blocks: zeros
        np.take(self._ids[:, :cols], rows, axis=0, out=table[:, :cols], mode="clip")
        table[:, cols:] = 0
        return out

    def common_prefix_len(self, req_ids: Sequence[object]) -> int:
        """Tokens at the start of every request that sit in the very same full blocks: what
        cascade attention can read once for the whole batch."""
        if not len(req_ids) or self.sharding.world_size > 1:  # no cascade under DCP
            return 0
        rows = self._row_array(req_ids)
        tokens = self._num_tokens[rows]
        full = int(tokens[tokens.argmin()]) // self.block_size
        if full == 0:
            return 0
        ids = self._ids[rows, :full]
        same = (ids == ids[0]).all(axis=0)
        return (full if same.all() else int(same.argmin())) * self.block_size

    def block_counts(self, req_ids: Sequence[object]) -> np.ndarray:
        """How many blocks each request holds (int64 [len(req_ids)])."""
        return self._num_blocks[self._row_array(req_ids)]

    # --- storage -------------------------------------------------------------------------
    def _row(self, req_id: object) -> int:
        row = self._rows.get(req_id)
        if row is None:
            raise ValueError(f"request {req_id!r} is not in the block table; add_request() "
                             "it first")
        return row

    def _row_array(self, req_ids: Sequence[object]) -> np.ndarray:
        try:
            return np.fromiter(map(self._rows.__getitem__, req_ids), np.intp, len(req_ids))
        except KeyError as e:
            raise ValueError(f"request {e.args[0]!r} is not in the block table; "
                             "add_request() it first") from None

    def _reserve(self, rows: int, cols: int) -> None:
        """Room for `rows` rows of `cols` blocks: each dimension doubles until it fits."""
        old_rows, old_cols = self._ids.shape
        if rows <= old_rows and cols <= old_cols:
            return
        new_rows, new_cols = old_rows, old_cols
        while new_rows < rows:
            new_rows *= 2
        while new_cols < cols:
            new_cols *= 2
        ids = np.zeros((new_rows, new_cols), dtype=np.int32)
        ids[:old_rows, :old_cols] = self._ids
        self._ids = ids
        for name in ("_num_blocks", "_num_tokens"):
            grown = np.zeros(new_rows, dtype=np.int64)
            grown[:old_rows] = getattr(self, name)
            setattr(self, name, grown)

    def _table_buffer(self, num_reqs: int, width: int) -> tuple[np.ndarray, torch.Tensor]:
        """A [num_reqs, width] int32 numpy array and a tensor over the same memory: views
        of the reused buffer, or of a new one (larger, or because the table last returned
        is still held somewhere)."""
        size = num_reqs * width
        buffer = self._buffer
        if buffer is None or buffer.shape[0] < size or _use_count is None or \
                _use_count(self._storage) != self._at_rest:
            capacity = max(size, 2 * buffer.shape[0] if buffer is not None else 0, 1024)
            with torch.inference_mode(False):  # its views stay normal tensors everywhere
                buffer = torch.empty(capacity, dtype=torch.int32,
                                     pin_memory=torch.cuda.is_available())
            self._buffer, self._buffer_np = buffer, buffer.numpy()
            self._storage = buffer.untyped_storage()._cdata
            self._at_rest = _use_count(self._storage) if _use_count is not None else 0
        return self._buffer_np[:size].reshape(num_reqs, width), buffer[:size].view(
            num_reqs, width)


class _BlockIds(Mapping):
    """`BlockTable.blocks`: request id -> its block ids (a new list each time)."""

    def __init__(self, table: BlockTable):
        self._table = table

    def __getitem__(self, req_id: object) -> list[int]:
        t = self._table
        row = t._rows[req_id]
        return t._ids[row, :t._num_blocks[row]].tolist()

    def __iter__(self) -> Iterator[object]:
        return iter(self._table._rows)

    def __len__(self) -> int:
        return len(self._table._rows)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._table._rows


class _NumTokens(_BlockIds):
    """`BlockTable.num_tokens`: request id -> its length (tokens with cache room)."""

    def __getitem__(self, req_id: object) -> int:  # type: ignore[override]
        t = self._table
        return int(t._num_tokens[t._rows[req_id]])


def _counts(name: str, values: Ints, n: int) -> np.ndarray:
    """`values` as int64 [n], or the ValueError / TypeError naming what is wrong."""
    a = values if type(values) is np.ndarray else np.asarray(values)
    if a.size and a.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers; got dtype {a.dtype}")
    if a.shape != (n,):
        raise ValueError(f"{name} has shape {a.shape}; need one count per request ({n},)")
    a = a.astype(np.int64, copy=False)
    if n and a[a.argmin()] < 0:
        i = int(np.flatnonzero(a < 0)[0])
        raise ValueError(f"{name}[{i}]={int(a[i])}: a request cannot give back tokens")
    return a

