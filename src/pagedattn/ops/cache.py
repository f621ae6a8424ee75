"""KV-cache writes: `reshape_and_cache_flash` and its different-head-size (DiffKV) variant."""

from __future__ import annotations

from typing import Optional, Union

import torch

from pagedattn.config import FP8_MAX, is_fp8_kv_cache, kv_cache_torch_dtype
from pagedattn.ops import custom_ops
from pagedattn.ops.checks import check_dim, check_tensor, require_tensor
from pagedattn.ops.index_checks import check_slots_if_asked
from pagedattn.ops.providers import provider_name
from pagedattn.ops.torch.cache import TorchCacheWritePlan

Scale = Union[torch.Tensor, float]
_FLOAT = (torch.float16, torch.bfloat16, torch.float32)


def reshape_and_cache_flash(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                            kv_cache_dtype: str, k_scale: Scale = 1.0,
                            v_scale: Scale = 1.0) -> None:
    """Write new keys/values into a paged cache.

    Args:
        key: [num_tokens, num_kv_heads, head_size]; value: [..., head_size_v].
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size(_v)], any
            strides (NHD or HND physical layout). fp8 caches may be given as uint8 storage.
        slot_mapping: [n] int32/int64, n <= num_tokens: token t goes to block
            slot // block_size, offset slot % block_size; negative slots are skipped.
        kv_cache_dtype: "auto"/"bfloat16"/"float16"/"float32"/"fp8"/"fp8_e4m3"/"fp8_e5m2".
        k_scale, v_scale: fp8 caches store x / scale, saturated to the format's range.
    """
    if not isinstance(kv_cache_dtype, str):
        raise TypeError(f"kv_cache_dtype={kv_cache_dtype!r} must be a string such as 'auto' "
                        "or 'fp8_e4m3'")
    key_cache = _storage_view(key_cache, kv_cache_dtype, "key_cache")
    value_cache = _storage_view(value_cache, kv_cache_dtype, "value_cache")
    _check(key, value, key_cache, value_cache, slot_mapping)
    check_slots_if_asked(slot_mapping, key_cache)  # PAGEDATTN_CHECK_INDICES=1: a host sync
    device = key.device
    custom_ops.reshape_and_cache(
        key, value, key_cache, value_cache, slot_mapping,
        _scale_tensor(k_scale, device, "k_scale"), _scale_tensor(v_scale, device, "v_scale"))


def reshape_and_cache_flash_diffkv(key: torch.Tensor, value: torch.Tensor,
                                   kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                                   kv_cache_dtype: str, k_scale: Scale = 1.0,
                                   v_scale: Scale = 1.0) -> None:
    """Like `reshape_and_cache_flash` for one cache tensor holding K and V side by side.

    kv_cache: [num_blocks, block_size, num_kv_heads, head_size + head_size_v]; K is
    [..., :head_size] and V is [..., head_size:].
    """
    require_tensor("kv_cache", kv_cache, 4)
    require_tensor("key", key, 3)
    require_tensor("value", value, 3)
    head_size = key.shape[-1]
    check_dim("kv_cache", kv_cache, 3, head_size + value.shape[-1],
              "head_size + head_size_v of key and value")
    reshape_and_cache_flash(key, value, kv_cache[..., :head_size], kv_cache[..., head_size:],
                            slot_mapping, kv_cache_dtype, k_scale, v_scale)


def _storage_view(cache: torch.Tensor, kv_cache_dtype: str, name: str) -> torch.Tensor:
    require_tensor(name, cache, 4)
    if is_fp8_kv_cache(kv_cache_dtype):
        fp8 = kv_cache_torch_dtype(kv_cache_dtype, cache.dtype)
        if cache.dtype == torch.uint8:
            return cache.view(fp8)
        if cache.dtype != fp8:
            raise TypeError(
                f"{name} has dtype {cache.dtype} but kv_cache_dtype={kv_cache_dtype!r} "
                f"needs {fp8} (or uint8 storage)")
    else:
        kv_cache_torch_dtype(kv_cache_dtype, cache.dtype)  # validates the string
        if cache.dtype in FP8_MAX or cache.dtype == torch.uint8:
            raise TypeError(
                f"{name} has dtype {cache.dtype} but kv_cache_dtype={kv_cache_dtype!r} is not "
                "fp8; pass kv_cache_dtype='fp8_e4m3' or 'fp8_e5m2'")
    return cache


