"""``python -m mla_dispatch conformance``: every available backend against the reference.

A generated case set walks the feature grid of docs/design.md §1–2 — page sizes,
query heads, KV heads, query length, causal, variable lengths, zero-length
requests, NaN-poisoned unused slots, head dims, the softmax scale, KV formats,
sparse indices and their optional arguments (DeepSeek-V4's cache, attention
sinks, topk_length, a second cache) — with the test data of :func:`mla_dispatch.numerics.cases.make_case`
(every case carries NaN in all unused cache slots and out-of-range ids in
unused block-table entries; the ``nan-poison`` row makes them the majority).
Each backend runs each case through :func:`mla_dispatch.mla_decode` and is
compared with the fp32 reference at the backend's declared tolerance
(docs/design.md §5). A vendor backend (one that declares ``VENDOR``) runs its
cells in a child process of its own: a vendor library that aborts the process
or faults the device fails the cell it was running (with how the child died and
its last stderr lines), a fresh child runs the cells after it, and the run goes on.

The result is a matrix: rows = case class, columns = backends, cells =
``pass``, ``FAIL (worst error)``, ``ERROR (exception)`` or ``unsupported
(the backend's own reason)``; the ``reference`` backend's own cells read ``oracle``
(compared with itself they show only that the harness runs it, and are never
counted as passes). The exit code is 1 if any cell failed or raised,
or if nothing was checked (every cell unsupported, or only the reference, the
oracle itself, ran); 2 for a usage mistake.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pickle
import random
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

import torch

from mla_dispatch.api import mla_decode
from mla_dispatch.dispatch.platform import platform_for
from mla_dispatch.dispatch.problem import describe_inputs
from mla_dispatch.dispatch.registry import get_backend, registered_names
from mla_dispatch.dispatch.select import NoBackendError
from mla_dispatch.numerics.cases import DecodeCase, make_case
from mla_dispatch.numerics.tolerance import compare_outputs
from mla_dispatch.tools.args import (CommandParser, UsageError, backend_names, parse_device, seed_int, usage_error,
                                     writable_file)

__all__ = ["ConformanceCase", "Cell", "case_set", "large_case_set", "run_conformance", "run_isolated", "isolated",
           "format_matrix", "main"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: The backend that computes what the cells are compared with (numerics/oracle.py behind a registered op).
ORACLE = "reference"


@dataclasses.dataclass(frozen=True)
class ConformanceCase:
    """One row of the matrix: a feature class and the ``make_case`` arguments that exercise it."""

    name: str
    feature: str  # which docs/design.md §1–2 feature it covers
    params: dict

    def make(self, device: torch.device, generator: torch.Generator, dtype: torch.dtype | None = None) -> DecodeCase:
        """The case's data on ``device``; ``dtype`` (q's, and a dense cache's) replaces the case's own (bf16 unless
        the case is about fp16)."""
        params = dict(self.params)
        if dtype is not None:
            params["dtype"] = dtype
        if "bench" in params:  # a large case: generated on the device, chunk by chunk, as `bench` does
            from mla_dispatch.tools.bench import BenchConfig, make_bench_case

            cfg = BenchConfig(**params.pop("bench"))
            seed = int(torch.randint(1 << 30, (1,), generator=generator))
            return make_bench_case(cfg, device=device, seed=seed, **params)
        return make_case(**params, device=device, generator=generator)


#: Pages of 64 bf16 tokens past which a cache holds more than 2^32 elements (576 per token).
_PAGES_PAST_2_32 = (1 << 32) // (64 * 576) + 1


def large_case_set() -> list[ConformanceCase]:
    """Cases at the sizes where 32-bit offsets overflow (GPU only; ~15 GB of device memory): a cache of more than
    2^32 elements whose few used pages are spread over all of it, and FlashMLA's largest serving shapes (b=128,
    mean length 32K: ~4M cached tokens, > 2^31 elements)."""
    return [
        ConformanceCase("cache > 2^32 elements", "page ids past 2^32 elements (b=8, L~4K, a 10 GB bf16 cache)",
                        {"bench": dict(batch=8, q_len=1, num_heads_q=128, seqlen=4096, varlen=True),
                         "extra_blocks": _PAGES_PAST_2_32 + 20000}),
        ConformanceCase("b=128 L~32K", "sum of lengths ~4M tokens, h_q=128",
                        {"bench": dict(batch=128, q_len=1, num_heads_q=128, seqlen=32768, varlen=True)}),
        ConformanceCase("b=128 L~32K s_q=2 causal", "the same with two causal query tokens",
                        {"bench": dict(batch=128, q_len=2, num_heads_q=128, seqlen=32768, varlen=True, causal=True)}),
    ]


def case_set(quick: bool = False) -> list[ConformanceCase]:
    """The generated cases. ``quick``: CI-sized (seconds on a CPU); otherwise bigger and more of them (the large
    caches of :func:`large_case_set` are separate: ``--large``)."""
    b, L, h = (2, 160, 16) if quick else (4, 700, 16)
    base = dict(batch=b, q_len=1, num_heads_q=h, seqlen=L, page_size=64, varlen=True)

    def case(name, feature, full_only=False, **over):
        return None if (quick and full_only) else ConformanceCase(name, feature, {**base, **over})

    ds_scale = 192**-0.5 * (0.1 * math.log(40) + 1.0) ** 2  # DeepSeek-V3: YaRN factor 40, mscale_all_dim 1
    v4 = dict(kv_format="fp8_ds_v4", head_dim_qk=512, head_dim_v=512)
    cases = [
        case("baseline", "bf16, h_q=16, s_q=1, page 64, varlen"),
        *(case(f"page_size={ps}", "page sizes", full_only=ps in (128,), page_size=ps) for ps in (1, 16, 128, 256)),
        *(case(f"h_q={hq}", "query heads", full_only=hq in (32,), num_heads_q=hq) for hq in (32, 64, 128)),
        case("h_kv=2", "KV heads (h_q=32)", num_heads_q=32, num_heads_kv=2),
        case("h_kv=4", "KV heads (h_q=64)", full_only=True, num_heads_q=64, num_heads_kv=4),
        case("s_q=2", "query length, not causal", q_len=2),
        case("s_q=2 causal", "causal (multi-token decode)", q_len=2, causal=True),
        case("s_q=4 causal h_q=64", "causal, longer", full_only=True, q_len=4, num_heads_q=64, causal=True),
        case("fixed length", "every request the same length", varlen=False),
        case("zero-length rows", "L_b = 0: out 0, lse +inf", zero_len_rows=1),
        case("zero-length causal", "L_b = 0 with s_q=2 causal", q_len=2, causal=True, zero_len_rows=1),
        case("nan-poison", "short requests in big pages: most slots NaN", page_size=256, seqlen=12, extra_blocks=6),
        case("long single", "b=1, one long request", batch=1, seqlen=4 * L, varlen=False),
        case("d=512/512", "head dims without RoPE", head_dim_qk=512, head_dim_v=512),
        case("d=320/256", "head dims 256+64", full_only=True, head_dim_qk=320, head_dim_v=256),
        case("DeepSeek scale", "softmax_scale = 1/sqrt(192)*mscale^2", softmax_scale=ds_scale),
        case("fp16", "fp16 q and cache", dtype=torch.float16),
        case("fp8_e4m3", "fp8 cache, per-tensor scale", kv_format="fp8_e4m3"),
        case("fp8_e4m3 s_q=2 causal", "fp8 cache, causal", full_only=True, kv_format="fp8_e4m3", q_len=2, causal=True),
        case("fp8_ds_mla", "656-byte DeepSeek token", kv_format="fp8_ds_mla"),
        case("fp8_ds_mla s_q=2 causal", "656-byte token, causal", kv_format="fp8_ds_mla", q_len=2, causal=True),
        case("sparse topk=64", "token-level sparse (bf16)", topk=64),
        case("sparse fp8_ds_mla topk=128", "DeepSeek Sparse Attention layout", kv_format="fp8_ds_mla", topk=128),
        case("sparse s_q=2 h_q=64", "sparse, two query tokens", full_only=True, q_len=2, num_heads_q=64, topk=96),
        case("sparse fp8_ds_v4 topk=128 sink", "DeepSeek-V4 (FlashMLA MODEL1) cache, attention sink", topk=128,
             attn_sink=True, **v4),
        case("sparse fp8_ds_v4 + extra cache", "V4: a second cache (pages of 2), topk_length, extra_topk_length",
             q_len=2, page_size=61, topk=64, topk_length=True, attn_sink=True, extra_topk=96, extra_page_size=2,
             extra_topk_length=True, **v4),
        case("sparse fp8_ds_mla sink topk_length", "V3.2 cache with FlashMLA's sink and topk_length", full_only=True,
             kv_format="fp8_ds_mla", topk=128, topk_length=True, attn_sink=True),
    ]
    return [c for c in cases if c is not None]


@dataclasses.dataclass
class Cell:
    """One (case, backend) outcome: ``pass``, ``fail``, ``error``, ``unsupported``, or ``oracle`` (the reference
    backend run and compared with the reference computation, i.e. with itself: not a pass), and why."""

    status: str
    detail: str = ""
    max_abs: float | None = None
    cos_diff: float | None = None

    def short(self) -> str:
        if self.status in ("pass", "oracle"):
            return self.status
        if self.status == "fail":
            return f"FAIL ({self.detail})"
        if self.status == "error":
            return f"ERROR ({self.detail})"
        return f"unsupported ({self.detail})"


def _problem(case: DecodeCase):
    return describe_inputs(case.q, case.kv_cache, case.block_table, case.cache_seqlens, head_dim_v=case.head_dim_v,
                           causal=case.causal, kv_format=case.kv_format, kv_scale=case.kv_scale, indices=case.indices,
                           return_lse=True, **case.sparse_extras())


def _unsupported(name: str, case: DecodeCase) -> Cell | None:
    """The ``unsupported`` cell of backend ``name`` on ``case`` (its own reasons), or None where it can run it."""
    reasons = get_backend(name).not_supported_reasons(_problem(case), platform_for(case.q.device))
    return Cell("unsupported", "; ".join(map(str, reasons))) if reasons else None


def _run_cell(name: str, case: DecodeCase, ref: tuple[torch.Tensor, torch.Tensor]) -> Cell:
    """Run backend ``name`` on ``case`` (which it declares it can run) and compare with ``ref`` at its tolerance."""
    cls = get_backend(name)
    try:
        out, lse = mla_decode(*case.args(), **case.kwargs(), backend=name)
        report = compare_outputs(out, lse, ref[0], ref[1], cls.TOLERANCE)
    except NoBackendError as exc:  # it declined here (e.g. its module does not import in a child process)
        why = "; ".join(str(r) for _, _, reasons in exc.report.candidates for r in reasons)
        return Cell("error", f"NoBackendError: {why}"[:300])
    except Exception as exc:
        return Cell("error", f"{type(exc).__name__}: {exc}".splitlines()[0][:200])
    if report:
        status = "oracle" if name == ORACLE else "pass"
        return Cell(status, report.message, report.max_abs, report.cos_diff)
    worst = report.message if report.max_abs == float("inf") else (
        f"max abs {report.max_abs:.3g}, cos diff {report.cos_diff:.3g}: {report.message}")
    return Cell("fail", worst, report.max_abs, report.cos_diff)


def check_backend(name: str, case: DecodeCase, ref: tuple[torch.Tensor, torch.Tensor]) -> Cell:
    """Run backend ``name`` on ``case`` in this process and compare with ``ref`` at its tolerance."""
    return _unsupported(name, case) or _run_cell(name, case, ref)


def _reference(case: DecodeCase) -> tuple[torch.Tensor, torch.Tensor]:
    from mla_dispatch.numerics.oracle import reference_attention

    return reference_attention(case.q, case.kv_cache, case.block_table, case.cache_seqlens, head_dim_v=case.head_dim_v,
                               softmax_scale=case.softmax_scale, causal=case.causal, kv_format=case.kv_format,
                               kv_scale=case.kv_scale, indices=case.indices, **case.sparse_extras())


def isolated(name: str) -> bool:
    """Whether conformance runs backend ``name``'s cells in a child process: a vendor library's (``VENDOR``), which
    may abort the process or fault the device (STYLE 20)."""
    return get_backend(name).VENDOR is not None


def run_conformance(cases: Sequence[ConformanceCase], backends: Sequence[str], *, device: torch.device,
                    seed: int = 0, progress: bool = True, dtype: torch.dtype | None = None
                    ) -> dict[str, dict[str, Cell]]:
    """``{case name: {backend: Cell}}`` for every case and backend; ``dtype`` replaces every case's q dtype.

    A vendor backend's cells (:func:`isolated`) run in a child process of their own (:func:`run_isolated`): a vendor
    library that aborts the process or faults the device fails that backend's cell, and the run goes on.
    """
    from tqdm import tqdm

    matrix: dict[str, dict[str, Cell]] = {}
    bar = tqdm(total=len(cases) * len(backends), desc="conformance", unit="cell", disable=not progress, leave=False,
               file=sys.stderr)
    apart = {name: [] for name in backends if isolated(name)}  # backend -> [(case index, case)] it declares it runs
    for i, spec in enumerate(cases):
        bar.set_postfix_str(spec.name)
        case = spec.make(device, torch.Generator().manual_seed(seed + i), dtype)
        ref = _reference(case)
        row = matrix.setdefault(spec.name, {})
        for name in backends:
            if name in apart:
                row[name] = _unsupported(name, case)
                if row[name] is None:
                    apart[name].append((i, spec))
                    continue
            else:
                row[name] = check_backend(name, case, ref)
            bar.update(1)
    for name, todo in apart.items():
        for case_name, cell in run_isolated(name, todo, device=device, seed=seed, dtype=dtype):
            matrix[case_name][name] = cell
            bar.update(1)
    bar.close()
    return matrix


# -- one backend's cells in a child process ---------------------------------------------------------------------


def run_isolated(name: str, cases: Sequence[tuple[int, ConformanceCase]], *, device: torch.device, seed: int,
                 dtype: torch.dtype | None = None):
    """Yield ``(case name, Cell)`` for backend ``name`` on each ``(index, case)``, run in a child process.

    The child regenerates each case from its seed (``seed + index``, as :func:`run_conformance` does), computes the
    reference and checks the backend, reporting each cell as it finishes. A child that dies (an abort, a device
    fault, a crash) fails the cell it was running with how it died and the end of its stderr (where a vendor's
    assert prints); a fresh child runs the cells after it.
    """
    from mla_dispatch.dispatch.registry import backend_qualname

    todo = list(cases)
    while todo:
        payload = {"backend": name, "qualname": backend_qualname(name), "device": str(device), "seed": seed,
                   "dtype": dtype, "cases": todo}
        with tempfile.TemporaryFile() as err:
            proc = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=err, env=_child_env())
            proc.stdin.write(pickle.dumps(payload))
            proc.stdin.close()
            running, finished = None, set()
            for line in proc.stdout:
                if not line.startswith(b"{"):
                    continue
                msg = json.loads(line)
                if "start" in msg:
                    running = msg["start"]
                else:
                    finished.add(msg["case"])
                    running = None
                    yield msg["case"], Cell(**msg["cell"])
            rc = proc.wait()
            err.seek(0)
            stderr = err.read().decode(errors="replace")
        todo = [(i, spec) for i, spec in todo if spec.name not in finished]
        if not todo:
            return
        how = _death(rc)
        tail = " / ".join(line.strip() for line in stderr.strip().splitlines()[-3:] if line.strip())[-300:]
        if running is not None:
            yield running, Cell("error", f"the process running {name} {how} in this cell" + (f": {tail}" if tail
                                                                                          else ""))
            todo = [(i, spec) for i, spec in todo if spec.name != running]
        elif not finished:  # it ran no cell at all (its imports failed): a fresh child would do the same
            for _, spec in todo:
                yield spec.name, Cell("error", f"the child process for {name} {how} before any cell ran: {tail}")
            return
        # else it stopped after an error on a GPU (child_main): a fresh child runs the cells left


def _death(rc: int) -> str:
    if rc < 0:
        try:
            return f"died of {signal.Signals(-rc).name}"
        except ValueError:
            return f"died of signal {-rc}"
    return f"exited with status {rc}"


def _child_env() -> dict[str, str]:
    """The parent's environment, its import path included (so the child imports the same mla_dispatch and the
    module of a backend registered at run time)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


