"""Property-based: random batches through every registered backend agree with the oracle.

Each backend in `selector.BACKENDS` is tested on what its declared capabilities say it serves
(dtypes, head and block sizes, fp8 caches, window / soft cap / ALiBi / sinks, different V head
sizes), plus a small `BackendProfile` for what the declaration cannot say: which ops provider
runs it on a CPU (FLASH_ATTN's Triton kernels run under the interpreter, at small sizes) and
its share of the example budget. A backend registered later is picked up with the default
profile; give it one here if it needs another provider, smaller batches or its own oracle.

Budgets: >= 300 examples per CI run (CPU). `HYPOTHESIS_PROFILE=gpu` (the profile conftest.py
registers) runs >= 2,000 on CUDA with larger batches and every backend on its own kernels, as
one `cuda`-marked test per (backend, layer configuration): a GPU compiles each kernel variant
once, so the configurations (dtype, head size, GQA group, block size, cache dtype, features,
block-sparse pattern) come from the short list GPU_CONFIGS while the batches (lengths,
contexts, block tables) vary freely. Each test prints how many batches it checked;
`PROPERTY_PROGRESS=<file>` also gets one line per batch (the backend's name), for a tally
across xdist workers; `PROPERTY_EXAMPLES=<n>` changes the budget. Command: docs/dev/RELIABILITY.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import FP8_TOLERANCE, LayerRunner, assert_close
from pagedattn import Attention, CacheConfig, model_scope, selector
from pagedattn.ops.providers import use_provider

ON_GPU = os.environ.get("HYPOTHESIS_PROFILE") == "gpu"
TOTAL_EXAMPLES = int(os.environ.get("PROPERTY_EXAMPLES", 2000 if ON_GPU else 300))
DEVICE = "cuda" if ON_GPU else "cpu"
PROGRESS = os.environ.get("PROPERTY_PROGRESS")  # a file that gets a line per example passed


@dataclass(frozen=True)
class BackendProfile:
    """What the test runs a backend on, beyond its declared capabilities."""

    cpu_provider: Optional[str] = None  # ops provider on a CPU; None: the backend's own
    weight: float = 1.0  # share of the example budget
    max_reqs: int = 4
    max_context: int = 60  # cached tokens per request before the checked step
    max_query: int = 20
    head_sizes: tuple[int, ...] = (16, 24, 64)  # drawn from those the backend declares
    # The builder serves whole prompts and single-token decodes only, prompts first
    # (BLOCK_SPARSE_FLASH_ATTN): the checked step decodes the requests with context.
    prompts_then_decodes: bool = False


# Interpreted Triton costs ~0.3 s per kernel launch here, ~100x the PyTorch path: Triton
# backends get small batches and a small share; the GPU profile is where they get volume.
INTERPRETED = BackendProfile("triton", weight=1.0, max_reqs=3, max_context=32, max_query=4,
                             head_sizes=(16, 24))
PROFILES = {
    "TORCH_SDPA": BackendProfile(weight=10.0),
    "FLASH_ATTN": INTERPRETED,
    "FLASH_ATTN_DIFFKV": INTERPRETED,
    "FLASHINFER": dataclasses.replace(INTERPRETED, head_sizes=(64,)),
    "BLOCK_SPARSE_FLASH_ATTN": dataclasses.replace(INTERPRETED, head_sizes=(32,),
                                                   prompts_then_decodes=True),
}
GPU_PROFILE = BackendProfile(max_reqs=8, max_context=1500, max_query=96)
GPU_ORDERED = dataclasses.replace(GPU_PROFILE, prompts_then_decodes=True)
# The GPU profile's layer configurations: each compiles its kernel variants once, then serves
# every batch drawn for it. `sparse` is the block-sparse pattern (its sizes are constexprs):
# (block in cache blocks, local_blocks, vert_stride, head variant).
GPU_CONFIGS = [
    dict(dtype=torch.bfloat16, head_size=128, group=4, num_kv_heads=2, block_size=16,
         cache_dtype="auto", layout="NHD", features={}, sparse=(1, 2, 2, {})),
    dict(dtype=torch.float16, head_size=64, group=1, num_kv_heads=4, block_size=32,
         cache_dtype="auto", layout="HND",
         features=dict(per_layer_sliding_window=300, logits_soft_cap=30.0),
         sparse=(2, 1, 4, {"homo_head": True})),
    dict(dtype=torch.bfloat16, head_size=128, group=8, num_kv_heads=1, block_size=16,
         cache_dtype="fp8", layout="NHD", features=dict(sinks=True),
         sparse=(4, 0, 3, {"homo_head_group": True})),
    dict(dtype=torch.bfloat16, head_size=64, group=2, num_kv_heads=2, block_size=16,
         cache_dtype="auto", layout="HND", features=dict(alibi=True), sparse=(1, 3, 1, {})),
]
FEATURE_DECLARED = {"per_layer_sliding_window": "sliding_window", "logits_soft_cap": "softcap",
                    "alibi": "alibi", "sinks": "sinks"}


def profile_of(name: str) -> BackendProfile:
    prof = PROFILES.get(name, BackendProfile())
    if ON_GPU:
        return GPU_ORDERED if prof.prompts_then_decodes else GPU_PROFILE
    return prof


def property_cases() -> list:
    """(backend, GPU configuration index): per backend on a CPU (configurations drawn),
    per backend and GPU_CONFIGS entry, marked `cuda`, in the GPU profile."""
    if not ON_GPU:
        return [pytest.param(name, None, id=name) for name in sorted(selector.BACKENDS)]
    return [pytest.param(name, i, id=f"{name}-{config_id(c)}", marks=pytest.mark.cuda)
            for name in sorted(selector.BACKENDS) for i, c in enumerate(GPU_CONFIGS)]


def config_id(c: dict) -> str:
    dtype = str(c["dtype"]).removeprefix("torch.")
    return f"{dtype}-d{c['head_size']}-g{c['group']}-{c['cache_dtype']}-{c['layout']}"


def examples_for(name: str, config: Optional[int] = None) -> int:
    """The test's share of TOTAL_EXAMPLES (rounded up, so the shares sum to >= it): on a GPU
    even over backends and configurations, on a CPU by the backends' weights."""
    if ON_GPU:
        return math.ceil(TOTAL_EXAMPLES / (len(selector.BACKENDS) * len(GPU_CONFIGS)))
    weights = {n: PROFILES.get(n, BackendProfile()).weight for n in selector.BACKENDS}
    return math.ceil(TOTAL_EXAMPLES * weights[name] / sum(weights.values()))


