"""The FLASH_ATTN backend through the Attention layer, against the oracle, step by step."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import FP8_TOLERANCE, TOLERANCE, LayerRunner, check_step, make_layers, set_scales
from pagedattn import (
    Attention,
    AttentionCGSupport,
    CommonAttentionMetadata,
    EngineConfig,
    model_scope,
)
from pagedattn.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadata,
    FlashAttentionMetadataBuilder,
    cascade_attention,
    use_cascade_attention,
)
from pagedattn.metadata import AttentionSpec


class SharedPrefixRunner(LayerRunner):
    """A LayerRunner whose requests can fork a prefix (share its cache blocks), recording the
    metadata of each step. Where cascade is enabled, the cost model is bypassed (its choices
    are tested on their own), so small batches take the cascade path."""

    def __init__(self, layers, enable_cascade=True, **kwargs):
        super().__init__(layers, engine_config=EngineConfig(enable_cascade=enable_cascade),
                         **kwargs)
        self.builder.use_cascade_attention = lambda *args, **kwargs: True
        self.built: list[FlashAttentionMetadata] = []
        build = self.builder.build
        self.builder.build = lambda *a, **k: self.built.append(build(*a, **k)) or self.built[-1]

    def fork(self, src, dst) -> None:
        """dst starts as src's whole-block prefix (its blocks are shared, not copied)."""
        n = self.table.num_tokens[src]
        assert n % self.block_size == 0, "fork whole blocks only"
        self.table.add_request(dst, prefix_blocks=self.table.blocks[src])
        for (name, r), hist in list(self.history.items()):
            if r == src:
                self.history[(name, dst)] = {"k": list(hist["k"]), "v": list(hist["v"])}


def shared_prefix_run(layers, prefix_len, query_lens, enable_cascade=True, dtype=torch.float32,
                      seed=0, num_blocks=256, **kwargs):
    """Request 0 prefills the prefix; requests 1.. fork it; then one step of `query_lens`."""
    run = SharedPrefixRunner(layers, enable_cascade=enable_cascade, num_blocks=num_blocks,
                             seed=seed, dtype=dtype, **kwargs)
    run.step([0], [prefix_len])
    reqs = list(range(1, len(query_lens) + 1))
    for r in reqs:
        run.fork(0, r)
    results = run.step(reqs, query_lens, common_prefix_len=prefix_len)
    return run, results


# --- declarations -------------------------------------------------------------------------
def test_backend_declares_the_seed_interface():
    b = FlashAttentionBackend
    assert b.get_name() == "FLASH_ATTN"
    assert b.accept_output_buffer and b.supports_quant_query_input
    assert b.get_impl_cls() is FlashAttentionImpl
    assert b.get_metadata_cls() is FlashAttentionMetadata
    assert b.get_builder_cls() is FlashAttentionMetadataBuilder
    assert b.get_supported_head_sizes() == list(range(8, 257, 8))
    assert set(b.get_supported_dtypes()) >= {torch.float16, torch.bfloat16}
    assert b.get_kv_cache_shape(10, 16, 4, 128) == (2, 10, 16, 4, 128)
    assert b.get_fp8_dtype_for_flashattn("fp8") is torch.float8_e4m3fn
    assert FlashAttentionMetadataBuilder.cudagraph_support == AttentionCGSupport.ALWAYS
    assert b.capabilities.cascade and not b.capabilities.different_kv_head_sizes
    assert {"fp8", "fp8_e4m3", "fp8_e5m2"} <= b.capabilities.kv_cache_dtypes
    from pagedattn.ops import cascade_attention as op
    from pagedattn.ops import use_cascade_attention as decide
    assert cascade_attention is op and use_cascade_attention is decide


@pytest.mark.parametrize("head_size", [12, 0, 264])
def test_validate_head_size_rejects_sizes_the_kernels_do_not_serve(head_size):
    with pytest.raises(ValueError, match="head_size"):
        FlashAttentionBackend.validate_head_size(head_size)


@pytest.mark.parametrize("layout, plain, with_layers", [
    ("NHD", (0, 1, 2, 3, 4), (2, 0, 1, 3, 4, 5)),
    ("HND", (0, 1, 3, 2, 4), (2, 4, 0, 1, 3, 5)),
])
def test_stride_order_follows_the_layout(layout, plain, with_layers, monkeypatch):
    monkeypatch.setenv("PAGEDATTN_KV_CACHE_LAYOUT", layout)
    assert FlashAttentionBackend.get_kv_cache_stride_order() == plain
    assert FlashAttentionBackend.get_kv_cache_stride_order(
        include_num_layers_dimension=True) == with_layers


def test_selector_ranks_flash_attn_first_on_cuda_only():
    from pagedattn.selector import PREFERENCE, explain
    from pagedattn.types import AttentionRequest

    assert PREFERENCE["cuda"][0] == "FLASH_ATTN"
    reasons = explain(AttentionRequest(128, torch.bfloat16, device_type="cuda"))
    assert reasons["FLASH_ATTN"] == []
    cpu = explain(AttentionRequest(128, torch.bfloat16, device_type="cpu"))
    assert cpu["FLASH_ATTN"] == ["never chosen automatically on cpu"]


