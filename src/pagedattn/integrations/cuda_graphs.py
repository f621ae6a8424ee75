"""Replay the paged generator's steps from CUDA graphs: decodes and mixed prefill steps.

A small model's step is a millisecond of GPU work behind tens of milliseconds of host work
(the HF layers' Python, one launch per kernel). A CUDA graph records the launches once per
padded shape (bucket) and replays them with one call. Pure-decode steps use a graph per padded
batch size; steps with prompt chunks use one per (padded token count, padded request count),
captured with a query bound of all their tokens, so any mix of chunks and decodes that fits
replays (the attention plan launches both kernel passes, each program finds its work on the
device). What changes between steps lives in device buffers the graph reads: the token ids,
positions and the rows to sample (copied in here) and the attention metadata, which the
builder writes into its persistent buffers on every `build` (FLASH_ATTN's builder;
`builder_reuses_buffers` checks it, because a builder that hands out new tensors would make a
replay read a stale batch). A builder whose graphs need each batch planned into the captured
step's own buffers (FLASHINFER's CUDA-graph wrappers) says so with
`build_for_cudagraph_replay(common, captured_metadata)`, used instead of `build`. Padding
requests have query_len 0 and seq_len 0 and padding tokens slot -1, which the builder fills
in for batches smaller than the captured one; their rows are dropped.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
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


def token_buckets(max_num_batched_tokens: int) -> list[int]:
    """Padded token counts of mixed steps: powers of 2 from 16, and max_num_batched_tokens."""
    sizes, b = [], 16
    while b < max_num_batched_tokens:
        sizes.append(b)
        b *= 2
    return sizes + [max_num_batched_tokens]


def why_not_cuda_graphs(device: torch.device, builder: Any) -> list[str]:
    """Reasons the generator cannot replay steps from graphs ([] if it can)."""
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
    return dummy_batch(num_reqs, num_reqs, block_size, device)


def dummy_batch(num_tokens: int, num_reqs: int, block_size: int,
                device: torch.device) -> CommonAttentionMetadata:
    """num_reqs requests sharing num_tokens new tokens as evenly as possible, keys = queries,
    every block 0 (capture only: its slots are set to -1)."""
    lens = [num_tokens // num_reqs + (r < num_tokens % num_reqs) for r in range(num_reqs)]
    table = torch.zeros(num_reqs, -(-max(lens) // block_size), dtype=torch.int32)
    return CommonAttentionMetadata.from_lengths(lens, lens, table, block_size, device)


def same_buffers(a: Any, b: Any) -> bool:
    names = getattr(a, "cuda_graph_inputs", _GRAPH_INPUTS)  # a metadata class may name its own
    return all(getattr(a, n).data_ptr() == getattr(b, n).data_ptr() for n in names)


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
    """One captured step of `num_tokens` tokens over `num_reqs` requests (padded)."""

    graph: Any  # torch.cuda.CUDAGraph
    inputs: torch.Tensor  # [2 * num_tokens + num_reqs] int64: ids, positions, sampled rows
    metadata: Any  # the captured attention metadata: views of the builder's buffers
    logits: torch.Tensor  # [num_reqs, vocab], rewritten by every replay
    num_tokens: int = 0
    num_reqs: int = 0
    # The host side of `inputs` (pinned on CUDA), a numpy view of it and the event of its
    # last upload: a step writes its inputs there and uploads them with one non_blocking
    # copy. Made on the first replay.
    staging: Optional[torch.Tensor] = None
    staging_np: Optional[np.ndarray] = None
    staged: Any = None  # torch.cuda.Event on CUDA


class DecodeGraphRunner:
    """Captures a step per bucket on first use and replays it (decode and mixed steps).

    `forward(input_ids [1, T], position_ids [1, T], rows [R])` runs the model under the
    current forward context and returns the logits of token rows `rows` [R, vocab]; it must be
    capturable (no host sync, no data-dependent shape). A capture that fails turns the runner
    off with a warning (steps then run eagerly); a replay never runs on metadata it cannot
    vouch for. Mixed steps are captured only with a builder that declares ALWAYS.
    """

    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor],
                                         torch.Tensor],
                 builder: Any, block_size: int, max_num_seqs: int, device: torch.device,
                 max_num_batched_tokens: int = 0):
        self.forward, self.builder = forward, builder
        self.block_size, self.device = block_size, device
        self.sizes = batch_buckets(max_num_seqs)
        mixed = getattr(builder, "cudagraph_support", 0) >= AttentionCGSupport.ALWAYS
        self.token_sizes = token_buckets(max_num_batched_tokens) \
            if mixed and max_num_batched_tokens > 1 else []
        self.graphs: dict[Any, DecodeGraph] = {}  # decodes by batch size, mixed by (T, R)
        self.failed: set = set()  # buckets the builder cannot capture (e.g. > max_model_len)
        self.pool = None  # one memory pool for every bucket: only one replays at a time
        self.disabled_reason: Optional[str] = None
        if not builder_reuses_buffers(builder, block_size, device):
            self._disable(f"{type(builder).__name__}.build returns new tensors, not views of "
                          "persistent buffers: a replay would read a stale batch")

    def bucket(self, num_tokens: int, num_reqs: int, max_query_len: int) -> Optional[Any]:
        """The graph key of a batch: its padded batch size (decodes) or (tokens, requests)."""
        if num_reqs > self.sizes[-1]:
            return None
        reqs = next(b for b in self.sizes if b >= num_reqs)
        if max_query_len == 1:
            return reqs
        tokens = next((t for t in self.token_sizes if t >= num_tokens and t > reqs), None)
        return None if tokens is None else (tokens, reqs)

    def run(self, token_ids: Sequence[int], positions: Sequence[int],
            common: CommonAttentionMetadata, rows: Optional[Sequence[int]] = None
            ) -> Optional[torch.Tensor]:
        """Logits [len(rows), vocab] of token rows `rows` (default: every token) from a graph
        replay, or None: run the step eagerly. Inputs are int sequences or arrays (numpy
        int64 costs least). The rows are valid until the next replay."""
        num_tokens = len(token_ids)
        key = None if self.disabled_reason is not None else self.bucket(
            num_tokens, common.num_reqs, common.max_query_len)
        if key is None or key in self.failed:
            return None
        entry = self.graphs.get(key) or self._capture(key)
        if entry is None:
            return None
        replay = getattr(self.builder, "build_for_cudagraph_replay", None)
        # The new batch, into the captured buffers.
        metadata = replay(common, entry.metadata) if replay else self.builder.build(0, common)
        if not same_buffers(metadata, entry.metadata):
            self._disable("the builder moved its buffers after capture")
            return None
        num_rows = num_tokens if rows is None else len(rows)
        _stage(entry, token_ids, positions, np.arange(num_tokens) if rows is None else rows)
        entry.graph.replay()
        return entry.logits[:num_rows]

    def _capture(self, key: Any) -> Optional[DecodeGraph]:
        tokens, reqs = (key, key) if isinstance(key, int) else key
        try:
            metadata = self.builder.build_for_cudagraph_capture(
                dummy_batch(tokens, reqs, self.block_size, self.device))
        except ValueError:  # the bucket does not fit the builder (e.g. max_model_len)
            self.failed.add(key)
            return None
        # The warm-up really runs: it must not write its keys over a block a request owns.
        metadata.slot_mapping.fill_(-1)
        inputs = torch.zeros(2 * tokens + reqs, dtype=torch.long, device=self.device)
        ids, pos, rows = inputs[:tokens][None], inputs[tokens:2 * tokens][None], \
            inputs[2 * tokens:]
        try:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), set_forward_context(metadata):
                self.forward(ids, pos, rows)  # compile and autotune outside capture
                with _syncs_raise():  # a host sync would break the capture: find it here
                    self.forward(ids, pos, rows)
            torch.cuda.current_stream().wait_stream(stream)
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with set_forward_context(metadata), torch.cuda.graph(graph, pool=self.pool):
                logits = self.forward(ids, pos, rows)
        except RuntimeError as e:  # e.g. a host sync (MoE routing's nonzero) in the forward
            self._disable(f"capturing a step of {tokens} tokens, {reqs} requests failed: "
                          f"{type(e).__name__}: {e}")
            return None
        self.graphs[key] = DecodeGraph(graph, inputs, metadata, logits, tokens, reqs)
        return self.graphs[key]

    def _disable(self, reason: str) -> None:
        self.disabled_reason = reason
        warnings.warn(f"CUDA graphs off, steps run eagerly: {reason}", RuntimeWarning,
                      stacklevel=3)


def _stage(entry: DecodeGraph, token_ids: Sequence[int], positions: Sequence[int],
           rows: Sequence[int]) -> None:
    """A step's ids, positions and sampled rows into the graph's input buffer, zero-padded
    to its bucket: written into the host staging buffer, then one non_blocking copy. The
    last upload from the staging buffer is waited for first (done already where the caller
    read the last step's tokens back, as the generator does)."""
    if entry.staging is None:
        entry.staging = torch.zeros(entry.inputs.shape[0], dtype=torch.int64,
                                    pin_memory=entry.inputs.is_cuda)
        entry.staging_np = entry.staging.numpy()
        entry.staged = torch.cuda.Event() if entry.inputs.is_cuda else None
    elif entry.staged is not None:
        entry.staged.synchronize()
    host, tokens, n, r = entry.staging_np, entry.num_tokens, len(token_ids), len(rows)
    host[:n] = token_ids
    host[n:tokens] = 0
    host[tokens:tokens + n] = positions
    host[tokens + n:2 * tokens] = 0
    host[2 * tokens:2 * tokens + r] = rows
    host[2 * tokens + r:] = 0
    entry.inputs.copy_(entry.staging, non_blocking=True)
    if entry.staged is not None:
        entry.staged.record()
