"""The DCP step planned once per step, run in one process: a DCP group of one runs the whole
algorithm (context pass with LSE, correction, new-token pass, merge) without collectives.
Through the Attention layer and the builder, against the oracle; a decode step captured with
`build_for_cudagraph_capture` replays with new lengths (a CUDA graph on a GPU; on a CPU the
captured metadata's plans run again over a later build's buffers, which is what a replay
reads)."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from conftest import FP8_TOLERANCE, LayerRunner, assert_close, check_step, make_layers
from pagedattn import CommonAttentionMetadata, EngineConfig, set_forward_context
from pagedattn.backends.dcp import DCPPlanner, DCPPlans
from pagedattn.backends.flash_attn import FlashAttentionBackend
from pagedattn.backends.flash_attn_diffkv import FlashAttentionDiffKVBackend
from pagedattn.ops.providers import use_provider

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton kernels' device
STEPS = [(["a", "b", "c"], [21, 40, 5]),  # prompts: no cached context yet
         (["a", "b", "c", "d"], [1, 17, 1, 9]),  # decodes, a chunk and a new prompt
         (["d", "a", "b", "c"], [4, 1, 1, 1])]


def dcp_runner(layers: dict, device="cpu", dtype=torch.float32, block_size=16,
               num_blocks=64, **config) -> LayerRunner:
    """A LayerRunner whose builder plans every step for a DCP group of one."""
    config = EngineConfig(enable_cascade=False, **config)
    runner = LayerRunner(layers, num_blocks=num_blocks, block_size=block_size, dtype=dtype,
                         device=device, engine_config=config)
    runner.builder.dcp = DCPPlanner(config, config.max_num_seqs, torch.device(device))
    for layer in layers.values():
        layer.to(device)  # its scales
    return runner


def keep_built(runner: LayerRunner) -> list:
    """Every metadata the runner's builder returns, in order."""
    built, build = [], runner.builder.build
    runner.builder.build = lambda *a, **kw: built.append(build(*a, **kw)) or built[-1]
    return built


def dcp_plans(md) -> list:
    return [p for p in md.plans.kinds if isinstance(p, DCPPlans)]


SINKS_SOFTCAP = dict(sinks=torch.tensor([0.5, -1.0, 0.0, 1.0]), logits_soft_cap=5.0)
WINDOW_ALIBI = dict(per_layer_sliding_window=6, alibi_slopes=[0.5, 0.25, 0.125, 0.0625])


# fp8 runs on the PyTorch provider only: under the interpreter the Triton kernel's fp8 cache
# with float32 queries is off the oracle on its plain path too (not a DCP matter).
@pytest.mark.parametrize("provider, features", [
    ("torch", SINKS_SOFTCAP), ("triton", SINKS_SOFTCAP), ("torch", WINDOW_ALIBI),
    ("triton", WINDOW_ALIBI), ("torch", dict(cache_dtype="fp8_e4m3"))])
def test_layers_of_a_step_share_one_dcp_plan_and_equal_the_oracle(provider, features):
    layers = make_layers(FlashAttentionBackend, 2, num_heads=4, num_kv_heads=2, head_size=32,
                         **features)
    runner = dcp_runner(layers, DEVICE, max_num_seqs=8, max_model_len=256)
    built = keep_built(runner)
    tol = FP8_TOLERANCE if "cache_dtype" in features else {}
    with use_provider(provider):
        for req_ids, query_lens in STEPS:
            check_step(runner.step(req_ids, query_lens), **tol)
            assert len(dcp_plans(built[-1])) == 1  # made by build(), run by both layers
            assert built[-1].dcp is not None


def test_diffkv_layers_run_the_planned_dcp_step(monkeypatch):
    monkeypatch.setattr(FlashAttentionDiffKVBackend, "head_size_v", 16)
    layers = make_layers(FlashAttentionDiffKVBackend, 1, num_heads=4, num_kv_heads=1,
                         head_size=32)
    runner = dcp_runner(layers, max_num_seqs=8, max_model_len=256)
    for req_ids, query_lens in STEPS:
        check_step(runner.step(req_ids, query_lens))


def decode_batch(runner: LayerRunner, req_ids, device) -> CommonAttentionMetadata:
    """One new token for each request (appended to the runner's block table)."""
    for r in req_ids:
        runner.table.append_tokens(r, 1)
    return CommonAttentionMetadata.from_lengths(
        [1] * len(req_ids), [runner.table.num_tokens[r] for r in req_ids],
        runner.table.tensor(req_ids), runner.block_size, device)


