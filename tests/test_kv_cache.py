"""Cache allocation in physical order, binding, and block swaps/copies for every layout."""

from __future__ import annotations

import pytest
import torch

from pagedattn import Attention, CacheConfig, model_scope
from pagedattn.backends.torch_sdpa import TorchSDPABackend
from pagedattn.kv_cache import (
    allocate_kv_cache,
    allocate_kv_caches,
    bind_kv_cache,
    block_dim,
    copy_blocks,
    swap_blocks,
)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_allocation_is_physical_order_with_logical_view(layout, monkeypatch):
    monkeypatch.setenv("PAGEDATTN_KV_CACHE_LAYOUT", layout)
    cache = allocate_kv_cache(TorchSDPABackend, 10, 16, 4, 64, torch.float16)
    assert cache.shape == (2, 10, 16, 4, 64)
    order = TorchSDPABackend.get_kv_cache_stride_order()
    physical = cache.permute(*order)
    assert physical.is_contiguous()
    assert order == ((0, 1, 2, 3, 4) if layout == "NHD" else (0, 1, 3, 2, 4))


def test_stride_order_with_layers_dimension():
    # (num_layers, 2, num_blocks, ...) is stored blocks first, then layers
    assert TorchSDPABackend.get_kv_cache_stride_order(include_num_layers_dimension=True) \
        == (2, 0, 1, 3, 4, 5)


def test_bad_layout_env_is_rejected(monkeypatch):
    monkeypatch.setenv("PAGEDATTN_KV_CACHE_LAYOUT", "HDN")
    with pytest.raises(ValueError, match="choose NHD or HND"):
        allocate_kv_cache(TorchSDPABackend, 2, 16, 1, 8, torch.float16)


def test_fp8_cache_dtype_and_shared_layers_bind_to_the_target():
    with model_scope():
        layers = {
            "a": Attention(4, 32, 0.1, 2, prefix="a",
                           cache_config=CacheConfig(cache_dtype="fp8_e5m2")),
            "b": Attention(4, 32, 0.1, 2, prefix="b", kv_sharing_target_layer_name="a",
                           cache_config=CacheConfig(cache_dtype="fp8_e5m2")),
        }
    caches = allocate_kv_caches(layers, 8)
    assert caches["a"].dtype == torch.float8_e5m2 and caches["b"] is caches["a"]
    bind_kv_cache(caches, layers)
    assert layers["b"].kv_cache[0] is layers["a"].kv_cache[0]
    with pytest.raises(ValueError, match="no KV cache given"):
        bind_kv_cache({}, layers)


def test_block_dim_from_the_backend_shape():
    assert block_dim(TorchSDPABackend) == 1


class _BlocksFirst(TorchSDPABackend):
    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size,
                           cache_dtype_str="auto"):
        return (num_blocks, 2, block_size, num_kv_heads, head_size)


@pytest.mark.parametrize("backend", [TorchSDPABackend, _BlocksFirst])
def test_swap_and_copy_blocks_move_whole_blocks(backend):
    dim = block_dim(backend)
    src = torch.randn(backend.get_kv_cache_shape(6, 4, 2, 8))
    dst = torch.randn(backend.get_kv_cache_shape(5, 4, 2, 8))
    mapping = torch.tensor([[0, 4], [3, 1]])
    before = dst.clone()
    swap_blocks(src, dst, mapping, dim)
    assert torch.equal(dst.select(dim, 4), src.select(dim, 0))
    assert torch.equal(dst.select(dim, 1), src.select(dim, 3))
    assert torch.equal(dst.select(dim, 0), before.select(dim, 0))
    copy_blocks([src], torch.tensor([[2, 5]]), dim)
    assert torch.equal(src.select(dim, 5), src.select(dim, 2))
    with pytest.raises(ValueError, match=r"\[n, 2\]"):
        swap_blocks(src, dst, torch.tensor([1, 2, 3]), dim)


# --- layer tensors follow the cache (issue 17) -----------------------------------------------

def _features_layer(backend_name: str = "TORCH_SDPA"):
    from conftest import make_layers
    from pagedattn.selector import load_backend

    return make_layers(load_backend(backend_name), 1, num_heads=4, num_kv_heads=2,
                       head_size=16, alibi_slopes=[0.5, 0.25, 0.125, 0.0625],
                       sinks=torch.tensor([0.1, -0.2, 0.3, 0.0]))


PER_CALL = ("_q_scale", "_k_scale", "_v_scale", "_prob_scale", "q_range", "k_range", "v_range")


