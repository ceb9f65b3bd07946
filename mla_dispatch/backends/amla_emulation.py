"""The AMLA emulation as a backend: conformance runs of the Ascend algorithm on any device.

Runs :func:`mla_dispatch.kernels.ascend.amla_emulation.amla_decode` directly
(not through the op ``mla_dispatch::amla_decode``, whose NPU kernel is the
thing under test on an Ascend box): the recurrence our Ascend C kernel executes, with its int32 exponent adds, bf16
casts, compensation, guards and split-KV combine. It is slow (a Python loop
over work items) and is never chosen by ``backend="auto"``: it is a built-in
outside the priority table. Ask for it by name::

    mla_decode(..., backend="amla_emulation")
"""

from __future__ import annotations

from mla_dispatch.dispatch.backend import ArchSupport, BackendState, CGSupport, MLABackend, Reason, ReasonCode
from mla_dispatch.numerics.tolerance import Tolerance
from mla_dispatch.dispatch.problem import DecodeProblem

__all__ = ["AMLAEmulationBackend"]

DEFAULT_NUM_CORES = 20  # cube cores of an Ascend 910B3/B4; only the split-KV pattern depends on it


class AMLAEmulationBackend(MLABackend):
    """Bit-faithful AMLA emulation (Ascend algorithm on CPU/GPU); conformance only."""

    NAME = "amla_emulation"
    DESCRIPTION = "AMLA (Ascend) recurrence emulated bit for bit in PyTorch; conformance only"
    PLATFORMS = frozenset({"cpu", "cuda", "rocm", "npu"})
    KV_FORMATS = frozenset({"bf16", "fp16"})
    SUPPORTS_SPARSE = False
    CUDA_GRAPH = CGSupport.NEVER  # reads sequence lengths on the host
    ANY_OUT_STRIDES = True  # out.copy_(...)
    ARCH_SUPPORT = (ArchSupport("any", "any (by name only)", notes="bit-faithful emulation of the AMLA kernel, its "
                                                                    "oracle", run_here="yes: CPU"),)
    # Same bounds as the reference comparison of every bf16 kernel (docs/design.md §5): AMLA's
    # extra error (tests/test_amla_emulation.py) stays well inside them.
    TOLERANCE = Tolerance()

    @classmethod
    def _check_availability(cls) -> list[Reason]:
        try:
            import mla_dispatch.kernels.ascend.amla_emulation  # noqa: F401
        except Exception as exc:
            return [Reason(ReasonCode.UNAVAILABLE, f"import mla_dispatch.kernels.ascend.amla_emulation failed: "
                                                   f"{type(exc).__name__}: {exc}")]
        return []

    @classmethod
    def plan(cls, problem: DecodeProblem, platform, block_table, cache_seqlens, *, softmax_scale: float) -> BackendState:
        cores = platform.num_compute_units if platform.kind == "npu" else DEFAULT_NUM_CORES
        return BackendState(seqlens_host=cache_seqlens.tolist(), num_cores=max(1, int(cores)))

    @classmethod
    def update(cls, state: BackendState, block_table, cache_seqlens) -> None:
        state.seqlens_host = cache_seqlens.tolist()

    @classmethod
    def run(cls, state: BackendState, q, kv_cache, block_table, cache_seqlens, *, problem: DecodeProblem,
            softmax_scale, kv_scale, indices, out, lse) -> None:
        from mla_dispatch.kernels.ascend.amla_emulation import amla_decode

        o, l = amla_decode(q, kv_cache, block_table, cache_seqlens, head_dim_v=problem.head_dim_v,
                           softmax_scale=softmax_scale, causal=problem.causal, num_cores=state.num_cores)
        out.copy_(o)
        lse.copy_(l)
