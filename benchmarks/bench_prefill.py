"""Prefill side by side (issues 16 and 40): pagedattn's passes, FlashAttention-3 (bf16 and fp8),
SDPA FlashAttention-2 / cuDNN, FlexAttention, in TFLOP/s on the same shapes, one run.

    PYTHONPATH=src python benchmarks/bench_prefill.py [--sweep] [--rows main,window,fp8,...]
        [--rounds 3] [--flex LABELS] [--out FILE]

"ours (engine)" is what the Attention layer runs: a plan made once per step, run with the new
tokens' keys and values as dense rows (on sm_90 the Gluon pass, beside it the `tl` pass the
plan picks with the Gluon pass switched off); "ours (op)" is the public
`flash_attn_varlen_func` over the paged cache alone (the Gluon pass reads it page by page;
without it, the portable prefill pass). The pass that ran is in brackets. References
see dense tensors with the KV heads expanded (FlexAttention: enable_gqa). FLOPs count only
visible scores: 4 * H * D per (query, visible key).

FA3 is the `fa3-fwd` wheel's forward (`peers.py`; where it is not installed its columns say
so) over dense varlen K/V holding the paged cache's values. Our engine path, our op path and
FA3 are timed alternately in `--rounds` rounds in one process (a single pass varies 10-20%),
the median of each; the SDPA and FlexAttention columns are timed once. Beside each row, the
error against the float64 oracle on 128 sampled query rows (every head; `sampled_error.py`),
max / mean abs, of ours and of FA3 on the same inputs: the cache holds the new tokens' keys
and values (the engine path reads them as dense rows too). The fp8 rows (`--rows fp8`) are
an e4m3 q over an e4m3 cache for ours (what a FLASH_ATTN layer runs for that cache) and e4m3
q, k, v with descales for FA3. `--out FILE` writes the tables there too.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math

import peers
import torch
import torch.nn.functional as F
import triton
from sampled_error import error_cell, oracle_rows, row_errors, sample_rows
from timing import Emitter, alternate, error_text, graph_ms
from timing import eager_ms as bench
from torch.nn.attention import SDPBackend, sdpa_kernel

from pagedattn.ops.triton import launch
from pagedattn.ops.triton.attention_plan import plan_attention
from pagedattn.ops.triton.op_plans import varlen_attention

DEV = "cuda"
DT = torch.bfloat16
E4M3 = torch.float8_e4m3fn
ROUNDS = 3  # --rounds: each row's engine, op and FA3 columns alternated this many times
SAMPLED_ROWS = 128  # query rows (every head) checked against the float64 oracle per row


class Prefill:
    """Prompts (or chunks after a cached context) over a scattered paged cache."""

    def __init__(self, query_lens, seq_lens, heads=32, kv_heads=8, d=128, window=-1,
                 cache_dtype=DT, block_size=16, q_dtype=DT):
        self.query_lens, self.seq_lens = list(query_lens), list(seq_lens)
        self.h, self.hkv, self.d, self.window = heads, kv_heads, d, window
        blocks = [math.ceil(s / block_size) for s in seq_lens]
        cache = torch.randn(2, sum(blocks), block_size, kv_heads, d, device=DEV, dtype=DT)
        self.k, self.v = cache.to(cache_dtype).unbind(0)
        perm = torch.randperm(sum(blocks), device=DEV, dtype=torch.int32)
        self.table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device=DEV)
        start = 0
        for r, n in enumerate(blocks):
            self.table[r, :n] = perm[start:start + n]
            start += n
        total = sum(query_lens)
        # q_dtype fp8: the query as the layer quantises it for an e4m3 cache
        self.q = torch.randn(total, heads, d, device=DEV, dtype=DT).to(q_dtype)
        # The new tokens' keys and values as the cache holds them (after the layer's cache
        # write), so the paths reading them as dense rows and those reading the cache agree
        new = [(r, s - n, s) for r, (n, s) in enumerate(zip(query_lens, seq_lens))]
        self.k_new = peers.paged_rows(self.k, self.table, new).to(DT)
        self.v_new = peers.paged_rows(self.v, self.table, new).to(DT)
        self.out = torch.empty(self.q.shape, device=DEV, dtype=DT)
        self.cu_q = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32,
                                 device=DEV)
        self.seqused = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
        fp8 = cache_dtype != DT
        self.descale = torch.ones((), device=DEV).expand(len(seq_lens), kv_heads) if fp8 \
            else None
        self.q_descale = self.descale if q_dtype != DT else None

    def flops(self) -> float:
        total = 0
        for n, s in zip(self.query_lens, self.seq_lens):
            for_pos = torch.arange(s - n, s, dtype=torch.float64) + 1  # keys each query sees
            if self.window >= 0:
                for_pos = for_pos.clamp(max=self.window + 1)
            total += float(for_pos.sum())
        return 4.0 * self.h * self.d * total

    def engine_plan(self, new_keys_only=None, batch_invariant=False):
        """The engine's plan; new_keys_only as the builder marks prompts alone unless given;
        batch_invariant: the plan of a builder in batch-invariant mode (issue 44)."""
        if new_keys_only is None:
            new_keys_only = self.query_lens == self.seq_lens
        return plan_attention(
            device=torch.device(DEV), cu_seqlens_q=self.cu_q, seqused_k=self.seqused,
            cu_seqlens_k=None, block_table=self.table, batch=len(self.seq_lens),
            total_q=self.q.shape[0], max_seqlen_q=max(self.query_lens),
            max_seqlen_k=max(self.seq_lens), num_heads=self.h, num_kv_heads=self.hkv,
            head_size=self.d, head_size_v=self.d, page_size=self.k.shape[1],
            q_dtype=self.q.dtype,
            kv_dtype=self.k.dtype, out_dtype=DT, softmax_scale=self.d ** -0.5, causal=True,
            window_left=self.window, window_right=0 if self.window >= 0 else -1, softcap=0.0,
            use_alibi=False, use_sinks=False, use_q_descale=self.q_descale is not None,
            use_kv_descale=self.descale is not None, write_lse=False, dense_new_kv=True,
            new_keys_only=new_keys_only, batch_invariant=batch_invariant)

    def engine(self, new_keys_only=None, batch_invariant=False):
        plan = self.engine_plan(new_keys_only, batch_invariant)
        return functools.partial(plan.run, self.q, self.k, self.v, self.out,
                                 q_descale=self.q_descale, k_descale=self.descale,
                                 v_descale=self.descale,
                                 k_new=self.k_new, v_new=self.v_new), plan

    @functools.cached_property
    def dense_kv(self) -> tuple:
        """(k_rows, v_rows [sum(seq_lens), H_kv, D], cu_seqlens_k): the cache's keys and
        values as dense varlen rows, the same values (made once)."""
        every = [(r, 0, s) for r, s in enumerate(self.seq_lens)]
        cu_k = torch.tensor([0, *itertools.accumulate(self.seq_lens)], dtype=torch.int32,
                            device=DEV)
        return (peers.paged_rows(self.k, self.table, every),
                peers.paged_rows(self.v, self.table, every), cu_k)

    def fa3(self):
        """(a call of FA3's forward on this batch returning its output, "") or (None, why
        not): bf16, or e4m3 q, k and v with descales (an fp8 row: q and cache in e4m3)."""
        module, why = peers.fa3()
        if module is None:
            return None, why
        if self.window >= 0:
            return None, "no sliding window in the wheel"
        if self.q.dtype != self.k.dtype:
            return None, "needs q in the cache's dtype"
        k_rows, v_rows, cu_k = self.dense_kv
        return peers.fa3_varlen(module, self.q, k_rows, v_rows, self.cu_q, cu_k,
                                max(self.query_lens), max(self.seq_lens), self.d ** -0.5,
                                descale=self.descale), ""

    def oracle(self, rows) -> torch.Tensor:
        """float64 outputs of the sampled query rows (sampled_error.oracle_rows)."""
        k_rows, v_rows, _ = self.dense_kv
        return oracle_rows(self.q, k_rows, v_rows, self.query_lens, self.seq_lens, rows,
                           self.d ** -0.5, self.window)

    def op(self):
        return functools.partial(
            varlen_attention, self.q, self.k, self.v, self.out, cu_seqlens_q=self.cu_q,
            seqused_k=self.seqused, cu_seqlens_k=None, block_table=self.table,
            max_seqlen_q=max(self.query_lens), max_seqlen_k=max(self.seq_lens),
            softmax_scale=self.d ** -0.5, causal=True, window_left=self.window,
            window_right=0 if self.window >= 0 else -1, softcap=0.0, alibi_slopes=None,
            sinks=None, q_descale=self.q_descale, k_descale=self.descale,
            v_descale=self.descale,
            softmax_lse=None)


def references(p: Prefill) -> list[str]:
    """SDPA flash / cuDNN and FlexAttention TFLOP/s on dense tensors of the same batch (equal
    lengths only; one sequence with a context: bottom-right causal)."""
    n, L, S = len(p.query_lens), p.query_lens[0], p.seq_lens[0]
    if any(q != L for q in p.query_lens) or any(s != S for s in p.seq_lens):
        return ["n/a"] * 3
    q = torch.randn(n, p.h, L, p.d, device=DEV, dtype=DT)
    k = torch.randn(n, p.h, S, p.d, device=DEV, dtype=DT)
    v = torch.randn_like(k)
    flops, res = p.flops(), []
    if p.window < 0:
        from torch.nn.attention.bias import causal_lower_right
        mask = causal_lower_right(L, S) if S != L else None
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
            try:
                with sdpa_kernel(backend):
                    fn = functools.partial(F.scaled_dot_product_attention, q, k, v,
                                           attn_mask=mask, is_causal=mask is None)
                    res.append(f"{flops / bench(fn) / 1e9:.0f}")
            except Exception as e:  # a backend missing on this build, or the shape refused
                res.append(f"n/a ({type(e).__name__})")
    else:
        res += ["n/a (window)"] * 2
    if not any(label in FLEX_LABELS for label in ("all", getattr(p, "label", None))):
        return res + ["skipped"]
    try:
        from torch.nn.attention.flex_attention import create_block_mask
        ctx, w = S - L, p.window

        def visible(b, h, qi, ki):
            ok = qi + ctx >= ki
            return ok & (qi + ctx - ki <= w) if w >= 0 else ok
        bm = create_block_mask(visible, None, None, L, S, device=DEV)
        kk, vv = k[:, :p.hkv].contiguous(), v[:, :p.hkv].contiguous()
        fn = functools.partial(_compiled_flex(), q, kk, vv, block_mask=bm, enable_gqa=True)
        fn()
        res.append(f"{flops / bench(fn) / 1e9:.0f}")
    except Exception as e:
        res.append(f"n/a ({type(e).__name__})")
    return res


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention)


MAIN_ROWS = [  # (label, query_lens, seq_lens, heads, kv_heads, head_size)
    ("1 x 8192", [8192], [8192], 32, 8, 128),
    ("1 x 16384", [16384], [16384], 32, 8, 128),
    ("8 x 2048", [2048] * 8, [2048] * 8, 32, 8, 128),
    ("32 x 512", [512] * 32, [512] * 32, 32, 8, 128),
    ("1 x 8192, head 64", [8192], [8192], 32, 8, 64),
    ("8 x 2048, head 64", [2048] * 8, [2048] * 8, 32, 8, 64),
    ("1 x 8192, head 256", [8192], [8192], 16, 8, 256),
    ("8 x 2048, head 256", [2048] * 8, [2048] * 8, 16, 8, 256),
    ("2048 after 30720 cached", [2048], [32768], 32, 8, 128),
]


FLEX_LABELS = ["all"]  # the rows whose FlexAttention column is timed (--flex)
WINDOW_ROWS = [("1 x 32768, window 4096", [32768], [32768], 32, 8, 128, 4095)]


def emit_table(rows, emit=print, rounds=None) -> None:
    """The bf16 rows: our passes, FA3 and the references, one line a row (see module doc)."""
    _note_fa3(emit)
    emit("| prompts | ours (engine) | ours, the `tl` pass or other row layout | ours (op) | "
         "FA3 | engine / FA3 | op / FA3 | SDPA flash | SDPA cuDNN | FlexAttention | "
         "floor ms (700 TFLOP/s) | ours ms | error ours (engine) | error ours (op) | "
         "error FA3 |")
    emit("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    failures: list[str] = []
    for label, ql, sl, h, hkv, d, *rest in rows:
        window = rest[0] if rest else -1
        _guarded(emit, label, functools.partial(bf16_row, label, ql, sl, h, hkv, d, window,
                                                rounds or ROUNDS, failures))
    _emit_failures(failures, emit)


def bf16_row(label, ql, sl, h, hkv, d, window, rounds, failures) -> str:
    p = Prefill(ql, sl, h, hkv, d, window=window)
    p.label = label
    flops = p.flops()
    run, plan = p.engine()
    kinds = _kinds(plan)
    if plan.gluon is not None:  # beside it, the `tl` pass the plan picks without it
        launch.SWITCHES.gluon_prefill = False
        other = p.engine()[0]  # the choice is the plan's: made now, run later
        launch.SWITCHES.gluon_prefill = None
    else:  # the Hopper pass's other row layout (packed GQA rows or one head per program)
        picked_packed = any(pl.name == "hopper" and pl.boxes[1] > 1 for pl in plan.launches)
        kinds += ", packed" if picked_packed else ""
        switch = launch.SWITCHES.hopper_pack_gqa
        launch.SWITCHES.hopper_pack_gqa = not picked_packed
        other = p.engine()[0]
        launch.SWITCHES.hopper_pack_gqa = switch
    fa3, fa3_why = _fa3_call(p)
    t = alternate([("engine", bench, run), ("other", bench, other), ("op", bench, p.op())]
                  + [("fa3", bench, fa3)] * (fa3 is not None), rounds)
    errors = row_errors_of(p, {"engine": run, "op": p.op(), "fa3": fa3})
    ref = references(p)
    failures += [f"{label}, {name}: {error}" for name, (_, error) in t.items() if error]
    return (f"| {label} [{kinds}] | {_rate(flops, t['engine'])} | {_rate(flops, t['other'])} | "
            f"{_rate(flops, t['op'])} | {_rate(flops, t.get('fa3'), fa3_why)} | "
            f"{_ratio(t['engine'], t.get('fa3'))} | {_ratio(t['op'], t.get('fa3'))} | "
            + " | ".join(ref)
            + f" | {flops / 700e12 * 1e3:.3f} | {t['engine'][0]:.3f} | {errors['engine']} | "
            f"{errors['op']} | {errors['fa3']} |")


FP8_ROWS = [  # (label, query_lens, seq_lens, heads, kv_heads, head_size): issue 40's fp8 rows
    ("1 x 8192", [8192], [8192], 32, 8, 128),
    ("8 x 2048", [2048] * 8, [2048] * 8, 32, 8, 128),
    ("2048 after 30720 cached", [2048], [32768], 32, 8, 128),
    ("32 x 512", [512] * 32, [512] * 32, 32, 8, 128),
    ("1 x 8192, head 64", [8192], [8192], 32, 8, 64),
    ("1 x 8192, head 256", [8192], [8192], 16, 8, 256),
]


def emit_fp8_table(rows, emit=print, rounds=None) -> None:
    """fp8: ours an e4m3 q over an e4m3 cache (engine and op paths), FA3 e4m3 q, k, v."""
    _note_fa3(emit)
    emit("| prompts, fp8 (e4m3) | ours (engine) | ours (op) | FA3 fp8 | engine / FA3 | "
         "op / FA3 | ours ms | FA3 ms | error ours (engine) | error ours (op) | error FA3 |")
    emit("|---|---|---|---|---|---|---|---|---|---|---|")
    failures: list[str] = []
    for label, ql, sl, h, hkv, d in rows:
        _guarded(emit, label, functools.partial(fp8_row, label, ql, sl, h, hkv, d,
                                                rounds or ROUNDS, failures))
    _emit_failures(failures, emit)


def fp8_row(label, ql, sl, h, hkv, d, rounds, failures) -> str:
    p = Prefill(ql, sl, h, hkv, d, cache_dtype=E4M3, q_dtype=E4M3)
    flops = p.flops()
    run, plan = p.engine()
    fa3, fa3_why = _fa3_call(p)
    t = alternate([("engine", bench, run), ("op", bench, p.op())]
                  + [("fa3", bench, fa3)] * (fa3 is not None), rounds)
    errors = row_errors_of(p, {"engine": run, "op": p.op(), "fa3": fa3})
    fa3_ms = t.get("fa3", (float("nan"), None))[0]
    failures += [f"{label}, {name}: {error}" for name, (_, error) in t.items() if error]
    return (f"| {label} [{_kinds(plan)}] | {_rate(flops, t['engine'])} | "
            f"{_rate(flops, t['op'])} | {_rate(flops, t.get('fa3'), fa3_why)} | "
            f"{_ratio(t['engine'], t.get('fa3'))} | {_ratio(t['op'], t.get('fa3'))} | "
            f"{t['engine'][0]:.3f} | {fa3_ms:.3f} | {errors['engine']} | {errors['op']} | "
            f"{errors['fa3']} |")


def _guarded(emit, label: str, row) -> None:
    """Emit row(), or where it raises (a kernel that fails to compile, memory) a line that
    says so: one row's failure never ends the table."""
    try:
        line = row()
    except Exception as e:  # noqa: BLE001 - a benchmark row, not a library path
        line = f"| {label} | failed: {error_text(e)} |"
    emit(line)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def row_errors_of(p: Prefill, calls: dict) -> dict:
    """{name: "max / mean" abs error against the float64 oracle on sampled query rows} of each
    call (ours write p.out, poisoned first; FA3's returns its output); "-" for a None call."""
    cells = {name: "-" for name in calls}
    try:
        rows = sample_rows(p.query_lens, SAMPLED_ROWS)
        want = p.oracle(rows)
    except Exception as e:  # noqa: BLE001 - the row's timings still print
        return {name: f"oracle failed ({error_text(e)[:60]})" for name in calls}
    for name, call in calls.items():
        if call is None:
            continue
        try:
            p.out.fill_(float("nan"))
            out = call()
            out = p.out if out is None else out
            if out.is_cuda:
                torch.cuda.synchronize()
            cells[name] = error_cell(row_errors(out, rows, want))
        except Exception as e:  # noqa: BLE001
            cells[name] = f"failed ({error_text(e)[:60]})"
    return cells


