"""The FlashInfer-style wrappers (pagedattn.ops.flashinfer) against the float64 oracle.

Caches are FlashInfer's (num_pages, 2, ...) tensors (or tuples) with scattered pages; every
slot outside a request's valid tokens holds NaN, so reading one would poison the output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

import reference as ref
from conftest import FP8_TOLERANCE, TOLERANCE, assert_close, poison
from pagedattn.ops import (
    BatchDecodeWithPagedKVCacheWrapper,
    BatchPrefillWithPagedKVCacheWrapper,
    MultiLevelCascadeAttentionWrapper,
)
from pagedattn.ops.flashinfer import merge_state

LOG2E = 1 / math.log(2)
WORKSPACE = torch.empty(0, dtype=torch.uint8)


@dataclass
class Batch:
    q: torch.Tensor  # [total_q, H, D]
    cache: torch.Tensor  # (num_pages, 2, page_size, Hkv, D) NHD / (num_pages, 2, Hkv, ps, D) HND
    k: torch.Tensor  # logical [num_pages, page_size, Hkv, D] views, for the oracle
    v: torch.Tensor
    qo_indptr: torch.Tensor
    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor
    table: torch.Tensor  # [batch, max_pages] for the oracle
    query_lens: list
    kv_lens: list


def make_batch(query_lens, kv_lens, heads=(4, 2), head_dim=16, page_size=16, layout="NHD",
               dtype=torch.float32, cache_dtype=None, seed=0, spare=3, pages=None) -> Batch:
    """Random batch; `pages` (page ids per request, shared ids allowed) defaults to scattered
    distinct pages. Only valid tokens get values; every other slot stays NaN."""
    g = torch.Generator().manual_seed(seed)
    h, hkv = heads
    if pages is None:
        counts = [math.ceil(n / page_size) for n in kv_lens]
        perm = torch.randperm(sum(counts) + spare, generator=g).tolist()
        pages = [perm[sum(counts[:r]):sum(counts[:r + 1])] for r in range(len(counts))]
    num_pages = max([max(p, default=-1) for p in pages]) + 1 + spare
    cache = poison((num_pages, 2, page_size, hkv, head_dim), torch.float32)
    for p, n in zip(pages, kv_lens):
        for j in range(n):
            slot = cache[p[j // page_size], :, j % page_size]
            if slot.isnan().any():  # a shared page is filled once
                slot.copy_(torch.randn(2, hkv, head_dim, generator=g))
    cache = cache.to(cache_dtype or dtype)
    if layout == "HND":
        cache = cache.transpose(2, 3).contiguous()
    logical = cache if layout == "NHD" else cache.transpose(2, 3)
    table = torch.zeros(len(pages), max(map(len, pages), default=1) or 1, dtype=torch.int32)
    for r, p in enumerate(pages):
        table[r, :len(p)] = torch.tensor(p, dtype=torch.int32)
    return Batch(
        q=torch.randn(sum(query_lens), h, head_dim, generator=g).to(dtype), cache=cache,
        k=logical[:, 0], v=logical[:, 1], qo_indptr=indptr_of(query_lens),
        indptr=indptr_of(map(len, pages)), indices=torch.tensor(sum(pages, []), dtype=torch.int32),
        last_page_len=torch.tensor([(n - 1) % page_size + 1 for n in kv_lens],
                                   dtype=torch.int32),
        table=table, query_lens=list(query_lens), kv_lens=list(kv_lens))


def indptr_of(lens) -> torch.Tensor:
    return torch.tensor([0, *lens]).cumsum(0).to(torch.int32)


def oracle(b: Batch, scale=None, k_scale=1.0, v_scale=1.0, **features):
    out, lse = ref.paged_attention(b.q, b.k, b.v, b.query_lens, b.kv_lens, b.table,
                                   scale=scale or b.q.shape[-1] ** -0.5, k_scale=k_scale,
                                   v_scale=v_scale, **features)
    return out, lse.T * LOG2E  # FlashInfer's LSE: base 2, [total_q, heads]


def plan_prefill(b: Batch, causal=True, **kw) -> BatchPrefillWithPagedKVCacheWrapper:
    w = BatchPrefillWithPagedKVCacheWrapper(WORKSPACE, kw.pop("kv_layout", "NHD"))
    w.plan(b.qo_indptr, b.indptr, b.indices, b.last_page_len, b.q.shape[1], b.k.shape[2],
           b.q.shape[2], b.k.shape[1], causal=causal, q_data_type=b.q.dtype, **kw)
    return w


def plan_decode(b: Batch, **kw) -> BatchDecodeWithPagedKVCacheWrapper:
    w = BatchDecodeWithPagedKVCacheWrapper(WORKSPACE, kw.pop("kv_layout", "NHD"))
    w.plan(b.indptr, b.indices, b.last_page_len, b.q.shape[1], b.k.shape[2], b.q.shape[2],
           b.k.shape[1], q_data_type=b.q.dtype, **kw)
    return w


# --- decode and prefill ---------------------------------------------------------------------
@pytest.mark.parametrize("page_size", [1, 5, 16])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_decode_with_lse_in_base_2(page_size, layout):
    b = make_batch([1] * 4, [1, 9, 33, 16], heads=(8, 2), page_size=page_size, layout=layout)
    w = plan_decode(b, kv_layout=layout)
    out, lse = w.run(b.q, b.cache, out=poison(b.q.shape, b.q.dtype), return_lse=True)
    want, want_lse = oracle(b, causal=True)
    assert_close(out, want)
    assert_close(lse, want_lse)


@pytest.mark.parametrize("page_size", [1, 5, 16])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_with_cached_context(page_size, layout, dtype):
    b = make_batch([7, 1, 20, 3], [30, 1, 20, 18], page_size=page_size, layout=layout,
                   dtype=dtype)
    out, lse = plan_prefill(b, kv_layout=layout).run(b.q, b.cache, return_lse=True)
    want, want_lse = oracle(b, causal=True)
    assert_close(out, want, dtype)
    assert_close(lse, want_lse, dtype)


def test_non_causal_with_more_queries_than_keys():
    b = make_batch([12, 5], [4, 9], page_size=5)
    out = plan_prefill(b, causal=False).run(b.q, b.cache, out=poison(b.q.shape, b.q.dtype))
    assert_close(out, oracle(b, causal=False)[0])


@pytest.mark.parametrize("provider", ["torch", "triton"])
@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn])
def test_plan_makes_every_launch_and_run_only_launches(provider, cache_dtype, monkeypatch):
    """One plan(), then runs with and without sinks, an LSE and scales: none plans again."""
    from pagedattn.ops.flashinfer import plan as planning

    monkeypatch.setenv("PAGEDATTN_OPS_PROVIDER", provider)  # triton: interpreted on a CPU
    b = make_batch([3, 1, 5], [20, 7, 9], heads=(8, 2), cache_dtype=cache_dtype)
    w = plan_prefill(b, kv_data_type=b.cache.dtype)
    made = planning.plan_varlen_attention
    monkeypatch.setattr(planning, "plan_varlen_attention",
                        lambda **kw: pytest.fail("run() planned a launch"))
    sinks = torch.linspace(-1, 1, 8)
    scales = dict(k_scale=0.5, v_scale=2.0) if cache_dtype else {}
    for extra in ({}, dict(sinks=sinks), dict(return_lse=True), dict(sinks=sinks, return_lse=True)):
        res = w.run(b.q, b.cache, **extra, **scales)
        out, lse = res if extra.get("return_lse") else (res, None)
        want, want_lse = oracle(b, causal=True, k_scale=scales.get("k_scale", 1.0),
                                v_scale=scales.get("v_scale", 1.0),
                                sinks=sinks.tolist() if "sinks" in extra else None)
        tolerance = FP8_TOLERANCE if cache_dtype else {}
        assert_close(out, want, **tolerance)
        if lse is not None:
            assert_close(lse, want_lse, **tolerance)
    assert made is not planning.plan_varlen_attention  # (the stand-in was in place)


def test_scales_of_a_16_bit_cache_scale_scores_and_output():
    b = make_batch([3, 1], [20, 7])
    out = plan_prefill(b).run(b.q, b.cache, k_scale=0.5, v_scale=2.0)
    assert_close(out, oracle(b, causal=True, k_scale=0.5, v_scale=2.0)[0])


@pytest.mark.parametrize("wrapper", ["decode", "prefill"])
def test_soft_cap_window_and_sinks(wrapper):
    b = make_batch([1, 1, 1] if wrapper == "decode" else [6, 1, 10], [25, 3, 40])
    sinks = torch.linspace(-1, 1, 4)
    plan = plan_decode if wrapper == "decode" else plan_prefill
    w = plan(b, window_left=7, logits_soft_cap=3.0, sm_scale=0.3)
    out, lse = w.run(b.q, b.cache, sinks=sinks, return_lse=True)
    want, want_lse = oracle(b, scale=0.3, causal=True, window=(7, -1), softcap=3.0,
                            sinks=sinks.tolist())
    assert_close(out, want)
    assert_close(lse, want_lse)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_cache_with_host_scales(cache_dtype):
    b = make_batch([1, 5], [20, 11], dtype=torch.bfloat16, cache_dtype=cache_dtype)
    w = plan_prefill(b, kv_data_type=cache_dtype)
    out = w.run(b.q, b.cache, k_scale=0.5, v_scale=2.0)
    assert_close(out, oracle(b, causal=True, k_scale=0.5, v_scale=2.0)[0], **FP8_TOLERANCE)


def test_tuple_and_non_contiguous_caches():
    b = make_batch([3, 1], [17, 6], page_size=5)
    wide = torch.full((b.cache.shape[0] * 2, 2, 5, 2, 24), float("nan"))
    wide[::2, ..., :16] = b.cache  # every other page, and a wider head dim: strided views
    cache = wide[::2, ..., :16]
    assert not cache.is_contiguous()
    w = plan_prefill(b)
    want = oracle(b, causal=True)[0]
    assert_close(w.run(b.q, cache), want)
    assert_close(w.run(b.q, (cache[:, 0], cache[:, 1])), want)


def test_triton_provider_runs_the_same_plan(monkeypatch):
    monkeypatch.setenv("PAGEDATTN_OPS_PROVIDER", "triton")
    b = make_batch([1, 9], [12, 14], page_size=5, layout="HND")
    w = plan_prefill(b, kv_layout="HND", logits_soft_cap=5.0)
    out, lse = w.run(b.q, b.cache, return_lse=True)
    want, want_lse = oracle(b, causal=True, softcap=5.0)
    assert_close(out, want, atol=2e-4, rtol=1e-4)  # the interpreter's dots: tf32-free fp32
    assert_close(lse, want_lse, atol=2e-4, rtol=1e-4)


def test_one_plan_serves_every_layer_and_replanning_replaces_it():
    pages = [[3], [0, 4]]
    a = make_batch([4, 1], [9, 30], seed=1, pages=pages)
    other_layer = make_batch([4, 1], [9, 30], seed=2, pages=pages)  # same pages, new values
    w = plan_prefill(a)
    assert_close(w.run(a.q, a.cache), oracle(a, causal=True)[0])
    assert_close(w.run(other_layer.q, other_layer.cache), oracle(other_layer, causal=True)[0])
    b = make_batch([2, 2, 2], [3, 40, 7], seed=3)
    w.plan(b.qo_indptr, b.indptr, b.indices, b.last_page_len, 4, 2, 16, 16, causal=True,
           q_data_type=torch.float32)
    assert_close(w.run(b.q, b.cache), oracle(b, causal=True)[0])
    with pytest.raises(ValueError, match="q has shape"):
        w.run(a.q, a.cache)  # the old batch no longer fits the plan


# --- cascade ----------------------------------------------------------------------------------
@pytest.mark.parametrize("levels", [2, 3])
def test_cascade_equals_attention_over_the_whole_sequences(levels):
    """Level 0: every query over 2 pages all requests share; (3 levels) level 1: requests 0-1
    and 2-3 share one page each; last level: each request's own pages, causal."""
    ps, query_lens, own = 4, [1, 3, 1, 2], [5, 3, 9, 2]
    mid = [[2], [2], [3], [3]] if levels == 3 else [[]] * 4
    own_pages = [[4, 5], [6], [7, 8, 9], [10]]
    pages = [[0, 1] + m + o for m, o in zip(mid, own_pages)]
    seq_lens = [(2 + len(m)) * ps + n for m, n in zip(mid, own)]
    b = make_batch(query_lens, seq_lens, page_size=ps, seed=5, pages=pages)
    total = sum(query_lens)
    qo, kv_ptr, kv_ids = [indptr_of([total])], [indptr_of([2])], [torch.tensor([0, 1]).int()]
    last = [torch.tensor([ps]).int()]
    if levels == 3:
        qo.append(indptr_of([4, total - 4]))
        kv_ptr.append(indptr_of([1, 1]))
        kv_ids.append(torch.tensor([2, 3]).int())
        last.append(torch.tensor([ps, ps]).int())
    qo.append(b.qo_indptr)
    kv_ptr.append(indptr_of(map(len, own_pages)))
    kv_ids.append(torch.tensor(sum(own_pages, [])).int())
    last.append(b.last_page_len)
    w = MultiLevelCascadeAttentionWrapper(levels, WORKSPACE)
    w.plan(qo, kv_ptr, kv_ids, last, 4, 2, 16, ps, causal=True, logits_soft_cap=6.0,
           q_data_type=torch.float32)
    sinks = torch.full((4,), 0.3)
    out, lse = w.run(b.q, b.cache, out=poison(b.q.shape, b.q.dtype), return_lse=True,
                     sinks=sinks)
    want, want_lse = oracle(b, causal=True, softcap=6.0, sinks=sinks.tolist())
    assert_close(out, want)
    assert_close(lse, want_lse)


