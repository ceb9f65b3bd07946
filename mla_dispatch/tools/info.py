"""``python -m mla_dispatch info``: the platform and every backend's availability.

For each registered backend it prints whether it can run here at all, and
whether it can run a representative DeepSeek-V3 decode problem on this
platform (or the problem you describe with the flags), with the reasons.
"""

from __future__ import annotations

import argparse
import platform as host_platform

import torch

from mla_dispatch.dispatch.backend import ArchSupport, CGSupport, version_of
from mla_dispatch.dispatch.platform import detect_platform
from mla_dispatch.dispatch.tuned import active_ranking, active_table_description
from mla_dispatch.version import __version__
from mla_dispatch.dispatch.problem import DecodeProblem
from mla_dispatch.dispatch.registry import BUILTIN_BACKENDS, get_backend, registered_names
from mla_dispatch.dispatch.select import explain, priority
from mla_dispatch.tools.args import CommandParser, positive_int

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def example_problem(platform_kind: str, *, batch: int = 8, q_len: int = 1, heads: int = 128, page_size: int = 64,
                    dtype: str = "bf16", kv_format: str | None = None, device_type: str | None = None) -> DecodeProblem:
    """A DeepSeek-V3-shaped decode problem (h_kv=1, D_qk=576, D_v=512)."""
    return DecodeProblem(batch=batch, q_len=q_len, num_heads_q=heads, num_heads_kv=1, head_dim_qk=576, head_dim_v=512,
                         page_size=page_size, max_blocks=64, q_dtype=_DTYPES[dtype], kv_format=kv_format or dtype,
                         causal=q_len > 1, topk=0, return_lse=True,
                         device_type=device_type or ("cuda" if platform_kind == "rocm" else platform_kind))


def report(problem: DecodeProblem | None = None) -> str:
    """The text ``info`` prints."""
    plat = detect_platform()
    problem = problem or example_problem(plat.kind)
    lines = [
        f"mla_dispatch {_version()}  torch {torch.__version__}  python {host_platform.python_version()}",
        f"platform: {plat.describe()}",
    ]
    lines += [f"  note: {n}" for n in plat.notes]
    lines.append(f"dispatch table: {_tuned_description()}")
    lines.append(f"priority here: {', '.join(priority(problem, plat, active_ranking(plat)))}")
    lines.append("")
    lines.append("backends (availability in this process):")
    for name in registered_names():
        cls = get_backend(name)
        reasons = cls.availability_reasons()
        state = "available" if not reasons else "; ".join(map(str, reasons))
        desc = f" — {cls.DESCRIPTION}" if cls.DESCRIPTION else ""
        lines.append(f"  {name}@{version_of(cls)}{desc}: {state}")
    lines.append("")
    lines.append("for this problem:")
    lines.append(problem.describe())
    sel = explain(problem, plat, candidates=registered_names())
    for name, version, reasons in sel.candidates:
        verdict = "can run" if not reasons else "; ".join(map(str, reasons))
        lines.append(f"  {name}@{version}: {verdict}")
    active = explain(problem, plat)
    lines.append(f"auto would choose: {active.chosen or 'nothing (NoBackendError)'}")
    if active.order != _tuned_description():
        lines.append(f"  (order: {active.order})")
    return "\n".join(lines)


# -- the support matrix (README "Support matrix") -------------------------------------------------------------

_FORMAT_ORDER = ("bf16", "fp16", "fp8_e4m3", "fp8_ds_mla")


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype).replace("torch.", ""))


