"""The FLASH_ATTN_DIFFKV backend (values with their own head size) through the Attention layer."""

from __future__ import annotations

import pytest
import torch

from conftest import FP8_TOLERANCE, LayerRunner, assert_close
from pagedattn import Attention, CacheConfig, EngineConfig, get_attn_backend, model_scope
from pagedattn.backends.flash_attn import FlashAttentionBackend, FlashAttentionImpl
from pagedattn.backends.flash_attn_diffkv import (
    FlashAttentionDiffKVBackend,
    FlashAttentionDiffKVImpl,
)
from pagedattn.selector import explain
from pagedattn.types import AttentionRequest

HEAD_SIZE, HEAD_SIZE_V = 32, 48


@pytest.fixture
def head_size_v():
    """Sets the backend's class-wide value head size for one test, then restores it."""
    old = FlashAttentionDiffKVBackend.head_size_v
    FlashAttentionDiffKVBackend.set_head_size_v(HEAD_SIZE_V)
    yield HEAD_SIZE_V
    FlashAttentionDiffKVBackend.set_head_size_v(old)


def make_layers(n=1, num_heads=8, num_kv_heads=2, cache_dtype="auto", dtype=torch.float32,
                **kwargs):
    torch.set_default_dtype(dtype)
    try:
        with model_scope():
            return {f"l{i}": Attention(
                num_heads, HEAD_SIZE, HEAD_SIZE ** -0.5, num_kv_heads, prefix=f"l{i}",
                cache_config=CacheConfig(block_size=16, cache_dtype=cache_dtype),
                attn_backend=FlashAttentionDiffKVBackend, **kwargs) for i in range(n)}
    finally:
        torch.set_default_dtype(torch.float32)


def record_builds(builder) -> list:
    """The metadata of every later `builder.build`, in order."""
    built, build = [], builder.build
    builder.build = lambda *a, **k: built.append(build(*a, **k)) or built[-1]
    return built


def check(results, **tol):
    for out, want in results.values():
        assert out.shape[-1] == HEAD_SIZE_V
        assert_close(out, want, **tol)


def test_backend_is_flash_attn_with_its_own_cache_and_value_head_size():
    b = FlashAttentionDiffKVBackend
    assert issubclass(b, FlashAttentionBackend) and b.head_size_v == 128
    assert issubclass(b.get_impl_cls(), FlashAttentionImpl)
    assert b.get_impl_cls() is FlashAttentionDiffKVImpl
    assert b.get_name() == "FLASH_ATTN_DIFFKV"
    assert b.get_builder_cls() is FlashAttentionBackend.get_builder_cls()
    assert b.get_kv_cache_shape(10, 32, 4, 64) == (10, 32, 4, 64 + 128)
    with pytest.raises(ValueError, match="multiple of 16"):
        b.get_kv_cache_shape(10, 8, 4, 64)
    assert b.capabilities.different_kv_head_sizes and b.capabilities.block_size_multiple == 16


@pytest.mark.parametrize("layout, plain, with_layers", [
    ("NHD", (0, 1, 2, 3), (1, 0, 2, 3, 4)),
    ("HND", (0, 2, 1, 3), (1, 3, 0, 2, 4)),
])
def test_stride_orders_are_the_seeds(layout, plain, with_layers, monkeypatch):
    monkeypatch.setenv("PAGEDATTN_KV_CACHE_LAYOUT", layout)
    b = FlashAttentionDiffKVBackend
    assert b.get_kv_cache_stride_order() == plain
    assert b.get_kv_cache_stride_order(include_num_layers_dimension=True) == with_layers


@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
def test_selector_chooses_diffkv_only_for_different_head_sizes(device_type, head_size_v,
                                                               monkeypatch):
    monkeypatch.setattr("pagedattn.selector.current_device_type", lambda: device_type)
    same = get_attn_backend(HEAD_SIZE, torch.bfloat16, "auto", 16)
    assert same.get_name() == ("FLASH_ATTN" if device_type == "cuda" else "TORCH_SDPA")
    diff = get_attn_backend(HEAD_SIZE, torch.bfloat16, "auto", 16, head_size_v=HEAD_SIZE_V)
    assert diff is FlashAttentionDiffKVBackend
    with pytest.raises(ValueError, match="set_head_size_v"):
        get_attn_backend(HEAD_SIZE, torch.bfloat16, "auto", 16, head_size_v=80)
    with pytest.raises(ValueError, match="multiple of 16"):
        get_attn_backend(HEAD_SIZE, torch.bfloat16, "auto", 8, head_size_v=HEAD_SIZE_V)