def test_merge_state_uses_base_2_lse():
    g = torch.Generator().manual_seed(0)
    va, vb = torch.randn(5, 3, 8, generator=g), torch.randn(5, 3, 8, generator=g)
    sa, sb = torch.randn(5, 3, generator=g) * 3, torch.randn(5, 3, generator=g) * 3
    v, s = merge_state(va, sa, vb, sb)
    want, want_lse = ref.merge_states(va, (sa / LOG2E).T, vb, (sb / LOG2E).T)
    assert_close(v, want)
    assert_close(s, want_lse.T * LOG2E)


# --- errors -------------------------------------------------------------------------------
def test_run_before_plan_raises():
    b = make_batch([1], [4])
    with pytest.raises(RuntimeError, match="before plan"):
        BatchDecodeWithPagedKVCacheWrapper(WORKSPACE).run(b.q, b.cache)


def test_q_and_cache_that_differ_from_the_plan_are_refused():
    b = make_batch([2, 3], [5, 8])
    w = plan_prefill(b)
    for q, what in ((b.q[:, :2], "q has shape"), (b.q[..., :8], "q has shape"),
                    (b.q[:4], "q has shape"), (b.q.half(), "q is torch.float16")):
        with pytest.raises(ValueError, match=what):
            w.run(q, b.cache)
    with pytest.raises(ValueError, match="plan expects"):
        w.run(b.q, b.cache.transpose(2, 3))  # an HND cache given to an NHD plan
    with pytest.raises(ValueError, match="the cache has 1 pages"):
        w.run(b.q, b.cache[:1])
    with pytest.raises(ValueError, match="paged_kv_cache must be"):
        w.run(b.q, b.cache[:, :1])
    with pytest.raises(ValueError, match="paged_kv_cache is on meta"):
        w.run(b.q, b.cache.to("meta"))


