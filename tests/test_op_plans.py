"""The op's kept plans (ops/triton/op_plans.py): a later call of the same batch runs the plan
the first made, with the same bits; anything a plan depends on (lengths, tensors, switches)
plans again."""

from __future__ import annotations

import inspect

import pytest
import torch

pytest.importorskip("triton")

import reference as ref  # noqa: E402
from conftest import (  # noqa: E402
    assert_close,
    cu_seqlens,
    make_paged_batch,
    randn,
)
from pagedattn.ops.triton import launch, op_plans  # noqa: E402
from pagedattn.ops.triton.attention_plan import plan_attention  # noqa: E402

FP8 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def _no_kept_plans():
    op_plans.clear()
    yield
    op_plans.clear()


def run_op(b, q, out, poisoned=True, **extra) -> torch.Tensor:
    if poisoned:
        out.fill_(float("nan"))
    op_plans.varlen_attention(
        q, b.k_cache, b.v_cache, out, cu_seqlens_q=b.cu_seqlens_q, seqused_k=b.seqused_k,
        cu_seqlens_k=None, block_table=b.block_table, max_seqlen_q=b.max_seqlen_q,
        max_seqlen_k=b.max_seqlen_k, softmax_scale=q.shape[2] ** -0.5, causal=True,
        window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, sinks=None,
        q_descale=None, k_descale=None, v_descale=None, softmax_lse=None, **extra)
    return out.clone()


def gpu_batch():
    """The GPU tests' batch: bf16, a decode beside two prompts, GQA 4, head 64."""
    return make_paged_batch([5, 1, 40], [40, 9, 40], num_heads=8, num_kv_heads=2, head_size=64,
                            dtype=torch.bfloat16, device="cuda")


def oracle(b, q) -> torch.Tensor:
    out, _ = ref.paged_attention(q, b.k_cache, b.v_cache, b.query_lens, b.seq_lens,
                                 b.block_table, scale=q.shape[2] ** -0.5, causal=True)
    return out


@pytest.mark.parametrize("query_lens, seq_lens", [([5, 1, 17], [40, 9, 17]), ([1, 1], [30, 70])])
def test_a_later_call_runs_the_kept_plan_and_gives_the_uncached_bits(query_lens, seq_lens,
                                                                     monkeypatch):
    b = make_paged_batch(query_lens, seq_lens, num_heads=4, num_kv_heads=2, head_size=32)
    out = torch.empty_like(b.q)
    first = run_op(b, b.q, out)
    assert op_plans.kept() == 1
    q2 = randn(*b.q.shape, generator=torch.Generator().manual_seed(7))
    second = run_op(b, q2, out)  # the kept plan, another layer's query
    assert op_plans.kept() == 1
    assert_close(first, oracle(b, b.q))
    assert_close(second, oracle(b, q2))
    monkeypatch.setattr(op_plans, "OP_PLANS", 0)  # planned afresh, as before plans were kept
    assert torch.equal(run_op(b, q2, out), second)
    assert torch.equal(run_op(b, b.q, out), first)


def test_the_same_arguments_return_the_same_plan_and_others_a_new_one():
    b = make_paged_batch([3, 9], [20, 9], num_heads=4, num_kv_heads=2, head_size=32)
    args = b.plan_args()
    plan = op_plans.plan_for(**args)
    assert op_plans.plan_for(**args) is plan
    # a view of the same memory is the same metadata; a copy (other memory) is not
    assert op_plans.plan_for(**dict(args, block_table=b.block_table[:])) is plan
    other = op_plans.plan_for(**dict(args, block_table=b.block_table.clone()))
    assert other is not plan and other.gluon is None
    longer = op_plans.plan_for(**dict(args, max_seqlen_k=b.max_seqlen_k + 16))
    assert longer is not plan and op_plans.kept() == 3
    assert op_plans.plan_for(**args) is plan  # still kept


