"""The sm_90 instruction mix of each Triton attention pass, for two source trees side by side.

    /work/venv36/bin/python tools/sass_mix.py --old OLD_ROOT --new NEW_ROOT [--out FILE]

No GPU needed: a Python with Triton 3.6 (the GPU machine's version; its wheel bundles ptxas
and cuobjdump, no torch) compiles every pass with `triton.compile` for sm_90a, as the plans
launch it for a 32 q / 8 KV head, head 128, bf16 model (tiles from `launch.py`; the Hopper
pass also at heads 64 and 256, as bench_prefill's engine rows run them), with the
argument specialisation Triton's runtime would give (pointers and ints divisible by 16 carry
`tt.divisibility`, ints equal to 1 are constants). Each tree compiles in a subprocess of its
own (`--tree ROOT`), importing only its kernel modules: `pagedattn/__init__.py` is skipped
and torch is stubbed when missing. The table per pass gives old and new counts of the
instructions that set a pass's speed: tensor-core MMAs, global loads / stores / cp.async,
TMA loads, exp2, float multiplies, barriers, wgmma waits (DEPBAR: two per key loop when
the wgmma pipeline runs; one per HGMMA when ptxas serialises it, its warning C7511),
local-memory spills; the registers and shared memory, the CTAs per SM they allow on an
H100, all instructions and those inside key loops (the static size of the loop bodies a
tile runs through), and each key loop's body (`_loop_bodies`: MMAs, TMA loads, cp.async
and spills per trip).

Kernels are found by name (each pass lists the names it has had) and their arguments by
parameter name, so a tree with other signatures compiles as long as its names appear in
`scenario` (the legacy names of the code before issue 25 are mapped in `_legacy`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import types
from collections import Counter

H, HKV, D, PAGE = 32, 8, 128, 16
GROUP = H // HKV

# (label, [(module, kernel name), ...], num_warps, num_stages, argument values by name,
#  the values that differ for the code before issue 25, other compile options)
PASSES = []


def scenario(label, kernels, warps, stages, legacy=None, options=None, **values):
    PASSES.append((label, kernels, warps, stages, values, legacy or {}, options or {}))


def _portable(decode: bool, split: bool, block_m: int, block_n: int, num_seqs: int,
              total_q: int, one_loop: bool, fp8: bool = False) -> dict:
    """attention_kernel's arguments (paged bf16 or fp8 cache, causal, no other feature)."""
    cache = "*fp8e4nv" if fp8 else "*bf16"
    return dict(
        Out="*fp32" if split else "*bf16", Lse="*fp32" if split else None, Q="*bf16",
        K=cache, V=cache, alibi_slopes=None, sinks=None, q_descale=None,
        k_descale="*fp32" if fp8 else None, v_descale="*fp32" if fp8 else None,
        stride_qt=H * D, stride_kb=PAGE * HKV * D, stride_ks=HKV * D, stride_kh=D,
        stride_vb=PAGE * HKV * D, stride_vs=HKV * D, stride_vh=D, stride_descale_head=0,
        cu_seqlens_q="*i32", seqused_k="*i32", cu_seqlens_k=None, block_table="*i32",
        stride_bt=512, num_seqs=num_seqs, total_q=total_q, softmax_scale=0.1, softcap=None,
        window_left=None, WINDOW_RIGHT=0, GROUP=GROUP, PAGE=PAGE, HEAD_D=D, HEAD_DV=D,
        BLOCK_M=block_m, BLOCK_N=block_n, DECODE_PASS=decode, SPLIT_KV=split,
        ONE_KEY_LOOP=one_loop, DOT_DTYPE="tl.float16" if fp8 else "tl.bfloat16",
        FP8_V_IN_REGS=fp8)


