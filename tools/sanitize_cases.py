"""Every GPU kernel of pagedattn once, at a small size, checked against the float64 oracle:
the program `tools/sanitize.sh` runs under compute-sanitizer (pytest under the sanitizer is
too slow). Each case launches its kernels eagerly (no CUDA graph) and compares the result
with `tests/reference.py`, through the test suite's own helpers where it has them; outputs
are poisoned with NaN first, so an unwritten element fails too.

    python tools/sanitize_cases.py [--only NAME,...] [--shared-memory] [--list]

--shared-memory runs the cases whose kernels stage data through shared memory behind
barriers (the Hopper prefill pass: TMA and mbarriers; the portable prefill pass: cp.async
pipelining), the ones racecheck and synccheck look at. Prints one line per case and
"N passed, N failed"; exits 1 if a case failed. Without CUDA the Triton kernels run under
TRITON_INTERPRET=1 (a check of this script, not of the kernels).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch

if not torch.cuda.is_available():  # before pagedattn.ops.triton defines its kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("PAGEDATTN_OPS_PROVIDER", "triton")  # every op on its Triton kernels
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import reference as ref  # noqa: E402
from conftest import assert_close, cu_seqlens, poison, randn  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16 = torch.bfloat16
# The Hopper pass's 16-bit type: the interpreter's bf16 dot reads raw bits (Triton 3.9).
HOPPER_DTYPE = BF16 if DEVICE == "cuda" else torch.float16
# The oracle's float64 work stays on the host: under the sanitizer only pagedattn's kernels
# (and the few PyTorch kernels that make inputs) should run on the GPU.
ref.DEVICE = torch.device("cpu")
CASES: dict = {}  # name -> (function, uses shared memory behind barriers)


def case(name: str, shared_memory: bool = False):
    def register(fn):
        CASES[name] = (fn, shared_memory)
        return fn
    return register


# --- the attention kernel (ops/triton/attention*.py, reduce.py) ------------------------------
@case("decode")
def _decode():
    from test_triton_attention import check_paged
    check_paged([1, 1, 1, 1], [1, 17, 64, 130], num_heads=8, num_kv_heads=2, head_size=64,
                dtype=BF16, num_splits=1)


@case("decode_fp8_cache")
def _decode_fp8():
    from test_triton_attention import check_paged
    check_paged([1, 1, 1], [5, 40, 97], num_heads=8, num_kv_heads=1, head_size=128, dtype=BF16,
                cache_dtype=torch.float8_e4m3fn, num_splits=1)


@case("prefill", shared_memory=True)
def _prefill():
    from test_triton_attention import check_paged
    check_paged([1, 30, 64], [9, 40, 64], num_heads=8, num_kv_heads=2, head_size=128,
                dtype=BF16, layout="HND", num_splits=1)


@case("prefill_features")
def _prefill_features():
    from test_triton_attention import check_paged
    check_paged([1, 20, 33], [50, 20, 70], num_heads=4, num_kv_heads=2, head_size=64,
                dtype=torch.float16, window=(24, 0), softcap=10.0, alibi=True, sinks=True)


@case("split_kv_and_reduce")
def _split_kv():
    from test_triton_attention import check_paged
    check_paged([1, 1, 24], [300, 70, 200], num_heads=4, num_kv_heads=2, head_size=64,
                dtype=BF16, num_splits=3)  # both passes split, both reduces run


@case("batch_invariant_splits_and_fold")
def _batch_invariant():
    # The mode's own kernels: fixed-size key splits, their fold, the fixed-tile prefill.
    from pagedattn.ops.batch_invariant import batch_invariant
    from test_triton_attention import check_paged
    with batch_invariant():
        check_paged([1, 1, 40], [700, 90, 300], num_heads=8, num_kv_heads=2, head_size=64,
                    dtype=BF16, window=(200, 0), softcap=20.0, sinks=True)
        check_paged([1, 17], [600, 17], num_heads=4, num_kv_heads=4, head_size=128,
                    dtype=BF16, cache_dtype=torch.float8_e4m3fn)


@case("batch_invariant_model_ops")
def _batch_invariant_model_ops():
    # The mode's matmul (tiles from the weight's shape, both tile sets, edges masked in M, N
    # and K, a bias) and row mean (a partial strip), against float64. Their outputs are
    # allocated inside; memcheck, not a poison, catches what they would leave unwritten.
    from pagedattn.ops.triton import launch
    from pagedattn.ops.triton.matmul import invariant_matmul
    from pagedattn.ops.triton.row_mean import invariant_row_mean

    dtype = BF16 if DEVICE == "cuda" else torch.float32
    tol = dict(rtol=2e-2, atol=2e-2) if DEVICE == "cuda" else dict(rtol=1e-5, atol=1e-5)
    tiles = [None] if DEVICE == "cuda" else [(16, 16, 16, 1, 1)]  # the interpreter: small
    for n in (70, 16400):
        for t in tiles:
            old = launch.SWITCHES.invariant_matmul_tiles
            launch.SWITCHES.invariant_matmul_tiles = t
            try:
                a = randn(37, 200, dtype=dtype, device=DEVICE)
                w = randn(n if DEVICE == "cuda" else 24, 200, dtype=dtype, device=DEVICE)
                bias = randn(w.shape[0], dtype=dtype, device=DEVICE)
                out = invariant_matmul(a, w.t(), bias, alpha=0.5, beta=1.5)
            finally:
                launch.SWITCHES.invariant_matmul_tiles = old
            want = 0.5 * a.double().cpu() @ w.double().cpu().t() + 1.5 * bias.double().cpu()
            assert_close(out.cpu(), want, **tol)
    x = randn(13, 1500, dtype=dtype, device=DEVICE)
    assert_close(invariant_row_mean(x).cpu(), x.double().cpu().mean(1), rtol=1e-5, atol=1e-6)


def _hopper(pack: bool, **kwargs):
    from pagedattn.ops.triton import launch
    from test_triton_hopper_prefill import check

    switches = launch.SWITCHES
    old = (switches.hopper_prefill, switches.hopper_pack_gqa, switches.gluon_prefill)
    if DEVICE == "cpu":  # the interpreter has no sm_90: force the pass on
        switches.hopper_prefill = True
    switches.hopper_pack_gqa = pack
    switches.gluon_prefill = False  # on sm_90 the Gluon pass would take its place
    try:
        check(**kwargs)  # asserts the plan ran the Hopper pass
    finally:
        switches.hopper_prefill, switches.hopper_pack_gqa, switches.gluon_prefill = old


@case("hopper_prefill_paged_packed_gqa", shared_memory=True)
def _hopper_packed():
    _hopper(True, query_lens=[40, 1, 23], seq_lens=[40, 30, 70], num_heads=8, num_kv_heads=2,
            head_size=128, dtype=HOPPER_DTYPE)


@case("hopper_prefill_paged_per_head", shared_memory=True)
def _hopper_per_head():
    _hopper(False, query_lens=[37, 24], seq_lens=[60, 24], num_heads=4, num_kv_heads=1,
            head_size=64, dtype=HOPPER_DTYPE, window=(9, 0), softcap=5.0, alibi=True,
            sinks=True)


@case("hopper_prefill_dense", shared_memory=True)
def _hopper_dense():
    _hopper(False, query_lens=[33, 20], seq_lens=[33, 50], paged=False, head_size=64,
            dtype=HOPPER_DTYPE)


@case("gluon_decode")
def _gluon_decode():
    """The Gluon decode pass (`SWITCHES.gluon_decode`), split and unsplit, bf16 and an e4m3
    q over an e4m3 cache, then its persistent form (`SWITCHES.gluon_decode_persistent`) on
    a grid of 2 SMs, so its programs walk several units through the carried rings; sm_90
    with Triton 3.6 only (elsewhere it says so and passes). Not a --shared-memory case:
    racecheck sees Triton's warp_specialize dispatch in every Gluon kernel, which
    `tools/sanitize.sh` runs it for apart (label gluon_decode)."""
    from conftest import gluon_sm90
    from pagedattn.ops.triton import gluon_decode_launch, launch
    from test_gluon_decode import run_decode

    if not gluon_sm90():
        print("       gluon_decode: not an sm_90 GPU with Triton 3.6's Gluon; not run")
        return
    old = launch.SWITCHES.gluon_decode
    launch.SWITCHES.gluon_decode = True
    try:
        run_decode([1, 2, 1], [300, 17, 129], num_heads=16, num_kv_heads=4, num_splits=1)
        run_decode([1, 3], [700, 40], num_heads=16, num_kv_heads=4, num_splits=3,
                   sinks=True)
        run_decode([1, 1, 2], [200, 1, 150], num_heads=16, num_kv_heads=4, fp8=True,
                   num_splits=2)
        persistent = launch.SWITCHES.gluon_decode_persistent
        launch.SWITCHES.gluon_decode_persistent = True
        sms = gluon_decode_launch.sm_count
        gluon_decode_launch.sm_count = lambda device: 2
        try:
            run_decode([1, 2, 1], [300, 17, 129], num_heads=16, num_kv_heads=4, num_splits=3,
                       nan_tail=True)
            run_decode([1, 1, 2], [200, 1, 150], num_heads=16, num_kv_heads=4, fp8=True,
                       num_splits=2, sinks=True)
        finally:
            gluon_decode_launch.sm_count = sms
            launch.SWITCHES.gluon_decode_persistent = persistent
    finally:
        launch.SWITCHES.gluon_decode = old


# --- cache writes, merge, cascade, DCP ---------------------------------------------------------
@case("cache_write")
def _cache_write():
    from test_triton_cache import test_reshape_and_cache_flash, test_reshape_and_cache_flash_diffkv
    test_reshape_and_cache_flash("bfloat16", "HND", torch.float32, 40, 32)
    test_reshape_and_cache_flash("fp8_e4m3", "HND", BF16, 32, 16)
    test_reshape_and_cache_flash("fp8_e5m2", "NHD", torch.float16, 48, 64)
    test_reshape_and_cache_flash_diffkv("fp8_e4m3")


@case("merge")
def _merge():
    from test_triton_merge import test_merge_matches_oracle_with_empty_parts
    test_merge_matches_oracle_with_empty_parts(BF16, 96, True)
    test_merge_matches_oracle_with_empty_parts(torch.float16, 128, False)


@case("cascade")
def _cascade():
    from pagedattn.ops import cascade_attention
    from test_cascade import shared_prefix_batch

    prefix, query_lens, suffix_lens = 32, [1, 4, 1], [3, 9, 17]
    q, k, v, table = shared_prefix_batch(prefix, query_lens, suffix_lens, head_size=64,
                                         dtype=BF16)
    seq_lens = [prefix + s for s in suffix_lens]
    out = poison(q.shape, BF16, DEVICE)
    cascade_attention(
        out, q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), cu_query_lens=cu_seqlens(query_lens,
                                                                               DEVICE),
        max_query_len=max(query_lens), cu_prefix_query_lens=cu_seqlens([q.shape[0]], DEVICE),
        prefix_kv_lens=torch.tensor([prefix], dtype=torch.int32, device=DEVICE),
        suffix_kv_lens=torch.tensor(suffix_lens, dtype=torch.int32, device=DEVICE),
        max_kv_len=max(seq_lens), softmax_scale=0.125, alibi_slopes=None,
        sliding_window=(-1, -1), logits_soft_cap=0.0, block_table=table.to(DEVICE),
        common_prefix_len=prefix)
    want, _ = ref.paged_attention(q, k, v, query_lens, seq_lens, table, scale=0.125)
    assert_close(out, want, BF16)


@case("dcp_correct_attn_out")
def _dcp():
    from pagedattn.ops.context_parallel import correct_attn_out

    g = torch.Generator().manual_seed(0)
    tokens, heads, dv = 7, 4, 64
    outs = [randn(tokens, heads, dv, generator=g) for _ in range(2)]
    lses = torch.randn(2, heads, tokens, generator=g) * 3
    lses[0, 1, :3] = -math.inf  # rank 0 saw no key for these
    want, _ = ref.merge_states(outs[0], lses[0], outs[1], lses[1])
    total = torch.zeros(heads, tokens, dv, device=DEVICE)
    for rank in range(2):
        total += correct_attn_out(outs[rank].to(DEVICE), lses.to(DEVICE), rank)[0]
    assert_close(total.transpose(0, 1), want)


# --- block-sparse (ops/triton/blocksparse*.py; the v0 cache write) -----------------------------
@case("blocksparse_prefill")
def _blocksparse_prefill():
    from test_ops_blocksparse import run_prefill
    run_prefill([40, 21, 5], [40, 53, 5], 4, 2, 64, (2, 3, 16, 1), dtype=BF16)


@case("blocksparse_decode")
def _blocksparse_decode():
    from test_ops_blocksparse import check_decode
    check_decode([1, 17, 33, 200], (2, 3, 16, -1), num_heads=4, num_kv_heads=2, head_size=64,
                 page=16, dtype=BF16)
    check_decode([300], (1, 4, 32, 1), num_heads=4, num_kv_heads=2, head_size=64, page=16,
                 dtype=BF16, kernel_args=dict(num_splits=3))  # split keys, then the merge


# --- FlashInfer-style wrappers (ops/flashinfer) --------------------------------------------
@case("flashinfer_wrappers")
def _flashinfer():
    from pagedattn.ops import (
        BatchDecodeWithPagedKVCacheWrapper,
        BatchPrefillWithPagedKVCacheWrapper,
        append_paged_kv_cache,
        get_batch_indices_positions,
    )
    from pagedattn.ops.flashinfer import get_seq_lens
    from test_ops_flashinfer import make_batch, oracle

    ws = torch.empty(1, dtype=torch.uint8, device=DEVICE)
    b = make_batch([1, 1, 9, 30], [17, 64, 40, 30], heads=(8, 2), head_dim=64, dtype=BF16)
    cache = b.cache.to(DEVICE)
    want, want_lse = oracle(b, causal=True)
    w = BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    w.plan(b.qo_indptr, b.indptr, b.indices, b.last_page_len, 8, 2, 64, 16, causal=True,
           q_data_type=BF16)
    out, lse = w.run(b.q.to(DEVICE), cache, out=poison(b.q.shape, BF16, DEVICE),
                     return_lse=True)
    assert_close(out, want, BF16)
    assert_close(lse, want_lse, BF16)
    d = BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    d.plan(b.indptr[:3], b.indices, b.last_page_len[:2], 8, 2, 64, 16, q_data_type=BF16)
    assert_close(d.run(b.q[:2].to(DEVICE), cache), want[:2], BF16)
    # append_paged_kv_cache: every key the batch's pages hold, written again into a fresh
    # cache through the CSR page table; the prefill plan over it gives the same result.
    kv_lens = get_seq_lens(b.indptr, b.last_page_len, 16)
    append_indptr = torch.cat([kv_lens.new_zeros(1), kv_lens.cumsum(0)]).to(torch.int32)
    batch, pos = get_batch_indices_positions(append_indptr, kv_lens, int(kv_lens.sum()))
    page = b.indices.long()[b.indptr.long()[batch.long()] + pos.long() // 16]
    k_rows, v_rows = b.cache[page, 0, pos.long() % 16], b.cache[page, 1, pos.long() % 16]
    fresh = poison(b.cache.shape, BF16, DEVICE)
    append_paged_kv_cache(k_rows.to(DEVICE), v_rows.to(DEVICE), batch.to(DEVICE),
                          pos.to(DEVICE), fresh, b.indices.to(DEVICE), b.indptr.to(DEVICE),
                          b.last_page_len.to(DEVICE))
    assert_close(w.run(b.q.to(DEVICE), fresh), want, BF16)


@case("flashinfer_graph_mode")
def _flashinfer_graph_mode():
    """CUDA-graph mode, eager: views of fixed buffers run the capacity's launch over the whole
    buffers (reads and writes past the views must stay inside them); exact tensors their own."""
    from test_ops_flashinfer import make_batch, oracle
    from test_ops_flashinfer_graph import DIM, HEADS, buffers, prefill_wrapper

    w = prefill_wrapper(buffers(4, qo=True, device=DEVICE), DEVICE, max_kv_len=128)
    q_buf, out_buf = (torch.zeros(16, HEADS[0], DIM, device=DEVICE) for _ in range(2))
    for i, (query_lens, kv_lens) in enumerate([([8, 8], [8, 20]), ([3, 2], [5, 9]),
                                               ([1, 1, 1], [30, 2, 7])]):
        b = make_batch(query_lens, kv_lens, heads=HEADS, head_dim=DIM, seed=i)
        w.plan(b.qo_indptr, b.indptr, b.indices, b.last_page_len, *HEADS, DIM, 16,
               causal=True, q_data_type=torch.float32)
        n, cache, want = sum(query_lens), b.cache.to(DEVICE), oracle(b, causal=True)[0]
        q_buf[:n] = b.q.to(DEVICE)
        w.run(q_buf[:n], cache, out=out_buf[:n])
        assert_close(out_buf[:n], want, atol=2e-4, rtol=1e-4)
        assert_close(w.run(b.q.to(DEVICE), cache), want, atol=2e-4, rtol=1e-4)


@case("flashinfer_cascade_and_merge_state")
def _flashinfer_cascade():
    from pagedattn.ops import MultiLevelCascadeAttentionWrapper, merge_state
    from test_ops_flashinfer import LOG2E, oracle
    from test_ops_flashinfer_graph import two_level_cascade

    b, levels = two_level_cascade([1, 4, 2], [40, 60, 37])
    ws = torch.empty(1, dtype=torch.uint8, device=DEVICE)
    w = MultiLevelCascadeAttentionWrapper(2, ws, "NHD")
    w.plan(*levels, 4, 2, 16, 16, causal=True, q_data_type=torch.float32)
    out = w.run(b.q.to(DEVICE), b.cache.to(DEVICE))
    assert_close(out, oracle(b, causal=True)[0])
    g = torch.Generator().manual_seed(3)
    va, vb = randn(5, 3, 64, generator=g), randn(5, 3, 64, generator=g)
    sa, sb = torch.randn(5, 3, generator=g) * 3, torch.randn(5, 3, generator=g) * 3
    v, s = merge_state(va.to(DEVICE), sa.to(DEVICE), vb.to(DEVICE), sb.to(DEVICE))
    want, want_lse = ref.merge_states(va, (sa / LOG2E).T, vb, (sb / LOG2E).T)
    assert_close(v, want)
    assert_close(s, want_lse.T * LOG2E)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated case names")
    parser.add_argument("--shared-memory", action="store_true",
                        help="only the cases racecheck / synccheck look at")
    parser.add_argument("--list", action="store_true", help="print the case names")
    args = parser.parse_args(argv)
    names = [n for n, (_, smem) in CASES.items() if smem or not args.shared_memory]
    if args.only:
        wanted = args.only.split(",")
        unknown = sorted(set(wanted) - set(CASES))
        if unknown:
            parser.error(f"--only: unknown case(s) {unknown}; choose from {sorted(CASES)}")
        names = [n for n in names if n in wanted]
    if args.list:
        print("\n".join(names))
        return 0
    print(f"device: {torch.cuda.get_device_name() if DEVICE == 'cuda' else 'cpu (interpreter)'}",
          flush=True)
    failed = []
    for name in names:
        start = time.perf_counter()
        try:
            CASES[name][0]()
            if DEVICE == "cuda":
                torch.cuda.synchronize()  # a kernel fault surfaces here, under its case
            print(f"ok     {name} ({time.perf_counter() - start:.1f} s)", flush=True)
        except Exception:  # report and go on: the sanitizer's log names the kernel
            traceback.print_exc()
            print(f"FAILED {name}", flush=True)
            failed.append(name)
    print(f"{len(names) - len(failed)} passed, {len(failed)} failed"
          + (f": {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