# --- batches against the oracle -----------------------------------------------------------


# --- attention types ----------------------------------------------------------------------
# --- cache handling -----------------------------------------------------------------------
# --- cascade through the layer ------------------------------------------------------------
CASCADE_CASES = {
    "decodes": dict(prefix_len=256, query_lens=[1] * 12),
    "mixed": dict(prefix_len=288, query_lens=[1, 5, 1, 1, 17, 1, 1, 2, 1, 1]),
    "softcap": dict(prefix_len=256, query_lens=[1] * 10, logits_soft_cap=3.0),
    "sinks": dict(prefix_len=256, query_lens=[1, 3] * 5, sinks=torch.linspace(-2, 2, 8)),
}


@pytest.mark.parametrize("case", list(CASCADE_CASES))
def test_cascade_equals_plain_attention_and_the_oracle(case):
    kwargs = dict(CASCADE_CASES[case])
    prefix_len, query_lens = kwargs.pop("prefix_len"), kwargs.pop("query_lens")
    outs = {}
    for cascade in (True, False):
        layers = make_layers(FlashAttentionBackend, 1, **kwargs)
        run, results = shared_prefix_run(layers, prefix_len, query_lens, enable_cascade=cascade)
        assert run.built[-1].use_cascade == cascade
        if cascade:
            assert run.built[-1].common_prefix_len == prefix_len
        check_step(results)
        outs[cascade] = results["layers.0.attn"][0]
    torch.testing.assert_close(outs[True], outs[False], atol=2e-6, rtol=1e-5)


def test_cascade_with_fp8_cache_and_query():
    layers = make_layers(FlashAttentionBackend, 1, cache_dtype="fp8", dtype=torch.bfloat16)
    layer = layers["layers.0.attn"]
    set_scales(layer, k=0.02, v=0.03, q=0.01)
    run, results = shared_prefix_run(layers, 256, [1] * 12, dtype=torch.bfloat16)
    assert run.built[-1].use_cascade
    check_step(results, **FP8_TOLERANCE)


def test_layer_that_cascade_cannot_serve_runs_plain_attention_from_cascade_metadata():
    slopes = [2 ** -(i + 1) for i in range(8)]
    layers = make_layers(FlashAttentionBackend, 1, alibi_slopes=slopes)
    run, results = shared_prefix_run(layers, 256, [1] * 12)
    assert run.built[-1].use_cascade  # the builder did not see the layer (no registry scope)
    check_step(results)


# --- the builder --------------------------------------------------------------------------
def spec(block_size=16):
    return AttentionSpec(block_size, 2, 64, torch.float32)


