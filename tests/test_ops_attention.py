"""flash_attn_varlen_func (default provider on this device) against the float64 oracle."""

from __future__ import annotations

import math

import pytest
import torch

import reference as ref
from conftest import FP8_TOLERANCE, assert_close, cu_seqlens, make_paged_batch, poison, randn
from pagedattn.ops import flash_attn_varlen_func

MIXED_Q, MIXED_K = [1, 1, 7, 33], [17, 300, 7, 90]  # decodes, a full prefill, a chunked one


def run_paged(b, *, out_dtype=None, head_size_v=None, **kwargs):
    num_heads = b.q.shape[1]
    dv = head_size_v or b.v_cache.shape[-1]
    out = poison((b.total_q, num_heads, dv), out_dtype or b.q.dtype)
    return flash_attn_varlen_func(
        q=b.q, k=b.k_cache, v=b.v_cache, out=out, cu_seqlens_q=b.cu_seqlens_q,
        max_seqlen_q=b.max_seqlen_q, seqused_k=b.seqused_k, max_seqlen_k=b.max_seqlen_k,
        block_table=b.block_table, return_softmax_lse=True, **kwargs)


def oracle(b, scale, causal=True, window=(-1, -1), **features):
    return ref.paged_attention(b.q, b.k_cache, b.v_cache, b.query_lens, b.seq_lens,
                               b.block_table, scale=scale, causal=causal, window=window,
                               **features)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(8, 2), (8, 1), (4, 4)], ids=["gqa", "mqa", "mha"])
@pytest.mark.parametrize("head_size", [64, 80, 128, 256])
@pytest.mark.parametrize("block_size", [16, 32])
def test_mixed_batch_matches_oracle(dtype, heads, head_size, block_size):
    b = make_paged_batch(MIXED_Q, MIXED_K, *heads, head_size, block_size, dtype)
    scale = head_size ** -0.5
    out, lse = run_paged(b, softmax_scale=scale, causal=True)
    want_out, want_lse = oracle(b, scale)
    assert_close(out, want_out, dtype)
    assert_close(lse, want_lse, torch.float32, atol=1e-4, rtol=1e-4)


FEATURES = {
    "non_causal": dict(causal=False),
    "window_left": dict(window=(20, 0)),
    "window_left_right": dict(causal=False, window=(9, 4)),
    "alibi": dict(alibi_slopes=[2 ** -(h + 1) for h in range(8)]),
    "softcap": dict(softcap=3.0),
    "sinks": dict(sinks=[0.3 * h - 1.0 for h in range(8)]),
    "all": dict(window=(40, 0), alibi_slopes=[0.1] * 8, softcap=10.0, sinks=[0.5] * 8),
}


@pytest.mark.parametrize("name", list(FEATURES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_optional_features_match_oracle(name, dtype):
    f = dict(FEATURES[name])
    b = make_paged_batch(MIXED_Q, MIXED_K, 8, 2, 64, 16, dtype, seed=1)
    kwargs = dict(softmax_scale=0.125, causal=f.get("causal", True),
                  window_size=f.get("window"), softcap=f.get("softcap", 0.0))
    if "alibi_slopes" in f:
        kwargs["alibi_slopes"] = torch.tensor(f["alibi_slopes"])
    if "sinks" in f:
        kwargs["s_aux"] = torch.tensor(f["sinks"])
    out, lse = run_paged(b, **kwargs)
    want_out, want_lse = oracle(b, 0.125, causal=kwargs["causal"],
                                window=f.get("window", (-1, -1)), softcap=f.get("softcap", 0.0),
                                alibi_slopes=f.get("alibi_slopes"), sinks=f.get("sinks"))
    assert_close(out, want_out, dtype)
    assert_close(lse, want_lse, torch.float32, atol=1e-4, rtol=1e-4)


def test_rows_without_visible_keys_give_zero_and_minus_inf_lse():
    # 6 queries over 3 keys: the first three queries sit before every key (bottom-right
    # alignment), so causal masking leaves them nothing.
    b = make_paged_batch([6], [3], 4, 2, 32, 16)
    out, lse = run_paged(b, causal=True)
    assert torch.equal(out[:3], torch.zeros_like(out[:3]))
    assert torch.isneginf(lse[:, :3]).all()
    want_out, want_lse = oracle(b, 32 ** -0.5)
    assert_close(out, want_out)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))


