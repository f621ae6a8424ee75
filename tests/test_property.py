"""Property-based: whole random batches through the TORCH_SDPA backend agree with the oracle."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import LayerRunner, assert_close
from pagedattn import Attention, CacheConfig, model_scope
from pagedattn.backends.torch_sdpa import TorchSDPABackend


@st.composite
def batches(draw):
    num_reqs = draw(st.integers(1, 4))
    contexts = draw(st.lists(st.integers(0, 60), min_size=num_reqs, max_size=num_reqs))
    queries = draw(st.lists(st.integers(1, 20), min_size=num_reqs, max_size=num_reqs))
    group = draw(st.sampled_from([1, 2, 4]))
    num_kv_heads = draw(st.sampled_from([1, 2]))
    features = draw(st.fixed_dictionaries({}, optional={
        "per_layer_sliding_window": st.integers(1, 40),
        "logits_soft_cap": st.floats(1.0, 50.0),
        "alibi": st.just(True),
        "sinks": st.just(True),
    }))
    return dict(
        contexts=contexts, queries=queries, num_kv_heads=num_kv_heads,
        num_heads=num_kv_heads * group, head_size=draw(st.sampled_from([16, 24, 64])),
        block_size=draw(st.sampled_from([1, 8, 16, 32])),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
        cache_dtype=draw(st.sampled_from(["auto", "auto", "fp8"])),
        features=features, seed=draw(st.integers(0, 2**16)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_random_batches_match_the_oracle(b):
    features = dict(b["features"])
    h = b["num_heads"]
    if features.pop("alibi", False):
        features["alibi_slopes"] = [2 ** -(i + 1) for i in range(h)]
    if features.pop("sinks", False):
        features["sinks"] = torch.linspace(-2, 2, h)
    torch.set_default_dtype(b["dtype"])
    try:
        with model_scope():
            layer = Attention(h, b["head_size"], b["head_size"] ** -0.5, b["num_kv_heads"],
                              cache_config=CacheConfig(block_size=b["block_size"],
                                                       cache_dtype=b["cache_dtype"]),
                              prefix="attn", attn_backend=TorchSDPABackend, **features)
    finally:
        torch.set_default_dtype(torch.float32)
    tokens = sum(b["contexts"]) + sum(b["queries"])
    run = LayerRunner({"attn": layer}, num_blocks=tokens // b["block_size"] + 8,
                      block_size=b["block_size"], dtype=b["dtype"], seed=b["seed"])
    reqs = list(range(len(b["contexts"])))
    tol = dict(atol=0.15, rtol=0.1) if b["cache_dtype"] == "fp8" else {}
    with_context = [r for r in reqs if b["contexts"][r]]
    if with_context:  # cache the context first (a prefill step of those requests)
        run.step(with_context, [b["contexts"][r] for r in with_context])
    out, want = run.step(reqs, b["queries"])["attn"]
    assert_close(out, want, b["dtype"], **tol)
