"""The SM90 extension's split-KV schedule launch (``mla_decode_sm90/schedule.cu``) in the terms of a plan's buffers
(:class:`mla_dispatch.metadata.split_plan.SplitKVPlan`): one native launch where the Triton launch would go through
Triton's Python launcher. ``cuda_sm90`` plans always take it; ``triton`` plans take it where the extension is already
loaded in the process and the GPU is the one it was built for (sm_90), never building it (the Triton schedule runs
everywhere else, ROCm included)."""

from __future__ import annotations

from mla_dispatch.metadata.split_plan import NativeSchedule, SplitKVPlan

__all__ = ["native_schedule", "loaded_native_schedule"]


def native_schedule(module) -> NativeSchedule | None:
    """``module``'s (the loaded extension's) schedule launch as :class:`SplitKVPlan` takes it, or None where the module
    has none (a build older than schedule.cu)."""
    fn = getattr(module, "split_kv_schedule", None)
    if fn is None:
        return None

    def native(cache_seqlens, plan: SplitKVPlan) -> None:
        s, lay = plan.schedule, plan.layout
        fn(cache_seqlens, s.items, s.part_offsets, s.num_splits, s.slot_req, plan.first_slot, plan.lengths,
           plan.workspace, lay.chunk_size, lay.overhead, -1 if lay.capacity is None else lay.capacity)

    return native


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