def test_window_smaller_than_the_gap_masks_whole_rows():
    # Non-causal, window right=-1, left=0 but keys only up to position 2 while queries sit
    # at 7..9 of a 10-key sequence: keys (0..9) — use a right-only window ahead of the keys.
    b = make_paged_batch([3], [10], 2, 1, 32, 16)
    out, lse = run_paged(b, causal=False, window_size=(-1, 0))
    want_out, want_lse = oracle(b, 32 ** -0.5, causal=False, window=(-1, 0))
    assert_close(out, want_out)
    b2 = make_paged_batch([4], [4], 2, 1, 32, 16)  # window (0, 0) with keys beyond seqused_k
    b2.seqused_k[0] = 2  # queries at -2..1: two rows see nothing
    b2.seq_lens[0] = 2
    out2, lse2 = run_paged(b2, causal=True, window_size=(0, 0))
    want2, want_lse2 = oracle(b2, 32 ** -0.5, window=(0, 0))
    assert_close(out2, want2)
    assert torch.isneginf(lse2[:, :2]).all() and torch.isfinite(lse2[:, 2:]).all()


def test_zero_length_queries_and_empty_requests():
    b = make_paged_batch([0, 3, 0, 1, 0], [5, 3, 9, 1, 0], 4, 2, 32, 16)
    out, lse = run_paged(b, causal=True)
    want_out, want_lse = oracle(b, 32 ** -0.5)
    assert_close(out, want_out)
    assert_close(lse, want_lse, atol=1e-4, rtol=1e-4)


def test_sinks_only_row_reports_sink_lse():
    b = make_paged_batch([2], [1], 2, 2, 16, 16)  # first query sees no key
    sinks = torch.tensor([0.7, -0.2])
    out, lse = run_paged(b, causal=True, s_aux=sinks)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert_close(lse[:, 0], sinks.double())


def test_dense_keys_for_encoder_attention():
    q_lens, k_lens, h, hk, d = [5, 1, 12], [5, 1, 12], 4, 2, 48
    q = randn(sum(q_lens), h, d)
    k, v = randn(sum(k_lens), hk, d), randn(sum(k_lens), hk, d)
    out = poison((sum(q_lens), h, d), torch.float32)
    flash_attn_varlen_func(q, k, v, max(q_lens), cu_seqlens(q_lens), max(k_lens),
                           cu_seqlens_k=cu_seqlens(k_lens), causal=False, out=out)
    want, _ = ref.varlen_attention(q, k, v, q_lens, k_lens, scale=d ** -0.5, causal=False)
    assert_close(out, want)


def test_different_value_head_size():
    b = make_paged_batch(MIXED_Q, MIXED_K, 8, 2, 192, 16, head_size_v=128, seed=3)
    out, _ = run_paged(b, softmax_scale=0.1, causal=True)
    assert out.shape[-1] == 128
    want, _ = oracle(b, 0.1)
    assert_close(out, want)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_cache_is_dequantized_with_descales(fp8):
    b = make_paged_batch(MIXED_Q, MIXED_K, 8, 2, 64, 16, torch.bfloat16, seed=4)
    k_scale, v_scale = 0.02, 0.05
    b.k_cache = ref.quantize_for_cache(b.k_cache, fp8, k_scale)
    b.v_cache = ref.quantize_for_cache(b.v_cache, fp8, v_scale)
    shape = (len(MIXED_Q), 2)
    out, _ = run_paged(b, causal=True, k_descale=torch.tensor(k_scale).expand(shape),
                       v_descale=torch.tensor(v_scale).expand(shape))
    want, _ = oracle(b, 0.125, k_scale=k_scale, v_scale=v_scale)  # same fp8 values, exact math
    assert_close(out, want, torch.bfloat16)


