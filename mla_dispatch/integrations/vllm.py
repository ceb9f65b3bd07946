"""vLLM MLA attention backend whose decode runs on mla_dispatch.

Use::

    pip install mla-dispatch            # declares the vllm.general_plugins entry point
    vllm serve deepseek-ai/DeepSeek-V2-Lite --attention-backend CUSTOM

The plugin (:func:`mla_dispatch.integrations.plugins.register_vllm`) registers
:class:`MLADispatchBackend` as ``AttentionBackendEnum.CUSTOM``. Prefill keeps
vLLM's own MLA prefill path (``MLAAttention.prefill_backend`` through
``MLACommonBaseImpl.forward_mha``); decode tokens go through
:meth:`MLADispatchImpl.forward_mqa` to :func:`mla_dispatch.plan_decode` /
:meth:`~mla_dispatch.DecodePlan.run`, which picks the best backend on the device
(native SM90 kernel, FlashMLA, FlashInfer, Triton, AITER, Ascend, the reference).

Contract implemented: vLLM 0.33.0 (PyPI), read from its installed sources —
``vllm/model_executor/layers/attention/mla_attention.py`` (``MLAAttention.forward_impl``:
decode tokens first, ``impl.forward_mqa(q, kv_cache, attn_metadata, layer)``, the LSE
read only when ``impl.dcp_world_size > 1``; ``MLACommonBackend``,
``MLACommonMetadataBuilder`` — ``build`` calls ``_build_decode`` with keywords, marks
a non-causal draft block with ``MLACommonMetadata.causal = False`` only when the builder
declares ``supports_non_causal_multi_token_decode``; ``QueryLenSupport``),
``vllm/v1/attention/backend.py`` (``AttentionBackend.validate_configuration``:
``supports_dcp()`` reads the impl's ``supports_dcp``, ``supports_non_causal()``,
``supports_non_causal_dcp()`` reads the builder's ``supports_non_causal_multi_token_dcp``;
``AttentionImplBase.__new__`` sets ``need_to_return_lse_for_decode = dcp_world_size > 1 and
can_return_lse_for_decode``; ``AttentionCGSupport``, ``MultipleOf``),
``vllm/v1/attention/backends/mla/triton_mla.py`` and ``flashmla.py`` (the shape of an MLA
decode backend), ``vllm/v1/attention/backends/registry.py`` (``register_backend``,
``AttentionBackendEnum.CUSTOM``), ``vllm/plugins/__init__.py`` (``vllm.general_plugins``).
Releases before 0.33 (no ``max_query_len`` in ``_build_decode``, no ``kv_cache_spec``
argument, ``_forward_decode`` instead of ``forward_mqa``) are accepted where the
difference is a name or an argument.

What is declared to vLLM comes from mla_dispatch's registry for the current device
(:func:`~mla_dispatch.integrations.layouts.engine_capabilities` over the backends
``"auto"`` may choose): block sizes (any, when some backend takes any page size; else
the union), model dtypes, KV-cache dtypes, CUDA-graph support (only on a GPU). Decode
context parallelism (DCP) is supported: each rank attends over its local tokens and
returns the natural-log LSE that vLLM's merge reads. Limits: dense MLA only (DeepSeek-V3.2's sparse
path is :mod:`mla_dispatch.integrations.vllm_sparse`, ``MLA_DISPATCH_SPARSE``), uniform decode query lengths (spec decode with a fixed
number of draft tokens), causal multi-token decode not under DCP (the causal mask
needs global positions; vLLM keeps such batches off the decode path unless a builder
declares ``supports_dcp_with_varlen``, which this one does not), ``fp8`` caches as
``float8_e4m3fn`` with a per-tensor scale (not ROCm's ``e4m3fnuz``). vLLM's CPU
platform picks its own MLA backend whatever ``--attention-backend`` says
(``vllm/platforms/cpu.py``, ``CpuPlatform.get_attn_backend_cls``). This module imports
vLLM; nothing else in mla_dispatch does.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import ClassVar

import torch
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonBackend,
    MLACommonDecodeMetadata,
    MLACommonImpl,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
    QueryLenSupport,
)
from vllm.v1.attention.backend import AttentionCGSupport, AttentionLayer, AttentionType, MultipleOf

from mla_dispatch.api import DecodePlan, plan_decode
from mla_dispatch.integrations.plan_cache import PlanCache
from mla_dispatch.integrations.layouts import (
    EngineCapabilities,
    auto_candidates,
    engine_capabilities,
    vllm_decode_outputs,
    vllm_decode_query,
    vllm_kv_cache,
    vllm_kv_cache_dtypes,
    vllm_kv_format,
)
from mla_dispatch.dispatch.platform import detect_platform

__all__ = ["MLADispatchBackend", "MLADispatchMetadataBuilder", "MLADispatchImpl", "capabilities"]


@functools.lru_cache(maxsize=1)
def capabilities() -> EngineCapabilities:
    """What mla_dispatch can run on this process's device (computed once)."""
    platform = detect_platform()
    return engine_capabilities(auto_candidates(platform), platform.kind)


