"""One decode plan's GPU time by four timers, side by side in one process on a GPU: a
single-call CUDA graph replayed between events (`tools/ab_gluon_decode.py`'s timer), the
profiler's kernel time, one graph of many unrolled calls (`do_bench_cudagraph`, the decode
table's graph column) and eager calls (`do_bench`, L2 flushed between). The fp8 decode's
figures have differed by timer (docs/PERFORMANCE.md, decode); this says by how much.

    PYTHONPATH=src python tools/decode_timers.py [--rows B64L16k,B8L128k] [--dtypes fp8,bf16]
        [--tries 2]

Rows as `benchmarks/decode_peers.py` builds them (32 q / 8 KV heads, head 128, block 16,
shuffled blocks; the engine path's plan; fp8: an e4m3 q over an e4m3 cache, descales of 1).
Prints one line per row, dtype and timer: the best try in us and GB/s of K/V read, and
every try.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for folder in (HERE, HERE.parent / "benchmarks"):  # ab_gluon_decode; decode_peers, timing
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

import decode_peers as dp  # noqa: E402
import torch  # noqa: E402
from ab_gluon_decode import ROWS, replays_for  # noqa: E402
from timing import capture_graph, eager_ms, graph_ms, kernel_ms, replay_rounds  # noqa: E402

DTYPES = {"fp8": dp.E4M3, "bf16": dp.DT}


def timers(run, graph, nbytes: int) -> dict:
    """{timer name: ms per call} of one try (the single-call graph replayed as
    `tools/ab_gluon_decode.py` replays it)."""
    return {"single-call graph, replayed": replay_rounds({"x": graph}, 3,
                                                         replays_for(nbytes))["x"],
            "profiler kernel time": kernel_ms(run, steps=10),
            "unrolled graph (do_bench_cudagraph)": graph_ms(run),
            "eager (do_bench)": eager_ms(run)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="B64L16k,B8L128k")
    ap.add_argument("--dtypes", default="fp8,bf16")
    ap.add_argument("--tries", type=int, default=2)
    args = ap.parse_args(argv)
    rows = [r for r in args.rows.split(",") if r]
    dtypes = [d for d in args.dtypes.split(",") if d]
    bad = [r for r in rows if r not in ROWS] + [d for d in dtypes if d not in DTYPES]
    if bad:
        ap.error(f"unknown {bad}: rows among {list(ROWS)}, dtypes among {list(DTYPES)}")
    if args.tries < 1:
        ap.error(f"--tries must be at least 1, got {args.tries}")
    print("| row | cache | timer | best us | GB/s | every try (us) |\n|---|---|---|---:|---:|---|")
    for name in rows:
        for dt in dtypes:
            batch = dp.DecodeBatch(*ROWS[name], DTYPES[dt])
            run = batch.engine()
            graph = capture_graph(run)
            tries: dict[str, list[float]] = {}
            for _ in range(args.tries):
                for timer, ms in timers(run, graph, batch.kv_bytes).items():
                    tries.setdefault(timer, []).append(ms)
            for timer, got in tries.items():
                best = min(got)
                print(f"| {name} | {dt} | {timer} | {best * 1e3:.1f} | "
                      f"{batch.kv_bytes / best / 1e6:.0f} | "
                      f"{', '.join(f'{ms * 1e3:.1f}' for ms in got)} |", flush=True)
            del batch, graph, run
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