def _hopper(pack: bool, num_seqs: int, total_q: int, window_left=None, d: int = D,
            block_m: int = 64, heads: int = H) -> dict:
    """hopper_prefill_kernel's arguments: the engine path (paged context, dense new rows;
    head size d, `heads` query heads over HKV, tiles of launch.hopper_prefill_config)."""
    group = heads // HKV
    box = f"tensordesc<bf16[64, {d}]>"  # BLOCK_N key rows
    desc_q = (f"tensordesc<bf16[{block_m // group}, {group}, {d}]>" if pack
              else f"tensordesc<bf16[{block_m}, {d}]>")
    return dict(
        Out="*bf16", Lse=None, desc_q=desc_q, desc_k=box, desc_v=box, K="*bf16", V="*bf16",
        alibi_slopes=None, sinks=None, stride_kb=PAGE * HKV * d, stride_ks=HKV * d,
        stride_kh=d, stride_vb=PAGE * HKV * d, stride_vs=HKV * d, stride_vh=d,
        cu_seqlens_q="*i32", seqused_k="*i32", cu_seqlens_k=None, block_table="*i32",
        stride_bt=512, num_seqs=num_seqs, total_q=total_q, softmax_scale=0.1, softcap=None,
        window_left=window_left, WINDOW_RIGHT=0, GROUP=group, PAGE=PAGE, HEAD_D=d, HEAD_DV=d,
        BLOCK_M=block_m, BLOCK_N=64, PACK_GQA=pack)


def _reduce(decode: bool, splits: int, num_seqs: int, total_q: int) -> dict:
    return dict(Out="*bf16", Lse=None, PartOut="*fp32", PartLse="*fp32", cu_seqlens_q="*i32",
                num_seqs=num_seqs, total_q=total_q, decode_max_q=16 // GROUP,
                stride_ot=H * D, stride_oh=D, NUM_HEADS=H, HEAD_DV=D, NUM_SPLITS=splits,
                DECODE_PASS=decode)


PORTABLE = [("attention", "attention_kernel"), ("attention", "_attention_kernel")]
HOPPER = [("attention_hopper", "hopper_prefill_kernel"), ("attention_hopper", "_prefill_kernel")]
REDUCE = [("reduce", "reduce_splits_kernel"), ("reduce", "_reduce_splits_kernel")]
scenario("decode, b32 ctx 8k", PORTABLE, 4, 2,
         **_portable(True, False, 16, 128, 32, 32, True))
scenario("decode split-KV, b1 ctx 32k", PORTABLE, 4, 2,
         **_portable(True, True, 16, 128, 1, 1, True))
scenario("decode fp8 cache, b32 ctx 8k", PORTABLE, 4, 3,
         **_portable(True, False, 16, 128, 32, 32, True, fp8=True))
scenario("portable prefill 256 rows, 3 loops (1 x 8192, op path)", PORTABLE, 8, 3,
         **_portable(False, False, 256, 64, 1, 8192, False))
scenario("portable prefill 64 rows, 1 loop (32 x 512, op path)", PORTABLE, 4, 3,
         **_portable(False, False, 64, 64, 32, 16384, True))
scenario("portable prefill split-KV (128 q over 32k)", PORTABLE, 4, 3,
         **_portable(False, True, 64, 64, 1, 128, True))
scenario("Hopper prefill, per head (8 x 2048)", HOPPER, 4, 3, **_hopper(False, 8, 16384))
scenario("Hopper prefill, packed GQA (1 x 8192)", HOPPER, 4, 3, **_hopper(True, 1, 8192))
scenario("Hopper prefill, packed GQA, window 4096 (1 x 32768)", HOPPER, 4, 3,
         **_hopper(True, 1, 32768, window_left=4095))
# Heads 64 and 256 as bench_prefill's engine rows run them (per head: launch.pack_gqa packs
# only head 128; head 256 with 16 q / 8 KV heads), with launch.hopper_prefill_config's tiles.
scenario("Hopper prefill, head 64, per head (1 x 8192)", HOPPER, 4, 3,
         **_hopper(False, 1, 8192, d=64))
scenario("Hopper prefill, head 256 (16 / 8 heads), per head (1 x 8192)", HOPPER, 8, 2,
         **_hopper(False, 1, 8192, d=256, block_m=128, heads=16))
scenario("split-KV reduce, decode (33 splits)", REDUCE, 4, 1, **_reduce(True, 33, 1, 1))
scenario("split-KV reduce, prefill (4 splits)", REDUCE, 4, 1, **_reduce(False, 4, 1, 128))
# Batch-invariant mode's pass and fold (issue 44): one tile config for decodes and prompts,
# no fused multiply-adds; the old tree has none.
INVARIANT = [("attention", "invariant_attention_kernel")]
_INVARIANT = dict(options=dict(enable_fp_fusion=False))


