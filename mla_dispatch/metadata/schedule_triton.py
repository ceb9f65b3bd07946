"""The split-KV schedule in one Triton launch.

Same contract, bit for bit, as the torch reference
:func:`mla_dispatch.metadata.schedule.split_kv_schedule` (read its module docstring for
the item format).  The idea of laying requests end to end on a cost axis and
cutting it into equal parts is FlashMLA's ``get_mla_metadata`` (csrc); the
torch reference builds the cut list with ~30 small ops (a sort, searchsorteds,
scatters).  Here every position on the cost axis is known in closed form, so
one program of one CTA computes the whole schedule:

1. **Cost axis.**  ``cost[b] = ceil(clamp(L_b, 0, capacity) / chunk) + overhead``;
   ``end = cumsum(cost)``, ``start = end - cost``, ``total = end[B-1]``.  The part
   boundaries are ``T_k = k * pp`` (``k = 1 .. P-1``, ``pp = ceil(total / P)``).
2. **Cuts in merged order.**  The reference sorts the ``B`` request starts
   together with the ``P - 1`` boundaries; each cut opens the interval up to
   the next distinct cut.  Request start ``b`` sits at merged position
   ``b + clamp(ceil(start_b / pp) - 1, 0, P-1)`` (before a boundary of equal
   value); boundary ``k`` lies inside request ``r = searchsorted(end, T_k,
   right=True)`` (a binary search by gathers) and sits at ``k - 1 + min(r + 1,
   B)``.  A boundary equal to a request start, or at/after ``total``, opens an
   empty interval, so it never yields an item (in the reference the tied pair
   yields one item from either cut; the start represents it here).
3. **Items.**  A request start's interval ends at ``min(end_b, next boundary)``;
   a boundary's at ``min(end_r, T_k + pp)``.  Token ranges, the validity rule
   (tokens, or the owner of a zero-length request) and the part index follow
   the reference.  Validity flags are written at the merged positions, and an
   exclusive prefix sum over them gives each item its compacted row.
4. **Splits and slots.**  Request ``b``'s cuts occupy merged positions
   ``[pos_b, pos_{b+1})``, so its first item and item count are two gathers of
   that prefix sum; slots are a prefix sum over split requests.  Part ``p``
   starts at the prefix sum just before boundary ``p`` (before the start it may
   tie with).

Phases that read what another lane wrote go through a global workspace and a
``tl.debug_barrier()`` (one CTA, so the barrier orders them).  Cost-axis values
are int64 (``B * ceil(L / chunk)`` can pass 2**31); rows, positions and counts
are int32 (below ``2 * (B + P)``).  Meant for ``B`` up to a few thousand: every
phase holds one ``next_power_of_2`` tile in registers (4 warps up to 2048 merged
cuts, 8 up to 4096, 16 above; compiled for sm_90 it spills a little from 4096
requests on), and the caller falls back to torch above :data:`MAX_BATCH`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_dispatch.metadata.workspace import workspace_numel
from mla_dispatch.metadata.triton_launch import CachedLaunch

__all__ = ["MAX_BATCH", "workspace_numel", "split_kv_schedule_into", "schedule_launch"]

#: Largest batch one program handles; mla_dispatch.metadata.schedule uses torch above it.
MAX_BATCH = 8192
_INT32_MAX = 2**31 - 1  # "no capacity": lengths are int32


@triton.jit
def _cdiv(a, b):
    return (a + b - 1) // b


@triton.jit
def _count_le(Sorted, n, x, mask, STEPS: tl.constexpr):
    """Per lane, ``searchsorted(Sorted[:n], x, right=True)`` (number of entries <= x) by binary search."""
    lo = tl.zeros(x.shape, tl.int32)
    hi = tl.zeros(x.shape, tl.int32) + n
    for _ in tl.static_range(STEPS):
        active = mask & (lo < hi)
        mid = (lo + hi) // 2
        v = tl.load(Sorted + mid, mask=active, other=0)
        go_right = v <= x
        lo = tl.where(active & go_right, mid + 1, lo)
        hi = tl.where(active & ~go_right, mid, hi)
    return lo


@triton.jit
def split_kv_schedule_kernel(
    SeqLens, Items, PartOffsets, NumSplits, SlotReq, FirstSlot, LensOut,
    WsEnd, WsFlag, WsExcl, WsSlotBase,
    batch, num_parts, chunk_size, overhead, capacity,
    stride_seq, stride_item_row, stride_item_col,
    BLOCK_B: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    WRITE_FIRST_SLOT: tl.constexpr = False, WRITE_LENGTHS: tl.constexpr = False,
):
    tl.static_assert(BLOCK_M >= BLOCK_B)
    n_rows = batch + num_parts  # rows of items and slot_req; merged cuts are n_rows - 1

    # -- phase 1: the cost axis; request starts as cuts ---------------------------------
    b = tl.arange(0, BLOCK_B)
    in_b = b < batch
    raw_len = tl.load(SeqLens + b.to(tl.int64) * stride_seq, mask=in_b, other=0)
    if WRITE_LENGTHS:  # the plan's copy of the lengths, as given (the kernels count the causal cut from them)
        tl.store(LensOut + b, raw_len, mask=in_b)
    seqlen = raw_len.to(tl.int64)
    seqlen = tl.minimum(tl.maximum(seqlen, 0), capacity)  # the tokens the request's table row can address
    n_chunks = _cdiv(seqlen, chunk_size)
    cost = tl.where(in_b, n_chunks + overhead, 0)
    end = tl.cumsum(cost, 0)
    start = end - cost
    total = tl.sum(cost, 0)
    per_part = _cdiv(total, num_parts)
    tl.store(WsEnd + b, end, mask=in_b)

    # the interval a request start opens ends at its request's end or the next boundary
    start_next = tl.minimum(end, (start // per_part + 1) * per_part)
    start_tok_end = tl.minimum(tl.maximum(start_next - start - overhead, 0) * chunk_size, seqlen)
    start_valid = in_b & ((start_tok_end > 0) | (n_chunks == 0))
    start_pos = b + tl.minimum(tl.maximum(_cdiv(start, per_part) - 1, 0), num_parts - 1).to(tl.int32)
    # the start of request b + 1 (or, for the last request, the first boundary at total)
    next_pos = b + 1 + tl.minimum(tl.maximum(_cdiv(end, per_part) - 1, 0), num_parts - 1).to(tl.int32)
    tl.store(WsFlag + start_pos, start_valid.to(tl.int32), mask=in_b)
    tl.debug_barrier()  # WsEnd is read below

    # -- phase 2: part boundaries T_p as cuts (lanes p = 0 .. P; boundaries are 1 .. P-1) -
    p = tl.arange(0, BLOCK_P)
    is_bound = (p >= 1) & (p < num_parts)
    bound = p.to(tl.int64) * per_part
    on_axis = is_bound & (bound < total)
    req = _count_le(WsEnd, batch, bound, is_bound, SEARCH_STEPS)
    req_c = tl.minimum(req, batch - 1)
    r_end = tl.load(WsEnd + req_c, mask=is_bound, other=0)
    r_len = tl.load(SeqLens + req_c.to(tl.int64) * stride_seq, mask=is_bound, other=0).to(tl.int64)
    r_len = tl.minimum(tl.maximum(r_len, 0), capacity)
    r_start = r_end - (_cdiv(r_len, chunk_size) + overhead)
    at_start = on_axis & (r_start == bound)
    r_next = tl.minimum(r_end, bound + per_part)
    r_tok0 = r_start + overhead
    bound_tok_begin = tl.minimum(tl.maximum(bound - r_tok0, 0) * chunk_size, r_len)
    bound_tok_end = tl.minimum(tl.maximum(r_next - r_tok0, 0) * chunk_size, r_len)
    bound_valid = on_axis & ~at_start & (bound_tok_end > bound_tok_begin)
    bound_pos = p - 1 + tl.minimum(req + 1, batch)
    tl.store(WsFlag + bound_pos, bound_valid.to(tl.int32), mask=is_bound)
    tl.debug_barrier()  # every flag is written

    # -- phase 3: compaction, an exclusive prefix sum over the merged cuts ---------------
    m = tl.arange(0, BLOCK_M)
    flag = tl.load(WsFlag + m, mask=m < n_rows - 1, other=0)
    excl = tl.cumsum(flag, 0) - flag  # excl[n_rows - 1] = number of items
    n_items = tl.sum(flag, 0)
    tl.store(WsExcl + m, excl, mask=m < n_rows)
    tl.debug_barrier()

    # -- phase 4: splits and slots per request; request-start items; padding rows --------
    first_item = tl.load(WsExcl + start_pos, mask=in_b, other=0)
    splits = tl.load(WsExcl + next_pos, mask=in_b, other=0) - first_item
    tl.store(NumSplits + b, splits, mask=in_b)
    is_split = in_b & (splits > 1)
    slots = tl.where(is_split, splits, 0)
    first_slot = tl.cumsum(slots, 0) - slots
    n_slots = tl.sum(slots, 0)
    if WRITE_FIRST_SLOT:  # metadata.combine.first_slots: the combines find a request's partial rows from it
        tl.store(FirstSlot + b, first_slot, mask=in_b)
    tl.store(WsSlotBase + b, first_slot - first_item, mask=in_b)

    start_slot = tl.where(is_split, first_slot, -1)
    row = Items + first_item.to(tl.int64) * stride_item_row
    tl.store(row, b, mask=start_valid)
    tl.store(row + stride_item_col, tl.zeros_like(b), mask=start_valid)
    tl.store(row + 2 * stride_item_col, start_tok_end.to(tl.int32), mask=start_valid)
    tl.store(row + 3 * stride_item_col, start_slot, mask=start_valid)
    tl.store(SlotReq + first_slot, b, mask=start_valid & is_split)

    pad = (m >= n_items) & (m < n_rows)
    row = Items + m.to(tl.int64) * stride_item_row
    tl.store(row, tl.full([BLOCK_M], -1, tl.int32), mask=pad)
    tl.store(row + stride_item_col, tl.zeros([BLOCK_M], tl.int32), mask=pad)
    tl.store(row + 2 * stride_item_col, tl.zeros([BLOCK_M], tl.int32), mask=pad)
    tl.store(row + 3 * stride_item_col, tl.full([BLOCK_M], -1, tl.int32), mask=pad)
    tl.store(SlotReq + m, tl.full([BLOCK_M], -1, tl.int32), mask=(m >= n_slots) & (m < n_rows))

    # part p starts after every cut below T_p: before boundary p and before a start it ties with
    part_q = tl.where(p == 0, 0, tl.where(is_bound, bound_pos - at_start.to(tl.int32), n_rows - 1))
    tl.store(PartOffsets + p, tl.load(WsExcl + part_q, mask=p <= num_parts, other=0), mask=p <= num_parts)
    tl.debug_barrier()  # NumSplits and WsSlotBase are read below

    # -- phase 5: boundary items ----------------------------------------------------------
    bound_row = tl.load(WsExcl + bound_pos, mask=bound_valid, other=0)
    r_splits = tl.load(NumSplits + req_c, mask=bound_valid, other=0)
    bound_slot = tl.where(r_splits > 1, bound_row + tl.load(WsSlotBase + req_c, mask=bound_valid, other=0), -1)
    row = Items + bound_row.to(tl.int64) * stride_item_row
    tl.store(row, req_c, mask=bound_valid)
    tl.store(row + stride_item_col, bound_tok_begin.to(tl.int32), mask=bound_valid)
    tl.store(row + 2 * stride_item_col, bound_tok_end.to(tl.int32), mask=bound_valid)
    tl.store(row + 3 * stride_item_col, bound_slot, mask=bound_valid)
    tl.store(SlotReq + bound_slot, req_c, mask=bound_valid & (r_splits > 1))


def split_kv_schedule_into(
    cache_seqlens: torch.Tensor,
    items: torch.Tensor,
    part_offsets: torch.Tensor,
    num_splits: torch.Tensor,
    slot_req: torch.Tensor,
    workspace: torch.Tensor,
    *,
    num_parts: int,
    chunk_size: int,
    overhead: int,
    capacity: int | None = None,
    first_slot: torch.Tensor | None = None,
    lengths_out: torch.Tensor | None = None,
) -> None:
    """Write the split-KV schedule of ``cache_seqlens`` into preallocated buffers (one launch, no host sync).

    Parameters
    ----------
    cache_seqlens : Tensor
        int32 ``[B]``, ``1 <= B <= MAX_BATCH`` (negative lengths count as 0, lengths past ``capacity`` as
        ``capacity``).
    items, part_offsets, num_splits, slot_req : Tensor
        int32 ``[B + P, 4]``, ``[P + 1]``, ``[B]``, ``[B + P]`` on the same device
        (the 1-D ones contiguous); every element is overwritten.
    workspace : Tensor
        int32 ``[workspace_numel(B, P)]`` (or larger), contiguous; contents are scratch.
    num_parts, chunk_size, overhead : int
        As in :func:`mla_dispatch.metadata.schedule.split_kv_schedule` (all >= 1).
    capacity : int, optional
        As there: ``max_blocks * page_size``, or None (no bound).
    first_slot : Tensor, optional
        int32 ``[B]``, contiguous: also written, :func:`mla_dispatch.metadata.combine.first_slots` of the schedule.
    lengths_out : Tensor, optional
        int32 ``[B]``, contiguous: also written, a copy of ``cache_seqlens`` (a plan's own lengths).

    Raises
    ------
    ValueError
        A buffer has the wrong shape, dtype or layout, or ``B`` is out of range.
    """
    schedule_launch(cache_seqlens, items, part_offsets, num_splits, slot_req, workspace, num_parts=num_parts,
                    chunk_size=chunk_size, overhead=overhead, capacity=capacity, first_slot=first_slot,
                    lengths_out=lengths_out).slow()


def schedule_launch(
    cache_seqlens: torch.Tensor,
    items: torch.Tensor,
    part_offsets: torch.Tensor,
    num_splits: torch.Tensor,
    slot_req: torch.Tensor,
    workspace: torch.Tensor,
    *,
    num_parts: int,
    chunk_size: int,
    overhead: int,
    capacity: int | None = None,
    first_slot: torch.Tensor | None = None,
    lengths_out: torch.Tensor | None = None,
) -> CachedLaunch:
    """The launch of :func:`split_kv_schedule_into` with these buffers, checked once and kept: calling it (no
    arguments) recomputes the schedule of the values ``cache_seqlens`` holds then (a plan's update), one launch
    through :class:`~mla_dispatch.metadata.triton_launch.CachedLaunch`. Arguments and errors as
    :func:`split_kv_schedule_into`."""
    batch = cache_seqlens.shape[0]
    if not 1 <= batch <= MAX_BATCH:
        raise ValueError(f"batch must be in [1, {MAX_BATCH}] for the triton schedule, got {batch}")
    n_rows = batch + num_parts
    expected = {"items": (items, (n_rows, 4)), "part_offsets": (part_offsets, (num_parts + 1,)),
                "num_splits": (num_splits, (batch,)), "slot_req": (slot_req, (n_rows,)),
                "first_slot": (first_slot, (batch,)), "lengths_out": (lengths_out, (batch,))}
    for name, (t, shape) in expected.items():
        if t is None:
            continue
        if tuple(t.shape) != shape or t.dtype != torch.int32 or t.device != cache_seqlens.device:
            raise ValueError(f"{name} must be int32 {list(shape)} on {cache_seqlens.device}, "
                             f"got {t.dtype} {list(t.shape)} on {t.device}")
        if t.dim() == 1 and t.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous")
    need = workspace_numel(batch, num_parts)
    if workspace.dtype != torch.int32 or not workspace.is_contiguous() or workspace.numel() < need:
        raise ValueError(f"workspace must be a contiguous int32 tensor of >= {need} elements, "
                         f"got {workspace.dtype} {list(workspace.shape)}")

    ws_end = workspace[: 2 * batch].view(torch.int64)
    ws_flag = workspace[2 * batch: 3 * batch + num_parts]
    ws_excl = workspace[3 * batch + num_parts: 4 * batch + 2 * num_parts]
    ws_slot_base = workspace[4 * batch + 2 * num_parts: need]

    block_b = triton.next_power_of_2(batch)
    block_p = triton.next_power_of_2(num_parts + 1)
    block_m = triton.next_power_of_2(n_rows)
    args = dict(
        SeqLens=cache_seqlens, Items=items, PartOffsets=part_offsets, NumSplits=num_splits, SlotReq=slot_req,
        FirstSlot=num_splits if first_slot is None else first_slot,  # (unused pointers stand in when not written)
        LensOut=num_splits if lengths_out is None else lengths_out,
        WsEnd=ws_end, WsFlag=ws_flag, WsExcl=ws_excl, WsSlotBase=ws_slot_base,
        batch=batch, num_parts=num_parts, chunk_size=chunk_size, overhead=overhead,
        capacity=_INT32_MAX if capacity is None else min(capacity, _INT32_MAX),
        stride_seq=cache_seqlens.stride(0), stride_item_row=items.stride(0), stride_item_col=items.stride(1),
        BLOCK_B=block_b, BLOCK_P=block_p, BLOCK_M=block_m, SEARCH_STEPS=block_b.bit_length(),
        WRITE_FIRST_SLOT=first_slot is not None, WRITE_LENGTHS=lengths_out is not None,
    )
    # Triton launches on the current device, not the tensors' (the launch guards it: kernels/triton/device.py)
    device = cache_seqlens.device.index if cache_seqlens.is_cuda else None
    if cache_seqlens.is_cuda and device is None:
        device = torch.cuda.current_device()
    return CachedLaunch(split_kv_schedule_kernel, (1,), args, (), {"num_warps": _num_warps(block_m)}, device)


def _num_warps(block_m: int) -> int:
    # AOT sm_90 compile: no spills up to BLOCK_M=4096 at 8 warps; above, 16 warps keep the spill small
    return 4 if block_m <= 2048 else 8 if block_m <= 4096 else 16
