"""FLASHINFER through the Attention layer: the oracle, FLASH_ATTN on the same batches, the
builder's decode/prefill split and cascade plan, reorder_batch, hyper-parameters, refusals."""

from __future__ import annotations

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
from pagedattn.backends.flashinfer import (
    FlashInferBackend,
    FlashInferImpl,
    FlashInferMetadata,
    FlashInferMetadataBuilder,
    PerLayerParameters,
    get_per_layer_parameters,
    infer_global_hyperparameters,
)
from pagedattn.metadata import AttentionSpec
from pagedattn.types import AttentionCGSupport
from test_backend_flash_attn import shared_prefix_run

STEPS = [  # (request ids, query lens): the batch mixes of test_backends_paged
    ([0, 1, 2], [17, 5, 40]),  # prefills
    ([0, 1, 2], [1, 1, 1]),  # decodes
    ([0, 1, 2], [9, 20, 3]),  # chunked prefills over cached context
    ([0, 1, 2, 3], [1, 7, 1, 33]),  # decodes among chunks (not reordered) and a new request
    ([1, 3, 0, 2], [1, 1, 6, 2]),  # decodes first, as reorder_batch leaves them
]


def run_both(steps=STEPS, n_layers=2, dtype=torch.float32, **layer_kwargs):
    """The same steps (same inputs) on FLASHINFER and FLASH_ATTN: per step, both results."""
    runs = [LayerRunner(make_layers(b, n_layers, dtype=dtype, **layer_kwargs), dtype=dtype,
                        block_size=layer_kwargs.get("block_size", 16), num_blocks=96)
            for b in (FlashInferBackend, FlashAttentionBackend)]
    return [tuple(r.step(ids, lens) for r in runs) for ids, lens in steps], runs


@pytest.mark.parametrize("dtype, heads", [(torch.float32, (8, 2)), (torch.bfloat16, (8, 2)),
                                          (torch.float32, (8, 8))],
                         ids=["fp32-gqa", "bf16-gqa", "fp32-mha"])
def test_same_outputs_as_flash_attn_and_the_oracle(dtype, heads):
    steps, _ = run_both(n_layers=1, dtype=dtype, num_heads=heads[0], num_kv_heads=heads[1])
    for fi, fa in steps:
        check_step(fi, dtype)
        for name in fi:
            torch.testing.assert_close(fi[name][0], fa[name][0], atol=1e-2 if dtype !=
                                       torch.float32 else 1e-5, rtol=1e-2)


def test_builder_splits_leading_decodes_from_the_rest():
    run = LayerRunner(make_layers(FlashInferBackend), num_blocks=64)
    built = [run.metadata(ids, lens)[0] for ids, lens in STEPS]
    assert [(m.num_decodes, m.num_prefills) for m in built] == [
        (0, 3), (3, 0), (0, 3), (1, 3), (2, 2)]
    md = built[-1]
    assert (md.num_decode_tokens, md.num_prefill_tokens) == (2, 8)
    assert md.decode_wrapper._plan.total_q == 2 and md.prefill_wrapper._plan.total_q == 8
    assert md.query_start_loc is md.qo_indptr
    ptr, idx = md.paged_kv_indptr.tolist(), md.paged_kv_indices.tolist()
    table = run.table
    for r, req in enumerate([1, 3, 0, 2]):  # the CSR rows are each request's blocks
        assert idx[ptr[r]:ptr[r + 1]] == table.blocks[req][:ptr[r + 1] - ptr[r]]
        assert md.paged_kv_last_page_len[r] == (table.num_tokens[req] - 1) % 16 + 1
    assert md.decode_wrapper.use_tensor_cores is False  # 8 / 2 query heads per KV head


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_layouts_and_block_sizes(layout, block_size, monkeypatch):
    monkeypatch.setenv("PAGEDATTN_KV_CACHE_LAYOUT", layout)
    run = LayerRunner(make_layers(FlashInferBackend, block_size=block_size), num_blocks=160,
                      block_size=block_size)
    cache = next(iter(run.caches.values()))
    assert cache.shape == (160, 2, block_size, 2, 64)
    assert (cache.stride(3) > cache.stride(2)) == (layout == "HND" and block_size > 1)
    check_step(run.step([0, 1], [9, 30]))
    check_step(run.step([0, 1], [1, 1]))
    check_step(run.step([0, 1, 2], [1, 4, 3]))


