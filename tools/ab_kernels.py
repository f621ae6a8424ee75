"""The kernel rows of docs/PERFORMANCE.md for two source trees, side by side, in one run.

    python tools/ab_kernels.py --old OLD_ROOT --new NEW_ROOT [--rounds 2] [--out FILE]

Each tree gets a worker process of its own (`PYTHONPATH=ROOT/src`, so `pagedattn` is that
tree's) that runs this checkout's benchmark code (benchmarks/, and tools/bench_gluon.py):
bench_kernels.py's decode, fp8-decode and split-KV rows (CUDA-graph replays) and
bench_prefill.py's prefill rows (the engine path in both Hopper row layouts and the public
op, eager `do_bench`), window row, fp8-context row
and mixed batches (graph replays). The parent asks the two workers for one row at a time,
old then new, the next row new then old, and so on for `--rounds` rounds, so that clocks
and temperature drift equally over both; a tree's time for a row is the median of its
rounds. It prints one table: old ms, new ms, new / old, and the passes that ran. With a warm
Triton cache two rounds (58 rows, 232 timings) take two to three minutes on an H100. Rows
"(g)" time the Gluon prefill pass alone on bench_gluon.py's rows (graph replays; run them
with `--gluon`), where both trees have it:

    python tools/ab_kernels.py --old OLD_ROOT --new . --gluon --rows "(g)"
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS = os.path.join(os.path.dirname(HERE), "benchmarks")  # bench_kernels, bench_prefill
FP8 = "float8_e4m3fn"


def rows() -> list[tuple]:
    """(label, kind, arguments) of every row, in order."""
    out = []
    for batch in (1, 32, 128):
        for ctx in (1024, 4096, 8192, 16384, 32768):
            out.append((f"(a) decode b{batch} ctx {ctx}", "decode", ([1] * batch, [ctx] * batch,
                                                                     None)))
    for batch, ctx in ((1, 8192), (1, 32768), (32, 8192), (32, 16384), (128, 8192)):
        out.append((f"(d) decode fp8 b{batch} ctx {ctx}", "decode",
                    ([1] * batch, [ctx] * batch, FP8)))
    import bench_prefill  # this checkout's, whichever tree's pagedattn imports it

    for label, ql, sl, h, hkv, d, *window in bench_prefill.MAIN_ROWS + bench_prefill.WINDOW_ROWS:
        shape = (ql, sl, h, hkv, d, window[0] if window else -1)
        out.append((f"(b) prefill {label}, engine", "engine", shape + ("picked",)))
        out.append((f"(b) prefill {label}, engine, other row layout", "engine",
                    shape + ("other",)))
        out.append((f"(b) prefill {label}, op (portable)", "op", shape))
    out.append(("(b) 2048 after 30720 cached, fp8 cache, engine", "engine",
                ([2048], [32768], 32, 8, 128, -1, "picked", FP8)))
    out.append(("(b) 2048 after 30720 cached, fp8 cache, fp8 q, engine", "engine",
                ([2048], [32768], 32, 8, 128, -1, "picked", FP8, FP8)))
    for n_pre, chunk, ctx_pre, n_dec, ctx_dec in ((4, 512, 2048, 128, 4096),
                                                  (2, 2048, 2048, 64, 8192)):
        lens = ([chunk] * n_pre + [1] * n_dec, [ctx_pre] * n_pre + [ctx_dec] * n_dec)
        label = f"(c) mixed {n_pre} x {chunk} + {n_dec} decodes"
        out.append((f"{label}, engine", "mixed engine", lens))
        out.append((f"{label}, op", "mixed op", lens))
    for label, q_lens, s_lens in (("64 q x 16k", [64], [16384]), ("256 q x 16k", [256], [16384]),
                                  ("128-token chunk over 32k", [128], [32768])):
        out.append((f"(e) split-KV prefill pass, {label}", "decode", (q_lens, s_lens, None)))
    try:
        import bench_gluon  # a tree with the Gluon pass (and, on the GPU, Triton 3.6)
    except ImportError:
        return out
    for label, ql, sl, h, hkv, d, dtype in bench_gluon.ROWS:
        out.append((f"(g) Gluon pass alone, {label}", "gluon",
                    (ql, sl, h, hkv, d, str(dtype).removeprefix("torch."))))
    return out


def _pass_names(plan) -> list[str]:
    """The passes a plan launches (its launch list changed shape in issue 25; the Gluon
    pass has its own launcher beside the list)."""
    names = [p[1] if isinstance(p, tuple) else p.name for p in plan.launches]
    return names + ["gluon"] * (getattr(plan, "gluon", None) is not None)


def _packed(plan) -> bool:
    boxes = getattr(plan, "hopper_boxes", None)  # before issue 25
    if boxes is not None:
        return boxes[1] > 1
    return any(getattr(p, "name", "") == "hopper" and p.boxes[1] > 1 for p in plan.launches)


def run_row(kind: str, args) -> tuple[float, str]:
    """(ms, the passes that ran) of one row in this process's tree."""
    import bench_kernels
    import bench_prefill
    import torch
    from timing import eager_ms, graph_ms

    from pagedattn.ops.triton import launch

    if kind == "decode":  # bench_kernels' rows: the public provider function, graph replays
        q_lens, s_lens, dtype = args
        p = bench_kernels.Paged(q_lens, s_lens, cache_dtype=getattr(torch, dtype or "bfloat16"))
        return graph_ms(p.run), ""
    if kind == "gluon":  # bench_gluon's rows: the Gluon pass alone, graph replays
        import bench_gluon

        ql, sl, h, hkv, d, dtype = args
        p = bench_prefill.Prefill(ql, sl, h, hkv, d, cache_dtype=getattr(torch, dtype))
        if p.k.dtype == bench_gluon.DT:  # the pass reads the new tokens from the cache too
            bench_gluon.write_new_rows(p)
        call, _ = bench_gluon.gluon_call(p, bench_gluon.gluon_plan(p))
        return graph_ms(call), "gluon"
    if kind in ("mixed engine", "mixed op"):
        p = bench_prefill.Prefill(*args)
        fn = p.engine()[0] if kind == "mixed engine" else p.op()
        return graph_ms(fn), ""
    ql, sl, h, hkv, d, window, *rest = args
    dtype = getattr(torch, rest[1]) if len(rest) > 1 else torch.bfloat16
    q_dtype = getattr(torch, rest[2]) if len(rest) > 2 else torch.bfloat16  # as the layer's
    p = bench_prefill.Prefill(ql, sl, h, hkv, d, window=window, cache_dtype=dtype,
                              q_dtype=q_dtype)
    if kind == "op":
        return eager_ms(p.op()), "portable"
    fn, plan = p.engine()
    if rest[0] == "other":  # the Hopper pass's other row layout than the plan's
        switch = launch.SWITCHES.hopper_pack_gqa
        launch.SWITCHES.hopper_pack_gqa = not _packed(plan)
        try:
            fn, plan = p.engine()
            return eager_ms(fn), "+".join(_pass_names(plan))
        finally:
            launch.SWITCHES.hopper_pack_gqa = switch
    names = "+".join(_pass_names(plan)) + (", packed" if _packed(plan) else "")
    return eager_ms(fn), names


