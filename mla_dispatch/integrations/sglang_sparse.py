"""SGLang DeepSeek sparse-attention (DSA) backend whose fp8 decode runs on mla_dispatch.

Use::

    pip install mla-dispatch            # declares the sglang.srt.plugins entry point
    sglang serve --model-path deepseek-ai/DeepSeek-V3.2 --attention-backend mla_dispatch_dsa --kv-cache-dtype fp8_e4m3

The plugin (:func:`mla_dispatch.integrations.plugins.register_sglang`) registers
:class:`MLADispatchDSABackend` under the name ``mla_dispatch_dsa``. It is SGLang's own ``dsa`` backend
(``DeepseekSparseAttnBackend``: its metadata, the indexer's top-k and its conversion to cache token ids,
prefill, the KV writes, the CUDA-graph buffers) with one change: every launch SGLang makes through
``_forward_flashmla_kv`` (decode; target-verify and draft-extend rows; prefill when the prefill kernel
is ``flashmla_kv``, SGLang's Hopper default for an fp8 cache) runs :func:`mla_dispatch.plan_decode` /
:meth:`~mla_dispatch.DecodePlan.run` with ``indices`` instead of FlashMLA's sparse kernel. So it takes
what FlashMLA's kernel does not: any head count per rank (no padding of q to 64 or 128 heads), and any
backend mla_dispatch picks on the device (our SM90 kernel, FlashMLA, Triton).

That change applies where the cache is stored in the 656-byte ``fp8_ds_mla`` layout (SGLang's
``dsa_kv_cache_store_fp8``): there the backend sets its decode kernel to ``flashmla_kv``, whatever
``--dsa-decode-backend`` chose. SGLang stores that layout for ``--kv-cache-dtype fp8_e4m3`` on CUDA
unless a ``trtllm`` or TileLang DSA kernel is configured: on Hopper its fp8 defaults (``flashmla_kv`` for
both) do; on Blackwell, whose fp8 default is ``trtllm``, pick others, e.g. ``--dsa-prefill-backend
flashmla_kv --dsa-decode-backend flashmla_kv``. Any
other cache (bf16, raw fp8, the 528-byte no-RoPE layout) keeps SGLang's behaviour unchanged: its own
decode kernel, and ``_forward_flashmla_kv`` as SGLang wrote it (a warning says so at start-up).

Selecting it by name: SGLang's DeepSeek code picks its attention path from the backend's name, read from
``AttentionBackend.decode_attention_backend_str`` / ``prefill_attention_backend_str`` (stamped by
``build_attention_backends``); an unknown name gets the ``triton`` path, which is wrong for DSA. This
backend reads ``"dsa"`` there, the backend it is, so the model runs its DSA path under ``mla_dispatch_dsa``.
Other parts of SGLang check the configured name itself and accept ``dsa`` only: two-batch overlap
(``--enable-two-batch-overlap``, refused here: it stamps a wrapper), speculative decoding (the draft
backends) and prefill context parallelism. For those, opt in to replacing SGLang's own name: with
``MLA_DISPATCH_SGLANG_REPLACE_DSA=1`` in the environment the plugin also registers this backend as
``dsa`` (the default for DSA models, or ``--attention-backend dsa``); drafts keep SGLang's classes.

Contract implemented: SGLang 0.5.23 (PyPI wheel), read from its installed sources —
``srt/layers/attention/dsa_backend.py``: ``DeepseekSparseAttnBackend.__init__`` (``dsa_decode_impl`` from
``get_exec().kernel.dsa_decode_backend``, ``dsa_kv_cache_store_fp8`` and ``kv_cache_dim`` from the pool,
``physical_page_size``), ``forward_decode`` / ``forward_extend`` (dispatch on ``dsa_decode_impl`` /
``dsa_prefill_impl``; ``flashmla_kv`` calls ``_forward_flashmla_kv``), ``_forward_flashmla_kv(q_all [T, h,
576] bf16, kv_cache [rows, 1, 656] float8_e4m3fn (the pool's ``get_key_buffer(layer_id)``, uint8 storage),
v_head_dim, sm_scale = layer.scaling, layer, metadata, page_table_1 [T, topk] int32 cache token ids, -1 =
none) -> o [T, 1, h, v_head_dim]`` (each row one query token; the LSE is dropped);
``srt/mem_cache/memory_pool.py`` (``MLATokenToKVPool.dsa_kv_cache_store_fp8``, ``DSATokenToKVPool``: 64-token
pages); ``srt/mem_cache/kv_cache_configurator.py`` (``calculate_mla_kv_cache_dim``);
``srt/arg_groups/overrides.py`` (``_dsa_kv_cache_dtype_default``, ``_dsa_split_backend_resolution``);
``srt/arg_groups/model_overrides/deepseek_v2.py`` (``_deepseek_family_overrides``: ``dsa`` only when no
backend is given, 64-token pages whatever the backend); ``srt/models/deepseek_v2.py``
(``DeepseekV2AttentionMLA.dispatch_attn_forward_method``);
``srt/models/deepseek_common/attention_backend_handler.py`` (``AttentionBackendRegistry.get_handler``);
``srt/models/deepseek_common/utils.py`` (``FORWARD_ABSORB_CORE_ATTENTION_BACKENDS``);
``srt/model_executor/model_runner_components/attention_backend_setup.py`` (``build_attention_backends``);
``srt/speculative/draft_utils.py`` (draft backends by name); ``srt/layers/cp/base.py``
(``CPAttentionBackendKind.from_string``); ``srt/layers/attention/attention_registry.py`` and
``srt/arg_groups/choices.py`` (the registry and the CLI's choices).

Limits: SGLang still computes FlashMLA's scheduler metadata for ``flashmla_kv`` batches
(``_compute_flashmla_metadata``; our hook does not read it) and runs its other prefill kernels
(``flashmla_sparse``, the dense MHA path), so the device needs what SGLang's ``flashmla_kv`` needs. DSA's
decode context parallelism uses ``trtllm`` (not this path). Not in SGLang's deterministic-inference list
(``dsa`` is not either). Checked against float64 on a CPU with SGLang's own pool and layer classes; not
run inside a SGLang server here. CUDA graphs: a plan is made on the first call of a shape (SGLang warms
up twice before each capture, ``srt/model_executor/runner_backend/full_cuda_graph_backend.py``), and a
plan used during a capture is kept for good; other shapes share a small cache of recent plans. This
module imports SGLang; nothing else in mla_dispatch does.
"""