def test_diffkv_is_never_chosen_for_equal_head_sizes_but_can_be_forced(monkeypatch):
    request = AttentionRequest(128, torch.bfloat16, device_type="cuda")
    assert "automatically" in explain(request)["FLASH_ATTN_DIFFKV"][0]
    monkeypatch.setenv("PAGEDATTN_ATTENTION_BACKEND", "FLASH_ATTN_DIFFKV")
    assert get_attn_backend(128, torch.bfloat16, "auto", 16) is FlashAttentionDiffKVBackend


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_batches_against_the_oracle(layout, head_size_v, monkeypatch):
    monkeypatch.setenv("PAGEDATTN_KV_CACHE_LAYOUT", layout)
    layers = make_layers(2)
    run = LayerRunner(layers, num_blocks=64)
    cache = run.caches["l0"]
    assert cache.shape == (64, 16, 2, HEAD_SIZE + HEAD_SIZE_V)
    assert (cache.stride(2) > cache.stride(1)) == (layout == "HND")
    check(run.step([0, 1, 2], [17, 5, 40]))  # pure prefill
    check(run.step([0, 1, 2], [1, 1, 1]))  # pure decode
    check(run.step([0, 1, 2], [9, 20, 3]))  # chunked prefill over cached context
    check(run.step([0, 1, 2, 3], [1, 7, 1, 33]))  # mixed, with a new request


@pytest.mark.parametrize("feature", [dict(per_layer_sliding_window=8),
                                     dict(alibi_slopes=[0.5 ** (i + 1) for i in range(8)]),
                                     dict(logits_soft_cap=3.0),
                                     dict(sinks=torch.linspace(-1, 1, 8))],
                         ids=["sliding_window", "alibi", "softcap", "sinks"])
def test_optional_features(feature, head_size_v):
    run = LayerRunner(make_layers(1, **feature))
    check(run.step([0, 1], [20, 3]))
    check(run.step([0, 1], [1, 6]))


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e5m2"])
def test_fp8_cache(cache_dtype, head_size_v):
    layers = make_layers(1, cache_dtype=cache_dtype, dtype=torch.bfloat16)
    layer = layers["l0"]
    for name, s in (("_k_scale", 0.02), ("_v_scale", 0.03)):
        getattr(layer, name).fill_(s)
        setattr(layer, name + "_float", s)
    run = LayerRunner(layers, dtype=torch.bfloat16)
    check(run.step([0, 1], [12, 4]), **FP8_TOLERANCE)
    check(run.step([0, 1], [1, 1]), **FP8_TOLERANCE)


def test_kv_sharing(head_size_v):
    with model_scope():
        first = Attention(4, HEAD_SIZE, 0.2, 2, prefix="a",
                          attn_backend=FlashAttentionDiffKVBackend)
        second = Attention(4, HEAD_SIZE, 0.2, 2, prefix="b", kv_sharing_target_layer_name="a",
                           attn_backend=FlashAttentionDiffKVBackend)
    run = LayerRunner({"a": first, "b": second})
    check(run.step([0, 1], [6, 2]))
    check(run.step([0, 1], [1, 1]))


def test_cascade_equals_plain(head_size_v):
    outs = {}
    for cascade in (True, False):
        run = LayerRunner(make_layers(1), num_blocks=128,
                          engine_config=EngineConfig(enable_cascade=cascade))
        run.builder.use_cascade_attention = lambda *args, **kwargs: True  # any batch
        built = record_builds(run.builder)
        run.step([0], [256])
        for r in range(1, 11):  # ten requests share request 0's 256-token prefix blocks
            run.table.add_request(r, prefix_blocks=run.table.blocks[0])  # 256 tokens
            run.history[("l0", r)] = {k: list(v) for k, v in run.history[("l0", 0)].items()}
        results = run.step(list(range(1, 11)), [1, 2] * 5, common_prefix_len=256)
        assert built[-1].use_cascade == cascade
        check(results)
        outs[cascade] = results["l0"][0]
    torch.testing.assert_close(outs[True], outs[False], atol=2e-6, rtol=1e-5)
