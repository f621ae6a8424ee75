"""The batch-invariant matmul's tiles swept on a model's weight shapes (issue 44): each tile
config checked for row invariance, then timed beside cuBLAS, graph-replayed.

    PYTHONPATH=src python tools/sweep_invariant_matmul.py [--rounds 3] [--out FILE]
    TRITON_INTERPRET=1 PYTHONPATH=src python tools/sweep_invariant_matmul.py --smoke   # CPU

`ops/triton/matmul.py` may choose its tiles from the weight's shape (n, k) but never from the
row count M: one config's rows are the same products in the same order whatever M is, while
two configs may round differently. So each config is checked on every shape for that alone:
rows of an [M, k] call (M from 1 to 512, at several offsets) bit-equal to the same rows of a
512-row call. Then every config and cuBLAS (`torch.mm` outside the mode) are timed on each
shape at M = 32 (a decode step of 32 requests) and M = 512 (a prefill step's tokens),
alternated in rounds. The shapes are SmolLM2-135M's linears (bench_generate.py's model,
bf16): q / o 576 x 576, k / v 192 x 576, gate / up 1536 x 576, down 576 x 1536, the tied LM
head 49152 x 576, each a weight w [n, k] called as x @ w.t() the way F.linear calls mm.
One markdown table a shape, then the best checked config per shape (by the decode time, the
prefill time within 1.25x of that config's best).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if "--smoke" in sys.argv:  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
BENCHMARKS = str(Path(__file__).resolve().parents[1] / "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)

import torch  # noqa: E402
from bench_batch_invariant import switches  # noqa: E402
from timing import Emitter, alternate, eager_ms, graph_ms  # noqa: E402

from pagedattn.ops.triton.matmul import invariant_matmul, matmul_tiles  # noqa: E402

SHAPES = {"q / o": (576, 576), "k / v": (192, 576), "gate / up": (1536, 576),
          "down": (576, 1536), "lm head": (49152, 576)}
ROWS = (32, 512)
# (block_m, block_n, block_k, warps, stages)
CONFIGS = [(64, 64, 32, 4, 3), (64, 32, 64, 4, 4), (64, 64, 64, 4, 4), (64, 32, 128, 4, 3),
           (64, 64, 128, 4, 3), (64, 128, 64, 4, 3), (64, 16, 128, 4, 4),
           (32, 32, 128, 2, 3), (32, 64, 64, 2, 4), (16, 32, 128, 1, 3), (16, 64, 64, 1, 4),
           (16, 16, 256, 1, 3), (128, 64, 64, 8, 3)]
SMOKE_SHAPES = {"small": (24, 40)}
SMOKE_CONFIGS = [(16, 16, 16, 1, 1), (32, 16, 32, 4, 1)]


def check(tiles: tuple, n: int, k: int, device: str, dtype: torch.dtype) -> str | None:
    """None when every row of [M, k] calls equals the same row of one 512-row call."""
    g = torch.Generator().manual_seed(n * 7 + k)
    top = 64 if device == "cpu" else 512
    x = torch.randn(top, k, generator=g).to(dtype).to(device)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype).to(device)
    with switches(invariant_matmul_tiles=tiles):
        full = invariant_matmul(x, w.t())
        for m in (1, 3, 17, 32, 100, 255, 511):
            for at in (0, 5):
                if at + m > top:
                    continue
                part = invariant_matmul(x[at:at + m], w.t())
                if not torch.equal(part, full[at:at + m]):
                    diff = (part.float() - full[at:at + m].float()).abs().max().item()
                    return f"M={m} at row {at}: max |diff| {diff:.3g}"
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny, on the CPU (interpreter)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    emit = Emitter()
    emit.to_file(args.out)
    if args.smoke:
        device, dtype, shapes, configs, rows, rounds = (
            "cpu", torch.float32, SMOKE_SHAPES, SMOKE_CONFIGS, (8,), 1)
        timer = lambda fn: eager_ms(fn, warmup=0, rep=1)  # noqa: E731
    else:
        device, dtype, shapes, configs, rows, rounds = (
            "cuda", torch.bfloat16, SHAPES, CONFIGS, ROWS, args.rounds)
        timer = lambda fn: graph_ms(fn, rep=30)  # noqa: E731
        emit(f"device: {torch.cuda.get_device_name(0)}; today's tiles by shape: "
             + ", ".join(f"{n}x{k} {tuple(matmul_tiles(n, k))}" for n, k in shapes.values()))
    best_lines = ["| shape | cuBLAS ms (M=32 / 512) | best config | its ms | first config's ms |",
                  "|---|---|---|---|---|"]
    for name, (n, k) in shapes.items():
        checks = {t: check(t, n, k, device, dtype) for t in configs}
        for t, broke in checks.items():
            if broke:
                emit(f"{name} {t}: BROKEN: {broke}")
        w = (torch.randn(n, k, device=device) / k ** 0.5).to(dtype)
        times = {}
        for m in rows:
            x = torch.randn(m, k, device=device).to(dtype)
            out = torch.empty(m, n, device=device, dtype=dtype)
            cols = [("cuBLAS", timer, lambda x=x, w=w, out=out: torch.mm(x, w.t(), out=out))]
            for t in configs:
                def call(t=t, x=x, w=w):
                    with switches(invariant_matmul_tiles=t):
                        invariant_matmul(x, w.t())
                cols.append((str(t), timer, call))
            times[m] = alternate(cols, rounds)
        emit(f"\n### {name}: w [{n}, {k}]\n")
        emit("| config | guarantee | " + " | ".join(f"M={m} ms" for m in rows) + " | "
             + " | ".join(f"M={m} / cuBLAS" for m in rows) + " |")
        emit("|---|---|" + "---:|" * (2 * len(rows)))
        emit("| cuBLAS | - | " + " | ".join(f"{times[m]['cuBLAS'][0]:.4f}" for m in rows)
             + " |" + " |" * len(rows))
        for t in configs:
            ms = [times[m][str(t)][0] for m in rows]
            emit(f"| {t} | {'ok' if checks[t] is None else 'BROKEN'} | "
                 + " | ".join(f"{v:.4f}" for v in ms) + " | "
                 + " | ".join(f"{v / times[m]['cuBLAS'][0]:.2f}" for v, m in zip(ms, rows))
                 + " |")
        ok = [t for t in configs if checks[t] is None]
        fastest_prefill = min((times[rows[-1]][str(t)][0] for t in ok), default=float("nan"))
        fit = [t for t in ok if times[rows[-1]][str(t)][0] <= 1.25 * fastest_prefill]
        if fit:
            best = min(fit, key=lambda t: times[rows[0]][str(t)][0])
            first = configs[0]  # 64 x 64 x 32: the fixed tiles before matmul_tiles
            best_lines.append(
                f"| {name} | " + " / ".join(f"{times[m]['cuBLAS'][0]:.4f}" for m in rows)
                + f" | {best} | " + " / ".join(f"{times[m][str(best)][0]:.4f}" for m in rows)
                + " | " + " / ".join(f"{times[m][str(first)][0]:.4f}" for m in rows) + " |")
    emit("")
    for line in best_lines:
        emit(line)


if __name__ == "__main__":
    main()
