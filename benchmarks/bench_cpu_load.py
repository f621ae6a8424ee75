"""CPU speed on a quiet machine and with another process spinning on one core, in one run.

Each figure is measured twice: with the machine as it is (run it on a quiet one), then with a
`while True: pass` process pinned to one of this process's cores, as a laptop doing other
work would have. The figures (issue 43's targets on 2 cores in brackets):

- `pagedattn demo` (a fresh process, as a user runs it, `--no-check`): its generated tokens/s
  (>= 25 quiet, >= 12 busy);
- eager generation of SmolLM2 (fp32) in this process: the paged generator against
  transformers' `generate` on the same prompts (`benchmarks/bench_generate.py`'s: 16 requests,
  prompts of 16..300 tokens, 32 new tokens each, EOS ignored), transformers both with torch's
  default threads and with one thread; the ratio is against the faster (>= 1.3x);
- with `--tests`, the test suite's wall time, `python -m pytest -q tests` (<= 5 min quiet,
  <= 7 busy).

    python benchmarks/bench_cpu_load.py                 # demo and generation, ~8 min on 2 cores
    python benchmarks/bench_cpu_load.py --tests         # and the test suite, twice (~15 min)
    python benchmarks/bench_cpu_load.py --random-weights   # without the weights package
    python benchmarks/bench_cpu_load.py --no-demo --quiet-only   # generation, quiet (~1 min)
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch
from bench_generate import NO_EOS, make_prompts, run_hf_generate

from pagedattn.cpu_threads import torch_threads, usable_cores
from pagedattn.integrations.hf_generator import PagedGenerator
from pagedattn.integrations.hf_models import load_smollm2, smollm2_dir, smollm2_shaped_model

ROOT = Path(__file__).resolve().parent.parent
TARGETS = {  # (quiet, busy); None: no target
    "demo tok/s": (25.0, 12.0),
    "ratio": (1.3, 1.3),
    "tests s": (300.0, 420.0),
}


class Spinner:
    """A `while True: pass` process pinned to one of this process's cores, while in use."""

    def __init__(self) -> None:
        self.core = max(os.sched_getaffinity(0))

    def __enter__(self) -> Spinner:
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        os.sched_setaffinity(self.proc.pid, {self.core})
        time.sleep(1.0)  # let the scheduler and the load figures see it
        return self

    def __exit__(self, *exc) -> None:
        self.proc.kill()
        self.proc.wait()


def demo_tokens_per_second(random_weights: bool) -> tuple[float, str]:
    """`pagedattn demo --no-check` in a fresh process: (tok/s, its CPU-threads line)."""
    model = ["--model", "random-smollm2"] if random_weights else []
    done = subprocess.run([sys.executable, "-m", "pagedattn.cli", "demo", "--no-check", *model],
                          cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"the demo failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    rate = re.search(r"throughput\s+([\d.]+) generated tokens/s", done.stdout)
    threads = re.search(r"CPU threads (.*)", done.stdout)
    return float(rate.group(1)), threads.group(1) if threads else "?"


def timed(fn, warm_up) -> float:
    warm_up()  # a short run: allocators fill, the paged generator's thread policy measures
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def generation(model, prompts: list[list[int]], new: int) -> dict[str, float]:
    """Tokens/s of each engine on the same prompts, in this process."""
    total = len(prompts) * new
    longest = max(map(len, prompts)) + new
    gen = PagedGenerator(model, block_size=16, num_blocks=len(prompts) * -(-longest // 16) + 16,
                         max_num_seqs=len(prompts), max_num_batched_tokens=512,
                         max_model_len=longest)

    def paged(ps=prompts, n=new):
        gen.stats.clear()
        gen.generate(ps, n, eos_token_id=NO_EOS)

    rates = {"pagedattn": total / timed(paged, lambda: paged(prompts[:4], 4))}
    threads = sorted({s.threads for s in gen.stats})
    pad = model.config.pad_token_id or 0

    def hf(ps=prompts, n=new):
        run_hf_generate(model, ps, n, pad)

    rates["transformers (default threads)"] = total / timed(hf, lambda: hf(prompts[:4], 4))
    with torch_threads(1):
        rates["transformers (1 thread)"] = total / timed(hf, lambda: hf(prompts[:4], 4))
    rates["pagedattn threads"] = threads[-1] if threads else 0
    return rates


def test_suite_seconds() -> float:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "tests"], cwd=ROOT,
                          capture_output=True, text=True, timeout=3600)
    seconds = time.perf_counter() - start
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "(no output)"
    print(f"    tests: {last}")
    return seconds


