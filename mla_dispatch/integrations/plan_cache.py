"""Plans kept per shape by the engine integrations: the sparse ones, whose plan depends on shapes alone (every query
position attends to its ``topk`` slots), and the dense ones, which refresh a kept plan of the step's shapes with the
step's block table and lengths (``DecodePlan.update``: the schedule in place, no allocation) instead of planning anew.

A plan first used while a CUDA graph is being captured is kept for good: the graph replays its buffers. Other
shapes share a small set of recent plans, so shapes that change every step (eager batch sizes, prefill token
counts) do not grow the cache; each plan holds a workspace on the device.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable

import torch

from mla_dispatch.api import DecodePlan

__all__ = ["PlanCache", "MAX_RECENT_PLANS"]

#: plans of shapes not captured in a CUDA graph kept at once (a step's layers share one)
MAX_RECENT_PLANS = 4


class PlanCache:
    """``get(key, make)``: the plan for ``key``, made by ``make()`` on the key's first use (or after it was evicted)."""

    def __init__(self, max_recent: int = MAX_RECENT_PLANS) -> None:
        self.max_recent = max_recent
        self._graph: dict[Hashable, DecodePlan] = {}
        self._recent: OrderedDict[Hashable, DecodePlan] = OrderedDict()

    def __len__(self) -> int:
        return len(self._graph) + len(self._recent)

    def get(self, key: Hashable, make: Callable[[], DecodePlan], device: torch.device,
            reuse: Callable[[DecodePlan], None] | None = None) -> DecodePlan:
        """The plan kept for ``key`` (after ``reuse(plan)``, where given: a dense plan's update with this step's
        table and lengths), else ``make()``'s, kept."""
        plan = self._graph.get(key)
        if plan is not None:
            if reuse is not None:
                reuse(plan)
            return plan
        plan = self._recent.pop(key, None)
        if plan is None:
            plan = make()
        elif reuse is not None:
            reuse(plan)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            self._graph[key] = plan
        else:
            self._recent[key] = plan
            while len(self._recent) > self.max_recent:
                self._recent.popitem(last=False)
        return plan
