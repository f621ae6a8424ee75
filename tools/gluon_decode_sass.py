"""Compile each variant of the Gluon decode kernel for sm_90a without a GPU and count its SASS.

    /work/venv36/bin/python tools/gluon_decode_sass.py [--tool PATH] [--only NAME] [--dump DIR]
        [--invariant | --persistent]

Runs with a Python whose Triton is 3.6.0 (no torch or driver needed) and the compile tool
`gluon_compile_sm90.py` (shared tools folder by default), as `tools/gluon_sass.py` does for
the prefill kernel. Prints one markdown row per variant: shared memory, the launch's
registers, the setmaxnreg values (the consumer's / the workers'), HGMMA and QGMMA (the fp8
wgmma) counts, spills (STL/LDL), whether ptxas serialised the wgmma pipeline (C7512), and
the instructions of the consumer's key loop (the longest backward branch around an HGMMA /
QGMMA). Variants mirror what `gluon_decode_launch.plan_gluon_decode` launches (tiles from
`gluon_decode_tiles.decode_tiles`, one program a SM or two). --invariant: batch-invariant
mode's decode kernel instead (`gluon_decode_invariant.py`, its tiles `TILES`, 64-key tiles
or BLOCK_N=128's, 1,024-key splits, compiled without fused multiply-adds as
`gluon_decode_invariant_launch.plan_invariant_decode` launches it). --persistent: the same
variants in the persistent form (`gluon_decode_persistent.py`: programs that walk units;
`SWITCHES.gluon_decode_persistent`).
"""

from __future__ import annotations

import os
import re
import sys

from gluon_compile import compile_variant, serialised, variant_table

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "..", "src", "pagedattn", "ops", "triton")
KERNEL = os.path.join(SRC, "gluon_decode.py")
NAME = "gluon_decode_kernel"
INVARIANT_KERNEL = os.path.join(SRC, "gluon_decode_invariant.py")
INVARIANT_NAME = "gluon_decode_invariant_kernel"
PERSISTENT_KERNEL = os.path.join(SRC, "gluon_decode_persistent.py")
PERSISTENT_NAME = "gluon_decode_persistent_kernel"

