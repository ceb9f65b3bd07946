"""AMD AITER adapter: ``aiter.mla.mla_decode_fwd`` on ROCm (gfx942 MI300X, gfx950 MI355X).

Supported versions: AITER from Dec 2025 on. The call passes everything after
``max_seqlen_q`` by keyword, because commit 739c631 (Feb 2026) inserted
``page_size`` and ``nhead_kv`` before ``sm_scale``; ``page_size``/``nhead_kv``/
``causal``/``q_scale``/``kv_scale`` are passed only where the installed signature has
them (read once per process, as vLLM's ``_aiter_ops.py`` does).

AITER aborts the process (``AITER_CHECK``, SIGABRT) when no assembly kernel matches a
(q dtype, kv dtype, heads, persistent, s_q) combination. This adapter therefore
decides from AITER's published kernel tables, :data:`KERNELS` (copied as data from
``hsa/gfx942/mla/mla_asm.csv`` @074f473 and ``hsa/gfx950/mla/mla_asm.csv`` @0462c53,
decode rows), and refuses everything else with a reason before calling. Matching, as
read from ``aiter/mla.py``: a row's Gqa is the head count the kernel runs, its qSeqLen
the exact s_q (0: any); fewer than 16 heads are zero-padded to 16 (vLLM's
``AiterMLAHelper``) unless a kernel for the exact count exists; in persistent mode
AITER itself folds 32..128 heads (step 16) onto the 16-head kernel.

Layout: the cache is flattened to page size 1 (``kv_buffer [tokens, 1, 1, 576]``)
with token-level ``kv_indptr``/``kv_indices`` and ``kv_last_page_lens`` built by
:mod:`mla_dispatch.metadata.schedule` (as vLLM and SGLang do), so any page size works.
Persistent mode (preferred when a ``ps`` kernel matches): the six work/reduce
buffers are sized by ``get_mla_metadata_info_v1`` and allocated in :meth:`plan`,
filled by ``get_mla_metadata_v1`` there and refilled in place by :meth:`update`.

FP8 (``fp8_e4m3`` per-tensor scale): gfx942 kernels read ``float8_e4m3fnuz``; the
adapter reinterprets the e4m3fn bytes (same bits = half the value, so the scale is
doubled; fn's negative zero 0x80 is NaN in fnuz and is rewritten to 0x00 — one
elementwise pass over the cache per call). Where only fp8-q kernels exist, q is
quantised per call with a dynamic per-tensor ``q_scale``.
"""

from __future__ import annotations

import functools
import inspect

import torch

from mla_dispatch.dispatch.backend import ArchSupport, BackendState, CGSupport, MLABackend, Reason, ReasonCode
from mla_dispatch.metadata.conversions import kv_last_page_lens, token_indices
from mla_dispatch.dispatch.platform import Platform
from mla_dispatch.dispatch.problem import DecodeProblem

from ._vendor import dist_version, import_reasons, visible_rows, zero_invisible_rows

__all__ = ["AiterBackend", "KERNELS", "choose_kernel"]

