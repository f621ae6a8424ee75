"""The path from the layer to the kernel is short: in a steady-state decode step (the plans
made by an earlier step, the layer's entry in them made by its first call), an
`Attention.forward` call enters at most six of our functions before its first call into
Triton, counted in call order with `sys.setprofile`: the layer, its input checks, the step's
metadata, the impl, the provider's plan of the layer and the planned launch. The same
sequence on the CPU (Triton's interpreter) and on the GPU, against the oracle."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import reference as ref
from conftest import LayerRunner, assert_close, make_layers, randn
from pagedattn import Attention, set_forward_context
from pagedattn.backends.flash_attn import FlashAttentionBackend
from pagedattn.backends.flash_attn_diffkv import FlashAttentionDiffKVBackend

PACKAGE = str(Path(__file__).resolve().parents[1] / "src" / "pagedattn")
STEADY_PATH = ["Attention.forward", "check_layer_inputs", "_run_layer",
               "PagedAttentionImpl.forward", "TritonLayerPlan.run", "KernelLaunch.__call__"]


def is_triton(frame_or_function) -> bool:
    module = getattr(frame_or_function, "__module__", None) or \
        getattr(frame_or_function, "f_globals", {}).get("__name__", "")
    return module == "triton" or module.startswith("triton.")


def calls_until_triton(call) -> list[str]:
    """Our functions entered (in order) from `Attention.forward` until the first call into
    Triton (a Triton Python function, or a builtin of Triton's), while `call()` runs."""
    entered, state = [], {"on": False, "done": False}

    def profile(frame, event, arg):
        if state["done"]:
            return
        if event == "call" and frame.f_code is Attention.forward.__code__:
            state["on"] = True
        if not state["on"]:
            return
        if (event == "call" and is_triton(frame)) or (event == "c_call" and is_triton(arg)):
            state["done"] = True
        elif event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            entered.append(frame.f_code.co_qualname)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    assert state["done"], f"no call into Triton after {entered}"
    return entered


def decode_steps(backend, device, dtype, monkeypatch):
    """A decode step after prompts: the layer, its runner and the step's metadata, the layer
    run once on it (its first call of the plans makes its entry; on the GPU, a later decode
    step of the same size reuses the plans and entries as they are)."""
    monkeypatch.setenv("PAGEDATTN_OPS_PROVIDER", "triton")  # CPU: under the interpreter
    layers = make_layers(backend, num_heads=4, num_kv_heads=2, head_size=64, dtype=dtype)
    layer = layers["layers.0.attn"].to(device)
    run = LayerRunner(layers, dtype=dtype, device=device)
    run.step([0, 1], [5, 3])
    md, _ = run.metadata([0, 1], [1, 1])
    q, k, v = (randn(2, n, dtype=dtype, device=device) for n in (256, 128, 128))
    with set_forward_context(md):
        layer(q, k, v)  # its first call of the plans makes its entry
    return layer, run, md


def check_call(layer, run, md, dtype, device):
    """One recorded layer call: its path, and its output against the oracle."""
    q, k, v = (randn(2, n, dtype=dtype, device=device) for n in (256, 128, 128))
    out = []
    with set_forward_context(md):
        path = calls_until_triton(lambda: out.append(layer(q, k, v)))
    cache = run.caches["layers.0.attn"].float().cpu()
    key_cache, value_cache = layer.impl.split_kv_cache(cache)
    want, _ = ref.paged_attention(q.float().cpu().view(2, 4, 64), key_cache, value_cache,
                                  [1, 1], md.seq_lens.tolist(), md.block_table.cpu(),
                                  scale=64 ** -0.5, causal=True)
    assert_close(out[0].float().cpu().view(2, 4, -1), want, dtype)
    return path


@pytest.mark.parametrize("backend", [FlashAttentionBackend, FlashAttentionDiffKVBackend],
                         ids=lambda b: b.get_name())
def test_a_steady_decode_call_enters_six_functions_before_triton(backend, monkeypatch):
    monkeypatch.setattr(FlashAttentionDiffKVBackend, "head_size_v", 64)
    layer, run, md = decode_steps(backend, "cpu", torch.float32, monkeypatch)
    assert check_call(layer, run, md, torch.float32, "cpu") == STEADY_PATH


def test_the_recorder_counts_our_functions_and_stops_at_triton(monkeypatch):
    """calls_until_triton on a layer call that never reaches Triton (PyTorch provider) fails,
    and on a Triton call it names every function of ours before it."""
    layers = make_layers(FlashAttentionBackend, num_heads=4, num_kv_heads=2, head_size=64)
    layer = layers["layers.0.attn"]
    run = LayerRunner(layers)
    md, _ = run.metadata([0], [3])
    q, k, v = randn(3, 256), randn(3, 128), randn(3, 128)
    with set_forward_context(md), pytest.raises(AssertionError, match="no call into Triton"):
        calls_until_triton(lambda: layer(q, k, v))
    monkeypatch.setenv("PAGEDATTN_OPS_PROVIDER", "triton")
    md, _ = run.metadata([0], [1])
    with set_forward_context(md):  # a first call: it makes the layer's entry on its way
        path = calls_until_triton(lambda: layer(q[:1], k[:1], v[:1]))
    assert path[:4] == STEADY_PATH[:4] and "PagedAttentionImpl.plan_layer" in path
    assert len(path) > len(STEADY_PATH)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_a_steady_decode_call_enters_the_same_six_functions(monkeypatch):
    layer, run, md = decode_steps(FlashAttentionBackend, "cuda", torch.bfloat16, monkeypatch)
    check_call(layer, run, md, torch.bfloat16, "cuda")  # warm: the kernels are compiled
    assert check_call(layer, run, md, torch.bfloat16, "cuda") == STEADY_PATH
