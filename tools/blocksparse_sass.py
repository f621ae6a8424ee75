"""The block-sparse decode kernel's variants compiled for sm_90a without a GPU: registers,
spills, shared memory, programs an SM and the key loop's instructions per key.

    /work/venv36/bin/python tools/blocksparse_sass.py [--tree ROOT] [--kv e4m3|bf16|both]
        [--patterns p1,p8,h8] [--variants "default;..."] [--split] [--dump DIR]

Runs with a Python whose Triton is 3.6.0 (the GPU machine's; no torch or driver needed):
`tools/sass_mix.py`'s tree import and argument specialisation, the kernel
(`blocksparse_decode._decode_kernel`) compiled as `paged_decode` launches it for 32 q / 8 KV
heads, head 128, cache block 16, sparse block 64, local 4 (p1 / p8: per head, vert_stride 1 /
8; h8: homo head, vert_stride 8), a bf16 q over a bf16 or an e4m3 cache. A variant is its
tiles (BLOCK_N, warps, stages[, maxnreg]) and the kernel switches it sets (`VARIANTS`);
`--split` compiles the split-KV form (partials) instead. Columns: registers, stack, spill
instructions (STL + LDL), shared memory, programs an SM (H100 / H200 limits), the key loop's
body (the innermost loop around the HMMAs: instructions, per key, and its LDGSTS, LDG, LDS,
STS, LDSM, HMMA, F2FP (conversions), PRMT, BAR (all BAR.SYNC there), and its global loads
by width: "16 LDGSTS.128" is 16 cp.async of 16 bytes a thread). `--dump DIR` writes each
variant's SASS (DIR/<kv>_<pattern>_<variant>.sass) for a byte-for-byte comparison of two
trees; a tree whose kernel lacks a switch compiles without it (the variants that need it
fail by name).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

from sass_mix import compile_args, use_tree

H, HKV, D, PAGE = 32, 8, 128, 16
# pattern key -> (step_size, PER_KV_HEAD, NUM_RESIDUES, VERT): the kernel's view of issue
# 19's rows (per head: head_sliding_step 1, 4 classes of 8 among a KV head's 4 heads)
PATTERNS = {"p1": (1, False, 1, 1), "p8": (1, False, 4, 8), "h8": (0, False, 1, 8)}
# name -> (tiles by kv dtype, kernel switches); tiles None: the defaults of
# `blocksparse_schedule.default_tiles` on the GPU (key lines at head 128)
DEFAULT_TILES = {"bf16": (64, 4, 2, 128), "e4m3": (128, 4, 2, 168)}
VARIANTS = {
    "default": (None, {}),
    "64 keys, 2 stages, 128 regs": ((64, 4, 2, 128), {}),
    "128 keys, 168 regs": ((128, 4, 2, 168), {}),
    "128 keys": ((128, 4, 2), {}),
    "256 keys, 2 stages": ((256, 4, 2), {}),
    "256 keys, 8 warps, 2 stages": ((256, 8, 2), {}),
    "page lines": (None, dict(PAGE_LINES=True)),
    "page lines, 168 regs": ((128, 4, 2, 168), dict(PAGE_LINES=True)),
    "page lines, 64 keys, 128 regs": ((64, 4, 2, 128), dict(PAGE_LINES=True)),
    "page lines, 128 keys": ((128, 4, 2), dict(PAGE_LINES=True)),
    "slot sums": (None, dict(SLOT_SUMS=True)),
    "page lines, slot sums": (None, dict(PAGE_LINES=True, SLOT_SUMS=True)),
    "page lines, slot sums, 168 regs": ((128, 4, 2, 168), dict(PAGE_LINES=True,
                                                               SLOT_SUMS=True)),
    "slot sums, 168 regs": ((128, 4, 2, 168), dict(SLOT_SUMS=True)),
    # page lines with V as lines too over every cache (over bf16 V goes by key otherwise)
    "page lines, value lines": (None, dict(PAGE_LINES=True, VALUE_LINES=True)),
    "page lines, value lines, 168 regs": ((128, 4, 2, 168), dict(PAGE_LINES=True,
                                                                   VALUE_LINES=True)),
    "page lines, value lines, slot sums": (None, dict(PAGE_LINES=True, VALUE_LINES=True,
                                                      SLOT_SUMS=True)),
    "page lines, 256 keys, 8 warps": ((256, 8, 2), dict(PAGE_LINES=True)),
}
# their values in today's launch (VALUE_LINES: over fp8 caches, as `value_lines` gives)
KERNEL_SWITCHES = {"PAGE_LINES": False, "SLOT_SUMS": False}
OPS = ("LDGSTS", "LDG", "LDS", "STS", "LDSM", "HMMA", "F2FP", "PRMT", "BAR")


def kernel_values(kv: str, pattern: str, block_n: int, split: bool, switches: dict) -> dict:
    """`_decode_kernel`'s arguments by name, as `paged_decode` passes them."""
    step, per_kv_head, residues, vert = PATTERNS[pattern]
    fp8 = kv == "e4m3"
    cache = "*fp8e4nv" if fp8 else "*bf16"
    return dict(
        Q="*bf16", KC=cache, VC=cache, Out="*bf16", PartOut="*fp32" if split else None,
        PartLse="*fp32" if split else None, block_tables="*i32", seq_lens="*i32",
        alibi_slopes=None, k_scale="*fp32" if fp8 else None,
        v_scale="*fp32" if fp8 else None, qk_scale=0.1, head_base=0, step_size=step,
        stride_qs=H * D, stride_qh=D, stride_kb=HKV * D * PAGE, stride_vb=HKV * D * PAGE,
        stride_bt=2048, stride_os=H * D, stride_oh=D, GROUP=H // HKV,
        PER_KV_HEAD=per_kv_head, NUM_RESIDUES=residues, BLOCK_M=16, PAGE=PAGE,
        X=16 if fp8 else 8, SBS=64, LOCAL=4, VERT=vert, HEAD_D=D, BLOCK_D=D, BLOCK_N=block_n,
        CHUNK=min(block_n, 64), DOT_DTYPE="tl.float16" if fp8 else "tl.bfloat16",
        KEY_LINES=True, **{**KERNEL_SWITCHES, "VALUE_LINES": fp8, **switches})


