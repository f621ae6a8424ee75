"""The builder's plans (backends/paged_plans.py): made in build() per kind of layer, in the
frozen metadata as it is made, run by each layer through its entry (made at its first call);
against the oracle, with poisoned outputs where a layer writes into a given buffer."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import reference as ref
from conftest import (
    FP8_TOLERANCE,
    LayerRunner,
    assert_close,
    cached,
    check_step,
    make_layers,
    poison,
    randn,
)
from pagedattn import Attention, CacheConfig, model_scope, set_forward_context
from pagedattn.backends.flash_attn import FlashAttentionBackend
from pagedattn.backends.paged_plans import PagedPlans
from pagedattn.backends.torch_sdpa import TorchSDPABackend

BACKENDS = [TorchSDPABackend, FlashAttentionBackend]


@pytest.fixture(params=BACKENDS, ids=lambda b: b.get_name())
def backend(request):
    return request.param


def ran_the_plans_of(md, layers) -> bool:
    """Whether each layer's call ran its kind's plans of `md` (its entry, made at its call)."""
    return all(md.plans.layers[layer.impl].plans in md.plans.kinds for layer in layers)


def test_layers_of_one_kind_share_one_plan_and_launch_it(backend):
    layers = make_layers(backend, 3, sinks=torch.tensor([0.5] * 8), logits_soft_cap=10.0)
    run = LayerRunner(layers)
    check_step(run.step([0, 1], [9, 4]))
    check_step(run.step([0, 1], [1, 1]))
    md, _ = run.metadata([0], [1])
    (plans,) = md.plans.kinds
    assert isinstance(plans, PagedPlans) and plans.num_tokens == 1
    with set_forward_context(md):
        for layer in layers.values():
            layer(randn(1, 512), randn(1, 128), randn(1, 128))
    assert ran_the_plans_of(md, layers.values())


def test_kinds_follow_what_planning_reads(backend):
    """Layers that differ in heads, window or cache sharing get their own plans."""
    with model_scope():
        layers = {
            "a": Attention(8, 64, 0.125, 2, prefix="a", attn_backend=backend),
            "b": Attention(8, 64, 0.125, 2, prefix="b", attn_backend=backend),
            "w": Attention(8, 64, 0.125, 2, prefix="w", attn_backend=backend,
                           per_layer_sliding_window=5),
            "s": Attention(8, 64, 0.125, 2, prefix="s", attn_backend=backend,
                           kv_sharing_target_layer_name="a"),
            "h": Attention(4, 64, 0.125, 2, prefix="h", attn_backend=backend),
        }
    run = LayerRunner(layers)
    check_step(run.step([0, 1], [12, 5]))
    md, _ = run.metadata([0, 1], [1, 1])
    assert len(md.plans.kinds) == 4  # a and b share; w, s and h each have their own


def test_a_layer_the_builder_does_not_serve_is_named_in_the_error(backend):
    layers = make_layers(backend, 1)
    run = LayerRunner(layers)
    with model_scope():
        other = Attention(8, 64, 0.125, 2, prefix="other.attn", attn_backend=backend)
    other.kv_cache = [run.caches["layers.0.attn"]]
    md, _ = run.metadata([0], [3])
    with set_forward_context(md), pytest.raises(
            ValueError, match=r"layer 'other.attn' is not among .*\['layers.0.attn'\]"):
        other(randn(3, 512), randn(3, 128), randn(3, 128))


def test_metadata_is_frozen_and_a_replaced_copy_is_planned_by_one_call(backend):
    layers = make_layers(backend, 1)
    layer = layers["layers.0.attn"]
    run = LayerRunner(layers)
    run.step([0], [5])
    md, _ = run.metadata([0], [3])
    with pytest.raises(dataclasses.FrozenInstanceError):
        md.max_seq_len = 100
    copy = dataclasses.replace(md, causal=True)
    assert md.plans is not None and copy.plans is None
    q, k, v = randn(3, 512), randn(3, 128), randn(3, 128)
    builder = type(run.builder).__name__
    with set_forward_context(copy), pytest.raises(
            ValueError, match=rf"layer 'layers.0.attn': this {type(md).__name__} carries no "
                              rf"plans: make it with {builder}\(...\).build\(\), or plan"):
        layer(q, k, v)
    with set_forward_context(md):
        planned = layer(q, k, v)
    with set_forward_context(run.builder.plan(copy)):  # the same keys into the same slots
        replanned = layer(q, k, v)
    torch.testing.assert_close(replanned, planned)


def expected(layer, q, md, query_lens, seq_lens):
    """The oracle over the layer's cache as it is now (after the call's write)."""
    cache = layer.kv_cache[0]
    want, _ = ref.paged_attention(q.view(-1, 8, 64), cache[0], cache[1], query_lens, seq_lens,
                                  md.block_table, scale=64 ** -0.5, causal=True)
    return want


def test_a_layer_made_after_the_builder_under_its_name_is_served(backend):
    layers = make_layers(backend, 1)
    run = LayerRunner(layers)
    run.step([0], [4])
    with model_scope():  # the same configuration and name, a new object
        twin = Attention(8, 64, 64 ** -0.5, 2, prefix="layers.0.attn", attn_backend=backend,
                         cache_config=CacheConfig(block_size=16))
    twin.kv_cache = [run.caches["layers.0.attn"]]
    md, seq_lens = run.metadata([0], [1])
    q = randn(1, 512)
    with set_forward_context(md):
        out = twin(q, randn(1, 128), randn(1, 128))
    assert_close(out.view(1, 8, 64), expected(twin, q, md, [1], seq_lens))
    assert ran_the_plans_of(md, [twin])


def test_the_impl_writes_into_the_given_output_with_the_builders_plans(backend):
    layers = make_layers(backend, 1)
    layer = layers["layers.0.attn"]
    run = LayerRunner(layers)
    run.step([0, 1], [6, 2])
    md, seq_lens = run.metadata([0, 1], [1, 1])
    q, k, v = randn(3, 8, 64), randn(3, 2, 64), randn(3, 2, 64)  # one padding token
    out = poison((3, 8, 64), torch.float32)
    layer.impl.forward(layer, q, k, v, layer.kv_cache[0], md, output=out)
    assert ran_the_plans_of(md, [layer])
    assert_close(out[:2], expected(layer, q[:2], md, [1, 1], seq_lens))
    assert torch.equal(out[2], torch.zeros(8, 64))  # the padding row


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_padded_prefill_through_the_builders_plans():
    """On the GPU (Triton; on an H100 the prefill's Hopper pass, which reads the new keys
    densely): a padded chunked step through the impl, against the oracle."""
    dtype = torch.bfloat16
    layers = make_layers(FlashAttentionBackend, 1, 32, 8, 128, dtype=dtype)
    layer = layers["layers.0.attn"].to("cuda")
    run = LayerRunner(layers, num_blocks=256, dtype=dtype, device="cuda")
    check_step(run.step([0, 1], [700, 40]), dtype)
    md, seq_lens = run.metadata([0, 1, 2], [300, 1, 513])
    n = 814
    q, k, v = (randn(n + 5, h, 128, dtype=dtype, device="cuda") for h in (32, 8, 8))
    out = poison((n + 5, 32, 128), dtype, "cuda")
    layer.impl.forward(layer, q, k, v, layer.kv_cache[0], md, output=out)
    cache = layer.kv_cache[0].cpu()
    want, _ = ref.paged_attention(q[:n].cpu(), cache[0], cache[1], [300, 1, 513], seq_lens,
                                  md.block_table.cpu(), scale=128 ** -0.5, causal=True)
    assert_close(out[:n].cpu(), want, dtype)
    assert torch.equal(out[n:].cpu(), torch.zeros(5, 32, 128, dtype=dtype))


@pytest.mark.parametrize("provider", ["triton", "torch"])
def test_steps_with_equal_planning_ints_share_their_plans_and_stay_exact(provider, monkeypatch):
    """FLASH_ATTN reuses a step's Triton plans for a later step of the same size and bounds;
    the reused plans read the later step's lengths and block table. PyTorch plans read them
    when made, so each step makes its own."""
    monkeypatch.setenv("PAGEDATTN_OPS_PROVIDER", provider)  # Triton: interpreted on a CPU
    layers = make_layers(FlashAttentionBackend, 2)
    run = LayerRunner(layers)
    check_step(run.step([0, 1], [9, 4]))
    check_step(run.step([2, 3], [9, 4]))  # other requests, other blocks, same ints
    first, _ = run.metadata([4, 5], [6, 6])
    again, _ = run.metadata([6, 7], [6, 6])
    longer, _ = run.metadata([6, 7], [6, 6])  # the same tokens, longer sequences
    assert (again.plans is first.plans) == (provider == "triton") and again is not first
    assert longer.plans is not first.plans


def test_key_bound_keeps_four_significant_bits():
    from pagedattn.backends.flash_attn import key_bound

    assert [key_bound(n) for n in (1, 16, 17, 31, 1024, 1025, 1152, 1153, 40000)] == \
        [1, 16, 18, 32, 1024, 1152, 1152, 1280, 40960]
    for n in range(1, 5000):
        assert n <= key_bound(n) <= n * 1.125 + 1


# --- a layer's plan: the provider's plan of its caches and tensors, made at its first call -----
def _spy_layer_plans(monkeypatch):
    """Record which plans each call ran: the provider's plan of the layer (its kind's plans)
    or, where that refused the call or none exists, the plans' own run (None)."""
    from pagedattn.ops.triton import layer_plan

    ran = []
    layer_run, plain_run = layer_plan.TritonLayerPlan.run, PagedPlans.run

    def spy_layer(self, *args):
        done = layer_run(self, *args)
        ran.append(self if done else "refused")
        return done

    def spy_run(self, *args):
        ran.append(None)
        plain_run(self, *args)

    monkeypatch.setattr(layer_plan.TritonLayerPlan, "run", spy_layer)
    monkeypatch.setattr(PagedPlans, "run", spy_run)
    return ran


