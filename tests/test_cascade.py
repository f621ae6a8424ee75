"""cascade_attention against the oracle, its plan (plan once, run per layer), and the
use_cascade_attention cost model."""

from __future__ import annotations

import pytest
import torch

import reference as ref
from conftest import FP8_TOLERANCE, TOLERANCE, assert_close, cu_seqlens, randn
from pagedattn.ops import (
    cascade_attention,
    flash_attn_varlen_func,
    merge_attn_states,
    use_cascade_attention,
)
from pagedattn.ops.cascade_plan import plan_cascade_attention


def shared_prefix_batch(prefix_len, query_lens, suffix_lens, num_heads=8, num_kv_heads=2,
                        head_size=32, head_size_v=None, block_size=16, dtype=torch.float32,
                        cache_dtype=None, seed=0):
    """A paged batch whose requests share their first prefix_len // block_size blocks."""
    g = torch.Generator().manual_seed(seed)
    prefix_blocks = prefix_len // block_size
    suffix_blocks = [-(-s // block_size) for s in suffix_lens]
    num_blocks = prefix_blocks + sum(suffix_blocks) + 2
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    table = torch.zeros(len(query_lens), prefix_blocks + max(suffix_blocks), dtype=torch.int32)
    table[:, :prefix_blocks] = perm[:prefix_blocks]
    start = prefix_blocks
    for r, n in enumerate(suffix_blocks):
        table[r, prefix_blocks:prefix_blocks + n] = perm[start:start + n]
        start += n

    def cache(d):
        return torch.randn(num_blocks, block_size, num_kv_heads, d, generator=g).to(
            cache_dtype or dtype)

    q = randn(sum(query_lens), num_heads, head_size, dtype=dtype, generator=g)
    return q, cache(head_size), cache(head_size_v or head_size), table


def run_cascade(q, k_cache, v_cache, table, prefix_len, query_lens, suffix_lens, out_dtype=None,
                **kwargs):
    seq_lens = [prefix_len + s for s in suffix_lens]
    out = torch.full((q.shape[0], q.shape[1], v_cache.shape[-1]), float("nan"),
                     dtype=out_dtype or q.dtype)
    cascade_attention(
        out, q, k_cache, v_cache, cu_query_lens=cu_seqlens(query_lens),
        max_query_len=max(query_lens), cu_prefix_query_lens=cu_seqlens([q.shape[0]]),
        prefix_kv_lens=torch.tensor([prefix_len], dtype=torch.int32),
        suffix_kv_lens=torch.tensor(suffix_lens, dtype=torch.int32), max_kv_len=max(seq_lens),
        softmax_scale=kwargs.pop("scale", 0.2), alibi_slopes=kwargs.pop("alibi", None),
        sliding_window=kwargs.pop("window", (-1, -1)), logits_soft_cap=kwargs.pop("softcap", 0.0),
        block_table=table, common_prefix_len=prefix_len, **kwargs)
    return out, seq_lens


@pytest.mark.parametrize("query_lens, suffix_lens", [
    ([1] * 6, [1, 5, 17, 2, 30, 1]),  # decodes
    ([4, 1, 9], [4, 3, 20]),  # chunked prefills whose context ends in the suffix
], ids=["decodes", "chunked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cascade_equals_plain_paged_attention(query_lens, suffix_lens, dtype):
    q, k, v, table = shared_prefix_batch(48, query_lens, suffix_lens, dtype=dtype)
    out, seq_lens = run_cascade(q, k, v, table, 48, query_lens, suffix_lens)
    want, _ = ref.paged_attention(q, k, v, query_lens, seq_lens, table, scale=0.2)
    assert_close(out, want, dtype)


@pytest.mark.parametrize("feature", ["softcap", "sinks", "gqa_mqa", "head_size_v"])
def test_cascade_features(feature):
    heads = dict(num_heads=8, num_kv_heads=1) if feature == "gqa_mqa" else {}
    dv = dict(head_size_v=16) if feature == "head_size_v" else {}
    query_lens, suffix_lens = [1, 3, 1, 2], [2, 3, 9, 16]
    q, k, v, table = shared_prefix_batch(32, query_lens, suffix_lens, **heads, **dv)
    sinks = torch.linspace(-1.0, 2.0, 8)
    extra = {"softcap": dict(softcap=2.0), "sinks": dict(s_aux=sinks)}.get(feature, {})
    out, seq_lens = run_cascade(q, k, v, table, 32, query_lens, suffix_lens, **extra)
    features = {"softcap": dict(softcap=2.0), "sinks": dict(sinks=sinks.tolist())}.get(
        feature, {})
    want, _ = ref.paged_attention(q, k, v, query_lens, seq_lens, table, scale=0.2, **features)
    assert_close(out, want)


@pytest.mark.parametrize("provider", ["torch", "triton"])
def test_a_plan_runs_layer_after_layer_exactly_as_the_op(provider, monkeypatch):
    """One plan for the batch, two layers' queries and sinks: each run equals the op."""
    monkeypatch.setenv("PAGEDATTN_OPS_PROVIDER", provider)  # triton: interpreted on a CPU
    query_lens, suffix_lens = [1, 3, 1, 2], [2, 3, 9, 16]
    q, k, v, table = shared_prefix_batch(32, query_lens, suffix_lens)
    seq_lens = [32 + s for s in suffix_lens]
    plan = plan_cascade_attention(
        cu_query_lens=cu_seqlens(query_lens), max_query_len=3,
        cu_prefix_query_lens=cu_seqlens([q.shape[0]]),
        prefix_kv_lens=torch.tensor([32], dtype=torch.int32),
        suffix_kv_lens=torch.tensor(suffix_lens, dtype=torch.int32), max_kv_len=max(seq_lens),
        block_table=table, common_prefix_len=32, num_tokens=q.shape[0], num_heads=8,
        num_kv_heads=2, head_size=32, page_size=16, q_dtype=torch.float32,
        kv_dtype=torch.float32, softmax_scale=0.2, use_sinks=True)
    for seed in (1, 2):
        layer_q = randn(*q.shape, generator=torch.Generator().manual_seed(seed))
        sinks = torch.rand(8, generator=torch.Generator().manual_seed(seed))
        out = torch.full_like(layer_q, float("nan"))
        plan.run(out, layer_q, k, v, s_aux=sinks)
        want, _ = run_cascade(layer_q, k, v, table, 32, query_lens, suffix_lens, s_aux=sinks)
        assert torch.equal(out, want)
        oracle, _ = ref.paged_attention(layer_q, k, v, query_lens, seq_lens, table, scale=0.2,
                                        sinks=sinks.tolist())
        assert_close(out, oracle)


def test_a_plan_needs_a_whole_page_prefix():
    with pytest.raises(ValueError, match=r"common_prefix_len=24 must be a positive multiple "
                                         r"of the page size 16"):
        plan_cascade_attention(
            cu_query_lens=cu_seqlens([1]), max_query_len=1, cu_prefix_query_lens=cu_seqlens([1]),
            prefix_kv_lens=torch.tensor([24], dtype=torch.int32),
            suffix_kv_lens=torch.tensor([3], dtype=torch.int32), max_kv_len=27,
            block_table=torch.zeros(1, 2, dtype=torch.int32), common_prefix_len=24,
            num_tokens=1, num_heads=8, num_kv_heads=2, head_size=32, page_size=16,
            q_dtype=torch.float32, kv_dtype=torch.float32, softmax_scale=0.2)


def test_cascade_reads_fp8_caches_and_queries_through_descales():
    query_lens, suffix_lens = [1, 1, 2], [3, 7, 2]
    q, k, v, table = shared_prefix_batch(32, query_lens, suffix_lens,
                                         cache_dtype=torch.float8_e4m3fn)
    q8 = q.to(torch.float8_e4m3fn)
    scales = {n: torch.tensor(s) for n, s in (("q", 0.5), ("k", 0.25), ("v", 2.0))}
    out, seq_lens = run_cascade(q8, k, v, table, 32, query_lens, suffix_lens,
                                out_dtype=torch.float32, q_descale=scales["q"],
                                k_descale=scales["k"], v_descale=scales["v"])
    want, _ = ref.paged_attention(q8, k, v, query_lens, seq_lens, table, scale=0.2, q_scale=0.5,
                                  k_scale=0.25, v_scale=2.0)
    assert_close(out, want, **FP8_TOLERANCE)
    assert_close(out, want, **TOLERANCE[torch.float32])  # same inputs: only fp32 rounding


def test_vllms_cascade_calls_with_an_fp8_query_and_no_out_run_and_merge():
    # vLLM's FLASH_ATTN cascade: two FlashAttention calls without `out` (an fp8 query gives
    # bf16, as FA3 returns), its descales expanded per pass, merged into the bf16 output.
    query_lens, suffix_lens = [1, 1, 2], [3, 7, 2]
    q, k, v, table = shared_prefix_batch(32, query_lens, suffix_lens, dtype=torch.bfloat16,
                                         cache_dtype=torch.float8_e4m3fn)
    q8 = q.to(torch.float8_e4m3fn)
    q_descale, k_descale, v_descale = torch.tensor(0.5), torch.tensor(0.25), torch.tensor(2.0)
    num_tokens, prefix = q8.shape[0], 32
    cu_prefix = cu_seqlens([num_tokens])
    common = dict(q=q8, k=k, v=v, softmax_scale=0.2, window_size=[-1, -1], softcap=0.0,
                  return_softmax_lse=True, fa_version=3)
    shape = (cu_prefix.shape[0] - 1, k.shape[-2])
    prefix_out, prefix_lse = flash_attn_varlen_func(
        cu_seqlens_q=cu_prefix, seqused_k=torch.tensor([prefix], dtype=torch.int32),
        max_seqlen_q=num_tokens, max_seqlen_k=prefix, causal=False, block_table=table[:1],
        q_descale=q_descale.expand(shape), k_descale=k_descale.expand(shape),
        v_descale=v_descale.expand(shape), **common)
    shape = (len(query_lens), k.shape[-2])
    suffix_out, suffix_lse = flash_attn_varlen_func(
        cu_seqlens_q=cu_seqlens(query_lens), seqused_k=torch.tensor(suffix_lens, dtype=torch.int32),
        max_seqlen_q=max(query_lens), max_seqlen_k=max(suffix_lens), causal=True,
        block_table=table[:, prefix // 16:], q_descale=q_descale.expand(shape),
        k_descale=k_descale.expand(shape), v_descale=v_descale.expand(shape), **common)
    assert prefix_out.dtype == suffix_out.dtype == torch.bfloat16
    output = torch.full((num_tokens, 8, 32), float("nan"), dtype=torch.bfloat16)
    merge_attn_states(output, prefix_out, prefix_lse, suffix_out, suffix_lse)
    seq_lens = [prefix + s for s in suffix_lens]
    want, _ = ref.paged_attention(q8, k, v, query_lens, seq_lens, table, scale=0.2, q_scale=0.5,
                                  k_scale=0.25, v_scale=2.0)
    assert_close(output, want, torch.bfloat16)
    # pagedattn's cascade_attention over the same fp8 query gives the same result.
    mine, _ = run_cascade(q8, k, v, table, prefix, query_lens, suffix_lens,
                          out_dtype=torch.bfloat16, q_descale=q_descale, k_descale=k_descale,
                          v_descale=v_descale)
    assert_close(mine, want, torch.bfloat16)


@pytest.mark.parametrize("kwargs, match", [
    (dict(alibi=torch.ones(8)), "ALiBi"),
    (dict(window=(7, 0)), "sliding_window"),
])
def test_cascade_refuses_position_dependent_features(kwargs, match):
    q, k, v, table = shared_prefix_batch(32, [1, 1], [1, 1])
    with pytest.raises(ValueError, match=match):
        run_cascade(q, k, v, table, 32, [1, 1], [1, 1], **kwargs)


def test_cascade_needs_a_whole_block_prefix():
    q, k, v, table = shared_prefix_batch(32, [1, 1], [1, 1])
    with pytest.raises(ValueError, match="multiple of block_size"):
        run_cascade(q, k, v, table, 24, [1, 1], [9, 9])


def _cascade_args(q, k, v, table, prefix_len, query_lens, suffix_lens):
    return dict(
        output=torch.empty_like(q), query=q, key_cache=k, value_cache=v,
        cu_query_lens=cu_seqlens(query_lens), max_query_len=max(query_lens),
        cu_prefix_query_lens=cu_seqlens([q.shape[0]]),
        prefix_kv_lens=torch.tensor([prefix_len], dtype=torch.int32),
        suffix_kv_lens=torch.tensor(suffix_lens, dtype=torch.int32),
        max_kv_len=prefix_len + max(suffix_lens), softmax_scale=0.2, alibi_slopes=None,
        sliding_window=(-1, -1), logits_soft_cap=0.0, block_table=table,
        common_prefix_len=prefix_len)


@pytest.mark.parametrize("change, error, match", [
    (lambda k, t: dict(key_cache=None), TypeError, "key_cache must be a torch.Tensor, got None"),
    (lambda k, t: dict(key_cache=k[None]), ValueError, "key_cache must have 4 dimensions"),
    (lambda k, t: dict(output=None), TypeError, "output must be a torch.Tensor, got None"),
    (lambda k, t: dict(cu_prefix_query_lens=cu_seqlens([1, 2])), ValueError,
     r"cu_prefix_query_lens has shape \(3,\); expected \(2,\)"),
    (lambda k, t: dict(prefix_kv_lens=torch.tensor([32, 32], dtype=torch.int32)), ValueError,
     r"prefix_kv_lens has shape \(2,\); expected \(1,\)"),
    (lambda k, t: dict(suffix_kv_lens=torch.tensor([3, 5], dtype=torch.int32)), ValueError,
     r"suffix_kv_lens has shape \(2,\); expected \(3,\)"),
    (lambda k, t: dict(block_table=t[:, :1]), ValueError,
     r"block_table has shape \(3, 1\); the prefix of 32 keys needs 2 columns"),
    (lambda k, t: dict(max_kv_len=16), ValueError, "max_kv_len=16 is below common_prefix_len"),
    (lambda k, t: dict(common_prefix_len="32"), TypeError, "common_prefix_len='32' must be an int"),
])
def test_cascade_arguments_are_checked_by_name(change, error, match):
    q, k, v, table = shared_prefix_batch(32, [1, 1, 1], [3, 5, 2])
    args = _cascade_args(q, k, v, table, 32, [1, 1, 1], [3, 5, 2])
    args.update(change(k, table))
    with pytest.raises(error, match=match):
        cascade_attention(**args)


# --- the cost model -----------------------------------------------------------------------
def decide(prefix=16384, query_lens=(1,) * 64, heads=(32, 8), alibi=False, window=False,
           local=False, num_sms=132):
    return use_cascade_attention(prefix, list(query_lens), heads[0], heads[1], alibi, window,
                                 local, num_sms)


def test_cost_model_chooses_cascade_for_many_decodes_over_a_long_prefix():
    assert decide()
    assert decide(prefix=8192)
    assert decide(prefix=512, query_lens=[1] * 256)
    # The prefix pass splits its keys (ops/triton), so fewer requests or keys pay already.
    assert decide(query_lens=[1] * 16)
    assert decide(prefix=8192, query_lens=[1] * 8)
    assert decide(prefix=2048)


@pytest.mark.parametrize("kwargs", [dict(alibi=True), dict(window=True), dict(local=True)])
def test_cost_model_never_chooses_cascade_where_it_is_wrong(kwargs):
    assert not decide(**kwargs)


@pytest.mark.parametrize("kwargs", [
    dict(prefix=128),  # too short a prefix to pay for two extra launches
    dict(query_lens=[1] * 4),  # too few requests
    dict(prefix=512),  # the extra passes cost what the prefix pass saves
    dict(prefix=2048, query_lens=[1] * 16),
    dict(query_lens=[512] * 16),  # prefills already share each tile among their rows
])
def test_cost_model_keeps_plain_attention_where_cascade_does_not_pay(kwargs):
    assert not decide(**kwargs)


@pytest.mark.parametrize("max_num_splits", [0, 3], ids=["auto", "split-prefix-pass"])
def test_cascade_on_the_triton_provider(monkeypatch, max_num_splits):
    """The Triton kernels (interpreted on a CPU) through the same two passes and merge; with
    forced splits the prefix pass (one long query) takes the split prefill path."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("CPU tensors run the Triton interpreter only on machines without CUDA")
    monkeypatch.setenv("PAGEDATTN_OPS_PROVIDER", "triton")
    query_lens, suffix_lens = [1, 7, 2], [1, 9, 17]  # 10 prefix-pass queries: prefill pass
    q, k, v, table = shared_prefix_batch(32, query_lens, suffix_lens, num_heads=4)
    sinks = torch.tensor([0.5, -1.0, 1.0, 0.0])
    out, seq_lens = run_cascade(q, k, v, table, 32, query_lens, suffix_lens, s_aux=sinks,
                                max_num_splits=max_num_splits)
    want, _ = ref.paged_attention(q, k, v, query_lens, seq_lens, table, scale=0.2,
                                  sinks=sinks.tolist())
    assert_close(out, want)
