"""The FlashInfer-style wrappers beside the FLASH_ATTN path (`flash_attn_varlen_func`) on the
same data, in one run: decode, prefill and cascade times (CUDA-graph replays and eager calls),
plan() host time per batch, and the host time of one run() / one flash_attn_varlen_func call.

    PYTHONPATH=src python benchmarks/bench_flashinfer.py [--out results.md]

Every row first checks that both paths give the same output (max |diff| printed). Graph rows
are medians of triton.testing.do_bench_cudagraph, eager rows of triton.testing.do_bench
(events around each call, so host launch time shows where it exceeds the kernel's).
Floors: decode K/V bytes / 3.0 TB/s; prefill causal FLOPs (2 L^2 H D) / 700 TFLOP/s.
"""

from __future__ import annotations

import argparse
import functools
import math
import time

import torch
import triton
from timing import Emitter, eager_ms, graph_ms, host_us

from pagedattn.ops import (
    BatchDecodeWithPagedKVCacheWrapper,
    BatchPrefillWithPagedKVCacheWrapper,
    MultiLevelCascadeAttentionWrapper,
    flash_attn_varlen_func,
)

H, HKV, D, PAGE = 32, 8, 128, 16
DT, DEV = torch.bfloat16, "cuda"
WS = None


emit = Emitter()  # prints, and with --out appends each row


class Batch:
    """Scattered pages holding seq_lens tokens per request, in FlashInfer's NHD cache, and
    its CSR page table (on the host, as FlashInfer recommends for plan())."""

    def __init__(self, query_lens, seq_lens, prefix_pages: int = 0):
        self.query_lens, self.seq_lens = list(query_lens), list(seq_lens)
        own = [math.ceil(s / PAGE) - prefix_pages for s in seq_lens]
        num_pages = prefix_pages + sum(own)
        self.cache = torch.randn(num_pages, 2, PAGE, HKV, D, device=DEV, dtype=DT)
        perm = torch.randperm(num_pages, dtype=torch.int32)
        shared, rest = perm[:prefix_pages], perm[prefix_pages:]
        self.own_indices = rest[:sum(own)]
        self.own_indptr = torch.tensor([0, *own]).cumsum(0).int()
        self.shared_indices = shared
        pages = [torch.cat([shared, rest[int(self.own_indptr[r]):int(self.own_indptr[r + 1])]])
                 for r in range(len(own))]
        self.indices = torch.cat(pages)
        self.indptr = torch.tensor([0, *(len(p) for p in pages)]).cumsum(0).int()
        self.last = torch.tensor([(s - 1) % PAGE + 1 for s in seq_lens], dtype=torch.int32)
        self.qo_indptr = torch.tensor([0, *query_lens]).cumsum(0).int()
        self.q = torch.randn(sum(query_lens), H, D, device=DEV, dtype=DT)
        self.out = torch.empty_like(self.q)
        self.kv_bytes = sum(seq_lens) * HKV * D * 2 * 2

    def flash_attn(self, plan):
        """The FLASH_ATTN path on the same data: the plan's block table and lengths."""
        return functools.partial(
            flash_attn_varlen_func, self.q, self.cache[:, 0], self.cache[:, 1],
            max(self.query_lens), plan.cu_seqlens_q, max(self.seq_lens),
            seqused_k=plan.seq_lens, causal=True, block_table=plan.block_table,
            out=torch.empty_like(self.q))


def plan_fn(wrapper, b: Batch):
    if isinstance(wrapper, BatchDecodeWithPagedKVCacheWrapper):
        return functools.partial(wrapper.plan, b.indptr, b.indices, b.last, H, HKV, D, PAGE,
                                 q_data_type=DT)
    return functools.partial(wrapper.plan, b.qo_indptr, b.indptr, b.indices, b.last, H, HKV,
                             D, PAGE, causal=True, q_data_type=DT)