def _check(key, value, key_cache, value_cache, slot_mapping) -> None:
    require_tensor("key", key, 3, _FLOAT)
    device = key.device
    require_tensor("value", value, 3, (key.dtype,), device)
    check_tensor("key_cache", key_cache, 4, None, device)
    check_tensor("value_cache", value_cache, 4, (key_cache.dtype,), device)
    require_tensor("slot_mapping", slot_mapping, 1, (torch.int32, torch.int64), device)
    if slot_mapping.shape[0] > key.shape[0] or value.shape[0] != key.shape[0]:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} slots for key {tuple(key.shape)} and "
            f"value {tuple(value.shape)}; need len(slot_mapping) <= num_tokens of both")
    check_dim("value", value, 1, key.shape[1], "num_kv_heads of key")
    check_dim("key_cache", key_cache, 2, key.shape[1], "num_kv_heads of key")
    check_dim("key_cache", key_cache, 3, key.shape[2], "head_size of key")
    check_dim("value_cache", value_cache, 2, value.shape[1], "num_kv_heads of value")
    check_dim("value_cache", value_cache, 3, value.shape[2], "head_size of value")
    if key_cache.shape[:2] != value_cache.shape[:2]:
        raise ValueError(f"key_cache {tuple(key_cache.shape)} and value_cache "
                         f"{tuple(value_cache.shape)} differ in blocks or block size")


class CacheWritePlan:
    """One batch's cache write, planned (`plan_reshape_and_cache_flash`); `run` per layer.

    `run` converts what it must (uint8 storage, float scales), then runs `provider_plan`
    (`TritonCacheWritePlan`, `TorchCacheWritePlan`), whose `run(key, value, key_cache,
    value_cache, k_scale, v_scale)` converts nothing: caches in the planned dtype, scales 0-d
    float32 tensors on the keys' device (the backends' builders plan for exactly those)."""

    def __init__(self, slot_mapping: torch.Tensor, cache_dtype: torch.dtype, provider: str,
                 provider_plan) -> None:
        self.slot_mapping, self.cache_dtype = slot_mapping, cache_dtype
        self.provider, self.provider_plan = provider, provider_plan
        # Whether the provider plan's run also takes 2-D rows [tokens, num_kv_heads *
        # head_size(_v)] (the Triton write reads them through strides; PyTorch's: 3-D only).
        self.takes_rows = provider_plan.takes_rows

    def run(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
            value_cache: torch.Tensor, k_scale: Scale = 1.0, v_scale: Scale = 1.0) -> None:
        """`reshape_and_cache_flash`'s tensors; scales as 0-d float32 tensors on the device
        avoid a conversion per call. uint8 caches are viewed as the planned fp8 dtype."""
        if key_cache.dtype != self.cache_dtype:
            key_cache, value_cache = (c.view(self.cache_dtype) if c.dtype == torch.uint8 else c
                                      for c in (key_cache, value_cache))
        if key_cache.dtype != self.cache_dtype or value_cache.dtype != self.cache_dtype:
            raise TypeError(f"caches have dtypes {key_cache.dtype}, {value_cache.dtype}; this "
                            f"plan writes {self.cache_dtype}")
        self.provider_plan.run(key, value, key_cache, value_cache,
                               _scale_tensor(k_scale, key.device),
                               _scale_tensor(v_scale, key.device))


def plan_reshape_and_cache_flash(slot_mapping: torch.Tensor, *, num_kv_heads: int,
                                 head_size: int, page_size: int, cache_dtype: torch.dtype,
                                 head_size_v: Optional[int] = None,
                                 provider: Optional[str] = None,
                                 cuda_graph: bool = False) -> CacheWritePlan:
    """Plan the cache write of one batch (slot_mapping [n] int32/int64, negative = skip) into
    caches of storage dtype `cache_dtype` (an fp8 dtype quantizes); heads and page size as the
    caches have them. `provider` defaults to the device's, read here once. The PyTorch
    provider reads the slots now (the plan serves this batch's values), or with `cuda_graph`
    (a captured plan that later batches replay) at every run; Triton's at launch."""
    check_tensor("slot_mapping", slot_mapping, 1, (torch.int32, torch.int64))
    provider = provider or provider_name(slot_mapping.device)
    if provider == "triton":
        from pagedattn.ops.triton.cache_write import TritonCacheWritePlan

        provider_plan = TritonCacheWritePlan(
            slot_mapping, num_kv_heads, head_size,
            head_size if head_size_v is None else head_size_v, page_size, cache_dtype)
    else:
        provider_plan = TorchCacheWritePlan(slot_mapping, page_size, cuda_graph)
    return CacheWritePlan(slot_mapping, cache_dtype, provider, provider_plan)


def _scale_tensor(scale: Scale, device: torch.device, name: str = "scale") -> torch.Tensor:
    if isinstance(scale, torch.Tensor):
        if scale.dtype == torch.float32 and scale.dim() == 0 and scale.device == device:
            return scale
        if scale.numel() != 1:
            raise ValueError(f"{name} has shape {tuple(scale.shape)}; expected one value (a "
                             "float or a one-element tensor)")
        return scale.to(device=device, dtype=torch.float32).reshape(())
    return torch.tensor(float(scale), dtype=torch.float32, device=device)