def programs_per_sm(registers: int, shared: int, warps: int) -> int:
    """Programs an SM: 64K registers (granted per warp in units of 256), 228 KB of shared
    memory (1 KB reserved a program), 64 warps."""
    per_warp = -(-registers * 32 // 256) * 256
    return min(65536 // (per_warp * warps), 233472 // (shared + 1024), 64 // warps)


def sass_of(cubin: bytes) -> tuple[str, str]:
    """(cuobjdump's SASS, its resource usage) of a cubin."""
    from triton import knobs
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        tool = knobs.nvidia.cuobjdump.path
        run = [subprocess.run([tool, flag, path], capture_output=True, text=True).stdout
               for flag in ("-sass", "--dump-resource-usage")]
    return run[0], run[1]


def key_loop(sass: str) -> tuple[Counter, Counter]:
    """The opcodes of the innermost loop around HMMAs (the key loop's body; the peeled last
    tile is outside it), and its global loads by width (`load_width`)."""
    lines = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)"
                     r"([.A-Z0-9_]*)(.*)", line)
        if m:
            lines.append((int(m.group(1), 16), m.group(2), m.group(3), m.group(4)))
    loops = []
    for address, op, _, operands in lines:
        target = re.search(r"0x([0-9a-f]+)", operands) if op == "BRA" else None
        if target and int(target.group(1), 16) < address:
            loops.append((int(target.group(1), 16), address))
    best, loads = Counter(), Counter()
    for lo, hi in loops:
        body = Counter(op for a, op, _, _ in lines if lo <= a <= hi)
        if body["HMMA"] and (not best or sum(body.values()) < sum(best.values())):
            best = body
            loads = Counter(load_width(op, mods) for a, op, mods, _ in lines
                            if lo <= a <= hi and op in ("LDG", "LDGSTS"))
    return best, loads


def load_width(op: str, modifiers: str) -> str:
    """A global load's opcode and width in bits (LDG.E is 32 bits; .64 / .128 / .U16 say
    theirs): "LDGSTS.128", "LDG.32"."""
    widths = {"128": 128, "64": 64, "U16": 16, "S16": 16, "U8": 8, "S8": 8}
    bits = next((widths[m] for m in modifiers.split(".") if m in widths), 32)
    return f"{op}.{bits}"


