"""The Gluon pass with three consumers (`SWITCHES.gluon_consumers = 3`: 192-row items) beside
its two (128-row items) and FA3 on the head-64 prefill rows, in one process on an sm_90 GPU:
each row planned both ways (the switch is read when a plan is made), the columns timed
alternately in rounds (eager, `benchmarks/timing.py`), TFLOP/s on visible FLOPs, and each
column's error against the float64 oracle on sampled rows (`bench_prefill.row_errors_of`).

    PYTHONPATH=src python tools/ab_consumers.py [--rounds 3] [--more]

FA3's column needs the `fa3-fwd` wheel (tools/README.md, `gpu_peers.sh`); without it the
column says why.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

BENCHMARKS = str(Path(__file__).resolve().parents[1] / "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)

import bench_prefill as bp  # noqa: E402
import torch  # noqa: E402
from timing import alternate  # noqa: E402
from timing import eager_ms as bench  # noqa: E402

from pagedattn.ops.triton import launch  # noqa: E402

# (label, query_lens, seq_lens, heads, kv_heads, head_size): issue 40's head-64 rows, and a
# chunk after a cached context (paged context + the new rows) and prompts of 192's
# multiples' neighbours
ROWS = [r for r in bp.MAIN_ROWS if r[5] == 64] + [
    ("2048 after 14336 cached, head 64", [2048], [16384], 32, 8, 64),
    ("4 x 1000, head 64", [1000] * 4, [1000] * 4, 32, 8, 64),
]
# --more: where the gain lies (prompt length, batch) for a rule that picks the form
MORE_ROWS = [(f"{b} x {n}, head 64", [n] * b, [n] * b, 32, 8, 64)
             for b, n in ((1, 16384), (2, 8192), (1, 4096), (4, 4096))]


def planned(p: bp.Prefill, consumers: int):
    """(p's engine call planned with `consumers`, the item rows its Gluon launch took)."""
    old = launch.SWITCHES.gluon_consumers
    launch.SWITCHES.gluon_consumers = consumers
    try:
        run, plan = p.engine()
    finally:
        launch.SWITCHES.gluon_consumers = old
    block_m = plan.gluon.schedule.constexprs["BLOCK_M"] if plan.gluon is not None else None
    return run, block_m


def rate(flops: float, timed, why: str = "") -> str:
    """TFLOP/s of an `alternate` entry (ms, error), or why the column did not run."""
    if timed is None:
        return f"- ({why})"
    return "failed" if timed[1] else f"{flops / timed[0] / 1e9:.0f}"


def speedup(ours, theirs) -> str:
    """Their time over ours (above 1: ours is faster)."""
    if ours is None or theirs is None or ours[1] or theirs[1]:
        return "-"
    return f"{theirs[0] / ours[0]:.2f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--more", action="store_true", help="MORE_ROWS instead of ROWS")
    args = ap.parse_args(argv)
    print("| row | 2 consumers | 3 consumers | FA3 | 3 / 2 | 3 / FA3 | ms (2, 3) | "
          "error 2 | error 3 | error FA3 |")
    print("|---|---:|---:|---:|---:|---:|---|---|---|---|")
    for label, ql, sl, h, hkv, d in (MORE_ROWS if args.more else ROWS):
        p = bp.Prefill(ql, sl, h, hkv, d)
        two, rows_two = planned(p, 2)
        three, rows_three = planned(p, 3)
        if (rows_two, rows_three) != (128, 192):
            print(f"| {label} | planned item rows {rows_two} / {rows_three}, not 128 / 192 |")
            continue
        fa3, why = p.fa3()
        t = alternate([("two", bench, two), ("three", bench, three)]
                      + [("fa3", bench, fa3)] * (fa3 is not None), args.rounds)
        errors = bp.row_errors_of(p, {"two": two, "three": three, "fa3": fa3})
        flops = p.flops()
        print(f"| {label} | {rate(flops, t['two'])} | {rate(flops, t['three'])} | "
              f"{rate(flops, t.get('fa3'), why)} | {speedup(t['three'], t['two'])} | "
              f"{speedup(t['three'], t.get('fa3'))} | {t['two'][0]:.3f}, "
              f"{t['three'][0]:.3f} | {errors['two']} | {errors['three']} | "
              f"{errors['fa3']} |", flush=True)
        del p
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
