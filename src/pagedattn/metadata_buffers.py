"""Where a step's metadata lives: its host and device buffers (`StepBuffers`), filled again
by a later step of the same shape once nothing holds them, and the pinned buffers its one
upload a step goes through (`StepBufferPool`).

`MetadataStager.make` hands each step's fields out as views of two buffers: a host one (numpy
fills it; the `*_cpu` fields are tensors over it) and, for a device, the one its upload lands
in (the device fields are views of it). Making those tensors costs as much host time as
computing the metadata (1-2 us a view, nine a step), and an engine's steps repeat their
shapes. So the pool keeps each shape's buffers with their views and fills them again, but
only once nothing outside it holds any of them: an older step's metadata, a field of it, a
view or a numpy array taken from one all keep their values while they are held, as with
fresh buffers (which the caching allocator, too, hands out again once they are freed).
"""

from __future__ import annotations

import sys
from typing import Optional

import numpy as np
import torch

_ALIGN = 16  # bytes: each field starts 16-byte aligned, as Triton's fast launches want
_MAX_BUFFERS = 8  # staging buffers in flight before the host waits for the oldest copy
# Step buffers kept: an engine holds a step's metadata while it makes the next one (or two),
# and its recent shapes repeat (decode steps; prefills of one chunk size)
_PER_SHAPE, _SHAPES = 4, 16
# How many tensors share a storage (a view or a `.numpy()` array of a field adds one). Where a
# torch build lacks it, nothing is reused.
_use_count = getattr(torch._C, "_storage_Use_Count", None)


class StepBuffers:
    """A step's buffers for `num_reqs` requests, `width` block-table columns and `num_tokens`
    tokens: the upload's layout (int32 words, each field 16-byte aligned: query_start_loc,
    seq_lens, block table, int64 slots), then the computed lengths (host only).

    Filled by the stager through the numpy views (`query_start_loc`, `seq_lens`,
    `block_table` 2-D, `slot_mapping`, `num_computed_tokens`; `words`: what uploads); it
    hands out `cpu` (the same five fields as tensors) and `device` (the first four on the
    device, once `upload` made them; until then the `cpu` ones). A holder may read them and
    write their values, not change a tensor's shape in place (`resize_`, `t_`): the next
    step that fills these buffers would hand the changed tensor out.
    """

    def __init__(self, num_reqs: int, width: int, num_tokens: int, upload: bool):
        self.key = (num_reqs, width, num_tokens)
        o_seq = aligned_words(num_reqs + 1)
        o_table = o_seq + aligned_words(num_reqs)
        o_slots = o_table + aligned_words(num_reqs * width)
        size = o_slots + 2 * num_tokens  # the uploaded words; the computed lengths follow
        self.layout = (o_seq, o_table, o_slots, size)
        host = np.empty(size + num_reqs, dtype=np.int32)
        self.words = host[:size]
        self.query_start_loc = host[:num_reqs + 1]
        self.query_ends = host[1:num_reqs + 1]
        self.seq_lens = host[o_seq:o_seq + num_reqs]
        self.flat_block_table = host[o_table:o_table + num_reqs * width]
        self.block_table = self.flat_block_table.reshape(num_reqs, width)
        self.slot_mapping = host[o_slots:size].view(np.int64)
        self.num_computed_tokens = host[size:]
        self.row_starts = np.arange(num_reqs) * width  # block_table.flat index of each row
        self.cpu = _normal_tensors(lambda: tuple(map(torch.from_numpy, (
            self.query_start_loc, self.seq_lens, self.block_table, self.slot_mapping,
            self.num_computed_tokens))))
        self.device = self.cpu[:4]
        self.device_words: Optional[torch.Tensor] = None
        self.stream = None  # the raw stream the device buffer was last written on
        self._at_rest: Optional[tuple[int, int]] = None  # (references, storage uses) at rest
        if not upload:  # (else the first upload makes the device fields, then settles)
            self._settle()

    def upload(self, words: torch.Tensor, device: torch.device, stream) -> None:
        """`words` (a pinned copy of `self.words`) into the device buffer, one non_blocking
        copy on `stream` (the current one's raw handle; None off CUDA): the first upload
        makes the buffer (one call allocates and copies) and its views, the device fields."""
        self.stream = stream
        if self.device_words is not None:
            self.device_words.copy_(words, non_blocking=True)
            return
        self.device_words = _normal_tensors(
            lambda: words.to(device, non_blocking=True, copy=True))
        self.device = _normal_tensors(self._device_views)
        self._settle()

    def _device_views(self) -> tuple[torch.Tensor, ...]:
        (num_reqs, width, _), (o_seq, o_table, o_slots, size) = self.key, self.layout
        return (self.device_words[:num_reqs + 1], self.device_words[o_seq:o_seq + num_reqs],
                self.device_words.as_strided((num_reqs, width), (width, 1), o_table),
                self.device_words[o_slots:size].view(torch.int64))

    def _settle(self) -> None:
        """The tensors are all made: their ids as stager_fields lists them, and their
        references and storage uses while only this object holds them (no local variable
        anywhere does), before any is handed out."""
        self.ids = tuple(map(id, self.cpu[:4] + self.device))
        self._counted = self.cpu if self.device_words is None else \
            self.cpu + self.device + (self.device_words,)
        if _use_count is not None:
            self._storages = tuple(t.untyped_storage()._cdata for t in (
                self.cpu if self.device_words is None else self.cpu + (self.device_words,)))
            self._at_rest = (sum(map(sys.getrefcount, self._counted)),
                             sum(map(_use_count, self._storages)))

    def free(self, stream) -> bool:
        """Whether nothing outside this object holds any of its tensors (no reference to one,
        no view or numpy array over their storage) and its device buffer was last written
        on `stream`: then the stager may fill it again. The device buffer's last readers
        ran on that stream, so the next upload, queued behind them, cannot overtake them (a
        tensor read on another stream must be held until that stream is done with it: this
        sees no `record_stream`)."""
        # Sums: each count can only rise above its resting value while this object holds
        # the tensors, so equal sums mean every one is at rest.
        at_rest = self._at_rest
        return at_rest is not None and stream == self.stream and \
            sum(map(sys.getrefcount, self._counted)) == at_rest[0] and \
            sum(map(_use_count, self._storages)) == at_rest[1]


