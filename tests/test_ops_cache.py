"""reshape_and_cache_flash(_diffkv) against the oracle's cache_after_write."""

from __future__ import annotations

import pytest
import torch

import reference as ref
from conftest import randn
from pagedattn.ops import reshape_and_cache_flash, reshape_and_cache_flash_diffkv


def make_cache(num_blocks, block_size, heads, d, dtype, layout="NHD"):
    x = randn(num_blocks, block_size, heads, d).to(dtype)
    if layout == "HND":
        x = x.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    return x


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_size", [64, 80])
def test_write_matches_oracle(layout, dtype, head_size):
    kc = make_cache(6, 16, 2, head_size, dtype, layout)
    vc = make_cache(6, 16, 2, head_size, dtype, layout)
    key, value = randn(11, 2, head_size, dtype=dtype), randn(11, 2, head_size, dtype=dtype)
    slots = torch.tensor([3, 17, -1, 95, 40, 41, -1, 0, 63, 64, 20])
    want_k = ref.cache_after_write(kc, key, slots)
    want_v = ref.cache_after_write(vc, value, slots)
    reshape_and_cache_flash(key, value, kc, vc, slots, "auto")
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


@pytest.mark.parametrize("cache_dtype, fp8", [("fp8", torch.float8_e4m3fn),
                                               ("fp8_e4m3", torch.float8_e4m3fn),
                                               ("fp8_e5m2", torch.float8_e5m2)])
def test_fp8_write_stores_scaled_saturated_values(cache_dtype, fp8):
    kc = make_cache(4, 16, 2, 32, fp8)
    vc = make_cache(4, 16, 2, 32, fp8)
    key = randn(5, 2, 32) * 3
    key[0, 0, 0] = 1e9  # saturates rather than becoming inf/nan
    value = randn(5, 2, 32)
    slots = torch.tensor([0, 5, 33, -1, 63])
    want_k = ref.cache_after_write(kc, key, slots, scale=0.05)
    want_v = ref.cache_after_write(vc, value, slots, scale=0.5)
    reshape_and_cache_flash(key, value, kc, vc, slots, cache_dtype, torch.tensor(0.05), 0.5)
    assert torch.equal(kc.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), want_v.view(torch.uint8))
    assert kc[0, 0, 0, 0].float() == ref.FP8_MAX[fp8]


def test_uint8_storage_is_viewed_as_fp8():
    kc = torch.zeros(2, 16, 1, 16, dtype=torch.uint8)
    vc = torch.zeros(2, 16, 1, 16, dtype=torch.uint8)
    key, value = randn(3, 1, 16), randn(3, 1, 16)
    slots = torch.tensor([1, 2, 30])
    want = ref.cache_after_write(kc.view(torch.float8_e4m3fn), key, slots)
    reshape_and_cache_flash(key, value, kc, vc, slots, "fp8")
    assert torch.equal(kc, want.view(torch.uint8))


def test_only_len_slot_mapping_tokens_are_written():
    kc, vc = make_cache(2, 16, 1, 8, torch.float32), make_cache(2, 16, 1, 8, torch.float32)
    key, value = randn(6, 1, 8), randn(6, 1, 8)  # 2 padded tokens beyond the slots
    slots = torch.tensor([4, 5, 6, 7])
    want = ref.cache_after_write(kc, key[:4], slots)
    reshape_and_cache_flash(key, value, kc, vc, slots, "auto")
    assert torch.equal(kc, want)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_diffkv_write_fills_both_halves(layout):
    cache = make_cache(3, 16, 2, 64 + 32, torch.bfloat16, layout)
    key, value = randn(4, 2, 64, dtype=torch.bfloat16), randn(4, 2, 32, dtype=torch.bfloat16)
    slots = torch.tensor([0, 17, -1, 47])
    want_k = ref.cache_after_write(cache[..., :64], key, slots)
    want_v = ref.cache_after_write(cache[..., 64:], value, slots)
    reshape_and_cache_flash_diffkv(key, value, cache, slots, "auto")
    assert torch.equal(cache[..., :64], want_k) and torch.equal(cache[..., 64:], want_v)


