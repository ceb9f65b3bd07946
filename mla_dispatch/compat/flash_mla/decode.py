"""FlashMLA's decode calls: ``get_mla_metadata`` (both conventions) and ``flash_mla_with_kvcache``."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple

import torch

from mla_dispatch.api import DecodePlan, plan_decode
from mla_dispatch.kvcache.formats import DS_MLA_TOKEN_BYTES
from mla_dispatch.metadata.schedule import ITEM_BEGIN, ITEM_END, ITEM_REQ, default_num_parts, split_kv_schedule
from mla_dispatch.dispatch.platform import platform_for

__all__ = [
    "FlashMLASchedMeta",
    "FlashMLAArgumentError",
    "get_mla_metadata",
    "get_mla_metadata_legacy",
    "flash_mla_with_kvcache",
]

#: FlashMLA's ``TileSchedulerMetaDataSize`` (csrc/params.h ``DecodingSchedMeta``: 8 ints)
TILE_SCHEDULER_METADATA_SIZE = 8
# FlashMLA's scheduler parameters: 64-token blocks, 5 blocks of fixed cost per request.
_BLOCK_N = 64
_FIXED_OVERHEAD_BLOCKS = 5


class FlashMLAArgumentError(ValueError, AssertionError):
    """An argument FlashMLA would reject with ``assert``; also a ``ValueError``."""


@dataclasses.dataclass
class FlashMLASchedMeta:
    """Per-step scheduling state, filled by the first :func:`flash_mla_with_kvcache` call.

    Field names follow FlashMLA's class of the same name. ``plan`` is the
    :class:`~mla_dispatch.DecodePlan` the first call made (``plan.backend`` says
    which backend runs); ``backend`` (mla_dispatch extension) names the backend to
    plan with, ``"auto"`` by default.
    """

    @dataclasses.dataclass
    class Config:
        b: int
        s_q: int
        h_q: int
        page_block_size: int
        h_k: int
        causal: bool
        is_fp8_kvcache: bool
        topk: Optional[int]
        extra_page_block_size: Optional[int]
        extra_topk: Optional[int]

    have_initialized: bool = False
    config: Optional[Config] = None
    tile_scheduler_metadata: Optional[torch.Tensor] = None
    num_splits: Optional[torch.Tensor] = None
    plan: Optional[DecodePlan] = None
    extra_plan: Optional[DecodePlan] = None
    backend: str = "auto"


# --------------------------------------------------------------------------------------
# Metadata
# --------------------------------------------------------------------------------------


def get_mla_metadata(*args, **kwargs) -> Tuple[FlashMLASchedMeta, None]:
    """An empty :class:`FlashMLASchedMeta` (FlashMLA's current convention).

    All arguments are accepted and ignored, as in FlashMLA, so callers written
    for the old signature keep working when they only pass the first element on.
    The plan is made by the first :func:`flash_mla_with_kvcache` call.

    Returns
    -------
    (FlashMLASchedMeta, None)
    """
    return FlashMLASchedMeta(), None


def get_mla_metadata_legacy(
    cache_seqlens: torch.Tensor,
    num_q_tokens_per_head_k: int,
    num_heads_k: int,
    num_heads_q: Optional[int] = None,
    is_fp8_kvcache: bool = False,
    topk: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's old ``get_mla_metadata``: scheduling tensors for one decode step.

    Parameters
    ----------
    cache_seqlens : Tensor
        int32 ``[b]``.
    num_q_tokens_per_head_k : int
        ``s_q * h_q // h_k``.
    num_heads_k : int
    num_heads_q, is_fp8_kvcache
        Accepted for compatibility.
    topk : int, optional
        Sparse attention: every request is scheduled as ``topk`` tokens.

    Returns
    -------
    tile_scheduler_metadata : Tensor
        int32 ``[num_sm_parts, 8]``, FlashMLA's ``DecodingSchedMeta`` layout:
        ``(begin_req, begin_token, end_req, end_token, begin_split, 0, 0, 0)`` —
        the requests and token ranges each persistent CTA works on.
    num_splits : Tensor
        int32 ``[b + 1]``: exclusive prefix sum of the number of pieces each
        request is split into.

    Raises
    ------
    FlashMLAArgumentError
        ``cache_seqlens`` is not a 1-D int32 tensor or a count is < 1.
    """
    if not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.dim() != 1 or cache_seqlens.dtype != torch.int32:
        got = f"{list(cache_seqlens.shape)} {cache_seqlens.dtype}" if isinstance(cache_seqlens, torch.Tensor) else type(cache_seqlens).__name__
        raise FlashMLAArgumentError(f"cache_seqlens must be a 1-D int32 tensor, got {got}")
    if num_q_tokens_per_head_k < 1 or num_heads_k < 1:
        raise FlashMLAArgumentError(
            f"num_q_tokens_per_head_k and num_heads_k must be >= 1, got {num_q_tokens_per_head_k}, {num_heads_k}"
        )
    seqlens = cache_seqlens if topk is None else torch.full_like(cache_seqlens, int(topk))
    platform = platform_for(cache_seqlens.device)
    num_parts = default_num_parts(platform.num_compute_units, num_heads_k, num_q_tokens_per_head_k)
    sched = split_kv_schedule(seqlens, num_parts=num_parts, chunk_size=_BLOCK_N, overhead=_FIXED_OVERHEAD_BLOCKS)
    return _flashmla_layout(sched)


def _flashmla_layout(sched) -> Tuple[torch.Tensor, torch.Tensor]:
    """Our split-KV schedule written in FlashMLA's two metadata tensors (device ops only)."""
    items = sched.items.to(torch.int64)
    offsets = sched.part_offsets.to(torch.int64)
    first, last = offsets[:-1], offsets[1:] - 1
    empty = last < first
    first_c = first.clamp(0, items.shape[0] - 1)
    last_c = last.clamp(0, items.shape[0] - 1)
    req = items[:, ITEM_REQ].clamp_min(0)
    item_idx = torch.arange(items.shape[0], device=items.device)
    splits = sched.num_splits.to(torch.int64)
    first_item_of_req = torch.cumsum(splits, 0) - splits
    rank_in_req = item_idx - first_item_of_req[req] if splits.numel() else item_idx
    meta = torch.zeros(sched.num_parts, TILE_SCHEDULER_METADATA_SIZE, dtype=torch.int64, device=items.device)
    meta[:, 0] = items[first_c, ITEM_REQ]
    meta[:, 1] = items[first_c, ITEM_BEGIN]
    meta[:, 2] = items[last_c, ITEM_REQ]
    meta[:, 3] = items[last_c, ITEM_END]
    meta[:, 4] = rank_in_req[first_c]
    meta = torch.where(empty[:, None], torch.zeros_like(meta), meta)
    num_splits = torch.cat([splits.new_zeros(1), torch.cumsum(splits, 0)])
    return meta.to(torch.int32), num_splits.to(torch.int32)


# --------------------------------------------------------------------------------------
# The decode call
# --------------------------------------------------------------------------------------


def _cache_and_format(k_cache: torch.Tensor, q: torch.Tensor, is_fp8_kvcache: bool, name: str):
    """FlashMLA's cache argument -> (tensor for mla_dispatch, kv_format)."""
    if not is_fp8_kvcache:
        if k_cache.dtype != q.dtype:
            raise FlashMLAArgumentError(
                f"{name}.dtype must equal q.dtype ({q.dtype}) when is_fp8_kvcache=False, got {k_cache.dtype}"
            )
        return k_cache, "auto"
    if k_cache.shape[-1] != DS_MLA_TOKEN_BYTES:
        raise FlashMLAArgumentError(
            f"is_fp8_kvcache=True expects DeepSeek's {DS_MLA_TOKEN_BYTES}-byte token format, so {name}.shape[-1] "
            f"must be {DS_MLA_TOKEN_BYTES}, got {k_cache.shape[-1]} (per-tensor-scale fp8 caches have no scale "
            "argument in FlashMLA's API: call mla_dispatch.mla_decode with kv_format='fp8_e4m3', kv_scale=...)"
        )
    if k_cache.dtype not in (torch.uint8, torch.int8):
        if k_cache.element_size() != 1:
            raise FlashMLAArgumentError(f"{name} must hold 1-byte elements for is_fp8_kvcache=True, got {k_cache.dtype}")
        k_cache = k_cache.view(torch.uint8)
    return k_cache, "fp8_ds_mla"


def _limit_topk(indices: Optional[torch.Tensor], topk_length: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Only the leftmost ``topk_length[b]`` indices of request b are used (others become -1)."""
    if indices is None or topk_length is None:
        return indices
    keep = torch.arange(indices.shape[-1], device=indices.device)[None, None, :] < topk_length.to(indices.device)[:, None, None]
    return torch.where(keep, indices, torch.full_like(indices, -1))


def _config_of(q, k_cache, causal, is_fp8_kvcache, topk, extra_k_cache, extra_topk) -> FlashMLASchedMeta.Config:
    return FlashMLASchedMeta.Config(
        q.shape[0], q.shape[1], q.shape[2], k_cache.shape[1], k_cache.shape[2] if k_cache.dim() == 4 else 1,
        bool(causal), bool(is_fp8_kvcache), topk,
        None if extra_k_cache is None else extra_k_cache.shape[1], extra_topk,
    )


def _check_same_config(have: FlashMLASchedMeta.Config, want: FlashMLASchedMeta.Config) -> None:
    for field in dataclasses.fields(have):
        a, b = getattr(have, field.name), getattr(want, field.name)
        if a != b:
            raise FlashMLAArgumentError(
                f"tile_scheduler_metadata was initialised for {field.name}={a!r}, this call has {field.name}={b!r}: "
                "a FlashMLASchedMeta may be reused only while shapes and cache_seqlens/topk_length values stay the "
                "same (make a new one with get_mla_metadata() for each decode step)"
            )


def _merge(out1, lse1, out2, lse2):
    """LSE-weighted merge of two attention results over disjoint key sets (lse +inf = no key)."""
    l1 = torch.where(torch.isposinf(lse1), torch.full_like(lse1, -math.inf), lse1)
    l2 = torch.where(torch.isposinf(lse2), torch.full_like(lse2, -math.inf), lse2)
    lse = torch.logaddexp(l1, l2)
    empty = torch.isneginf(lse)
    safe = torch.where(empty, torch.zeros_like(lse), lse)
    w1 = torch.exp(l1 - safe).transpose(1, 2)[..., None]  # [b, s_q, h_q, 1]
    w2 = torch.exp(l2 - safe).transpose(1, 2)[..., None]
    out = (out1.float() * w1 + out2.float() * w2).to(out1.dtype)
    return out, torch.where(empty, torch.full_like(lse, math.inf), lse)


def _apply_sink(out: torch.Tensor, lse: torch.Tensor, attn_sink: torch.Tensor) -> torch.Tensor:
    """out * exp(lse) / (exp(lse) + exp(sink)); a +inf sink (or no key at all) gives 0."""
    factor = torch.sigmoid(lse - attn_sink.float()[None, :, None]).nan_to_num(nan=0.0)  # [b, h_q, s_q]
    return (out.float() * factor.transpose(1, 2)[..., None]).to(out.dtype)


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: Optional[torch.Tensor],
    cache_seqlens: Optional[torch.Tensor],
    head_dim_v: int,
    tile_scheduler_metadata,
    num_splits=None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    is_fp8_kvcache: bool = False,
    indices: Optional[torch.Tensor] = None,
    attn_sink: Optional[torch.Tensor] = None,
    extra_k_cache: Optional[torch.Tensor] = None,
    extra_indices_in_kvcache: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
    extra_topk_length: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's decode call (see the module docstring for both conventions).

    Parameters
    ----------
    q : Tensor
        ``[b, s_q, h_q, d]`` bf16/fp16.
    k_cache : Tensor
        ``[num_blocks, page_block_size, h_k, d]`` in q's dtype, or with
        ``is_fp8_kvcache=True`` the 656-byte DeepSeek format ``[..., 656]``.
    block_table, cache_seqlens : Tensor or None
        int32 ``[b, max_blocks]`` and ``[b]``; may be None with ``indices``.
    head_dim_v : int
    tile_scheduler_metadata : FlashMLASchedMeta or Tensor
        From :func:`get_mla_metadata` (current) or :func:`get_mla_metadata_legacy` (old).
    num_splits : None or Tensor
        None with a ``FlashMLASchedMeta``; the old convention's tensor otherwise.
    softmax_scale : float, optional
        Default ``d ** -0.5``.
    causal : bool
    is_fp8_kvcache : bool
    indices : Tensor, optional
        int32 ``[b, s_q, topk]`` sparse token ids ``block * page_block_size + offset``, -1 = skip.
    attn_sink : Tensor, optional
        fp32 ``[h_q]``: the output is scaled by ``exp(lse) / (exp(lse) + exp(sink))``; lse unchanged.
    extra_k_cache, extra_indices_in_kvcache : Tensor, optional
        A second sparse cache attended to together with the first.
    topk_length, extra_topk_length : Tensor, optional
        int32 ``[b]``: only the leftmost that many indices are used.

    Returns
    -------
    out : Tensor
        ``[b, s_q, h_q, head_dim_v]`` in q's dtype.
    softmax_lse : Tensor
        fp32 ``[b, h_q, s_q]``.

    Raises
    ------
    FlashMLAArgumentError
        Where FlashMLA asserts (wrong metadata type, mismatch with a reused
        ``FlashMLASchedMeta``, sparse with causal, ...).
    ValueError, NoBackendError
        From :func:`mla_dispatch.plan_decode` / :meth:`~mla_dispatch.DecodePlan.run`.
    """
    sparse = indices is not None
    current = isinstance(tile_scheduler_metadata, FlashMLASchedMeta)
    if current:
        if num_splits is not None:
            raise FlashMLAArgumentError("num_splits must be None when tile_scheduler_metadata is a FlashMLASchedMeta")
    elif not isinstance(tile_scheduler_metadata, torch.Tensor):
        raise FlashMLAArgumentError(
            "tile_scheduler_metadata must be a FlashMLASchedMeta from get_mla_metadata() (or, old convention, the "
            f"tensor from get_mla_metadata_legacy()), got {type(tile_scheduler_metadata).__name__}"
        )
    if sparse:
        if causal:
            raise FlashMLAArgumentError("causal must be False when sparse attention is enabled (indices given)")
        if not is_fp8_kvcache:
            raise FlashMLAArgumentError("is_fp8_kvcache must be True when sparse attention is enabled (FlashMLA's contract)")
    else:
        if any(t is not None for t in (attn_sink, extra_k_cache, extra_indices_in_kvcache, topk_length, extra_topk_length)):
            raise FlashMLAArgumentError(
                "attn_sink, extra_k_cache, extra_indices_in_kvcache, topk_length and extra_topk_length must be None "
                "when dense attention is used"
            )
        if block_table is None or cache_seqlens is None:
            raise FlashMLAArgumentError("block_table and cache_seqlens must be provided when dense attention is used")
    if (extra_k_cache is None) != (extra_indices_in_kvcache is None):
        raise FlashMLAArgumentError("extra_k_cache and extra_indices_in_kvcache must be given together")

    kv, kv_format = _cache_and_format(k_cache, q, is_fp8_kvcache, "k_cache")
    idx = _limit_topk(indices, topk_length)
    extra_kv = extra_idx = None
    if extra_k_cache is not None:
        extra_kv, _ = _cache_and_format(extra_k_cache, q, is_fp8_kvcache, "extra_k_cache")
        extra_idx = _limit_topk(extra_indices_in_kvcache, extra_topk_length)
    topk = None if indices is None else indices.shape[-1]
    extra_topk = None if extra_indices_in_kvcache is None else extra_indices_in_kvcache.shape[-1]

    def make_plans(backend: str):
        common = dict(head_dim_v=head_dim_v, softmax_scale=softmax_scale, causal=causal and not sparse,
                      kv_format=kv_format, backend=backend)
        main = plan_decode(q, kv, None if sparse else block_table, None if sparse else cache_seqlens,
                           indices=idx, **common)
        extra = None
        if extra_kv is not None:
            extra = plan_decode(q, extra_kv, None, None, indices=extra_idx, **common)
        return main, extra

    if current:
        meta = tile_scheduler_metadata
        config = _config_of(q, k_cache, causal, is_fp8_kvcache, topk, extra_k_cache, extra_topk)
        if not meta.have_initialized:
            meta.plan, meta.extra_plan = make_plans(meta.backend)
            meta.config = config
            meta.have_initialized = True
        else:
            _check_same_config(meta.config, config)
        plan, extra_plan = meta.plan, meta.extra_plan
    else:
        plan, extra_plan = make_plans("auto")

    out, lse = plan.run(q, kv, indices=idx)
    if extra_plan is not None:
        out2, lse2 = extra_plan.run(q, extra_kv, indices=extra_idx)
        out, lse = _merge(out, lse, out2, lse2)
    if attn_sink is not None:
        out = _apply_sink(out, lse, attn_sink)
    return out, lse
