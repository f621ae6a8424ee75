"""Host time of one decode step's block bookkeeping: allocate + block table + slots.

Requests of ~300 tokens (280-319, block 16) each take one token per step. Per batch size it
prints, in one run, the milliseconds of one step's bookkeeping two ways:

- batched (what an engine does): `BlockTable.append_tokens_batch` (the step's new blocks in
  one allocation, written into the rows in place), `BlockTable.tensor` (one gather) and
  `MetadataStager.make` (slots and offsets, vectorised), each timed, and their sum;
- per request (the README's loop): `append_tokens` once per request (each returns its
  slots), then `tensor` and `from_lengths`.

    PYTHONPATH=src python benchmarks/bench_block_table.py [--requests 1 32 256 512] [--out f.md]

Median of `--steps` steps (the sequences grow by one token a step), wall clock
(`time.perf_counter_ns`): on a shared machine, other work shows as noise. No GPU needed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from timing import Emitter, markdown_table

from pagedattn import BlockAllocator, BlockTable, CommonAttentionMetadata
from pagedattn.metadata_staging import MetadataStager

BLOCK = 16


def started_table(num_reqs: int, steps: int, seed: int = 0) -> tuple[BlockTable, list[int]]:
    """A table whose requests hold their ~300-token prompts, with room for `steps` more."""
    lens = np.random.default_rng(seed).integers(280, 320, num_reqs)
    table = BlockTable(BlockAllocator(num_reqs * (-(-(320 + steps) // BLOCK) + 1)), BLOCK)
    req_ids = list(range(num_reqs))
    for r in req_ids:
        table.add_request(r)
    table.append_tokens_batch(req_ids, lens)
    return table, req_ids


def batched_ms(num_reqs: int, steps: int) -> tuple[float, float, float, float]:
    """Median ms of (append_tokens_batch, tensor, make, the whole step)."""
    table, req_ids = started_table(num_reqs, steps)
    stager = MetadataStager("cpu")
    ones = np.ones(num_reqs, dtype=np.int64)
    times = []
    clock = time.perf_counter_ns
    for _ in range(steps):
        t0 = clock()
        seq_lens = table.append_tokens_batch(req_ids, ones)
        t1 = clock()
        block_table = table.tensor(req_ids)
        t2 = clock()
        common = stager.make(ones, seq_lens, block_table, BLOCK)
        t3 = clock()
        times.append((t1 - t0, t2 - t1, t3 - t2, t3 - t0))
        del common, block_table
    return tuple(statistics.median(col) / 1e6 for col in zip(*times))


def per_request_ms(num_reqs: int, steps: int) -> float:
    """Median ms of the README's step: append_tokens per request, tensor, from_lengths."""
    table, req_ids = started_table(num_reqs, steps)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter_ns()
        for r in req_ids:
            table.append_tokens(r, 1)
        CommonAttentionMetadata.from_lengths([1] * num_reqs, [table.num_tokens[r] for r in req_ids],
                                             table.tensor(req_ids), BLOCK)
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, nargs="+", default=[1, 32, 256, 512])
    ap.add_argument("--steps", type=int, default=200, help="decode steps timed per row")
    ap.add_argument("--out", default=None, help="also write the table (markdown) here")
    args = ap.parse_args()
    emit = Emitter()
    emit.to_file(args.out)
    emit(f"One decode step's block bookkeeping, ms (median of {args.steps} steps; requests of "
         f"280-319 tokens, block {BLOCK}; wall clock on the CPU)\n")
    rows = []
    for n in args.requests:
        append, table, make, total = batched_ms(n, args.steps)
        slow = per_request_ms(n, max(5, args.steps // 10))
        rows.append((n, append, table, make, total, slow, f"{slow / total:.0f}x"))
    emit.lines(markdown_table(
        ("requests", "`append_tokens_batch`", "`tensor`", "`MetadataStager.make`",
         "batched step", "per-request step (README loop)", "speed-up"), rows))


if __name__ == "__main__":
    main()
