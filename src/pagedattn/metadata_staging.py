"""`CommonAttentionMetadata`, and how an engine makes it each step from host lengths and
block tables (`MetadataStager`; `CommonAttentionMetadata.from_lengths` is this path).

An engine knows each step's query and sequence lengths and block ids on the host. This
module turns them into the metadata with numpy (offsets, slots, maxima: a handful of
vectorised array ops, no per-request Python), packs the device-side fields into one pinned
staging buffer and uploads it with ONE `non_blocking` copy per step. The copy never waits
for the GPU: building step N+1 overlaps the GPU's work on step N, and nothing here syncs.

    stager = MetadataStager("cuda")
    for step in engine:
        common = stager.make(query_lens, seq_lens, block_table, block_size)  # numpy or lists
        metadata = builder.build(0, common)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
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

    The `*_cpu` fields of the metadata are numpy-backed CPU tensors of their own; the device
    fields are views of one fresh device buffer per step (so an older step's metadata stays
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
        q = _host_ints("query_lens", query_lens, 1)
        s = _host_ints("seq_lens", seq_lens, 1)
        if q.shape[0] != s.shape[0]:
            raise ValueError(
                f"query_lens has {q.shape[0]} entries but seq_lens has {s.shape[0]}")
        bad = (q < 0) | (s < q)
        if bad.any():
            r = int(np.flatnonzero(bad)[0])
            raise ValueError(f"request {r}: query_len={int(q[r])}, seq_len={int(s[r])}; need "
                             "0 <= query_len <= seq_len")
        table = _host_ints("block_table", block_table, 2, np.int32)
        if table.ndim != 2:
            if table.size:
                raise ValueError(f"block_table must be 2-D [num_reqs, max_blocks]; got shape "
                                 f"{table.shape}")
            table = np.zeros((q.shape[0], 0), dtype=np.int32)
        stored = s if sharding is None or sharding.world_size == 1 else np.asarray(
            sharding.local_len(torch.from_numpy(s)))
        need = -(-stored // block_size)
        width = table.shape[1]
        if need.size and int(need.max()) > width:
            r = int(np.flatnonzero(need > width)[0])
            raise ValueError(f"request {r}: seq_len={int(s[r])} needs {int(need[r])} blocks of "
                             f"{block_size} but block_table has {width} columns")
        num_reqs = q.shape[0]
        qsl = np.zeros(num_reqs + 1, dtype=np.int32)
        np.cumsum(q, out=qsl[1:])
        num_tokens = int(qsl[-1])
        slots = _slots(table, s - q, q, qsl, num_tokens, block_size, sharding)
        fields = (qsl, s.astype(np.int32), np.ascontiguousarray(table), slots)
        cpu = [torch.from_numpy(a) for a in fields]
        device = self._to_device(fields) if self._upload else cpu
        return CommonAttentionMetadata(
            query_start_loc=device[0], query_start_loc_cpu=cpu[0],
            seq_lens=device[1], seq_lens_cpu=cpu[1],
            num_computed_tokens_cpu=torch.from_numpy((s - q).astype(np.int32)),
            num_reqs=num_reqs, num_actual_tokens=num_tokens,
            max_query_len=int(q.max()) if num_reqs else 0,
            max_seq_len=int(s.max()) if num_reqs else 0,
            block_table_tensor=device[2], slot_mapping=device[3], causal=causal,
            block_table_cpu=cpu[2], slot_mapping_cpu=cpu[3])

    def _to_device(self, fields: tuple[np.ndarray, ...]) -> list[torch.Tensor]:
        """Every field packed as int32 words (an int64 field takes two per value), each
        16-byte aligned, in one pinned buffer filled by numpy; one copy moves it all. Few
        torch calls on purpose: each costs microseconds of host time, a numpy copy less."""
        offsets, total = [], 0
        for a in fields:
            offsets.append(total)
            total += -(-a.nbytes // _ALIGN) * (_ALIGN // 4)
        total = max(total, _ALIGN // 4)
        j = self._staging(total)
        words = self._words[j]
        for a, start in zip(fields, offsets):
            words[start:start + a.nbytes // 4] = a.reshape(-1).view(np.int32)
        out = torch.empty(total, dtype=torch.int32, device=self.device)
        out.copy_(self._buffers[j][:total], non_blocking=True)
        if self._pin:
            self._events[j].record(self._current_stream())
        views = []
        for a, start in zip(fields, offsets):
            view = out[start:start + a.nbytes // 4]
            if a.dtype == np.int64:
                view = view.view(torch.int64)
            views.append(view.view(a.shape) if a.ndim == 2 else view)
        return views

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


def _host_ints(name: str, values: ArrayLike, ndim: int, dtype=np.int64) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()  # a device tensor: the caller's sync
    a = np.asarray(values)
    if a.size and a.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers; got dtype {a.dtype}")
    if ndim == 1 and a.ndim != 1:
        raise ValueError(f"{name} must be 1-D [num_reqs]; got shape {a.shape}")
    return a.astype(dtype, copy=False)


def _slots(table: np.ndarray, starts: np.ndarray, lens: np.ndarray, qsl: np.ndarray,
           num_tokens: int, block_size: int, sharding: Optional[KVSharding]) -> np.ndarray:
    """int64 cache slots of each request's new positions, back to back
    (`slots_for_positions` in numpy; under DCP, that function itself)."""
    if sharding is not None and sharding.world_size > 1:
        return slots_for_positions(torch.from_numpy(table), torch.from_numpy(starts),
                                   torch.from_numpy(lens), block_size, sharding).numpy()
    req = np.repeat(np.arange(lens.shape[0]), lens)
    pos = np.arange(num_tokens) + np.repeat(starts - qsl[:-1], lens)
    return table[req, pos // block_size].astype(np.int64) * block_size + pos % block_size


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
