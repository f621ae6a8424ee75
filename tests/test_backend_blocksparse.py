"""BLOCK_SPARSE_FLASH_ATTN through the Attention layer (prefill, then decodes) against the
oracle with the pattern's mask; its params, metadata, selection and refusals."""

from __future__ import annotations

import pytest
import torch

import reference as ref
from conftest import LayerRunner, assert_close, make_layers, randn
from pagedattn import CommonAttentionMetadata, get_attn_backend, info, selector
from pagedattn.backends import blocksparse_attn
from pagedattn.backends.blocksparse_attn import (
    BlocksparseFlashAttentionBackend as Backend,
)
from pagedattn.backends.blocksparse_attn import (
    BlocksparseFlashAttentionImpl,
    BlocksparseParams,
)
from pagedattn.metadata import AttentionSpec
from pagedattn.types import AttentionRequest, AttentionType

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PARAMS = dict(max_seqlen=256, block_size=16, local_blocks=2, vert_stride=3)


class RecordingRunner(LayerRunner):
    """Keeps every step's queries per (layer, request) so the oracle can take them."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.queries: dict = {}

    def step(self, req_ids, query_lens, common_prefix_len=0, inputs=None):
        g = self.generator
        inputs = {}
        for name, layer in self.layers.items():
            h, hk, d = layer.num_heads, layer.num_kv_heads, layer.head_size
            total = sum(query_lens)
            inputs[name] = (randn(total, h * d, dtype=self.dtype, generator=g),
                            randn(total, hk * d, dtype=self.dtype, generator=g),
                            randn(total, hk * d, dtype=self.dtype, generator=g))
            start = 0
            for r, n in zip(req_ids, query_lens):
                q = inputs[name][0][start:start + n].view(n, h, d).double()
                self.queries[(name, r)] = q
                start += n
        return super().step(req_ids, query_lens, common_prefix_len, inputs)


def sparse_runner(params, num_heads=4, num_kv_heads=2, head_size=64, dtype=torch.float32,
                  cache_dtype="auto"):
    layers = make_layers(Backend, n=2, num_heads=num_heads, num_kv_heads=num_kv_heads,
                         head_size=head_size, block_size=8, dtype=dtype,
                         cache_dtype=cache_dtype, use_sparse=True, blocksparse_params=params)
    return RecordingRunner(layers, num_blocks=48, block_size=8, dtype=dtype, device=DEVICE)


def check_sparse_step(run: LayerRunner, req_ids, query_lens, dtype=torch.float32, **tol):
    """One step of every layer against the oracle with each layer's pattern."""
    results = run.step(req_ids, query_lens)
    for name, (out, _) in results.items():
        impl = run.layers[name].impl
        p = impl.blocksparse_params
        group = impl.num_heads // impl.num_kv_heads

        def mask(h, q_pos, k_pos, p=p, group=group):
            offset = ref.blocksparse_offset(p.active_head_range[0] + h, group,
                                            p.head_sliding_step)
            return ref.blocksparse_visible(q_pos, k_pos, offset=offset, block_size=p.block_size,
                                           local_blocks=p.local_blocks,
                                           vert_stride=p.vert_stride)
        want = []
        for r in req_ids:
            hist = run.history[(name, r)]
            want.append(ref.attend_one_sequence(run.queries[(name, r)], torch.cat(hist["k"]),
                                                torch.cat(hist["v"]), scale=impl.scale,
                                                head_mask=mask)[0])
        assert_close(out, torch.cat(want), dtype, **tol)


@pytest.mark.parametrize("params,heads,dtype", [
    (dict(PARAMS), (4, 2), torch.float32),
    (dict(PARAMS, local_blocks=1, vert_stride=2, homo_head_group=True), (4, 2), torch.bfloat16),
    (dict(PARAMS, block_size=32, local_blocks=1, vert_stride=4, homo_head=True), (2, 2),
     torch.float32),
])
def test_prefill_then_decode_matches_oracle(params, heads, dtype):
    run = sparse_runner(params, *heads, dtype=dtype)
    check_sparse_step(run, [0, 1], [37, 14], dtype)  # two prompts
    for _ in range(4):  # decodes crossing the 16- and 32-token block edges
        check_sparse_step(run, [0, 1], [1, 1], dtype)
    check_sparse_step(run, [2, 0, 1], [20, 1, 1], dtype)  # a new prompt, then decodes


