"""Engine layouts -> mla_dispatch's canonical call, without the engines.

Pure tensor/metadata translation used by :mod:`mla_dispatch.integrations.vllm`
and :mod:`mla_dispatch.integrations.sglang`. Nothing here imports vLLM or
SGLang, so it is unit-tested on any machine.

Engine contracts implemented (read from the engines' installed sources):

- vLLM 0.33.0 (``vllm/model_executor/layers/attention/mla_attention.py``,
  ``vllm/v1/attention/backend.py``, ``vllm/v1/attention/backends/mla/triton_mla.py``):
  ``MLACommonImpl.forward_mqa(q, kv_c_and_k_pe_cache, attn_metadata,
  layer) -> (o [T, N, kv_lora_rank], lse [T, N] | None)``; ``q`` is a tuple
  ``(ql_nope [T, N, 512], q_pe [T, N, 64])`` or one tensor ``[T, N, 576]``; decode
  tokens come first, ``num_decodes`` requests of equal query length
  (``QueryLenSupport.UNIFORM``); the cache is ``[num_blocks, block_size, 576]``
  (viewed as fp8 for fp8 caches, per-tensor scale ``layer._k_scale``); the LSE is
  natural-log (``lse_base_on_e = True``; DCP merges with ``is_lse_base_on_e``).
- SGLang 0.5.23 (``python/sglang/srt/layers/attention/flashinfer_mla_backend.py`` and
  ``flashmla_backend.py``, ``mem_cache/memory_pool.py``): ``forward_decode(q, k, v, layer,
  forward_batch, save_kv_cache, q_rope=None, k_rope=None) -> [T, H * v_head_dim]``;
  ``q`` is ``[T, H * 512]`` with ``q_rope [T, H * 64]``, or ``[T, H * 576]``; the
  ``MLATokenToKVPool`` buffer is ``[size + page_size, 1, 576]`` addressed by the slots in
  ``req_to_token[req_pool_indices[b], :seq_lens[b]]``; with ``page_size > 1``
  page ``p`` holds slots ``p * page_size ...`` (slots of a page are contiguous).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import torch

from mla_dispatch.dispatch.backend import CGSupport, MLABackend
from mla_dispatch.api import auto_candidates

__all__ = [
    "EngineCapabilities",
    "engine_capabilities",
    "auto_candidates",
    "vllm_kv_format",
    "vllm_kv_cache_dtypes",
    "vllm_decode_query",
    "vllm_kv_cache",
    "vllm_decode_outputs",
    "sglang_kv_format",
    "sglang_block_table",
    "sglang_kv_cache",
    "sglang_decode_query",
    "sglang_decode_output",
    "max_blocks_for",
]

# --------------------------------------------------------------------------------------
# What the engine may be told we support (from our registry)
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class EngineCapabilities:
    """The union of what a set of backends can run: what an engine may configure.

    ``page_sizes`` is None when some backend takes any page size.
    """

    page_sizes: tuple[int, ...] | None
    q_dtypes: tuple[torch.dtype, ...]
    kv_formats: tuple[str, ...]
    cuda_graph: bool
    backends: tuple[str, ...]


#: platform kinds whose engines capture device graphs (vLLM's AttentionCGSupport, SGLang's CUDA-graph runner)
_GRAPH_PLATFORMS = frozenset({"cuda", "rocm"})


def engine_capabilities(backends: Iterable[type[MLABackend]], platform_kind: str) -> EngineCapabilities:
    """Fold backend capability constants into what an engine may be told.

    Only backends that are implemented, import cleanly and run on
    ``platform_kind`` count. ``cuda_graph`` is True only on a GPU platform
    (``"cuda"``, ``"rocm"``), where the engines capture CUDA/HIP graphs, and only
    when some counted backend can be captured; on a CPU (or an NPU) nothing is.
    """
    page_sizes: set[int] | None = set()
    q_dtypes: set[torch.dtype] = set()
    kv_formats: set[str] = set()
    cuda_graph = False
    names = []
    for cls in backends:
        if not cls.IMPLEMENTED or cls.availability_reasons() or platform_kind not in cls.PLATFORMS:
            continue
        names.append(cls.NAME)
        if cls.PAGE_SIZES is None:
            page_sizes = None
        elif page_sizes is not None:
            page_sizes |= set(cls.PAGE_SIZES)
        q_dtypes |= set(cls.Q_DTYPES)
        kv_formats |= set(cls.KV_FORMATS)
        cuda_graph = cuda_graph or (platform_kind in _GRAPH_PLATFORMS and cls.CUDA_GRAPH is CGSupport.ALWAYS)
    order = {torch.bfloat16: 0, torch.float16: 1}
    return EngineCapabilities(
        page_sizes=None if page_sizes is None else tuple(sorted(page_sizes)),
        q_dtypes=tuple(sorted(q_dtypes, key=lambda d: order.get(d, 9))),
        kv_formats=tuple(sorted(kv_formats)),
        cuda_graph=cuda_graph,
        backends=tuple(names),
    )


# --------------------------------------------------------------------------------------
# vLLM
# --------------------------------------------------------------------------------------

_VLLM_FORMATS = {"auto": "auto", "bfloat16": "bf16", "float16": "fp16", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3"}


def vllm_kv_format(kv_cache_dtype: str) -> str:
    """vLLM's ``cache_dtype`` string -> our ``kv_format``.

    Raises
    ------
    ValueError
        For cache dtypes the dense MLA path cannot read (``fp8_e5m2``,
        ``fp8_ds_mla`` — the latter is vLLM's sparse-only layout).
    """
    try:
        return _VLLM_FORMATS[kv_cache_dtype]
    except KeyError:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} (supported: {', '.join(sorted(_VLLM_FORMATS))})"
        ) from None


def vllm_kv_cache_dtypes(caps: EngineCapabilities) -> list[str]:
    """vLLM ``CacheDType`` strings our backends can read, for ``supported_kv_cache_dtypes``."""
    out = ["auto"]
    if "bf16" in caps.kv_formats:
        out.append("bfloat16")
    if "fp16" in caps.kv_formats:
        out.append("float16")
    if "fp8_e4m3" in caps.kv_formats:
        out += ["fp8", "fp8_e4m3"]
    return out


def vllm_decode_query(q: torch.Tensor | tuple[torch.Tensor, torch.Tensor], num_decodes: int) -> torch.Tensor:
    """``forward_mqa``'s q -> canonical ``[B, s_q, N, D]``.

    ``q`` is ``(ql_nope [T, N, L], q_pe [T, N, R])`` or ``[T, N, L + R]``, its
    ``T = num_decodes * s_q`` tokens grouped by request (vLLM's uniform decode).

    Raises
    ------
    ValueError
        ``T`` is not a multiple of ``num_decodes`` (non-uniform query lengths).
    """
    if isinstance(q, (tuple, list)):
        q = torch.cat(q, dim=-1)
    if q.dim() != 3:
        raise ValueError(f"q must be [num_tokens, num_heads, head_dim], got shape {list(q.shape)}")
    tokens = q.shape[0]
    if num_decodes < 1 or tokens % num_decodes != 0:
        raise ValueError(
            f"{tokens} decode tokens do not split evenly over {num_decodes} requests (mla_dispatch needs uniform "
            "query lengths: vLLM's QueryLenSupport.UNIFORM)"
        )
    if q.stride(-1) != 1:
        q = q.contiguous()
    return q.reshape(num_decodes, tokens // num_decodes, q.shape[1], q.shape[2])


def vllm_kv_cache(kv_c_and_k_pe_cache: torch.Tensor) -> torch.Tensor:
    """vLLM's ``[num_blocks, block_size, 576]`` cache -> ``[num_blocks, block_size, 1, 576]`` (a view)."""
    if kv_c_and_k_pe_cache.dim() != 3:
        raise ValueError(f"the MLA cache must be [num_blocks, block_size, head_size], got {list(kv_c_and_k_pe_cache.shape)}")
    return kv_c_and_k_pe_cache.unsqueeze(2)


def vllm_decode_outputs(out: torch.Tensor, lse: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Canonical ``out [B, s_q, N, Dv]``, ``lse [B, N, s_q]`` -> vLLM's ``o [T, N, Dv]``, ``lse [T, N]``.

    Rows that saw no key carry ``lse = -inf`` here (the log of an empty sum),
    not FlashMLA's ``+inf``: vLLM merges decode-context-parallel partials by
    LSE, and a rank holding none of a request's tokens must weigh zero.
    """
    b, s_q, n, dv = out.shape
    o = out.reshape(b * s_q, n, dv)
    if lse is None:
        return o, None
    lse = lse.transpose(1, 2).reshape(b * s_q, n)
    return o, torch.where(torch.isposinf(lse), torch.full_like(lse, float("-inf")), lse)


# --------------------------------------------------------------------------------------
# SGLang
# --------------------------------------------------------------------------------------


def sglang_kv_format(kv_dtype: torch.dtype, q_dtype: torch.dtype) -> str:
    """The token pool's dtype -> our ``kv_format``.

    Raises
    ------
    ValueError
        A pool dtype the dense path cannot read (e.g. ``float8_e5m2``).
    """
    if kv_dtype == q_dtype and kv_dtype in (torch.bfloat16, torch.float16):
        return "bf16" if kv_dtype == torch.bfloat16 else "fp16"
    if kv_dtype == torch.float8_e4m3fn:
        return "fp8_e4m3"
    raise ValueError(f"KV pool dtype {kv_dtype} with q dtype {q_dtype} (supported: q's dtype, float8_e4m3fn)")


def sglang_block_table(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    max_blocks: int,
) -> torch.Tensor:
    """Block table ``int32 [B, max_blocks]`` from SGLang's request-to-token map.

    Entry ``j`` of request ``b`` is the page holding its tokens
    ``j * page_size ...``: ``req_to_token[req, j * page_size] // page_size``
    (the slot itself when ``page_size == 1``). Entries past
    ``ceil(seq_lens[b] / page_size)`` are 0 and are never read. Device ops only,
    no host sync; the width is the caller's ``max_blocks``.
    """
    if page_size < 1 or max_blocks < 1:
        raise ValueError(f"page_size and max_blocks must be >= 1, got {page_size}, {max_blocks}")
    device = req_to_token.device
    cols = torch.arange(max_blocks, device=device, dtype=torch.int64) * page_size
    rows = req_to_token[req_pool_indices.to(torch.int64)]  # [B, max_context_len]
    first_slot = rows[:, cols.clamp_max(rows.shape[1] - 1)].to(torch.int64)
    pages = (seq_lens.to(torch.int64) + page_size - 1) // page_size
    live = torch.arange(max_blocks, device=device)[None, :] < pages[:, None]
    return torch.where(live, first_slot // page_size, torch.zeros_like(first_slot)).to(torch.int32)


def sglang_kv_cache(kv_buffer: torch.Tensor, page_size: int) -> torch.Tensor:
    """The token pool's ``[slots, 1, D]`` (or ``[slots, D]``) buffer as ``[pages, page_size, 1, D]`` (a view).

    A trailing partial page (if the pool size is not a multiple of
    ``page_size``) is left out: SGLang never hands out its slots as a page.
    """
    if kv_buffer.dim() == 2:
        kv_buffer = kv_buffer.unsqueeze(1)
    if kv_buffer.dim() != 3 or kv_buffer.shape[1] != 1:
        raise ValueError(f"the MLA token pool buffer must be [slots, 1, head_dim], got {list(kv_buffer.shape)}")
    pages = kv_buffer.shape[0] // page_size
    return kv_buffer[: pages * page_size].view(pages, page_size, 1, kv_buffer.shape[-1])


def sglang_decode_query(q: torch.Tensor, q_rope: torch.Tensor | None, batch: int, num_heads: int,
                        head_dim: int) -> torch.Tensor:
    """``forward_decode``'s q (and q_rope) -> canonical ``[B, s_q, H, head_dim]``."""
    if q_rope is not None:
        q = torch.cat([q.reshape(q.shape[0], num_heads, -1), q_rope.reshape(q_rope.shape[0], num_heads, -1)], dim=-1)
    q = q.reshape(-1, num_heads, head_dim)
    if q.shape[-1] != head_dim:
        raise ValueError(f"q has head dim {q.shape[-1]}, the layer says {head_dim}")
    tokens = q.shape[0]
    if batch < 1 or tokens % batch != 0:
        raise ValueError(f"{tokens} decode tokens do not split evenly over {batch} requests")
    if q.stride(-1) != 1:
        q = q.contiguous()
    return q.reshape(batch, tokens // batch, num_heads, head_dim)


def sglang_decode_output(out: torch.Tensor) -> torch.Tensor:
    """Canonical ``[B, s_q, H, Dv]`` -> SGLang's ``[T, H * Dv]``."""
    b, s_q, h, dv = out.shape
    return out.reshape(b * s_q, h * dv)


def max_blocks_for(context_len: int, page_size: int) -> int:
    """Block-table width that covers ``context_len`` tokens."""
    return max(1, -(-int(context_len) // page_size))
