"""The TORCH_SDPA backend through the Attention layer, against the oracle, step by step."""

from __future__ import annotations

import pytest
import torch

import reference as ref
from conftest import LayerRunner, assert_close, cu_seqlens, randn
from pagedattn import Attention, AttentionType, CacheConfig, model_scope, set_forward_context
from pagedattn.backends.torch_sdpa import TorchSDPABackend


def make_layers(n=1, num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                cache_dtype="auto", dtype=torch.float32, **kwargs):
    torch.set_default_dtype(dtype)
    try:
        with model_scope():
            return {f"layers.{i}.attn": Attention(
                num_heads, head_size, head_size ** -0.5, num_kv_heads,
                cache_config=CacheConfig(block_size=block_size, cache_dtype=cache_dtype),
                prefix=f"layers.{i}.attn", attn_backend=TorchSDPABackend, **kwargs)
                for i in range(n)}
    finally:
        torch.set_default_dtype(torch.float32)


def check(results, dtype=torch.float32, **tol):
    for out, want in results.values():
        assert_close(out, want, dtype, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", [(8, 2), (8, 1)], ids=["gqa", "mqa"])
def test_prefill_then_decodes_then_mixed(dtype, block_size, heads):
    layers = make_layers(2, *heads, block_size=block_size, dtype=dtype)
    run = LayerRunner(layers, num_blocks=64, block_size=block_size, dtype=dtype)
    check(run.step([0, 1, 2], [17, 5, 40]), dtype)  # pure prefill
    check(run.step([0, 1, 2], [1, 1, 1]), dtype)  # pure decode
    check(run.step([0, 1, 2, 3], [1, 7, 1, 33]), dtype)  # chunked prefill + decodes + new


FEATURES = {
    "sliding_window": dict(per_layer_sliding_window=8),
    "alibi": dict(alibi_slopes=[2 ** -(i + 1) for i in range(8)]),
    "softcap": dict(logits_soft_cap=4.0),
    "sinks": dict(sinks=torch.linspace(-1, 1, 8)),
}


@pytest.mark.parametrize("name", list(FEATURES))
def test_optional_features(name):
    layers = make_layers(1, **FEATURES[name])
    run = LayerRunner(layers)
    check(run.step([0, 1], [20, 3]))
    check(run.step([0, 1], [1, 6]))


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_kv_cache_layouts(layout, monkeypatch):
    monkeypatch.setenv("PAGEDATTN_KV_CACHE_LAYOUT", layout)
    layers = make_layers(1)
    run = LayerRunner(layers)
    cache = next(iter(run.caches.values()))
    assert cache.shape == (2, 64, 16, 2, 64)
    assert (cache.stride(3) > cache.stride(2)) == (layout == "HND")
    check(run.step([0, 1], [9, 30]))
    check(run.step([0, 1], [1, 1]))


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e5m2"])
def test_fp8_cache(cache_dtype):
    layers = make_layers(1, cache_dtype=cache_dtype, dtype=torch.bfloat16)
    layer = layers["layers.0.attn"]
    layer._k_scale.fill_(0.02)
    layer._v_scale.fill_(0.03)
    layer._k_scale_float, layer._v_scale_float = 0.02, 0.03
    run = LayerRunner(layers, dtype=torch.bfloat16)
    assert run.caches["layers.0.attn"].dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    check(run.step([0, 1], [12, 4]), torch.bfloat16)
    check(run.step([0, 1], [1, 1]), torch.bfloat16)


def test_calculated_kv_scales_are_set_once_from_the_first_batch():
    torch.manual_seed(0)
    with model_scope():
        layer = Attention(4, 32, 32 ** -0.5, 2, attn_backend=TorchSDPABackend, prefix="a",
                          cache_config=CacheConfig(cache_dtype="fp8", calculate_kv_scales=True))
    run = LayerRunner({"a": layer})
    q, k, v = randn(5, 128), randn(5, 64) * 7, randn(5, 64) * 3
    run.step([0], [5], inputs={"a": (q, k, v)})
    assert layer._k_scale_float == pytest.approx(k.abs().max().item() / 200)
    assert layer._v_scale_float == pytest.approx(v.abs().max().item() / 100)
    assert layer._q_scale_float == pytest.approx(q.abs().max().item() / 200)
    assert not layer.calculate_kv_scales
    first = layer._k_scale_float
    check(run.step([0], [1]), **{"atol": 0.15, "rtol": 0.1})
    assert layer._k_scale_float == first


def test_padding_tokens_are_neither_cached_nor_attended():
    layers = make_layers(1)
    layer = layers["layers.0.attn"]
    run = LayerRunner(layers)
    md, _ = run.metadata([0, 1], [3, 2])
    md.slot_mapping = torch.cat([md.slot_mapping, torch.full((3,), -1)])  # 3 padded tokens
    q, k, v = randn(8, 512), randn(8, 128), randn(8, 128)
    run.caches["layers.0.attn"].fill_(0.5)  # uninitialised memory may hold NaN != NaN
    before = run.caches["layers.0.attn"].clone()
    with set_forward_context(md):
        out = layer(q, k, v)
    assert out.shape == (8, 512)
    assert torch.equal(out[5:], torch.zeros_like(out[5:]))
    written = (run.caches["layers.0.attn"] != before).any(dim=(0, 3, 4)).sum()
    assert written == 5  # five real tokens, one slot each


def test_kv_sharing_layer_reads_the_target_cache_and_writes_nothing():
    with model_scope():
        first = Attention(4, 32, 0.2, 2, prefix="l0", attn_backend=TorchSDPABackend)
        second = Attention(4, 32, 0.2, 2, prefix="l1", attn_backend=TorchSDPABackend,
                           kv_sharing_target_layer_name="l0")
    run = LayerRunner({"l0": first, "l1": second})
    assert run.caches["l1"] is run.caches["l0"]
    check(run.step([0, 1], [6, 2]))
    check(run.step([0, 1], [1, 1]))


def test_profiling_run_without_metadata_gives_zeros_and_leaves_cache_alone():
    layers = make_layers(1)
    run = LayerRunner(layers)
    cache = run.caches["layers.0.attn"]
    cache.fill_(1.5)
    with set_forward_context(None):
        out = layers["layers.0.attn"](randn(4, 512), randn(4, 128), randn(4, 128))
    assert torch.equal(out, torch.zeros(4, 512))
    assert (cache == 1.5).all()


@pytest.mark.parametrize("attn_type", [AttentionType.ENCODER_ONLY, AttentionType.ENCODER])
def test_encoder_attention_is_bidirectional_and_uncached(attn_type):
    with model_scope():
        layer = Attention(4, 32, 0.2, 2, prefix="enc", attn_type=attn_type,
                          attn_backend=TorchSDPABackend)
    run = LayerRunner({"enc": layer})
    md, _ = run.metadata([0, 1], [5, 9])
    q, k, v = randn(14, 128), randn(14, 64), randn(14, 64)
    cache = run.caches["enc"]
    cache.fill_(2.0)
    with set_forward_context(md):
        out = layer(q, k, v)
    want, _ = ref.varlen_attention(q.view(14, 4, 32), k.view(14, 2, 32), v.view(14, 2, 32),
                                   [5, 9], [5, 9], scale=0.2, causal=False)
    assert_close(out.view(14, 4, 32), want)
    assert (cache == 2.0).all()


def test_cross_attention_caches_encoder_kv_once_then_reads_it():
    with model_scope():
        layer = Attention(4, 32, 0.2, 2, prefix="cross", attn_backend=TorchSDPABackend,
                          attn_type=AttentionType.ENCODER_DECODER)
    run = LayerRunner({"cross": layer})
    enc_lens = [6, 11]
    # Step 1: decoder queries (2 and 1 tokens) with the encoder's K/V, cached now.
    md, _ = run.metadata([0, 1], enc_lens)  # slots for the encoder tokens
    md.query_start_loc = cu_seqlens([2, 1])
    md.max_query_len, md.num_actual_tokens, md.causal = 2, 3, False
    k, v = randn(17, 64), randn(17, 64)
    q1 = randn(3, 128)
    with set_forward_context(md):
        out1 = layer(q1, k, v)
    # Step 2: one new decoder token per request, key/value None: read the cache only.
    md.query_start_loc, md.max_query_len, md.num_actual_tokens = cu_seqlens([1, 1]), 1, 2
    q2 = randn(2, 128)
    with set_forward_context(md):
        out2 = layer(q2, None, None)
    kk, vv = k.view(17, 2, 32), v.view(17, 2, 32)
    want1, _ = ref.varlen_attention(q1.view(3, 4, 32), kk, vv, [2, 1], enc_lens, scale=0.2,
                                    causal=False)
    want2, _ = ref.varlen_attention(q2.view(2, 4, 32), kk, vv, [1, 1], enc_lens, scale=0.2,
                                    causal=False)
    assert_close(out1.view(3, 4, 32), want1)
    assert_close(out2.view(2, 4, 32), want2)


def test_batch_of_requests_equals_each_request_alone():
    layers = make_layers(1)
    together = LayerRunner(layers, seed=3)
    inputs = {"layers.0.attn": (randn(24, 512), randn(24, 128), randn(24, 128))}
    out = together.step([0, 1, 2], [4, 15, 5], inputs=inputs)["layers.0.attn"][0]
    q, k, v = inputs["layers.0.attn"]
    start = 0
    for n in (4, 15, 5):
        alone_layers = make_layers(1)
        alone = LayerRunner(alone_layers, seed=9)
        part = {"layers.0.attn": (q[start:start + n], k[start:start + n], v[start:start + n])}
        got = alone.step([0], [n], inputs=part)["layers.0.attn"][0]
        torch.testing.assert_close(got, out[start:start + n], atol=1e-6, rtol=1e-6)
        start += n
