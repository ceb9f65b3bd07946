"""One decode step's split-KV plan, shared by the in-house backends (``triton`` and ``cuda_sm90``).

A plan of either backend holds the same buffers: the split-KV schedule of the step's lengths
(:mod:`.schedule`), the first partial slot of each request (the combines' index, :func:`.combine.first_slots`),
the plan's own copy of the lengths (what every run computes with: docs/design.md §2, "Stale plans"), and the
workspace split requests write their partial rows to. The backends differ only in data: the chunk and part counts,
the schedule's overhead, a partial row's width and dtype, whether the pieces are fixed (batch-invariant plans) and
whether the lengths are read at all (a sparse plan's query positions each attend to ``topk`` slots).
:class:`SplitKVLayout` is that data, a function of shapes, so a backend computes it once per problem;
:class:`SplitKVPlan` allocates the buffers for one step and fills them, and :meth:`SplitKVPlan.update` refreshes
them in place for new lengths (no allocation, no host synchronisation: a CUDA graph over a run stays valid).

How the schedule is computed is chosen once, when the plan is made: a backend's native launch where it brings one
(``cuda_sm90``: its extension's schedule kernel), else one Triton launch on a GPU (:mod:`.schedule_triton`,
through its kept :class:`~.triton_launch.CachedLaunch`), else the torch reference (CPU, batches past
:data:`.schedule_triton.MAX_BATCH`, batch-invariant pieces).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import torch

from mla_dispatch.metadata.combine import first_slots
from mla_dispatch.metadata.reuse import ReusePool, reuse_key
from mla_dispatch.metadata.schedule import (TRITON_SCHEDULE_MAX_BATCH, SplitKVSchedule, _check_schedule_args,
                                           fixed_split_schedule, split_kv_schedule, workspace_numel)

__all__ = ["SplitKVLayout", "SplitKVPlan", "NativeSchedule"]

#: A backend's own schedule launch: ``fn(cache_seqlens, plan)`` writes ``plan.schedule``'s items, part offsets,
#: splits and slot owners, ``plan.first_slot`` and ``plan.lengths`` (a copy of ``cache_seqlens``) for a balanced
#: schedule (:func:`.schedule.split_kv_schedule`'s contract, bit for bit), with ``plan.workspace`` as scratch. One
#: with a ``bind(plan)`` method returning ``run(cache_seqlens)`` is bound once per set of pooled buffers and layout.
NativeSchedule = Callable[[torch.Tensor, "SplitKVPlan"], None]


@dataclasses.dataclass(frozen=True)
class SplitKVLayout:
    """What a split-KV plan allocates and how its schedule cuts the work; shapes only (no tensors, hashable).

    Attributes
    ----------
    batch : int
        Requests of the schedule (a sparse ``cuda_sm90`` plan: one per query position, ``B * s_q``).
    num_parts, chunk_size, overhead : int
        As :func:`.schedule.split_kv_schedule` takes them.
    capacity : int or None
        Tokens a request's table row addresses (``max_blocks * page_size``), or None (no bound).
    partial_row : tuple of int
        ``partial_out``'s shape after its slot dimension (the backend's row format).
    partial_dtype : torch.dtype
    split_tokens : int or None
        Set for a batch-invariant plan (:func:`.schedule.fixed_split_schedule`).
    fixed_length : int or None
        Set for a sparse plan: every request has this many positions (``topk``); ``cache_seqlens`` is not read,
        the schedule is made once and :meth:`SplitKVPlan.update` does nothing.
    """

    batch: int
    num_parts: int
    chunk_size: int
    overhead: int
    capacity: int | None
    partial_row: tuple[int, ...]
    partial_dtype: torch.dtype
    split_tokens: int | None = None
    fixed_length: int | None = None

    def __post_init__(self):
        # the schedule's parameters, checked once per layout (a plan checks only its lengths)
        _check_schedule_args(torch.zeros(1, dtype=torch.int32), self.num_parts, self.chunk_size, self.overhead,
                             self.capacity)

    @functools.cached_property
    def max_items(self) -> int:
        """Rows of the item list, and of the partial buffers (every item may be a split piece)."""
        if self.split_tokens is not None:
            return self.batch * max(1, -(-self.capacity // self.split_tokens))
        return self.batch + self.num_parts

    @property
    def max_slots(self) -> int:
        return self.max_items

    @functools.cached_property
    def _int32_sizes(self) -> tuple[int, ...]:
        """Elements of items, workspace, part_offsets, num_splits, slot_req, first_slot and lengths, in that order
        in one int32 buffer: items first (the CUDA kernels read a row as one 16-byte vector), the workspace after
        them (its first part is viewed as int64)."""
        b, p = self.batch, self.num_parts
        return (4 * self.max_items, workspace_numel(b, p), p + 1, b, self.max_slots, b, b)

    @functools.cached_property
    def _int32_total(self) -> int:
        return sum(self._int32_sizes)

    @functools.cached_property
    def _pool_sizes(self) -> tuple:
        """What a pooled set of buffers must match (:func:`_pool_key`): the int32 buffer's cuts and the partials'."""
        return self._int32_sizes, self.max_slots, self.partial_row, self.partial_dtype

    @functools.cached_property
    def _nbytes(self) -> int:
        """Bytes of a plan's three buffers."""
        rows = self.max_slots * math.prod(self.partial_row[:-1])
        return 4 * self._int32_total + rows * self.partial_row[-1] * self.partial_dtype.itemsize + 4 * rows


