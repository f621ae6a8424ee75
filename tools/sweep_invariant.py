"""Batch-invariant mode's knobs swept (issue 44): split keys, tiles and fused multiply-adds,
each config first checked for the guarantee, then timed beside the default mode.

    PYTHONPATH=src python tools/sweep_invariant.py [--quick] [--cross] [--rounds 3]
        [--configs WORD,...] [--rows WORD,...] [--out FILE]
    TRITON_INTERPRET=1 PYTHONPATH=src python tools/sweep_invariant.py --smoke   # CPU

A config is a set of `launch.SWITCHES` fields (`invariant_split_keys`, `invariant_tiles`,
`invariant_fp_fusion`). Any fixed config keeps a request's bits independent of its batch by
construction, unless the compiler rounds a masked and an unmasked tile (or the two folds)
differently, so each is checked first on a small random batch (`invariant_guarantee.py`: a
request's rows, outputs and float32 LSEs, alone, inside a batch of other prompts and
decodes, and computed chunk by chunk and as decode steps, all `torch.equal`). A config that
fails (or cannot run) is marked and never picked.

Then bench_batch_invariant.py's decode rows (graph replays) and prefill rows (the engine
path, eager), the default mode and every config alternated in rounds in one process
(`timing.alternate`). One markdown table, a config a line and a row a column: ms and the
ratio to the default mode (the issue's target is <= 1.15). Then the best config per row
class (decode; prefill by head size; head 128's decode and prefill together, the choice one
layer makes for both), by the geometric mean of its ratios. Configs name one tile shape for
every head size: where it does not fit a head size its rows read n/a, and the lead sets
`invariant_tiles` (and `invariant_split_keys`) as a dict by head size from the classes.

Configs: one knob at a time from today's (split keys 256-4096; five tile shapes; the
schedule's threshold `invariant_split_below`, which moves launches but never bits; fused
multiply-adds; head 128's tiles before; prompts on the Gluon pass, `invariant_gluon`;
decodes on the Gluon decode layout, `invariant_gluon_decode`; the prompt candidates:
`invariant_gluon_lean`, 128-key tiles with and without the lean consumer,
`invariant_scale_in_exp`, and all three together; `invariant_tiles_128`,
the 128-key tiles with the decode kernel's fold in memory, and at head 128 the prompt
consumer's); --cross adds every
split x tile pair; --quick a handful; --configs keeps today's and those named (`--quick
--configs gluon`: both Gluon configs beside today's; `--configs "gluon decodes"`: the Gluon
decodes alone; `--configs lean,128-key,exp`: the candidates; `--configs "head 256"`:
head 256 on the Gluon kernels alone; `--configs "fold in memory"`: `invariant_tiles_128`;
`--configs "self fold"`: `invariant_self_fold`, split programs without the fold launch;
`--configs "lazy rescale,max slack"`: `invariant_lazy_rescale`, O's rescale skipped where no
row moved (at slack 0), and `invariant_max_slack` 8 (the default since KERNEL_NOTES v54) or 0
(the arithmetic before it), the running max lagging in every pass, at 64-key tiles and with
`invariant_tiles_128`; `--configs "128-key tiles switch"`: that switch alone, with the lazy
rescale and with slack 8; `--configs "skip unseen"`: `invariant_skip_unseen`, the prompt
consumers passing the tiles past their rows' last key). --rows keeps the rows whose kind and
label ("decode decode 1 x 8192", "prefill 1 x 8192") hold one of the words (`--configs "split
below" --rows "head 256"`: head 256's split rule at 32, 64 and 128 x 8192; `--rows "prefill 1
x 8192,prefill 32 x 512"`: head 128's two quick prompt rows alone).
--smoke: tiny rows and configs for the CPU under TRITON_INTERPRET=1 (wall-clock timings;
what the tests run).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

if "--smoke" in sys.argv:  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
BENCHMARKS = str(Path(__file__).resolve().parents[1] / "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)

import bench_kernels  # noqa: E402
import bench_prefill  # noqa: E402
import torch  # noqa: E402
from bench_batch_invariant import switches  # noqa: E402
from invariant_guarantee import (  # noqa: E402, F401 - World, check_invariance: the tests'
    World,
    check_config,
    check_invariance,
)
from timing import Emitter, alternate, eager_ms, graph_ms  # noqa: E402

from pagedattn.ops.triton import launch  # noqa: E402
from pagedattn.ops.triton.op_plans import varlen_attention  # noqa: E402


@dataclass(frozen=True)
class Config:
    label: str
    values: dict = field(default_factory=dict)  # launch.SWITCHES fields


@dataclass(frozen=True)
class Row:
    label: str
    kind: str  # "decode" or "prefill"
    query_lens: tuple
    seq_lens: tuple
    heads: int
    kv_heads: int
    head_size: int
    window: int = -1


# --- configs and rows ---------------------------------------------------------------------
SPLITS = (256, 512, 2048, 4096)
BELOW = (2.0, 4.0, 8.0, 16.0)  # split programs below this many x the SMs (today: 1; 4 at head 256)
TILES = ((64, 64, 4, 2), (128, 64, 8, 2), (128, 128, 8, 2), (64, 128, 4, 3), (128, 64, 4, 3))


# head 128 runs 128-row, 8-warp prefill tiles beside 64-row, 4-warp tiles for steps of
# decodes alone (`invariant_config.INVARIANT_DECODE_TILES`); this is the one 64-row config
# before them
NARROW = Config("64-row tiles for every step, head 128 (before)",
                {"invariant_tiles": {128: (64, 64, 4, 3)}})
# prompts on the Gluon pass's invariant consumer (the `tl` pass's bits), decodes on the `tl`
# pass; where it cannot serve (head 256, `invariant_plan.invariant_gluon_refusal`) today's
GLUON = Config("gluon prompts", {"invariant_gluon": True})
# decodes on the Gluon decode layout's invariant kernel (`gluon_decode_invariant.py`, the
# `tl` pass's bits; `invariant_plan.invariant_gluon_decode_refusal` says where it serves),
# prompts on the Gluon pass as today
GLUON_DECODES = Config("gluon decodes", {"invariant_gluon_decode": True})
# head 256 on the Gluon kernels alone (`invariant_gluon_256`: prompts and decodes with one
# arithmetic a row of their own, the splits' states in memory; never the `tl` pass there)
GLUON_256 = Config("gluon head 256", {"invariant_gluon_256": True})
# issue 44's prompt candidates (KERNEL_NOTES v32): the Gluon consumer without work that
# cannot change a bit (`invariant_gluon_lean`), 128-key tiles for every pass (the `tl` pass's
# prompt and decode tiles, the Gluon consumer and decode kernel alike), the score scale in
# the exponent's fma (`invariant_scale_in_exp`)
TILES_128 = {"invariant_tiles": {64: (64, 128, 4, 3), 128: (128, 128, 8, 2)},
             "invariant_decode_tiles": {128: (64, 4, 3)}}
LEAN = Config("lean consumer", {"invariant_gluon_lean": True})
KEYS_128 = Config("128-key tiles", TILES_128)
KEYS_128_LEAN = Config("128-key tiles, lean consumer", dict(TILES_128, invariant_gluon_lean=True))
# the score scale in the exponent's fma, every pass (changes the bits of all alike)
SCALE_IN_EXP = Config("scale in exp", {"invariant_scale_in_exp": True})
ALL = Config("128-key tiles, lean consumer, scale in exp",
             dict(TILES_128, invariant_gluon_lean=True, invariant_scale_in_exp=True))
# since v32 the lean consumer and the scale in the exponent are today's: the tree before
# them beside it, and 128-key tiles at head 64 alone (head 128's decodes lost 1.07-1.10x)
BEFORE_V32 = Config("neither lean nor scale in exp (before)",
                    {"invariant_gluon_lean": False, "invariant_scale_in_exp": False})
KEYS_128_H64 = Config("128-key tiles at head 64", {"invariant_tiles": {64: (64, 128, 4, 3)}})
# `SWITCHES.invariant_tiles_128`: the same tiles as "128-key tiles", the decode kernel's
# unsplit programs and head 128's prompt consumer folding in float32 memory (KERNEL_NOTES
# v39, v53); beside "128-key tiles" (the folds in registers) the two differ by that alone
KEYS_128_SWITCH = Config("128-key tiles switch, fold in memory", {"invariant_tiles_128": True})
# split programs that fold their own splits (`invariant_self_fold`, KERNEL_NOTES v43: no fold
# launch, the same bits), alone and with split programs up to 4 x the SMs' programs (a
# split then costs no launch)
SELF_FOLD = Config("self fold", {"invariant_self_fold": True})
SELF_FOLD_BELOW = Config("self fold, split below 4 x SMs",
                         {"invariant_self_fold": True, "invariant_split_below": 4.0})
# the prompt consumer skipping O's rescale where no row of a warp moved its max
# (`invariant_lazy_rescale`, KERNEL_NOTES v45: schedule only, the same bits)
# (the slack 0 that lets it decide; the default slack 8 skips more)
LAZY = Config("lazy rescale", {"invariant_lazy_rescale": True, "invariant_max_slack": 0})
# the running max lagging by up to 2^8 in every pass (`invariant_max_slack`: other bits, all
# passes alike), the prompt consumer's rescale then skipped nearly every tile: the default
# since KERNEL_NOTES v54; "max slack 0" is the arithmetic before it
SLACK_8 = Config("max slack 8", {"invariant_max_slack": 8})
SLACK_0 = Config("max slack 0", {"invariant_max_slack": 0})
# 128-key tiles at head 128 with O's rescale skipped in both Gluon kernels, the prompts'
# and the decodes' (KERNEL_NOTES v50): part of what kept `invariant_tiles_128` off at head
# 128 (its decodes, v41) may be that rescale, 64 multiplies a tile on the decode's chain
KEYS_128_LAZY = Config("128-key tiles switch, lazy rescale",
                       {"invariant_tiles_128": True, "invariant_lazy_rescale": True,
                        "invariant_max_slack": 0})
KEYS_128_SLACK_8 = Config("128-key tiles switch, max slack 8",
                          {"invariant_tiles_128": True, "invariant_max_slack": 8})
# the prompt consumer passing the key tiles past its rows' last seen key without products
# (`invariant_skip_unseen`, KERNEL_NOTES v55: schedule only, the same bits): causal, consumer
# 0's last 64-key tile of each item, 10% of the consumers' tiles at 32 x 512
SKIP_UNSEEN = Config("skip unseen", {"invariant_skip_unseen": True})
CANDIDATES = [LEAN, KEYS_128, KEYS_128_LEAN, SCALE_IN_EXP, ALL, BEFORE_V32,
              KEYS_128_H64, KEYS_128_SWITCH, SELF_FOLD, SELF_FOLD_BELOW, LAZY, SLACK_8,
              SLACK_0, KEYS_128_LAZY, KEYS_128_SLACK_8, SKIP_UNSEEN]


def gpu_configs(quick: bool, cross: bool) -> list[Config]:
    if quick:
        return [Config("today"), Config("split 512", {"invariant_split_keys": 512}),
                Config("split 2048", {"invariant_split_keys": 2048}),
                Config("tiles (128,64,8,2)", {"invariant_tiles": (128, 64, 8, 2)}),
                Config("split below 4 x SMs", {"invariant_split_below": 4.0}),
                Config("fused mul-add", {"invariant_fp_fusion": True}), NARROW, GLUON,
                GLUON_DECODES, GLUON_256] + CANDIDATES
    out = [Config("today")]
    out += [Config(f"split {s}", {"invariant_split_keys": s}) for s in SPLITS]
    out += [Config(f"tiles {_tiles(t)}", {"invariant_tiles": t}) for t in TILES]
    out += [Config(f"split below {b:g} x SMs", {"invariant_split_below": b})
            for b in BELOW]
    out += [Config("fused mul-add", {"invariant_fp_fusion": True}), NARROW, GLUON,
            GLUON_DECODES, GLUON_256] + CANDIDATES
    if cross:
        out += [Config(f"split {s}, tiles {_tiles(t)}",
                       {"invariant_split_keys": s, "invariant_tiles": t})
                for s in SPLITS for t in TILES if s % t[1] == 0]
    return out


def _tiles(t: tuple) -> str:
    return "(" + ",".join(map(str, t)) + ")"


def pick_configs(configs: list[Config], words: str) -> list[Config]:
    """--configs: today's (the first) and those whose label holds one of the words."""
    return configs[:1] + [c for c in configs[1:] if any(w in c.label for w in words.split(","))]


