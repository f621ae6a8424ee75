"""Cache configuration and the one place where KV-cache dtype strings are parsed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pagedattn import envs

# String accepted by CacheConfig.cache_dtype -> torch dtype of the stored cache ("auto" follows
# the model dtype and is resolved by the caller).
_KV_CACHE_DTYPES: dict[str, Optional[torch.dtype]] = {
    "auto": None,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "float": torch.float32,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
KV_CACHE_DTYPE_STRINGS = tuple(_KV_CACHE_DTYPES)
# Largest finite magnitude of each fp8 format: quantized values saturate there.
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
KV_CACHE_LAYOUTS = ("NHD", "HND")


def is_fp8_kv_cache(cache_dtype: str) -> bool:
    return cache_dtype.startswith("fp8")


def kv_cache_torch_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype a cache of `cache_dtype` is stored in; "auto" means `model_dtype`."""
    if cache_dtype not in _KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype={cache_dtype!r} is not supported; "
            f"choose one of {', '.join(KV_CACHE_DTYPE_STRINGS)}")
    return _KV_CACHE_DTYPES[cache_dtype] or model_dtype


def get_kv_cache_layout() -> str:
    layout = envs.PAGEDATTN_KV_CACHE_LAYOUT
    if layout not in KV_CACHE_LAYOUTS:
        raise ValueError(
            f"PAGEDATTN_KV_CACHE_LAYOUT={layout!r} is not supported; choose NHD or HND")
    return layout


@dataclass
class CacheConfig:
    """How the paged KV cache is laid out: the seeds' CacheConfig, trimmed to attention."""

    block_size: int = 16
    cache_dtype: str = "auto"
    sliding_window: Optional[int] = None
    calculate_kv_scales: bool = False
    # Blocks in the allocated cache, when the engine knows it: builders then check that block
    # ids and slots stay inside the cache (vLLM's CacheConfig.num_gpu_blocks).
    num_gpu_blocks: Optional[int] = None

    def __post_init__(self) -> None:
        if self.num_gpu_blocks is not None and (
                not isinstance(self.num_gpu_blocks, int) or self.num_gpu_blocks <= 0):
            raise ValueError(
                f"num_gpu_blocks={self.num_gpu_blocks!r} must be a positive int or None")
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"block_size={self.block_size!r} must be a positive int")
        kv_cache_torch_dtype(self.cache_dtype, torch.float16)  # validates the string
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(
                f"sliding_window={self.sliding_window!r} must be a positive int or None")


@dataclass
class EngineConfig:
    """The engine limits a metadata builder sizes its persistent buffers for.

    It stands where the seeds pass `vllm_config`: builders accept one of these (or None for the
    defaults) as their `vllm_config` argument.
    """

    max_num_seqs: int = 256
    max_model_len: int = 8192
    max_num_batched_tokens: int = 8192
    cache_config: CacheConfig = None  # type: ignore[assignment]
    # Let builders choose cascade attention when the batch shares a long prefix.
    enable_cascade: bool = True
    # Parallelism (pagedattn.distributed must be initialised with the same sizes). Under DCP,
    # runs of dcp_kv_cache_interleave_size positions go round-robin over the DCP ranks.
    tensor_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    dcp_kv_cache_interleave_size: int = 1
    # A request's attention outputs the same bits whatever else is in its batch, however its
    # prompt was chunked, and a sampled token's as its re-prefill's (ops/batch_invariant.py;
    # PAGEDATTN_BATCH_INVARIANT=1 turns it on for every engine). Cascade is then not used.
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        if self.cache_config is None:
            self.cache_config = CacheConfig()
        for name in ("max_num_seqs", "max_model_len", "max_num_batched_tokens",
                     "tensor_parallel_size", "decode_context_parallel_size",
                     "dcp_kv_cache_interleave_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if self.tensor_parallel_size % self.decode_context_parallel_size:
            raise ValueError(
                f"decode_context_parallel_size={self.decode_context_parallel_size} must divide "
                f"tensor_parallel_size={self.tensor_parallel_size}")
        if not isinstance(self.batch_invariant, bool):
            raise TypeError(f"batch_invariant={self.batch_invariant!r} must be a bool")
        batch_invariant_mode(self)  # refuses it with decode context parallelism
        if self.decode_context_parallel_size > 1 and self.enable_cascade:
            raise ValueError(
                "cascade attention is not exact with decode context parallelism (the shared "
                "prefix is sharded across ranks): pass enable_cascade=False with "
                f"decode_context_parallel_size={self.decode_context_parallel_size}")


def batch_invariant_mode(config: Optional[EngineConfig]) -> bool:
    """Whether a builder of `config` (None: the defaults) plans batch-invariant attention: the
    config asks for it, or PAGEDATTN_BATCH_INVARIANT=1 does for every engine."""
    on = bool(config is not None and config.batch_invariant) or \
        envs.get("PAGEDATTN_BATCH_INVARIANT")
    if on and config is not None and config.decode_context_parallel_size > 1:
        raise ValueError(
            "batch-invariant mode is not available with decode context parallelism (a "
            "request's context is merged from its ranks' partial states): pass "
            "batch_invariant=False or decode_context_parallel_size=1")
    return on
