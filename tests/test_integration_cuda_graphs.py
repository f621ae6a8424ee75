"""The paged generator's CUDA-graph decode steps: the same tokens as eager steps.

On CUDA, pure-decode steps replay a graph captured per padded batch size; every other step runs
eagerly. The CPU tests check that the option changes nothing off CUDA and that a builder
whose `build` does not reuse its buffers (TORCH_SDPA's) is refused, never replayed.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs the hf extra: transformers")

from pagedattn.backends.flash_attn import (  # noqa: E402
    FlashAttentionBackend,
    FlashAttentionMetadataBuilder,
)
from pagedattn.backends.torch_sdpa import TorchSDPABackend, TorchSDPAMetadataBuilder  # noqa: E402
from pagedattn.config import EngineConfig  # noqa: E402
from pagedattn.forward_context import set_forward_context  # noqa: E402
from pagedattn.integrations import hf_generator  # noqa: E402
from pagedattn.integrations.cuda_graphs import (  # noqa: E402
    DecodeGraph,
    DecodeGraphRunner,
    batch_buckets,
    builder_reuses_buffers,
    dummy_batch,
    why_not_cuda_graphs,
)
from pagedattn.integrations.hf_generator import PagedGenerator  # noqa: E402
from pagedattn.integrations.hf_models import available_archs, tiny_model  # noqa: E402
from pagedattn.metadata import AttentionSpec  # noqa: E402
from pagedattn.types import AttentionCGSupport  # noqa: E402

BLOCK = 4
# Prompt lengths and new tokens differ so that the decode batch shrinks as requests finish and
# replays pad it to a bucket (6 -> 8, 3 -> 4); 33 > the token budget: a chunked prefill.
PROMPT_LENS = (5, 17, 33, 9, 12, 3)
NEW_TOKENS = (16, 9, 12, 20, 5, 14)


def _prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _run(model, use_cuda_graphs: bool, eos=(), **kwargs
         ) -> tuple[PagedGenerator, list[list[int]]]:
    gen = PagedGenerator(model, block_size=BLOCK, num_blocks=96, max_num_seqs=8,
                         max_num_batched_tokens=24, record_logits=True, max_model_len=64,
                         use_cuda_graphs=use_cuda_graphs, **kwargs)
    reqs = [gen.add_request(p, n, eos_token_id=eos) for p, n in zip(_prompts(), NEW_TOKENS)]
    while gen.has_unfinished():
        gen.step()
    return gen, [r.output_ids for r in reqs]


def _logits(gen: PagedGenerator) -> list[torch.Tensor]:
    return [torch.stack(r.logits) for r in sorted(gen.finished, key=lambda r: r.req_id)]


def _builder(cls, device="cpu"):
    spec = AttentionSpec(BLOCK, 2, 16, torch.float32)
    return cls(spec, [], EngineConfig(max_num_seqs=8, max_model_len=64), torch.device(device))


# --- CPU: the option is ignored, the guards hold -----------------------------------------------
def test_batch_buckets_cover_every_batch_size_up_to_max_num_seqs():
    assert batch_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert batch_buckets(16) == [1, 2, 4, 8, 16]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(1) == [1]


def test_cuda_graphs_are_ignored_on_cpu_and_tokens_are_unchanged():
    model = tiny_model("llama")
    with_graphs, tokens = _run(model, use_cuda_graphs=True)
    without, eager_tokens = _run(model, use_cuda_graphs=False)
    assert with_graphs.graphs is None
    assert any("cpu" in r for r in with_graphs.cuda_graphs_off), with_graphs.cuda_graphs_off
    assert without.cuda_graphs_off == ["use_cuda_graphs=False"]
    assert tokens == eager_tokens
    assert not any(s.cuda_graph for s in with_graphs.stats)


def test_why_not_names_the_device_and_a_builder_without_graph_support():
    builder = _builder(FlashAttentionMetadataBuilder)
    assert why_not_cuda_graphs(torch.device("cuda"), builder) == []
    assert why_not_cuda_graphs(torch.device("cpu"), builder) == [
        "the model is on cpu, CUDA graphs need cuda"]

    class NoGraphs(FlashAttentionMetadataBuilder):
        cudagraph_support = AttentionCGSupport.NEVER

    (reason,) = why_not_cuda_graphs(torch.device("cuda"), _builder(NoGraphs))
    assert "NoGraphs.cudagraph_support is NEVER" in reason


def test_a_builder_that_returns_new_tensors_is_never_replayed():
    # TORCH_SDPA passes each batch's own tensors through (so it declares NEVER): a graph
    # captured over one batch would replay it forever. Handed such a builder anyway, the
    # runner's own check refuses it before capturing.
    assert builder_reuses_buffers(_builder(FlashAttentionMetadataBuilder), BLOCK,
                                  torch.device("cpu"))
    sdpa = _builder(TorchSDPAMetadataBuilder)
    assert not builder_reuses_buffers(sdpa, BLOCK, torch.device("cpu"))
    with pytest.warns(RuntimeWarning, match="CUDA graphs off"):
        runner = DecodeGraphRunner(lambda ids, pos: None, sdpa, BLOCK, 8, torch.device("cpu"))
    assert "returns new tensors" in runner.disabled_reason
    assert runner.run([1], [0], None) is None  # the step runs eagerly


def _an_early_eos(tokens: list[list[int]]) -> int:
    """A token that some requests sample before their last one (they stop there)."""
    early = [t[2] for t in tokens if t[2] not in t[:2] and len(t) > 4]
    if early:
        return early[0]
    # A tiny model may repeat one token a request (gemma2's does): a request's first token,
    # which some other request never samples, stops it at once and leaves those running.
    return next(t[0] for t in tokens if any(t[0] not in u for u in tokens))


def _emulate_graphs(monkeypatch) -> None:
    """On the CPU a stand-in "graph" re-runs the forward on the captured metadata object, which
    reads the builder's buffers (and the captured input ids) as a real replay does."""
    def capture(self, key):
        tokens, reqs = (key, key) if isinstance(key, int) else key
        metadata = self.builder.build_for_cudagraph_capture(
            dummy_batch(tokens, reqs, self.block_size, self.device))
        metadata.slot_mapping.fill_(-1)
        inputs = torch.zeros(2 * tokens + reqs, dtype=torch.long)
        ids, pos, rows = inputs[:tokens][None], inputs[tokens:2 * tokens][None], \
            inputs[2 * tokens:]
        with set_forward_context(metadata):
            logits = self.forward(ids, pos, rows).clone()

        def replay():
            with set_forward_context(metadata):
                logits.copy_(self.forward(ids, pos, rows))
        self.graphs[key] = DecodeGraph(SimpleNamespace(replay=replay), inputs, metadata, logits,
                                       tokens, reqs)
        return self.graphs[key]

    monkeypatch.setattr(DecodeGraphRunner, "_capture", capture)
    monkeypatch.setattr(hf_generator, "why_not_cuda_graphs", lambda device, builder: [])


