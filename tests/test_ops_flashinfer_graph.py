"""The paged wrappers in FlashInfer's CUDA-graph mode (`use_cuda_graph=True`): plan() copies
each batch into the caller's fixed buffers, run() takes q with the planned batch's rows (or
the buffers' capacity), one captured run() serves any later batch of at most its size, and
batches beyond the buffers are refused. On a CPU the run is eager over the same buffers (what
a replay reads); the GPU tests capture and replay."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_close, poison
from pagedattn.ops import (
    BatchDecodeWithPagedKVCacheWrapper,
    BatchPrefillWithPagedKVCacheWrapper,
    MultiLevelCascadeAttentionWrapper,
)
from pagedattn.ops.flashinfer.run import buffer_rows
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


@pytest.mark.parametrize("provider", ["torch", "triton"])
@pytest.mark.parametrize("decode", [True, False])
def test_run_takes_the_planned_batchs_rows_after_any_replan(provider, decode, monkeypatch):
    """FlashInfer's run() contract: q, out and lse have the current plan's qo_indptr[-1] rows,
    fewer than the first plan's (prefill) or the buffers' batch size (decode)."""
    monkeypatch.setenv("PAGEDATTN_OPS_PROVIDER", provider)
    w = (decode_wrapper if decode else prefill_wrapper)(buffers(4, qo=not decode),
                                                        max_kv_len=128)
    batches = [([1] * len(k), k) for k in DECODE_BATCHES] if decode else PREFILL_BATCHES
    for i, (query_lens, kv_lens) in enumerate(batches):
        b = make_batch(query_lens, kv_lens, heads=HEADS, head_dim=DIM, seed=i)
        plan(w, b, decode, window_left=50)
        out = poison(b.q.shape, b.q.dtype)
        got, lse = w.run(b.q, b.cache, out=out, return_lse=True)
        want, want_lse = oracle(b, causal=True, window=(50, -1))
        assert got is out and lse.shape == (sum(query_lens), HEADS[0])
        assert_close(out, want, atol=2e-4, rtol=1e-4)
        assert_close(lse, want_lse, atol=2e-4, rtol=1e-4)


def test_q_rows_of_neither_the_plan_nor_the_buffers_are_refused():
    w = prefill_wrapper(buffers(4, qo=True))
    plan(w, make_batch([8, 8], [8, 20], heads=HEADS, head_dim=DIM), False)  # latches 16
    b = make_batch([3, 2], [5, 9], heads=HEADS, head_dim=DIM, seed=1)
    plan(w, b, False)
    for rows in (4, 6, 15):
        with pytest.raises(ValueError, match=rf"q has shape \({rows}, 4, 16\); the plan "
                           r"expects .* = \[5, 4, 16\] or, CUDA-graph mode, the buffers' "
                           r"\[16, \.\.\.\]"):
            w.run(torch.zeros(rows, HEADS[0], DIM), b.cache)
    with pytest.raises(ValueError, match=r"out is .* \(16, 4, 16\).* expected .*\(5, 4, 16\)"):
        w.run(b.q, b.cache, out=torch.zeros(16, HEADS[0], DIM))  # out's rows follow q's
    with pytest.raises(ValueError, match=r"lse is .* \(16, 4\); expected .* \[5, 4\]"):
        w.run(b.q, b.cache, return_lse=True, lse=torch.zeros(16, HEADS[0]))
    q = torch.zeros(16, HEADS[0], DIM)  # the buffers' rows: a fixed q, as a captured graph's
    q[:5] = b.q
    out = poison(q.shape, q.dtype)
    w.run(q, b.cache, out=out)
    assert_close(out[:5], oracle(b, causal=True)[0])  # rows past the batch: no result


def test_views_of_fixed_buffers_run_the_capacitys_launch_over_the_buffers(monkeypatch):
    """FlashInfer's CUDA-graph callers cut fixed q/out buffers to each plan's rows. Such views
    run the capacity's launch over the whole buffers (a graph captured on them replays any
    batch up to the latch, as FlashInfer's does), reading and writing only the planned rows."""
    monkeypatch.setenv("PAGEDATTN_OPS_PROVIDER", "triton")
    w = prefill_wrapper(buffers(4, pages=200, qo=True), max_kv_len=2048)  # keys split, too
    plan(w, make_batch([8, 8], [8, 20], heads=HEADS, head_dim=DIM), False)  # latches 16
    q_buf, out_buf = torch.zeros(16, HEADS[0], DIM), torch.zeros(16, HEADS[0], DIM)
    for i, (query_lens, kv_lens) in enumerate([([3, 2], [5, 9]), ([1, 1, 1], [30, 2, 7]),
                                               ([1, 1, 1, 9], [2, 700, 1000, 600])]):
        b = make_batch(query_lens, kv_lens, heads=HEADS, head_dim=DIM, seed=i)
        plan(w, b, False)
        n = sum(query_lens)
        q_buf[:n] = b.q
        out_buf.fill_(float("nan"))
        w.run(q_buf[:n], b.cache, out=out_buf[:n])
        assert_close(out_buf[:n], oracle(b, causal=True)[0], atol=2e-4, rtol=1e-4)
        assert out_buf[n:].isnan().all()  # the Triton kernels write the planned rows only
    assert w.planned().launch.plan.q_shape[0] == 16  # the capacity's launch, whatever the rows


