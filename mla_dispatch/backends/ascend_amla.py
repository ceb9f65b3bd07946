"""Our Ascend C AMLA kernel on Huawei Ascend 910B/910C NPUs.

The kernel (``mla_dispatch/kernels/ascend/kernel/``) implements AMLA (arXiv
2509.25224): output rescaling as int32 additions on the fp32 bit patterns of
the accumulator in global memory, a preload pipeline overlapping the cube and
vector cores, 512-token KV blocks, split-KV with an LSE combine. It is exposed
as the registered op ``mla_dispatch::amla_decode`` whose ``PrivateUse1``
kernel comes from the C++ extension built with CANN.

**Status: written, not compiled or run on hardware** (no CANN toolkit or NPU
was available; see ``kernels/ascend/NOTES.md``). Its numerics are those of the
emulation (``backend="amla_emulation"``), which is tested on CPU/GPU. Where the
extension is not built this backend reports so and ``auto`` falls through to
``torch_npu`` (the vendor op), then ``reference``.
"""

from __future__ import annotations

import torch

from mla_dispatch.dispatch.backend import ArchSupport, BackendState, CGSupport, MLABackend, Reason, ReasonCode
from mla_dispatch.dispatch.problem import DecodeProblem

__all__ = ["AscendAMLABackend"]


def _extension_reasons() -> list[Reason]:
    """Why our NPU op cannot run here (empty: the PrivateUse1 kernel is registered)."""
    try:
        from mla_dispatch.kernels.ascend import ops
    except Exception as exc:
        return [Reason(ReasonCode.UNAVAILABLE, f"import mla_dispatch.kernels.ascend.ops failed: {type(exc).__name__}: {exc}")]
    if ops.npu_kernel_registered():
        return []
    error = ops.load_npu_extension()
    if error is None and ops.npu_kernel_registered():
        return []
    return [Reason(ReasonCode.UNAVAILABLE, error or f"no PrivateUse1 (NPU) kernel is registered for {ops.OP_NAME}")]


class AscendAMLABackend(MLABackend):
    """Our AMLA kernel (Ascend C, cube + vector, int32 exponent-add rescale)."""

    NAME = "ascend_amla"
    DESCRIPTION = "our Ascend C AMLA kernel (written, not compiled or run on hardware)"
    PLATFORMS = frozenset({"npu"})
    ARCHS = frozenset({"Ascend910B", "Ascend910C"})
    KV_FORMATS = frozenset({"bf16", "fp16"})
    HEAD_DIMS = frozenset({(576, 512)})  # the kernel's L1/L0 tiling is specialised for DeepSeek's 576/512
    PAGE_SIZES = frozenset({16, 32, 64, 128, 256, 512})  # pages must tile the 512-token KV block
    MAX_HEADS_Q = 128
    MAX_HEADS_KV = 1
    MAX_Q_LEN = 4  # rows = s_q * h_q <= 512: two 256-row tiles, one per vector core pair
    CUDA_GRAPH = CGSupport.NEVER  # host tiling from host sequence lengths (aclgraph capture not done)
    ARCH_SUPPORT = (ArchSupport("910B/910C", "Ascend 910B/910C", notes="our Ascend C kernel of the AMLA algorithm",
                                run_here="no: not compiled (no CANN); host tiling compiled and tested with g++"),)

    @classmethod
    def version(cls) -> str:
        return "unbuilt"

    @classmethod
    def _check_availability(cls) -> list[Reason]:
        return _extension_reasons()

    @classmethod
    def plan(cls, problem: DecodeProblem, platform, block_table, cache_seqlens, *, softmax_scale: float) -> BackendState:
        # The host tiling needs the lengths on the host (one sync per decode step, as
        # torch_npu's actual_seq_kvlen lists do); every layer reuses them.
        return BackendState(seqlens_host=cache_seqlens.tolist(), num_cores=max(1, int(platform.num_compute_units)))

    @classmethod
    def update(cls, state: BackendState, block_table, cache_seqlens) -> None:
        state.seqlens_host = cache_seqlens.tolist()

    @classmethod
    def run(cls, state: BackendState, q, kv_cache, block_table, cache_seqlens, *, problem: DecodeProblem,
            softmax_scale, kv_scale, indices, out, lse) -> None:
        torch.ops.mla_dispatch.amla_decode(q, kv_cache, block_table, cache_seqlens, state.seqlens_host, out, lse,
                                           softmax_scale, problem.causal, state.num_cores)
