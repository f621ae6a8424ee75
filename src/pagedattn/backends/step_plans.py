"""What a step's metadata carries from its builder, for every backend: the step's plans
(`StepPlans`: one entry per kind of layer, and each layer's entry, `PlannedLayer`, made at
its first call of them), put into the metadata as it is made (`PlannedMetadata`).

The kinds' plans are the backends' own (`paged_plans`, `dcp`, `flashinfer`); each has
`run(impl, layer, query, key, value, key_cache, value_cache, output)` and
`plan_layer(impl, layer, key_cache, value_cache)` (checks the layer against the plans, and
returns the provider's plan of its caches and tensors, or None).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import KW_ONLY, InitVar, dataclass, field
from typing import Any, Optional

import torch

from pagedattn.ops.plan import LayerPlan
from pagedattn.types import AttentionMetadata


@dataclass(frozen=True)
class StepPlans:
    """A batch's plans, one entry per kind of the layout's layers (`PlanLayout.kinds`), and
    each layer's entry (`PlannedLayer`, by impl), made at its first call of these plans."""

    layout: Any  # PlanLayout, or any object with index_of(impl, layer) -> kind index
    kinds: tuple
    layers: dict = field(default_factory=dict)


class PlannedLayer:
    """A layer's entry in a step's plans (`PagedAttentionImpl.plan_layer`): its kind's plans,
    the cache and per-layer tensors they were made with (a call checks them by identity),
    the cache's K/V views and `run`, the provider's plan of the layer (None: `plans.run`
    takes every call)."""

    __slots__ = ("plans", "kv_cache", "key_cache", "value_cache", "k_scale", "v_scale",
                 "q_scale", "alibi_slopes", "sinks", "run")

    def __init__(self, plans: Any, kv_cache: torch.Tensor, key_cache: Optional[torch.Tensor],
                 value_cache: Optional[torch.Tensor], k_scale: torch.Tensor,
                 v_scale: torch.Tensor, q_scale: torch.Tensor,
                 alibi_slopes: Optional[torch.Tensor], sinks: Optional[torch.Tensor],
                 layer_plan: Optional[LayerPlan]):
        self.plans, self.kv_cache, self.key_cache, self.value_cache = (
            plans, kv_cache, key_cache, value_cache)
        self.k_scale, self.v_scale, self.q_scale = k_scale, v_scale, q_scale
        self.alibi_slopes, self.sinks = alibi_slopes, sinks
        self.run = None if layer_plan is None else layer_plan.run


@dataclass(frozen=True)
class PlannedMetadata(AttentionMetadata):
    """Metadata that carries its builder's plans: made by `planner(metadata)` as the builder
    makes it (an init-only argument), never set afterwards. A `dataclasses.replace` copy is
    another batch and carries none (a builder's `plan(metadata)` plans one)."""

    plans: Optional[StepPlans] = field(default=None, init=False, repr=False, compare=False)
    _: KW_ONLY
    planner: InitVar[Optional[Callable[[Any], StepPlans]]] = None

    def __post_init__(self, planner: Optional[Callable[[Any], StepPlans]]) -> None:
        if planner is not None:  # a frozen dataclass sets what it derives this way
            object.__setattr__(self, "plans", planner(self))


class OneKind:
    """The layout of a builder whose one set of plans serves every layer (FLASHINFER)."""

    missing = ()

    def index_of(self, impl: Any, layer: Any) -> int:
        return 0


ONE_KIND = OneKind()
