"""The public op's per-call cost beside the engine path's (issue 40), bench_prefill's rows.

    PYTHONPATH=src python3 tools/op_host_cost.py [--rows "32 x 512,8 x 2048,1 x 8192"]
        [--dtypes bf16,fp8] [--rounds 3] [--out FILE]
    PYTHONPATH=src python3 tools/op_host_cost.py --cpu     # no GPU: the host stages alone

The engine path plans a step once and runs the plan per layer; the op (`varlen_attention`
over the paged cache, what `flash_attn_varlen_func` runs) plans per call, through the plans
it keeps (`ops/triton/op_plans.py`), or, in the "op, planning" column, afresh every call
(`op_plans.OP_PLANS = 0`: the op before it kept plans). For each row and dtype (bf16; fp8:
an e4m3 q over an e4m3 cache, as bench_prefill's fp8 rows), in one process:
- eager ms (`timing.eager_ms`, do_bench: GPU events around each call after an L2 flush, so
  host time past the flush's shows), the three columns alternated in `--rounds` rounds;
- graph ms (`timing.graph_ms`): a captured call plans during the capture (nothing is kept
  there), so the replay is the kernels alone; a failed capture prints its error;
- host us per call (`timing.host_us`: calls queued without waiting);
- the host stages of one op call (perf_counter, us per call): planning afresh
  (`plan_attention`), a kept plan's look-up (`plan_for`), the plan's `run`; then cProfile
  of `plan_attention` + `run` by stage (cumulative us per call; cProfile inflates small
  functions, so read them against the perf_counter totals).
`--cpu` prices the same stages on a CPU (no launch): the Gluon plan's pieces called directly
for 132 SMs (`why_not`, `launch_config`, `GluonPrefillLaunch`, its `kernel_args`), the
portable `plan_attention` on CPU tensors and a kept plan's look-up.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import itertools
import math
import os
import pstats
import sys
import time
from pathlib import Path

BENCHMARKS = str(Path(__file__).resolve().parents[1] / "benchmarks")
if BENCHMARKS not in sys.path:  # bench_prefill and timing, run from any folder
    sys.path.insert(0, BENCHMARKS)

import torch  # noqa: E402

DT, E4M3 = torch.bfloat16, torch.float8_e4m3fn
# (label, query_lens, seq_lens, heads, kv_heads, head_size): bench_prefill's prompt rows
ROWS = [
    ("32 x 512", [512] * 32, [512] * 32, 32, 8, 128),
    ("8 x 2048", [2048] * 8, [2048] * 8, 32, 8, 128),
    ("1 x 8192", [8192], [8192], 32, 8, 128),
    ("1 x 16384", [16384], [16384], 32, 8, 128),
    ("2048 after 30720 cached", [2048], [32768], 32, 8, 128),
]
# The host stages of one op call, as cProfile names them: (label, file, function)
STAGES = [
    ("plan_attention", "attention_plan.py", "plan_attention"),
    ("  decode_config", "launch.py", "decode_config"),
    ("  prefill_config", "launch.py", "prefill_config"),
    ("  prefill_splits", "launch.py", "prefill_splits"),
    ("  hopper_prefill_config", "launch.py", "hopper_prefill_config"),
    ("  plan_gluon_prefill", "attention_gluon.py", "plan_gluon_prefill"),
    ("    why_not", "attention_gluon.py", "why_not"),
    ("    launch_config", "attention_gluon.py", "launch_config"),
    ("    GluonPrefillLaunch", "gluon_launch.py", "__init__"),
    ("    KernelLaunch (each pass's)", "fast_launch.py", "__init__"),
    ("  batch_section", "attention_args.py", "batch_section"),
    ("  dot_dtype", "launch.py", "dot_dtype"),
    ("  fp8_v_in_regs", "launch.py", "fp8_v_in_regs"),
    ("  PassLaunch", "pass_launch.py", "__init__"),
    ("torch.ones", "~", "<built-in method torch.ones>"),
    ("torch.empty", "~", "<built-in method torch.empty>"),
    ("run", "attention_plan.py", "run"),
    ("  GluonPrefillLaunch.run", "gluon_launch.py", "run"),
    ("    kernel_args", "gluon_launch.py", "kernel_args"),
    ("    launch_with_scratch", "gluon_launch.py", "launch_with_scratch"),
]


def parse_rows(text: str) -> list[tuple]:
    """ROWS named in `text` (labels, comma-separated), in its order."""
    by_label = {row[0]: row for row in ROWS}
    rows = []
    for label in (s.strip() for s in text.split(",")):
        if label not in by_label:
            raise ValueError(f"--rows: no row {label!r}; rows: {', '.join(by_label)}")
        rows.append(by_label[label])
    return rows


def parse_dtypes(text: str) -> list[str]:
    dtypes = [s.strip() for s in text.split(",")]
    for d in dtypes:
        if d not in ("bf16", "fp8"):
            raise ValueError(f"--dtypes: {d!r} is not bf16 or fp8")
    return dtypes


def stage_us(stats: pstats.Stats, calls: int, stages=STAGES) -> list[tuple[str, float, float]]:
    """(label, cumulative us per profiled call, calls per profiled call) of each stage that
    ran in `stats` (a profile of `calls` calls); a function named in several files counts
    only in the stage's own (`file` a path suffix, or "~" for built-ins)."""
    rows = []
    for label, file, name in stages:
        cum = ncalls = 0.0
        for (path, _, func), (_, nc, _, ct, _) in stats.stats.items():
            if func == name and (path == file if file == "~" else path.endswith(file)):
                cum, ncalls = cum + ct, ncalls + nc
        if ncalls:
            rows.append((label, cum / calls * 1e6, ncalls / calls))
    return rows


