"""``plan_decode(batch_invariant=True)``: a request's out and lse are bitwise the same alone and inside any batch.

CPU (CI): the fixed-split schedule itself, the reference backend, and the Triton kernel under Triton's interpreter
(fp16; a child process, since ``TRITON_INTERPRET=1`` must be set before triton is imported: ``python
tests/test_batch_invariant.py SEED`` prints one JSON line per case). GPU: cuda_sm90 and triton in bf16 and fp8,
against batches of 1 to 64 other random requests.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys

import pytest
import torch

from invariance import invariance_mismatches, random_batches
from mla_dispatch import plan_decode
from mla_dispatch.dispatch.platform import platform_for
from mla_dispatch.dispatch.registry import get_backend
from mla_dispatch.metadata.combine import first_slots
from mla_dispatch.metadata.schedule import fixed_split_schedule
from mla_dispatch.numerics.cases import make_case


# ---- the schedule ---------------------------------------------------------------------------------------------------

def _request_items(sched, b):
    items = sched.items.tolist()
    return [(beg, end) for req, beg, end, _ in items if req == b]


@pytest.mark.parametrize("split", [64, 192, 1024])
def test_fixed_split_pieces_depend_on_the_request_alone(split, gen):
    capacity = 4096
    lens = torch.randint(-5, capacity + 300, (37,), generator=gen, dtype=torch.int32)
    lens[3] = 0
    parts = int(torch.randint(1, 140, (1,), generator=gen))
    sched = fixed_split_schedule(lens, num_parts=parts, chunk_size=64, split_tokens=split, overhead=3,
                                 capacity=capacity)
    num_splits = sched.num_splits.tolist()
    for b, n in enumerate(lens.tolist()):
        tokens = min(max(n, 0), capacity)
        want = [(k, min(k + split, tokens)) for k in range(0, tokens, split)] or [(0, 0)]
        assert _request_items(sched, b) == want, b
        assert num_splits[b] == len(want)
        alone = fixed_split_schedule(lens[b:b + 1], num_parts=parts, chunk_size=64, split_tokens=split, overhead=3,
                                     capacity=capacity)
        assert _request_items(alone, 0) == want
    # slots: consecutive per split request, in the combine's order (first_slots), -1 for whole requests
    first = first_slots(sched.num_splits).tolist()
    for b in range(lens.shape[0]):
        slots = [s for req, _, _, s in sched.items.tolist() if req == b]
        assert slots == ([first[b] + k for k in range(len(slots))] if len(slots) > 1 else [-1])
        assert all(sched.slot_req[s].item() == b for s in slots if s >= 0)
    # parts: runs of consecutive items covering every used row once, unused rows in no part
    offs = sched.part_offsets.tolist()
    used = int((sched.items[:, 0] >= 0).sum())
    assert offs[0] == 0 and offs[-1] == used and offs == sorted(offs) and len(offs) == parts + 1
    assert (sched.items[used:, 0] == -1).all()
    assert sched.fixed_splits and sched.max_items == 37 * math.ceil(capacity / split)


def test_fixed_split_update_matches_a_fresh_schedule(gen):
    lens = torch.randint(0, 3000, (9,), generator=gen, dtype=torch.int32)
    sched = fixed_split_schedule(lens, num_parts=7, chunk_size=64, split_tokens=512, capacity=3072)
    new = torch.randint(0, 3000, (9,), generator=gen, dtype=torch.int32)
    ptr = sched.items.data_ptr()
    sched.update_(new)
    fresh = fixed_split_schedule(new, num_parts=7, chunk_size=64, split_tokens=512, capacity=3072)
    assert sched.items.data_ptr() == ptr
    for name in ("items", "part_offsets", "num_splits", "slot_req"):
        assert torch.equal(getattr(sched, name), getattr(fresh, name)), name


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(split_tokens=100), "split_tokens must be a positive multiple of chunk_size=64, got 100"),
    (dict(split_tokens=0), "split_tokens must be a positive multiple"),
    (dict(capacity=None), "capacity .* is required"),
])
def test_fixed_split_rejects_bad_arguments(kwargs, pattern):
    args = dict(num_parts=4, chunk_size=64, split_tokens=128, capacity=1024) | kwargs
    with pytest.raises(ValueError, match=pattern):
        fixed_split_schedule(torch.zeros(3, dtype=torch.int32), **args)


# ---- the front end --------------------------------------------------------------------------------------------------

def test_backends_without_it_decline_with_the_reason(gen):
    case = make_case(2, 1, 16, 50, generator=gen)
    plan = plan_decode(*case.args(), **case.kwargs(), batch_invariant=True)
    assert plan.backend == "reference" and plan.problem.batch_invariant
    for name in ("flashmla", "flashinfer", "aiter"):
        reasons = get_backend(name).not_supported_reasons(plan.problem, platform_for(case.q.device))
        assert any("batch_invariant=True" in str(r) for r in reasons), name


def test_split_tokens_needs_a_batch_invariant_plan(gen):
    from mla_dispatch.backends.triton import TritonBackend

    case = make_case(2, 1, 16, 50, generator=gen)
    plan = plan_decode(*case.args(), **case.kwargs())
    with pytest.raises(ValueError, match=r"backend_options\['split_tokens'\]=256 applies to batch_invariant=True"):
        TritonBackend.make_state(plan.problem, plan.platform, case.cache_seqlens, split_tokens=256)
    with pytest.raises(ValueError, match=r"split_tokens'\]=100 \(supported: 128, 256"):
        plan_decode(*case.args(), **case.kwargs(), backend="triton", backend_options={"split_tokens": 100},
                    batch_invariant=True)


@pytest.mark.parametrize("q_len, causal", [(1, False), (2, True)])
def test_reference_is_batch_invariant(q_len, causal, gen):
    pool = make_case(12, q_len, 16, 300, page_size=16, causal=causal, zero_len_rows=1, generator=gen)
    target = int(torch.randint(0, 12, (1,), generator=gen))
    batches = random_batches(12, target, [1, 4, 11, 11], gen)
    assert invariance_mismatches(pool, target, batches, backend="reference") == []


# ---- the Triton kernel under the interpreter (child process) --------------------------------------------------------

# (id, make_case kwargs, pool size, other-request counts)
INTERPRET_CASES = [
    ("fp16-s1-h16-ps16", dict(q_len=1, num_heads_q=16, seqlen=400, page_size=16), 9, [1, 4, 8]),
    ("fp16-s2-causal-h8-ps7", dict(q_len=2, num_heads_q=8, seqlen=400, page_size=7, causal=True), 7, [2, 6]),
    ("fp8e4m3-s1-h4-ps16", dict(q_len=1, num_heads_q=4, seqlen=400, page_size=16, kv_format="fp8_e4m3"), 6, [5]),
]


def _interpret_child(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for cid, kw, pool_size, others in INTERPRET_CASES:
        split_counts, problems = [], []
        try:
            pool = make_case(pool_size, generator=gen, dtype=torch.float16, **kw)
            target = int(pool.cache_seqlens.argmax())  # the longest request: split into pieces of 128

            def check(plan, rows):
                split_counts.append(int(plan.state.schedule.num_splits[rows.index(target)]))

            problems = invariance_mismatches(pool, target, random_batches(pool_size, target, others, gen),
                                             backend="triton", backend_options={"split_tokens": 128},
                                             check_plan=check)
        except Exception as exc:  # reported to the parent
            problems.append(f"{type(exc).__name__}: {exc}")
        print(json.dumps({"id": cid, "problems": problems, "splits": split_counts}), flush=True)


@pytest.fixture(scope="module")
def interpreted() -> dict:
    from tests.conftest import interpreter_child_results

    return interpreter_child_results(__file__)


@pytest.mark.parametrize("cid", [c[0] for c in INTERPRET_CASES])
def test_triton_interpreter_is_batch_invariant(cid, interpreted):
    result = interpreted.get(cid)
    assert result is not None, f"case {cid} did not report (child crashed?)"
    assert result["problems"] == []
    # the target really was split, alone and in every batch
    assert result["splits"] and min(result["splits"]) >= 2


# ---- GPU: the kernels -----------------------------------------------------------------------------------------------

GPU_CASES = [
    # (id, make_case kwargs, backend, split_tokens)
    ("bf16-h128-s1", dict(q_len=1, num_heads_q=128), None),
    ("bf16-h128-s2-causal", dict(q_len=2, num_heads_q=128, causal=True), None),
    ("bf16-h16-s1", dict(q_len=1, num_heads_q=16), None),
    ("bf16-h32-s1", dict(q_len=1, num_heads_q=32), 256),
    ("bf16-h64-s1-ps16", dict(q_len=1, num_heads_q=64, page_size=16), 512),
    ("fp8e4m3-h16-s1", dict(q_len=1, num_heads_q=16, kv_format="fp8_e4m3"), None),
    ("fp8e4m3-h128-s1", dict(q_len=1, num_heads_q=128, kv_format="fp8_e4m3"), None),
    ("fp8dsmla-h16-s1-ps1", dict(q_len=1, num_heads_q=16, kv_format="fp8_ds_mla", page_size=1), 256),
]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda_sm90", "triton"])
@pytest.mark.parametrize("cid, kw, split", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_kernels_are_batch_invariant(backend, cid, kw, split, gen):
    if backend == "cuda_sm90" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("cuda_sm90 needs an SM90 GPU")
    kw = dict(page_size=64) | kw
    pool = make_case(65, seqlen=3000, device="cuda", generator=gen, **kw)
    target = int(pool.cache_seqlens.argmax())  # the longest request: surely split
    variants = set()

    def check(plan, rows):
        if backend == "cuda_sm90":
            variants.add(plan.state.launch.variant)
            assert plan.state.launch.fixed_splits and not plan.state.launch.fuse_combine
        assert plan.state.schedule.num_splits[rows.index(target)] > 1

    options = None if split is None else {"split_tokens": split}
    batches = random_batches(65, target, [1, 3, 16, 64, 64], gen)
    assert invariance_mismatches(pool, target, batches, backend=backend, backend_options=options,
                                 check_plan=check) == []
    assert len(variants) <= 1  # one mainloop for every batch size


if __name__ == "__main__":
    _interpret_child(int(sys.argv[1]))


def test_auto_ignores_the_tuned_table_when_batch_invariant(gen):
    """The measured table's winner changes with the batch; a batch-invariant problem keeps the default order."""
    import dataclasses

    from mla_dispatch.dispatch.select import priority
    from mla_dispatch.dispatch.tuned import shape_bucket

    from fakes import H100

    case = make_case(2, 1, 16, 50, generator=gen)
    problem = plan_decode(*case.args(), **case.kwargs()).problem
    default = priority(problem, H100)
    table = {shape_bucket(problem): default[-2]}  # a measured winner that is not first by default
    assert priority(problem, H100, table)[0] == default[-2]
    invariant = dataclasses.replace(problem, batch_invariant=True)
    assert priority(invariant, H100, table) == priority(invariant, H100) == default


