"""Planned attention and cache writes: plan once per batch, run per layer.

On a CPU the Triton plans run under the interpreter at small sizes. The graph-bucket plan is
checked here without a graph: a plan made for a padded bucket (more tokens and requests,
keys up to max_model_len) must give a smaller, padded batch's result, which is what a
replayed CUDA graph relies on.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import reference as ref  # noqa: E402
from conftest import assert_close, cu_seqlens, make_paged_batch, poison  # noqa: E402
from pagedattn.ops import flash_attn_varlen_func  # noqa: E402
from pagedattn.ops.cache import plan_reshape_and_cache_flash  # noqa: E402
from pagedattn.ops.plan import plan_varlen_attention  # noqa: E402
from pagedattn.ops.triton import fast_launch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROVIDERS = ["triton", "torch"]


def plan_for(b, num_heads, num_kv_heads, head_size, provider, **kw):
    args = dict(cu_seqlens_q=b.cu_seqlens_q, num_tokens=b.total_q, max_seqlen_q=b.max_seqlen_q,
                max_seqlen_k=b.max_seqlen_k, num_heads=num_heads, num_kv_heads=num_kv_heads,
                head_size=head_size, q_dtype=b.q.dtype, kv_dtype=b.k_cache.dtype,
                seqused_k=b.seqused_k, block_table=b.block_table,
                page_size=b.k_cache.shape[1], softmax_scale=head_size ** -0.5, causal=True,
                provider=provider)
    return plan_varlen_attention(**{**args, **kw})


@pytest.mark.parametrize("provider", PROVIDERS)
def test_one_plan_runs_every_layer_of_a_step(provider):
    """Two layers (own caches and queries) share one plan; each matches the oracle."""
    lens_q, lens_k = [1, 6, 1], [37, 20, 9]
    layers = [make_paged_batch(lens_q, lens_k, 4, 2, 32, seed=s, device=DEVICE) for s in (0, 1)]
    # Both layers read the same block table: the batch is the same, only the data differ.
    layers[1].block_table.copy_(layers[0].block_table)
    plan = plan_for(layers[0], 4, 2, 32, provider, return_softmax_lse=True)
    for b in layers:
        out = poison((b.total_q, 4, 32), torch.float32, DEVICE)
        lse = poison((4, b.total_q), torch.float32, DEVICE)
        plan.run(b.q, b.k_cache, b.v_cache, out, softmax_lse=lse)
        want, want_lse = ref.paged_attention(b.q.cpu(), b.k_cache.cpu(), b.v_cache.cpu(),
                                             lens_q, lens_k, layers[0].block_table.cpu(),
                                             scale=32 ** -0.5, causal=True)
        assert_close(out, want)
        assert_close(lse, want_lse, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_graph_bucket_plan_serves_a_smaller_padded_mixed_batch(provider):
    """Planned for 24 tokens, 4 requests and 128 keys; run on 2 real requests (a chunk and a
    decode), padded as a builder pads a replayed batch: empty requests, spare tokens."""
    lens_q, lens_k = [9, 1], [30, 50]
    b = make_paged_batch(lens_q, lens_k, 4, 2, 32, device=DEVICE, seed=3)
    tokens, reqs = 24, 4
    q = torch.cat([b.q, torch.randn(tokens - b.total_q, 4, 32, device=DEVICE)])
    cu_q = cu_seqlens(lens_q + [0] * (reqs - 2), DEVICE)
    seqused = torch.tensor(lens_k + [0] * (reqs - 2), dtype=torch.int32, device=DEVICE)
    # The builder's table: as wide as max_model_len, padded requests' rows unused.
    table = torch.zeros(reqs, 128 // b.k_cache.shape[1], dtype=torch.int32, device=DEVICE)
    table[:2, :b.block_table.shape[1]] = b.block_table
    plan = plan_varlen_attention(
        cu_seqlens_q=cu_q, num_tokens=tokens, max_seqlen_q=tokens, max_seqlen_k=128,
        num_heads=4, num_kv_heads=2, head_size=32, q_dtype=q.dtype, kv_dtype=q.dtype,
        seqused_k=seqused, block_table=table, page_size=b.k_cache.shape[1], causal=True,
        cuda_graph=True, provider=provider)
    out = poison((tokens, 4, 32), torch.float32, DEVICE)
    plan.run(q, b.k_cache, b.v_cache, out)
    want, _ = ref.paged_attention(b.q.cpu(), b.k_cache.cpu(), b.v_cache.cpu(), lens_q, lens_k,
                                  b.block_table.cpu(), scale=32 ** -0.5, causal=True)
    assert_close(out[:b.total_q], want)


@pytest.mark.parametrize("shape", [(), (1,)])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_per_tensor_descales_broadcast(shape, provider, monkeypatch):
    monkeypatch.setenv("PAGEDATTN_OPS_PROVIDER", provider)
    b = make_paged_batch([2, 1], [19, 33], 4, 2, 32, cache_dtype=torch.float8_e4m3fn,
                         device=DEVICE, seed=5)
    k_scale, v_scale = 0.5, 2.0
    out = poison((b.total_q, 4, 32), torch.float32, DEVICE)
    flash_attn_varlen_func(
        b.q, b.k_cache, b.v_cache, b.max_seqlen_q, b.cu_seqlens_q, b.max_seqlen_k,
        seqused_k=b.seqused_k, block_table=b.block_table, causal=True, out=out,
        k_descale=torch.full(shape, k_scale, device=DEVICE),
        v_descale=torch.full(shape, v_scale, device=DEVICE))
    want, _ = ref.paged_attention(b.q.cpu(), b.k_cache.cpu(), b.v_cache.cpu(), b.query_lens,
                                  b.seq_lens, b.block_table.cpu(), k_scale=k_scale,
                                  v_scale=v_scale, scale=32 ** -0.5, causal=True)
    assert_close(out, want)


def test_descale_of_another_shape_is_refused_by_name():
    b = make_paged_batch([1], [5], 4, 2, 32, device=DEVICE)
    with pytest.raises(ValueError, match=r"k_descale has shape \(3,\)"):
        flash_attn_varlen_func(b.q, b.k_cache, b.v_cache, 1, b.cu_seqlens_q, 5,
                               seqused_k=b.seqused_k, block_table=b.block_table,
                               k_descale=torch.ones(3, device=DEVICE))


def test_run_refuses_a_query_the_plan_was_not_made_for():
    b = make_paged_batch([2, 1], [9, 4], 4, 2, 32, device=DEVICE)
    plan = plan_for(b, 4, 2, 32, "torch")
    with pytest.raises(ValueError, match="this plan was made for"):
        plan.run(b.q[:2], b.k_cache, b.v_cache)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_planned_cache_write_matches_the_oracle(provider):
    num_blocks, block_size = 6, 16
    key_cache = torch.zeros(num_blocks, block_size, 2, 32, device=DEVICE)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.tensor([17, -1, 3, 90], dtype=torch.int64, device=DEVICE)
    plan = plan_reshape_and_cache_flash(slots, num_kv_heads=2, head_size=32,
                                        page_size=block_size, cache_dtype=torch.float32,
                                        provider=provider)
    for _layer in range(2):  # one plan, two layers' tensors
        key = torch.randn(4, 2, 32, device=DEVICE)
        value = torch.randn(4, 2, 32, device=DEVICE)
        want_k = ref.cache_after_write(key_cache.cpu(), key.cpu(), slots.cpu())
        want_v = ref.cache_after_write(value_cache.cpu(), value.cpu(), slots.cpu())
        plan.run(key, value, key_cache, value_cache)
        assert torch.equal(key_cache.cpu(), want_k) and torch.equal(value_cache.cpu(), want_v)


def test_a_step_plans_once_in_the_build_for_all_its_layers(monkeypatch):
    from conftest import LayerRunner, check_step, make_layers
    from pagedattn.backends import paged_plans
    from pagedattn.backends.flash_attn import FlashAttentionBackend

    made = []
    real = paged_plans.plan_varlen_attention
    monkeypatch.setattr(paged_plans, "plan_varlen_attention",
                        lambda **kw: made.append(1) or real(**kw))
    run = LayerRunner(make_layers(FlashAttentionBackend, n=3))
    built = run.builder.build
    run.builder.build = lambda *args: made.append("build") or built(*args)
    check_step(run.step([0, 1], [5, 1]))
    check_step(run.step([0, 1], [1, 1]))
    assert made == ["build", 1, "build", 1]  # three layers of one kind; no layer call plans


def test_layers_on_the_triton_provider_run_the_planned_path(monkeypatch):
    """FLASH_ATTN layers with Triton kernels (the interpreter on a CPU): cache write and
    attention through the impl's plans, over two steps, against the oracle."""
    from conftest import LayerRunner, check_step, make_layers
    from pagedattn.backends.flash_attn import FlashAttentionBackend

    monkeypatch.setenv("PAGEDATTN_OPS_PROVIDER", "triton")
    layers = make_layers(FlashAttentionBackend, n=2, num_heads=4, num_kv_heads=2,
                         head_size=32)
    run = LayerRunner(layers, device=DEVICE)
    check_step(run.step([0, 1], [6, 1]))
    check_step(run.step([0, 1], [1, 1]))


def test_specialisation_keys_follow_tritons_rules():
    assert fast_launch.int_key([1, 32, 7]) == (
        (True, False, True), (False, True, True), (False, False, True))
    x = torch.zeros(8)
    assert fast_launch.tensor_key([x, x[1:]]) == ((torch.float32, True),
                                                  (torch.float32, False))
    assert fast_launch.aligned(x) and not fast_launch.aligned(x, x[1:])
