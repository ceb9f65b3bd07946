"""Counting work and measuring ceilings for the roofline (docs/design.md §6).

For one decode call over requests ``b`` with ``L_b`` cached tokens::

    FLOPs = 2 * s_q * h_q * (D_qk + D_v) * sum_b L_b
    bytes = h_kv * kv_bytes_per_token * sum_b L_b + q_bytes * B * s_q * h_q * (D_qk + D_v)

With bf16 everywhere ``kv_bytes_per_token = 2 * D_qk`` and ``q_bytes = 2``,
which is docs/design.md's ``2 * (h_kv * D_qk * sum L + B * s_q * h_q * (D_qk + D_v))``
(the cache read once; q read and out written once). fp8 formats count the bytes
actually stored: ``fp8_e4m3`` is 1 byte per value (plus its single 4-byte
scale), ``fp8_ds_mla`` is the 656-byte token. Sparse calls (``topk > 0``) read
``topk`` tokens per query token instead of ``L_b`` per request: the sums become
``B * s_q * topk`` and the FLOPs drop the leading ``s_q``. Causal masking is
not subtracted (FlashMLA's own counting).

The roofline time is ``max(FLOPs / peak_flops, bytes / peak_bandwidth)`` with
both peaks measured in the same process by :func:`measure_ceilings`: a 1 GiB
device-to-device copy (read + write counted) and an 8192^3 bf16 matmul. On a
CPU the same two measurements run at a smaller size (64 MiB, 256^3) and the
:class:`Ceilings` record says so.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable

import torch

from mla_dispatch.kvcache.formats import DS_MLA_TOKEN_BYTES, DS_V4_TOKEN_BYTES

__all__ = ["Work", "Ceilings", "decode_work", "kv_bytes_per_token", "measure_ceilings", "time_fn", "timer_name"]


@dataclasses.dataclass(frozen=True)
class Work:
    """FLOPs and bytes of one decode call."""

    flops: float
    bytes: float

    def roofline_seconds(self, ceilings: "Ceilings") -> float:
        """``max(FLOPs / peak_flops, bytes / peak_bandwidth)``."""
        return max(self.flops / ceilings.flops_per_s, self.bytes / ceilings.bytes_per_s)


def kv_bytes_per_token(kv_format: str, head_dim_qk: int) -> int:
    """Bytes one cached token occupies per KV head in ``kv_format``."""
    if kv_format in ("bf16", "fp16"):
        return 2 * head_dim_qk
    if kv_format == "fp8_e4m3":
        return head_dim_qk
    if kv_format == "fp8_ds_mla":
        return DS_MLA_TOKEN_BYTES
    if kv_format == "fp8_ds_v4":
        return DS_V4_TOKEN_BYTES
    raise ValueError(f"kv_format={kv_format!r} (supported: bf16, fp16, fp8_e4m3, fp8_ds_mla, fp8_ds_v4)")


def decode_work(*, batch: int, q_len: int, num_heads_q: int, num_heads_kv: int, head_dim_qk: int,
                head_dim_v: int, total_kv_tokens: int, kv_format: str = "bf16", q_elem_bytes: int = 2,
                topk: int = 0) -> Work:
    """The work of one call (module docstring). ``total_kv_tokens`` is ``sum_b L_b`` (dense)."""
    qo = q_elem_bytes * batch * q_len * num_heads_q * (head_dim_qk + head_dim_v)
    if topk:
        tokens = batch * q_len * topk  # every query token gathers its own list
        flops = 2 * num_heads_q * (head_dim_qk + head_dim_v) * tokens
    else:
        tokens = total_kv_tokens
        flops = 2 * q_len * num_heads_q * (head_dim_qk + head_dim_v) * tokens
    kv = num_heads_kv * kv_bytes_per_token(kv_format, head_dim_qk) * tokens
    if kv_format == "fp8_e4m3":
        kv += 4  # the per-tensor scale
    return Work(float(flops), float(kv + qo))


# -- timing -----------------------------------------------------------------------------------


def timer_name(device: torch.device) -> str:
    """How :func:`time_fn` times on ``device`` (for result headers)."""
    if device.type == "cuda":
        try:
            import triton.testing  # noqa: F401
        except ImportError:
            return "CUDA events, median, L2 flushed before each run (triton missing: do_bench's method re-implemented)"
        return "triton.testing.do_bench (median, L2 flushed before each run)"
    return "time.perf_counter wall clock (median of repeats; CPU fallback, no cache flush)"


def time_fn(fn: Callable[[], object], device: torch.device, *, rep_ms: float = 100.0) -> float:
    """Median seconds per call of ``fn``.

    CUDA: ``triton.testing.do_bench`` (imported here, lazily), which zeroes a
    256 MB buffer before each timed run so L2 starts cold. Elsewhere: a wall
    clock around each call after one warm-up, repeated for about ``rep_ms``
    (at least 3 and at most 1000 times).
    """
    if device.type == "cuda":
        try:
            from triton.testing import do_bench
        except ImportError:
            return _cuda_event_median(fn, rep_ms)
        return do_bench(fn, warmup=max(1, int(rep_ms // 4)), rep=int(rep_ms), return_mode="median") * 1e-3
    fn()
    samples: list[float] = []
    deadline = time.perf_counter() + rep_ms * 1e-3
    while len(samples) < 3 or (time.perf_counter() < deadline and len(samples) < 1000):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _cuda_event_median(fn: Callable[[], object], rep_ms: float) -> float:
    """do_bench's method without triton: CUDA events around each call, a 256 MB buffer zeroed before it."""
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    n = int(min(1000, max(3, rep_ms * 1e-3 / max(time.perf_counter() - t0, 1e-6))))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for start, end in zip(starts, ends):
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e-3


