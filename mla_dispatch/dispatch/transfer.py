"""Carry a measured dispatch table to a device that has none of its own, corrected by the two devices' peaks.

A table (:mod:`mla_dispatch.dispatch.tuned`) holds, per shape bucket, each backend's measured time and the work of
the bucket's configs (FLOPs and bytes, docs/design.md §6). On another device of the same architecture the winners
can change: faster memory shortens the memory-bound part of every kernel and leaves the compute-bound part alone,
so a backend that won by streaming the cache well but computes slowly falls behind (the H200 against the H100:
copy 1.42× faster, matmul no faster, and FlashMLA's kernel, the most compute-efficient, won rows that were ties on
the H100). So each backend gets a small cost model, fitted to its measurements across the table's buckets::

    t = overhead * configs + ((memory * bytes / BW) ** p + (compute * flops / FLOPS) ** p) ** (1 / p)

``memory`` and ``compute`` are the backend's multipliers on the two roofline times (1 = at the ceiling), the
overhead a per-call cost that no peak changes, and ``p`` = :data:`P_NORM` how much the two overlap (1 = not at all,
infinity = perfectly, the roofline). p = 3 and 4 fit the H100's table about equally and better than the others
(summed squared relative error of the four backends' fits over its 24 buckets: p = 1: 1.45, 2: 1.14, 3: 1.08,
4: 1.11, 6: 1.19, 8: 1.24, 16: 1.29; over the 31 configs of benchmarks/h100-all-backends-1851utc.json one by one,
with FlashMLA's own calls too, 4 was the least; ``python dev/transfer_check.py`` recomputes the first). A bucket's
time on the target is its measured time scaled by the model's ratio, target over source, so what the model does
not capture about a bucket (a page size, a format) stays in the measurement.

Predictions within :data:`TIE` of the best are a tie: timings of one kernel differ by that much between two runs
(benchmarks/RESULTS.md, "auto with the shipped table"). A tie goes to the backend with the smallest fitted
multiplier on the resource the target has relatively less of (compute when its bandwidth grew more than its
compute), whose hidden limits the target is likeliest to expose: on the H200, cuda_sm90's time at h_q = 32 / 64 rose
to 1.24 / 1.31× FlashMLA's from 1.01 / 1.02× on the H100 (docs/design.md §6), a limit no H100 measurement shows.
Only where the bucket runs near a roofline (its roofline time at least :data:`ROOFLINE_SHARE` of the predicted
time): where latency and launch costs dominate (one request), neither peak moves the times and the measured order
stands.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from mla_dispatch.dispatch.devices import DevicePeaks

__all__ = ["P_NORM", "TIE", "Cost", "fit_cost", "Transferred", "transfer_table", "can_transfer", "assumed_peaks",
           "peak_distance"]

#: How memory and compute time overlap in the cost model (module docstring).
P_NORM = 4
#: Predictions within this fraction of the best are a tie (module docstring).
TIE = 0.03
#: A tie is broken only where the bucket's roofline time is at least this share of the best predicted time.
ROOFLINE_SHARE = 0.5
#: Buckets a backend needs for its own fit; with fewer, its times scale with the roofline (multipliers 1, no overhead).
MIN_BUCKETS = 3
#: Local minima of the fit's grid refined, best first (fit_cost).
FIT_STARTS = 8


def _pnorm(x, y):
    """``(x**p + y**p) ** (1/p)`` without overflow; floats or numpy arrays."""
    s = np.maximum(np.maximum(x, y), 1e-30)
    return s * ((x / s) ** P_NORM + (y / s) ** P_NORM) ** (1 / P_NORM)


@dataclasses.dataclass(frozen=True)
class Cost:
    """One backend's fitted cost: µs per config of fixed overhead, and multipliers on the memory and compute
    roofline times."""

    overhead_us: float
    memory: float
    compute: float

    def us(self, memory_us: float, compute_us: float, configs: int) -> float:
        """Predicted µs of ``configs`` calls whose roofline times sum to ``memory_us`` and ``compute_us``."""
        return self.overhead_us * configs + float(_pnorm(self.memory * memory_us, self.compute * compute_us))


#: The cost of a backend measured in fewer than MIN_BUCKETS buckets: its times scale with the roofline.
ROOFLINE = Cost(0.0, 1.0, 1.0)


def fit_cost(points: Sequence[tuple[float, float, int, float]]) -> Cost:
    """Fit a :class:`Cost` to ``(memory_us, compute_us, configs, measured_us)`` points (one per bucket), minimising
    the summed squared relative error: a log grid over the two multipliers (1/8 .. 64) with the overhead (>= 0)
    solved for each pair, then Levenberg-Marquardt steps from each of the grid's :data:`FIT_STARTS` best local minima.
    The error's valleys are narrow across the multiplier of the resource most buckets are bound by and flat along the
    other: refining only the grid's best cell settles in the wrong valley in about 1% of random exact-time tests (a
    memory multiplier 15-85% off) and in 61% of those where every bucket is compute-bound (tests/test_transfer.py).
    :data:`ROOFLINE` for fewer than :data:`MIN_BUCKETS` points."""
    if len(points) < MIN_BUCKETS:
        return ROOFLINE
    m, f, n, t = (np.asarray(col, dtype=np.float64) for col in zip(*points))
    w = 1.0 / t**2
    a = np.exp(np.linspace(math.log(1 / 8), math.log(64), 41))
    norm = _pnorm(a[:, None, None] * m, a[None, :, None] * f)
    overhead = np.maximum((w * n * (t - norm)).sum(-1) / (w * n * n).sum(-1), 0.0)
    err = (((overhead[..., None] * n + norm - t) / t) ** 2).sum(-1)
    padded = np.pad(err, 1, constant_values=np.inf)
    neighbours = np.stack([padded[1 + di:42 + di, 1 + dj:42 + dj] for di in (-1, 0, 1) for dj in (-1, 0, 1)
                           if (di, dj) != (0, 0)])
    starts = sorted(np.argwhere(err <= neighbours.min(0)).tolist(), key=lambda ij: err[ij[0], ij[1]])[:FIT_STARTS]
    fits = [_refine(np.array([overhead[i, j], math.log(a[i]), math.log(a[j])]), m, f, n, t) for i, j in starts]
    _, x = min(fits, key=lambda fit: fit[0])
    return Cost(float(x[0]), float(math.exp(x[1])), float(math.exp(x[2])))


def _relative_residuals(x: np.ndarray, m, f, n, t) -> tuple[np.ndarray, np.ndarray]:
    """Residuals (predicted - t) / t of ``x`` = (overhead, log memory, log compute), and their Jacobian."""
    am, bf = math.exp(x[1]) * m, math.exp(x[2]) * f
    norm = _pnorm(am, bf)
    # d norm / d log a = (a m)^p / norm^(p - 1), by the chain rule on (x^p + y^p)^(1/p).
    jac = np.stack([n, (am / norm) ** P_NORM * norm, (bf / norm) ** P_NORM * norm], axis=1) / t[:, None]
    return (x[0] * n + norm - t) / t, jac


#: Bounds of the fit's (overhead, log memory, log compute) while refining.
_FIT_LOW = np.array([0.0, math.log(1 / 64), math.log(1 / 64)])
_FIT_HIGH = np.array([np.inf, math.log(512), math.log(512)])


def _refine(x: np.ndarray, m, f, n, t, steps: int = 50) -> tuple[float, np.ndarray]:
    """Levenberg-Marquardt on the relative residuals from ``x`` = (overhead, log memory, log compute), the
    overhead held >= 0 and the multipliers within 1/64 .. 512 by projection: (summed squared error, x)."""
    damping = 1e-3
    r, jac = _relative_residuals(x, m, f, n, t)
    for _ in range(steps):
        jtj = jac.T @ jac
        try:
            step = np.linalg.solve(jtj + damping * np.diag(np.diag(jtj) + 1e-12), -jac.T @ r)
        except np.linalg.LinAlgError:  # a degenerate system: keep the best point so far
            break
        trial = np.clip(x + step, _FIT_LOW, _FIT_HIGH)
        r_t, jac_t = _relative_residuals(trial, m, f, n, t)
        if r_t @ r_t < r @ r:
            x, r, jac, damping = trial, r_t, jac_t, damping / 3
        else:
            damping *= 4
        if damping > 1e8:
            break
    return float(r @ r), x


@dataclasses.dataclass(frozen=True)
class Transferred:
    """A table carried to another device: per bucket the backends best first, and each one's predicted µs (summed
    over the bucket's configs, as the source measured them); ``bandwidth`` and ``compute`` are the target's peaks over
    the source's; ``costs`` the fitted models."""

    ranking: dict[str, tuple[str, ...]]
    predicted: dict[str, dict[str, float]]
    bandwidth: float
    compute: float
    costs: dict[str, Cost]


