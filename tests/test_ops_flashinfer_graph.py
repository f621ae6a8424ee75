"""The paged wrappers in FlashInfer's CUDA-graph mode (`use_cuda_graph=True`): plan() copies
each batch into the caller's fixed buffers, one run() serves any batch of at most the
captured size, and batches beyond the buffers are refused. On a CPU the run is eager over the
same buffers (what a replay reads); the GPU test captures and replays."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_close
from pagedattn.ops import BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper
from test_ops_flashinfer import make_batch, oracle

WORKSPACE = torch.empty(0, dtype=torch.uint8)
HEADS, DIM, PAGE = (4, 2), 16, 16
DECODE_BATCHES = [[5, 40, 17, 3], [100, 1], [33, 64, 2, 120], [7]]  # keys per request
PREFILL_BATCHES = [([3, 1, 12], [40, 1, 12]), ([16], [100]), ([1, 1, 1, 1], [9, 2, 30, 64]),
                   ([5, 4], [5, 70])]


def buffers(batch, pages=64, qo=False, device="cpu"):
    int32 = dict(dtype=torch.int32, device=device)
    bufs = [torch.zeros(batch + 1, **int32), torch.zeros(pages, **int32),
            torch.zeros(batch, **int32)]
    return bufs + [torch.zeros(batch + 1, **int32)] if qo else bufs


def decode_wrapper(bufs, device="cpu", **kw):
    return BatchDecodeWithPagedKVCacheWrapper(
        WORKSPACE.to(device), "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=bufs[0],
        paged_kv_indices_buffer=bufs[1], paged_kv_last_page_len_buffer=bufs[2], **kw)


def prefill_wrapper(bufs, device="cpu", **kw):
    return BatchPrefillWithPagedKVCacheWrapper(
        WORKSPACE.to(device), "NHD", use_cuda_graph=True, qo_indptr_buf=bufs[3],
        paged_kv_indptr_buf=bufs[0], paged_kv_indices_buf=bufs[1],
        paged_kv_last_page_len_buf=bufs[2], **kw)


def plan(w, b, decode, **kw):
    shape = (HEADS[0], HEADS[1], DIM, PAGE)
    if decode:
        w.plan(b.indptr, b.indices, b.last_page_len, *shape, q_data_type=b.q.dtype, **kw)
    else:
        w.plan(b.qo_indptr, b.indptr, b.indices, b.last_page_len, *shape, causal=True,
               q_data_type=b.q.dtype, **kw)


@pytest.mark.parametrize("provider", ["torch", "triton"])
@pytest.mark.parametrize("decode", [True, False])
def test_plans_copy_into_the_callers_buffers_and_one_run_serves_every_batch(
        provider, decode, monkeypatch):
    monkeypatch.setenv("PAGEDATTN_OPS_PROVIDER", provider)
    bufs = buffers(4, qo=not decode)
    w = (decode_wrapper if decode else prefill_wrapper)(bufs, max_kv_len=128)
    assert w.is_cuda_graph_enabled
    batches = [([1] * len(k), k) for k in DECODE_BATCHES] if decode else PREFILL_BATCHES
    rows = 4 if decode else 16  # the decode batch size; the first prefill plan's rows
    q = torch.zeros(rows, HEADS[0], DIM)
    out = torch.full((rows, HEADS[0], DIM), float("nan"))
    for i, (query_lens, kv_lens) in enumerate(batches):
        b = make_batch(query_lens, kv_lens, heads=HEADS, head_dim=DIM, seed=i)
        plan(w, b, decode, window_left=50, logits_soft_cap=4.0)
        n, r = sum(query_lens), len(kv_lens)
        q[:n] = b.q
        w.run(q, b.cache, out=out)  # the same q and out every time, as in a graph
        want, _ = oracle(b, causal=True, window=(50, -1), softcap=4.0)
        assert_close(out[:n], want, atol=2e-4, rtol=1e-4)
        assert bufs[0][:r + 1].tolist() == b.indptr.tolist()
        assert bufs[0][r + 1:].tolist() == [b.indptr[-1]] * (4 - r)  # empty padded requests
        assert bufs[1][:b.indices.shape[0]].tolist() == b.indices.tolist()
        assert bufs[2][:r].tolist() == b.last_page_len.tolist()
        if not decode:
            assert bufs[3][:r + 1].tolist() == b.qo_indptr.tolist()


def test_lse_and_fp8_caches_in_graph_mode():
    bufs = buffers(2)
    w = decode_wrapper(bufs)
    b = make_batch([1, 1], [30, 9], heads=HEADS, head_dim=DIM, dtype=torch.bfloat16,
                   cache_dtype=torch.float8_e4m3fn)
    plan(w, b, True, kv_data_type=torch.float8_e4m3fn)
    out, lse = w.run(b.q, b.cache, k_scale=0.5, v_scale=2.0, return_lse=True)
    want, want_lse = oracle(b, causal=True, k_scale=0.5, v_scale=2.0)
    assert_close(out, want, atol=0.15, rtol=0.1)
    assert_close(lse, want_lse, atol=0.15, rtol=0.1)


def test_batches_beyond_the_buffers_are_refused():
    b = make_batch([1] * 3, [5, 5, 5], heads=HEADS, head_dim=DIM)
    with pytest.raises(ValueError, match="exceeds the batch size of the cudagraph buffers"):
        plan(decode_wrapper(buffers(2)), b, True)
    with pytest.raises(ValueError, match="size of indices"):
        plan(decode_wrapper(buffers(4, pages=2)), b, True)
    w = decode_wrapper(buffers(4), max_kv_len=32)
    with pytest.raises(ValueError, match="raise max_kv_len"):
        plan(w, make_batch([1], [33], heads=HEADS, head_dim=DIM), True)
    w = prefill_wrapper(buffers(4, qo=True))
    b = make_batch([4, 4], [8, 8], heads=HEADS, head_dim=DIM)
    plan(w, b, False)  # latches 8 rows
    with pytest.raises(ValueError, match="total number of rows in qo_indptr 9"):
        plan(w, make_batch([9], [9], heads=HEADS, head_dim=DIM), False)
    with pytest.raises(ValueError, match=r"q has shape \(2, 4, 16\)"):  # rows are 8 now
        w.run(torch.zeros(2, HEADS[0], DIM), b.cache)


@pytest.mark.parametrize("kwargs, match", [
    (dict(paged_kv_indptr_buffer=None), "paged_kv_indptr_buffer should be a torch.Tensor"),
    (dict(paged_kv_indices_buffer=torch.zeros(8)), "paged_kv_indices_buffer must be a 1-D int32"),
    (dict(paged_kv_last_page_len_buffer=torch.zeros(5, dtype=torch.int32)),
     "should be batch_size \\+ 1"),
    (dict(max_kv_len=0), "max_kv_len=0"),
    (dict(backend="trtllm-gen"), "backend='trtllm-gen' is not supported"),
])
def test_graph_mode_construction_errors_name_the_argument(kwargs, match):
    bufs = dict(zip(("paged_kv_indptr_buffer", "paged_kv_indices_buffer",
                     "paged_kv_last_page_len_buffer"), buffers(4)))
    with pytest.raises(ValueError, match=match):
        BatchDecodeWithPagedKVCacheWrapper(WORKSPACE, "NHD", True, **{**bufs, **kwargs})


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("decode", [True, False])
def test_gpu_captured_run_replays_four_new_batches_against_the_oracle(decode):
    device = torch.device("cuda")
    bufs = buffers(4, pages=256, qo=not decode, device=device)
    w = (decode_wrapper if decode else prefill_wrapper)(bufs, device, max_kv_len=2048)
    batches = [([1] * len(k), k) for k in ([100, 2000, 7, 512], [1, 64], [1500, 3, 40, 900],
                                            [33])] if decode else \
        [([64], [64]), ([3, 1, 40, 20], [700, 1, 40, 1200]), ([1, 1], [5, 2048]),
         ([30, 30], [30, 500])]
    rows = 4 if decode else 64
    first = make_batch(*batches[0], heads=(32, 8), head_dim=128, dtype=torch.bfloat16,
                       seed=9)
    shape = (32, 8, 128, PAGE)

    def replan(b):
        if decode:
            w.plan(b.indptr, b.indices, b.last_page_len, *shape, q_data_type=torch.bfloat16)
        else:
            w.plan(b.qo_indptr, b.indptr, b.indices, b.last_page_len, *shape, causal=True,
                   q_data_type=torch.bfloat16)

    replan(first)
    cache = torch.zeros(300, 2, PAGE, 8, 128, dtype=torch.bfloat16, device=device)
    q = torch.zeros(rows, 32, 128, dtype=torch.bfloat16, device=device)
    w.run(q, cache)  # warm up: compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = w.run(q, cache)
    for i, (query_lens, kv_lens) in enumerate(batches):
        b = make_batch(query_lens, kv_lens, heads=(32, 8), head_dim=128, dtype=torch.bfloat16,
                       seed=i)
        cache[:b.cache.shape[0]].copy_(b.cache.nan_to_num(0))
        b.k, b.v = b.cache[:, 0].nan_to_num(0), b.cache[:, 1].nan_to_num(0)
        replan(b)
        q.zero_()
        q[:sum(query_lens)] = b.q.to(device)
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out[:sum(query_lens)], oracle(b, causal=True)[0], torch.bfloat16)


def test_cascade_wrapper_in_graph_mode_equals_its_eager_result():
    from pagedattn.ops import MultiLevelCascadeAttentionWrapper

    pages = [[0, 1, 5], [0, 1, 2, 7], [0, 1, 3]]  # two shared pages, then each request's own
    b = make_batch([1, 4, 2], [40, 60, 37], heads=HEADS, head_dim=DIM, pages=pages)
    shared = [torch.tensor([0, 7], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32),
              torch.tensor([0, 1], dtype=torch.int32), torch.tensor([PAGE], dtype=torch.int32)]
    own_pages = [p[2:] for p in pages]
    own = [b.qo_indptr, torch.tensor([0, 1, 3, 4], dtype=torch.int32),
           torch.tensor(sum(own_pages, []), dtype=torch.int32), b.last_page_len]
    bufs = [buffers(1, qo=True), buffers(4, qo=True)]
    arrs = [[lvl[i] for lvl in bufs] for i in (3, 0, 1, 2)]  # qo, indptr, indices, last
    w = MultiLevelCascadeAttentionWrapper(2, WORKSPACE, "NHD", True, *arrs)
    assert w.is_cuda_graph_enabled
    w.plan(*[[s, o] for s, o in zip(shared, own)], HEADS[0], HEADS[1], DIM, PAGE, causal=True,
           q_data_type=torch.float32)
    assert_close(w.run(b.q, b.cache), oracle(b, causal=True)[0])
    with pytest.raises(ValueError, match="four \\*_buf_arr lists"):
        MultiLevelCascadeAttentionWrapper(2, WORKSPACE, "NHD", True, arrs[0])
