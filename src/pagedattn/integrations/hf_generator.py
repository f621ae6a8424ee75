"""A small continuous-batching generator: transformers decoder models over a paged KV cache.

Each step packs the scheduled tokens of all running requests into one row: decodes first
(one token each), then prompt chunks (chunked prefill) up to a token budget. Blocks are
allocated as sequences grow and freed when a request finishes; a request is admitted only
when the free blocks cover its whole life (prompt + max_new_tokens), so a running request
never has to be preempted. Sampling is greedy: the point is exact agreement with
transformers' own `generate`.

A step's host work is built for the whole batch at once, so that it stays below the GPU's
step at hundreds of requests: the block table reserves every request's tokens in one call,
token ids, positions and sampled rows are numpy arrays, the metadata is one
`MetadataStager.make`, the sampled tokens come back in one copy (the step's one device sync),
and only the requests whose prompt chunks ran are offered to the prefix cache.
`StepStats.host_seconds` is what the host spent, the wait at that sync excluded.

Async scheduling (on by default on CUDA, `async_scheduling`) overlaps the two: a `step()`
launches the next step before it reads this one's tokens back, so the host prepares step t+1
while the device runs step t (`integrations/async_steps.py`). Step t+1 is scheduled as if
every request continues; its decodes take their input tokens from step t's sampled tokens on
the device. A request that stops at step t by EOS (the one thing not known in advance:
max_new_tokens is) had one more token computed at step t+1, which is discarded, and its blocks
are freed once step t+1 is done with them. A step whose composition the tokens could change
otherwise (a waiting request could take a seat) runs serialised, as without the option, so
the tokens are the same with and without it.

On CUDA, a step is replayed from a CUDA graph of its padded shape (`integrations/cuda_graphs.py`)
when the backend's builder supports it: every step with FLASH_ATTN and FLASHINFER (ALWAYS;
FLASHINFER's cascade steps stay eager), pure-decode steps with a builder that supports
uniform batches only.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
from torch import nn

from pagedattn.config import CacheConfig, EngineConfig, batch_invariant_mode
from pagedattn.cpu_threads import ThreadPolicy, torch_threads
from pagedattn.forward_context import set_forward_context
from pagedattn.integrations import transformers as hf
from pagedattn.integrations.async_steps import LaunchedStep, carry_tokens, pending_rows
from pagedattn.integrations.batch_invariant_ops import batch_invariant_ops
from pagedattn.integrations.cuda_graphs import DecodeGraphRunner, why_not_cuda_graphs
from pagedattn.kv_cache import allocate_kv_caches, bind_kv_cache
from pagedattn.metadata import AttentionSpec, BlockAllocator, BlockTable
from pagedattn.metadata_staging import MetadataStager
from pagedattn.types import AttentionBackend


@dataclass
class Request:
    """One generation request; `token_ids` grows by one token per decode step."""

    req_id: int
    token_ids: list[int]
    prompt_len: int
    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    num_computed: int = 0  # tokens whose keys/values are in the cache
    num_prefix_hits: int = 0  # prompt tokens found in the prefix cache (not recomputed)
    prefix_keys: list[int] = field(default_factory=list)  # chained hash per full prompt block
    logits: list[torch.Tensor] = field(default_factory=list)  # per generated token, if recorded
    finished: bool = False
    # Tokens sampled for it by launched steps, read back or not (its output's length once
    # they are read), and the row of its token among the sampled tokens of the launched step
    # not yet read back (-1: its last token is in token_ids).
    num_sampled: int = 0
    pending_row: int = -1

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    def blocks_needed(self, block_size: int) -> int:
        return -(-(self.prompt_len + self.max_new_tokens) // block_size)


@dataclass
class StepStats:
    """What one step ran: how many prefill and decode tokens, over how many requests.

    `seconds` is the wall time of the `step()` call that read the step back; with async
    scheduling that call also launched the next step, so the calls' times add up to the
    run's and a step's share of it drops toward the device's step time."""

    num_reqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    blocks_in_use: int
    seconds: float
    cuda_graph: bool = False  # replayed from a captured graph
    # The call's wall time less the wait for the device at the step's one sync: the host's
    # own time (scheduling, bookkeeping, metadata, launches or the replay call, the tokens).
    host_seconds: float = 0.0
    overlapped: bool = False  # launched while the step before it ran, before its tokens came
    discarded: int = 0  # tokens computed for requests that had stopped at the step before
    threads: int = 0  # torch's intra-op threads for a CPU step (0: not a CPU step)


