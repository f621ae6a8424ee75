"""Compare, in PTX, the float operations batch-invariant decodes get from the `tl` invariant
pass at its decode tiles and from the Gluon invariant decode kernel (no GPU needed).

    /work/venv36/bin/python tools/invariant_decode_ptx.py [--cache bf16|e4m3] [--head 128]
        [--group 4] [--dump DIR]

Both compile for sm_90a with Triton 3.6 (the GPU's; torch is stubbed for the `tl` kernel's
modules, as `sass_mix.py` does): the `tl` pass as `invariant_plan` launches it for decodes
alone (64 rows, 4 warps, 3 stages, 64-key tiles, 1,024-key splits folded in the program, no
fused multiply-adds), the Gluon kernel as `gluon_decode_invariant_launch` does. A row's
bits follow the MMA instructions and its float operations in order, so the script prints
for each kernel:
- the SASS HGMMA forms (shape, types, flags) and the counts of the float instructions
  (mul.rn / add.rn / sub.rn / ex2.approx.ftz / fma / div / max / shuffles);
- the row sum of each tile's weights as an expression tree: PTX is read in program order,
  each register standing for its latest definition, max
  reductions opaque (a max is exact in any order), adds with their operands sorted (an
  IEEE add commutes, it does not associate). The distinct trees of the two kernels must be
  the same set; so must the trees of the `l * alpha + sum` update (l standing for the
  running sum, whatever defined it).
Exit status 0 when the HGMMA forms and the trees agree and neither kernel has a fused
multiply-add outside libdevice's log2 (counted apart).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import os
import re
import subprocess
import sys
import tempfile
import types
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")
SRC = os.path.join(ROOT, "src", "pagedattn", "ops", "triton")
sys.path.insert(0, HERE)
import gluon_compile  # noqa: E402 - the Gluon compile tool's driver
import gluon_decode_sass  # noqa: E402 - the Gluon kernel's compile specs
import sass_mix  # noqa: E402 - the `tl` kernels' compile machinery

FLOAT_OPS = ("mul.rn.f32", "add.rn.f32", "sub.rn.f32", "ex2.approx.ftz.f32", "max.f32",
             "div.full.f32", "div.rn.f32", "fma.rn.f32", "fma.rn.ftz.f32", "mul.f32",
             "add.f32", "shfl.sync.bfly.b32")
COMMUTES = ("add.rn.f32", "add.f32", "mul.rn.f32", "mul.f32")


def tl_compile(head: int, group: int, cache: str, dump: str) -> None:
    """The `tl` invariant kernel at its decode tiles, its PTX and cubin written to dump."""
    try:
        import torch  # noqa: F401
    except ImportError:
        sys.modules["torch"] = sass_mix._StubModule("torch")
    for pkg in ("pagedattn", "pagedattn.ops", "pagedattn.ops.triton"):
        mod = types.ModuleType(pkg)
        mod.__path__ = [os.path.join(ROOT, "src", *pkg.split("."))]
        sys.modules[pkg] = mod
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    kernel = importlib.import_module("pagedattn.ops.triton.attention").invariant_attention_kernel
    fp8 = cache == "e4m3"
    values = sass_mix._portable(False, False, 64, 64, 32, 32, True, fp8)
    del values["DECODE_PASS"]
    if cache == "fp16":
        values.update(Q="*fp16", K="*fp16", V="*fp16", Out="*fp16", DOT_DTYPE="tl.float16")
    values.update(HEAD_D=head, HEAD_DV=head, SPLIT_KEYS=1024, MAX_Q_LEN=None, GROUP=group,
                  stride_qt=8 * group * head, stride_kb=16 * 8 * head, stride_ks=8 * head,
                  stride_kh=head, stride_vb=16 * 8 * head, stride_vs=8 * head, stride_vh=head)
    compiled = triton.compile(ASTSource(kernel, *sass_mix.compile_args(kernel, values)),
                              target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=4, num_stages=3, enable_fp_fusion=False))
    os.makedirs(dump, exist_ok=True)
    with open(os.path.join(dump, "tl_invariant.ptx"), "w") as f:
        f.write(compiled.asm["ptx"])
    with open(os.path.join(dump, "tl_invariant.cubin"), "wb") as f:
        f.write(compiled.asm["cubin"])


def hgmma_forms(cubin: str) -> Counter:
    """The HGMMA instructions of a cubin's SASS, registers and descriptors set aside: shape,
    types and flags (cuobjdump from Triton's wheel)."""
    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    sass = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True,
                          check=True).stdout
    forms = Counter()
    for m in re.finditer(r"\b(HGMMA\.[\w.]+)\s+([^;]*);", sass):
        flags = [a.strip() for a in m.group(2).split(",")
                 if not re.match(r"\s*-?(U?R\d+|gdesc\[|RZ$|URZ$)", a.strip())]
        forms[" ".join([m.group(1)] + flags)] += 1
    return forms


