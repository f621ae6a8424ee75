"""The Attention layer's construction rules, registry, scales and output paths."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import reference as ref
from conftest import LayerRunner, assert_close, randn
from pagedattn import Attention, CacheConfig, model_scope, set_forward_context
from pagedattn.backends.flash_attn import FlashAttentionBackend
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


# --- input contracts (issue 24): every wrong input is an error naming the layer -------------
def _readme_layer(**kwargs):
    """README's model layer: 8 query / 2 KV heads of 32, one 10-token step (7 + 3)."""
    with model_scope():
        layer = Attention(8, 32, 32 ** -0.5, 2, cache_config=CacheConfig(block_size=16),
                          prefix="layers.0.attn", **kwargs)
    run = LayerRunner({"layers.0.attn": layer})
    md, _ = run.metadata(["a", "b"], [7, 3])
    return layer, run, md


def _call(layer, md, q, k, v, **kwargs):
    with set_forward_context(md):
        return layer(q, k, v, **kwargs)


def test_key_with_twice_the_kv_heads_columns_is_refused_not_run_as_padding():
    layer, _, md = _readme_layer()
    with pytest.raises(ValueError, match=r"layer 'layers.0.attn': key has shape \(10, 128\); "
                                         r"expected \[num_tokens, 64\] \(2 heads x head size 32"):
        _call(layer, md, randn(10, 256), randn(10, 128), randn(10, 64))


def test_fewer_tokens_than_the_step_names_both_counts_and_the_metadata_field():
    layer, _, md = _readme_layer()
    with pytest.raises(ValueError, match=r"layer 'layers.0.attn': query has 9 tokens but this "
                                         r"step's metadata has attn_metadata.num_actual_tokens=10"):
        _call(layer, md, randn(9, 256), randn(9, 64), randn(9, 64))


def test_query_hidden_size_must_be_num_heads_times_head_size():
    layer, _, md = _readme_layer()
    with pytest.raises(ValueError, match=r"layer 'layers.0.attn': query has shape \(10, 261\); "
                                         r"expected \[num_tokens, 256\] \(8 heads x head size 32"):
        _call(layer, md, randn(10, 261), randn(10, 64), randn(10, 64))


@pytest.mark.parametrize("name, shape", [
    ("query", (10, 8, 31)), ("query", (10,)), ("query", (1, 10, 256)), ("value", (10, 4, 32))])
def test_three_d_inputs_must_have_the_layers_heads_and_head_size(name, shape):
    layer, _, md = _readme_layer()
    args = {"query": randn(10, 8, 32), "key": randn(10, 2, 32), "value": randn(10, 2, 32)}
    args[name] = randn(*shape)
    with pytest.raises(ValueError, match=rf"layer 'layers.0.attn': {name} has shape "
                                         rf"{re.escape(str(shape))}; expected"):
        _call(layer, md, args["query"], args["key"], args["value"])


def test_key_and_value_token_counts_must_agree():
    layer, _, md = _readme_layer()
    with pytest.raises(ValueError, match=r"key has shape \(10, 64\) and value \(11, 64\): they "
                                         "must hold the same number of tokens"):
        _call(layer, md, randn(10, 256), randn(10, 64), randn(11, 64))


def test_key_token_count_must_equal_the_querys_outside_cross_attention():
    layer, _, md = _readme_layer()
    with pytest.raises(ValueError, match=r"key has shape \(12, 64\) \(12 tokens\) but query "
                                         r"\(10, 256\) \(10 tokens\)"):
        _call(layer, md, randn(10, 256), randn(12, 64), randn(12, 64))


@pytest.mark.parametrize("missing", ["key", "value"])
def test_key_and_value_come_together_or_not_at_all(missing):
    layer, _, md = _readme_layer()
    kv = {"key": randn(10, 64), "value": randn(10, 64), missing: None}
    with pytest.raises(ValueError, match=f"but {missing} is None; pass both"):
        _call(layer, md, randn(10, 256), kv["key"], kv["value"])


