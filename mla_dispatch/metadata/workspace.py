"""The scratch a one-launch split-KV schedule needs, apart from the schedules themselves.

Its own module so that :mod:`.schedule` (which launches :mod:`.schedule_triton` lazily, and sizes the scratch of a
plan's buffers for :mod:`.split_plan`) and :mod:`.schedule_triton` (which checks the scratch it is given) share it
without importing each other.
"""

from __future__ import annotations

__all__ = ["workspace_numel"]


def workspace_numel(batch: int, num_parts: int) -> int:
    """int32 elements of the scratch a one-launch schedule needs (:func:`.schedule_triton.split_kv_schedule_into`).

    Layout: ``end`` (int64 ``[B]``, as 2B int32), merged-cut flags ``[B + P]``,
    their exclusive prefix sum ``[B + P]``, per-request slot base ``[B]``.
    """
    return 2 * batch + 2 * (batch + num_parts) + batch
