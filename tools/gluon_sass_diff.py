"""Compare the SASS of two `gluon_sass.py --dump` folders, variant by variant (no GPU needed;
`gluon_decode_sass.py --dump` folders too: each variant's one SASS listing is compared).

    python tools/gluon_sass_diff.py OLD_DUMP NEW_DUMP

For the same kernel compiled from two trees (dump the old tree's variants with its own
gluon_sass.py, the new tree's with its own), one line per variant:
- `identical`: the same instructions in the same order (addresses and encodings aside);
- otherwise the instruction counts, the opcodes whose counts moved, and whether the rest is
  the same once the kernel-parameter plumbing is set aside (ULDC / LDC constant loads and
  the UMOV / NOP around them, which move when a parameter's offset does), register
  numbers, reuse flags and branch targets are normalised: "same order" (only the plumbing
  moved), "same multiset" (ptxas scheduled the same instructions differently), or the
  instructions that differ.
Exit status 0 when every variant of OLD_DUMP has a counterpart in NEW_DUMP.
"""

from __future__ import annotations

import os
import re
import sys
from collections import Counter

PLUMBING = {"ULDC", "ULDC.64", "LDC", "LDC.64", "UMOV", "NOP"}
BRANCHES = ("BRA", "BSSY", "CALL", "JMP", "BRX")


def instructions(path: str) -> list[str]:
    """The instructions of a cuobjdump SASS listing, without addresses and encodings."""
    out = []
    with open(path) as f:
        for line in f:
            m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(.*?)\s*;", line)
            if m:
                out.append(m.group(1))
    return out


def opcode(ins: str) -> str:
    return re.sub(r"^@!?U?P[T\d]\s+", "", ins).split()[0]


def normalised(ins: list[str]) -> list[str]:
    """The instructions but the parameter plumbing, with registers, predicates, reuse flags,
    parameter offsets and branch targets made anonymous."""
    out = []
    for x in ins:
        op = opcode(x)
        if op in PLUMBING:
            continue
        if op.startswith(BRANCHES):
            x = re.sub(r"0x[0-9a-f]+", "TARGET", x)
        x = x.replace(".reuse", "")
        x = re.sub(r"c\[0x0\]\[0x[0-9a-f]+\]", "c[param]", x)
        x = re.sub(r"\bU?R\d+\b", "R", x)
        x = re.sub(r"\bU?P\d\b", "P", x)
        out.append(x)
    return out


def compare(old: list[str], new: list[str]) -> str:
    if old == new:
        return f"identical ({len(old)} instructions)"
    a, b = Counter(map(opcode, old)), Counter(map(opcode, new))
    moved = {k: b[k] - a[k] for k in sorted(set(a) | set(b)) if a[k] != b[k]}
    line = f"{len(old)} -> {len(new)} instructions, opcode counts {moved or 'unchanged'}; "
    rest_a, rest_b = normalised(old), normalised(new)
    if rest_a == rest_b:
        return line + "rest: same order"
    bag_a, bag_b = Counter(rest_a), Counter(rest_b)
    if bag_a == bag_b:
        return line + "rest: same multiset (scheduled differently)"
    diff = [f"{bag_a[k]} -> {bag_b[k]} x {k}" for k in sorted(set(bag_a) | set(bag_b))
            if bag_a[k] != bag_b[k]]
    return line + "rest differs: " + "; ".join(diff)


def _sass(folder: str) -> str | None:
    """The SASS listing a variant's folder holds (one kernel a folder), or None."""
    if not os.path.isdir(folder):
        return None
    names = sorted(n for n in os.listdir(folder) if n.endswith(".sass"))
    return os.path.join(folder, names[0]) if names else None


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__)
        return 2
    old_dir, new_dir = argv[1:]
    ok = True
    for name in sorted(os.listdir(old_dir)):
        old, new = (_sass(os.path.join(d, name)) for d in (old_dir, new_dir))
        if old is None:
            continue
        if new is None:
            print(f"{name}: missing in {new_dir}")
            ok = False
            continue
        print(f"{name}: {compare(instructions(old), instructions(new))}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
