"""What an `Attention` layer call accepts: shape, dtype and device checks of query/key/value
against the layer, and of their token counts against the step's metadata.

Host-side and O(1): tensor metadata and a few metadata fields only, never a tensor's values,
so no device sync and nothing that a captured CUDA graph replays (`forward` runs them while
capturing; a replay re-runs the kernels only). Each error is a ValueError or TypeError that
names the layer, the argument, its shape or dtype and what was expected: q/k/v in the dtype
the layer's cache takes, and key/value given wherever the layer writes or reads them.

The padding rule: a call may carry more tokens than the step's `num_actual_tokens` (CUDA
graphs pad a batch to a captured size); rows past it are padding: their keys are not cached,
their queries attend to nothing, and their output rows are zero (docs/DESIGN.md, "What is
checked where", names the one backend that does not zero them). Fewer tokens is an error.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from pagedattn.types import AttentionType

_FLOAT = (torch.float16, torch.bfloat16, torch.float32)


def check_layer_inputs(layer: Any, query: torch.Tensor, key: Optional[torch.Tensor],
                       value: Optional[torch.Tensor],
                       output_shape: Optional[torch.Size] = None) -> None:
    """query [T, num_heads * head_size] (or [T, num_heads, head_size]); key and value
    [T, num_kv_heads * head_size(_v)] (or 3-d), both given or both None. Cross-attention
    (ENCODER_DECODER) keys and values hold the encoder's tokens, so their count may differ
    from the query's; every other type takes the same T for all three."""
    # The common call in a few comparisons (a model's q/k/v projections, as vLLM passes
    # them): 2-D tensors of the layer's widths, one token count, dtype and device. Anything
    # else, valid or not, takes the checks below, which also word every error.
    if output_shape is None and isinstance(query, torch.Tensor) and \
            isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor):
        q_shape, k_shape, v_shape = query.shape, key.shape, value.shape
        q_width, k_width, v_width = layer.input_widths
        if len(q_shape) == 2 and len(k_shape) == 2 and len(v_shape) == 2 and \
                q_shape[1] == q_width and k_shape[1] == k_width and v_shape[1] == v_width and \
                q_shape[0] == k_shape[0] == v_shape[0]:
            # The dtype the layer's cache takes, compared by identity (`_dtype_taken`, written
            # out: a steady call enters six of our functions, tests/test_short_path.py). A
            # layer without a bound cache takes the checks below, which let it pass.
            dtype, device = query.dtype, query.device
            takes = layer.kv_cache[0].dtype if layer.kv_cache_dtype == "auto" else layer.dtype
            if dtype is takes and key.dtype is dtype and value.dtype is dtype and \
                    dtype in _FLOAT and key.device == device and value.device == device:
                return
    num_tokens = _tokens(layer, "query", query, layer.num_heads, layer.head_size)
    if query.dtype not in _FLOAT:
        raise TypeError(f"{_name(layer)}: query has dtype {query.dtype}; allowed: "
                        f"{[str(d) for d in _FLOAT]} (the layer quantizes fp8 queries itself)")
    if output_shape is not None:
        _check_output_shape(layer, num_tokens, output_shape)
    if key is None and value is None:
        _check_kv_may_be_none(layer)
        _check_cache_dtype(layer, query.dtype)
        return
    if key is None or value is None:
        given, missing = ("key", "value") if value is None else ("value", "key")
        raise ValueError(f"{_name(layer)}: {given} is given but {missing} is None; pass both "
                         "(the new tokens' K/V) or neither (cross-attention over the cached "
                         "encoder K/V)")
    num_keys = _tokens(layer, "key", key, layer.num_kv_heads, layer.head_size)
    num_values = _tokens(layer, "value", value, layer.num_kv_heads, layer.head_size_v)
    if num_values != num_keys:
        raise ValueError(f"{_name(layer)}: key has shape {tuple(key.shape)} and value "
                         f"{tuple(value.shape)}: they must hold the same number of tokens")
    if num_keys != num_tokens and layer.attn_type != AttentionType.ENCODER_DECODER:
        raise ValueError(f"{_name(layer)}: key has shape {tuple(key.shape)} ({num_keys} tokens) "
                         f"but query {tuple(query.shape)} ({num_tokens} tokens); a "
                         f"{layer.attn_type} layer takes one key and value row per query token")
    for name, x in (("key", key), ("value", value)):
        if x.dtype != query.dtype:
            raise TypeError(f"{_name(layer)}: {name} has dtype {x.dtype} but query has "
                            f"{query.dtype}; pass query, key and value in one dtype")
        if x.device != query.device:
            raise ValueError(f"{_name(layer)}: {name} is on {x.device} but query is on "
                             f"{query.device}")
    _check_cache_dtype(layer, query.dtype)


def _check_kv_may_be_none(layer: Any) -> None:
    """key = value = None: only where the layer has nothing to write (it reads another
    layer's cache, or it is cross-attention reading the encoder's cached K/V)."""
    if layer.kv_sharing_target_layer_name is not None or \
            layer.attn_type == AttentionType.ENCODER_DECODER:
        return
    if layer.attn_type == AttentionType.DECODER:
        why = ("this decoder layer writes the new tokens' keys and values into its KV cache "
               "before attending (None would attend over cache slots never written)")
    else:
        why = (f"this {layer.attn_type} layer attends over the call's own keys and values "
               "(it has no cache to read them from)")
    raise ValueError(f"{_name(layer)}: key and value are None, but {why}; pass the tokens' "
                     "key and value (only a layer that shares another layer's KV cache, or "
                     "a cross-attention step after the encoder's K/V are cached, passes None)")