FEATURES = {
    "sliding_window": dict(per_layer_sliding_window=8),
    "softcap": dict(logits_soft_cap=4.0),
    "sinks": dict(sinks=torch.linspace(-1, 1, 8)),
    "all": dict(per_layer_sliding_window=24, logits_soft_cap=10.0, sinks=torch.full((8,), 0.5)),
}


@pytest.mark.parametrize("name", list(FEATURES))
def test_optional_features(name):
    run = LayerRunner(make_layers(FlashInferBackend, 2, **FEATURES[name]))
    check_step(run.step([0, 1], [20, 3]))
    check_step(run.step([0, 1], [1, 6]))


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e5m2"])
def test_fp8_cache_with_host_scales(cache_dtype):
    layers = make_layers(FlashInferBackend, cache_dtype=cache_dtype, dtype=torch.bfloat16)
    layer = layers["layers.0.attn"]
    assert layer.query_quant_dtype is None  # FLASHINFER reads a model-dtype query
    set_scales(layer, k=0.02, v=0.03)
    run = LayerRunner(layers, dtype=torch.bfloat16)
    check_step(run.step([0, 1], [12, 4]), **FP8_TOLERANCE)
    check_step(run.step([0, 1], [1, 1]), **FP8_TOLERANCE)
    assert not run.builder.use_cascade_attention(512, [1] * 64, 8, 2, False, False, False, 132)


@pytest.mark.parametrize("kwargs", [dict(), dict(logits_soft_cap=3.0),
                                    dict(sinks=torch.linspace(-2, 2, 8))],
                         ids=["plain", "softcap", "sinks"])
def test_cascade_plan_equals_plain_attention_and_the_oracle(kwargs):
    outs = {}
    for cascade in (True, False):
        layers = make_layers(FlashInferBackend, 1, **kwargs)
        run, results = shared_prefix_run(layers, 64, [1, 5, 1, 1, 3, 1],
                                         enable_cascade=cascade)
        md = run.built[-1]
        assert md.use_cascade == cascade and (md.cascade_wrapper is not None) == cascade
        if cascade:
            assert md.shared_kv_page_indptr.tolist() == [0, 4]
            assert md.paged_kv_indptr.tolist()[-1] == sum(
                len(run.table.blocks[r]) - 4 for r in range(1, 7))
        check_step(results)
        outs[cascade] = results["layers.0.attn"][0]
    torch.testing.assert_close(outs[True], outs[False], atol=2e-6, rtol=1e-5)


def test_a_layer_checks_what_the_wrappers_planned_once_per_step(monkeypatch):
    """A layer's first call of a step reads the wrappers' plan through their public
    planned() and checks it against its own (window, soft cap, scale); later calls of the
    step run the wrappers only. A layer the step was not planned for is named."""
    from pagedattn.backends.flashinfer import FlashInferPlans

    layers = make_layers(FlashInferBackend)
    layer, run = layers["layers.0.attn"], LayerRunner(layers)
    run.step([0, 1], [6, 2])
    md, _ = run.metadata([0, 1], [1, 1])
    checks = []
    check = FlashInferPlans.plan_layer
    monkeypatch.setattr(FlashInferPlans, "plan_layer",
                        lambda plans, *args: checks.append(args[1]) or check(plans, *args))
    q, k, v = randn(2, 512), randn(2, 128), randn(2, 128)
    with set_forward_context(md):
        outs = [layer(q, k, v) for _ in range(3)]
    assert checks == [layer] and all(torch.equal(o, outs[0]) for o in outs)
    with model_scope():
        other = Attention(8, 64, 0.5, 2, prefix="other", attn_backend=FlashInferBackend)
    other.kv_cache = layer.kv_cache
    with set_forward_context(md), pytest.raises(
            ValueError, match=r"planned with \(window_left, logits_soft_cap, sm_scale\)=\(-1, "
                              r"0.0, 0.125\) but layer 'other' needs \(-1, 0.0, 0.5\)"):
        other(q, k, v)


