"""Decode context parallelism across processes: what each rank of tests/test_dcp.py runs, and how it is launched.

Every rank makes the same global decode problem (``numerics/cases.py``, one seed), then plays its part of a
DCP x TP deployment as vLLM lays one out (its merge: ``vllm/attention/ops/common.py``, ``cp_lse_ag_out_rs``; token
placement: ``vllm/v1/attention/backends/utils.py``, ``get_dcp_local_seq_lens``):

- TP: rank ``r`` owns query heads ``[r * h_q / W, (r + 1) * h_q / W)``; the ranks all-gather q along the heads, so
  each attends with every head over its own tokens;
- DCP: token ``t`` of a request lives on rank ``(t // interleave) % W``; each rank builds its own cache (blocks in a
  random order of its own, NaN in every slot it does not use), block table (2147480000 past a request's blocks)
  and local ``cache_seqlens``, and plans with ``plan_decode`` on them;
- the ranks all-gather ``out`` and ``lse``, merge them with :func:`mla_dispatch.merge_shards`, and check their
  own heads against the same backend run on the whole cache on one rank and against the float64 oracle
  (tests/oracle64.py), with the backend's tolerance (docs/design.md §5). Outputs are NaN-poisoned before every run.

Requests of length 1 (rank 1 holds none of their tokens) and 0 (no rank does) check the empty-shard conventions.

Launch: :func:`launch` spawns the ranks (``torch.multiprocessing``, a TCP rendezvous on 127.0.0.1) and returns
rank 0's records; ``torchrun --nproc-per-node 2 tests/dcp_ranks.py --device cuda`` runs the same ranks under
torchrun and prints them. Communication: ``gloo`` on CPU tensors, ``nccl`` with one GPU per rank, or ``gloo`` with
every rank on ``cuda:0`` (tensors staged through the host), which runs the GPU backends' side on a one-GPU machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist

from mla_dispatch import merge_shards, plan_decode
from mla_dispatch.dispatch.registry import get_backend
from mla_dispatch.dispatch.select import NoBackendError
from mla_dispatch.kvcache.formats import pack_ds_mla
from mla_dispatch.numerics.cases import UNUSED_BLOCK_ID, DecodeCase, make_case, poisoned_outputs
from mla_dispatch.numerics.tolerance import compare_outputs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from oracle64 import naive_attention  # noqa: E402

__all__ = ["DcpCase", "CPU_CASES", "INTERPRETER_CASES", "GPU_CASES", "GPU_BACKENDS", "shard_case", "shorten",
           "default_jobs", "spawn", "launch", "run_rank"]


@dataclasses.dataclass(frozen=True)
class DcpCase:
    """One global problem: ``make_case`` arguments, lengths forced onto the last requests, the DCP interleave."""

    name: str
    make: dict
    last_lengths: tuple[int, ...] = (1, 0)
    interleave: int = 1


CPU_CASES = [
    DcpCase("bf16-b5xs1xh8-ps16", dict(batch=5, q_len=1, num_heads_q=8, seqlen=60, page_size=16)),
    DcpCase("fp16-b4xs2xh4-ps64-noncausal", dict(batch=4, q_len=2, num_heads_q=4, seqlen=50, page_size=64,
                                                dtype=torch.float16)),
    DcpCase("fp8dsmla-b3xs1xh4-ps16-i8", dict(batch=3, q_len=1, num_heads_q=4, seqlen=70, page_size=16,
                                              kv_format="fp8_ds_mla"), interleave=8),
]
#: Cases the Triton interpreter runs on the CPU (fp16: its tl.dot on bf16 is wrong, docs/design.md §7).
INTERPRETER_CASES = [
    DcpCase("fp16-b3xs1xh4-ps16", dict(batch=3, q_len=1, num_heads_q=4, seqlen=40, page_size=16,
                                       dtype=torch.float16)),
]
GPU_CASES = [
    DcpCase("bf16-b8xs1xh32-ps64", dict(batch=8, q_len=1, num_heads_q=32, seqlen=600, page_size=64)),
    DcpCase("bf16-b4xs2xh16-ps64-noncausal-i64", dict(batch=4, q_len=2, num_heads_q=16, seqlen=500, page_size=64),
            interleave=64),
    DcpCase("fp16-b6xs1xh128-ps64", dict(batch=6, q_len=1, num_heads_q=128, seqlen=300, page_size=64,
                                         dtype=torch.float16)),
    DcpCase("fp8e4m3-b4xs1xh16-ps16", dict(batch=4, q_len=1, num_heads_q=16, seqlen=400, page_size=16,
                                           kv_format="fp8_e4m3")),
]
CASES = {c.name: c for c in CPU_CASES + INTERPRETER_CASES + GPU_CASES}


# ----------------------------------------------------------------------------------------------------------------
# Each rank's shard of the cache
# ----------------------------------------------------------------------------------------------------------------

def _poison(kv_format: str, kv: torch.Tensor) -> torch.Tensor:
    """A token of ``kv``'s storage format that decodes to NaN (as ``make_case`` poisons unused slots)."""
    if kv_format in ("bf16", "fp16"):
        return torch.full(kv.shape[-1:], float("nan"), dtype=kv.dtype)
    if kv_format == "fp8_e4m3":
        return torch.full(kv.shape[-1:], 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)  # e4m3fn NaN
    return pack_ds_mla(torch.full((576,), float("nan")))


