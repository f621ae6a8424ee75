"""The Gluon decode pass (`SWITCHES.gluon_decode`) beside the `tl` decode pass on issue 41's
rows, in one process on an sm_90 GPU.

    PYTHONPATH=src python tools/ab_gluon_decode.py [--rounds 5] [--rows B64L16k,B8L128k]
        [--dtypes bf16,fp8] [--columns tl,gluon1,gluon2,pers1,pers2,pers2pv8,pers2lazy,...]
        [--gluon-splits 2,8] [--persistent-splits 4,32] [--timer single|unrolled]
        [--out FILE]

Each row (32 q / 8 KV heads, head 128, block 16, shuffled pages) is planned through
`plan_attention` with the switch off and on (it is read when a plan is made), on with one
and two programs a SM (`SWITCHES.gluon_decode_per_sm`: two have half-size rings), and in
the persistent form at both (`SWITCHES.gluon_decode_persistent`: programs that walk units,
with that form's split count; --columns picks among these); the plans' outputs are
checked against the float64 oracle on SAMPLED_SEQS sequences (every head; bf16 bound
2e-2), then each plan's run is captured in a CUDA graph and the graphs are replayed in
alternated rounds (order rotated each round), medians reported in GB/s of K/V bytes read
(the cache's bytes: fp8 counts one byte an element) and each pass's speed-up over the `tl`
pass (its time / theirs). --timer unrolled times each column instead as the decode peers
table does, by `do_bench_cudagraph` (one graph of many unrolled calls: the timer under which
the fp8 kernel ran slowest, KERNEL_NOTES v41), the columns alternated in rounds, medians.
The pv8 columns run an fp8 cache's P V as an fp8 wgmma (`SWITCHES.gluon_decode_fp8_pv`;
over a 16-bit cache they are their base column; their bound adds 2^-4 of the oracle's
weighted mean of |V|, DESIGN.md); the lazy columns skip O's rescale in warps whose rows
kept their max (`SWITCHES.gluon_decode_max_slack` 0; slack8: 8, a 16-bit P V's).
--gluon-splits adds the Gluon pass at forced split counts (one and two a SM),
--persistent-splits the persistent form's (its columns chosen). fp8: an
e4m3 q over an e4m3 cache (descales 1), as the layer runs it. Prints a markdown table; the
splits column of a persistent plan also gives its programs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
for folder in (HERE.parent / "benchmarks", HERE.parent / "tests"):  # timing; reference
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

import torch  # noqa: E402
from timing import Emitter, capture_graph, graph_ms, replay_rounds  # noqa: E402

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

    def plan(self, gluon: bool, per_sm: int = 1, num_splits: int = 0,
             persistent: bool = False, fp8_pv: bool = False, slack: int = -1):
        switches = launch.SWITCHES
        names = ("gluon_decode", "gluon_decode_per_sm", "gluon_decode_persistent",
                 "gluon_decode_fp8_pv", "gluon_decode_max_slack")
        old = [getattr(switches, n) for n in names]
        for n, value in zip(names, (gluon, per_sm, persistent, fp8_pv, slack), strict=True):
            setattr(switches, n, value)
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
            for n, value in zip(names, old, strict=True):
                setattr(switches, n, value)
        if gluon and plan.gluon_decode is None:
            raise RuntimeError("the Gluon decode pass does not serve this row")
        return plan

    def runner(self, plan):
        ones = self.ones

        def run():
            plan.run(self.q, self.k, self.v, self.out, None, None, None, ones, ones, ones)
        return run

    def expected(self, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The oracle's outputs of request s over V and over |V| (float64 [1, H, D] each),
        computed once."""
        if s not in self._expected:
            pages = self.table[s].long()
            # pages gathered as bytes (indexing fp8 tensors is not every build's)
            k = _bytes(self.k)[pages].view(self.k.dtype).reshape(-1, HKV, D)[:self.ctx]
            v = _bytes(self.v)[pages].view(self.v.dtype).reshape(-1, HKV, D)[:self.ctx]
            self._expected[s] = tuple(reference.attend_one_sequence(
                self.q[s:s + 1].float(), k.float(), x, scale=D ** -0.5)[0]
                for x in (v.float(), v.float().abs()))
        return self._expected[s]

    def error(self, run, fp8_p: bool = False) -> tuple[float, bool]:
        """(max abs error of `run`'s output, poisoned first, on the sampled sequences; whether
        every output is within the bound: TOLERANCE, plus with an fp8 P (`fp8_p`) 2^-4 of
        the oracle's weighted mean of |V|). NaN (never written) is out of bounds."""
        self.out.fill_(float("nan"))
        run()
        torch.cuda.synchronize()
        worst, within = 0.0, True
        for s in sorted({0, self.batch - 1})[:SAMPLED_SEQS]:
            got = self.out[s:s + 1].float().cpu().double()
            want, mean_abs_v = self.expected(s)
            err = (got - want).abs()
            within &= bool((err <= TOLERANCE + (2.0 ** -4 * mean_abs_v if fp8_p else 0)).all())
            worst = max(worst, float(err.max()))  # NaN: never written
            if got.isnan().any():
                worst = float("nan")
        return worst, within


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """x's elements as raw integers of their width (int16 for 16-bit, uint8 for fp8)."""
    return x.view(torch.uint8 if x.element_size() == 1 else torch.int16)


