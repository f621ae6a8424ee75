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
