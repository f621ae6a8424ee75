"""Cascade vs plain attention: a batch of decodes sharing one long prefix, side by side.

    PYTHONPATH=src python benchmarks/bench_cascade.py [--batch 64] [--prefix 16384]
        [--suffix 512] [--sweep] [--out results.md]

Every request's keys are the shared prefix (the same cache blocks) plus its own suffix of
1..suffix tokens. Rows: the two ops alone (`flash_attn_varlen_func` over whole sequences vs
`cascade_attention`), then a FLASH_ATTN layer's whole forward (cache write included) with the
builder's cascade switched off and on. Each is timed twice: eagerly (how cascade runs in an
engine: it is never captured; host launch time shows where it exceeds the L2 flush that
do_bench runs between calls) and replayed from a CUDA graph (GPU time alone). Times are
medians in ms (`timing.py`: triton.testing.do_bench, L2 flushed between calls;
do_bench_cudagraph for replays); a path that cannot be captured gets "n/a" and its error
below the table. `--sweep` times the layer over batch sizes and prefix lengths, next to the
builder's choice.
"""

from __future__ import annotations

import argparse

import torch
from timing import Emitter, eager_ms, graph_ms, markdown_row, markdown_table, measure, ratio

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
from pagedattn.ops import cascade_attention, flash_attn_varlen_func

H, HKV, D, BLOCK = 32, 8, 128, 16


ERRORS: dict[str, str] = {}  # row label -> why its graph column is n/a


def timed(label: str, fn) -> tuple[str, float, float]:
    """(label, eager ms, graph-replay ms); a failed capture is NaN, its error in ERRORS."""
    graph, error = measure(graph_ms, fn)
    if error:
        ERRORS[label] = error
    return label, eager_ms(fn), graph