def common(query_lens, seq_lens, block_size=16):
    width = max(-(-s // block_size) for s in seq_lens)
    table = torch.arange(len(seq_lens) * width, dtype=torch.int32).view(len(seq_lens), width)
    return CommonAttentionMetadata.from_lengths(query_lens, seq_lens, table, block_size)


def test_builder_rounds_the_prefix_to_blocks_and_keeps_it_before_every_query():
    builder = FlashAttentionMetadataBuilder(spec(), [], EngineConfig(), torch.device("cpu"))
    builder.num_sms = 16  # a fixed count: the decision must not depend on the CI machine
    m = common([1] * 63 + [40], [2100] * 64)  # the last request computed 2060 tokens
    md = builder.build(2090, m)  # the cost model itself chooses cascade here
    assert md.use_cascade and md.common_prefix_len == 2048  # min(2090, 2060) // 16 * 16
    assert md.cu_prefix_query_lens.tolist() == [0, 103]
    assert md.prefix_kv_lens.tolist() == [2048]
    assert md.suffix_kv_lens.tolist() == [52] * 64
    assert not builder.build(0, m).use_cascade
    assert not builder.build(2090, common([1] * 8, [2100] * 8)).use_cascade  # too few
    off = FlashAttentionMetadataBuilder(spec(), [], EngineConfig(enable_cascade=False), "cpu")
    assert not off.build(2090, m).use_cascade


def test_builder_reads_layer_features_for_the_cascade_decision():
    with model_scope():
        Attention(8, 64, 0.1, 2, prefix="a", attn_backend=FlashAttentionBackend,
                  alibi_slopes=[0.5] * 8)
        builder = FlashAttentionMetadataBuilder(spec(), ["a"], None, "cpu")
    builder.num_sms = 16
    assert not builder.build(2048, common([1] * 64, [2100] * 64)).use_cascade


def test_builder_refuses_batches_larger_than_its_buffers():
    builder = FlashAttentionMetadataBuilder(spec(), [], EngineConfig(max_num_seqs=2), "cpu")
    with pytest.raises(ValueError, match="max_num_seqs"):
        builder.build(0, common([1, 1, 1], [5, 5, 5]))
    builder = FlashAttentionMetadataBuilder(spec(), [], EngineConfig(max_model_len=64), "cpu")
    with pytest.raises(ValueError, match="max_model_len"):
        builder.build(0, common([1], [100]))


def test_prompts_alone_are_marked_for_the_dense_key_pass_and_plan_apart():
    builder = FlashAttentionMetadataBuilder(spec(), [], EngineConfig(), torch.device("cpu"))
    prompts = builder.build(0, common([5, 9], [5, 9]))
    assert prompts.new_keys_only
    assert not builder.build(0, common([5, 9], [5, 12])).new_keys_only  # one has a context
    assert not builder.build(0, common([1, 1], [1, 1])).new_keys_only  # a decode-sized step
    assert not builder.build_for_cudagraph_capture(common([5, 9], [5, 9])).new_keys_only
    # the same planning ints with a context: plans of their own, not the prompts' reused
    with_context = builder.build(0, common([5, 9], [6, 9]))
    assert with_context.max_seq_len == prompts.max_seq_len
    assert with_context.plans is not prompts.plans


def test_metadata_keeps_the_seed_fields():
    names = [f.name for f in dataclasses.fields(FlashAttentionMetadata) if f.name != "_"]
    assert set(names) == {
        "num_actual_tokens", "max_query_len", "query_start_loc", "max_seq_len", "seq_lens",
        "block_table", "slot_mapping", "use_cascade", "common_prefix_len",
        "cu_prefix_query_lens", "prefix_kv_lens", "suffix_kv_lens", "scheduler_metadata",
        "prefix_scheduler_metadata", "max_num_splits", "causal", "dcp", "plans",
        "cuda_graph", "new_keys_only"}


# --- on a GPU, at model sizes ---------------------------------------------------------------
def gpu_layers(n=2, **kwargs):
    layers = make_layers(FlashAttentionBackend, n, 32, 8, 128, dtype=torch.bfloat16, **kwargs)
    return {name: layer.to("cuda") for name, layer in layers.items()}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_mixed_batches_at_model_sizes():
    run = LayerRunner(gpu_layers(), num_blocks=1024, dtype=torch.bfloat16, device="cuda")
    check_step(run.step(list(range(6)), [1000, 7, 300, 64, 1, 600]), torch.bfloat16)
    check_step(run.step(list(range(6)), [1] * 6), torch.bfloat16)
    check_step(run.step(list(range(8)), [1, 200, 1, 1, 33, 1, 17, 1200]), torch.bfloat16)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("features", [{}, dict(sinks=torch.linspace(-1, 1, 32)),
                                      dict(cache_dtype="fp8")], ids=["plain", "sinks", "fp8"])
def test_gpu_prefill_calls_through_the_layers_plan_repeat_the_plans_own_run(features):
    """Steps of one size share their plans, so a layer runs a prefill plan again: its first
    call makes the provider's plan of the layer (the Gluon pass's too, where it serves),
    which every call of the planned size runs, and must give what the plans' own run gives
    (a padded call takes that). Prompts alone, then chunks after a context, beside a decode.
    An fp8 cache: the layer quantises q, with its q descale."""
    tol = FP8_TOLERANCE if features.get("cache_dtype") else TOLERANCE[torch.bfloat16]
    from pagedattn import set_forward_context

    layers = gpu_layers(1, **features)
    (name, layer), = layers.items()
    run = LayerRunner(layers, num_blocks=1024, dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator().manual_seed(3)
    for req_ids, query_lens in (([0, 1], [700, 300]), ([0, 1, 2], [512, 256, 1])):
        md, _ = run.metadata(req_ids, query_lens)
        q, k, v = (torch.randn(sum(query_lens), width, generator=gen).to(torch.bfloat16)
                   for width in layer.input_widths)
        pad = [torch.cat([x, torch.zeros_like(x[:1])]).cuda() for x in (q, k, v)]
        with set_forward_context(md):
            outs = [layer(q.cuda(), k.cuda(), v.cuda()) for _ in range(2)]
            outs.append(layer(*pad)[:-1])  # padded: the plans' own run
        assert md.plans.layers[layer.impl].run is not None  # the provider's plan of the layer
        want = run._expected(name, layer, req_ids, query_lens, q, k, v)
        check_step({name: (outs[0].view(want.shape), want)}, **tol)
        for out in outs[1:]:
            assert torch.equal(out, outs[0])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kwargs", [{}, dict(sinks=torch.linspace(-1, 1, 32)),
                                    dict(cache_dtype="fp8")], ids=["plain", "sinks", "fp8"])
def test_gpu_cascade_equals_plain_at_model_sizes(kwargs):
    tol = FP8_TOLERANCE if kwargs.get("cache_dtype") else TOLERANCE[torch.bfloat16]
    query_lens = [1] * 40 + [9, 1, 70, 2]
    outs = {}
    for cascade in (True, False):
        run, results = shared_prefix_run(gpu_layers(1, **kwargs), 1024, query_lens, cascade,
                                         torch.bfloat16, num_blocks=1024, device="cuda")
        assert run.built[-1].use_cascade == cascade
        check_step(results, **tol)
        outs[cascade] = results["layers.0.attn"][0].float()
    torch.testing.assert_close(outs[True], outs[False], atol=2e-2, rtol=2e-2)
