"""`CommonAttentionMetadata`, and how an engine makes it each step from host lengths and
block tables (`MetadataStager`; `CommonAttentionMetadata.from_lengths` is this path).

An engine knows each step's query and sequence lengths and block ids on the host. This
module turns them into the metadata with numpy (offsets, slots, maxima: a handful of
vectorised array ops, no per-request Python, each written in place into one host buffer laid
out as the upload), copies that buffer into a pinned staging buffer and uploads it with ONE
`non_blocking` copy per step. The copy never waits
for the GPU: building step N+1 overlaps the GPU's work on step N, and nothing here syncs.

    stager = MetadataStager("cuda")
    for step in engine:
        common = stager.make(query_lens, seq_lens, block_table, block_size)  # numpy or lists
        metadata = builder.build(0, common)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional, Union

import numpy as np
import torch

from pagedattn.kv_sharding import KVSharding
from pagedattn.metadata_buffers import StepBufferPool
from pagedattn.metadata_persistent import PersistentBatch

ArrayLike = Union[np.ndarray, torch.Tensor, Sequence]
_INT64, _INT32 = np.dtype(np.int64), np.dtype(np.int32)
# Maxima and minima as `a[a.argmax()]`: argmax is a plain method, about 0.2 us on a short
# array where a ufunc reduction (`np.maximum.reduce`, `a.max()`) costs 1.5-3 us per step.


@dataclass
class CommonAttentionMetadata:
    """Per-batch attention metadata, independent of the backend (the seeds' fields).

    Requests are laid out back to back: request r's query tokens are
    `query_start_loc[r]:query_start_loc[r + 1]` of the flattened batch, and its keys are the
    first `seq_lens[r]` positions of the sequence, the last `query_len` of which are new.
    """

    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, on device
    query_start_loc_cpu: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32, on device
    seq_lens_cpu: torch.Tensor  # [num_reqs] int32
    num_computed_tokens_cpu: torch.Tensor  # [num_reqs] int32: seq_len - query_len
    num_reqs: int
    num_actual_tokens: int  # tokens in the batch, padding excluded
    max_query_len: int
    max_seq_len: int
    block_table_tensor: torch.Tensor  # [num_reqs, max_blocks_per_req] int32, on device
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64; negative = padding, skip
    causal: bool = True
    # Host copies an engine may keep (from_lengths does): build() checks block ids and slots
    # on them without a GPU sync.
    block_table_cpu: Optional[torch.Tensor] = None  # [num_reqs, max_blocks_per_req] int32
    slot_mapping_cpu: Optional[torch.Tensor] = None  # [num_actual_tokens] int64
    # Set by `MetadataStager.make`: (the block size it built for, `stager_fields(self)`, its
    # numpy view of block_table_cpu).
    # It checked the lengths and derived every other field from them, so build() checks
    # only the block ids while the fields are still the ones it made (a field replaced or
    # assigned since no longer matches, and the whole check runs).
    made_by_stager: Optional[tuple] = field(default=None, repr=False, compare=False)
    # Set by a stager with persistent buffers: (its PersistentBatch, the token of this
    # batch's write), which the device fields are views of.
    staged_into: Optional[tuple] = field(default=None, repr=False, compare=False)

    @property
    def query_lens_cpu(self) -> torch.Tensor:
        return self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]

    @staticmethod
    def from_lengths(query_lens: Sequence[int], seq_lens: Sequence[int],
                     block_table: torch.Tensor, block_size: int,
                     device: torch.device | str = "cpu", causal: bool = True,
                     sharding: Optional[KVSharding] = None) -> CommonAttentionMetadata:
        """Metadata for a batch whose new tokens are the last `query_len` of each sequence.
        With a DCP `sharding`, `block_table` is this rank's and tokens stored on other ranks
        get slot -1; `seq_lens` stay global. Computed in numpy and uploaded with one
        non_blocking copy from pinned memory (`metadata_staging.MetadataStager`, one per
        device); an engine may keep its own stager."""
        return stager_for(device).make(query_lens, seq_lens, block_table, block_size, causal,
                                       sharding)


def stager_fields(m: CommonAttentionMetadata) -> tuple:
    """The fields `MetadataStager.make` derives a batch's consistency from: the scalars,
    and the tensors by identity (the metadata holds them, so no other live tensor has their
    id)."""
    return (m.num_reqs, m.num_actual_tokens, m.max_query_len, m.max_seq_len,
            id(m.query_start_loc_cpu), id(m.seq_lens_cpu), id(m.block_table_cpu),
            id(m.slot_mapping_cpu), id(m.query_start_loc), id(m.seq_lens),
            id(m.block_table_tensor), id(m.slot_mapping))


def slots_for_positions(block_table: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor,
                        block_size: int, sharding: Optional[KVSharding] = None) -> torch.Tensor:
    """Cache slots of positions start..start+len-1 of each request, back to back.

    slot = block_id * block_size + offset, int64 (large caches overflow int32). Under DCP
    (`sharding`), a position another rank stores gets -1 and the rest their local slots.
    """
    req = torch.repeat_interleave(torch.arange(len(lens)), lens.long())
    first = torch.repeat_interleave(torch.cumsum(lens.long(), 0) - lens.long(), lens.long())
    pos = starts.long()[req] + torch.arange(int(lens.sum())) - first
    if sharding is None or sharding.world_size == 1:
        blocks = block_table.long()[req, pos // block_size]
        return blocks * block_size + pos % block_size
    local = sharding.local_len(pos)  # index among this rank's positions
    here = sharding.owner(pos) == sharding.rank
    local = torch.where(here, local, 0)
    slots = block_table.long()[req, local // block_size] * block_size + local % block_size
    return torch.where(here, slots, -1)


class MetadataStager:
    """Makes `CommonAttentionMetadata` for `device` from host arrays, once per step.

    The `*_cpu` fields of the metadata are views of one numpy buffer, and the device fields
    views of one device buffer (`metadata_buffers.StepBuffers`). A step gets the buffers of
    an earlier step of its shape once nothing outside the stager holds any of their
    tensors, else fresh ones: so an older step's metadata stays valid while it is held.
    The upload goes through pinned buffers reused round-robin, skipping one whose previous
    upload is still in flight, so `make` never blocks on the GPU.

    With `persistent` (a builder's `PersistentBatch`, FLASH_ATTN's `persistent_batch`) the
    upload lands in the builder's own buffers instead, padded for its captured graphs, and
    that builder's `build()` copies nothing: the device fields are then views of those
    buffers, which hold the last batch written to them (a `build()` of an older step's
    metadata writes it there again from its host fields).
    """

    def __init__(self, device: Union[torch.device, str] = "cpu",
                 persistent: Optional[PersistentBatch] = None):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if persistent is not None and persistent.device.type != self.device.type:
            raise ValueError(f"persistent buffers on {persistent.device} for a stager on "
                             f"{self.device}; give both one device")
        self.persistent = persistent
        # (tests force the packing path on a CPU)
        self._upload = self.device.type != "cpu" and persistent is None
        self._pool = StepBufferPool(self.device)

    def make(self, query_lens: ArrayLike, seq_lens: ArrayLike, block_table: ArrayLike,
             block_size: int, causal: bool = True,
             sharding: Optional[KVSharding] = None) -> CommonAttentionMetadata:
        """query_lens, seq_lens [num_reqs] ints; block_table [num_reqs, max_blocks] block ids
        (numpy, a CPU tensor or nested lists). The new tokens of request r are the last
        query_lens[r] of its seq_lens[r] positions. With a DCP `sharding`, `block_table` is this
        rank's and tokens stored on other ranks get slot -1; `seq_lens` stay global."""
        q, s, starts, table, max_seq_len = _checked_lengths(
            query_lens, seq_lens, block_table, block_size, sharding)
        num_reqs, width = table.shape
        ends = np.add.accumulate(q)  # query_start_loc[1:]
        num_tokens, max_query_len = (int(ends[-1]), int(q[q.argmax()])) if num_reqs else (0, 0)
        b = self._pool.take(num_reqs, width, num_tokens, self._upload)
        # Every field's words are written again: a caller may have changed an older step's
        # values in place before it let them go.
        b.query_start_loc[0] = 0
        b.query_ends[:] = ends
        b.seq_lens[:] = s
        b.block_table[:] = table
        b.num_computed_tokens[:] = starts
        if sharding is not None and sharding.world_size > 1:
            b.slot_mapping[:] = slots_for_positions(
                torch.from_numpy(table), torch.from_numpy(starts), torch.from_numpy(q),
                block_size, sharding).numpy()
        elif num_tokens == num_reqs and max_query_len == 1:  # decode: one token a request
            _fill_slots(b.slot_mapping, b.flat_block_table, b.row_starts, starts, block_size)
        else:
            rows = np.repeat(b.row_starts, q)
            pos = np.arange(num_tokens) + np.repeat(starts - (ends - q), q)
            _fill_slots(b.slot_mapping, b.flat_block_table, rows, pos, block_size)
        if self._upload:
            self._pool.upload(b)
        cpu, device = b.cpu, b.device
        staged = None
        if self.persistent is not None:
            staged = self.persistent.write(b.query_start_loc, b.seq_lens, b.block_table,
                                           b.slot_mapping, num_tokens)
            device = self.persistent.views(num_reqs, width, num_tokens)
        m = CommonAttentionMetadata(
            query_start_loc=device[0], query_start_loc_cpu=cpu[0],
            seq_lens=device[1], seq_lens_cpu=cpu[1], num_computed_tokens_cpu=cpu[4],
            num_reqs=num_reqs, num_actual_tokens=num_tokens, max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            block_table_tensor=device[2], slot_mapping=device[3], causal=causal,
            block_table_cpu=cpu[2], slot_mapping_cpu=cpu[3])
        if staged is not None:
            m.staged_into = (self.persistent, staged)
        if sharding is None or sharding.world_size == 1:  # (DCP batches: always checked)
            # stager_fields(m), its tensors' ids known; the block ids as numpy for build()
            ids = b.ids if staged is None else b.ids[:4] + tuple(map(id, device))
            m.made_by_stager = (block_size, (num_reqs, num_tokens, max_query_len, max_seq_len)
                                + ids, b.block_table)
        return m


def _checked_lengths(query_lens: ArrayLike, seq_lens: ArrayLike, block_table: ArrayLike,
                     block_size: int, sharding: Optional[KVSharding]) -> tuple:
    """(query_lens, seq_lens, their difference, block_table, the longest seq_len) as numpy
    (int64, an int32 table), or the ValueError / TypeError naming the first bad request and
    value."""
    q = _host_ints("query_lens", query_lens, 1)
    s = _host_ints("seq_lens", seq_lens, 1)
    num_reqs = q.shape[0]
    if s.shape[0] != num_reqs:
        raise ValueError(f"query_lens has {num_reqs} entries but seq_lens has {s.shape[0]}")
    starts = s - q  # positions cached before each request's new tokens
    # 0 <= query_len <= seq_len in one pass: a bitwise or is negative iff one side is
    either = q | starts
    if num_reqs and either[either.argmin()] < 0:
        r = int(np.flatnonzero((q < 0) | (starts < 0))[0])
        raise ValueError(f"request {r}: query_len={int(q[r])}, seq_len={int(s[r])}; need "
                         "0 <= query_len <= seq_len")
    table = _host_ints("block_table", block_table, 2, _INT32)
    if table.ndim != 2:
        if table.size:
            raise ValueError(f"block_table must be 2-D [num_reqs, max_blocks]; got shape "
                             f"{table.shape}")
        table = np.zeros((num_reqs, 0), dtype=np.int32)
    if table.shape[0] != num_reqs:
        raise ValueError(f"block_table has {table.shape[0]} rows for {num_reqs} requests; it "
                         "must be [num_reqs, max_blocks] (a persistent table's first num_reqs "
                         "rows)")
    max_seq_len = int(s[s.argmax()]) if num_reqs else 0
    stored, max_stored = s, max_seq_len
    if sharding is not None and sharding.world_size > 1:
        stored = np.asarray(sharding.local_len(torch.from_numpy(s)))
        max_stored = int(stored.max()) if num_reqs else 0
    width = table.shape[1]
    if -(-max_stored // block_size) > width:  # the longest request decides
        r = int(np.flatnonzero(-(-stored // block_size) > width)[0])
        raise ValueError(f"request {r}: seq_len={int(s[r])} needs "
                         f"{-(-int(stored[r]) // block_size)} blocks of {block_size} but "
                         f"block_table has {width} columns")
    return q, s, starts, table, max_seq_len


def _host_ints(name: str, values: ArrayLike, ndim: int, dtype: np.dtype = _INT64
               ) -> np.ndarray:
    if type(values) is np.ndarray and values.dtype is dtype and values.ndim == ndim:
        return values  # what an engine passes: nothing to convert or refuse
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()  # a device tensor: the caller's sync
    a = np.asarray(values)
    if a.size and a.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers; got dtype {a.dtype}")
    if ndim == 1 and a.ndim != 1:
        raise ValueError(f"{name} must be 1-D [num_reqs]; got shape {a.shape}")
    return a.astype(dtype, copy=False)


def _fill_slots(slots: np.ndarray, flat_table: np.ndarray, rows: np.ndarray,
                pos: np.ndarray, block_size: int) -> None:
    """slots[t] = block id * block_size + offset of position pos[t] of the request whose
    block-table row starts at flat_table[rows[t]] (`slots_for_positions` in numpy), in
    int64: block ids times block_size may pass 2^31."""
    if block_size & (block_size - 1):
        block = pos // block_size
    else:  # a power of two (the usual page): a shift, several times cheaper
        block = pos >> (block_size.bit_length() - 1)
    # (id - block) * block_size + pos = id * block_size + offset: in place, and the fewest
    # operations with a Python int (each costs about twice an array-array one)
    slots[:] = flat_table[rows + block]
    slots -= block
    slots *= block_size
    slots += pos


_stagers: dict[torch.device, MetadataStager] = {}


def stager_for(device: Union[torch.device, str]) -> MetadataStager:
    """The process's stager for `device` (what `from_lengths` uses)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    stager = _stagers.get(device)
    if stager is None:
        stager = _stagers[device] = MetadataStager(device)
    return stager
