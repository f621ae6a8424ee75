"""Decode-pass tile and split sweep on issue 41's rows (graph replays, one run).

    PYTHONPATH=src python tools/sweep_decode.py [--rows B64L16k,B8L128k] [--out FILE]
        [--profile ROW:DTYPE]  (today's decode of one row, six eager calls, for ncu)

Times the decode pass of the Triton provider over a scattered paged cache (32 q / 8 KV heads,
head 128, block 16) for the current heuristic and for fixed (block_n, warps, stages, splits)
variants, bf16 and e4m3 (fp8 q, as the layer runs it), in GB/s of K/V bytes read. A read-only
reference (`torch.sum` over 4 GiB) gives the read ceiling of this device in the same run.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from pathlib import Path

BENCHMARKS = str(Path(__file__).resolve().parents[1] / "benchmarks")
if BENCHMARKS not in sys.path:  # timing, run from any folder
    sys.path.insert(0, BENCHMARKS)

import torch  # noqa: E402
from timing import Emitter, graph_ms  # noqa: E402

from pagedattn.ops.triton import launch  # noqa: E402
from pagedattn.ops.triton.launch import AttnConfig  # noqa: E402
from pagedattn.ops.triton.op_plans import varlen_attention  # noqa: E402

H, HKV, D = 32, 8, 128
DEV = "cuda"
FP8 = torch.float8_e4m3fn
ROWS = {"B1L32k": (1, 32768), "B32L4k": (32, 4096), "B128L1k": (128, 1024),
        "B64L16k": (64, 16384), "B8L128k": (8, 131072)}


def read_ceiling() -> float:
    """Bytes per second of a read-only pass (a sum over 4 GiB of bf16)."""
    x = torch.randn(1 << 31, device=DEV, dtype=torch.bfloat16)
    ms = graph_ms(functools.partial(torch.sum, x, dtype=torch.float32))
    return x.numel() * 2 / (ms * 1e-3)


class Decode:
    def __init__(self, batch: int, ctx: int, cache_dtype: torch.dtype, block_size: int = 16):
        blocks = math.ceil(ctx / block_size)
        n = batch * blocks
        cache = torch.randn(2, n, block_size, HKV, D, device=DEV, dtype=torch.bfloat16)
        cache = cache.to(cache_dtype)
        self.k, self.v = cache[0], cache[1]
        perm = torch.randperm(n, device=DEV, dtype=torch.int32)
        self.table = perm.view(batch, blocks).contiguous()
        q = torch.randn(batch, H, D, device=DEV, dtype=torch.bfloat16)
        self.q = q.to(FP8) if cache_dtype == FP8 else q
        self.out = torch.empty(batch, H, D, device=DEV, dtype=torch.bfloat16)
        self.cu = torch.arange(batch + 1, device=DEV, dtype=torch.int32)
        self.seqused = torch.full((batch,), ctx, device=DEV, dtype=torch.int32)
        one = torch.ones((), device=DEV).expand(batch, HKV)
        self.descale = one if cache_dtype == FP8 else None
        self.batch, self.ctx = batch, ctx
        self.bytes = batch * ctx * HKV * D * 2 * cache.element_size()

    def run(self, config=None, num_splits=0):
        varlen_attention(
            self.q, self.k, self.v, self.out, cu_seqlens_q=self.cu, seqused_k=self.seqused,
            cu_seqlens_k=None, block_table=self.table, max_seqlen_q=1, max_seqlen_k=self.ctx,
            softmax_scale=D ** -0.5, causal=True, window_left=-1, window_right=-1,
            softcap=0.0, alibi_slopes=None, sinks=None, q_descale=self.descale,
            k_descale=self.descale, v_descale=self.descale, softmax_lse=None,
            num_splits=num_splits, config=config)


# Split counts around the ones that fill whole waves: today's heuristic gives 512 unsplit
# programs to B64 L16k, 1.29 waves of three programs an SM (ncu), and 320 to B8 L128k, 0.81.
SPLITS = {"B1L32k": (33, 49, 64), "B32L4k": (1, 2, 3), "B128L1k": (1, 2),
          "B64L16k": (1, 2, 3, 4), "B8L128k": (5, 6, 12, 18)}
# (block_n, warps, stages): today's bf16 (72 KB: three programs an SM) and fp8 tiles, and
# other shared-memory footprints (programs an SM) and bytes in flight.
TILES = ((128, 4, 2), (128, 4, 3), (64, 4, 3), (64, 4, 4), (128, 8, 2))


def variants(name: str):
    """(label, config or None, num_splits) per variant; None = today's heuristic."""
    yield "current", None, 0
    for bn, w, st in TILES:
        for s in SPLITS[name]:
            yield f"{bn},{w},{st} s{s}", AttnConfig(16, bn, w, st, s), s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", default=None, metavar="ROW:DTYPE",
                    help="run today's decode of one row 6 times, eagerly, for ncu")
    args = ap.parse_args()
    if args.profile:
        name, dt = args.profile.split(":")
        d = Decode(*ROWS[name], FP8 if dt == "fp8" else torch.bfloat16)
        for _ in range(6):
            d.run()
        torch.cuda.synchronize()
        return
    emit = Emitter()
    emit.to_file(args.out)
    ceiling = read_ceiling()
    emit(f"read ceiling (sum over 4 GiB bf16): {ceiling / 1e9:.0f} GB/s; "
         f"SMs {launch.sm_count(torch.device(DEV))}")
    emit("| row | cache | variant | ms | GB/s | % read ceiling |")
    emit("|---|---|---|---|---|---|")
    for name in args.rows.split(","):
        batch, ctx = ROWS[name]
        for dt in args.dtypes.split(","):
            d = Decode(batch, ctx, FP8 if dt == "fp8" else torch.bfloat16)
            best = None
            for label, cfg, splits in variants(name):
                try:
                    ms = graph_ms(functools.partial(d.run, cfg, splits))
                except Exception as e:  # a variant that does not compile or fit: say so
                    emit(f"| {name} | {dt} | {label} | fail: {type(e).__name__} "
                         f"{str(e)[:60]} | | |")
                    continue
                gbs = d.bytes / (ms * 1e-3) / 1e9
                best = max(best or (0, ""), (gbs, label))
                emit(f"| {name} | {dt} | {label} | {ms:.4f} | {gbs:.0f} | "
                     f"{100 * gbs * 1e9 / ceiling:.0f}% |")
            emit(f"| {name} | {dt} | **best: {best[1]}** | | {best[0]:.0f} | |")
            d = None
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
