"""vLLM's DeepSeek-V4 attention layer with its sparse decode on mla_dispatch.

Use::

    pip install mla-dispatch            # declares the vllm.general_plugins entry point
    vllm serve <a DeepSeek-V4 checkpoint> --attention-backend MLA_DISPATCH_SPARSE

vLLM 0.33.0 builds DeepSeek-V4's attention layers itself: ``DeepseekV4DecoderLayer`` takes its class from
``_select_dsv4_attn_cls(vllm_config)`` (``vllm/models/deepseek_v4/nvidia/model.py``), which maps the configured
attention backend to ``DeepseekV4FlashMLAAttention`` or a FlashInfer class. The plugin
(:func:`mla_dispatch.integrations.plugins.register_vllm`) wraps that function when the module is imported, so
that the backend name ``MLA_DISPATCH_SPARSE`` (the one DeepSeek-V3.2's sparse backend answers to,
:mod:`~mla_dispatch.integrations.vllm_sparse`) selects :class:`MLADispatchDeepseekV4Attention`; every other name
keeps vLLM's answer.

:class:`MLADispatchDeepseekV4Attention` is vLLM's FlashMLA layer (its metadata builders, the fused q-norm / RoPE /
cache insert, the indexer, prefill through FlashMLA's sparse prefill kernel, the O projection) with one change:
the decode step (``_forward_decode``), which vLLM sends to FlashMLA's ``flash_mla_with_kvcache`` with the
sliding-window cache as the main cache and the compressed cache as the extra one, runs
:func:`mla_dispatch.plan_decode` / :meth:`~mla_dispatch.DecodePlan.run` with the same arguments (``fp8_ds_v4``
caches, ``indices`` / ``topk_length``, ``attn_sink``, ``extra_kv_cache`` / ``extra_indices`` /
``extra_topk_length``). FlashMLA's decode kernel takes 64 or 128 query heads, so vLLM pads every rank's heads to
that (at TP 8 a 128-head model runs 16 real heads in a 64-head kernel); the decode here runs the rank's real
heads only, on any backend mla_dispatch picks on the device, and zeroes the padding heads' rows of the output
(the O projection reads the real heads only).

Contract implemented: vLLM 0.33.0 (PyPI), read from its installed sources:
``DeepseekV4FlashMLAAttention._forward_decode(q [t, padded_heads, 512] bf16, kv_cache (the layer's compressed
cache [blocks, block, 584] uint8) or None, swa_metadata: DeepseekSparseSWAMetadata, attn_metadata:
DeepseekV4FlashMLAMetadata or None, swa_only: bool, output [t, padded_heads, 512]) -> None``, writing
``output``. Prefill keeps FlashMLA's kernels, so this layer needs what vLLM's FlashMLA layer needs on the device.
CUDA graphs: vLLM's builders declare full graphs for this layer; before capturing a size, vLLM warms it up with
attention metadata (``gpu_model_runner.py``: ``force_attention`` for ``CUDAGraphMode.FULL``), so the plan of each
captured shape is made in the warm-up and kept for good at the capture (:class:`PlanCache`).
This module imports vLLM; nothing else in mla_dispatch does except the other engine modules.
"""

from __future__ import annotations

import torch
from vllm.models.deepseek_v4.common.ops import compute_global_topk_indices_and_lens
from vllm.models.deepseek_v4.nvidia.flashmla import DeepseekV4FlashMLAAttention

from mla_dispatch.api import DecodePlan, plan_decode
from mla_dispatch.integrations.plan_cache import PlanCache

__all__ = ["MLADispatchDeepseekV4Attention"]


