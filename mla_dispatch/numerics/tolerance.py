"""Tolerances and the comparison every check uses (tests, ``conformance``, ``bench``, ``demo``).

The bounds and their sources are in docs/design.md ("Numerics"): per element ``abs <= atol or rel <= rtol`` and
a cosine-difference bound on ``out``, FlashMLA's ``check_is_allclose`` (``tests/test_flash_mla_dense_decoding.py``);
Inf/NaN positions must match exactly. A backend whose arithmetic needs looser bounds declares its own
:class:`Tolerance` (``MLABackend.TOLERANCE``).
"""

from __future__ import annotations

import dataclasses
import math

import torch

__all__ = ["Tolerance", "BF16_TOLERANCE", "CloseReport", "check_close", "compare_outputs"]


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """Per-element ``abs <= atol or rel <= rtol`` plus a cosine-difference bound (docs/design.md §5)."""

    out_atol: float = 8e-4
    out_rtol: float = 2.01 / 128
    out_cos: float = 5e-6
    lse_atol: float = 1e-6
    lse_rtol: float = 8.01 / 65536


BF16_TOLERANCE = Tolerance()


@dataclasses.dataclass
class CloseReport:
    """Outcome of :func:`check_close`: ``ok`` and the worst errors seen."""

    ok: bool
    max_abs: float
    max_rel: float
    cos_diff: float
    message: str

    def __bool__(self) -> bool:
        return self.ok


def check_close(name: str, got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float,
                cos: float | None = None) -> CloseReport:
    """FlashMLA's ``check_is_allclose``: each element passes if abs <= atol or rel <= rtol;
    Inf/NaN positions must match exactly; optionally a cosine-difference bound."""
    got = got.double()
    want = want.double()
    if got.shape != want.shape:
        return CloseReport(False, math.inf, math.inf, math.inf, f"{name}: shape {list(got.shape)} != {list(want.shape)}")
    nonfinite_got, nonfinite_want = ~torch.isfinite(got), ~torch.isfinite(want)
    if not torch.equal(nonfinite_got, nonfinite_want) or not torch.equal(
        torch.where(nonfinite_got, got.nan_to_num(nan=1.0, posinf=2.0, neginf=3.0), 0.0),
        torch.where(nonfinite_want, want.nan_to_num(nan=1.0, posinf=2.0, neginf=3.0), 0.0),
    ):
        n = int((nonfinite_got != nonfinite_want).sum())
        return CloseReport(False, math.inf, math.inf, math.inf, f"{name}: Inf/NaN positions differ ({n} elements)")
    fin = ~nonfinite_want
    g, w = got[fin], want[fin]
    abs_err = (g - w).abs()
    rel_err = abs_err / w.abs().clamp_min(1e-30)
    bad = (abs_err > atol) & (rel_err > rtol)
    max_abs = float(abs_err.max()) if abs_err.numel() else 0.0
    max_rel = float(torch.where(abs_err > atol, rel_err, 0.0).max()) if abs_err.numel() else 0.0
    cos_diff = 0.0
    if cos is not None and g.numel():
        denom = (g * g + w * w).sum()
        cos_diff = float(1 - 2 * (g * w).sum() / denom) if denom > 0 else 0.0
    if bool(bad.any()):
        i = int(torch.nonzero(bad.flatten())[0])
        msg = (f"{name}: {int(bad.sum())} of {bad.numel()} elements out of tolerance (atol={atol}, rtol={rtol}); "
               f"first: got {float(g.flatten()[i]):.6g} want {float(w.flatten()[i]):.6g}")
        return CloseReport(False, max_abs, max_rel, cos_diff, msg)
    if cos is not None and cos_diff > cos:
        return CloseReport(False, max_abs, max_rel, cos_diff, f"{name}: cosine difference {cos_diff:.3g} > {cos}")
    return CloseReport(True, max_abs, max_rel, cos_diff, f"{name}: ok (max abs {max_abs:.3g})")


def compare_outputs(out: torch.Tensor, lse: torch.Tensor | None, ref_out: torch.Tensor, ref_lse: torch.Tensor,
                    tol: Tolerance) -> CloseReport:
    """Compare a backend's (out, lse) with the reference's, docs/design.md §5 tolerances."""
    r = check_close("out", out, ref_out.to(out.dtype), tol.out_atol, tol.out_rtol, tol.out_cos)
    if not r or lse is None:
        return r
    r2 = check_close("lse", lse, ref_lse, tol.lse_atol, tol.lse_rtol)
    if not r2:
        return r2
    return CloseReport(True, r.max_abs, r.max_rel, r.cos_diff,
                       f"ok (out max abs {r.max_abs:.3g}, cosine difference {r.cos_diff:.2g})")