def _dtype_taken(layer: Any) -> torch.dtype:
    """The dtype q/k/v must have: an "auto" cache's own (it holds the model dtype: the kernels
    read both in one dtype), else the model dtype (`layer.dtype`), which a cache of a dtype of
    its own (`cache_dtype` "fp8", "bfloat16", ...) stores converted."""
    return layer.kv_cache[0].dtype if layer.kv_cache_dtype == "auto" else layer.dtype


def _check_cache_dtype(layer: Any, dtype: torch.dtype) -> None:
    """q/k/v in `_dtype_taken(layer)`. Encoder layers never touch the cache; an unbound layer
    has none yet."""
    if layer.attn_type in (AttentionType.ENCODER, AttentionType.ENCODER_ONLY):
        return
    cache = layer.kv_cache[0]
    if not cache.numel() or dtype is _dtype_taken(layer):
        return
    if layer.kv_cache_dtype == "auto":
        raise TypeError(
            f"{_name(layer)}: query, key and value have dtype {dtype} but the layer's KV "
            f"cache is {cache.dtype}; pass them in {cache.dtype} (or allocate the cache "
            f"in {dtype})")
    raise TypeError(
        f"{_name(layer)}: query, key and value have dtype {dtype} but the layer's KV "
        f"cache is {cache.dtype} (cache_dtype {layer.kv_cache_dtype!r}), which stores the "
        f"model dtype {layer.dtype} converted; pass them in {layer.dtype}")


def check_step_tokens(layer: Any, query: torch.Tensor, key: Optional[torch.Tensor],
                      attn_metadata: Any) -> None:
    """The call's tokens against this step's metadata (query [T, ...], key [Tk, ...]):
    at least `num_actual_tokens` queries (more: padding), and a key row for every entry of
    `slot_mapping` when the layer writes its keys (the cache write reads one row per slot)."""
    step_tokens = getattr(attn_metadata, "num_actual_tokens", None)
    if step_tokens is None:
        step_tokens = _step_tokens(attn_metadata)[1]
    num_tokens = query.shape[0]
    if step_tokens is not None and num_tokens < step_tokens:
        field = _step_tokens(attn_metadata)[0]
        raise ValueError(
            f"{_name(layer)}: query has {num_tokens} tokens but this step's metadata has "
            f"{field}={step_tokens}: pass every token of the step (more rows are allowed: "
            f"padding, whose output rows are zero)")
    if key is None or getattr(layer, "kv_sharing_target_layer_name", None) is not None:
        return
    slots = getattr(attn_metadata, "slot_mapping", None)
    if slots is not None and key.shape[0] < slots.shape[0]:
        raise ValueError(
            f"{_name(layer)}: key has {key.shape[0]} tokens (shape {tuple(key.shape)}) but "
            f"this step's attn_metadata.slot_mapping has "
            f"{slots.shape[0]} slots; pass a key and value row for every slot (slot -1 marks "
            "a padding row)")


def _tokens(layer: Any, name: str, x: Any, heads: int, head_size: int) -> int:
    """Rows of a [T, heads * head_size] or [T, heads, head_size] tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{_name(layer)}: {name} must be a torch.Tensor or None, got "
                        f"{type(x).__name__}")
    shape = x.shape
    if (len(shape) == 2 and shape[1] == heads * head_size) or \
            (len(shape) == 3 and shape[1] == heads and shape[2] == head_size):
        return shape[0]
    raise ValueError(
        f"{_name(layer)}: {name} has shape {tuple(shape)}; expected [num_tokens, "
        f"{heads * head_size}] ({heads} heads x head size {head_size}) or [num_tokens, "
        f"{heads}, {head_size}]")


def _check_output_shape(layer: Any, num_tokens: int, output_shape: torch.Size) -> None:
    per_token = layer.num_heads * layer.head_size_v
    numel = 1
    for size in output_shape:
        numel *= size
    if numel != num_tokens * per_token:
        raise ValueError(
            f"{_name(layer)}: output_shape={tuple(output_shape)} holds {numel} elements; "
            f"the output of {num_tokens} tokens has {num_tokens} x {per_token} (num_heads "
            f"{layer.num_heads} x head_size_v {layer.head_size_v})")


def _step_tokens(attn_metadata: Any) -> tuple[str, Optional[int]]:
    """(field name, the step's real token count) of any backend's metadata."""
    count = getattr(attn_metadata, "num_actual_tokens", None)
    if count is not None:
        return "attn_metadata.num_actual_tokens", count
    prefill = getattr(attn_metadata, "num_prefill_tokens", None)
    decode = getattr(attn_metadata, "num_decode_tokens", None)
    if prefill is None or decode is None:
        return "", None
    return ("attn_metadata.num_prefill_tokens + num_decode_tokens", prefill + decode)


def _name(layer: Any) -> str:
    return f"layer {layer.layer_name!r}" if layer.layer_name else "Attention layer (no prefix)"