def _invariant(split: bool, num_seqs: int, total_q: int, block_m: int = 64,
               d: int = D, block_n: int = 64) -> dict:
    values = _portable(False, split, block_m, block_n, num_seqs, total_q, True)
    del values["DECODE_PASS"]
    # (a tree whose kernel lacks a switch ignores it: only the kernel's parameters are read)
    return dict(values, HEAD_D=d, HEAD_DV=d, SPLIT_KEYS=1024, MAX_Q_LEN=None,
                SCALE_IN_EXP=True, MAX_SLACK=0)


scenario("batch-invariant pass, in-program folds (32 x 512 or decodes b32)", INVARIANT, 4, 3,
         **_INVARIANT, **_invariant(False, 32, 16384))
scenario("batch-invariant pass, split programs (decode b1 ctx 32k)", INVARIANT, 4, 3,
         **_INVARIANT, **_invariant(True, 1, 1))
scenario("batch-invariant pass, head 256 (16 / 8 heads), in-program folds", INVARIANT, 8, 2,
         **_INVARIANT, **_invariant(False, 1, 8192, d=256))
scenario("batch-invariant pass, 128-row prefill tiles, 8 warps (with 64-row decode tiles)",
         INVARIANT, 8, 2, **_INVARIANT, **_invariant(False, 1, 8192, block_m=128))
# the running max's slack (`SWITCHES.invariant_max_slack`; a tree without it compiles 0)
scenario("batch-invariant pass, 128-row prefill tiles, max slack 8", INVARIANT, 8, 2,
         **_INVARIANT, **dict(_invariant(False, 1, 8192, block_m=128), MAX_SLACK=8))
scenario("batch-invariant pass, 128-key tiles: 128 rows, 8 warps (prompts)", INVARIANT, 8, 2,
         **_INVARIANT, **_invariant(False, 1, 8192, block_m=128, block_n=128))
scenario("batch-invariant pass, 128-key tiles: 64 rows, 4 warps (decodes b32)", INVARIANT, 4,
         2, **_INVARIANT, **_invariant(False, 32, 32, block_n=128))
scenario("batch-invariant fold of split programs", [("invariant", "fold_splits_kernel")], 4,
         1, **_INVARIANT, Out="*bf16", Lse=None, PartOut="*fp32", PartLse="*fp32",
         cu_seqlens_q="*i32", seqused_k="*i32", num_seqs=1, total_q=1, stride_ot=H * D,
         stride_oh=D, NUM_HEADS=H, HEAD_DV=D, SPLIT_KEYS=1024, BLOCK_T=16)
# The kernels whose softmax, epilogue and LSE merge moved to tile_math (not attention passes).
scenario("block-sparse decode, b32 (block 64, local 4, vert 8)",
         [("blocksparse_decode", "_decode_kernel")], 4, 3,
         legacy=dict(SPLIT_KV=False, USE_ALIBI=False, KV_SCALE=False, PartOut="*bf16",
                     PartLse="*bf16", alibi_slopes="*i32", k_scale="*i32", v_scale="*i32"),
         Q="*bf16", KC="*bf16", VC="*bf16", Out="*bf16", PartOut=None, PartLse=None,
         block_tables="*i32", seq_lens="*i32", alibi_slopes=None, k_scale=None, v_scale=None,
         qk_scale=0.1, head_base=0, step_size=1, stride_qs=H * D, stride_qh=D,
         stride_kb=HKV * D * PAGE, stride_vb=HKV * D * PAGE, stride_bt=2048, stride_os=H * D,
         stride_oh=D, GROUP=GROUP, PER_KV_HEAD=False, NUM_RESIDUES=4, BLOCK_M=16, PAGE=PAGE,
         X=8, SBS=64, LOCAL=4, VERT=8, HEAD_D=D, BLOCK_D=D, BLOCK_N=64, CHUNK=64,
         DOT_DTYPE="tl.bfloat16")
scenario("block-sparse prefill, 1 x 8192", [("blocksparse", "_prefill_kernel")], 4, 3,
         Q="*bf16", K="*bf16", V="*bf16", Out="*bf16", cu_seqlens_q="*i32",
         cu_seqlens_k="*i32", num_seqs=1, qk_scale=0.1, head_base=0, step_size=1,
         stride_qt=H * D, stride_qh=D, stride_kt=HKV * D, stride_kh=D, stride_vt=HKV * D,
         stride_vh=D, stride_ot=H * D, stride_oh=D, GROUP=GROUP, PER_KV_HEAD=False, SBS=64,
         LOCAL=4, VERT=8, HEAD_D=D, BLOCK_D=D, BLOCK_M=64, BLOCK_N=64, DOT_DTYPE="tl.bfloat16",
         DOT_PRECISION="tf32")
