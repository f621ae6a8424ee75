"""transformers decoder models run through pagedattn give transformers' own eager results.

Tiny random-weight models of each architecture whose attention feature we serve (GQA,
sliding window, soft cap + alternating window, ALiBi, sinks). Four prompts of different
lengths run together through the paged generator: continuous batching with chunked prefill
and mixed prefill/decode steps over a small, scattered cache; each must give the tokens and
the per-step logits of transformers' eager `generate` run one prompt at a time.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs the hf extra: transformers")

from pagedattn.integrations import transformers as hf  # noqa: E402
from pagedattn.integrations.hf_generator import PagedGenerator  # noqa: E402
from pagedattn.integrations.hf_models import WINDOW, available_archs, tiny_model  # noqa: E402

PROMPT_LENS = (5, 17, 33, 9)  # 33 > the step budget below: its prefill is chunked
NEW_TOKENS = 16
LOGITS_ATOL = 1e-4  # float32 end to end; the attention sums in another order than eager's


def _prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module", params=available_archs())
def arch_run(request):
    """(arch, reference tokens, reference logits, generator after the paged run, its tokens)."""
    arch = request.param
    model = tiny_model(arch)
    prompts = _prompts()
    ref_tokens, ref_logits = hf.hf_generate_greedy(model, prompts, NEW_TOKENS)
    gen = PagedGenerator(model, block_size=4, num_blocks=64, max_num_seqs=4,
                         max_num_batched_tokens=24, record_logits=True)
    tokens = gen.generate(prompts, NEW_TOKENS)
    return arch, ref_tokens, ref_logits, gen, tokens


def test_greedy_tokens_equal_transformers_eager(arch_run):
    arch, ref_tokens, _, _, tokens = arch_run
    assert tokens == ref_tokens, f"{arch}: paged tokens differ from transformers' eager"
    assert sum(len(t) for t in tokens) >= 3 * NEW_TOKENS  # eos may end one early, not all


def test_per_step_logits_match_transformers_eager(arch_run):
    arch, _, ref_logits, gen, _ = arch_run
    reqs = sorted(gen.finished, key=lambda r: r.req_id)
    for req, expected in zip(reqs, ref_logits):
        actual = torch.stack(req.logits)
        assert actual.shape == expected.shape
        torch.testing.assert_close(actual, expected, atol=LOGITS_ATOL, rtol=1e-4,
                                   msg=lambda m, r=req.req_id: f"{arch} request {r}: {m}")


def test_steps_mix_prefill_and_decode_and_chunk_prompts(arch_run):
    _, _, _, gen, _ = arch_run
    mixed = [s for s in gen.stats if s.num_prefill_tokens and s.num_decode_tokens]
    assert mixed, "no step ran prefill and decode tokens together"
    assert all(s.num_prefill_tokens + s.num_decode_tokens <= 24 for s in gen.stats)
    assert gen.stats[0].num_prefill_tokens == 24  # the budget, so a prompt was split


def test_blocks_grow_with_sequences_and_are_all_freed(arch_run):
    _, _, _, gen, tokens = arch_run
    lengths = [p + len(t) for p, t in zip(PROMPT_LENS, tokens)]
    assert gen.peak_blocks_in_use <= sum(-(-n // 4) for n in lengths)
    assert gen.peak_blocks_in_use > -(-max(PROMPT_LENS) // 4)
    assert gen.allocator.num_free == gen.num_blocks
    assert not gen.block_table.blocks


def test_a_cache_too_small_for_all_requests_queues_them_and_matches():
    """With room for about one request at a time, requests wait for blocks and still match."""
    model = tiny_model("llama")
    prompts = _prompts(seed=1)
    ref_tokens, _ = hf.hf_generate_greedy(model, prompts, 8)
    gen = PagedGenerator(model, block_size=8, num_blocks=6, max_num_batched_tokens=64)
    assert gen.generate(prompts, 8) == ref_tokens
    assert max(s.num_reqs for s in gen.stats) <= 2
    assert gen.peak_blocks_in_use <= 6


def test_sliding_window_and_soft_cap_reach_the_layers():
    model = tiny_model("gemma2")
    layers = list(hf.attach(model).values())
    assert [layer.sliding_window for layer in layers] == [WINDOW, None]
    assert all(layer.impl.logits_soft_cap == 5.0 for layer in layers)


def test_a_padded_batch_is_refused_with_the_fix():
    model = tiny_model("llama")
    hf.attach(model)
    module = model.model.layers[0].self_attn
    q = torch.zeros(2, 4, 3, 16)
    kv = torch.zeros(2, 1, 3, 16)
    with pytest.raises(ValueError, match="batch size must be 1"):
        hf.paged_attention_forward(module, q, kv, kv, None, scaling=module.scaling)


def test_eager_context_restores_pagedattn():
    model = tiny_model("llama")
    hf.attach(model)
    with hf.attn_implementation_ctx(model, "eager"):
        assert model.config._attn_implementation == "eager"
    assert model.config._attn_implementation == hf.ATTN_IMPLEMENTATION


def test_shared_prompt_prefix_is_computed_once_and_tokens_still_match():
    """Prompts that start with the same 20 tokens share those cached blocks (prefix caching);
    requests that arrive later skip their prefill, and every answer stays transformers'."""
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(5)
    system = torch.randint(3, 256, (20,), generator=g).tolist()
    prompts = [system + torch.randint(3, 256, (n,), generator=g).tolist() for n in (3, 7, 1)]
    ref_tokens, _ = hf.hf_generate_greedy(model, prompts, 8)
    gen = PagedGenerator(model, block_size=4, num_blocks=64, max_num_seqs=4,
                         max_num_batched_tokens=64)
    assert gen.generate(prompts[:1], 8) == ref_tokens[:1]  # alone: nothing to share
    assert not gen._cached_blocks  # its blocks, and their cache entries, went with it
    holder = gen.add_request(prompts[0], 40)  # keeps the prefix blocks alive while others run
    gen.step()
    assert gen.generate(prompts[1:], 8) == ref_tokens[1:]  # runs the holder to the end too
    hits = {r.req_id: r.num_prefix_hits for r in gen.finished}
    assert hits[holder.req_id] == 0
    assert [hits[r] for r in sorted(hits) if r > holder.req_id] == [20, 20]  # 5 full blocks
    assert gen.allocator.num_free == gen.num_blocks and not gen._cached_blocks