class StepBufferPool:
    """Each shape's recent `StepBuffers`, and the pinned buffers their uploads go through
    (reused round-robin; one whose last upload is still in flight is skipped, so an upload
    never waits for the GPU)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._pin = device.type == "cuda"
        self._shapes: dict[tuple[int, int, int], list[StepBuffers]] = {}  # least recent first
        self._buffers: list[torch.Tensor] = []  # pinned int32 staging buffers
        self._words: list[np.ndarray] = []  # numpy views of them (numpy fills them: cheap)
        self._events: list[Optional[torch.cuda.Event]] = []  # each buffer's last upload
        self._sources: dict[tuple[int, int], torch.Tensor] = {}  # (buffer, words): its view
        self._next = 0
        self._stream = CurrentStream(device) if self._pin else None

    def take(self, num_reqs: int, width: int, num_tokens: int, upload: bool) -> StepBuffers:
        """This shape's least recently filled buffers that are free on the current stream,
        else new ones (kept: up to _PER_SHAPE per shape, the last _SHAPES shapes); `upload`:
        whether `upload(b)` follows."""
        # Host-only buffers (a stager writing into persistent ones) no GPU reads: any stream
        stream = self._stream.get()[0] if self._pin and upload else None
        key = (num_reqs, width, num_tokens)
        ring = self._shapes.get(key)
        if ring is None:
            if len(self._shapes) >= _SHAPES:  # forget the oldest shape
                del self._shapes[next(iter(self._shapes))]
            ring = self._shapes[key] = []
        for i, b in enumerate(ring):
            if b.free(stream):
                ring.append(ring.pop(i))
                return b
        if len(ring) >= _PER_SHAPE:  # all held: the oldest is its holders' alone from now
            ring.pop(0)
        b = StepBuffers(num_reqs, width, num_tokens, upload)
        ring.append(b)
        return b

    def upload(self, b: StepBuffers) -> None:
        """`b`'s words (just taken and filled) copied into a pinned buffer and from there in
        one non_blocking copy to its device buffer, on the current stream. Few torch calls
        on purpose: each costs microseconds of host time, a numpy copy less."""
        size = b.words.shape[0]
        j = self._staging(size)
        self._words[j][:size] = b.words
        source = self._sources.get((j, size))
        if source is None:
            if len(self._sources) >= _MAX_BUFFERS * _SHAPES:
                self._sources.clear()
            source = self._sources[j, size] = self._buffers[j][:size]
        raw, stream = self._stream.last if self._pin else (None, None)
        b.upload(source, self.device, raw)
        if self._pin:  # (take read the current stream)
            self._events[j].record(stream)

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
            self._sources.clear()  # views of the old buffer
        self._next = j + 1
        return j


class CurrentStream:
    """The device's current stream as (raw handle, Stream), one Stream object per raw
    stream: making one, as torch.cuda.current_stream does, costs tens of microseconds on a
    GPU host, reading the raw handle a fraction of one."""

    def __init__(self, device: torch.device):
        self.index = torch.cuda.current_device() if device.index is None else device.index
        self.last: tuple = (None, None)  # what `get` returned last

    def get(self) -> tuple:
        raw = torch._C._cuda_getCurrentRawStream(self.index)
        if raw != self.last[0]:
            self.last = (raw, torch.cuda.current_stream(self.index))
        return self.last


def _normal_tensors(make):
    """make(), its tensors normal ones even in inference mode: a later step, made outside
    it, hands them out too, and a caller may then update them in place (an inference tensor
    refuses that outside inference mode; a normal one is updated in place in both)."""
    if not torch.is_inference_mode_enabled():
        return make()
    with torch.inference_mode(False):
        return make()


def aligned_words(words: int) -> int:
    """int32 words a field of `words` takes, padded to the next 16 bytes."""
    return -(-words // (_ALIGN // 4)) * (_ALIGN // 4)
