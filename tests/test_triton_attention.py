"""The Triton attention kernel against the float64 oracle.

Without CUDA the kernels run under TRITON_INTERPRET=1 at small sizes (each feature at least
once, not the cross product); with CUDA the same cases run on the GPU, plus `cuda`-marked cases
at real sizes. Outputs are poisoned with NaN first, so an unwritten element fails.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

if not torch.cuda.is_available():  # before pagedattn.ops.triton defines its kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import reference as ref  # noqa: E402
from conftest import (  # noqa: E402
    TOLERANCE,
    assert_close,
    assert_within_fp8_p_bound,
    make_paged_batch,
    poison,
)
from pagedattn.ops import flash_attn_varlen_func  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
LSE_TOL = {torch.float32: dict(atol=1e-4, rtol=1e-5), torch.float16: dict(atol=2e-2, rtol=1e-2),
           torch.bfloat16: dict(atol=5e-2, rtol=2e-2)}


@pytest.fixture(autouse=True)
def _triton_provider(_fresh_env, monkeypatch):
    monkeypatch.setenv("PAGEDATTN_OPS_PROVIDER", "triton")


def check_paged(query_lens, seq_lens, num_heads=4, num_kv_heads=2, head_size=32,
                head_size_v=None, block_size=16, dtype=torch.float32, layout="NHD",
                cache_dtype=None, q_fp8=False, causal=True, window=(-1, -1), softcap=0.0,
                alibi=False, sinks=False, num_splits=0, seed=0):
    b = make_paged_batch(query_lens, seq_lens, num_heads, num_kv_heads, head_size, block_size,
                         dtype, head_size_v, layout, cache_dtype, device=DEVICE, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    slopes = torch.rand(num_heads, generator=g) * 0.5 if alibi else None
    sink = torch.randn(num_heads, generator=g) * 2 if sinks else None
    batch = len(query_lens)
    q, q_scale, k_scale, v_scale = b.q, 1.0, 1.0, 1.0
    descale = {}
    if q_fp8:
        q, q_scale = (b.q * 4).to(torch.float8_e4m3fn), 0.25
        descale["q_descale"] = torch.tensor(q_scale, device=DEVICE).expand(batch, num_kv_heads)
    if cache_dtype is not None:
        k_scale, v_scale = 0.5, 2.0
        descale["k_descale"] = torch.full((batch, num_kv_heads), k_scale, device=DEVICE)
        descale["v_descale"] = torch.tensor(v_scale, device=DEVICE).expand(batch, num_kv_heads)
    scale = head_size ** -0.5
    out = poison((b.total_q, num_heads, head_size_v or head_size), dtype, DEVICE)
    out, lse = flash_attn_varlen_func(
        q, b.k_cache, b.v_cache, b.max_seqlen_q, b.cu_seqlens_q, b.max_seqlen_k,
        seqused_k=b.seqused_k, block_table=b.block_table, softmax_scale=scale, causal=causal,
        window_size=window, softcap=softcap,
        alibi_slopes=None if slopes is None else slopes.to(DEVICE),
        s_aux=None if sink is None else sink.to(DEVICE), return_softmax_lse=True, out=out,
        num_splits=num_splits, **descale)
    exp_out, exp_lse = ref.paged_attention(
        q.cpu(), b.k_cache.cpu(), b.v_cache.cpu(), b.query_lens, b.seq_lens,
        b.block_table.cpu(), q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, scale=scale,
        causal=causal, window=window, softcap=softcap, alibi_slopes=slopes, sinks=sink)
    if q_fp8:
        # An fp8 q may run P V on fp8 tensor cores (the Gluon pass at head 128: P rounded to
        # e4m3 a tile, each weight within 2^-4 of itself), so an output may lie up to 2^-4
        # of the oracle's weighted mean of |V| beyond the 16-bit tolerance (DESIGN.md).
        v_abs = b.v_cache.cpu().float().abs()
        mean_abs_v, _ = ref.paged_attention(
            q.cpu(), b.k_cache.cpu(), v_abs, b.query_lens, b.seq_lens, b.block_table.cpu(),
            q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, scale=scale, causal=causal,
            window=window, softcap=softcap, alibi_slopes=slopes, sinks=sink)
        assert_within_fp8_p_bound(out, exp_out, mean_abs_v, 2.0 ** -4, **TOLERANCE[dtype])
    else:
        assert_close(out, exp_out, dtype)
    assert_close(lse, exp_lse, **LSE_TOL[dtype])


# --- CPU (interpreter) and GPU, small sizes: each feature at least once ---------------------
def test_mixed_batch_with_zero_length_query_and_context_offset():
    check_paged([1, 7, 0, 19], [40, 30, 5, 19], head_size=40)


def test_hnd_layout_bf16_mqa_with_wider_values():
    check_paged([3, 1], [35, 64], num_heads=4, num_kv_heads=1, head_size=32, head_size_v=48,
                block_size=32, dtype=torch.bfloat16, layout="HND")


def test_non_causal_window_alibi_softcap():
    check_paged([6, 9], [20, 33], causal=False, window=(5, 3), alibi=True, softcap=2.5)


def test_sinks_and_fully_masked_rows():
    # 10 queries over 4 keys: the first 6 queries sit before every key (fully masked rows);
    # a window of 2 also leaves the second sequence's queries few keys.
    check_paged([10, 5], [4, 40], window=(2, -1), sinks=True, num_heads=6, num_kv_heads=2)


@pytest.mark.parametrize("block_size", [32, 64])
def test_forced_split_kv_matches_oracle(block_size):
    check_paged([1, 1, 4], [150, 3, 97], block_size=block_size, num_splits=3, sinks=True)


def test_fp16_gqa_group_of_three():
    check_paged([2, 5], [18, 21], num_heads=6, num_kv_heads=2, dtype=torch.float16)


def test_fp8_cache_and_fp8_query_with_descales():
    check_paged([1, 4], [30, 20], dtype=torch.bfloat16, cache_dtype=torch.float8_e4m3fn,
                q_fp8=True)


def test_fp8_e5m2_cache():
    check_paged([2], [25], dtype=torch.float16, cache_dtype=torch.float8_e5m2)


def test_fp8_cache_with_bf16_query_runs_fp16_dots():
    check_paged([1, 3, 12], [40, 20, 30], dtype=torch.bfloat16, cache_dtype=torch.float8_e4m3fn)


def test_prefill_only_batch_over_64_sequences():
    # Every request is long, so the decode pass is skipped; the sequence search spans two
    # 64-wide chunks of cu_seqlens_q.
    lens = [9 + i % 5 for i in range(67)]
    check_paged(lens, [n + i % 3 for i, n in enumerate(lens)], head_size=16)


def test_dense_keys_for_encoder_attention():
    g = torch.Generator().manual_seed(3)
    q_lens, k_lens = [5, 0, 9], [7, 3, 9]
    q = torch.randn(sum(q_lens), 4, 32, generator=g)
    k = torch.randn(sum(k_lens), 2, 32, generator=g)
    v = torch.randn(sum(k_lens), 2, 24, generator=g)
    cu_q = torch.tensor([0, 5, 5, 14], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 10, 19], dtype=torch.int32)
    out = poison((14, 4, 24), torch.float32, DEVICE)
    out, lse = flash_attn_varlen_func(
        q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), 9, cu_q.to(DEVICE), 9,
        cu_seqlens_k=cu_k.to(DEVICE), causal=False, return_softmax_lse=True, out=out)
    exp_out, exp_lse = ref.varlen_attention(q, k, v, q_lens, k_lens, scale=32 ** -0.5,
                                            causal=False)
    assert_close(out, exp_out)
    assert_close(lse, exp_lse, **LSE_TOL[torch.float32])


def test_split_kv_equals_unsplit():
    b = make_paged_batch([1, 1], [120, 77], 4, 2, 32, device=DEVICE, seed=5)
    args = (b.q, b.k_cache, b.v_cache, 1, b.cu_seqlens_q, b.max_seqlen_k)
    kw = dict(seqused_k=b.seqused_k, block_table=b.block_table, causal=True,
              return_softmax_lse=True)
    one = flash_attn_varlen_func(*args, num_splits=1, **kw)
    four = flash_attn_varlen_func(*args, num_splits=4, **kw)
    assert_close(four[0], one[0].double())
    assert_close(four[1], one[1].double(), **LSE_TOL[torch.float32])


@pytest.mark.parametrize("kwargs", [
    dict(query_lens=[12, 1, 20], seq_lens=[60, 30, 20]),  # both passes split, one scratch
    dict(query_lens=[12, 9], seq_lens=[50, 70], causal=False, window=(9, 4), alibi=True,
         softcap=2.5),
    # sinks join once (split 0 only); queries before every key are fully masked rows
    dict(query_lens=[10, 11], seq_lens=[4, 40], window=(2, -1), sinks=True, num_heads=6),
    dict(query_lens=[9, 1], seq_lens=[100, 5], causal=False, sinks=True),
], ids=["causal", "non-causal-window-alibi-softcap", "sinks-masked-rows", "non-causal-sinks"])
@pytest.mark.parametrize("num_splits", [2, 5])
def test_split_prefill_pass_matches_oracle(kwargs, num_splits):
    kwargs = dict(kwargs)
    check_paged(kwargs.pop("query_lens"), kwargs.pop("seq_lens"), num_splits=num_splits,
                **kwargs)


def test_split_prefill_reduce_finds_tokens_past_64_sequences():
    # The reduce's token -> sequence search spans two 64-wide chunks of cu_seqlens_q.
    check_paged([1] * 64 + [12, 10], [30] * 64 + [40, 25], num_heads=2, num_kv_heads=1,
                head_size=16, num_splits=2)


def test_graph_plan_leaves_rows_past_the_batch_alone():
    # A CUDA-graph plan serves up to its bucket's tokens; rows past the batch's last token are
    # the caller's padding, and the split prefill pass's reduce must not write them.
    from pagedattn.ops.plan import plan_varlen_attention

    b = make_paged_batch([1, 24], [20, 40], 2, 1, 16, device=DEVICE)
    bucket = b.total_q + 7
    q = torch.cat([b.q, torch.randn(7, 2, 16, device=DEVICE)])
    out = poison((bucket, 2, 16), torch.float32, DEVICE)
    plan = plan_varlen_attention(
        cu_seqlens_q=b.cu_seqlens_q, num_tokens=bucket, max_seqlen_q=24, max_seqlen_k=40,
        num_heads=2, num_kv_heads=1, head_size=16, q_dtype=torch.float32,
        kv_dtype=torch.float32, seqused_k=b.seqused_k, block_table=b.block_table,
        page_size=16, causal=True, num_splits=2, cuda_graph=True, provider="triton")
    plan.run(q, b.k_cache, b.v_cache, out)
    expected, _ = ref.paged_attention(b.q.cpu(), b.k_cache.cpu(), b.v_cache.cpu(),
                                      b.query_lens, b.seq_lens, b.block_table.cpu(),
                                      scale=16 ** -0.5)
    assert_close(out[:b.total_q], expected)
    assert torch.isnan(out[b.total_q:]).all(), "a padding row past the batch was written"


def test_prefill_pass_splits_only_when_its_programs_cannot_fill_the_gpu():
    from pagedattn.ops.triton import launch

    splits = functools.partial(launch.prefill_splits, device=torch.device("cpu"), block_m=64,
                               num_kv_heads=1, num_splits=0)  # 4 "SMs" on the CPU
    assert splits(q_blocks=1, max_seqlen_k=16384) == 8  # 2 x SMs programs
    assert splits(q_blocks=1, max_seqlen_k=1100) == 2  # >= 512 keys a split
    assert splits(q_blocks=4, max_seqlen_k=16384) == 2  # two 64-row programs fit an SM
    assert splits(q_blocks=4, max_seqlen_k=16384, block_m=256) == 1  # one does
    assert splits(q_blocks=8, max_seqlen_k=16384) == 1  # already fills the SMs
    assert splits(q_blocks=1, max_seqlen_k=300) == 1
    assert launch.prefill_splits(device=torch.device("cpu"), q_blocks=64, block_m=64,
                                 max_seqlen_k=9, num_kv_heads=8, num_splits=3) == 3  # forced


def test_decode_splits_fill_whole_waves_of_the_sms():
    from pagedattn.ops.triton.launch import MIN_KEYS_PER_SPLIT, decode_splits

    # 132 SMs (an H100 / H200), 8 KV heads: the rows the splits were measured on.
    assert decode_splits(132, 64 * 8, 16384) == 2  # unsplit: 1.29 waves, the last one thin
    assert decode_splits(132, 32 * 8, 4096) == 1  # 256 programs, two an SM, already saturate
    assert decode_splits(132, 128 * 8, 1024) == 1  # 512 keys a split would cost more
    assert decode_splits(132, 1 * 8, 32768) == 33  # one program an SM is not enough
    assert decode_splits(132, 32 * 8, 4096, kv_bytes=1) == 3  # fp8 programs need three an SM
    for programs in (1, 7, 64, 300, 4096):
        for keys in (1, 511, 513, 4096, 1 << 17):
            s = decode_splits(132, programs, keys)
            assert s == 1 or -(-keys // s) >= MIN_KEYS_PER_SPLIT, (programs, keys, s)


def test_mixed_steps_split_decodes_only_below_one_program_per_sm():
    from pagedattn.ops.triton import launch

    cfg = functools.partial(launch.decode_config, device=torch.device("cpu"), batch=64,
                            max_seqlen_k=16384, num_kv_heads=1, group_pad=4, head_size=128,
                            num_splits=0)  # 4 "SMs" on the CPU: 64 programs fill them
    assert cfg(decode_only=False).num_splits == 1
    assert cfg(decode_only=True).num_splits == launch.decode_splits(4, 64, 16384)


def test_argument_structures_mirror_the_kernel_signatures():
    from pagedattn.ops.triton import attention_args as args
    from pagedattn.ops.triton.attention import attention_kernel
    from pagedattn.ops.triton.attention_hopper import hopper_prefill_kernel
    from pagedattn.ops.triton.reduce import reduce_splits_kernel

    args.check_signature(attention_kernel, args.LayerArgs, args.Batch)
    args.check_signature(hopper_prefill_kernel, args.HopperLayerArgs, args.Batch)
    args.check_signature(reduce_splits_kernel, args.Outputs, args.ReduceBatch)
    assert args.LayerArgs._fields[:2] == args.HopperLayerArgs._fields[:2] == args.Outputs._fields
    for kernel in (attention_kernel, hopper_prefill_kernel, reduce_splits_kernel):
        assert len(kernel.arg_names) <= 40, kernel.fn.__name__
    with pytest.raises(TypeError, match="attention_kernel takes"):
        args.check_signature(attention_kernel, args.Outputs, args.Batch)


def test_run_hands_each_pass_the_layer_arguments_in_signature_order(monkeypatch):
    """run() builds the layer's section as LayerArgs, and keys the call only when the
    tensors have the plan's dtypes (else Triton's launch specialises)."""
    from pagedattn.ops.triton import attention_args as args
    from pagedattn.ops.triton.attention_plan import PassLaunch, plan_attention

    b = make_paged_batch([1, 1], [40, 17], 4, 2, 16, device=DEVICE)
    plan = plan_attention(**b.plan_args(device=torch.device(DEVICE), use_alibi=True))
    calls = []
    monkeypatch.setattr(PassLaunch, "__call__",
                        lambda launch, a, key: calls.append((launch, a, key)))
    out, slopes = torch.empty_like(b.q), torch.rand(4, device=DEVICE)
    plan.run(b.q, b.k_cache, b.v_cache, out, alibi_slopes=slopes)
    (launch, a, key), = calls
    layer = args.LayerArgs(*a[:len(args.LayerArgs._fields)])
    k, v = b.k_cache, b.v_cache
    assert layer.Out is out and layer.Q is b.q and layer.K is k and layer.V is v
    assert layer.Lse is None and layer.alibi_slopes is slopes and layer.sinks is None
    assert (layer.stride_qt, layer.stride_kb, layer.stride_ks, layer.stride_kh) == (
        b.q.stride(0), *k.stride()[:3])
    assert (layer.stride_vb, layer.stride_vs, layer.stride_vh) == v.stride()[:3]
    assert layer.stride_descale_head == 0 and a[len(layer):] == launch.batch
    assert key is not None
    calls.clear()
    plan.run(b.q.double(), k, v, out.double(), alibi_slopes=slopes)  # not the plan's dtypes
    assert calls[0][2] is None


def test_plan_passes_by_batch_shape():
    from pagedattn.ops.triton.attention_plan import plan_attention

    def names(query_lens, seq_lens, **kw):
        b = make_paged_batch(query_lens, seq_lens, 4, 2, 16, device=DEVICE)
        plan = plan_attention(**b.plan_args(device=torch.device(DEVICE), **kw))
        return [p.name for p in plan.launches]

    assert names([1, 1], [40, 9]) == ["decode"]
    assert names([30, 20], [30, 20]) == ["prefill"]  # no request is short enough to decode
    assert names([30, 1], [30, 20]) == ["decode", "prefill"]
    assert names([1], [40], num_splits=2) == ["decode", "reduce"]
    assert names([1, 30], [40, 30], cuda_graph=True, num_splits=3) == [
        "decode", "reduce", "prefill", "reduce"]


def test_auto_split_prefill_equals_unsplit():
    # One 12-query sequence over 1100 keys, 1 KV head: 2 query blocks < 4 "SMs" -> 2 splits.
    b = make_paged_batch([12], [1100], 2, 1, 16, device=DEVICE, seed=7)
    args = (b.q, b.k_cache, b.v_cache, 12, b.cu_seqlens_q, b.max_seqlen_k)
    kw = dict(seqused_k=b.seqused_k, block_table=b.block_table, causal=False,
              return_softmax_lse=True)
    auto = flash_attn_varlen_func(*args, num_splits=0, **kw)
    one = flash_attn_varlen_func(*args, num_splits=1, **kw)
    assert_close(auto[0], one[0].double())
    assert_close(auto[1], one[1].double(), **LSE_TOL[torch.float32])


# --- GPU, real sizes -------------------------------------------------------------------------
@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("kwargs", [
    dict(), dict(alibi=True, sinks=True, softcap=20.0, window=(50, 0)),
    dict(cache_dtype=torch.float8_e4m3fn, q_fp8=True), dict(num_splits=4),
    dict(causal=False, head_size_v=64)], ids=["plain", "features", "fp8", "split", "diff_v"])
def test_repeated_calls_launch_directly_and_stay_exact(kwargs):
    """The first call compiles through Triton's launch; the later ones hand their arguments
    (None for features that are off) straight to the compiled kernels (fast_launch)."""
    from pagedattn.ops.triton import fast_launch

    for _ in range(3):
        check_paged([1, 1, 37, 5], [700, 33, 300, 90], num_heads=8, num_kv_heads=2,
                    head_size=128, dtype=torch.bfloat16, seed=5, **kwargs)
    assert fast_launch.fast_path_enabled()


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("head_size,block_size", [(128, 16), (64, 32), (80, 64), (96, 128),
                                                  (112, 16), (192, 256), (256, 16), (32, 64)])
def test_real_sizes_mixed_batch(head_size, block_size):
    check_paged([1, 1, 1, 300, 0, 77, 1], [1500, 4000, 17, 700, 64, 2100, 33], num_heads=32,
                num_kv_heads=8, head_size=head_size, block_size=block_size,
                dtype=torch.bfloat16, layout="HND" if block_size >= 64 else "NHD")


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_real_sizes_fp8_decode_with_auto_split(cache_dtype):
    check_paged([1, 1, 1], [9000, 300, 4100], num_heads=32, num_kv_heads=8, head_size=128,
                dtype=torch.bfloat16, cache_dtype=cache_dtype)


@cuda
@pytest.mark.cuda
def test_real_sizes_fp8_cache_mixed_prefill_and_decode():
    check_paged([1, 300, 1, 77], [4000, 700, 9000, 2100], num_heads=32, num_kv_heads=8,
                head_size=128, dtype=torch.bfloat16, cache_dtype=torch.float8_e4m3fn)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("query_len", [512, 1024])
def test_real_sizes_equal_length_causal_prefill(query_len):
    check_paged([query_len] * 3, [query_len] * 3, num_heads=32, num_kv_heads=8, head_size=128,
                dtype=torch.bfloat16)


@cuda
@pytest.mark.cuda
def test_real_sizes_all_features():
    check_paged([1, 64, 200, 1], [3000, 500, 200, 1000], num_heads=16, num_kv_heads=2,
                head_size=128, head_size_v=96, dtype=torch.float16, window=(256, -1),
                softcap=30.0, alibi=True, sinks=True, num_splits=0)


@cuda
@pytest.mark.cuda
def test_real_sizes_non_causal_fp32_with_window_both_sides():
    check_paged([100, 37], [300, 400], num_heads=8, num_kv_heads=8, head_size=64,
                causal=False, window=(40, 25), block_size=32)


# --- which prefill pass the plan picks (the Gluon pass cannot run here: a recording stub) ---
class _GluonStub:
    def __init__(self, **planned):
        self.planned, self.calls = planned, []

    def run(self, *args):
        self.calls.append(args)

    def plan_layer(self, *args, **kwargs):  # a layer's plan: records what it was made for
        self.bound, self.bound_kwargs = args, kwargs
        return _GluonLayerStub(self)


class _GluonLayerStub:
    def __init__(self, launch):
        self.launch = launch

    def call_args(self, q, out, k_new, v_new):
        return None if k_new is None else (q, out, k_new, v_new)

    def run(self, call_args):
        self.launch.calls.append(call_args)


@pytest.fixture
def gluon_stub(monkeypatch):
    from pagedattn.ops.triton import attention_plan

    made = []

    def plan(**kwargs):
        made.append(_GluonStub(**kwargs))
        return made[-1]

    monkeypatch.setattr(attention_plan, "plan_gluon_prefill", plan)
    return made


def _plan_mixed(num_splits=0, cuda_graph=False, query_lens=(1, 300, 1), seq_lens=(40, 300, 70),
                new_keys_only=False):
    from pagedattn.ops.triton.attention_plan import plan_attention

    b = make_paged_batch(list(query_lens), list(seq_lens), 32, 8, 64, device=DEVICE)
    plan = plan_attention(**b.plan_args(
        device=torch.device(DEVICE), batch=3, max_seqlen_q=300, max_seqlen_k=300,
        num_splits=num_splits, cuda_graph=cuda_graph, dense_new_kv=True,
        new_keys_only=new_keys_only))
    return b, plan


def test_gluon_pass_takes_the_long_requests_and_leaves_decodes_to_the_decode_pass(gluon_stub):
    b, plan = _plan_mixed()
    (stub,) = gluon_stub
    assert plan.gluon is stub and [p.name for p in plan.launches] == ["decode"]
    assert stub.planned["skip_q_len"] >= 1 and stub.planned["dense_new_kv"]
    assert stub.planned["block_table"] is b.block_table
    k_new = torch.randn(b.total_q, 8, 64, device=DEVICE)
    out = poison((b.total_q, 32, 64), torch.float32, DEVICE)
    plan.run(b.q, b.k_cache, b.v_cache, out, None, None, None, None, None, None, k_new, k_new)
    (args,) = stub.calls
    assert args[0] is b.q and args[3] is out and args[7] is k_new
    assert not torch.isnan(out[0]).any() and torch.isnan(out[1:301]).all()  # decode rows only


def test_prompts_alone_give_the_gluon_pass_their_new_rows_as_dense_keys(gluon_stub):
    b, plan = _plan_mixed(query_lens=(300, 200), seq_lens=(300, 200), new_keys_only=True)
    (stub,) = gluon_stub
    assert stub.planned["block_table"] is None and not stub.planned["dense_new_kv"]
    assert stub.planned["cu_seqlens_k"] is b.cu_seqlens_q
    k_new = torch.randn(b.total_q, 8, 64, device=DEVICE)
    v_new = torch.randn(b.total_q, 8, 64, device=DEVICE)
    out = poison((b.total_q, 32, 64), torch.float32, DEVICE)
    plan.run(b.q, b.k_cache, b.v_cache, out, None, None, None, None, None, None, k_new, v_new)
    (args,) = stub.calls
    assert args[0] is b.q and args[1] is k_new and args[2] is v_new and args[3] is out
    with pytest.raises(ValueError, match="k_new"):
        plan.run(b.q, b.k_cache, b.v_cache, out)
    # a graph's plan serves later batches, which may have a context: it keeps the pages
    b2, _ = _plan_mixed(query_lens=(300, 200), seq_lens=(300, 200), new_keys_only=True,
                        cuda_graph=True)
    assert gluon_stub[-1].planned["block_table"] is b2.block_table
    assert gluon_stub[-1].planned["dense_new_kv"]


def test_a_layers_plan_runs_the_gluon_pass_beside_the_decode_pass(gluon_stub):
    """Steps of one size share their plans, so a layer runs a prefill plan again: its own
    plan launches the Gluon pass (planned for its caches) and the decode pass, as run()."""
    from pagedattn.ops.triton.layer_plan import TritonLayerPlan

    b, plan = _plan_mixed()
    (stub,) = gluon_stub
    assert plan.takes_rows  # the Gluon pass reads rows through their strides
    attention = plan.plan_layer(b.k_cache, b.v_cache)
    assert attention is not None and stub.bound[:2] == (b.k_cache, b.v_cache)
    layer_plan = TritonLayerPlan(None, attention, b.total_q)
    assert stub.bound[2:] == (None, None, None, None) + (torch.float32,) * 3
    assert stub.bound_kwargs == {"q_descale": None}
    k_new = torch.randn(b.total_q, 8 * 64, device=DEVICE)
    q_rows = b.q.reshape(b.total_q, -1)
    outs = []
    for call in ("run", "bound"):
        out = poison((b.total_q, 32 * 64), torch.float32, DEVICE)
        if call == "run":
            plan.run(q_rows, b.k_cache, b.v_cache, out, None, None, None, None, None, None,
                     k_new, k_new)
            args = stub.calls[-1]
            assert args[0] is q_rows and args[3] is out and args[7] is k_new
        else:
            assert not layer_plan.run(q_rows, None, None, out)  # the pass needs its rows
            assert layer_plan.run(q_rows, k_new, k_new, out)
            assert stub.calls[-1] == (q_rows, out, k_new, k_new)
        outs.append(out)
    assert not torch.isnan(outs[1][0]).any() and torch.isnan(outs[1][1:301]).all()
    torch.testing.assert_close(outs[1], outs[0], equal_nan=True, rtol=0, atol=0)


def test_forced_splits_and_the_switch_keep_the_tl_passes(gluon_stub, monkeypatch):
    from pagedattn.ops.triton import launch

    _, plan = _plan_mixed(num_splits=2)
    assert plan.gluon is None and not gluon_stub
    monkeypatch.setattr(launch.SWITCHES, "gluon_prefill", False)
    _, plan = _plan_mixed()
    assert plan.gluon is None and not gluon_stub
    assert any(p.name in ("prefill", "hopper") for p in plan.launches)