def _pool_key(layout: "SplitKVLayout", device: torch.device) -> tuple | None:
    """The pool key of a plan made now (:func:`.reuse.reuse_key`): the buffers' sizes and dtypes and how the int32 one
    is cut (not the layout: a table one column wider, a new ``capacity``, leaves them as they are), the device and
    its current stream; None while the stream captures a CUDA graph."""
    return reuse_key(device, layout._pool_sizes)


class _Pooled:
    """What a dropped plan gives the pool: its three buffers (``buffers``), their views as a plan cuts them
    (``views``: items as ``[max_items, 4]``, workspace, part offsets, splits, slot owners, first slots, lengths),
    their bytes, and the schedule object over those views with the layout it was made for and the native schedule
    launches bound to them (a plan of the same layout takes them as they are). The views and the schedule cost more
    host time to make than the plan's other work (benchmarks/RESULTS.md, "2026-11-29 (evening)")."""

    __slots__ = ("buffers", "views", "nbytes", "layout", "schedule", "bound")

    def __init__(self, layout: "SplitKVLayout", device: torch.device) -> None:
        # three allocations, one per dtype: a mutated view of another dtype's buffer stops torch.compile over a
        # run ("aot_autograd() does not yet handle input mutations on views with different dtypes", H200)
        ints = torch.empty(layout._int32_total, dtype=torch.int32, device=device)
        self.buffers = (ints,
                        torch.empty((layout.max_slots, *layout.partial_row), dtype=layout.partial_dtype, device=device),
                        torch.empty((layout.max_slots, *layout.partial_row[:-1]), dtype=torch.float32, device=device))
        items, *rest = ints.split_with_sizes(layout._int32_sizes)
        self.views = (items.view(layout.max_items, 4), *rest)
        self.nbytes = layout._nbytes
        self.layout = self.schedule = None
        self.bound: dict = {}  # native schedule -> its launch bound to these buffers and ``layout`` (SplitKVPlan)


#: What dropped split-KV plans leave (:meth:`SplitKVPlan.__del__`), for the next plan of their key (:func:`_pool_key`):
#: an engine makes a plan per decode step and drops the last one, and the three ``torch.empty`` of a plan were the
#: largest item of ``cuda_sm90``'s ``plan_decode`` on the H200 (benchmarks/RESULTS.md, "NVIDIA H200, 2026-11-29
#: (night)": 150 calls, 3 of 8 ms under the profiler), then their views and schedule object (the evening's CPU
#: profile). The buffers' contents are undefined either way: every field a kernel reads is rewritten by the plan's
#: schedule. At most 2 sets per key and 256 MiB in all.
_POOL = ReusePool(keep=2, max_bytes=256 << 20, size=lambda pooled: pooled.nbytes)


