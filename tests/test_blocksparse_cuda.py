"""Block-sparse decode on the GPU at real sizes against the oracle's pattern mask (every pattern
family, vertical stride, window, sparse block and head size), and a captured decode step of
BLOCK_SPARSE_FLASH_ATTN replayed with new lengths and block tables against eager runs."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_close, make_layers
from test_ops_blocksparse import check_decode

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# head_sliding_step: 1 per head (vLLM's default), 0 homo_head, -1 / -2 homo_head_group.
STEPS = {"per_head": 1, "homo_head": 0, "homo_head_group": -1}
# Lengths: a short one, block edges, and long ones (split-KV happens at batch 1 below).
LENS = [1, 63, 64, 65, 1000, 4097]
# 18 sequences x 8 KV heads: programs enough to fill the H200's 132 SMs (the wave rules split)
FULL_LENS = LENS * 3


@pytest.mark.parametrize("family", list(STEPS))
@pytest.mark.parametrize("vert_stride", [1, 2, 4, 8, 16])
def test_patterns_at_real_sizes(family, vert_stride):
    check_decode(LENS, (4, vert_stride, 64, STEPS[family]), num_heads=32, num_kv_heads=8,
                 head_size=128, page=16, dtype=torch.bfloat16)


@pytest.mark.parametrize("family", list(STEPS))
@pytest.mark.parametrize("local_blocks,vert_stride,block_size,head_size", [
    (16, 8, 64, 128), (4, 8, 16, 128), (16, 16, 16, 64), (4, 4, 64, 64), (0, 4, 32, 128)])
def test_windows_blocks_and_head_sizes(family, local_blocks, vert_stride, block_size,
                                       head_size):
    check_decode(LENS, (local_blocks, vert_stride, block_size, STEPS[family]), num_heads=32,
                 num_kv_heads=8, head_size=head_size, page=16, dtype=torch.bfloat16)


@pytest.mark.parametrize("tiles", [None, (128, 4, 2)])
@pytest.mark.parametrize("pattern", [(4, 8, 64, 1), (4, 8, 64, 0), (4, 1, 64, 1),
                                     (4, 4, 16, -1), (0, 4, 32, 1)])
def test_key_lines_at_real_sizes(monkeypatch, pattern, tiles):
    # SWITCHES.blocksparse_decode_key_lines (K gathered as whole lines; KERNEL_NOTES v28) as
    # the GPU compiles it: 64- and 128-key tiles, sparse blocks of 16 to 64, split (batch 1),
    # an entry a key (page lines off).
    from pagedattn.ops.triton import launch
    monkeypatch.setattr(launch.SWITCHES, "blocksparse_decode_key_lines", True)
    monkeypatch.setattr(launch.SWITCHES, "blocksparse_decode_page_lines", False)
    monkeypatch.setattr(launch.SWITCHES, "blocksparse_decode_tiles", tiles)
    check_decode(LENS, pattern, num_heads=32, num_kv_heads=8, head_size=128, page=16,
                 dtype=torch.bfloat16)
    check_decode([32768], pattern, num_heads=32, num_kv_heads=8, head_size=128, page=16,
                 dtype=torch.bfloat16)
    check_decode([17, 4097], pattern, num_heads=8, num_kv_heads=2, head_size=64, page=16,
                 dtype=torch.bfloat16)


@pytest.mark.parametrize("switches", [
    dict(splits="short fill"), dict(splits=3), dict(tiles=(64, 4, 2, 128), key_lines=True)])
@pytest.mark.parametrize("pattern", [(4, 8, 64, 0), (4, 8, 64, 1), (4, 4, 16, -1)])
def test_homo_head_candidates_at_real_sizes(monkeypatch, pattern, switches):
    # KERNEL_NOTES v31's candidates as the GPU compiles them: GQA 4 and 8, homo and per-head
    # patterns, a batch that fills the SMs (so the split rules apply) and batch 1.
    from pagedattn.ops.triton import launch
    for knob, value in switches.items():
        monkeypatch.setattr(launch.SWITCHES, f"blocksparse_decode_{knob}", value)
    check_decode(FULL_LENS, pattern, num_heads=32, num_kv_heads=8, head_size=128, page=16,
                 dtype=torch.bfloat16)
    check_decode([32768], pattern, num_heads=32, num_kv_heads=4, head_size=128, page=16,
                 dtype=torch.bfloat16)


@pytest.mark.parametrize("key_lines", [None, True])
@pytest.mark.parametrize("pattern", [(4, 8, 64, 0), (4, 8, 64, 1), (0, 4, 32, -1)])
def test_fp8_cache_with_and_without_key_lines(monkeypatch, pattern, key_lines):
    # An e4m3 cache read by the [D, N] K load (the default over fp8) and as whole lines
    # (X = 16: a d // X run is still 256 bytes); GQA 1 and 4.
    from conftest import FP8_TOLERANCE
    from pagedattn.ops.triton import launch
    monkeypatch.setattr(launch.SWITCHES, "blocksparse_decode_key_lines", key_lines)
    check_decode(FULL_LENS, pattern, num_heads=32, num_kv_heads=8, head_size=128, page=16,
                 dtype=torch.bfloat16, cache_dtype="fp8_e4m3", scales=(0.05, 0.02),
                 **FP8_TOLERANCE)
    check_decode([9000, 65], pattern, num_heads=8, num_kv_heads=8, head_size=128, page=16,
                 dtype=torch.float16, cache_dtype="fp8_e4m3", scales=(0.05, 0.02),
                 **FP8_TOLERANCE)


@pytest.mark.parametrize("cache_dtype,switches", [
    ("fp8_e4m3", dict(tiles=(128, 4, 2, 168))), ("fp8_e4m3", dict(page_lines=True)),
    ("fp8_e4m3", dict(page_lines=True, tiles=(128, 4, 2, 168))),
    ("fp8_e4m3", dict(page_lines=True, tiles=(64, 4, 2, 128))),
    ("fp8_e5m2", dict(page_lines=True)), ("auto", dict(page_lines=True))])
@pytest.mark.parametrize("pattern", [(4, 8, 64, 1), (4, 8, 64, 0), (0, 4, 32, -1)])
def test_fp8_candidates_at_real_sizes(monkeypatch, pattern, cache_dtype, switches):
    # KERNEL_NOTES v42's candidates as the GPU compiles them: 128-key tiles capped at 168
    # registers, K and V from one table entry a page (V as whole lines), in four-an-SM tiles;
    # per head and homo head, GQA 4 / 8 (a batch that fills the SMs: the split rules apply)
    # and GQA 1 at batch 1 (split).
    from conftest import FP8_TOLERANCE
    from pagedattn.ops.triton import launch
    for knob, value in switches.items():
        monkeypatch.setattr(launch.SWITCHES, f"blocksparse_decode_{knob}", value)
    fp8 = dict(cache_dtype=cache_dtype, scales=(0.05, 0.02), **FP8_TOLERANCE) if (
        cache_dtype != "auto") else {}
    check_decode(FULL_LENS, pattern, num_heads=32, num_kv_heads=8, head_size=128, page=16,
                 dtype=torch.bfloat16, **fp8)
    check_decode(FULL_LENS[:6], pattern, num_heads=32, num_kv_heads=4, head_size=128,
                 page=16, dtype=torch.float16, **fp8)
    check_decode([20000], pattern, num_heads=8, num_kv_heads=8, head_size=128, page=16,
                 dtype=torch.float16, **fp8)


@pytest.mark.parametrize("family", list(STEPS))
def test_batch_one_splits_the_keys(family):
    for length in ([32768], [9000]):
        check_decode(length, (4, 8, 64, STEPS[family]), num_heads=32, num_kv_heads=8,
                     head_size=128, page=16, dtype=torch.bfloat16)


def test_captured_decode_step_replays_new_batches_like_eager():
    from pagedattn import CommonAttentionMetadata
    from pagedattn.backends.blocksparse_attn import BlocksparseFlashAttentionBackend as Backend
    from pagedattn.config import EngineConfig
    from pagedattn.metadata import AttentionSpec

    H, HKV, D, PAGE, R, MAX_LEN = 32, 8, 128, 16, 8, 4096
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    # A named layer: the builder plans each step for the layers it is made with.
    (name, layer), = make_layers(Backend, num_heads=H, num_kv_heads=HKV, head_size=D,
                                 block_size=PAGE, dtype=bf16, use_sparse=True,
                                 blocksparse_params=dict(max_seqlen=MAX_LEN, block_size=64,
                                                         local_blocks=4, vert_stride=8)).items()
    layer.place_on(dev)
    impl = layer.impl
    config = EngineConfig(max_num_seqs=R, max_model_len=MAX_LEN, max_num_batched_tokens=64)
    builder = Backend.get_builder_cls()(AttentionSpec(PAGE, HKV, D, bf16), [name], config, dev)
    num_blocks = R * MAX_LEN // PAGE + 1
    g = torch.Generator(device=dev).manual_seed(0)
    kv_cache = torch.randn(Backend.get_kv_cache_shape(num_blocks, PAGE, HKV, D), device=dev,
                           generator=g).to(bf16)
    q, k, v = (torch.zeros(R, h, D, device=dev, dtype=bf16) for h in (H, HKV, HKV))
    out = torch.zeros_like(q)
    dummy = CommonAttentionMetadata.from_lengths([1] * R, [1] * R,
                                                 torch.zeros(R, 1, dtype=torch.int32), PAGE, dev)
    md = builder.build_for_cudagraph_capture(dummy)
    md.slot_mapping.fill_(-1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        impl.forward(layer, q, k, v, kv_cache, md, output=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.forward(layer, q, k, v, kv_cache, md, output=out)
    for n, top in ((R, MAX_LEN), (5, 3000), (1, MAX_LEN)):
        lens = torch.randint(1, top + 1, (n,), generator=torch.Generator().manual_seed(n))
        table = torch.randperm(num_blocks - 1)[:n * (MAX_LEN // PAGE)].view(n, -1).int() + 1
        common = CommonAttentionMetadata.from_lengths([1] * n, lens.tolist(), table, PAGE, dev)
        for x in (q, k, v):
            x[:n].copy_(torch.randn(x[:n].shape, device=dev, generator=g).to(bf16))
        replayed = builder.build(0, common)
        assert replayed.block_tables.data_ptr() == md.block_tables.data_ptr()
        graph.replay()
        eager = torch.full_like(out[:n], float("nan"))
        impl.forward(layer, q[:n], k[:n], v[:n], kv_cache, builder.build(0, common),
                     output=eager)
        assert_close(out[:n], eager.float(), torch.bfloat16)