def test_dense_limit_equals_causal_attention():
    run = sparse_runner(dict(PARAMS, local_blocks=0, vert_stride=1))
    results = run.step([0], [30])  # LayerRunner's own oracle: plain causal attention
    for out, want in results.values():
        assert_close(out, want)
    results = run.step([0], [1])
    for out, want in results.values():
        assert_close(out, want)


def test_steps_run_the_builders_plans_and_metadata_without_them_is_refused():
    """build() plans the cache write and each layer pattern's decode; a replaced copy
    carries none (an error naming the builder) until the builder's plan() plans it."""
    import dataclasses

    from pagedattn import set_forward_context

    run = sparse_runner(dict(PARAMS))
    run.step([0], [20])
    md, _ = run.metadata([0], [1])
    layer = run.layers["layers.0.attn"]
    assert set(md.plans.decodes) == {layer.impl.decode_pattern}  # both layers': one pattern
    copy = dataclasses.replace(md, plans=None)
    q, k, v = randn(1, 256), randn(1, 128), randn(1, 128)
    with set_forward_context(copy), pytest.raises(
            ValueError, match=r"carries no plans: make it with "
                              r"BlocksparseFlashAttentionMetadataBuilder\(...\).build\(\)"):
        layer(q, k, v)
    with set_forward_context(md):
        planned = layer(q, k, v)
    with set_forward_context(run.builder.plan(copy)):  # the same key into the same slot
        assert torch.equal(layer(q, k, v), planned)


def test_fp8_cache_decode_runs_against_oracle_of_the_cache():
    run = sparse_runner(dict(PARAMS), dtype=torch.float16, cache_dtype="fp8_e4m3")
    run.step([0], [20])
    check_sparse_step(run, [0], [1], torch.float16, atol=0.15, rtol=0.1)


def test_profiling_run_gives_zeros():
    layer = next(iter(make_layers(Backend, use_sparse=True, blocksparse_params=dict(PARAMS),
                                  num_heads=4, num_kv_heads=2).values()))
    out = torch.full((3, 4, 64), float("nan"))
    layer.impl.forward(layer, torch.randn(3, 4, 64), torch.randn(3, 2, 64),
                       torch.randn(3, 2, 64), torch.empty(0), None, output=out)
    assert not out.any()


def test_params_derive_sliding_step_and_head_range(monkeypatch):
    p = BlocksparseParams(1024, 8, 2, 64, 4, 16)
    assert (p.head_sliding_step, p.active_head_range) == (2, (0, 8))
    assert BlocksparseParams(1024, 8, 2, 64, 4, 16, homo_head_group=True).head_sliding_step == -8
    assert BlocksparseParams(1024, 8, 2, 64, 4, 16, True, True).head_sliding_step == 0
    monkeypatch.setattr(blocksparse_attn, "tensor_parallel_rank_and_size", lambda: (1, 2))
    p = BlocksparseParams(1024, 8, 2, 64, 4, 16)
    assert (p.head_sliding_step, p.active_head_range) == (1, (8, 16))


@pytest.mark.parametrize("field,value", [("block_size", 0), ("local_blocks", -1),
                                         ("vert_stride", 0)])
def test_params_reject_bad_values(field, value):
    args = dict(max_seqlen=64, num_heads=4, num_kv_heads=2, block_size=16, local_blocks=1,
                vert_stride=2)
    with pytest.raises(ValueError, match=f"{field}={value}"):
        BlocksparseParams(**{**args, field: value})


@pytest.mark.parametrize("kwargs,match", [
    (dict(alibi_slopes=[0.1] * 4), "ALiBi"), (dict(sliding_window=8), "sliding window"),
    (dict(logits_soft_cap=30.0), "soft cap"), (dict(attn_type=AttentionType.ENCODER), "encoder"),
    (dict(kv_sharing_target_layer_name="x"), "KV sharing"),
    (dict(blocksparse_params=None), "needs blocksparse_params"),
    (dict(head_size=48), "Head size 48")])
def test_impl_refuses_what_it_cannot_serve(kwargs, match):
    args = dict(num_heads=4, head_size=64, scale=0.125, num_kv_heads=2, alibi_slopes=None,
                sliding_window=None, kv_cache_dtype="auto", blocksparse_params=dict(PARAMS))
    with pytest.raises(ValueError, match=match):
        BlocksparseFlashAttentionImpl(**{**args, **kwargs})


