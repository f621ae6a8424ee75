"""The Triton cache write (`reshape_and_cache_flash[_diffkv]`) against the oracle."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # before pagedattn.ops.triton defines its kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import reference as ref  # noqa: E402
from pagedattn.ops import reshape_and_cache_flash, reshape_and_cache_flash_diffkv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CACHE_DTYPE = {"auto": None, "bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn,
               "fp8_e5m2": torch.float8_e5m2}


@pytest.fixture(autouse=True)
def _triton_provider(_fresh_env, monkeypatch):
    monkeypatch.setenv("PAGEDATTN_OPS_PROVIDER", "triton")


def _cache(num_blocks, block_size, heads, d, dtype, layout, g):
    # A NaN-poisoned base so untouched slots are recognisable; fp8 caches start from random.
    x = torch.randn(num_blocks, block_size, heads, d, generator=g).to(dtype)
    if layout == "HND":
        x = x.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    return x.to(DEVICE)


def _slots(num_tokens, num_slots, num_blocks, block_size, g):
    """Distinct random slots with some -1 (padding), as int64."""
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_slots]
    slots[torch.rand(num_slots, generator=g) < 0.25] = -1
    return slots


def _fp8_exact(x, dtype, scale):
    """Values whose x / scale is an fp8 number, or past the fp8 range (saturation).

    The interpreter's fp8 rounding is wrong where rounding carries into the exponent (31.5 ->
    16); hardware rounds to nearest even like torch. Exact inputs test the kernel, not that.
    """
    bound = ref.FP8_MAX[dtype]
    exact = (x / scale).clamp(-bound, bound).to(dtype).float() * scale
    exact.view(-1)[::7] = 4 * bound * scale  # every 7th saturates
    return exact


def _assert_cache_equal(actual, expected, dtype):
    actual, expected = actual.cpu().double(), expected.cpu().double()
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        # The interpreter truncates float32 -> bf16 instead of rounding: one ulp apart.
        torch.testing.assert_close(actual, expected, rtol=2 ** -7, atol=0)
    else:
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)


@pytest.mark.parametrize("kv_cache_dtype,layout,src_dtype,head_size,block_size", [
    ("auto", "NHD", torch.float32, 24, 16),
    ("bfloat16", "HND", torch.float32, 40, 32),
    ("fp8_e4m3", "HND", torch.bfloat16, 32, 16),
    ("fp8_e5m2", "NHD", torch.float16, 48, 64),
])
def test_reshape_and_cache_flash(kv_cache_dtype, layout, src_dtype, head_size, block_size):
    g = torch.Generator().manual_seed(0)
    num_tokens, num_slots, heads, num_blocks = 23, 19, 3, 4
    dtype = CACHE_DTYPE[kv_cache_dtype] or src_dtype
    key = torch.randn(num_tokens, heads, head_size, generator=g) * 300
    value = torch.randn(num_tokens, heads, head_size, generator=g)
    k_cache = _cache(num_blocks, block_size, heads, head_size, dtype, layout, g)
    v_cache = _cache(num_blocks, block_size, heads, head_size, dtype, layout, g)
    slots = _slots(num_tokens, num_slots, num_blocks, block_size, g)
    k_scale, v_scale = (0.5, 0.25) if dtype in ref.FP8_MAX else (1.0, 1.0)
    if dtype in ref.FP8_MAX:
        key, value = _fp8_exact(key, dtype, k_scale), _fp8_exact(value, dtype, v_scale)
    key, value = key.to(src_dtype), value.to(src_dtype)
    exp_k = ref.cache_after_write(k_cache.cpu(), key, slots, k_scale)
    exp_v = ref.cache_after_write(v_cache.cpu(), value, slots, v_scale)
    reshape_and_cache_flash(key.to(DEVICE), value.to(DEVICE), k_cache, v_cache,
                            slots.to(DEVICE), kv_cache_dtype,
                            torch.tensor(k_scale, device=DEVICE), v_scale)
    _assert_cache_equal(k_cache, exp_k, dtype)
    _assert_cache_equal(v_cache, exp_v, dtype)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_reshape_and_cache_flash_diffkv(kv_cache_dtype):
    g = torch.Generator().manual_seed(1)
    num_tokens, heads, d, dv, block_size, num_blocks = 9, 2, 40, 24, 16, 3
    dtype = CACHE_DTYPE[kv_cache_dtype] or torch.float16
    key = torch.randn(num_tokens, heads, d, generator=g)
    value = torch.randn(num_tokens, heads, dv, generator=g)
    kv_cache = _cache(num_blocks, block_size, heads, d + dv, dtype, "NHD", g)
    slots = _slots(num_tokens, num_tokens, num_blocks, block_size, g).to(torch.int32)
    k_scale, v_scale = (2.0, 0.5) if dtype in ref.FP8_MAX else (1.0, 1.0)
    if dtype in ref.FP8_MAX:
        key, value = _fp8_exact(key, dtype, k_scale), _fp8_exact(value, dtype, v_scale)
    key, value = key.half(), value.half()
    expected = kv_cache.cpu().clone()
    expected[..., :d] = ref.cache_after_write(expected[..., :d], key, slots, k_scale)
    expected[..., d:] = ref.cache_after_write(expected[..., d:], value, slots, v_scale)
    reshape_and_cache_flash_diffkv(key.to(DEVICE), value.to(DEVICE), kv_cache, slots.to(DEVICE),
                                   kv_cache_dtype, k_scale, v_scale)
    _assert_cache_equal(kv_cache, expected, dtype)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_real_sizes(layout, kv_cache_dtype):
    g = torch.Generator().manual_seed(2)
    num_tokens, heads, d, block_size, num_blocks = 4096, 8, 128, 16, 600
    dtype = CACHE_DTYPE[kv_cache_dtype] or torch.bfloat16
    key = torch.randn(num_tokens, heads, d, generator=g).bfloat16()
    value = torch.randn(num_tokens, heads, d, generator=g).bfloat16()
    k_cache = _cache(num_blocks, block_size, heads, d, dtype, layout, g)
    v_cache = _cache(num_blocks, block_size, heads, d, dtype, layout, g)
    slots = _slots(num_tokens, num_tokens, num_blocks, block_size, g)
    # A scale of 0.005 pushes |x| / scale past 448: the fp8 case checks saturation.
    exp_k = ref.cache_after_write(k_cache.cpu(), key, slots, 0.005)
    exp_v = ref.cache_after_write(v_cache.cpu(), value, slots, 0.05)
    reshape_and_cache_flash(key.to(DEVICE), value.to(DEVICE), k_cache, v_cache,
                            slots.to(DEVICE), kv_cache_dtype, 0.005, 0.05)
    _assert_cache_equal(k_cache, exp_k, dtype)
    _assert_cache_equal(v_cache, exp_v, dtype)