_CHILD = "from mla_dispatch.tools.conformance import child_main; child_main()"


def child_main() -> None:
    """The child of :func:`run_isolated`: reads its pickled payload on stdin, prints one JSON line as each cell starts
    and one as it ends, and exits after an error on a GPU (a faulted CUDA context fails every later call: the parent
    starts a fresh child for the cells left)."""
    from mla_dispatch.dispatch.registry import backend_qualname, register_backend, registered_names

    payload = pickle.loads(sys.stdin.buffer.read())
    name, qualname = payload["backend"], payload["qualname"]
    if name not in registered_names() or backend_qualname(name) != qualname:  # registered at run time in the parent
        register_backend(name, qualname, replace=True)
    device = torch.device(payload["device"])
    for i, spec in payload["cases"]:
        print(json.dumps({"start": spec.name}), flush=True)
        case = spec.make(device, torch.Generator().manual_seed(payload["seed"] + i), payload["dtype"])
        cell = _run_cell(name, case, _reference(case))
        print(json.dumps({"case": spec.name, "cell": dataclasses.asdict(cell)}), flush=True)
        if cell.status == "error" and device.type != "cpu":
            return


def format_matrix(matrix: dict[str, dict[str, Cell]], backends: Sequence[str]) -> str:
    """Markdown matrix: rows = case class, columns = backends.

    Unsupported cells carry a footnote number; the notes (each backend's own
    reasons, verbatim) follow the table, so a repeated reason is printed once.
    """
    notes: dict[str, int] = {}
    lines = ["| case | " + " | ".join(backends) + " |", "|---|" + "---|" * len(backends)]
    for case, cells in matrix.items():
        shown = []
        for b in backends:
            cell = cells[b]
            if cell.status == "unsupported":
                n = notes.setdefault(f"{b}: {cell.detail}", len(notes) + 1)
                shown.append(f"unsupported [{n}]")
            else:
                shown.append(cell.short().replace("|", "/"))
        lines.append(f"| {case} | " + " | ".join(shown) + " |")
    if notes:
        lines.append("")
        lines += [f"[{n}] {text}" for text, n in notes.items()]
    if any(cell.status == "oracle" for cells in matrix.values() for cell in cells.values()):
        lines += ["", f"oracle: the {ORACLE} backend computes what every cell is compared with; its own cells show that "
                      "the harness runs it, and are not counted as passes"]
    return "\n".join(lines)


