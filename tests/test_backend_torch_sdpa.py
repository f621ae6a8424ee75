"""What is TORCH_SDPA's own: pure PyTorch on every device. Shared paged-backend behaviour is
tested in test_backends_paged.py."""

from __future__ import annotations

import torch

from conftest import LayerRunner, check_step, make_layers
from pagedattn.backends import paged_plans
from pagedattn.backends.torch_sdpa import TorchSDPABackend
from pagedattn.ops import custom_ops, providers


def test_ops_run_on_the_pytorch_provider_even_when_triton_is_forced(monkeypatch):
    monkeypatch.setenv("PAGEDATTN_OPS_PROVIDER", "triton")
    seen = []
    original = providers.provider_for
    monkeypatch.setattr(custom_ops, "provider_for",
                        lambda device: seen.append(providers.provider_name(device))
                        or original(device))
    planned = paged_plans.plan_varlen_attention  # a layer call runs the build's plans
    monkeypatch.setattr(paged_plans, "plan_varlen_attention",
                        lambda **kw: seen.append(kw["provider"]) or planned(**kw))
    run = LayerRunner(make_layers(TorchSDPABackend))
    check_step(run.step([0, 1], [5, 3]))
    assert seen and set(seen) == {"torch"}


def test_any_head_size_is_served():
    assert TorchSDPABackend.get_supported_head_sizes() == []
    TorchSDPABackend.validate_head_size(36)
    run = LayerRunner(make_layers(TorchSDPABackend, head_size=36))
    check_step(run.step([0], [7]))
    block = run.table.blocks[0][0]  # the request's 7 tokens sit in its first block
    assert run.caches["layers.0.attn"].shape[-1] == 36
    assert torch.isfinite(run.caches["layers.0.attn"][:, block, :7]).all()


def test_declares_no_cuda_graph_support():
    # Its builder passes each batch's tensors through: a captured graph would replay stale ones.
    from pagedattn.types import AttentionCGSupport

    assert TorchSDPABackend.get_builder_cls().cudagraph_support == AttentionCGSupport.NEVER
    assert TorchSDPABackend.capabilities.cudagraph == AttentionCGSupport.NEVER