def measure(args, model, prompts) -> dict[str, float]:
    row: dict[str, float] = {}
    if not args.no_demo:
        row["demo tok/s"], threads = demo_tokens_per_second(args.random_weights)
        print(f"    demo: {row['demo tok/s']:.1f} tok/s, CPU threads {threads}")
    rates = generation(model, prompts, args.max_new_tokens)
    for name, rate in rates.items():
        row[name] = rate
    best_hf = max(rates["transformers (default threads)"], rates["transformers (1 thread)"])
    row["ratio"] = rates["pagedattn"] / best_hf
    print("    generation: " + ", ".join(f"{k} {v:.1f}" for k, v in rates.items()))
    if args.tests:
        row["tests s"] = test_suite_seconds()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tests", action="store_true", help="also time the test suite")
    parser.add_argument("--random-weights", action="store_true",
                        help="SmolLM2's architecture with random weights (same speed)")
    parser.add_argument("--requests", type=int, default=16,
                        help="generation requests (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=32,
                        help="new tokens per request (default: %(default)s)")
    parser.add_argument("--no-demo", action="store_true",
                        help="skip `pagedattn demo` (generation only, while iterating)")
    parser.add_argument("--quiet-only", action="store_true",
                        help="skip the busy half (no spinning process)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if os.environ.get("OMP_NUM_THREADS"):
        print(f"note: OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} fixes the threads: the "
              "thread policy is not what is measured")
    if args.random_weights or smollm2_dir() is None:
        args.random_weights = True
        model, name = smollm2_shaped_model(torch.float32), "SmolLM2-135M architecture, random"
    else:
        model, name = load_smollm2("cpu", torch.float32)[0], "SmolLM2-135M-Instruct"
    prompts = make_prompts(args.requests, model.config.vocab_size)
    print(f"{name}, fp32, torch {torch.__version__}, {usable_cores()} usable cores "
          f"({os.cpu_count()} on the machine), load average {os.getloadavg()[0]:.2f} at start")
    rows = {}
    print("quiet (the machine as it is)")
    rows["quiet"] = measure(args, model, prompts)
    if not args.quiet_only:
        spinner = Spinner()
        print(f"busy (a spinning process pinned to core {spinner.core})")
        with spinner:
            rows["busy"] = measure(args, model, prompts)
    print()
    loads = list(rows)
    names = [n for n in rows["quiet"] if n != "pagedattn threads"]
    print(f"{'':40s}" + "".join(f" {k:>10s}" for k in loads) + "   target (quiet / busy)")
    for n in names:
        target = TARGETS.get(n)
        verdict = ""
        if target:
            better = (lambda v, t: v <= t) if n == "tests s" else (lambda v, t: v >= t)
            ok = all(better(rows[k][n], t) for k, t in zip(loads, target))
            sign = "<=" if n == "tests s" else ">="
            verdict = f"   {sign} {target[0]:g} / {target[1]:g}: {'met' if ok else 'MISSED'}"
        print(f"{n:40s}" + "".join(f" {rows[k][n]:10.2f}" for k in loads) + verdict)
    print(f"{'pagedattn threads (last step)':40s}"
          + "".join(f" {rows[k]['pagedattn threads']:10.0f}" for k in loads))


if __name__ == "__main__":
    main()
