"""A model using Attention compiles whole (fullgraph) and matches eager, step after step."""

from __future__ import annotations

import torch

from conftest import LayerRunner, assert_close, randn
from pagedattn import Attention, model_scope, set_forward_context


class TinyBlock(torch.nn.Module):
    def __init__(self, hidden=64, heads=4, kv_heads=2):
        super().__init__()
        self.head_size = hidden // heads
        self.qkv = torch.nn.Linear(hidden, (heads + 2 * kv_heads) * self.head_size)
        self.out = torch.nn.Linear(hidden, hidden)
        self.sizes = [heads * self.head_size, kv_heads * self.head_size,
                      kv_heads * self.head_size]
        self.attn = Attention(heads, self.head_size, self.head_size ** -0.5, kv_heads,
                              prefix="block.attn")

    def forward(self, x):
        q, k, v = self.qkv(x).split(self.sizes, dim=-1)
        return self.out(self.attn(q, k, v))


def test_compiled_model_matches_eager_across_steps():
    torch.manual_seed(0)
    with model_scope():
        model = TinyBlock()
    layers = {"block.attn": model.attn}
    eager = LayerRunner(layers, seed=1)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=True)
    for req_ids, lens in (([0, 1], [7, 3]), ([0, 1], [1, 1]), ([0, 1, 2], [1, 4, 9])):
        md, _ = eager.metadata(req_ids, lens)
        x = randn(sum(lens), 64)
        with set_forward_context(md):
            got = compiled(x)
        # Rerunning the step in eager writes the same K/V into the same slots, so both runs
        # see the same cache.
        with set_forward_context(md):
            want = model(x)
        assert_close(got, want.double())
