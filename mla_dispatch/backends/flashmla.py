"""FlashMLA adapter (deepseek-ai/FlashMLA, built from source; import name ``flash_mla``).

What it runs is :attr:`FlashMLABackend.ARCH_SUPPORT`, read from FlashMLA's kernels (HEAD 9241ae3), not from
its API: ``csrc/api/dense_decode.h`` accepts ``head_size_k`` 576 or 512, but the SM90 dense kernel then
asserts ``params.d == Config::HEAD_DIM_K`` (576; ``csrc/sm90/decode/dense/splitkv_mla.cuh``, ``FLASH_ASSERT``:
print and ``exit(1)``), so a 512-wide q ends the caller's process. A failed ``TORCH_CHECK`` raises, a
failed ``FLASH_ASSERT`` ends the process and a failed ``KU_ASSERT`` throws from inside the launch: every one of
them is declined here, with a reason, before FlashMLA is called.

Dense decode: SM90 only, q/kv bf16 or fp16 (no dense FP8 upstream), D_qk 576 with D_v 512,
page size 64 (``csrc/api/dense_decode.h``). A cache whose page size is a multiple of 64 is
re-viewed as page 64 (a view plus a re-paged block table, cheap and exact); other page
sizes are refused with a reason.

Sparse decode: SM90 and SM100, the 656-byte ``fp8_ds_mla`` cache, h_kv 1, h_q in {64, 128},
q bf16, any page size, top-k a multiple of 64 (``csrc/api/sparse_decode.h``; the kernels
``KU_ASSERT(params.topk % 64 == 0)``). Builds from before its sparse kernels (c28eca9, Sep 2025)
take no ``indices``: there sparse decode is declined.

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

from mla_dispatch.dispatch.backend import (ArchSupport, BackendState, CGSupport, MLABackend, Reason, ReasonCode,
                                           dense_call_matcher)
from mla_dispatch.metadata.conversions import repage_block_table
from mla_dispatch.dispatch.platform import Platform
from mla_dispatch.dispatch.problem import DecodeProblem

from ._vendor import dist_version, import_reasons, zero_invisible_rows

__all__ = ["FlashMLABackend"]

DENSE_PAGE = 64
SPARSE_HEADS = frozenset({64, 128})
#: top-k block of the sparse kernels: csrc/sm90/decode/sparse_fp8/config.h TOPK_BLOCK_SIZE, csrc/sm100/decode/head64
#: B_TOPK; both launches KU_ASSERT(params.topk % 64 == 0)
SPARSE_TOPK_BLOCK = 64
#: the largest split count FlashMLA's combine kernel has an instance for (csrc/smxx/decode/combine/combine.cu,
#: MLA_NUM_SPLITS_SWITCH: FLASH_ASSERT(false) past 160): its num_sm_parts must not exceed it
MAX_SM_PARTS = 160

_SPARSE_LIMITS = {"SUPPORTS_DENSE": False, "Q_DTYPES": frozenset({torch.bfloat16}),
                  "KV_FORMATS": frozenset({"fp8_ds_mla"}), "NUM_HEADS_Q": SPARSE_HEADS, "MAX_HEADS_KV": 1}


def _dense_sm_parts(num_sms: int, p: DecodeProblem) -> int:
    """FlashMLA's split count for a dense problem (``csrc/api/dense_decode.h``, ``num_sm_parts``; the same formula
    as :func:`mla_dispatch.metadata.flashmla_sched.num_sm_parts`, whose module needs triton)."""
    rows = p.q_len * p.num_heads_q // p.num_heads_kv
    return max(num_sms // p.num_heads_kv // -(-rows // 64), 1)


@functools.lru_cache(maxsize=None)
def _takes_indices() -> bool:
    """Whether the installed ``flash_mla_with_kvcache`` has sparse decode (an ``indices`` parameter), read once."""
    import inspect

    import flash_mla

    try:
        return "indices" in inspect.signature(flash_mla.flash_mla_with_kvcache).parameters
    except (TypeError, ValueError):  # a compiled callable without a signature: assume the current interface
        return True


@functools.lru_cache(maxsize=None)
def _has_sched_meta() -> bool:
    """True for the current interface (FlashMLASchedMeta), False for the legacy tensors."""
    import flash_mla.flash_mla_interface as iface

    return hasattr(iface, "FlashMLASchedMeta")


class FlashMLABackend(MLABackend):
    """DeepSeek FlashMLA: dense bf16/fp16 decode on SM90, sparse fp8_ds_mla decode on SM90/SM100."""

    NAME = "flashmla"
    VENDOR = "DeepSeek FlashMLA"
    DESCRIPTION = "DeepSeek FlashMLA (dense SM90 page 64; sparse fp8_ds_mla SM90/SM100)"
    PLATFORMS = frozenset({"cuda"})
    MIN_CAPABILITY = (9, 0)
    MAX_CAPABILITY = (10, 3)  # dense: 9.0 only (ARCH_SUPPORT)
    Q_DTYPES = frozenset({torch.bfloat16, torch.float16})
    KV_FORMATS = frozenset({"bf16", "fp16", "fp8_ds_mla"})
    # Dense: the SM90 kernel asserts params.d == 576 (its API accepts 512 and lets it through: the process exits).
    # Sparse: 512/512 exists upstream only in its MODEL1 cache layout, not DeepSeek-V3.2's 656-byte token.
    HEAD_DIMS = frozenset({(576, 512)})
    SUPPORTS_SPARSE = True
    CUDA_GRAPH = CGSupport.ALWAYS  # legacy interface only (extra_reasons)
    ANY_OUT_STRIDES = True  # out.copy_(...)
    REQUIRES = ("flash_mla",)
    ARCH_SUPPORT = (
        ArchSupport("sm90 dense", "Hopper (sm_90a)", min_capability=(9, 0), max_capability=(9, 0),
                    limits={"SUPPORTS_SPARSE": False, "KV_FORMATS": frozenset({"bf16", "fp16"}),
                            "HEAD_DIMS": frozenset({(576, 512)}), "PAGE_SIZE_MULTIPLE": DENSE_PAGE},
                    sources={"KV_FORMATS": "FlashMLA's dense decode reads a cache of q's dtype "
                                           "(csrc/api/dense_decode.h)",
                             "HEAD_DIMS": "FlashMLA's SM90 dense kernel asserts params.d == 576 and ends the process "
                                          "otherwise (csrc/sm90/decode/dense/splitkv_mla.cuh; its API lets 512 "
                                          "through)",
                             "PAGE_SIZE_MULTIPLE": "csrc/api/dense_decode.h: page_block_size == 64"},
                    notes="FlashMLA's dense decode",
                    run_here="yes: H100, H200 (built from source)"),
        ArchSupport("sm90 sparse", "Hopper (sm_90a)", min_capability=(9, 0), max_capability=(9, 0),
                    limits=_SPARSE_LIMITS,
                    sources={"NUM_HEADS_Q": "csrc/sm90/decode/sparse_fp8/config.h static_assert(NUM_HEADS == 64 "
                                            "|| NUM_HEADS == 128)",
                             "Q_DTYPES": "csrc/api/sparse_decode.h KU_CHECK_DTYPE(q, kBFloat16)",
                             "MAX_HEADS_KV": "csrc/sm90/decode/sparse_fp8/splitkv_mla.cuh KU_ASSERT(params.h_kv == 1)"},
                    notes="FlashMLA's sparse fp8 decode; top-k a multiple of 64; CUDA graph with its legacy interface "
                          "only",
                    run_here="no: contract-tested (its sparse kernel ran beside ours on an H100, not through "
                             "this adapter)"),
        ArchSupport("sm100 sparse", "Blackwell (sm_100f)", min_capability=(10, 0), max_capability=(10, 3),
                    limits=_SPARSE_LIMITS,
                    sources={"NUM_HEADS_Q": "csrc/api/sparse_decode.h: the head64 kernel, twice for 128 heads",
                             "Q_DTYPES": "csrc/api/sparse_decode.h KU_CHECK_DTYPE(q, kBFloat16)",
                             "MAX_HEADS_KV": "csrc/sm100/decode/head64/kernel.cuh KU_ASSERT(params.h_kv == 1)"},
                    notes="FlashMLA's sparse fp8 decode; top-k a multiple of 64; CUDA graph with its legacy interface "
                          "only; no dense decode upstream",
                    run_here="no: contract-tested"),
    )

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
        installed = not cls.availability_reasons()
        if p.sparse:
            if p.topk % SPARSE_TOPK_BLOCK:
                reasons.append(Reason(R.FEATURE, f"topk={p.topk} for sparse decode (supported: multiples of "
                                                 f"{SPARSE_TOPK_BLOCK}; FlashMLA's sparse kernels assert "
                                                 f"topk % {SPARSE_TOPK_BLOCK} == 0)"))
            if installed and not _takes_indices():
                reasons.append(Reason(R.FEATURE, "sparse indices with the installed flash_mla, whose "
                                                 "flash_mla_with_kvcache takes no indices (FlashMLA before its sparse "
                                                 "kernels, c28eca9)"))
        else:
            parts = _dense_sm_parts(platform.num_compute_units, p)
            if parts > MAX_SM_PARTS:
                reasons.append(Reason(R.CAPABILITY, f"{platform.num_compute_units} SMs (supported: FlashMLA's combine "
                                                    f"kernel has instances up to {MAX_SM_PARTS} splits, this problem "
                                                    f"would make {parts}; combine.cu asserts it)"))
        if p.cuda_graph and p.sparse and installed and _has_sched_meta():
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
        matches = dense_call_matcher(p, kv_dtype)
        pages, dv, causal, table_of = DENSE_PAGE, p.head_dim_v, p.causal, cls._table

        def fast(q, kv, kv_scale, out, lse):
            if not matches(q, kv, kv_scale, out, lse):
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
        # the sparse arguments only where they are used: builds before the sparse kernels have no such parameters
        sparse = dict(is_fp8_kvcache=True, indices=indices) if p.sparse else {}
        o, l = flash_mla.flash_mla_with_kvcache(
            q, kv, cls._table(state, block_table), cache_seqlens, p.head_dim_v, state.meta, state.num_splits,
            softmax_scale=softmax_scale, causal=p.causal, **sparse)
        out.copy_(o)
        lse.copy_(l)
        if p.sparse:  # dense rows with no key already hold FlashMLA's 0 / +inf
            zero_invisible_rows(out, lse, (indices >= 0).any(dim=-1))
