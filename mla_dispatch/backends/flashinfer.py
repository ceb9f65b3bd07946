"""FlashInfer adapter: the MLA paged wrapper (SM80/SM90) and trtllm-gen decode (SM100).

Supported versions: flashinfer-python >= 0.6.0 (signatures checked against the
0.6.0 wheel's ``flashinfer/mla.py`` and v0.6.18 ``flashinfer/mla/_core.py``).

SM90 and other non-Blackwell GPUs: ``BatchMLAPagedAttentionWrapper`` (fa3 on
SM90a, fa2 elsewhere, FlashInfer's own "auto"):

- ``plan()`` copies the indptrs to the host (a sync) and builds a CPU schedule:
  it runs once per decode step in our :meth:`FlashInferBackend.plan`; every layer
  then calls ``run()``. For CUDA graphs the wrapper is built with
  ``use_cuda_graph=True`` and buffers the plan owns; :meth:`update` re-plans into
  them (outside the capture).
- q is split into ``q_nope [n, H, 512]`` / ``q_pe [n, H, 64]`` views, the cache into
  ``ckv [pages, ps, 512]`` / ``kpe [pages, ps, 64]`` views (no copies); any page size.
- The LSE is **base 2** by default: we pass ``return_lse_base_on_e=True`` where the
  installed ``run`` has it, else multiply by ln 2. It is ``[n, H]``; we transpose it
  to ``[B, h_q, s_q]``. Rows with no visible key are forced to out 0 / lse +inf.

SM100/SM103: ``trtllm_batch_decode_with_kv_cache_mla`` (trtllm-gen):

- page size 32 or 64 (a cache of page 128, 192, ... is re-viewed as page 64);
  ``kv_cache`` goes in as ``[pages, 1, ps, 576]``; the block table's width is padded
  to a multiple of ``128 / ps`` (FlashInfer requires it unless its backend is named).
- head counts: none in (64, 128) and ``H % min(H, tile) == 0`` with tile 8/16/64 for
  H <= 8/32/larger (vLLM ``_trtllm_gen_mla_decode_supports_num_heads``); other counts
  are zero-padded up to the next allowed one.
- bf16 only (its output is bf16); ``bmm1_scale = softmax_scale``, ``bmm2_scale = 1``;
  s_q > 1 is the causal MTP mask; the semaphore workspace is zeroed once per device.
- no LSE: 0.6.0 returns none; later versions' ``return_lse`` is not wired (unverified base/layout).
"""

from __future__ import annotations

import functools
import inspect
import math
import weakref

import torch

from mla_dispatch.dispatch.backend import ArchSupport, BackendState, CGSupport, MLABackend, Reason, ReasonCode
from mla_dispatch.numerics.tolerance import Tolerance
from mla_dispatch.metadata.conversions import repage_block_table
from mla_dispatch.metadata.page_lists import PageLists
from mla_dispatch.metadata.reuse import ReusePool, reuse_key
from mla_dispatch.dispatch.platform import Platform
from mla_dispatch.dispatch.problem import DecodeProblem

from ._vendor import dist_version, import_reasons, visible_rows, zero_invisible_rows

__all__ = ["FlashInferBackend", "trtllm_heads"]

MIN_VERSION = (0, 6, 0)
#: Before this version the MLA wrapper's kernels (include/flashinfer/attention/mla_hopper.cuh and mla.cuh,
#: ``prefetch_offset``) compute a page's offset as int32 page id * uint32 page stride in 32-bit arithmetic, so
#: every page whose first element lies at or past 2^32 elements of the cache is read from a wrapped address:
#: silently wrong output (NaN where the wrap lands in unused slots). Fixed by flashinfer PR #3136 (commit
#: d885b71, first released in 0.6.11). Found as NaN in ~98% of out/lse with 0.6.0 on an H100 at b=128,
#: h_q=128, mean length 32768 (a cache of ~177K pages of 64 tokens).
PAGE_OFFSET_FIX = (0, 6, 11)
_WRAPPER_MAX_CACHE_ELEMENTS = 1 << 32
WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's and vLLM's recommendation
_LN2 = math.log(2.0)
_TRTLLM_PAGE_SIZES = (64, 32)


def _is_trtllm(platform: Platform) -> bool:
    return platform.kind == "cuda" and platform.capability is not None and platform.capability[0] == 10


def _trtllm_allows(h: int) -> bool:
    if 64 < h < 128:
        return False
    tile = 8 if h <= 8 else (16 if h <= 32 else 64)
    return h % min(h, tile) == 0


