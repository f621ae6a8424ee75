"""End-to-end generation throughput on the same prompts, side by side:

- pagedattn: the paged generator (continuous batching, chunked prefill, pagedattn attention),
  on CUDA with its steps replayed from CUDA graphs and, for comparison, all eager;
- transformers `generate`: all prompts in one left-padded batch (sdpa attention);
- transformers `generate_batch`: its own continuous batching, where the installed version has it.

Greedy, a fixed number of new tokens (EOS ignored) so every engine does the same work.
Tokens/s = generated tokens / wall time (model already loaded and warmed up). For the paged
generator it also prints the host ms per step, measured inside the run: each step's wall time
less its wait for the device at the step's one sync (`StepStats.host_seconds`), the mean over
decode steps and over all steps.

    python benchmarks/bench_generate.py                      # SmolLM2-135M, default device
    python benchmarks/bench_generate.py --requests 32 --max-new-tokens 128 --dtype bf16
    python benchmarks/bench_generate.py --repeat 3 --no-generate-batch   # best of 3 each
    python benchmarks/bench_generate.py --requests 1 32 64 256 512 --max-new-tokens 128 \
        --no-generate-batch --out generate.md    # one table over batch sizes

With several `--requests`, each count runs in turn and a markdown table of all of them ends
the output (and goes to `--out`).

The paged generator is built once per variant and reused: CUDA graphs are captured during the
warm-up run (a start-up cost, as in vLLM), and the timed run replays them.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import dataclass

import torch
from timing import markdown_row, markdown_table, ratio

from pagedattn.integrations.hf_generator import PagedGenerator
from pagedattn.integrations.hf_models import (
    load_smollm2,
    smollm2_dir,
    smollm2_shaped_model,
    tiny_model,
)
from pagedattn.integrations.transformers import attn_implementation_ctx

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
NO_EOS = -1  # a token id that never occurs: every request runs max_new_tokens


def make_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompt lengths spread over 16..300 tokens, as a chat workload's would be."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(16, 300, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (n_,), generator=g).tolist() for n_ in lens]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: torch.device) -> tuple[float, object]:
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - start, out


_generators: dict[tuple[int, bool], PagedGenerator] = {}


@dataclass
class PagedRun:
    """A paged generator's tokens and what its steps took."""

    tokens: list[list[int]]
    steps: int
    decode_host_ms: float  # mean host ms of the steps with no prompt tokens
    host_ms: float  # mean host ms of all steps
    wall_ms: float  # mean wall ms of all steps
    replayed: int  # steps replayed from CUDA graphs


def run_paged(model, prompts, max_new, args, use_cuda_graphs: bool) -> PagedRun:
    longest = max(map(len, prompts)) + max_new
    key = (len(prompts), use_cuda_graphs)
    if key not in _generators:
        seqs = args.max_num_seqs or len(prompts)
        _generators[key] = PagedGenerator(
            model, block_size=16, num_blocks=seqs * -(-longest // 16) + seqs,
            max_num_seqs=seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=longest, use_cuda_graphs=use_cuda_graphs)
    gen = _generators[key]
    gen.stats.clear()
    tokens = gen.generate(prompts, max_new, eos_token_id=NO_EOS)
    stats = gen.stats
    decodes = [s.host_seconds for s in stats if not s.num_prefill_tokens] or [math.nan]
    return PagedRun(tokens, len(stats), 1e3 * sum(decodes) / len(decodes),
                    1e3 * sum(s.host_seconds for s in stats) / len(stats),
                    1e3 * sum(s.seconds for s in stats) / len(stats),
                    sum(s.cuda_graph for s in stats))


def run_hf_generate(model, prompts, max_new, pad_id: int) -> list[list[int]]:
    device = next(model.parameters()).device
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as decoder-only generation needs
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with attn_implementation_ctx(model, "sdpa"):
        out = model.generate(ids.to(device), attention_mask=mask.to(device), do_sample=False,
                             max_new_tokens=max_new, min_new_tokens=max_new,
                             pad_token_id=pad_id)
    return out[:, width:].tolist()


def run_hf_generate_batch(model, prompts, max_new) -> list[list[int]]:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=NO_EOS,
                              pad_token_id=0)
    with attn_implementation_ctx(model, "sdpa"):
        out = model.generate_batch(prompts, generation_config=config, progress_bar=False)
    return [out[f"req_{i}"].generated_tokens for i in range(len(prompts))]


PAGED = "pagedattn (continuous batching)"
PAGED_EAGER = "pagedattn (continuous batching), eager steps"
HF = "transformers generate (padded batch)"
HF_BATCH = "transformers generate_batch (continuous batching)"


