"""The Gluon prefill pass (issue 23) beside today's passes, one run on an H100: each row is
checked first (the Gluon output against the Hopper `tl` pass's), then timed, in TFLOP/s on
visible FLOPs, beside the Hopper `tl` pass, SDPA cuDNN, SDPA FlashAttention-2 and
FlexAttention; a markdown table comes last.

    PYTHONPATH=src python tools/bench_gluon.py [--no-flex] [--rows 1,2,...]
    PYTHONPATH=src compute-sanitizer --tool racecheck python tools/bench_gluon.py --racecheck
    PYTHONPATH=src compute-sanitizer --tool synccheck python tools/bench_gluon.py --racecheck
    PYTHONPATH=src python tools/bench_gluon.py --host-cpu    # no GPU needed

Rows are issue 23's: 32 query / 8 KV heads, head 128, bf16, causal prompts (the new tokens are
every key: the Gluon pass reads them as dense varlen rows, the `tl` pass likewise through its
plan with cu_seqlens_k), heads 64 and 256, and a 2,048-token chunk after 30,720 cached tokens
(Gluon: the context from the paged cache by one TMA box per page, the chunk's own keys as
dense rows; `tl`: the engine path's plan), and that chunk over an fp8 (e4m3) cache (Gluon:
every key from the pages through the converter warps; `tl`: the engine path's portable pass;
issue 23 wants it no slower than the bf16 row). `--racecheck` runs one small case of each
kernel variant once, for compute-sanitizer.

Host cost: "host us" is `run()` per call (a layer's launch: its pointers and strides, the
fast launch), "bare us" the compiled kernel's own launcher called with the same prebuilt
arguments in the same run (what this host's driver and Triton's launcher cost, the floor for
`run()`). `--host-cpu` times `run()` on a CPU with the launch stubbed (the Python above the
launcher), on tensors of each row's shapes.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import statistics
import sys
import time
from pathlib import Path

BENCHMARKS = str(Path(__file__).resolve().parents[1] / "benchmarks")
if BENCHMARKS not in sys.path:  # bench_prefill and timing, run from any folder
    sys.path.insert(0, BENCHMARKS)

import bench_prefill  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
from bench_prefill import Prefill, references  # noqa: E402
from timing import eager_ms as bench  # noqa: E402
from timing import graph_ms, host_us, markdown_table  # noqa: E402

from pagedattn.ops.triton import attention_gluon as ag  # noqa: E402
from pagedattn.ops.triton import gluon_prefill, launch  # noqa: E402
from pagedattn.ops.triton.attention_plan import plan_attention  # noqa: E402

DEV = "cuda"
DT = torch.bfloat16
ROWS = [  # (label, query_lens, seq_lens, heads, kv_heads, head_size, cache dtype)
    ("1 x 8192", [8192], [8192], 32, 8, 128, DT),
    ("1 x 16384", [16384], [16384], 32, 8, 128, DT),
    ("8 x 2048", [2048] * 8, [2048] * 8, 32, 8, 128, DT),
    ("32 x 512", [512] * 32, [512] * 32, 32, 8, 128, DT),
    ("1 x 8192, head 64", [8192], [8192], 32, 8, 64, DT),
    ("1 x 8192, head 256 (16 q / 8 KV)", [8192], [8192], 16, 8, 256, DT),
    ("2048 after 30720 cached", [2048], [32768], 32, 8, 128, DT),
    ("2048 after 30720 cached, fp8 e4m3 cache", [2048], [32768], 32, 8, 128,
     torch.float8_e4m3fn),
    ("8 x 2048, head 64", [2048] * 8, [2048] * 8, 32, 8, 64, DT),
    ("8 x 2048, head 256 (16 q / 8 KV)", [2048] * 8, [2048] * 8, 16, 8, 256, DT),
]
CHECK_TOL = 0.06  # max |Gluon - tl| on bf16 outputs of magnitude ~1 (both ~1e-2 off fp64)


def gluon_plan(p: Prefill, launcher=None) -> ag.GluonPrefillLaunch:
    """The Gluon pass's launch for p's batch: dense varlen keys when every key is a new token,
    else the paged context plus the new tokens' dense rows. launcher: a stub (--host-cpu)
    plans on the CPU, for 132 SMs, and launches nothing."""
    dense = p.query_lens == p.seq_lens
    fp8 = p.k.dtype != DT
    kw = dict(batch=len(p.query_lens), total_q=p.q.shape[0], max_seqlen_q=max(p.query_lens),
              num_heads=p.h, num_kv_heads=p.hkv, head_size=p.d, head_size_v=p.d,
              causal=True, window_left=-1, window_right=-1, softcap=0.0, use_alibi=False,
              use_sinks=False, write_lse=False, page_size=p.k.shape[1], dense_new_kv=True,
              softmax_scale=p.d ** -0.5)
    metadata = dict(cu_seqlens_q=p.cu_q, seqused_k=p.seqused,
                    cu_seqlens_k=p.cu_q if dense else None,
                    block_table=None if dense else p.table)
    if launcher is not None:
        schedule = ag.launch_config(sm_count=132, paged=not dense, kv_fp8=fp8,
                                    use_kv_descale=fp8, **kw)
        return ag.GluonPrefillLaunch(schedule, launcher=launcher, **metadata)
    launch = ag.plan_gluon_prefill(device=torch.device(DEV), max_seqlen_k=max(p.seq_lens),
                                   q_dtype=DT, kv_dtype=p.k.dtype, use_kv_descale=fp8,
                                   **metadata, **kw)
    if launch is None:
        raise RuntimeError("the Gluon pass cannot serve this GPU / Triton (needs sm_90, 3.6)")
    return launch


def gluon_call(p: Prefill, launch: ag.GluonPrefillLaunch):
    """(the Gluon pass over p's batch as a no-argument call, its output tensor)."""
    out = torch.empty_like(p.q)
    if p.query_lens == p.seq_lens:  # every key is a new token: dense varlen keys
        call = functools.partial(launch.run, p.q, p.k_new, p.v_new, out)
    else:  # an fp8 plan reads the new tokens from the cache (k_new unused)
        call = functools.partial(launch.run, p.q, p.k, p.v, out, k_new=p.k_new,
                                 v_new=p.v_new, k_descale=p.descale, v_descale=p.descale)
    return call, out


def bare_launch(launch: ag.GluonPrefillLaunch, call):
    """The compiled kernel's own launcher with `call`'s arguments prebuilt: a no-argument
    call (Triton's allocator set to the plan's scratch for this script)."""
    args, _ = launch.kernel_args(*call.args, **call.keywords)
    fn = gluon_prefill.gluon_prefill_kernel
    constexprs = launch.schedule.constexprs
    triton.set_allocator(launch.allocate)
    grid = launch.schedule.grid
    kernel = fn[(grid,)](*args, **constexprs, num_warps=4, num_stages=3)
    full = args + tuple(constexprs[n] for n in fn.arg_names[len(args):])
    stream = torch.cuda.current_stream().cuda_stream
    return functools.partial(kernel.run, grid, 1, 1, stream, kernel.function,
                             kernel.packed_metadata, None, None, None, *full)


def host_us_median(fn, repeats: int = 5) -> float:
    return statistics.median(host_us(fn, n=50) for _ in range(repeats))


def tl_call(p: Prefill):
    """(the `tl` pass over the same batch: the Hopper `tl` pass on dense keys, or the engine
    path's plan for a chunk after a cached context, its output tensor). Planned with the Gluon
    pass switched off, which the plan would otherwise pick."""
    launch.SWITCHES.gluon_prefill = False
    try:
        return _tl_call(p)
    finally:
        launch.SWITCHES.gluon_prefill = None


def _tl_call(p: Prefill):
    if p.query_lens != p.seq_lens:
        run, _ = p.engine()
        return run, p.out
    plan = plan_attention(
        device=torch.device(DEV), cu_seqlens_q=p.cu_q, seqused_k=p.seqused,
        cu_seqlens_k=p.cu_q, block_table=None, batch=len(p.seq_lens), total_q=p.q.shape[0],
        max_seqlen_q=max(p.query_lens), max_seqlen_k=max(p.seq_lens), num_heads=p.h,
        num_kv_heads=p.hkv, head_size=p.d, head_size_v=p.d, page_size=1, q_dtype=DT,
        kv_dtype=DT, out_dtype=DT, softmax_scale=p.d ** -0.5, causal=True, window_left=-1,
        window_right=-1, softcap=0.0, use_alibi=False, use_sinks=False, use_q_descale=False,
        use_kv_descale=False, write_lse=False)
    out = torch.empty_like(p.q)
    return functools.partial(plan.run, p.q, p.k_new, p.v_new, out), out


def write_new_rows(p: Prefill) -> None:
    """Put the new tokens' keys/values into the paged cache too (what the layer's cache write
    does), so a pass reading them from the cache and one reading k_new agree."""
    bs = p.k.shape[1]
    for r, (n, s) in enumerate(zip(p.query_lens, p.seq_lens)):
        pos = torch.arange(s - n, s, device=DEV)
        blocks = p.table[r, pos // bs].long()
        first = int(p.cu_q[r])
        p.k[blocks, pos % bs] = p.k_new[first:first + n]
        p.v[blocks, pos % bs] = p.v_new[first:first + n]


def row(label, ql, sl, h, hkv, d, cache_dtype, flex: bool) -> list:
    p = Prefill(ql, sl, h, hkv, d, cache_dtype=cache_dtype)
    if cache_dtype == DT:  # an fp8 row's passes both read the new tokens from the cache
        write_new_rows(p)
    flops = p.flops()
    launch = gluon_plan(p)
    g_run, g_out = gluon_call(p, launch)
    t_run, t_out = tl_call(p)
    g_run()
    t_run()
    torch.cuda.synchronize()
    diff = (g_out.float() - t_out.float()).abs().max().item()
    check = f"ok ({diff:.3f})" if diff <= CHECK_TOL else f"MISMATCH ({diff:.3f})"
    g_ms, t_ms = bench(g_run), bench(t_run)
    refs = references(p) if flex else references_without_flex(p)
    flash, cudnn, flex_s = refs
    ratio = f"{t_ms / g_ms:.2f}" if g_ms else "n/a"
    try:
        vs_cudnn = f"{flops / g_ms / 1e9 / float(cudnn):.2f}"
    except ValueError:
        vs_cudnn = "n/a"
    cells = [label, check, f"{flops / g_ms / 1e9:.0f}", f"{flops / t_ms / 1e9:.0f}", cudnn,
             flash, flex_s, ratio, vs_cudnn, f"{flops / 700e12 * 1e3:.3f}", f"{g_ms:.3f}",
             f"{host_us_median(g_run):.1f}", f"{host_us_median(bare_launch(launch, g_run)):.1f}"]
    print("| " + " | ".join(cells) + " |", flush=True)
    del p
    torch.cuda.empty_cache()
    return cells


def references_without_flex(p: Prefill) -> list[str]:
    """SDPA flash / cuDNN only (FlexAttention compiles per shape: ~20 s a row)."""
    flex = bench_prefill.FLEX_LABELS[:]
    bench_prefill.FLEX_LABELS[:] = []
    try:
        return references(p)
    finally:
        bench_prefill.FLEX_LABELS[:] = flex


# --- racecheck: one small case of each kernel variant ---------------------------------------
RACE_CASES = {  # name -> (query_lens, seq_lens, heads, kv_heads, d, paged, features)
    "h128 causal dense": ([300, 129], [300, 129], 4, 2, 128, None, {}),
    "h128 non-causal dense, keys longer": ([200, 70], [260, 300], 4, 2, 128, None,
                                           dict(causal=False)),
    "h64 causal dense": ([300], [300], 4, 2, 64, None, {}),
    # three consumers of 64 rows (192-row items: the turn ring of three, empty barriers
    # counting three), static and dynamic hand-out, dense and paged context + new rows
    "h64 three consumers causal dense": ([400, 130], [400, 130], 4, 2, 64, None,
                                         dict(consumers=3)),
    "h64 three consumers dynamic": ([200] * 4, [200] * 4, 4, 2, 64, None,
                                    dict(consumers=3, dynamic=True)),
    "h64 three consumers paged context + new rows": ([3, 200], [1033, 400], 4, 2, 64,
                                                     "context", dict(consumers=3)),
    "h256 causal dense": ([200], [200], 2, 1, 256, None, {}),
    "h128 window+alibi+softcap+sinks+lse": ([300], [300], 4, 1, 128, None, dict(
        window_left=100, softcap=20.0, use_alibi=True, use_sinks=True, write_lse=True)),
    "h128 paged context + new rows (fix-up)": ([3, 200], [1033, 400], 4, 2, 128, "context",
                                                {}),
    "h128 paged cache only (fix-up)": ([150], [701], 4, 2, 128, "cache", {}),
    "h256 paged cache only (fix-up)": ([100], [403], 2, 2, 256, "cache", {}),
    "h128 fp8 e4m3 cache (split q; converter V)": ([150, 40], [701, 90], 4, 2, 128, "cache",
                                                   dict(cache_dtype=torch.float8_e4m3fn)),
    "h64 fp8 e5m2 cache (split q, e4m3 x e5m2)": ([150, 40], [701, 90], 4, 2, 64, "cache",
                                                  dict(cache_dtype=torch.float8_e5m2)),
    "h256 fp8 e5m2 cache (converter K and V)": ([100], [403], 2, 2, 256, "context",
                                                dict(cache_dtype=torch.float8_e5m2)),
    "h128 fp8 e4m3 q + cache (fp8 Q K^T)": ([150, 40], [701, 90], 4, 2, 128, "cache",
                                            dict(cache_dtype=torch.float8_e4m3fn,
                                                 q_dtype=torch.float8_e4m3fn)),
    "h256 fp8 e4m3 q + cache (fp8 Q K^T)": ([100], [403], 2, 2, 256, "cache",
                                            dict(cache_dtype=torch.float8_e4m3fn,
                                                 q_dtype=torch.float8_e4m3fn)),
    # FA3's wider fp8 key tiles (forced: the rule takes them from 6,144 keys), with the V^T
    # 128-column slabs of every fp8 P V launch
    "h128 fp8 e4m3 q + cache, wide tiles": ([150, 40], [701, 90], 4, 2, 128, "cache",
                                            dict(cache_dtype=torch.float8_e4m3fn,
                                                 q_dtype=torch.float8_e4m3fn, wide=True)),
    "h256 fp8 e4m3 q + cache, wide tiles": ([100], [403], 2, 2, 256, "cache",
                                            dict(cache_dtype=torch.float8_e4m3fn,
                                                 q_dtype=torch.float8_e4m3fn, wide=True)),
    # dynamic item hand-out: the id slots between the producer and the readers
    "h128 causal dense, dynamic items": ([300, 129, 200, 64], [300, 129, 200, 64], 4, 2, 128,
                                         None, dict(dynamic=True)),
    "h128 fp8 e4m3 cache (split q), dynamic items": (
        [150, 40, 90, 7], [701, 90, 300, 20], 4, 2, 128, "cache",
        dict(cache_dtype=torch.float8_e4m3fn, dynamic=True)),
}


def racecheck(only: str = "") -> None:
    for name, (ql, sl, h, hkv, d, paged, feats) in RACE_CASES.items():
        if only not in name:
            continue
        torch.manual_seed(0)
        page = 16
        feats = dict(feats)
        cache_dtype = feats.pop("cache_dtype", DT)
        q_dtype = feats.pop("q_dtype", DT)
        ag.SWITCHES.gluon_dynamic = feats.pop("dynamic", None)
        ag.SWITCHES.gluon_consumers = feats.pop("consumers", 2)
        ag.SWITCHES.gluon_fp8_wide_tiles = feats.pop("wide", None)
        fp8, q_fp8 = cache_dtype != DT, q_dtype != DT
        blocks = [math.ceil(s / page) for s in sl]
        cache = torch.randn(2, sum(blocks), page, hkv, d, device=DEV).to(cache_dtype)
        table = torch.zeros(len(sl), max(blocks), dtype=torch.int32, device=DEV)
        start = 0
        for r, nb in enumerate(blocks):
            table[r, :nb] = torch.arange(start, start + nb, dtype=torch.int32)
            start += nb
        total = sum(ql)
        q = torch.randn(total, h, d, device=DEV, dtype=DT).to(q_dtype)
        k_new = torch.randn(total, hkv, d, device=DEV, dtype=DT)
        v_new = torch.randn_like(k_new)
        kd = torch.randn(sum(sl), hkv, d, device=DEV, dtype=DT)
        vd = torch.randn_like(kd)
        cu_q = torch.tensor([0, *itertools.accumulate(ql)], dtype=torch.int32, device=DEV)
        cu_k = torch.tensor([0, *itertools.accumulate(sl)], dtype=torch.int32, device=DEV)
        seqused = torch.tensor(sl, dtype=torch.int32, device=DEV)
        kw = dict(causal=True, window_left=-1, window_right=-1, softcap=0.0, use_alibi=False,
                  use_sinks=False, write_lse=False)
        kw.update(feats)
        launch = ag.plan_gluon_prefill(
            device=torch.device(DEV), cu_seqlens_q=cu_q, seqused_k=seqused,
            cu_seqlens_k=cu_k if paged is None else None,
            block_table=table if paged is not None else None, batch=len(ql), total_q=total,
            max_seqlen_q=max(ql), max_seqlen_k=max(sl), num_heads=h, num_kv_heads=hkv,
            head_size=d, head_size_v=d, q_dtype=q_dtype, kv_dtype=cache_dtype, page_size=page,
            dense_new_kv=paged == "context", softmax_scale=d ** -0.5, use_kv_descale=fp8,
            use_q_descale=q_fp8, out_dtype=DT, **kw)
        ag.SWITCHES.gluon_dynamic = None
        ag.SWITCHES.gluon_consumers = None
        ag.SWITCHES.gluon_fp8_wide_tiles = None
        out = torch.empty(q.shape, device=DEV, dtype=DT)
        lse = torch.empty(h, total, device=DEV) if kw["write_lse"] else None
        slopes = torch.rand(h, device=DEV) if kw["use_alibi"] else None
        sinks = torch.randn(h, device=DEV) if kw["use_sinks"] else None
        if paged is None:
            launch.run(q, kd, vd, out, lse, slopes, sinks)
        else:
            descales = (torch.tensor(0.5, device=DEV),) * 2 if fp8 else (None, None)
            launch.run(q, cache[0], cache[1], out, lse, slopes, sinks, k_new, v_new,
                       *descales, torch.tensor(0.5, device=DEV) if q_fp8 else None)
        torch.cuda.synchronize()
        print(f"{name}: ran, output finite: {bool(torch.isfinite(out.float()).all())}",
              flush=True)


def key_layouts() -> None:
    """Prompts without a context three ways, graph-replayed TFLOP/s: the Gluon pass over the
    paged cache plus the new rows (the plan without `new_keys_only`), over dense varlen keys
    (the new rows alone: what the builder plans for prompts), and the op over the cache."""
    print("| prompts | paged + new rows | dense varlen keys | op over the paged cache |")
    print("|---|---|---|---|")
    for label, ql in (("32 x 512", [512] * 32), ("8 x 2048", [2048] * 8)):
        p = Prefill(ql, ql, 32, 8, 128)
        paged, _ = p.engine(new_keys_only=False)
        dense, _ = gluon_call(p, gluon_plan(p))
        rates = [f"{p.flops() / graph_ms(fn) / 1e9:.0f}" for fn in (paged, dense, p.op())]
        print(f"| {label} | " + " | ".join(rates) + " |", flush=True)


def host_cpu() -> None:
    """run()'s host side per call on a CPU, the launch stubbed, on each row's shapes."""
    print("| prompts | run() without the launch, us (median of 7 x 1000 calls) |")
    print("|---|---:|")
    for label, ql, sl, h, hkv, d, cache_dtype in ROWS:
        p = CpuPrefill(ql, sl, h, hkv, d, cache_dtype)
        launch = gluon_plan(p, launcher=lambda args, call_key: None)
        call, _ = gluon_call(p, launch)
        for _ in range(200):
            call()
        per_call = []
        for _ in range(7):
            start = time.perf_counter()
            for _ in range(1000):
                call()
            per_call.append((time.perf_counter() - start) * 1e3)
        print(f"| {label} | {statistics.median(per_call):.1f} |", flush=True)


class CpuPrefill(Prefill):
    """Prefill's tensors on the CPU, uninitialised (only shapes and strides matter here)."""

    def __init__(self, query_lens, seq_lens, heads, kv_heads, d, cache_dtype, block_size=16):
        self.query_lens, self.seq_lens = list(query_lens), list(seq_lens)
        self.h, self.hkv, self.d = heads, kv_heads, d
        blocks = [math.ceil(s / block_size) for s in seq_lens]
        self.k, self.v = torch.empty(2, sum(blocks), block_size, kv_heads, d,
                                     dtype=cache_dtype)
        self.descale = torch.ones(()).expand(len(seq_lens), kv_heads) \
            if cache_dtype != DT else None
        self.table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
        total = sum(query_lens)
        self.q = torch.empty(total, heads, d, dtype=DT)
        self.k_new = torch.empty(total, kv_heads, d, dtype=DT)
        self.v_new = torch.empty_like(self.k_new)
        self.cu_q = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32)
        self.seqused = torch.tensor(seq_lens, dtype=torch.int32)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention (compiles)")
    ap.add_argument("--rows", default="", help="row numbers to run, e.g. 1,4 (default all)")
    ap.add_argument("--racecheck", action="store_true",
                    help="one small case per kernel variant, no timing")
    ap.add_argument("--cases", default="",
                    help="with --racecheck: only the cases whose name contains this")
    ap.add_argument("--host-cpu", action="store_true",
                    help="run()'s host side on a CPU, the launch stubbed")
    ap.add_argument("--key-layouts", action="store_true",
                    help="prompts alone: paged + new rows vs dense keys vs the op")
    args = ap.parse_args()
    if args.host_cpu:
        host_cpu()
        return
    if args.key_layouts:
        key_layouts()
        return
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}; torch {torch.__version__}, triton {triton.__version__}")
    if args.racecheck:
        racecheck(args.cases)
        return
    torch.manual_seed(0)
    picked = [int(x) - 1 for x in args.rows.split(",") if x] or range(len(ROWS))
    header = ["prompts", "check vs tl (max abs)", "Gluon", "Hopper tl pass", "SDPA cuDNN",
              "SDPA FA2", "FlexAttention", "tl ms / Gluon ms", "Gluon / cuDNN",
              "floor ms (700 TFLOP/s)", "Gluon ms", "Gluon host us", "bare launch us"]
    print("\n" + "\n".join(markdown_table(header)))
    cells = [row(*ROWS[i], flex=not args.no_flex) for i in picked]
    print("\n### Gluon prefill pass vs today's passes (TFLOP/s on visible FLOPs, causal, bf16)"
          "\n")
    print("\n".join(markdown_table(header, cells)))


if __name__ == "__main__":
    main()