def pick_rows(rows: list[Row], words: str) -> list[Row]:
    """--rows: the rows whose kind and label hold one of the words (the kind first, so
    "prefill 1 x 8192" names the prompt row without "decode 1 x 8192")."""
    return [r for r in rows if any(w in f"{r.kind} {r.label}" for w in words.split(","))]


def gpu_rows(quick: bool) -> list[Row]:
    decode = ([(1, 8192), (32, 8192), (128, 8192)] if quick else
              [(1, 1024), (1, 8192), (1, 32768), (32, 1024), (32, 8192), (32, 32768),
               (128, 4096), (128, 16384)])
    rows = [Row(f"decode {b} x {c}", "decode", (1,) * b, (c,) * b, bench_kernels.H,
                bench_kernels.HKV, bench_kernels.D) for b, c in decode]
    # head 64's decodes, whose tiles may differ from head 128's (`invariant_tiles` by head)
    for d in (64, 256):  # heads whose tiles differ from head 128's (`invariant_tiles`)
        rows.append(Row(f"decode 32 x 8192, head {d}", "decode", (1,) * 32, (8192,) * 32,
                        bench_kernels.H, bench_kernels.HKV, d))
    if not quick:  # head 256 past 4 x the SMs' programs (`INVARIANT_SPLIT_BELOW`'s 8.0 since v49)
        for b in (64, 128):
            rows.append(Row(f"decode {b} x 8192, head 256", "decode", (1,) * b, (8192,) * b,
                            bench_kernels.H, bench_kernels.HKV, 256))
    prefill = bench_prefill.MAIN_ROWS + bench_prefill.WINDOW_ROWS
    if quick:
        prefill = [r for r in prefill
                   if r[0] in ("1 x 8192", "32 x 512", "8 x 2048, head 64",
                               "8 x 2048, head 256")]
    for label, ql, sl, h, hkv, d, *rest in prefill:
        rows.append(Row(label, "prefill", tuple(ql), tuple(sl), h, hkv, d,
                        rest[0] if rest else -1))
    return rows