def test_kv_sharing_padding_and_profiling_run():
    with model_scope():
        first = Attention(4, 64, 0.2, 2, prefix="l0", attn_backend=FlashInferBackend)
        second = Attention(4, 64, 0.2, 2, prefix="l1", attn_backend=FlashInferBackend,
                           kv_sharing_target_layer_name="l0")
    run = LayerRunner({"l0": first, "l1": second})
    check_step(run.step([0, 1], [6, 2]))
    check_step(run.step([0, 1], [1, 1]))
    cache = run.caches["l0"].fill_(1.5)
    with set_forward_context(None):
        out = first(randn(4, 256), randn(4, 128), randn(4, 128))
    assert torch.equal(out, torch.zeros(4, 256)) and (cache == 1.5).all()


def test_padded_tokens_and_requests_are_neither_cached_nor_attended():
    layers = make_layers(FlashInferBackend)
    layer, run = layers["layers.0.attn"], LayerRunner(layers)
    md, _ = run.metadata([0, 1], [3, 2])
    m = CommonAttentionMetadata(  # 3 padded tokens and 2 empty padded requests
        query_start_loc=cu_seqlens([3, 2, 0, 0]), query_start_loc_cpu=cu_seqlens([3, 2, 0, 0]),
        seq_lens=torch.tensor([3, 2, 0, 0], dtype=torch.int32),
        seq_lens_cpu=torch.tensor([3, 2, 0, 0], dtype=torch.int32),
        num_computed_tokens_cpu=torch.zeros(4, dtype=torch.int32), num_reqs=4,
        num_actual_tokens=5, max_query_len=3, max_seq_len=3,
        block_table_tensor=torch.tensor([[r] for r in run.table.blocks[0][:1]
                                         + run.table.blocks[1][:1] + [0, 0]],
                                        dtype=torch.int32),
        slot_mapping=torch.cat([md.slot_mapping, torch.full((3,), -1)]))
    md = run.builder.build(0, m)
    assert md.paged_kv_indptr.tolist() == [0, 1, 2, 2, 2]
    q, k, v = randn(8, 512), randn(8, 128), randn(8, 128)
    cache = run.caches["layers.0.attn"].zero_()
    with set_forward_context(md):
        out = layer(q, k, v)
    assert torch.equal(out[5:], torch.zeros_like(out[5:]))
    assert int((cache != 0).any(dim=(1, 3, 4)).sum()) == 5  # five real tokens, one slot each
    want, _ = ref.paged_attention(q[:5].view(5, 8, 64), cache[:, 0], cache[:, 1], [3, 2],
                                  [3, 2], m.block_table_tensor, scale=64 ** -0.5)
    assert_close(out[:5].view(5, 8, 64), want)


# --- reorder_batch ------------------------------------------------------------------------
class InputBatch:
    def __init__(self, req_ids):
        self.req_ids, self.swaps = list(req_ids), 0

    def swap_states(self, i, j):
        self.req_ids[i], self.req_ids[j] = self.req_ids[j], self.req_ids[i]
        self.swaps += 1


class SchedulerOutput:
    def __init__(self, tokens):
        self.num_scheduled_tokens = tokens


