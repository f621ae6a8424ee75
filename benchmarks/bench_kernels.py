"""Side-by-side kernel timings on one GPU, in one run: decode, prefill, mixed, fp8, sweeps.

    PYTHONPATH=src python benchmarks/bench_kernels.py [--sections decode,prefill,mixed,fp8]
        [--sweep] [--rounds 3] [--out results.md]   (sections also: decode_grid, split, host)

Two source trees side by side (old code against new): tools/ab_kernels.py.

"host" prints issue 13's table: eager 32-layer steps (one `build` each), their kernel time
from the profiler, and the host time of one layer call and of `flash_attn_varlen_func`.

"decode" prints issue 41's rows beside FlashAttention-3 (bf16 and fp8), SDPA cuDNN and vLLM's
Triton kernel, graph-replayed and eager, alternated in `--rounds` rounds (decode_peers.py);
"decode_grid" the batch x context grid of ours beside SDPA's default backend.
Decode is memory-bound: its floor is the K/V bytes over the measured device-to-device copy
bandwidth (bytes read + written / time), so "% copy" is achieved bandwidth over that ceiling.
Prefill is compute-bound and reported in TFLOP/s (causal FLOPs: 2 * 2 * L^2 / 2 * H * D).
Every timing is the median of triton.testing.do_bench (events, L2 flushed between runs).
"""

from __future__ import annotations

import argparse
import functools
import math
import time
from dataclasses import replace

import torch
import torch.nn.functional as F
import triton
from timing import Emitter, eager_ms, graph_ms, host_us, kernel_ms
from torch.nn.attention import SDPBackend, sdpa_kernel

from pagedattn.ops.triton import launch
from pagedattn.ops.triton.launch import AttnConfig
from pagedattn.ops.triton.op_plans import varlen_attention

H, HKV, D = 32, 8, 128
DT = torch.bfloat16
DEV = "cuda"
emit = Emitter()  # prints, and with --out appends each row (a cut-off run keeps rows)
bench = eager_ms  # median ms, events around each call, L2 flushed in between
# Decode rows are CUDA-graph replays: engines capture decode steps, and a kernel of a few
# microseconds would otherwise time the host's launch path.
bench_graph = graph_ms


def copy_bandwidth() -> float:
    """Bytes per second of a large device-to-device copy, counting reads and writes."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    ms = bench(functools.partial(y.copy_, x))
    return 2 * (1 << 30) / (ms * 1e-3)


class Paged:
    """A scattered paged cache holding `seq_lens` and the batch's metadata (heads of
    head_size, D by default)."""

    def __init__(self, query_lens, seq_lens, block_size=16, cache_dtype=DT, layout="NHD",
                 head_size=D):
        self.query_lens, self.seq_lens = list(query_lens), list(seq_lens)
        self.head_size = head_size
        blocks = [math.ceil(s / block_size) for s in seq_lens]
        num_blocks = sum(blocks)
        shape = (2, num_blocks, block_size, HKV, head_size)
        if layout == "HND":
            cache = torch.randn(2, num_blocks, HKV, block_size, head_size, device=DEV, dtype=DT)
            cache = cache.to(cache_dtype).permute(0, 1, 3, 2, 4)
        else:
            cache = torch.randn(shape, device=DEV, dtype=DT).to(cache_dtype)
        self.k, self.v = cache[0], cache[1]
        perm = torch.randperm(num_blocks, device=DEV, dtype=torch.int32)
        table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device=DEV)
        start = 0
        for r, n in enumerate(blocks):
            table[r, :n] = perm[start:start + n]
            start += n
        self.block_table = table
        self.q = torch.randn(sum(query_lens), H, head_size, device=DEV, dtype=DT)
        self.out = torch.empty_like(self.q)
        cu = [0]
        for n in query_lens:
            cu.append(cu[-1] + n)
        self.cu_q = torch.tensor(cu, dtype=torch.int32, device=DEV)
        self.seqused = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
        batch = len(seq_lens)
        fp8 = cache_dtype != DT
        one = torch.ones((), device=DEV)
        self.descale = one.expand(batch, HKV) if fp8 else None
        self.kv_bytes = sum(seq_lens) * HKV * head_size * 2 * cache.element_size()

    def run(self, num_splits=0, config=None, fn=None):
        (fn or varlen_attention)(
            self.q, self.k, self.v, self.out, cu_seqlens_q=self.cu_q, seqused_k=self.seqused,
            cu_seqlens_k=None, block_table=self.block_table,
            max_seqlen_q=max(self.query_lens), max_seqlen_k=max(self.seq_lens),
            softmax_scale=self.head_size ** -0.5, causal=True, window_left=-1, window_right=-1,
            softcap=0.0,
            alibi_slopes=None, sinks=None, q_descale=None, k_descale=self.descale,
            v_descale=self.descale, softmax_lse=None, num_splits=num_splits, config=config)


def sdpa_decode_ms(batch, ctx) -> float:
    q = torch.randn(batch, H, 1, D, device=DEV, dtype=DT)
    k = torch.randn(batch, HKV, ctx, D, device=DEV, dtype=DT)
    v = torch.randn_like(k)
    return bench_graph(functools.partial(F.scaled_dot_product_attention, q, k, v,
                                         enable_gqa=True))


def section_decode(rounds: int) -> None:
    """Issue 41's decode rows beside their peers (benchmarks/decode_peers.py)."""
    import decode_peers

    decode_peers.section(emit, rounds)


