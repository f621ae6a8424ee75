"""Our decode pass under `ncu` (issue 41): what limits B64 L16k and B8 L128k, bf16 and fp8.

tools/gpu_peers.sh runs all of this; by hand, from the repository root (ncu needs
`--clock-control none` on the GPU machine):

    ncu --clock-control none --profile-from-start off \\
        --kernel-name 'regex:attention_kernel|reduce_splits_kernel' --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \\
        --section Occupancy --section LaunchStats -f -o decode \\
        python3 benchmarks/ncu_decode.py launch --manifest manifest.json
    ncu -i decode.ncu-rep --page raw --csv --print-units base > raw.csv
    # per case, the attention pass's SASS with executed counts per instruction (one launch)
    ncu --clock-control none --profile-from-start off --kernel-name regex:attention_kernel \\
        --launch-count 1 --section SourceCounters --section WarpStateStats -f -o sass_CASE \\
        python3 benchmarks/ncu_decode.py launch --cases CASE --runs 1
    ncu -i sass_CASE.ncu-rep --page source --csv --print-source sass > sass_CASE.csv
    python3 benchmarks/ncu_decode.py summary --manifest manifest.json --raw raw.csv --sass-dir .

`launch` builds each case (`decode_peers.DecodeBatch`: 32 q / 8 KV heads, head 128, shuffled
blocks of 16; fp8 is an e4m3 q over an e4m3 cache), runs it twice to compile and warm, prints
its plan (passes, grids, warps, stages, tiles, split count, programs per SM), then runs it
`--runs` times between cudaProfilerStart and Stop, all that `--profile-from-start off`
profiles; the manifest records the order, so the summary can tell the launches apart.

Block-sparse decode beside dense decode (issue 41's block-sparse target; one script,
tools/ncu_blocksparse.sh, runs this): the cases b32_l32k_bf16 and b64_l16k_bf16 (dense) and
SPARSE_CASES (`blocksparse_batch.SparseDecodeBatch`: per head vert_stride 8, 4 classes, and
homo_head 8 at B32 L32k; per head 1 at B64 L16k; each also with
`SWITCHES.blocksparse_decode_key_lines`) in one profiled process, the kernel regex taking
the block-sparse pass (`_decode_kernel`) too, and EXTRA_METRICS for the L2 columns:

    CASES=b32_l32k_bf16,bs_b32_l32k_per8,bs_b32_l32k_homo8,b64_l16k_bf16,bs_b64_l16k_per1,\
    bs_b32_l32k_per8_lines,bs_b32_l32k_homo8_lines,bs_b64_l16k_per1_lines
    ncu --clock-control none --profile-from-start off \
        --kernel-name 'regex:attention_kernel|reduce_splits_kernel|_decode_kernel' \
        --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section MemoryWorkloadAnalysis_Tables --section Occupancy --section LaunchStats \
        --section WarpStateStats --metrics lts__t_sector_hit_rate.pct,\
    lts__t_sectors_srcunit_tex_op_read.sum,lts__t_requests_srcunit_tex_op_read.sum,\
    smsp__inst_executed.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum \
        -f -o bs python3 benchmarks/ncu_decode.py launch --cases $CASES --manifest bs.json
    ncu -i bs.ncu-rep --page raw --csv --print-units base > bs_raw.csv
    # per case: as above with --kernel-name 'regex:attention_kernel|_decode_kernel'
    python3 benchmarks/ncu_decode.py summary --manifest bs.json --raw bs_raw.csv --sass-dir .

`summary` prints per case, from the last run: each pass's time under ncu and the reduce's
share; the K/V bytes over both passes' time; the attention pass's DRAM reads (GB/s, % of
peak); achieved and theoretical occupancy, CTAs per SM and their limiter, waves and the
programs of the last one; sectors per global-load request; and from the SASS, the global
loads by instruction and width (bytes, thread-level counts) and the 4-byte loads (the
block-table lookups, plus a few per program: lengths, descales) per page and KV head, whose
floor is 1, and per KiB of K/V; then the L2 hit rate, L2 sectors per request of the
L1's reads (4: whole 128-byte lines; 1: a sector from each line), shared-memory bank
conflicts and instructions per KiB of K/V, `BAR` executions per tile (SASS), and the five
largest warp stall reasons (WarpStateStats: warps stalled per issued instruction).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Optional

CASES = {  # name: (label, batch, ctx, cache dtype)
    "b64_l16k_bf16": ("B64 L16k", 64, 16384, "bf16"),
    "b64_l16k_fp8": ("B64 L16k", 64, 16384, "fp8"),
    "b8_l128k_bf16": ("B8 L128k", 8, 131072, "bf16"),
    "b8_l128k_fp8": ("B8 L128k", 8, 131072, "fp8"),
}
DEFAULT_CASES = tuple(CASES)
CASES["b32_l32k_bf16"] = ("B32 L32k", 32, 32768, "bf16")  # block-sparse's rows, dense
KEY_LINES = {"blocksparse_decode_key_lines": True}
# Block-sparse decode (blocksparse_batch.py; issue 41's block-sparse target) beside the
# dense rows of the same batch and context: name: (label, batch, ctx, family, vert_stride,
# launch.SWITCHES fields).
SPARSE_CASES = {
    "bs_b32_l32k_per8": ("B32 L32k sparse per head 8", 32, 32768, "per head", 8, {}),
    "bs_b32_l32k_homo8": ("B32 L32k sparse homo 8", 32, 32768, "homo_head", 8, {}),
    "bs_b64_l16k_per1": ("B64 L16k sparse per head 1", 64, 16384, "per head", 1, {}),
    "bs_b32_l32k_per8_lines": ("B32 L32k sparse per head 8, key lines", 32, 32768,
                               "per head", 8, KEY_LINES),
    "bs_b32_l32k_homo8_lines": ("B32 L32k sparse homo 8, key lines", 32, 32768,
                                "homo_head", 8, KEY_LINES),
    "bs_b64_l16k_per1_lines": ("B64 L16k sparse per head 1, key lines", 64, 16384,
                               "per head", 1, KEY_LINES),
}
HKV, PAGE = 8, 16
PREFIX = {"n": 1e-9, "u": 1e-6, "m": 1e-3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
LOAD = re.compile(r"^\s*(?:@!?U?P\w+\s+)?(LDGSTS|LDG)\b((?:\.\w+)*)")
BARRIER = re.compile(r"^\s*(?:@!?U?P\w+\s+)?(BAR)\b((?:\.\w+)*)")
WIDTH = {"128": 16, "64": 8, "U16": 2, "S16": 2, "U8": 1, "S8": 1}


# --- launch (runs under ncu) ---------------------------------------------------------------
def launch(names: list[str], runs: int, manifest: Optional[str]) -> None:
    import torch
    from blocksparse_batch import SparseDecodeBatch
    from decode_peers import E4M3, DecodeBatch

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    record = dict(sm_count=sms, cases=[])
    for name in names:
        label, dtype = name, ""
        try:  # a case that cannot be built or compiled is left out of the manifest
            if name in SPARSE_CASES:
                label, batch, ctx, family, vert, switches = SPARSE_CASES[name]
                dtype = "bf16"
                b = SparseDecodeBatch(batch, ctx, family, vert, switches)
            else:
                label, batch, ctx, dtype = CASES[name]
                b = DecodeBatch(batch, ctx, E4M3 if dtype == "fp8" else torch.bfloat16)
            run = b.engine()
            run()
            run()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - the other cases still run
            print(f"{label} {dtype}: failed before profiling ({type(e).__name__}: {e})")
            continue
        passes = b.passes()
        for p in passes:
            programs = math.prod(p["grid"])
            print(f"{label} {dtype}: {p['name']} pass, {p['kernel']} grid {tuple(p['grid'])} = "
                  f"{programs} programs ({programs / sms:.2f} per SM of {sms}), "
                  f"{p['num_warps']} warps, {p['num_stages']} stages, BLOCK_M {p['block_m']}, "
                  f"BLOCK_N {p['block_n']}; splits {b.splits()}; K/V {b.kv_bytes / 1e6:.0f} MB",
                  flush=True)
        torch.cuda.profiler.start()
        for _ in range(runs):
            run()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        # block-table entries the pass needs (one per page and KV head it reads)
        lookups = getattr(b, "lookups", batch * HKV * math.ceil(ctx / PAGE))
        record["cases"].append(dict(name=name, label=f"{label} {dtype}", batch=batch, ctx=ctx,
                                    kv_bytes=b.kv_bytes, runs=runs, passes=passes,
                                    splits=b.splits(), lookups=lookups))
        del b, run
        torch.cuda.empty_cache()
    if manifest:
        Path(manifest).write_text(json.dumps(record, indent=1))


# --- reading ncu's CSV exports ------------------------------------------------------------
def number(cell: str) -> Optional[float]:
    try:
        return float(cell.replace(",", ""))
    except (AttributeError, ValueError):
        return None


TIME_UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}


def to_base(value: Optional[float], unit: str) -> Optional[float]:
    """value in seconds, bytes or bytes per second where its unit has a prefix (usecond,
    Mbyte, Gbyte/second); other units as they are."""
    if value is None:
        return None
    if unit in TIME_UNITS:  # ncu writes durations as "ns" even with --print-units base
        return value * TIME_UNITS[unit]
    for base in ("byte/second", "byte", "second"):
        prefix = unit[:-len(base)] if unit.endswith(base) else None
        if prefix is not None and len(prefix) <= 1:
            return value * PREFIX.get(prefix, 1.0)
    return value


def read_raw(path: str) -> list[dict]:
    """The raw page (`--page raw --csv`): one dict per profiled launch, in ID order, with
    "Kernel Name", "Grid Size" as text and every metric as a float in base units (or None)."""
    rows = list(csv.reader(open(path)))
    start = next(i for i, r in enumerate(rows) if "ID" in r and "Kernel Name" in r)
    header = rows[start]
    units = {}
    launches = []
    for r in rows[start + 1:]:
        cells = dict(zip(header, r))
        if not str(cells.get("ID", "")).strip().isdigit():  # the units row
            units = cells if not units else units
            continue
        row = {}
        for key, cell in cells.items():
            value = number(cell)
            row[key] = cell if value is None else to_base(value, units.get(key, ""))
        launches.append(row)
    return sorted(launches, key=lambda row: row["ID"])


def assign(manifest: dict, launches: list[dict]) -> tuple[dict, list[str]]:
    """({case: {pass name: raw row}} from each case's last run, warnings): the launches in
    the manifest's order (case, run, pass), checked by kernel name."""
    expected = [(case, run, p) for case in manifest["cases"] for run in range(case["runs"])
                for p in case["passes"]]
    warnings = []
    if len(expected) != len(launches):
        warnings.append(f"{len(launches)} profiled launches, {len(expected)} expected: "
                        "the cases below may be mismatched")
    by_case: dict = {}
    for (case, run, p), row in zip(expected, launches):
        if p["kernel"] not in str(row.get("Kernel Name", "")):
            warnings.append(f"{case['label']} run {run}: expected {p['kernel']}, "
                            f"got {row.get('Kernel Name')}")
        if run == case["runs"] - 1:
            by_case.setdefault(case["name"], {})[p["name"]] = row
    return by_case, warnings


def metric(row: dict, *names: str) -> Optional[float]:
    """The first of `names` that the row has as a number."""
    for name in names:
        value = row.get(name)
        if isinstance(value, float):
            return value
    return None


def summed(row: dict, pattern: str) -> Optional[float]:
    """The sum of the row's metrics whose names match `pattern` (None if none)."""
    values = [v for k, v in row.items() if re.fullmatch(pattern, k) and isinstance(v, float)]
    return sum(values) if values else None


def read_sass(path: str, pattern: re.Pattern = LOAD) -> Counter:
    """{(instruction, bytes a thread): [thread-level executions]} of the global loads (or the
    instructions `pattern` matches: BARRIER) in a source page (`--page source --csv
    --print-source sass`) of one launch."""
    rows = list(csv.reader(open(path)))
    start = next(i for i, r in enumerate(rows) if r and r[0].strip("# ") == "Address")
    header = rows[start]
    col = {name: header.index(name) for name in header}  # the first of duplicate names
    count = next((col[c] for c in ("Predicated-On Thread Instructions Executed",
                                   "Thread Instructions Executed") if c in col), None)
    warp = col.get("Instructions Executed")
    loads: Counter = Counter()
    for r in rows[start + 1:]:
        m = pattern.match(r[col["Source"]]) if len(r) > col["Source"] else None
        if not m:
            continue
        n = number(r[count]) if count is not None else None
        if n is None and warp is not None:
            n = (number(r[warp]) or 0.0) * 32  # no thread-level column: full warps
        width = next((WIDTH[t] for t in m.group(2).split(".") if t in WIDTH), 4)
        loads[(m.group(1), width)] += n or 0.0
    return loads


# --- summary ------------------------------------------------------------------------------
def summary(manifest: dict, launches: list[dict], sass_dir: Optional[str]) -> list[str]:
    by_case, warnings = assign(manifest, launches)
    sms = manifest["sm_count"]
    out = [f"warning: {w}" for w in warnings]
    out += ["\n#### Decode under ncu: time and bytes (last run of each case)\n",
            "| case | passes (grid, warps, stages, BLOCK_N) | splits | attention us | reduce us "
            "| reduce share | K/V GB/s over both | attention DRAM read GB/s | DRAM % of peak |",
            "|---|---|---|---|---|---|---|---|---|"]
    for case in manifest["cases"]:
        rows = by_case.get(case["name"], {})
        attn, red = rows.get("decode", {}), rows.get("reduce")
        t_attn = metric(attn, "gpu__time_duration.sum")
        t_red = metric(red, "gpu__time_duration.sum") if red else 0.0
        total = None if t_attn is None or t_red is None else t_attn + t_red
        dram = metric(attn, "dram__bytes_read.sum")
        peak = metric(attn, "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
                      "dram__throughput.avg.pct_of_peak_sustained_elapsed")
        plan = "; ".join(f"{p['name']} {tuple(p['grid'])} x{p['num_warps']} s{p['num_stages']}"
                         f" n{p['block_n']}" for p in case["passes"])
        out.append(
            f"| {case['label']} | {plan} | {case['splits']} | {_f(t_attn, 1e6, 1)} | "
            f"{_f(t_red if red else None, 1e6, 1)} | "
            f"{_pct(t_red / total if red and total else None)} | "
            f"{_f(case['kv_bytes'] / total if total else None, 1e-9, 0)} | "
            f"{_f(dram / t_attn if dram and t_attn else None, 1e-9, 0)} | "
            f"{_f(peak, 1, 1)} |")
    out += _attention_table(
        "occupancy and waves", "| case | registers | shared KB | CTAs / SM (limiter) | "
        "occupancy theoretical | achieved | waves | programs in the last wave / slots |",
        manifest, by_case, lambda attn, case: _occupancy(attn, case, sms))
    out += _attention_table(
        "loads", "| case | sectors / request: LDG, LDGSTS | memory instructions 128 / 64 / 32 "
        "/ 16 / 8 bit | global loads by bytes (SASS) | 4-byte loads per page and KV head (per "
        "KiB of K/V) |", manifest, by_case, lambda attn, case: _loads(attn, case, sass_dir))
    out += _attention_table(
        "caches, instructions and stalls", "| case | L2 hit rate | L2 sectors / request (L1 "
        "reads) | shared bank conflicts per KiB | instructions per KiB of K/V | barriers per "
        "tile | top 5 stalls (warps per issue) |",
        manifest, by_case, lambda attn, case: _caches(attn, case, sass_dir))
    return out


def _attention_table(title: str, header: str, manifest: dict, by_case: dict,
                     cells: Callable[[dict, dict], list[str]]) -> list[str]:
    """A table of the attention pass's metrics, a row per case of `cells(metrics, case)`."""
    out = [f"\n#### Decode under ncu: {title} (attention pass)\n", header,
           "|" + "---|" * (header.count("|") - 1)]
    for case in manifest["cases"]:
        attn = by_case.get(case["name"], {}).get("decode", {})
        out.append(f"| {case['label']} | " + " | ".join(cells(attn, case)) + " |")
    return out


STALL = re.compile(r"smsp__average_warps?_issue_stalled_(\w+?)_per_issue_active\.ratio")
# ncu's --metrics beyond the sections (tools/ncu_blocksparse.sh asks for them; a run
# without them prints "-" in their columns)
EXTRA_METRICS = ("lts__t_sector_hit_rate.pct", "lts__t_sectors_srcunit_tex_op_read.sum",
                 "lts__t_requests_srcunit_tex_op_read.sum", "smsp__inst_executed.sum",
                 "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum")


def _lookups(case: dict) -> int:
    """Block-table entries the pass needs: one per page and KV head it reads."""
    return case.get("lookups") or case["batch"] * HKV * math.ceil(case["ctx"] / PAGE)


def _caches(attn: dict, case: dict, sass_dir: Optional[str]) -> list[str]:
    kib = case["kv_bytes"] / 1024
    sectors = metric(attn, "lts__t_sectors_srcunit_tex_op_read.sum")
    requests = metric(attn, "lts__t_requests_srcunit_tex_op_read.sum")
    conflicts = metric(attn, "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum")
    instructions = metric(attn, "smsp__inst_executed.sum")
    stalls = sorted(((m.group(1), v) for k, v in attn.items()
                     if isinstance(v, float) and (m := STALL.fullmatch(k))),
                    key=lambda x: -x[1])
    cells = [_f(metric(attn, "lts__t_sector_hit_rate.pct"), 1, 1, "%"),
             _f(sectors / requests if sectors and requests else None, 1, 2),
             _f(conflicts / kib if conflicts is not None else None, 1, 2),
             _f(instructions / kib if instructions else None, 1, 1), "-",
             ", ".join(f"{name} {value:.2f}" for name, value in stalls[:5]) or "-"]
    path = Path(sass_dir or ".") / f"sass_{case['name']}.csv"
    if sass_dir is not None and path.exists():
        try:
            bars = read_sass(str(path), BARRIER)[("BAR", 4)] / 32  # warp-level executions
        except (StopIteration, KeyError, IndexError, ValueError) as e:
            cells[4] = f"unreadable ({type(e).__name__})"
            return cells
        attn_pass = case["passes"][0]
        tiles = _lookups(case) / max(1, attn_pass["block_n"] // PAGE)
        cells[4] = _f(bars / attn_pass["num_warps"] / tiles, 1, 1)
    return cells


def _occupancy(attn: dict, case: dict, sms: int) -> list[str]:
    limits = {name: metric(attn, f"launch__occupancy_limit_{name}")
              for name in ("registers", "shared_mem", "warps", "blocks", "barriers")}
    limits = {k: v for k, v in limits.items() if v is not None}
    per_sm = min(limits.values()) if limits else None
    limiter = ", ".join(k for k, v in limits.items() if v == per_sm)
    grid = math.prod(case["passes"][0]["grid"])
    waves = last = "-"
    if per_sm:
        slots = int(per_sm) * sms
        full, rest = divmod(grid, slots)
        waves = f"{grid / slots:.2f}"
        last = f"{rest or slots} / {slots}"
    shared = summed(attn, r"launch__shared_mem_per_block_(dynamic|static)")
    return [_f(metric(attn, "launch__registers_per_thread"), 1, 0), _f(shared, 1e-3, 1),
            f"{_f(per_sm, 1, 0)} ({limiter})" if per_sm else "-",
            _f(metric(attn, "sm__maximum_warps_per_active_cycle_pct"), 1, 1, "%"),
            _f(metric(attn, "sm__warps_active.avg.pct_of_peak_sustained_active"), 1, 1, "%"),
            waves, last]


def _loads(attn: dict, case: dict, sass_dir: Optional[str]) -> list[str]:
    def per_request(op: str) -> str:
        def count(unit):  # the op's total, else the sum of its cache access / bypass parts
            name = f"l1tex__t_{unit}_pipe_lsu_mem_global_op_{op}"
            return metric(attn, f"{name}.sum") or summed(attn, rf"{name}_cache_\w+\.sum")
        sectors, requests = count("sectors"), count("requests")
        return _f(sectors / requests if sectors and requests else None, 1, 1)

    widths = " / ".join(_f(metric(attn, f"smsp__sass_inst_executed_op_memory_{b}b.sum"), 1e-6,
                           2, "M") for b in (128, 64, 32, 16, 8))
    cells = [f"{per_request('ld')}, {per_request('ldgsts')}", widths, "-", "-"]
    path = Path(sass_dir or ".") / f"sass_{case['name']}.csv"
    if sass_dir is not None and path.exists():
        try:
            loads = read_sass(str(path))
        except (StopIteration, KeyError, IndexError, ValueError) as e:
            return cells[:2] + [f"unreadable ({type(e).__name__})", "-"]
        total = sum(n * w for (_, w), n in loads.items()) or 1.0
        cells[2] = ", ".join(f"{kind} {w} B {100 * n * w / total:.1f}%"
                             for (kind, w), n in sorted(loads.items(),
                                                        key=lambda x: -x[1] * x[0][1]))
        lookups = _lookups(case)
        four = sum(n for (kind, w), n in loads.items() if kind == "LDG" and w == 4)
        cells[3] = f"{four / lookups:.2f} ({four / (case['kv_bytes'] / 1024):.2f} per KiB)"
    return cells


def _f(value: Optional[float], scale: float, digits: int, suffix: str = "") -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}{suffix}"


def _pct(value: Optional[float]) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    run = sub.add_parser("launch", help="build and run the cases (under ncu)")
    run.add_argument("--cases", default=",".join(DEFAULT_CASES),
                     help=f"comma-separated, of {', '.join([*CASES, *SPARSE_CASES])}")
    run.add_argument("--runs", type=int, default=2, help="profiled runs of each case")
    run.add_argument("--manifest", default=None, help="write the launch order here (JSON)")
    read = sub.add_parser("summary", help="tables from ncu's CSV exports")
    read.add_argument("--manifest", required=True)
    read.add_argument("--raw", required=True, help="ncu -i REP --page raw --csv output")
    read.add_argument("--sass-dir", default=None,
                      help="folder of sass_<case>.csv (ncu --page source --csv) files")
    args = ap.parse_args()
    if args.mode == "launch":
        names = args.cases.split(",")
        unknown = [n for n in names if n not in CASES and n not in SPARSE_CASES]
        if unknown:
            ap.error(f"--cases {unknown}: not among {', '.join([*CASES, *SPARSE_CASES])}")
        launch(names, args.runs, args.manifest)
    else:
        manifest = json.loads(Path(args.manifest).read_text())
        print("\n".join(summary(manifest, read_raw(args.raw), args.sass_dir)))


if __name__ == "__main__":
    main()