@pytest.mark.parametrize("lens, swaps", [
    ([1, 1, 5, 9], 0),  # ordered
    ([1, 1, 1], 0),  # all decodes
    ([4, 7, 2], 0),  # all prefills
    ([5, 1, 9, 1, 1, 3], 2),  # interleaved: two decodes sit behind the decode region
    ([8, 8, 1, 1], 2),
    ([1, 6, 1, 6, 1], 1),
])
def test_reorder_batch_moves_decodes_first_with_the_fewest_swaps(lens, swaps):
    batch = InputBatch([f"r{i}" for i in range(len(lens))])
    tokens = {f"r{i}": n for i, n in enumerate(lens)}
    builder = FlashInferMetadataBuilder(AttentionSpec(16, 2, 64, torch.float32), [], None,
                                        torch.device("cpu"))
    assert builder.reorder_batch(batch, SchedulerOutput(tokens)) == (swaps > 0)
    assert batch.swaps == swaps  # = decodes behind the decode region: the minimum
    ordered = [tokens[r] for r in batch.req_ids]
    num_decodes = lens.count(1)
    assert ordered[:num_decodes] == [1] * num_decodes and 1 not in ordered[num_decodes:]


# --- hyper-parameters, declarations, refusals -----------------------------------------------
def test_layers_must_share_their_plan_hyperparameters():
    with model_scope():
        a = Attention(8, 64, 0.125, 2, prefix="a", attn_backend=FlashInferBackend,
                      per_layer_sliding_window=16, logits_soft_cap=5.0)
        b = Attention(8, 64, 0.25, 2, prefix="b", attn_backend=FlashInferBackend)
    params = get_per_layer_parameters({"a": a, "b": b})
    assert params["a"] == PerLayerParameters(15, 5.0, 0.125)
    assert infer_global_hyperparameters({"a": params["a"]}) == params["a"]
    with pytest.raises(ValueError, match="'b' has PerLayerParameters"):
        infer_global_hyperparameters(params)
    with pytest.raises(ValueError, match="No attention layers"):
        infer_global_hyperparameters({})
    spec = AttentionSpec(16, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="must share"):
        FlashInferMetadataBuilder(spec, ["a", "b"], None, torch.device("cpu"))
    with pytest.raises(ValueError, match="none of layer_names=\\['gone'\\]"):
        FlashInferMetadataBuilder(spec, ["gone"], None, "cpu").hyperparameters()


def test_backend_declares_the_seed_interface(monkeypatch):
    b = FlashInferBackend
    assert b.get_name() == "FLASHINFER" and b.accept_output_buffer
    assert b.get_impl_cls() is FlashInferImpl and b.get_metadata_cls() is FlashInferMetadata
    assert b.get_builder_cls() is FlashInferMetadataBuilder
    assert b.get_kv_cache_shape(10, 16, 2, 128) == (10, 2, 16, 2, 128)
    assert b.get_kv_cache_stride_order() == (0, 1, 2, 3, 4)
    monkeypatch.setenv("PAGEDATTN_KV_CACHE_LAYOUT", "HND")
    assert b.get_kv_cache_stride_order() == (0, 1, 3, 2, 4)
    with pytest.raises(ValueError, match="Head size 96 is not supported by FlashInfer. "
                                         "Supported head sizes are: \\[64, 128, 256\\]"):
        b.validate_head_size(96)


def test_selector_forces_it_on_cpu_and_ranks_it_after_flash_attn(monkeypatch):
    import pagedattn
    from pagedattn.selector import PREFERENCE

    assert PREFERENCE["cuda"].index("FLASHINFER") == PREFERENCE["cuda"].index("FLASH_ATTN") + 1
    assert "FLASHINFER" not in PREFERENCE["cpu"]
    monkeypatch.setenv("PAGEDATTN_ATTENTION_BACKEND", "FLASHINFER")
    assert pagedattn.get_attn_backend(128, torch.bfloat16, "auto", 16) is FlashInferBackend


