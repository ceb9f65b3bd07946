"""Peers timed beside our backends in ``bench``: FlashMLA and FlashAttention-3 called directly, through their own
Python APIs, on the same inputs (docs/design.md §6), and the host-time measurements every row reports.

FlashMLA is optional: where ``import flash_mla`` fails (or resolves to mla_dispatch's own alias), no peer row is
made. Its direct call is timed as its users call it:

- ``graph``: ``get_mla_metadata()``, one warm-up call (which fills the scheduling object), then one
  ``flash_mla_with_kvcache`` captured in a CUDA graph and replayed (decode and combine kernels, the schedule
  already made), each replay after an L2 flush;
- ``call``: the whole eager call, a fresh ``get_mla_metadata()`` and ``flash_mla_with_kvcache`` (FlashMLA then
  computes its schedule inside the call), with ``triton.testing.do_bench``;
- ``host_call_us``: the same whole call by wall clock with a device synchronisation after, median of 50.

FlashAttention-3 (its MLA path: the RoPE part as q/k, the latent as ``qv``/v; vLLM's FLASH_ATTN_MLA) is optional
the same way: where none of the modules the ``fa3`` backend imports provides it, no peer row is made. It is called as
vLLM calls it, through the backend class's ``attention`` (views of the same tensors and FA3's one call, nothing else)
and ``scheduler_metadata``:

- ``graph``: ``get_scheduler_metadata`` once (vLLM's per-step schedule), one warm-up call, then one call captured in a
  CUDA graph and replayed, each replay after an L2 flush;
- ``call`` / ``host_call_us``: ``get_scheduler_metadata`` and the call, eagerly (one step of one layer).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from mla_dispatch.numerics.cases import DecodeCase
from mla_dispatch.numerics.tolerance import BF16_TOLERANCE, compare_outputs

__all__ = ["PEER_FLASHMLA", "PEER_FA3", "flashmla_peer_available", "flashmla_runs", "time_flashmla",
           "fa3_peer_available", "fa3_runs", "time_fa3", "host_us"]

#: The name of FlashMLA's own rows in bench output ("flashmla" is our adapter over it).
PEER_FLASHMLA = "FlashMLA (direct)"
#: The name of FlashAttention-3's own rows ("fa3" is our adapter over it).
PEER_FA3 = "FA3 (direct)"


def flashmla_peer_available() -> str | None:
    """FlashMLA's version when the real ``flash_mla`` imports here, else None."""
    try:
        import flash_mla
    except Exception:
        return None
    if getattr(flash_mla, "MLA_DISPATCH_ALIAS", None) is not None or not hasattr(flash_mla, "flash_mla_with_kvcache"):
        return None
    return str(getattr(flash_mla, "__version__", "unknown"))


def sparse_padded_heads(h_q: int) -> int:
    """The head count FlashMLA's SM90 sparse kernel runs ``h_q`` query heads at: 64 or 128 (its only two), the
    smallest that holds them, as engines pad q for it (vLLM's FLASHMLA_SPARSE backend pads fewer heads to 64, e.g.
    DeepSeek-V3.2's 16 per GPU at TP8); 0 above 128."""
    return 64 if h_q <= 64 else 128 if h_q <= 128 else 0