def section_decode_grid(bw: float) -> None:
    emit("\n### (a2) Decode: 32 q / 8 KV heads, head 128, bf16, block 16 (scattered blocks)\n")
    emit("| batch | ctx | ours ms | ours TB/s | % copy | SDPA (dense) ms | SDPA TB/s | floor ms |")
    emit("|---|---|---|---|---|---|---|---|")
    for batch in (1, 32, 128):
        for ctx in (1024, 4096, 8192, 16384, 32768):
            p = Paged([1] * batch, [ctx] * batch)
            ms = bench_graph(p.run)
            try:
                sd = sdpa_decode_ms(batch, ctx)
            except torch.OutOfMemoryError:
                sd = float("nan")
            gb = p.kv_bytes
            emit(f"| {batch} | {ctx} | {ms:.3f} | {gb / ms / 1e9:.2f} | "
                 f"{100 * gb / ms / 1e-3 / bw:.0f}% | {sd:.3f} | {gb / sd / 1e9:.2f} | "
                 f"{gb / bw * 1e3:.3f} |")
            p = None
            torch.cuda.empty_cache()


def causal_flops(lens) -> float:
    return sum(2.0 * L * L * H * D for L in lens)  # 4 * L^2/2 * H * D


def section_prefill() -> None:
    """Issue 16's prefill rows side by side (benchmarks/bench_prefill.py): both of our
    passes, SDPA FlashAttention-2 / cuDNN, FlexAttention; sliding window; fp8 context."""
    import bench_prefill

    emit("\n### (b) Causal prefill, bf16, block 16 (TFLOP/s on visible FLOPs)\n")
    bench_prefill.emit_table(bench_prefill.MAIN_ROWS, emit)
    emit("\n### (b2) Sliding window 4096 over 1 x 32768 (visible FLOPs)\n")
    bench_prefill.emit_table(bench_prefill.WINDOW_ROWS, emit)
    bench_prefill.fp8_context_row(emit)


def section_mixed(bw: float) -> None:
    """Table (c): chunked prefills + decodes in one step, the engine path and the public op
    side by side against their floors (benchmarks/bench_prefill.py)."""
    import bench_prefill

    emit("\n### (c) Mixed batch: chunked prefills + decodes in one step (graph replays)")
    bench_prefill.mixed_rows(bw, emit)


def section_fp8() -> None:
    emit("\n### (d) fp8 (e4m3) vs bf16 cache, decode\n")
    emit("| batch | ctx | bf16 ms | fp8 ms | speed-up |")
    emit("|---|---|---|---|---|")
    for batch, ctx in ((1, 8192), (1, 32768), (32, 8192), (32, 16384), (128, 8192)):
        a = Paged([1] * batch, [ctx] * batch)
        t_bf16 = bench_graph(a.run)
        a = None
        b = Paged([1] * batch, [ctx] * batch, cache_dtype=torch.float8_e4m3fn)
        t_fp8 = bench_graph(b.run)
        b = None
        torch.cuda.empty_cache()
        emit(f"| {batch} | {ctx} | {t_bf16:.3f} | {t_fp8:.3f} | {t_bf16 / t_fp8:.2f}x |")


