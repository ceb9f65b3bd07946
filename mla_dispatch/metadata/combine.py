"""The LSE-weighted merge of a split-KV schedule's partial results (the reference and CPU path; the GPU backends
merge in their own kernels with the same arithmetic)."""

from __future__ import annotations

import torch

from mla_dispatch.metadata.schedule import SplitKVSchedule

__all__ = ["first_slots", "combine_splits"]


def first_slots(num_splits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """int32 ``[batch]``: the first partial slot of each split request.

    Slots of split requests are consecutive, request after request (see
    :func:`split_kv_schedule`), so this is an exclusive prefix sum of
    ``num_splits`` over split requests; unsplit requests get the running value
    (they use no slot). Combine kernels use it to find a request's partials.
    Written into ``out`` when given (no allocation escapes; CUDA-graph friendly).
    """
    slots = torch.where(num_splits > 1, num_splits, torch.zeros_like(num_splits)).to(torch.int64)
    first = torch.cumsum(slots, 0) - slots
    if out is None:
        return first.to(torch.int32)
    out.copy_(first)
    return out


def combine_splits(
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    schedule: SplitKVSchedule,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """Merge the partial results of split requests into ``out`` and ``lse``, in place.

    Rows of requests that were not split are left untouched (the kernel wrote
    them directly).

    Parameters
    ----------
    partial_out : Tensor
        fp32 ``[max_slots, s_q, h_q, D_v]``: per-slot output normalised by its
        own softmax denominator.
    partial_lse : Tensor
        fp32 ``[max_slots, s_q, h_q]``: per-slot natural-log LSE, ``-inf`` for a
        row that saw no key in its slot.
    schedule : SplitKVSchedule
        The schedule the partials were computed with.
    out : Tensor
        ``[batch, s_q, h_q, D_v]`` in the output dtype.
    lse : Tensor
        fp32 ``[batch, h_q, s_q]``; rows with no visible key get ``+inf`` and
        ``out = 0``; rows with a NaN partial LSE (a piece that met a bad block
        id) get NaN in both.
    """
    batch = out.shape[0]
    slot_req = schedule.slot_req.to(torch.int64)
    used = slot_req >= 0
    req = slot_req.clamp_min(0)
    plse = partial_lse.masked_fill(~used[:, None, None], float("-inf"))  # no host-to-device scalar copy

    # Per request maximum LSE over its slots (requests without slots keep -inf).
    idx = req[:, None, None].expand_as(plse)
    m = torch.full((batch,) + tuple(plse.shape[1:]), float("-inf"), device=plse.device)
    m.scatter_reduce_(0, idx, plse, reduce="amax", include_self=True)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(plse - m_safe[req])  # 0 for -inf partials and unused slots
    denom = torch.zeros_like(m).index_add_(0, req, w)
    acc = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
    acc.index_add_(0, req, torch.nan_to_num(partial_out, nan=0.0) * w[..., None])

    empty = denom == 0  # NaN (a NaN partial) is not empty: it stays NaN
    merged_out = torch.where(empty[..., None], torch.zeros_like(acc), acc / denom.clamp_min(1e-30)[..., None])
    merged_lse = torch.where(empty, torch.full_like(m, float("inf")), m_safe + torch.log(denom.clamp_min(1e-30)))

    split = (schedule.num_splits > 1).to(out.device)
    out.copy_(torch.where(split[:, None, None, None], merged_out.to(out.dtype), out))
    lse.copy_(torch.where(split[:, None, None], merged_lse.transpose(1, 2), lse))
