"""The Attention layer's construction rules, registry, scales and output paths."""

from __future__ import annotations

import pytest
import torch

from conftest import randn
from pagedattn import Attention, CacheConfig, model_scope, set_forward_context
from pagedattn.backends.torch_sdpa import TorchSDPABackend
from pagedattn.forward_context import get_forward_context


def test_default_backend_and_impl_arguments(monkeypatch):
    monkeypatch.setenv("PAGEDATTN_ATTENTION_BACKEND", "TORCH_SDPA")  # any device
    with model_scope():
        layer = Attention(8, 64, 0.125, 2, cache_config=CacheConfig(block_size=32,
                          sliding_window=128), logits_soft_cap=30.0, prefix="x")
    assert layer.attn_backend.get_name() == "TORCH_SDPA"
    assert layer.impl.sliding_window == (127, 0)
    assert layer.impl.logits_soft_cap == 30.0
    assert layer.block_size == 32 and layer.sliding_window == 128
    assert "num_kv_heads=2" in repr(layer) and "TorchSDPAImpl" in repr(layer)


def test_per_layer_window_overrides_cache_config():
    with model_scope():
        layer = Attention(4, 32, 0.1, cache_config=CacheConfig(sliding_window=64),
                          per_layer_sliding_window=8)
    assert layer.sliding_window == 8 and layer.impl.sliding_window == (7, 0)
    assert layer.num_kv_heads == 4  # defaults to num_heads


def test_gqa_groups_must_divide():
    with pytest.raises(ValueError, match=r"num_heads \(6\) is not divisible by num_kv_heads"):
        Attention(6, 32, 0.1, 4)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_heads=0), "num_heads"),
    (dict(head_size=-1), "head_size"),
    (dict(alibi_slopes=[0.1, 0.2]), "alibi_slopes must have one value per query head"),
    (dict(sinks=torch.zeros(3)), "sinks must have one value per query head"),
    (dict(logits_soft_cap=-1.0), "logits_soft_cap"),
    (dict(per_layer_sliding_window=0), "sliding_window"),
    (dict(attn_type="bidirectional"), "attn_type"),
])
def test_bad_arguments_raise_clear_errors(kwargs, match):
    args = dict(num_heads=4, head_size=32, scale=0.1, num_kv_heads=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        Attention(**args)


def test_duplicate_names_are_rejected_within_a_scope_only():
    with model_scope():
        Attention(4, 32, 0.1, prefix="layers.0.attn")
        with pytest.raises(ValueError, match="Duplicate layer name"):
            Attention(4, 32, 0.1, prefix="layers.0.attn")
    with model_scope():
        Attention(4, 32, 0.1, prefix="layers.0.attn")  # a new model may reuse names


@pytest.mark.parametrize("target, match", [
    ("missing", "no such layer was built before it"),
    ("self", "cannot share its own cache"),
])
def test_kv_sharing_target_is_validated(target, match):
    with model_scope():
        Attention(4, 32, 0.1, prefix="first")
        with pytest.raises(ValueError, match=match):
            Attention(4, 32, 0.1, prefix="self", kv_sharing_target_layer_name=target)


def test_kv_sharing_needs_the_same_attention_type():
    with model_scope():
        Attention(4, 32, 0.1, prefix="enc", attn_type="encoder_only")
        with pytest.raises(ValueError, match="attention type"):
            Attention(4, 32, 0.1, prefix="dec", kv_sharing_target_layer_name="enc")


def test_forward_needs_a_forward_context():
    with pytest.raises(RuntimeError, match="set_forward_context"):
        get_forward_context()
    layer = Attention(4, 32, 0.1)
    with pytest.raises(RuntimeError, match="no forward context"):
        layer(randn(1, 128), randn(1, 128), randn(1, 128))


def test_per_layer_metadata_dict_is_keyed_by_layer_name():
    with model_scope():
        layer = Attention(2, 16, 0.1, prefix="only", attn_backend=TorchSDPABackend)
    with set_forward_context({"only": None}):  # profiling entry for this layer
        out = layer(randn(3, 32), randn(3, 32), randn(3, 32))
    assert torch.equal(out, torch.zeros(3, 32))


def test_return_value_path_when_backend_takes_no_output_buffer():
    class NoBuffer(TorchSDPABackend):
        accept_output_buffer = False

    layer = Attention(2, 16, 0.1, attn_backend=NoBuffer)
    assert not layer.use_output
    with set_forward_context(None):
        out = layer(randn(3, 32), randn(3, 32), randn(3, 32))
    assert out.shape == (3, 32) and torch.equal(out, torch.zeros(3, 32))


def test_output_shape_is_honoured():
    layer = Attention(2, 16, 0.1)
    with set_forward_context(None):
        out = layer(randn(3, 32), randn(3, 32), randn(3, 32), output_shape=torch.Size((3, 32)))
    assert out.shape == (3, 32)


def test_scales_follow_the_layer_to_a_new_dtype_and_stay_float32():
    layer = Attention(2, 16, 0.1)
    layer._k_scale.fill_(0.5)
    layer.to(torch.float16)
    assert layer._k_scale.dtype == torch.float32 and layer._k_scale.item() == 0.5


def test_fp8_query_quantization_only_for_backends_that_read_fp8_queries():
    class QuantQuery(TorchSDPABackend):
        supports_quant_query_input = True

    fp8 = CacheConfig(cache_dtype="fp8")
    plain = Attention(2, 16, 0.1, cache_config=fp8, attn_backend=TorchSDPABackend)
    assert plain.query_quant_dtype is None
    layer = Attention(2, 16, 0.1, cache_config=fp8, attn_backend=QuantQuery)
    assert layer.query_quant_dtype == torch.float8_e4m3fn
    e5m2 = CacheConfig(cache_dtype="fp8_e5m2")
    assert Attention(2, 16, 0.1, cache_config=e5m2, attn_backend=QuantQuery) \
        .query_quant_dtype is None


def test_process_weights_after_loading_reaches_the_impl():
    layer = Attention(2, 16, 0.1)
    seen = []
    layer.impl.process_weights_after_loading = seen.append
    layer.process_weights_after_loading(torch.bfloat16)
    assert seen == [torch.bfloat16]


def test_quant_config_creates_kv_scale_weights_and_rejects_e5m2():
    class KVScales:
        def create_weights(self, layer):
            layer.k_scale = torch.nn.Parameter(torch.tensor(1.0), requires_grad=False)

    class QuantConfig:
        def get_quant_method(self, layer, prefix):
            return KVScales()

    layer = Attention(2, 16, 0.1, quant_config=QuantConfig(),
                      cache_config=CacheConfig(cache_dtype="fp8"))
    assert isinstance(layer.k_scale, torch.nn.Parameter)
    with pytest.raises(ValueError, match="fp8_e5m2"):
        Attention(2, 16, 0.1, quant_config=QuantConfig(),
                  cache_config=CacheConfig(cache_dtype="fp8_e5m2"))