# name -> (head_size, group, fp8, split, features); PER_SM=2 in features: the tiles and
# maxnreg of two programs a SM (`SWITCHES.gluon_decode_per_sm`)
VARIANTS = {
    "bf16 h128 G4": (128, 4, False, False, {}),
    "bf16 h128 G4 split": (128, 4, False, True, {}),
    "e4m3 h128 G4": (128, 4, True, False, {}),
    "e4m3 h128 G4 split": (128, 4, True, True, {}),
    "bf16 h64 G8": (64, 8, False, False, {}),
    "bf16 h64 G8 split": (64, 8, False, True, {}),
    "bf16 h128 G1": (128, 1, False, False, {}),
    "bf16 h256 G4": (256, 4, False, False, {}),
    "bf16 h128 G4 window+softcap+sinks+lse": (128, 4, False, False, dict(
        WINDOW_LEFT=True, USE_SOFTCAP=True, USE_SINKS=True, SCALE_IN_EXP=False,
        WRITE_LSE=True)),
    "e4m3 h128 G4 split, sinks": (128, 4, True, True, dict(USE_SINKS=True)),
    "bf16 h128 G4, 2 a SM": (128, 4, False, False, dict(PER_SM=2)),
    "bf16 h128 G4 split, 2 a SM": (128, 4, False, True, dict(PER_SM=2)),
    "e4m3 h128 G4, 2 a SM": (128, 4, True, False, dict(PER_SM=2)),
    "e4m3 h128 G4 split, 2 a SM": (128, 4, True, True, dict(PER_SM=2)),
    "bf16 h64 G8, 2 a SM": (64, 8, False, False, dict(PER_SM=2)),
    "bf16 h64 G8 split, 2 a SM": (64, 8, False, True, dict(PER_SM=2)),
    # P V as an fp8 wgmma over V^T the converter transposes (`SWITCHES.gluon_decode_fp8_pv`)
    "e4m3 h128 G4, fp8 P V": (128, 4, True, False, dict(PV_FP8=True)),
    "e4m3 h128 G4 split, fp8 P V": (128, 4, True, True, dict(PV_FP8=True)),
    "e4m3 h128 G4 split, sinks, fp8 P V": (128, 4, True, True, dict(USE_SINKS=True,
                                                                    PV_FP8=True)),
    "e4m3 h128 G4, 2 a SM, fp8 P V": (128, 4, True, False, dict(PER_SM=2, PV_FP8=True)),
    "e4m3 h128 G4 split, 2 a SM, fp8 P V": (128, 4, True, True, dict(PER_SM=2, PV_FP8=True)),
    "e4m3 h128 G4 window+softcap+sinks+lse, fp8 P V": (128, 4, True, False, dict(
        WINDOW_LEFT=True, USE_SOFTCAP=True, USE_SINKS=True, SCALE_IN_EXP=False,
        WRITE_LSE=True, PV_FP8=True)),
    "e4m3 h64 G8, fp8 P V": (64, 8, True, False, dict(PV_FP8=True)),
    "e4m3 h64 G8, 2 a SM, fp8 P V": (64, 8, True, False, dict(PER_SM=2, PV_FP8=True)),
    "e4m3 h256 G4, fp8 P V": (256, 4, True, False, dict(PV_FP8=True)),
    # O's rescale skipped by warps whose rows kept their max (`SWITCHES.gluon_decode_max_slack`
    # 0, or 8: the max kept within 2^8)
    "e4m3 h128 G4, lazy rescale": (128, 4, True, False, dict(MAX_SLACK=0)),
    "e4m3 h128 G4, 2 a SM, lazy rescale": (128, 4, True, False, dict(PER_SM=2, MAX_SLACK=0)),
    "e4m3 h128 G4, fp8 P V, lazy rescale": (128, 4, True, False, dict(PV_FP8=True,
                                                                      MAX_SLACK=0)),
    "e4m3 h128 G4, 2 a SM, fp8 P V, lazy rescale": (128, 4, True, False, dict(
        PER_SM=2, PV_FP8=True, MAX_SLACK=0)),
    "e4m3 h128 G4 split, sinks, 2 a SM, fp8 P V, lazy rescale": (128, 4, True, True, dict(
        USE_SINKS=True, PER_SM=2, PV_FP8=True, MAX_SLACK=0)),
    "e4m3 h256 G4, fp8 P V, lazy rescale": (256, 4, True, False, dict(PV_FP8=True,
                                                                      MAX_SLACK=0)),
    "bf16 h128 G4, 2 a SM, slack 8": (128, 4, False, False, dict(PER_SM=2, MAX_SLACK=8)),
}