def row(label: str, b: Batch, wrapper, floor_ms: float) -> None:
    plan = plan_fn(wrapper, b)
    plan()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        plan()
    torch.cuda.synchronize()
    plan_us = (time.perf_counter() - t0) / 20 * 1e6
    run = functools.partial(wrapper.run, b.q, b.cache, out=b.out)
    fa = b.flash_attn(wrapper._plan)
    diff = (run().float() - fa().float()).abs().max().item()
    g, ge = graph_ms(run), graph_ms(fa)
    e, ee = eager_ms(run), eager_ms(fa)
    emit(f"| {label} | {g:.4f} | {ge:.4f} | {g / ge:.3f} | {e:.4f} | {ee:.4f} | "
         f"{floor_ms:.4f} | {plan_us:.0f} | {host_us(run):.1f} | {host_us(fa):.1f} | "
         f"{diff:.1e} |")


HEADER = ("| batch | wrapper graph ms | FLASH_ATTN graph ms | ratio | wrapper eager ms | "
          "FLASH_ATTN eager ms | floor ms | plan() us | run() host us | FA call host us | "
          "max diff |\n|---|---|---|---|---|---|---|---|---|---|---|")


def section_decode() -> None:
    emit("\n### Decode (BatchDecodeWithPagedKVCacheWrapper): 32 q / 8 KV heads, head 128, "
         "bf16, page 16\n")
    emit(HEADER)
    for batch, ctx in ((1, 8192), (32, 4096), (128, 1024), (128, 4096)):
        b = Batch([1] * batch, [ctx] * batch)
        w = BatchDecodeWithPagedKVCacheWrapper(WS, "NHD")
        row(f"{batch} x {ctx}", b, w, b.kv_bytes / 3.0e12 * 1e3)
    emit("\n### Prefill (BatchPrefillWithPagedKVCacheWrapper, causal)\n")
    emit(HEADER)
    for q_lens, s_lens in (([8192], [8192]), ([2048] * 4, [2048] * 4),
                           ([512] * 8, [4096] * 8)):
        b = Batch(q_lens, s_lens)
        flops = sum(2.0 * q * (2 * s - q) * H * D for q, s in zip(q_lens, s_lens))
        w = BatchPrefillWithPagedKVCacheWrapper(WS, "NHD")
        row(f"{len(q_lens)} x {q_lens[0]} q / {s_lens[0]} kv", b, w, flops / 700e12 * 1e3)


def section_cascade() -> None:
    emit("\n### Two-level cascade (MultiLevelCascadeAttentionWrapper): 64 decodes sharing "
         "an 8192-token prefix, 256 own tokens each\n")
    emit("| path | graph ms | eager ms | max diff vs plain |\n|---|---|---|---|")
    prefix_pages, n = 8192 // PAGE, 64
    b = Batch([1] * n, [8192 + 256] * n, prefix_pages=prefix_pages)
    c = MultiLevelCascadeAttentionWrapper(2, WS, "NHD")
    c.plan([torch.tensor([0, n]).int(), b.qo_indptr],
           [torch.tensor([0, prefix_pages]).int(), b.own_indptr], [b.shared_indices,
                                                                   b.own_indices],
           [torch.tensor([PAGE]).int(), b.last], H, HKV, D, PAGE, causal=True, q_data_type=DT)
    d = BatchDecodeWithPagedKVCacheWrapper(WS, "NHD")
    plan_fn(d, b)()
    plain = functools.partial(d.run, b.q, b.cache, out=torch.empty_like(b.q))
    cascade = functools.partial(c.run, b.q, b.cache, out=b.out)
    fa = b.flash_attn(d._plan)
    ref = plain().float()
    for name, fn in (("cascade wrapper", cascade), ("decode wrapper (plain)", plain),
                     ("FLASH_ATTN plain", fa)):
        diff = (fn().float() - ref).abs().max().item()
        emit(f"| {name} | {graph_ms(fn):.4f} | {eager_ms(fn):.4f} | {diff:.1e} |")


def main() -> None:
    global WS
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--sections", default="decode,cascade")
    args = ap.parse_args()
    emit.to_file(args.out)
    torch.manual_seed(0)
    WS = torch.empty(1, dtype=torch.uint8, device=DEV)
    props = torch.cuda.get_device_properties(0)
    emit(f"device: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}, "
         f"triton {triton.__version__}")
    t0 = time.time()
    if "decode" in args.sections:
        section_decode()
    if "cascade" in args.sections:
        section_cascade()
    emit(f"\n(bench wall time {time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
