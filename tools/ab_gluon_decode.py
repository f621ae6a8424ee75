"""The Gluon decode pass (`SWITCHES.gluon_decode`) beside the `tl` decode pass on issue 41's
rows, in one process on an sm_90 GPU.

    PYTHONPATH=src python tools/ab_gluon_decode.py [--rounds 5] [--rows B64L16k,B8L128k]
        [--dtypes bf16,fp8] [--gluon-splits 2,8] [--out FILE]

Each row (32 q / 8 KV heads, head 128, block 16, shuffled pages) is planned through
`plan_attention` with the switch off and on (it is read when a plan is made), and on with
two programs a SM (`SWITCHES.gluon_decode_per_sm = 2`: half-size rings); the plans'
outputs are checked against the float64 oracle on SAMPLED_SEQS sequences (every head; bf16
bound 2e-2), then each plan's run is captured in a CUDA graph and the graphs are replayed in
alternated rounds (order rotated each round), medians reported in GB/s of K/V bytes read
(the cache's bytes: fp8 counts one byte an element) and each pass's speed-up over the `tl`
pass (its time / theirs). --gluon-splits adds the Gluon pass at forced split counts. fp8: an
e4m3 q over an e4m3 cache (descales 1), as the layer runs it. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
for folder in (HERE.parent / "benchmarks", HERE.parent / "tests"):  # timing; reference
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

import torch  # noqa: E402
from timing import Emitter, capture_graph, replay_rounds  # noqa: E402

import reference  # noqa: E402
from pagedattn.ops.triton import launch  # noqa: E402
from pagedattn.ops.triton.attention_plan import plan_attention  # noqa: E402

H, HKV, D, PAGE = 32, 8, 128, 16
FP8 = torch.float8_e4m3fn
ROWS = {"B1L32k": (1, 32768), "B32L4k": (32, 4096), "B128L1k": (128, 1024),
        "B64L16k": (64, 16384), "B8L128k": (8, 131072)}
SAMPLED_SEQS = 2
TOLERANCE = 2e-2  # max abs error of a bf16 output (the GPU tests' bf16 bound)


class Batch:
    """One decode step: `batch` requests of `ctx` keys over a shuffled paged cache."""

    def __init__(self, batch: int, ctx: int, fp8: bool):
        blocks = -(-ctx // PAGE)
        g = torch.Generator(device="cuda").manual_seed(0)
        kv = torch.randn(2, batch * blocks, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16,
                         generator=g)
        kv = kv.to(FP8) if fp8 else kv
        self.k, self.v = kv[0], kv[1]
        self.table = torch.randperm(batch * blocks, device="cuda", dtype=torch.int32,
                                    generator=g).view(batch, blocks)
        q = torch.randn(batch, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
        self.q = q.to(FP8) if fp8 else q
        self.out = torch.empty(batch, H, D, device="cuda", dtype=torch.bfloat16)
        self.cu = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
        self.lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
        self.ones = torch.ones(batch, HKV, device="cuda") if fp8 else None
        self.batch, self.ctx, self.fp8 = batch, ctx, fp8
        self.bytes = batch * ctx * HKV * D * 2 * kv.element_size()
        self._expected: dict = {}

    def plan(self, gluon: bool, per_sm: int = 1, num_splits: int = 0):
        switches = launch.SWITCHES
        old = (switches.gluon_decode, switches.gluon_decode_per_sm)
        switches.gluon_decode, switches.gluon_decode_per_sm = gluon, per_sm
        try:
            plan = plan_attention(
                device=self.q.device, cu_seqlens_q=self.cu, seqused_k=self.lens,
                cu_seqlens_k=None, block_table=self.table, batch=self.batch,
                total_q=self.batch, max_seqlen_q=1, max_seqlen_k=self.ctx, num_heads=H,
                num_kv_heads=HKV, head_size=D, head_size_v=D, page_size=PAGE,
                q_dtype=self.q.dtype, kv_dtype=self.k.dtype, out_dtype=torch.bfloat16,
                softmax_scale=D ** -0.5, causal=True, window_left=-1, window_right=-1,
                softcap=0.0, use_alibi=False, use_sinks=False, use_q_descale=self.fp8,
                use_kv_descale=self.fp8, write_lse=False, num_splits=num_splits)
        finally:
            switches.gluon_decode, switches.gluon_decode_per_sm = old
        if gluon and plan.gluon_decode is None:
            raise RuntimeError("the Gluon decode pass does not serve this row")
        return plan

    def runner(self, plan):
        ones = self.ones

        def run():
            plan.run(self.q, self.k, self.v, self.out, None, None, None, ones, ones, ones)
        return run

    def expected(self, s: int) -> torch.Tensor:
        """The oracle's output of request s (float64 [1, H, D]), computed once."""
        if s not in self._expected:
            pages = self.table[s].long()
            # pages gathered as bytes (indexing fp8 tensors is not every build's)
            k = _bytes(self.k)[pages].view(self.k.dtype).reshape(-1, HKV, D)[:self.ctx]
            v = _bytes(self.v)[pages].view(self.v.dtype).reshape(-1, HKV, D)[:self.ctx]
            self._expected[s], _ = reference.attend_one_sequence(
                self.q[s:s + 1].float(), k.float(), v.float(), scale=D ** -0.5)
        return self._expected[s]

    def error(self, run) -> float:
        """Max abs error of `run`'s output (poisoned first) on the sampled sequences."""
        self.out.fill_(float("nan"))
        run()
        torch.cuda.synchronize()
        worst = 0.0
        for s in sorted({0, self.batch - 1})[:SAMPLED_SEQS]:
            got = self.out[s:s + 1].float().cpu().double()
            want = self.expected(s)
            worst = max(worst, float((got - want).abs().max()))  # NaN: never written
            if got.isnan().any():
                worst = float("nan")
        return worst


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """x's elements as raw integers of their width (int16 for 16-bit, uint8 for fp8)."""
    return x.view(torch.uint8 if x.element_size() == 1 else torch.int16)


