"""The forward context: per-step attention metadata for every layer of a model step.

An engine wraps each model step in `with set_forward_context(attn_metadata): model(...)`;
every `Attention` layer reads its metadata from `get_forward_context()`. Per-layer metadata
dicts are keyed by the layers' names (`layer_registry`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Optional, Union

# The registry's scope functions stay importable from here, where they used to live.
from pagedattn.layer_registry import LayerRegistry, current_layer_registry, model_scope
from pagedattn.types import AttentionMetadata

__all__ = ["ForwardContext", "LayerRegistry", "current_layer_registry", "get_forward_context",
           "is_forward_context_available", "model_scope", "set_forward_context"]


@dataclass
class ForwardContext:
    # One metadata object for every layer, or a dict keyed by layer name; None = profiling run.
    attn_metadata: Union[AttentionMetadata, dict[str, AttentionMetadata], None]
    virtual_engine: int = 0
    no_compile_layers: LayerRegistry = field(default_factory=current_layer_registry)
    extra: dict[str, Any] = field(default_factory=dict)


# The context of the step being run, None outside `set_forward_context`: set only there. A
# layer call reads it as an attribute (a function call less on every call).
current: Optional[ForwardContext] = None


def get_forward_context() -> ForwardContext:
    if current is None:
        raise RuntimeError(
            "no forward context is set: run the model inside "
            "`with pagedattn.set_forward_context(attn_metadata): ...`")
    return current


def is_forward_context_available() -> bool:
    return current is not None


@contextlib.contextmanager
def set_forward_context(attn_metadata: Union[AttentionMetadata, dict, None],
                        vllm_config: Any = None, virtual_engine: int = 0,
                        **extra: Any) -> Iterator[ForwardContext]:
    """Make `attn_metadata` visible to every Attention layer for the duration of one step.

    `vllm_config` is accepted for signature compatibility with the seeds and is unused.
    """
    global current
    previous = current
    current = ForwardContext(attn_metadata, virtual_engine, current_layer_registry(),
                             dict(extra))
    try:
        yield current
    finally:
        current = previous