def gluon_ptx(head: int, group: int, cache: str, tool: str, dump: str) -> str:
    """The Gluon invariant decode kernel's PTX (compiled by the shared compile tool)."""
    spec = gluon_decode_sass.invariant_spec(head, group, cache, False, {})
    name = f"inv_{cache}_h{head}_g{group}"
    done = gluon_compile.compile_variant(tool, gluon_decode_sass.INVARIANT_KERNEL,
                                         gluon_decode_sass.INVARIANT_NAME, name, spec, dump)
    failed = done.failure_row(name)
    if failed:
        sys.exit(f"the Gluon kernel did not compile: {failed[1]}")
    with open(done.stage("ptx")) as f:
        return f.read()


def _statements(ptx: str) -> list[tuple[str, list[str], str]]:
    """(opcode, register operands, text) of each instruction, in program order."""
    out = []
    for line in ptx.splitlines():
        m = re.match(r"\s*(?:@!?%p\d+\s+)?([a-z][\w.]*)\s*(.*?);\s*$", line)
        if m:
            out.append((m.group(1), re.findall(r"%[a-z]+\d+", m.group(2)), m.group(2)))
    return out


def trees(ptx: str) -> tuple[Counter, Counter]:
    """(row-sum trees, `l * alpha + sum` trees), as digests with a readable form."""
    defs: dict[str, str] = {}
    sums, updates = Counter(), Counter()
    run, last_op = 0, ""
    products: dict[str, list[str]] = {}
    for op, regs, text in _statements(ptx):
        if op.startswith("wgmma.mma_async"):
            groups = re.findall(r"\{([^}]*)\}", text)
            kind = "S" if len(groups) == 1 else "O"  # P V takes P from registers
            for k, reg in enumerate(re.findall(r"%r\d+", groups[0])):
                defs[reg] = f"{kind}{k}"
            continue
        if not regs:
            continue
        dst, srcs = regs[0], regs[1:]
        if op.startswith("mov.") and len(srcs) == 1:
            defs[dst] = defs.get(srcs[0], "?")
            continue
        if op.startswith("max."):
            defs[dst] = "M"
            continue
        if op.startswith("ex2."):  # a weight: its element's place in the thread's tile
            run = run + 1 if last_op.startswith("ex2.") else 0
            last_op = op
            defs[dst] = f"e({run})"
            continue
        last_op = op
        if op.startswith(("add.", "sub.", "mul.", "selp.", "shfl.", "fma.", "neg.")):
            args = [defs.get(r, "?") for r in srcs if not r.startswith("%p")]
            if op.startswith("shfl."):
                args = args[:1] + [text.split(",")[2].strip()]
            if op in COMMUTES:
                args = sorted(args)
            node = f"{op.split('.')[0]}({','.join(args)})"
            defs[dst] = node
            if op.startswith("mul."):
                products[node] = args
            # a row's whole sum: the thread's weights, then two butterfly levels (3 shuffles
            # in the string: the first level's appears in both operands of the second)
            if op.startswith("add.") and node.count("e(") >= 8 and node.count("shfl(") == 3:
                scaled = [a for a in args if a in products]
                if not scaled:
                    sums[_digest(node)] += 1
                elif len(args) == 2:  # l * alpha + sum: l (loop-carried or not) as "l"
                    alpha = [a for a in products[scaled[0]] if "e(" in a] or ["?"]
                    total = [a for a in args if a not in products][0]
                    updates[_digest(f"add(mul(l,{alpha[0]}),{total})")] += 1
            continue
        defs[dst] = "?"
    return sums, updates