class PagedGenerator:
    """Greedy generation for a transformers causal LM with attention run by pagedattn.

    `max_model_len` bounds prompt + new tokens of a request (default: the whole cache); it sizes
    the builder's block tables and is the key bound captured decode graphs plan with, so a
    tight value gives them a better split-KV choice. `use_cuda_graphs` replays pure-decode
    steps from CUDA graphs, and steps with prompt chunks too where the builder declares ALWAYS
    (FLASH_ATTN, FLASHINFER); ignored off CUDA and for builders below UNIFORM_BATCH support
    (`cuda_graphs_off` says why). Graph steps pad the batch to a bucket, so their matmuls run
    on more rows than eager ones: same ops, rounding may differ in the last bit.

    `batch_invariant` (or PAGEDATTN_BATCH_INVARIANT=1): each request's logits the same bits
    whatever else runs beside it, padded graph steps included. The builder plans
    batch-invariant attention (its EngineConfig's mode) and the model's forward runs inside
    `model_ops`, which is then `batch_invariant_ops` (its matmuls and means too; entered per
    forward, so the overrides hold only while the model runs), else a no-op context.

    `async_scheduling` launches each step before the previous one is read back (the module's
    docstring); None: on where the device runs apart from the host (CUDA). True runs the
    same code path on the CPU, where nothing overlaps.

    `cpu_threads` sets torch's intra-op threads for each step on a CPU (restored after it):
    "auto" (or a `ThreadPolicy`, to share one) the cores other processes leave free,
    measured as the steps run (`pagedattn.cpu_threads`: threads waiting on a busy core made
    steps several times slower); a number, that many; None leaves torch's setting alone.
    """

    def __init__(self, model: nn.Module, *, block_size: int = 16, num_blocks: int = 512,
                 max_num_seqs: int = 8, max_num_batched_tokens: int = 256,
                 kv_cache_dtype: str = "auto", record_logits: bool = False,
                 attn_backend: Optional[type[AttentionBackend]] = None,
                 enable_prefix_caching: bool = True, max_model_len: Optional[int] = None,
                 use_cuda_graphs: bool = True, batch_invariant: bool = False,
                 async_scheduling: Optional[bool] = None,
                 cpu_threads: ThreadPolicy | int | str | None = "auto") -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.cpu_threads = _cpu_threads(cpu_threads) if self.device.type == "cpu" else None
        self.block_size, self.num_blocks = block_size, num_blocks
        self.max_model_len = max_model_len or num_blocks * block_size
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.record_logits = record_logits
        cache_config = CacheConfig(block_size=block_size, cache_dtype=kv_cache_dtype,
                                   num_gpu_blocks=num_blocks)
        self.layers = hf.attach(model, cache_config, attn_backend)
        self.kv_caches = allocate_kv_caches(self.layers, num_blocks, self.device, model.dtype)
        for cache in self.kv_caches.values():
            # Never-written slots of a block are read (and masked) with the written ones; torch
            # provider's p * V turns garbage NaNs there into NaN outputs, so start from zeros.
            cache.zero_()
        bind_kv_cache(self.kv_caches, self.layers)
        first = next(iter(self.layers.values()))
        self.backend = first.attn_backend
        config = EngineConfig(max_num_seqs, self.max_model_len, max_num_batched_tokens,
                              cache_config, batch_invariant=batch_invariant)
        self.builder = self.backend.get_builder_cls()(
            AttentionSpec(block_size, first.num_kv_heads, first.head_size, model.dtype,
                          kv_cache_dtype),
            list(self.layers), config, self.device)
        # The context each model forward runs in (eager and captured alike).
        self.batch_invariant = batch_invariant_mode(config)
        self.model_ops: Callable[[], AbstractContextManager] = (
            batch_invariant_ops if self.batch_invariant else contextlib.nullcontext)
        self.allocator = BlockAllocator(num_blocks)
        self.block_table = BlockTable(self.allocator, block_size)
        # Steps upload straight into the builder's persistent buffers where it has them
        self._stager = MetadataStager(self.device,
                                      getattr(self.builder, "persistent_batch", None))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.stats: list[StepStats] = []
        self.peak_blocks_in_use = 0
        self._next_id = 0
        # Prefix cache: full prompt blocks whose K/V are computed, by the chained hash of the
        # tokens up to their end, so a request whose prompt starts the same way shares them.
        self.enable_prefix_caching = enable_prefix_caching
        self._cached_blocks: dict[int, int] = {}  # prefix key -> block id
        self._block_keys: dict[int, int] = {}  # block id -> prefix key
        # Only the logits of sampled positions are needed; most models take their indices.
        self._takes_logits_to_keep = "logits_to_keep" in inspect.signature(
            model.forward).parameters
        self.async_scheduling = self.device.type == "cuda" if async_scheduling is None \
            else bool(async_scheduling)
        self._launched: Optional[LaunchedStep] = None  # launched, not yet read back
        self.graphs: Optional[DecodeGraphRunner] = None
        self.cuda_graphs_off = ["use_cuda_graphs=False"] if not use_cuda_graphs else \
            why_not_cuda_graphs(self.device, self.builder)
        if not self.cuda_graphs_off:
            self.graphs = DecodeGraphRunner(self._graph_logits, self.builder, block_size,
                                            max_num_seqs, self.device, max_num_batched_tokens)

    # --- requests ----------------------------------------------------------------------------
    def add_request(self, prompt_ids: Sequence[int], max_new_tokens: int,
                    eos_token_id: int | Sequence[int] | None = None) -> Request:
        if not prompt_ids:
            raise ValueError("prompt_ids is empty: a request needs at least one token")
        eos = () if eos_token_id is None else (
            (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id))
        req = Request(self._next_id, list(prompt_ids), len(prompt_ids), max_new_tokens,
                      frozenset(eos))
        if req.prompt_len + max_new_tokens > self.max_model_len:
            raise ValueError(f"request {req.req_id} has {req.prompt_len} prompt + "
                             f"{max_new_tokens} new tokens > max_model_len="
                             f"{self.max_model_len}; raise max_model_len")
        if req.blocks_needed(self.block_size) > self.num_blocks:
            raise ValueError(f"request {req.req_id} needs {req.blocks_needed(self.block_size)} "
                             f"blocks of {self.block_size} tokens but the cache has "
                             f"{self.num_blocks}; raise num_blocks")
        self._next_id += 1
        self.waiting.append(req)
        return req

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running) or self._launched is not None

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 eos_token_id: int | Sequence[int] | None = None,
                 on_step: Optional[Callable[[StepStats, list[Request]], None]] = None
                 ) -> list[list[int]]:
        """Run all prompts to completion; returns each one's generated token ids, in order.
        `eos_token_id` None means the model's (as transformers' `generate`); () means none."""
        if eos_token_id is None:
            eos_token_id = getattr(self.model.generation_config, "eos_token_id", None)
        reqs = [self.add_request(p, max_new_tokens, eos_token_id) for p in prompts]
        while self.has_unfinished():
            finished = self.step()
            if on_step is not None:
                on_step(self.stats[-1], finished)
        return [r.output_ids for r in reqs]

    # --- one step ----------------------------------------------------------------------------
    def schedule(self) -> list[tuple[Request, int]]:
        """Pick (request, num_tokens) for this step: decodes, then prompt chunks, in budget."""
        reqs, query_lens, _ = self._schedule()
        return list(zip(reqs, query_lens.tolist()))

    def _schedule(self, ahead: bool = False) -> tuple[list[Request], np.ndarray, int]:
        """This step's requests (decodes first, one token each, then prompt chunks, within
        the token budget), their query lengths (int64) and how many are decodes. `ahead`:
        a launched step is not read back yet, and the requests it samples the last token of
        (their max_new_tokens reached) get no more."""
        if self.waiting and len(self.running) < self.max_num_seqs:
            self._admit_waiting()
        budget = self.max_num_batched_tokens
        decoding = [r for r in self.running if r.num_computed >= r.prompt_len]
        prefilling = len(decoding) < len(self.running)
        if ahead:
            decoding = [r for r in decoding if r.num_sampled < r.max_new_tokens]
        reqs = decoding[:budget]
        num_decodes = len(reqs)
        budget -= num_decodes
        chunks = []
        if budget > 0 and prefilling:
            for req in self.running:
                if req.num_computed < req.prompt_len:
                    n = min(len(req.token_ids) - req.num_computed, budget)
                    reqs.append(req)
                    chunks.append(n)
                    budget -= n
                    if budget == 0:
                        break
        query_lens = np.ones(len(reqs), dtype=np.int64)
        query_lens[num_decodes:] = chunks
        return reqs, query_lens, num_decodes

    def step(self) -> list[Request]:
        """Run one mixed prefill/decode step; returns the requests that finished in it.

        With async scheduling the call launches the next step before it reads this one's
        tokens back (where `_can_launch_ahead`), and that step is the next call's."""
        policy = self.cpu_threads
        if policy is None:
            return self._step(0)
        with policy.applied() if isinstance(policy, ThreadPolicy) else torch_threads(policy) \
                as threads:
            return self._step(threads)

    @torch.inference_mode()
    def _step(self, threads: int) -> list[Request]:
        start = time.perf_counter()
        current = self._launch(None) if self._launched is None else self._launched
        if current is None:
            raise RuntimeError("nothing could be scheduled: no running request and the next "
                               "waiting one does not fit in the KV cache")
        self._launched = self._launch(current) if self._can_launch_ahead() else None
        finished, discarded, waited = self._complete(current, self._launched)
        seconds = time.perf_counter() - start
        self.stats.append(StepStats(
            len(current.reqs), int(current.query_lens[current.num_decodes:].sum()),
            current.num_decodes, self.blocks_in_use, seconds, current.graphed,
            seconds - waited, current.overlapped, discarded, threads))
        return finished

    def _launch(self, prev: Optional[LaunchedStep]) -> Optional[LaunchedStep]:
        """Schedule a step and launch it: bookkeeping, inputs, metadata, the forward (or its
        graph's replay) and the argmax, with no wait for the device; None if nothing can be
        scheduled. `prev`: the launched step not yet read back, whose sampled tokens feed
        this step's decodes on the device."""
        reqs, query_lens, num_decodes = self._schedule(ahead=prev is not None)
        if not reqs:
            return None
        req_ids = [r.req_id for r in reqs]
        seq_lens = self.block_table.append_tokens_batch(req_ids, query_lens)
        self.peak_blocks_in_use = max(self.peak_blocks_in_use, self.blocks_in_use)
        token_ids, positions, rows, sampled = _step_inputs(reqs, query_lens, seq_lens,
                                                           num_decodes)
        carry = None
        if prev is not None:  # a decode's token that prev samples: from prev's, on the device
            pending = pending_rows(np.array([r.pending_row for r in reqs[:num_decodes]],
                                            dtype=np.int64))
            if pending is not None:
                carry = functools.partial(carry_tokens, tokens=prev.tokens, dest=pending[0],
                                          src=pending[1])
        common = self._stager.make(query_lens, seq_lens, self.block_table.tensor(req_ids),
                                   self.block_size)
        logits = None
        if self.graphs is not None:  # decode or mixed step, replayed: [len(rows), vocab]
            logits = self.graphs.run(token_ids, positions, common, rows, fill_ids=carry)
        graphed = logits is not None
        if logits is None:
            prefix = (self.block_table.common_prefix_len(req_ids)
                      if self.enable_prefix_caching else 0)
            attn_metadata = self.builder.build(common_prefix_len=prefix,
                                               common_attn_metadata=common)
            logits = self._forward(token_ids, positions, rows, attn_metadata, carry)
        step = LaunchedStep(reqs, query_lens, num_decodes, sampled, logits.argmax(-1), graphed,
                            overlapped=prev is not None)
        step.copy_tokens_out()
        if self.record_logits:  # a graph step's logits are its buffer, rewritten next replay
            step.logits = logits.clone() if graphed else logits
        self._after_launch(reqs, query_lens, seq_lens, num_decodes, sampled)
        return step

    def _after_launch(self, reqs: list[Request], query_lens: np.ndarray, seq_lens: np.ndarray,
                      num_decodes: int, sampled: list[Request]) -> None:
        """What a launched step will have done, recorded before it is read back (a later
        step is ordered after it on the device): computed lengths, newly full prompt blocks
        offered to the prefix cache, tokens sampled and their rows."""
        for req, n in zip(reqs, seq_lens.tolist()):
            req.num_computed = n
        # prompt chunks (a few a step): the blocks they filled
        for req, n in zip(reqs[num_decodes:], query_lens[num_decodes:].tolist()):
            self._cache_prompt_blocks(req, req.num_computed - n)
        for row, req in enumerate(sampled):
            req.pending_row = row
            req.num_sampled += 1

    def _can_launch_ahead(self) -> bool:
        """Whether the next step may be launched before the one in flight is read back: only
        where its tokens can change no more than which requests stop by EOS. A waiting
        request that a seat freed by then could admit would change the next step, so that
        step waits (the serialised step); requests stopping at their max_new_tokens are
        known in advance."""
        if not self.async_scheduling:
            return False
        if self.waiting:
            stopping = sum(r.num_sampled >= r.max_new_tokens for r in self.running)
            return len(self.running) - stopping >= self.max_num_seqs
        return True

    def _complete(self, step: LaunchedStep, ahead: Optional[LaunchedStep]
                  ) -> tuple[list[Request], int, float]:
        """A launched step's results into the requests: reads its tokens back (its one
        sync), appends them, finishes the requests that stop (their blocks freed, or handed
        to `ahead` where it computes one more of their tokens) and frees the blocks of those
        that stopped a step earlier. Returns the requests that finished, the tokens
        discarded and the seconds waited for the device."""
        tokens, waited = step.read_tokens()
        logits = step.host_logits() if self.record_logits else None
        finished, discarded = [], 0
        for row, (req, token) in enumerate(zip(step.sampled, tokens)):
            if req.finished:  # it stopped at the step before: this token is past its end
                discarded += 1
                continue
            ids = req.token_ids
            ids.append(token)
            generated = len(ids) - req.prompt_len
            if generated == req.num_sampled:  # no later launched step samples it
                req.pending_row = -1
            if logits is not None:
                req.logits.append(logits[row])
            if generated >= req.max_new_tokens or token in req.eos_token_ids:
                finished.append(req)
        for req in finished:
            self._finish(req, ahead)
        if finished:
            self.running = [r for r in self.running if not r.finished]
        for req in step.free_after:
            self._free_blocks(req)
        return finished, discarded, waited

    @property
    def blocks_in_use(self) -> int:
        return self.num_blocks - self.allocator.num_free

    def _forward(self, token_ids: np.ndarray, positions: np.ndarray, rows: np.ndarray,
                 attn_metadata, fill_ids: Optional[Callable[[torch.Tensor], None]] = None
                 ) -> torch.Tensor:
        """One packed forward; returns the logits of token rows `rows` [len(rows), vocab].
        `fill_ids` writes the ids only the device has yet into the uploaded ones."""
        n = token_ids.shape[0]
        # One upload for the three: non_blocking from pageable memory is staged by the driver
        # before the call returns (safe to reuse the array), without a stream sync.
        inputs = torch.from_numpy(np.concatenate((token_ids, positions, rows))).to(
            self.device, non_blocking=True)
        if fill_ids is not None:
            fill_ids(inputs[:n])
        input_ids, position_ids, sample_idx = inputs[:n][None], inputs[n:2 * n][None], \
            inputs[2 * n:]
        with set_forward_context(attn_metadata):
            logits = self._logits(input_ids, position_ids, sample_idx)
        return logits if self._takes_logits_to_keep else logits[sample_idx]

    def _graph_logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                      rows: torch.Tensor) -> torch.Tensor:
        """Logits of token rows `rows` [R, vocab]: a captured step's forward."""
        logits = self._logits(input_ids, position_ids, rows)
        return logits if self._takes_logits_to_keep else logits[rows]

    def _logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                logits_to_keep: torch.Tensor | int) -> torch.Tensor:
        """The model's forward over one packed row: logits [kept tokens, vocab] (all tokens
        where the model takes no `logits_to_keep`; 0 keeps all). Capturable in a CUDA graph."""
        kwargs = {"logits_to_keep": logits_to_keep} if self._takes_logits_to_keep else {}
        # An all-ones mask: without one, transformers looks for packed sequences in
        # position_ids, a host sync (and a data-dependent branch) every step. Our attention
        # ignores the mask; the metadata keeps requests apart.
        with self.model_ops():
            out = self.model(input_ids=input_ids, position_ids=position_ids,
                             attention_mask=torch.ones_like(input_ids), use_cache=False,
                             **kwargs)
        return out.logits[0]

    def _finish(self, req: Request, ahead: Optional[LaunchedStep] = None) -> None:
        """Mark `req` finished and free its blocks, or leave them to `ahead` where that
        launched step computes one more token of it (the caller drops it from `running`)."""
        req.finished = True
        self.finished.append(req)
        if ahead is not None and req.num_sampled > len(req.token_ids) - req.prompt_len:
            ahead.free_after.append(req)  # the device may still read them
        else:
            self._free_blocks(req)

    def _free_blocks(self, req: Request) -> None:
        for block in self.block_table.free_request(req.req_id):
            key = self._block_keys.pop(block, None)
            if key is not None:
                del self._cached_blocks[key]

    # --- prefix cache ------------------------------------------------------------------------
    def _admit_waiting(self) -> None:
        """Start waiting requests, in order, while the free blocks cover what they and the
        running requests still need; a prompt prefix found in the cache is shared, not
        recomputed."""
        bs = self.block_size
        still_needed = sum(r.blocks_needed(bs) for r in self.running) - int(
            self.block_table.block_counts([r.req_id for r in self.running]).sum())
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            shared = self._match_prefix(req)
            need = req.blocks_needed(bs) - len(shared)
            if need > self.allocator.num_free - still_needed:
                return  # admit it once running requests finish and free their blocks
            self.block_table.add_request(req.req_id, shared)
            req.num_computed = req.num_prefix_hits = len(shared) * bs
            still_needed += need
            self.running.append(self.waiting.popleft())

    def _prompt_block_keys(self, req: Request, num_blocks: int) -> list[int]:
        """Chained hashes of the first `num_blocks` full prompt blocks (computed once each)."""
        bs = self.block_size
        while len(req.prefix_keys) < num_blocks:
            i = len(req.prefix_keys)
            parent = req.prefix_keys[-1] if req.prefix_keys else 0
            req.prefix_keys.append(hash((parent, tuple(req.token_ids[i * bs:(i + 1) * bs]))))
        return req.prefix_keys[:num_blocks]

    def _match_prefix(self, req: Request) -> list[int]:
        if not self.enable_prefix_caching:
            return []
        # At least the last prompt token is recomputed: its logits pick the first new token.
        keys = self._prompt_block_keys(req, (req.prompt_len - 1) // self.block_size)
        shared = []
        for key in keys:
            if key not in self._cached_blocks:
                break
            shared.append(self._cached_blocks[key])
        return shared

    def _cache_prompt_blocks(self, req: Request, computed_before: int) -> None:
        """Offer the full prompt blocks the request's last chunk completed (those past
        `computed_before` tokens) to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        first = min(computed_before, req.prompt_len) // bs
        full = min(req.num_computed, req.prompt_len) // bs
        if full == first:
            return
        keys = self._prompt_block_keys(req, full)[first:]
        blocks = self.block_table.blocks[req.req_id][first:full]
        for key, block in zip(keys, blocks):
            if key not in self._cached_blocks and block not in self._block_keys:
                self._cached_blocks[key] = block
                self._block_keys[block] = key


def _cpu_threads(choice: ThreadPolicy | int | str | None) -> ThreadPolicy | int | None:
    if choice == "auto":
        return ThreadPolicy()
    if choice is None or isinstance(choice, ThreadPolicy) or (
            isinstance(choice, int) and not isinstance(choice, bool) and choice > 0):
        return choice
    raise ValueError(f"cpu_threads={choice!r}: expected 'auto', a ThreadPolicy, a positive "
                     "number of threads, or None (leave torch's setting alone)")


def _step_inputs(reqs: list[Request], query_lens: np.ndarray, seq_lens: np.ndarray,
                 num_decodes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[Request]]:
    """A step's token ids and positions (int64 [num_tokens], requests back to back), the
    token rows to sample (int64: where a request's known tokens end, the last prompt token
    or its decode token) and the requests sampled, in row order. A decode whose token a
    launched step samples gets its last known one here, replaced on the device."""
    decodes = reqs[:num_decodes]
    token_ids = [r.token_ids[-1] for r in decodes]  # a decode's one token: its last
    computed = seq_lens - query_lens
    if num_decodes == len(reqs):
        return np.array(token_ids, dtype=np.int64), computed, np.arange(num_decodes), decodes
    sampled, rows = list(decodes), list(range(num_decodes))
    ends = np.add.accumulate(query_lens)
    for i in range(num_decodes, len(reqs)):  # prompt chunks: a few a step
        req, n, start = reqs[i], int(query_lens[i]), reqs[i].num_computed
        token_ids += req.token_ids[start:start + n]
        if start + n == len(req.token_ids):  # its last prompt chunk
            sampled.append(req)
            rows.append(int(ends[i]) - 1)
    positions = np.arange(int(ends[-1])) + np.repeat(computed - (ends - query_lens), query_lens)
    return np.array(token_ids, dtype=np.int64), positions, np.array(rows, dtype=np.int64), sampled