def _switched(**flags):
    """Run with some `launch.SWITCHES` flipped (restored after each call)."""
    def wrap(fn):
        def run(*a, **kw):
            old = dict(vars(launch.SWITCHES))
            vars(launch.SWITCHES).update(flags)
            try:
                return fn(*a, **kw)
            finally:
                vars(launch.SWITCHES).update(old)
        return run
    return wrap


def section_sweep(bw: float) -> None:
    """Variants side by side: the current defaults, each switch flipped, and a few tile
    configs."""
    emit("\n### Sweeps (tuning): decode rows = % of copy bandwidth (graph replays)\n")
    emit("| case | variant | ms | % copy or TFLOP/s |")
    emit("|---|---|---|---|")
    fp8 = torch.float8_e4m3fn

    def variants(decode: bool, cache_dtype):
        yield "current", {}
        if decode and cache_dtype == fp8:
            yield "no fp8 V asm", dict(switches=dict(fp8_v_in_regs=False))
            yield "bf16 dot", dict(switches=dict(fp16_dot_for_fp8_kv=False))
            for bn, w, st in ((128, 4, 3), (64, 4, 3), (128, 8, 2), (256, 4, 2)):
                yield f"{bn},{w},{st}", dict(config=(16, bn, w, st))
        elif decode:
            yield "128,4,3", dict(config=(16, 128, 4, 3))
        else:
            for bm, bn, w, st in ((256, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2),
                                  (256, 128, 8, 2), (64, 64, 4, 3)):
                yield f"{bm},{bn},{w},{st}", dict(config=(bm, bn, w, st))

    def time_one(p, decode, v):
        fn = v.get("fn", varlen_attention)
        if "switches" in v:
            fn = _switched(**v["switches"])(fn)
        cfg = None
        if "config" in v:
            cfg = AttnConfig(*v["config"], 1)
            if decode:  # keep the automatic split count (an override turns it off)
                cfg = replace(cfg, num_splits=launch.auto_splits(
                    torch.device(DEV), len(p.seq_lens), max(p.seq_lens), HKV))
        run = functools.partial(p.run, fn=fn, config=cfg)
        return bench_graph(run) if decode else bench(run)

    for batch, ctx, cache_dtype in ((32, 8192, fp8), (32, 16384, fp8), (128, 8192, fp8),
                                    (1, 32768, fp8), (32, 8192, DT), (128, 4096, DT),
                                    (1, 32768, DT), (32, 1024, DT)):
        p = Paged([1] * batch, [ctx] * batch, cache_dtype=cache_dtype)
        for name, v in variants(True, cache_dtype):
            try:
                ms = time_one(p, True, v)
            except Exception as e:
                emit(f"| decode b{batch} ctx{ctx} | {name} | fail {type(e).__name__}: "
                     f"{str(e)[:80]} | |")
                continue
            emit(f"| decode b{batch} ctx{ctx} {str(cache_dtype)[6:]} | {name} | {ms:.3f} | "
                 f"{100 * p.kv_bytes / ms / 1e-3 / bw:.0f}% |")
        p = None
        torch.cuda.empty_cache()
    for n, L in ((16, 1024), (32, 512), (8, 1024), (4, 4096), (1, 16384)):
        p = Paged([L] * n, [L] * n)
        flops = causal_flops([L] * n)
        for name, v in variants(False, DT):
            try:
                ms = time_one(p, False, v)
            except Exception as e:
                emit(f"| prefill {n}x{L} | {name} | fail {type(e).__name__}: "
                     f"{str(e)[:80]} | |")
                continue
            emit(f"| prefill {n}x{L} | {name} | {ms:.3f} | {flops / ms / 1e9:.0f} TFLOP/s |")
        q = torch.randn(n, H, L, D, device=DEV, dtype=DT)
        k, v = torch.randn_like(q), torch.randn_like(q)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            ms = bench(functools.partial(F.scaled_dot_product_attention, q, k, v,
                                         is_causal=True))
        emit(f"| prefill {n}x{L} | SDPA flash | {ms:.3f} | {flops / ms / 1e9:.0f} TFLOP/s |")
        p = q = k = v = None
        torch.cuda.empty_cache()
    for q_lens, s_lens in (([512] * 4 + [1] * 128, [2048] * 4 + [4096] * 128),
                           ([2048] * 2 + [1] * 64, [2048] * 2 + [8192] * 64)):
        p = Paged(q_lens, s_lens)
        ms = bench_graph(p.run)
        emit(f"| mixed {len(q_lens)} requests | current | {ms:.3f} | "
             f"{100 * p.kv_bytes / ms / 1e-3 / bw:.0f}% |")
        p = None
        torch.cuda.empty_cache()


