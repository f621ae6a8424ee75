"""The `Attention` layer: writes new keys/values into the paged cache and attends over it.

Constructor and forward follow the seeds' `vllm.attention.Attention`. The layer owns what is
per layer (scales, the bound cache, query quantization); everything per batch comes from the
forward context, and the computation is the backend impl's.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from pagedattn import envs, forward_context
from pagedattn.config import FP8_MAX, CacheConfig, kv_cache_torch_dtype
from pagedattn.distributed import get_decode_context_parallel_world_size
from pagedattn.forward_context import get_forward_context
from pagedattn.layer_checks import check_layer_inputs
from pagedattn.layer_registry import current_layer_registry, layer_by_key, register_layer
from pagedattn.ops.custom_ops import opaque_op
from pagedattn.selector import get_attn_backend
from pagedattn.types import AttentionBackend, AttentionType


class Attention(nn.Module):
    """Attention layer: cache the new K/V, then (multi-head/multi-query/grouped-query) attention.

    The KV cache is bound after construction (`bind_kv_cache`) and read from `self.kv_cache`.
    """

    def __init__(self, num_heads: int, head_size: int, scale: float,
                 num_kv_heads: Optional[int] = None,
                 alibi_slopes: Optional[list[float]] = None,
                 cache_config: Optional[CacheConfig] = None, quant_config: Any = None,
                 logits_soft_cap: Optional[float] = None,
                 per_layer_sliding_window: Optional[int] = None, use_mla: bool = False,
                 use_sparse: bool = False, prefix: str = "",
                 attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: Optional[str] = None,
                 attn_backend: Optional[type[AttentionBackend]] = None,
                 **extra_impl_args: Any) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        _check_heads(num_heads, num_kv_heads, head_size)
        if per_layer_sliding_window is not None:
            sliding_window = per_layer_sliding_window
        else:
            sliding_window = cache_config.sliding_window if cache_config else None
        cache_config = cache_config or CacheConfig()
        self.kv_cache_dtype = cache_config.cache_dtype
        self.block_size = cache_config.block_size
        self.calculate_kv_scales = cache_config.calculate_kv_scales
        # Scales as device tensors (for kernels, CUDA-graph safe) and host floats (for backends
        # that want them on the host). 1.0 unless loaded from a checkpoint or calculated.
        self._q_scale = torch.tensor(1.0, dtype=torch.float32)
        self._k_scale = torch.tensor(1.0, dtype=torch.float32)
        self._v_scale = torch.tensor(1.0, dtype=torch.float32)
        self._prob_scale = torch.tensor(1.0, dtype=torch.float32)
        self._q_scale_float = self._k_scale_float = self._v_scale_float = 1.0
        self._o_scale_float: Optional[float] = None
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.sliding_window = sliding_window
        self.use_mla, self.use_sparse = use_mla, use_sparse
        self.has_sink = extra_impl_args.get("sinks") is not None
        self.quant_method = _kv_quant_method(quant_config, self, prefix, self.kv_cache_dtype)
        self.dtype = torch.get_default_dtype()
        self.attn_backend = attn_backend or get_attn_backend(
            head_size, self.dtype, self.kv_cache_dtype, self.block_size, use_mla=use_mla,
            has_sink=self.has_sink, use_sparse=use_sparse)
        self.attn_backend.validate_head_size(head_size)
        self.head_size_v = getattr(self.attn_backend, "head_size_v", head_size)
        self._out_features = num_heads * self.head_size_v
        # The widths of a call's 2-D query, key and value (layer_checks' fast check).
        self.input_widths = (num_heads * head_size, num_kv_heads * head_size,
                             num_kv_heads * self.head_size_v)
        self.impl = self.attn_backend.get_impl_cls()(
            num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
            self.kv_cache_dtype, logits_soft_cap=logits_soft_cap, attn_type=attn_type,
            kv_sharing_target_layer_name=kv_sharing_target_layer_name, **extra_impl_args)
        self.backend = self.attn_backend.get_name()  # the seeds' enum, as its name
        if get_decode_context_parallel_world_size() > 1 and \
                not getattr(self.impl, "supports_dcp", False):
            raise ValueError(f"backend {self.backend} does not support decode context "
                             "parallelism; use FLASH_ATTN or FLASH_ATTN_DIFFKV")
        self.use_output = self.attn_backend.accept_output_buffer
        self.layer_name, self.attn_type = prefix, attn_type
        if kv_sharing_target_layer_name is not None:
            validate_kv_sharing_target(prefix, kv_sharing_target_layer_name,
                                       current_layer_registry(), attn_type)
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.kv_cache = [torch.tensor([])]  # replaced by bind_kv_cache
        self._op_key = register_layer(prefix, self)  # what the opaque op carries
        self.q_range = torch.tensor(envs.Q_SCALE_CONSTANT, dtype=torch.float32)
        self.k_range = torch.tensor(envs.K_SCALE_CONSTANT, dtype=torch.float32)
        self.v_range = torch.tensor(envs.V_SCALE_CONSTANT, dtype=torch.float32)
        # The layer quantizes the query itself when the backend reads an fp8 query, so that
        # torch.compile can fuse the quantization into the projection before it. Encoder
        # attention never reads the cache, so its query stays in the model dtype.
        self.query_quant_dtype: Optional[torch.dtype] = None
        reads_cache = attn_type not in (AttentionType.ENCODER, AttentionType.ENCODER_ONLY)
        if self.kv_cache_dtype in ("fp8", "fp8_e4m3") and reads_cache and \
                self.attn_backend.supports_quant_query_input:
            self.query_quant_dtype = kv_cache_torch_dtype(self.kv_cache_dtype, self.dtype)

    def forward(self, query: torch.Tensor, key: Optional[torch.Tensor],
                value: Optional[torch.Tensor],
                output_shape: Optional[torch.Size] = None) -> torch.Tensor:
        """query [T, num_heads * head_size], key/value [T, num_kv_heads * head_size(_v)] or None
        (cross-attention after the first step) -> [T, num_heads * head_size_v]."""
        check_layer_inputs(self, query, key, value, output_shape)  # shapes only: no sync
        if self.calculate_kv_scales:
            self.calc_kv_scales(query, key, value)
        # The result is the one allocation: empty (padding rows are zeroed by the impl). Ints,
        # not a tuple: torch parses them faster.
        output = query.new_empty(query.shape[0], self._out_features) if output_shape is None \
            else query.new_empty(output_shape)
        if self.query_quant_dtype is not None:
            query = _quantize_fp8(query, self._q_scale, self.query_quant_dtype)
        out = output
        if output_shape is not None or not self.impl.forward_takes_rows:
            query, key, value, out = self._heads(query, key, value, output)
        # One opaque op under torch.compile: the graph sees neither the forward context nor
        # the cache, so it does not depend on per-step metadata and never breaks around
        # attention. Eager calls skip the op's dispatch (tens of us) and find the layer
        # directly; they need no torch.no_grad either: the Triton launches record nothing,
        # and the PyTorch provider's launches turn autograd off themselves.
        if torch.compiler.is_compiling():
            unified_attention_with_output(query, key, value, out, self._op_key)
        else:
            _run_layer(self, query, key, value, out)
        return output

    def _heads(self, query, key, value, output) -> tuple:
        """The call's tensors as [T, heads, D] views, for an impl that takes only those."""
        query = query.view(-1, self.num_heads, self.head_size)
        if key is not None:
            key = key.view(-1, self.num_kv_heads, self.head_size)
        if value is not None:
            value = value.view(-1, self.num_kv_heads, self.head_size_v)
        return query, key, value, output.view(-1, self.num_heads, self.head_size_v)

    def calc_kv_scales(self, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor) -> None:
        """Set q/k/v scales once, from this batch's |max| over the range constants."""
        self._q_scale.copy_(query.abs().max().float().cpu() / self.q_range)
        self._k_scale.copy_(key.abs().max().float().cpu() / self.k_range)
        self._v_scale.copy_(value.abs().max().float().cpu() / self.v_range)
        self._q_scale_float = self._q_scale.item()
        self._k_scale_float = self._k_scale.item()
        self._v_scale_float = self._v_scale.item()
        self.calculate_kv_scales = False

    def _apply(self, fn, recurse: bool = True):
        # The scales are plain attributes, not buffers: they follow the module until a cache
        # is bound, then stay on the cache's device, where the kernels read them.
        module = super()._apply(fn, recurse)
        cache = self.kv_cache[0]
        if cache.numel():
            self.place_on(cache.device)
        else:
            for name in _PER_CALL_TENSORS:
                setattr(self, name, fn(getattr(self, name)).float())
        return module

    def place_on(self, device: torch.device) -> None:
        """Put every tensor a call reads (scales, ranges, the impl's ALiBi slopes and sinks) on
        `device`, once: `bind_kv_cache` calls it with the cache's device, so a layer built on
        the CPU and never moved costs no host-to-device copy per call (and can be captured)."""
        for name in _PER_CALL_TENSORS:
            t = getattr(self, name)
            if t.device != device:
                setattr(self, name, t.to(device))
        move = getattr(self.impl, "to_device", None)
        if move is not None:
            move(device)
        else:  # impls without the hook: the per-head tensors the paged impls read per call
            for name in ("alibi_slopes", "sinks"):
                t = getattr(self.impl, name, None)
                if isinstance(t, torch.Tensor) and t.device != device:
                    setattr(self.impl, name, t.to(device))

    def extra_repr(self) -> str:
        return (f"head_size={self.impl.head_size}, num_heads={self.impl.num_heads}, "
                f"num_kv_heads={self.impl.num_kv_heads}, scale={self.impl.scale}, "
                f"backend={self.impl.__class__.__name__}")

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        self.impl.process_weights_after_loading(act_dtype)

    def get_attn_backend(self) -> type[AttentionBackend]:
        return self.attn_backend