@pytest.mark.parametrize("features", [{}, dict(alibi_slopes=[0.5, 0.25, 0.1, 0.05]),
                                      dict(cache_dtype="fp8")], ids=["plain", "alibi", "fp8"])
def test_a_layer_runs_the_plan_made_at_its_first_call_and_each_call_is_exact(features,
                                                                            monkeypatch):
    monkeypatch.setenv("PAGEDATTN_OPS_PROVIDER", "triton")  # interpreted on a CPU
    cache_dtype = features.pop("cache_dtype", "auto")
    layers = make_layers(FlashAttentionBackend, num_heads=4, head_size=32,
                         cache_dtype=cache_dtype, **features)
    layer = layers["layers.0.attn"]
    run = LayerRunner(layers)
    ran = _spy_layer_plans(monkeypatch)
    for query_lens in ([5, 3], [4, 4], [1, 1]):  # new plans each step, two of 8 tokens
        md, _ = run.metadata([0, 1], query_lens)
        for _ in range(3):
            q, k, v = randn(sum(query_lens), 128), randn(sum(query_lens), 64), \
                randn(sum(query_lens), 64)
            with set_forward_context(md):
                out = layer(q, k, v)
            cache = run.caches["layers.0.attn"]
            want, _ = ref.paged_attention(
                cached(q.view(-1, 4, 32), layer, 1.0), ref.dequantize(cache[0], 1.0),
                ref.dequantize(cache[1], 1.0), query_lens, md.seq_lens.tolist(),
                md.block_table, scale=32 ** -0.5, alibi_slopes=features.get("alibi_slopes"))
            assert_close(out.view(-1, 4, 32), want,
                         **(FP8_TOLERANCE if cache_dtype == "fp8" else {}))
        # the first call made the layer's plan, and every call ran it
        planned = md.plans.layers[layer.impl]
        assert planned.plans is md.plans.kinds[0] and planned.run is not None
        assert ran[-3:] == [planned.run.__self__] * 3, ran[-3:]


