"""FLASHINFER's plan inputs that come from the model's layers, and its CSR page table.

One plan serves every layer of a step, so the builder must find the layers it plans for and
check they agree on what a plan fixes (`PerLayerParameters`, as in vLLM's FlashInfer backend).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from pagedattn.layer_registry import find_layers as find_named_layers


# --- per-layer hyper-parameters --------------------------------------------------------------
@dataclass(frozen=True)
class PerLayerParameters:
    """What one plan fixes for every layer it serves."""

    window_left: int
    logits_soft_cap: Optional[float]
    sm_scale: float


def get_per_layer_parameters(layers: Mapping[str, Any]) -> dict[str, PerLayerParameters]:
    """The plan hyper-parameters each FLASHINFER Attention layer (name -> layer) asks for."""
    params = {}
    for name, layer in layers.items():
        if not _is_flashinfer(layer):
            raise TypeError(f"layer {name!r} runs {type(layer.impl).__name__} of backend "
                            f"{layer.get_attn_backend().get_name()}, not FLASHINFER")
        impl = layer.impl
        params[name] = PerLayerParameters(impl.sliding_window[0], impl.logits_soft_cap or None,
                                          impl.scale)
    return params


def infer_global_hyperparameters(per_layer_params: Mapping[str, PerLayerParameters]
                                 ) -> PerLayerParameters:
    """The one set of (window_left, logits_soft_cap, sm_scale) every layer shares."""
    if not per_layer_params:
        raise ValueError("No attention layers found in the model.")
    names = list(per_layer_params)
    first = per_layer_params[names[0]]
    for name in names[1:]:
        if per_layer_params[name] != first:
            raise ValueError(
                "FLASHINFER plans once per batch for all layers, so every layer must share "
                f"window_left, logits_soft_cap and sm_scale; layer {names[0]!r} has {first} "
                f"but {name!r} has {per_layer_params[name]}. Use FLASH_ATTN for such models.")
    return first


def find_layers(layer_names: list[str]) -> dict[str, Any]:
    """The FLASHINFER Attention layers named `layer_names`: from the current model scope, else the
    most recently built live one of that name (a model built in a scope since left)."""
    return find_named_layers(layer_names, accept=_is_flashinfer)


def csr_indices(table: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """The first bounds[r] entries of each row of table [num_reqs, width] (host tensors),
    concatenated, int32; in numpy, whose masked indexing is cheap on a busy host."""
    t, b = table.numpy(), bounds.numpy()
    used = np.arange(t.shape[1])[None, :] < b[:, None]
    return torch.from_numpy(t[used].astype(np.int32))


def _is_flashinfer(layer: Any) -> bool:
    # By the backend's name: the backend module imports this one, so not by its impl class.
    return layer.get_attn_backend().get_name() == "FLASHINFER"