scenario("merge_attn_states, with the merged LSE", [("merge", "_merge_kernel")], 1, 1,
         legacy=dict(WRITE_LSE=True, BLOCK_D=D),
         Out="*bf16", PrefixOut="*bf16", PrefixLse="*fp32", SuffixOut="*bf16",
         SuffixLse="*fp32", OutLse="*fp32", stride_ot=H * D, stride_oh=D, stride_pt=H * D,
         stride_ph=D, stride_st=H * D, stride_sh=D, stride_plh=8192, stride_plt=1,
         stride_slh=8192, stride_slt=1, stride_olh=8192, stride_olt=1, HEAD_D=D)
scenario("DCP correction, 4 ranks", [("context_parallel", "_correct_kernel")], 1, 1,
         Out="*bf16", Lses="*fp32", Corrected="*fp32", Lse="*fp32", rank=0, world=4,
         num_tokens=1024, stride_ot=H * D, stride_oh=D, stride_lw=H * 1024, stride_lh=1024,
         stride_ch=1024 * D, stride_ct=D, HEAD_DV=D, BLOCK_DV=D, BLOCK_W=4)

_LEGACY_SWITCHES = {  # a legacy switch -> the argument whose None-ness it encoded
    "USE_ALIBI": "alibi_slopes", "USE_SINKS": "sinks", "Q_DESCALE": "q_descale",
    "KV_DESCALE": "k_descale", "WRITE_LSE": "Lse", "USE_SOFTCAP": "softcap",
}


def _legacy(values: dict) -> dict:
    """The same call in the argument names of the code before issue 25: switches instead of
    None, placeholder pointers (cu_seqlens_q) for disabled features, IS_CAUSAL, explicit
    strides and padded sizes."""
    v = dict(values)
    d, group = values.get("HEAD_D", D), values.get("GROUP", GROUP)
    for switch, arg in _LEGACY_SWITCHES.items():
        v[switch] = values.get(arg) is not None
    split = bool(values.get("SPLIT_KV"))
    if values.get("window_left") is None:
        v["window_left"] = -1
    v.update(IS_CAUSAL=True, window_right=-1, IS_PAGED=True, PAGED_CONTEXT=True,
             LONGEST_FIRST=True, NUM_HEADS=group * HKV, GROUP_PAD=group, BLOCK_D=d,
             BLOCK_DV=d, DOT_PRECISION="tf32", stride_qh=d, stride_ot=group * HKV * d, stride_oh=d,
             stride_qd_b=0, stride_qd_h=0, stride_kvd_b=0, stride_kvd_h=0,
             decode_max_q=16 // group, softcap="fp32",
             SPLITS_PAD=1 << (values.get("NUM_SPLITS", 1) - 1).bit_length())
    if "PartOut" not in values:  # the attention kernel's partials were arguments of their own
        v.update(PartOut="*fp32" if split else "*i32", PartLse="*fp32" if split else "*i32",
                 Out="*bf16", Lse=None)
    for arg in ("alibi_slopes", "sinks", "q_descale", "k_descale", "v_descale", "Lse",
                "cu_seqlens_k"):
        if v.get(arg) is None:
            v[arg] = "*i32"
    return v


class _StubModule(types.ModuleType):
    """Any attribute is a placeholder (module-level `torch.float16` and the like)."""

    def __getattr__(self, name):
        return _StubModule(f"{self.__name__}.{name}")

    def __call__(self, *args, **kwargs):
        return self


def use_tree(root: str) -> None:
    """Import `pagedattn.ops.triton`'s kernel modules from the tree at `root` (once a
    process): `pagedattn/__init__.py` is skipped and torch is stubbed when missing."""
    try:
        import torch  # noqa: F401
    except ImportError:  # the kernels' host halves import torch; only their kernels run here
        sys.modules["torch"] = _StubModule("torch")
    for pkg in ("pagedattn", "pagedattn.ops", "pagedattn.ops.triton"):
        mod = types.ModuleType(pkg)
        mod.__path__ = [os.path.join(root, "src", *pkg.split("."))]
        sys.modules[pkg] = mod


