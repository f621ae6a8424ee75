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

ArrayLike = Union[np.ndarray, torch.Tensor, Sequence]
_ALIGN = 16  # bytes: each field starts 16-byte aligned, as Triton's fast launches want
_MAX_BUFFERS = 8  # staging buffers in flight before the host waits for the oldest copy


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
    # Set by `MetadataStager.make`: (the block size it built for, `stager_fields(self)`).
    # It checked the lengths and derived every other field from them, so build() checks
    # only the block ids while the fields are still the ones it made (a field replaced or
    # assigned since no longer matches, and the whole check runs).
    made_by_stager: Optional[tuple] = field(default=None, repr=False, compare=False)

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

    The `*_cpu` fields of the metadata are views of one fresh numpy buffer per step, and the
    device fields views of one fresh device buffer (so an older step's metadata stays
    valid). Pinned staging buffers are reused round-robin; one whose previous upload has not
    finished yet is skipped (a new one is made), so `make` never blocks on the GPU.
    """

    def __init__(self, device: Union[torch.device, str] = "cpu"):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._upload = self.device.type != "cpu"  # (tests force the packing path on a CPU)
        self._pin = self.device.type == "cuda"
        self._buffers: list[torch.Tensor] = []  # pinned int32 staging buffers
        self._words: list[np.ndarray] = []  # numpy views of them (numpy fills them: cheap)
        self._events: list[Optional[torch.cuda.Event]] = []  # each buffer's last upload
        self._next = 0
        self._stream: tuple = (None, None)  # (raw handle, Stream) of the last current stream

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
        max_query_len = int(_MAX(q)) if num_reqs else 0
        ends = np.add.accumulate(q)  # query_start_loc[1:]
        num_tokens = int(ends[-1]) if num_reqs else 0
        # One host buffer in the upload's layout (int32 words, each field 16-byte aligned),
        # filled in place: the *_cpu fields are views of it and it uploads in one copy.
        o_seq = _aligned(num_reqs + 1)
        o_table = o_seq + _aligned(num_reqs)
        o_slots = o_table + _aligned(num_reqs * width)
        size = o_slots + 2 * num_tokens  # the uploaded words; the computed lengths follow
        host = np.empty(size + num_reqs, dtype=np.int32)
        qsl, computed = host[:num_reqs + 1], host[size:]
        qsl[0] = 0
        qsl[1:] = ends
        host[o_seq:o_seq + num_reqs] = s
        flat_table = host[o_table:o_table + num_reqs * width]
        flat_table[:] = table.reshape(-1)
        computed[:] = starts
        slots = host[o_slots:size].view(np.int64)
        if sharding is not None and sharding.world_size > 1:
            slots[:] = slots_for_positions(torch.from_numpy(table), torch.from_numpy(starts),
                                           torch.from_numpy(q), block_size, sharding).numpy()
        elif num_tokens == num_reqs and max_query_len == 1:  # decode: one token a request
            _fill_slots(slots, flat_table, np.arange(num_reqs) * width, starts, block_size)
        else:
            rows = np.repeat(np.arange(num_reqs) * width, q)
            pos = np.arange(num_tokens) + np.repeat(starts - (ends - q), q)
            _fill_slots(slots, flat_table, rows, pos, block_size)
        cpu = [torch.from_numpy(a) for a in (qsl, host[o_seq:o_seq + num_reqs],
                                            flat_table.reshape(num_reqs, width), slots)]
        device = self._to_device(host[:size], (o_seq, o_table, o_slots), (num_reqs, width)) \
            if self._upload else cpu
        m = CommonAttentionMetadata(
            query_start_loc=device[0], query_start_loc_cpu=cpu[0],
            seq_lens=device[1], seq_lens_cpu=cpu[1],
            num_computed_tokens_cpu=torch.from_numpy(computed),
            num_reqs=num_reqs, num_actual_tokens=num_tokens, max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            block_table_tensor=device[2], slot_mapping=device[3], causal=causal,
            block_table_cpu=cpu[2], slot_mapping_cpu=cpu[3])
        if sharding is None or sharding.world_size == 1:  # (DCP batches: always checked)
            m.made_by_stager = (block_size, stager_fields(m))
        return m

    def _to_device(self, host: np.ndarray, offsets: tuple[int, int, int],
                   table_shape: tuple[int, int]) -> list[torch.Tensor]:
        """`host` (make's buffer: query_start_loc, seq_lens, block table, slots at word
        `offsets`) copied into a pinned buffer and from there in one copy to a fresh device
        buffer; the fields are views of it. Few torch calls on purpose: each costs
        microseconds of host time, a numpy copy less."""
        total = max(host.shape[0], _ALIGN // 4)
        j = self._staging(total)
        self._words[j][:host.shape[0]] = host
        # One call allocates and copies (copy=True: a fresh buffer on the CPU too)
        out = self._buffers[j][:total].to(self.device, non_blocking=True, copy=True)
        if self._pin:
            self._events[j].record(self._current_stream())
        o_seq, o_table, o_slots = offsets
        rows, width = table_shape
        return [out[:rows + 1], out[o_seq:o_seq + rows],
                out.as_strided(table_shape, (width, 1), o_table),
                out[o_slots:host.shape[0]].view(torch.int64)]

    def _current_stream(self) -> torch.cuda.Stream:
        """The device's current stream, one Stream object per raw stream: making one, as
        torch.cuda.current_stream does, costs tens of microseconds on a GPU host, reading
        the raw handle a fraction of one."""
        raw = torch._C._cuda_getCurrentRawStream(self.device.index)
        if raw != self._stream[0]:
            self._stream = (raw, torch.cuda.current_stream(self.device))
        return self._stream[1]

    def _staging(self, words: int) -> int:
        """Index of the next pinned buffer whose last upload is done (never a wait, up to
        _MAX_BUFFERS in flight), grown to at least `words` int32 words."""
        n = len(self._buffers)
        j = n
        for i in range(n):
            k = (self._next + i) % n
            if not self._pin or self._events[k].query():
                j = k
                break
        if j == n and n == _MAX_BUFFERS:  # the GPU is that many steps behind: wait for it
            j = self._next % n
            self._events[j].synchronize()
        if j == n:
            self._buffers.append(torch.empty(0, dtype=torch.int32))
            self._words.append(self._buffers[j].numpy())
            self._events.append(torch.cuda.Event() if self._pin else None)
        if self._buffers[j].shape[0] < words:  # grows rarely: doubles
            size = max(words, 2 * self._buffers[j].shape[0], 1 << 14)
            self._buffers[j] = torch.empty(size, dtype=torch.int32, pin_memory=self._pin)
            self._words[j] = self._buffers[j].numpy()
        self._next = j + 1
        return j


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
    # 0 <= query_len <= seq_len in one reduction: a bitwise or is negative iff one side is
    if num_reqs and _MIN(q | starts) < 0:
        r = int(np.flatnonzero((q < 0) | (starts < 0))[0])
        raise ValueError(f"request {r}: query_len={int(q[r])}, seq_len={int(s[r])}; need "
                         "0 <= query_len <= seq_len")
    table = _host_ints("block_table", block_table, 2, np.int32)
    if table.ndim != 2:
        if table.size:
            raise ValueError(f"block_table must be 2-D [num_reqs, max_blocks]; got shape "
                             f"{table.shape}")
        table = np.zeros((num_reqs, 0), dtype=np.int32)
    if table.shape[0] != num_reqs:
        raise ValueError(f"block_table has {table.shape[0]} rows for {num_reqs} requests; it "
                         "must be [num_reqs, max_blocks] (a persistent table's first num_reqs "
                         "rows)")
    max_seq_len = int(_MAX(s)) if num_reqs else 0
    stored, max_stored = s, max_seq_len
    if sharding is not None and sharding.world_size > 1:
        stored = np.asarray(sharding.local_len(torch.from_numpy(s)))
        max_stored = int(_MAX(stored)) if num_reqs else 0
    width = table.shape[1]
    if -(-max_stored // block_size) > width:  # the longest request decides
        r = int(np.flatnonzero(-(-stored // block_size) > width)[0])
        raise ValueError(f"request {r}: seq_len={int(s[r])} needs "
                         f"{-(-int(stored[r]) // block_size)} blocks of {block_size} but "
                         f"block_table has {width} columns")
    return q, s, starts, table, max_seq_len


def _host_ints(name: str, values: ArrayLike, ndim: int, dtype=np.int64) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()  # a device tensor: the caller's sync
    a = np.asarray(values)
    if a.size and a.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers; got dtype {a.dtype}")
    if ndim == 1 and a.ndim != 1:
        raise ValueError(f"{name} must be 1-D [num_reqs]; got shape {a.shape}")
    return a.astype(dtype, copy=False)


def _aligned(words: int) -> int:
    """int32 words a field of `words` takes, padded to the next 16 bytes."""
    return -(-words // (_ALIGN // 4)) * (_ALIGN // 4)


def _fill_slots(slots: np.ndarray, flat_table: np.ndarray, rows: np.ndarray,
                pos: np.ndarray, block_size: int) -> None:
    """slots[t] = block id * block_size + offset of position pos[t] of the request whose
    block-table row starts at flat_table[rows[t]] (`slots_for_positions` in numpy), in
    int64: block ids times block_size may pass 2^31."""
    if block_size & (block_size - 1):
        block, offset = np.divmod(pos, block_size)
    else:  # a power of two (the usual page): a shift and a mask, several times cheaper
        block, offset = pos >> (block_size.bit_length() - 1), pos & (block_size - 1)
    np.multiply(flat_table[rows + block], block_size, out=slots, dtype=np.int64)
    slots += offset


# numpy's reductions without ndarray.max's Python wrapper (a microsecond each, per step)
_MIN, _MAX = np.minimum.reduce, np.maximum.reduce


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