def test_at_most_op_plans_are_kept_the_oldest_first_out(monkeypatch):
    monkeypatch.setattr(op_plans, "OP_PLANS", 2)
    b = make_paged_batch([3, 9], [20, 9], num_heads=4, num_kv_heads=2, head_size=32)
    args = b.plan_args()
    plans = [op_plans.plan_for(**dict(args, max_seqlen_k=b.max_seqlen_k + 16 * i))
             for i in range(3)]
    assert op_plans.kept() == 2
    assert op_plans.plan_for(**dict(args, max_seqlen_k=b.max_seqlen_k + 32)) is plans[2]
    assert op_plans.plan_for(**args) is not plans[0]  # the oldest went first
    monkeypatch.setattr(op_plans, "OP_PLANS", 0)
    assert op_plans.plan_for(**args) is not op_plans.plan_for(**args)


def test_a_flipped_switch_plans_again_and_gives_its_own_result(monkeypatch):
    # fp16_dot_for_fp8_kv: an fp8 cache's products in fp16, or in the interpreter's float32
    b = make_paged_batch([6, 1], [30, 12], num_heads=4, num_kv_heads=2, head_size=32,
                         dtype=torch.bfloat16, cache_dtype=FP8)
    out = torch.empty_like(b.q)
    on = run_op(b, b.q, out)
    monkeypatch.setattr(launch.SWITCHES, "fp16_dot_for_fp8_kv", False)
    off = run_op(b, b.q, out)
    assert op_plans.kept() == 2  # the op planned again
    monkeypatch.setattr(launch.SWITCHES, "fp16_dot_for_fp8_kv", True)
    plan_on = op_plans.plan_for(**b.plan_args())
    monkeypatch.setattr(launch.SWITCHES, "fp16_dot_for_fp8_kv", False)
    plan_off = op_plans.plan_for(**b.plan_args())
    assert plan_off is not plan_on
    dots = {pl.constexprs["DOT_DTYPE"] for pl in plan_off.launches}
    assert dots == {pl.constexprs["DOT_DTYPE"]
                    for pl in plan_attention(**b.plan_args()).launches} != \
        {pl.constexprs["DOT_DTYPE"] for pl in plan_on.launches}
    assert not torch.equal(on, off)  # fp16 products round apart from float32 ones
    want = oracle(b, b.q)
    assert_close(off, want, torch.bfloat16)
    assert_close(on, want, torch.bfloat16)
    monkeypatch.setattr(launch.SWITCHES, "fp16_dot_for_fp8_kv", True)
    assert op_plans.plan_for(**b.plan_args()) is plan_on
    assert torch.equal(run_op(b, b.q, out), on)


def test_a_switch_that_holds_a_dict_plans_every_call(monkeypatch):
    b = make_paged_batch([3, 9], [20, 9], num_heads=4, num_kv_heads=2, head_size=32)
    monkeypatch.setattr(launch.SWITCHES, "hopper_tiles", {128: (64, 64, 4, 3)})
    assert op_plans.plan_for(**b.plan_args()) is not op_plans.plan_for(**b.plan_args())
    assert op_plans.kept() == 0


def test_the_key_describes_every_tensor_plan_attention_takes():
    tensors = {name for name, p in inspect.signature(plan_attention).parameters.items()
               if "Tensor" in str(p.annotation)}
    assert tensors == set(op_plans.METADATA)


@pytest.mark.parametrize("switch, value", [("gluon_max_slack", 2), ("gluon_consumers", 3),
                                           ("gluon_fp8_wide_tiles", False),
                                           ("invariant_split_keys", 512)])
