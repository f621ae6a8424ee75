"""The Triton `merge_attn_states` against the oracle."""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():  # before pagedattn.ops.triton defines its kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import reference as ref  # noqa: E402
from conftest import assert_close, poison  # noqa: E402
from pagedattn.ops import merge_attn_states  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _triton_provider(_fresh_env, monkeypatch):
    monkeypatch.setenv("PAGEDATTN_OPS_PROVIDER", "triton")


@pytest.mark.parametrize("dtype,head_size,with_lse", [(torch.float32, 40, True),
                                                      (torch.float16, 128, False),
                                                      (torch.bfloat16, 96, True)])
def test_merge_matches_oracle_with_empty_parts(dtype, head_size, with_lse):
    g = torch.Generator().manual_seed(0)
    tokens, heads = 11, 3
    p_out = torch.randn(tokens, heads, head_size, generator=g).to(dtype)
    s_out = torch.randn(tokens, heads, head_size, generator=g).to(dtype)
    p_lse = torch.randn(heads, tokens, generator=g) * 3
    s_lse = torch.randn(tokens, heads, generator=g).T * 3  # a transposed (strided) view
    p_lse[0, :4] = -math.inf  # empty prefix
    s_lse[1, 2:6] = math.inf  # empty suffix, flagged the other way
    p_lse[1, 3] = -math.inf  # both empty at (token 3, head 1)
    out = poison((tokens, heads, head_size), dtype, DEVICE)
    out_lse = poison((heads, tokens), torch.float32, DEVICE) if with_lse else None
    merge_attn_states(out, p_out.to(DEVICE), p_lse.to(DEVICE), s_out.to(DEVICE),
                      s_lse.to(DEVICE), out_lse)
    exp_out, exp_lse = ref.merge_states(p_out, p_lse, s_out, s_lse)
    assert_close(out, exp_out, dtype)
    assert out[3, 1].abs().max() == 0
    if with_lse:
        assert_close(out_lse, exp_lse, atol=1e-5, rtol=1e-5)
