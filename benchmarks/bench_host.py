"""Host time of eager steps, broken down, beside a bare launch of the same compiled kernels.

32 `Attention` layers (FLASH_ATTN, 32 q / 8 KV heads, head 128, bf16, block 16) built on the
CPU as the README builds them and never moved: `bind_kv_cache` places their tensors on the
GPU with the caches. Per step kind (issue 25's four rows) it prints, in one run:

- host us per layer call: 32 calls queued without waiting, over 32 (what an eager step pays);
- its breakdown: `Attention.__call__` (nn.Module dispatch + forward), the impl's `forward`
  (given the tensors as the layer hands them on: 2-D rows where impl and plans take rows),
  the layer's planned run (its entry in `metadata.plans`, made at its first call, as every
  call runs it: the provider's plan of the layer, else the kind's `run`; cache write +
  attention launches, the per-call keys of the provider's plans included) and a bare launch
  of the same compiled kernels (Triton's launcher called with prepared arguments: the floor
  of any Python launch), with the launch count;
- metadata per step: `MetadataStager.make` (numpy lengths and block table in, one pinned
  upload into the builder's persistent buffers) and `builder.build()` (checks and the plans
  of every kind of layer; `--stager-buffers`: the upload goes to the stager's own buffer and
  `build()` copies it into the builder's, one more launch), and their sum;
- the eager 32-layer step (make + build + 32 layer calls, wall ms) and its kernels' time
  (profiler);
- vLLM's `unified_attention` op per call, where vLLM is installed (optional reference).

    PYTHONPATH=src python benchmarks/bench_host.py [--layers 32] [--out results.md]
    PYTHONPATH=src python benchmarks/bench_host.py --python-only   # on a CPU
    PYTHONPATH=src python benchmarks/bench_host.py --python-only --gluon-plans

`--python-only` runs the same rows on the CPU with the Triton provider's kernel launches
replaced by no-ops (the interpreter's plans, nothing launched): the Python cost of the path
alone, in CPU time of this process (robust to other work on a shared machine). Its "bare
launches" and "kernels" columns are n/a. `--gluon-plans` adds the Gluon prefill pass's host
path to those rows, planned as on an H100. `--cpu-time` times the host columns on the GPU in
this process's CPU time as well: GPU hosts are shared, and wall-clock host times there swing
2x between runs minutes apart. `--smoke` runs two tiny rows under the interpreter for real
(checks the script runs).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch
from timing import kernel_ms

H, HKV, D, BS, DT = 32, 8, 128, 16, torch.bfloat16
STEPS = [  # label, query lens, seq lens: issue 25's rows
    ("decode B1, ctx 1k", [1], [1024]),
    ("decode B32, ctx 4k", [1] * 32, [4096] * 32),
    ("decode B128, ctx 1k", [1] * 128, [1024] * 128),
    ("4 x 512-token chunks, ctx 2k", [512] * 4, [2048] * 4),
]
SMOKE_STEPS = [("smoke decode", [1, 1], [40, 17]), ("smoke chunks", [5, 3], [21, 3])]
LINES: list[str] = []
DEV = "cuda"
CLOCK = time.perf_counter  # --python-only: time.process_time (this process's CPU time)
SCALE = 1.0  # --smoke: a few calls of each timer only (the interpreter runs every kernel)
PERSISTENT = True  # --stager-buffers: the stager uploads into its own buffers, build() copies


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def emit(line: str) -> None:
    print(line, flush=True)
    LINES.append(line)


def host_us(fn, n: int, repeats: int = 5) -> float:
    """Best of `repeats`: microseconds of host time per call, n calls queued without waiting."""
    best = float("inf")
    n, repeats = max(1, int(n * SCALE)), max(1, int(repeats * SCALE))
    for _ in range(repeats):
        sync()
        start = CLOCK()
        for _ in range(n):
            fn()
        best = min(best, (CLOCK() - start) / n * 1e6)
    sync()
    return best


def make_layers(n: int):
    from pagedattn import Attention, CacheConfig, model_scope
    from pagedattn.backends.flash_attn import FlashAttentionBackend

    torch.set_default_dtype(DT)
    try:
        with model_scope():
            return {f"layers.{i}": Attention(H, D, D ** -0.5, HKV,
                                             cache_config=CacheConfig(block_size=BS),
                                             prefix=f"layers.{i}",
                                             attn_backend=FlashAttentionBackend)
                    for i in range(n)}
    finally:
        torch.set_default_dtype(torch.float32)


def no_kernel_launches() -> None:
    """--python-only: every Triton kernel launch of a plan becomes a no-op (the plans' own
    Python, their per-call keys included, still runs)."""
    from pagedattn.ops.triton import fast_launch

    fast_launch.KernelLaunch.__call__ = lambda launch, args, call_key: None


def gluon_plans_on_the_cpu() -> None:
    """--gluon-plans: the Gluon prefill pass serves on the CPU as on an H100 (132 SMs), so
    the Python-only rows run its host path (its launches are no-ops, as every launch). Reads
    the planner's private SM count: a benchmark's business, not a library path."""
    from pagedattn.ops.triton import attention_gluon

    attention_gluon.why_not = lambda **kwargs: None
    attention_gluon._sm_count = lambda device: 132


class LaunchSpy:
    """Records the direct launches (compiled kernel and arguments) one call makes, and
    replays them bare (Triton's launcher with prepared arguments, no launch hooks, nothing
    else). Reads the fast-launch module's internals: a benchmark's business, not a library
    path."""

    def __init__(self):
        from pagedattn.ops.triton import fast_launch

        self.fast_launch, self.calls = fast_launch, []
        self.scratch = torch.empty(1 << 22, dtype=torch.int8, device=DEV)

    def __enter__(self):
        original = self.original = self.fast_launch.KernelLaunch.__call__
        calls = self.calls

        def spy(launch, args, call_key):
            original(launch, args, call_key)
            direct = launch._kernels.get(call_key) if call_key is not None else None
            if direct is not None:
                calls.append((launch, direct, args))

        self.fast_launch.KernelLaunch.__call__ = spy
        return self

    def __exit__(self, *exc):
        self.fast_launch.KernelLaunch.__call__ = self.original

    def replay(self) -> None:
        # A kernel with global scratch (the Gluon pass builds its tensor descriptors there)
        # asks Triton's allocator, which its plan sets only around its own launches: here a
        # preallocated buffer stands in, so the replay stays bare.
        import triton

        scratch = self.scratch
        triton.set_allocator(lambda size, align, stream: scratch[:size])
        get_stream, _ = self.fast_launch._runtime()
        for launch, (run, function, packed_metadata, _), args in self.calls:
            g = launch.grid
            run(g[0], g[1], g[2], get_stream(launch.device_index), function, packed_metadata,
                None, None, None, *args, *launch._const_tail)


def bare_launch_us(run) -> tuple[float, int]:
    """Host us of the kernels one `run()` launches, replayed bare; (n/a, 0) off the GPU."""
    if DEV != "cuda":
        return float("nan"), 0
    spy = LaunchSpy()
    with spy:
        run()
    return (host_us(spy.replay, 200) if spy.calls else float("nan")), len(spy.calls)


class Step:
    """One step kind's setup: every layer bound to its own GPU cache (one shared small cache
    in the Python-only rows), the builder, the stager and the step's q/k/v."""

    def __init__(self, query_lens, seq_lens, layers):
        from pagedattn import AttentionSpec, EngineConfig
        from pagedattn.backends.flash_attn import FlashAttentionBackend
        from pagedattn.kv_cache import allocate_kv_cache, bind_kv_cache
        from pagedattn.metadata_staging import MetadataStager

        blocks = -(-seq_lens[0] // BS)
        # On the GPU every layer has its own cache; the Python-only rows share one small
        # cache (nothing is launched, and 32 real caches would not fit a CPU's memory).
        num_blocks = blocks * len(seq_lens) + 1 if DEV == "cuda" else 64
        shared = None if DEV == "cuda" else allocate_kv_cache(
            FlashAttentionBackend, num_blocks, BS, HKV, D, DT, device=DEV)
        self.caches = {name: shared if shared is not None else allocate_kv_cache(
            FlashAttentionBackend, num_blocks, BS, HKV, D, DT, device=DEV).normal_()
            for name in layers}
        bind_kv_cache(self.caches, layers)
        rng = np.random.default_rng(0)
        table = (rng.permutation(num_blocks - 1)[:blocks * len(seq_lens)] if DEV == "cuda"
                 else rng.integers(0, num_blocks, blocks * len(seq_lens))).astype(np.int32)
        self.table = table.reshape(len(seq_lens), blocks)
        self.q_np, self.s_np = np.array(query_lens), np.array(seq_lens)
        self.builder = FlashAttentionBackend.get_builder_cls()(
            AttentionSpec(BS, HKV, D, DT), list(layers),
            EngineConfig(max_num_seqs=max(len(seq_lens), 8), max_model_len=max(seq_lens),
                         max_num_batched_tokens=max(sum(query_lens), 512)), torch.device(DEV))
        # As an engine makes it: uploading into the builder's buffers (PERSISTENT=False:
        # into the stager's own, which build() then copies across, as before)
        self.stager = MetadataStager(DEV, persistent=self.builder.persistent_batch
                                     if PERSISTENT else None)
        self.T = T = sum(query_lens)
        self.q = torch.randn(T, H * D, device=DEV, dtype=DT)
        self.k = torch.randn(T, HKV * D, device=DEV, dtype=DT)
        self.v = torch.randn_like(self.k)
        self.layers = layers
        self.stack = list(layers.values())

    def make(self):
        return self.stager.make(self.q_np, self.s_np, self.table, BS)

    def build(self, common=None):
        return self.builder.build(0, self.make() if common is None else common)

    def calls(self) -> None:
        q, k, v = self.q, self.k, self.v
        for layer in self.stack:
            layer(q, k, v)

    def step(self) -> None:
        from pagedattn import set_forward_context

        with set_forward_context(self.build()):
            self.calls()

    def release(self) -> None:
        for layer in self.layers.values():
            layer.kv_cache = [torch.tensor([])]
        self.caches.clear()
        if DEV == "cuda":
            torch.cuda.empty_cache()


def row(label, query_lens, seq_lens, layers) -> str:
    from pagedattn import set_forward_context as context

    s = Step(query_lens, seq_lens, layers)
    common = s.make()
    stage_us = host_us(s.make, 50)
    build_us = host_us(lambda: s.build(common), 50)
    T, q, k, v, stack, calls, step = s.T, s.q, s.k, s.v, s.stack, s.calls, s.step
    step()
    sync()
    walls = []
    for _ in range(max(1, int(10 * SCALE))):
        start = CLOCK()
        step()
        sync()
        walls.append(CLOCK() - start)
    wall_ms = sorted(walls)[len(walls) // 2] * 1e3
    kern_ms = kernel_ms(step, steps=3) if DEV == "cuda" else float("nan")
    md = s.build(common)
    layer = stack[0]
    plans = md.plans.kinds[0]  # the one kind of these 32 layers
    # The tensors as the layer hands them on: its 2-D rows where the impl and the plans
    # take rows, else [T, heads, D] views.
    out = torch.empty(T, H * D, device=DEV, dtype=DT)
    if not (layer.impl.forward_takes_rows and plans.takes_rows):
        q, k, v, out = q.view(T, H, D), k.view(T, HKV, D), v.view(T, HKV, D), out.view(T, H, D)
    cache = layer.kv_cache[0]
    with context(md):
        calls()
        per_layer = host_us(calls, 5, repeats=7) / len(stack)
        module = host_us(lambda: layer(s.q, s.k, s.v), 200)
    impl = host_us(lambda: layer.impl.forward(layer, q, k, v, cache, md, output=out), 200)
    # As the layer's calls run them: its entry in the step's plans (made at its first call)
    planned = md.plans.layers[layer.impl]
    kc, vc = planned.key_cache, planned.value_cache

    def run():
        if planned.run is None or not planned.run(q, k, v, out):
            plans.run(layer.impl, layer, q, k, v, kc, vc, out)

    plan_us = host_us(run, 200)
    bare, count = bare_launch_us(run)
    vllm = vllm_reference_us(q.view(T, H, D), kc, vc, out.view(T, H, D), md)
    s.release()
    return (f"| {label} | {per_layer:.1f} | {module:.1f} | {impl:.1f} | {plan_us:.1f} | "
            f"{bare:.1f} ({count}) | {per_layer - bare:.1f} | {vllm} | {stage_us:.0f} | "
            f"{build_us:.0f} | {stage_us + build_us:.0f} | {wall_ms:.2f} | {kern_ms:.2f} |")


def vllm_reference_us(q, k_cache, v_cache, out, md) -> str:
    """vLLM's Triton `unified_attention` on the same batch, where vLLM is installed."""
    if DEV != "cuda":
        return "-"
    try:
        from vllm.attention.ops.triton_unified_attention import unified_attention
    except Exception:  # not installed (or not importable here): no reference column
        return "-"
    one = torch.ones((), device=q.device)

    def call():
        unified_attention(q=q, k=k_cache, v=v_cache, out=out, cu_seqlens_q=md.query_start_loc,
                          max_seqlen_q=md.max_query_len, seqused_k=md.seq_lens,
                          max_seqlen_k=md.max_seq_len, softmax_scale=D ** -0.5, causal=True,
                          window_size=(-1, -1), block_table=md.block_table, softcap=0,
                          q_descale=None, k_descale=one.expand(1, HKV),
                          v_descale=one.expand(1, HKV))

    try:
        call()
        return f"{host_us(call, 200):.1f}"
    except Exception as e:  # another vLLM's signature: say so, do not fail the table
        return f"failed ({type(e).__name__})"


def main() -> None:
    global DEV, CLOCK, SCALE, PERSISTENT
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--out", default=None)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--python-only", action="store_true",
                      help="on the CPU, Triton launches as no-ops: the path's Python alone")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time host costs in this process's CPU time, not wall time: on a "
                         "shared GPU host, time spent descheduled then does not count")
    ap.add_argument("--gluon-plans", action="store_true",
                    help="with --python-only: plan as on an H100 (the Gluon prefill pass "
                         "serves prefills; its launches are no-ops too)")
    ap.add_argument("--stager-buffers", action="store_true",
                    help="the stager uploads each step into its own device buffer and "
                         "build() copies it into the builder's (the path without "
                         "persistent=): the before of the one-upload path")
    mode.add_argument("--smoke", action="store_true",
                      help="tiny steps on the CPU under TRITON_INTERPRET=1: checks the script runs")
    args = ap.parse_args()
    if args.python_only or args.smoke:
        DEV = "cpu"
        if os.environ.get("TRITON_INTERPRET") != "1":
            if "triton" in sys.modules:  # Triton reads the switch when it is imported
                raise SystemExit("--python-only and --smoke need TRITON_INTERPRET=1")
            os.environ["TRITON_INTERPRET"] = "1"
        os.environ["PAGEDATTN_OPS_PROVIDER"] = "triton"  # read at each build
    if args.python_only or args.cpu_time:
        CLOCK = time.process_time
    if args.python_only:
        no_kernel_launches()
        if args.gluon_plans:
            gluon_plans_on_the_cpu()
    if args.smoke:
        SCALE = 0.01
    PERSISTENT = not args.stager_buffers
    import triton

    torch.manual_seed(0)
    name = torch.cuda.get_device_name() if DEV == "cuda" else \
        "cpu (python only: launches are no-ops, CPU time)" if args.python_only else "cpu (smoke)"
    emit(f"device: {name}; torch {torch.__version__}, triton "
         f"{triton.__version__}; {args.layers} FLASH_ATTN layers, {H} q / {HKV} KV heads, "
         f"head {D}, bf16, block {BS}; layers built on the CPU, never moved"
         + ("; host times in CPU time" if args.cpu_time else "")
         + ("; make uploads into the stager's buffers, build() copies" if not PERSISTENT
            else "; make uploads into the builder's buffers"))
    emit("\nhost us per call (best of 5; 200 calls queued, per-layer: best of 7 x 5 x 32 "
         "calls) | metadata us "
         "per step | eager step vs kernels\n")
    emit("| step | per layer call (32 queued) | `Attention.__call__` | impl `forward` | "
         "planned run (write + attention) | bare launches (count) | layer call - bare | "
         "vLLM `unified_attention` | `MetadataStager.make` | `build()` | make + build | "
         "eager step ms | kernels ms |")
    emit("|" + "---|" * 13)
    layers = make_layers(args.layers)
    for label, query_lens, seq_lens in SMOKE_STEPS if args.smoke else STEPS:
        emit(row(label, query_lens, seq_lens, layers))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
