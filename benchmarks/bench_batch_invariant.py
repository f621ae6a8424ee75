"""Batch-invariant mode's cost (issue 44): the default mode and the invariant mode side by
side in one run, on docs/PERFORMANCE.md's rows.

    PYTHONPATH=src python benchmarks/bench_batch_invariant.py \\
        [--sections decode,fp8,prefill,mixed,generate] [--out FILE] \\
        [--variant invariant_split_keys=512 --variant 'invariant_tiles=(128,64,8,3)' ...]

- decode: bench_kernels.py's table (a) (32 q / 8 KV heads, head 128, bf16, block 16, graph
  replays); fp8: its table (d)'s e4m3 rows;
- prefill: bench_prefill.py's main and window rows on the engine path (a plan per step, the
  new rows dense; default: the Gluon pass on sm_90, beside it the `tl` pass it would run
  without), eager, L2 flushed; mixed: its mixed batches, graph replays;
- generate: bench_generate.py's paged generator (SmolLM2-135M, or its shape with random
  weights), CUDA graphs, tokens/s: default, invariant attention, and invariant attention with
  the model's matmuls and means invariant too (`integrations.batch_invariant_ops`).

"invariant / default" is the issue's cost (target <= 1.15). Each --variant adds a column:
the invariant mode with `launch.SWITCHES` fields set (split keys, tiles, fused multiply-adds),
for sweeps; the bits of a variant differ from the default invariant mode's (they are its own).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import os
import time

import torch
import triton
from bench_kernels import Paged
from bench_prefill import MAIN_ROWS, WINDOW_ROWS, Prefill
from timing import Emitter, eager_ms, graph_ms

from pagedattn.ops.triton import launch
from pagedattn.ops.triton.op_plans import varlen_attention

emit = Emitter()


@contextlib.contextmanager
def switches(**values):
    """`launch.SWITCHES` with `values` set inside the block."""
    old = dict(vars(launch.SWITCHES))
    vars(launch.SWITCHES).update(values)
    try:
        yield
    finally:
        vars(launch.SWITCHES).update(old)


def parse_variant(text: str) -> dict:
    """"a=1;b=(64,64,4,2)" -> {"a": 1, "b": (64, 64, 4, 2)} (fields of launch.SWITCHES)."""
    out = {}
    for item in text.split(";"):
        key, _, value = item.partition("=")
        if not hasattr(launch.SWITCHES, key.strip()):
            raise SystemExit(f"--variant {text!r}: launch.SWITCHES has no field {key!r}")
        out[key.strip()] = ast.literal_eval(value.strip())
    return out


def columns(variants) -> list[tuple[str, dict]]:
    """(label, switches) of the invariant columns: the mode itself, then each variant."""
    return [("invariant", {})] + [("; ".join(f"{k}={v}" for k, v in var.items()), var)
                                  for var in variants]


def header(first: list[str], variants, last: list[str] = ()) -> None:
    cols = first + [f"{label} ms" for label, _ in columns(variants)] + \
        [f"{label} / default" for label, _ in columns(variants)] + list(last)
    emit("| " + " | ".join(cols) + " |")
    emit("|" + "---|" * len(cols))


def section_decode(variants, rows, title: str, cache_dtype=torch.bfloat16) -> None:
    emit(f"\n### {title}\n")
    header(["batch", "ctx", "default ms"], variants)
    invariant = functools.partial(varlen_attention, batch_invariant=True)
    for batch, ctx in rows:
        p = Paged([1] * batch, [ctx] * batch, cache_dtype=cache_dtype)
        base = graph_ms(p.run)
        times = []
        for _, values in columns(variants):
            with switches(**values):
                times.append(graph_ms(functools.partial(p.run, fn=invariant)))
        emit(f"| {batch} | {ctx} | {base:.4f} | " + " | ".join(f"{t:.4f}" for t in times)
             + " | " + " | ".join(f"{t / base:.2f}" for t in times) + " |")
        del p
        torch.cuda.empty_cache()


def section_prefill(variants) -> None:
    emit("\n### Prefill, engine path (TFLOP/s on visible FLOPs; ms)\n")
    header(["prompts", "default [pass]", "default ms", "`tl` pass ms"], variants,
           ["invariant TFLOP/s"])
    for label, ql, sl, h, hkv, d, *rest in MAIN_ROWS + WINDOW_ROWS:
        p = Prefill(ql, sl, h, hkv, d, window=rest[0] if rest else -1)
        run, plan = p.engine()
        kind = "gluon" if plan.gluon is not None else "+".join(x.name for x in plan.launches)
        base = eager_ms(run)
        with switches(gluon_prefill=False):
            tl_ms = eager_ms(p.engine()[0])
        times = []
        for _, values in columns(variants):
            with switches(**values):
                times.append(eager_ms(p.engine(batch_invariant=True)[0]))
        flops = p.flops()
        emit(f"| {label} | {flops / base / 1e9:.0f} [{kind}] | {base:.3f} | {tl_ms:.3f} | "
             + " | ".join(f"{t:.3f}" for t in times) + " | "
             + " | ".join(f"{t / base:.2f}" for t in times)
             + f" | {flops / times[0] / 1e9:.0f} |")
        del p
        torch.cuda.empty_cache()


def section_mixed(variants) -> None:
    emit("\n### Mixed batches: chunked prefills + decodes in one step (graph replays)\n")
    header(["batch", "default ms"], variants)
    for n_pre, chunk, ctx_pre, n_dec, ctx_dec in ((4, 512, 2048, 128, 4096),
                                                  (2, 2048, 2048, 64, 8192)):
        p = Prefill([chunk] * n_pre + [1] * n_dec, [ctx_pre] * n_pre + [ctx_dec] * n_dec)
        base = graph_ms(p.engine()[0])
        times = []
        for _, values in columns(variants):
            with switches(**values):
                times.append(graph_ms(p.engine(batch_invariant=True)[0]))
        emit(f"| {n_pre} x {chunk} (ctx {ctx_pre}) + {n_dec} decodes (ctx {ctx_dec}) | "
             f"{base:.3f} | " + " | ".join(f"{t:.3f}" for t in times) + " | "
             + " | ".join(f"{t / base:.2f}" for t in times) + " |")
        del p
        torch.cuda.empty_cache()


def section_generate(requests: int, new_tokens: int) -> None:
    """bench_generate.py's paged generator: each mode's generator built (and its graphs
    captured) once, warmed up, then the best of 3 timed runs."""
    from bench_generate import NO_EOS, make_prompts

    from pagedattn.integrations.hf_generator import PagedGenerator
    from pagedattn.integrations.hf_models import load_smollm2, smollm2_dir, smollm2_shaped_model

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if smollm2_dir() is None:
        model, name = smollm2_shaped_model(torch.bfloat16).cuda(), "SmolLM2-135M shape"
    else:
        model, name = load_smollm2("cuda", torch.bfloat16)[0], "SmolLM2-135M-Instruct"
    prompts = make_prompts(requests, model.config.vocab_size)
    longest = max(map(len, prompts)) + new_tokens
    emit(f"\n### Generation: {name}, bf16, {requests} requests, {new_tokens} new tokens each, "
         "CUDA graphs\n")
    emit("| mode | tok/s | s | time / default |")
    emit("|---|---|---|---|")
    base = None
    # (label, the generator's mode, its model ops kept as they are): in the mode the
    # generator runs its model inside batch_invariant_ops(); the middle row takes that away
    # to show attention's share of the cost.
    modes = (("default", False, True), ("invariant attention", True, False),
             ("invariant attention + model ops", True, True))
    for label, invariant, model_ops in modes:
        gen = PagedGenerator(model, block_size=16,
                             num_blocks=requests * triton.cdiv(longest, 16) + requests,
                             max_num_seqs=requests, max_num_batched_tokens=512,
                             max_model_len=longest, use_cuda_graphs=True,
                             batch_invariant=invariant)
        if not model_ops:
            gen.model_ops = contextlib.nullcontext
        runs = []
        for i in range(4):  # a warm-up (compiles, captures), then 3 timed
            torch.cuda.synchronize()
            start = time.perf_counter()
            gen.generate(prompts, new_tokens, eos_token_id=NO_EOS)
            torch.cuda.synchronize()
            if i:
                runs.append(time.perf_counter() - start)
        seconds = min(runs)
        base = base or seconds
        emit(f"| {label} | {requests * new_tokens / seconds:.0f} | {seconds:.3f} | "
             f"{seconds / base:.2f} |")
        del gen
        torch.cuda.empty_cache()


DECODE_ROWS = [(b, c) for b in (1, 32, 128) for c in (1024, 4096, 8192, 16384, 32768)]
FP8_ROWS = [(1, 8192), (1, 32768), (32, 8192), (32, 16384), (128, 8192)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default="decode,fp8,prefill,mixed,generate")
    ap.add_argument("--variant", action="append", default=[],
                    help="a column of the invariant mode with launch.SWITCHES fields set "
                         "(';' between fields), e.g. invariant_split_keys=512 or "
                         "'invariant_tiles=(128,64,8,3);invariant_fp_fusion=True'")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if os.environ.get("PAGEDATTN_BATCH_INVARIANT", "0") == "1":
        raise SystemExit("unset PAGEDATTN_BATCH_INVARIANT: this benchmark runs each mode itself "
                         "(the variable would put the default rows in the mode too)")
    emit.to_file(args.out)
    torch.manual_seed(0)
    variants = [parse_variant(v) for v in args.variant]
    props = torch.cuda.get_device_properties(0)
    emit(f"device: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}, "
         f"triton {triton.__version__}; invariant mode: split keys "
         f"{launch.SWITCHES.invariant_split_keys}, fused multiply-adds "
         f"{launch.SWITCHES.invariant_fp_fusion}")
    t0 = time.time()
    sections = args.sections.split(",")
    if "decode" in sections:
        section_decode(variants, DECODE_ROWS, "Decode: 32 q / 8 KV heads, head 128, bf16 "
                       "cache, block 16 (graph replays)")
    if "fp8" in sections:
        section_decode(variants, FP8_ROWS, "Decode, e4m3 cache (graph replays)",
                       torch.float8_e4m3fn)
    if "prefill" in sections:
        section_prefill(variants)
    if "mixed" in sections:
        section_mixed(variants)
    if "generate" in sections:
        section_generate(args.requests, args.max_new_tokens)
    emit(f"\n(bench wall time {time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
