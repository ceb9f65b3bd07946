"""The LSE-weighted merge of partial attention results: the split-KV schedule's pieces of one request
(:func:`combine_splits`, the reference and CPU path; the GPU backends merge in their own kernels with the same
arithmetic) and the shards of a request's KV cache held by different ranks (:func:`merge_shards`, decode context
parallelism). Both go through one merge (:func:`merge_by_lse`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mla_dispatch.metadata.schedule import SplitKVSchedule

__all__ = ["first_slots", "merge_by_lse", "combine_splits", "merge_shards"]


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


def merge_by_lse(partial_out: torch.Tensor, partial_lse: torch.Tensor, owner: torch.Tensor,
                 num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial results by their log-sum-exps: row ``r`` of the result merges every slot ``s`` with
    ``owner[s] == r``.

    With ``w_s = exp(lse_s - max lse)``: ``out = sum w_s out_s / sum w_s`` and ``lse = max lse + log sum w_s``.
    On the device of the inputs, without host synchronisation.

    Parameters
    ----------
    partial_out : Tensor
        ``[slots, *rest, D_v]``, any floating dtype: each slot's output normalised by its own softmax denominator.
    partial_lse : Tensor
        fp32 ``[slots, *rest]``: each slot's natural-log LSE; ``-inf`` for a slot that saw no key (it weighs zero
        and its ``out`` row is not read, whatever it holds).
    owner : Tensor
        int64 ``[slots]``: the row each slot belongs to, in ``[0, num_rows)``.
    num_rows : int

    Returns
    -------
    (out, lse)
        fp32 ``[num_rows, *rest, D_v]`` and ``[num_rows, *rest]``. A row with no slot that saw a key gets
        ``out = 0`` and ``lse = +inf`` (docs/design.md §1); a row with a NaN partial LSE (a piece that met a bad
        block id) gets NaN in both.
    """
    # Per row maximum LSE over its slots (rows without live slots keep -inf).
    idx = owner.view((-1,) + (1,) * (partial_lse.dim() - 1)).expand_as(partial_lse)
    m = torch.full((num_rows,) + tuple(partial_lse.shape[1:]), float("-inf"), device=partial_lse.device)
    m.scatter_reduce_(0, idx, partial_lse, reduce="amax", include_self=True)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(partial_lse - m_safe[owner])  # 0 for -inf partials, NaN for NaN ones
    denom = torch.zeros_like(m).index_add_(0, owner, w)
    # Rows of slots with zero weight are not read (an empty slot's out may be anything); a NaN weight keeps its NaN.
    contrib = torch.where((w == 0)[..., None], 0.0, partial_out.float() * w[..., None])
    acc = torch.zeros((num_rows,) + tuple(partial_out.shape[1:]), dtype=torch.float32, device=partial_out.device)
    acc.index_add_(0, owner, contrib)

    empty = denom == 0  # NaN (a NaN partial) is not empty: it stays NaN
    merged_out = torch.where(empty[..., None], torch.zeros_like(acc), acc / denom.clamp_min(1e-30)[..., None])
    merged_lse = torch.where(empty, torch.full_like(m, float("inf")), m_safe + torch.log(denom.clamp_min(1e-30)))
    return merged_out, merged_lse


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
    plse = partial_lse.masked_fill(~used[:, None, None], float("-inf"))  # no host-to-device scalar copy
    merged_out, merged_lse = merge_by_lse(partial_out, plse, slot_req.clamp_min(0), batch)

    split = (schedule.num_splits > 1).to(out.device)
    out.copy_(torch.where(split[:, None, None, None], merged_out.to(out.dtype), out))
    lse.copy_(torch.where(split[:, None, None], merged_lse.transpose(1, 2), lse))


def _stacked(name: str, value, dims: int) -> torch.Tensor:
    """``value`` as one tensor of ``dims`` dimensions, shards first (a sequence of shards is stacked)."""
    if isinstance(value, torch.Tensor):
        if value.dim() != dims:
            raise ValueError(f"{name} must be a tensor of {dims} dims (shards first) or a sequence of {dims - 1}-dim "
                             f"tensors, got a tensor of shape {list(value.shape)}")
        return value
    shards = list(value)
    if not shards or not all(isinstance(t, torch.Tensor) for t in shards):
        raise ValueError(f"{name} must be a tensor or a non-empty sequence of tensors, got {value!r:.80}")
    shapes = {tuple(t.shape) for t in shards}
    if len(shapes) != 1 or len(next(iter(shapes))) != dims - 1:
        raise ValueError(f"{name} must be shards of one {dims - 1}-dim shape, got shapes "
                         f"{[list(t.shape) for t in shards]}")
    return torch.stack(shards)