class MLADispatchBackend(MLACommonBackend):
    """``AttentionBackendEnum.CUSTOM``: vLLM's MLA layout, decode through mla_dispatch."""

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_builder_cls() -> type["MLADispatchMetadataBuilder"]:
        return MLADispatchMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type["MLADispatchImpl"]:
        return MLADispatchImpl

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        # vLLM 0.33 passes the layer's KV-cache spec; earlier releases pass nothing.
        sizes = capabilities().page_sizes
        return [MultipleOf(1)] if sizes is None else list(sizes)

    @classmethod
    def supports_dtype(cls, dtype: torch.dtype) -> bool:
        return dtype in capabilities().q_dtypes

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype) -> bool:
        return kv_cache_dtype is None or kv_cache_dtype in vllm_kv_cache_dtypes(capabilities())

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return True  # the reference runs anywhere; plan_decode picks the fast path

    @classmethod
    def supports_non_causal(cls) -> bool:
        # Non-causal draft blocks (DSpark): every query row sees the whole prefix, plan_decode(causal=False).
        return True

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        # vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT): the selector passes use_batch_invariant to
        # validate_configuration, which refuses a backend without this (vllm/v1/attention/selector.py, backend.py);
        # forward_mqa then plans with batch_invariant=True, which keeps split-KV (fixed-size splits)
        return True

    @classmethod
    def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink, use_sparse,
                             *args, **kwargs) -> str | None:
        if use_sparse:
            return "mla_dispatch's CUSTOM backend runs dense MLA (sparse: MLA_DISPATCH_SPARSE)"
        if has_sink:
            return "attention sinks are not supported by mla_dispatch's vLLM backend"
        return None


def _batch_invariant_mode() -> bool:
    """Whether vLLM runs in its batch-invariant mode: ``VLLM_BATCH_INVARIANT`` (vllm/envs.py in 0.33), or the
    helper other releases keep (``vllm.model_executor.layers.batch_invariant.vllm_is_batch_invariant``)."""
    try:
        from vllm.model_executor.layers.batch_invariant import vllm_is_batch_invariant
    except ImportError:
        import vllm.envs as envs

        if hasattr(envs, "VLLM_BATCH_INVARIANT"):
            return bool(envs.VLLM_BATCH_INVARIANT)
        return os.environ.get("VLLM_BATCH_INVARIANT", "0") not in ("", "0")
    return bool(vllm_is_batch_invariant())


class _PlanSlot:
    """One decode step's plan, found by the first layer that runs (the builder's kept plan of these shapes, updated
    with this step's table and lengths, or a new one) and reused by the rest."""

    __slots__ = ("plan", "plans")

    def __init__(self, plans: PlanCache | None = None) -> None:
        self.plan: DecodePlan | None = None
        self.plans = plans  # the builder's plans, kept across steps


@dataclasses.dataclass
class MLADispatchDecodeMetadata(MLACommonDecodeMetadata):
    plan_slot: _PlanSlot = dataclasses.field(default_factory=_PlanSlot)


class MLADispatchMetadataBuilder(MLACommonMetadataBuilder[MLACommonMetadata]):
    """Decode metadata: vLLM's block table and sequence lengths plus an empty plan slot.

    The plan itself needs the query's geometry, which the builder does not see,
    so the first layer's ``forward_mqa`` finds it (FlashMLA's ``FlashMLASchedMeta``
    works the same way): the plan the builder keeps for these shapes
    (:class:`~mla_dispatch.integrations.plan_cache.PlanCache`), updated with this
    step's table and lengths (``DecodePlan.update``: the schedule refreshed in
    place, one launch for the in-house backends), or a new one where no plan of
    these shapes is kept. Under full CUDA-graph capture the planning is captured
    with the layer, so every replay re-plans from the live ``seq_lens`` buffer on
    the device; a plan captured so is kept for good.
    """

    query_len_support: ClassVar[QueryLenSupport] = QueryLenSupport.UNIFORM
    # MLACommonMetadataBuilder.build keeps a non-causal block on the decode path (causal=False on the
    # metadata) only when the builder says so; plan_decode(causal=False) runs it as one block.
    supports_non_causal_multi_token_decode: ClassVar[bool] = True
    # Non-causal rows see every local token, so each DCP rank's (out, lse) is exact for its shard and
    # vLLM's LSE merge recombines them (AttentionBackend.supports_non_causal_dcp).
    supports_non_causal_multi_token_dcp: ClassVar[bool] = True

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        return AttentionCGSupport.UNIFORM_BATCH if capabilities().cuda_graph else AttentionCGSupport.NEVER

    def _build_decode(self, block_table_tensor, seq_lens_device, *args, **kwargs) -> MLADispatchDecodeMetadata:
        # vLLM passes keywords; the list grew (max_query_len, 0.33) and dcp_tot_seq_lens_device stays last.
        dcp_tot_seq_lens = kwargs.get("dcp_tot_seq_lens_device", args[-1] if len(args) >= 5 else None)
        plans = self.__dict__.get("_mla_dispatch_plans")
        if plans is None:
            plans = self.__dict__["_mla_dispatch_plans"] = PlanCache()
        return MLADispatchDecodeMetadata(
            block_table=block_table_tensor,
            seq_lens=seq_lens_device,
            dcp_tot_seq_lens=dcp_tot_seq_lens,
            plan_slot=_PlanSlot(plans),
        )


