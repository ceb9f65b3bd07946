"""SGLang attention backend whose MLA decode runs on mla_dispatch.

Use::

    pip install mla-dispatch            # declares the sglang.srt.plugins entry point
    python -m sglang.launch_server --model-path deepseek-ai/DeepSeek-V2-Lite \\
        --attention-backend mla_dispatch --disable-cuda-graph

The plugin (:func:`mla_dispatch.integrations.plugins.register_sglang`) adds
``"mla_dispatch"`` to SGLang's attention-backend registry. Decode batches read
the MLA token pool directly — page size 1 (token slots) or paged
(``--page-size N``) — through a block table built on the device from
``req_to_token``, and run :func:`mla_dispatch.plan_decode` /
:meth:`~mla_dispatch.DecodePlan.run` (one plan per step, shared by all layers).
Extend / prefill / speculative-verify batches are delegated to SGLang's own
``triton`` backend, which is also the handler SGLang's DeepSeek model uses to
choose its attention path for a backend name it does not know.

Contract implemented (SGLang main, files read at these commits):
``python/sglang/srt/layers/attention/base_attn_backend.py`` @ 009db01
(``AttentionBackend``: ``init_forward_metadata``, ``forward_decode``,
``forward_extend``), ``attention_registry.py`` @ 00a66eb
(``register_attention_backend``), ``cutlass_mla_backend.py`` @ 08cf5ef (MLA
``forward_decode(..., q_rope, k_rope)``, ``set_mla_kv_buffer``,
``get_key_buffer``), ``plugins/__init__.py`` @ 0298b5b (``sglang.srt.plugins``),
``server_args.add_attention_backend_choices``.

Limits of this version: no CUDA-graph hooks (run with ``--disable-cuda-graph``;
SGLang's capture/replay interface has changed across 2026 releases and is not
implemented here), MLA models only, KV pool in the model dtype or
``float8_e4m3fn`` (per-tensor ``k_scale``). This module imports SGLang.
"""

from __future__ import annotations

import dataclasses

import torch
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from mla_dispatch.api import DecodePlan, plan_decode
from mla_dispatch.integrations.layouts import (
    max_blocks_for,
    sglang_block_table,
    sglang_decode_output,
    sglang_decode_query,
    sglang_kv_cache,
    sglang_kv_format,
)

__all__ = ["MLADispatchAttnBackend"]


@dataclasses.dataclass
class _DecodeStep:
    block_table: torch.Tensor  # int32 [B, max_blocks]
    seq_lens: torch.Tensor  # int32 [B]
    plan: DecodePlan | None = None  # made by the first layer, reused by the others


class MLADispatchAttnBackend(AttentionBackend):
    """``--attention-backend mla_dispatch``.

    Parameters
    ----------
    model_runner : sglang ModelRunner
    extend_backend : str
        Name of the SGLang backend that runs non-decode batches (default ``"triton"``).

    Raises
    ------
    ValueError
        The model is not an MLA model.
    """

    def __init__(self, model_runner, extend_backend: str = "triton") -> None:
        super().__init__()
        if not getattr(model_runner, "use_mla_backend", False):
            raise ValueError("the mla_dispatch attention backend serves MLA models (DeepSeek-V2/V3/R1 and kin) only")
        self.page_size = int(model_runner.page_size)
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.q_dtype = model_runner.dtype
        self.max_blocks = max_blocks_for(self.req_to_token.shape[1], self.page_size)
        self.forward_metadata: _DecodeStep | None = None
        self.extend_backend = ATTENTION_BACKENDS[extend_backend](model_runner)

    # -- metadata ----------------------------------------------------------------------

    def init_forward_metadata(self, forward_batch) -> None:
        mode = forward_batch.forward_mode
        if mode.is_decode_or_idle():
            self.forward_metadata = _DecodeStep(
                block_table=sglang_block_table(self.req_to_token, forward_batch.req_pool_indices,
                                               forward_batch.seq_lens, self.page_size, self.max_blocks),
                seq_lens=forward_batch.seq_lens.to(torch.int32),
            )
        else:
            self.forward_metadata = None
            self.extend_backend.init_forward_metadata(forward_batch)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    # -- compute -----------------------------------------------------------------------

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, q_rope=None, k_rope=None,
                       **kwargs):
        pool = forward_batch.token_to_kv_pool
        if k is not None and save_kv_cache:
            if k_rope is not None:
                pool.set_mla_kv_buffer(layer, forward_batch.out_cache_loc, k, k_rope)
            else:
                pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)
        step = self.forward_metadata
        if step is None:
            raise ValueError("forward_decode without decode metadata (init_forward_metadata saw a non-decode batch)")
        query = sglang_decode_query(q, q_rope, forward_batch.batch_size, layer.tp_q_head_num, layer.head_dim)
        if query.dtype != self.q_dtype:
            query = query.to(self.q_dtype)
        kv = sglang_kv_cache(pool.get_key_buffer(layer.layer_id), self.page_size)
        kv_format = sglang_kv_format(kv.dtype, query.dtype)
        kv_scale = None
        if kv_format == "fp8_e4m3":
            kv_scale = float(getattr(layer, "k_scale_float", None) or 1.0)
        if step.plan is None:
            step.plan = plan_decode(query, kv, step.block_table, step.seq_lens, head_dim_v=layer.v_head_dim,
                                    softmax_scale=layer.scaling, causal=True, kv_format=kv_format,
                                    kv_scale=kv_scale, return_lse=False)
        out, _ = step.plan.run(query, kv, kv_scale=kv_scale)
        return sglang_decode_output(out)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        return self.extend_backend.forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