def _default_backends(device: torch.device) -> list[str]:
    names = [n for n in registered_names() if not get_backend(n).availability_reasons()]
    # Against itself the reference only checks the harness: shown on CPU, where it is all there is.
    return [n for n in names if n != ORACLE or device.type == "cpu"]


def main(argv: list[str] | None = None) -> int:
    p = CommandParser(prog="python -m mla_dispatch conformance", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="CI-sized case set (seconds on a CPU)")
    p.add_argument("--large", action="store_true",
                   help="also the large-cache cases (> 2^32 cache elements, ~4M tokens; a GPU with ~20 GB free)")
    p.add_argument("--backends", default=None,
                   help="comma-separated names (default: every available backend; 'reference' only on CPU)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                   help="q (and dense cache) dtype of every case (default: bf16, fp16 in the fp16 row); fp16 runs the "
                        "Triton kernel on a CPU (TRITON_INTERPRET=1, whose bf16 tl.dot is wrong)")
    p.add_argument("--seed", type=seed_int, default=None, help="data seed (default: random, printed for replay)")
    p.add_argument("--json", default=None, help="also write the matrix as JSON to this path")
    p.add_argument("--list", action="store_true", help="print the case set and exit")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    try:
        return _run(args)
    except UsageError as exc:
        return usage_error(p.prog, exc)