def trtllm_heads(h_q: int) -> int | None:
    """The head count trtllm-gen runs ``h_q`` query heads at (zero-padded), or None above 128."""
    for h in range(h_q, 129):
        if _trtllm_allows(h):
            return h
    return None


def _trtllm_page_size(page_size: int) -> int | None:
    for ps in _TRTLLM_PAGE_SIZES:
        if page_size % ps == 0:
            return ps
    return None


@functools.lru_cache(maxsize=None)
def _signature_has(func_qualname: str, param: str) -> bool:
    """Feature detection on the installed flashinfer, once per process (never per call)."""
    import flashinfer

    obj = flashinfer
    for part in func_qualname.split("."):
        obj = getattr(obj, part)
    return param in inspect.signature(obj).parameters


#: ``BatchMLAPagedAttentionWrapper`` objects of plans that were dropped, for the next eager plans on the same device
#: and stream (metadata/reuse.py), at most 8 per key. Constructing one allocates its int workspace and a pinned host
#: buffer of the same size (FlashInfer 0.6's ``__init__``), which dominated the adapter's ``plan_decode`` on the H200
#: (benchmarks/RESULTS.md, "NVIDIA H200, 2026-11-29 (afternoon)"). A wrapper is meant to be planned again and again
#: (FlashInfer's engines keep one and re-plan it every step); the plan's state gives it back when it is collected
#: (``weakref.finalize``). A re-plan writes the wrapper's workspace on the current stream, hence the stream in the
#: key (:func:`~mla_dispatch.metadata.reuse.reuse_key`, the wrapper class beside it). CUDA-graph plans keep their own
#: (their buffers are captured), and nothing is pooled while the stream captures a graph.
_WRAPPERS = ReusePool(keep=8)

#: The other per-plan objects of dropped eager plans, by shapes (batch, s_q, table width, page size, h_q) on the
#: wrapper's key: the query offsets, the page lists with their kept launch (metadata/page_lists.py) and the LSE
#: buffer, at most 2 sets per key. Making them was most of what the adapter's ``plan_decode`` added to FlashInfer's own
#: plan after the wrappers were pooled (benchmarks/RESULTS.md, "NVIDIA H200, 2026-11-29 (evening)": +170 µs at b=1).
#: Nothing is pooled while the stream captures a CUDA graph (:func:`~mla_dispatch.metadata.reuse.reuse_key`).
_BUFFERS = ReusePool(keep=2)


def _give_back(wrapper_key: tuple | None, wrapper, buffers_key: tuple | None, buffers: tuple) -> None:
    """A dropped eager plan's wrapper and buffers, to the pools (``weakref.finalize`` of its state; a key of None:
    not pooled)."""
    if wrapper_key is not None:
        _WRAPPERS.give(wrapper_key, wrapper)
    if buffers_key is not None:
        _BUFFERS.give(buffers_key, buffers)


def _parse_version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


