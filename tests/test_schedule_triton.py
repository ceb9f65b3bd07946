"""The one-launch Triton split-KV schedule (metadata/schedule_triton.py) against the torch reference.

Every output tensor must be bit-identical to ``split_kv_schedule(..., impl="torch")``; the first slots and the
lengths' copy a plan's launch also writes, to ``first_slots`` of that schedule and the lengths given.

- CPU: the kernel runs under Triton's interpreter. ``TRITON_INTERPRET=1`` must be
  set before triton is imported, so all cases run in one child process
  (``python tests/test_schedule_triton.py SEED``) that prints one JSON line per
  case; each parametrized test checks its line. Each case checks both a fresh
  ``impl="triton"`` build and ``update_`` into buffers (and a workspace) filled
  with junk, so an element the kernel forgot to write shows up.
- GPU (``gpu`` marker): exact equality up to B=1024, P=132; ``update_`` keeps its
  buffers and does no host sync. Speed is not a test's business (``bench``).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
import torch

from mla_dispatch.metadata.schedule import SplitKVSchedule, split_kv_schedule

OUTPUTS = ("items", "part_offsets", "num_splits", "slot_req")

# (id, lengths, num_parts, chunk_size, overhead): the edge cases the closed-form merge must get right
EDGE_CASES = [
    ("b1-p1", [100], 1, 64, 4),
    ("b1-p132", [5000], 132, 64, 5),
    ("b1-zero-p3", [0], 3, 64, 1),
    ("all-zero-b4-p8", [0, 0, 0, 0], 8, 16, 1),
    ("negative-clamped", [-5, 10, -1, 0, 33], 4, 8, 2),
    ("docstring-zero-then-split", [0, 0, 5], 8, 4, 1),
    ("ties-every-start-on-a-boundary", [12, 12, 12, 12], 4, 4, 1),
    ("ties-starts-and-midpoints", [28, 28, 28, 28], 8, 4, 1),
    ("boundaries-inside-overhead", [640, 640, 640], 9, 64, 5),
    ("parts-exceed-cost", [1, 2, 3], 500, 64, 1),
    ("parts-exceed-cost-zero", [0, 0], 7, 64, 1),
    ("bounds-clamped-at-total", [100, 1], 7, 16, 1),
    ("total-over-int32", [2**31 - 1] * 5, 132, 1, 1),
    ("huge-and-zero", [2**31 - 1, 0, 2**30, 0], 17, 1, 3),
    ("chunk1-b9-p5", [7, 0, 3, 11, 1, 0, 2, 9, 4], 5, 1, 1),
    ("one-long-many-short", [100000] + [1] * 30, 132, 64, 5),
    ("b300-p17", None, 17, 128, 4),
    ("b1024-p132", None, 132, 64, 5),
    ("b8192-max-batch-p132", None, 132, 64, 5),
]
# (id, lengths, num_parts, chunk_size, overhead, capacity): lengths past the block table's capacity
# (max_blocks * page_size) count as the capacity
CAPACITY_CASES = [
    ("capacity-clamps", [-5, 100, 300, 2**31 - 1, 64, 0], 4, 16, 1, 128),
    ("capacity-zero", [5, 0, 7], 3, 8, 1, 0),
    ("capacity-one-chunk1", [3, 1, 0, 2**31 - 1], 5, 1, 2, 1),
    ("capacity-unaligned", [1000, 999, 37, 2**30], 9, 64, 5, 999),
]
NUM_RANDOM = 24


def make_cases(seed: int) -> list[tuple[str, list[int], int, int, int, int | None]]:
    """Edge cases plus ``NUM_RANDOM`` random ones (with a capacity or none); ids do not depend on the seed."""
    rng = random.Random(seed)

    def lengths(batch: int) -> list[int]:
        return [0 if rng.random() < 0.2 else rng.randint(-3, 3000) for _ in range(batch)]

    cases = [(cid, lens if lens is not None else lengths(int(cid.split("-")[0][1:])), p, c, o, None)
             for cid, lens, p, c, o in EDGE_CASES]
    cases += CAPACITY_CASES
    for i in range(NUM_RANDOM):
        batch = rng.choice([1, 2, 3, 5, 8, 31, 64, 129, 200])
        cases.append((f"rand{i:02d}", lengths(batch), rng.choice([1, 2, 3, 7, 16, 33, 132, 160]),
                      rng.choice([1, 16, 64, 128]), rng.randint(1, 5), rng.choice([None, None, 0, 1, 500, 2999])))
    return cases


def _mismatches(got: SplitKVSchedule, want: SplitKVSchedule) -> list[str]:
    bad = []
    for name in OUTPUTS:
        g, w = getattr(got, name), getattr(want, name)
        if g.dtype != w.dtype or g.shape != w.shape or not torch.equal(g.cpu(), w.cpu()):
            bad.append(f"{name}: got {g.tolist()} want {w.tolist()}")
    return bad


def _check_case(lens: list[int], num_parts: int, chunk: int, overhead: int, capacity: int | None = None,
                device: str = "cpu", into: bool = True) -> list[str]:
    """Compare a fresh triton build and a triton update_ into junk-filled buffers with the torch path (and, with
    ``into``, a launch that also writes the first slots and the lengths' copy)."""
    seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
    kw = dict(num_parts=num_parts, chunk_size=chunk, overhead=overhead, capacity=capacity)
    want = split_kv_schedule(seqlens, impl="torch", **kw)
    problems = [f"fresh {m}" for m in _mismatches(split_kv_schedule(seqlens, impl="triton", **kw), want)]

    # update_ into buffers (and a workspace) full of junk: every element must be written
    sched = split_kv_schedule(seqlens, impl="triton", **kw)
    for t in (sched.items, sched.part_offsets, sched.num_splits, sched.slot_req, sched.workspace):
        t.fill_(0x5A5A5A5)
    ptrs = [getattr(sched, n).data_ptr() for n in OUTPUTS + ("workspace",)]
    sched.update_(seqlens, impl="triton")
    problems += [f"update_ {m}" for m in _mismatches(sched, want)]
    if ptrs != [getattr(sched, n).data_ptr() for n in OUTPUTS + ("workspace",)]:
        problems.append("update_ replaced a buffer")
    if into:
        problems += [f"into {m}" for m in _check_into(seqlens, want, **kw)]
    return problems


def _junk_buffers(batch: int, num_parts: int, device) -> dict[str, torch.Tensor]:
    """A schedule's buffers, the first slots, a lengths copy and the workspace, all full of junk."""
    from mla_dispatch.metadata.schedule import workspace_numel

    shapes = {"items": (batch + num_parts, 4), "part_offsets": (num_parts + 1,), "num_splits": (batch,),
              "slot_req": (batch + num_parts,), "first_slot": (batch,), "lengths": (batch,),
              "workspace": (workspace_numel(batch, num_parts),)}
    return {name: torch.full(shape, 0x5A5A5A5, dtype=torch.int32, device=device) for name, shape in shapes.items()}


def _into_mismatches(bufs: dict[str, torch.Tensor], seqlens: torch.Tensor, want: SplitKVSchedule) -> list[str]:
    """What a one-launch schedule wrote into ``bufs`` against the torch schedule ``want``, its first slots and the
    lengths it was given."""
    from mla_dispatch.metadata.combine import first_slots

    got = SplitKVSchedule(items=bufs["items"], part_offsets=bufs["part_offsets"], num_splits=bufs["num_splits"],
                          slot_req=bufs["slot_req"], chunk_size=want.chunk_size, num_parts=want.num_parts,
                          overhead=want.overhead)
    bad = _mismatches(got, want)
    for name, expected in (("first_slot", first_slots(want.num_splits)), ("lengths", seqlens)):
        if not torch.equal(bufs[name].cpu(), expected.cpu()):
            bad.append(f"{name}: got {bufs[name].tolist()} want {expected.tolist()}")
    return bad


def _check_into(seqlens: torch.Tensor, want: SplitKVSchedule, *, num_parts: int, chunk_size: int, overhead: int,
                capacity: int | None) -> list[str]:
    """split_kv_schedule_into with the first slots and the lengths' copy (a plan's buffers), into junk."""
    from mla_dispatch.metadata.schedule_triton import split_kv_schedule_into

    bufs = _junk_buffers(seqlens.shape[0], num_parts, seqlens.device)
    split_kv_schedule_into(seqlens, bufs["items"], bufs["part_offsets"], bufs["num_splits"], bufs["slot_req"],
                           bufs["workspace"], num_parts=num_parts, chunk_size=chunk_size, overhead=overhead,
                           capacity=capacity, first_slot=bufs["first_slot"], lengths_out=bufs["lengths"])
    return _into_mismatches(bufs, seqlens, want)


def _run_cases(seed: int) -> None:
    """Child process (TRITON_INTERPRET=1): run every case, print one JSON line each."""
    for cid, lens, num_parts, chunk, overhead, capacity in make_cases(seed):
        try:
            # the first slots and the lengths' copy on the edge and capacity cases (interpreter time)
            problems = _check_case(lens, num_parts, chunk, overhead, capacity, into=not cid.startswith("rand"))
            msg = "; ".join(problems)[:4000]
        except Exception as exc:  # reported to the parent
            problems, msg = [exc], f"{type(exc).__name__}: {exc}"
        print(json.dumps({"id": cid, "ok": not problems, "message": msg,
                          "case": [len(lens), num_parts, chunk, overhead, capacity]}), flush=True)


# --------------------------------------------------------------------------------------
# CPU: the kernel under the Triton interpreter
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    from tests.conftest import interpreter_child_results

    return interpreter_child_results(__file__)


@pytest.mark.parametrize("case_id", [c[0] for c in make_cases(0)])
def test_triton_schedule_matches_torch_under_interpreter(interpreter_results, case_id):
    rec = interpreter_results.get(case_id)
    assert rec is not None, f"case {case_id} did not report (child crashed?)"
    assert rec["ok"], f"[batch, num_parts, chunk, overhead, capacity]={rec['case']}: {rec['message']}"


def test_auto_on_cpu_is_torch_and_imports_no_triton():
    code = ("import sys, torch\n"
            "from mla_dispatch.metadata.schedule import split_kv_schedule\n"
            "s = split_kv_schedule(torch.tensor([3, 0, 70], dtype=torch.int32), num_parts=4)\n"
            "s.update_(torch.tensor([1, 2, 3], dtype=torch.int32))\n"
            "print(s.workspace is None, 'triton' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "True False"


def test_impl_argument_errors(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    lens = torch.tensor([5, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"impl='cuda' \(supported: auto, torch, triton\)"):
        split_kv_schedule(lens, num_parts=2, impl="cuda")
    with pytest.raises(ValueError, match="needs a CUDA/ROCm tensor"):
        split_kv_schedule(lens, num_parts=2, impl="triton")
    with pytest.raises(ValueError, match=r"needs 1 <= batch <= 8192, got batch=8193"):
        split_kv_schedule(torch.zeros(8193, dtype=torch.int32), num_parts=2, impl="triton")
    sched = split_kv_schedule(lens, num_parts=2)
    with pytest.raises(ValueError, match="must keep batch=2, got 3"):
        sched.update_(torch.zeros(3, dtype=torch.int32))


# --------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_triton_schedule_matches_torch_on_gpu(seed):
    pytest.importorskip("triton")
    rng = random.Random(seed)
    cases = make_cases(seed)  # each new (batch, num_parts) shape compiles once, so keep the count modest
    for i in range(20):
        batch = rng.choice([1, 2, 7, 64, 128, 333, 512, 1000, 1024])
        lens = [0 if rng.random() < 0.2 else rng.randint(-3, rng.choice([100, 4000, 130000])) for _ in range(batch)]
        cases.append((f"gpu{i}", lens, rng.choice([1, 2, 16, 78, 100, 132]), rng.choice([1, 16, 64, 128]),
                      rng.randint(1, 5), rng.choice([None, 64, 5000])))
    failures = [(cid, len(lens), p, c, o, cap, problems[:2]) for cid, lens, p, c, o, cap in cases
                if (problems := _check_case(lens, p, c, o, cap, device="cuda"))]
    assert not failures, failures[:3]


@pytest.mark.gpu
def test_auto_picks_triton_and_update_keeps_buffers_without_host_sync(gen):
    pytest.importorskip("triton")
    lens = torch.randint(0, 5000, (256,), generator=gen, dtype=torch.int32).cuda()
    sched = split_kv_schedule(lens, num_parts=132, chunk_size=64, overhead=5)
    assert sched.workspace is not None, "auto on a CUDA tensor should take the triton path"
    ptrs = [getattr(sched, n).data_ptr() for n in OUTPUTS + ("workspace",)]
    new = torch.randint(0, 5000, (256,), generator=gen, dtype=torch.int32).cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sched.update_(new)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert ptrs == [getattr(sched, n).data_ptr() for n in OUTPUTS + ("workspace",)]
    assert not _mismatches(sched, split_kv_schedule(new, num_parts=132, chunk_size=64, overhead=5, impl="torch"))


if __name__ == "__main__":
    _run_cases(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
