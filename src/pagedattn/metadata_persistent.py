"""A builder's persistent batch buffers, and the one upload a step writes them with.

CUDA graphs read a batch from buffers that stay put (FLASH_ATTN's builder hands out views of
them every `build`). A stager that knows them (`MetadataStager(device, persistent=...)`)
writes each step straight into them: it packs the step, padded for the largest captured
batch, into a pinned host mirror of their layout and uploads it with ONE `non_blocking`
copy, so `build()` copies nothing. Without it, a step goes up into the stager's own buffer
and `build()` copies it across (one more launch).

One allocation, laid out as the upload: query_start_loc [S + 1], seq_lens [S], slot_mapping
[T] (int64), then the block table [S, W] last, so a step of n requests uploads its first
n rows and nothing past them (vLLM's runner copies its block table's rows so too).

The device buffer needs no guard: every upload is queued on the stream behind the kernels
that read the last step. The host mirror does: its copy is still in flight when `write`
returns. One CUDA event per mirror, recorded behind its copy, is that guard; a mirror is
filled again only once its event (or a later one on the same stream) has passed, and with
`_MIRRORS` in flight the next write waits for the oldest.
"""

from __future__ import annotations

import itertools
from typing import Any, Optional

import numpy as np
import torch

from pagedattn.metadata_buffers import CurrentStream, aligned_words

_MIRRORS = 4  # pinned mirrors in flight before a write waits for the oldest upload
_serials = itertools.count(1)  # one count for every buffer: a token names one write


