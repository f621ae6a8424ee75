"""Choose the provider (module of kernels) an op runs on for a given device: the ops' and
the backends' one public place for it.

A provider module exposes `varlen_attention`, `reshape_and_cache` and `merge_attn_states`
with the signatures of `pagedattn.ops.torch`. The choice follows PAGEDATTN_OPS_PROVIDER:
"auto" runs Triton on CUDA and PyTorch elsewhere; "torch" and "triton" force one ("triton"
on CPU tensors needs TRITON_INTERPRET=1, which is how tests run the kernels on a CPU).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
from collections.abc import Iterator
from types import ModuleType

import torch

from pagedattn import envs

PROVIDERS = ("auto", "torch", "triton")
# A backend can pin its ops to one provider (TORCH_SDPA runs pure PyTorch on every device).
_pinned: contextvars.ContextVar[str | None] = contextvars.ContextVar("provider", default=None)


@contextlib.contextmanager
def use_provider(name: str) -> Iterator[None]:
    """Run the ops inside this block on provider `name` ("torch" or "triton")."""
    if name not in PROVIDERS:
        raise ValueError(f"provider={name!r} is not supported; choose one of {PROVIDERS}")
    token = _pinned.set(name)
    try:
        yield
    finally:
        _pinned.reset(token)


@functools.cache
def triton_available() -> bool:
    """Whether Triton is installed: looked up once (a module search costs microseconds, and
    `provider_name` runs at every build)."""
    return importlib.util.find_spec("triton") is not None


def provider_name(device: torch.device) -> str:
    choice = _pinned.get() or envs.get("PAGEDATTN_OPS_PROVIDER")  # (a build reads it)
    if choice not in PROVIDERS:
        raise ValueError(
            f"PAGEDATTN_OPS_PROVIDER={choice!r} is not supported; choose one of {PROVIDERS}")
    if choice == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    return choice


def provider_for(device: torch.device) -> ModuleType:
    if provider_name(device) == "triton":
        import pagedattn.ops.triton as provider
    else:
        import pagedattn.ops.torch as provider
    return provider