# What a layer call reads from the layer itself: kept on the bound cache's device.
_PER_CALL_TENSORS = ("_q_scale", "_k_scale", "_v_scale", "_prob_scale", "q_range", "k_range",
                     "v_range")


@opaque_op("unified_attention_with_output", mutates_args=("output",))
def unified_attention_with_output(query: torch.Tensor, key: Optional[torch.Tensor],
                                  value: Optional[torch.Tensor], output: torch.Tensor,
                                  layer_key: str) -> None:
    """Run layer `layer_key`'s attention with this step's metadata, writing into `output`."""
    _run_layer(layer_by_key(layer_key), query, key, value, output)


def _run_layer(layer: Attention, query: torch.Tensor, key: Optional[torch.Tensor],
               value: Optional[torch.Tensor], output: torch.Tensor) -> None:
    """The step's metadata and the layer's cache from the forward context, into the impl
    (whose plans check the call's tokens against the step: `layer_checks.check_step_tokens`
    where a call is not the planned one)."""
    context = forward_context.current
    if context is None:
        context = get_forward_context()  # raises: no step is being run
    attn_metadata = context.attn_metadata
    if isinstance(attn_metadata, dict):
        attn_metadata = attn_metadata[layer.layer_name]
    if attn_metadata is None:  # profiling run: no cache, no attention, zeros out
        output.zero_()  # (the output buffer is torch.empty)
        return
    kv_cache = layer.kv_cache[context.virtual_engine]
    if kv_cache.device != query.device and kv_cache.numel():  # a device compare: no sync
        raise ValueError(f"layer {layer.layer_name or layer._op_key!r}: query is on "
                         f"{query.device} but its KV cache is on {kv_cache.device}; run the "
                         "layer on its cache's device (bind_kv_cache places its tensors there)")
    if layer.use_output:
        layer.impl.forward(layer, query, key, value, kv_cache, attn_metadata, output=output)
    else:
        output.copy_(layer.impl.forward(layer, query, key, value, kv_cache, attn_metadata)
                     .view_as(output))