def allowed(options, accepted) -> list:
    return [o for o in options if accepted(o)]


def fit_block_size(block_size: int, caps) -> int:
    block_size = max(block_size, caps.block_size_multiple)
    block_size -= block_size % caps.block_size_multiple
    return block_size if caps.block_sizes is None else min(caps.block_sizes)


def cpu_config(draw, caps, prof: BackendProfile) -> dict:
    """Any layer configuration the backend declares, at small sizes."""
    optional = {}
    if caps.sliding_window:
        optional["per_layer_sliding_window"] = st.integers(1, 2 * prof.max_context)
    if caps.softcap:
        optional["logits_soft_cap"] = st.floats(1.0, 50.0)
    if caps.alibi:
        optional["alibi"] = st.just(True)
    if caps.sinks:
        optional["sinks"] = st.just(True)
    return dict(
        dtype=draw(st.sampled_from(allowed(
            [torch.float32, torch.bfloat16, torch.float16], lambda d: d in caps.dtypes))),
        head_size=draw(st.sampled_from(allowed(
            prof.head_sizes, lambda h: caps.head_sizes is None or h in caps.head_sizes))),
        group=draw(st.sampled_from([1, 2, 4])), num_kv_heads=draw(st.sampled_from([1, 2])),
        block_size=fit_block_size(draw(st.sampled_from([1, 8, 16, 32])), caps),
        head_size_v=(draw(st.sampled_from([16, 32, 48])) if caps.different_kv_head_sizes
                     else None),
        cache_dtype=draw(st.sampled_from(allowed(
            ["auto", "auto", "fp8"], lambda c: c in caps.kv_cache_dtypes))),
        layout=draw(st.sampled_from(["NHD", "HND"])),
        features=draw(st.fixed_dictionaries({}, optional=optional)))