def _slots(table_row: torch.Tensor, positions: list[int], page_size: int) -> torch.Tensor:
    pos = torch.tensor(positions, dtype=torch.int64)
    return table_row[pos // page_size].to(torch.int64) * page_size + pos % page_size


def shorten(case: DecodeCase, lengths: tuple[int, ...]) -> DecodeCase:
    """``case`` (on the CPU) with its last requests cut to ``lengths``, freed slots and table entries poisoned.

    A request already exactly that long is left as it is (``make_case`` draws lengths down to ``q_len``)."""
    kv, table, lens = case.kv_cache.clone(), case.block_table.clone(), case.cache_seqlens.clone()
    page = kv.shape[1]
    flat = kv.view(-1, *kv.shape[2:])
    poison = _poison(case.kv_format, kv)
    for b, n in zip(range(len(lens) - len(lengths), len(lens)), lengths):
        old = int(lens[b])
        if n > old:
            raise ValueError(f"shorten: request {b} has {old} tokens, cannot cut it to {n}")
        flat[_slots(table[b], list(range(n, old)), page)] = poison
        table[b, math.ceil(n / page):] = UNUSED_BLOCK_ID
        lens[b] = n
    return dataclasses.replace(case, kv_cache=kv, block_table=table, cache_seqlens=lens)


def shard_case(case: DecodeCase, rank: int, world: int, *, interleave: int = 1,
               generator: torch.Generator) -> DecodeCase:
    """Rank ``rank``'s shard of ``case`` (on the CPU): the tokens ``t`` with ``(t // interleave) % world == rank``,
    in order, in a cache of the same page size and format with its own random block order, NaN in every unused slot
    and 2147480000 in every unused table entry; ``cache_seqlens`` the local counts."""
    kv, table, lens = case.kv_cache, case.block_table, case.cache_seqlens.tolist()
    page = kv.shape[1]
    mine = [[t for t in range(n) if (t // interleave) % world == rank] for n in lens]
    local_lens = [len(m) for m in mine]
    max_blocks = max(1, math.ceil(max(local_lens, default=0) / page))
    num_blocks = len(lens) * max_blocks + 2
    local_table = torch.randperm(num_blocks, generator=generator)[: len(lens) * max_blocks].view(len(lens), -1)
    local_kv = _poison(case.kv_format, kv).expand(num_blocks, page, *kv.shape[2:]).clone()
    src, dst = kv.view(-1, *kv.shape[2:]), local_kv.view(-1, *kv.shape[2:])
    for b, positions in enumerate(mine):
        if positions:
            dst[_slots(local_table[b], list(range(len(positions))), page)] = src[_slots(table[b], positions, page)]
        local_table[b, math.ceil(len(positions) / page):] = UNUSED_BLOCK_ID
    return dataclasses.replace(case, kv_cache=local_kv, block_table=local_table.to(torch.int32),
                               cache_seqlens=torch.tensor(local_lens, dtype=torch.int32))


def _to(case: DecodeCase, device) -> DecodeCase:
    move = {f: getattr(case, f).to(device) for f in ("q", "kv_cache", "block_table", "cache_seqlens", "kv_scale")
            if getattr(case, f) is not None}
    return dataclasses.replace(case, **move)


# ----------------------------------------------------------------------------------------------------------------
# One rank
# ----------------------------------------------------------------------------------------------------------------

class _Comm:
    """all-gather over the process group; with gloo, CUDA tensors travel through the host."""

    def __init__(self, backend: str, world: int):
        self.staged = backend == "gloo"
        self.world = world

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        src = t.cpu() if self.staged else t.contiguous()
        bufs = [torch.full_like(src, float("nan")) for _ in range(self.world)]
        dist.all_gather(bufs, src)
        return [b.to(t.device) for b in bufs]

    def objects(self, obj) -> list:
        got = [None] * self.world
        dist.all_gather_object(got, obj)
        return got


def _run_local(plan_case: DecodeCase, q: torch.Tensor, backend: str):
    """Plan and run ``backend`` on ``plan_case`` with query ``q``, into NaN-poisoned outputs."""
    plan = plan_decode(q, plan_case.kv_cache, plan_case.block_table, plan_case.cache_seqlens, backend=backend,
                       **plan_case.kwargs())
    out, lse = poisoned_outputs(dataclasses.replace(plan_case, q=q))
    return plan.run(q, plan_case.kv_cache, kv_scale=plan_case.kv_scale, out=out, lse=lse)


_MEMO: dict = {}


def _global_case(spec: DcpCase, seed: int) -> DecodeCase:
    """The whole problem (on the CPU), the same on every rank; made once per case (every backend runs it)."""
    if ("case", spec.name, seed) not in _MEMO:
        case = make_case(**spec.make, generator=torch.Generator().manual_seed(seed))
        _MEMO["case", spec.name, seed] = shorten(case, spec.last_lengths)
    return _MEMO["case", spec.name, seed]


def _oracle(spec: DcpCase, seed: int, heads: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 out and lse of the whole problem for ``heads``, once per case."""
    if ("oracle", spec.name, seed, heads.start) not in _MEMO:
        case = _global_case(spec, seed)
        _MEMO["oracle", spec.name, seed, heads.start] = naive_attention(
            dataclasses.replace(case, q=case.q[:, :, heads]))
    return _MEMO["oracle", spec.name, seed, heads.start]


def _one_case(comm: _Comm, rank: int, world: int, device: torch.device, backend: str, spec: DcpCase,
              seed: int) -> dict:
    """Rank ``rank``'s part of one case; every rank makes the same collective calls whatever happens locally."""
    record = {"id": f"{backend}-{spec.name}-dcp{world}", "rank": rank, "seed": seed}
    start = time.monotonic()
    whole = _global_case(spec, seed)
    h_q = whole.q.shape[2]
    heads = slice(rank * h_q // world, (rank + 1) * h_q // world)
    # TP: this rank's heads of q, gathered along the heads so that every rank attends with all of them.
    q = torch.cat(comm.all_gather(whole.q[:, :, heads].contiguous().to(device)), dim=2)
    local = _to(shard_case(whole, rank, world, interleave=spec.interleave,
                           generator=torch.Generator().manual_seed(seed + 1 + rank)), device)
    status, result = "ok", None
    try:
        result = _run_local(local, q, backend)
    except NoBackendError as exc:
        status = "skip: " + "; ".join(line[4:] for line in str(exc).splitlines() if line.startswith("  - "))
    except Exception:  # noqa: BLE001 - reported with its traceback, the other ranks must not wait for this one
        status = "fail: " + traceback.format_exc(limit=6)
    statuses = comm.objects(status)
    if any(s != "ok" for s in statuses):
        bad = next(s for s in statuses if s != "ok")
        return {**record, "status": bad.split(":")[0], "message": f"rank {statuses.index(bad)}: {bad}"}

    outs, lses = comm.all_gather(result[0]), comm.all_gather(result[1])
    try:  # no collective below: a failure here is this rank's record
        failed = _check(whole, _oracle(spec, seed, heads), device, backend, heads, outs, lses)
    except Exception:  # noqa: BLE001
        failed = [traceback.format_exc(limit=6)]
    message = "; ".join(failed) if failed else f"ok, local lengths {local.cache_seqlens.tolist()}"
    return {**record, "status": "fail" if failed else "ok", "message": message,
            "seconds": round(time.monotonic() - start, 2)}


def _check(whole: DecodeCase, want, device, backend: str, heads: slice, outs, lses) -> list[str]:
    """Merge the gathered shards; check this rank's heads against one rank's run on ``whole`` and against the
    float64 ``want``. Returns what failed."""
    whole = _to(whole, device)
    merged = poisoned_outputs(whole)
    merge_shards(outs, lses, out=merged[0], lse=merged[1])
    single = _run_local(whole, whole.q, backend)
    mine = [(o[:, :, heads].cpu(), l[:, heads].cpu()) for o, l in (merged, single)]
    tol = get_backend(backend).TOLERANCE
    checks = {
        "merged vs float64": compare_outputs(*mine[0], want[0].float(), want[1].float(), tol),
        "one rank vs float64": compare_outputs(*mine[1], want[0].float(), want[1].float(), tol),
        "merged vs one rank": compare_outputs(*mine[0], mine[1][0].float(), mine[1][1], tol),
    }
    return [f"{name}: {r.message}" for name, r in checks.items() if not r]


def run_rank(rank: int, world: int, init_method: str, comm_backend: str, device_kind: str,
             jobs: list[tuple[str, str]], seed: int, result_path: str | None, *, destroy: bool = True) -> list[dict]:
    """One rank: join the group, run every ``(backend, case name)`` of ``jobs``, gather the records on rank 0
    (written to ``result_path`` as JSON when given) and return them. ``destroy=False`` leaves the group to the
    process's end (see :func:`_spawned`)."""
    if device_kind == "cuda":
        device = torch.device("cuda", rank if comm_backend == "nccl" else 0)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # one thread per rank, as torchrun sets OMP_NUM_THREADS=1: the ranks share the CPU
    extra = {"device_id": device} if comm_backend == "nccl" else {}
    dist.init_process_group(comm_backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300), **extra)
    try:
        comm = _Comm(comm_backend, world)
        records = []
        for backend, name in jobs:
            records.append(_one_case(comm, rank, world, device, backend, CASES[name], seed + list(CASES).index(name)))
        everyone = comm.objects(records)
        merged = [r for rank_records in everyone for r in rank_records]
        if rank == 0 and result_path:
            with open(result_path + ".part", "w") as f:
                json.dump(merged, f)
            os.replace(result_path + ".part", result_path)
        dist.barrier()  # nothing is in flight past here
    finally:
        if destroy:
            dist.destroy_process_group()
    return merged


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(target, world: int, args: tuple, timeout_s: float, seed: int) -> None:
    """Run ``target(rank, init_method, *args)`` in ``world`` spawned processes (a TCP rendezvous on 127.0.0.1 as
    ``init_method``), wait for them and kill them after ``timeout_s``.

    Raises
    ------
    RuntimeError
        A rank raised or died, or the ranks ran past ``timeout_s`` (with what is known, and ``seed``).
    """
    import torch.multiprocessing as mp

    ctx = mp.start_processes(target, args=(f"tcp://127.0.0.1:{_free_port()}",) + tuple(args), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {world} ranks ran past {timeout_s:.0f} s (seed {seed})")
    except mp.ProcessRaisedException as exc:
        raise RuntimeError(f"a rank raised (seed {seed}):\n{exc}") from None
    except mp.ProcessExitedException as exc:
        raise RuntimeError(f"a rank died (seed {seed}): {exc}") from None
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


def _spawned(rank, init_method, world, *args):
    # A spawned rank ends with os._exit once its records are written and every rank has passed the last barrier:
    # gloo's teardown at interpreter exit (its worker threads, tensors they hold) aborted a rank with
    # "terminate called without an active exception" on a CI machine after the work was done (torch 2.13; see
    # pytorch/pytorch#179291 on gloo threads at finalization). An exception still propagates to spawn's error queue.
    run_rank(rank, world, init_method, *args, destroy=False)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(world: int, comm_backend: str, device_kind: str, jobs: list[tuple[str, str]], seed: int,
           result_path: str, timeout_s: float) -> dict[str, list[dict]]:
    """Spawn ``world`` ranks of :func:`run_rank` (see :func:`spawn`) and return rank 0's records by id."""
    spawn(_spawned, world, (world, comm_backend, device_kind, jobs, seed, result_path), timeout_s, seed)
    with open(result_path) as f:
        records = json.load(f)
    by_id: dict[str, list[dict]] = {}
    for r in records:
        by_id.setdefault(r["id"], []).append(r)
    return by_id


#: The GPU backends the two-GPU run covers (each skips with its own reason where it cannot run).
GPU_BACKENDS = ["cuda_sm90", "triton", "flashinfer", "flashmla"]


def default_jobs(device_kind: str, backends: list[str] | None = None) -> list[tuple[str, str]]:
    """``(backend, case name)`` pairs: on the GPU every backend of :data:`GPU_BACKENDS` on :data:`GPU_CASES`; on the
    CPU the reference on :data:`CPU_CASES` and triton (under ``TRITON_INTERPRET=1``) on :data:`INTERPRETER_CASES`."""
    if device_kind == "cuda":
        return [(b, c.name) for b in (backends or GPU_BACKENDS) for c in GPU_CASES]
    cases = {"reference": CPU_CASES, "triton": INTERPRETER_CASES}
    return [(b, c.name) for b in (backends or ["reference"]) for c in cases.get(b, CPU_CASES)]


def main() -> int:
    ap = argparse.ArgumentParser(description="DCP x TP decode across processes (see the module docstring).")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--comm", choices=["nccl", "gloo"], default=None, help="default: nccl on cuda, gloo on cpu")
    ap.add_argument("--backends", default=None, help=f"comma-separated (default on cuda: {','.join(GPU_BACKENDS)}; "
                    "on cpu: reference; triton needs TRITON_INTERPRET=1)")
    ap.add_argument("--seed", type=int, default=int(os.environ.get("MLA_DISPATCH_SEED", "0")))
    ap.add_argument("--world", type=int, default=2, help="ranks to spawn when not under torchrun")
    ap.add_argument("--json", default=None, help="write rank 0's records here")
    a = ap.parse_args()
    comm = a.comm or ("nccl" if a.device == "cuda" else "gloo")
    jobs = default_jobs(a.device, a.backends.split(",") if a.backends else None)
    if "RANK" in os.environ:  # under torchrun: env:// rendezvous, one process per rank
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        records = run_rank(rank, world, "env://", comm, a.device, jobs, a.seed, a.json)
        if rank != 0:
            return 0
    else:
        path = a.json or f"/tmp/dcp_ranks_{os.getpid()}.json"
        records = [r for rs in launch(a.world, comm, a.device, jobs, a.seed, path, 600).values() for r in rs]
    for r in records:
        print(json.dumps(r))
    return int(any(r["status"] == "fail" for r in records))


if __name__ == "__main__":
    sys.exit(main())
