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
(docs/design.md §5).

The result is a matrix: rows = case class, columns = backends, cells =
``pass``, ``FAIL (worst error)``, ``ERROR (exception)`` or ``unsupported
(the backend's own reason)``. The exit code is 1 if any cell failed or raised,
or if nothing was checked (every cell unsupported, or only the reference, the
oracle itself, ran); 2 for a usage mistake.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
from pathlib import Path
from typing import Sequence

import torch

from mla_dispatch.api import mla_decode
from mla_dispatch.dispatch.platform import platform_for
from mla_dispatch.dispatch.problem import describe_inputs
from mla_dispatch.dispatch.registry import get_backend, registered_names
from mla_dispatch.numerics.cases import DecodeCase, make_case
from mla_dispatch.numerics.tolerance import compare_outputs
from mla_dispatch.tools.args import (CommandParser, UsageError, backend_names, parse_device, usage_error,
                                     writable_file)

__all__ = ["ConformanceCase", "Cell", "case_set", "large_case_set", "run_conformance", "format_matrix", "main"]


@dataclasses.dataclass(frozen=True)
class ConformanceCase:
    """One row of the matrix: a feature class and the ``make_case`` arguments that exercise it."""

    name: str
    feature: str  # which docs/design.md §1–2 feature it covers
    params: dict

    def make(self, device: torch.device, generator: torch.Generator) -> DecodeCase:
        if "bench" in self.params:  # a large case: generated on the device, chunk by chunk, as `bench` does
            from mla_dispatch.tools.bench import BenchConfig, make_bench_case

            params = dict(self.params)
            cfg = BenchConfig(**params.pop("bench"))
            seed = int(torch.randint(1 << 30, (1,), generator=generator))
            return make_bench_case(cfg, device=device, seed=seed, **params)
        return make_case(**self.params, device=device, generator=generator)


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
    """One (case, backend) outcome: ``pass``, ``fail``, ``error`` or ``unsupported``, and why."""

    status: str
    detail: str = ""
    max_abs: float | None = None
    cos_diff: float | None = None

    def short(self) -> str:
        if self.status == "pass":
            return "pass"
        if self.status == "fail":
            return f"FAIL ({self.detail})"
        if self.status == "error":
            return f"ERROR ({self.detail})"
        return f"unsupported ({self.detail})"


def check_backend(name: str, case: DecodeCase, ref: tuple[torch.Tensor, torch.Tensor]) -> Cell:
    """Run backend ``name`` on ``case`` and compare with ``ref`` at its tolerance."""
    cls = get_backend(name)
    problem = describe_inputs(case.q, case.kv_cache, case.block_table, case.cache_seqlens, head_dim_v=case.head_dim_v,
                              causal=case.causal, kv_format=case.kv_format, kv_scale=case.kv_scale,
                              indices=case.indices, return_lse=True, **case.sparse_extras())
    reasons = cls.not_supported_reasons(problem, platform_for(case.q.device))
    if reasons:
        return Cell("unsupported", "; ".join(map(str, reasons)))
    try:
        out, lse = mla_decode(*case.args(), **case.kwargs(), backend=name)
        report = compare_outputs(out, lse, ref[0], ref[1], cls.TOLERANCE)
    except Exception as exc:
        return Cell("error", f"{type(exc).__name__}: {exc}".splitlines()[0][:200])
    if report:
        return Cell("pass", report.message, report.max_abs, report.cos_diff)
    worst = report.message if report.max_abs == float("inf") else (
        f"max abs {report.max_abs:.3g}, cos diff {report.cos_diff:.3g}: {report.message}")
    return Cell("fail", worst, report.max_abs, report.cos_diff)


def run_conformance(cases: Sequence[ConformanceCase], backends: Sequence[str], *, device: torch.device,
                    seed: int = 0, progress: bool = True) -> dict[str, dict[str, Cell]]:
    """``{case name: {backend: Cell}}`` for every case and backend."""
    from tqdm import tqdm

    from mla_dispatch.numerics.oracle import reference_attention

    matrix: dict[str, dict[str, Cell]] = {}
    bar = tqdm(total=len(cases) * len(backends), desc="conformance", unit="cell", disable=not progress, leave=False,
               file=sys.stderr)
    for i, spec in enumerate(cases):
        bar.set_postfix_str(spec.name)
        case = spec.make(device, torch.Generator().manual_seed(seed + i))
        ref = reference_attention(case.q, case.kv_cache, case.block_table, case.cache_seqlens,
                                  head_dim_v=case.head_dim_v, softmax_scale=case.softmax_scale, causal=case.causal,
                                  kv_format=case.kv_format, kv_scale=case.kv_scale, indices=case.indices,
                                  **case.sparse_extras())
        row = matrix.setdefault(spec.name, {})
        for name in backends:
            row[name] = check_backend(name, case, ref)
            bar.update(1)
    bar.close()
    return matrix


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
    return "\n".join(lines)


def _default_backends(device: torch.device) -> list[str]:
    names = [n for n in registered_names() if not get_backend(n).availability_reasons()]
    # Against itself the reference only checks the harness: shown on CPU, where it is all there is.
    return [n for n in names if n != "reference" or device.type == "cpu"]


def main(argv: list[str] | None = None) -> int:
    p = CommandParser(prog="python -m mla_dispatch conformance", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="CI-sized case set (seconds on a CPU)")
    p.add_argument("--large", action="store_true",
                   help="also the large-cache cases (> 2^32 cache elements, ~4M tokens; a GPU with ~20 GB free)")
    p.add_argument("--backends", default=None,
                   help="comma-separated names (default: every available backend; 'reference' only on CPU)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--seed", type=int, default=None, help="data seed (default: random, printed for replay)")
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
    matrix = run_conformance(cases, backends, device=device, seed=seed, progress=not args.quiet)
    plat = platform_for(device)
    print(f"## conformance ({'quick' if args.quick else 'full'}) on {plat.describe()}, torch {torch.__version__}, "
          f"seed {seed} (replay: --seed {seed})\n")
    print(format_matrix(matrix, backends))
    unavailable = {} if args.backends else {
        n: "; ".join(map(str, get_backend(n).availability_reasons())) for n in known if n not in backends}
    unavailable = {n: r for n, r in unavailable.items() if r}
    if unavailable:
        print("\nnot available here: " + "; ".join(f"{n} ({r})" for n, r in unavailable.items()))
    if args.json:
        doc = {"platform": plat.describe(), "torch": torch.__version__, "seed": seed, "quick": args.quick,
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
    checked = [(c, b) for c, b, cell in cells if cell.status == "pass" and b != "reference"]
    unsupported = sum(cell.status == "unsupported" for _, _, cell in cells)
    if not checked:
        why = ("only the reference ran, and it is the oracle itself" if any(cell.status == "pass" for *_, cell in cells)
               else f"every backend declined every case ({', '.join(backends)}; their reasons are under the matrix)")
        print(f"\nnothing was checked: {why}", file=sys.stderr)
        return 1
    print(f"\n{len(checked)} cell(s) checked against the reference: all pass; {unsupported} unsupported")
    return 0