class FlashInferBackend(MLABackend):
    """FlashInfer: MLA paged wrapper on SM80/SM90, trtllm-gen decode on SM100."""

    NAME = "flashinfer"
    VENDOR = "FlashInfer"
    DESCRIPTION = "FlashInfer BatchMLAPagedAttentionWrapper (SM80/90) / trtllm-gen MLA decode (SM100)"
    PLATFORMS = frozenset({"cuda"})
    MIN_CAPABILITY = (8, 0)
    Q_DTYPES = frozenset({torch.bfloat16, torch.float16})  # SM100: bf16 only (extra_reasons)
    KV_FORMATS = frozenset({"bf16", "fp16"})
    HEAD_DIMS = frozenset({(576, 512)})  # head_dim_ckv 512 + head_dim_kpe 64
    PAGE_SIZES = None  # wrapper: any; SM100: multiples of 32 (extra_reasons)
    MAX_HEADS_KV = 1  # one latent KV head
    SUPPORTS_LSE = True  # SM80/SM90 wrapper only; SM100 trtllm-gen: no (extra_reasons)
    CUDA_GRAPH = CGSupport.ALWAYS  # wrapper in use_cuda_graph mode with plan-owned buffers
    ANY_OUT_STRIDES = True  # out.copy_(...) where out is not contiguous
    REQUIRES = ("flashinfer",)
    # First match wins: on SM100/SM103 the adapter runs trtllm-gen, elsewhere (SM80+) the MLA wrapper.
    ARCH_SUPPORT = (
        ArchSupport("sm100 trtllm-gen", "Blackwell (SM100/SM103)", min_capability=(10, 0), max_capability=(10, 3),
                    limits={"Q_DTYPES": frozenset({torch.bfloat16}), "KV_FORMATS": frozenset({"bf16"}),
                            "SUPPORTS_LSE": False, "PAGE_SIZE_MULTIPLE": 32, "MAX_HEADS_Q": 128},
                    sources={"Q_DTYPES": "trtllm_batch_decode_with_kv_cache_mla runs bf16 (its output is bf16)",
                             "KV_FORMATS": "trtllm_batch_decode_with_kv_cache_mla runs bf16 (its output is bf16)",
                             "SUPPORTS_LSE": "0.6.0 returns no LSE; the later return_lse is not wired here (its base "
                                             "and layout unverified)"},
                    notes="the trtllm-gen MLA kernel: pages of 64 or 32, heads zero-padded to a count it runs, s_q > 1 "
                          "causal only",
                    run_here="no: contract-tested"),
        ArchSupport("sm80+ wrapper", "NVIDIA SM80+ (not SM100/SM103)", min_capability=(8, 0),
                    notes="BatchMLAPagedAttentionWrapper (fa3 on SM90a, fa2 elsewhere), flashinfer-python >= 0.6; "
                          "causal s_q > 1 only at a power-of-two h_q (measured wrong otherwise, 0.6.0)",
                    run_here="yes: H100, H200"),
    )
    # docs/design.md's bounds, except cosine difference 1e-5 (FlashMLA's own test bound) instead of
    # 5e-6: 0.6.0 gave 5.26e-6 on H200 for b=1, h_q=1, L~20 (a single 512-value row averaging a
    # handful of bf16-rounded P values); every element was within the per-element bounds.
    TOLERANCE = Tolerance(out_cos=1e-5)

    @classmethod
    def version(cls) -> str:
        return dist_version("flashinfer-python", "flashinfer")

    @classmethod
    def _check_availability(cls) -> list[Reason]:
        reasons = import_reasons("flashinfer")
        if reasons:
            return reasons
        have = cls.version()
        if _parse_version(have) < MIN_VERSION:
            want = ".".join(map(str, MIN_VERSION))
            return [Reason(ReasonCode.UNAVAILABLE, f"flashinfer-python {have} (supported: >= {want})")]
        return []

    @classmethod
    def extra_reasons(cls, problem: DecodeProblem, platform: Platform) -> list[Reason]:
        p = problem
        R = ReasonCode
        reasons = []
        if p.num_heads_kv != 1:
            return reasons  # MAX_HEADS_KV already says it
        if not _is_trtllm(platform):
            if p.cache_numel > _WRAPPER_MAX_CACHE_ELEMENTS and _parse_version(cls.version()) < PAGE_OFFSET_FIX:
                fix = ".".join(map(str, PAGE_OFFSET_FIX))
                reasons.append(Reason(R.FEATURE, f"a KV cache of {p.cache_numel} elements (supported: <= 2^32 with "
                                                 f"flashinfer {cls.version()}; its MLA kernel's page offsets wrap at "
                                                 f"2^32 elements before {fix})"))
            # Measured wrong (not a rounding margin: ~0.2% of the softmax mass missing on some rows)
            # with 0.6.0 on H200, 2026-11-21, FlashMLA-compat grid: causal s_q=4, h_q in {63, 126},
            # b=64, varlen (L=140 and 4096); b in {1, 2, 6} and h_q in {1, 3, 9, 64, 128} passed.
            # Refused for every h_q that is not a power of two, a margin past what was observed.
            if p.causal and p.q_len > 1 and p.num_heads_q & (p.num_heads_q - 1):
                reasons.append(Reason(R.FEATURE, f"causal s_q={p.q_len} with h_q={p.num_heads_q} (not a power of "
                                                 "two): wrong results measured with flashinfer 0.6.0 (see "
                                                 "backends/flashinfer.py)"))
            return reasons
        # SM100: trtllm-gen (its dtype, pages, heads and LSE: ARCH_SUPPORT).
        if p.q_len > 1 and not p.causal:
            reasons.append(Reason(R.FEATURE, "causal=False with s_q > 1 on SM100 trtllm-gen (its MTP mask is causal)"))
        return reasons

    # -- plan ------------------------------------------------------------------------

    _workspaces: dict = {}

    @classmethod
    def _workspace(cls, device: torch.device) -> torch.Tensor:
        """One zeroed 128 MB workspace per device, shared by every plan (trtllm-gen semaphores
        must be zero on first use and are left zero by the kernel)."""
        key = (device.type, device.index)
        ws = cls._workspaces.get(key)
        if ws is None:
            ws = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            cls._workspaces[key] = ws
        return ws

    @classmethod
    def plan(cls, problem, platform, block_table, cache_seqlens, *, softmax_scale) -> BackendState:
        if _is_trtllm(platform):
            return cls._plan_trtllm(problem, block_table, cache_seqlens, softmax_scale)
        return cls._plan_wrapper(problem, block_table, cache_seqlens, softmax_scale)

    @classmethod
    def _plan_wrapper(cls, p: DecodeProblem, block_table, cache_seqlens, softmax_scale) -> BackendState:
        import flashinfer

        device = block_table.device
        n = p.batch * p.q_len
        buffers_key = buffers = None
        if not p.cuda_graph:
            buffers_key = reuse_key(device, p.batch, p.q_len, p.max_blocks, p.page_size, p.num_heads_q)
            buffers = None if buffers_key is None else _BUFFERS.take(buffers_key)
        if buffers is None:
            buffers = (torch.arange(0, n + 1, p.q_len, dtype=torch.int32, device=device),
                       PageLists(p.batch, p.max_blocks, p.page_size, device),
                       torch.empty(n, p.num_heads_q, dtype=torch.float32, device=device))
        qo_indptr, lists, lse_buf = buffers
        lists.update(block_table, cache_seqlens)
        if p.cuda_graph:
            # the wrapper's own buffers, read by a captured run and refilled in place by its plan()
            graph_indices = lists.indices.clone()
            wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(
                torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device), use_cuda_graph=True,
                qo_indptr=qo_indptr, kv_indptr=lists.indptr.clone(), kv_indices=graph_indices,
                kv_len_arr=cache_seqlens.to(torch.int32).clone())
        else:
            graph_indices = None
            make = flashinfer.mla.BatchMLAPagedAttentionWrapper
            pool_key = reuse_key(device, make)
            wrapper = None if pool_key is None else _WRAPPERS.take(pool_key)
            if wrapper is None:
                wrapper = make(cls._workspace(device))
        state = BackendState(kind="wrapper", wrapper=wrapper, qo_indptr=qo_indptr, softmax_scale=softmax_scale,
                             problem=p, lse_buf=lse_buf,
                             lse_base_e=_signature_has("mla.BatchMLAPagedAttentionWrapper.run", "return_lse_base_on_e"),
                             graph_indices=graph_indices, lists=lists, page_pos=lists.page_pos, indices_buf=None)
        if not p.cuda_graph:  # the wrapper and buffers go back to the pools when the plan is dropped
            weakref.finalize(state, _give_back, pool_key, wrapper, buffers_key, buffers)
        cls._replan_wrapper(state, block_table, cache_seqlens, lists_fresh=True)
        return state

    @classmethod
    def _replan_wrapper(cls, state: BackendState, block_table, cache_seqlens, lists_fresh: bool = False) -> None:
        p, lists = state.problem, state.lists
        # the packed page ids, where each sits in the table (a run gathers the table's values there again: every run
        # reads the block table, docs/design.md §2), and the lengths' offsets: one launch (metadata/page_lists.py)
        if not lists_fresh:
            lists.update(block_table, cache_seqlens)
        state.wrapper.plan(
            state.qo_indptr, lists.indptr, lists.indices, cache_seqlens.to(torch.int32),
            p.num_heads_q, p.head_dim_v, p.head_dim_qk - p.head_dim_v, p.page_size, p.causal,
            state.softmax_scale, p.q_dtype, p.q_dtype,
        )
        # the page ids the wrapper's kernel reads: its own buffer where it keeps one (flashinfer 0.6.x:
        # `_kv_indices_buf`, the tensor given to the constructor (CUDA graphs) or to plan()), else what we gave it
        buf = getattr(state.wrapper, "_kv_indices_buf", None)
        if not isinstance(buf, torch.Tensor):
            buf = state.graph_indices if state.graph_indices is not None else lists.indices
        state.indices_buf = buf[: lists.page_pos.shape[0]]

    @classmethod
    def _plan_trtllm(cls, p: DecodeProblem, block_table, cache_seqlens, softmax_scale) -> BackendState:
        device = block_table.device
        page = _trtllm_page_size(p.page_size)
        heads = trtllm_heads(p.num_heads_q)
        width = p.max_blocks * (p.page_size // page)
        align = 128 // page
        padded = torch.zeros(p.batch, -(-width // align) * align, dtype=torch.int32, device=device)
        state = BackendState(kind="trtllm", page=page, heads=heads, table=padded, problem=p,
                             softmax_scale=softmax_scale, workspace=cls._workspace(device),
                             q_pad=(torch.zeros(p.batch, p.q_len, heads, p.head_dim_qk, dtype=p.q_dtype, device=device)
                                    if heads != p.num_heads_q else None))
        cls._refresh_trtllm(state, block_table)
        return state

    @classmethod
    def _refresh_trtllm(cls, state: BackendState, block_table) -> None:
        p = state.problem
        table = block_table if state.page == p.page_size else repage_block_table(block_table, p.page_size, state.page)
        # Entries past a request's length may be garbage ids: the kernel reads only
        # ceil(L / page) of them, and the padding columns hold page 0.
        state.table[:, : table.shape[1]].copy_(table)

    @classmethod
    def update(cls, state: BackendState, block_table, cache_seqlens) -> None:
        if state.kind == "wrapper":
            cls._replan_wrapper(state, block_table, cache_seqlens)
        else:
            cls._refresh_trtllm(state, block_table)

    # -- run -----------------------------------------------------------------------------

    @classmethod
    def run(cls, state, q, kv_cache, block_table, cache_seqlens, *, problem, softmax_scale, kv_scale, indices,
            out, lse) -> None:
        if state.kind == "wrapper":
            cls._run_wrapper(state, q, kv_cache, block_table, out, lse)
        else:
            cls._refresh_trtllm(state, block_table)  # every run reads the block table (docs/design.md §2)
            cls._run_trtllm(state, q, kv_cache, cache_seqlens, out, lse)
        zero_invisible_rows(out, lse, visible_rows(cache_seqlens, problem.q_len, problem.causal))

    @classmethod
    def _run_wrapper(cls, state, q, kv_cache, block_table, out, lse) -> None:
        p = state.problem
        n, dv = p.batch * p.q_len, p.head_dim_v
        # the page ids of the table's current values (planned lengths): one gather
        torch.index_select(block_table.reshape(-1), 0, state.page_pos, out=state.indices_buf)
        qf = q.reshape(n, p.num_heads_q, p.head_dim_qk)
        kv = kv_cache[:, :, 0, :]  # [pages, ps, 576]
        o = out.view(n, p.num_heads_q, dv) if out.is_contiguous() else torch.empty(
            n, p.num_heads_q, dv, dtype=out.dtype, device=out.device)
        extra = {"return_lse_base_on_e": True} if state.lse_base_e else {}
        state.wrapper.run(qf[..., :dv], qf[..., dv:], kv[..., :dv], kv[..., dv:], out=o, lse=state.lse_buf,
                          return_lse=True, **extra)
        if o.data_ptr() != out.data_ptr():
            out.copy_(o.view(out.shape))
        lse_e = state.lse_buf if state.lse_base_e else state.lse_buf * _LN2
        lse.copy_(lse_e.view(p.batch, p.q_len, p.num_heads_q).transpose(1, 2))

    @classmethod
    def _run_trtllm(cls, state, q, kv_cache, cache_seqlens, out, lse) -> None:
        from flashinfer.decode import trtllm_batch_decode_with_kv_cache_mla

        p = state.problem
        if state.q_pad is not None:
            state.q_pad[:, :, : p.num_heads_q].copy_(q)
            q = state.q_pad
        pages = kv_cache.shape[0] * (p.page_size // state.page)
        kv = kv_cache.view(pages, state.page, p.head_dim_qk).unsqueeze(1)  # [pages, 1, ps, 576]
        o = trtllm_batch_decode_with_kv_cache_mla(
            query=q, kv_cache=kv, workspace_buffer=state.workspace,
            qk_nope_head_dim=128, kv_lora_rank=p.head_dim_v, qk_rope_head_dim=p.head_dim_qk - p.head_dim_v,
            block_tables=state.table, seq_lens=cache_seqlens, max_seq_len=p.max_blocks * p.page_size,
            bmm1_scale=state.softmax_scale, bmm2_scale=1.0)
        out.copy_(o.view(p.batch, p.q_len, state.heads, p.head_dim_v)[:, :, : p.num_heads_q])
        lse.fill_(float("nan"))  # not computed: plans on SM100 are made with return_lse=False