def profile(fn, calls: int) -> pstats.Stats:
    """cProfile of `calls` calls of fn (after one unprofiled call)."""
    fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    return pstats.Stats(prof)


def per_call_us(fn, calls: int = 20, repeats: int = 100) -> float:
    """The best of `repeats` means of `calls` calls, us (perf_counter; on a GPU after a sync,
    the launches queued without waiting: the host's own time). Short runs, the best of many:
    a shared host's scheduler takes ~10 ms slices, which would land in most longer runs."""
    fn()
    best = math.inf
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def stage_lines(stages: list[tuple[str, float, float]]) -> list[str]:
    lines = ["| stage (cProfile, cumulative) | us per op call | calls |", "|---|---:|---:|"]
    return lines + [f"| `{label}` | {us:.1f} | {n:g} |" for label, us, n in stages]


def op_kwargs(op) -> dict:
    """The `plan_attention` keywords the op passes for a call of `op`, spied once."""
    from pagedattn.ops.triton import attention_plan, op_plans

    seen = {}
    real, kept = attention_plan.plan_attention, op_plans.OP_PLANS
    attention_plan.plan_attention = lambda **kw: seen.update(kw) or real(**kw)
    op_plans.OP_PLANS = 0
    try:
        op()
    finally:
        attention_plan.plan_attention, op_plans.OP_PLANS = real, kept
    return seen


def planning_every_call(op):
    """`op` with the plans not kept: the op as it was, planning afresh each call."""
    from pagedattn.ops.triton import op_plans

    def call():
        kept = op_plans.OP_PLANS
        op_plans.OP_PLANS = 0
        try:
            op()
        finally:
            op_plans.OP_PLANS = kept
    return call


