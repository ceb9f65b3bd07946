"""The split-KV plan both in-house backends use (metadata/split_plan.py): its buffers hold the schedule of the
lengths it was made or last updated for, the first slots of that schedule and a copy of those lengths, whatever
the caller's tensor holds since; update refreshes them in place.

CPU: the torch path. GPU (``gpu``): the Triton launch, and the cuda_sm90 extension's where it is built, against the
torch path, with no host synchronisation in update.
"""

from __future__ import annotations

import pytest
import torch

from mla_dispatch.metadata.combine import first_slots
from mla_dispatch.metadata.schedule import fixed_split_schedule, split_kv_schedule
from mla_dispatch.metadata.split_plan import SplitKVLayout, SplitKVPlan

OUTPUTS = ("items", "part_offsets", "num_splits", "slot_req")


def layout(batch, num_parts=7, chunk=16, overhead=2, capacity=640, **kw) -> SplitKVLayout:
    return SplitKVLayout(batch=batch, num_parts=num_parts, chunk_size=chunk, overhead=overhead, capacity=capacity,
                         partial_row=(2, 3, 8), partial_dtype=torch.float16, **kw)


def lengths(gen, batch, device="cpu", high=700) -> torch.Tensor:
    lens = torch.randint(-3, high, (batch,), generator=gen, dtype=torch.int32)
    lens[torch.randint(0, batch, (max(1, batch // 4),), generator=gen)] = 0
    return lens.to(device)


def expected(lay: SplitKVLayout, lens: torch.Tensor):
    kw = dict(num_parts=lay.num_parts, chunk_size=lay.chunk_size, overhead=lay.overhead, capacity=lay.capacity)
    if lay.split_tokens is not None:
        return fixed_split_schedule(lens, split_tokens=lay.split_tokens, **kw)
    return split_kv_schedule(lens, impl="torch", **kw)


def mismatches(plan: SplitKVPlan, lens: torch.Tensor) -> list[str]:
    want = expected(plan.layout, lens)
    bad = [name for name in OUTPUTS if not torch.equal(getattr(plan.schedule, name).cpu(), getattr(want, name).cpu())]
    if not torch.equal(plan.first_slot.cpu(), first_slots(want.num_splits).cpu()):
        bad.append("first_slot")
    if not torch.equal(plan.lengths.cpu(), lens.cpu()):
        bad.append("lengths")
    return bad


def buffer_ptrs(plan: SplitKVPlan) -> list[int]:
    return [getattr(plan.schedule, n).data_ptr() for n in OUTPUTS] + [
        t.data_ptr() for t in (plan.first_slot, plan.lengths, plan.partial_out, plan.partial_lse, plan.workspace)]


@pytest.mark.parametrize("lay", [layout(5), layout(33, num_parts=132, chunk=64, overhead=5, capacity=512),
                                 layout(9, split_tokens=128)], ids=["b5-p7", "b33-p132", "invariant-b9"])
def test_plan_holds_the_lengths_it_was_made_for_until_update(lay, gen):
    lens = lengths(gen, lay.batch)
    plan = SplitKVPlan(lay, lens, lens.device)
    assert mismatches(plan, lens) == []
    assert plan.partial_out.shape == (lay.max_slots, 2, 3, 8) and plan.partial_out.dtype == torch.float16
    assert plan.partial_lse.shape == (lay.max_slots, 2, 3) and plan.partial_lse.dtype == torch.float32
    planned = lens.clone()
    ptrs = buffer_ptrs(plan)
    lens.copy_(lengths(gen, lay.batch))  # the caller's tensor changes in place: the plan keeps what it planned
    assert mismatches(plan, planned) == []
    plan.update(lens)
    assert mismatches(plan, lens) == [] and buffer_ptrs(plan) == ptrs


def test_sparse_plan_is_made_once_for_topk_positions():
    lay = layout(6, capacity=None, fixed_length=48)
    plan = SplitKVPlan(lay, None, torch.device("cpu"))
    topk = torch.full((6,), 48, dtype=torch.int32)
    assert mismatches(plan, topk) == []
    plan.update(torch.zeros(6, dtype=torch.int32))  # nothing to update: the lengths are topk
    assert mismatches(plan, topk) == []


def test_a_dropped_plans_buffers_go_to_the_next_plan_of_its_layout(gen):
    """A plan's buffers go back to the pool as soon as the last reference to it goes (no reference cycle: the cycle
    collector is turned off here), the next plan of the same layout, device and stream takes them and computes its
    own schedule in them (nothing of the dropped plan's lengths is left); a plan made while another is alive, or of
    another layout, gets buffers of its own; a plan that fails gives them back."""
    import gc

    from mla_dispatch.metadata.split_plan import _POOL

    _POOL.clear()
    gc.disable()
    try:
        _check_pool_reuse(gen)
    finally:
        gc.enable()
        _POOL.clear()


def test_nothing_is_pooled_during_cuda_graph_capture(monkeypatch):
    """A plan made while a stream captures a CUDA graph takes no pooled buffers and gives none back (its own belong
    to the graph's memory pool, which the graph's replays write): the pool's key is None then."""
    from mla_dispatch.metadata.split_plan import _pool_key

    lay = layout(4)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert _pool_key(lay, torch.device("cuda", 0)) is None
    assert _pool_key(lay, torch.device("cpu"))[1:] == (torch.device("cpu"), 0)


def _check_pool_reuse(gen) -> None:
    def same(a, b) -> bool:
        return all(x is y for x, y in zip(a, b, strict=True))

    lay = layout(6, num_parts=9, chunk=8, overhead=3, capacity=700)
    first = SplitKVPlan(lay, lengths(gen, 6), torch.device("cpu"))
    held = first._buffers  # (the tensors themselves: memory a new allocation could not reuse)
    del first
    lens = lengths(gen, 6)
    second = SplitKVPlan(lay, lens, torch.device("cpu"))
    assert same(second._buffers, held)
    assert mismatches(second, lens) == []
    third = SplitKVPlan(lay, lens, torch.device("cpu"))          # the second is alive: its buffers are its own
    assert not any(x is y for x, y in zip(third._buffers, held))
    third_buffers = third._buffers
    other = SplitKVPlan(layout(6, num_parts=10, chunk=8, overhead=3, capacity=700), lens, torch.device("cpu"))
    del third
    assert not same(other._buffers, third_buffers)
    with pytest.raises(ValueError, match="cache_seqlens must be int32"):
        SplitKVPlan(lay, lens.long(), torch.device("cpu"))      # takes the third's buffers, fails, gives them back
    fourth = SplitKVPlan(lay, lens, torch.device("cpu"))
    assert same(fourth._buffers, third_buffers) and mismatches(fourth, lens) == []
    # a layout of the same buffer sizes (a wider table: another capacity) takes them too
    fourth_buffers = fourth._buffers
    del fourth
    wider = SplitKVPlan(layout(6, num_parts=9, chunk=8, overhead=3, capacity=764), lens, torch.device("cpu"))
    assert same(wider._buffers, fourth_buffers) and mismatches(wider, lens) == []
    assert wider.schedule.capacity == 764                   # its own schedule object over the pooled views


def nbytes(buffers: tuple) -> int:
    """What a plan's buffers hold, counted from the tensors themselves."""
    return sum(t.numel() * t.element_size() for t in buffers)


def test_the_pool_holds_at_most_its_byte_budget(monkeypatch):
    """Dropped plans of many sizes (an engine's batch sizes) leave at most ``max_bytes`` pooled, the oldest given
    back first to the allocator; at most ``keep`` sets per key."""
    from mla_dispatch.metadata import split_plan
    from mla_dispatch.metadata.reuse import ReusePool

    pool = ReusePool(keep=2, max_bytes=1 << 30, size=lambda pooled: pooled.nbytes)
    monkeypatch.setattr(split_plan, "_POOL", pool)
    cpu = torch.device("cpu")

    def plan(batch: int) -> SplitKVPlan:
        return SplitKVPlan(layout(batch), torch.zeros(batch, dtype=torch.int32), cpu)

    same_size = [plan(3) for _ in range(4)]
    size3 = nbytes(same_size[0]._buffers)
    assert same_size[0].layout._nbytes == size3               # what the pool counts is what the plan holds
    while same_size:
        same_size.pop()
    assert pool.pooled_bytes == 2 * size3                   # keep = 2 sets of one key
    pool.clear()
    p3, p5, p7 = plan(3), plan(5), plan(7)
    k3, k5, k7 = (split_plan._pool_key(p.layout, cpu) for p in (p3, p5, p7))
    s5, s7 = nbytes(p5._buffers), nbytes(p7._buffers)
    pool.max_bytes = s5 + s7
    del p3
    del p5
    assert pool.pooled_bytes == size3 + s5
    del p7                                                   # over the budget: the oldest (batch 3) goes
    assert list(pool._free) == [k5, k7] and pool.pooled_bytes == s5 + s7
    pool.max_bytes = s7 - 1                                  # a set larger than the whole budget is not kept
    big = plan(7)
    del big
    assert pool.pooled_bytes <= s7 - 1


def test_plan_argument_errors():
    with pytest.raises(ValueError, match=r"cache_seqlens is required"):
        SplitKVPlan(layout(3), None, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"cache_seqlens must be int32 \[3\]"):
        SplitKVPlan(layout(3), torch.zeros(4, dtype=torch.int32), torch.device("cpu"))
    with pytest.raises(ValueError, match=r"cache_seqlens must be int32 \[3\] on cpu, got torch.int64"):
        SplitKVPlan(layout(3), torch.zeros(3, dtype=torch.int64), torch.device("cpu"))
    with pytest.raises(ValueError, match=r"overhead must be >= 1"):
        layout(3, overhead=0)


@pytest.mark.gpu
@pytest.mark.parametrize("native", [False, True], ids=["triton", "cuda_sm90-extension"])
def test_gpu_plan_matches_torch_without_host_sync(native, gen):
    """The Triton launch (and the extension's, where built) writes what the torch path computes, and update does
    not synchronise with the host."""
    pytest.importorskip("triton")
    fn = None
    if native:
        from mla_dispatch.backends import cuda_sm90

        if cuda_sm90.CudaSM90Backend.availability_reasons():
            pytest.skip(f"cuda_sm90 unavailable: {cuda_sm90.CudaSM90Backend.availability_reasons()[0]}")
        from mla_dispatch.kernels.cuda.schedule import native_schedule

        fn = native_schedule(cuda_sm90.load_module())
        assert fn is not None, "the built extension has no split_kv_schedule"
    for lay in (layout(1, num_parts=132, chunk=64, overhead=5, capacity=2**20),
                layout(128, num_parts=132, chunk=64, overhead=2, capacity=32768),
                layout(1000, num_parts=66, chunk=64, overhead=5, capacity=8192),
                layout(8192, num_parts=132, chunk=64, overhead=5, capacity=4096)):
        lens = lengths(gen, lay.batch, "cuda", high=lay.capacity + 100)
        plan = SplitKVPlan(lay, lens, lens.device, native=fn)
        assert mismatches(plan, lens) == [], lay
        for t in (plan.schedule.items, plan.schedule.slot_req, plan.first_slot, plan.lengths, plan.workspace):
            t.fill_(0x5A5A5A5)  # every element must be written again
        lens.copy_(lengths(gen, lay.batch, "cuda", high=lay.capacity + 100))
        ptrs = buffer_ptrs(plan)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            plan.update(lens)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert mismatches(plan, lens) == [] and buffer_ptrs(plan) == ptrs, lay


@pytest.mark.gpu
def test_gpu_pool_key_names_the_current_stream():
    """The pool key's stream is the raw handle of the device's current stream (reuse.stream_of reads it without a
    Stream object): on the default stream and inside another stream's context, with and without a device index."""
    from mla_dispatch.metadata.reuse import stream_of

    for device in (torch.device("cuda"), torch.device("cuda", torch.cuda.current_device())):
        assert stream_of(device) == torch.cuda.current_stream(device).cuda_stream
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            assert stream_of(device) == side.cuda_stream != torch.cuda.default_stream().cuda_stream


@pytest.mark.gpu
def test_gpu_bound_native_schedule_follows_pooled_buffers_and_layouts(gen):
    """The extension's schedule is bound once per pooled buffer set and layout (PlannedSchedule): a plan of the same
    layout on the same buffers takes the binding as it is, one of another capacity binds again and computes its own
    schedule; the unbound call writes the same; the bound run checks the lengths it is given and names them."""
    import gc

    from mla_dispatch.backends import cuda_sm90
    from mla_dispatch.metadata.split_plan import _POOL

    if cuda_sm90.CudaSM90Backend.availability_reasons():
        pytest.skip(f"cuda_sm90 unavailable: {cuda_sm90.CudaSM90Backend.availability_reasons()[0]}")
    from mla_dispatch.kernels.cuda.schedule import native_schedule

    fn = native_schedule(cuda_sm90.load_module())
    assert hasattr(fn, "bind") and fn is native_schedule(cuda_sm90.load_module())
    _POOL.clear()
    gc.disable()
    try:
        lens = lengths(gen, 8, "cuda", high=4200)
        lay = layout(8, num_parts=132, chunk=64, overhead=5, capacity=4096)
        first = SplitKVPlan(lay, lens, lens.device, native=fn)
        bound = first._pooled.bound[fn]
        del first
        again = SplitKVPlan(lay, lens, lens.device, native=fn)  # the same layout: the same binding, not a new one
        assert again._pooled.bound[fn] is bound and mismatches(again, lens) == []
        held = again._buffers
        del again
        lens = lengths(gen, 8, "cuda", high=8300)
        second = SplitKVPlan(layout(8, num_parts=132, chunk=64, overhead=5, capacity=8192), lens, lens.device,
                             native=fn)
        assert all(x is y for x, y in zip(second._buffers, held)) and mismatches(second, lens) == []
        lens.copy_(lengths(gen, 8, "cuda", high=8300))
        fn(lens, second)  # unbound: binds and runs in one call
        assert mismatches(second, lens) == []
        with pytest.raises(ValueError, match=r"cache_seqlens must be a contiguous int32 tensor of shape \[8\]"):
            second.update(lens.long())
    finally:
        gc.enable()
        _POOL.clear()
