"""The Gluon pass's softmax and P V variants on issue 40's fp8 rows, in one process on an sm_90
GPU: the fp8 P V (`SWITCHES.gluon_fp8_pv`), O's rescale skipped where no row's max moved
(`gluon_max_slack`), the converter's V^T by PRMT (`gluon_fp8_v_prmt`, over the ldmatrix
words with `gluon_fp8_v_words`) and P as words (`gluon_fp8_p_words`; at head 256 too since
the consumers keep one P tile live there), the wider key tiles of heads 128 and 256
(`gluon_fp8_wide_tiles`, column "wide tiles"), the converter's V^T in 128-column slabs and a
deeper V^T ring (`gluon_fp8_vt_wide_slabs`, `gluon_fp8_vt_slots`, columns "V^T ..."), O's
rescale after the P V wait at head 256 (`gluon_fp8_rescale_after_pv`, column "rescale after
P V"), the converter's slabs loaded a slab ahead (`gluon_fp8_vt_prefetch`, "V^T
prefetch"), three consumers over an fp8 q at head 64 (`gluon_fp8_three_consumers`,
"three consumers ...") and head 64's 256-key tiles (`gluon_fp8_wide_tiles_64`, "wide tiles
at head 64 ..."), each variant a column (the switches are read when a plan is made),
timed alternately in rounds (eager, `benchmarks/timing.py`),
TFLOP/s on visible FLOPs (KERNEL_NOTES v23, v34); then each column's error against the
float64 oracle on sampled query rows (max / mean abs), FA3 fp8's beside them where the
`fa3-fwd` wheel is installed. With --bf16, the main rows over a bf16 cache and q instead
(`bench_prefill.MAIN_ROWS`, FA3 bf16 beside them): the softmax switches that apply to a 16-bit
P V (the max slack).

    PYTHONPATH=src python tools/ab_fp8_pv.py [--rounds 3] [--columns "NAME;NAME"]
        [--rows "LABEL;LABEL"] [--warm-only] [--bf16]

--columns: the variants by name, ";" between them (default: DEFAULT_COLUMNS; "all": every
one of COLUMNS; "wide": WIDE_COLUMNS, the forms for heads 64 and 256); --rows: rows by
label, ";" between them (default: every row, issue 40's six and RULE_ROWS); --warm-only:
runs each column's plan once and times nothing, so that a few such processes started side
by side, a row each, compile the kernels into Triton's cache before the timed run (each
variant of each row is a kernel of its own: compiling them one after the other takes
longer than timing them).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

BENCHMARKS = str(Path(__file__).resolve().parents[1] / "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)

import bench_prefill as bp  # noqa: E402
import torch  # noqa: E402
from timing import alternate  # noqa: E402
from timing import eager_ms as bench  # noqa: E402

from pagedattn.ops.triton import launch  # noqa: E402

# column -> the switches its plan is made under, from every softmax switch off (the rest
# as launch.SWITCHES has them); "default": launch.SWITCHES as they are
OFF = dict(gluon_fp8_pv=False, gluon_fp8_p_words=False, gluon_fp8_v_prmt=False,
           gluon_fp8_v_words=False, gluon_max_slack=-1, gluon_fp8_wide_tiles=False)
FP8 = dict(OFF, gluon_fp8_pv=True)
COLUMNS = {
    "default": {},
    "fp16 P V": OFF,
    "fp16 P V, slack 8": dict(OFF, gluon_max_slack=8),
    "fp16 P V, slack 4": dict(OFF, gluon_max_slack=4),
    "fp16 P V, slack 0": dict(OFF, gluon_max_slack=0),
    "fp8 P V": FP8,
    "fp8 P V, slack 0": dict(FP8, gluon_max_slack=0),
    "fp8 P V, slack 4": dict(FP8, gluon_max_slack=4),
    "fp8 P V, V by PRMT": dict(FP8, gluon_fp8_v_prmt=True),
    "fp8 P V, V by PRMT, slack 4": dict(FP8, gluon_fp8_v_prmt=True, gluon_max_slack=4),
    "fp8 P V, P words": dict(FP8, gluon_fp8_p_words=True),
    "fp8 P V, P words, V by PRMT": dict(FP8, gluon_fp8_p_words=True, gluon_fp8_v_prmt=True),
    "fp8 P V, P words, V by PRMT, slack 4": dict(FP8, gluon_fp8_p_words=True,
                                                gluon_fp8_v_prmt=True, gluon_max_slack=4),
    "fp8 P V, P words, V words": dict(FP8, gluon_fp8_p_words=True, gluon_fp8_v_prmt=True,
                                      gluon_fp8_v_words=True),
    "fp8 P V, P words, V words, slack 4": dict(FP8, gluon_fp8_p_words=True,
                                               gluon_fp8_v_prmt=True, gluon_fp8_v_words=True,
                                               gluon_max_slack=4),
    # the default's fp8 P V (P words, V words) over FA3's wider key tiles: head 128 256
    # keys, head 256 128 (`gluon_schedule.wide_config_for`; KERNEL_NOTES v38)
    "wide tiles": dict(FP8, gluon_fp8_p_words=True, gluon_fp8_v_prmt=True,
                       gluon_fp8_v_words=True, gluon_fp8_wide_tiles=True),
    # the default with the wide tiles off (the default takes them at head 256 and on long
    # head-128 launches: `attention_gluon.wide_tiles`)
    "narrow tiles": dict(gluon_fp8_wide_tiles=False),
    # the default with the converter's V^T in 128-column slabs (half its barriers a tile),
    # a deeper V^T ring on the default tiles (the wide ones have no room), both
    # (`gluon_fp8_vt_wide_slabs`, `gluon_fp8_vt_slots`; KERNEL_NOTES v46)
    "V^T 128 columns": dict(gluon_fp8_vt_wide_slabs=True),
    "V^T 4 slots": dict(gluon_fp8_vt_slots=4),
    "V^T 128 columns, 4 slots": dict(gluon_fp8_vt_wide_slabs=True, gluon_fp8_vt_slots=4),
    "narrow tiles, V^T 128 columns, 4 slots": dict(
        gluon_fp8_wide_tiles=False, gluon_fp8_vt_wide_slabs=True, gluon_fp8_vt_slots=4),
    # the default with O's rescale after the P V wait, FA3's fp8 order: the consumers' turn
    # holds S's and P V's issues alone (head 256 only; `gluon_fp8_rescale_after_pv`; v52)
    "rescale after P V": dict(gluon_fp8_rescale_after_pv=True),
    # the default with the converter's 128-column V^T slabs each loaded a slab ahead (Dv 256
    # only; `gluon_fp8_vt_prefetch`; v52), and both
    "V^T prefetch": dict(gluon_fp8_vt_prefetch=True),
    "rescale after P V, V^T prefetch": dict(gluon_fp8_rescale_after_pv=True,
                                            gluon_fp8_vt_prefetch=True),
    # the default with three consumers over an fp8 q at head 64 (`gluon_fp8_three_consumers`;
    # FA3 fp8's 192-row items; KERNEL_NOTES v55): by the consumer rule (requests of 8,192+
    # causal queries on average) or forced, with head 64's 16-bit P V or the fp8 P V
    "three consumers": dict(gluon_fp8_three_consumers=True),
    "three consumers, fp8 P V": dict(gluon_fp8_three_consumers=True, gluon_fp8_pv=True),
    "three consumers forced": dict(gluon_fp8_three_consumers=True, gluon_consumers=3),
    "three consumers forced, fp8 P V": dict(gluon_fp8_three_consumers=True, gluon_consumers=3,
                                            gluon_fp8_pv=True),
    # and the fp8 P V at head 64 on two consumers, beside them: on its 128-key tiles, and
    # over 256-key ones (`gluon_fp8_wide_tiles_64`) by the wide tiles' rule or forced
    "fp8 P V at head 64": dict(gluon_fp8_pv=True, gluon_fp8_wide_tiles_64=False),
    "wide tiles at head 64": dict(gluon_fp8_pv=True, gluon_fp8_wide_tiles_64=True),
    "wide tiles at head 64 forced": dict(gluon_fp8_pv=True, gluon_fp8_wide_tiles_64=True,
                                         gluon_fp8_wide_tiles=True),
}
# Rows beside issue 40's (--rows by label): the lengths around the wide tiles' rule
RULE_ROWS = [
    ("4 x 4096", [4096] * 4, [4096] * 4, 32, 8, 128),
    ("1 x 16384", [16384], [16384], 32, 8, 128),
    ("4096 after 4096 cached", [4096], [8192], 32, 8, 128),
    # between 4,096 and 8,192 keys, to place `attention_gluon.WIDE_MIN_KEYS`
    ("1 x 6144", [6144], [6144], 32, 8, 128),
    ("2 x 6144", [6144] * 2, [6144] * 2, 32, 8, 128),
    ("2048 after 4096 cached", [2048], [6144], 32, 8, 128),
    ("8 x 2048, head 256", [2048] * 8, [2048] * 8, 16, 8, 256),
    ("32 x 512, head 256", [512] * 32, [512] * 32, 16, 8, 256),
    # head 64 beside issue 40's 1 x 8192 (three consumers: `gluon_fp8_three_consumers`)
    ("8 x 2048, head 64", [2048] * 8, [2048] * 8, 32, 8, 64),
    ("4 x 4096, head 64", [4096] * 4, [4096] * 4, 32, 8, 64),
    ("1 x 16384, head 64", [16384], [16384], 32, 8, 64),
    ("2048 after 6144 cached, head 64", [2048], [8192], 32, 8, 64),
]
# --columns wide: the fp8 P V's forms at heads 64 and 256, where the default keeps the fp16
# P V (P words reach head 256 now; V words are new)
WIDE_COLUMNS = ("default", "fp16 P V", "fp8 P V, V by PRMT", "fp8 P V, P words, V by PRMT",
                "fp8 P V, P words, V words")
DEFAULT_COLUMNS = ("fp16 P V", "fp16 P V, slack 8", "fp8 P V", "fp8 P V, slack 4",
                   "fp8 P V, P words", "fp8 P V, P words, V by PRMT",
                   "fp8 P V, P words, V by PRMT, slack 4")


@contextlib.contextmanager
def switched(**values):
    """launch.SWITCHES with `values` set, restored on leaving."""
    old = {name: getattr(launch.SWITCHES, name) for name in values}
    try:
        for name, value in values.items():
            setattr(launch.SWITCHES, name, value)
        yield
    finally:
        for name, value in old.items():
            setattr(launch.SWITCHES, name, value)


# --bf16: the columns' default (the 16-bit rows' softmax switches alone)
BF16_COLUMNS = ("default", "fp16 P V, slack 0", "fp16 P V, slack 4", "fp16 P V, slack 8")


def row(label, ql, sl, h, hkv, d, names, rounds, warm_only=False, bf16=False
        ) -> tuple[str, str]:
    """(the row's TFLOP/s line, its error line); bf16: a bf16 q over a bf16 cache."""
    p = bp.Prefill(ql, sl, h, hkv, d) if bf16 else \
        bp.Prefill(ql, sl, h, hkv, d, cache_dtype=bp.E4M3, q_dtype=bp.E4M3)
    peer = "FA3 bf16" if bf16 else "FA3 fp8"
    calls = {}
    for name in names:
        with switched(**COLUMNS[name]):
            calls[name] = p.engine()[0]  # the plan is made now, under the switches
    if warm_only:
        for call in calls.values():
            call()
        torch.cuda.synchronize()
        return f"| {label} | compiled |", ""
    fa3, why = p.fa3()
    t = alternate([(name, bench, call) for name, call in calls.items()]
                  + [(peer, bench, fa3)] * (fa3 is not None), rounds)
    rates = [f"{p.flops() / ms / 1e9:.0f}" if err is None else f"failed: {err}"
             for ms, err in t.values()]
    if fa3 is None:
        rates.append(f"- ({why})")
    errors = bp.row_errors_of(p, dict(calls, **{peer: fa3}))
    del p
    torch.cuda.empty_cache()
    return (f"| {label} | " + " | ".join(rates) + " |",
            f"| {label} | " + " | ".join(errors.values()) + " |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--columns", default=None)
    ap.add_argument("--rows", default=None)
    ap.add_argument("--warm-only", action="store_true")
    ap.add_argument("--bf16", action="store_true", help="the main rows over a bf16 cache")
    args = ap.parse_args(argv)
    table = bp.MAIN_ROWS if args.bf16 else bp.FP8_ROWS + RULE_ROWS
    columns = args.columns or ";".join(BF16_COLUMNS if args.bf16 else DEFAULT_COLUMNS)
    names = list(COLUMNS) if columns == "all" else list(WIDE_COLUMNS) \
        if columns == "wide" else [n.strip() for n in columns.split(";") if n.strip()]
    unknown = [n for n in names if n not in COLUMNS]
    if unknown:
        ap.error(f"--columns: unknown {unknown}; choose from {list(COLUMNS)}")
    labels = [r[0] for r in table]
    rows = [r.strip() for r in (args.rows or ";".join(labels)).split(";") if r.strip()]
    if any(r not in labels for r in rows):
        ap.error(f"--rows: choose from {labels}, got {rows}")
    header = "| row | " + " | ".join(names + ["FA3 bf16" if args.bf16 else "FA3 fp8"]) + " |"
    rule = "|---|" + "---:|" * (len(names) + 1)
    errors = []
    print("TFLOP/s (visible FLOPs), median of the rounds\n\n" + header + "\n" + rule)
    for label, ql, sl, h, hkv, d in (r for r in table if r[0] in rows):
        rates, error = row(label, ql, sl, h, hkv, d, names, args.rounds, args.warm_only,
                           args.bf16)
        print(rates, flush=True)
        errors.append(error)
    if args.warm_only:
        return 0
    print("\nerror against the float64 oracle, max / mean abs (sampled query rows)\n\n"
          + header + "\n" + rule)
    print("\n".join(errors))
    return 0


if __name__ == "__main__":
    sys.exit(main())