# batch-invariant mode's decodes: name -> (head_size, group, cache, split, features); cache
# "bf16", "fp16" or "e4m3" (then a bf16 q over it, fp16 products; Q_FP8: an e4m3 q)
INVARIANT_VARIANTS = {
    "inv bf16 h128 G4": (128, 4, "bf16", False, {}),
    "inv bf16 h128 G4 split": (128, 4, "bf16", True, {}),
    "inv fp16 h128 G1": (128, 1, "fp16", False, {}),
    "inv bf16 h64 G8": (64, 8, "bf16", False, {}),
    "inv bf16 h64 G8 split": (64, 8, "bf16", True, {}),
    "inv e4m3 h128 G4": (128, 4, "e4m3", False, {}),
    "inv e4m3 h128 G4 split": (128, 4, "e4m3", True, {}),
    "inv e4m3 h64 G8": (64, 8, "e4m3", False, {}),
    "inv e4m3 q h128 G4": (128, 4, "e4m3", False, dict(Q_FP8=True)),
    "inv bf16 h128 G4 window+softcap+sinks+lse": (128, 4, "bf16", False, dict(
        WINDOW_LEFT=True, USE_SOFTCAP=True, USE_SINKS=True, WRITE_LSE=True)),
    "inv e4m3 h128 G8 split, sinks+softcap": (128, 8, "e4m3", True, dict(
        USE_SINKS=True, USE_SOFTCAP=True)),
    # 128-key tiles (`SWITCHES.invariant_tiles` naming block_n 128 for the `tl` pass)
    "inv bf16 h128 G4, 128 keys": (128, 4, "bf16", False, dict(BLOCK_N=128)),
    "inv bf16 h128 G4 split, 128 keys": (128, 4, "bf16", True, dict(BLOCK_N=128)),
    "inv bf16 h64 G8, 128 keys": (64, 8, "bf16", False, dict(BLOCK_N=128)),
    "inv bf16 h128 G4, 128 keys, scale in exp": (128, 4, "bf16", False, dict(
        BLOCK_N=128, SCALE_IN_EXP=True)),
    "inv e4m3 h128 G4, 128 keys": (128, 4, "e4m3", False, dict(BLOCK_N=128)),
    "inv e4m3 h64 G8 split, 128 keys": (64, 8, "e4m3", True, dict(BLOCK_N=128)),
    "inv bf16 h128 G4 window+softcap+sinks+lse, 128 keys": (128, 4, "bf16", False, dict(
        WINDOW_LEFT=True, USE_SOFTCAP=True, USE_SINKS=True, WRITE_LSE=True, BLOCK_N=128)),
    # 128-key tiles with an unsplit program's fold state in float32 memory
    # (`SWITCHES.invariant_tiles_128`: FOLD_MEM, the registers of the running fold freed;
    # KERNEL_NOTES v39: 0 STL/LDL in the consumer, the e4m3 forms' 16 are the converter's)
    "inv bf16 h128 G4, 128 keys, fold in memory": (128, 4, "bf16", False, dict(
        BLOCK_N=128, FOLD_MEM=True)),
    "inv bf16 h128 G4, 128 keys, scale in exp, fold in memory": (128, 4, "bf16", False, dict(
        BLOCK_N=128, SCALE_IN_EXP=True, FOLD_MEM=True)),
    "inv fp16 h128 G1, 128 keys, fold in memory": (128, 1, "fp16", False, dict(
        BLOCK_N=128, SCALE_IN_EXP=True, FOLD_MEM=True)),
    "inv e4m3 h128 G4, 128 keys, fold in memory": (128, 4, "e4m3", False, dict(
        BLOCK_N=128, SCALE_IN_EXP=True, FOLD_MEM=True)),
    "inv bf16 h128 G4 window+softcap+sinks+lse, 128 keys, fold in memory": (
        128, 4, "bf16", False, dict(WINDOW_LEFT=True, USE_SOFTCAP=True, USE_SINKS=True,
                                    WRITE_LSE=True, BLOCK_N=128, FOLD_MEM=True)),
    "inv e4m3 h128 G8 window+sinks+lse, 128 keys, fold in memory": (128, 8, "e4m3", False, dict(
        WINDOW_LEFT=True, USE_SINKS=True, WRITE_LSE=True, SCALE_IN_EXP=True, BLOCK_N=128,
        FOLD_MEM=True)),
    "inv bf16 h64 G8, 128 keys, fold in memory": (64, 8, "bf16", False, dict(
        BLOCK_N=128, SCALE_IN_EXP=True, FOLD_MEM=True)),
    "inv e4m3 h64 G8 window+sinks, 128 keys, fold in memory": (64, 8, "e4m3", False, dict(
        WINDOW_LEFT=True, USE_SINKS=True, SCALE_IN_EXP=True, BLOCK_N=128, FOLD_MEM=True)),
    # head 256 (`SWITCHES.invariant_gluon_256`): split states in memory, the scale in exp
    "inv bf16 h256 G4": (256, 4, "bf16", False, dict(SCALE_IN_EXP=True)),
    "inv bf16 h256 G4 split": (256, 4, "bf16", True, dict(SCALE_IN_EXP=True)),
    "inv bf16 h256 G8 window+softcap+sinks+lse": (256, 8, "bf16", False, dict(
        WINDOW_LEFT=True, USE_SOFTCAP=True, USE_SINKS=True, WRITE_LSE=True)),
    "inv e4m3 h256 G4": (256, 4, "e4m3", False, dict(SCALE_IN_EXP=True)),
    "inv e4m3 h256 G1 split": (256, 1, "e4m3", True, dict(SCALE_IN_EXP=True)),
    # the layer whose GPU test did not finish (KERNEL_NOTES v37): e4m3, GQA 8, window + sinks
    "inv e4m3 h256 G8 window+sinks": (256, 8, "e4m3", False, dict(
        WINDOW_LEFT=True, USE_SINKS=True, SCALE_IN_EXP=True)),
    "inv e4m3 h256 G8 split, window+sinks": (256, 8, "e4m3", True, dict(
        WINDOW_LEFT=True, USE_SINKS=True, SCALE_IN_EXP=True)),
    # split programs that fold their own splits (`SWITCHES.invariant_self_fold`, KERNEL_NOTES
    # v43: no fold launch; heads 64 / 128)
    "inv bf16 h128 G4 split, self fold": (128, 4, "bf16", True, dict(SELF_FOLD=True)),
    "inv bf16 h128 G4 split, self fold, scale in exp": (128, 4, "bf16", True, dict(
        SELF_FOLD=True, SCALE_IN_EXP=True)),
    "inv bf16 h64 G8 split, self fold": (64, 8, "bf16", True, dict(SELF_FOLD=True)),
    "inv e4m3 h128 G4 split, self fold": (128, 4, "e4m3", True, dict(SELF_FOLD=True)),
    "inv e4m3 h128 G8 split, self fold, sinks+softcap+lse": (128, 8, "e4m3", True, dict(
        SELF_FOLD=True, USE_SINKS=True, USE_SOFTCAP=True, WRITE_LSE=True)),
    "inv bf16 h128 G4 split, 128 keys, self fold": (128, 4, "bf16", True, dict(
        BLOCK_N=128, SELF_FOLD=True)),
    # the fold state by program (FOLD_BY_PROGRAM: [batch, NUM_KV, QUERIES x GROUP_PAD, Dv],
    # a step whose prompts bring most tokens; `gluon_decode_invariant_launch.fold_shape`)
    "inv bf16 h256 G4, fold by program": (256, 4, "bf16", False, dict(
        SCALE_IN_EXP=True, FOLD_BY_PROGRAM=True)),
    "inv e4m3 h256 G8 window+sinks, fold by program": (256, 8, "e4m3", False, dict(
        WINDOW_LEFT=True, USE_SINKS=True, SCALE_IN_EXP=True, FOLD_BY_PROGRAM=True)),
    "inv bf16 h128 G4, 128 keys, scale in exp, fold in memory by program": (
        128, 4, "bf16", False, dict(BLOCK_N=128, SCALE_IN_EXP=True, FOLD_MEM=True,
                                    FOLD_BY_PROGRAM=True)),
    "inv e4m3 h128 G8 window+sinks+lse, 128 keys, fold in memory by program": (
        128, 8, "e4m3", False, dict(WINDOW_LEFT=True, USE_SINKS=True, WRITE_LSE=True,
                                    SCALE_IN_EXP=True, BLOCK_N=128, FOLD_MEM=True,
                                    FOLD_BY_PROGRAM=True)),
    # the running max's slack in every pass (`SWITCHES.invariant_max_slack`; other bits)
    "inv bf16 h128 G4, scale in exp, max slack 8": (128, 4, "bf16", False, dict(
        SCALE_IN_EXP=True, MAX_SLACK=8)),
    "inv e4m3 h128 G8 split, sinks+softcap, max slack 8": (128, 8, "e4m3", True, dict(
        USE_SINKS=True, USE_SOFTCAP=True, MAX_SLACK=8)),
    # the forms of the GPU tests' e4m3 + sinks layer under the slack
    "inv e4m3 h128 G4, sinks, scale in exp, max slack 8": (128, 4, "e4m3", False, dict(
        USE_SINKS=True, SCALE_IN_EXP=True, MAX_SLACK=8)),
    "inv e4m3 h128 G4 split, sinks, scale in exp, max slack 1": (128, 4, "e4m3", True, dict(
        USE_SINKS=True, SCALE_IN_EXP=True, MAX_SLACK=1)),
    "inv fp16 h128 G1, softcap, max slack 1": (128, 1, "fp16", False, dict(
        USE_SOFTCAP=True, MAX_SLACK=1)),
    "inv fp16 h64 G8 window+sinks, 128 keys, scale in exp, max slack 8": (64, 8, "fp16", False,
        dict(WINDOW_LEFT=True, USE_SINKS=True, SCALE_IN_EXP=True, BLOCK_N=128, MAX_SLACK=8)),
    # O's rescale skipped by a warp none of whose rows moved its max (MAX_SLACK 0:
    # `SWITCHES.invariant_lazy_rescale`, the same bits; a slack skips it too), beside the
    # same forms rescaling every tile: today's 64-key tiles and `invariant_tiles_128`'s
    "inv bf16 h128 G4, scale in exp": (128, 4, "bf16", False, dict(SCALE_IN_EXP=True)),
    "inv bf16 h128 G4, scale in exp, lazy rescale": (128, 4, "bf16", False, dict(
        SCALE_IN_EXP=True, MAX_SLACK=0)),
    "inv bf16 h128 G4, 128 keys, scale in exp, fold in memory, lazy rescale": (
        128, 4, "bf16", False, dict(BLOCK_N=128, SCALE_IN_EXP=True, FOLD_MEM=True,
                                    MAX_SLACK=0)),
    "inv bf16 h128 G4, 128 keys, scale in exp, fold in memory, max slack 8": (
        128, 4, "bf16", False, dict(BLOCK_N=128, SCALE_IN_EXP=True, FOLD_MEM=True,
                                    MAX_SLACK=8)),
    "inv bf16 h128 G4 split, 128 keys, lazy rescale": (128, 4, "bf16", True, dict(
        BLOCK_N=128, MAX_SLACK=0)),
    "inv e4m3 h128 G8, scale in exp": (128, 8, "e4m3", False, dict(SCALE_IN_EXP=True)),
    "inv e4m3 h128 G8, scale in exp, lazy rescale": (128, 8, "e4m3", False, dict(
        SCALE_IN_EXP=True, MAX_SLACK=0)),
    "inv e4m3 h128 G8, scale in exp, max slack 8": (128, 8, "e4m3", False, dict(
        SCALE_IN_EXP=True, MAX_SLACK=8)),
    "inv e4m3 h128 G8, 128 keys, scale in exp, fold in memory": (128, 8, "e4m3", False, dict(
        BLOCK_N=128, SCALE_IN_EXP=True, FOLD_MEM=True)),
    "inv e4m3 h128 G8, 128 keys, scale in exp, fold in memory, lazy rescale": (
        128, 8, "e4m3", False, dict(BLOCK_N=128, SCALE_IN_EXP=True, FOLD_MEM=True,
                                    MAX_SLACK=0)),
    "inv e4m3 h128 G8, 128 keys, scale in exp, fold in memory, max slack 8": (
        128, 8, "e4m3", False, dict(BLOCK_N=128, SCALE_IN_EXP=True, FOLD_MEM=True,
                                    MAX_SLACK=8)),
    "inv e4m3 h128 G8 split, sinks+softcap, lazy rescale": (128, 8, "e4m3", True, dict(
        USE_SINKS=True, USE_SOFTCAP=True, MAX_SLACK=0)),
}