def test_replays_of_an_emulated_graph_give_the_eager_tokens(monkeypatch):
    # This checks the padding to buckets, the builder's refills and the row selection without
    # a GPU.
    _emulate_graphs(monkeypatch)
    model = tiny_model("llama")
    graphed, tokens = _run(model, True, attn_backend=FlashAttentionBackend)
    eager, eager_tokens = _run(model, False, attn_backend=FlashAttentionBackend)
    assert tokens == eager_tokens
    for a, b in zip(_logits(graphed), _logits(eager)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert all(s.cuda_graph for s in graphed.stats), "a step ran eagerly"
    assert {8, 4} <= set(graphed.graphs.graphs)
    mixed = [k for k in graphed.graphs.graphs if isinstance(k, tuple)]
    assert mixed and any(s.num_prefill_tokens and s.num_decode_tokens for s in graphed.stats)


def test_async_steps_over_emulated_graphs_give_the_serial_tokens(monkeypatch):
    # Each replay launched before the step before it is read back: its decodes' ids carried
    # into the graph's input buffer from that step's tokens, EOS-stopped requests' extra
    # tokens discarded.
    _emulate_graphs(monkeypatch)
    model = tiny_model("llama")
    eos = _an_early_eos(_run(model, False, attn_backend=FlashAttentionBackend)[1])
    graphed, tokens = _run(model, True, eos, attn_backend=FlashAttentionBackend,
                           async_scheduling=True)
    eager, eager_tokens = _run(model, False, eos, attn_backend=FlashAttentionBackend,
                               async_scheduling=False)
    assert tokens == eager_tokens
    assert any(len(t) < n for t, n in zip(tokens, NEW_TOKENS))  # EOS stopped some early
    for a, b in zip(_logits(graphed), _logits(eager)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert all(s.cuda_graph for s in graphed.stats), "a step ran eagerly"
    assert sum(s.overlapped for s in graphed.stats) >= len(graphed.stats) - 2
    assert sum(s.discarded for s in graphed.stats) >= 1
    assert graphed.allocator.num_free == graphed.num_blocks


def test_a_request_longer_than_max_model_len_is_refused():
    gen = PagedGenerator(tiny_model("llama"), block_size=BLOCK, num_blocks=96, max_model_len=20)
    with pytest.raises(ValueError, match="max_model_len=20"):
        gen.add_request([5] * 10, 11)


# --- CUDA: replayed decode steps give eager's tokens ------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", available_archs())
def test_graph_decode_steps_give_the_eager_tokens(arch):
    model = tiny_model(arch).cuda()
    graphed, tokens = _run(model, use_cuda_graphs=True)
    eager, eager_tokens = _run(model, use_cuda_graphs=False)
    assert tokens == eager_tokens, f"{arch}: graph replay changed tokens"
    for a, b in zip(_logits(graphed), _logits(eager)):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)
    reason = graphed.graphs.disabled_reason
    print(f"{arch}: {sum(s.cuda_graph for s in graphed.stats)} graph steps, buckets "
          f"{sorted(graphed.graphs.graphs, key=str)}, off: {reason}")
    if arch == "gpt_oss" and reason is not None:  # MoE routing syncs the host (nonzero)
        assert "capturing" in reason
        return
    assert reason is None, reason
    assert sum(s.cuda_graph for s in graphed.stats) >= 10
    assert {8, 4} <= set(graphed.graphs.graphs), "padded buckets were not replayed"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", available_archs())
def test_async_graph_steps_give_the_serialised_tokens(arch):
    # Async scheduling is on by default on CUDA: each step is replayed while the one before
    # it still runs, its decodes' ids carried on the device. Same tokens as serialised steps,
    # graph-replayed and eager, with requests that EOS stops early.
    model = tiny_model(arch).cuda()
    eos = _an_early_eos(_run(model, True, async_scheduling=False)[1])
    overlapped, tokens = _run(model, True, eos)
    assert overlapped.async_scheduling
    serial, serial_tokens = _run(model, True, eos, async_scheduling=False)
    eager_tokens = _run(model, False, eos)[1]
    assert tokens == serial_tokens == eager_tokens, f"{arch}: async steps changed tokens"
    assert any(len(t) < n for t, n in zip(tokens, NEW_TOKENS))  # EOS stopped some early
    for a, b in zip(_logits(overlapped), _logits(serial)):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)
    stats = overlapped.stats
    print(f"{arch}: {sum(s.overlapped for s in stats)}/{len(stats)} steps overlapped, "
          f"{sum(s.cuda_graph for s in stats)} replayed, "
          f"{sum(s.discarded for s in stats)} tokens discarded")
    assert sum(s.overlapped for s in stats) >= len(stats) - 2
    assert sum(s.discarded for s in stats) >= 1
    assert not any(s.overlapped for s in serial.stats)
    assert overlapped.allocator.num_free == overlapped.num_blocks


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_torch_sdpa_on_cuda_runs_its_decode_steps_eagerly():
    model = tiny_model("llama").cuda()
    gen, tokens = _run(model, use_cuda_graphs=True, attn_backend=TorchSDPABackend)
    # Refused by its declaration (no persistent buffers), before any capture is tried.
    assert gen.graphs is None
    assert any("cudagraph_support is NEVER" in r for r in gen.cuda_graphs_off)
    assert not any(s.cuda_graph for s in gen.stats)
    assert tokens == _run(model, use_cuda_graphs=False, attn_backend=TorchSDPABackend)[1]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_graph_steps_mostly_agree_with_eager():
    # bf16 rounds the padded batch's matmuls differently: report agreement, require most.
    model = tiny_model("llama", dtype=torch.bfloat16).cuda()
    graphed, tokens = _run(model, use_cuda_graphs=True, attn_backend=FlashAttentionBackend)
    eager_tokens = _run(model, use_cuda_graphs=False, attn_backend=FlashAttentionBackend)[1]
    same = sum(a == b for a, b in zip(tokens, eager_tokens))
    print(f"bf16: {same}/{len(tokens)} requests identical")
    assert graphed.graphs.disabled_reason is None
    assert same >= len(tokens) // 2