def test_any_switch_flipped_plans_again(switch, value, monkeypatch):
    # Every switch is in the key, those the Gluon schedule reads on sm_90 included
    b = make_paged_batch([3, 9], [20, 9], num_heads=4, num_kv_heads=2, head_size=32)
    plan = op_plans.plan_for(**b.plan_args())
    key = op_plans.plan_key(b.plan_args())
    monkeypatch.setattr(launch.SWITCHES, switch, value)
    assert op_plans.plan_key(b.plan_args()) != key
    assert op_plans.plan_for(**b.plan_args()) is not plan
    monkeypatch.undo()
    assert op_plans.plan_for(**b.plan_args()) is plan


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_captured_call_keeps_no_plan_and_replays_the_eager_bits():
    b = gpu_batch()
    out = torch.empty_like(b.q)
    eager = run_op(b, b.q, out)
    assert op_plans.kept() == 1
    op_plans.clear()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run_op(b, b.q, out)  # warm (compiles) on the capture's stream
    torch.cuda.current_stream().wait_stream(stream)
    kept = op_plans.kept()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_op(b, b.q, out, poisoned=False)
    assert op_plans.kept() == kept  # planned inside the capture, not kept
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    assert_close(out, oracle(b, b.q), torch.bfloat16)


def test_the_public_op_keeps_its_plans_and_a_builder_plan_is_its_own(monkeypatch):
    from pagedattn.ops.attention import flash_attn_varlen_func
    from pagedattn.ops.plan import plan_varlen_attention

    monkeypatch.setenv("PAGEDATTN_OPS_PROVIDER", "triton")
    b = make_paged_batch([4, 1, 9], [30, 9, 9], num_heads=4, num_kv_heads=2, head_size=32)

    def op(q):
        return flash_attn_varlen_func(
            q, b.k_cache, b.v_cache, max_seqlen_q=b.max_seqlen_q, cu_seqlens_q=b.cu_seqlens_q,
            max_seqlen_k=b.max_seqlen_k, seqused_k=b.seqused_k, block_table=b.block_table,
            causal=True)
    first = op(b.q)
    assert op_plans.kept() == 1
    q2 = randn(*b.q.shape, generator=torch.Generator().manual_seed(3))
    second = op(q2)
    assert op_plans.kept() == 1
    assert_close(first, oracle(b, b.q))
    assert_close(second, oracle(b, q2))
    monkeypatch.setattr(op_plans, "OP_PLANS", 0)
    assert torch.equal(op(q2), second)
    monkeypatch.setattr(op_plans, "OP_PLANS", 4)
    plan_varlen_attention(  # a builder's plan: made afresh, not kept
        cu_seqlens_q=b.cu_seqlens_q, num_tokens=b.total_q, max_seqlen_q=b.max_seqlen_q,
        max_seqlen_k=b.max_seqlen_k, num_heads=4, num_kv_heads=2, head_size=32,
        q_dtype=b.q.dtype, kv_dtype=b.k_cache.dtype, seqused_k=b.seqused_k,
        block_table=b.block_table, page_size=b.k_cache.shape[1], causal=True)
    assert op_plans.kept() == 1


def test_dense_keys_without_seqused_k_keep_no_plan(monkeypatch):
    # The op derives keys per request from cu_seqlens_k: new memory each call, never met again
    from pagedattn.ops.attention import flash_attn_varlen_func

    monkeypatch.setenv("PAGEDATTN_OPS_PROVIDER", "triton")
    g = torch.Generator().manual_seed(5)
    q, k, v = (randn(n, h, 32, generator=g) for n, h in ((12, 4), (20, 2), (20, 2)))
    out = flash_attn_varlen_func(q, k, v, max_seqlen_q=8, cu_seqlens_q=cu_seqlens([4, 8]),
                                 max_seqlen_k=12, cu_seqlens_k=cu_seqlens([8, 12]), causal=True)
    assert op_plans.kept() == 0
    want, _ = ref.varlen_attention(q, k, v, [4, 8], [8, 12], scale=32 ** -0.5, causal=True)
    assert_close(out, want)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_each_stream_keeps_its_own_plan():
    # A plan's scratch is shared in stream order only: another stream plans its own
    b = gpu_batch()
    out = torch.empty_like(b.q)
    first = run_op(b, b.q, out)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = run_op(b, b.q, torch.empty_like(b.q))
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert op_plans.kept() == 2
    assert torch.equal(on_side, first)
    assert_close(first, oracle(b, b.q), torch.bfloat16)