def gpu_config(index: int, caps) -> dict:
    """GPU_CONFIGS[index], less what the backend does not declare."""
    config = dict(GPU_CONFIGS[index])
    config["features"] = {k: v for k, v in config["features"].items()
                          if getattr(caps, FEATURE_DECLARED[k])}
    if config["cache_dtype"] not in caps.kv_cache_dtypes:
        config["cache_dtype"] = "auto"
    config["block_size"] = fit_block_size(config["block_size"], caps)
    config["head_size_v"] = 96 if caps.different_kv_head_sizes else None
    return config


@st.composite
def cases(draw, name: str, gpu_index: Optional[int] = None):
    """A layer configuration the backend declares it serves (GPU_CONFIGS[gpu_index] in the
    GPU profile), and a random batch for it."""
    backend = selector.load_backend(name)
    caps, prof = backend.capabilities, profile_of(name)
    config = gpu_config(gpu_index, caps) if ON_GPU else cpu_config(draw, caps, prof)
    sparse = config.pop("sparse", None)
    if caps.sparse:  # the local + vertical-stride pattern; its block: whole cache blocks
        blocks, local, vert, heads = sparse if ON_GPU else (
            draw(st.sampled_from([1, 2, 4])), draw(st.integers(0, 3)), draw(st.integers(1, 4)),
            draw(st.sampled_from([{}, {"homo_head": True}, {"homo_head_group": True}])))
        config["features"] = dict(config["features"], use_sparse=True, blocksparse_params=dict(
            max_seqlen=4096, block_size=config["block_size"] * blocks, local_blocks=local,
            vert_stride=vert, **heads, num_heads=config["num_kv_heads"] * config["group"],
            num_kv_heads=config["num_kv_heads"]))
    config["prompts_then_decodes"] = prof.prompts_then_decodes
    num_reqs = draw(st.integers(1, prof.max_reqs))
    config["contexts"] = draw(st.lists(st.integers(0, prof.max_context), min_size=num_reqs,
                                       max_size=num_reqs))
    config["queries"] = draw(st.lists(st.integers(1, prof.max_query), min_size=num_reqs,
                                      max_size=num_reqs))
    config["seed"] = draw(st.integers(0, 2**16))
    return config


def make_layer(backend, c: dict) -> Attention:
    features = dict(c["features"])
    h = c["num_kv_heads"] * c["group"]
    if features.pop("alibi", False):
        features["alibi_slopes"] = [2 ** -(i + 1) for i in range(h)]
    if features.pop("sinks", False):
        features["sinks"] = torch.linspace(-2, 2, h)
    torch.set_default_dtype(c["dtype"])
    try:
        with model_scope():
            return Attention(h, c["head_size"], c["head_size"] ** -0.5, c["num_kv_heads"],
                             cache_config=CacheConfig(block_size=c["block_size"],
                                                      cache_dtype=c["cache_dtype"]),
                             prefix="attn", attn_backend=backend, **features)
    finally:
        torch.set_default_dtype(torch.float32)