def section_split(bw: float) -> None:
    """Few query blocks over many keys (the prefill pass's split-KV), and the decode rows that
    share its reduce: current auto and current forced unsplit."""
    emit("\n### (s) Prefill-pass split-KV: few query blocks over long keys (graph replays)\n")
    emit("| case | variant | splits | ms | TB/s of K/V |")
    emit("|---|---|---|---|---|")
    cases = (("cascade prefix pass: 64 q x 16k", [64], [16384], (4, 16, 32)),
             ("cascade prefix pass: 256 q x 16k", [256], [16384], (2, 4)),
             ("cascade prefix pass: 16 q x 8k", [16], [8192], ()),
             ("chunk 128 q over 32k ctx", [128], [32768], (8,)),
             ("decode b1 ctx 32k", [1], [32768], ()), ("decode b1 ctx 8k", [1], [8192], ()),
             ("decode b32 ctx 8k", [1] * 32, [8192] * 32, ()))
    for label, q_lens, s_lens, forced in cases:
        p = Paged(q_lens, s_lens)
        group_pad = triton.next_power_of_2(H // HKV)
        cfg = launch.prefill_config(max_seqlen_q=max(q_lens), head_size=D, group_pad=group_pad)
        block_q = cfg.block_m // group_pad
        auto = launch.prefill_splits(device=torch.device(DEV), num_kv_heads=HKV, num_splits=0,
                                     q_blocks=sum(q_lens) // block_q + len(q_lens),
                                     block_m=cfg.block_m,
                                     max_seqlen_k=max(s_lens)) if max(q_lens) > 4 else "-"
        rows = [("current auto", auto, dict())]
        if max(q_lens) > 4:
            rows += [("current forced", n, dict(num_splits=n)) for n in (1, *forced)]
        for name, n, kw in rows:
            ms = bench_graph(functools.partial(p.run, **kw))
            emit(f"| {label} | {name} | {n} | {ms:.4f} | {p.kv_bytes / ms / 1e9:.2f} |")
        p = None
        torch.cuda.empty_cache()


HOST_STEPS = (("decode B1, ctx 32k", [1], [32768]),
              ("decode B32, ctx 4k", [1] * 32, [4096] * 32),
              ("decode B128, ctx 1k", [1] * 128, [1024] * 128),
              ("4 x 512-token chunks, ctx 2k", [512] * 4, [2048] * 4))


def section_host(num_layers: int = 32) -> None:
    """Issue 13's table: eager steps of 32 FLASH_ATTN layers, one `build` per step."""
    from pagedattn import Attention, CacheConfig, model_scope
    from pagedattn.backends.flash_attn import FlashAttentionBackend

    emit(f"\n### (f) Eager steps: {num_layers} FLASH_ATTN layers, 32 q / 8 KV heads, head 128, "
         "bf16, block 16; one build per step\n")
    emit("| step | eager step ms | kernels ms (profiler) | host us / layer call | build us | "
         "flash_attn_varlen_func host us |")
    emit("|---|---|---|---|---|---|")
    bs = 16
    torch.set_default_dtype(DT)
    try:
        with model_scope():
            layers = [Attention(H, D, D ** -0.5, HKV, cache_config=CacheConfig(block_size=bs),
                                prefix=f"layers.{i}", attn_backend=FlashAttentionBackend)
                      .to(DEV) for i in range(num_layers)]
    finally:
        torch.set_default_dtype(torch.float32)
    for label, query_lens, seq_lens in HOST_STEPS:
        emit(_host_row(label, query_lens, seq_lens, layers, bs))
        for layer in layers:
            layer.kv_cache = [torch.tensor([])]
        torch.cuda.empty_cache()


def _host_row(label, query_lens, seq_lens, layers, bs) -> str:
    from pagedattn import AttentionSpec, CommonAttentionMetadata, EngineConfig
    from pagedattn import set_forward_context as context
    from pagedattn.backends.flash_attn import FlashAttentionBackend
    from pagedattn.kv_cache import allocate_kv_cache
    from pagedattn.ops import flash_attn_varlen_func

    blocks = math.ceil(seq_lens[0] / bs)  # every request of a row has the same length
    num_blocks = blocks * len(seq_lens) + 1
    for layer in layers:
        layer.kv_cache = [allocate_kv_cache(FlashAttentionBackend, num_blocks, bs, HKV, D,
                                            DT, device=DEV).normal_()]
    table = torch.randperm(num_blocks - 1, dtype=torch.int32).view(len(seq_lens), blocks)
    common = CommonAttentionMetadata.from_lengths(query_lens, seq_lens, table, bs, DEV)
    builder = FlashAttentionBackend.get_builder_cls()(
        AttentionSpec(bs, HKV, D, DT), [layer.layer_name for layer in layers],
        EngineConfig(max_num_seqs=max(len(seq_lens), 8), max_model_len=max(seq_lens),
                     max_num_batched_tokens=max(sum(query_lens), 512)), torch.device(DEV))
    T = sum(query_lens)
    q = torch.randn(T, H * D, device=DEV, dtype=DT)
    k = torch.randn(T, HKV * D, device=DEV, dtype=DT)
    v = torch.randn_like(k)

    def layer_calls():
        for layer in layers:
            layer(q, k, v)

    def step():
        with context(builder.build(0, common)):
            layer_calls()

    step()
    torch.cuda.synchronize()
    walls = []
    for _ in range(10):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - start)
    wall_ms = sorted(walls)[len(walls) // 2] * 1e3
    step_kernel_ms = kernel_ms(step)
    build_us = host_us(lambda: builder.build(0, common), 50, warmup=0)
    with context(builder.build(0, common)):
        layer_calls()
        layer_us = min(host_us(layer_calls, 1, warmup=0) for _ in range(5)) / len(layers)
    md = builder.build(0, common)
    qh = q.view(T, H, D)
    out = torch.empty_like(qh)
    cache = layers[0].kv_cache[0]

    def varlen():
        flash_attn_varlen_func(qh, cache[0], cache[1], md.max_query_len, md.query_start_loc,
                               md.max_seq_len, seqused_k=md.seq_lens,
                               block_table=md.block_table, causal=True, out=out)

    varlen()
    op_us = min(host_us(varlen, 20, warmup=0) for _ in range(3))
    return (f"| {label} | {wall_ms:.2f} | {step_kernel_ms:.2f} | {layer_us:.0f} | {build_us:.0f} | "
            f"{op_us:.0f} |")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="decode,prefill,mixed,fp8")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--rounds", type=int, default=3,
                    help="decode: rounds of alternated timings of ours and the peers (median)")
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def main() -> None:
    args = parse_args()
    emit.to_file(args.out)
    torch.manual_seed(0)
    t0 = time.time()
    props = torch.cuda.get_device_properties(0)
    bw = copy_bandwidth()
    emit(f"device: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}, "
         f"triton {triton.__version__}; measured copy bandwidth {bw / 1e12:.2f} TB/s")
    sections = args.sections.split(",")
    if args.sweep:
        section_sweep(bw)
    if "split" in sections:
        section_split(bw)
    if "decode" in sections:
        section_decode(args.rounds)
    if "decode_grid" in sections:
        section_decode_grid(bw)
    if "prefill" in sections:
        section_prefill()
    if "mixed" in sections:
        section_mixed(bw)
    if "fp8" in sections:
        section_fp8()
    if "host" in sections:
        section_host()
    emit(f"\n(bench wall time {time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
