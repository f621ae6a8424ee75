"""FLASH_ATTN's builder buffers and CUDA-graph capture / replay of a decode step."""

from __future__ import annotations

import pytest
import torch

import reference as ref
from conftest import assert_close, scattered_block_table
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

BLOCK = 16


def decode_batch(seq_lens, table, device="cpu"):
    return CommonAttentionMetadata.from_lengths([1] * len(seq_lens), seq_lens, table, BLOCK,
                                                device)


def test_builds_return_views_of_the_same_persistent_buffers():
    spec = AttentionSpec(BLOCK, 2, 64, torch.float32)
    builder = FlashAttentionMetadataBuilder(spec, [], EngineConfig(max_num_seqs=8), "cpu")
    first = builder.build(0, decode_batch([5, 9], torch.tensor([[1], [2]], dtype=torch.int32)))
    second = builder.build(0, decode_batch([7, 3], torch.tensor([[4], [3]], dtype=torch.int32)))
    for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
        assert getattr(first, name).data_ptr() == getattr(second, name).data_ptr(), name
    assert first.seq_lens.tolist() == [7, 3]  # the first metadata now reads the second batch
    assert first.block_table[:, 0].tolist() == [4, 3]
    assert first.slot_mapping.tolist() == [4 * BLOCK + 6, 3 * BLOCK + 2]


def test_a_smaller_batch_after_capture_pads_the_captured_views():
    spec = AttentionSpec(BLOCK, 2, 64, torch.float32)
    builder = FlashAttentionMetadataBuilder(spec, [], EngineConfig(max_num_seqs=8,
                                                                   max_model_len=256), "cpu")
    table = torch.arange(4, dtype=torch.int32).view(4, 1)
    captured = builder.build_for_cudagraph_capture(decode_batch([3, 4, 5, 6], table))
    assert captured.max_seq_len == 256 and not captured.use_cascade
    builder.build(0, decode_batch([9, 2], table[:2]))
    assert captured.query_start_loc.tolist() == [0, 1, 2, 2, 2]  # empty padded requests
    assert captured.seq_lens.tolist() == [9, 2, 0, 0]
    assert captured.slot_mapping[2:].tolist() == [-1, -1]  # padded tokens write nothing


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_captured_decode_step_replays_with_new_lengths_and_block_tables():
    device, dtype = torch.device("cuda"), torch.bfloat16
    num_heads, num_kv_heads, head_size, batch, num_blocks = 32, 8, 128, 8, 512
    layer, cache = _layer_and_cache(device, dtype, num_heads, num_kv_heads, head_size,
                                    num_blocks)
    spec = AttentionSpec(BLOCK, num_kv_heads, head_size, dtype)
    builder = FlashAttentionMetadataBuilder(
        spec, ["attn"], EngineConfig(max_num_seqs=16, max_model_len=2048), device)
    g = torch.Generator().manual_seed(0)
    q = torch.zeros(batch, num_heads * head_size, dtype=dtype, device=device)
    k = torch.zeros(batch, num_kv_heads * head_size, dtype=dtype, device=device)
    v = torch.zeros_like(k)

    def new_batch(seq_lens):
        table = scattered_block_table(seq_lens, BLOCK, num_blocks, g)
        for x in (q, k, v):
            x.copy_(torch.randn(x.shape, generator=g))
        return decode_batch(seq_lens, table, device), table

    common, _ = new_batch([100] * batch)
    md = builder.build_for_cudagraph_capture(common)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), set_forward_context(md):
        layer(q, k, v)  # warm up: compile the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), set_forward_context(md):
        out = layer(q, k, v)

    for seq_lens in ([1, 17, 300, 2048, 5, 64, 999, 31], [40, 2000, 3, 7, 0, 0, 0, 0]):
        real = sum(s > 0 for s in seq_lens)
        common, table = new_batch(seq_lens[:real])
        builder.build(0, common)  # same buffers: the graph reads this batch
        graph.replay()
        torch.cuda.synchronize()
        with set_forward_context(builder.build(0, common)):
            eager = layer(q[:real], k[:real], v[:real])  # rewrites the same slots
        keys, values = cache[0].cpu(), cache[1].cpu()
        want, _ = ref.paged_attention(q[:real].view(real, num_heads, head_size).cpu(), keys,
                                      values, [1] * real, seq_lens[:real], table,
                                      scale=head_size ** -0.5)
        # Rows of padded tokens (past the last real request) are unspecified, as in an
        # engine, which drops them; their slots are -1, so the cache is untouched.
        assert_close(out[:real].view(real, num_heads, head_size), want, dtype)
        assert_close(out[:real], eager.double(), dtype)  # split counts may differ