def run_case(name: str, c: dict) -> None:
    backend = selector.load_backend(name)
    device = DEVICE
    old_v = getattr(backend, "head_size_v", None)
    old_layout = os.environ.get("PAGEDATTN_KV_CACHE_LAYOUT")
    os.environ["PAGEDATTN_KV_CACHE_LAYOUT"] = c["layout"]
    try:
        if c["head_size_v"] is not None:
            backend.set_head_size_v(c["head_size_v"])
        layer = make_layer(backend, c).to(device)
        block_size = c["block_size"]
        blocks = sum(-(-(x + q) // block_size) for x, q in zip(c["contexts"], c["queries"]))
        run = LayerRunner({"attn": layer}, num_blocks=blocks + 4, block_size=block_size,
                          dtype=c["dtype"], device=device, seed=c["seed"])
        make = _inputs(layer, c, device)
        reqs = list(range(len(c["contexts"])))
        with_context = [r for r in reqs if c["contexts"][r]]
        tol = FP8_TOLERANCE if c["cache_dtype"] == "fp8" else {}
        if with_context:
            # Cache the context first (a prefill step of those requests). On a CPU it runs
            # on the PyTorch provider: interpreted Triton is for the checked step only.
            with use_provider("torch") if device == "cpu" else contextlib.nullcontext():
                lens = [c["contexts"][r] for r in with_context]
                out, want = run.step(with_context, lens, inputs=make(sum(lens)))["attn"]
            assert_close(out, want, c["dtype"], **tol)
        queries = c["queries"]
        if c["prompts_then_decodes"]:  # new prompts first, then one token per context
            reqs = [r for r in reqs if not c["contexts"][r]] + with_context
            queries = [1 if c["contexts"][r] else c["queries"][r] for r in reqs]
        out, want = run.step(reqs, queries, inputs=make(sum(queries)))["attn"]
        assert_close(out, want, c["dtype"], **tol)
        if PROGRESS:
            with open(PROGRESS, "a") as f:
                f.write(f"{name}\n")
    finally:
        if c["head_size_v"] is not None:
            backend.set_head_size_v(old_v)
        if old_layout is None:
            os.environ.pop("PAGEDATTN_KV_CACHE_LAYOUT", None)
        else:
            os.environ["PAGEDATTN_KV_CACHE_LAYOUT"] = old_layout


def _inputs(layer: Attention, c: dict, device: str):
    """Random q, k, v for n tokens. For an fp8 cache on a CPU, k and v are fp8 numbers: the
    Triton interpreter rounds float -> fp8 wrongly where rounding carries into the exponent
    (1.95 -> 1.0), which the GPU does not; exact values take that bug out of the test."""
    g = torch.Generator().manual_seed(c["seed"] + 1)
    fp8 = c["cache_dtype"] == "fp8" and device == "cpu"
    h, hk = layer.num_heads, layer.num_kv_heads
    d, dv = layer.head_size, layer.head_size_v

    def make(n: int) -> dict:
        def randn(width: int, exact: bool) -> torch.Tensor:
            x = torch.randn(n, width, generator=g)
            return (x.to(torch.float8_e4m3fn).float() if exact else x).to(c["dtype"])

        return {"attn": (randn(h * d, False), randn(hk * d, fp8), randn(hk * dv, fp8))}

    return make


@pytest.mark.parametrize("name, gpu_index", property_cases())
def test_random_batches_match_the_oracle(name, gpu_index, monkeypatch):
    if ON_GPU and not torch.cuda.is_available():
        pytest.skip("HYPOTHESIS_PROFILE=gpu needs CUDA")
    provider = profile_of(name).cpu_provider
    if provider is not None and not ON_GPU:
        monkeypatch.setenv("PAGEDATTN_OPS_PROVIDER", provider)
    checked = []

    @settings(max_examples=examples_for(name, gpu_index), deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(cases(name, gpu_index))
    def check(c):
        run_case(name, c)
        checked.append(c["queries"])

    start = time.perf_counter()
    check()
    print(f"{name}{'' if gpu_index is None else ' ' + config_id(GPU_CONFIGS[gpu_index])}: "
          f"{len(checked)} random batches ({sum(map(len, checked))} requests) matched the "
          f"oracle in {time.perf_counter() - start:.1f} s")


def test_every_registered_backend_gets_examples_and_the_budget_is_met():
    per_test = {p.id: examples_for(*p.values) for p in property_cases()}
    assert all(n > 0 for n in per_test.values())
    assert {p.values[0] for p in property_cases()} == set(selector.BACKENDS)
    assert sum(per_test.values()) >= TOTAL_EXAMPLES