def compile_one(kv: str, pattern: str, name: str, split: bool) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    from pagedattn.ops.triton import blocksparse_decode
    tiles, switches = VARIANTS[name]
    tiles = tiles or DEFAULT_TILES[kv]
    kernel = blocksparse_decode._decode_kernel  # noqa: SLF001 (the kernel is what we compile)
    params = {p.name for p in kernel.params}
    missing = set(switches) - params
    if missing:
        return dict(error=f"this tree's kernel has no {sorted(missing)}")
    values = {k: v for k, v in kernel_values(kv, pattern, tiles[0], split, switches).items()
              if k in params}
    options = dict(num_warps=tiles[1], num_stages=tiles[2])
    if len(tiles) == 4:
        options["maxnreg"] = tiles[3]
    compiled = triton.compile(ASTSource(kernel, *compile_args(kernel, values)),
                              target=GPUTarget("cuda", 90, 32), options=options)
    sass, usage = sass_of(compiled.asm["cubin"])
    found = {k: int(m.group(1)) for k in ("REG", "STACK")
             if (m := re.search(rf"{k}:(\d+)", usage))}
    ops = Counter(m.group(1) for m in re.finditer(r"\s([A-Z][A-Z0-9_]+)[. ]", sass))
    loop, loads = key_loop(sass)
    shared = compiled.metadata.shared
    return dict(sass=sass, tiles=tiles, regs=found.get("REG", -1), stack=found.get("STACK", -1),
                spills=ops["STL"] + ops["LDL"], smem=shared,
                per_sm=programs_per_sm(found.get("REG", 255), shared, tiles[1]),
                loop=sum(loop.values()), per_key=sum(loop.values()) / tiles[0],
                loads=", ".join(f"{n} {w}" for w, n in sorted(loads.items())) or "-",
                **{op: loop[op] for op in OPS})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", default=os.path.join(os.path.dirname(__file__), ".."),
                    help="the source tree to compile (holds src/pagedattn)")
    ap.add_argument("--kv", default="e4m3", choices=("e4m3", "bf16", "both"))
    ap.add_argument("--patterns", default="p1,p8,h8")
    ap.add_argument("--variants", default=";".join(VARIANTS))
    ap.add_argument("--split", action="store_true", help="the split-KV form (partials)")
    ap.add_argument("--dump", default=None, help="write each variant's SASS here")
    args = ap.parse_args()
    use_tree(os.path.abspath(args.tree))
    names = [n.strip() for n in args.variants.split(";")]
    for name in names:
        if name not in VARIANTS:
            ap.error(f"--variants: {name!r} is not one of {list(VARIANTS)}")
    kvs = ("bf16", "e4m3") if args.kv == "both" else (args.kv,)
    print("| kv | pattern | variant | tiles | regs | stack | spills | smem | per SM | loop | "
          "per key | " + " | ".join(OPS) + " | global loads |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(OPS) + "---|")
    for kv in kvs:
        for pattern in args.patterns.split(","):
            for name in names:
                try:
                    r = compile_one(kv, pattern, name, args.split)
                except Exception as exc:  # a variant that does not compile: say why, go on
                    r = dict(error=f"{type(exc).__name__}: {str(exc)[-300:]}")
                if "error" in r:
                    print(f"| {kv} | {pattern} | {name} | FAILED: {r['error']} |")
                    continue
                if args.dump:
                    os.makedirs(args.dump, exist_ok=True)
                    file = re.sub(r"\W+", "_", f"{kv}_{pattern}_{name}") + ".sass"
                    with open(os.path.join(args.dump, file), "w") as f:
                        f.write(r["sass"])
                cells = [str(r["tiles"]), r["regs"], r["stack"], r["spills"], r["smem"],
                         r["per_sm"], r["loop"], f"{r['per_key']:.2f}"] + [r[op] for op in OPS]
                cells.append(r["loads"])
                print(f"| {kv} | {pattern} | {name} | " + " | ".join(map(str, cells)) + " |")
                sys.stdout.flush()


if __name__ == "__main__":
    main()
