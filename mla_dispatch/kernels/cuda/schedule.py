"""The SM90 extension's split-KV schedule launch (``mla_decode_sm90/schedule.cu``) in the terms of a plan's buffers
(:class:`mla_dispatch.metadata.split_plan.SplitKVPlan`): one native launch where the Triton launch would go through
Triton's Python launcher. ``cuda_sm90`` plans always take it; ``triton`` plans take it where the extension is already
loaded in the process and the GPU is the one it was built for (sm_90), never building it (the Triton schedule runs
everywhere else, ROCm included)."""

from __future__ import annotations

from typing import Callable

import torch

from mla_dispatch.metadata.split_plan import NativeSchedule, SplitKVPlan

__all__ = ["native_schedule", "loaded_native_schedule"]


class _ExtensionSchedule:
    """The extension's schedule as :class:`SplitKVPlan` takes it: called as ``fn(cache_seqlens, plan)``, or bound
    once to a plan's buffers (:meth:`bind`: the extension's ``PlannedSchedule``, whose run checks only the lengths;
    a split-KV plan keeps the binding with its pooled buffers, so a plan or update made on them is one launch)."""

    __slots__ = ("_planned", "_fn")

    def __init__(self, module) -> None:
        self._planned = getattr(module, "PlannedSchedule", None)  # (a build older than the bound schedule: None)
        self._fn = module.split_kv_schedule

    def _args(self, plan: SplitKVPlan) -> tuple:
        s, lay = plan.schedule, plan.layout
        return (s.items, s.part_offsets, s.num_splits, s.slot_req, plan.first_slot, plan.lengths, plan.workspace,
                lay.chunk_size, lay.overhead, -1 if lay.capacity is None else lay.capacity)

    def __call__(self, cache_seqlens: torch.Tensor, plan: SplitKVPlan) -> None:
        self._fn(cache_seqlens, *self._args(plan))

    def bind(self, plan: SplitKVPlan) -> Callable[[torch.Tensor], None]:
        """``run(cache_seqlens)`` over ``plan``'s buffers and layout; it holds the buffers, not the plan."""
        args = self._args(plan)
        if self._planned is None:
            fn = self._fn
            return lambda cache_seqlens: fn(cache_seqlens, *args)
        return self._planned(*args).run


_MADE: dict[int, tuple] = {}  # id(module) -> (module, its schedule): one per loaded extension


def native_schedule(module) -> NativeSchedule | None:
    """``module``'s (the loaded extension's) schedule launch as :class:`SplitKVPlan` takes it (the same object for
    the same module), or None where the module has none (a build older than schedule.cu)."""
    if getattr(module, "split_kv_schedule", None) is None:
        return None
    made = _MADE.get(id(module))
    if made is None or made[0] is not module:
        made = _MADE[id(module)] = (module, _ExtensionSchedule(module))
    return made[1]


def loaded_native_schedule(capability) -> NativeSchedule | None:
    """The extension's schedule launch if the extension is loaded in this process already and ``capability`` (the
    plan's GPU, :attr:`mla_dispatch.dispatch.platform.Platform.capability`) is the sm_90 it was built for; else None.
    Never builds or loads it."""
    if capability != (9, 0):
        return None
    from mla_dispatch.kernels.cuda.build import load_sm90

    if not load_sm90.cache_info().currsize:
        return None
    try:
        return native_schedule(load_sm90())
    except Exception:  # a failed load is cuda_sm90's to report, not triton's
        return None