SMOKE_CONFIGS = [Config("today"), Config("split 16", {"invariant_split_keys": 16}),
                 Config("split 32, tiles (32,16,4,1)",
                        {"invariant_split_keys": 32, "invariant_tiles": (32, 16, 4, 1)})]
SMOKE_ROWS = [Row("decode 2 x 40", "decode", (1, 1), (40, 40), 2, 1, 32),
              Row("prefill 1 x 24", "prefill", (24,), (24,), 2, 1, 32)]


# --- timing -------------------------------------------------------------------------------
def row_calls(row: Row, configs: list[Config], smoke: bool) -> list[Callable]:
    """The row's calls: the default mode's, then each config's in batch-invariant mode."""
    if row.kind == "decode":
        p = bench_kernels.Paged(row.query_lens, row.seq_lens, head_size=row.head_size)
        invariant = functools.partial(varlen_attention, batch_invariant=True)

        def call(values):
            with switches(**values):
                p.run(fn=invariant)

        return [p.run] + [functools.partial(call, c.values) for c in configs]
    p = bench_prefill.Prefill(row.query_lens, row.seq_lens, row.heads, row.kv_heads,
                              row.head_size, window=row.window)
    calls = [p.engine()[0]]
    for c in configs:
        try:
            with switches(**c.values):
                calls.append(p.engine(batch_invariant=True)[0])
        except Exception as e:  # noqa: BLE001 - a plan that refuses the config: a NaN cell
            calls.append(functools.partial(_raise, e))
    return calls