def _kinds(plan) -> str:
    """The passes a plan launches, as the row label shows them."""
    return "+".join(["gluon"] * (plan.gluon is not None) + [pl.name for pl in plan.launches])


def _rate(flops: float, timed, why: str = "") -> str:
    """TFLOP/s cell of an `alternate` entry (ms, error); `why` where the column was not run."""
    if timed is None:
        return f"- ({why})" if why else "-"
    ms, error = timed
    return "failed" if error else f"{flops / ms / 1e9:.0f}"


def _ratio(ours, theirs) -> str:
    """ours / theirs in speed (their time over ours)."""
    if ours is None or theirs is None or ours[1] or theirs[1]:
        return "-"
    return f"{theirs[0] / ours[0]:.2f}"


def _emit_failures(failures: list, emit) -> None:
    """Below the table (a line inside would end it): each column that failed, and why."""
    if failures:
        emit("")
    for line in failures:
        emit(f"failed: {line}")


def _fa3_call(p: Prefill) -> tuple:
    """p.fa3(), the reason left out where the wheel is missing (said once above the table)."""
    call, why = p.fa3()
    return call, why if peers.fa3()[0] is not None else ""


def _note_fa3(emit) -> None:
    module, why = peers.fa3()
    if module is None:
        emit(f"FlashAttention-3 (fa3-fwd): {why}\n")