def _args(head_size: int, group: int, q: str, kv: str, split: bool, descales: bool,
          features: dict) -> dict:
    """The arguments both decode kernels take, at a page of 16, 8 KV heads, causal, no
    window: q / kv the pointer types of Q and of the caches, k and v descales given where
    `descales`, then `features` (constexprs; USE_SINKS gives the sinks too)."""
    args = {
        "Q": q, "KC": kv, "VC": kv, "Out": "*fp32" if split else "*bf16",
        "Lse": "*fp32" if split or features.get("WRITE_LSE") else None,
        "cu_seqlens_q": "*i32", "seqused_k": "*i32", "block_table": "*i32",
        "sinks": None, "q_descale": "*fp32" if descales else None,
        "k_descale": "*fp32" if descales else None, "v_descale": "*fp32" if descales else None,
        "qk_scale": "fp32", "softcap": "fp32", "left": "i32", "right": "i32",
        "total_q": "i32", "num_splits": "i32", "stride_qt": "i32", "kv_rows": "i32",
        "stride_kc": "i32", "stride_vc": "i32", "page_rows": "i32", "head_rows": "i32",
        "head_cols_k": "i32", "head_cols_v": "i32", "stride_bt": "i32",
        "stride_ot": "i32:16", "stride_oh": "i32:16", "stride_ds_b": "i32",
        "stride_ds_h": "i32",
        "NUM_KV": 8, "GROUP": group, "GROUP_PAD": 1 << (group - 1).bit_length(),
        "QUERIES": 64 >> (group - 1).bit_length(), "HEAD_D": head_size,
        "HEAD_DV": head_size, "PAGE": 16, "WINDOW_LEFT": False, "WINDOW_RIGHT": True,
        "USE_SOFTCAP": False, "USE_SINKS": False, "WRITE_LSE": False, "SPLIT_KV": split,
        "KV_FP8": kv == "*fp8e4nv", "KV_DESCALE": descales,
    }
    for name, value in features.items():
        if name == "USE_SINKS" and value:
            args["sinks"] = "*fp32"
        args[name] = value
    return args