def test_refusals_name_the_reason():
    with pytest.raises(NotImplementedError, match="Encoder self-attention and encoder/decoder "
                                                  "cross-attention are not implemented"):
        with model_scope():
            Attention(4, 64, 0.1, 2, attn_backend=FlashInferBackend,
                      attn_type=AttentionType.ENCODER_ONLY)
    with pytest.raises(ValueError, match="alibi_slopes are not supported by FLASHINFER"):
        make_layers(FlashInferBackend, alibi_slopes=[0.1] * 8)
    layer = make_layers(FlashInferBackend)["layers.0.attn"]
    q = torch.zeros(2, 8, 64)
    with pytest.raises(ValueError, match="Output tensor must be provided"):
        layer.impl.forward(layer, q, None, None, torch.zeros(4, 2, 16, 2, 64), None)
    with pytest.raises(NotImplementedError, match="fused output quantization"):
        layer.impl.forward(layer, q, None, None, torch.zeros(4, 2, 16, 2, 64), None,
                           output=q.clone(), output_scale=torch.ones(()))
    with pytest.raises(ValueError, match="Head size 80"):
        Attention(4, 80, 0.1, 2, attn_backend=FlashInferBackend,
                  cache_config=CacheConfig())


def test_csr_indices_of_a_block_table_with_empty_rows():
    from pagedattn.backends.flashinfer import csr_indices

    table = torch.arange(24, dtype=torch.int32).view(4, 6)
    got = csr_indices(table, torch.tensor([2, 0, 6, 0]))
    assert got.tolist() == [0, 1, 12, 13, 14, 15, 16, 17]
    assert csr_indices(table[:0], torch.zeros(0, dtype=torch.int64)).tolist() == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_layers_match_flash_attn_and_the_oracle():
    steps = [([0, 1, 2, 3], [700, 1, 300, 64]), ([0, 1, 2, 3], [1, 1, 1, 1]),
             ([3, 1, 0, 2], [1, 1, 200, 33])]
    runs = [LayerRunner(make_layers(b, 2, 32, 8, 128, dtype=torch.bfloat16), num_blocks=256,
                        dtype=torch.bfloat16, device="cuda")
            for b in (FlashInferBackend, FlashAttentionBackend)]
    for ids, lens in steps:
        fi, fa = (r.step(ids, lens) for r in runs)
        check_step(fi, torch.bfloat16)
        for name in fi:
            torch.testing.assert_close(fi[name][0], fa[name][0], atol=1e-2, rtol=1e-2)


# --- CUDA graphs: capture builds, replay builds -------------------------------------------------
GRAPH_BATCHES = [  # (query lens, seq lens): decodes, chunks, a first chunk, mixes, fewer requests
    ([1, 5, 1, 9], [40, 5, 100, 30]),
    ([1, 1, 1], [7, 200, 33]),
    ([20], [20]),
    ([3, 1, 12, 1], [250, 1, 12, 64]),
]


def graph_setup(device, dtype, tokens, reqs, num_blocks=96, heads=(8, 2), head_size=64):
    """One FLASHINFER layer over a random cache, its builder, the captured metadata of a step
    of `tokens` over `reqs` (decode only when equal) and static q/k/v of that many rows."""
    from pagedattn import EngineConfig
    from pagedattn.integrations.cuda_graphs import dummy_batch
    from pagedattn.kv_cache import allocate_kv_cache

    (name, layer), = make_layers(FlashInferBackend, 1, *heads, head_size, dtype=dtype).items()
    layer.to(device)
    cache = allocate_kv_cache(FlashInferBackend, num_blocks, 16, heads[1], head_size, dtype,
                              device=device)
    cache.copy_(torch.randn(cache.shape, dtype=dtype))
    layer.kv_cache = [cache]
    builder = FlashInferMetadataBuilder(
        AttentionSpec(16, heads[1], head_size, dtype), [name],
        EngineConfig(max_num_seqs=reqs, max_model_len=256, max_num_batched_tokens=tokens),
        torch.device(device))
    captured = builder.build_for_cudagraph_capture(dummy_batch(tokens, reqs, 16, device))
    captured.slot_mapping.fill_(-1)  # the capture's own run writes nothing
    qkv = [torch.zeros(tokens, h * head_size, dtype=dtype, device=device)
           for h in (heads[0], heads[1], heads[1])]
    return layer, cache, builder, captured, qkv