def _digest(node: str) -> str:
    """A short name of the tree and its first leaves (the whole string can be 10 KB)."""
    leaves = re.findall(r"e\(\d+\)", node)
    return (f"{hashlib.sha1(node.encode()).hexdigest()[:12]} ({len(leaves)} weights, "
            f"{node.count('add(')} adds, first {' '.join(leaves[:4])})")


def float_counts(ptx: str) -> Counter:
    counts = Counter()
    for op, _, _ in _statements(ptx):
        if op in FLOAT_OPS or op.startswith("wgmma.mma_async"):
            counts[op] += 1
    return counts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", default="bf16", choices=("bf16", "fp16", "e4m3"))
    ap.add_argument("--head", type=int, default=128, choices=(64, 128))
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--tool", default=gluon_compile.TOOL)
    ap.add_argument("--dump", default=tempfile.mkdtemp(prefix="invariant_decode_ptx_"))
    ap.add_argument("--tl-only", action="store_true", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.tl_only:  # child: the `tl` kernel in a process of its own (torch stubbed there)
        tl_compile(ns.head, ns.group, ns.cache, ns.dump)
        return 0
    env = dict(os.environ, TRITON_CACHE_DIR=tempfile.mkdtemp(prefix="invariant_decode_ptx_"))
    done = subprocess.run([sys.executable, __file__, "--tl-only", "--cache", ns.cache,
                           "--head", str(ns.head), "--group", str(ns.group), "--dump",
                           ns.dump],
                          capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        sys.exit(f"the `tl` kernel did not compile:\n{done.stderr[-3000:]}")
    with open(os.path.join(ns.dump, "tl_invariant.ptx")) as f:
        ptx = {"tl invariant (decode tiles)": f.read(),
               "Gluon invariant decode": gluon_ptx(ns.head, ns.group, ns.cache, ns.tool,
                                                   ns.dump)}
    name = f"inv_{ns.cache}_h{ns.head}_g{ns.group}"
    cubins = {"tl invariant (decode tiles)": os.path.join(ns.dump, "tl_invariant.cubin"),
              "Gluon invariant decode": os.path.join(
                  ns.dump, name, f"{gluon_decode_sass.INVARIANT_NAME}.cubin")}
    print(f"cache {ns.cache}, head {ns.head}, GQA {ns.group}; PTX under {ns.dump}\n")
    counts = {k: float_counts(v) for k, v in ptx.items()}
    ops = sorted(set().union(*counts.values()))
    print("| instruction | " + " | ".join(ptx) + " |")
    print("|---|" + "---:|" * len(ptx))
    for op in ops:
        print(f"| `{op}` | " + " | ".join(str(counts[k][op]) for k in ptx) + " |")
    forms = {k: hgmma_forms(v) for k, v in cubins.items()}
    print("\nSASS wgmma forms (copies in the code):")
    for k in ptx:
        print(f"  {k}: " + "; ".join(f"{f} x{n}" for f, n in sorted(forms[k].items())))
    ok = set(forms["tl invariant (decode tiles)"]) == set(forms["Gluon invariant decode"])
    print(f"  -> {'the same forms' if ok else 'FORMS DIFFER'}")
    found = {k: trees(v) for k, v in ptx.items()}
    for i, what in enumerate(("row sums of a tile's weights", "l * alpha + row sum")):
        print(f"\n{what} (distinct trees: copies in the code):")
        for k in ptx:
            for digest, copies in sorted(found[k][i].items()):
                print(f"  {k}: {digest}: {copies}")
        sets = [set(found[k][i]) for k in ptx]
        same = sets[0] == sets[1] and bool(sets[0])
        ok &= same
        print(f"  -> {'the same trees' if same else 'TREES DIFFER'}")
    fused = {k: counts[k]["fma.rn.f32"] for k in ptx}
    print(f"\nfma.rn.f32 (fused multiply-adds of the kernels' own code): {fused}; "
          f"fma.rn.ftz.f32 (libdevice's log2): "
          f"{ {k: counts[k]['fma.rn.ftz.f32'] for k in ptx} }")
    ok &= not any(fused.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
