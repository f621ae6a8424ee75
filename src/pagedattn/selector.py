"""Backend registry and `get_attn_backend`: the best backend that can serve a request.

Backends register by name with the import path of their class, and are imported only when
considered. Ranking is per device: the first backend in the device's preference list whose
declared capabilities accept the request wins. `PAGEDATTN_ATTENTION_BACKEND` forces one.
"""

from __future__ import annotations

import functools
import importlib
from typing import Optional

import torch

from pagedattn import envs
from pagedattn.types import AttentionBackend, AttentionRequest

# name -> "module:Class"
BACKENDS: dict[str, str] = {
    "FLASH_ATTN": "pagedattn.backends.flash_attn:FlashAttentionBackend",
    "FLASH_ATTN_DIFFKV": "pagedattn.backends.flash_attn_diffkv:FlashAttentionDiffKVBackend",
    "TORCH_SDPA": "pagedattn.backends.torch_sdpa:TorchSDPABackend",
    "FLASHINFER": "pagedattn.backends.flashinfer:FlashInferBackend",
    "BLOCK_SPARSE_FLASH_ATTN":
        "pagedattn.backends.blocksparse_attn:BlocksparseFlashAttentionBackend",
}
# Preference order per device type; backends not listed for a device are never auto-chosen.
PREFERENCE: dict[str, tuple[str, ...]] = {
    "cuda": ("FLASH_ATTN", "FLASHINFER", "FLASH_ATTN_DIFFKV", "TORCH_SDPA"),
    "cpu": ("TORCH_SDPA", "FLASH_ATTN_DIFFKV"),  # DIFFKV: different K/V head sizes only
}
# Sparse-only backends come last: they refuse dense requests (use_sparse=False) themselves.
PREFERENCE = {device: (*order, "BLOCK_SPARSE_FLASH_ATTN") for device, order in PREFERENCE.items()}


def load_backend(name: str) -> type[AttentionBackend]:
    """Import and return the backend class registered as `name` (KeyError if unknown)."""
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def forced_backend() -> Optional[str]:
    """The backend PAGEDATTN_ATTENTION_BACKEND forces, as its registered name (None: unset);
    a ValueError names an unknown one."""
    forced = envs.PAGEDATTN_ATTENTION_BACKEND
    if forced is None:
        return None
    if forced.upper() not in BACKENDS:
        raise ValueError(f"PAGEDATTN_ATTENTION_BACKEND={forced!r} is not a known backend; "
                         f"known: {', '.join(BACKENDS)}")
    return forced.upper()


def current_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def explain(request: AttentionRequest) -> dict[str, list[str]]:
    """For every registered backend, why it cannot serve `request` (empty list: it can)."""
    return _merged(_reasons(request))


def _merged(reasons: dict[str, tuple[list[str], list[str]]]) -> dict[str, list[str]]:
    return {name: cannot + never_auto for name, (cannot, never_auto) in reasons.items()}


def _reasons(request: AttentionRequest) -> dict[str, tuple[list[str], list[str]]]:
    """Per backend: why it cannot serve `request`, and why it is never chosen by itself for
    it (a forced backend may be one of those)."""
    reasons = {}
    for name in BACKENDS:
        try:
            backend = load_backend(name)
        except ImportError as e:
            reasons[name] = ([f"not available in this build ({e.name or e})"], [])
            continue
        cannot = backend.capabilities.why_not(request)
        never_auto = backend.capabilities.why_not_automatic(request)
        if name not in PREFERENCE.get(request.device_type, ()) and not cannot + never_auto:
            never_auto = [f"never chosen automatically on {request.device_type}"]
        reasons[name] = (cannot, never_auto)
    return reasons


def get_attn_backend(head_size: int, dtype: torch.dtype, kv_cache_dtype: Optional[str],
                     block_size: int, use_mla: bool = False, has_sink: bool = False,
                     use_sparse: bool = False, head_size_v: Optional[int] = None
                     ) -> type[AttentionBackend]:
    """Select the attention backend for a layer on the current device.

    `head_size_v` (an addition to the seeds' signature) asks for different K/V head sizes.
    """
    request = AttentionRequest(
        head_size=head_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype or "auto",
        block_size=block_size, use_mla=use_mla, has_sink=has_sink, use_sparse=use_sparse,
        device_type=current_device_type(),
        head_size_v=None if head_size_v == head_size else head_size_v)
    # The env var is an explicit cache key, so changing it is never answered from the cache.
    return _cached_select(request, envs.PAGEDATTN_ATTENTION_BACKEND)


def choose(request: AttentionRequest, forced: Optional[str] = None
           ) -> tuple[Optional[str], dict[str, list[str]]]:
    """The backend name `get_attn_backend` would pick (None if none can serve), with every
    backend's reasons. `forced` is a PAGEDATTN_ATTENTION_BACKEND value."""
    reasons = _reasons(request)
    explained = _merged(reasons)
    if forced is not None:
        name = forced.upper()
        ok = name in reasons and not reasons[name][0]  # never-automatic reasons do not count
        return (name if ok else None), explained
    order = PREFERENCE.get(request.device_type, ())
    return next((name for name in order if not explained[name]), None), explained


@functools.lru_cache(maxsize=256)
def _cached_select(request: AttentionRequest, forced: Optional[str]) -> type[AttentionBackend]:
    name, reasons = choose(request, forced)
    if name is not None:
        return load_backend(name)
    if forced is None:
        why = "no attention backend can serve this request"
    elif forced.upper() not in BACKENDS:
        why = f"PAGEDATTN_ATTENTION_BACKEND={forced!r} is not a known backend"
    else:
        why = f"PAGEDATTN_ATTENTION_BACKEND={forced!r} cannot serve this request"
    raise ValueError(_no_backend_message(why, request, reasons))


def _no_backend_message(why: str, request: AttentionRequest,
                        reasons: dict[str, list[str]]) -> str:
    lines = [f"{why}: {request}", "backends:"]
    for name, rs in reasons.items():
        lines.append(f"  {name}: {'; '.join(rs) if rs else 'ok'}")
    return "\n".join(lines)