class SplitKVPlan:
    """The buffers of one step's split-KV plan (see the module docstring), filled for ``cache_seqlens``.

    Attributes
    ----------
    layout : SplitKVLayout
    schedule : SplitKVSchedule
        Its tensors are views of the plan's buffers; refreshed in place by :meth:`update`.
    first_slot : Tensor
        int32 ``[batch]``: :func:`.combine.first_slots` of the schedule.
    lengths : Tensor
        int32 ``[batch]``: the lengths the schedule was made for (a copy of ``cache_seqlens`` as of the last
        :meth:`update`; ``fixed_length`` everywhere for a sparse plan). Kernels read these, never the caller's
        tensor.
    partial_out, partial_lse : Tensor
        ``[max_slots, *partial_row]`` of ``partial_dtype``, and fp32 ``[max_slots, *partial_row[:-1]]``: the
        workspace (contents undefined between runs).
    workspace : Tensor
        int32 scratch of the schedule launch.

    Parameters
    ----------
    layout : SplitKVLayout
    cache_seqlens : Tensor or None
        int32 ``[batch]`` on ``device`` (None or ignored when ``layout.fixed_length`` is set).
    device : torch.device
    native : NativeSchedule, optional
        The backend's own schedule launch (used on CUDA devices for balanced schedules).

    Raises
    ------
    ValueError
        ``cache_seqlens`` is not int32 ``[batch]`` (or is missing), or the layout's parameters are out of range.
    """

    __slots__ = ("layout", "schedule", "first_slot", "lengths", "partial_out", "partial_lse", "workspace",
                 "_refresh", "_pool_key", "_pooled")

    def __init__(self, layout: SplitKVLayout, cache_seqlens: torch.Tensor | None, device: torch.device, *,
                 native: NativeSchedule | None = None) -> None:
        lay = self.layout = layout
        self._pool_key = None
        if cache_seqlens is not None and device.index is None:
            device = cache_seqlens.device  # (the pool's key names the device by its index)
        key = _pool_key(lay, device)
        pooled = None if key is None else _POOL.take(key)
        if pooled is None:
            pooled = _Pooled(lay, device)
        self._pooled = pooled
        self._pool_key = key  # set once the buffers are the plan's: __del__ gives them back
        _, self.partial_out, self.partial_lse = pooled.buffers
        items, self.workspace, part_offsets, num_splits, slot_req, self.first_slot, self.lengths = pooled.views
        if pooled.layout is not lay and pooled.layout != lay:  # (frozen: equal layouts, equal schedules)
            pooled.schedule = SplitKVSchedule(items=items, part_offsets=part_offsets, num_splits=num_splits,
                                              slot_req=slot_req, chunk_size=lay.chunk_size, num_parts=lay.num_parts,
                                              overhead=lay.overhead, capacity=lay.capacity,
                                              split_tokens=lay.split_tokens, workspace=self.workspace)
            pooled.layout = lay
            pooled.bound = {}
        self.schedule = pooled.schedule
        if lay.fixed_length is not None:  # sparse: the schedule of topk positions per request, made once
            self.lengths.fill_(lay.fixed_length)
            self._refresh = None
            self._refresh_with(self._torch_or_triton(self.lengths, native))(self, self.lengths)
            return
        if cache_seqlens is None:
            raise ValueError("cache_seqlens is required for a dense split-KV plan (int32 [batch])")
        if (cache_seqlens.dtype != torch.int32 or cache_seqlens.shape != (lay.batch,)
                or cache_seqlens.device != self.lengths.device):
            raise ValueError(f"cache_seqlens must be int32 [{lay.batch}] on {self.lengths.device}, got "
                             f"{cache_seqlens.dtype} {list(cache_seqlens.shape)} on {cache_seqlens.device}")
        self._refresh = self._refresh_with(self._torch_or_triton(cache_seqlens, native))
        self._refresh(self, cache_seqlens)

    def __del__(self) -> None:
        key = getattr(self, "_pool_key", None)
        if key is not None:
            try:
                _POOL.give(key, self._pooled)
            except Exception:  # interpreter shutdown: the pool may be gone already
                pass

    @property
    def _buffers(self) -> tuple:
        """The plan's three buffers (int32, partial rows, partial LSE)."""
        return self._pooled.buffers

    def update(self, cache_seqlens: torch.Tensor) -> None:
        """Recompute the schedule, first slots and lengths in place for the values ``cache_seqlens`` holds now
        (int32 ``[batch]``, the tensor the plan was made with or one of the same shape); a sparse plan's does
        nothing. No allocation on a GPU, no host synchronisation."""
        if self._refresh is not None:
            self._refresh(self, cache_seqlens)

    # -- how the schedule is computed, chosen once ----------------------------------------------------------

    def _torch_or_triton(self, cache_seqlens: torch.Tensor, native: NativeSchedule | None) -> str | NativeSchedule:
        lay = self.layout
        if lay.split_tokens is not None or not cache_seqlens.is_cuda or not 1 <= lay.batch <= TRITON_SCHEDULE_MAX_BATCH:
            return "torch"
        if native is not None:
            return native
        try:
            import triton  # noqa: F401
        except ImportError:
            return "torch"
        return "triton"

    def _refresh_with(self, how: str | NativeSchedule) -> Callable[["SplitKVPlan", torch.Tensor], None]:
        """``fn(plan, cache_seqlens)``, kept as ``self._refresh``: it takes the plan as an argument and holds no
        reference to it, so a dropped plan is freed (and its buffers pooled) at once, not by the cycle collector."""
        if how == "torch":
            return SplitKVPlan._refresh_torch
        if how == "triton":
            return self._triton_refresh()
        bind = getattr(how, "bind", None)
        if bind is None:
            return lambda plan, cache_seqlens: how(cache_seqlens, plan)
        # bound to the buffers once: kept with them in the pool, for the next plan of this layout on them
        bound = self._pooled.bound
        run = bound.get(how)
        if run is None:
            if len(bound) >= 4:  # (natives of unloaded extensions: at most a few per process)
                bound.clear()
            run = bound[how] = bind(self)
        return lambda plan, cache_seqlens: run(cache_seqlens)

    def _triton_refresh(self) -> Callable[["SplitKVPlan", torch.Tensor], None]:
        """One kept launch of the Triton schedule, which also writes first_slot and the lengths' copy; a call with
        another lengths tensor than the one it was made for rebuilds it (checks and all) once."""
        from mla_dispatch.metadata.schedule_triton import schedule_launch

        s, lay = self.schedule, self.layout
        workspace, first_slot, lengths = self.workspace, self.first_slot, self.lengths
        made: dict[int, object] = {}

        def refresh(plan: "SplitKVPlan", cache_seqlens: torch.Tensor) -> None:
            launch = made.get(id(cache_seqlens))
            if launch is None or launch[0] is not cache_seqlens:
                launch = made[id(cache_seqlens)] = (cache_seqlens, schedule_launch(
                    cache_seqlens, s.items, s.part_offsets, s.num_splits, s.slot_req, workspace,
                    num_parts=lay.num_parts, chunk_size=lay.chunk_size, overhead=lay.overhead,
                    capacity=lay.capacity, first_slot=first_slot, lengths_out=lengths))
                while len(made) > 2:  # the plan's own tensor and one other at most
                    made.pop(next(iter(made)))
            launch[1]()

        return refresh

    def _refresh_torch(self, cache_seqlens: torch.Tensor) -> None:
        lay, s = self.layout, self.schedule
        if lay.split_tokens is not None:
            fresh = fixed_split_schedule(cache_seqlens, num_parts=lay.num_parts, chunk_size=lay.chunk_size,
                                         split_tokens=lay.split_tokens, overhead=lay.overhead, capacity=lay.capacity)
        else:
            fresh = split_kv_schedule(cache_seqlens, num_parts=lay.num_parts, chunk_size=lay.chunk_size,
                                      overhead=lay.overhead, capacity=lay.capacity, impl="torch")
        for name in ("items", "part_offsets", "num_splits", "slot_req"):
            getattr(s, name).copy_(getattr(fresh, name))
        first_slots(s.num_splits, out=self.first_slot)
        if cache_seqlens is not self.lengths:
            self.lengths.copy_(cache_seqlens)
