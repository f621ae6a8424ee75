"""The fp8 decode pass's V-load variants beside today's, checked and timed in one run (issue 41).

    bash -c '. tools/device_env.sh && python tools/ab_fp8_decode.py --out $OUT/ab_fp8_decode.md'
        [--rows B64L16k,B8L128k] [--rounds 5] [--variants today,ahead,...]

Each variant is `launch.SWITCHES.fp8_decode_v` (where the decode pass loads an fp8 V tile:
`tile_loop.attend`) and optionally other decode tiles (block_n, warps, stages; the split
count stays the heuristic's), over sweep_decode.py's rows: an e4m3 cache and an fp8 q, 32 q /
8 KV heads, head 128, block 16, shuffled blocks. Per row, each variant's output is first
checked against the float64 oracle on sampled sequences (every head;
benchmarks/sampled_error.py), then every variant's CUDA graph is replayed in turn, the order
rotated each round, and a variant's time is the median over rounds: GB/s of the fp8 cache's
bytes read, and the ratio to today's time. `tools/fp8_decode_sass.py` gives each variant's
registers, spills and load placement (sm_90 SASS, no GPU).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for folder in (HERE, HERE.parent / "benchmarks"):  # sweep_decode; timing, sampled_error
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

import torch  # noqa: E402
from sampled_error import error_cell, oracle_rows, row_errors  # noqa: E402
from sweep_decode import DEV, FP8, HKV, ROWS, D, Decode  # noqa: E402
from timing import Emitter  # noqa: E402

import reference  # noqa: E402 - tests/ is on the path through sampled_error
from pagedattn.ops.triton import launch  # noqa: E402
from pagedattn.ops.triton.launch import AttnConfig  # noqa: E402

# name -> (SWITCHES.fp8_decode_v, SWITCHES.fp8_v_in_regs, tiles or None: today's)
VARIANTS = {
    "today": (None, True, None),
    "first": ("first", True, None),
    "ahead": ("ahead", True, None),
    "kv_ahead": ("kv_ahead", True, None),
    "ahead 64 keys": ("ahead", True, (64, 4, 3)),
    "ahead 2 stages": ("ahead", True, (128, 4, 2)),
    "today 64 keys 4 stages": (None, True, (64, 4, 4)),
    "V cast by the compiler": (None, False, None),
}
SAMPLED_SEQS = 3  # sequences per row checked against the oracle (every head)
TOLERANCE = 2e-2  # max abs error of a bf16 output with fp16 P V (the GPU tests' bf16 bound)


def switched(name: str):
    """Set SWITCHES to variant `name`; the decode config (None: today's heuristic)."""
    variant, in_regs, _ = VARIANTS[name]
    launch.SWITCHES.fp8_decode_v = variant
    launch.SWITCHES.fp8_v_in_regs = in_regs


def run_variant(d: Decode, name: str):
    """The row's decode as variant `name` runs it (tiles overridden at today's split count)."""
    tiles = VARIANTS[name][2]
    switched(name)
    if tiles is None:
        d.run()
    else:
        splits = launch.decode_splits(launch.sm_count(torch.device(DEV)), d.batch * HKV, d.ctx,
                                      kv_bytes=1)
        d.run(AttnConfig(16, *tiles, splits), splits)


def oracle(d: Decode, seqs: list[int]) -> torch.Tensor:
    """float64 outputs [len(seqs), H, D] of sequences `seqs` (descales are 1)."""
    def rows(cache):  # gathered as bytes (CUDA indexing of fp8 need not exist)
        return torch.cat([reference.gather_paged(cache.view(torch.uint8), d.table[s].cpu(),
                                                 d.ctx) for s in seqs]).view(FP8)

    k, v = rows(d.k), rows(d.v)
    q = d.q[seqs]
    n = len(seqs)
    return oracle_rows(q, k, v, [1] * n, [d.ctx] * n, list(range(n)), D ** -0.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="B64L16k,B8L128k")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--replays", type=int, default=20, help="graph replays per timing")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    names = args.variants.split(",")
    for name in names:
        if name not in VARIANTS:
            ap.error(f"--variants: {name!r} is not one of {list(VARIANTS)}")
    emit = Emitter()
    emit.to_file(args.out)
    emit(f"{torch.cuda.get_device_name()}; SMs {launch.sm_count(torch.device(DEV))}; "
         f"{args.rounds} rounds of {args.replays} graph replays, medians")
    emit("| row | variant | max / mean abs error | ms | GB/s fp8 | time / today |")
    emit("|---|---|---|---:|---:|---:|")
    failed = False
    for row in args.rows.split(","):
        d = Decode(*ROWS[row], FP8)
        seqs = sorted(torch.randperm(d.batch)[:SAMPLED_SEQS].tolist())
        want = oracle(d, seqs)
        graphs, errors = {}, {}
        for name in names:
            d.out.fill_(float("nan"))
            run_variant(d, name)  # compiles outside the capture
            torch.cuda.synchronize()
            errors[name] = row_errors(d.out, seqs, want)
            failed |= not errors[name][0] <= TOLERANCE
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run_variant(d, name)
            graphs[name] = graph
        times = {name: [] for name in names}
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                graphs[name].replay()  # warm
                start.record()
                for _ in range(args.replays):
                    graphs[name].replay()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end) / args.replays)
        base = statistics.median(times[names[0]])
        for name in names:
            ms = statistics.median(times[name])
            emit(f"| {row} | {name} | {error_cell(errors[name])} | {ms:.4f} | "
                 f"{d.bytes / (ms * 1e-3) / 1e9:.0f} | {ms / base:.3f} |")
        del graphs, d
        torch.cuda.empty_cache()
    switched("today")
    if failed:
        sys.exit(f"a variant's error exceeds {TOLERANCE}")


if __name__ == "__main__":
    main()