def replays_for(nbytes: int) -> int:
    """Replays a round: about 20 ms of work at 4 TB/s, 5 to 200."""
    return max(5, min(200, int(20e-3 * 4e12 / max(nbytes, 1))))


# --columns: name -> (label, Gluon, programs a SM, persistent, fp8 P V, max slack)
COLUMNS = {"tl": ("`tl`", False, 1, False, False, -1),
           "gluon1": ("Gluon", True, 1, False, False, -1),
           "gluon2": ("Gluon 2/SM", True, 2, False, False, -1),
           "pers1": ("Persistent", True, 1, True, False, -1),
           "pers2": ("Persistent 2/SM", True, 2, True, False, -1),
           "gluon2pv8": ("Gluon 2/SM, fp8 P V", True, 2, False, True, -1),
           "pers2pv8": ("Persistent 2/SM, fp8 P V", True, 2, True, True, -1),
           "pers2lazy": ("Persistent 2/SM, lazy", True, 2, True, False, 0),
           "pers2slack8": ("Persistent 2/SM, slack 8", True, 2, True, False, 8),
           "pers2pv8lazy": ("Persistent 2/SM, fp8 P V, lazy", True, 2, True, True, 0)}
DEFAULT_COLUMNS = "tl,gluon1,gluon2,pers1,pers2"


def variants(gluon_splits: list[int], persistent_splits: list[int] = (),
             names: str = DEFAULT_COLUMNS) -> list[tuple]:
    """(label, Gluon, programs a SM, forced splits or 0 for the plan's, persistent, fp8 P V,
    max slack) of each column: the `names` columns, then each chosen Gluon column at the
    forced counts (the grid's at gluon_splits, the persistent form's at persistent_splits).
    `tl` comes first (the ratios' base) whether named or not."""
    chosen = [n for n in names.split(",") if n]
    unknown = [n for n in chosen if n not in COLUMNS]
    if unknown:
        raise ValueError(f"--columns {unknown}: choose among {list(COLUMNS)}")
    out = [(*COLUMNS["tl"][:3], 0, False, False, -1)]
    for name in chosen:
        label, gluon, per_sm, persistent, fp8_pv, slack = COLUMNS[name]
        if gluon:
            out.append((label, gluon, per_sm, 0, persistent, fp8_pv, slack))
    for name in chosen:
        label, gluon, per_sm, persistent, fp8_pv, slack = COLUMNS[name]
        for n in (persistent_splits if persistent else gluon_splits) if gluon else ():
            out.append((f"{label} s{n}", gluon, per_sm, n, persistent, fp8_pv, slack))
    return out