def compile_tree(root: str) -> dict:
    """{pass label: counts} for the tree at `root` (run in a subprocess per tree)."""
    use_tree(root)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    results = {}
    for label, kernels, warps, stages, values, legacy, options in PASSES:
        kernel = None
        for module, name in kernels:
            try:
                kernel = getattr(importlib.import_module(f"pagedattn.ops.triton.{module}"),
                                 name, None)
            except ImportError:
                kernel = None
            if kernel is not None:
                break
        if kernel is None:  # a pass this tree does not have (batch-invariant mode's)
            results[label] = dict(kernel="absent")
            continue
        if {p.name for p in kernel.params} - set(values):  # a kernel from before issue 25
            values = dict(values, **legacy) if legacy else _legacy(values)
        compiled = triton.compile(ASTSource(kernel, *compile_args(kernel, values)),
                                  target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=warps, num_stages=stages, **options))
        counts = _sass_counts(compiled.asm["cubin"])
        counts["shared memory"] = compiled.metadata.shared
        counts["CTAs per SM"] = _ctas_per_sm(counts["registers"], compiled.metadata.shared,
                                             warps)
        results[label] = dict(counts, arguments=len(kernel.params),
                              kernel=f"{kernel.fn.__module__.split('.')[-1]}.{kernel.__name__}")
    return results