def _layer_and_cache(device, dtype, num_heads, num_kv_heads, head_size, num_blocks):
    torch.set_default_dtype(dtype)
    try:
        with model_scope():
            layer = Attention(num_heads, head_size, head_size ** -0.5, num_kv_heads,
                              cache_config=CacheConfig(block_size=BLOCK), prefix="attn",
                              attn_backend=FlashAttentionBackend).to(device)
    finally:
        torch.set_default_dtype(torch.float32)
    cache = allocate_kv_cache(FlashAttentionBackend, num_blocks, BLOCK, num_kv_heads,
                              head_size, dtype, device=device)
    cache.copy_(torch.randn(cache.shape, dtype=dtype))
    layer.kv_cache = [cache]
    return layer, cache


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_captured_mixed_step_replays_with_new_lengths_chunks_and_block_tables():
    """One graph of 96 tokens over 8 requests serves decodes, chunks and mixes of them."""
    from pagedattn.integrations.cuda_graphs import dummy_batch

    device, dtype = torch.device("cuda"), torch.bfloat16
    num_heads, num_kv_heads, head_size, num_blocks, tokens, reqs = 32, 8, 128, 1024, 96, 8
    layer, cache = _layer_and_cache(device, dtype, num_heads, num_kv_heads, head_size,
                                    num_blocks)
    builder = FlashAttentionMetadataBuilder(
        AttentionSpec(BLOCK, num_kv_heads, head_size, dtype), ["attn"],
        EngineConfig(max_num_seqs=reqs, max_model_len=2048, max_num_batched_tokens=tokens),
        device)
    g = torch.Generator().manual_seed(1)
    q = torch.zeros(tokens, num_heads * head_size, dtype=dtype, device=device)
    k = torch.zeros(tokens, num_kv_heads * head_size, dtype=dtype, device=device)
    v = torch.zeros_like(k)
    md = builder.build_for_cudagraph_capture(dummy_batch(tokens, reqs, BLOCK, device))
    md.slot_mapping.fill_(-1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), set_forward_context(md):
        layer(q, k, v)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), set_forward_context(md):
        out = layer(q, k, v)

    batches = (([1, 40, 1, 1, 30], [700, 40, 5, 2048, 94]),  # chunks (one a first chunk)
               ([1] * 8, [9, 1500, 33, 2, 64, 700, 1, 17]),  # pure decode
               ([96], [1000]), ([3, 1, 50], [3, 2000, 300]))  # one long chunk; few requests
    for query_lens, seq_lens in batches:
        real = sum(query_lens)
        table = scattered_block_table(seq_lens, BLOCK, num_blocks, g)
        for x in (q, k, v):
            x.copy_(torch.randn(x.shape, generator=g))
        common = CommonAttentionMetadata.from_lengths(query_lens, seq_lens, table, BLOCK,
                                                      device)
        builder.build(0, common)
        graph.replay()
        torch.cuda.synchronize()
        with set_forward_context(builder.build(0, common)):
            eager = layer(q[:real], k[:real], v[:real])
        want, _ = ref.paged_attention(q[:real].view(real, num_heads, head_size).cpu(),
                                      cache[0].cpu(), cache[1].cpu(), query_lens, seq_lens,
                                      table, scale=head_size ** -0.5)
        assert_close(out[:real].view(real, num_heads, head_size), want, dtype)
        assert_close(out[:real], eager.double(), dtype)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("query_lens", [[1, 1, 1], [1, 37, 5]])
def test_a_layer_call_neither_allocates_nor_synchronises(query_lens):
    """With the batch planned by build(): the impl allocates nothing and no
    layer call waits for the GPU; Layer.forward allocates only the output it returns."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    layer, cache = _layer_and_cache(device, dtype, 8, 2, 64, 256)
    builder = FlashAttentionMetadataBuilder(AttentionSpec(BLOCK, 2, 64, dtype), ["attn"],
                                            EngineConfig(max_num_seqs=8), device)
    seq_lens = [600, 80, 9]
    table = scattered_block_table(seq_lens, BLOCK, 256, torch.Generator().manual_seed(0))
    md = builder.build(0, CommonAttentionMetadata.from_lengths(query_lens, seq_lens, table,
                                                               BLOCK, device))
    n = sum(query_lens)
    q = torch.randn(n, 8 * 64, dtype=dtype, device=device)
    k, v = (torch.randn(n, 2 * 64, dtype=dtype, device=device) for _ in range(2))
    out = torch.empty(n, 8, 64, dtype=dtype, device=device)
    with set_forward_context(md):
        layer(q, k, v)  # compiles the kernels
        torch.cuda.synchronize()
        allocations = torch.cuda.memory_stats()["allocation.all.allocated"]
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            layer.impl.forward(layer, q.view(n, 8, 64), k.view(n, 2, 64), v.view(n, 2, 64),
                               cache, md, output=out)
            after_impl = torch.cuda.memory_stats()["allocation.all.allocated"]
            layer(q, k, v)
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        after_layer = torch.cuda.memory_stats()["allocation.all.allocated"]
    assert after_impl == allocations, "the impl's forward allocated"
    assert after_layer == allocations + 1, "Layer.forward allocated beyond its output"
