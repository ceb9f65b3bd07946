"""Small helpers shared by the vendor adapters (FlashMLA, FlashInfer, AITER).

Nothing here imports a vendor library. The helpers are static-shape tensor
code (no host sync), so they can run inside ``plan``/``update``/``run`` of a
CUDA-graph plan.
"""

from __future__ import annotations

import importlib
import importlib.metadata

import torch

from mla_dispatch.dispatch.backend import Reason, ReasonCode

__all__ = ["dist_version", "import_reasons", "visible_rows", "zero_invisible_rows"]


def dist_version(dist: str, module: str) -> str:
    """Installed version of distribution ``dist`` (else ``module.__version__``, else "not installed")."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        return str(getattr(importlib.import_module(module), "__version__", "unknown"))
    except Exception:
        return "not installed"


def import_reasons(module: str) -> list[Reason]:
    """[] if ``module`` imports, else one UNAVAILABLE reason carrying the real exception text."""
    try:
        importlib.import_module(module)
    except Exception as exc:  # ImportError, OSError from a missing .so, RuntimeError from a CUDA probe
        return [Reason(ReasonCode.UNAVAILABLE, f"import {module} failed: {type(exc).__name__}: {exc}")]
    return []


def visible_rows(cache_seqlens: torch.Tensor, q_len: int, causal: bool) -> torch.Tensor:
    """bool ``[B, s_q]``: query token ``i`` of request ``b`` sees at least one key."""
    seqlens = cache_seqlens.to(torch.int64)[:, None]
    if not causal:
        return (seqlens > 0).expand(-1, q_len)
    i = torch.arange(q_len, device=cache_seqlens.device)[None, :]
    return seqlens - q_len + i + 1 > 0


def zero_invisible_rows(out: torch.Tensor, lse: torch.Tensor, visible: torch.Tensor) -> None:
    """Enforce the canonical sentinel in place: rows with no visible key get out 0, lse +inf.

    ``out`` ``[B, s_q, h_q, D_v]``, ``lse`` ``[B, h_q, s_q]``, ``visible`` bool ``[B, s_q]``.
    Vendors disagree on what such rows hold (FlashInfer: garbage or -inf; FlashMLA: 0/+inf).
    """
    out.masked_fill_(~visible[:, :, None, None], 0)
    lse.masked_fill_(~visible[:, None, :], float("inf"))