def replays_for(nbytes: int) -> int:
    """Replays a round: about 20 ms of work at 4 TB/s, 5 to 200."""
    return max(5, min(200, int(20e-3 * 4e12 / max(nbytes, 1))))


def variants(gluon_splits: list[int]) -> list[tuple[str, bool, int, int]]:
    """(label, Gluon, programs a SM, forced splits or 0 for the plan's) of each column."""
    out = [("`tl`", False, 1, 0), ("Gluon", True, 1, 0), ("Gluon 2/SM", True, 2, 0)]
    for n in gluon_splits:
        out += [(f"Gluon s{n}", True, 1, n), (f"Gluon 2/SM s{n}", True, 2, n)]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--gluon-splits", default="",
                    help="comma-separated split counts the Gluon pass is also timed at")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    emit = Emitter()
    emit.to_file(args.out)
    began = time.time()
    columns = variants([int(n) for n in args.gluon_splits.split(",") if n])
    emit("| row | cache | pass | splits | GB/s | / `tl` | max err |")
    emit("|---|---|---|---:|---:|---:|---:|")
    ok = True
    for name in args.rows.split(","):
        for dt in args.dtypes.split(","):
            b = Batch(*ROWS[name], fp8=dt == "fp8")
            graphs, errors, splits, failed = {}, {}, {}, {}
            for label, gluon, per_sm, forced in columns:
                try:
                    plan = b.plan(gluon, per_sm, forced)
                    run = b.runner(plan)
                    errors[label] = b.error(run)
                    graphs[label] = capture_graph(run)
                    splits[label] = plan_splits(plan)
                except Exception as e:  # noqa: BLE001 - a row of the table, not a library path
                    settle()
                    failed[label] = f"failed: {type(e).__name__}: {str(e)[:100]}"
            ms = replay_rounds(graphs, args.rounds, replays_for(b.bytes)) if graphs else {}
            base = ms.get("`tl`")
            for label, *_ in columns:
                if label in failed:
                    ok = False
                    emit(f"| {name} | {dt} | {label} | | {failed[label]} | | |")
                    continue
                gbs = b.bytes / (ms[label] * 1e-3) / 1e9
                ratio = f"{base / ms[label]:.3f}" if base else ""
                bad = not errors[label] <= TOLERANCE  # NaN too
                ok &= not bad
                emit(f"| {name} | {dt} | {label} | {splits[label]} | {gbs:.0f} | {ratio} | "
                     f"{errors[label]:.1e}{' **over the bound**' if bad else ''} |")
            del b, graphs
            torch.cuda.empty_cache()
    emit(f"\n{args.rounds} rounds, {time.time() - began:.0f} s")
    return 0 if ok else 1


def settle() -> None:
    """Wait for queued work after a failure (a failed capture may leave some); a kernel
    fault raises again here, and the rows after it will fail by name."""
    try:
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - the failure is reported by the caller
        pass


def plan_splits(plan) -> int:
    """The decode splits of a plan: its Gluon launch's grid, or its `tl` decode launch's."""
    if plan.gluon_decode is not None:
        return plan.gluon_decode.grid[2]
    return next(p.grid[2] for p in plan.launches if p.name == "decode")


if __name__ == "__main__":
    sys.exit(main())