def run_engines(model, device, num_requests: int, args) -> dict:
    """Every engine on `num_requests` prompts, printed as it goes: {label: (tok/s, result)}."""
    prompts = make_prompts(num_requests, model.config.vocab_size)
    new = args.max_new_tokens
    total = len(prompts) * new
    print(f"{len(prompts)} requests, {sum(map(len, prompts))} prompt tokens, {new} new each")
    graphs = device.type == "cuda" and not args.no_cuda_graphs
    paged = PAGED + (", CUDA graphs" if graphs else "")
    engines = {paged: lambda: run_paged(model, prompts, new, args, graphs)}
    if graphs:
        engines[PAGED_EAGER] = lambda: run_paged(model, prompts, new, args, False)
    engines[HF] = lambda: run_hf_generate(model, prompts, new, model.config.pad_token_id or 0)
    if hasattr(model, "generate_batch") and not args.no_generate_batch:
        engines[HF_BATCH] = lambda: run_hf_generate_batch(model, prompts, new)
    results = {}
    for label, fn in engines.items():
        try:
            timed(fn, device)  # warm-up: Triton compiles, allocators fill, caches load
            seconds, out = min((timed(fn, device) for _ in range(args.repeat)),
                               key=lambda r: r[0])
        except Exception as e:  # a missing feature of one engine must not hide the others
            print(f"  {label}: failed: {type(e).__name__}: {e}")
            continue
        results[label] = (total / seconds, out)
        host = (f"; host ms/step: {out.decode_host_ms:.3f} decode, {out.host_ms:.3f} all "
                f"({out.steps} steps, {out.wall_ms:.2f} ms wall each)"
                if isinstance(out, PagedRun) else "")
        print(f"  {label:52s} {total / seconds:10.1f} tok/s  ({seconds:.2f} s){host}")
    if graphs and (len(prompts), True) in _generators and paged in results:
        gen = _generators[len(prompts), True]
        print(f"  CUDA graphs: {results[paged][1].replayed}/{results[paged][1].steps} steps "
              f"replayed, buckets {sorted(gen.graphs.graphs, key=str) if gen.graphs else []}, "
              f"off: {gen.cuda_graphs_off or gen.graphs.disabled_reason}")
    tokens_paged = results[paged][1].tokens if paged in results else None
    for label, (_, out) in results.items():
        tokens = out.tokens if isinstance(out, PagedRun) else out
        if tokens_paged is not None and label != paged:
            same = sum(a == b for a, b in zip(tokens_paged, tokens))
            print(f"  same tokens as {paged}: {label}: {same}/{len(prompts)} requests")
    return results


def table(rows: dict[int, dict]) -> list[str]:
    """One markdown row per request count: the paged generator (graphs, eager) beside
    transformers' generate, tok/s and host ms per step."""
    def cell(results, label, field=None):
        if label not in results:
            return math.nan
        speed, out = results[label]
        return speed if field is None else getattr(out, field)

    lines = markdown_table(("requests", "pagedattn tok/s", "host ms / decode step",
                            "host ms / step", "wall ms / step", "eager steps tok/s",
                            "eager host ms / decode step", "transformers `generate` tok/s",
                            "vs `generate`", "same tokens, graphs vs eager"))
    for n, results in rows.items():
        paged = next((label for label in results if label.startswith(PAGED)
                      and label != PAGED_EAGER), None)
        same = "n/a"
        if paged and PAGED_EAGER in results:
            a, b = results[paged][1].tokens, results[PAGED_EAGER][1].tokens
            same = f"{sum(x == y for x, y in zip(a, b))}/{n}"
        speed = cell(results, paged)
        lines.append(markdown_row((
            n, speed, cell(results, paged, "decode_host_ms"), cell(results, paged, "host_ms"),
            cell(results, paged, "wall_ms"), cell(results, PAGED_EAGER),
            cell(results, PAGED_EAGER, "decode_host_ms"), cell(results, HF),
            ratio(speed, cell(results, HF)), same), digits=2))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[16],
                        help="one or more request counts; several end with one table")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="default: every request at once, as transformers' padded batch")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--dtype", choices=list(DTYPES), default=None,
                        help="default: bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--tiny", action="store_true", help="tiny random Llama instead")
    parser.add_argument("--random-weights", action="store_true",
                        help="SmolLM2-135M's architecture with random weights (same speed)")
    parser.add_argument("--no-cuda-graphs", action="store_true",
                        help="on CUDA, run only the eager paged generator")
    parser.add_argument("--no-generate-batch", action="store_true",
                        help="skip transformers' generate_batch (slow)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="timed runs per engine after the warm-up; the best is printed")
    parser.add_argument("--out", default=None, help="write the markdown table here too")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = DTYPES[args.dtype] if args.dtype else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.tiny:
        model, name = tiny_model("llama", dtype=dtype).to(device), "tiny random Llama"
    elif args.random_weights or smollm2_dir() is None:
        model = smollm2_shaped_model(dtype).to(device)
        name = "SmolLM2-135M architecture, random weights"
    else:
        model, _ = load_smollm2(device, dtype)
        name = "SmolLM2-135M-Instruct"
    where = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    title = (f"{name}, {str(dtype).removeprefix('torch.')} on {where}; {args.max_new_tokens} "
             f"new tokens a request, max_num_batched_tokens {args.max_num_batched_tokens}"
             + (f", max_num_seqs {args.max_num_seqs}" if args.max_num_seqs else ""))
    print(title)
    rows = {n: run_engines(model, device, n, args) for n in args.requests}
    if len(rows) > 1 or args.out:
        lines = [title, ""] + table(rows)
        print("\n".join(lines))
        if args.out:
            with open(args.out, "w") as f:
                f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
