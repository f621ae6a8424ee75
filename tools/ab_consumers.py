"""The Gluon pass with three consumers (`SWITCHES.gluon_consumers = 3`: 192-row items) beside
its two (128-row items) and FA3 on the head-64 prefill rows, in one process on an sm_90 GPU:
each row planned both ways (the switches are read when a plan is made), the columns timed
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
# column -> (consumers, the item rows its plan must take)
FORMS = {"two": (2, 128), "three": (3, 192)}


def planned(p: bp.Prefill, consumers: int):
    """(p's engine call planned with `consumers`, the (item rows, lane masks) its Gluon
    launch took)."""
    old = launch.SWITCHES.gluon_consumers
    launch.SWITCHES.gluon_consumers = consumers
    try:
        run, plan = p.engine()
    finally:
        launch.SWITCHES.gluon_consumers = old
    if plan.gluon is None:
        return run, None
    k = plan.gluon.schedule.constexprs
    return run, (k["BLOCK_M"], k["LANE_MASKS"])


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
    forms = ["two", "three"]
    names = {"two": "2 consumers", "three": "3 consumers"}
    ratios = [("three", "two", "3 / 2")]
    ratios += [(f, "fa3", f"{names[f]} / FA3") for f in forms[1:]]
    print("| row | " + " | ".join(names[f] for f in forms) + " | FA3 | "
          + " | ".join(r[2] for r in ratios) + " | ms | "
          + " | ".join(f"error {names[f]}" for f in forms) + " | error FA3 |")
    print("|---|" + "---:|" * (len(forms) + 1 + len(ratios)) + "---|" * (len(forms) + 2))
    rows = MORE_ROWS if args.more else ROWS
    for label, ql, sl, h, hkv, d in rows:
        p = bp.Prefill(ql, sl, h, hkv, d)
        calls, why = {}, {}
        for form in forms:
            consumers, block_m = FORMS[form]
            run, took = planned(p, consumers)
            if took == (block_m, consumers == 3):  # three consumers mask by lane
                calls[form] = run
            else:
                why[form] = f"planned {took}"
        calls["fa3"], why["fa3"] = p.fa3()
        timed = [(f, bench, fn) for f, fn in calls.items() if fn is not None]
        t = alternate(timed, args.rounds)
        errors = bp.row_errors_of(p, calls)
        flops = p.flops()
        cells = [rate(flops, t.get(f), why.get(f, "")) for f in forms + ["fa3"]]
        cells += [speedup(t.get(a), t.get(b)) for a, b, _ in ratios]
        cells.append(", ".join(f"{t[f][0]:.3f}" for f in forms if f in t))
        cells += [str(errors.get(f, "-")) for f in forms + ["fa3"]]
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)
        del p
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