def merge_shards(outs, lses, *, out: torch.Tensor | None = None,
                 lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge decode results computed on disjoint shards of each request's KV cache into the full result.

    Decode context parallelism (DCP) splits every request's cached tokens among ranks (vLLM interleaves them:
    token ``t`` on rank ``t % world_size``); each rank runs :func:`mla_decode` or :meth:`DecodePlan.run` on its
    own tokens (its own cache, block table and local ``cache_seqlens``) with every query head, and the ranks
    gather their ``out`` and ``lse``. This merges them, exactly up to fp32 rounding::

        lse = log sum_n exp(lse_n)        out = sum_n exp(lse_n - lse) * out_n

    The same LSE-weighted merge as the split-KV combine (:func:`merge_by_lse`), with these conventions:

    - A shard that holds none of a request's tokens returns ``lse = +inf`` (docs/design.md §1, FlashMLA's
      convention); ``-inf`` (the log of an empty sum: vLLM's and FlashAttention-3's convention) is read alike. Such
      a shard weighs zero and its ``out`` rows are not read, whatever they hold.
    - A row that no shard saw a key for (``L_b = 0``) gets ``out = 0`` and ``lse = +inf``, as from one rank.
    - A NaN ``lse`` (a shard whose block table had a bad block id, docs/design.md §1) makes that row's ``out`` and
      ``lse`` NaN: a fault on one rank is not hidden (vLLM's merge treats a NaN LSE as an empty shard).
    - ``lse`` is natural-log, what every mla_dispatch backend returns; convert a base-2 LSE (multiply by ln 2) first.
    - Causal multi-token decode (``causal=True`` with ``s_q > 1``) does not shard this way: each rank's causal cut
      would count from its local length, not from the token's global position. Shard ``s_q = 1`` steps and
      non-causal blocks.

    Parameters
    ----------
    outs : Tensor or sequence of Tensor
        ``[N, B, s_q, h_q, D_v]``, or N tensors ``[B, s_q, h_q, D_v]`` (what ``torch.distributed.all_gather``
        fills); any floating dtype (each rank's ``out``, in q's dtype).
    lses : Tensor or sequence of Tensor
        fp32 ``[N, B, h_q, s_q]``, or N tensors ``[B, h_q, s_q]``: each shard's natural-log LSE.
    out : Tensor, optional
        ``[B, s_q, h_q, D_v]``, any floating dtype, on the shards' device: written in place. Default: a new tensor
        in the shards' dtype.
    lse : Tensor, optional
        fp32 ``[B, h_q, s_q]`` on the shards' device: written in place. Default: a new tensor.

    Returns
    -------
    (out, lse)
        ``[B, s_q, h_q, D_v]`` and fp32 ``[B, h_q, s_q]``. On the shards' device, without host synchronisation;
        the sum runs in fp32, in shard order on the CPU (on a GPU with more than two shards its order, and so the
        last bits, may vary between runs).

    Raises
    ------
    ValueError
        ``outs``/``lses`` of inconsistent shapes, shard counts, dtypes or devices; ``out``/``lse`` of the wrong
        shape, dtype or device (the message names the argument and the expected value).
    """
    o = _stacked("outs", outs, 5)
    ls = _stacked("lses", lses, 4)
    n, batch, s_q, h_q, d_v = o.shape
    if not o.is_floating_point():
        raise ValueError(f"outs must be floating point (each shard's out), got {o.dtype}")
    if ls.dtype != torch.float32:
        raise ValueError(f"lses must be float32 (each shard's natural-log lse), got {ls.dtype}")
    if tuple(ls.shape) != (n, batch, h_q, s_q):
        raise ValueError(f"lses must be [{n}, {batch}, {h_q}, {s_q}] to match outs [{n}, {batch}, {s_q}, {h_q}, "
                         f"{d_v}] (shards, B, h_q, s_q), got {list(ls.shape)}")
    if ls.device != o.device:
        raise ValueError(f"lses must be on the device of outs ({o.device}), got {ls.device}")
    if out is not None and (tuple(out.shape) != (batch, s_q, h_q, d_v) or not out.is_floating_point()
                            or out.device != o.device):
        raise ValueError(f"out must be a floating-point [{batch}, {s_q}, {h_q}, {d_v}] tensor on {o.device}, got "
                         f"{list(out.shape)} {out.dtype} on {out.device}")
    if lse is not None and (tuple(lse.shape) != (batch, h_q, s_q) or lse.dtype != torch.float32
                            or lse.device != o.device):
        raise ValueError(f"lse must be float32 [{batch}, {h_q}, {s_q}] on {o.device}, got {list(lse.shape)} "
                         f"{lse.dtype} on {lse.device}")

    # Slot n * B + b holds shard n's row b; both empty-shard conventions become -inf, which weighs zero. vLLM reads
    # +inf so too (vllm/attention/ops/common.py correct_attn_out, triton_merge_attn_states.py), and NaN as empty.
    partial_lse = ls.transpose(2, 3).reshape(n * batch, s_q, h_q)
    partial_lse = partial_lse.masked_fill(torch.isinf(partial_lse), float("-inf"))
    owner = torch.arange(n * batch, device=o.device) % batch
    merged_out, merged_lse = merge_by_lse(o.reshape(n * batch, s_q, h_q, d_v), partial_lse, owner, batch)
    if out is None:
        out = torch.empty((batch, s_q, h_q, d_v), dtype=o.dtype, device=o.device)
    if lse is None:
        lse = torch.empty((batch, h_q, s_q), dtype=torch.float32, device=o.device)
    out.copy_(merged_out)
    lse.copy_(merged_lse.transpose(1, 2))
    return out, lse