def _raise(e: Exception):
    raise e


def timer(row: Row, smoke: bool) -> Callable:
    if smoke:
        return functools.partial(eager_ms, warmup=0, rep=0)
    if row.kind == "decode":
        return functools.partial(graph_ms, rep=30)
    return functools.partial(eager_ms, warmup=10, rep=50)


def time_row(row: Row, configs: list[Config], rounds: int, smoke: bool
             ) -> list[tuple[float, Optional[str]]]:
    """(ms, error) of the default mode, then of each config, alternated in rounds."""
    calls = row_calls(row, configs, smoke)
    names = ["default"] + [c.label for c in configs]
    t = timer(row, smoke)
    result = alternate([(name, t, fn) for name, fn in zip(names, calls)], rounds)
    del calls
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return [result[name] for name in names]


# --- report -------------------------------------------------------------------------------
def row_class(row: Row) -> str:
    return "decode" if row.kind == "decode" else f"prefill, head {row.head_size}"


def table(configs, checks, rows, times) -> list[str]:
    """times[i][j]: (ms, error) of column j (0: default) on rows[i]."""
    cols = ["config", "guarantee"] + [r.label for r in rows]
    lines = ["| " + " | ".join(cols) + " |", "|---|---|" + "---:|" * len(rows)]
    lines.append("| default mode | - | " + " | ".join(
        _ms(times[i][0][0]) for i in range(len(rows))) + " |")
    for j, c in enumerate(configs, 1):
        cells = []
        for i in range(len(rows)):
            base, ms = times[i][0][0], times[i][j][0]
            cells.append("n/a" if ms != ms else f"{_ms(ms)} ({ms / base:.2f}x)")
        lines.append(f"| {c.label} | {'ok' if checks[j - 1] is None else 'BROKEN'} | "
                     + " | ".join(cells) + " |")
    return lines


def _ms(ms: float) -> str:
    return "n/a" if ms != ms else f"{ms:.4f}" if ms < 1 else f"{ms:.3f}"


