"""The Gluon pass's fp8 P V (`SWITCHES.gluon_fp8_pv`) beside its fp16 P V on issue 40's fp8
rows, in one process on an sm_90 GPU: each row planned both ways (the switch is read when a
plan is made), the two timed alternately in rounds (eager, `benchmarks/timing.py`), TFLOP/s
on visible FLOPs (KERNEL_NOTES v23).

    PYTHONPATH=src python tools/ab_fp8_pv.py [--rounds 3] [--only-on]

--only-on times the fp8 P V alone (a tree where the fp16 P V does not fit shared memory).
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

ROWS = ("1 x 8192", "8 x 2048", "2048 after 30720 cached", "1 x 8192, head 64",
        "1 x 8192, head 256")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only-on", action="store_true")
    args = ap.parse_args(argv)
    print("| row | " + " | ".join(["fp8 P V"] + ["fp16 P V"] * (not args.only_on)) + " |")
    for label, ql, sl, h, hkv, d in (r for r in bp.FP8_ROWS if r[0] in ROWS):
        p = bp.Prefill(ql, sl, h, hkv, d, cache_dtype=bp.E4M3, q_dtype=bp.E4M3)
        columns = []
        old = launch.SWITCHES.gluon_fp8_pv
        try:
            for on in [True] + [False] * (not args.only_on):
                launch.SWITCHES.gluon_fp8_pv = on
                run, _ = p.engine()
                columns.append((f"fp8 P V {on}", bench, run))
        finally:
            launch.SWITCHES.gluon_fp8_pv = old
        t = alternate(columns, args.rounds)
        cells = [f"{p.flops() / ms / 1e9:.0f}" if err is None else f"failed: {err}"
                 for ms, err in t.values()]
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)
        del p
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