def unrolled_rounds(runs: dict, rounds: int) -> dict[str, float]:
    """{name: median ms per call} of `runs` ({name: callable}) by `do_bench_cudagraph` (the
    decode peers table's timer), one timing of each a round, the order rotated by one from
    the round before."""
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(graph_ms(runs[name]))
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--columns", default=DEFAULT_COLUMNS,
                    help=f"comma-separated columns among {','.join(COLUMNS)}")
    ap.add_argument("--gluon-splits", default="",
                    help="comma-separated split counts the Gluon pass is also timed at")
    ap.add_argument("--persistent-splits", default="",
                    help="comma-separated split counts its persistent form is also timed at")
    ap.add_argument("--timer", choices=("single", "unrolled"), default="single",
                    help="single: a one-call graph replayed between events; unrolled: "
                         "do_bench_cudagraph (the decode peers table's)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    emit = Emitter()
    emit.to_file(args.out)
    began = time.time()
    columns = variants([int(n) for n in args.gluon_splits.split(",") if n],
                       [int(n) for n in args.persistent_splits.split(",") if n], args.columns)
    emit("| row | cache | pass | splits | GB/s | / `tl` | max err |")
    emit("|---|---|---|---:|---:|---:|---:|")
    ok = True
    for name in args.rows.split(","):
        for dt in args.dtypes.split(","):
            b = Batch(*ROWS[name], fp8=dt == "fp8")
            graphs, runs, errors, splits, failed = {}, {}, {}, {}, {}
            for label, gluon, per_sm, forced, persistent, fp8_pv, slack in columns:
                try:
                    plan = b.plan(gluon, per_sm, forced, persistent, fp8_pv, slack)
                    run = b.runner(plan)
                    errors[label] = b.error(run, fp8_pv and b.fp8)
                    if args.timer == "single":
                        graphs[label] = capture_graph(run)
                    runs[label] = run
                    splits[label] = plan_splits(plan)
                except Exception as e:  # noqa: BLE001 - a row of the table, not a library path
                    settle()
                    failed[label] = f"failed: {type(e).__name__}: {str(e)[:100]}"
            if args.timer == "unrolled":
                ms = unrolled_rounds(runs, args.rounds) if runs else {}
            else:
                ms = replay_rounds(graphs, args.rounds, replays_for(b.bytes)) if graphs else {}
            base = ms.get("`tl`")
            for label, *_ in columns:
                if label in failed:
                    ok = False
                    emit(f"| {name} | {dt} | {label} | | {failed[label]} | | |")
                    continue
                gbs = b.bytes / (ms[label] * 1e-3) / 1e9
                ratio = f"{base / ms[label]:.3f}" if base else ""
                worst, within = errors[label]
                ok &= within
                emit(f"| {name} | {dt} | {label} | {splits[label]} | {gbs:.0f} | {ratio} | "
                     f"{worst:.1e}{'' if within else ' **over the bound**'} |")
            del b, graphs
            torch.cuda.empty_cache()
    emit(f"\n{args.rounds} rounds, timer {args.timer}, {time.time() - began:.0f} s")
    return 0 if ok else 1


def settle() -> None:
    """Wait for queued work after a failure (a failed capture may leave some); a kernel
    fault raises again here, and the rows after it will fail by name."""
    try:
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - the failure is reported by the caller
        pass


def plan_splits(plan) -> str:
    """The decode splits of a plan: its Gluon launch's (with the programs of a persistent
    one), or its `tl` decode launch's grid's."""
    g = plan.gluon_decode
    if g is not None:
        programs = getattr(g, "programs", None)
        return f"{g.num_splits}" + (f" ({programs} prog.)" if programs else "")
    return str(next(p.grid[2] for p in plan.launches if p.name == "decode"))


if __name__ == "__main__":
    sys.exit(main())
