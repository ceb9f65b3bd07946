"""SGLang attention backend whose MLA decode runs on mla_dispatch.

Use::

    pip install mla-dispatch            # declares the sglang.srt.plugins entry point
    sglang serve --model-path deepseek-ai/DeepSeek-V2-Lite --attention-backend mla_dispatch

The plugin (:func:`mla_dispatch.integrations.plugins.register_sglang`) adds
``"mla_dispatch"`` to SGLang's attention-backend registry. Decode batches read
the MLA token pool directly — page size 1 (token slots) or paged
(``--page-size N``) — through a block table built on the device from
``req_to_token``, and run :func:`mla_dispatch.plan_decode` /
:meth:`~mla_dispatch.DecodePlan.run` (one plan per step, shared by all layers: a plan kept per batch shape and
updated with each step's table and lengths, ``DecodePlan.update``; under CUDA graphs one per captured batch size).
Extend / prefill / speculative-verify batches are delegated to SGLang's own
``triton`` backend, which is also the handler SGLang's DeepSeek model uses to
choose its attention path for a backend name it does not know.

Contract implemented: SGLang 0.5.23 (PyPI wheel; read from its installed
sources): ``srt/layers/attention/base_attn_backend.py`` (``AttentionBackend``:
``init_forward_metadata``; the CUDA-graph contract ``init_cuda_graph_state``,
``init_forward_metadata_out_graph(fb, in_capture)`` — run outside the graph
before capture and before every replay — and ``init_forward_metadata_in_graph``;
``forward_decode`` / ``forward_extend``), ``attention_registry.py``
(``register_attention_backend``), ``flashinfer_mla_backend.py`` /
``triton_backend.py`` (MLA ``forward_decode(..., q_rope, k_rope)``, writes with
``set_mla_kv_buffer`` / ``set_kv_buffer`` through a ``KVWriteLoc``, fp8 writes
divided by ``layer.k_scale``, ``get_key_buffer``; the pool is the runner's
``token_to_kv_pool``, not a ``ForwardBatch`` field), ``mem_cache/memory_pool.py``
(``MLATokenToKVPool``), ``mem_cache/kv_index_translator.py`` (ids in
``req_to_token`` are physical unless the pool translates reads),
``plugins/__init__.py`` (``sglang.srt.plugins``, loaded before the CLI is
parsed), ``arg_groups/choices.py`` (``add_attention_backend_choices``, re-exported by
``server_args.py``). Older
releases (``out_cache_loc`` writes, no translator) are handled where the
difference is a name.

Limits: dense MLA models only (DeepSeek-V3.2's sparse attention is
:mod:`mla_dispatch.integrations.sglang_sparse`, ``mla_dispatch_dsa``); plain KV
pools (a unified pool that translates reads is refused at start-up, with the
reason); KV pool in the model dtype or
``float8_e4m3fn`` (per-tensor ``k_scale``). The CUDA-graph hooks follow 0.5.23's
contract but have not been run inside SGLang here; if they misbehave, add
``--disable-cuda-graph``. This module imports SGLang.
"""

from __future__ import annotations

import dataclasses

import torch
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

try:  # SGLang >= 0.5.2x: writes name their target with a KVWriteLoc
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc
except ModuleNotFoundError:  # a broken install, not an older release: say so
    raise
except ImportError:  # older releases (no such name) take forward_batch.out_cache_loc itself
    KVWriteLoc = None

from mla_dispatch.api import DecodePlan, plan_decode
from mla_dispatch.integrations.plan_cache import PlanCache
from mla_dispatch.integrations.layouts import (
    max_blocks_for,
    sglang_block_table,
    sglang_decode_output,
    sglang_decode_query,
    sglang_kv_cache,
    sglang_kv_format,
)

__all__ = ["MLADispatchAttnBackend"]


def deterministic_inference() -> bool:
    """Whether SGLang runs with ``--enable-deterministic-inference`` (read as SGLang 0.5.23's own attention backends
    read it: ``sglang/srt/runtime_context.py`` ``get_exec().deterministic``, e.g. ``flashattention_backend.py``).
    False where this SGLang has no such setting or has not published its configuration."""
    try:
        from sglang.srt.runtime_context import get_exec

        return bool(get_exec().deterministic.enable_deterministic_inference)
    except (ImportError, AttributeError, ValueError):
        return False


