"""``python -m mla_dispatch info``: the platform and every backend's availability.

For each registered backend it prints whether it can run here at all, and
whether it can run a representative DeepSeek-V3 decode problem on this
platform (or the problem you describe with the flags), with the reasons.
"""

from __future__ import annotations

import argparse
import platform as host_platform

import torch

from mla_dispatch.dispatch.backend import version_of
from mla_dispatch.dispatch.platform import detect_platform
from mla_dispatch.dispatch.tuned import active_table_description
from mla_dispatch.version import __version__
from mla_dispatch.dispatch.problem import DecodeProblem
from mla_dispatch.dispatch.registry import get_backend, registered_names
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
    lines.append(f"priority here: {', '.join(priority(problem, plat))}")
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
    chosen = explain(problem, plat).chosen
    lines.append(f"auto would choose: {chosen or 'nothing (NoBackendError)'}")
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
    args = parser.parse_args(argv)
    plat = detect_platform()
    problem = example_problem(plat.kind, batch=args.batch, q_len=args.q_len, heads=args.heads,
                              page_size=args.page_size, dtype=args.dtype, kv_format=args.kv_format)
    print(report(problem))
    return 0