def test_fp8_query_with_descale():
    b = make_paged_batch([1, 4], [9, 4], 4, 2, 32, 16, torch.bfloat16, seed=5)
    q_scale = 0.01
    q8 = ref.quantize_for_cache(b.q, torch.float8_e4m3fn, q_scale)
    b.q = q8
    out, _ = run_paged(b, out_dtype=torch.bfloat16, causal=True,
                       q_descale=torch.tensor(q_scale).expand(2, 2))
    want, _ = oracle(b, 32 ** -0.5, q_scale=q_scale)
    assert out.dtype == torch.bfloat16
    assert_close(out, want, **FP8_TOLERANCE)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_query_without_out_returns_bf16_as_vllms_flash_attention_call(fp8):
    # vLLM calls FlashAttention with an fp8 query and no `out` (its cascade passes do); FA3
    # returns bf16 then, and so does this op. A given `out` sets another dtype.
    b = make_paged_batch([1, 4], [9, 4], 4, 2, 32, 16, torch.bfloat16, seed=5)
    q_scale, k_scale, v_scale = 0.01, 0.02, 0.05
    b.q = ref.quantize_for_cache(b.q, fp8, q_scale)
    b.k_cache = ref.quantize_for_cache(b.k_cache, fp8, k_scale)
    b.v_cache = ref.quantize_for_cache(b.v_cache, fp8, v_scale)
    descales = {name: torch.tensor(s).expand(2, 2) for name, s in
                (("q_descale", q_scale), ("k_descale", k_scale), ("v_descale", v_scale))}
    out = flash_attn_varlen_func(
        q=b.q, k=b.k_cache, v=b.v_cache, cu_seqlens_q=b.cu_seqlens_q,
        max_seqlen_q=b.max_seqlen_q, seqused_k=b.seqused_k, max_seqlen_k=b.max_seqlen_k,
        softmax_scale=32 ** -0.5, causal=True, window_size=[-1, -1],
        block_table=b.block_table, fa_version=3, **descales)
    want, _ = oracle(b, 32 ** -0.5, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)
    assert out.dtype == torch.bfloat16 and out.shape == (5, 4, 32)
    assert_close(out, want, torch.bfloat16)  # the oracle reads the same fp8 values
    out32, _ = run_paged(b, out_dtype=torch.float32, softmax_scale=32 ** -0.5, causal=True,
                         **descales)
    assert out32.dtype == torch.float32
    assert_close(out32, want, torch.float32)


def test_hnd_layout_equals_nhd():
    nhd = make_paged_batch(MIXED_Q, MIXED_K, 8, 2, 64, 16, seed=6)
    hnd = make_paged_batch(MIXED_Q, MIXED_K, 8, 2, 64, 16, layout="HND", seed=6)
    assert hnd.k_cache.stride(2) > hnd.k_cache.stride(1)  # really head-major in memory
    assert torch.equal(run_paged(nhd)[0], run_paged(hnd)[0])