def test_bind_puts_every_per_call_tensor_on_the_cache_device():
    """A layer built on the CPU and never moved: binding a cache on another device moves its
    scales, ranges, ALiBi slopes and sinks there, once (the GPU test checks the values)."""
    layers = _features_layer()
    layer = layers["layers.0.attn"]
    bind_kv_cache({"layers.0.attn": torch.zeros(2, 4, 16, 2, 16)}, layers)  # same device
    assert layer.impl.sinks.tolist() == pytest.approx([0.1, -0.2, 0.3, 0.0])
    bind_kv_cache({"layers.0.attn": torch.empty(2, 4, 16, 2, 16, device="meta")}, layers)
    for name in PER_CALL:
        assert getattr(layer, name).device.type == "meta", name
    assert layer.impl.alibi_slopes.device.type == "meta"
    assert layer.impl.sinks.device.type == "meta"


def test_moving_a_bound_layer_keeps_its_tensors_on_the_cache():
    layers = _features_layer()
    layer = layers["layers.0.attn"]
    bind_kv_cache({"layers.0.attn": torch.empty(2, 4, 16, 2, 16, device="meta")}, layers)
    layer.to("cpu")  # the module moves; what a call reads stays with the cache
    assert layer._k_scale.device.type == "meta" and layer.impl.sinks.device.type == "meta"


def test_a_query_on_another_device_than_the_cache_is_refused():
    from pagedattn import CommonAttentionMetadata, set_forward_context

    layers = _features_layer()
    layer = layers["layers.0.attn"]
    bind_kv_cache({"layers.0.attn": torch.empty(2, 4, 16, 2, 16, device="meta")}, layers)
    md = CommonAttentionMetadata.from_lengths([1], [1], torch.zeros(1, 1, dtype=torch.int32), 16)
    q, k = torch.randn(1, 64), torch.randn(1, 32)
    with set_forward_context(md), pytest.raises(
            ValueError, match=r"layer 'layers\.0\.attn': query is on cpu but its KV cache is "
                              r"on meta"):
        layer(q, k, k)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("features", [
    dict(), dict(cache_dtype="fp8", alibi_slopes=[0.5, 0.25, 0.125, 0.0625, 0.03, 0.01,
                                                   0.005, 0.001],
                 sinks=torch.linspace(-1, 1, 8))], ids=["plain", "fp8-alibi-sinks"])
def test_layers_never_moved_run_on_the_gpu_without_host_syncs(features):
    """Layers built on the CPU and never `.to()`-moved, caches on the GPU: no host-to-device
    copy (a sync from pageable memory) anywhere on the layer path, proved under CUDA's
    sync-debug mode, and the values match the oracle."""
    from conftest import LayerRunner, assert_close, make_layers
    from pagedattn import set_forward_context
    from pagedattn.backends.flash_attn import FlashAttentionBackend

    layers = make_layers(FlashAttentionBackend, 2, num_heads=8, num_kv_heads=2,
                         head_size=64, dtype=torch.bfloat16, **features)
    run = LayerRunner(layers, num_blocks=64, dtype=torch.bfloat16, device="cuda")
    for layer in layers.values():
        assert layer._k_scale.is_cuda and layer.q_range.is_cuda
        assert all(t is None or t.is_cuda for t in (layer.impl.alibi_slopes, layer.impl.sinks))
    run.step(["a", "b"], [20, 7])  # prefill: compiles, fills the history
    run.step(["a", "b"], [1, 1])  # the decode kind, compiled outside the checked region
    md, _ = run.metadata(["a", "b"], [1, 1])
    gen = torch.Generator().manual_seed(5)
    inputs = {name: tuple(torch.randn(2, n, generator=gen).to(torch.bfloat16)
                          for n in (8 * 64, 2 * 64, 2 * 64)) for name in layers}
    on_gpu = {name: tuple(x.cuda() for x in xs) for name, xs in inputs.items()}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with set_forward_context(md):
            outs = {name: layer(*on_gpu[name]) for name, layer in layers.items()}
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for name, layer in layers.items():
        want = run._expected(name, layer, ["a", "b"], [1, 1], *inputs[name])
        tol = dict(atol=0.15, rtol=0.1) if features else {}
        assert_close(outs[name].view(2, 8, 64), want, torch.bfloat16, **tol)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_query_on_a_cpu_cache_names_both_devices():
    from pagedattn import CommonAttentionMetadata, set_forward_context

    layers = _features_layer("FLASH_ATTN")
    bind_kv_cache({"layers.0.attn": torch.zeros(2, 4, 16, 2, 16)}, layers)
    md = CommonAttentionMetadata.from_lengths([1], [1], torch.zeros(1, 1, dtype=torch.int32), 16)
    q, k = torch.randn(1, 64, device="cuda"), torch.randn(1, 32, device="cuda")
    with set_forward_context(md), pytest.raises(
            ValueError, match=r"query is on cuda:0 but its KV cache is on cpu"):
        layers["layers.0.attn"](q, k, k)