def mixed_rows(bw: float, emit=print) -> None:
    """Table (c)'s mixed batches through the engine path, graph-replayed, against their
    floors: K/V bytes over the copy bandwidth plus visible FLOPs at 700 TFLOP/s."""
    emit("\n| batch | engine ms | op ms | bytes floor ms | FLOP floor ms | engine / sum |")
    emit("|---|---|---|---|---|---|")
    for n_pre, chunk, ctx_pre, n_dec, ctx_dec in ((4, 512, 2048, 128, 4096),
                                                  (2, 2048, 2048, 64, 8192)):
        ql = [chunk] * n_pre + [1] * n_dec
        sl = [ctx_pre] * n_pre + [ctx_dec] * n_dec
        p = Prefill(ql, sl)
        run, _ = p.engine()
        ms = graph_ms(run)
        op_ms = graph_ms(p.op())
        kv_bytes = sum(sl) * p.hkv * p.d * 2 * 2
        floor_b, floor_f = kv_bytes / bw * 1e3, p.flops() / 700e12 * 1e3
        emit(f"| {n_pre} x {chunk} (ctx {ctx_pre}) + {n_dec} decodes (ctx {ctx_dec}) | "
             f"{ms:.3f} | {op_ms:.3f} | {floor_b:.3f} | {floor_f:.3f} | "
             f"{ms / (floor_b + floor_f):.2f} |")
        del p
        torch.cuda.empty_cache()