def test_slot_offsets_beyond_int32_are_written():
    # 2**25 blocks of 16 slots x 8 elements: the last slot's element offset exceeds 2**31.
    # torch.empty leaves the pages untouched, so this costs no real memory.
    num_blocks = 1 << 25
    kc = torch.empty(num_blocks, 16, 1, 8, dtype=torch.float8_e4m3fn)
    vc = torch.empty(num_blocks, 16, 1, 8, dtype=torch.float8_e4m3fn)
    slot = num_blocks * 16 - 1
    assert slot * 8 > 2**31
    key, value = randn(1, 1, 8), randn(1, 1, 8)
    reshape_and_cache_flash(key, value, kc, vc, torch.tensor([slot]), "fp8")
    want = key[0, 0].to(torch.float8_e4m3fn)
    assert torch.equal(kc[-1, -1, 0].view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("change, error, match", [
    (dict(kv_cache_dtype="int4"), ValueError, "kv_cache_dtype"),
    (dict(kv_cache_dtype="fp8"), TypeError, "needs torch.float8_e4m3fn"),
    (dict(slot_mapping=torch.zeros(9, dtype=torch.int64)), ValueError, "slot_mapping has 9"),
    (dict(slot_mapping=torch.zeros(2)), TypeError, "slot_mapping has dtype"),
    (dict(key=randn(4, 3, 16)), ValueError, "num_kv_heads of key"),
    (dict(value=randn(4, 2, 8)), ValueError, "head_size of value"),
    # issue 24's contracts
    (dict(key=[0.0]), TypeError, "key must be a torch.Tensor, got list"),
    (dict(value=None), TypeError, "value must be a torch.Tensor, got None"),
    (dict(key=torch.zeros(4, 2, 16, dtype=torch.int32)), TypeError, "key has dtype torch.int32"),
    (dict(value=randn(4, 2, 16, dtype=torch.float16)), TypeError,
     r"value has dtype torch.float16; allowed: \['torch.float32'\]"),
    (dict(value=randn(4, 1, 16), value_cache=make_cache(2, 16, 1, 16, torch.float32)),
     ValueError, r"value has shape \(4, 1, 16\); dimension 1 must be 2 \(num_kv_heads of key"),
    (dict(value_cache=make_cache(2, 16, 2, 16, torch.float16)), TypeError,
     r"value_cache has dtype torch.float16; allowed: \['torch.float32'\]"),
    (dict(slot_mapping=None), TypeError, "slot_mapping must be a torch.Tensor, got None"),
    (dict(kv_cache_dtype=None), TypeError, "kv_cache_dtype=None must be a string"),
    (dict(k_scale=torch.ones(2)), ValueError, r"k_scale has shape \(2,\); expected one value"),
])
def test_bad_arguments_raise_clear_errors(change, error, match):
    args = dict(key=randn(4, 2, 16), value=randn(4, 2, 16),
                key_cache=make_cache(2, 16, 2, 16, torch.float32),
                value_cache=make_cache(2, 16, 2, 16, torch.float32),
                slot_mapping=torch.arange(4), kv_cache_dtype="auto")
    args.update(change)
    with pytest.raises(error, match=match):
        reshape_and_cache_flash(**args)


@pytest.mark.parametrize("change, error, match", [
    (dict(value=None), TypeError, "value must be a torch.Tensor, got None"),
    (dict(kv_cache=None), TypeError, "kv_cache must be a torch.Tensor, got None"),
    (dict(kv_cache=make_cache(2, 16, 2, 20, torch.float32)), ValueError,
     "head_size \\+ head_size_v of key and value"),
])
def test_diffkv_bad_arguments_raise_clear_errors(change, error, match):
    args = dict(key=randn(4, 2, 16), value=randn(4, 2, 8),
                kv_cache=make_cache(2, 16, 2, 24, torch.float32), slot_mapping=torch.arange(4),
                kv_cache_dtype="auto")
    args.update(change)
    with pytest.raises(error, match=match):
        reshape_and_cache_flash_diffkv(**args)