class PersistentBatch:
    """Buffers for up to `max_num_seqs` requests, `max_blocks` block-table columns and
    `max_num_tokens` tokens on `device`; `pads`: the largest captured batch (requests,
    tokens), which every write pads to (empty requests, skipped slots)."""

    def __init__(self, max_num_seqs: int, max_blocks: int, max_num_tokens: int,
                 device: torch.device):
        s, w, t = max_num_seqs, max_blocks, max_num_tokens
        o_seq = aligned_words(s + 1)
        o_slots = o_seq + aligned_words(s)
        o_table = o_slots + aligned_words(2 * t)
        self.layout = (o_seq, o_slots, o_table, w)
        self.device = torch.device(device)
        self.words = torch.zeros(o_table + s * w, dtype=torch.int32, device=self.device)
        self.query_start_loc = self.words[:s + 1]  # [S + 1] int32
        self.seq_lens = self.words[o_seq:o_seq + s]  # [S] int32
        self.slot_mapping = self.words[o_slots:o_slots + 2 * t].view(torch.int64)  # [T]
        self.block_table = self.words.as_strided((s, w), (w, 1), o_table)  # [S, W] int32
        self.slot_mapping.fill_(-1)
        self.pads = (0, 0)
        self.written: Optional[tuple] = None  # (token, pads) of the last write; None: other
        self._pin = self.device.type == "cuda"
        self._stream = CurrentStream(self.device) if self._pin else None
        self._mirrors: list[_Mirror] = []
        self._next = 0
        self._newest: Optional[_Mirror] = None
        self._done: tuple = (None, 0)  # (stream, serial): that upload and all before it done
        self._views: dict[tuple[int, int, int], tuple] = {}
        self._copies: dict[tuple[int, int], tuple] = {}  # (mirror, words): (dst, src)

    def views(self, num_reqs: int, width: int, num_tokens: int) -> tuple:
        """(query_start_loc, seq_lens, block_table [num_reqs, width], slot_mapping) of a
        batch of this size: the same tensors for every batch of it."""
        key = (num_reqs, width, num_tokens)
        v = self._views.get(key)
        if v is None:
            if len(self._views) > 4096:
                self._views.clear()
            v = self._views[key] = (self.query_start_loc[:num_reqs + 1],
                                    self.seq_lens[:num_reqs],
                                    self.block_table[:num_reqs, :width],
                                    self.slot_mapping[:num_tokens])
        return v

    def write(self, query_start_loc: np.ndarray, seq_lens: np.ndarray, block_table: np.ndarray,
              slot_mapping: np.ndarray, num_actual_tokens: int) -> int:
        """One batch (host arrays: [n + 1], [n], [n, width], [num_tokens]) into the buffers,
        padded to `pads`; returns its token (what `holds` compares)."""
        n, width = block_table.shape
        num_tokens = slot_mapping.shape[0]
        pad_reqs, pad_tokens = self.pads
        if n > self.seq_lens.shape[0] or width > self.layout[3] or \
                num_tokens > self.slot_mapping.shape[0]:
            raise ValueError(f"a batch of {n} requests, {width} block-table columns and "
                             f"{num_tokens} tokens does not fit buffers of "
                             f"{self.seq_lens.shape[0]}, {self.layout[3]} and "
                             f"{self.slot_mapping.shape[0]}; raise the EngineConfig limits")
        raw, stream = self._stream.get() if self._pin else (None, None)
        m = self._mirror()
        m.query_start_loc[:n + 1] = query_start_loc
        m.seq_lens[:n] = seq_lens
        if pad_reqs > n:  # a captured graph reads these as empty requests
            m.query_start_loc[n + 1:pad_reqs + 1] = num_actual_tokens
            m.seq_lens[n:pad_reqs] = 0
        m.slot_mapping[:num_tokens] = slot_mapping
        if pad_tokens > num_tokens:
            m.slot_mapping[num_tokens:pad_tokens] = -1
        m.block_table[:n, :width] = block_table
        size = self.layout[2] + n * self.layout[3]
        copy = self._copies.get((m.index, size))
        if copy is None:
            if len(self._copies) >= 64 * _MIRRORS:
                self._copies.clear()
            copy = self._copies[m.index, size] = (self.words[:size], m.pinned[:size])
        copy[0].copy_(copy[1], non_blocking=True)
        m.serial, m.stream = next(_serials), raw
        if self._pin:
            m.event.record(stream)
        self._newest = m
        self.written = (m.serial, self.pads)
        return m.serial

    def hold(self, m: Any, token: int) -> bool:
        """Make the buffers hold `m` (CommonAttentionMetadata a stager wrote here as
        `token`), padded as now: written again from its host fields if another batch or
        padding went in since. False (nothing done) if its device fields are no longer
        this batch's views of them (replaced since)."""
        n, width = m.block_table_tensor.shape
        v = self.views(n, width, m.slot_mapping.shape[0])
        if m.query_start_loc is not v[0] or m.seq_lens is not v[1] or \
                m.block_table_tensor is not v[2] or m.slot_mapping is not v[3]:
            return False
        if self.written != (token, self.pads):
            self.write(m.query_start_loc_cpu.numpy(), m.seq_lens_cpu.numpy(),
                       m.block_table_cpu.numpy(), m.slot_mapping_cpu.numpy(),
                       m.num_actual_tokens)
            self.written = (token, self.pads)  # the same batch as `token` names
        return True

    def _mirror(self) -> _Mirror:
        """The next mirror in turn, once its last upload is done; the ring of _MIRRORS is
        made first (a new mirror needs no check), then a write waits only when every upload
        is still in flight. In turn, so that one query of the newest event vouches for the
        next few mirrors: about one query in _MIRRORS writes while the GPU keeps up."""
        n = len(self._mirrors)
        if n < _MIRRORS:
            m = _Mirror(n, self.words.shape[0], self.layout, self._pin)
            self._mirrors.append(m)
            self._next = n + 1
            return m
        for i in range(n):
            m = self._mirrors[(self._next + i) % n]
            if self._passed(m):
                self._next = m.index + 1
                return m
        m = self._mirrors[self._next % n]  # the GPU is _MIRRORS uploads behind: wait
        m.event.synchronize()
        self._next = m.index + 1
        return m

    def _passed(self, m: _Mirror) -> bool:
        """Whether m's last upload is done. One query at most in the common case: the newest
        upload's event first, which (on the same stream) vouches for every earlier one."""
        if not self._pin or (m.stream == self._done[0] and m.serial <= self._done[1]):
            return True
        newest = self._newest
        if newest.stream == m.stream and newest.event.query():
            self._done = (newest.stream, newest.serial)
            return True
        return m is not newest and m.event.query()


class _Mirror:
    """A pinned host copy of the buffers' layout (numpy views fill it) and its event."""

    def __init__(self, index: int, size: int, layout: tuple, pin: bool):
        o_seq, o_slots, o_table, width = layout
        self.index, self.serial, self.stream = index, 0, None
        self.pinned = torch.zeros(size, dtype=torch.int32, pin_memory=pin)
        words = self.pinned.numpy()
        self.query_start_loc = words[:o_seq]
        self.seq_lens = words[o_seq:o_slots]
        self.slot_mapping = words[o_slots:o_table].view(np.int64)
        self.block_table = words[o_table:].reshape(-1, width)
        self.event = torch.cuda.Event() if pin else None


def held_in(m: Any) -> Optional[PersistentBatch]:
    """The persistent buffers `m`'s device fields are views of, holding `m` now (see
    `PersistentBatch.hold`), or None where a stager wrote it elsewhere."""
    staged = m.staged_into
    if staged is None or not staged[0].hold(m, staged[1]):
        return None
    return staged[0]