# (q type, kv type, Gqa heads, persistent, qSeqLen (0 = any)) of every decode kernel.
KERNELS: dict[str, frozenset[tuple[str, str, int, bool, int]]] = {
    "gfx942": frozenset({
        ("bf16", "bf16", 128, False, 0), ("bf16", "bf16", 16, True, 4), ("bf16", "bf16", 16, False, 1),
        ("bf16", "bf16", 16, False, 4), ("bf16", "bf16", 16, False, 8), ("bf16", "fp8", 16, True, 4),
        ("fp8", "fp8", 16, True, 1), ("fp8", "fp8", 64, True, 1), ("fp8", "fp8", 16, True, 2),
        ("fp8", "fp8", 16, True, 4), ("fp8", "fp8", 16, False, 1), ("fp8", "fp8", 16, False, 2),
        ("fp8", "fp8", 16, False, 4), ("fp8", "fp8", 128, False, 0), ("fp8", "fp8", 128, True, 0),
        ("bf16", "bf16", 32, False, 0), ("bf16", "bf16", 64, False, 0), ("bf16", "bf16", 8, False, 1),
        ("fp8", "fp8", 8, False, 1), ("bf16", "bf16", 8, True, 2),
    }),
    "gfx950": frozenset({
        ("bf16", "bf16", 128, False, 0), ("bf16", "bf16", 16, True, 4), ("bf16", "bf16", 16, False, 1),
        ("bf16", "bf16", 16, False, 4), ("bf16", "bf16", 16, False, 8), ("bf16", "fp8", 16, True, 4),
        ("fp8", "fp8", 16, True, 1), ("fp8", "fp8", 16, True, 2), ("fp8", "fp8", 16, True, 4),
        ("fp8", "fp8", 64, True, 1), ("fp8", "fp8", 16, False, 1), ("fp8", "fp8", 16, False, 2),
        ("fp8", "fp8", 16, False, 4), ("fp8", "fp8", 32, True, 4), ("fp8", "fp8", 32, True, 2),
        ("fp8", "fp8", 128, False, 0), ("bf16", "bf16", 32, False, 0), ("bf16", "bf16", 64, False, 0),
        ("bf16", "bf16", 64, False, 1), ("bf16", "bf16", 8, False, 1), ("bf16", "bf16", 8, False, 2),
        ("fp8", "fp8", 8, False, 1), ("fp8", "fp8", 8, True, 4), ("bf16", "bf16", 32, True, 4),
        ("bf16", "bf16", 64, True, 1),
    }),
}
FP8_DTYPE = {"gfx942": torch.float8_e4m3fnuz, "gfx950": torch.float8_e4m3fn}
FP8_MAX = {"gfx942": 240.0, "gfx950": 448.0}
MIN_HEADS = 16


def choose_kernel(arch: str, kv_format: str, h_q: int, q_len: int) -> tuple[str, int, bool] | None:
    """The (q type, heads to run at, persistent) of a matching kernel, or None (AITER would abort).

    Preference: bf16 q over quantised q, persistent over not, exact heads over padding.
    """
    table = KERNELS.get(arch, frozenset())
    kv = "bf16" if kv_format == "bf16" else "fp8"
    q_types = ("bf16",) if kv == "bf16" else ("bf16", "fp8")
    heads = [h_q] + ([MIN_HEADS] if h_q < MIN_HEADS else [])
    for q in q_types:
        for persistent in (True, False):
            for h in heads:
                lookup = MIN_HEADS if persistent and h in range(32, 129, 16) else h
                for qlen in (q_len, 0):
                    if (q, kv, lookup, persistent, qlen) in table:
                        return q, h, persistent
    return None


@functools.lru_cache(maxsize=None)
def _decode_params() -> frozenset[str]:
    """Parameter names of the installed ``mla_decode_fwd`` (read once, never per call)."""
    from aiter.mla import mla_decode_fwd

    return frozenset(inspect.signature(mla_decode_fwd).parameters)


