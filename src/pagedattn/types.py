"""The attention API's core types: AttentionType and the backend / impl / metadata / builder ABCs.

Names and signatures follow the seeds (vLLM's attention API). One addition: every backend
declares a `BackendCapabilities` object, which answers "can you serve this request, and if
not, why not" for the selector and for `pagedattn info`. It, `AttentionRequest`,
`AttentionType` and `AttentionCGSupport` are defined in `capabilities.py` with that match and
re-exported here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar, Generic, Optional, TypeVar

import torch

from pagedattn.capabilities import (  # noqa: F401 - re-exported: the seeds' names live here
    ALL_ATTN_TYPES,
    AttentionCGSupport,
    AttentionRequest,
    AttentionType,
    BackendCapabilities,
)
from pagedattn.metadata_checks import check_builder_batch

if TYPE_CHECKING:
    from pagedattn.metadata import CommonAttentionMetadata


class AttentionMetadata:
    """Per-batch metadata a backend's builder produces; each backend subclasses it."""


M = TypeVar("M", bound=AttentionMetadata)


class AttentionBackend(ABC):
    """Abstract class for attention backends (the seeds' API plus `capabilities`)."""

    # The layer allocates the output and passes it to forward (needed for CUDA graphs).
    accept_output_buffer: ClassVar[bool] = False
    # The layer quantizes the query to fp8 itself when the cache is fp8.
    supports_quant_query_input: ClassVar[bool] = False
    capabilities: ClassVar[BackendCapabilities]

    @staticmethod
    @abstractmethod
    def get_name() -> str: ...

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type[AttentionImpl]: ...

    @staticmethod
    @abstractmethod
    def get_metadata_cls() -> type[AttentionMetadata]: ...

    @staticmethod
    @abstractmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]: ...

    @staticmethod
    @abstractmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int, cache_dtype_str: str = "auto") -> tuple[int, ...]: ...

    @staticmethod
    def get_kv_cache_stride_order() -> tuple[int, ...]:
        raise NotImplementedError("this backend keeps its cache in logical order")

    @classmethod
    def make_metadata(cls, *args, **kwargs) -> AttentionMetadata:
        return cls.get_metadata_cls()(*args, **kwargs)

    @classmethod
    def full_cls_name(cls) -> tuple[str, str]:
        return (cls.__module__, cls.__qualname__)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        """Supported head sizes; an empty list means any positive size."""
        return list(cls.capabilities.head_sizes or ())

    @classmethod
    def get_supported_dtypes(cls) -> list[torch.dtype]:
        return sorted(cls.capabilities.dtypes, key=str)

    @classmethod
    def validate_head_size(cls, head_size: int) -> None:
        supported = cls.get_supported_head_sizes()
        if not isinstance(head_size, int) or head_size <= 0:
            raise ValueError(f"head_size={head_size!r} must be a positive int")
        if supported and head_size not in supported:
            raise ValueError(
                f"head_size={head_size} is not supported by {cls.get_name()}; supported head "
                f"sizes are {supported}. Set PAGEDATTN_ATTENTION_BACKEND=TORCH_SDPA to use the "
                "backend that serves any head size.")


class AttentionImpl(ABC, Generic[M]):
    """One layer's attention computation; constructed by the `Attention` layer."""

    num_heads: int
    head_size: int
    scale: float
    num_kv_heads: int
    # Whether forward() also takes 2-D rows: query [T, num_heads * head_size], key / value
    # [T, num_kv_heads * head_size(_v)], output [T, num_heads * head_size_v] (the layer then
    # passes its tensors without viewing them as [T, heads, D]).
    forward_takes_rows: ClassVar[bool] = False

    @abstractmethod
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: Optional[list[float]], sliding_window: Optional[int],
                 kv_cache_dtype: str, logits_soft_cap: Optional[float] = None,
                 attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: Optional[str] = None, **kwargs) -> None: ...

    @abstractmethod
    def forward(self, layer: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: M,
                output: Optional[torch.Tensor] = None, output_scale: Optional[torch.Tensor] = None,
                output_block_scale: Optional[torch.Tensor] = None) -> torch.Tensor: ...

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        pass


class AttentionMetadataBuilder(ABC, Generic[M]):
    """Turns a batch's CommonAttentionMetadata into a backend's metadata, once per batch."""

    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    # Requests with query_len <= this are "decodes" for reorder_batch.
    reorder_batch_threshold: ClassVar[Optional[int]] = None

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config, device: torch.device):
        self.kv_cache_spec = kv_cache_spec
        self.layer_names = layer_names
        self.vllm_config = vllm_config
        self.device = torch.device(device)

    @abstractmethod
    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> M: ...

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> M:
        return self.build(0, common_attn_metadata)

    def check_batch(self, m: CommonAttentionMetadata) -> None:
        """ValueError naming request and value for a malformed batch (host copies only)."""
        check_builder_batch(self, m)

    def reorder_batch(self, input_batch, scheduler_output) -> bool:
        """Reorder requests so decodes come first; returns whether anything moved."""
        return False

    def use_cascade_attention(self, common_prefix_len: int, query_lens, num_query_heads: int,
                              num_kv_heads: int, use_alibi: bool, use_sliding_window: bool,
                              use_local_attention: bool, num_sms: int) -> bool:
        return False