def _what_it_runs(get, notes: str) -> str:
    """The matrix's "what it runs" cell, from the class constants as an architecture narrows them (``get(name)``)."""
    parts = [notes] if notes else []
    parts.append("q " + "/".join(sorted(map(_dtype_name, get("Q_DTYPES")))))
    formats = sorted(get("KV_FORMATS"), key=lambda f: (_FORMAT_ORDER.index(f) if f in _FORMAT_ORDER else 99, f))
    parts.append("cache " + ", ".join(formats))
    dims = get("HEAD_DIMS")
    parts.append("D " + (", ".join(f"{a}/{b}" for a, b in sorted(dims, reverse=True)) if dims is not None else "any"))
    dense_only = " (dense; sparse: any)" if get("SUPPORTS_SPARSE") else ""  # (the page bounds are dense decoding's)
    if get("PAGE_SIZES") is not None:
        parts.append("page " + "/".join(map(str, sorted(get("PAGE_SIZES")))) + dense_only)
    elif get("PAGE_SIZE_MULTIPLE") is not None:
        parts.append(f"page a multiple of {get('PAGE_SIZE_MULTIPLE')}{dense_only}")
    elif get("MAX_PAGE_SIZE") is not None:
        parts.append(f"page <= {get('MAX_PAGE_SIZE')}{dense_only}")
    else:
        parts.append("any page size")
    if get("NUM_HEADS_Q") is not None:
        parts.append("h_q " + "/".join(map(str, sorted(get("NUM_HEADS_Q")))))
    elif get("MAX_HEADS_Q") is not None:
        parts.append(f"h_q <= {get('MAX_HEADS_Q')}")
    else:
        parts.append("any h_q")
    max_kv = get("MAX_HEADS_KV")
    parts.append("any h_kv" if max_kv is None else ("h_kv 1" if max_kv == 1 else f"h_kv <= {max_kv}"))
    parts.append(f"s_q <= {get('MAX_Q_LEN')}" if get("MAX_Q_LEN") is not None else "any s_q")
    parts.append("causal" if get("SUPPORTS_CAUSAL") else "not causal")
    dense, sparse = get("SUPPORTS_DENSE"), get("SUPPORTS_SPARSE")
    parts.append("dense and sparse" if dense and sparse else ("sparse only" if sparse else "dense only"))
    parts.append("LSE" if get("SUPPORTS_LSE") else "no LSE")
    if get("CUDA_GRAPH") is CGSupport.ALWAYS:
        parts.append("CUDA graph")
    if get("SUPPORTS_BATCH_INVARIANT"):
        parts.append("batch-invariant")
    return "; ".join(parts)


def _hardware(cls) -> str:
    """A hardware label from the class constants alone (a backend that declares no ``ARCH_SUPPORT``)."""
    where = []
    for kind in sorted(cls.PLATFORMS):
        if kind == "cuda" and (cls.MIN_CAPABILITY or cls.MAX_CAPABILITY):
            lo, hi = cls.MIN_CAPABILITY, cls.MAX_CAPABILITY
            where.append("cuda " + (f"sm{lo[0]}{lo[1]}" if lo else "") + (f"..sm{hi[0]}{hi[1]}" if hi else "+"))
        else:
            where.append(kind)
    if cls.ARCHS:
        where.append(", ".join(sorted(cls.ARCHS)))
    return "; ".join(where) or "none"


def support_rows(names=None) -> list[tuple[str, str, str, str]]:
    """``(backend, hardware, what it runs, run here)`` for each backend (default: the built-in ones) and each entry
    of its ``ARCH_SUPPORT``; one row from the class constants where it declares none. Reads class data only (no
    vendor library is imported), so the table is the same on every machine."""
    names = tuple(BUILTIN_BACKENDS) if names is None else tuple(names)
    rows = []
    for name in names:
        cls = get_backend(name)
        label = f"`{name}`" + (f" ({cls.VENDOR})" if cls.VENDOR else "")
        if not cls.PLATFORMS:  # planned, or its adapter module does not import: only the reason is known
            rows.append((label, "-", "; ".join(map(str, cls.availability_reasons())), "-"))
            continue
        entries = cls.ARCH_SUPPORT or (ArchSupport("", _hardware(cls)),)
        for entry in entries:
            limits = entry.limits
            get = (lambda limits: lambda key: limits[key] if key in limits else getattr(cls, key))(limits)
            rows.append((label, entry.hardware, _what_it_runs(get, entry.notes), entry.run_here))
    return rows


def support_matrix(names=None) -> str:
    """The README's support matrix as Markdown (``python -m mla_dispatch info --markdown``)."""
    lines = ["| backend | hardware | what it runs | run here |", "|---|---|---|---|"]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in support_rows(names)]
    return "\n".join(lines)


def _version() -> str:
    return __version__


def _tuned_description() -> str:
    return active_table_description(detect_platform())


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(prog="python -m mla_dispatch info", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=positive_int, default=8)
    parser.add_argument("--q-len", type=positive_int, default=1, help="s_q, query tokens per request")
    parser.add_argument("--heads", type=positive_int, default=128, help="h_q")
    parser.add_argument("--page-size", type=positive_int, default=64)
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    parser.add_argument("--kv-format", choices=["bf16", "fp16", "fp8_e4m3", "fp8_ds_mla"], default=None)
    parser.add_argument("--markdown", action="store_true",
                        help="print the support matrix of the built-in backends, from their class data (the README's "
                             "table) and exit")
    args = parser.parse_args(argv)
    if args.markdown:
        print(support_matrix())
        return 0
    plat = detect_platform()
    problem = example_problem(plat.kind, batch=args.batch, q_len=args.q_len, heads=args.heads,
                              page_size=args.page_size, dtype=args.dtype, kv_format=args.kv_format)
    print(report(problem))
    return 0
