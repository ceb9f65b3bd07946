"""FlashMLA adapter (deepseek-ai/FlashMLA, built from source; import name ``flash_mla``).

Dense decode: SM90 only, q/kv bf16 or fp16 (no dense FP8 upstream), D_qk 576 or 512
with D_v 512, page size 64 (``csrc/api/dense_decode.h``). A cache whose page size
is a multiple of 64 is re-viewed as page 64 (a view plus a re-paged block table, cheap
and exact); other page sizes are refused with a reason.

Sparse decode: SM90 and SM100, the 656-byte ``fp8_ds_mla`` cache, h_kv 1,
h_q in {64, 128}, q bf16, any page size (``csrc/api/sparse_decode.h``).

Both interfaces of ``flash_mla_with_kvcache`` are handled; which one is detected from
the installed module (``FlashMLASchedMeta`` in ``flash_mla.flash_mla_interface``):

- current (HEAD 9241ae3 and since late 2025): ``get_mla_metadata()`` returns an empty
  ``FlashMLASchedMeta`` that the first call fills; ``num_splits`` must be None. Eager
  plans keep one such object per decode step (:meth:`update` makes a new one), so the
  first layer's call schedules, as in FlashMLA's own use. CUDA-graph plans fill the
  object before capture with the same schedule computed by us
  (:mod:`mla_dispatch.metadata.flashmla_sched`, one launch) and refresh its tensors in
  place in :meth:`update`, so a captured graph holds only FlashMLA's decode and combine.
- legacy (up to c28eca9, Sep 2025): ``get_mla_metadata(cache_seqlens, s_q*h_q//h_kv,
  h_kv, ...)`` returns ``(tile_scheduler_metadata, num_splits)`` tensors, computed in
  :meth:`plan` and refreshed in place by :meth:`update` (capturable).

Output and LSE are FlashMLA's native layout (natural log, ``[B, h_q, s_q]``); rows that see
no key already hold 0 / +inf (FlashMLA's test requires it: ``tests/ref.py``, ``lonely_q_mask``).
FlashMLA allocates its outputs: an eager call without ``out`` returns them as they are
(:meth:`FlashMLABackend.bind`), one with ``out`` / ``lse`` copies into them.
"""

from __future__ import annotations

import functools

import torch

from mla_dispatch.dispatch.backend import BackendState, CGSupport, MLABackend, Reason, ReasonCode
from mla_dispatch.metadata.conversions import repage_block_table
from mla_dispatch.dispatch.platform import Platform
from mla_dispatch.dispatch.problem import DecodeProblem

from ._vendor import dist_version, import_reasons, zero_invisible_rows

__all__ = ["FlashMLABackend"]

DENSE_PAGE = 64
SPARSE_HEADS = frozenset({64, 128})


@functools.lru_cache(maxsize=None)
def _has_sched_meta() -> bool:
    """True for the current interface (FlashMLASchedMeta), False for the legacy tensors."""
    import flash_mla.flash_mla_interface as iface

    return hasattr(iface, "FlashMLASchedMeta")