def validate_kv_sharing_target(current_layer_name: str, target_layer_name: str,
                               registry, attn_type: Optional[str] = None) -> None:
    """A layer may read an earlier layer's cache: the target exists, is not itself, came
    first (is registered already) and has the same attention type."""
    error = (f"layer {current_layer_name!r} cannot share the KV cache of "
             f"{target_layer_name!r}: ")
    if target_layer_name == current_layer_name:
        raise ValueError(error + "a layer cannot share its own cache")
    target = registry.get(target_layer_name)
    if target is None:
        raise ValueError(error + "no such layer was built before it (the target must be an "
                         f"earlier layer of the same model; known: {registry.names()})")
    if target.kv_sharing_target_layer_name is not None:
        raise ValueError(error + "the target itself shares another layer's cache")
    if attn_type is not None and target.attn_type != attn_type:
        raise ValueError(error + f"its attention type {target.attn_type!r} differs from "
                         f"{attn_type!r}")


def _check_heads(num_heads: int, num_kv_heads: int, head_size: int) -> None:
    for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                        ("head_size", head_size)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive int")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) is not divisible by num_kv_heads "
                         f"({num_kv_heads}); grouped-query attention needs whole groups")


def _kv_quant_method(quant_config: Any, layer: Attention, prefix: str, cache_dtype: str):
    """The checkpoint's KV-cache quantization method, if any (it creates k/v scale weights)."""
    method = quant_config.get_quant_method(layer, prefix=prefix) if quant_config else None
    if method is None:
        return None
    if cache_dtype == "fp8_e5m2":
        raise ValueError("fp8_e5m2 kv-cache is not supported with fp8 checkpoints; "
                         "use kv_cache_dtype='fp8_e4m3'")
    method.create_weights(layer)
    return method


def _quantize_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    bound = FP8_MAX[dtype]
    return (x.float() / scale).clamp(-bound, bound).to(dtype)
