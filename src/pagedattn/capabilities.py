"""What a backend can serve: attention types, CUDA-graph support, and the match of a layer's
request against a backend's declared capabilities (`BackendCapabilities.why_not`), which the
selector and `pagedattn info` read.

`pagedattn.types` re-exports every name here: the seeds' API keeps them there.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

import torch


class AttentionType:
    """Attention type; plain strings so that torch.compile treats them as constants."""

    DECODER = "decoder"  # causal self-attention over the paged cache
    ENCODER = "encoder"  # bidirectional encoder self-attention of an encoder-decoder model
    ENCODER_ONLY = "encoder_only"  # bidirectional self-attention of an encoder-only model
    ENCODER_DECODER = "encoder_decoder"  # decoder queries over cached encoder keys/values


ALL_ATTN_TYPES = (AttentionType.DECODER, AttentionType.ENCODER, AttentionType.ENCODER_ONLY,
                  AttentionType.ENCODER_DECODER)


class AttentionCGSupport(enum.IntEnum):
    """How far a backend's metadata builder supports CUDA-graph capture (more is better)."""

    NEVER = 0
    UNIFORM_SINGLE_TOKEN_DECODE = 1  # pure decode batches only
    UNIFORM_BATCH = 2  # batches whose requests all have the same query length
    ALWAYS = 3  # any batch, mixed prefill and decode included


@dataclass(frozen=True)
class AttentionRequest:
    """What a layer asks of a backend; the selector matches it against capabilities."""

    head_size: int
    dtype: torch.dtype
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    use_mla: bool = False
    has_sink: bool = False
    use_sparse: bool = False
    device_type: str = "cpu"
    head_size_v: Optional[int] = None  # set only when V's head size differs from K's


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend can serve, declared once as data."""

    devices: frozenset[str]
    dtypes: frozenset[torch.dtype]
    kv_cache_dtypes: frozenset[str]
    head_sizes: Optional[tuple[int, ...]]  # None: any positive head size
    block_sizes: Optional[tuple[int, ...]] = None  # None: any positive size
    block_size_multiple: int = 1
    attn_types: frozenset[str] = frozenset(ALL_ATTN_TYPES)
    sliding_window: bool = True
    alibi: bool = True
    softcap: bool = True
    sinks: bool = True
    cascade: bool = False
    different_kv_head_sizes: bool = False
    mla: bool = False
    sparse: bool = False
    sparse_only: bool = False  # serves use_sparse layers only; never chosen for a dense one
    cudagraph: AttentionCGSupport = AttentionCGSupport.NEVER
    needs: tuple[str, ...] = field(default=())  # importable modules the backend needs

    def why_not(self, request: AttentionRequest) -> list[str]:
        """Reasons this backend cannot serve `request`; empty when it can."""
        reasons = []
        if request.device_type not in self.devices:
            reasons.append(f"device {request.device_type!r} not in {sorted(self.devices)}")
        if request.dtype not in self.dtypes:
            reasons.append(f"dtype {request.dtype} not supported")
        if request.kv_cache_dtype not in self.kv_cache_dtypes:
            reasons.append(f"kv_cache_dtype {request.kv_cache_dtype!r} not supported")
        if self.head_sizes is not None and request.head_size not in self.head_sizes:
            reasons.append(f"head_size {request.head_size} not supported")
        if self.block_sizes is not None and request.block_size not in self.block_sizes:
            reasons.append(f"block_size {request.block_size} not in {list(self.block_sizes)}")
        if request.block_size % self.block_size_multiple:
            reasons.append(
                f"block_size {request.block_size} not a multiple of {self.block_size_multiple}")
        if request.use_mla and not self.mla:
            reasons.append("MLA not supported")
        if request.use_sparse and not self.sparse:
            reasons.append("sparse attention not supported")
        if request.has_sink and not self.sinks:
            reasons.append("attention sinks not supported")
        if (request.head_size_v not in (None, request.head_size)
                and not self.different_kv_head_sizes):
            reasons.append("different K and V head sizes not supported")
        for module in self.needs:
            if not _importable(module):
                reasons.append(f"package {module!r} is not installed")
        return reasons

    def why_not_automatic(self, request: AttentionRequest) -> list[str]:
        """Reasons the selector never picks this backend by itself for `request`, though it
        can serve it when forced (PAGEDATTN_ATTENTION_BACKEND)."""
        if self.sparse_only and not request.use_sparse:
            return ["block-sparse only: never chosen automatically for a dense layer "
                    "(use_sparse=False)"]
        return []


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None