class FlashMLABackend(MLABackend):
    """DeepSeek FlashMLA: dense bf16/fp16 decode on SM90, sparse fp8_ds_mla decode on SM90/SM100."""

    NAME = "flashmla"
    DESCRIPTION = "DeepSeek FlashMLA (dense SM90 page 64; sparse fp8_ds_mla SM90/SM100)"
    PLATFORMS = frozenset({"cuda"})
    MIN_CAPABILITY = (9, 0)
    MAX_CAPABILITY = (10, 3)  # dense: 9.x only (extra_reasons)
    Q_DTYPES = frozenset({torch.bfloat16, torch.float16})
    KV_FORMATS = frozenset({"bf16", "fp16", "fp8_ds_mla"})
    HEAD_DIMS = frozenset({(576, 512), (512, 512)})
    SUPPORTS_SPARSE = True
    CUDA_GRAPH = CGSupport.ALWAYS  # legacy interface only (extra_reasons)
    ANY_OUT_STRIDES = True  # out.copy_(...)
    REQUIRES = ("flash_mla",)

    @classmethod
    def version(cls) -> str:
        ver = dist_version("flash_mla", "flash_mla")
        if ver == "not installed" or cls.availability_reasons():
            return ver
        return f"{ver} ({'sched-meta' if _has_sched_meta() else 'legacy-metadata'} interface)"

    @classmethod
    def _check_availability(cls) -> list[Reason]:
        reasons = import_reasons("flash_mla")
        if not reasons:
            import flash_mla

            if getattr(flash_mla, "MLA_DISPATCH_ALIAS", None) is not None:  # would call back into mla_dispatch
                reasons.append(Reason(ReasonCode.UNAVAILABLE, "flash_mla in this process is mla_dispatch's own alias "
                                                              "(mla_dispatch.compat.flash_mla), not DeepSeek FlashMLA"))
            elif not hasattr(flash_mla, "flash_mla_with_kvcache"):  # e.g. a directory without its Python sources
                where = getattr(flash_mla, "__file__", None) or list(getattr(flash_mla, "__path__", []))
                reasons.append(Reason(ReasonCode.UNAVAILABLE, f"flash_mla at {where} has no flash_mla_with_kvcache "
                                                              "(not an installed DeepSeek FlashMLA)"))
        return reasons

    @classmethod
    def extra_reasons(cls, problem: DecodeProblem, platform: Platform) -> list[Reason]:
        p = problem
        R = ReasonCode
        reasons = []
        cap = platform.capability if platform.kind == "cuda" else None
        if p.sparse:
            if p.kv_format != "fp8_ds_mla":
                reasons.append(Reason(R.KV_FORMAT, f"kv_format={p.kv_format} with sparse indices (supported: fp8_ds_mla)"))
            if p.num_heads_q not in SPARSE_HEADS:
                reasons.append(Reason(R.HEADS, f"h_q={p.num_heads_q} for sparse decode (supported: {{64, 128}})"))
            if p.num_heads_kv != 1:
                reasons.append(Reason(R.HEADS, f"h_kv={p.num_heads_kv} for sparse decode (supported: 1)"))
            if p.q_dtype != torch.bfloat16:
                reasons.append(Reason(R.DTYPE, f"q dtype={str(p.q_dtype)[6:]} for sparse decode (supported: bfloat16)"))
        else:
            if cap is not None and cap[0] != 9:
                reasons.append(Reason(R.CAPABILITY, f"compute capability {cap[0]}.{cap[1]} for dense decode "
                                                    "(supported: 9.0; upstream has no SM100 dense decode)"))
            if p.kv_format == "fp8_ds_mla":
                reasons.append(Reason(R.KV_FORMAT, "kv_format=fp8_ds_mla without sparse indices "
                                                   "(supported dense: bf16, fp16)"))
            if p.page_size % DENSE_PAGE != 0:
                reasons.append(Reason(R.PAGE_SIZE, f"page_size={p.page_size} for dense decode "
                                                   f"(supported: {DENSE_PAGE}, or a multiple re-viewed as {DENSE_PAGE})"))
        if p.cuda_graph and p.sparse and not cls.availability_reasons() and _has_sched_meta():
            reasons.append(Reason(R.CUDA_GRAPH, "cuda_graph=True for sparse decode with FlashMLA's FlashMLASchedMeta "
                                                "interface (the object fills itself on its first call)"))
        return reasons

    # -- plan ------------------------------------------------------------------------

    @classmethod
    def plan(cls, problem, platform, block_table, cache_seqlens, *, softmax_scale) -> BackendState:
        p = problem
        ratio = 1 if p.sparse else p.page_size // DENSE_PAGE
        table = block_table
        if block_table is not None and ratio > 1:
            table = repage_block_table(block_table, p.page_size, DENSE_PAGE)
        sub = None if ratio == 1 else torch.arange(ratio, dtype=torch.int32, device=block_table.device)
        state = BackendState(problem=p, ratio=ratio, table=table, sub=sub, new_api=_has_sched_meta(), meta=None,
                             num_splits=None, seqlens=cache_seqlens, parts=platform.num_compute_units)
        cls._schedule(state, cache_seqlens)
        return state

    @classmethod
    def _schedule(cls, state: BackendState, cache_seqlens) -> None:
        import flash_mla

        p = state.problem
        if state.new_api and p.cuda_graph and not p.sparse:
            cls._fill_sched_meta(state, cache_seqlens)
            return
        if state.new_api:
            state.meta, _ = flash_mla.get_mla_metadata()
            return
        seqlens = cache_seqlens
        if seqlens is None:  # sparse without lengths: every request attends to topk tokens
            seqlens = torch.full((p.batch,), p.topk, dtype=torch.int32)
        kwargs = {}
        if p.sparse:
            kwargs = dict(num_heads_q=p.num_heads_q, is_fp8_kvcache=True, topk=p.topk)
        meta, splits = flash_mla.get_mla_metadata(seqlens, p.rows_per_kv_head, p.num_heads_kv, **kwargs)
        if state.meta is None:
            state.meta, state.num_splits = meta, splits
        else:  # in place, so a captured graph sees the new schedule
            state.meta.copy_(meta)
            state.num_splits.copy_(splits)

    @classmethod
    def _fill_sched_meta(cls, state: BackendState, cache_seqlens) -> None:
        """A ``FlashMLASchedMeta`` filled as FlashMLA's first call would fill it, its tensors refreshed in place."""
        from flash_mla.flash_mla_interface import FlashMLASchedMeta

        from mla_dispatch.metadata.flashmla_sched import META_INTS, flashmla_sched_meta_into, num_sm_parts

        p = state.problem
        if state.meta is None:
            parts = num_sm_parts(state.parts, p.num_heads_q, p.num_heads_kv, p.q_len)
            dev = cache_seqlens.device
            meta = FlashMLASchedMeta()
            meta.tile_scheduler_metadata = torch.empty(parts, META_INTS, dtype=torch.int32, device=dev)
            meta.num_splits = torch.empty(p.batch + 1, dtype=torch.int32, device=dev)
            meta.config = FlashMLASchedMeta.Config(p.batch, p.q_len, p.num_heads_q, DENSE_PAGE, p.num_heads_kv,
                                                   p.causal, False, None, None, None)
            meta.have_initialized = True
            state.meta = meta
        flashmla_sched_meta_into(cache_seqlens, state.meta.tile_scheduler_metadata, state.meta.num_splits)

    @classmethod
    def update(cls, state: BackendState, block_table, cache_seqlens) -> None:
        cls._schedule(state, cache_seqlens)

    @staticmethod
    def _table(state: BackendState, block_table):
        """The table FlashMLA reads, from the block table's current values (every run reads them: docs/design.md
        §2): the table itself for pages of 64, else its re-paged copy refreshed in place (two ops)."""
        if state.ratio == 1 or block_table is None:
            return block_table
        b, mb = block_table.shape
        torch.add(block_table.unsqueeze(-1) * state.ratio, state.sub, out=state.table.view(b, mb, state.ratio))
        return state.table

    # -- run -----------------------------------------------------------------------------

    @classmethod
    def bind(cls, state, problem, kv_dtype, block_table, cache_seqlens, *, softmax_scale):
        """Dense eager calls: FlashMLA's own call and nothing else; its outputs are returned as they are unless
        ``out`` / ``lse`` were given."""
        import flash_mla

        p = problem
        call = flash_mla.flash_mla_with_kvcache
        q_shape, q_dtype = (p.batch, p.q_len, p.num_heads_q, p.head_dim_qk), p.q_dtype
        kv_tail = (p.page_size, p.num_heads_kv, p.head_dim_qk)
        out_shape, lse_shape = (p.batch, p.q_len, p.num_heads_q, p.head_dim_v), (p.batch, p.num_heads_q, p.q_len)
        pages, dv, causal, table_of = DENSE_PAGE, p.head_dim_v, p.causal, cls._table

        def fast(q, kv, kv_scale, out, lse):
            if (kv_scale is not None or q.shape != q_shape or q.dtype != q_dtype or q.stride(-1) != 1
                    or kv.shape[1:] != kv_tail or kv.dtype != kv_dtype or kv.stride(-1) != 1
                    or (out is not None and (out.shape != out_shape or out.dtype != q_dtype or out.device != q.device))
                    or (lse is not None and (lse.shape != lse_shape or lse.dtype != torch.float32
                                             or lse.device != q.device))):
                return None  # the checked path names what is wrong
            if state.ratio > 1:
                kv = kv.view(kv.shape[0] * state.ratio, pages, kv.shape[2], kv.shape[3])
            o, l = call(q, kv, table_of(state, block_table), cache_seqlens, dv, state.meta, state.num_splits,
                        softmax_scale=softmax_scale, causal=causal)
            if out is not None:
                o = out.copy_(o)
            if lse is not None:
                l = lse.copy_(l)
            return o, l

        return fast

    @classmethod
    def run(cls, state, q, kv_cache, block_table, cache_seqlens, *, problem, softmax_scale, kv_scale, indices,
            out, lse) -> None:
        import flash_mla

        p = problem
        kv = kv_cache
        if state.ratio > 1:
            nb, ps, h_kv, d = kv_cache.shape
            kv = kv_cache.view(nb * state.ratio, DENSE_PAGE, h_kv, d)
        o, l = flash_mla.flash_mla_with_kvcache(
            q, kv, cls._table(state, block_table), cache_seqlens, p.head_dim_v, state.meta, state.num_splits,
            softmax_scale=softmax_scale, causal=p.causal, is_fp8_kvcache=p.sparse, indices=indices)
        out.copy_(o)
        lse.copy_(l)
        if p.sparse:  # dense rows with no key already hold FlashMLA's 0 / +inf
            zero_invisible_rows(out, lse, (indices >= 0).any(dim=-1))