def worker(root: str, gluon: bool) -> None:
    """Answer row numbers on stdin with one JSON line each on stdout. Without `gluon` a tree
    that has the Gluon prefill pass runs with it switched off: the rows then compare the
    `tl` kernel family of both trees."""
    import torch

    import pagedattn
    from pagedattn.ops.triton import launch

    if hasattr(launch.SWITCHES, "gluon_prefill") and not gluon:
        launch.SWITCHES.gluon_prefill = False

    if not os.path.abspath(pagedattn.__file__).startswith(os.path.abspath(root)):
        sys.exit(f"pagedattn came from {pagedattn.__file__}, not {root}: set PYTHONPATH")
    table = rows()
    torch.manual_seed(0)
    print(json.dumps(dict(ready=True, device=torch.cuda.get_device_name())), flush=True)
    for line in sys.stdin:
        i = int(line)
        try:
            ms, passes = run_row(table[i][1], table[i][2])
            answer = dict(ms=ms, passes=passes)
        except Exception as e:  # noqa: BLE001 - a benchmark row: report it and go on
            answer = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        print(json.dumps(answer), flush=True)


class Worker:
    def __init__(self, root: str, gluon: bool):
        path = [os.path.join(root, "src"), BENCHMARKS, HERE]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", root] + ["--gluon"] * gluon, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info = self._answer()

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            sys.exit(f"a worker died (exit {self.proc.wait()})")
        return json.loads(line)

    def row(self, i: int) -> dict:
        self.proc.stdin.write(f"{i}\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", help="root of the old tree (holds src/pagedattn)")
    ap.add_argument("--new", help="root of the new tree")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rows", default="",
                    help="only rows whose label has one of these texts ('|'-separated)")
    ap.add_argument("--out", help="also write the table to this file")
    ap.add_argument("--gluon", action="store_true",
                    help="keep the Gluon prefill pass on where a tree has it (default: off)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.gluon)
        return
    if not (args.old and args.new):
        ap.error("give --old and --new")
    start = time.time()
    sys.path[:0] = [os.path.join(args.new, "src"), BENCHMARKS, HERE]  # rows() imports them
    wanted = args.rows.split("|")
    table = [(i, label) for i, (label, *_) in enumerate(rows())
             if any(w in label for w in wanted)]
    workers = {"old": Worker(args.old, args.gluon), "new": Worker(args.new, args.gluon)}
    times: dict = {(i, tree): [] for i, _ in table for tree in workers}
    notes: dict = {}
    order = ("old", "new")
    for _ in range(args.rounds):
        for i, _label in table:
            for tree in order:
                answer = workers[tree].row(i)
                if "error" in answer:
                    notes[(i, tree)] = answer["error"]
                else:
                    times[(i, tree)].append(answer["ms"])
                    notes.setdefault((i, tree), answer["passes"])
                print(f"{_label} [{tree}]: {answer}", file=sys.stderr, flush=True)
            order = order[::-1]
    for w in workers.values():
        w.close()
    median = functools.partial(_median, times)
    lines = [f"device: {workers['new'].info['device']}; old {args.old}, new {args.new}; "
             f"{args.rounds} rounds, rows alternating old/new",
             "", "| row | passes (new) | old ms | new ms | new / old |",
             "|---|---|---:|---:|---:|"]
    for i, label in table:
        old, new = median((i, "old")), median((i, "new"))
        ratio = f"{new / old:.3f}" if old == old and new == new else "n/a"
        lines.append(f"| {label} | {notes.get((i, 'new'), '')} | {old:.4f} | {new:.4f} | "
                     f"{ratio} |")
    labels = dict(table)
    errors = [f"- {labels[i]} ({tree}): {note}" for (i, tree), note in notes.items()
              if not times[(i, tree)]]
    lines += [""] + errors + [f"(wall time {time.time() - start:.0f} s)"]
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


def _median(times: dict, key) -> float:
    return statistics.median(times[key]) if times[key] else float("nan")


if __name__ == "__main__":
    main()
