"""Where an eager step's host time goes on this machine: the cost of each primitive a layer
call is made of, then cProfile of layer calls and of `make` + `build()`.

Host speed differs up to 2x between GPU machines of one kind, so the first table prices the
pieces on the machine at hand (a bare Triton launch among them): read the profiles against
it, not against another host's numbers.

    PYTHONPATH=src python3 tools/profile_host.py [--out host_profile.txt]
    PYTHONPATH=src python3 tools/profile_host.py --python-only   # on a CPU: launches are no-ops

Rows are bench_host.py's (32 FLASH_ATTN layers, 32 q / 8 KV heads, head 128, bf16).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
from pathlib import Path

BENCHMARKS = str(Path(__file__).resolve().parents[1] / "benchmarks")
if BENCHMARKS not in sys.path:  # bench_host and timing, run from any folder
    sys.path.insert(0, BENCHMARKS)

import bench_host as bh  # noqa: E402
import torch  # noqa: E402

PROFILED = [("decode B1, ctx 1k", [1], [1024]),
            ("4 x 512-token chunks, ctx 2k", [512] * 4, [2048] * 4)]
BUILD_ROW = ("decode B128, ctx 1k", [1] * 128, [1024] * 128)


def primitives(s: bh.Step) -> list[tuple[str, float]]:
    """Host us of each piece a layer call is made of, on this machine."""
    q, k = s.q, s.k
    q3 = q.view(-1, bh.H, bh.D)
    dev = q.device

    class Identity(torch.nn.Module):
        def forward(self, x):
            return x

    module = Identity()

    def nothing():
        return None

    rows = [
        ("python: call of an empty function", nothing),
        ("nn.Module __call__ (no hooks) of an identity", lambda: module(q)),
        ("q.view(-1, H, D)", lambda: q.view(-1, bh.H, bh.D)),
        ("q.new_empty(q.shape)", lambda: q.new_empty(q.shape)),
        ("torch.empty((T, H, D), dtype, device)",
         lambda: torch.empty((s.T, bh.H, bh.D), dtype=bh.DT, device=dev)),
        ("q3.stride()", q3.stride),
        ("q3.data_ptr()", q3.data_ptr),
        ("q3.is_contiguous()", q3.is_contiguous),
        ("q3.shape[0]", lambda: q3.shape[0]),
        ("q3.dtype", lambda: q3.dtype),
        ("q3.device", lambda: q3.device),
        ("k.device != q.device", lambda: k.device != q.device),
        ("q3[:1] (a slice)", lambda: q3[:1]),
        ("torch.compiler.is_compiling()", torch.compiler.is_compiling),
    ]
    if bh.DEV == "cuda":
        from pagedattn.ops.triton import fast_launch

        get_stream, _ = fast_launch._runtime()
        rows += [("torch.cuda.current_device()", torch.cuda.current_device),
                 ("Triton get_current_stream(device)", lambda: get_stream(0))]
        spy = bh.LaunchSpy()
        layer = s.stack[0]
        md = s.build()
        plans = md.plans.kinds[0]
        kc, vc = layer.impl.split_kv_cache(layer.kv_cache[0])
        out = torch.empty(s.T, bh.H, bh.D, device=dev, dtype=bh.DT)
        with spy:
            plans.run(layer.impl, layer, q3, k.view(-1, bh.HKV, bh.D),
                      s.v.view(-1, bh.HKV, bh.D), kc, vc, out)
        spy.calls = spy.calls[:1]  # the cache write's launch alone
        rows.append(("bare launch of the cache-write kernel", spy.replay))
    return [(name, bh.host_us(fn, 2000)) for name, fn in rows]


def profile(fn, n: int, top: int) -> str:
    """cProfile of n calls of fn: the `top` functions by own time, us per call of fn."""
    fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    stats = pstats.Stats(prof)
    lines = [f"{'own us':>8} {'cum us':>8} {'calls':>6}  function (per call of the profiled "
             f"step; cProfile inflates small functions)"]
    entries = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]
    for (path, line, name), (_, calls, own, cum, _) in entries:
        where = f"{os.path.basename(path)}:{line}" if line else path
        lines.append(f"{own / n * 1e6:8.2f} {cum / n * 1e6:8.2f} {calls / n:6.1f}  "
                     f"{name} ({where})")
    total = sum(v[2] for v in stats.stats.values())
    lines.append(f"total own time {total / n * 1e6:.1f} us per call")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--python-only", action="store_true",
                      help="on the CPU, Triton launches as no-ops (as bench_host.py's)")
    args = ap.parse_args()
    if args.python_only:
        bh.DEV, bh.CLOCK = "cpu", __import__("time").process_time
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ["PAGEDATTN_OPS_PROVIDER"] = "triton"
        bh.no_kernel_launches()
    from pagedattn import set_forward_context

    out = io.StringIO()

    def emit(text: str) -> None:
        print(text, flush=True)
        out.write(text + "\n")

    name = torch.cuda.get_device_name() if bh.DEV == "cuda" else "cpu (python only)"
    emit(f"device: {name}; python {sys.version.split()[0]}; torch {torch.__version__}")
    layers = bh.make_layers(args.layers)
    for index, (label, query_lens, seq_lens) in enumerate(PROFILED):
        s = bh.Step(query_lens, seq_lens, layers)
        if index == 0:
            emit("\n## primitives (host us per call, best of 5 x 2000)\n")
            for what, us in primitives(s):
                emit(f"{us:8.2f}  {what}")
        md = s.build()
        with set_forward_context(md):
            emit(f"\n## one layer call, {label} ({args.layers} layers called in turn)\n")
            emit(profile(s.calls, 100, args.top).replace(
                "per call of the profiled step", f"per call of {args.layers} layers"))
        s.release()
    s = bh.Step(*BUILD_ROW[1:], layers)
    common = s.make()
    emit(f"\n## MetadataStager.make, {BUILD_ROW[0]}\n")
    emit(profile(s.make, 300, args.top))
    emit(f"\n## builder.build(), {BUILD_ROW[0]}\n")
    emit(profile(lambda: s.build(common), 300, args.top))
    s.release()
    if args.out:
        with open(args.out, "w") as f:
            f.write(out.getvalue())


if __name__ == "__main__":
    main()