def _run(args: argparse.Namespace) -> int:
    cases = case_set(quick=args.quick) + (large_case_set() if args.large else [])
    if args.list:
        for c in cases:
            print(f"{c.name:<28} {c.feature}")
        return 0
    device = parse_device(args.device)
    backends = backend_names(args.backends) or _default_backends(device)
    known = registered_names()
    if not backends:
        print("nothing to check: no registered backend is available here (python -m mla_dispatch info says why)",
              file=sys.stderr)
        return 1
    if args.json:
        writable_file(args.json, "--json")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    dtype = _DTYPES[args.dtype] if args.dtype else None
    matrix = run_conformance(cases, backends, device=device, seed=seed, progress=not args.quiet, dtype=dtype)
    plat = platform_for(device)
    dtypes = f", {args.dtype} throughout" if args.dtype else ""
    print(f"## conformance ({'quick' if args.quick else 'full'}{dtypes}) on {plat.describe()}, torch "
          f"{torch.__version__}, seed {seed} (replay: --seed {seed})\n")
    print(format_matrix(matrix, backends))
    unavailable = {} if args.backends else {
        n: "; ".join(map(str, get_backend(n).availability_reasons())) for n in known if n not in backends}
    unavailable = {n: r for n, r in unavailable.items() if r}
    if unavailable:
        print("\nnot available here: " + "; ".join(f"{n} ({r})" for n, r in unavailable.items()))
    if args.json:
        doc = {"platform": plat.describe(), "torch": torch.__version__, "seed": seed, "quick": args.quick,
               "dtype": args.dtype,
               "backends": {b: get_backend(b).version() for b in backends},
               "matrix": {c: {b: dataclasses.asdict(cell) for b, cell in cells.items()} for c, cells in matrix.items()}}
        try:
            Path(args.json).write_text(json.dumps(doc, indent=1))
        except OSError as exc:
            raise UsageError(f"argument --json: cannot write {args.json!r}: {exc.strerror or exc}") from None
    cells = [(c, b, cell) for c, row in matrix.items() for b, cell in row.items()]
    failed = [(c, b) for c, b, cell in cells if cell.status in ("fail", "error")]
    if failed:
        print(f"\n{len(failed)} failing cell(s): " + ", ".join(f"{b} on {c}" for c, b in failed), file=sys.stderr)
        return 1
    # The reference is the oracle: its own column compares it with itself, which checks only the harness.
    checked = [(c, b) for c, b, cell in cells if cell.status == "pass"]
    unsupported = sum(cell.status == "unsupported" for _, _, cell in cells)
    oracle = sum(cell.status == "oracle" for _, _, cell in cells)
    if not checked:
        why = ("only the reference ran, and it is the oracle itself" if oracle
               else f"every backend declined every case ({', '.join(backends)}; their reasons are under the matrix)")
        print(f"\nnothing was checked: {why}", file=sys.stderr)
        return 1
    itself = f"; {oracle} cell(s) of the {ORACLE} itself, not counted" if oracle else ""
    print(f"\n{len(checked)} cell(s) checked against the reference: all pass; {unsupported} unsupported{itself}")
    return 0