def flashmla_runs(case: DecodeCase) -> bool:
    """Whether FlashMLA takes ``case`` (no re-viewing of the cache). Dense: page 64, one KV head, a 16-bit cache of
    q's dtype, D_qk 576 or 512 with D_v 512. Sparse (its SM90 kernel, ``csrc/api/sparse_decode.h``): a
    DeepSeek-V3.2 ``fp8_ds_mla`` cache (656 bytes per token) of one KV head, bf16 q with D_qk 576, any page size;
    or DeepSeek-V4's ``fp8_ds_v4`` (FlashMLA's MODEL1) with D_qk 512, one key list (no sink, no extra cache: the
    bench's cases have neither); up to 128 heads, q padded with zero heads to 64 or 128 where it has others
    (:func:`sparse_padded_heads`, :func:`time_flashmla`)."""
    kv, q = case.kv_cache, case.q
    if not q.is_cuda or kv.dim() != 4 or kv.shape[2] != 1 or case.head_dim_v != 512:
        return False
    if case.indices is not None:  # DeepSeek-V3.2's token (D_qk 576) or V4's (MODEL1, D_qk 512)
        formats = {"fp8_ds_mla": 576, "fp8_ds_v4": 512}
        return (formats.get(case.kv_format) == q.shape[-1] and q.dtype == torch.bfloat16
                and sparse_padded_heads(q.shape[2]) > 0
                and case.attn_sink is None and case.extra_kv_cache is None and case.topk_length is None)
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

    A sparse case of other than 64 or 128 heads runs as engines run it: each call copies q into a buffer of
    :func:`sparse_padded_heads` heads whose others are zero, and its outputs are the first ``h_q`` heads of
    FlashMLA's (views); the copy is part of the timed call and of the captured graph, and ``note`` says so.

    Returns ``{"status", "note", "us_call", "us_graph", "host_call_us"}``; ``status`` is ``ok`` or ``wrong`` (not
    timed) or ``error``.
    """
    import flash_mla

    q, kv = case.q, case.kv_cache
    h_q = q.shape[2]
    padded = sparse_padded_heads(h_q) if case.indices is not None else h_q
    q_in = q if padded == h_q else torch.zeros(*q.shape[:2], padded, q.shape[3], dtype=q.dtype, device=q.device)
    if case.indices is not None:  # sparse: no table, no lengths; the cache as FlashMLA's sparse call takes it
        args = (q_in, kv, None, None, case.head_dim_v)
        kw = dict(softmax_scale=case.softmax_scale, causal=False, is_fp8_kvcache=True, indices=case.indices)
    else:
        args = (q, kv, case.block_table, case.cache_seqlens, case.head_dim_v)
        kw = dict(softmax_scale=case.softmax_scale, causal=case.causal)

    def call(meta):
        if padded == h_q:
            return flash_mla.flash_mla_with_kvcache(*args, meta, None, **kw)
        q_in[:, :, :h_q].copy_(q)
        out, lse = flash_mla.flash_mla_with_kvcache(*args, meta, None, **kw)
        return out[:, :, :h_q], lse[:, :h_q]

    def whole_call():
        meta, _ = flash_mla.get_mla_metadata()
        return call(meta)

    def graphed():  # one scheduling object, filled by the warm-up call before capture
        meta, _ = flash_mla.get_mla_metadata()
        return lambda: call(meta)

    def check(out, lse):
        return compare_outputs(out, lse, ref[0], ref[1], BF16_TOLERANCE)

    result = _check_and_time(whole_call, graphed, check, q.device, time_fn, rep_ms)
    if padded != h_q and result["status"] == "ok":
        result["note"] = f"h_q {h_q} padded to {padded} (q copied into zero heads each call, as engines do)"
    return result


def _check_and_time(whole_call, graphed, check, device, time_fn, rep_ms: float) -> dict:
    """A peer's direct call: ``whole_call()`` checked (``check(out, lse)``) and timed eagerly, then the call that
    ``graphed()`` returns run once on a side stream, captured in a CUDA graph, replayed into NaN-poisoned outputs,
    checked again and timed. Returns the keys of :func:`time_flashmla`."""
    try:
        report = check(*whole_call())
        if not report:
            return {"status": "wrong", "note": report.message}
        result = {"status": "ok", "note": "",
                  "us_call": time_fn(whole_call, device, rep_ms=rep_ms) * 1e6,
                  "host_call_us": host_us(whole_call, device)}
        step = graphed()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            g_out, g_lse = step()
        g_out.fill_(float("nan"))
        g_lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        report = check(g_out, g_lse)
        if not report:
            return {"status": "wrong", "note": f"CUDA-graph replay: {report.message}"}
        result["us_graph"] = time_fn(graph.replay, device, rep_ms=rep_ms) * 1e6
        return result
    except Exception as exc:  # a peer that crashes is a result too
        return {"status": "error", "note": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}


def fa3_peer_available() -> str | None:
    """FlashAttention-3's version (and the module that provides it) when the ``fa3`` backend finds one here, else
    None."""
    from mla_dispatch.dispatch.registry import get_backend

    fa3 = get_backend("fa3")
    return None if fa3.availability_reasons() else fa3.version()


def _fa3_problem(case: DecodeCase):
    from mla_dispatch.dispatch.problem import describe_inputs

    return describe_inputs(case.q, case.kv_cache, case.block_table, case.cache_seqlens, head_dim_v=case.head_dim_v,
                           causal=case.causal, kv_format=case.kv_format, kv_scale=case.kv_scale,
                           indices=case.indices, return_lse=True)


def fa3_runs(case: DecodeCase) -> bool:
    """Whether FA3 takes ``case``: what the ``fa3`` backend declares for it on this device (the adapter passes FA3
    views of the same tensors, so FA3 runs the cases it does: dense, a 16-bit cache of q's dtype, D 576/512, SM90; any
    page size and head count), and its paged-TMA path too, which the backend declines for what a NaN in an unused
    slot does there (:meth:`~mla_dispatch.backends.fa3.FA3Backend.paged_tma_reason`): :func:`time_fa3` times that path, the one
    vLLM's FLASH_ATTN_MLA runs, on the case's cache with its unused slots zeroed."""
    from mla_dispatch.dispatch.platform import platform_for
    from mla_dispatch.dispatch.registry import get_backend

    if not case.q.is_cuda or case.indices is not None or case.kv_cache.dim() != 4:
        return False
    problem = _fa3_problem(case)
    fa3 = get_backend("fa3")
    reasons = fa3.not_supported_reasons(problem, platform_for(case.q.device))
    if fa3.uses_paged_tma(problem):
        reasons = [r for r in reasons if r != fa3.paged_tma_reason(problem)]
    return not reasons


def time_fa3(case: DecodeCase, ref: tuple[torch.Tensor, torch.Tensor], time_fn, *, rep_ms: float) -> dict:
    """FlashAttention-3's direct call on ``case``: checked against ``ref`` (docs/design.md §5 bounds; FA3's -inf LSE of
    a row without keys read as the canonical +inf), then timed. Returns the keys of :func:`time_flashmla`. On FA3's
    paged-TMA path (:func:`fa3_runs`) the call reads a copy of the cache whose unused slots (NaN in bench's cases) are
    zero, and the note says so."""
    from mla_dispatch.dispatch.registry import get_backend

    fa3 = get_backend("fa3")
    prov, module = fa3.vendor()
    problem = _fa3_problem(case)
    q = case.q
    kv_cache = case.kv_cache
    tma = fa3.uses_paged_tma(problem)
    if tma:  # only unused slots hold NaN in a bench case (make_bench_case): zero them, the values FA3 reads
        kv_cache = kv_cache.masked_fill(kv_cache.isnan(), 0)
    cu_q = (torch.arange(0, problem.batch * problem.q_len + 1, problem.q_len, dtype=torch.int32, device=q.device)
            if prov.call == "varlen" else None)

    def call(meta):
        return fa3.attention(prov, module, problem, q, kv_cache, case.block_table, case.cache_seqlens,
                             softmax_scale=case.softmax_scale, meta=meta, num_splits=0, cu_seqlens_q=cu_q)

    def schedule():
        return fa3.scheduler_metadata(module, problem, case.cache_seqlens, cu_seqlens_q=cu_q, num_splits=0)

    def whole_call():
        return call(schedule())

    def check(out, lse):
        return compare_outputs(out, torch.where(torch.isneginf(lse), float("inf"), lse), ref[0], ref[1],
                               BF16_TOLERANCE)

    def graphed():  # the schedule made once, outside the capture
        meta = schedule()
        return lambda: call(meta)

    result = _check_and_time(whole_call, graphed, check, q.device, time_fn, rep_ms)
    if tma:
        result["note"] = "; ".join(filter(None, [result["note"], "paged-TMA path, on the cache with its unused slots "
                                                                 "zeroed (it reads them)"]))
    return result
