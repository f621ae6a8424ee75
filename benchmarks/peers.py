"""Other libraries' attention kernels, timed beside ours by the benchmarks. Each is optional:
it loads where installed and says why not elsewhere, and none is a dependency of the package.

    from peers import fa3, fa3_varlen, paged_rows, sdpa_cudnn, vllm_unified, vllm_paged

- FlashAttention-3's forward kernels, the `fa3-fwd` wheel (carried in `.whl/`, installed by
  tools/device_env.sh): `fa3()` gives its `fa3_fwd_interface` module or why not. The wheel's
  paged path is compiled out (and its sliding window), so it reads dense varlen K/V:
  `fa3_varlen` over `paged_rows` of our cache, the same values.
- SDPA restricted to cuDNN attention over dense K/V: `sdpa_cudnn`.
- vLLM's Triton unified attention over our paged cache: `vllm_unified()`, `vllm_paged`.
"""

from __future__ import annotations

import functools
import importlib
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Optional

import torch
import torch.nn.functional as F
from timing import error_text

# The interface module imports `flash_attn_config` (the name of the full package's build
# record); the wheel ships it as `fa3_fwd_config`, so a one-line module bridges the names.
FA3_CONFIG_BRIDGE = "from fa3_fwd_config import CONFIG  # noqa: F401\n"
VLLM_MODULES = ("vllm.attention.ops.triton_unified_attention",
                "vllm.v1.attention.ops.triton_unified_attention")


@functools.cache
def fa3() -> tuple[Optional[ModuleType], str]:
    """(the `fa3_fwd_interface` module, "") where the wheel imports, else (None, why not)."""
    try:
        importlib.import_module("fa3_fwd_config")
    except Exception as e:  # noqa: BLE001 - a missing peer is a table note, not a failure
        return None, f"not installed ({error_text(e)})"
    try:
        importlib.import_module("flash_attn_config")
    except ImportError:
        bridge = Path(tempfile.mkdtemp(prefix="fa3_config_"))
        (bridge / "flash_attn_config.py").write_text(FA3_CONFIG_BRIDGE)
        sys.path.insert(0, str(bridge))
        importlib.invalidate_caches()
    try:
        return importlib.import_module("fa3_fwd_interface"), ""
    except Exception as e:  # noqa: BLE001 - e.g. a torch its binary does not load on
        return None, f"installed but failed to import ({error_text(e)})"


def fa3_varlen(module: ModuleType, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
               max_seqlen_k: int, softmax_scale: float, causal: bool = True,
               descale: Optional[torch.Tensor] = None, num_splits: int = 0
               ) -> Callable[[], torch.Tensor]:
    """A call of FA3's forward over dense varlen K/V that returns out [total_q, H, D] (bf16
    for e4m3 inputs too). q [total_q, H, D]; k, v [total_k, H_kv, D]; descale [batch, H_kv]
    float32, the descale of q, k and v alike (e4m3 inputs). num_splits 0: FA3's own split
    heuristic, as vLLM calls it. Causal is bottom-right aligned, as ours."""
    def run() -> torch.Tensor:
        return module._flash_attn_forward(
            q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, q_descale=descale,
            k_descale=descale, v_descale=descale, softmax_scale=softmax_scale, causal=causal,
            num_splits=num_splits)[0]
    return run


def sdpa_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False
               ) -> Callable[[], torch.Tensor]:
    """SDPA restricted to cuDNN attention: q [B, H, Lq, D], k / v [B, H_kv, Lk, D] (any
    strides with a unit last one; the KV heads shared through enable_gqa, not copied)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    return run


@functools.cache
def vllm_unified() -> tuple[Optional[Callable], str]:
    """(vLLM's Triton `unified_attention`, "") where vLLM is installed, else (None, why not)."""
    why = "not installed"
    for name in VLLM_MODULES:
        try:
            return importlib.import_module(name).unified_attention, ""
        except ModuleNotFoundError:
            continue
        except Exception as e:  # noqa: BLE001 - installed but broken here: say so
            why = f"failed to import ({error_text(e)})"
    return None, why


def vllm_paged(fn: Callable, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               out: torch.Tensor, cu_seqlens_q: torch.Tensor, max_seqlen_q: int,
               seqused_k: torch.Tensor, max_seqlen_k: int, block_table: torch.Tensor,
               softmax_scale: float) -> Callable[[], None]:
    """A causal call of vLLM's `unified_attention` over our paged cache (16-bit)."""
    one = torch.ones((), dtype=torch.float32, device=q.device).expand(
        seqused_k.shape[0], k_cache.shape[-2])
    return functools.partial(
        fn, q=q, k=k_cache, v=v_cache, out=out, cu_seqlens_q=cu_seqlens_q,
        max_seqlen_q=max_seqlen_q, seqused_k=seqused_k, max_seqlen_k=max_seqlen_k,
        softmax_scale=softmax_scale, causal=True, window_size=(-1, -1),
        block_table=block_table, softcap=0, q_descale=None, k_descale=one, v_descale=one)


def paged_rows(cache: torch.Tensor, block_table: torch.Tensor,
               ranges: Sequence[tuple[int, int, int]]) -> torch.Tensor:
    """The keys (or values) of a paged cache [num_blocks, block_size, H_kv, D] as dense rows
    [sum of range lengths, H_kv, D], same dtype and bits: for each (request, lo, hi), its
    positions lo..hi-1 through block_table [batch, max_blocks]."""
    block_size = cache.shape[1]
    # fp8 through its bytes: indexing kernels do not cover every float8 type on every build
    raw = cache.view(torch.uint8) if cache.element_size() == 1 else cache
    total = sum(hi - lo for _, lo, hi in ranges)
    rows = torch.empty((total, *cache.shape[2:]), dtype=raw.dtype, device=cache.device)
    start = 0
    for request, lo, hi in ranges:
        pos = torch.arange(lo, hi, device=cache.device)
        rows[start:start + hi - lo] = raw[block_table[request, pos // block_size].long(),
                                          pos % block_size]
        start += hi - lo
    return rows.view(cache.dtype)