class SharedPrefixBatch:
    """`batch` decodes whose block tables start with the same prefix blocks."""

    def __init__(self, batch, prefix, suffix, device, dtype, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.batch, self.prefix = batch, prefix
        self.suffix_lens = torch.randint(1, suffix + 1, (batch,), generator=g).tolist()
        self.seq_lens = [prefix + s for s in self.suffix_lens]
        prefix_blocks = prefix // BLOCK
        own = [-(-s // BLOCK) for s in self.suffix_lens]
        table = torch.zeros(batch, prefix_blocks + max(own), dtype=torch.int32)
        table[:, :prefix_blocks] = torch.arange(prefix_blocks, dtype=torch.int32)
        start = prefix_blocks
        for r, n in enumerate(own):
            table[r, prefix_blocks:prefix_blocks + n] = torch.arange(start, start + n)
            start += n
        self.cache = allocate_kv_cache(FlashAttentionBackend, start, BLOCK, HKV, D, dtype,
                                       device=device)
        self.cache.copy_(torch.randn(self.cache.shape, generator=g).to(dtype))
        self.common = CommonAttentionMetadata.from_lengths([1] * batch, self.seq_lens, table,
                                                           BLOCK, device)
        self.q = torch.randn(batch, H, D, generator=g).to(device, dtype)
        self.k = torch.randn(batch, HKV * D, generator=g).to(device, dtype)


def op_rows(b: SharedPrefixBatch, device):
    c, scale = b.common, D ** -0.5
    out = torch.empty_like(b.q)
    ints = dict(dtype=torch.int32, device=device)
    prefix_q = torch.tensor([0, b.batch], **ints)
    prefix_kv = torch.tensor([b.prefix], **ints)
    suffix_kv = torch.tensor(b.suffix_lens, **ints)

    def plain():
        return flash_attn_varlen_func(
            q=b.q, k=b.cache[0], v=b.cache[1], cu_seqlens_q=c.query_start_loc, max_seqlen_q=1,
            seqused_k=c.seq_lens, max_seqlen_k=max(b.seq_lens), softmax_scale=scale,
            causal=True, block_table=c.block_table_tensor)

    def cascade():
        return cascade_attention(
            out, b.q, b.cache[0], b.cache[1], cu_query_lens=c.query_start_loc, max_query_len=1,
            cu_prefix_query_lens=prefix_q, prefix_kv_lens=prefix_kv, suffix_kv_lens=suffix_kv,
            max_kv_len=max(b.seq_lens), softmax_scale=scale, alibi_slopes=None,
            sliding_window=(-1, -1), logits_soft_cap=0.0, block_table=c.block_table_tensor,
            common_prefix_len=b.prefix)

    diff = (plain().float() - cascade().float()).abs().max().item()
    return diff, [timed(name, fn) for name, fn in (("op: flash_attn_varlen_func (plain)", plain),
                                                   ("op: cascade_attention", cascade))]


def layer_rows(b: SharedPrefixBatch, device, dtype):
    """The FLASH_ATTN layer's forward, its builder's cascade off, then forced on; and whether
    the builder (its cost model) would have chosen cascade itself."""
    torch.set_default_dtype(dtype)
    with model_scope():
        layer = Attention(H, D, D ** -0.5, HKV, cache_config=CacheConfig(block_size=BLOCK),
                          prefix="attn", attn_backend=FlashAttentionBackend).to(device)
        config = EngineConfig(max_num_seqs=b.batch, max_model_len=max(b.seq_lens))
        builder = FlashAttentionMetadataBuilder(AttentionSpec(BLOCK, HKV, D, dtype), ["attn"],
                                                config, device)
    torch.set_default_dtype(torch.float32)
    layer.kv_cache = [b.cache]
    chosen = builder.build(b.prefix, b.common).use_cascade
    builder.use_cascade_attention = lambda *args, **kwargs: True
    rows = []
    for prefix in (0, b.prefix):
        md = builder.build(prefix, b.common)

        def forward(md=md):
            with set_forward_context(md):
                return layer(b.q.view(b.batch, H * D), b.k, b.k)

        rows.append(timed(f"layer: FLASH_ATTN, cascade {'on' if md.use_cascade else 'off'}",
                          forward))
    return chosen, rows


def table(rows) -> list[str]:
    """Rows in pairs (plain, cascade); speed-ups against the pair's first row."""
    cells = []
    for i, (label, eager, graph) in enumerate(rows):
        _, base_eager, base_graph = rows[i - i % 2]
        cells.append((label, eager, graph, ratio(base_eager, eager), ratio(base_graph, graph)))
    lines = markdown_table(("path", "eager ms", "graph ms", "eager speed-up",
                            "graph speed-up"), cells)
    return lines + [f"<!-- {label}: graph n/a, {error} -->" for label, error in ERRORS.items()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prefix", type=int, default=16384)
    p.add_argument("--suffix", type=int, default=512)
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    emit = Emitter()
    emit.to_file(args.out)
    b = SharedPrefixBatch(args.batch, args.prefix, args.suffix, device, dtype)
    diff, rows = op_rows(b, device)
    chosen, more = layer_rows(b, device, dtype)
    emit(f"{args.batch} decodes sharing a {args.prefix}-token prefix (+1..{args.suffix} own "
         f"tokens each), {H} q heads / {HKV} kv heads, head {D}, {dtype}, block {BLOCK}, on "
         f"{name}; builder chose cascade: {chosen}; max |plain - cascade| = {diff:.2e}")
    emit()
    emit.lines(table(rows + more))
    if not args.sweep:
        return
    emit()
    emit.lines(markdown_table(("batch", "prefix", "builder", "plain eager", "cascade eager",
                               "plain graph", "cascade graph")))
    for batch in (8, 16, 64, 256):
        for prefix in (512, 2048, 8192, 16384):
            b = SharedPrefixBatch(batch, prefix, args.suffix, device, dtype)
            chosen, ((_, pe, pg), (_, ce, cg)) = layer_rows(b, device, dtype)
            emit(markdown_row((batch, prefix, "cascade" if chosen else "plain", pe, ce, pg, cg)))
            del b

if __name__ == "__main__":
    main()
