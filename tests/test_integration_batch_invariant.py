"""Batch-invariant mode end to end (issue 44): a PagedGenerator running many requests together
gives each one the logits, bit for bit, that it gets alone.

Together, requests share steps with others' decodes and prompt chunks, their prompts are cut
by the token budget, and a third of them start with the first request's prompt (prefix-cache
hits); alone, a request runs its own steps only. PAGEDATTN_BATCH_INVARIANT=1 (or the
generator's `batch_invariant=True`) makes the builders plan batch-invariant attention, and the
generator run its model inside `batch_invariant_ops()` (its matmuls and means). CPU: a small
batch, eager; GPU (`cuda`): 32 requests, eager and graph-replayed.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="needs the hf extra: transformers")

from pagedattn.backends.flash_attn import FlashAttentionBackend  # noqa: E402
from pagedattn.backends.flashinfer import FlashInferBackend  # noqa: E402
from pagedattn.backends.torch_sdpa import TorchSDPABackend  # noqa: E402
from pagedattn.integrations.batch_invariant_ops import batch_invariant_ops  # noqa: E402
from pagedattn.integrations.hf_generator import PagedGenerator  # noqa: E402
from pagedattn.integrations.hf_models import tiny_config, tiny_model  # noqa: E402


def _prompts(n: int, seed: int) -> list[list[int]]:
    """n prompts of 3-60 tokens; every third starts with the first one's first 20 tokens."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 256, (int(torch.randint(3, 61, (), generator=g)),),
                             generator=g).tolist() for _ in range(n)]
    prompts[0] = prompts[0] + torch.randint(3, 256, (24,), generator=g).tolist()
    for i in range(3, n, 3):
        prompts[i] = prompts[0][:20] + prompts[i]
    return prompts


def _llama(backend, dtype: torch.dtype) -> torch.nn.Module:
    """The tiny Llama, with heads of 64 for FLASHINFER (which serves 64, 128 and 256)."""
    if backend is not FlashInferBackend:
        return tiny_model("llama", dtype=dtype)
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama")
    config.head_dim = 64
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                            dtype=dtype).eval()


def _logits(model, prompts, new_tokens: int, **kwargs) -> list[torch.Tensor]:
    """Each request's logits per generated token [new_tokens, vocab], in prompt order. The
    first request runs a step ahead, so the others find its first blocks cached."""
    gen = PagedGenerator(model, block_size=4, num_blocks=1024, max_num_seqs=32,
                         max_num_batched_tokens=48, record_logits=True, max_model_len=160,
                         **kwargs)
    reqs = [gen.add_request(prompts[0], new_tokens, eos_token_id=())]
    if len(prompts) > 1:
        gen.step()
        reqs += [gen.add_request(p, new_tokens, eos_token_id=()) for p in prompts[1:]]
    while gen.has_unfinished():
        gen.step()
    assert any(r.num_prefix_hits for r in reqs) or len(prompts) < 4, "no prefix-cache hit"
    return [torch.stack(r.logits) for r in reqs]


def _check(model, prompts, new_tokens, together_kwargs, alone_kwargs) -> None:
    """The generators enter `batch_invariant_ops()` themselves (nothing here does)."""
    together = _logits(model, prompts, new_tokens, **together_kwargs)
    for i, prompt in enumerate(prompts):
        alone = _logits(model, [prompt], new_tokens, **alone_kwargs)[0]
        same = together[i].view(torch.int32) == alone.view(torch.int32)
        assert same.all(), (
            f"request {i} ({len(prompt)} prompt tokens): logits of "
            f"{(~same).any(1).sum().item()} of {new_tokens} steps differ from its run "
            f"alone, by up to {(together[i] - alone).abs().max().item():.3g}")


@pytest.mark.parametrize("backend", [TorchSDPABackend, FlashAttentionBackend],
                         ids=lambda b: b.get_name())
@pytest.mark.parametrize("switch", ["env", "argument"])
def test_each_request_gets_its_logits_alone_on_the_cpu(backend, switch, monkeypatch):
    monkeypatch.delenv("PAGEDATTN_BATCH_INVARIANT", raising=False)
    kwargs = dict(attn_backend=backend)
    if switch == "env":
        monkeypatch.setenv("PAGEDATTN_BATCH_INVARIANT", "1")
    else:
        kwargs["batch_invariant"] = True
    model = tiny_model("llama")
    _check(model, _prompts(7, seed=1), 5, kwargs, kwargs)


