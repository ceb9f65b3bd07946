"""vLLM sparse-MLA backend (DeepSeek-V3.2's DSA) whose fp8 decode runs on mla_dispatch.

Use::

    pip install mla-dispatch            # declares the vllm.general_plugins entry point
    vllm serve deepseek-ai/DeepSeek-V3.2 --kv-cache-dtype fp8_ds_mla --attention-backend MLA_DISPATCH_SPARSE

The plugin (:func:`mla_dispatch.integrations.plugins.register_vllm`) registers
:class:`MLADispatchSparseBackend` under the name ``MLA_DISPATCH_SPARSE``. It is vLLM's own
``FLASHMLA_SPARSE`` backend (``vllm/v1/attention/backends/mla/flashmla_sparse.py``: its metadata
builder, the indexer's top-k conversion to cache token ids, prefill, DCP, the host-backed cache)
with one change: every fp8 decode launch, which vLLM makes through
``FlashMLASparseImpl._fp8_flash_mla_kernel`` (the pure-decode, mixed-batch and host-backed paths
all call it), runs :func:`mla_dispatch.plan_decode` / :meth:`~mla_dispatch.DecodePlan.run` with
``indices`` instead of FlashMLA's sparse kernel. So it takes what FlashMLA's kernel does not: any
head count per rank (no padding of q to 64 or 128 heads), and any backend mla_dispatch picks on
the device (our SM90 kernel, FlashMLA, Triton).

Contract implemented: vLLM 0.33.0 (PyPI), read from its installed sources —
``FlashMLASparseImpl._fp8_flash_mla_kernel(q [b, s_q, h, 576] bf16, kv_c_and_k_pe_cache [pages,
page, 656] (uint8 or fp8 viewed as bytes), topk_indices [b, s_q, topk] int32 cache token ids, -1 =
none, kernel_metadata) -> (out [b, s_q, h, 512], lse [b, h, s_q])``, the LSE in natural log
(vLLM's DCP merge reads it). The bf16-cache path (``_forward_bf16_kv``) and prefill keep vLLM's
FlashMLA sparse prefill kernel, so this backend needs what ``FLASHMLA_SPARSE`` needs on the device.
This module imports vLLM; nothing else in mla_dispatch does.
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend, FlashMLASparseImpl

from mla_dispatch.api import DecodePlan, plan_decode
from mla_dispatch.integrations.plan_cache import PlanCache

__all__ = ["MLADispatchSparseBackend", "MLADispatchSparseImpl", "SPARSE_BACKEND_NAME"]

#: the name ``--attention-backend`` selects (registered by the plugin)
SPARSE_BACKEND_NAME = "MLA_DISPATCH_SPARSE"


class MLADispatchSparseImpl(FlashMLASparseImpl):
    """vLLM's FlashMLA-sparse implementation with its fp8 decode kernel replaced by mla_dispatch."""

    def _sparse_plan(self, q: torch.Tensor, kv: torch.Tensor, topk_indices: torch.Tensor) -> DecodePlan:
        """The plan for this shape (:class:`~mla_dispatch.integrations.plan_cache.PlanCache`: made on a shape's first
        call, kept for good once a CUDA graph captured it; vLLM warms each captured size up before capture)."""
        plans = self.__dict__.get("_mla_dispatch_plans")
        if plans is None:
            plans = self.__dict__["_mla_dispatch_plans"] = PlanCache()
        key = (tuple(q.shape), q.dtype, tuple(kv.shape[1:]), kv.dtype, tuple(topk_indices.shape), q.device)
        return plans.get(key, lambda: plan_decode(q, kv, None, None, indices=topk_indices, head_dim_v=512,
                                                  softmax_scale=self.softmax_scale, kv_format="fp8_ds_mla",
                                                  return_lse=True), q.device)

    def _fp8_flash_mla_kernel(self, q: torch.Tensor, kv_c_and_k_pe_cache: torch.Tensor, topk_indices: torch.Tensor,
                              kernel_metadata=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [b, s_q, h, 512], lse [b, h, s_q])`` of top-k decode over the 656-byte ``fp8_ds_mla`` cache."""
        kv = kv_c_and_k_pe_cache.view(torch.uint8)
        if kv.dim() == 3:  # [pages, page, 656] -> one KV head
            kv = kv.unsqueeze(-2)
        if topk_indices.dtype != torch.int32:
            topk_indices = topk_indices.to(torch.int32)
        plan = self._sparse_plan(q, kv, topk_indices)
        return plan.run(q, kv, indices=topk_indices)


class MLADispatchSparseBackend(FlashMLASparseBackend):
    """``MLA_DISPATCH_SPARSE``: vLLM's FlashMLA-sparse backend, fp8 decode through mla_dispatch."""

    @staticmethod
    def get_name() -> str:
        return SPARSE_BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[MLADispatchSparseImpl]:
        return MLADispatchSparseImpl