def best_per_class(configs, checks, rows, times) -> list[str]:
    """A line per class: the checked config with the lowest geometric mean of its ratios
    over the class's rows (every row timed), its worst ratio beside it."""
    classes: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        classes.setdefault(row_class(r), []).append(i)
    both = [i for i, r in enumerate(rows) if r.head_size == 128]
    if both and len({rows[i].kind for i in both}) == 2:
        classes["head 128, decode + prefill"] = both
    lines = ["| class | best config | geomean ratio | worst ratio | today's geomean |",
             "|---|---|---:|---:|---:|"]
    for name, idx in classes.items():
        scored = []
        for j, c in enumerate(configs, 1):
            ratios = [times[i][j][0] / times[i][0][0] for i in idx]
            if checks[j - 1] is None and all(x == x for x in ratios):
                scored.append((math.exp(sum(map(math.log, ratios)) / len(ratios)),
                               max(ratios), c.label))
        today = next((s[0] for s in scored if s[2] == configs[0].label), float("nan"))
        if scored:
            g, worst, label = min(scored)
            lines.append(f"| {name} | {label} | {g:.2f} | {worst:.2f} | {today:.2f} |")
        else:
            lines.append(f"| {name} | none checked and timed | n/a | n/a | n/a |")
    return lines


def sweep(configs: list[Config], rows: list[Row], rounds: int, smoke: bool,
          emit: Callable[[str], None] = print) -> tuple[list, list]:
    """Check each config, time every row, emit the tables; (checks, times)."""
    head_sizes = sorted({r.head_size for r in rows})
    checks = []
    for c in configs:
        broke, cannot = check_config(c, head_sizes, smoke)
        checks.append(broke)
        emit(f"check {c.label}: {'ok' if broke is None else 'BROKEN: ' + broke}"
             + "".join(f"; cannot run at {why}" for why in cannot))
    times = []
    for r in rows:
        times.append(time_row(r, configs, rounds, smoke))
        # the row's numbers at once, so that a run cut short keeps them
        labels = ["default"] + [c.label for c in configs]
        emit(f"timed {r.label}: " + ", ".join(
            f"{k} {_ms(ms)}" for k, (ms, _) in zip(labels, times[-1])))
        for k, (_, e) in zip(labels, times[-1]):
            if e:
                emit(f"  <!-- {k}: {e} -->")
    emit("")
    for line in table(configs, checks, rows, times) + [""] + \
            best_per_class(configs, checks, rows, times):
        emit(line)
    return checks, times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="five configs, seven rows")
    ap.add_argument("--cross", action="store_true", help="add every split x tiles pair")
    ap.add_argument("--smoke", action="store_true", help="tiny, on the CPU (interpreter)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--configs", default=None, metavar="WORD,...",
                    help="today's config and those whose label holds one of the words")
    ap.add_argument("--rows", default=None, metavar="WORD,...",
                    help='only the rows whose kind and label ("prefill 1 x 8192") hold '
                         'one of the words')
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if os.environ.get("PAGEDATTN_BATCH_INVARIANT", "0") == "1":
        raise SystemExit("unset PAGEDATTN_BATCH_INVARIANT: the sweep runs each mode itself")
    emit = Emitter()
    emit.to_file(args.out)
    torch.manual_seed(0)
    if args.smoke:
        use_cpu()
        configs, rows, rounds = SMOKE_CONFIGS, SMOKE_ROWS, 1
    else:
        configs, rows, rounds = gpu_configs(args.quick, args.cross), gpu_rows(args.quick), \
            args.rounds
        if args.configs:
            configs = pick_configs(configs, args.configs)
        if args.rows:
            rows = pick_rows(rows, args.rows)
            if not rows:
                raise SystemExit(f"--rows {args.rows!r}: no row's kind and label hold one of "
                                 "them")
        props = torch.cuda.get_device_properties(0)
        emit(f"device: {props.name}, {props.multi_processor_count} SMs; torch "
             f"{torch.__version__}; today: split keys {launch.SWITCHES.invariant_split_keys}, "
             f"tiles {launch.SWITCHES.invariant_tiles or 'invariant_config'}")
    sweep(configs, rows, rounds, args.smoke, emit)


def use_cpu() -> None:
    """The benchmarks' row builders on the CPU (their device is a module constant)."""
    bench_kernels.DEV = bench_prefill.DEV = "cpu"
    bench_kernels.H, bench_kernels.HKV, bench_kernels.D = 2, 1, 32


if __name__ == "__main__":
    main()