def test_buffer_rows_widens_views_within_their_storage_only():
    buf = torch.zeros(10, 4, 8)
    assert buffer_rows(buf[:3], 10).data_ptr() == buf.data_ptr()
    assert buffer_rows(buf[:3], 10).shape == (10, 4, 8)
    assert buffer_rows(buf[2:5], 8).storage_offset() == 2 * 32
    assert buffer_rows(buf[2:5], 9) is None  # past the storage's end
    assert buffer_rows(torch.zeros(3, 4, 8), 4) is None  # an exact-size tensor
    strided = torch.zeros(8, 10, 4).transpose(0, 1)[:3]  # rows 4 apart, heads 40 apart
    assert buffer_rows(strided, 10) is not None and buffer_rows(strided, 11) is None


def test_plans_of_one_set_of_parameters_share_one_launch_whatever_their_rows():
    w = prefill_wrapper(buffers(2, qo=True))
    plan(w, make_batch([20, 20], [20, 20], heads=HEADS, head_dim=DIM), False)  # latches 40
    launch = w.planned().launch
    for rows in range(1, 24):
        b = make_batch([rows], [rows + 3], heads=HEADS, head_dim=DIM, seed=rows)
        plan(w, b, False)
        out = w.run(b.q, b.cache)
        assert w.planned().launch is launch
        assert_close(out, oracle(b, causal=True)[0])


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


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("decode", [True, False])
def test_gpu_graphs_captured_with_the_planned_rows_replay_later_batches(decode):
    """FlashInfer's run() contract under capture, after a replan to fewer rows than the
    capacity: a graph over views of fixed buffers cut to the plan's rows replays any later
    batch the wrapper accepts, more rows than at capture included (as FlashInfer's does); a
    graph over tensors of exactly those rows replays batches of at most its rows. Eager runs
    of each plan's rows in between, of many row counts, do not disturb either."""
    device, dtype, heads, dim = torch.device("cuda"), torch.bfloat16, (32, 8), 128
    shape = (*heads, dim, PAGE)
    w = (decode_wrapper if decode else prefill_wrapper)(
        buffers(4, pages=256, qo=not decode, device=device), device, max_kv_len=2048)
    if decode:  # (query_lens, kv_lens): the capacity, the captured plan, later plans
        first, captured = ([1] * 4, [9, 700, 3, 40]), ([1] * 3, [100, 2000, 7])
        later = [([1] * 2, [1, 64]), ([1] * 4, [1500, 3, 40, 900]), ([1], [33])]
    else:
        first = ([16, 16, 16, 16], [16, 16, 300, 16])
        captured = ([3, 1, 20, 16], [700, 1, 40, 1200])
        later = [([1, 1], [5, 2048]), ([30, 30, 4], [30, 500, 9]), ([40], [40])]
    cache = torch.zeros(300, 2, PAGE, *heads[1:], dim, dtype=dtype, device=device)
    q_buf, out_buf = (torch.zeros(64, heads[0], dim, dtype=dtype, device=device)
                      for _ in range(2))

    def replan(query_lens, kv_lens, seed):
        b = make_batch(query_lens, kv_lens, heads=heads, head_dim=dim, dtype=dtype, seed=seed)
        cache[:b.cache.shape[0]].copy_(b.cache.nan_to_num(0))
        b.k, b.v = b.cache[:, 0].nan_to_num(0), b.cache[:, 1].nan_to_num(0)
        if decode:
            w.plan(b.indptr, b.indices, b.last_page_len, *shape, q_data_type=dtype)
        else:
            w.plan(b.qo_indptr, b.indptr, b.indices, b.last_page_len, *shape, causal=True,
                   q_data_type=dtype)
        n = sum(query_lens)
        q_buf[:n] = b.q.to(device)
        return b, n

    replan(*first, seed=0)  # the capacity: 4 requests, 64 rows (decode: 4)
    b, rows = replan(*captured, seed=1)
    q_exact, out_exact = q_buf[:rows].clone(), torch.zeros_like(q_buf[:rows])
    for _ in range(2):  # warm up (compiles) outside the captures
        w.run(q_buf[:rows], cache, out=out_buf[:rows])
        w.run(q_exact, cache, out=out_exact)
    torch.cuda.synchronize()
    on_views, on_exact = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(on_views):
        w.run(q_buf[:rows], cache, out=out_buf[:rows])
    with torch.cuda.graph(on_exact):
        w.run(q_exact, cache, out=out_exact)
    for i, (query_lens, kv_lens) in enumerate([captured, *later]):
        b, n = replan(query_lens, kv_lens, seed=i + 2)
        want = oracle(b, causal=True)[0]
        out_buf.fill_(float("nan"))
        on_views.replay()
        torch.cuda.synchronize()
        assert_close(out_buf[:n], want, dtype)
        assert out_buf[n:].isnan().all()  # rows past the batch: not written
        if n <= rows:
            q_exact[:n] = q_buf[:n]
            on_exact.replay()
            torch.cuda.synchronize()
            assert_close(out_exact[:n], want, dtype)
        assert_close(w.run(q_buf[:n].clone(), cache), want, dtype)  # eager, this plan's rows
    if not decode:  # eager runs of many row counts, then both replays
        for n in range(1, 20):
            replan([n], [n + 5], seed=n)
            w.run(q_buf[:n].clone(), cache)
        b, n = replan([30, 10], [30, 500], seed=99)
        q_exact[:n] = q_buf[:n]
        on_views.replay()
        on_exact.replay()
        torch.cuda.synchronize()
        want = oracle(b, causal=True)[0]
        assert_close(out_buf[:n], want, dtype)
        assert_close(out_exact[:n], want, dtype)