class MLADispatchDeepseekV4Attention(DeepseekV4FlashMLAAttention):
    """vLLM's DeepSeek-V4 FlashMLA attention layer with its decode replaced by mla_dispatch."""

    def _compressed_topk(self, swa_metadata, attn_metadata, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The compressed cache's ``(indices [t, 1, k] int32 cache slots, lengths [t] int32)`` for this step, as
        vLLM's ``_forward_decode`` computes them: C4A layers convert the indexer's per-layer top-k with vLLM's
        ``compute_global_topk_indices_and_lens``; C128A layers read the metadata builder's."""
        if attn_metadata is None or swa_metadata.is_valid_token is None:
            raise ValueError("a DeepSeek-V4 layer with a compressed cache needs the step's attn_metadata and "
                             "swa_metadata.is_valid_token (vLLM's metadata builders provide them)")
        if self.compress_ratio == 4:
            if self.topk_indices_buffer is None:
                raise ValueError("a C4A layer (compress_ratio 4) needs the indexer's topk_indices_buffer")
            indices, lengths = compute_global_topk_indices_and_lens(
                self.topk_indices_buffer[:num_tokens], swa_metadata.token_to_req_indices,
                attn_metadata.block_table[:swa_metadata.num_decodes], attn_metadata.block_size // self.compress_ratio,
                swa_metadata.is_valid_token[:num_tokens])
            return indices.view(num_tokens, 1, -1), lengths
        if self.compress_ratio == 128:
            return attn_metadata.c128a_global_decode_topk_indices, attn_metadata.c128a_decode_topk_lens
        raise ValueError(f"compress_ratio must be 1, 4 or 128 for a DeepSeek-V4 layer, got {self.compress_ratio}")

    def _v4_plan(self, q: torch.Tensor, swa_cache: torch.Tensor, indices: torch.Tensor, sparse: dict) -> DecodePlan:
        """The plan for this step's shapes (:class:`~mla_dispatch.integrations.plan_cache.PlanCache`, per layer:
        made on a shape's first call, kept for good once a CUDA graph captured it). A sparse plan depends on shapes
        alone: the indices and lengths are arguments of every run."""
        plans = self.__dict__.get("_mla_dispatch_plans")
        if plans is None:
            plans = self.__dict__["_mla_dispatch_plans"] = PlanCache()

        def shape(t):
            return None if t is None else (tuple(t.shape), t.dtype)

        key = (shape(q), tuple(swa_cache.shape[1:]), tuple(swa_cache.stride()), q.device, shape(indices),
               tuple((name, shape(t), None if t is None or t.dim() < 4 else tuple(t.stride()))
                     for name, t in sorted(sparse.items())))
        return plans.get(key, lambda: plan_decode(q, swa_cache, None, None, indices=indices, head_dim_v=512,
                                                  softmax_scale=self.scale, kv_format="fp8_ds_v4", **sparse),
                         q.device)

    def _forward_decode(self, q: torch.Tensor, kv_cache: torch.Tensor | None, swa_metadata, attn_metadata,
                        swa_only: bool, output: torch.Tensor) -> None:
        """Decode attention of the step's first ``num_decode_tokens`` tokens into ``output`` (vLLM's contract).

        ``q`` and ``output`` are ``[t, padded_heads, 512]`` bf16; each token is its own request of one query
        position (vLLM's convention: tokens of one sequence attend through their own indices). The sliding-window
        cache (``self.swa_cache_layer.kv_cache``, ``[blocks, block, 584]`` bytes in DeepSeek-V4's fp8 layout)
        is the main cache, indexed by ``swa_metadata.decode_swa_indices`` cut to ``decode_swa_lens``; layers
        with a compressed cache (``kv_cache``) attend to it as the extra cache in the same softmax.
        """
        t = swa_metadata.num_decode_tokens
        h = self.n_local_heads
        q_real = q.unsqueeze(1)[:, :, :h]  # [t, 1, h, 512]: the rank's own heads, not vLLM's padding
        swa_cache = self.swa_cache_layer.kv_cache.unsqueeze(-2)  # [blocks, block, 1, 584], the strides kept
        indices = swa_metadata.decode_swa_indices
        sparse = dict(topk_length=swa_metadata.decode_swa_lens, attn_sink=self.attn_sink[:h])
        if not swa_only:
            if kv_cache is None:
                raise ValueError("kv_cache (the layer's compressed cache) is None on a layer that is not SWA-only")
            extra_indices, extra_lengths = self._compressed_topk(swa_metadata, attn_metadata, t)
            sparse.update(extra_kv_cache=kv_cache.unsqueeze(-2), extra_indices=extra_indices,
                          extra_topk_length=extra_lengths)
        plan = self._v4_plan(q_real, swa_cache, indices, sparse)
        out = output.unsqueeze(1)
        plan.run(q_real, swa_cache, indices=indices, out=out[:, :, :h], **sparse)
        if h < out.shape[2]:
            out[:, :, h:].zero_()