def test_prefix_caching_can_be_turned_off():
    model = tiny_model("llama")
    prompts = [[7] * 12 + [9], [7] * 12 + [11]]
    gen = PagedGenerator(model, block_size=4, num_blocks=32, enable_prefix_caching=False)
    gen.generate(prompts, 2)
    assert all(r.num_prefix_hits == 0 for r in gen.finished)


def test_a_large_batch_matches_transformers_request_by_request():
    """24 requests at once under a 6-token budget (steps of decodes and prompt chunks, a
    14-token prompt split over steps), different max_new_tokens and an EOS that ends some
    early: each request's tokens are transformers' own, run alone. The step's inputs are built for
    the whole batch with array operations; this checks them request by request."""
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 256, (1 + i % 3 if i % 4 else 14,), generator=g).tolist()
               for i in range(24)]
    max_new = torch.randint(4, 21, (24,), generator=g).tolist()
    ref_tokens, _ = hf.hf_generate_greedy(model, prompts, 20)
    eos = ref_tokens[0][3]  # some requests stop at it, the others run to their max_new
    want = []
    for tokens, n in zip(ref_tokens, max_new):
        tokens = tokens[:n]
        want.append(tokens[:tokens.index(eos) + 1] if eos in tokens else tokens)
    assert sum(len(w) < n for w, n in zip(want, max_new)) >= 2  # EOS ends a few early
    gen = PagedGenerator(model, block_size=4, num_blocks=512, max_num_seqs=24,
                         max_num_batched_tokens=6)
    reqs = [gen.add_request(p, n, eos_token_id=[eos, 2]) for p, n in zip(prompts, max_new)]
    while gen.has_unfinished():
        gen.step()
    assert [r.output_ids for r in reqs] == want
    assert any(s.num_decode_tokens >= 4 and s.num_prefill_tokens for s in gen.stats)
    assert all(s.num_prefill_tokens + s.num_decode_tokens <= 6 for s in gen.stats)
    assert all(0 < s.host_seconds <= s.seconds for s in gen.stats)
    assert gen.allocator.num_free == gen.num_blocks and not gen.block_table.blocks
