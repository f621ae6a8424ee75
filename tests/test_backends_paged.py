"""What every paged backend does the same way, through the Attention layer, step by step.

Each test runs on TORCH_SDPA and FLASH_ATTN (both run the PyTorch provider on a CPU; on a GPU,
FLASH_ATTN runs the Triton kernels) and compares with the float64 oracle.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import reference as ref
from conftest import (
    FP8_TOLERANCE,
    LayerRunner,
    assert_close,
    check_step,
    cu_seqlens,
    make_layers,
    randn,
    set_scales,
)
from pagedattn import (
    Attention,
    AttentionType,
    CacheConfig,
    CommonAttentionMetadata,
    model_scope,
    set_forward_context,
)
from pagedattn.backends.flash_attn import FlashAttentionBackend
from pagedattn.backends.torch_sdpa import TorchSDPABackend

BACKENDS = [TorchSDPABackend, FlashAttentionBackend]


@pytest.fixture(params=BACKENDS, ids=lambda b: b.get_name())
def backend(request):
    return request.param


# --- batches against the oracle -----------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(8, 2), (8, 1), (8, 8)], ids=["gqa", "mqa", "mha"])
def test_prefill_decode_chunked_and_mixed_batches(backend, dtype, heads):
    layers = make_layers(backend, 2, *heads, dtype=dtype)
    run = LayerRunner(layers, num_blocks=64, dtype=dtype)
    check_step(run.step([0, 1, 2], [17, 5, 40]), dtype)  # pure prefill
    check_step(run.step([0, 1, 2], [1, 1, 1]), dtype)  # pure decode
    check_step(run.step([0, 1, 2], [9, 20, 3]), dtype)  # chunked prefill over cached context
    check_step(run.step([0, 1, 2, 3], [1, 7, 1, 33]), dtype)  # decodes + chunks + a new one


@pytest.mark.parametrize("block_size", [1, 32, 64])
def test_block_sizes(backend, block_size):
    run = LayerRunner(make_layers(backend, block_size=block_size), num_blocks=200,
                      block_size=block_size)
    check_step(run.step([0, 1], [45, 3]))
    check_step(run.step([0, 1], [1, 1]))


def test_one_long_sequence_among_many_short_ones(backend):
    run = LayerRunner(make_layers(backend, 1, 4, 1, 32), num_blocks=128)
    check_step(run.step(list(range(16)), [400] + [3] * 15))
    check_step(run.step(list(range(16)), [1] * 16))


FEATURES = {
    "sliding_window": dict(per_layer_sliding_window=8),
    "alibi": dict(alibi_slopes=[2 ** -(i + 1) for i in range(8)]),
    "softcap": dict(logits_soft_cap=4.0),
    "sinks": dict(sinks=torch.linspace(-1, 1, 8)),
    "all": dict(per_layer_sliding_window=24, alibi_slopes=[0.1] * 8, logits_soft_cap=10.0,
                sinks=torch.full((8,), 0.5)),
}


@pytest.mark.parametrize("name", list(FEATURES))
def test_optional_features(backend, name):
    run = LayerRunner(make_layers(backend, **FEATURES[name]))
    check_step(run.step([0, 1], [20, 3]))
    check_step(run.step([0, 1], [1, 6]))


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_kv_cache_layouts(backend, layout, monkeypatch):
    monkeypatch.setenv("PAGEDATTN_KV_CACHE_LAYOUT", layout)
    run = LayerRunner(make_layers(backend))
    cache = next(iter(run.caches.values()))
    assert cache.shape == (2, 64, 16, 2, 64)
    assert (cache.stride(3) > cache.stride(2)) == (layout == "HND")
    check_step(run.step([0, 1], [9, 30]))
    check_step(run.step([0, 1], [1, 1]))


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e5m2"])
def test_fp8_cache(backend, cache_dtype):
    layers = make_layers(backend, cache_dtype=cache_dtype, dtype=torch.bfloat16)
    layer = layers["layers.0.attn"]
    # FLASH_ATTN reads an fp8 query with an e4m3 cache: the layer quantizes it.
    quantizes = backend.supports_quant_query_input and cache_dtype == "fp8"
    assert layer.query_quant_dtype == (torch.float8_e4m3fn if quantizes else None)
    set_scales(layer, k=0.02, v=0.03, q=0.01)
    run = LayerRunner(layers, dtype=torch.bfloat16)
    assert run.caches["layers.0.attn"].dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    check_step(run.step([0, 1], [12, 4]), **FP8_TOLERANCE)
    check_step(run.step([0, 1], [1, 1]), **FP8_TOLERANCE)


def test_calculated_kv_scales_are_set_once_from_the_first_batch(backend):
    with model_scope():
        layer = Attention(4, 32, 32 ** -0.5, 2, attn_backend=backend, prefix="a",
                          cache_config=CacheConfig(cache_dtype="fp8", calculate_kv_scales=True))
    run = LayerRunner({"a": layer})
    q, k, v = randn(5, 128), randn(5, 64) * 7, randn(5, 64) * 3
    run.step([0], [5], inputs={"a": (q, k, v)})
    assert layer._k_scale_float == pytest.approx(k.abs().max().item() / 200)
    assert layer._v_scale_float == pytest.approx(v.abs().max().item() / 100)
    assert layer._q_scale_float == pytest.approx(q.abs().max().item() / 200)
    assert not layer.calculate_kv_scales
    first = layer._k_scale_float
    check_step(run.step([0], [1]), **FP8_TOLERANCE)
    assert layer._k_scale_float == first


# --- attention types ----------------------------------------------------------------------
@pytest.mark.parametrize("cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("attn_type", [AttentionType.ENCODER_ONLY, AttentionType.ENCODER])
def test_encoder_attention_is_bidirectional_and_uncached(backend, attn_type, cache_dtype):
    # A model-wide fp8 cache does not touch encoder layers: they never read the cache.
    with model_scope():
        layer = Attention(4, 32, 0.2, 2, prefix="enc", attn_type=attn_type,
                          attn_backend=backend, cache_config=CacheConfig(cache_dtype=cache_dtype))
    assert layer.query_quant_dtype is None
    run = LayerRunner({"enc": layer})
    md, _ = run.metadata([0, 1], [5, 9])
    q, k, v = randn(14, 128), randn(14, 64), randn(14, 64)
    cache = run.caches["enc"].fill_(0.5)
    with set_forward_context(md):
        out = layer(q, k, v)
    want, _ = ref.varlen_attention(q.view(14, 4, 32), k.view(14, 2, 32), v.view(14, 2, 32),
                                   [5, 9], [5, 9], scale=0.2, causal=False)
    assert_close(out.view(14, 4, 32), want)
    assert (cache.float() == 0.5).all()


def test_cross_attention_caches_encoder_kv_once_then_reads_it(backend):
    with model_scope():
        layer = Attention(4, 32, 0.2, 2, prefix="cross", attn_backend=backend,
                          attn_type=AttentionType.ENCODER_DECODER)
    run = LayerRunner({"cross": layer})
    enc_lens = [6, 11]
    # Step 1: decoder queries (2 and 1 tokens) with the encoder's K/V, cached now. The slots
    # are the encoder tokens', so the metadata is the builder's with other query offsets: a
    # replaced copy, which carries no plans until the builder plans it.
    md, _ = run.metadata([0, 1], enc_lens)
    md = dataclasses.replace(md, query_start_loc=cu_seqlens([2, 1]), max_query_len=2,
                             num_actual_tokens=3, causal=False)
    assert md.plans is None
    md = run.builder.plan(md)
    assert md.plans is not None
    k, v, q1 = randn(17, 64), randn(17, 64), randn(3, 128)
    with set_forward_context(md):
        out1 = layer(q1, k, v)
    # Step 2: one new decoder token per request, key/value None: read the cache only, with
    # the builder's plans.
    table = run.table.tensor([0, 1])
    md = run.builder.build(0, CommonAttentionMetadata.from_lengths([1, 1], enc_lens, table, 16))
    assert md.plans is not None
    q2 = randn(2, 128)
    with set_forward_context(md):
        out2 = layer(q2, None, None)
    kk, vv = k.view(17, 2, 32), v.view(17, 2, 32)
    for q, out, lens in ((q1, out1, [2, 1]), (q2, out2, [1, 1])):
        want, _ = ref.varlen_attention(q.view(-1, 4, 32), kk, vv, lens, enc_lens, scale=0.2,
                                       causal=False)
        assert_close(out.view(-1, 4, 32), want)


# --- cache handling -----------------------------------------------------------------------
def test_kv_sharing_layer_reads_the_target_cache_and_writes_nothing(backend):
    with model_scope():
        first = Attention(4, 32, 0.2, 2, prefix="l0", attn_backend=backend)
        second = Attention(4, 32, 0.2, 2, prefix="l1", attn_backend=backend,
                           kv_sharing_target_layer_name="l0")
    run = LayerRunner({"l0": first, "l1": second})
    assert run.caches["l1"] is run.caches["l0"]
    check_step(run.step([0, 1], [6, 2]))
    check_step(run.step([0, 1], [1, 1]))


def test_padded_tokens_and_requests_are_neither_cached_nor_attended(backend):
    layers = make_layers(backend)
    layer = layers["layers.0.attn"]
    run = LayerRunner(layers)
    md, _ = run.metadata([0, 1], [3, 2])
    m = CommonAttentionMetadata(  # 3 padded tokens and 2 empty padded requests
        query_start_loc=cu_seqlens([3, 2, 0, 0]), query_start_loc_cpu=cu_seqlens([3, 2, 0, 0]),
        seq_lens=torch.tensor([3, 2, 0, 0], dtype=torch.int32),
        seq_lens_cpu=torch.tensor([3, 2, 0, 0], dtype=torch.int32),
        num_computed_tokens_cpu=torch.zeros(4, dtype=torch.int32), num_reqs=4,
        num_actual_tokens=5, max_query_len=3, max_seq_len=3,
        block_table_tensor=torch.cat([md.block_table[:, :1],
                                      torch.zeros(2, 1, dtype=torch.int32)]),
        slot_mapping=torch.cat([md.slot_mapping, torch.full((3,), -1)]))
    md = run.builder.build(0, m)
    q, k, v = randn(8, 512), randn(8, 128), randn(8, 128)
    before = run.caches["layers.0.attn"].zero_().clone()
    with set_forward_context(md):
        out = layer(q, k, v)
    assert torch.equal(out[5:], torch.zeros_like(out[5:]))
    written = (run.caches["layers.0.attn"] != before).any(dim=(0, 3, 4)).sum()
    assert written == 5  # five real tokens, one slot each
    want, _ = ref.paged_attention(q[:5].view(5, 8, 64), run.caches["layers.0.attn"][0],
                                  run.caches["layers.0.attn"][1], [3, 2], [3, 2],
                                  m.block_table_tensor, scale=64 ** -0.5)
    assert_close(out[:5].view(5, 8, 64), want)


def test_profiling_run_without_metadata_gives_zeros_and_leaves_cache_alone(backend):
    layers = make_layers(backend)
    run = LayerRunner(layers)
    cache = run.caches["layers.0.attn"].fill_(1.5)
    with set_forward_context(None):
        out = layers["layers.0.attn"](randn(4, 512), randn(4, 128), randn(4, 128))
    assert torch.equal(out, torch.zeros(4, 512))
    assert (cache == 1.5).all()


def test_fused_output_quantization_is_refused_by_name(backend):
    layer = make_layers(backend)["layers.0.attn"]
    q = torch.zeros(2, 8, 64)
    with pytest.raises(NotImplementedError, match="fused output quantization"):
        layer.impl.forward(layer, q, None, None, torch.zeros(2, 4, 16, 2, 64), None,
                           output=torch.zeros(2, 8, 64), output_scale=torch.ones(()))


def test_batch_of_requests_equals_each_request_alone(backend):
    together = LayerRunner(make_layers(backend), seed=3)
    inputs = {"layers.0.attn": (randn(24, 512), randn(24, 128), randn(24, 128))}
    out = together.step([0, 1, 2], [4, 15, 5], inputs=inputs)["layers.0.attn"][0]
    q, k, v = inputs["layers.0.attn"]
    start = 0
    for n in (4, 15, 5):
        alone = LayerRunner(make_layers(backend), seed=9)
        part = {"layers.0.attn": (q[start:start + n], k[start:start + n], v[start:start + n])}
        got = alone.step([0], [n], inputs=part)["layers.0.attn"][0]
        torch.testing.assert_close(got, out[start:start + n], atol=1e-6, rtol=1e-6)
        start += n


def test_inputs_that_require_grad_leave_cache_and_output_out_of_autograd(backend):
    layers = make_layers(backend)
    run = LayerRunner(layers)
    inputs = {"layers.0.attn": tuple(randn(9, n).requires_grad_() for n in (512, 128, 128))}
    results = run.step([0, 1], [6, 3], inputs=inputs)  # grad mode on, the builder's plans
    check_step({name: (out.detach(), want) for name, (out, want) in results.items()})
    out = results["layers.0.attn"][0]
    assert not out.requires_grad and not run.caches["layers.0.attn"].requires_grad