def copy_bandwidth() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    return 2 * (1 << 30) / (bench(functools.partial(y.copy_, x)) * 1e-3)


def fp8_context_row(emit=print) -> None:
    """The fp8 cache beside bf16: with a bf16 q (an e5m2 cache, or a backend that keeps q),
    and with the fp8 q a FLASH_ATTN layer makes for an e4m3 cache."""
    emit("\n| 2048 after 30720 cached | bf16 cache ms | fp8 cache ms | fp8 cache, fp8 q ms |")
    emit("|---|---|---|---|")
    res, kinds = [], []
    e4m3 = torch.float8_e4m3fn
    for cache_dtype, q_dtype in ((DT, DT), (e4m3, DT), (e4m3, e4m3)):
        p = Prefill([2048], [32768], cache_dtype=cache_dtype, q_dtype=q_dtype)
        run, plan = p.engine()
        kinds.append(_kinds(plan))
        res.append(bench(run))
    emit(f"| engine path [{', '.join(kinds)}] | {res[0]:.3f} | {res[1]:.3f} | {res[2]:.3f} |")


def sweep(tiles) -> dict:
    """Times each tile set on a few shapes; returns the best per head size (by the sum of
    TFLOP/s over that head size's shapes) for `--pick`."""
    print("\n### Hopper pass tiles (block_m, block_n, warps, stages): TFLOP/s\n")
    shapes = [("1 x 8192", [8192], [8192], 32, 8, 128),
              ("8 x 2048", [2048] * 8, [2048] * 8, 32, 8, 128),
              ("32 x 512", [512] * 32, [512] * 32, 32, 8, 128),
              ("1 x 8192 d64", [8192], [8192], 32, 8, 64),
              ("1 x 8192 d256", [8192], [8192], 16, 8, 256),
              ("2048 after 30720", [2048], [32768], 32, 8, 128)]
    print("| tiles | " + " | ".join(s[0] for s in shapes) + " |")
    print("|---|" + "---|" * len(shapes))
    data = {s[0]: Prefill(*s[1:]) for s in shapes}
    score: dict = {}
    for *t, pack in tiles:
        launch.SWITCHES.hopper_tiles = tuple(t)
        launch.SWITCHES.hopper_pack_gqa = bool(pack)
        cells = []
        for s in shapes:
            p = data[s[0]]
            try:
                tflops = p.flops() / bench(p.engine()[0]) / 1e9
                cells.append(f"{tflops:.0f}")
                key = (p.d, tuple(t), bool(pack))
                score[key] = score.get(key, 0.0) + tflops
            except Exception as e:  # out of shared memory, say
                cells.append(f"err {type(e).__name__}")
                score[(p.d, tuple(t), bool(pack))] = float("-inf")
        print(f"| {tuple(t)}{' packed' if pack else ''} | " + " | ".join(cells) + " |",
              flush=True)
    launch.SWITCHES.hopper_tiles = launch.SWITCHES.hopper_pack_gqa = None
    best: dict = {}
    for (d, t, pack), total in score.items():
        if not pack and total > best.get(d, (None, float("-inf")))[1]:
            best[d] = (t, total)
    return {d: t for d, (t, _) in best.items()}


