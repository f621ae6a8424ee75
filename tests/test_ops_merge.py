"""merge_attn_states against the oracle, including empty parts (LSE +-inf)."""

from __future__ import annotations

import math

import pytest
import torch

import reference as ref
from conftest import assert_close, poison, randn
from pagedattn.ops import flash_attn_varlen_func, merge_attn_states


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_merge_matches_oracle(dtype):
    t, h, d = 7, 4, 48
    po, so = randn(t, h, d, dtype=dtype), randn(t, h, d, dtype=dtype)
    pl, sl = randn(h, t) * 3, randn(h, t) * 3
    pl[0, 0], sl[1, 1] = -math.inf, math.inf  # one empty part each
    pl[2, 2] = sl[2, 2] = -math.inf  # both empty
    out, lse = poison((t, h, d), dtype), poison((h, t), torch.float32)
    merge_attn_states(out, po, pl, so, sl, output_lse=lse)
    want_out, want_lse = ref.merge_states(po, pl, so, sl)
    assert_close(out, want_out, dtype)
    assert torch.equal(out[2, 2], torch.zeros_like(out[2, 2]))
    assert torch.isneginf(lse[2, 2])
    finite = torch.isfinite(want_lse)
    assert_close(lse[finite], want_lse[finite])


def test_merging_two_key_halves_equals_attention_over_all_keys():
    q, k, v = randn(5, 4, 32), randn(20, 2, 32), randn(20, 2, 32)
    cu_q = torch.tensor([0, 5], dtype=torch.int32)

    def attend(keys, values):
        cu_k = torch.tensor([0, keys.shape[0]], dtype=torch.int32)
        return flash_attn_varlen_func(q, keys, values, 5, cu_q, keys.shape[0], cu_seqlens_k=cu_k,
                                      causal=False, return_softmax_lse=True)

    whole, whole_lse = attend(k, v)
    (a, a_lse), (b, b_lse) = attend(k[:12], v[:12]), attend(k[12:], v[12:])
    out, lse = torch.empty_like(whole), torch.empty_like(whole_lse)
    merge_attn_states(out, a, a_lse, b, b_lse, lse)
    torch.testing.assert_close(out, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, whole_lse, atol=1e-5, rtol=1e-5)


def test_lse_shape_is_checked():
    x = randn(3, 2, 8)
    with pytest.raises(ValueError, match="num_heads, num_tokens"):
        merge_attn_states(torch.empty_like(x), x, randn(3, 2), x, randn(2, 3))


@pytest.mark.parametrize("name, bad, error, match", [
    ("output", None, TypeError, "output must be a torch.Tensor, got None"),
    ("prefix_output", torch.zeros(3, 2, 4), ValueError,
     r"prefix_output has shape \(3, 2, 4\); expected \(3, 2, 8\)"),
    ("suffix_output", torch.zeros(3, 2, 8, dtype=torch.int32), TypeError,
     "suffix_output has dtype torch.int32"),
    ("prefix_lse", None, TypeError, "prefix_lse must be a torch.Tensor, got None"),
    ("suffix_lse", torch.zeros(2, 3, dtype=torch.float16), TypeError,
     "suffix_lse has dtype torch.float16"),
])
def test_each_argument_is_checked_by_name(name, bad, error, match):
    x = randn(3, 2, 8)
    args = dict(output=torch.empty_like(x), prefix_output=x, prefix_lse=randn(2, 3),
                suffix_output=x, suffix_lse=randn(2, 3))
    args[name] = bad
    with pytest.raises(error, match=match):
        merge_attn_states(**args)