def invariant_spec(head_size: int, group: int, cache: str, split: bool,
                   features: dict) -> dict:
    """The invariant decode kernel's compile spec (`gluon_decode_invariant_launch`'s
    constexprs at a page of 16, 8 KV heads, causal, no window)."""
    features = dict(features)
    q8 = features.pop("Q_FP8", False)
    block_n = features.pop("BLOCK_N", 64)
    sys.path.insert(0, SRC)
    import gluon_decode_invariant  # noqa: E402 - imports only Triton
    fp8 = cache == "e4m3"
    num_buf, stages, worker_regs = gluon_decode_invariant.TILES[(head_size, fp8, block_n)]
    kv = "*fp8e4nv" if fp8 else f"*{cache}"
    args = dict(BLOCK_N=block_n, NUM_BUF=num_buf, STAGES=stages, Q_DESCALE=q8,
                DOT_F16=cache != "bf16", SPLIT_KEYS=1024, WORKER_REGS=worker_regs)
    q = "*fp8e4nv" if q8 else ("*bf16" if fp8 else kv)
    args.update(_args(head_size, group, q, kv, split, fp8, features))
    # the fold state of unsplit programs at head 256 (`SWITCHES.invariant_gluon_256`) and
    # of FOLD_MEM's (`SWITCHES.invariant_tiles_128`)
    fold = head_size > 128 or features.get("FOLD_MEM", False)
    args["Fold"] = "*fp32" if fold and not split else None
    # SELF_FOLD (`SWITCHES.invariant_self_fold`): split programs that fold their own splits,
    # writing the outputs (Out / Lse as an unsplit launch's) and partials beside them
    self_fold = features.get("SELF_FOLD", False)
    args["PartOut"] = args["PartLse"] = "*fp32" if self_fold else None
    args["Tickets"] = "*i32" if self_fold else None
    if self_fold:
        args["Out"] = "*bf16" if cache != "fp16" else "*fp16"
        args["Lse"] = "*fp32" if features.get("WRITE_LSE") else None
    return {"num_warps": 4, "args": args, "options": {"enable_fp_fusion": False}}