def gpu(rows, dtypes, rounds: int, emit) -> None:
    from pagedattn.ops.triton import op_plans

    emit("| row | dtype | engine eager ms | op eager ms | op, planning, eager ms | "
         "op / engine (eager) | engine graph ms | op graph ms | engine host us | "
         "op host us | op, planning, host us | TFLOP/s engine / op / op planning |")
    emit("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    details = []
    for row, dtype in itertools.product(rows, dtypes):
        line, lines = gpu_row(*row, dtype, rounds)
        emit(line)
        details += lines
        op_plans.clear()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    emit("")
    for line in details:
        emit(line)


def gpu_row(label, ql, sl, h, hkv, d, dtype, rounds) -> tuple[str, list[str]]:
    """(the row's table line, its host-stage tables)."""
    import bench_prefill as bp
    from timing import alternate, graph_ms, host_us, measure

    from pagedattn.ops.triton import op_plans
    from pagedattn.ops.triton.attention_plan import plan_attention

    fp8 = dtype == "fp8"
    p = bp.Prefill(ql, sl, h, hkv, d, cache_dtype=E4M3 if fp8 else DT,
                   q_dtype=E4M3 if fp8 else DT)
    engine, _ = p.engine()
    op = p.op()
    fresh = planning_every_call(op)
    t = alternate([("engine", bp.bench, engine), ("op", bp.bench, op),
                   ("fresh", bp.bench, fresh)], rounds)
    graphs = [measure(graph_ms, fn) for fn in (engine, op)]
    hosts = {name: host_us(fn) for name, fn in (("engine", engine), ("op", op),
                                               ("fresh", fresh))}
    flops = p.flops()
    rates = " / ".join(f"{flops / t[n][0] / 1e9:.0f}" for n in ("engine", "op", "fresh"))
    cells = [f"{t[n][0]:.4f}" for n in ("engine", "op", "fresh")]
    graph_cells = [f"{ms:.4f}" if error is None else f"n/a ({error})" for ms, error in graphs]
    line = (f"| {label} | {dtype} | {' | '.join(cells)} | {t['engine'][0] / t['op'][0]:.2f}x "
            f"| {' | '.join(graph_cells)} | {hosts['engine']:.1f} | {hosts['op']:.1f} | "
            f"{hosts['fresh']:.1f} | {rates} |")
    kw = op_kwargs(op)
    tensors = (p.q, p.k, p.v, p.out, None, None, None, p.q_descale, p.descale, p.descale)
    steps = [("plan_attention (the op's planning before)",
              functools.partial(plan_attention, **kw)),
             ("plan_for, a kept plan (the op's planning now)",
              functools.partial(op_plans.plan_for, **kw)),
             ("plan.run (launch included)",
              functools.partial(op_plans.plan_for(**kw).run, *tensors))]
    lines = [f"\n#### {label}, {dtype}: one op call's host stages\n",
             "| stage (perf_counter) | us per call |", "|---|---:|"]
    lines += [f"| {name} | {per_call_us(fn):.1f} |" for name, fn in steps]

    def fresh_call():
        plan_attention(**kw).run(*tensors)
    lines += [""] + stage_lines(stage_us(profile(fresh_call, 200), 200))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return line, lines


def cpu(rows, dtypes, emit) -> None:
    """The host stages on a CPU: the Gluon plan's pieces for 132 SMs, the portable plan."""
    from pagedattn.ops.triton import attention_gluon as ag
    from pagedattn.ops.triton import op_plans
    from pagedattn.ops.triton.attention_plan import plan_attention

    emit("| row | dtype | why_not | launch_config | GluonPrefillLaunch (launch stubbed) | "
         "GluonPrefillLaunch (its KernelLaunch) | kernel_args | plan_attention (CPU, "
         "portable) | plan_for, a kept plan |")
    emit("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for (label, ql, sl, h, hkv, d), dtype in itertools.product(rows, dtypes):
        fp8 = dtype == "fp8"
        kv_dtype = q_dtype = E4M3 if fp8 else DT
        blocks = [math.ceil(s / 16) for s in sl]
        cu_q = torch.tensor([0, *itertools.accumulate(ql)], dtype=torch.int32)
        seqused = torch.tensor(sl, dtype=torch.int32)
        table = torch.arange(sum(blocks), dtype=torch.int32).view(len(sl), -1)
        k, v = torch.empty(2, sum(blocks), 16, hkv, d, dtype=kv_dtype)
        q, out = torch.empty(sum(ql), h, d, dtype=q_dtype), torch.empty(sum(ql), h, d, dtype=DT)
        descale = torch.ones(()).expand(len(sl), hkv) if fp8 else None
        shape = dict(batch=len(sl), total_q=sum(ql), max_seqlen_q=max(ql), num_heads=h,
                     num_kv_heads=hkv, head_size=d, head_size_v=d, causal=True, window_left=-1,
                     window_right=-1, softcap=0.0, use_alibi=False, use_sinks=False,
                     write_lse=False, page_size=16, softmax_scale=d ** -0.5)
        why = functools.partial(
            ag.why_not, device=torch.device("cpu"), num_heads=h, num_kv_heads=hkv, head_size=d,
            head_size_v=d, q_dtype=q_dtype, kv_dtype=kv_dtype, out_dtype=DT, paged=True,
            page_size=16, use_q_descale=fp8, use_kv_descale=fp8)
        config = functools.partial(  # as plan_gluon_prefill calls it for the op
            ag.launch_config, sm_count=132, paged=True, dense_new_kv=False, kv_fp8=fp8,
            use_kv_descale=fp8, max_seqlen_k=max(sl), q_fp8=fp8, use_q_descale=fp8,
            split_q=ag.split_q_for(q_dtype, kv_dtype, d), **shape)
        schedule = config()
        metadata = dict(cu_seqlens_q=cu_q, seqused_k=seqused, block_table=table)
        stub = functools.partial(ag.GluonPrefillLaunch, schedule,
                                 launcher=lambda args, call_key: None, **metadata)
        own = functools.partial(ag.GluonPrefillLaunch, schedule, **metadata)
        launch = stub()
        args = functools.partial(launch.kernel_args, q, k, v, out, k_descale=descale,
                                 v_descale=descale, q_descale=descale)
        kw = dict(device=torch.device("cpu"), cu_seqlens_q=cu_q, seqused_k=seqused,
                  cu_seqlens_k=None, block_table=table, max_seqlen_k=max(sl), q_dtype=q_dtype,
                  kv_dtype=kv_dtype, out_dtype=DT, use_q_descale=fp8, use_kv_descale=fp8,
                  **{n: shape[n] for n in shape if n not in ("use_sinks", "write_lse")},
                  use_sinks=False, write_lse=False)
        cells = [per_call_us(fn) for fn in (why, config, stub, own, args)]
        cells += [per_call_us(functools.partial(plan_attention, **kw)),
                  per_call_us(functools.partial(op_plans.plan_for, **kw))]
        emit(f"| {label} | {dtype} | " + " | ".join(f"{us:.1f}" for us in cells) + " |")
        op_plans.clear()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="32 x 512,8 x 2048,1 x 8192")
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cpu", action="store_true", help="the host stages on a CPU, no launch")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows, dtypes = parse_rows(args.rows), parse_dtypes(args.dtypes)
    if args.cpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from timing import Emitter

    emit = Emitter()
    emit.to_file(args.out)
    torch.manual_seed(0)
    if args.cpu:
        emit(f"cpu; torch {torch.__version__}; us per call, best of 100 x 20 calls (a shared "
             "machine's: noisy)\n")
        cpu(rows, dtypes, emit)
        return
    import triton

    emit(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}, triton "
         f"{triton.__version__}; {args.rounds} rounds\n")
    gpu(rows, dtypes, args.rounds, emit)


if __name__ == "__main__":
    main()
