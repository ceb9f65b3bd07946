"""Bad block tables and sequence lengths: what each backend makes of them (issue 45, item 5).

With ``validate=False`` (the default) nothing checks the values of ``block_table`` / ``cache_seqlens`` on the host,
so no such input may make a kernel read or write outside its tensors, and the results follow one rule, the
reference's (``numerics/oracle.py``, ``mla_decode``'s docstring):

- request ``b``'s tokens are its first ``clamp(L_b, 0, max_blocks * page_size)`` (a negative length is 0; past the
  table's capacity, the tokens its row can address; the causal cut is still counted from ``L_b``);
- a block id outside ``[0, num_blocks)`` among the entries those tokens use makes all of request ``b``'s ``out`` rows
  and its ``lse`` NaN, and changes nothing else: every other request's rows are bitwise those of a run on the same
  inputs with that request's table and length repaired;
- entries past the tokens' pages are never read (garbage there is legal);
- ``validate=True`` raises a ValueError naming ``block_table`` or ``cache_seqlens`` and the offending request.

Each case runs each backend on the bad inputs and on repaired ones (``out`` and ``lse`` are views into buffers with
a sentinel row on either side, which must stay as they were; the cache sits between two blocks of finite values, so a
kernel reading block -1 or ``num_blocks`` unchecked gives finite rows where NaN is due) and checks: NaN rows exactly
for the requests with a bad id; every other request within the backend's tolerance of the reference; the requests
left alone bitwise equal to the repaired run. One line per case and backend, PASS / FAIL / SKIP (the backend cannot
run the problem: its reason; a backend that is not available at all fails); the exit status is 1 if anything failed.

    python ci/bad_tables.py --backends triton,cuda_sm90,reference
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python ci/bad_tables.py --backends triton,cuda_sm90

(without the caching allocator every tensor is its own allocation, so memcheck sees a read past one). A backend may
carry ``backend_options`` for its plans, ``name:key=value:...``: ``cuda_sm90:variant=5`` forces that mainloop, and a
forced choice that cannot run a case is a SKIP with the backend's reason. Every mainloop of ``cuda_sm90`` (its plan
takes v2 for all of these shapes), in the command above:

    V=cuda_sm90:variant
    ... --backends cuda_sm90,$V=2:fuse_combine=true,$V=5,$V=6,$V=6:fuse_combine=true,$V=7,$V=8,$V=9

On an H100 the Triton backend takes its Gluon kernels here: the seesaw kernel for bf16 on page 64, ``gluon_sm90``
(every tile gathered) on pages 1 and 16 and for fp8_e4m3 with 64 heads, the tokens-on-M fp8 kernel for fp8_e4m3 with
16 heads, the plain kernel for fp8_ds_mla; ``triton:kernel=gluon`` sends page 64 to ``gluon_sm90``'s TMA path and the
16-head fp8 cases to ``gluon_sm90``. On a CPU: ``--device cpu --small`` (float16, small shapes; Triton under
``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from typing import Callable

import torch

from mla_dispatch.tools.args import backend_spec

INT32_MAX = 2**31 - 1
INT32_MIN = -(2**31)
SENTINEL = 1024.0  # written around out and lse; exact in every float type


@dataclasses.dataclass(frozen=True)
class BadCase:
    """One kind of bad input (``id`` short, ``name`` what it is). ``mutate(table, lens, geometry)`` edits the int64 host copies in place and returns the
    requests it touched; ``finite`` replaces the NaN of unused cache slots with values (for requests whose repaired
    rows read whole pages)."""

    id: str
    name: str
    mutate: Callable
    q_len: int = 1
    causal: bool = False
    kv_format: str | None = None  # None: q's dtype
    heads: int | None = None  # None: the run's default
    finite: bool = False
    expect_validate: str | None = "block_table"  # what validate=True must name; None: it must pass


@dataclasses.dataclass(frozen=True)
class Geometry:
    num_blocks: int
    page_size: int
    max_blocks: int

    @property
    def capacity(self) -> int:
        return self.max_blocks * self.page_size

    def live_blocks(self, length: int) -> int:
        return -(-min(max(length, 0), self.capacity) // self.page_size)


def _set_id(b: int, which: str, block_id: Callable[[Geometry], int]):
    def mutate(table, lens, g: Geometry):
        n = g.live_blocks(int(lens[b]))
        j = {"first": 0, "middle": n // 2, "last": n - 1}[which]
        table[b, j] = block_id(g)
        return {b}
    return mutate


def _fill_row(table, b, g: Geometry):
    """Every entry of row ``b`` a valid id (blocks may be shared: the cache is read only)."""
    table[b] = torch.arange(g.max_blocks) % g.num_blocks


def _length(b: int, length: Callable[[Geometry], int], bad_id: int | None = None):
    def mutate(table, lens, g: Geometry):
        lens[b] = length(g)
        if lens[b] > 0:
            _fill_row(table, b, g)
            if bad_id is not None:
                table[b, g.max_blocks // 2] = bad_id
        return {b}
    return mutate


def _mixed(table, lens, g: Geometry):
    touched = set()
    for b, block_id in ((0, -1), (2, g.num_blocks)):
        if b < table.shape[0]:
            table[b, g.live_blocks(int(lens[b])) - 1] = block_id
            touched.add(b)
    return touched


def _garbage_past_length(table, lens, g: Geometry):
    for b in range(table.shape[0]):
        n = g.live_blocks(int(lens[b]))
        junk = torch.tensor([-1, g.num_blocks, INT32_MAX, INT32_MIN])
        table[b, n:] = junk[torch.arange(g.max_blocks - n) % 4]
    return set()


CASES = [
    BadCase("id-1", "block id -1 in request 1's live part", _set_id(1, "middle", lambda g: -1)),
    BadCase("id-nb", "block id num_blocks in request 1's live part", _set_id(1, "last", lambda g: g.num_blocks)),
    BadCase("id-int32max", "block id 2^31-1 in request 0's live part", _set_id(0, "first", lambda g: INT32_MAX)),
    BadCase("id-int32min", "block id -2^31 in request 2's live part", _set_id(2, "last", lambda g: INT32_MIN)),
    BadCase("mixed", "requests 0 and 2 with bad ids (-1, num_blocks), the others good", _mixed),
    BadCase("garbage", "control: bad ids past every request's pages only", _garbage_past_length,
            expect_validate=None),
    BadCase("len-neg", "request 1 of length -7", _length(1, lambda g: -7), expect_validate="cache_seqlens"),
    BadCase("len-cap", "request 0 37 tokens past max_blocks * page_size", _length(0, lambda g: g.capacity + 37),
            finite=True, expect_validate="cache_seqlens"),
    BadCase("len-int32max", "request 2 of length 2^31-1", _length(2, lambda g: INT32_MAX), finite=True,
            expect_validate="cache_seqlens"),
    BadCase("len-cap-id-1", "request 1 past its capacity, with a block id -1",
            _length(1, lambda g: g.capacity + 5, bad_id=-1), finite=True, expect_validate="cache_seqlens"),
    BadCase("causal-id-nb", "s_q=2 causal, block id num_blocks in request 1",
            _set_id(1, "middle", lambda g: g.num_blocks), q_len=2, causal=True),
    BadCase("causal-len-cap", "s_q=2 causal, request 0 past its capacity", _length(0, lambda g: g.capacity + 3),
            q_len=2, causal=True, finite=True, expect_validate="cache_seqlens"),
    BadCase("fp8-id-1", "fp8_e4m3 cache, block id -1 in request 1", _set_id(1, "middle", lambda g: -1),
            kv_format="fp8_e4m3"),
    BadCase("fp8-h64-id-nb", "fp8_e4m3 cache, 64 heads, block id num_blocks in request 0",
            _set_id(0, "last", lambda g: g.num_blocks), kv_format="fp8_e4m3", heads=64),
    BadCase("dsmla-id-nb", "fp8_ds_mla cache, block id num_blocks in request 1",
            _set_id(1, "middle", lambda g: g.num_blocks), kv_format="fp8_ds_mla"),
]


@dataclasses.dataclass
class Inputs:
    case: object  # numerics.cases.DecodeCase, on the run's device, with the guarded cache
    bad_table: torch.Tensor
    bad_lens: torch.Tensor
    good_table: torch.Tensor
    good_lens: torch.Tensor
    poisoned: list[bool]  # per request: a bad id among the entries its tokens use
    touched: set


def _guarded_cache(case, gen, device) -> torch.Tensor:
    """The case's cache on ``device`` as a view between two blocks of finite values (what an unchecked read of block
    -1 or ``num_blocks`` would find)."""
    from mla_dispatch.kvcache.formats import pack_ds_mla, quantize_fp8_e4m3

    kv = case.kv_cache
    guard = (torch.randn(2, *kv.shape[1:3], case.q.shape[-1], generator=gen) / 10).clamp(-1, 1)
    if case.kv_format == "fp8_e4m3":
        guard = quantize_fp8_e4m3(guard, case.kv_scale)
    elif case.kv_format == "fp8_ds_mla":
        guard = pack_ds_mla(guard)
    else:
        guard = guard.to(kv.dtype)
    big = torch.cat([guard[:1], kv, guard[1:]]).to(device)
    return big[1:-1]


def build_inputs(bad: BadCase, *, page_size: int, dtype: torch.dtype, batch: int, heads: int, seqlen: int,
                 device: str, seed: int) -> Inputs:
    from mla_dispatch.numerics.cases import make_case

    gen = torch.Generator().manual_seed(seed)
    case = make_case(batch, bad.q_len, bad.heads or heads, seqlen, page_size=page_size, dtype=dtype,
                     kv_format=bad.kv_format, causal=bad.causal, generator=gen)
    if bad.finite:  # (bf16 / fp16 / fp8_e4m3 caches)
        if case.kv_format == "fp8_e4m3":
            nan = case.kv_cache.view(torch.uint8) == 0x7F
            case.kv_cache.view(torch.uint8)[nan] = 0x30  # 0.5 in e4m3
        else:
            nan = torch.isnan(case.kv_cache)
            case.kv_cache[nan] = (torch.randn(int(nan.sum()), generator=gen) / 10).to(case.kv_cache.dtype)
    g = Geometry(case.kv_cache.shape[0], page_size, case.block_table.shape[1])
    table = case.block_table.to(torch.int64)
    lens = case.cache_seqlens.to(torch.int64)
    touched = bad.mutate(table, lens, g)
    poisoned = []
    for b in range(batch):
        n = g.live_blocks(int(lens[b]))
        ids = table[b, :n]
        poisoned.append(bool(((ids < 0) | (ids >= g.num_blocks)).any()))
    good_table = table.clone()
    for b in range(batch):
        n = g.live_blocks(int(lens[b]))
        row = good_table[b, :n]
        row[(row < 0) | (row >= g.num_blocks)] = 0
    good_lens = lens.clamp(0, g.capacity)
    dev = torch.device(device)
    kv = _guarded_cache(case, gen, dev)
    case = dataclasses.replace(case, q=case.q.to(dev), kv_cache=kv,
                               kv_scale=None if case.kv_scale is None else case.kv_scale.to(dev))
    i32 = torch.int32
    return Inputs(case, table.to(i32).to(dev), lens.to(i32).to(dev), good_table.to(i32).to(dev),
                  good_lens.to(i32).to(dev), poisoned, touched)


def _guarded_outputs(case):
    b, s, h, _ = case.q.shape
    big_out = torch.full((b + 2, s, h, case.head_dim_v), SENTINEL, dtype=case.q.dtype, device=case.q.device)
    big_lse = torch.full((b + 2, h, s), SENTINEL, dtype=torch.float32, device=case.q.device)
    return big_out, big_lse


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _run(backend: str, inp: Inputs, table, lens, tweak_plan=None):
    """(out, lse, problems with the sentinel rows) of ``backend`` (a :func:`backend_spec`) on the case with ``table``
    / ``lens``; ``tweak_plan(plan)`` may change the plan before it runs (tests force split schedules and kernel
    configs)."""
    from mla_dispatch import plan_decode

    c = inp.case
    kwargs = dict(c.kwargs(), indices=None)
    name, options = backend_spec(backend)
    plan = plan_decode(c.q, c.kv_cache, table, lens, backend=name, backend_options=options or None, **kwargs)
    if tweak_plan is not None:
        tweak_plan(plan)
    big_out, big_lse = _guarded_outputs(c)
    out, lse = plan.run(c.q, c.kv_cache, kv_scale=c.kv_scale, out=big_out[1:-1], lse=big_lse[1:-1])
    if c.q.is_cuda:
        torch.cuda.synchronize()
    problems = []
    for name, big in (("out", big_out), ("lse", big_lse)):
        for edge in (0, -1):
            if not bool((big[edge] == SENTINEL).all()):
                problems.append(f"wrote outside {name} (the row {'before' if edge == 0 else 'after'} it)")
    return out, lse, problems


def check_backend(backend: str, inp: Inputs, tweak_plan=None) -> tuple[str, str]:
    """``("PASS" | "FAIL" | "SKIP", message)`` for one backend (a :func:`backend_spec`) on one case (``tweak_plan``
    as in :func:`_run`)."""
    from mla_dispatch.dispatch.backend import ReasonCode
    from mla_dispatch.dispatch.select import NoBackendError
    from mla_dispatch.dispatch.registry import get_backend
    from mla_dispatch.numerics.oracle import reference_attention
    from mla_dispatch.numerics.tolerance import compare_outputs

    c = inp.case
    try:
        out, lse, problems = _run(backend, inp, inp.bad_table, inp.bad_lens, tweak_plan)
        good_out, good_lse, good_problems = _run(backend, inp, inp.good_table, inp.good_lens, tweak_plan)
    except NoBackendError as exc:
        reasons = exc.report.candidates[0][2]
        text = "; ".join(str(r) for r in reasons)
        if any(r.code in (ReasonCode.UNAVAILABLE, ReasonCode.NOT_IMPLEMENTED) for r in reasons):
            return "FAIL", f"the backend is not available here: {text}"  # asked for by name: not a skip
        return "SKIP", text
    except ValueError as exc:
        if str(exc).startswith("backend_options[") and "cannot run" in str(exc):  # a forced choice that does not fit
            return "SKIP", str(exc)
        return "FAIL", f"raised ValueError: {str(exc)[:300]}"
    except Exception as exc:
        return "FAIL", f"raised {type(exc).__name__}: {str(exc)[:300]}"
    problems += [p + " (repaired run)" for p in good_problems]
    try:
        ref_out, ref_lse = reference_attention(c.q, c.kv_cache, inp.bad_table, inp.bad_lens, **dict(c.kwargs(),
                                                                                                       indices=None))
    except Exception as exc:
        ref_out = ref_lse = None
        problems.append(f"the reference raised {type(exc).__name__}: {str(exc)[:200]}")
    tol = get_backend(backend_spec(backend)[0]).TOLERANCE
    out, lse = out.cpu(), lse.cpu()
    for b, bad in enumerate(inp.poisoned):
        if bad:
            if not (bool(torch.isnan(out[b]).all()) and bool(torch.isnan(lse[b]).all())):
                problems.append(f"request {b}: out/lse not all NaN ({int((~torch.isnan(out[b])).sum())} out and "
                                f"{int((~torch.isnan(lse[b])).sum())} lse values are not)")
            continue
        if ref_out is not None:
            rep = compare_outputs(out[b], lse[b], ref_out[b].cpu(), ref_lse[b].cpu(), tol)
            if not rep:
                problems.append(f"request {b} vs the reference: {rep.message}")
        if b not in inp.touched and not (torch.equal(_bits(out[b]), _bits(good_out[b].cpu()))
                                         and torch.equal(_bits(lse[b]), _bits(good_lse[b].cpu()))):
            problems.append(f"request {b}: not bitwise equal to the repaired run")
    if problems:
        return "FAIL", "; ".join(problems)
    nan_rows = [b for b, bad in enumerate(inp.poisoned) if bad]
    return "PASS", f"NaN requests {nan_rows}, the others as the reference and the repaired run"


def check_validate(bad: BadCase, inp: Inputs) -> tuple[str, str]:
    """``validate=True`` raises a ValueError naming the argument and a touched request (or passes, for controls)."""
    from mla_dispatch import plan_decode

    c = inp.case
    try:
        plan_decode(c.q, c.kv_cache, inp.bad_table, inp.bad_lens, backend="reference", validate=True,
                    **dict(c.kwargs(), indices=None))
    except ValueError as exc:
        msg = str(exc)
        if bad.expect_validate is None:
            return "FAIL", f"validate=True rejected good inputs: {msg}"
        rows = re.search(r"rows \[([0-9, ]*)\]", msg)
        named = (bad.expect_validate in msg and rows is not None
                 and bool(inp.touched & {int(r) for r in rows.group(1).split(",") if r.strip()}))
        return ("PASS" if named else "FAIL"), msg
    if bad.expect_validate is None:
        return "PASS", "validate=True accepts them"
    return "FAIL", "validate=True did not raise"


def run_catalogue(backends, *, device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
                  page_sizes=(1, 16, 64), small: bool = False, names=None, seed: int = 0, emit=print,
                  tweak_plan=None):
    """Run every case (``names``: only those ids) with every page size on every backend; ``emit(status, backend,
    case_id, message)`` for each line; ``tweak_plan(plan)`` as in :func:`_run`. Returns the number of failures."""
    shape = dict(batch=3, heads=2, seqlen=40) if small else dict(batch=4, heads=16, seqlen=300)
    failures = 0
    for i, bad in enumerate(CASES):
        if names is not None and bad.id not in names:
            continue
        for page_size in page_sizes:
            case_id = f"{bad.id}-ps{page_size}"
            inp = build_inputs(bad, page_size=page_size, dtype=dtype, device=device, seed=seed + i, **shape)
            status, msg = check_validate(bad, inp)
            failures += status == "FAIL"
            emit(status, "validate", case_id, msg)
            for backend in backends:
                status, msg = check_backend(backend, inp, tweak_plan)
                failures += status == "FAIL"
                emit(status, backend, case_id, msg)
    return failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="triton,cuda_sm90,reference",
                        help="comma-separated, each name[:key=value...] (backend_options, e.g. cuda_sm90:variant=5)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--page-sizes", default="1,16,64")
    parser.add_argument("--small", action="store_true", help="float16, 3 requests of ~40 tokens, 2 heads (CPU)")
    parser.add_argument("--cases", default=None, help="comma-separated case ids (default: all; --list shows them)")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.list:
        for bad in CASES:
            print(f"{bad.id:<16} {bad.name}")
        return 0

    def emit(status, backend, case_id, msg):
        print(f"{status} {backend:<9} {case_id:<22} {msg}", flush=True)

    failures = run_catalogue(
        [b for b in args.backends.split(",") if b], device=args.device,
        dtype=torch.float16 if args.small else torch.bfloat16,
        page_sizes=tuple(int(p) for p in args.page_sizes.split(",")), small=args.small,
        names=None if args.cases is None else set(args.cases.split(",")), seed=args.seed, emit=emit)
    print(f"{failures} failed", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