class MLADispatchImpl(MLACommonImpl[MLACommonMetadata]):
    """``forward_mqa`` on :func:`mla_dispatch.plan_decode` / :meth:`DecodePlan.run`.

    The LSE is computed only when vLLM reads it (``need_to_return_lse_for_decode``,
    i.e. under DCP); otherwise ``forward_mqa`` returns ``(o, None)``.
    """

    can_return_lse_for_decode: bool = True
    # AttentionBackend.supports_dcp() reads this; without it vLLM refuses the backend with "DCP not supported".
    supports_dcp: bool = True

    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                 logits_soft_cap, attn_type, kv_sharing_target_layer_name, **mla_args) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                         logits_soft_cap, attn_type, kv_sharing_target_layer_name, **mla_args)
        if alibi_slopes or sliding_window or logits_soft_cap:
            raise NotImplementedError("mla_dispatch's vLLM backend does not support alibi_slopes, sliding_window "
                                      "or logits_soft_cap")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"mla_dispatch's vLLM backend supports decoder attention only, got {attn_type}")
        self.kv_format = vllm_kv_format(kv_cache_dtype)
        # q reaches us in the model dtype even with an fp8 cache (mla_dispatch dequantises the cache).
        self.supports_quant_query_input = False

    def forward_mqa(self, q, kv_c_and_k_pe_cache: torch.Tensor, attn_metadata: MLACommonMetadata,
                    layer: AttentionLayer) -> tuple[torch.Tensor, torch.Tensor | None]:
        decode = attn_metadata.decode
        if decode is None:
            raise ValueError("forward_mqa was called without decode metadata")
        query = vllm_decode_query(q, attn_metadata.num_decodes)
        # MLACommonMetadata.causal is False only for a non-causal draft block (the builder declares it).
        causal = bool(getattr(attn_metadata, "causal", True))
        dcp_world_size = getattr(self, "dcp_world_size", 1)
        if causal and query.shape[1] > 1 and dcp_world_size > 1:
            raise ValueError(
                f"causal multi-token decode (query length {query.shape[1]}) with decode context parallelism "
                f"(dcp_world_size={dcp_world_size}) is not supported: the causal mask needs each token's "
                "global position, and seq_lens holds this rank's local count")
        kv = vllm_kv_cache(kv_c_and_k_pe_cache)
        kv_scale = layer._k_scale if self.kv_format == "fp8_e4m3" else None
        # Set by vLLM (AttentionImplBase.__new__) when dcp_world_size > 1: only then is the LSE read.
        return_lse = bool(getattr(self, "need_to_return_lse_for_decode", True))
        slot = getattr(decode, "plan_slot", None)
        plan = slot.plan if slot is not None else None
        if plan is None:
            capturing = query.is_cuda and torch.cuda.is_current_stream_capturing()
            table, lens = decode.block_table, decode.seq_lens

            def make() -> DecodePlan:
                return plan_decode(query, kv, table, lens, head_dim_v=self.kv_lora_rank, softmax_scale=self.scale,
                                   causal=causal, kv_format=self.kv_format, kv_scale=kv_scale, return_lse=return_lse,
                                   cuda_graph=capturing, batch_invariant=_batch_invariant_mode())

            if slot is None or slot.plans is None:
                plan = make()
            else:
                # the kept plan of these shapes takes this step's table and lengths (its schedule refreshed in
                # place; a captured graph replays that too), else a new one
                key = (tuple(query.shape), query.dtype, tuple(kv.shape[1:]), kv.dtype, tuple(table.shape),
                       tuple(lens.shape), query.device, causal, self.kv_format, kv_scale is None, return_lse,
                       capturing, _batch_invariant_mode(), float(self.scale))
                plan = slot.plans.get(key, make, query.device,
                                      reuse=lambda kept: kept.update(block_table=table, cache_seqlens=lens))
            if slot is not None:
                slot.plan = plan
        out, lse = plan.run(query, kv, kv_scale=kv_scale)
        return vllm_decode_outputs(out, lse if return_lse else None)

    # The same hook's name in the vLLM releases before forward_mqa.
    _forward_decode = forward_mqa