def new_graph_batch(query_lens, seq_lens, qkv, device, g, num_blocks=96):
    from conftest import scattered_block_table

    table = scattered_block_table(seq_lens, 16, num_blocks, g)
    for x in qkv:  # a batch too large for them is never run
        x.zero_()
        n = min(sum(query_lens), x.shape[0])
        x[:n] = torch.randn(n, x.shape[1], generator=g)
    return CommonAttentionMetadata.from_lengths(query_lens, seq_lens, table, 16, device), table


def graph_oracle(layer, cache, q, query_lens, seq_lens, table):
    """The step's attention from the cache as the step left it (its new keys written)."""
    n, h, d = sum(query_lens), layer.num_heads, layer.head_size
    want, _ = ref.paged_attention(q[:n].view(n, h, d).cpu(), cache[:, 0].cpu(),
                                  cache[:, 1].cpu(), query_lens, seq_lens, table,
                                  scale=d ** -0.5)
    return want


@pytest.mark.parametrize("tokens, reqs", [(32, 4), (4, 4)])
def test_a_replay_build_plans_new_batches_into_the_captured_wrapper(tokens, reqs):
    """On a CPU the captured step runs eagerly on the replay build's metadata: what a graph
    replay reads. It equals the oracle and an eager build of the same batch."""
    layer, cache, builder, captured, (q, k, v) = graph_setup("cpu", torch.float32, tokens, reqs)
    decode = tokens == reqs
    assert (captured.decode_wrapper if decode else captured.prefill_wrapper) \
        .is_cuda_graph_enabled
    g = torch.Generator().manual_seed(0)
    for query_lens, seq_lens in GRAPH_BATCHES:
        if decode and max(query_lens) > 1:
            with pytest.raises(ValueError, match="decodes only"):
                builder.build_for_cudagraph_replay(new_graph_batch(
                    query_lens, seq_lens, (q, k, v), "cpu", g)[0], captured)
            continue
        common, table = new_graph_batch(query_lens, seq_lens, (q, k, v), "cpu", g)
        md = builder.build_for_cudagraph_replay(common, captured)
        for name in md.cuda_graph_inputs:  # what a graph reads stays where it was captured
            assert getattr(md, name).data_ptr() == getattr(captured, name).data_ptr(), name
        with set_forward_context(md):
            out = layer(q, k, v)
        n = sum(query_lens)
        want = graph_oracle(layer, cache, q, query_lens, seq_lens, table)
        assert_close(out[:n].view(want.shape), want)
        with set_forward_context(builder.build(0, common)):
            eager = layer(q[:n], k[:n], v[:n])  # rewrites the same slots with the same keys
        assert_close(out[:n], eager.double())


def test_graph_builds_refuse_what_does_not_fit_and_declare_always():
    _, _, builder, captured, qkv = graph_setup("cpu", torch.float32, 16, 2)
    common, _ = new_graph_batch([9, 9], [9, 9], qkv, "cpu", torch.Generator())
    with pytest.raises(ValueError, match="does not fit the captured step of 16 tokens"):
        builder.build_for_cudagraph_replay(common, captured)
    common, _ = new_graph_batch([1, 1, 1], [3, 3, 3], qkv, "cpu", torch.Generator())
    with pytest.raises(ValueError, match="num_reqs=3 > 2"):
        builder.build(0, common)
    assert FlashInferMetadataBuilder.cudagraph_support == FlashInferBackend.capabilities \
        .cudagraph == AttentionCGSupport.ALWAYS
    first = builder.build(0, new_graph_batch([1], [5], qkv, "cpu", torch.Generator())[0])
    second = builder.build(0, new_graph_batch([2], [7], qkv, "cpu", torch.Generator())[0])
    for name in FlashInferMetadata.cuda_graph_inputs:  # builds reuse the persistent buffers
        assert getattr(first, name).data_ptr() == getattr(second, name).data_ptr(), name


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("tokens, reqs", [(64, 4), (4, 4)])
def test_gpu_captured_step_replays_with_new_lengths_and_block_tables(tokens, reqs):
    device, dtype = torch.device("cuda"), torch.bfloat16
    layer, cache, builder, captured, (q, k, v) = graph_setup(
        device, dtype, tokens, reqs, heads=(32, 8), head_size=128)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), set_forward_context(captured):
        layer(q, k, v)  # warm up: compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), set_forward_context(captured):
        out = layer(q, k, v)
    g = torch.Generator().manual_seed(1)
    for query_lens, seq_lens in GRAPH_BATCHES:
        if tokens == reqs and max(query_lens) > 1:
            continue
        common, table = new_graph_batch(query_lens, seq_lens, (q, k, v), device, g)
        builder.build_for_cudagraph_replay(common, captured)
        graph.replay()
        torch.cuda.synchronize()
        n = sum(query_lens)
        want = graph_oracle(layer, cache, q, query_lens, seq_lens, table)
        assert_close(out[:n].view(want.shape), want, dtype)
        with set_forward_context(builder.build(0, common)):
            eager = layer(q[:n], k[:n], v[:n])
        assert_close(out[:n], eager.double(), dtype)