def test_inputs_must_be_tensors_of_the_query_dtype():
    layer, _, md = _readme_layer()
    with pytest.raises(TypeError, match="layer 'layers.0.attn': key must be a torch.Tensor"):
        _call(layer, md, randn(10, 256), [0.0] * 64, randn(10, 64))
    with pytest.raises(TypeError, match=r"value has dtype torch.float16 but query has "
                                        "torch.float32"):
        _call(layer, md, randn(10, 256), randn(10, 64), randn(10, 64, dtype=torch.float16))
    with pytest.raises(TypeError, match="query has dtype torch.int64"):
        _call(layer, md, torch.zeros(10, 256, dtype=torch.long), randn(10, 64), randn(10, 64))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_inputs_in_another_dtype_than_a_16_or_32_bit_cache_are_refused(dtype):
    layer, run, md = _readme_layer()  # an fp32 cache
    cache = run.caches["layers.0.attn"].fill_(0.25)
    with pytest.raises(TypeError, match=rf"layer 'layers.0.attn': query, key and value have "
                                        rf"dtype {dtype} but the layer's KV cache is "
                                        r"torch.float32; pass them in torch.float32"):
        _call(layer, md, randn(10, 256, dtype=dtype), randn(10, 64, dtype=dtype),
              randn(10, 64, dtype=dtype))
    assert (cache == 0.25).all()  # refused before any write
    # The same call in the cache's dtype runs, and gives the oracle's values.
    q, k, v = randn(10, 256), randn(10, 64), randn(10, 64)
    out = _call(layer, md, q, k, v)
    want, _ = ref.paged_attention(q.view(10, 8, 32), cache[0], cache[1], [7, 3], [7, 3],
                                  md.block_table, scale=32 ** -0.5)
    assert_close(out.view(10, 8, 32), want)


def test_a_16_bit_cache_takes_its_own_dtype_whatever_the_default_dtype():
    with model_scope():  # built under the fp32 default, cache and inputs in bf16
        layer = Attention(8, 32, 32 ** -0.5, 2, prefix="layers.0.attn")
    run = LayerRunner({"layers.0.attn": layer}, dtype=torch.bfloat16)
    md, _ = run.metadata(["a"], [5])
    q, k, v = (randn(5, n, dtype=torch.bfloat16) for n in (256, 64, 64))
    out = _call(layer, md, q, k, v)
    cache = run.caches["layers.0.attn"]
    want, _ = ref.paged_attention(q.view(5, 8, 32), cache[0], cache[1], [5], [5],
                                  md.block_table, scale=32 ** -0.5)
    assert out.dtype == torch.bfloat16
    assert_close(out.view(5, 8, 32), want, torch.bfloat16)
    with pytest.raises(TypeError, match="have dtype torch.float32 but the layer's KV cache is "
                                        "torch.bfloat16"):
        _call(layer, md, q.float(), k.float(), v.float())


def test_an_fp8_cache_takes_the_model_dtype():
    with model_scope():
        layer = Attention(8, 32, 32 ** -0.5, 2, prefix="layers.0.attn",
                          cache_config=CacheConfig(cache_dtype="fp8"))
    run = LayerRunner({"layers.0.attn": layer})
    md, _ = run.metadata(["a"], [5])
    assert run.caches["layers.0.attn"].dtype == torch.float8_e4m3fn and layer.dtype is \
        torch.float32
    with pytest.raises(TypeError, match=r"have dtype torch.float16 but the layer's KV cache is "
                                        r"torch.float8_e4m3fn \(cache_dtype 'fp8'\), which "
                                        r"stores the model dtype torch.float32 converted; pass "
                                        r"them in torch.float32"):
        _call(layer, md, *(randn(5, n, dtype=torch.float16) for n in (256, 64, 64)))
    q, k, v = randn(5, 256), randn(5, 64), randn(5, 64)
    out = _call(layer, md, q, k, v)
    cache = run.caches["layers.0.attn"]
    want, _ = ref.paged_attention(q.view(5, 8, 32), cache[0], cache[1], [5], [5],
                                  md.block_table, scale=32 ** -0.5)
    assert_close(out.view(5, 8, 32), want, atol=2e-2, rtol=2e-2)


def test_a_layer_without_a_bound_cache_is_not_held_to_a_dtype():
    layer = Attention(2, 16, 0.1)  # profiling run: no cache yet, zeros out
    with set_forward_context(None):
        out = layer(*(randn(3, 32, dtype=torch.float16) for _ in range(3)))
    assert out.dtype == torch.float16 and torch.equal(out, torch.zeros(3, 32).half())


@pytest.mark.parametrize("attn_type, why", [
    ("decoder", "this decoder layer writes the new tokens' keys and values into its KV cache"),
    ("encoder_only", "this encoder_only layer attends over the call's own keys and values"),
    ("encoder", "this encoder layer attends over the call's own keys and values")])
