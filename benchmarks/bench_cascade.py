"""Cascade vs plain attention: a batch of decodes sharing one long prefix, side by side.

    PYTHONPATH=src python benchmarks/bench_cascade.py [--batch 64] [--prefix 16384]
        [--suffix 512] [--out results.md]

Every request's keys are the shared prefix (the same cache blocks) plus its own suffix of
1..suffix tokens. Rows: the two ops alone (`flash_attn_varlen_func` over whole sequences vs
`cascade_attention`), then a FLASH_ATTN layer's whole forward (cache write included) with the
builder's cascade switched off and on. Times are medians of CUDA-event timed runs (CPU:
wall clock) after warm-up; "prefix GB/s" is the prefix K/V bytes plain attention must read
once per request, over the time, to show what cascade saves.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedattn import (
    Attention,
    CacheConfig,
    CommonAttentionMetadata,
    EngineConfig,
    model_scope,
    set_forward_context,
)
from pagedattn.backends.flash_attn import FlashAttentionBackend, FlashAttentionMetadataBuilder
from pagedattn.kv_cache import allocate_kv_cache
from pagedattn.metadata import AttentionSpec
from pagedattn.ops import cascade_attention, flash_attn_varlen_func, use_cascade_attention

H, HKV, D, BLOCK = 32, 8, 128, 16


def timed(fn, device, iters=50, warmup=5) -> float:
    """Median milliseconds of fn()."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def shared_prefix_table(batch, prefix, suffix_lens):
    """Block table: every row starts with the same prefix blocks, then its own blocks."""
    prefix_blocks = prefix // BLOCK
    own = [-(-s // BLOCK) for s in suffix_lens]
    table = torch.zeros(batch, prefix_blocks + max(own), dtype=torch.int32)
    table[:, :prefix_blocks] = torch.arange(prefix_blocks, dtype=torch.int32)
    next_block = prefix_blocks
    for r, n in enumerate(own):
        table[r, prefix_blocks:prefix_blocks + n] = torch.arange(next_block, next_block + n)
        next_block += n
    return table, next_block


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prefix", type=int, default=16384)
    p.add_argument("--suffix", type=int, default=512)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    suffix_lens = torch.randint(1, args.suffix + 1, (args.batch,), generator=g).tolist()
    seq_lens = [args.prefix + s for s in suffix_lens]
    table, num_blocks = shared_prefix_table(args.batch, args.prefix, suffix_lens)
    cache = allocate_kv_cache(FlashAttentionBackend, num_blocks, BLOCK, HKV, D, dtype,
                              device=device)
    cache.copy_(torch.randn(cache.shape, generator=g).to(dtype))
    common = CommonAttentionMetadata.from_lengths([1] * args.batch, seq_lens, table, BLOCK,
                                                  device)
    q = torch.randn(args.batch, H, D, generator=g).to(device, dtype)
    scale = D ** -0.5
    num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
               if device.type == "cuda" else 1)
    chosen = use_cascade_attention(args.prefix, [1] * args.batch, H, HKV, False, False, False,
                                   num_sms)

    def plain_op():
        return flash_attn_varlen_func(
            q=q, k=cache[0], v=cache[1], cu_seqlens_q=common.query_start_loc, max_seqlen_q=1,
            seqused_k=common.seq_lens, max_seqlen_k=max(seq_lens), softmax_scale=scale,
            causal=True, block_table=common.block_table_tensor)

    out = torch.empty_like(q)
    to_dev = dict(dtype=torch.int32, device=device)

    def cascade_op():
        return cascade_attention(
            out, q, cache[0], cache[1], cu_query_lens=common.query_start_loc, max_query_len=1,
            cu_prefix_query_lens=torch.tensor([0, args.batch], **to_dev),
            prefix_kv_lens=torch.tensor([args.prefix], **to_dev),
            suffix_kv_lens=torch.tensor(suffix_lens, **to_dev), max_kv_len=max(seq_lens),
            softmax_scale=scale, alibi_slopes=None, sliding_window=(-1, -1),
            logits_soft_cap=0.0, block_table=common.block_table_tensor,
            common_prefix_len=args.prefix)

    max_diff = (plain_op().float() - cascade_op().float()).abs().max().item()
    rows = [("op: flash_attn_varlen_func (plain)", timed(plain_op, device, args.iters)),
            ("op: cascade_attention", timed(cascade_op, device, args.iters))]

    torch.set_default_dtype(dtype)
    with model_scope():
        layer = Attention(H, D, scale, HKV, cache_config=CacheConfig(block_size=BLOCK),
                          prefix="attn", attn_backend=FlashAttentionBackend).to(device)
    torch.set_default_dtype(torch.float32)
    layer.kv_cache = [cache]
    spec = AttentionSpec(BLOCK, HKV, D, dtype)
    k = torch.randn(args.batch, HKV * D, generator=g).to(device, dtype)
    for cascade in (False, True):
        config = EngineConfig(max_num_seqs=args.batch, max_model_len=max(seq_lens),
                              enable_cascade=cascade)
        builder = FlashAttentionMetadataBuilder(spec, ["attn"], config, device)
        md = builder.build(args.prefix, common)
        assert md.use_cascade == (cascade and chosen)

        def forward(md=md):
            with set_forward_context(md):
                return layer(q.view(args.batch, H * D), k, k)

        rows.append((f"layer: FLASH_ATTN forward, cascade {'on' if md.use_cascade else 'off'}",
                     timed(forward, device, args.iters)))

    prefix_bytes = 2 * args.prefix * HKV * D * cache.element_size() * args.batch
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [f"{args.batch} decodes sharing a {args.prefix}-token prefix (+1..{args.suffix} own "
             f"tokens each), {H} q heads / {HKV} kv heads, head {D}, {dtype}, block {BLOCK}, "
             f"on {name}; use_cascade_attention -> {chosen}; max |plain - cascade| = "
             f"{max_diff:.2e}", "",
             "| path | ms | prefix GB/s | speed-up vs plain |", "|---|---:|---:|---:|"]
    for label, ms in rows:
        base = rows[0][1] if label.startswith("op") else rows[2][1]
        lines.append(f"| {label} | {ms:.3f} | {prefix_bytes / ms / 1e6:.0f} | "
                     f"{base / ms:.2f}x |")
    print("\n".join(lines), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
