"""Foundation layers on a CUDA device (run on the device tool; skipped without a GPU)."""

import dataclasses

import pytest
import torch

import mla_dispatch
from mla_dispatch.metadata.schedule import split_kv_schedule
from mla_dispatch.metadata.combine import combine_splits
from mla_dispatch.numerics.cases import case_reference, make_case, poisoned_outputs
from mla_dispatch.numerics.tolerance import compare_outputs

pytestmark = pytest.mark.gpu


def test_schedule_and_combine_do_not_sync_with_the_host(gen):
    lens = torch.randint(0, 5000, (64,), generator=gen).to(torch.int32).cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sched = split_kv_schedule(lens, num_parts=132)
        p_out = torch.zeros(sched.max_slots, 1, 16, 512, device="cuda")
        p_lse = torch.full((sched.max_slots, 1, 16), float("-inf"), device="cuda")
        out = torch.zeros(64, 1, 16, 512, device="cuda", dtype=torch.bfloat16)
        lse = torch.zeros(64, 16, 1, device="cuda")
        combine_splits(p_out, p_lse, sched, out, lse)
        sched.update_(lens.flip(0))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    cpu = split_kv_schedule(lens.flip(0).cpu(), num_parts=132)
    assert torch.equal(sched.items.cpu(), cpu.items) and torch.equal(sched.part_offsets.cpu(), cpu.part_offsets)


def test_reference_on_cuda_matches_cpu(gen):
    case = make_case(4, 2, 16, 300, page_size=64, causal=True, zero_len_rows=1, generator=gen)
    out_cpu, lse_cpu = case_reference(case)
    cuda_case = dataclasses.replace(case, q=case.q.cuda(), kv_cache=case.kv_cache.cuda(),
                                    block_table=case.block_table.cuda(), cache_seqlens=case.cache_seqlens.cuda())
    out, lse = mla_dispatch.mla_decode(*cuda_case.args(), **cuda_case.kwargs(), backend="reference")
    assert compare_outputs(out.cpu(), lse.cpu(), out_cpu, lse_cpu, mla_dispatch.Tolerance())


def test_cuda_graph_capture_and_replay_with_new_lengths(gen):
    """plan once, capture run, change cache_seqlens values in place, update, replay."""
    case = make_case(3, 1, 16, 200, page_size=16, generator=gen, device="cuda")
    plan = mla_dispatch.plan_decode(*case.args(), **case.kwargs(), backend="reference", cuda_graph=True)
    out, lse = poisoned_outputs(case)
    plan.run(case.q, case.kv_cache, out=out, lse=lse)  # warm-up outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(case.q, case.kv_cache, out=out, lse=lse)
    new_lens = (case.cache_seqlens // 2).to(torch.int32)
    new_lens[1] = 0
    plan.update(cache_seqlens=new_lens)
    out.fill_(float("nan"))
    graph.replay()
    want_out, want_lse = case_reference(case, new_lens)
    assert compare_outputs(out, lse, want_out, want_lse, mla_dispatch.Tolerance())
    assert torch.isposinf(lse[1]).all()