def matmul_rate() -> float:
    a = torch.randn(8192, 8192, device=DEV, dtype=DT)
    b = torch.randn_like(a)
    return 2 * 8192 ** 3 / bench(lambda: a @ b) / 1e9


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="main,window,fp8,mixed",
                    help="tables: main (bf16 rows), window, fp8 (e4m3 rows beside FA3 fp8, "
                         "then the fp8-cache variants of the chunk row), mixed")
    ap.add_argument("--sweep", default="", help="tiles 'bm,bn,w,s,pack;...' to sweep")
    ap.add_argument("--pick", action="store_true", help="use the sweep's best tiles below")
    ap.add_argument("--flex", default="all",
                    help="rows (labels, comma-separated) that time FlexAttention, which "
                         "compiles ~20 s a row; 'all' (default) or '' for none")
    ap.add_argument("--rounds", type=int, default=ROUNDS,
                    help="rounds of alternated timings of our paths and FA3 (median)")
    ap.add_argument("--out", default=None, help="also write the tables to this file")
    return ap.parse_args(argv)


def main() -> None:
    args = parse_args()
    FLEX_LABELS[:] = args.flex.split(",") if args.flex else []
    emit = Emitter()
    emit.to_file(args.out)
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    emit(f"device: {props.name}; torch {torch.__version__}, triton {triton.__version__}; "
         f"bf16 matmul 8192^3: {matmul_rate():.0f} TFLOP/s; {args.rounds} rounds")
    if args.sweep:
        best = sweep([tuple(int(x) for x in t.split(",")) for t in args.sweep.split(";")])
        if args.pick:  # the tables below use the sweep's best per-head tiles
            launch.SWITCHES.hopper_tiles = best
            print(f"\ntables below use tiles {best}")
    rows = args.rows.split(",")
    if "main" in rows:
        emit("\n### Causal prefill, bf16, block 16 (TFLOP/s on visible FLOPs)\n")
        emit_table(MAIN_ROWS, emit, args.rounds)
    if "window" in rows:
        emit("\n### Sliding window 4096 over 1 x 32768 (visible FLOPs)\n")
        emit_table(WINDOW_ROWS, emit, args.rounds)
    if "fp8" in rows:
        emit("\n### Causal prefill, fp8 (e4m3), block 16 (TFLOP/s on visible FLOPs)\n")
        emit_fp8_table(FP8_ROWS, emit, args.rounds)
        fp8_context_row(emit)
    if "mixed" in rows:
        mixed_rows(copy_bandwidth(), emit)


if __name__ == "__main__":
    main()