def test_a_layer_whose_tensors_changed_is_planned_again_and_padded_calls_run_the_plans(
        monkeypatch):
    monkeypatch.setenv("PAGEDATTN_OPS_PROVIDER", "triton")
    layers = make_layers(FlashAttentionBackend, num_heads=4, head_size=32)
    layer = layers["layers.0.attn"]
    run = LayerRunner(layers)
    ran = _spy_layer_plans(monkeypatch)
    md, _ = run.metadata([0, 1], [5, 3])
    q, k, v = randn(10, 128), randn(10, 64), randn(10, 64)  # 2 padding rows
    with set_forward_context(md):
        for _ in range(2):
            layer(q[:8], k[:8], v[:8])
        first = md.plans.layers[layer.impl]
        assert ran[-2:] == [first.run.__self__] * 2
        layer._k_scale = layer._k_scale.clone()  # a new scale tensor: a new plan of the layer
        layer(q[:8], k[:8], v[:8])
        again = md.plans.layers[layer.impl]
        assert again is not first and again.k_scale is layer._k_scale
        assert ran[-1] is again.run.__self__
        out = layer(q, k, v)  # padded: the plans' own run
        assert ran[-2:] == ["refused", None]
    assert torch.equal(out[8:], torch.zeros(2, 128))
    cache = run.caches["layers.0.attn"]
    want, _ = ref.paged_attention(q[:8].view(8, 4, 32), cache[0], cache[1], [5, 3], [5, 3],
                                  md.block_table, scale=32 ** -0.5)
    assert_close(out[:8].view(8, 4, 32), want)


def test_a_layer_whose_cache_differs_from_the_plans_is_refused(backend):
    layers = make_layers(backend, 1)
    layer = layers["layers.0.attn"]
    run = LayerRunner(layers)
    md, _ = run.metadata([0], [3])
    layer.kv_cache = [torch.zeros(2, 64, 8, 2, 64)]  # block size 8; the spec's is 16
    with set_forward_context(md), pytest.raises(
            ValueError, match=r"layer 'layers.0.attn' has a cache of block size 8, .* but the "
                              r"step was planned for 16"):
        layer(randn(3, 512), randn(3, 128), randn(3, 128))