def test_views_remembered_for_a_cache_are_checked_again_after_replanning():
    b = make_batch([2, 3], [5, 8], spare=0)
    w = plan_prefill(b)
    small = b.cache[:b.indices.max() + 1]
    w.run(b.q, small)  # remembered for this plan
    far = make_batch([2, 3], [5, 8], pages=[[0], [small.shape[0]]])
    w.plan(far.qo_indptr, far.indptr, far.indices, far.last_page_len, 4, 2, 16, 16,
           causal=True, q_data_type=torch.float32)
    with pytest.raises(ValueError, match=f"reads page {small.shape[0]} but the cache has"):
        w.run(b.q, small)


@pytest.mark.parametrize("change, match", [
    (dict(last_page_len=torch.tensor([0, 3], dtype=torch.int32)), "last_page_len\\[0\\]=0"),
    (dict(last_page_len=torch.tensor([17, 3], dtype=torch.int32)), "1..page_size=16"),
    (dict(qo_indptr=torch.tensor([0, 4, 2], dtype=torch.int32)), "never decrease"),
    (dict(qo_indptr=torch.tensor([0, 2], dtype=torch.int32)), "expected 3"),
    (dict(indptr=torch.tensor([0, 1, 9], dtype=torch.int32)), "paged_kv_indptr="),
    (dict(indices=torch.tensor([-1, 2], dtype=torch.int32)), "negative page ids"),
    (dict(pos_encoding_mode="ROPE_LLAMA"), "pos_encoding_mode='ROPE_LLAMA'"),
    (dict(window_left=-2), "window_left=-2"),
    (dict(logits_soft_cap=-1.0), "logits_soft_cap=-1.0"),
    (dict(q_data_type="int8"), "q_data_type='int8'"),
    (dict(custom_mask=torch.ones(4, dtype=torch.bool)), "custom_mask"),
    (dict(num_kv_heads=3), "multiple of num_kv_heads=3"),
])
def test_plan_errors_name_the_argument(change, match):
    b = make_batch([2, 3], [5, 8])
    args = dict(qo_indptr=b.qo_indptr, indptr=b.indptr, indices=b.indices,
                last_page_len=b.last_page_len, num_kv_heads=2)
    kw = dict(causal=True, q_data_type=torch.float32)
    for k, v in change.items():
        (args if k in args else kw)[k] = v
    w = BatchPrefillWithPagedKVCacheWrapper(WORKSPACE)
    with pytest.raises(ValueError, match=match):
        w.plan(args["qo_indptr"], args["indptr"], args["indices"], args["last_page_len"], 4,
               args["num_kv_heads"], 16, 16, **kw)


