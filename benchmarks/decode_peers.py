"""Decode beside its peers (issue 41's table), in one process, alternated in rounds.

    from decode_peers import DECODE_ROWS, DecodeBatch, section
    section(emit, rounds=3)          # bench_kernels.py --sections decode

Rows: 32 q / 8 KV heads, head 128, block 16, shuffled blocks; B requests of L cached keys and
one new query each. Columns, each graph-replayed and eager:
- ours: the engine path, a plan made once for the batch (`plan_attention`) and run over the
  paged cache; bf16, and fp8: an e4m3 q over an e4m3 cache (what FLASH_ATTN runs for it);
- FA3 bf16 / fp8 (e4m3 q, k, v): the `fa3-fwd` wheel over dense varlen K/V holding the same
  keys, with its own split heuristic (`num_splits=0`);
- SDPA's cuDNN attention over the same dense bf16 K/V (the KV heads shared, not copied);
- vLLM's Triton unified attention over our bf16 paged cache, where vLLM is installed.
GB/s of K/V read is the cache's bytes (every request's keys and values; fp8 columns count
fp8 bytes) over the kernel's time; the ms tables follow. The timings of a row's columns are
alternated in `rounds` rounds (the order rotated each round), the median of each.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import peers
import torch
from timing import alternate, eager_ms, error_text, graph_ms

from pagedattn.ops.triton.attention_plan import plan_attention

DECODE_ROWS = (("B1 L32k", 1, 32768), ("B32 L4k", 32, 4096), ("B128 L1k", 128, 1024),
               ("B64 L16k", 64, 16384), ("B8 L128k", 8, 131072))
H, HKV, D, PAGE = 32, 8, 128, 16
DT, E4M3 = torch.bfloat16, torch.float8_e4m3fn
DEV = "cuda"
MODES = (("graph", graph_ms), ("eager", eager_ms))
# Column names, in table order; a column without a call on this machine shows "-".
COLUMNS = ("ours bf16", "FA3 bf16", "SDPA cuDNN", "vLLM", "ours fp8", "FA3 fp8")


class DecodeBatch:
    """`batch` requests of `ctx` cached keys and one new query each, over a paged cache of
    shuffled blocks in `dtype` (bf16, or e4m3 with an e4m3 q and descales of 1), with the
    plan the engine makes once for the batch."""

    def __init__(self, batch: int, ctx: int, dtype: torch.dtype = DT, device: str = DEV):
        self.batch, self.ctx, self.dtype = batch, ctx, dtype
        blocks = math.ceil(ctx / PAGE)
        # [2, num_blocks, PAGE, H_kv, D]: K and V, the seeds' FLASH_ATTN layout
        cache = torch.randn(2, batch * blocks, PAGE, HKV, D, dtype=DT, device=device).to(dtype)
        self.k, self.v = cache.unbind(0)
        self.block_table = torch.randperm(batch * blocks, dtype=torch.int32,
                                          device=device).view(batch, blocks)
        self.q = torch.randn(batch, H, D, dtype=DT, device=device).to(dtype)  # [B, H, D]
        self.out = torch.empty(batch, H, D, dtype=DT, device=device)
        self.cu_q = torch.arange(batch + 1, dtype=torch.int32, device=device)
        self.seqused = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        fp8 = dtype != DT
        self.descale = torch.ones((), device=device).expand(batch, HKV) if fp8 else None
        self.kv_bytes = 2 * batch * ctx * HKV * D * cache.element_size()
        self.plan = plan_attention(
            device=torch.device(device), cu_seqlens_q=self.cu_q, seqused_k=self.seqused,
            cu_seqlens_k=None, block_table=self.block_table, batch=batch, total_q=batch,
            max_seqlen_q=1, max_seqlen_k=ctx, num_heads=H, num_kv_heads=HKV, head_size=D,
            head_size_v=D, page_size=PAGE, q_dtype=self.q.dtype, kv_dtype=dtype, out_dtype=DT,
            softmax_scale=D ** -0.5, causal=True, window_left=-1, window_right=-1, softcap=0.0,
            use_alibi=False, use_sinks=False, use_q_descale=fp8, use_kv_descale=fp8,
            write_lse=False)

    def engine(self) -> Callable[[], None]:
        """Ours: the plan's launches over the paged cache, writing self.out."""
        return functools.partial(self.plan.run, self.q, self.k, self.v, self.out,
                                 q_descale=self.descale, k_descale=self.descale,
                                 v_descale=self.descale)

    def passes(self) -> list[dict]:
        """The plan's launches: name, kernel, grid, warps, stages and tiles (for ncu)."""
        return [dict(name=pl.name, kernel=pl.fn.__name__, grid=list(pl.grid),
                     num_warps=pl.kwargs["num_warps"], num_stages=pl.kwargs["num_stages"],
                     block_m=pl.constexprs.get("BLOCK_M"), block_n=pl.constexprs.get("BLOCK_N"))
                for pl in self.plan.launches]

    def splits(self) -> int:
        """The decode pass's split-KV count: the Gluon decode launch's (its grid form's third
        axis, or the persistent form's count, whose grid is the programs alone) or the `tl`
        pass's (its grid's third axis)."""
        if self.plan.gluon_decode is not None:
            return self.plan.gluon_decode.num_splits
        return next((pl.grid[2] for pl in self.plan.launches if pl.name == "decode"), 1)

    @functools.cached_property
    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache's keys and values as dense rows [batch * ctx, H_kv, D], request after
        request (made once; the dense peers read them)."""
        every = [(r, 0, self.ctx) for r in range(self.batch)]
        return (peers.paged_rows(self.k, self.block_table, every),
                peers.paged_rows(self.v, self.block_table, every))

    def fa3(self, module) -> Callable[[], torch.Tensor]:
        k_rows, v_rows = self.dense
        cu_k = self.cu_q * self.ctx
        return peers.fa3_varlen(module, self.q, k_rows, v_rows, self.cu_q, cu_k, 1, self.ctx,
                                D ** -0.5, causal=True, descale=self.descale)

    def cudnn(self) -> Callable[[], torch.Tensor]:
        k_rows, v_rows = self.dense

        def heads_first(x):  # [B * L, H_kv, D] -> [B, H_kv, L, D], a view
            return x.view(self.batch, self.ctx, HKV, D).transpose(1, 2)
        return peers.sdpa_cudnn(self.q.unsqueeze(2), heads_first(k_rows), heads_first(v_rows))

    def vllm(self, fn) -> Callable[[], None]:
        return peers.vllm_paged(fn, self.q, self.k, self.v, self.out, self.cu_q, 1,
                                self.seqused, self.ctx, self.block_table, D ** -0.5)


def row_calls(bf16: DecodeBatch, fp8: DecodeBatch) -> dict[str, Callable]:
    """{column: call} of one row: ours always, each peer where it loads."""
    calls = {"ours bf16": bf16.engine(), "ours fp8": fp8.engine(), "SDPA cuDNN": bf16.cudnn()}
    fa3, _ = peers.fa3()
    if fa3 is not None:
        calls["FA3 bf16"], calls["FA3 fp8"] = bf16.fa3(fa3), fp8.fa3(fa3)
    vllm, _ = peers.vllm_unified()
    if vllm is not None:
        calls["vLLM"] = bf16.vllm(vllm)
    return calls


def measure_rows(rows=DECODE_ROWS, rounds: int = 3, progress=print) -> list[dict]:
    """Each row's timings {"column|mode": (median ms, error)}, its K/V bytes per dtype and
    our plans' split counts. A row's tensors are freed before the next row is made."""
    results = []
    for label, batch, ctx in rows:
        try:
            result = measure_row(label, batch, ctx, rounds)
        except Exception as e:  # noqa: BLE001 - memory, a compile: the other rows still run
            result = dict(label=label, timed={"row|": (float("nan"), error_text(e))},
                          splits=("-", "-"), bytes={})
        results.append(result)
        progress(f"{label}: " + ", ".join(
            f"{key} {ms:.4f} ms" for key, (ms, _) in result["timed"].items()), flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return results


def measure_row(label: str, batch: int, ctx: int, rounds: int) -> dict:
    bf16, fp8 = DecodeBatch(batch, ctx), DecodeBatch(batch, ctx, E4M3)
    columns = [(f"{name}|{mode}", timer, call) for name, call in row_calls(bf16, fp8).items()
               for mode, timer in MODES]
    return dict(label=label, timed=alternate(columns, rounds),
                splits=(bf16.splits(), fp8.splits()),
                bytes={"bf16": bf16.kv_bytes, "fp8": fp8.kv_bytes})


def tables(results: list[dict]) -> list[str]:
    """Markdown: per mode, GB/s of K/V read with ratio columns, then ms; failures below."""
    lines = []
    notes = [f"FlashAttention-3 (fa3-fwd): {peers.fa3()[1]}" if peers.fa3()[0] is None else "",
             f"vLLM Triton unified attention: {peers.vllm_unified()[1]}"
             if peers.vllm_unified()[0] is None else ""]
    lines += [n for n in notes if n]
    for mode, _ in MODES:
        title = "CUDA-graph replays" if mode == "graph" else "eager calls (L2 flushed between)"
        lines += [f"\n#### {title}: GB/s of K/V read\n",
                  "| row [our splits bf16 / fp8] | ours bf16 | FA3 bf16 | ours / FA3 | "
                  "SDPA cuDNN | ours / cuDNN | vLLM | ours / vLLM | ours fp8 | FA3 fp8 | "
                  "ours / FA3 (fp8) | ours fp8 / bf16 speed |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in results:
            ms = {name: _ms(r, name, mode) for name in COLUMNS}
            rate = {name: _rate(r, name, ms[name]) for name in COLUMNS}
            lines.append(
                f"| {r['label']} [{r['splits'][0]} / {r['splits'][1]}] | {rate['ours bf16']} | "
                f"{rate['FA3 bf16']} | {_speed(ms['ours bf16'], ms['FA3 bf16'])} | "
                f"{rate['SDPA cuDNN']} | {_speed(ms['ours bf16'], ms['SDPA cuDNN'])} | "
                f"{rate['vLLM']} | {_speed(ms['ours bf16'], ms['vLLM'])} | {rate['ours fp8']} | "
                f"{rate['FA3 fp8']} | {_speed(ms['ours fp8'], ms['FA3 fp8'])} | "
                f"{_speed(ms['ours fp8'], ms['ours bf16'])} |")
        lines += [f"\n#### {title}: ms\n", "| row | " + " | ".join(COLUMNS) + " |",
                  "|---|" + "---|" * len(COLUMNS)]
        for r in results:
            cells = [_ms(r, name, mode) for name in COLUMNS]
            lines.append(f"| {r['label']} | " + " | ".join(
                "-" if c is None else f"{c:.4f}" for c in cells) + " |")
    failed = [f"failed: {r['label']}, {key.replace('|', ' ').strip()}: {error}"
              for r in results for key, (_, error) in r["timed"].items() if error]
    return lines + ([""] + failed if failed else [])


def section(emit, rounds: int = 3, rows=DECODE_ROWS) -> None:
    """Times the rows, then emits the tables (a progress line on stdout as each row ends)."""
    emit("\n### (a) Decode beside FA3, cuDNN and vLLM: 32 q / 8 KV heads, head 128, block 16, "
         f"shuffled blocks; {rounds} rounds alternated, medians\n")
    emit.lines(tables(measure_rows(rows, rounds)))


def _ms(result: dict, name: str, mode: str):
    """Median ms of a column in a mode, None where it did not run or failed."""
    ms, error = result["timed"].get(f"{name}|{mode}", (None, None))
    return None if error or ms is None or ms != ms else ms


def _rate(result: dict, name: str, ms) -> str:
    if ms is None:
        return "-"
    kv_bytes = result["bytes"]["fp8" if name.endswith("fp8") else "bf16"]
    return f"{kv_bytes / ms / 1e6:.0f}"


def _speed(ours, theirs) -> str:
    """ours / theirs in speed: their time over ours."""
    return "-" if ours is None or theirs is None else f"{theirs / ours:.2f}"
