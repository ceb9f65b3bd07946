"""The split-KV work partition shared by every backend (the combine of its partial results is in
:mod:`mla_dispatch.metadata.combine`).

The split-KV schedule
---------------------
Decode attention has little parallelism per request (one to a few query tokens)
and very uneven work across requests (cache lengths vary by orders of
magnitude).  Like FlashMLA's tile scheduler (``csrc/sm90/decode/...``
``get_mla_metadata``) we lay the requests end to end on one "cost axis", give
every request ``ceil(L_b / chunk) + overhead`` cost units, and cut that axis
into ``num_parts`` equal pieces, one per persistent CTA.  A request that a cut
falls inside is split; its pieces are merged afterwards by
:func:`mla_dispatch.metadata.combine.combine_splits`.

The schedule is a flat list of *work items*.  Each item is one (request, token
range) pair::

    items[i] = (req, token_begin, token_end, slot)

- ``req``: request index, or -1 for the padding rows at the end.
- ``[token_begin, token_end)``: the KV tokens of ``req`` this item covers; the
  range is aligned to ``chunk_size`` (except at the request's end).
- ``slot``: -1 when the item covers the whole request — the kernel writes the
  final ``out``/``lse`` directly; otherwise the row of the partial buffers
  (``partial_out[slot]``, ``partial_lse[slot]``) the kernel writes, to be merged
  by the combine.

Items of part ``p`` are ``items[part_offsets[p] : part_offsets[p + 1]]``, in
increasing request order.  Every request has at least one item: a zero-length
request has exactly one, with an empty token range, whose kernel writes
``out = 0`` and ``lse = +inf``.

A batch-invariant schedule (:func:`fixed_split_schedule`) cuts every request at multiples of a fixed
token count instead, so a request's pieces depend on its own length only; its shapes depend on
``(batch, capacity, split_tokens)``.

Everything is computed with tensor operations on the device holding
``cache_seqlens``: no host synchronisation, and every shape depends only on
``(batch, num_parts)``, so the computation can run inside a CUDA graph (or
before it, into the same buffers, with :meth:`SplitKVSchedule.update_`).
On a CUDA/ROCm device the same schedule, bit for bit, comes from one Triton
launch (``metadata/schedule_triton.py``); the tensor-op code here stays the
reference and the CPU path (``impl=`` of :func:`split_kv_schedule`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import torch

from mla_dispatch.metadata.workspace import workspace_numel  # (split_plan and tests import it from here too)

__all__ = ["SplitKVSchedule", "split_kv_schedule", "fixed_split_schedule", "default_num_parts",
           "BATCH_INVARIANT_SPLIT_TOKENS", "SPLIT_TOKENS_CHOICES", "check_invariant_workspace", "ITEM_REQ", "ITEM_BEGIN", "ITEM_END", "ITEM_SLOT"]

ITEM_REQ, ITEM_BEGIN, ITEM_END, ITEM_SLOT = range(4)

#: Largest batch the one-launch Triton schedule takes (``metadata/schedule_triton.py``); torch above it.
TRITON_SCHEDULE_MAX_BATCH = 8192
SCHEDULE_IMPLS = ("auto", "torch", "triton")
#: Tokens per piece of a batch-invariant schedule (:func:`fixed_split_schedule`) unless a backend option says
#: otherwise. benchmarks/RESULTS.md ("Batch-invariant decode") has what it costs against the default schedule.
BATCH_INVARIANT_SPLIT_TOKENS = 1024
#: The piece sizes backends accept as ``backend_options={"split_tokens": ...}`` (for experiments).
SPLIT_TOKENS_CHOICES = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)
#: Largest partial-result workspace a batch-invariant plan may allocate: it holds one row per possible piece,
#: ``batch * ceil(capacity / split_tokens)`` of them (a long table and a large batch reach many GiB).
BATCH_INVARIANT_MAX_WORKSPACE_BYTES = 4 << 30


def check_invariant_workspace(batch: int, capacity: int, split_tokens: int, bytes_per_piece: int) -> None:
    """Refuse a batch-invariant plan whose partial-result workspace, ``bytes_per_piece`` for each of the
    ``batch * max(1, ceil(capacity / split_tokens))`` pieces it can hold, would exceed
    :data:`BATCH_INVARIANT_MAX_WORKSPACE_BYTES`.

    Raises
    ------
    ValueError
        Naming the workspace, its cause and the ``split_tokens`` that would fit.
    """
    def nbytes(split: int) -> int:
        return batch * max(1, -(-capacity // split)) * bytes_per_piece

    if nbytes(split_tokens) <= BATCH_INVARIANT_MAX_WORKSPACE_BYTES:
        return
    fits = next((s for s in SPLIT_TOKENS_CHOICES if nbytes(s) <= BATCH_INVARIANT_MAX_WORKSPACE_BYTES), None)
    hint = (f"pass backend_options={{'split_tokens': {fits}}} or more" if fits is not None
            else "use a smaller batch or a narrower block table")
    raise ValueError(
        f"batch_invariant=True: the partial-result workspace for batch={batch} and a block table of {capacity} "
        f"tokens in pieces of split_tokens={split_tokens} would take {nbytes(split_tokens) / 2**30:.1f} GiB (limit "
        f"{BATCH_INVARIANT_MAX_WORKSPACE_BYTES / 2**30:.0f} GiB); {hint}")


@dataclasses.dataclass
class SplitKVSchedule:
    """A split-KV work partition (see the module docstring for the item format).

    Attributes
    ----------
    items : Tensor
        int32 ``[max_items, 4]``: ``(req, token_begin, token_end, slot)``;
        ``max_items = batch + num_parts`` (a fixed-split schedule: ``batch * max(1, ceil(capacity /
        split_tokens))``); unused rows have ``req = -1``.
    part_offsets : Tensor
        int32 ``[num_parts + 1]``: part ``p`` owns ``items[part_offsets[p]:part_offsets[p+1]]``.
    num_splits : Tensor
        int32 ``[batch]``: number of items of each request (1 = not split).
    slot_req : Tensor
        int32 ``[max_slots]``: the request each partial slot belongs to, -1 if unused.
    chunk_size, num_parts, overhead : int
        The parameters the schedule was built with.
    capacity : int or None
        Tokens a request's block-table row can address (``max_blocks * page_size``): longer lengths count as
        this many. None: no bound (sparse schedules, whose "tokens" are top-k positions).
    split_tokens : int or None
        Set for a batch-invariant schedule (:func:`fixed_split_schedule`): every request is cut at multiples of
        this many tokens, whatever the batch around it, and any request may be split anywhere (combines must
        merge per request, not per part boundary). None: the balanced schedule of :func:`split_kv_schedule`.
    workspace : Tensor or None
        int32 scratch of the Triton implementation, owned by the schedule so
        :meth:`update_` allocates nothing (created on the first Triton build or update).
    """

    items: torch.Tensor
    part_offsets: torch.Tensor
    num_splits: torch.Tensor
    slot_req: torch.Tensor
    chunk_size: int
    num_parts: int
    overhead: int
    capacity: int | None = None
    split_tokens: int | None = None
    workspace: torch.Tensor | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def fixed_splits(self) -> bool:
        """True for a batch-invariant schedule (:attr:`split_tokens` set)."""
        return self.split_tokens is not None

    @property
    def batch(self) -> int:
        return self.num_splits.shape[0]

    @property
    def max_items(self) -> int:
        return self.items.shape[0]

    @property
    def max_slots(self) -> int:
        """Static number of partial-result rows a kernel must provide."""
        return self.slot_req.shape[0]

    def update_(self, cache_seqlens: torch.Tensor, *, impl: str = "auto") -> "SplitKVSchedule":
        """Recompute in place for new ``cache_seqlens`` of the same batch size.

        No allocation escapes and no host sync happens, so a CUDA graph that
        reads these buffers stays valid. ``impl`` as in :func:`split_kv_schedule`;
        the Triton path writes straight into the buffers (one launch, no
        allocation once :attr:`workspace` exists).

        Raises
        ------
        ValueError
            ``cache_seqlens`` is not int32 ``[batch]``, or ``impl`` is unknown or cannot run.
        """
        _check_schedule_args(cache_seqlens, self.num_parts, self.chunk_size, self.overhead, self.capacity)
        if cache_seqlens.shape[0] != self.batch:
            raise ValueError(f"cache_seqlens must keep batch={self.batch}, got {cache_seqlens.shape[0]}")
        if self.split_tokens is not None:
            fresh = fixed_split_schedule(cache_seqlens, num_parts=self.num_parts, chunk_size=self.chunk_size,
                                         split_tokens=self.split_tokens, overhead=self.overhead,
                                         capacity=self.capacity)
            for name in ("items", "part_offsets", "num_splits", "slot_req"):
                getattr(self, name).copy_(getattr(fresh, name))
            return self
        if _schedule_impl(impl, cache_seqlens) == "triton":
            _triton_schedule_into(self, cache_seqlens)
            return self
        fresh = split_kv_schedule(
            cache_seqlens, num_parts=self.num_parts, chunk_size=self.chunk_size, overhead=self.overhead,
            capacity=self.capacity, impl="torch"
        )
        for name in ("items", "part_offsets", "num_splits", "slot_req"):
            getattr(self, name).copy_(getattr(fresh, name))
        return self

    def to_list(self) -> list[list[tuple[int, int, int, int]]]:
        """Host-side view for tests and debugging: for each part, its items (syncs)."""
        items = self.items.tolist()
        offs = self.part_offsets.tolist()
        return [[tuple(items[i]) for i in range(offs[p], offs[p + 1])] for p in range(self.num_parts)]


def split_kv_schedule(
    cache_seqlens: torch.Tensor,
    *,
    num_parts: int,
    chunk_size: int = 64,
    overhead: int = 4,
    capacity: int | None = None,
    impl: str = "auto",
) -> SplitKVSchedule:
    """Partition the KV tokens of all requests over ``num_parts`` work units.

    Parameters
    ----------
    cache_seqlens : Tensor
        int32 ``[batch]``, number of cached tokens per request (the number of
        tokens each query attends to before any causal cut). Negative lengths
        count as 0, lengths past ``capacity`` as ``capacity``.
    num_parts : int
        Number of parallel work units (typically the number of CTAs a
        persistent kernel launches). Must be >= 1.
    chunk_size : int
        Split granularity in tokens (a kernel's KV tile); splits fall on
        multiples of it.
    overhead : int
        Fixed cost, in chunks, charged per request (the cost of loading the
        queries and writing the output); FlashMLA uses 5 blocks of 64.
    capacity : int, optional
        Tokens a request's block-table row can address, ``max_blocks * page_size``:
        no item reaches past it, so a kernel following the schedule reads no table
        entry past the row, whatever ``cache_seqlens`` holds. None: no bound.
    impl : str
        ``"torch"``: the tensor-op reference below (~30 small ops, any device).
        ``"triton"``: one launch of ``metadata/schedule_triton.py``, identical
        output; needs ``1 <= batch <= TRITON_SCHEDULE_MAX_BATCH`` and a CUDA/ROCm
        tensor (or ``TRITON_INTERPRET=1`` on a CPU). ``"auto"`` (default):
        Triton for a CUDA/ROCm tensor when triton imports and the batch fits,
        else torch.

    Returns
    -------
    SplitKVSchedule
        On the device of ``cache_seqlens``.

    Raises
    ------
    ValueError
        If ``num_parts``, ``chunk_size`` or ``overhead`` is out of range,
        ``cache_seqlens`` is not a 1-D int32 tensor, ``impl`` is unknown, or
        ``impl="triton"`` cannot run on this input.
    ImportError
        ``impl="triton"`` without an importable triton.
    """
    _check_schedule_args(cache_seqlens, num_parts, chunk_size, overhead, capacity)
    if _schedule_impl(impl, cache_seqlens) == "triton":
        return _triton_schedule(cache_seqlens, num_parts, chunk_size, overhead, capacity)

    device = cache_seqlens.device
    batch = cache_seqlens.shape[0]
    i64 = torch.int64
    seqlens = cache_seqlens.to(i64).clamp(0, capacity)  # capacity None: no upper bound

    # Cost axis: request b occupies [start[b], start[b] + cost[b]); its first
    # `overhead` units are the fixed cost, then one unit per chunk of tokens.
    num_chunks = (seqlens + chunk_size - 1) // chunk_size
    cost = num_chunks + overhead
    end = torch.cumsum(cost, 0)
    start = end - cost
    total = end[-1:] if batch > 0 else torch.zeros(1, dtype=i64, device=device)

    # Cut the axis into num_parts equal pieces: boundaries[p] = p * ceil(total / P).
    per_part = (total + num_parts - 1) // num_parts
    inner_bounds = torch.arange(1, num_parts, device=device, dtype=i64) * per_part
    inner_bounds = torch.minimum(inner_bounds, total)

    # Intervals between consecutive cut points (request starts and part boundaries).
    cuts, _ = torch.sort(torch.cat([start, inner_bounds]))
    nxt = torch.cat([cuts[1:], total])
    req = torch.searchsorted(end, cuts, right=True).clamp_max(max(batch - 1, 0))
    part = torch.searchsorted(inner_bounds, cuts, right=True)

    req_start = start[req] + overhead
    req_len = seqlens[req]
    tok_begin = ((cuts - req_start).clamp_min(0) * chunk_size).minimum(req_len)
    tok_end = ((nxt - req_start).clamp_min(0) * chunk_size).minimum(req_len)

    # An interval is a work item if it has tokens, or if it is the owner (first
    # interval) of a zero-length request.
    nonempty_axis = nxt > cuts
    owner_of_empty = (num_chunks[req] == 0) & (cuts == start[req])
    valid = nonempty_axis & ((tok_end > tok_begin) | owner_of_empty)

    # Compact valid intervals to the front, preserving their order.
    max_items = batch + num_parts
    n_cuts = cuts.shape[0]
    dest = torch.cumsum(valid.to(i64), 0) - 1
    dest = torch.where(valid, dest, torch.full_like(dest, max_items))  # dump row
    rows = torch.stack([req, tok_begin, tok_end], dim=1)
    items = torch.full((max_items + 1, 4), -1, dtype=i64, device=device)
    items[:, 1:3] = 0
    items.index_copy_(0, dest, torch.cat([rows, torch.full((n_cuts, 1), -1, dtype=i64, device=device)], 1))
    item_part = torch.full((max_items + 1,), num_parts, dtype=i64, device=device)
    item_part.index_copy_(0, dest, part)
    items, item_part = items[:max_items], item_part[:max_items]

    # Splits per request and partial slots for split requests.
    item_valid = items[:, ITEM_REQ] >= 0
    item_req = items[:, ITEM_REQ].clamp_min(0)
    num_splits = torch.zeros(batch, dtype=i64, device=device)
    num_splits.index_add_(0, item_req, item_valid.to(i64))
    first_item = torch.cumsum(num_splits, 0) - num_splits
    is_split = num_splits > 1
    slots_per_req = torch.where(is_split, num_splits, torch.zeros_like(num_splits))
    first_slot = torch.cumsum(slots_per_req, 0) - slots_per_req
    rank = torch.arange(max_items, device=device, dtype=i64) - first_item[item_req]
    slot = torch.where(item_valid & is_split[item_req], first_slot[item_req] + rank, torch.full_like(rank, -1))
    items[:, ITEM_SLOT] = slot

    max_slots = max_items
    slot_req = torch.full((max_slots + 1,), -1, dtype=i64, device=device)
    slot_req.index_copy_(0, torch.where(slot >= 0, slot, torch.full_like(slot, max_slots)), item_req)
    slot_req = slot_req[:max_slots]

    part_offsets = torch.searchsorted(item_part, torch.arange(num_parts + 1, device=device, dtype=i64))

    i32 = torch.int32
    return SplitKVSchedule(
        items=items.to(i32).contiguous(),
        part_offsets=part_offsets.to(i32),
        num_splits=num_splits.to(i32),
        slot_req=slot_req.to(i32),
        chunk_size=chunk_size,
        num_parts=num_parts,
        overhead=overhead,
        capacity=capacity,
    )


def fixed_split_schedule(
    cache_seqlens: torch.Tensor,
    *,
    num_parts: int,
    chunk_size: int,
    split_tokens: int = BATCH_INVARIANT_SPLIT_TOKENS,
    overhead: int = 4,
    capacity: int,
) -> SplitKVSchedule:
    """A batch-invariant partition: request ``b`` is cut into ``max(1, ceil(L_b / split_tokens))`` pieces at
    multiples of ``split_tokens``, a function of its own length only.

    A kernel computes each piece from the piece alone, and the combine merges a request's pieces in their order,
    so a request's ``out`` and ``lse`` do not depend on the other requests of the batch or on its place in it
    (the batch-invariance of Thinking Machines' "Defeating Nondeterminism in LLM Inference", 2025, which fixes
    the split size rather than the split count; SGLang's deterministic mode does the same with FlashInfer's
    ``fixed_split_size``). Which part runs a piece changes nothing in the result; the pieces are laid on the
    parts as :func:`split_kv_schedule` lays requests, by cost (chunks plus ``overhead``), in order, never cut.

    Parameters
    ----------
    cache_seqlens : Tensor
        int32 ``[batch]``; negative lengths count as 0, lengths past ``capacity`` as ``capacity``.
    num_parts, chunk_size, overhead : int
        As in :func:`split_kv_schedule`.
    split_tokens : int
        Tokens per piece, a multiple of ``chunk_size``. Small pieces spread a long request over more parts
        (latency at small batch); every piece of a split request writes and the combine reads one partial row
        per query row, so at large batch each piece costs memory traffic.
    capacity : int
        ``max_blocks * page_size`` (required: it bounds the pieces a request can have, so the item count,
        ``batch * max(1, ceil(capacity / split_tokens))``, is static).

    Returns
    -------
    SplitKVSchedule
        With :attr:`~SplitKVSchedule.split_tokens` set (``fixed_splits``). Items of a request are consecutive,
        in token order; unused rows (``req = -1``) come last and belong to no part.

    Raises
    ------
    ValueError
        Arguments out of range (as :func:`split_kv_schedule`), or ``split_tokens`` not a positive multiple of
        ``chunk_size``.
    """
    _check_schedule_args(cache_seqlens, num_parts, chunk_size, overhead, capacity)
    if capacity is None:
        raise ValueError("capacity (max_blocks * page_size) is required for a fixed-split schedule")
    if split_tokens < chunk_size or split_tokens % chunk_size:
        raise ValueError(f"split_tokens must be a positive multiple of chunk_size={chunk_size}, got {split_tokens}")
    device, batch, i64 = cache_seqlens.device, cache_seqlens.shape[0], torch.int64
    max_items = batch * max(1, -(-capacity // split_tokens))
    seqlens = cache_seqlens.to(i64).clamp(0, capacity)
    pieces = ((seqlens + split_tokens - 1) // split_tokens).clamp_min(1)  # a zero-length request keeps one item
    last = torch.cumsum(pieces, 0)  # one past each request's last item
    item = torch.arange(max_items, device=device, dtype=i64)
    valid = item < (last[-1] if batch else 0)
    req = torch.searchsorted(last, item, right=True).clamp_max(max(batch - 1, 0))
    rank = item - (last[req] - pieces[req])
    begin = torch.minimum(rank * split_tokens, seqlens[req])
    end = torch.minimum(begin + split_tokens, seqlens[req])
    is_split = pieces > 1
    first_slot = torch.cumsum(torch.where(is_split, pieces, 0), 0) - torch.where(is_split, pieces, 0)
    slot = torch.where(valid & is_split[req], first_slot[req] + rank, -1)
    items = torch.stack([torch.where(valid, req, -1), torch.where(valid, begin, 0), torch.where(valid, end, 0), slot],
                        dim=1)

    # Parts: piece i starts at cost offset start[i] of the total; part p takes the pieces starting in
    # [p * total / P, (p + 1) * total / P), so parts are runs of consecutive items.
    cost = torch.where(valid, (end - begin + chunk_size - 1) // chunk_size + overhead, 0)
    start = torch.cumsum(cost, 0) - cost
    total = cost.sum().clamp_min(1)
    item_part = torch.where(valid, (start * num_parts // total).clamp_max(num_parts - 1), num_parts)
    part_offsets = torch.searchsorted(item_part, torch.arange(num_parts + 1, device=device, dtype=i64))

    slot_req = torch.full((max_items + 1,), -1, dtype=i64, device=device)
    slot_req.index_copy_(0, torch.where(slot >= 0, slot, max_items), req)
    i32 = torch.int32
    return SplitKVSchedule(
        items=items.to(i32).contiguous(),
        part_offsets=part_offsets.to(i32),
        num_splits=pieces.to(i32),
        slot_req=slot_req[:max_items].to(i32),
        chunk_size=chunk_size,
        num_parts=num_parts,
        overhead=overhead,
        capacity=capacity,
        split_tokens=split_tokens,
    )


def _check_schedule_args(cache_seqlens: torch.Tensor, num_parts: int, chunk_size: int, overhead: int,
                         capacity: int | None = None) -> None:
    if cache_seqlens.dim() != 1 or cache_seqlens.dtype != torch.int32:
        raise ValueError(
            f"cache_seqlens must be a 1-D int32 tensor, got shape {tuple(cache_seqlens.shape)} "
            f"dtype {cache_seqlens.dtype}"
        )
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if overhead < 1:
        raise ValueError(f"overhead must be >= 1 (zero-length requests need an owner), got {overhead}")
    if capacity is not None and capacity < 0:
        raise ValueError(f"capacity (max_blocks * page_size) must be >= 0 or None, got {capacity}")


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _schedule_impl(impl: str, cache_seqlens: torch.Tensor) -> str:
    """Resolve ``impl`` for this input: "torch" or "triton" (raises if an explicit "triton" cannot run)."""
    if impl not in SCHEDULE_IMPLS:
        raise ValueError(f"impl={impl!r} (supported: {', '.join(SCHEDULE_IMPLS)})")
    if impl == "torch":
        return "torch"
    batch = cache_seqlens.shape[0]
    fits = 1 <= batch <= TRITON_SCHEDULE_MAX_BATCH
    on_gpu = cache_seqlens.device.type == "cuda"  # ROCm builds of torch report "cuda" too
    if impl == "auto":
        return "triton" if on_gpu and fits and _triton_importable() else "torch"
    if not fits:
        raise ValueError(f"impl='triton' needs 1 <= batch <= {TRITON_SCHEDULE_MAX_BATCH}, got batch={batch}")
    if not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"impl='triton' needs a CUDA/ROCm tensor (or TRITON_INTERPRET=1), "
                         f"got device {cache_seqlens.device}")
    return "triton"


def _triton_schedule(cache_seqlens: torch.Tensor, num_parts: int, chunk_size: int, overhead: int,
                     capacity: int | None) -> SplitKVSchedule:
    batch, device, i32 = cache_seqlens.shape[0], cache_seqlens.device, torch.int32
    sched = SplitKVSchedule(
        items=torch.empty(batch + num_parts, 4, dtype=i32, device=device),
        part_offsets=torch.empty(num_parts + 1, dtype=i32, device=device),
        num_splits=torch.empty(batch, dtype=i32, device=device),
        slot_req=torch.empty(batch + num_parts, dtype=i32, device=device),
        chunk_size=chunk_size,
        num_parts=num_parts,
        overhead=overhead,
        capacity=capacity,
        workspace=torch.empty(workspace_numel(batch, num_parts), dtype=i32, device=device),
    )
    _triton_schedule_into(sched, cache_seqlens)
    return sched


def _triton_schedule_into(sched: SplitKVSchedule, cache_seqlens: torch.Tensor) -> None:
    from mla_dispatch.metadata.schedule_triton import split_kv_schedule_into

    need = workspace_numel(sched.batch, sched.num_parts)
    ws = sched.workspace
    if ws is None or ws.device != cache_seqlens.device or ws.numel() < need:
        sched.workspace = ws = torch.empty(need, dtype=torch.int32, device=cache_seqlens.device)
    split_kv_schedule_into(cache_seqlens, sched.items, sched.part_offsets, sched.num_splits, sched.slot_req, ws,
                           num_parts=sched.num_parts, chunk_size=sched.chunk_size, overhead=sched.overhead,
                           capacity=sched.capacity)


def default_num_parts(num_compute_units: int, num_heads_kv: int, rows_per_head: int, tile_rows: int = 64) -> int:
    """FlashMLA's heuristic: one part per SM, divided among KV heads and head tiles."""
    tiles = num_heads_kv * math.ceil(rows_per_head / tile_rows)
    return max(num_compute_units // tiles, 1)
