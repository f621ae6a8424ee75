"""Where Attention layers are found: by name in a model scope, and by a process-unique key.

Layers with a `prefix` register by that name in the current *model scope* (`model_scope()`),
which keeps names unique within one model and is how KV sharing finds its target. Every layer
also gets a process-unique key, because the opaque op that runs a layer under torch.compile
can only carry a string. Builders find the layers they plan for by name (`find_layers`): in
the current scope, else the newest live layer of that name (builders are often made after the
scope that built the model was left).
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any, Optional


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
# Every live layer by its key, in construction order (a dict keeps insertion order, so the
# last match is the newest). Weak: the index never keeps a model alive.
_live: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
_serials = itertools.count()


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


def register_layer(name: str, layer: Any) -> str:
    """Register a new layer (by `name` in the current scope when it has one) and return its
    process-unique key."""
    if name:
        current_layer_registry().register(name, layer)
    key = f"{name or 'attention'}#{next(_serials)}"
    _live[key] = layer
    return key


def layer_by_key(key: str) -> Any:
    """The live layer registered under `key` (what the opaque op carries)."""
    layer = _live.get(key)
    if layer is None:
        raise ValueError(f"no live Attention layer has key {key!r}; the layer was deleted "
                         "while a compiled graph still calls it")
    return layer


def find_layers(names: list[str], accept: Callable[[Any], bool] = lambda layer: True
                ) -> dict[str, Any]:
    """The layers named `names` that `accept` takes: from the current model scope, else the
    newest live layer of that name. Names without such a layer are left out."""
    return {name: layers[-1] for name, layers in find_all_layers(names, accept).items()}


def find_all_layers(names: list[str], accept: Callable[[Any], bool] = lambda layer: True
                    ) -> dict[str, list[Any]]:
    """Like `find_layers`, but a name outside the current scope gives every live layer of
    that name, oldest first (two models built with the same names, e.g. a reference and a
    sharded copy, are both found)."""
    registry = current_layer_registry()
    found = {name: [layer] for name in names
             if (layer := registry.get(name)) is not None and accept(layer)}
    wanted = set(names) - set(found)
    if wanted:
        for layer in list(_live.values()):  # construction order
            if layer.layer_name in wanted and accept(layer):
                found.setdefault(layer.layer_name, []).append(layer)
    return {name: found[name] for name in names if name in found}
