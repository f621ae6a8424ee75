"""Batch-invariant mode's guarantee checked for a config of `launch.SWITCHES` (issue 44; what
`tools/sweep_invariant.py` runs before it times a config): a request's rows, outputs and
float32 LSEs, alone, inside a batch of other prompts and decodes, and computed chunk by chunk
and as decode steps, all `torch.equal`, under each split schedule.

`World` holds requests over one scattered paged cache and runs parts of them through the
Triton pass; `check_invariance(run, lengths, seed)` says which comparison broke (None: none);
`check_config(config, head_sizes, smoke)` runs it at each head size under a config's switches.
"""

from __future__ import annotations

import itertools
import math
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Optional

BENCHMARKS = str(Path(__file__).resolve().parents[1] / "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)

import torch  # noqa: E402
from bench_batch_invariant import switches  # noqa: E402

from pagedattn.ops.triton import launch  # noqa: E402
from pagedattn.ops.triton.op_plans import varlen_attention  # noqa: E402


class World:
    """Requests of given lengths over one scattered paged cache (bf16 on the GPU, float32 on
    the CPU): `run(parts, num_splits)` gives the batch-invariant rows of parts (request,
    first, end), the queries of tokens [first, end) over keys [0, end): each row's output
    (as float32) and its heads' LSEs."""

    def __init__(self, lengths, heads, kv_heads, head_size, device, seed, block_size=16):
        g = torch.Generator().manual_seed(seed)
        self.device, self.heads, self.head_size = device, heads, head_size
        self.dtype = torch.bfloat16 if device == "cuda" else torch.float32
        blocks = [math.ceil(n / block_size) for n in lengths]
        perm = torch.randperm(sum(blocks), generator=g).to(torch.int32)
        self.table = torch.zeros(len(lengths), max(blocks), dtype=torch.int32)
        start = 0
        for r, n in enumerate(blocks):
            self.table[r, :n] = perm[start:start + n]
            start += n
        shape = (sum(blocks), block_size, kv_heads, head_size)
        self.k = torch.randn(shape, generator=g).to(self.dtype).to(device)
        self.v = torch.randn(shape, generator=g).to(self.dtype).to(device)
        self.q = [torch.randn(n, heads, head_size, generator=g).to(self.dtype)
                  for n in lengths]
        self.table = self.table.to(device)

    def run(self, parts, num_splits: int = 0) -> list[torch.Tensor]:
        q = torch.cat([self.q[r][a:b] for r, a, b in parts]).to(self.device)
        query_lens = [b - a for _, a, b in parts]
        cu_q = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32,
                            device=self.device)
        seq_lens = [b for _, _, b in parts]
        out = torch.full_like(q, float("nan"))  # poisoned: an unwritten row cannot match
        lse = torch.full((self.heads, q.shape[0]), float("nan"), device=self.device)
        # the Triton pass the rows time (the CPU's public op would take the PyTorch path)
        varlen_attention(
            q, self.k, self.v, out, cu_seqlens_q=cu_q,
            seqused_k=torch.tensor(seq_lens, dtype=torch.int32, device=self.device),
            cu_seqlens_k=None, block_table=self.table[[r for r, _, _ in parts]],
            max_seqlen_q=max(query_lens), max_seqlen_k=max(seq_lens),
            softmax_scale=self.head_size ** -0.5, causal=True, window_left=-1,
            window_right=-1, softcap=0.0, alibi_slopes=None, sinks=None, q_descale=None,
            k_descale=None, v_descale=None, softmax_lse=lse, num_splits=num_splits,
            batch_invariant=True)
        # Each row's output and its float32 LSEs side by side: a bf16 output's rounding can
        # hide a 1-ulp change of the row sum that the LSE shows (KERNEL_NOTES v25).
        rows = torch.cat([out.float().flatten(1), lse.T], dim=1)
        return list(rows.cpu().split(query_lens))


def check_invariance(run: Callable, lengths: list[int], seed: int) -> Optional[str]:
    """None when request 0's rows have the same bits alone, inside a batch of the other
    requests (prompts and decodes, shuffled), chunk by chunk inside such batches and as decode
    steps, under each split schedule (0: the plan's, 1: folds in the program, 3: split
    programs); else which comparison broke. run(parts, num_splits): `World.run`'s."""
    rng = random.Random(seed)
    n = lengths[0]
    alone = run([(0, 0, n)], 0)[0]
    if alone.isnan().any():
        return "alone: rows left unwritten"

    def beside_others(part, num_splits, decodes=False):
        others = [(r, 0, m) if rng.random() < 0.5 and not decodes else (r, m - 1, m)
                  for r, m in enumerate(lengths) if r and rng.random() < 0.8]
        parts = others + [part]
        rng.shuffle(parts)
        return run(parts, num_splits)[parts.index(part)]

    cuts = sorted(rng.sample(range(1, n - 2), min(3, n - 3))) + [n - 2, n - 1, n]
    trials = [("in a batch", [(0, 0, n)])]
    trials.append(("chunked and as decodes",
                   [(0, a, b) for a, b in zip([0] + cuts[:-1], cuts)]))
    # steps of decodes alone (their own tiles where `invariant_decode_tiles` names some)
    trials.append(("as decodes beside decodes", [(0, 0, n - 3)]
                   + [(0, b - 1, b) for b in range(n - 2, n + 1)]))
    for name, pieces in trials:
        for num_splits in (0, 1, 3):
            rows = torch.cat([beside_others(piece, num_splits, decodes=piece[2] - piece[1] == 1)
                              for piece in pieces])
            if not torch.equal(rows, alone):
                diff = (rows.float() - alone.float()).abs().nan_to_num(float("inf")).max()
                return f"{name}, num_splits={num_splits}: max |diff| {diff.item():.3g}"
    return None


def check_config(config, head_sizes, smoke: bool) -> tuple[Optional[str], list]:
    """check_invariance at each head size under config's switches (`config.values`, a dict
    of `launch.SWITCHES` fields): (which comparison broke, or None; the head sizes where the
    config cannot run, with the error). A config whose tiles do not fit one head size is not
    broken: its rows there read n/a."""
    device = "cpu" if smoke else "cuda"
    cannot = []
    with switches(**config.values):
        split = launch.SWITCHES.invariant_split_keys
        for d in head_sizes:
            keys = split.get(d, 1024) if isinstance(split, dict) else split
            keys = min(keys, 16) if smoke else keys  # the interpreter: a few tiles at most
            # the target folds 2-3 splits; the others are shorter or longer
            lengths = [int(2.5 * keys) + 7, keys // 2 + 3, 3 * keys + 1, 40, 1]
            heads, kv_heads = (2, 1) if smoke else (16 if d == 256 else 32, 8)
            try:
                world = World(lengths, heads, kv_heads, d, device, seed=d)
                broke = check_invariance(world.run, lengths, seed=d)
            except Exception as e:  # noqa: BLE001 - a config that cannot run is reported
                cannot.append(f"head {d}: {type(e).__name__}: "
                              f"{str(e).splitlines()[0][:120] if str(e) else ''}")
                continue
            if broke:
                return f"head {d}: {broke}", cannot
    return None, cannot