def can_transfer(doc: dict) -> bool:
    """Whether a table document carries what a transfer needs: per bucket, measurements and the work measured."""
    work, measured = doc.get("work"), doc.get("measurements")
    return isinstance(work, dict) and isinstance(measured, dict) and any(b in work for b in measured)


def peak_distance(a: DevicePeaks, b: DevicePeaks) -> float:
    """How far apart two devices are: octaves (natural log) of bandwidth plus of compute."""
    return abs(math.log(a.bytes_per_s / b.bytes_per_s)) + abs(math.log(a.flops_per_s / b.flops_per_s))


def assumed_peaks(name: str, sms: int, source: DevicePeaks) -> DevicePeaks:
    """Peaks for a device of the source's architecture whose spec sheet we do not know: the source's bandwidth, and
    its compute scaled by the SM count."""
    ratio = sms / source.sms if sms > 0 else 1.0
    return DevicePeaks(f"{name} (not in the spec list: {source.name}'s bandwidth, compute x{ratio:.2f} by SM count "
                       f"{sms}/{source.sms})", source.bytes_per_s, source.flops_per_s * ratio, sms)


def transfer_table(doc: dict, source: DevicePeaks, target: DevicePeaks) -> Transferred:
    """Carry table ``doc`` (measured on the device of ``source``) to the device of ``target`` (module docstring).

    The roofline times of a bucket on the source use the ceilings the table's run measured (``doc["ceilings"]``),
    else the source's spec-sheet peaks; the target's are those over the peaks' ratios. Buckets without their work
    recorded keep the measured order.
    """
    bandwidth = target.bytes_per_s / source.bytes_per_s
    compute = target.flops_per_s / source.flops_per_s
    ceilings = doc.get("ceilings") or {}
    bw = float(ceilings.get("bytes_per_s") or source.bytes_per_s)
    fl = float(ceilings.get("flops_per_s") or source.flops_per_s)
    work, measured = doc.get("work", {}), doc.get("measurements", {})

    def roofline(bucket: str) -> tuple[float, float, int]:
        w = work[bucket]
        return w["bytes"] / bw * 1e6, w["flops"] / fl * 1e6, int(w.get("configs", 1))

    points: dict[str, list[tuple[float, float, int, float]]] = {}
    for bucket, times in measured.items():
        if bucket in work:
            for backend, us in times.items():
                points.setdefault(backend, []).append((*roofline(bucket), float(us)))
    costs = {backend: fit_cost(p) for backend, p in sorted(points.items())}

    scarce = "compute" if bandwidth > compute * (1 + 1e-6) else "memory" if compute > bandwidth * (1 + 1e-6) else None
    ranking, predicted = {}, {}
    for bucket, times in measured.items():
        if bucket not in work:
            ranking[bucket] = tuple(sorted(times, key=times.get))
            continue
        m, f, n = roofline(bucket)
        pred = {b: us * costs[b].us(m / bandwidth, f / compute, n) / costs[b].us(m, f, n) for b, us in times.items()}
        order = sorted(pred, key=pred.get)
        near_roofline = max(m / bandwidth, f / compute) >= ROOFLINE_SHARE * pred[order[0]] if order else False
        if scarce and near_roofline:
            tied = [b for b in order if pred[b] <= pred[order[0]] * (1 + TIE)]
            first = min(tied, key=lambda b: (getattr(costs[b], scarce), pred[b]))
            order.remove(first)
            order.insert(0, first)
        ranking[bucket], predicted[bucket] = tuple(order), pred
    for bucket, winner in doc.get("table", {}).items():  # a bucket with a winner but no measurements keeps it
        ranking.setdefault(bucket, (winner,))
    return Transferred(ranking, predicted, bandwidth, compute, costs)
