"""Host ms of the paged generator's decode steps on the CPU, the model taken out.

The generator runs as on a GPU with CUDA graphs (FLASH_ATTN's builder, every step handed to
the graph runner) but each "replay" does nothing and returns fixed logits: what is left is
the host's part of a step (scheduling, block bookkeeping, inputs, metadata, the builder's
refill, staging the graph inputs, reading the tokens back, finishing requests), which on a
GPU runs while the device waits. Per batch size: the median and best host ms of a decode
step (all requests decoding), and the calls a step makes (cProfile), to show that they do
not grow with the batch.

    PYTHONPATH=src python benchmarks/bench_generator_host.py [--requests 1 32 64 256 512]

Wall clock on the CPU (`time.perf_counter_ns`): on a shared machine other work shows as
noise; the best of the steps is the least disturbed. Needs transformers (the hf extra).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from types import SimpleNamespace

import torch
from timing import Emitter, markdown_table

from pagedattn.backends.flash_attn import FlashAttentionBackend
from pagedattn.integrations import hf_generator
from pagedattn.integrations.cuda_graphs import DecodeGraph, DecodeGraphRunner, dummy_batch
from pagedattn.integrations.hf_generator import PagedGenerator
from pagedattn.integrations.hf_models import tiny_model

VOCAB = 256  # the tiny model's


def stub_graphs() -> None:
    """Every step goes to the graph runner, whose captures record nothing and whose replays
    do nothing (reads the runner's capture hook: a benchmark's business)."""
    def capture(self, key):
        tokens, reqs = (key, key) if isinstance(key, int) else key
        metadata = self.builder.build_for_cudagraph_capture(
            dummy_batch(tokens, reqs, self.block_size, self.device))
        logits = torch.randn(reqs, VOCAB, generator=torch.Generator().manual_seed(reqs))
        self.graphs[key] = DecodeGraph(SimpleNamespace(replay=lambda: None),
                                       torch.zeros(2 * tokens + reqs, dtype=torch.long),
                                       metadata, logits, tokens, reqs)
        return self.graphs[key]

    DecodeGraphRunner._capture = capture
    hf_generator.why_not_cuda_graphs = lambda device, builder: []


def decoding_generator(num_reqs: int, steps: int) -> PagedGenerator:
    """A generator whose `num_reqs` requests (prompts of 16-299 tokens) all decode, with
    `steps` decode steps left before the first finishes."""
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(16, 300, (num_reqs,), generator=g).tolist()
    # the first requests decode while the last ones' prompts run (512 tokens a step, with
    # room for every decode beside them)
    new = sum(lens) // 512 + 2 * steps + 10
    gen = PagedGenerator(tiny_model("llama"), block_size=16,
                         num_blocks=num_reqs * -(-(300 + new) // 16), max_num_seqs=num_reqs,
                         max_num_batched_tokens=512 + num_reqs, max_model_len=300 + new,
                         attn_backend=FlashAttentionBackend)
    for n in lens:
        gen.add_request(torch.randint(3, VOCAB, (n,), generator=g).tolist(), new,
                        eos_token_id=())
    while gen.waiting or any(r.num_computed < r.prompt_len for r in gen.running):
        gen.step()
    return gen


def row(num_reqs: int, steps: int) -> tuple:
    gen = decoding_generator(num_reqs, steps)
    times = []
    for _ in range(steps):
        start = time.perf_counter_ns()
        gen.step()
        times.append(time.perf_counter_ns() - start)
    assert all(s.cuda_graph and s.num_reqs == num_reqs for s in gen.stats[-steps:])
    profile = cProfile.Profile()
    profile.runcall(gen.step)
    calls = pstats.Stats(profile).total_calls
    return (num_reqs, statistics.median(times) / 1e6, min(times) / 1e6,
            statistics.median(s.host_seconds for s in gen.stats[-steps - 1:-1]) * 1e3, calls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, nargs="+", default=[1, 32, 64, 256, 512])
    ap.add_argument("--steps", type=int, default=50, help="decode steps timed per row")
    ap.add_argument("--out", default=None, help="also write the table (markdown) here")
    args = ap.parse_args()
    stub_graphs()
    emit = Emitter()
    emit.to_file(args.out)
    emit(f"The paged generator's decode step on the CPU, model and replay stubbed: host ms "
         f"({args.steps} steps per row, wall clock)\n")
    emit.lines(markdown_table(("requests", "median ms", "best ms",
                               "`StepStats.host_seconds` median ms", "Python calls a step"),
                              [row(n, args.steps) for n in args.requests]))


if __name__ == "__main__":
    main()
