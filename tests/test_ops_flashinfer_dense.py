"""FlashInfer's calls over contiguous K/V (single decode / prefill, the ragged prefill
wrapper), its paged-cache append and its state merges, against the float64 oracle on both
providers (Triton interpreted on a CPU)."""

from __future__ import annotations

import math

import pytest
import torch

import reference as ref
from conftest import FP8_TOLERANCE, TOLERANCE, assert_close, poison
from pagedattn.ops import (
    BatchPrefillWithRaggedKVCacheWrapper,
    append_paged_kv_cache,
    get_batch_indices_positions,
    merge_state,
    merge_state_in_place,
    merge_states,
    single_decode_with_kv_cache,
    single_prefill_with_kv_cache,
)
from pagedattn.ops.flashinfer import get_seq_lens
from test_ops_flashinfer import indptr_of, make_batch

LOG2E = 1 / math.log(2)
WORKSPACE = torch.empty(0, dtype=torch.uint8)
PROVIDERS = ["torch", "triton"]
TRITON_FP32 = dict(atol=2e-4, rtol=1e-4)  # the interpreter's fp32 dots


@pytest.fixture(params=PROVIDERS)
def provider(request, monkeypatch):
    monkeypatch.setenv("PAGEDATTN_OPS_PROVIDER", request.param)
    return request.param


def tol(provider, dtype=torch.float32):
    return TRITON_FP32 if provider == "triton" and dtype == torch.float32 else TOLERANCE[dtype]


def rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def layout_of(x, layout):
    """[len, heads, dim] as FlashInfer takes it: HND is [heads, len, dim] (contiguous)."""
    return x if layout == "NHD" else x.transpose(0, 1).contiguous()


# --- single-request calls -----------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_single_decode_with_window_cap_and_lse(provider, layout):
    q, k, v = rand(8, 16), rand(37, 2, 16, seed=1), rand(37, 2, 16, seed=2)
    out, lse = single_decode_with_kv_cache(q, layout_of(k, layout), layout_of(v, layout),
                                           kv_layout=layout, window_left=20,
                                           logits_soft_cap=3.0, sm_scale=0.4, return_lse=True)
    want, want_lse = ref.attend_one_sequence(q[None], k, v, scale=0.4, window=(20, -1),
                                             softcap=3.0)
    assert_close(out, want[0], **tol(provider))
    assert_close(lse, want_lse[:, 0] * LOG2E, **tol(provider))


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_single_decode_fp8_with_scales(provider, cache_dtype):
    q = rand(4, 16, dtype=torch.bfloat16)
    k8, v8 = rand(20, 2, 16, seed=1).to(cache_dtype), rand(20, 2, 16, seed=2).to(cache_dtype)
    out = single_decode_with_kv_cache(q, k8, v8, q_scale=1.5, k_scale=0.5, v_scale=2.0)
    want, _ = ref.attend_one_sequence(q[None].double() * 1.5, ref.dequantize(k8, 0.5),
                                      ref.dequantize(v8, 2.0), scale=16 ** -0.5)
    assert out.dtype == torch.bfloat16
    assert_close(out, want[0], **FP8_TOLERANCE)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_single_prefill_causal_aligned_to_the_end(provider, causal, layout):
    q, k, v = rand(9, 4, 16), rand(25, 2, 16, seed=1), rand(25, 2, 8, seed=2)
    out, lse = single_prefill_with_kv_cache(q, layout_of(k, layout), layout_of(v, layout),
                                            causal=causal, kv_layout=layout, window_left=10,
                                            return_lse=True)
    want, want_lse = ref.attend_one_sequence(q, k, v, scale=16 ** -0.5, causal=causal,
                                             window=(10, -1))
    assert_close(out, want, **tol(provider))
    assert_close(lse, want_lse.T * LOG2E, **tol(provider))


def test_single_prefill_fp8_with_per_head_scales(provider):
    q8 = rand(5, 4, 16).to(torch.float8_e4m3fn)
    k8, v8 = (rand(12, 2, 16, seed=s).to(torch.float8_e4m3fn) for s in (1, 2))
    sq, sk, sv = torch.tensor([0.5, 1.0, 2.0, 1.5]), torch.tensor([0.25, 1.0]), \
        torch.tensor([2.0, 0.5])
    out = single_prefill_with_kv_cache(q8, k8, v8, scale_q=sq, scale_k=sk, scale_v=sv,
                                       causal=True)
    want, _ = ref.attend_one_sequence(q8.double() * sq[:, None].double(),
                                      k8.double() * sk[:, None].double(),
                                      v8.double() * sv[:, None].double(), scale=16 ** -0.5)
    assert out.dtype == torch.bfloat16
    assert_close(out, want, **FP8_TOLERANCE)