from __future__ import annotations

import logging

import torch
from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend

from mla_dispatch.api import DecodePlan, plan_decode
from mla_dispatch.integrations.plan_cache import PlanCache
from mla_dispatch.integrations.names import SGLANG_DSA_BACKEND_NAME, SGLANG_REPLACE_DSA_ENV
from mla_dispatch.kvcache.formats import DS_MLA_TOKEN_BYTES

__all__ = ["MLADispatchDSABackend", "create_dsa_backend", "SGLANG_DSA_BACKEND_NAME"]

logger = logging.getLogger(__name__)


class _ReadsDSA:
    """A backend-name attribute SGLang stamps and its DeepSeek model reads: it reads ``"dsa"``; the stamped
    name is kept as ``stamped_<attribute>``."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, obj, objtype=None) -> str:
        return "dsa"

    def __set__(self, obj, value) -> None:
        obj.__dict__["stamped_" + self.name] = value


def _two_batch_overlap() -> bool:
    """Whether SGLang runs with ``--enable-two-batch-overlap`` (False where no configuration is published)."""
    try:
        from sglang.srt.runtime_context import get_exec

        return bool(get_exec().overlap.enable_two_batch_overlap)
    except (ImportError, AttributeError, ValueError):
        return False


def create_dsa_backend(model_runner) -> MLADispatchDSABackend:
    """The factory of ``--attention-backend mla_dispatch_dsa``.

    Raises
    ------
    ValueError
        ``--enable-two-batch-overlap`` is on: SGLang then stamps the backend's name on its wrapper, which the
        DeepSeek model would read as an unknown backend.
    """
    if _two_batch_overlap():
        raise ValueError(f"--attention-backend {SGLANG_DSA_BACKEND_NAME} does not support --enable-two-batch-overlap "
                         f"(SGLang's model reads the wrapper's backend name); set {SGLANG_REPLACE_DSA_ENV}=1 and use "
                         "--attention-backend dsa instead")
    return MLADispatchDSABackend(model_runner)


class MLADispatchDSABackend(DeepseekSparseAttnBackend):
    """SGLang's DSA backend with its ``flashmla_kv`` kernel replaced by mla_dispatch on ``fp8_ds_mla`` caches.

    Takes ``DeepseekSparseAttnBackend``'s arguments.
    """

    # what SGLang's DeepSeek model reads to pick its attention path: this backend is a dsa backend
    prefill_attention_backend_str = _ReadsDSA()
    decode_attention_backend_str = _ReadsDSA()

    def __init__(self, model_runner, *args, **kwargs) -> None:
        super().__init__(model_runner, *args, **kwargs)
        if self.serves_fp8_ds_mla:
            if self.dsa_decode_impl != "flashmla_kv":
                logger.info("mla_dispatch DSA backend: decode runs on mla_dispatch (configured DSA decode backend: "
                            "%s)", self.dsa_decode_impl)
            self.dsa_decode_impl = "flashmla_kv"  # forward_decode then calls _forward_flashmla_kv
        else:
            logger.warning("mla_dispatch DSA backend: the KV cache is not stored as fp8_ds_mla (%s bytes per token, "
                           "fp8 layout: %s); attention runs on SGLang's own DSA kernels (%s decode)",
                           self.kv_cache_dim, self.dsa_kv_cache_store_fp8, self.dsa_decode_impl)

    @property
    def serves_fp8_ds_mla(self) -> bool:
        """Whether the cache is SGLang's 656-byte fp8 layout, the one mla_dispatch reads as ``fp8_ds_mla``."""
        return bool(self.dsa_kv_cache_store_fp8) and self.kv_cache_dim == DS_MLA_TOKEN_BYTES

    def _sparse_plan(self, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, v_head_dim: int,
                     sm_scale: float) -> DecodePlan:
        """The plan for this shape (:class:`~mla_dispatch.integrations.plan_cache.PlanCache`: made on a shape's first
        call; kept for good once a CUDA graph captured it, else among the most recent few, as prefill token counts
        vary)."""
        key = (tuple(q.shape), q.dtype, tuple(kv.shape[1:]), kv.dtype, tuple(indices.shape), q.device,
               int(v_head_dim), float(sm_scale))
        plans = self.__dict__.get("_mla_dispatch_plans")
        if plans is None:
            plans = self.__dict__["_mla_dispatch_plans"] = PlanCache()
        return plans.get(key, lambda: plan_decode(q, kv, None, None, indices=indices, kv_format="fp8_ds_mla",
                                                  softmax_scale=sm_scale, head_dim_v=v_head_dim, return_lse=False),
                         q.device)

    def _forward_flashmla_kv(self, q_all: torch.Tensor, kv_cache: torch.Tensor, v_head_dim: int, sm_scale: float,
                             layer, metadata, page_table_1) -> torch.Tensor:
        """``o [T, 1, h, v_head_dim]``: query row ``t`` over its top-k cache tokens ``page_table_1[t]`` (-1 = none).

        ``metadata`` (FlashMLA's scheduler data) is not read. A cache not stored as ``fp8_ds_mla`` goes to
        SGLang's own implementation.
        """
        if not self.serves_fp8_ds_mla:
            return super()._forward_flashmla_kv(q_all, kv_cache, v_head_dim, sm_scale, layer, metadata, page_table_1)
        q = q_all.reshape(-1, 1, layer.tp_q_head_num, layer.head_dim)
        kv = kv_cache.view(torch.uint8).view(-1, self.physical_page_size, 1, self.kv_cache_dim)
        indices = page_table_1.to(torch.int32).unsqueeze(1).contiguous()  # [T, 1, topk]
        if indices.shape[0] != q.shape[0]:
            raise ValueError(f"page_table_1 must have one row per query row ({q.shape[0]}), got "
                             f"{list(page_table_1.shape)}")
        out, _ = self._sparse_plan(q, kv, indices, v_head_dim, sm_scale).run(q, kv, indices=indices)
        return out
