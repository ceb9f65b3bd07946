"""FlashAttention-3 adapter: FA3's paged-KV forward with the 512-wide latent passed as ``qv``.

This is the MLA decode path of vLLM's ``FLASH_ATTN_MLA`` backend (vLLM's default on Hopper,
``vllm/v1/attention/backends/mla/flashattn_mla.py``) and of SGLang's ``fa3`` backend. The score of MLA's
absorbed form, ``scale * <q, K>`` over 576 channels, is FA3's ``scale * (<q, k> + <qv, v>)`` with

- ``q``  = the query's 64 RoPE channels ``q[..., 512:]``,   ``k_cache`` = the cache's ``[..., 512:]``,
- ``qv`` = the query's 512 latent channels ``q[..., :512]``, ``v_cache`` = the cache's ``[..., :512]``,

all views of the canonical tensors (no copies); V is the latent, so the output is FA3's ``[B, s_q, h_q, 512]``.

Providers, tried in this order (the first that imports wins; :func:`provider` names it):

- ``flash_attn_interface``: Dao-AILab/flash-attention ``hopper/`` (the ``flash_attn_3`` wheel or a source
  build): ``flash_attn_with_kvcache`` and ``get_scheduler_metadata``; its build flags are read from
  ``flash_attn_config.CONFIG`` (a build may leave out fp16, the paged non-TMA path, varlen, ...);
- ``vllm.vllm_flash_attn``: vLLM's fork: ``flash_attn_varlen_func`` (``q_v``, ``out``, ``seqused_k``,
  ``block_table``, ``fa_version=3``; its LSE is ``[h_q, total_q]``) and ``get_scheduler_metadata``;
- ``sgl_kernel.flash_attn``: SGLang's: ``flash_attn_with_kvcache`` (``get_scheduler_metadata`` where the
  installed version has one; otherwise FA3 schedules inside each call).

What the kernel runs, from its host checks (``hopper/flash_api_stable.cpp`` ``mha_fwd`` at 0251105, the same in
``flash_api.cpp``), not from its docstrings:

- SM90 only: ``q_v`` requires ``params.arch == 90``, and a V head dim unlike Q/K's is Hopper-only;
- ``q_v`` requires Q/K head dim <= 64 and V head dim >= 256, fp16 or bf16 (no fp8), and the only such
  instantiation with V 512 is ``run_mha_fwd_<90, T, 64, 512, ...>``: D_qk/D_v 576/512 only, the cache in q's dtype;
- any page size: TMA pages when ``page_size % 64 == 0`` and ``s_q * h_q / h_kv > 64`` (``get_pagedkv_tma``), the
  non-TMA paged path otherwise (upstream's ``test_flash_attn_kvcache`` runs pages 1, 4 and 128 with ``qv``);
- any h_q divisible by h_kv (GQA packs heads), any s_q; causal is bottom-right aligned, as ours;
- LSE: natural log (``softmax.h`` ``finalize``: ``max * scale_log2 * ln 2 + log(sum)``), ``[B, h_q, s_q]``
  (``[h_q, B * s_q]`` from the varlen call). Rows that see no key get out 0 and LSE -inf (``epilogue_fwd.hpp``
  ``store_zero``; the split combine keeps both); the adapter makes that LSE +inf, the canonical sentinel;
- split-KV is FA3's own: ``get_scheduler_metadata`` (its ``prepare_varlen_num_blocks`` kernel over the lengths)
  runs once per step in :meth:`FA3Backend.plan` and is refreshed in place by :meth:`FA3Backend.update`, with the
  same ``max_seqlen_k`` (``max_blocks * page_size``, what the call derives from the table), ``num_splits`` and
  ``causal`` as the call, so both make the same split decision. ``num_splits=0`` lets FA3 choose; batch-invariant
  plans pass 1 (no split: a request's tiles never depend on the batch; vLLM's ``VLLM_BATCH_INVARIANT`` does the same);
- CUDA graphs: the call does no host sync; its split buffers come from the graph's pool (vLLM captures it whole).

FA3's ``flash_attn_with_kvcache`` allocates its output: an eager call without ``out`` returns it as it is
(:meth:`FA3Backend.bind`); with ``out`` it is copied (vLLM's varlen call writes ``out`` in place).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import torch

from mla_dispatch.dispatch.backend import (ArchSupport, BackendState, CGSupport, MLABackend, Reason, ReasonCode,
                                           dense_call_matcher)
from mla_dispatch.dispatch.platform import Platform
from mla_dispatch.dispatch.problem import DecodeProblem

from ._vendor import dist_version, visible_rows

__all__ = ["FA3Backend", "Provider", "PROVIDERS", "resolve", "provider", "build_flags"]

#: ``tile_size_fwd_sm90(64, 512, ...)``'s kBlockN: pages of a multiple of it can be read by TMA.
TMA_PAGE_MULTIPLE = 64


@dataclasses.dataclass(frozen=True)
class Provider:
    """One packaging of FA3: the module to import, the distribution (and else the module's ``__version__``) whose
    version it reports, and its call."""

    module: str
    dist: str
    version_module: str
    #: ``"kvcache"``: ``flash_attn_with_kvcache(q, k_cache, v_cache, qv=...)`` (batched q, LSE ``[B, h, s]``);
    #: ``"varlen"``: ``flash_attn_varlen_func(q, k, v, ..., q_v=..., out=...)`` (packed q, LSE ``[h, total_q]``)
    call: str

    @property
    def function(self) -> str:
        return "flash_attn_with_kvcache" if self.call == "kvcache" else "flash_attn_varlen_func"


PROVIDERS = (
    Provider("flash_attn_interface", "flash_attn_3", "flash_attn_3", "kvcache"),
    Provider("vllm.vllm_flash_attn", "vllm", "vllm", "varlen"),
    Provider("sgl_kernel.flash_attn", "sgl-kernel", "sgl_kernel", "kvcache"),
)


@functools.lru_cache(maxsize=None)
def resolve() -> tuple[Provider | None, object, tuple[str, ...]]:
    """``(provider, module, failures)``: the first provider that imports with its call (else None), its module, and
    why each one before it did not. Imports once per process."""
    failures = []
    for prov in PROVIDERS:
        try:
            module = importlib.import_module(prov.module)
        except Exception as exc:  # ImportError, OSError from a missing .so, RuntimeError from a CUDA probe
            failures.append(f"import {prov.module} failed: {type(exc).__name__}: {exc}")
            continue
        if not callable(getattr(module, prov.function, None)):
            failures.append(f"{prov.module} at {getattr(module, '__file__', '?')} has no {prov.function}")
            continue
        unsupported = getattr(module, "fa_version_unsupported_reason", None)  # vLLM's: FA2 and FA3 in one package
        if unsupported is not None:
            try:
                why = unsupported(3)
            except Exception as exc:  # it asks the current CUDA device
                why = f"{type(exc).__name__}: {exc}"
            if why:
                failures.append(f"{prov.module} has no usable FA3: {why}")
                continue
        return prov, module, tuple(failures)
    return None, None, tuple(failures)


def provider() -> Provider | None:
    """The FA3 packaging this process uses, or None when none imports."""
    return resolve()[0]


@functools.lru_cache(maxsize=None)
def build_flags() -> dict[str, bool]:
    """The installed upstream build's ``flash_attn_config.CONFIG["build_flags"]`` (``FLASHATTENTION_DISABLE_*``),
    or {} where there is none (vLLM's and SGLang's builds, which carry the MLA instantiations)."""
    prov = provider()
    if prov is None or prov.module != "flash_attn_interface":
        return {}
    try:
        config = importlib.import_module("flash_attn_config").CONFIG
        return {str(k): bool(v) for k, v in config.get("build_flags", {}).items()}
    except Exception:
        return {}


class FA3Backend(MLABackend):
    """FlashAttention-3 (SM90): paged decode with the latent as ``qv``, as vLLM's FLASH_ATTN_MLA runs it."""

    NAME = "fa3"
    DESCRIPTION = "FlashAttention-3 paged decode with qv (vLLM FLASH_ATTN_MLA, SGLang fa3), SM90"
    PLATFORMS = frozenset({"cuda"})
    MIN_CAPABILITY = (9, 0)  # q_v: params.arch == 90
    MAX_CAPABILITY = (9, 0)
    Q_DTYPES = frozenset({torch.bfloat16, torch.float16})  # a build may leave fp16 out (extra_reasons)
    KV_FORMATS = frozenset({"bf16", "fp16"})  # q_v rejects fp8
    HEAD_DIMS = frozenset({(576, 512)})  # hdim 64 + hdim_v 512
    PAGE_SIZES = None  # any (a build without the non-TMA paged path: extra_reasons)
    SUPPORTS_CAUSAL = True
    SUPPORTS_LSE = True
    SUPPORTS_BATCH_INVARIANT = True  # num_splits=1
    CUDA_GRAPH = CGSupport.ALWAYS
    ANY_OUT_STRIDES = True  # out.copy_(...) where FA3 cannot write out itself
    #: FA3 ends the process on a CUDA error (``exit(1)`` in its ``CHECK_CUDA``): conformance runs it in a child
    VENDOR = "FlashAttention-3"
    ARCH_SUPPORT = (
        ArchSupport("sm90", "Hopper (sm_90a)", min_capability=(9, 0), max_capability=(9, 0),
                    sources={"HEAD_DIMS": "hopper/flash_api.cpp: q_v needs head dim <= 64 and V >= 256; the one "
                                          "instantiation with V 512 is run_mha_fwd_<90, T, 64, 512>",
                             "KV_FORMATS": "hopper/flash_api.cpp: q_v rejects fp8"},
                    notes="FlashAttention-3's paged decode with the latent as qv (vLLM's FLASH_ATTN_MLA; from "
                          "flash_attn_3, vllm.vllm_flash_attn or sgl_kernel); not its paged-TMA path (page a "
                          "multiple of 64 with s_q*h_q/h_kv > 64), where a NaN in unused slots reaches the output",
                    run_here="yes: H200 (flash_attn_3 built from source by ci/build_fa3_peer.sh; vLLM's and "
                             "SGLang's builds contract-tested)"),
    )

    @classmethod
    def version(cls) -> str:
        prov = provider()
        if prov is None:
            return "not installed"
        return f"{dist_version(prov.dist, prov.version_module)} ({prov.module})"

    @classmethod
    def _check_availability(cls) -> list[Reason]:
        prov, _, failures = resolve()
        if prov is None:
            return [Reason(ReasonCode.UNAVAILABLE, "; ".join(failures))]
        return []

    # which path FA3 takes, and the reason the backend gives for declining one (also read by tools/peers.py, which
    # times FA3's own call on that path)
    @staticmethod
    def uses_paged_tma(p: DecodeProblem) -> bool:
        """Whether FA3 reads ``p``'s pages by TMA (hopper/flash_api.cpp ``get_pagedkv_tma``): whole pages once
        s_q*h_q/h_kv > kBlockM (64) and the page holds whole kBlockN (64) tiles."""
        return p.page_size % TMA_PAGE_MULTIPLE == 0 and p.rows_per_kv_head > TMA_PAGE_MULTIPLE

    @staticmethod
    def paged_tma_reason(p: DecodeProblem) -> Reason:
        """Why the backend declines FA3's paged-TMA path. On it a request's last page is read to its end and the
        scores past the length masked, but P V still multiplies their V rows by 0: a NaN in an unused slot
        (docs/design.md §1: they may hold anything) made every output of its request NaN on the H200
        (benchmarks/RESULTS.md, "NVIDIA H200, 2026-11-29"); the non-TMA paged path predicates its loads and passed the
        same cases."""
        return Reason(ReasonCode.PAGE_SIZE, f"page_size={p.page_size} with s_q*h_q/h_kv={p.rows_per_kv_head} "
                                            f"(supported: page_size not a multiple of {TMA_PAGE_MULTIPLE}, or "
                                            f"s_q*h_q/h_kv <= {TMA_PAGE_MULTIPLE}): FA3's paged-TMA path lets a NaN "
                                            "in a page's unused slots into its request's output")

    @classmethod
    def extra_reasons(cls, problem: DecodeProblem, platform: Platform) -> list[Reason]:
        p = problem
        R = ReasonCode
        reasons = []
        tma = cls.uses_paged_tma(p)
        if tma:
            reasons.append(cls.paged_tma_reason(p))
        flags = build_flags()
        if not flags:
            return reasons
        missing = [f for f in ("FLASHATTENTION_DISABLE_HDIM64", "FLASH_ATTENTION_DISABLE_HDIMDIFF64") if flags.get(f)]
        if missing:
            reasons.append(Reason(R.HEAD_DIM, f"D_qk/D_v={p.head_dim_qk}/{p.head_dim_v}: this flash_attn_3 build has "
                                              f"no hdim 64 / hdim_v 512 kernels (built with {', '.join(missing)})"))
        if p.q_dtype == torch.float16 and flags.get("FLASHATTENTION_DISABLE_FP16"):
            reasons.append(Reason(R.DTYPE, "q dtype=float16 (supported by this flash_attn_3 build: bfloat16; built "
                                           "with FLASHATTENTION_DISABLE_FP16)"))
        if flags.get("FLASHATTENTION_DISABLE_VARLEN"):
            reasons.append(Reason(R.FEATURE, "per-request cache_seqlens (seqused_k) need FA3's varlen kernels (this "
                                             "build has FLASHATTENTION_DISABLE_VARLEN)"))
        if flags.get("FLASHATTENTION_DISABLE_PAGEDKV") and not tma:
            reasons.append(Reason(R.PAGE_SIZE, f"page_size={p.page_size} with s_q*h_q/h_kv={p.rows_per_kv_head} "
                                               "(supported by this flash_attn_3 build, FLASHATTENTION_DISABLE_PAGEDKV: "
                                               f"TMA pages only, page_size a multiple of {TMA_PAGE_MULTIPLE} and "
                                               f"s_q*h_q/h_kv > {TMA_PAGE_MULTIPLE})"))
        return reasons

    # -- FA3's own calls ---------------------------------------------------------------

    @classmethod
    def vendor(cls) -> tuple[Provider, object]:
        """``(provider, module)``: the FA3 this process uses (:func:`resolve`), for FA3's own calls below (bench times
        them directly, as a peer).

        Raises
        ------
        RuntimeError
            Where none is available; the message holds each import's failure.
        """
        prov, module, failures = resolve()
        if prov is None:
            raise RuntimeError("FlashAttention-3 is not available: " + "; ".join(failures))
        return prov, module

    @staticmethod
    def scheduler_metadata(module, problem: DecodeProblem, cache_seqlens: torch.Tensor, *,
                           cu_seqlens_q: torch.Tensor | None, num_splits: int) -> torch.Tensor | None:
        """FA3's ``get_scheduler_metadata`` for ``problem`` and these lengths (int32, FA3's layout), or None where the
        installed FA3 has none (it then schedules inside each call). ``max_seqlen_k`` is the table's capacity, what the
        call derives from a paged table, so the metadata and the call make the same split decision."""
        get = getattr(module, "get_scheduler_metadata", None)
        if get is None:
            return None
        p = problem
        return get(batch_size=p.batch, max_seqlen_q=p.q_len, max_seqlen_k=p.max_blocks * p.page_size,
                   num_heads_q=p.num_heads_q, num_heads_kv=p.num_heads_kv, headdim=p.head_dim_qk - p.head_dim_v,
                   cache_seqlens=cache_seqlens, qkv_dtype=p.q_dtype, headdim_v=p.head_dim_v, cu_seqlens_q=cu_seqlens_q,
                   page_size=p.page_size, causal=p.causal, num_splits=num_splits)

    @staticmethod
    def attention(prov: Provider, module, problem: DecodeProblem, q: torch.Tensor, kv_cache: torch.Tensor,
                  block_table: torch.Tensor, cache_seqlens: torch.Tensor, *, softmax_scale: float,
                  meta: torch.Tensor | None, num_splits: int, cu_seqlens_q: torch.Tensor | None,
                  out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One FA3 call on the canonical tensors (q ``[B, s_q, h_q, 576]``, kv_cache ``[blocks, page, h_kv, 576]``),
        the RoPE and latent parts passed as views. Returns ``(out [B, s_q, h_q, 512], lse [B, h_q, s_q])`` as FA3
        leaves them: ``out`` FA3's own, or the given one where FA3 can write it (the varlen call, a contiguous
        ``out``); ``lse`` a transposed view for the varlen call, with -inf where a row sees no key. ``cu_seqlens_q``
        (the varlen call only): ``[0, s_q, 2 s_q, ..., B s_q]`` int32."""
        p = problem
        dv = p.head_dim_v
        q_rope, q_latent = q[..., dv:], q[..., :dv]
        k_rope, v_latent = kv_cache[..., dv:], kv_cache[..., :dv]
        if prov.call == "kvcache":
            res = module.flash_attn_with_kvcache(
                q_rope, k_rope, v_latent, qv=q_latent, cache_seqlens=cache_seqlens, page_table=block_table,
                softmax_scale=softmax_scale, causal=p.causal, scheduler_metadata=meta, num_splits=num_splits,
                return_softmax_lse=True)
            return res[0], res[1]
        n, h = p.batch * p.q_len, p.num_heads_q
        o = out.view(n, h, dv) if out is not None and out.is_contiguous() else None
        res, lse = module.flash_attn_varlen_func(
            q_rope.reshape(n, h, -1), k_rope, v_latent, max_seqlen_q=p.q_len, cu_seqlens_q=cu_seqlens_q,
            max_seqlen_k=p.max_blocks * p.page_size, seqused_k=cache_seqlens, q_v=q_latent.reshape(n, h, dv),
            softmax_scale=softmax_scale, causal=p.causal, block_table=block_table, return_softmax_lse=True, out=o,
            scheduler_metadata=meta, num_splits=num_splits, fa_version=3)
        return res.view(p.batch, p.q_len, h, dv), lse.view(h, p.batch, p.q_len).transpose(0, 1)

    # -- plan ------------------------------------------------------------------------

    @classmethod
    def plan(cls, problem, platform, block_table, cache_seqlens, *, softmax_scale) -> BackendState:
        prov, module, _ = resolve()
        p = problem
        device = cache_seqlens.device
        n = p.batch * p.q_len
        state = BackendState(
            problem=p, provider=prov, module=module, meta=None,
            num_splits=1 if p.batch_invariant else 0,
            cu_seqlens_q=(torch.arange(0, n + 1, p.q_len, dtype=torch.int32, device=device)
                          if prov.call == "varlen" else None),
            no_key=torch.empty(p.batch, 1, p.q_len, dtype=torch.bool, device=device),
        )
        cls._schedule(state, cache_seqlens)
        return state

    @classmethod
    def _schedule(cls, state: BackendState, cache_seqlens: torch.Tensor) -> None:
        """FA3's scheduler metadata for these lengths (in place once made, so a captured graph reads the new one),
        and the rows that see no key."""
        p = state.problem
        state.no_key.copy_(~visible_rows(cache_seqlens, p.q_len, p.causal)[:, None, :])
        meta = cls.scheduler_metadata(state.module, p, cache_seqlens, cu_seqlens_q=state.cu_seqlens_q,
                                      num_splits=state.num_splits)
        if state.meta is None or meta is None:
            state.meta = meta
        else:
            state.meta.copy_(meta)

    @classmethod
    def update(cls, state: BackendState, block_table, cache_seqlens) -> None:
        cls._schedule(state, cache_seqlens)

    # -- run -----------------------------------------------------------------------------

    @classmethod
    def _call(cls, state, q, kv_cache, block_table, cache_seqlens, softmax_scale, out):
        return cls.attention(state.provider, state.module, state.problem, q, kv_cache, block_table, cache_seqlens,
                             softmax_scale=softmax_scale, meta=state.meta, num_splits=state.num_splits,
                             cu_seqlens_q=state.cu_seqlens_q, out=out)

    @classmethod
    def bind(cls, state, problem, kv_dtype, block_table, cache_seqlens, *, softmax_scale):
        """Eager calls: FA3's call, and the LSE's no-key rows made +inf; its outputs are returned as they are
        (the LSE made contiguous) unless ``out`` / ``lse`` were given."""
        p = problem
        matches = dense_call_matcher(p, kv_dtype)
        call, no_key, inf = cls._call, state.no_key, float("inf")

        def fast(q, kv, kv_scale, out, lse):
            if not matches(q, kv, kv_scale, out, lse):
                return None  # the checked path names what is wrong
            o, l = call(state, q, kv, block_table, cache_seqlens, softmax_scale, out)
            if out is not None:
                if o.data_ptr() != out.data_ptr():
                    out.copy_(o)
                o = out
            l = lse.copy_(l) if lse is not None else l.contiguous()
            return o, l.masked_fill_(no_key, inf)

        return fast

    @classmethod
    def run(cls, state, q, kv_cache, block_table, cache_seqlens, *, problem, softmax_scale, kv_scale, indices,
            out, lse) -> None:
        o, l = cls._call(state, q, kv_cache, block_table, cache_seqlens, softmax_scale, out)
        if o.data_ptr() != out.data_ptr():
            out.copy_(o)
        lse.copy_(l).masked_fill_(state.no_key, float("inf"))