def kernel_module():
    """`gluon_decode_tiles` (imports nothing)."""
    sys.path.insert(0, SRC)
    import gluon_decode_tiles  # noqa: E402 - a module of the package, read without torch
    return gluon_decode_tiles


def spec(head_size: int, group: int, fp8: bool, split: bool, features: dict) -> dict:
    features = dict(features)
    per_sm = features.pop("PER_SM", 1)
    module = kernel_module()
    block_n, num_buf, stages, worker_regs = module.decode_tiles(head_size, fp8, per_sm)
    args = dict(BLOCK_N=block_n, NUM_BUF=num_buf, STAGES=stages, Q_DESCALE=fp8,
                SCALE_IN_EXP=True, WORKER_REGS=worker_regs)
    kv = "*fp8e4nv" if fp8 else "*bf16"
    args.update(_args(head_size, group, kv, kv, split, fp8, features))
    options = {"maxnreg": module.TWO_PER_SM_MAXNREG} if per_sm == 2 else {}
    return {"num_warps": 4, "args": args, "options": options}


def gmma_loops(sass: str) -> list[tuple[int, int, int]]:
    """(first address, back edge's address, instructions) of each loop (a predicated backward
    branch; the mbarrier retry stubs branch back unpredicated) holding a wgmma."""
    lines = re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)
    addr = [int(a, 16) for a, _ in lines]
    loops = []
    for i, (_, text) in enumerate(lines):
        m = re.search(r"^@!?U?P\d\s+BRA\b(?:\s+\S+,)?\s+0x([0-9a-f]+)", text)
        if not m or int(m.group(1), 16) >= addr[i]:
            continue
        body = [t for a, t in zip(addr, (t for _, t in lines), strict=True)
                if int(m.group(1), 16) <= a <= addr[i]]
        if any("GMMA" in t for t in body):
            loops.append((int(m.group(1), 16), addr[i], len(body)))
    return loops


