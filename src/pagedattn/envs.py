"""Every environment variable pagedattn reads, in one place.

Values are read when accessed (`envs.PAGEDATTN_ATTENTION_BACKEND`), never cached at import, so a
test or a user can change them at run time and the next decision sees the new value.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

_READERS: dict[str, Callable[[], Any]] = {
    # Force a backend by name (TORCH_SDPA, FLASH_ATTN, ...); unset means "choose the best".
    "PAGEDATTN_ATTENTION_BACKEND": lambda: os.environ.get("PAGEDATTN_ATTENTION_BACKEND") or None,
    # Physical KV-cache layout: NHD (token-major) or HND (head-major).
    "PAGEDATTN_KV_CACHE_LAYOUT": lambda: os.environ.get("PAGEDATTN_KV_CACHE_LAYOUT", "NHD").upper(),
    # Which kernels the ops run: auto (Triton on CUDA, PyTorch elsewhere), torch, or triton.
    # "triton" on a CPU tensor needs TRITON_INTERPRET=1 (that is how the tests run kernels).
    "PAGEDATTN_OPS_PROVIDER": lambda: os.environ.get("PAGEDATTN_OPS_PROVIDER", "auto").lower(),
    # Triton's own switch: kernels run on the CPU through its interpreter (read, never set).
    "TRITON_INTERPRET": lambda: os.environ.get("TRITON_INTERPRET", "0") == "1",
    # FLASHINFER: plan decodes for the tensor-core decode wrapper whatever the GQA group size.
    "PAGEDATTN_FLASHINFER_FORCE_TENSOR_CORES": lambda: os.environ.get(
        "PAGEDATTN_FLASHINFER_FORCE_TENSOR_CORES", "0") == "1",
    # 1: the public ops also check index tensors (block ids, slots, lengths) against the
    # cache, which copies them to the host (a GPU sync per call): for debugging only.
    "PAGEDATTN_CHECK_INDICES": lambda: os.environ.get("PAGEDATTN_CHECK_INDICES", "0") == "1",
    # Divisors for calc_kv_scales: scale = amax / range (the seeds' Q/K/V_SCALE_CONSTANT).
    "Q_SCALE_CONSTANT": lambda: float(os.environ.get("Q_SCALE_CONSTANT", "200")),
    "K_SCALE_CONSTANT": lambda: float(os.environ.get("K_SCALE_CONSTANT", "200")),
    "V_SCALE_CONSTANT": lambda: float(os.environ.get("V_SCALE_CONSTANT", "100")),
}


def __getattr__(name: str) -> Any:
    if name in _READERS:
        return _READERS[name]()
    raise AttributeError(f"module 'pagedattn.envs' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(_READERS)


def is_set(name: str) -> bool:
    """Whether variable `name` is set in the environment (else its reader gives the default)."""
    return name in os.environ
