"""The forward context: per-step attention metadata, and the model-scoped layer registry.

An engine wraps each model step in `with set_forward_context(attn_metadata): model(...)`;
every `Attention` layer reads its metadata from `get_forward_context()`. Layers register by
name (their `prefix`) in the current model scope when they are built, which is how KV sharing
finds its target layer and how per-layer metadata dicts are keyed.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from pagedattn.types import AttentionMetadata


class LayerRegistry:
    """Attention layers of one model by name. The default registry holds layers weakly, so
    a model that is gone frees its names; an explicit `model_scope()` holds them strongly."""

    def __init__(self, weak: bool = False):
        self._layers: MutableMapping[str, Any] = (
            weakref.WeakValueDictionary() if weak else {})

    def register(self, name: str, layer: Any) -> None:
        if name in self._layers:
            raise ValueError(
                f"Duplicate layer name: {name!r} is already registered in this model scope; give "
                "each Attention a unique prefix, or build each model inside `model_scope()`")
        self._layers[name] = layer

    def get(self, name: str) -> Optional[Any]:
        return self._layers.get(name)

    def names(self) -> list[str]:
        return list(self._layers)

    def items(self) -> list[tuple[str, Any]]:
        return list(self._layers.items())

    def __contains__(self, name: str) -> bool:
        return name in self._layers

    def __len__(self) -> int:
        return len(self._layers)


_default_registry = LayerRegistry(weak=True)
_registry_stack: list[LayerRegistry] = []


def current_layer_registry() -> LayerRegistry:
    return _registry_stack[-1] if _registry_stack else _default_registry


@contextlib.contextmanager
def model_scope(registry: Optional[LayerRegistry] = None) -> Iterator[LayerRegistry]:
    """Build a model inside this scope: its layers' names are unique within it only."""
    registry = registry if registry is not None else LayerRegistry()
    _registry_stack.append(registry)
    try:
        yield registry
    finally:
        _registry_stack.pop()


@dataclass
class ForwardContext:
    # One metadata object for every layer, or a dict keyed by layer name; None = profiling run.
    attn_metadata: Union[AttentionMetadata, dict[str, AttentionMetadata], None]
    virtual_engine: int = 0
    no_compile_layers: LayerRegistry = field(default_factory=current_layer_registry)
    extra: dict[str, Any] = field(default_factory=dict)


_forward_context: Optional[ForwardContext] = None


def get_forward_context() -> ForwardContext:
    if _forward_context is None:
        raise RuntimeError(
            "no forward context is set: run the model inside "
            "`with pagedattn.set_forward_context(attn_metadata): ...`")
    return _forward_context


def is_forward_context_available() -> bool:
    return _forward_context is not None


@contextlib.contextmanager
def set_forward_context(attn_metadata: Union[AttentionMetadata, dict, None],
                        vllm_config: Any = None, virtual_engine: int = 0,
                        **extra: Any) -> Iterator[ForwardContext]:
    """Make `attn_metadata` visible to every Attention layer for the duration of one step.

    `vllm_config` is accepted for signature compatibility with the seeds and is unused.
    """
    global _forward_context
    previous = _forward_context
    _forward_context = ForwardContext(attn_metadata, virtual_engine, current_layer_registry(),
                                      dict(extra))
    try:
        yield _forward_context
    finally:
        _forward_context = previous