def test_batch_equals_requests_one_by_one():
    b = make_paged_batch(MIXED_Q, MIXED_K, 8, 2, 64, 16, seed=7)
    whole, whole_lse = run_paged(b, causal=True, softcap=5.0)
    start = 0
    for r, (lq, lk) in enumerate(zip(MIXED_Q, MIXED_K)):
        one = torch.empty(lq, 8, 64)
        _, lse = flash_attn_varlen_func(
            b.q[start:start + lq], b.k_cache, b.v_cache, lq, cu_seqlens([lq]), lk,
            seqused_k=b.seqused_k[r:r + 1], block_table=b.block_table[r:r + 1], causal=True,
            softcap=5.0, out=one, return_softmax_lse=True)
        torch.testing.assert_close(one, whole[start:start + lq], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(lse, whole_lse[:, start:start + lq], atol=1e-6, rtol=1e-6)
        start += lq


def test_shuffled_blocks_equal_contiguous_blocks():
    b = make_paged_batch([3, 1], [40, 70], 4, 2, 32, 16, seed=8)
    out, _ = run_paged(b)
    # Rebuild the cache with each request's blocks laid out contiguously.
    order = torch.cat([b.block_table[r, :math.ceil(s / 16)].long()
                       for r, s in enumerate(b.seq_lens)])
    k2, v2 = b.k_cache[order].clone(), b.v_cache[order].clone()
    table = torch.zeros_like(b.block_table)
    table[0, :3] = torch.arange(3)
    table[1, :5] = torch.arange(3, 8)
    b.k_cache, b.v_cache, b.block_table = k2, v2, table
    assert torch.equal(run_paged(b)[0], out)


def test_split_count_does_not_change_the_result():
    b = make_paged_batch([1, 1, 5], [900, 33, 700], 8, 2, 64, 16, seed=9)
    auto, _ = run_paged(b)
    forced, _ = run_paged(b, num_splits=7)
    torch.testing.assert_close(forced, auto, atol=1e-5, rtol=1e-5)


# --- argument errors ----------------------------------------------------------------------
def _args(b):
    return dict(q=b.q, k=b.k_cache, v=b.v_cache, cu_seqlens_q=b.cu_seqlens_q,
                max_seqlen_q=b.max_seqlen_q, seqused_k=b.seqused_k,
                max_seqlen_k=b.max_seqlen_k, block_table=b.block_table)


@pytest.mark.parametrize("change, error, match", [
    (dict(dropout_p=0.1), ValueError, "dropout_p"),
    (dict(return_attn_probs=True), ValueError, "return_attn_probs"),
    (dict(window_size=(3,)), ValueError, "window_size"),
    (dict(window_size=(-5, 0)), ValueError, "window_size"),
    (dict(seqused_k=None), ValueError, "seqused_k"),
    (dict(num_splits=-1), ValueError, "num_splits"),
    (dict(max_seqlen_k=10_000), ValueError, "block_table has"),
    (dict(alibi_slopes=torch.ones(3)), ValueError, "alibi_slopes"),
    (dict(s_aux=torch.ones(5)), ValueError, "s_aux"),
    (dict(q_descale=torch.ones(1, 1)), ValueError, "q_descale"),
    (dict(q=torch.ones(5, 8, 64, dtype=torch.int32)), TypeError, "q has dtype"),
    # issue 24's contracts: each argument named with its value and what is allowed
    (dict(q=None), TypeError, "q must be a torch.Tensor, got None"),
    (dict(cu_seqlens_q=None), TypeError, "cu_seqlens_q must be a torch.Tensor, got None"),
    (dict(cu_seqlens_q=torch.zeros(0, dtype=torch.int32)), ValueError,
     r"cu_seqlens_q has shape \(0,\); it needs batch \+ 1 >= 1 entries"),
    (dict(v="cache"), TypeError, "v must be a torch.Tensor, got str"),
    (dict(max_seqlen_q=-1), ValueError, "max_seqlen_q=-1 must be >= 0"),
    (dict(max_seqlen_k="9"), TypeError, "max_seqlen_k='9' must be an int"),
    (dict(softcap=-1.0), ValueError, "softcap=-1.0 must be >= 0"),
    (dict(softmax_scale="x"), TypeError, "softmax_scale='x' must be a number"),
    (dict(num_splits=1.5), TypeError, "num_splits=1.5 must be an int"),
    (dict(out=torch.empty(5, 8, 32)), ValueError, r"out has shape \(5, 8, 32\); expected "
     r"\(5, 8, 64\)"),
])
def test_bad_arguments_raise_clear_errors(change, error, match):
    b = make_paged_batch([1, 4], [9, 4], 8, 2, 64, 16)
    args = _args(b)
    args.update(change)
    with pytest.raises(error, match=match):
        flash_attn_varlen_func(**args)


def test_heads_not_divisible_is_rejected():
    b = make_paged_batch([1], [3], 6, 4, 32, 16)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        flash_attn_varlen_func(**_args(b))


def test_block_table_must_be_int32():
    b = make_paged_batch([1], [3], 2, 2, 32, 16)
    args = _args(b)
    args["block_table"] = b.block_table.long()
    with pytest.raises(TypeError, match="block_table has dtype"):
        flash_attn_varlen_func(**args)


def test_keys_and_values_share_a_dtype():
    b = make_paged_batch([1, 4], [9, 4], 8, 2, 64, 16)
    args = _args(b)
    args["v"] = b.v_cache.half()
    with pytest.raises(TypeError, match="k has dtype torch.float32 but v torch.float16"):
        flash_attn_varlen_func(**args)


def test_keys_and_values_share_blocks_and_heads():
    b = make_paged_batch([1, 4], [9, 4], 8, 2, 64, 16)
    args = _args(b)
    args["k"] = b.k_cache[:, :, :1]
    with pytest.raises(ValueError, match=r"k \(5, 16, 1, 64\) and v \(5, 16, 2, 64\) differ "
                                         "beyond head size"):
        flash_attn_varlen_func(**args)