class AiterBackend(MLABackend):
    """AMD AITER assembly MLA decode (ROCm gfx942 / gfx950)."""

    NAME = "aiter"
    VENDOR = "AMD AITER"
    DESCRIPTION = "AMD AITER mla_decode_fwd (ROCm MI300X gfx942, MI355X gfx950)"
    PLATFORMS = frozenset({"rocm"})
    ARCHS = frozenset(KERNELS)
    Q_DTYPES = frozenset({torch.bfloat16})
    KV_FORMATS = frozenset({"bf16", "fp8_e4m3"})
    HEAD_DIMS = frozenset({(576, 512)})
    MAX_HEADS_KV = 1  # asm_mla.cu: nhead_kv == 1
    MAX_HEADS_Q = 128
    CUDA_GRAPH = CGSupport.ALWAYS  # persistent buffers owned by the plan, refilled in place
    ANY_OUT_STRIDES = True  # out.copy_(...)
    REQUIRES = ("aiter",)
    ARCH_SUPPORT = tuple(
        ArchSupport(arch, f"ROCm {gpu} ({arch})", archs=frozenset({arch}),
                    notes=f"AITER's mla_decode_fwd: page-1 token indices; h_q and s_q as its kernel table has them "
                          f"(hsa/{arch}/mla/mla_asm.csv: AITER aborts where none matches), fewer than 16 heads padded "
                          "to 16",
                    run_here="no: contract-tested")
        for arch, gpu in (("gfx942", "MI300X"), ("gfx950", "MI355X")))

    @classmethod
    def version(cls) -> str:
        return dist_version("amd-aiter", "aiter")

    @classmethod
    def _check_availability(cls) -> list[Reason]:
        return import_reasons("aiter")

    @classmethod
    def extra_reasons(cls, problem: DecodeProblem, platform: Platform) -> list[Reason]:
        p = problem
        reasons = []
        if p.q_len > 1 and not p.causal:
            reasons.append(Reason(ReasonCode.FEATURE, "causal=False with s_q > 1 (AITER's decode kernels are causal)"))
        if platform.arch in KERNELS and p.num_heads_q <= cls.MAX_HEADS_Q and p.kv_format in cls.KV_FORMATS:
            if choose_kernel(platform.arch, p.kv_format, p.num_heads_q, p.q_len) is None:
                kv = "bf16" if p.kv_format == "bf16" else "fp8"
                have = sorted({(r[2], r[4]) for r in KERNELS[platform.arch] if r[1] == kv})
                listed = ", ".join(f"h{h}/s_q={'any' if s == 0 else s}" for h, s in have)
                reasons.append(Reason(ReasonCode.HEADS, f"h_q={p.num_heads_q}, s_q={p.q_len}, kv {kv} on "
                                                        f"{platform.arch}: no AITER kernel (AITER would abort; "
                                                        f"kernels: {listed})"))
        return reasons

    # -- plan ------------------------------------------------------------------------

    @classmethod
    def plan(cls, problem, platform, block_table, cache_seqlens, *, softmax_scale) -> BackendState:
        import aiter

        p = problem
        q_type, heads, persistent = choose_kernel(platform.arch, p.kv_format, p.num_heads_q, p.q_len)
        device = block_table.device
        n = p.batch * p.q_len
        fp8 = FP8_DTYPE[platform.arch]
        q_dtype = fp8 if q_type == "fp8" else torch.bfloat16
        kv_dtype = torch.bfloat16 if p.kv_format == "bf16" else fp8
        state = BackendState(
            problem=p, arch=platform.arch, heads=heads, persistent=persistent, q_dtype=q_dtype, kv_dtype=kv_dtype,
            softmax_scale=softmax_scale,
            qo_indptr=torch.arange(0, n + 1, p.q_len, dtype=torch.int32, device=device),
            q_buf=torch.zeros(n, heads, p.head_dim_qk, dtype=q_dtype, device=device),
            o_buf=torch.empty(n, heads, p.head_dim_v, dtype=torch.bfloat16, device=device),
            meta=None, kv_indptr=None, kv_indices=None, last_page=None, token_pos=None, token_offset=None,
            table_pos=torch.arange(p.batch * p.max_blocks, dtype=torch.int32, device=device).view(p.batch,
                                                                                                  p.max_blocks))
        if persistent:
            info = aiter.get_mla_metadata_info_v1(p.batch, p.q_len, heads, q_dtype, kv_dtype, is_sparse=False,
                                                  fast_mode=True)
            state.meta = tuple(torch.empty(shape, dtype=dtype, device=device) for shape, dtype in info)
        cls.update(state, block_table, cache_seqlens)
        return state

    @classmethod
    def update(cls, state: BackendState, block_table, cache_seqlens) -> None:
        p = state.problem
        last = kv_last_page_lens(cache_seqlens, 1)
        # each packed token's table entry (its row-major position in the table) and offset in its page (0 for the
        # padding past kv_indptr[-1], never read): its slot is the table's value there, now and at every run
        # (docs/design.md §2: every run reads the block table)
        indptr, token_pos = token_indices(state.table_pos, cache_seqlens, p.page_size)
        token_pos = token_pos.long()
        token_pos, token_offset = token_pos // p.page_size, (token_pos % p.page_size).to(torch.int32)
        indices = torch.index_select(block_table.reshape(-1), 0, token_pos) * p.page_size + token_offset
        if state.kv_indptr is None:
            state.kv_indptr, state.kv_indices, state.last_page = indptr, indices, last
            state.token_pos, state.token_offset = token_pos, token_offset
        else:  # in place: a captured graph keeps pointing at these
            state.kv_indptr.copy_(indptr)
            state.kv_indices.copy_(indices)
            state.last_page.copy_(last)
            state.token_pos.copy_(token_pos)
            state.token_offset.copy_(token_offset)
        if state.persistent:
            import aiter

            work_meta, work_indptr, work_info, reduce_indptr, reduce_final, reduce_partial = state.meta
            aiter.get_mla_metadata_v1(
                state.qo_indptr, state.kv_indptr, state.last_page, state.heads, 1, True,
                work_meta, work_info, work_indptr, reduce_indptr, reduce_final, reduce_partial,
                page_size=1, kv_granularity=16, max_seqlen_qo=p.q_len, uni_seqlen_qo=p.q_len, fast_mode=True)

    # -- run -----------------------------------------------------------------------------

    @classmethod
    def run(cls, state, q, kv_cache, block_table, cache_seqlens, *, problem, softmax_scale, kv_scale, indices,
            out, lse) -> None:
        from aiter.mla import mla_decode_fwd

        p = problem
        n, d = p.batch * p.q_len, p.head_dim_qk
        kv = kv_cache.reshape(-1, 1, 1, d)  # page size 1 (a view for a contiguous cache)
        params = _decode_params()
        kwargs = dict(sm_scale=softmax_scale, return_lse=True)
        if p.kv_format == "fp8_e4m3":
            kv, kv_scale = cls._fp8_cache(state, kv, kv_scale)
            if "kv_scale" in params:
                kwargs["kv_scale"] = kv_scale
        qf = q.reshape(n, p.num_heads_q, d)
        if state.q_dtype == torch.bfloat16:
            state.q_buf[:, : p.num_heads_q].copy_(qf)
        else:  # dynamic per-tensor quantisation for fp8-q kernels
            q_scale = (qf.float().abs().amax() / FP8_MAX[state.arch]).clamp_min(1e-12).reshape(1)
            state.q_buf[:, : p.num_heads_q].copy_((qf.float() / q_scale).to(state.q_dtype))
            kwargs["q_scale"] = q_scale
        if "page_size" in params:
            kwargs.update(page_size=1, nhead_kv=1)
        if "causal" in params:
            kwargs["causal"] = p.causal
        # the token slots of the block table's current values (planned lengths): a gather and two in-place ops
        torch.index_select(block_table.reshape(-1), 0, state.token_pos, out=state.kv_indices)
        state.kv_indices.mul_(p.page_size).add_(state.token_offset)
        if state.persistent:
            work_meta, work_indptr, work_info, reduce_indptr, reduce_final, reduce_partial = state.meta
            kwargs.update(work_meta_data=work_meta, work_indptr=work_indptr, work_info_set=work_info,
                          reduce_indptr=reduce_indptr, reduce_final_map=reduce_final,
                          reduce_partial_map=reduce_partial)
        _, final_lse = mla_decode_fwd(state.q_buf, kv, state.o_buf, state.qo_indptr, state.kv_indptr,
                                      state.kv_indices, state.last_page, p.q_len, **kwargs)
        h = p.num_heads_q
        out.copy_(state.o_buf[:, :h].view(p.batch, p.q_len, h, p.head_dim_v))
        lse.copy_(final_lse[:, :h].view(p.batch, p.q_len, h).transpose(1, 2))
        zero_invisible_rows(out, lse, visible_rows(cache_seqlens, p.q_len, p.causal))

    @classmethod
    def _fp8_cache(cls, state, kv, kv_scale):
        """The cache in the arch's fp8 dtype and its scale (see the module docstring)."""
        if state.kv_dtype == torch.float8_e4m3fn:
            return kv, kv_scale
        bits = kv.view(torch.uint8)
        bits = torch.where(bits == 0x80, torch.zeros((), dtype=torch.uint8, device=bits.device), bits)
        return bits.view(state.kv_dtype), kv_scale * 2.0