@dataclasses.dataclass
class _DecodeStep:
    block_table: torch.Tensor  # int32 [B, max_blocks]
    seq_lens: torch.Tensor  # int32 [B]
    plan: DecodePlan | None = None  # made by the first layer, reused by the others
    graph: bool = False  # persistent buffers of a CUDA-graph batch size: plan for capture


def _write_loc(forward_batch):
    return KVWriteLoc.for_batch(forward_batch) if KVWriteLoc is not None else forward_batch.out_cache_loc


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
        The model is not an MLA model, or its KV pool translates reads (unified pool).
    """

    def __init__(self, model_runner, extend_backend: str = "triton") -> None:
        super().__init__()
        if not getattr(model_runner, "use_mla_backend", False):
            raise ValueError("the mla_dispatch attention backend serves MLA models (DeepSeek-V2/V3/R1 and kin) only")
        translator = getattr(model_runner, "kv_index_translator", None)
        if translator is not None and getattr(translator, "reads_are_translated", False):
            raise ValueError("the mla_dispatch attention backend reads req_to_token ids as physical slots; this KV "
                             "pool translates reads (unified pool) and is not supported")
        self.kv_index_translator = translator  # SGLang checks every backend carries the runner's translator
        self.page_size = int(getattr(model_runner, "page_size", 1) or 1)
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.q_dtype = model_runner.dtype
        self.max_blocks = max_blocks_for(self.req_to_token.shape[1], self.page_size)
        self.forward_metadata: _DecodeStep | None = None
        self.extend_backend = ATTENTION_BACKENDS[extend_backend](model_runner)
        self._graph_block_table: torch.Tensor | None = None
        self._graph_seq_lens: torch.Tensor | None = None
        self._graph_steps: dict[int, _DecodeStep] = {}
        self._kv_scales: dict[int, torch.Tensor] = {}
        self._plans = PlanCache()  # eager decode plans kept per shape, updated step after step
        # SGLang's --enable-deterministic-inference: each request's result independent of the batch
        self.batch_invariant = deterministic_inference()

    # -- metadata ----------------------------------------------------------------------

    def init_forward_metadata(self, forward_batch) -> None:
        mode = forward_batch.forward_mode
        if mode.is_decode_or_idle():
            # Eager batches get a table only as wide as their longest request (the host
            # copy of the lengths is there already: no sync); graph batches use the full width.
            # Batch-invariant plans keep the full width too: the reference's rounding follows the table's width.
            seq_lens_cpu = getattr(forward_batch, "seq_lens_cpu", None)
            width = self.max_blocks
            if seq_lens_cpu is not None and seq_lens_cpu.numel() and not self.batch_invariant:
                # rounded up to a power of two: the steps of a batch share a table shape, so they share a kept plan
                # that each step updates (the columns past a request's pages are never read)
                needed = max_blocks_for(int(seq_lens_cpu.max()), self.page_size)
                width = min(self.max_blocks, 1 << (needed - 1).bit_length())
            self.forward_metadata = _DecodeStep(
                block_table=sglang_block_table(self.req_to_token, forward_batch.req_pool_indices,
                                               forward_batch.seq_lens, self.page_size, width),
                seq_lens=forward_batch.seq_lens.to(torch.int32),
            )
        else:
            self.forward_metadata = None
            self.extend_backend.init_forward_metadata(forward_batch)

    # -- CUDA graphs (SGLang's out_graph / in_graph contract) ---------------------------

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        device = self.req_to_token.device
        self._graph_block_table = torch.zeros(max_bs, self.max_blocks, dtype=torch.int32, device=device)
        self._graph_seq_lens = torch.full((max_bs,), self.get_cuda_graph_seq_len_fill_value(), dtype=torch.int32,
                                          device=device)
        self._graph_steps.clear()
        self.extend_backend.init_cuda_graph_state(max_bs, max_num_tokens)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        """Before capture and before every replay: refresh the persistent block table and
        lengths of this batch size and re-plan in place (no allocation, no host sync)."""
        if not forward_batch.forward_mode.is_decode_or_idle() or self._graph_block_table is None:
            self.forward_metadata = None
            self.extend_backend.init_forward_metadata_out_graph(forward_batch, in_capture)
            return
        bs = forward_batch.batch_size
        step = self._graph_steps.get(bs)
        if step is None:
            step = _DecodeStep(self._graph_block_table[:bs], self._graph_seq_lens[:bs], graph=True)
            self._graph_steps[bs] = step
        step.block_table.copy_(sglang_block_table(self.req_to_token, forward_batch.req_pool_indices[:bs],
                                                  forward_batch.seq_lens[:bs], self.page_size, self.max_blocks))
        step.seq_lens.copy_(forward_batch.seq_lens[:bs])
        if step.plan is not None:
            step.plan.update()
        self.forward_metadata = step

    def init_forward_metadata_in_graph(self, forward_batch) -> None:
        if self.forward_metadata is None:
            self.extend_backend.init_forward_metadata_in_graph(forward_batch)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    # -- compute -----------------------------------------------------------------------

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, q_rope=None, k_rope=None,
                       **kwargs):
        # 0.5.23's ForwardBatch carries no pool: backends keep the runner's (as flashmla_backend.py does).
        pool = self.token_to_kv_pool
        if k is not None and save_kv_cache:
            if getattr(layer, "k_scale", None) is not None:  # fp8 pools store value / k_scale (as SGLang's triton)
                k = k / layer.k_scale
                k_rope = None if k_rope is None else k_rope / layer.k_scale
            if k_rope is not None:
                pool.set_mla_kv_buffer(layer, _write_loc(forward_batch), k, k_rope)
            else:
                pool.set_kv_buffer(layer, _write_loc(forward_batch), k, v)
        step = self.forward_metadata
        if step is None:
            raise ValueError("forward_decode without decode metadata (init_forward_metadata saw a non-decode batch)")
        query = sglang_decode_query(q, q_rope, forward_batch.batch_size, layer.tp_q_head_num, layer.head_dim)
        if query.dtype != self.q_dtype:
            query = query.to(self.q_dtype)
        kv = sglang_kv_cache(pool.get_key_buffer(layer.layer_id), self.page_size)
        kv_format = sglang_kv_format(kv.dtype, query.dtype)
        kv_scale = self._kv_scale(layer, kv.device) if kv_format == "fp8_e4m3" else None
        if step.plan is None:
            def make() -> DecodePlan:
                return plan_decode(query, kv, step.block_table, step.seq_lens, head_dim_v=layer.v_head_dim,
                                   softmax_scale=layer.scaling, causal=True, kv_format=kv_format, kv_scale=kv_scale,
                                   return_lse=False, cuda_graph=step.graph, batch_invariant=self.batch_invariant)

            if step.graph:  # one plan per captured batch size, over its persistent buffers (init_forward_metadata_*)
                step.plan = make()
            else:  # eager: the kept plan of these shapes, updated with this step's table and lengths, or a new one
                key = (tuple(query.shape), query.dtype, tuple(kv.shape[1:]), kv.dtype, tuple(step.block_table.shape),
                       query.device, kv_format, kv_scale is None, float(layer.scaling), int(layer.v_head_dim))
                step.plan = self._plans.get(key, make, query.device, reuse=lambda kept: kept.update(
                    block_table=step.block_table, cache_seqlens=step.seq_lens))
        out, _ = step.plan.run(query, kv, kv_scale=kv_scale)
        return sglang_decode_output(out)

    def _kv_scale(self, layer, device) -> torch.Tensor:
        """The layer's per-tensor fp8 scale as a 1-element fp32 tensor, made once (outside any capture)."""
        scale = self._kv_scales.get(layer.layer_id)
        if scale is None:
            value = float(getattr(layer, "k_scale_float", None) or 1.0)
            scale = self._kv_scales[layer.layer_id] = torch.tensor([value], dtype=torch.float32, device=device)
        return scale

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        return self.extend_backend.forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