def test_without_the_mode_the_logits_follow_the_batch(monkeypatch):
    """What the mode buys: the same requests, default mode, differ from their runs alone."""
    monkeypatch.delenv("PAGEDATTN_BATCH_INVARIANT", raising=False)
    with pytest.raises(AssertionError, match="differ from its run alone"):
        _check(tiny_model("llama"), _prompts(7, seed=1), 5,
               dict(attn_backend=TorchSDPABackend), dict(attn_backend=TorchSDPABackend))


@pytest.mark.parametrize("switch", ["off", "env", "argument"])
def test_the_generator_runs_its_model_inside_batch_invariant_ops_in_the_mode(switch,
                                                                             monkeypatch):
    """A matmul inside the model's forward is batch_invariant_ops()'s exactly where the mode
    is on; after the step (and always without the mode) it is torch's own again."""
    monkeypatch.delenv("PAGEDATTN_BATCH_INVARIANT", raising=False)
    if switch == "env":
        monkeypatch.setenv("PAGEDATTN_BATCH_INVARIANT", "1")
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(37, 300, generator=g), torch.randn(300, 29, generator=g)
    with batch_invariant_ops():
        invariant = a @ b
    plain = a @ b
    assert not torch.equal(invariant, plain)  # else the probe cannot tell them apart
    model = tiny_model("llama")
    inside = []
    model.register_forward_pre_hook(lambda module, args: inside.append(a @ b))
    gen = PagedGenerator(model, block_size=4, num_blocks=64, max_num_seqs=2,
                         max_num_batched_tokens=16, batch_invariant=switch == "argument")
    assert gen.batch_invariant is (switch != "off")
    gen.generate([[5, 6, 7, 8, 9]], 2, eos_token_id=())
    assert len(inside) == 2
    for x in inside:
        assert torch.equal(x, invariant if switch != "off" else plain)
    assert torch.equal(a @ b, plain)


GPU = [pytest.mark.cuda,
       pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("device, backend", [
    ("cpu", TorchSDPABackend),
    pytest.param("cuda", FlashAttentionBackend, marks=GPU),
    pytest.param("cuda", FlashInferBackend, marks=GPU)], ids=["cpu", "cuda-FA", "cuda-FI"])
def test_a_sampled_sequences_logits_are_its_re_prefills(device, backend, monkeypatch):
    """A request's logits at each decode step equal those of its prompt and the tokens
    sampled so far prefilled as one prompt (six such requests at once, sharing the prompt's
    cached blocks): a token's rows as a decode and inside a prompt are the same bits."""
    monkeypatch.setenv("PAGEDATTN_BATCH_INVARIANT", "1")
    model = _llama(backend, torch.bfloat16 if device == "cuda" else torch.float32)
    model = model.to(device)
    prompt = _prompts(1, seed=3)[0]
    # Serialised steps: the requests added after the first step must be admitted before the
    # first request finishes, so that they share its cached prompt blocks (with async
    # scheduling the step that finishes it is already launched when they arrive).
    kwargs = dict(block_size=4, num_blocks=256, max_num_seqs=8, max_num_batched_tokens=48,
                  record_logits=True, attn_backend=backend, async_scheduling=False)
    gen = PagedGenerator(model, **kwargs)
    first = gen.add_request(prompt, 6, eos_token_id=())
    while gen.has_unfinished():
        gen.step()
    gen = PagedGenerator(model, **kwargs)
    again = [gen.add_request(prompt, 1, eos_token_id=())]
    gen.step()  # the prompt's blocks cached: the others find them
    again += [gen.add_request(prompt + first.output_ids[:k], 1, eos_token_id=())
              for k in range(1, 6)]
    while gen.has_unfinished():
        gen.step()
    assert any(r.num_prefix_hits for r in again)
    for k, r in enumerate(again):
        assert torch.equal(r.logits[0].view(torch.int32), first.logits[k].view(torch.int32)), k


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend, graphs", [(FlashAttentionBackend, False),
                                             (FlashAttentionBackend, True),
                                             (FlashInferBackend, True)],
                         ids=["FLASH_ATTN-eager", "FLASH_ATTN-graphs", "FLASHINFER-graphs"])
def test_32_requests_get_their_logits_alone_on_the_gpu(backend, graphs, monkeypatch):
    """Together (eagerly, or replayed from CUDA graphs of padded batches) against each
    request alone and eager."""
    monkeypatch.setenv("PAGEDATTN_BATCH_INVARIANT", "1")
    model = _llama(backend, torch.bfloat16).cuda()
    _check(model, _prompts(32, seed=2), 8,
           dict(attn_backend=backend, use_cuda_graphs=graphs),
           dict(attn_backend=backend, use_cuda_graphs=False))
