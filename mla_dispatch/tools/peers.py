"""Peers timed beside our backends in ``bench``: FlashMLA called directly, through its own Python API, on the
same inputs (docs/design.md §6), and the host-time measurements every row reports.

FlashMLA is optional: where ``import flash_mla`` fails (or resolves to mla_dispatch's own alias), no peer row is
made. Its direct call is timed as its users call it:

- ``graph``: ``get_mla_metadata()``, one warm-up call (which fills the scheduling object), then one
  ``flash_mla_with_kvcache`` captured in a CUDA graph and replayed (decode and combine kernels, the schedule
  already made), each replay after an L2 flush;
- ``call``: the whole eager call, a fresh ``get_mla_metadata()`` and ``flash_mla_with_kvcache`` (FlashMLA then
  computes its schedule inside the call), with ``triton.testing.do_bench``;
- ``host_call_us``: the same whole call by wall clock with a device synchronisation after, median of 50.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from mla_dispatch.numerics.cases import DecodeCase
from mla_dispatch.numerics.tolerance import BF16_TOLERANCE, compare_outputs

__all__ = ["PEER_FLASHMLA", "flashmla_peer_available", "flashmla_runs", "time_flashmla", "host_us"]

#: The name of FlashMLA's own rows in bench output ("flashmla" is our adapter over it).
PEER_FLASHMLA = "FlashMLA (direct)"


def flashmla_peer_available() -> str | None:
    """FlashMLA's version when the real ``flash_mla`` imports here, else None."""
    try:
        import flash_mla
    except Exception:
        return None
    if getattr(flash_mla, "MLA_DISPATCH_ALIAS", None) is not None or not hasattr(flash_mla, "flash_mla_with_kvcache"):
        return None
    return str(getattr(flash_mla, "__version__", "unknown"))


def flashmla_runs(case: DecodeCase) -> bool:
    """Whether FlashMLA takes ``case`` as it is (no re-viewing). Dense: page 64, one KV head, a 16-bit cache of q's
    dtype, D_qk 576 or 512 with D_v 512. Sparse (its SM90 kernel, ``csrc/api/sparse_decode.h``): a DeepSeek-V3.2
    ``fp8_ds_mla`` cache (656 bytes per token) of one KV head, bf16 q with D_qk 576, h_q 64 or 128, any page size."""
    kv, q = case.kv_cache, case.q
    if not q.is_cuda or kv.dim() != 4 or kv.shape[2] != 1 or case.head_dim_v != 512:
        return False
    if case.indices is not None:
        return (case.kv_format == "fp8_ds_mla" and q.dtype == torch.bfloat16 and q.shape[-1] == 576
                and q.shape[2] in (64, 128))
    return (kv.shape[1] == 64 and kv.dtype == q.dtype and q.dtype in (torch.bfloat16, torch.float16)
            and q.shape[-1] in (576, 512))


def host_us(fn: Callable[[], object], device: torch.device, *, reps: int = 50) -> float:
    """Median wall-clock µs of ``fn()`` followed by a device synchronisation (after three warm-up calls)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        fn()
    sync()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def time_flashmla(case: DecodeCase, ref: tuple[torch.Tensor, torch.Tensor], time_fn, *, rep_ms: float) -> dict:
    """FlashMLA's direct call on ``case``: checked against ``ref`` (docs/design.md §5 bounds), then timed.

    Returns ``{"status", "note", "us_call", "us_graph", "host_call_us"}``; ``status`` is ``ok`` or ``wrong`` (not
    timed) or ``error``.
    """
    import flash_mla

    q, kv = case.q, case.kv_cache
    if case.indices is not None:  # sparse: no table, no lengths; the cache as FlashMLA's sparse call takes it
        args = (q, kv, None, None, case.head_dim_v)
        kw = dict(softmax_scale=case.softmax_scale, causal=False, is_fp8_kvcache=True, indices=case.indices)
    else:
        args = (q, kv, case.block_table, case.cache_seqlens, case.head_dim_v)
        kw = dict(softmax_scale=case.softmax_scale, causal=case.causal)

    def whole_call():
        meta, _ = flash_mla.get_mla_metadata()
        return flash_mla.flash_mla_with_kvcache(*args, meta, None, **kw)

    try:
        out, lse = whole_call()
        report = compare_outputs(out, lse, ref[0], ref[1], BF16_TOLERANCE)
        if not report:
            return {"status": "wrong", "note": report.message}
        result = {"status": "ok", "note": "",
                  "us_call": time_fn(whole_call, q.device, rep_ms=rep_ms) * 1e6,
                  "host_call_us": host_us(whole_call, q.device)}
        meta, _ = flash_mla.get_mla_metadata()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            flash_mla.flash_mla_with_kvcache(*args, meta, None, **kw)  # fills the scheduling object
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            g_out, g_lse = flash_mla.flash_mla_with_kvcache(*args, meta, None, **kw)
        g_out.fill_(float("nan"))
        g_lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        report = compare_outputs(g_out, g_lse, ref[0], ref[1], BF16_TOLERANCE)
        if not report:
            return {"status": "wrong", "note": f"CUDA-graph replay: {report.message}"}
        result["us_graph"] = time_fn(graph.replay, q.device, rep_ms=rep_ms) * 1e6
        return result
    except Exception as exc:  # a peer that crashes is a result too
        return {"status": "error", "note": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