def captured_decode_replays(device, dtype, heads, kv_heads, head_size, prompts, long,
                            use_graph: bool) -> None:
    """Capture a decode step of len(prompts) requests, then replay batches with other
    lengths: all of them one step on, and (after a new prompt of `long` tokens, longer than
    any context at capture) two of them padded to the captured count. Each replay is checked
    against the oracle and an eager step."""
    batch = len(prompts)
    layers = make_layers(FlashAttentionBackend, 1, num_heads=heads, num_kv_heads=kv_heads,
                         head_size=head_size, dtype=dtype, logits_soft_cap=20.0,
                         sinks=torch.linspace(-1.0, 1.0, heads))
    (name, layer), = layers.items()
    runner = dcp_runner(layers, device, dtype, num_blocks=4 * long // 16 + 32,
                        max_num_seqs=8, max_model_len=2 * long)
    reqs = [f"r{i}" for i in range(batch)]
    check_step(runner.step(reqs, prompts), dtype)
    g = torch.Generator().manual_seed(5)
    q = torch.zeros(batch, heads * head_size, dtype=dtype, device=device)
    k = torch.zeros(batch, kv_heads * head_size, dtype=dtype, device=device)
    v = torch.zeros_like(k)

    def new_inputs(n):
        for x in (q, k, v):
            x.copy_(torch.randn(x.shape, generator=g))
        return (x[:n].cpu().float() for x in (q, k, v))

    def expected(req_ids, inputs):
        return runner._expected(name, layer, req_ids, [1] * len(req_ids), *inputs)

    md = runner.builder.build_for_cudagraph_capture(decode_batch(runner, reqs, device))
    want = expected(reqs, new_inputs(batch))
    side = torch.cuda.Stream() if use_graph else None  # warm up off the capture's stream
    with torch.cuda.stream(side) if use_graph else nullcontext(), set_forward_context(md):
        out = layer(q, k, v)  # on a GPU, compiles the kernels outside the capture
    if use_graph:
        torch.cuda.current_stream().wait_stream(side)
    assert_close(out.view(batch, heads, head_size), want, dtype)
    if use_graph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), set_forward_context(md):
            out = layer(q, k, v)

    def replay():
        if use_graph:
            graph.replay()
            torch.cuda.synchronize()
            return out
        with set_forward_context(md):  # the captured plans, over the new build's buffers
            return layer(q, k, v)

    for step in range(2):
        if step == 1:  # a context longer than the capture's: the plans' bound is max_model_len
            check_step(runner.step(["long"], [long]), dtype)
            real = ["long", "r1", "r2"]
        else:
            real = reqs
        common = decode_batch(runner, real, device)
        want = expected(real, new_inputs(len(real)))
        runner.builder.build(0, common)  # the same persistent buffers the capture reads
        got = replay()[:len(real)]
        assert_close(got.view(len(real), heads, head_size), want, dtype)
        with set_forward_context(runner.builder.build(0, common)):
            eager = layer(q[:len(real)], k[:len(real)], v[:len(real)])  # same slots, values
        assert_close(got, eager.double(), dtype)
    assert len(dcp_plans(md)) == 1


@pytest.mark.parametrize("provider", ["torch", "triton"])
def test_captured_dcp_decode_plans_serve_later_batches(provider):
    with use_provider(provider):
        captured_decode_replays(DEVICE, torch.float32, 4, 1, 32, [20, 7, 33, 1], 80,
                                use_graph=False)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_dcp_decode_step_captured_in_a_cuda_graph_replays_with_new_lengths():
    captured_decode_replays("cuda", torch.bfloat16, 32, 4, 128, [30, 7, 640, 1, 12, 45],
                            1500, use_graph=True)


def test_a_window_layer_under_dcp_cannot_be_captured():
    layers = make_layers(FlashAttentionBackend, 1, num_heads=4, num_kv_heads=2, head_size=32,
                         per_layer_sliding_window=8)
    runner = dcp_runner(layers, max_num_seqs=4, max_model_len=128)
    runner.step(["a"], [10])
    with pytest.raises(ValueError, match="cannot be captured"):  # planned in the build
        runner.builder.build_for_cudagraph_capture(decode_batch(runner, ["a"], "cpu"))