def two_level_cascade(query_lens, kv_lens, seed=0):
    """A batch whose requests share their first two pages, and the cascade's per-level
    arguments: level 0 every query over the shared pages, level 1 each request's own."""
    pages = [[0, 1, 2 + 2 * r, 3 + 2 * r][:-(-n // PAGE)] for r, n in enumerate(kv_lens)]
    b = make_batch(query_lens, kv_lens, heads=HEADS, head_dim=DIM, pages=pages, seed=seed)
    int32 = dict(dtype=torch.int32)
    shared = [torch.tensor([0, sum(query_lens)], **int32), torch.tensor([0, 2], **int32),
              torch.tensor([0, 1], **int32), torch.tensor([PAGE], **int32)]
    own_pages = [p[2:] for p in pages]
    own = [b.qo_indptr, torch.tensor([0, *map(len, own_pages)], **int32).cumsum(0).int(),
           torch.tensor(sum(own_pages, []), **int32), b.last_page_len]
    return b, [[s, o] for s, o in zip(shared, own)]


def test_cascade_wrapper_in_graph_mode_takes_each_plans_rows():
    bufs = [buffers(1, qo=True), buffers(4, qo=True)]
    arrs = [[lvl[i] for lvl in bufs] for i in (3, 0, 1, 2)]  # qo, indptr, indices, last
    w = MultiLevelCascadeAttentionWrapper(2, WORKSPACE, "NHD", True, *arrs)
    assert w.is_cuda_graph_enabled
    for i, (query_lens, kv_lens) in enumerate([([1, 4, 2], [40, 60, 37]),  # latches 7 rows
                                               ([2, 1], [33, 64]), ([1], [50])]):
        b, levels = two_level_cascade(query_lens, kv_lens, seed=i)
        w.plan(*levels, HEADS[0], HEADS[1], DIM, PAGE, causal=True, q_data_type=torch.float32)
        out = poison(b.q.shape, b.q.dtype)
        got, lse = w.run(b.q, b.cache, out=out, return_lse=True)
        want, want_lse = oracle(b, causal=True)
        assert got is out
        assert_close(out, want)
        assert_close(lse, want_lse)
    with pytest.raises(ValueError, match="four \\*_buf_arr lists"):
        MultiLevelCascadeAttentionWrapper(2, WORKSPACE, "NHD", True, arrs[0])