def compile_args(kernel, values: dict) -> tuple[dict, dict, dict]:
    """(signature, constants, attrs) of `triton.compile`'s ASTSource for a `tl` kernel given
    each parameter's value by name, as Triton's runtime would specialise them: constexprs (a
    "tl.<dtype>" string for a dtype), None and ints equal to 1 as constants, floats fp32,
    ints i32, strings as the type they name; pointers and ints divisible by 16 carry
    `tt.divisibility`."""
    import triton.language as tl
    signature, constants, attrs = {}, {}, {}
    for i, p in enumerate(kernel.params):
        value = values[p.name]
        if p.is_constexpr:
            signature[p.name] = "constexpr"
            is_dtype = isinstance(value, str) and value.startswith("tl.")
            constants[(i,)] = getattr(tl, value[3:]) if is_dtype else value
        elif value is None or (isinstance(value, int) and value == 1):
            signature[p.name] = "constexpr"  # Triton makes None and ints equal to 1 constants
            constants[(i,)] = value
        elif isinstance(value, float):
            signature[p.name] = "fp32"
        elif isinstance(value, int):
            signature[p.name] = "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[p.name] = value
            if value.startswith("*"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, constants, attrs


def _ctas_per_sm(registers: int, shared: int, warps: int) -> int:
    """H100 occupancy: 64K registers (granted per warp in units of 256), 228 KB of shared
    memory (1 KB reserved per CTA), 64 warps, 32 CTAs."""
    per_warp = -(-registers * 32 // 256) * 256
    return min(65536 // (per_warp * warps), 233472 // (shared + 1024), 64 // warps, 32)


def _sass_counts(cubin: bytes) -> Counter:
    from triton import knobs

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        tool = knobs.nvidia.cuobjdump.path
        sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True).stdout
        usage = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True,
                               text=True).stdout
    counts, loops, addresses, ops = Counter(), [], [], []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)"
                     r"([.A-Z0-9_]*)(.*)", line)
        if not m:
            continue
        address, op, suffix, operands = m.groups()
        counts["instructions"] += 1
        addresses.append(int(address, 16))
        ops.append(op)
        target = re.search(r"0x([0-9a-f]+)", operands) if op == "BRA" else None
        if target and int(target.group(1), 16) < addresses[-1]:  # a loop's back edge
            loops.append((int(target.group(1), 16), addresses[-1]))
        if op == "MUFU" and ".EX2" in suffix:
            counts["MUFU.EX2"] += 1
        elif op == "WARPGROUP" and suffix.startswith(".DEPBAR"):
            counts["wgmma waits"] += 1
        elif op in ("HGMMA", "HMMA", "LDG", "STG", "LDGSTS", "UTMALDG", "FFMA", "FMUL", "BAR",
                    "STL", "LDL", "LDS", "STS", "LDSM"):
            counts[op] += 1
    counts["key loop bodies"] = _loop_bodies(loops, addresses, ops)
    # Key loops (not the 64-wide sequence search): instructions inside any back edge's range.
    loops = [(lo, hi) for lo, hi in loops if (hi - lo) // 16 >= 64]
    counts["loop instructions"] = sum(any(lo <= a <= hi for lo, hi in loops) for a in addresses)
    for key in ("REG", "STACK", "SHARED"):
        m = re.search(rf"{key}:(\d+)", usage)
        counts[key.lower() if key != "REG" else "registers"] = int(m.group(1)) if m else -1
    return counts


def _loop_bodies(loops: list, addresses: list, ops: list) -> str:
    """The innermost loops (back edges whose range holds no other) with a tensor-core MMA,
    in code order, as "MMA/TMA/cp.async/spill" (HGMMA or HMMA, UTMALDG, LDGSTS, STL + LDL
    per trip), equal neighbours counted: "2x 20/0/16/0". The mbarrier retry stubs at the
    kernel's end jump back into the loops that wait, so those ranges hold the stubs and do
    not count."""
    inner = sorted((lo, hi) for lo, hi in loops
                   if not any((lo, hi) != o and lo <= o[0] and o[1] <= hi for o in loops))
    bodies = []
    for lo, hi in inner:
        body = Counter(op for a, op in zip(addresses, ops) if lo <= a <= hi)
        if body["HGMMA"] + body["HMMA"]:
            bodies.append(f"{body['HGMMA'] + body['HMMA']}/{body['UTMALDG']}/{body['LDGSTS']}"
                          f"/{body['STL'] + body['LDL']}")
    runs = []
    for body in bodies:
        if runs and runs[-1][1] == body:
            runs[-1][0] += 1
        else:
            runs.append([1, body])
    return ", ".join(f"{n}x {body}" if n > 1 else body for n, body in runs)


COLUMNS = ("arguments", "registers", "shared memory", "CTAs per SM", "stack", "instructions",
           "loop instructions", "HGMMA", "HMMA", "LDGSTS", "UTMALDG", "LDG", "STG", "LDSM",
           "LDS", "STS", "MUFU.EX2", "FFMA", "FMUL", "BAR", "wgmma waits", "STL", "LDL",
           "key loop bodies")
HEADER = ("args", "regs", "smem", "CTAs/SM", "stack", "instrs", "in loops", "HGMMA", "HMMA",
          "LDGSTS", "UTMALDG", "LDG", "STG", "LDSM", "LDS", "STS", "EX2", "FFMA", "FMUL", "BAR",
          "DEPBAR", "STL", "LDL", "key loop bodies: MMA/TMA/cp.async/spill")


def table(old: dict, new: dict) -> list[str]:
    """Per pass: a row per tree and the counts that differ in bold."""
    lines = []
    for label, *_ in PASSES:
        a, b = old[label], new[label]
        lines += ["", f"#### {label}: `{a['kernel']}` -> `{b['kernel']}`", "",
                  "| | " + " | ".join(HEADER) + " |", "|---|" + "---:|" * len(HEADER)]
        for name, counts, other in (("old", a, b), ("new", b, a)):
            if counts["kernel"] == "absent":
                lines.append(f"| {name} | " + " | ".join("-" * len(COLUMNS)) + " |")
                continue
            cells = [str(counts.get(c, 0)) for c in COLUMNS]
            cells = [f"**{x}**" if counts.get(c, 0) != other.get(c, 0) else x
                     for c, x in zip(COLUMNS, cells)]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", help="root of the old tree (holds src/pagedattn)")
    ap.add_argument("--new", help="root of the new tree")
    ap.add_argument("--tree", help=argparse.SUPPRESS)  # child: compile one tree, print JSON
    ap.add_argument("--out", help="also write the tables to this file")
    ap.add_argument("--passes", default="", help="only the passes whose label has this text")
    args = ap.parse_args()
    PASSES[:] = [p for p in PASSES if args.passes in p[0]]
    if args.tree:
        print(json.dumps(compile_tree(args.tree)))
        return
    if not (args.old and args.new):
        ap.error("give --old and --new")
    counts = []
    for root in (args.old, args.new):
        env = dict(os.environ, TRITON_CACHE_DIR=tempfile.mkdtemp(prefix="sass_mix_"))
        done = subprocess.run([sys.executable, __file__, "--tree", os.path.abspath(root),
                               "--passes", args.passes],
                              capture_output=True, text=True, env=env)
        if done.returncode:
            sys.exit(f"compiling {root} failed:\n{done.stderr[-4000:]}")
        counts.append(json.loads(done.stdout.splitlines()[-1]))
    lines = table(*counts)
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