@pytest.mark.parametrize("causal", [False, True])
def test_reference_in_fixed_chunks_is_right_and_width_invariant(causal, gen):
    """The batch-invariant reference (an online softmax over fixed chunks of table positions) against the float64
    oracle, and a wider block table (more empty chunks) gives the same bits; a bad block id poisons its request."""
    from oracle64 import naive_attention

    from mla_dispatch.numerics.tolerance import compare_outputs
    from mla_dispatch.backends.reference import ReferenceBackend

    case = make_case(4, 2, 8, 700, page_size=16, causal=causal, zero_len_rows=1, generator=gen)
    plan = plan_decode(*case.args(), **case.kwargs(), batch_invariant=True)
    out, lse = plan.run(case.q, case.kv_cache)
    want_out, want_lse = naive_attention(case)
    report = compare_outputs(out, lse, want_out.float(), want_lse.float(), ReferenceBackend.TOLERANCE)
    assert report, report.message
    wide = dataclasses.replace(case, block_table=torch.cat([case.block_table, torch.zeros_like(case.block_table)], 1))
    wide_out, wide_lse = plan_decode(*wide.args(), **wide.kwargs(), batch_invariant=True).run(wide.q, wide.kv_cache)
    assert torch.equal(wide_out, out) and torch.equal(wide_lse, lse)
    bad = dataclasses.replace(case, block_table=case.block_table.clone())
    bad.block_table[0, 0] = -1
    bad_out, bad_lse = plan_decode(*bad.args(), **bad.kwargs(), batch_invariant=True).run(bad.q, bad.kv_cache)
    assert bad_out[0].isnan().all() and bad_lse[0].isnan().all() and torch.equal(bad_out[1:], out[1:])