def test_key_and_value_none_where_the_layer_must_write_or_read_them(attn_type, why):
    layer, run, md = _readme_layer(attn_type=attn_type)
    cache = run.caches["layers.0.attn"].fill_(0.25)
    with pytest.raises(ValueError, match=rf"layer 'layers.0.attn': key and value are None, "
                                         rf"but {re.escape(why)}"):
        _call(layer, md, randn(10, 256), None, None)
    assert (cache == 0.25).all()


def test_a_kv_sharing_layer_takes_key_and_value_none_and_reads_its_targets_cache():
    with model_scope():
        first = Attention(8, 32, 32 ** -0.5, 2, prefix="l0")
        second = Attention(8, 32, 32 ** -0.5, 2, prefix="l1", kv_sharing_target_layer_name="l0")
    run = LayerRunner({"l0": first, "l1": second})
    md, _ = run.metadata(["a", "b"], [7, 3])
    q, k, v = randn(10, 256), randn(10, 64), randn(10, 64)
    with set_forward_context(md):
        first(q, k, v)
        out = second(q, None, None)
    want, _ = ref.varlen_attention(q.view(10, 8, 32), k.view(10, 2, 32), v.view(10, 2, 32),
                                   [7, 3], [7, 3], scale=32 ** -0.5, causal=True)
    assert_close(out.view(10, 8, 32), want)


def test_output_shape_must_hold_the_output():
    layer, _, md = _readme_layer()
    with pytest.raises(ValueError, match=r"output_shape=\(10, 128\) holds 1280 elements; the "
                                         r"output of 10 tokens has 10 x 256"):
        _call(layer, md, randn(10, 256), randn(10, 64), randn(10, 64),
              output_shape=torch.Size((10, 128)))


def test_fewer_key_rows_than_slots_is_refused_for_cross_attention():
    with model_scope():
        layer = Attention(8, 32, 0.2, 2, prefix="cross", attn_type="encoder_decoder")
    run = LayerRunner({"cross": layer})
    md, _ = run.metadata([0], [6])  # six encoder tokens' slots
    md = run.builder.plan(dataclasses.replace(md, num_actual_tokens=2))  # built: frozen
    with pytest.raises(ValueError, match=r"layer 'cross': key has 5 tokens .* but this "
                                         r"step's attn_metadata.slot_mapping has 6 slots"):
        _call(layer, md, randn(2, 256), randn(5, 64), randn(5, 64))


def test_more_tokens_than_the_step_are_padding_with_zero_output():
    layer, run, md = _readme_layer()
    cache = run.caches["layers.0.attn"].zero_()
    q, k, v = randn(12, 256), randn(12, 64), randn(12, 64)
    out = _call(layer, md, q, k, v)
    assert torch.equal(out[10:], torch.zeros(2, 256))
    want, _ = ref.paged_attention(q[:10].view(10, 8, 32), cache[0], cache[1], [7, 3], [7, 3],
                                  md.block_table, scale=32 ** -0.5)
    assert_close(out[:10].view(10, 8, 32), want)
    assert (cache != 0).any(dim=(0, 3, 4)).sum() == 10  # padding keys are not cached


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_contracts_hold_on_the_planned_triton_path():
    """The issue's three examples on the GPU's default backend (FLASH_ATTN, planned Triton
    path) raise before any launch; a padded call zeroes the padding rows."""
    with model_scope():
        layer = Attention(8, 32, 32 ** -0.5, 2, cache_config=CacheConfig(block_size=16),
                          prefix="layers.0.attn").to("cuda")
    assert layer.backend == "FLASH_ATTN"
    run = LayerRunner({"layers.0.attn": layer}, device="cuda")
    md, _ = run.metadata(["a", "b"], [7, 3])
    cuda_randn = lambda *shape: randn(*shape, device="cuda")  # noqa: E731
    for (q, k, v), match in (
            ((cuda_randn(10, 256), cuda_randn(10, 128), cuda_randn(10, 64)), "key has shape"),
            ((cuda_randn(9, 256), cuda_randn(9, 64), cuda_randn(9, 64)), "num_actual_tokens=10"),
            ((cuda_randn(10, 261), cuda_randn(10, 64), cuda_randn(10, 64)), "query has shape")):
        with pytest.raises(ValueError, match=match):
            _call(layer, md, q, k, v)
    cache = run.caches["layers.0.attn"].zero_()
    q, k, v = cuda_randn(12, 256), cuda_randn(12, 64), cuda_randn(12, 64)
    out = _call(layer, md, q, k, v)
    assert torch.equal(out[10:], torch.zeros_like(out[10:]))
    want, _ = ref.paged_attention(q[:10].view(10, 8, 32).cpu(), cache[0].cpu(), cache[1].cpu(),
                                  [7, 3], [7, 3], md.block_table.cpu(), scale=32 ** -0.5)
    assert_close(out[:10].view(10, 8, 32), want)