def test_single_call_refusals_name_the_argument():
    q, k = rand(4, 16), rand(8, 2, 16)
    with pytest.raises(ValueError, match="pos_encoding_mode='ROPE_LLAMA'"):
        single_decode_with_kv_cache(q, k, k, pos_encoding_mode="ROPE_LLAMA")
    with pytest.raises(ValueError, match="custom_mask"):
        single_prefill_with_kv_cache(q[None], k, k, custom_mask=torch.ones(1, 8, dtype=bool))
    with pytest.raises(ValueError, match="kv_layout='NDH'"):
        single_decode_with_kv_cache(q, k, k, kv_layout="NDH")
    with pytest.raises(ValueError, match="window_left=-2"):
        single_prefill_with_kv_cache(q[None], k, k, window_left=-2)
    with pytest.raises(ValueError, match="scale_k / scale_v dequantize fp8"):
        single_prefill_with_kv_cache(q[None], k, k, scale_k=torch.ones(2))


# --- ragged prefill wrapper -------------------------------------------------------------------
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ragged_wrapper_against_the_oracle(provider, causal, dtype):
    q_lens, kv_lens = [5, 1, 12, 0], [9, 30, 12, 4]
    q = rand(sum(q_lens), 8, 16, dtype=dtype)
    k, v = rand(sum(kv_lens), 2, 16, dtype=dtype, seed=1), rand(sum(kv_lens), 2, 16,
                                                                  dtype=dtype, seed=2)
    w = BatchPrefillWithRaggedKVCacheWrapper(WORKSPACE, "NHD")
    w.plan(indptr_of(q_lens), indptr_of(kv_lens), 8, 2, 16, causal=causal,
           logits_soft_cap=5.0, q_data_type=dtype)
    out, lse = w.run(q, k, v, out=poison(q.shape, dtype), return_lse=True)
    want, want_lse = ref.varlen_attention(q, k, v, q_lens, kv_lens, scale=16 ** -0.5,
                                          causal=causal, softcap=5.0)
    assert_close(out, want, dtype, **tol(provider, dtype))
    assert_close(lse, want_lse.T * LOG2E, dtype, **tol(provider, dtype))
    assert_close(w.run(q, k, v), want, dtype, **tol(provider, dtype))  # the plan is reused


def test_ragged_wrapper_refusals():
    w = BatchPrefillWithRaggedKVCacheWrapper(WORKSPACE)
    with pytest.raises(RuntimeError, match="before plan"):
        w.run(rand(1, 4, 16), rand(1, 2, 16), rand(1, 2, 16))
    with pytest.raises(ValueError, match="use_cuda_graph=True is not supported"):
        BatchPrefillWithRaggedKVCacheWrapper(WORKSPACE, use_cuda_graph=True)
    with pytest.raises(ValueError, match="kv_data_type"):
        w.plan(indptr_of([1]), indptr_of([1]), 4, 2, 16, kv_data_type=torch.float8_e4m3fn)
    w.plan(indptr_of([2]), indptr_of([3]), 4, 2, 16, q_data_type=torch.float32)
    with pytest.raises(ValueError, match=r"k is torch.float32 \(4, 2, 16\)"):
        w.run(rand(2, 4, 16), rand(4, 2, 16), rand(3, 2, 16))


