"""Decode context parallelism (DCP): :func:`mla_dispatch.merge_shards`, and decode sharded across processes.

- In one process: a problem's cache split among 1-4 shards (tests/dcp_ranks.py ``shard_case``), each shard run on
  the reference, merged, against the float64 oracle; the empty-shard and NaN conventions against a float64
  merge written out here; the argument errors.
- Across processes (tests/dcp_ranks.py): 2 ranks, DCP-interleaved KV and head-split TP, each rank planning on its
  own cache, table and lengths, all-gather of out/lse, merge, checked against one rank's run and float64. On CPUs
  with gloo (CI: the reference, and triton under its interpreter in fp16); on GPUs, marked ``gpu``: NCCL with one
  GPU per rank (needs two GPUs), and gloo with both ranks on one GPU (the one-GPU machine), for every GPU backend.

The ranks run in spawned processes (one launch per module, its records checked per case); the seed is the
session's (``MLA_DISPATCH_SEED`` replays it).
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

from mla_dispatch import get_backend, merge_shards, plan_decode
from mla_dispatch.numerics.cases import make_case, poisoned_outputs
from mla_dispatch.numerics.tolerance import check_close, compare_outputs
from dcp_ranks import default_jobs, launch, shard_case, shorten
from oracle64 import naive_attention
from tests.conftest import SEED

TOL = get_backend("reference").TOLERANCE


def _run(case, backend="reference"):
    plan = plan_decode(*case.args(), backend=backend, **case.kwargs())
    out, lse = poisoned_outputs(case)
    return plan.run(case.q, case.kv_cache, kv_scale=case.kv_scale, out=out, lse=lse)


# ------------------------------------------------------------------------------------------------------------------
# merge_shards in one process
# ------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("world,interleave,kv_format", [(1, 1, "bf16"), (2, 1, "bf16"), (3, 1, "fp8_e4m3"),
                                                        (4, 5, "bf16")])
def test_shards_merge_to_the_whole_cache(world, interleave, kv_format, gen):
    """Request 4 has one token (every shard but one is empty for it), request 5 none (all are)."""
    case = shorten(make_case(6, 2, 4, 40, page_size=16, kv_format=kv_format, generator=gen), (1, 0))
    shards = [shard_case(case, r, world, interleave=interleave, generator=gen) for r in range(world)]
    assert sum(s.cache_seqlens for s in shards).tolist() == case.cache_seqlens.tolist()
    results = [_run(s) for s in shards]
    out, lse = poisoned_outputs(case)
    got = merge_shards([o for o, _ in results], [l for _, l in results], out=out, lse=lse)
    assert got[0] is out and got[1] is lse
    want_out, want_lse = naive_attention(case)
    assert check_close("lse", lse, want_lse.float(), TOL.lse_atol, TOL.lse_rtol)
    # Each shard's out reaches the merge rounded to its dtype (relative error <= eps/2, bf16: 2^-8), and shards of
    # opposite sign cancel, so the merged out can be off by sum_j w_j |o_j| eps/2 beyond the one-kernel tolerance,
    # w_j the merge weight exp(lse_j - lse): a bound on the inputs, not a looser tolerance (seeds 2762 and 2911 of
    # the 3-shard fp8_e4m3 case reach 4 bf16 ulps of a small merged value).
    outs = torch.stack([o for o, _ in results]).double()
    lses = torch.stack([l for _, l in results]).double()
    live = torch.isfinite(lses) & torch.isfinite(want_lse)                         # an empty shard (+inf) weighs 0
    weights = torch.where(live, torch.exp(lses - want_lse.double()), 0.0)          # (shards, b, h, s_q)
    unit = torch.finfo(results[0][0].dtype).eps / 2                              # bf16: 2^-8
    carried = (weights.permute(0, 1, 3, 2)[..., None] * outs.abs()).sum(0) * unit
    bound = torch.maximum(torch.full_like(carried, TOL.out_atol), TOL.out_rtol * want_out.abs()) + carried
    err = (out.double() - want_out).abs()
    assert bool((err <= bound).all()), f"out: {int((err > bound).sum())} elements beyond the derived bound"
    for shard, (o, l) in zip(shards, results):                          # and each shard alone, at the tolerance
        if int(shard.cache_seqlens.sum()):
            report = compare_outputs(o, l, *(t.float() for t in naive_attention(shard)), TOL)
            assert report, report.message
    assert torch.isposinf(lse[5]).all() and (out[5] == 0).all()


def _float64_merge(outs: torch.Tensor, lses: torch.Tensor):
    """The merge written out row by row in float64: +-inf shards weigh nothing, a NaN LSE poisons its row."""
    n, b, s_q, h, d = outs.shape
    out = torch.zeros(b, s_q, h, d, dtype=torch.float64)
    lse = torch.zeros(b, h, s_q, dtype=torch.float64)
    for r in range(b):
        for i in range(s_q):
            for k in range(h):
                ls = [float(lses[j, r, k, i]) for j in range(n)]
                if any(math.isnan(x) for x in ls):
                    out[r, i, k], lse[r, k, i] = math.nan, math.nan
                    continue
                live = [j for j in range(n) if math.isfinite(ls[j])]
                if not live:
                    lse[r, k, i] = math.inf
                    continue
                total = math.log(sum(math.exp(ls[j]) for j in live))
                lse[r, k, i] = total
                out[r, i, k] = sum(math.exp(ls[j] - total) * outs[j, r, i, k].double() for j in live)
    return out, lse


def test_empty_and_nan_shard_conventions(gen):
    n, b, s_q, h, d = 3, 4, 2, 3, 8
    outs = torch.randn(n, b, s_q, h, d, generator=gen)
    lses = torch.randn(n, b, h, s_q, generator=gen) * 4
    lses[1, 0], outs[1, 0] = math.inf, math.nan       # request 0: shard 1 empty (our +inf), out never read
    lses[2, 0], outs[2, 0] = -math.inf, 1e30          # ... shard 2 empty (the -inf convention)
    lses[:, 1] = torch.tensor([math.inf, -math.inf, math.inf])[:, None, None]  # request 1: no shard saw a key
    lses[0, 2, 1, 0] = math.nan                       # request 2, head 1, token 0: a shard met a bad block id
    lses[2, 3, 0, 1] = 100.0                          # request 3: one shard dominates (exp(100) overflows fp32)
    got_out, got_lse = merge_shards(outs, lses)
    want_out, want_lse = _float64_merge(outs, lses)
    assert check_close("out", got_out, want_out, 1e-6, 1e-5)
    assert check_close("lse", got_lse, want_lse, 1e-6, 1e-7)
    assert torch.equal(got_out[0], outs[0, 0])  # one live shard: its own result, bit for bit
    assert (got_out[1] == 0).all() and torch.isposinf(got_lse[1]).all()
    nan = torch.isnan(got_lse)
    assert nan[2, 1, 0] and int(nan.sum()) == 1 and int(torch.isnan(got_out).sum()) == d


def test_a_live_shard_with_a_nan_out_is_not_hidden(gen):
    outs = torch.randn(2, 1, 1, 2, 4, generator=gen)
    lses = torch.randn(2, 1, 2, 1, generator=gen)
    outs[1, 0, 0, 0, 2] = math.nan
    got_out, _ = merge_shards(outs, lses)
    assert torch.isnan(got_out[0, 0, 0, 2]) and int(torch.isnan(got_out).sum()) == 1


def test_stacked_and_listed_shards_agree(gen):
    outs = torch.randn(3, 2, 1, 4, 16, generator=gen).to(torch.bfloat16)
    lses = torch.randn(3, 2, 4, 1, generator=gen)
    stacked = merge_shards(outs, lses)
    listed = merge_shards(list(outs), list(lses))
    assert stacked[0].dtype == torch.bfloat16 and torch.equal(stacked[0], listed[0])
    assert torch.equal(stacked[1], listed[1])
    wide = torch.full((2, 1, 4, 16), math.nan)  # an fp32 destination keeps the bits the bf16 result rounds away
    merge_shards(outs, lses, out=wide)
    assert torch.equal(wide.to(torch.bfloat16), stacked[0])


@pytest.mark.parametrize("kwargs,match", [
    (dict(outs=torch.zeros(2, 3, 1, 4, 8), lses=torch.zeros(2, 3, 1, 4)), r"lses must be \[2, 3, 4, 1\]"),
    (dict(outs=torch.zeros(2, 3, 1, 4, 8), lses=torch.zeros(2, 3, 4, 1, dtype=torch.float64)), "lses must be float32"),
    (dict(outs=torch.zeros(3, 1, 4, 8), lses=torch.zeros(2, 3, 4, 1)), "outs must be a tensor of 5 dims"),
    (dict(outs=[], lses=[]), "outs must be a tensor or a non-empty sequence"),
    (dict(outs=[torch.zeros(3, 1, 4, 8), torch.zeros(2, 1, 4, 8)], lses=torch.zeros(2, 3, 4, 1)),
     "outs must be shards of one 4-dim shape"),
    (dict(outs=torch.zeros(2, 3, 1, 4, 8, dtype=torch.int32), lses=torch.zeros(2, 3, 4, 1)),
     "outs must be floating point"),
    (dict(outs=torch.zeros(2, 3, 1, 4, 8), lses=torch.zeros(2, 3, 4, 1), out=torch.zeros(3, 1, 4, 9)),
     r"out must be a floating-point \[3, 1, 4, 8\]"),
    (dict(outs=torch.zeros(2, 3, 1, 4, 8), lses=torch.zeros(2, 3, 4, 1), lse=torch.zeros(3, 1, 4)),
     r"lse must be float32 \[3, 4, 1\]"),
])
def test_merge_shards_argument_errors(kwargs, match):
    outs, lses = kwargs.pop("outs"), kwargs.pop("lses")
    with pytest.raises(ValueError, match=match):
        merge_shards(outs, lses, **kwargs)


# ------------------------------------------------------------------------------------------------------------------
# Across processes
# ------------------------------------------------------------------------------------------------------------------

def _launch(tmp_path_factory, comm, device_kind, jobs, env, timeout_s):
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available in this torch build")
    path = str(tmp_path_factory.mktemp("dcp") / "records.json")
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)  # inherited by the spawned ranks
        return launch(2, comm, device_kind, jobs, SEED, path, timeout_s)


def _check(records, job):
    backend, case = job
    recs = records.get(f"{backend}-{case}-dcp2")
    assert recs is not None and len(recs) == 2, f"{backend} {case}: the ranks did not both report ({recs})"
    if any(r["status"] == "skip" for r in recs):
        pytest.skip(recs[0]["message"])
    bad = [f"rank {r['rank']}: {r['message']}" for r in recs if r["status"] != "ok"]
    assert not bad, f"{backend} {case} (seed {recs[0]['seed']}):\n" + "\n".join(bad)


CPU_JOBS = default_jobs("cpu", ["reference", "triton"])
GPU_JOBS = default_jobs("cuda")


def _ids(jobs):
    return [f"{b}-{c}" for b, c in jobs]


@pytest.fixture(scope="module")
def gloo_cpu_records(tmp_path_factory):
    # TRITON_INTERPRET=1 lets triton run on the CPU in the ranks (read when they import triton); the reference
    # ignores it.
    return _launch(tmp_path_factory, "gloo", "cpu", CPU_JOBS, {"TRITON_INTERPRET": "1"}, timeout_s=300)


@pytest.mark.xdist_group("dcp_cpu")
@pytest.mark.parametrize("job", CPU_JOBS, ids=_ids(CPU_JOBS))
def test_two_ranks_gloo_cpu(gloo_cpu_records, job):
    _check(gloo_cpu_records, job)


@pytest.fixture(scope="module")
def nccl_records(tmp_path_factory):
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices (the device tool's nvidia-h200-x2)")
    return _launch(tmp_path_factory, "nccl", "cuda", GPU_JOBS, {"NCCL_NVLS_ENABLE": "0"}, timeout_s=540)


@pytest.mark.gpu
@pytest.mark.xdist_group("dcp_gpu")
@pytest.mark.parametrize("job", GPU_JOBS, ids=_ids(GPU_JOBS))
def test_two_ranks_nccl_two_gpus(nccl_records, job):
    _check(nccl_records, job)


@pytest.fixture(scope="module")
def one_gpu_records(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return _launch(tmp_path_factory, "gloo", "cuda", GPU_JOBS, {}, timeout_s=540)


@pytest.mark.gpu
@pytest.mark.xdist_group("dcp_gpu")
@pytest.mark.parametrize("job", GPU_JOBS, ids=_ids(GPU_JOBS))
def test_two_ranks_on_one_gpu_gloo(one_gpu_records, job):
    """Both ranks on cuda:0, gathering through the host: each GPU backend's shards and the merge on the GPU,
    where the machine has one GPU."""
    _check(one_gpu_records, job)