def test_builders_find_layers_in_the_scope_else_the_newest_live_one():
    from pagedattn.layer_registry import find_layers, layer_by_key

    with model_scope():
        old = Attention(4, 32, 0.1, 2, prefix="found.attn")
    with model_scope():
        new = Attention(4, 32, 0.1, 2, prefix="found.attn")
    assert find_layers(["found.attn", "missing"]) == {"found.attn": new}
    with model_scope():
        mine = Attention(4, 32, 0.1, 2, prefix="found.attn")
        assert find_layers(["found.attn"])["found.attn"] is mine
        assert find_layers(["found.attn"], accept=lambda layer: layer is old) == {
            "found.attn": old}
    assert layer_by_key(old._op_key) is old
    with pytest.raises(ValueError, match="no live Attention layer has key 'gone#-1'"):
        layer_by_key("gone#-1")


# --- the 2-D row path: the layer's tensors reach the Triton plans unviewed -----------------
def _triton_readme_layer(monkeypatch, **kwargs):
    monkeypatch.setenv("PAGEDATTN_OPS_PROVIDER", "triton")  # interpreted on a CPU
    layer, run, md = _readme_layer(attn_backend=FlashAttentionBackend, **kwargs)
    assert md.plans.kinds[0].takes_rows  # else this checks the views, not the rows
    return layer, run, md


def test_rows_give_what_the_heads_path_gives_and_the_oracle(monkeypatch):
    layer, run, md = _triton_readme_layer(monkeypatch)
    cache = run.caches["layers.0.attn"]
    q, k, v = randn(12, 256), randn(12, 64), randn(12, 64)  # 10 tokens, 2 padding rows
    out = _call(layer, md, q, k, v)
    heads = torch.empty(12, 8, 32)
    layer.impl.forward(layer, q.view(12, 8, 32), k.view(12, 2, 32), v.view(12, 2, 32), cache,
                       md, output=heads)
    assert out.shape == (12, 256) and torch.equal(out, heads.view(12, 256))
    assert torch.equal(out[10:], torch.zeros(2, 256))
    want, _ = ref.paged_attention(q[:10].view(10, 8, 32), cache[0], cache[1], [7, 3], [7, 3],
                                  md.block_table, scale=32 ** -0.5)
    assert_close(out[:10].view(10, 8, 32), want)


@pytest.mark.parametrize("provider", ["torch", "triton"])
def test_strided_rows_of_a_fused_projection_and_a_transposed_key_are_read(provider,
                                                                          monkeypatch):
    """q/k/v as slices of one qkv row (row stride > width) and a key whose columns are
    strided (no view splits it into heads) give the output of contiguous inputs."""
    monkeypatch.setenv("PAGEDATTN_OPS_PROVIDER", provider)
    layer, run, md = _readme_layer(attn_backend=FlashAttentionBackend)
    q, k, v = randn(10, 256), randn(10, 64), randn(10, 64)
    want = _call(layer, md, q, k, v)
    qkv = torch.cat([q, k, v], dim=1)
    key_t = k.t().contiguous().t()  # strides (1, 10)
    got = _call(layer, md, qkv[:, :256], key_t, qkv[:, 320:])
    assert torch.equal(got, want)


def test_encoder_rows_are_read_as_dense_keys(monkeypatch):
    monkeypatch.setenv("PAGEDATTN_OPS_PROVIDER", "triton")
    with model_scope():
        layer = Attention(4, 32, 0.2, 2, prefix="enc", attn_type="encoder_only",
                          attn_backend=FlashAttentionBackend)
    run = LayerRunner({"enc": layer})
    md, _ = run.metadata([0, 1], [5, 3])
    assert md.plans.kinds[0].takes_rows
    q, k, v = randn(8, 128), randn(8, 64), randn(8, 64)
    out = _call(layer, md, q, k, v)
    want, _ = ref.varlen_attention(q.view(8, 4, 32), k.view(8, 2, 32), v.view(8, 2, 32),
                                   [5, 3], [5, 3], scale=0.2, causal=False)
    assert_close(out.view(8, 4, 32), want)