# -- ceilings ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Ceilings:
    """Peak bandwidth and compute measured on one device in this process."""

    device: str
    bytes_per_s: float
    flops_per_s: float
    how: str  # what was measured, in words (sizes, dtype, timer)

    def describe(self) -> str:
        return f"copy {self.bytes_per_s / 1e12:#.3g} TB/s, matmul {self.flops_per_s / 1e12:#.3g} TFLOP/s ({self.how})"


def measure_ceilings(device: torch.device | str, *, copy_bytes: int | None = None, matmul_n: int | None = None,
                     rep_ms: float = 200.0) -> Ceilings:
    """Measure peak copy bandwidth (read + write counted) and bf16 matmul throughput.

    Defaults: 1 GiB and 8192^3 on an accelerator; 64 MiB and 256^3 on a CPU (the full sizes would take minutes
    there; a CPU's bf16 matmul runs below 1 GFLOP/s, so 1024^3 took ~10 s, and its ceiling only labels CPU runs).
    """
    device = torch.device(device)
    on_cpu = device.type == "cpu"
    copy_bytes = copy_bytes or ((64 << 20) if on_cpu else (1 << 30))
    matmul_n = matmul_n or (256 if on_cpu else 8192)
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    t_copy = time_fn(lambda: dst.copy_(src), device, rep_ms=rep_ms)
    del src, dst
    a = torch.randn(matmul_n, matmul_n, device=device, dtype=torch.bfloat16)
    b = torch.randn(matmul_n, matmul_n, device=device, dtype=torch.bfloat16)
    t_mm = time_fn(lambda: a @ b, device, rep_ms=rep_ms)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    size = f"{copy_bytes / (1 << 20):.0f} MiB copy, {matmul_n}^3 bf16 matmul"
    how = f"{size}{' (CPU: smaller than the 1 GiB / 8192^3 used on GPUs)' if on_cpu else ''}; {timer_name(device)}"
    return Ceilings(name, 2 * copy_bytes / t_copy, 2 * matmul_n**3 / t_mm, how)