# --- append to a paged cache --------------------------------------------------------------------
def test_batch_indices_and_positions_as_flashinfer_documents():
    b, p = get_batch_indices_positions(torch.tensor([0, 1, 3, 6, 10], dtype=torch.int32),
                                       torch.tensor([5, 5, 5, 5], dtype=torch.int32), 12)
    assert b.tolist() == [0, 1, 1, 2, 2, 2, 3, 3, 3, 3, -1, -1]
    assert p.tolist() == [4, 3, 4, 2, 3, 4, 1, 2, 3, 4, 0, 0]
    assert get_seq_lens(torch.tensor([0, 3, 3, 5]), torch.tensor([2, 7, 16]), 16).tolist() \
        == [34, 0, 32]


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_append_writes_each_row_where_the_page_table_says(provider, layout, cache_dtype):
    append, kv_lens, page = [3, 1, 20], [10, 1, 35], 8
    b = make_batch([1] * 3, kv_lens, heads=(4, 2), head_dim=16, page_size=page,
                   layout=layout, dtype=torch.float32)
    cache = b.cache.nan_to_num(0).to(cache_dtype)
    k_new = rand(sum(append), 2, 16, seed=3).to(cache_dtype)
    v_new = rand(sum(append), 2, 16, seed=4).to(cache_dtype)
    seq_lens = get_seq_lens(b.indptr, b.last_page_len, page)
    batch_idx, pos = get_batch_indices_positions(indptr_of(append), seq_lens, sum(append))
    before = cache.clone()
    append_paged_kv_cache(k_new, v_new, batch_idx, pos, cache, b.indices, b.indptr,
                          b.last_page_len, kv_layout=layout)
    logical = (lambda c: c if layout == "NHD" else c.transpose(2, 3))
    want_k, want_v = logical(before)[:, 0].clone(), logical(before)[:, 1].clone()
    row = 0
    for r, n in enumerate(append):
        for j in range(kv_lens[r] - n, kv_lens[r]):
            page_id = b.table[r, j // page]
            want_k[page_id, j % page], want_v[page_id, j % page] = k_new[row], v_new[row]
            row += 1
    got = logical(cache)
    assert torch.equal(got[:, 0].view(torch.uint8), want_k.view(torch.uint8))  # bit exact
    assert torch.equal(got[:, 1].view(torch.uint8), want_v.view(torch.uint8))


def test_append_refuses_rows_of_another_dtype():
    cache = torch.zeros(4, 2, 8, 2, 16, dtype=torch.float8_e4m3fn)
    idx = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="append_key has dtype torch.bfloat16 but the cache"):
        append_paged_kv_cache(rand(1, 2, 16, dtype=torch.bfloat16),
                              rand(1, 2, 16, dtype=torch.bfloat16), idx, idx, cache, idx,
                              torch.tensor([0, 1], dtype=torch.int32), idx + 1)


# --- state merges ------------------------------------------------------------------------------
def states(n, seq=6, heads=4, dim=16, dtype=torch.float32):
    v = rand(seq, n, heads, dim, dtype=dtype, seed=5)
    s = rand(seq, n, heads, seed=6) * 3
    s[0, 0] = -math.inf  # an empty part
    return v, s


def oracle_merge(v, s):
    """Fold the oracle's natural-log merge over the states; back to base 2."""
    out, lse = v[:, 0].double(), s[:, 0].double().T / LOG2E
    for i in range(1, v.shape[1]):
        out, lse = ref.merge_states(out, lse, v[:, i], s[:, i].T / LOG2E)
    return out, lse.T * LOG2E


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merges_against_the_oracle(provider, dtype):
    v, s = states(3, dtype=dtype)
    want, want_s = oracle_merge(v, s)
    got_v, got_s = merge_states(v, s)
    assert_close(got_v, want, dtype)
    assert_close(got_s, want_s)
    two, two_s = oracle_merge(v[:, :2], s[:, :2])
    got_v, got_s = merge_state(v[:, 0], s[:, 0].contiguous(), v[:, 1], s[:, 1].contiguous())
    assert_close(got_v, two, dtype)
    assert_close(got_s, two_s)
    acc_v, acc_s = v[:, 0].clone(), s[:, 0].clone()
    mask = torch.tensor([True, False, True, True, False, True])
    merge_state_in_place(acc_v, acc_s, v[:, 1], s[:, 1].contiguous(), mask)
    assert_close(acc_v[mask], two[mask], dtype)
    assert torch.equal(acc_v[~mask], v[~mask, 0])  # unmasked rows keep their state
    assert_close(acc_s[mask], two_s[mask])


def test_merge_refusals_name_the_argument():
    v, s = states(2)
    with pytest.raises(ValueError, match="s_b is torch.float16"):
        merge_state(v[:, 0], s[:, 0], v[:, 1], s[:, 1].half())
    with pytest.raises(ValueError, match="mask must be bool"):
        merge_state_in_place(v[:, 0], s[:, 0], v[:, 1], s[:, 1], torch.ones(6))
    with pytest.raises(ValueError, match="expected float32 \\[seq_len, num_states"):
        merge_states(v, s[:, :1])
