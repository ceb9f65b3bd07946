"""FlashMLA's scheduling metadata: :class:`FlashMLASchedMeta` and the ``get_mla_*metadata`` functions.

Three generations of the same idea (see the package docstring for the sources):

- FlashMLA's current ``get_mla_metadata(*args, **kwargs) -> (FlashMLASchedMeta(), None)``, an empty object that
  the first decode call fills (vLLM 0.33.0's bundled copy and sgl-flash-mla 1.0.0 have the same function);
- FlashMLA's old ``get_mla_metadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, ...)`` returning two
  int32 tensors: :func:`get_mla_metadata_legacy`;
- sgl-flash-mla's ``get_mla_decoding_metadata(..., use_legacy=False)``, the old function with a kernel-family
  switch, whose tensors callers assign onto a ``FlashMLASchedMeta``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch

from mla_dispatch.api import DecodePlan
from mla_dispatch.compat.flash_mla.errors import FlashMLAArgumentError
from mla_dispatch.dispatch.platform import platform_for
from mla_dispatch.metadata.schedule import ITEM_BEGIN, ITEM_END, ITEM_REQ, default_num_parts, split_kv_schedule

__all__ = [
    "TILE_SCHEDULER_METADATA_SIZE",
    "FlashMLASchedMeta",
    "get_mla_metadata",
    "get_mla_metadata_legacy",
    "get_mla_decoding_metadata",
    "has_legacy",
]

#: FlashMLA's ``TileSchedulerMetaDataSize`` (csrc/params.h ``DecodingSchedMeta``: 8 ints)
TILE_SCHEDULER_METADATA_SIZE = 8
# FlashMLA's scheduler parameters: 64-token blocks, 5 blocks of fixed cost per request.
_BLOCK_N = 64
_FIXED_OVERHEAD_BLOCKS = 5


@dataclasses.dataclass
class FlashMLASchedMeta:
    """Per-step scheduling state, filled by the first :func:`flash_mla_with_kvcache` call.

    Field names follow FlashMLA's class of the same name (``Config.enable_batch_invariant`` as in vLLM 0.33.0's
    and sgl-flash-mla 1.0.0's). ``plan`` is the :class:`~mla_dispatch.DecodePlan` the first call made
    (``plan.backend`` says which backend runs); ``backend`` (mla_dispatch extension) names the backend to plan
    with, ``"auto"`` by default. ``tile_scheduler_metadata`` / ``num_splits`` may be assigned by the caller
    (sgl-flash-mla's :func:`get_mla_decoding_metadata` convention); the decode call plans from ``cache_seqlens``
    whatever they hold.

    Reuse follows FlashMLA's contract: while the shapes (``config``) and the values of ``cache_seqlens`` /
    ``topk_length`` stay the same, every other argument is read on each call. ``block_table`` (another tensor, or
    the same one with another shape or strides), ``softmax_scale``, ``head_dim_v`` and the dtypes a plan is made
    for are compared with the previous call's (``per_call_key``, host-side, no device sync) and the plan is made
    again when they differ; the cache, ``indices``, ``attn_sink`` and ``out`` go to each run as given. A change of
    the *values* of the same block-table tensor, made in place, is read as a :class:`~mla_dispatch.DecodePlan`
    reads its table (docs/design.md §2). A shape change raises :class:`FlashMLAArgumentError` with FlashMLA's
    message.
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
        enable_batch_invariant: bool = False

    have_initialized: bool = False
    config: Optional[Config] = None
    tile_scheduler_metadata: Optional[torch.Tensor] = None
    num_splits: Optional[torch.Tensor] = None
    plan: Optional[DecodePlan] = None
    extra_plan: Optional[DecodePlan] = None
    backend: str = "auto"
    per_call_key: Optional[tuple] = None


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
        int32 ``[b]``; ``b`` may be 0 (then every part is empty and ``num_splits`` is ``[0]``).
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
        ``cache_seqlens`` is not a 1-D int32 tensor or a count is < 1 (the message names it).
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
    if cache_seqlens.shape[0] == 0:  # no request: every part is empty (all-zero rows), no split
        device = cache_seqlens.device
        return (torch.zeros(num_parts, TILE_SCHEDULER_METADATA_SIZE, dtype=torch.int32, device=device),
                torch.zeros(1, dtype=torch.int32, device=device))
    sched = split_kv_schedule(seqlens, num_parts=num_parts, chunk_size=_BLOCK_N, overhead=_FIXED_OVERHEAD_BLOCKS)
    return _flashmla_layout(sched)


def get_mla_decoding_metadata(
    seqlens_k: torch.Tensor,
    num_q_tokens_per_head_k: int,
    h_k: int,
    h_q: Optional[int] = None,
    is_fp8_kvcache: bool = False,
    topk: Optional[int] = None,
    use_legacy: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """sgl-flash-mla 1.0.0's ``get_mla_decoding_metadata``: the split-KV schedule, hoisted out of the decode call.

    The tensors of :func:`get_mla_metadata_legacy` (same layout, same schedule for every ``use_legacy``). As in
    sgl-flash-mla, callers assign them onto a :class:`FlashMLASchedMeta`; here :func:`flash_mla_with_kvcache`
    plans from ``cache_seqlens`` itself, so they describe the schedule rather than drive it.

    Parameters
    ----------
    seqlens_k : Tensor
        int32 ``[b]``.
    num_q_tokens_per_head_k : int
        ``s_q * h_q // h_k``.
    h_k : int
    h_q : int, optional
        Accepted for compatibility.
    is_fp8_kvcache : bool
        With ``topk=None`` (dense fp8 decoding, a scheduler of its own in sgl-flash-mla), ``use_legacy`` must be
        True, as there.
    topk : int, optional
        Sparse attention: every request is scheduled as ``topk`` tokens.
    use_legacy : bool
        Which of sgl-flash-mla's kernel families the schedule is for: ``True`` the frozen one (SM90, dense
        decoding, DeepSeek-V3.2 / V4 caches), ``False`` the current one (upstream's newest kernels).

    Returns
    -------
    tile_scheduler_metadata : Tensor
        int32 ``[num_sm_parts, 8]``.
    num_splits : Tensor
        int32 ``[b + 1]``.

    Raises
    ------
    FlashMLAArgumentError
        Dense fp8 (``is_fp8_kvcache=True``, ``topk=None``) without ``use_legacy=True``; the arguments
        :func:`get_mla_metadata_legacy` rejects.
    """
    if is_fp8_kvcache and topk is None and not use_legacy:
        raise FlashMLAArgumentError(
            "use_legacy must be True for dense fp8 decoding metadata (is_fp8_kvcache=True, topk=None): in "
            "sgl-flash-mla dense fp8 decoding exists only on the legacy side"
        )
    return get_mla_metadata_legacy(seqlens_k, num_q_tokens_per_head_k, h_k, h_q, is_fp8_kvcache, topk)


def has_legacy() -> bool:
    """sgl-flash-mla's ``has_legacy()``: whether ``use_legacy=True`` calls can run. Always True here: dense
    decoding and the DeepSeek-V3.2 cache, what sgl-flash-mla keeps on its legacy side, run on mla_dispatch's
    backends."""
    return True


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
