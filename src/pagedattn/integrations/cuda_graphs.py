"""Replay the paged generator's pure-decode steps from CUDA graphs, as vLLM does.

A small model's decode step is a millisecond of GPU work behind tens of milliseconds of host
work (the HF layers' Python, our checks, one launch per kernel). A CUDA graph records the
launches once per padded batch size (bucket) and replays them with one call. What changes
between steps lives in device buffers the graph reads: the token ids and positions (copied in
here) and the attention metadata, which the builder writes into its persistent buffers on every
`build` (FLASH_ATTN's builder; `builder_reuses_buffers` checks it, because a builder that hands
out new tensors would make a replay read a stale batch). Padding requests have query_len 0 and
seq_len 0 and padding tokens slot -1, which the builder fills in for batches smaller than the
captured one; their logits rows are dropped.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch

from pagedattn.forward_context import set_forward_context
from pagedattn.metadata import CommonAttentionMetadata
from pagedattn.types import AttentionCGSupport

# The tensors of the metadata a captured graph reads; a replay is right only if every later
# `build` writes the new batch into these same buffers.
_GRAPH_INPUTS = ("query_start_loc", "seq_lens", "block_table", "slot_mapping")


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Padded batch sizes to capture: 1, 2, 4, then multiples of 8, and max_num_seqs."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sizes + [max_num_seqs]


def why_not_cuda_graphs(device: torch.device, builder: Any) -> list[str]:
    """Reasons the generator cannot replay decode steps from graphs ([] if it can)."""
    reasons = []
    if device.type != "cuda":
        reasons.append(f"the model is on {device.type}, CUDA graphs need cuda")
    support = getattr(builder, "cudagraph_support", AttentionCGSupport.NEVER)
    if support < AttentionCGSupport.UNIFORM_BATCH:
        reasons.append(f"{type(builder).__name__}.cudagraph_support is {support.name}; "
                       "replaying decode steps needs UNIFORM_BATCH or more")
    return reasons


def dummy_decode_batch(num_reqs: int, block_size: int,
                       device: torch.device) -> CommonAttentionMetadata:
    """num_reqs decodes of one key each, in block 0 (capture only: its slots are set to -1)."""
    table = torch.zeros(num_reqs, 1, dtype=torch.int32)
    return CommonAttentionMetadata.from_lengths([1] * num_reqs, [1] * num_reqs, table,
                                                block_size, device)


def same_buffers(a: Any, b: Any) -> bool:
    return all(getattr(a, n).data_ptr() == getattr(b, n).data_ptr() for n in _GRAPH_INPUTS)


def builder_reuses_buffers(builder: Any, block_size: int, device: torch.device) -> bool:
    """Whether two builds return views of the same buffers (what a replay relies on)."""
    first = builder.build(0, dummy_decode_batch(1, block_size, device))
    second = builder.build(0, dummy_decode_batch(1, block_size, device))
    return same_buffers(first, second)


@contextlib.contextmanager
def _syncs_raise() -> Iterator[None]:
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():  # torch warns that the mode is a prototype, every time
        warnings.simplefilter("ignore", UserWarning)
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


@dataclass
class DecodeGraph:
    """One captured decode step of `size` tokens (one per request, padded)."""

    graph: Any  # torch.cuda.CUDAGraph
    inputs: torch.Tensor  # [2, size] int64: token ids, positions
    metadata: Any  # the captured attention metadata: views of the builder's buffers
    logits: torch.Tensor  # [size, vocab], rewritten by every replay


class DecodeGraphRunner:
    """Captures a decode step per batch bucket on first use and replays it.

    `forward(input_ids [1, T], position_ids [1, T])` runs the model under the current forward
    context and returns logits for every token [T, vocab]; it must be capturable (no host
    sync, no data-dependent shape). A capture that fails turns the runner off with a warning
    (steps then run eagerly); a replay never runs on metadata it cannot vouch for.
    """

    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 builder: Any, block_size: int, max_num_seqs: int, device: torch.device):
        self.forward, self.builder = forward, builder
        self.block_size, self.device = block_size, device
        self.sizes = batch_buckets(max_num_seqs)
        self.graphs: dict[int, DecodeGraph] = {}
        self.pool = None  # one memory pool for every bucket: only one replays at a time
        self.disabled_reason: Optional[str] = None
        if not builder_reuses_buffers(builder, block_size, device):
            self._disable(f"{type(builder).__name__}.build returns new tensors, not views of "
                          "persistent buffers: a replay would read a stale batch")

    def run(self, token_ids: list[int], positions: list[int],
            common: CommonAttentionMetadata) -> Optional[torch.Tensor]:
        """Logits [n, vocab] of a batch of n decodes (one token per request) from a graph
        replay, or None: run the step eagerly. The rows are valid until the next replay."""
        n = len(token_ids)
        if self.disabled_reason is not None or n > self.sizes[-1]:
            return None
        size = next(b for b in self.sizes if b >= n)
        entry = self.graphs.get(size) or self._capture(size)
        if entry is None:
            return None
        metadata = self.builder.build(0, common)  # the new batch, into the captured buffers
        if not same_buffers(metadata, entry.metadata):
            self._disable("the builder moved its buffers after capture")
            return None
        pad = [0] * (size - n)
        entry.inputs.copy_(torch.tensor([token_ids + pad, positions + pad]), non_blocking=True)
        entry.graph.replay()
        return entry.logits[:n]

    def _capture(self, size: int) -> Optional[DecodeGraph]:
        metadata = self.builder.build_for_cudagraph_capture(
            dummy_decode_batch(size, self.block_size, self.device))
        # The warm-up really runs: it must not write its keys over a block a request owns.
        metadata.slot_mapping.fill_(-1)
        inputs = torch.zeros(2, size, dtype=torch.long, device=self.device)
        try:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), set_forward_context(metadata):
                self.forward(inputs[0:1], inputs[1:2])  # compile and autotune outside capture
                with _syncs_raise():  # a host sync would break the capture: find it here
                    self.forward(inputs[0:1], inputs[1:2])
            torch.cuda.current_stream().wait_stream(stream)
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with set_forward_context(metadata), torch.cuda.graph(graph, pool=self.pool):
                logits = self.forward(inputs[0:1], inputs[1:2])
        except RuntimeError as e:  # e.g. a host sync (MoE routing's nonzero) in the forward
            self._disable(f"capturing a decode step of {size} failed: {type(e).__name__}: {e}")
            return None
        self.graphs[size] = DecodeGraph(graph, inputs, metadata, logits)
        return self.graphs[size]

    def _disable(self, reason: str) -> None:
        self.disabled_reason = reason
        warnings.warn(f"CUDA graphs off, decode steps run eagerly: {reason}", RuntimeWarning,
                      stacklevel=3)