def loop_instructions(sass: str) -> str:
    """Instructions of the consumer's key loop: the longest loop holding a wgmma and no other
    such loop (both of its softmax branches, masked tile or not, counted); in the persistent
    form, " / " and those of the unit loop around it (the longest)."""
    loops = gmma_loops(sass)
    inner = [n for lo, hi, n in loops
             if not any((lo, hi) != (lo2, hi2) and lo <= lo2 and hi2 <= hi
                        for lo2, hi2, _ in loops)]
    if not inner:
        return "?"
    longest = max(n for _, _, n in loops)
    return str(max(inner)) + ("" if longest == max(inner) else f" / {longest}")


def compile_row(tool: str, name: str, dump: str) -> list[str]:
    return _row(compile_variant(tool, KERNEL, NAME, name, spec(*VARIANTS[name]), dump), name)


def compile_persistent_row(tool: str, name: str, dump: str) -> list[str]:
    """A variant in the persistent form: its spec plus the runtime batch and grid."""
    sp = spec(*VARIANTS[name])
    sp["args"] = dict(sp["args"], batch="i32", programs="i32")
    return _row(compile_variant(tool, PERSISTENT_KERNEL, PERSISTENT_NAME, name, sp, dump), name)


def compile_invariant_row(tool: str, name: str, dump: str) -> list[str]:
    return _row(compile_variant(tool, INVARIANT_KERNEL, INVARIANT_NAME, name,
                                invariant_spec(*INVARIANT_VARIANTS[name]), dump), name)


def _row(done, name: str) -> list[str]:
    failed = done.failure_row(name)
    if failed:
        return failed
    with open(done.stage("sass")) as f:
        sass = f.read()

    def find(rx):
        m = re.search(rx, done.log)
        return m.group(1) if m else "?"
    regs = re.findall(r"\('(dec|inc)', '(\d+)'\)", done.log)
    return [name, find(r"dynamic smem, bytes\) = (\d+)"), find(r"REG:(\d+)"),
            "/".join(f"{k} {v}" for k, v in regs) or "-",
            str(len(re.findall(r"\bHGMMA\.", sass))), str(len(re.findall(r"\bQGMMA\.", sass))),
            str(len(re.findall(r"\b(?:STL|LDL)\b", sass))),
            serialised(done.stage("ptx")), loop_instructions(sass)]


def main() -> int:
    def choose(ns):
        if ns.invariant:
            return compile_invariant_row, INVARIANT_VARIANTS
        if ns.persistent:
            return compile_persistent_row, VARIANTS
        return compile_row, VARIANTS
    return variant_table(
        __doc__, "gluon_decode_sass_",
        ["| variant | smem B | REG | setmaxnreg | HGMMA | QGMMA | STL/LDL | "
         "wgmma serialised | instructions in the key loop (/ the loop around it) |",
         "|---|---:|---:|---|---:|---:|---:|---|---:|"], compile_row, VARIANTS,
        flags=[("--invariant", "batch-invariant mode's decode kernel (gluon_decode_invariant.py)"),
               ("--persistent", "the persistent form (gluon_decode_persistent.py)")],
        choose=choose)


if __name__ == "__main__":
    sys.exit(main())