# --- the paged generator replays FLASHINFER steps ------------------------------------------------
def tiny_llama_head_64():
    """A 2-layer Llama with head_dim 64 (FLASHINFER's smallest), random weights, fp32."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=64, max_position_embeddings=256)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def emulated_capture(self, key):
    """DecodeGraphRunner._capture whose "graph" re-runs the forward on the captured metadata
    (what a replay reads), so the runner's replay builds are checked on a CPU."""
    from types import SimpleNamespace

    from pagedattn.integrations.cuda_graphs import DecodeGraph, dummy_batch

    tokens, reqs = (key, key) if isinstance(key, int) else key
    md = self.builder.build_for_cudagraph_capture(
        dummy_batch(tokens, reqs, self.block_size, self.device))
    md.slot_mapping.fill_(-1)
    inputs = torch.zeros(2 * tokens + reqs, dtype=torch.long)
    ids, pos, rows = inputs[:tokens][None], inputs[tokens:2 * tokens][None], inputs[2 * tokens:]
    with set_forward_context(md):
        logits = self.forward(ids, pos, rows).clone()

    def replay():
        with set_forward_context(md):
            logits.copy_(self.forward(ids, pos, rows))
    self.graphs[key] = DecodeGraph(SimpleNamespace(replay=replay), inputs, md, logits, tokens,
                                   reqs)
    return self.graphs[key]


def test_generator_replays_flashinfer_decode_and_mixed_steps(monkeypatch):
    from pagedattn.integrations import hf_generator
    from pagedattn.integrations.cuda_graphs import DecodeGraphRunner
    from test_integration_cuda_graphs import _logits, _run

    monkeypatch.setattr(DecodeGraphRunner, "_capture", emulated_capture)
    monkeypatch.setattr(hf_generator, "why_not_cuda_graphs", lambda device, builder: [])
    model = tiny_llama_head_64()
    graphed, tokens = _run(model, True, attn_backend=FlashInferBackend)
    eager, eager_tokens = _run(model, False, attn_backend=FlashInferBackend)
    assert tokens == eager_tokens
    for a, b in zip(_logits(graphed), _logits(eager)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert all(s.cuda_graph for s in graphed.stats), "a step ran eagerly"
    assert any(isinstance(k, tuple) for k in graphed.graphs.graphs)  # mixed steps too


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_generator_graph_steps_give_the_eager_tokens():
    from test_integration_cuda_graphs import _logits, _run

    model = tiny_llama_head_64().cuda()
    graphed, tokens = _run(model, True, attn_backend=FlashInferBackend)
    eager, eager_tokens = _run(model, False, attn_backend=FlashInferBackend)
    assert graphed.graphs.disabled_reason is None, graphed.graphs.disabled_reason
    assert tokens == eager_tokens
    for a, b in zip(_logits(graphed), _logits(eager)):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)
    assert sum(s.cuda_graph for s in graphed.stats) >= 10
