"""The fp8 decode pass's V-load variants compiled for sm_90a without a GPU: registers, spills
and where the loads sit in the key loop.

    /work/venv36/bin/python tools/fp8_decode_sass.py [--dump DIR]

A Python with Triton 3.6 (the GPU's; no torch or driver needed) compiles the decode pass as
the plan launches it over an e4m3 cache (32 q / 8 KV heads, head 128, block 16, split-KV as
B64 L16k runs; `sass_mix.compile_kernel`) once per variant of `launch.SWITCHES.fp8_decode_v`
(the FP8_V_IN_REGS constexpr: True today, "first", "ahead", "kv_ahead") and per tile choice.
Per variant: registers, stack, spill stores / loads (STL / LDL), shared memory, the CTAs an
SM holds (H100 limits), and the key loop's body in order, runs of one opcode counted: where
the global loads (`LDG`; `LDG.E.128` carries V's fp8 bytes, the 32-bit ones the block
table), the cp.async copies (`LDGSTS`, K's tiles), the barriers (`BAR.SYNC`), exp2
(`MUFU.EX2`), conversions (`F2FP`) and the MMAs (`HMMA`) sit against each other.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import sass_mix  # noqa: E402

# (label, FP8_V_IN_REGS, block_n, warps, stages): today's tiles (launch.decode_config: 128
# keys, 4 warps, 3 stages over an fp8 cache) under each V load, then other tiles.
VARIANTS = (
    ("today (V after the softmax)", True, 128, 4, 3),
    ("first (V beside K)", "first", 128, 4, 3),
    ("ahead (V one tile ahead)", "ahead", 128, 4, 3),
    ("kv_ahead (K and V one tile ahead)", "kv_ahead", 128, 4, 3),
    ("today, 2 stages", True, 128, 4, 2),
    ("today, 64 keys, 4 stages", True, 64, 4, 4),
    ("ahead, 64 keys, 3 stages", "ahead", 64, 4, 3),
    ("ahead, 2 stages", "ahead", 128, 4, 2),
)
SHOWN = ("LDG", "LDGSTS", "BAR", "HMMA", "MUFU", "F2FP", "LDSM", "STS", "LDS", "STL", "LDL",
         "DEPBAR", "SHFL")


def loop_body(sass: str) -> list[str]:
    """The opcodes (with suffixes) of the innermost loop that holds an HMMA."""
    lines, loops = [], []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)"
                     r"([.A-Z0-9_]*)(.*)", line)
        if not m:
            continue
        address, op, suffix, operands = m.groups()
        lines.append((int(address, 16), op + suffix))
        target = re.search(r"0x([0-9a-f]+)", operands) if op == "BRA" else None
        if target and int(target.group(1), 16) < int(address, 16):
            loops.append((int(target.group(1), 16), int(address, 16)))
    inner = [(lo, hi) for lo, hi in loops
             if not any((lo, hi) != o and lo <= o[0] and o[1] <= hi for o in loops)]
    for lo, hi in sorted(inner, key=lambda r: r[0] - r[1]):  # the largest such loop
        body = [op for a, op in lines if lo <= a <= hi]
        if any(op.startswith("HMMA") for op in body):
            return body
    return []


def timeline(body: list[str]) -> str:
    """The loop body's shown opcodes in order, runs counted, with each run's first index."""
    runs = []
    for i, op in enumerate(body):
        if op.split(".")[0] not in SHOWN:
            continue
        if runs and runs[-1][1] == op:
            runs[-1][2] += 1
        else:
            runs.append([i, op, 1])
    return " ".join(f"{i}:{op}" + (f"x{n}" if n > 1 else "") for i, op, n in runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dump", help="write each variant's SASS to this folder")
    args = ap.parse_args()
    root = os.path.dirname(HERE)
    sass_mix.load_tree(root)
    from pagedattn.ops.triton.attention import attention_kernel

    rows = []
    for label, mode, block_n, warps, stages in VARIANTS:
        values = dict(sass_mix.portable_args(True, True, 16, block_n, 64, 64, True, fp8=True),
                      FP8_V_IN_REGS=mode)
        compiled = sass_mix.compile_kernel(attention_kernel, warps, stages, values, {})
        sass, usage = sass_mix.sass_and_usage(compiled.asm["cubin"])
        regs = int(re.search(r"REG:(\d+)", usage).group(1))
        stack = int(re.search(r"STACK:(\d+)", usage).group(1))
        body = loop_body(sass)
        ops = Counter(op.split(".")[0] for op in body)
        all_ops = Counter(re.findall(r"\b(STL|LDL)\b", sass))
        smem = compiled.metadata.shared
        rows.append(f"| {label} | {block_n},{warps},{stages} | {regs} | {stack} | "
                    f"{all_ops['STL']}/{all_ops['LDL']} | {smem} | "
                    f"{sass_mix.ctas_per_sm(regs, smem, warps)} | {len(body)} | "
                    f"{ops['LDG']} | {ops['LDGSTS']} | {ops['BAR']} | {ops['HMMA']} |")
        print(f"### {label} ({block_n} keys, {warps} warps, {stages} stages)\n"
              f"{timeline(body)}\n", flush=True)
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            name = re.sub(r"[^a-z0-9]+", "_", label.lower()).strip("_")
            with open(os.path.join(args.dump, f"{name}.sass"), "w") as f:
                f.write(sass)
    print("| variant | tiles | regs | stack | STL/LDL | smem | CTAs/SM | loop instrs | LDG | "
          "LDGSTS | BAR | HMMA |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
