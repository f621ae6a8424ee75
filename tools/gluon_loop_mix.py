"""The instructions a consumer thread issues per key tile of the Gluon prefill and decode
kernels, from `gluon_sass.py --dump` / `gluon_decode_sass.py --dump` folders (no GPU needed).

    python tools/gluon_loop_mix.py DUMP [DUMP ...] [--only TEXT] [--converter]

For each variant: the first pipelined tile loop in the SASS (the backward branch whose body
holds both a wgmma wait for S, `WARPGROUP.DEPBAR.LE gsb0, 0x1`, and one for P V, `0x0`:
consumer 0's `for j in range(1, n_pipe)`), and every path through its body (forward
branches taken or not; branches out of the body, the mbarrier waits' retry loops, not
taken): the instructions on each path, MUFU.EX2, FFMA, FMUL, FADD, FMNMX (with their suffixed
forms, FMUL.FTZ ...) and the rest. Any folder of one cuobjdump SASS listing reads alike
(FA3's kernels from its wheel: KERNEL_NOTES v46).
Paths differ by the masked or unmasked softmax (`gluon_softmax.softmax_tile`'s two
branches) and, where O's rescale is a branch (`Scores.MAX_SLACK` >= 0), by whether it
runs. A row per distinct path, fewest instructions first; `spills` counts its local-memory
loads and stores (STL / LDL: ptxas out of registers inside the loop).
--converter: the fp8 converter warps' tile loop instead (the innermost loop that stores to
shared memory, STS / STSM, with no wgmma or TMA load: `gluon_convert.convert_v` a trip),
its paths (a full tile, the sequence's last with its tail zeroed) with the instructions a
converted element takes (F2FP, PRMT, LDS / LDSM loads, STS / STSM stores).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections import Counter

LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
KINDS = ("MUFU.EX2", "FFMA", "FMUL", "FADD", "FMNMX")
# the converter's: opcodes counted by their first part (LDS.64, LDS.U8, ... are LDS)
CONVERTER_KINDS = ("F2FP", "PRMT", "LDS", "LDSM", "STS", "STSM")


def parse(path: str) -> list[tuple[int, str, str, bool]]:
    """(address, opcode, operands, predicated) of each instruction."""
    out = []
    with open(path) as f:
        for line in f:
            m = LINE.search(line)
            if m:
                out.append((int(m.group(1), 16), m.group(3), m.group(4).strip(), bool(m.group(2))))
    return out


def main_loop(ins) -> tuple[int, int] | None:
    """(first, last) index of the first loop body with an S wait and a P V wait; failing
    that, of the first whose body waits for all wgmmas twice around a tile's exponentials
    (the wide head-128 form, `gluon_consumer`'s PV_FIRST: P V, then S, each waited for)."""
    index = {a: i for i, (a, *_rest) in enumerate(ins)}
    backs = []
    for i, (addr, op, args, _) in enumerate(ins):
        if op != "BRA":
            continue
        target = _target(args)
        if target is None or target >= addr or target not in index:
            continue
        body = ins[index[target]:i + 1]
        backs.append((index[target], i, body))
        waits = {a for _, o, a, _ in body if o == "WARPGROUP.DEPBAR.LE"}
        if any(w.endswith("0x1") for w in waits) and any(w.endswith("0x0") for w in waits):
            return index[target], i
    for first, last, body in backs:
        waits = [a for _, o, a, _ in body if o == "WARPGROUP.DEPBAR.LE"]
        if len(waits) >= 2 and sum(o == "MUFU.EX2" for _, o, _, _ in body) >= 32:
            return first, last
    return None


def converter_loop(ins) -> tuple[int, int] | None:
    """(first, last) index of the innermost loop whose body stores to shared memory and holds
    no wgmma or TMA load: the converter partition's tile loop."""
    index = {a: i for i, (a, *_rest) in enumerate(ins)}
    found = []
    for i, (addr, op, args, _) in enumerate(ins):
        target = _target(args) if op == "BRA" else None
        if target is None or target >= addr or target not in index:
            continue
        ops = [o for _, o, _, _ in ins[index[target]:i + 1]]
        if any(o.startswith(("STS", "STSM")) for o in ops) and \
                not any("GMMA" in o or o.startswith("UTMALDG") for o in ops):
            found.append((index[target], i))
    inner = [(a, b) for a, b in found
             if not any((a, b) != (c, d) and a <= c and d <= b for c, d in found)]
    return max(inner, key=lambda ab: ab[1] - ab[0]) if inner else None


def _target(args: str) -> int | None:
    m = re.search(r"0x([0-9a-f]+)\s*$", args.strip())
    return int(m.group(1), 16) if m else None


def paths(ins, first: int, last: int, limit: int = 64) -> list[Counter]:
    """The opcode counts of each path from ins[first] to the back edge ins[last]."""
    index = {ins[i][0]: i for i in range(first, last + 1)}
    found: list[Counter] = []

    def walk(i: int, counts: Counter) -> None:
        while len(found) < limit:
            addr, op, args, pred = ins[i]
            counts[op] += 1
            if i == last:
                found.append(counts)
                return
            if op == "BRA":
                t = _target(args)
                inside = t is not None and t in index and t > addr
                if inside and pred:
                    walk(index[t], counts.copy())
                elif inside:
                    i = index[t]
                    continue
            i += 1

    walk(first, Counter())
    return found


def sass_of(folder: str) -> str | None:
    """The SASS listing a variant's folder holds (one kernel a folder), or None."""
    names = sorted(n for n in os.listdir(folder) if n.endswith(".sass")) \
        if os.path.isdir(folder) else []
    return os.path.join(folder, names[0]) if names else None


def rows(dump: str, only: str | None, converter: bool = False) -> list[str]:
    out = []
    kinds = CONVERTER_KINDS if converter else KINDS
    for name in sorted(os.listdir(dump)):
        path = sass_of(os.path.join(dump, name))
        if (only and only not in name) or path is None:
            continue
        ins = parse(path)
        loop = converter_loop(ins) if converter else main_loop(ins)
        if loop is None:
            out.append(f"| {name} | no such loop found |" + " |" * (len(kinds) + 2))
            continue
        seen = set()
        for counts in sorted(paths(ins, *loop), key=lambda c: sum(c.values())):
            if converter:  # by the opcode's first part
                counts = Counter({k: n for k, n in _by_base(counts).items()})
            else:  # FMUL.FTZ as FMUL (nvcc's fast-math forms: FA3's listing)
                counts = Counter({_kind_of(op): n for op, n in counts.items()})
            key = tuple(sorted(counts.items()))
            if key in seen:
                continue
            seen.add(key)
            total = sum(counts.values())
            rest = total - sum(counts[k] for k in kinds)
            spills = sum(n for op, n in counts.items() if op.startswith(("STL", "LDL")))
            out.append(f"| {name} | {total} | " + " | ".join(str(counts[k]) for k in kinds)
                       + f" | {rest} | {spills} |")
    return out


def _kind_of(op: str) -> str:
    """The KINDS entry an opcode counts as (itself, or a kind its suffixes refine)."""
    return next((k for k in KINDS if op.startswith(k + ".")), op)


def _by_base(counts: Counter) -> Counter:
    """Opcode counts merged by the opcode's first part (LDS.64 -> LDS, STSM.16.M88.4 ->
    STSM)."""
    out: Counter = Counter()
    for op, n in counts.items():
        out[op.split(".")[0]] += n
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dumps", nargs="+")
    ap.add_argument("--only")
    ap.add_argument("--converter", action="store_true",
                    help="the fp8 converter's tile loop instead of the consumer's")
    args = ap.parse_args(argv)
    kinds = CONVERTER_KINDS if args.converter else KINDS
    print("| variant | instructions a tile | " + " | ".join(kinds) + " | other | spills |")
    print("|---|---:|" + "---:|" * (len(kinds) + 2))
    for dump in args.dumps:
        for row in rows(dump, args.only, args.converter):
            print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
