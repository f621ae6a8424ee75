"""Every environment variable pagedattn reads, in one place.

Values are read when accessed (`envs.PAGEDATTN_ATTENTION_BACKEND`), never cached at import, so a
test or a user can change them at run time and the next decision sees the new value. A read
looks the raw value up in os.environ's own dict and parses it again only when it changed:
`os.environ.get` encodes the name and decodes the value each time (1-3 us), and some of these
are read at every build or op call.
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
    # 1: batch-invariant attention everywhere (EngineConfig.batch_invariant turns it on for
    # one engine): a request's outputs are the same bits whatever else is in its batch.
    "PAGEDATTN_BATCH_INVARIANT": lambda: os.environ.get(
        "PAGEDATTN_BATCH_INVARIANT", "0") == "1",
    # OpenMP's thread count: when set, CPU work keeps the threads it gives torch instead of
    # the ones `cpu_threads` would choose (read, never set).
    "OMP_NUM_THREADS": lambda: os.environ.get("OMP_NUM_THREADS") or None,
    # Divisors for calc_kv_scales: scale = amax / range (the seeds' Q/K/V_SCALE_CONSTANT).
    "Q_SCALE_CONSTANT": lambda: float(os.environ.get("Q_SCALE_CONSTANT", "200")),
    "K_SCALE_CONSTANT": lambda: float(os.environ.get("K_SCALE_CONSTANT", "200")),
    "V_SCALE_CONSTANT": lambda: float(os.environ.get("V_SCALE_CONSTANT", "100")),
}


_encode = getattr(os.environ, "encodekey", None)  # the names as os.environ stores them
_KEYS = {name: _encode(name) for name in _READERS} if _encode else {}
_SEEN: dict[str, tuple[Any, Any]] = {}  # name -> (its raw value when last read, the reading)


def __getattr__(name: str) -> Any:
    if name not in _READERS:
        raise AttributeError(f"module 'pagedattn.envs' has no attribute {name!r}")
    return get(name)


def get(name: str) -> Any:
    """`envs.<name>` as a plain call, for reads at every build (a module's __getattr__ costs
    as much again as the read)."""
    reader = _READERS[name]
    try:  # os.environ's own dict: a set, changed or deleted variable is a new raw value
        raw = os.environ._data.get(_KEYS[name])
    except (AttributeError, KeyError):  # os.environ is another mapping: the usual read
        return reader()
    seen = _SEEN.get(name)
    if seen is not None and seen[0] is raw:  # (holding raw, so its id is not reused)
        return seen[1]
    value = reader()
    _SEEN[name] = (raw, value)
    return value


def __dir__() -> list[str]:
    return sorted(_READERS)


def is_set(name: str) -> bool:
    """Whether variable `name` is set in the environment (else its reader gives the default)."""
    return name in os.environ
