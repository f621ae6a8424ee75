"""Where a kernel's warps wait, from ncu's per-instruction warp-state samples.

    ncu --kernel-name regex:gluon_prefill --launch-skip 2 --launch-count 1 \\
        --section WarpStateStats --section SourceCounters -o rep python ...
    ncu -i rep.ncu-rep --page source --csv --print-source sass > sass.csv
    python tools/ncu_stalls.py sass.csv [--top 20] [--names 0x30150=k_ready,...]

Prints the samples of each code region that a `USETMAXREG` starts (a warp-specialised
partition's body, with the register count it sets: the consumers', the producer's, ...; a
partition whose samples run near the kernel's duration is busy throughout), then the
samples by class, as a markdown table: each mbarrier wait by its barrier's
shared-memory offset (the `SYNCS.PHASECHK` try-wait and the branch that spins on it; name
the offsets with --names, from the kernel's barrier order), wgmma issue and waits, the
softmax's float math, global loads and stores, idle warps (`NOP` at a barrier: partitions
that are done or have nothing to do), everything else. Then the instructions with the most
samples and their top stall reasons. This is how KERNEL_NOTES v11 found the Gluon pass's
epilogue stores (`STG.E`, `stall_lg`) holding 8-9% of the samples on short prompts.
"""

from __future__ import annotations

import argparse
import collections
import csv
import re

MATH = re.compile(r"\b(MUFU|FMUL|FADD|FFMA|FMNMX|FSEL|F2FP|FSETP)\b")
GLOBAL = re.compile(r"\b(STG|LDG)\b")
OFFSET = re.compile(r"\+(0x[0-9a-f]+)\]")
TRYWAIT = re.compile(r"TRYWAIT\s+(P\d)\b")
BRANCH = re.compile(r"@!?(P\d)\s+BRA\b")
PREDICATE_WRITE = re.compile(r"^\s*(?:@!?U?P\w+\s+)?[A-Z][\w.]*\s+(P\d)\s*,")


def load(path: str) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the source page; ncu puts a kernel-name line above the header."""
    rows = list(csv.reader(open(path)))
    start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    return rows[start], rows[start + 1:]


def spun_on(source: str, pending: dict) -> str | None:
    """The try-wait whose predicate a branch tests (ptxas schedules other instructions between
    the two on the main path; the retry loops keep them adjacent), else None. `pending` maps
    a predicate to the try-wait that last set it, in address order; this updates it."""
    branch = BRANCH.search(source)
    if branch:
        return pending.get(branch.group(1))
    wait = TRYWAIT.search(source)
    if wait:
        pending[wait.group(1)] = source
    else:
        written = PREDICATE_WRITE.match(source)
        if written:
            pending.pop(written.group(1), None)
    return None


def classify(source: str, spinning_on: str | None, names: dict) -> str:
    wait = source if "TRYWAIT" in source else spinning_on
    if wait is not None:
        m = OFFSET.search(wait)
        offset = m.group(1) if m else "?"
        return f"wait {names.get(offset, offset)}"
    if "NOP" in source:
        return "idle (NOP at a barrier)"
    if "HGMMA" in source or "WARPGROUP" in source:
        return "wgmma issue / wait"
    if "SYNCS.ARRIVE" in source:
        return "mbarrier arrive"
    if MATH.search(source):
        return "softmax math"
    if GLOBAL.search(source):
        return "global loads / stores"
    return "other"


REGS = re.compile(r"USETMAXREG\.\w+\.CTAPOOL\s+(?:UP\d+,\s*)?(0x[0-9a-f]+)")


def print_regions(samples: list, total: int) -> None:
    """Samples per code region between `USETMAXREG`s (regions under 0.5% left out), with
    each region's three largest classes. samples: (address, source, samples, class) per
    instruction, in address order."""
    regions = []  # [first address, registers, samples, classes]
    for address, source, n, name in samples:
        m = REGS.search(source)
        if m or not regions:
            regions.append([address, int(m.group(1), 16) if m else None, 0,
                            collections.Counter()])
        regions[-1][2] += n
        regions[-1][3][name] += n
    print("| region from | registers | samples | share | largest classes |")
    print("|---|---:|---:|---:|---|")
    for address, regs, n, classes in regions:
        if n >= total / 200:
            largest = ", ".join(f"{name} {c}" for name, c in classes.most_common(3))
            print(f"| {address} | {regs or '-'} | {n} | {100 * n / total:.1f}% | {largest} |")
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--names", default="",
                    help="barrier names by offset, e.g. 0x30150=k_ready,0x30160=v_ready")
    args = ap.parse_args()
    names = dict(kv.split("=") for kv in args.names.split(",") if kv)
    header, rows = load(args.csv)
    col = {name: i for i, name in enumerate(header)}
    samples = col["Warp Stall Sampling (All Samples)"]
    reasons = [i for i, h in enumerate(header) if h.startswith("stall_") and "Not Issued" not in h]
    classes: collections.Counter = collections.Counter()
    per_instruction, top = [], []
    pending: dict = {}
    for r in rows:
        n = int(r[samples] or 0)
        source, address = r[col["Source"]], r[col["Address"]][-6:]
        name = classify(source, spun_on(source, pending), names)
        classes[name] += n
        per_instruction.append((address, source, n, name))
        why = sorted(((int(r[i] or 0), header[i]) for i in reasons), reverse=True)[:3]
        top.append((n, address, source.strip()[:70], why))
    total = sum(classes.values()) or 1
    print(f"{total} samples\n")
    print_regions(per_instruction, total)
    print("| class | samples | share |\n|---|---:|---:|")
    for name, n in classes.most_common():
        print(f"| {name} | {n} | {100 * n / total:.1f}% |")
    print("\n| samples | share | address | instruction | top stall reasons |")
    print("|---:|---:|---|---|---|")
    for n, address, source, why in sorted(top, reverse=True)[:args.top]:
        text = ", ".join(f"{h.removeprefix('stall_')} {c}" for c, h in why if c)
        print(f"| {n} | {100 * n / total:.1f}% | {address} | `{source}` | {text} |")


if __name__ == "__main__":
    main()