def test_wrapper_construction_and_cascade_errors():
    with pytest.raises(ValueError, match="kv_layout='NDH'"):
        BatchDecodeWithPagedKVCacheWrapper(WORKSPACE, "NDH")
    with pytest.raises(TypeError, match="float_workspace_buffer"):
        BatchPrefillWithPagedKVCacheWrapper(None)
    with pytest.raises(ValueError, match="num_levels=0"):
        MultiLevelCascadeAttentionWrapper(0, WORKSPACE)
    b = make_batch([2], [5])
    w = MultiLevelCascadeAttentionWrapper(2, WORKSPACE)
    with pytest.raises(ValueError, match="qo_indptr_arr must be a list of num_levels=2"):
        w.plan([b.qo_indptr], [b.indptr], [b.indices], [b.last_page_len], 4, 2, 16, 16)
    with pytest.raises(ValueError, match="same queries"):
        w.plan([b.qo_indptr, torch.tensor([0, 3], dtype=torch.int32)], [b.indptr] * 2,
               [b.indices] * 2, [b.last_page_len] * 2, 4, 2, 16, 16,
               q_data_type=torch.float32)
    with pytest.raises(RuntimeError, match="before plan"):
        w.run(b.q, b.cache)


# --- GPU sizes --------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_gpu_sizes_against_the_oracle(layout):
    dev = torch.device("cuda")
    b = make_batch([1] * 6 + [300, 77], [4000, 1, 17, 900, 2048, 33, 1200, 77], heads=(32, 8),
                   head_dim=128, page_size=16, layout=layout, dtype=torch.bfloat16)
    want, want_lse = oracle(b, causal=True)
    ws = torch.empty(1, dtype=torch.uint8, device=dev)
    w = BatchPrefillWithPagedKVCacheWrapper(ws, layout)
    w.plan(b.qo_indptr, b.indptr, b.indices, b.last_page_len, 32, 8, 128, 16, causal=True,
           q_data_type=torch.bfloat16)
    out, lse = w.run(b.q.to(dev), b.cache.to(dev), out=poison(b.q.shape, b.q.dtype, dev),
                     return_lse=True)
    assert_close(out, want, torch.bfloat16)
    assert_close(lse, want_lse, torch.bfloat16)
    d = BatchDecodeWithPagedKVCacheWrapper(ws, layout, use_tensor_cores=True)
    d.plan(b.indptr[:7], b.indices, b.last_page_len[:6], 32, 8, 128, 16,
           q_data_type=torch.bfloat16)
    out = d.run(b.q[:6].to(dev), b.cache.to(dev))
    assert_close(out, want[:6], torch.bfloat16, **TOLERANCE[torch.bfloat16])