def test_builder_splits_prefills_and_decodes_and_refuses_the_rest():
    builder = Backend.get_builder_cls()(AttentionSpec(8, 2, 64, torch.float32), [], None, "cpu")
    table = torch.arange(12, dtype=torch.int32).view(3, 4)
    md = builder.build(0, CommonAttentionMetadata.from_lengths([5, 7, 1], [5, 7, 20], table, 8))
    assert (md.num_prefills, md.num_prefill_tokens, md.num_decode_tokens) == (2, 12, 1)
    assert md.prefill_metadata.seq_start_loc.tolist() == [0, 5, 12]
    assert md.decode_metadata.seq_lens_tensor.tolist() == [20]
    assert md.decode_metadata.block_tables[:, :4].tolist() == [[8, 9, 10, 11]]
    with pytest.raises(ValueError, match="no chunked prefill or prefix caching"):
        builder.build(0, CommonAttentionMetadata.from_lengths([3], [9], table[:1], 8))
    with pytest.raises(ValueError, match="needs prefills before decodes"):
        builder.build(0, CommonAttentionMetadata.from_lengths([1, 4], [9, 4], table[:2], 8))


def test_kv_cache_shape_and_block_moves():
    assert Backend.get_kv_cache_shape(10, 16, 2, 64) == (2, 10, 2048)
    cache = torch.randn(2, 4, 64)
    copy = cache.clone()
    Backend.copy_blocks([cache], {0: [3]})
    assert torch.equal(cache[:, 3], copy[:, 0])


def test_selected_only_for_sparse_layers_or_when_forced(monkeypatch):
    sparse = get_attn_backend(64, torch.float16, "auto", 16, use_sparse=True)
    assert sparse is Backend
    assert get_attn_backend(64, torch.float16, "auto", 16) is not Backend
    request = AttentionRequest(head_size=64, dtype=torch.float16, device_type="cuda")
    assert "never chosen automatically" in selector.explain(request)[
        "BLOCK_SPARSE_FLASH_ATTN"][0]
    monkeypatch.setenv("PAGEDATTN_ATTENTION_BACKEND", "BLOCK_SPARSE_FLASH_ATTN")
    assert get_attn_backend(64, torch.float16, "auto", 16) is Backend


def test_info_matrix_has_the_backend_and_a_sparse_row():
    header, rows = info.capability_matrix()
    column = header.index("BLOCK_SPARSE_FLASH_ATTN")
    row = {r[0]: r for r in rows}
    assert row["block-sparse"][column] == "only"
    assert row["alibi"][column] == "-" and row["encoder-only"][column] == "-"



def test_info_command_selects_it_for_a_sparse_layer(capsys):
    from pagedattn.cli import main

    assert main(["info", "--sparse", "--head-size", "128", "--device", "cpu"]) == 0
    assert "chosen: BLOCK_SPARSE_FLASH_ATTN" in capsys.readouterr().out


def test_builder_reuses_its_buffers_and_pads_a_smaller_decode_batch():
    from pagedattn.config import EngineConfig

    config = EngineConfig(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=32)
    builder = Backend.get_builder_cls()(AttentionSpec(8, 2, 64, torch.float32), [], config,
                                        "cpu")
    table = torch.arange(16, dtype=torch.int32).view(4, 4)
    # A captured step: four single-token requests (seq_len 1 too) are all decodes.
    captured = builder.build_for_cudagraph_capture(
        CommonAttentionMetadata.from_lengths([1] * 4, [1] * 4, table, 8))
    assert captured.num_prefills == 0 and captured.num_decode_tokens == 4
    md = builder.build(0, CommonAttentionMetadata.from_lengths([1, 1], [30, 9], table[:2], 8))
    for name in builder.graph_inputs:
        assert getattr(md, name).data_ptr() == getattr(captured, name).data_ptr()
    assert captured.seq_lens_tensor.tolist() == [30, 9, 0, 0]  # padded requests: empty
    assert captured.slot_mapping[2:].tolist() == [-1, -1]  # padded tokens: no write
    assert md.workspace is captured.workspace
    with pytest.raises(ValueError, match="captures decode steps"):
        builder.build_for_cudagraph_capture(
            CommonAttentionMetadata.from_lengths([3], [3], table[:1], 8))
    with pytest.raises(ValueError, match="exceeds the builder's buffers"):
        builder.build(0, CommonAttentionMetadata.from_lengths([1] * 5, [2] * 5,
                                                              torch.zeros(5, 1).int(), 8))
