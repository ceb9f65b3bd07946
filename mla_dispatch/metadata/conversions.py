"""Conversions of the canonical paged layout into what vendor kernels take: token-level (page size 1) indices,
page indptrs, last-page lengths (FlashInfer, AITER), re-paged block tables (FlashMLA, torch_npu)."""

from __future__ import annotations

import torch

__all__ = ["kv_indptr", "kv_last_page_lens", "token_indices", "repage_block_table"]


def kv_indptr(cache_seqlens: torch.Tensor, page_size: int) -> torch.Tensor:
    """int32 ``[batch + 1]`` exclusive prefix sum of pages per request (FlashInfer/AITER ``kv_indptr``)."""
    pages = (cache_seqlens.to(torch.int64) + page_size - 1) // page_size
    return torch.cat([pages.new_zeros(1), torch.cumsum(pages, 0)]).to(torch.int32)


def kv_last_page_lens(cache_seqlens: torch.Tensor, page_size: int) -> torch.Tensor:
    """int32 ``[batch]`` tokens in each request's last page (``page_size`` for a full page, 0 for an empty request)."""
    seqlens = cache_seqlens.to(torch.int64)
    last = seqlens - ((seqlens + page_size - 1) // page_size - 1) * page_size
    return torch.where(seqlens > 0, last, torch.zeros_like(last)).to(torch.int32)


def token_indices(
    block_table: torch.Tensor, cache_seqlens: torch.Tensor, page_size: int, *, max_tokens: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Page-size-1 view of a paged cache: flat token slots of every request.

    Returns ``(indptr, indices)``: int32 ``[batch + 1]`` token offsets and int32
    ``[batch * max_blocks * page_size]`` slot ids ``block_id * page_size + offset``,
    packed request after request (entries past ``indptr[-1]`` are 0). The shape is
    static (no host sync). Table entries past a request's length are never read
    into ``indices``. With ``max_tokens`` the output is truncated/padded to that size.
    """
    batch, max_blocks = block_table.shape
    cap = max_blocks * page_size
    seqlens = cache_seqlens.to(torch.int64).clamp(0, cap)
    pos = torch.arange(cap, device=block_table.device, dtype=torch.int64)
    live = pos[None, :] < seqlens[:, None]
    pages = torch.where(live, block_table.to(torch.int64)[:, pos // page_size], torch.zeros_like(live, dtype=torch.int64))
    slots = pages * page_size + (pos % page_size)[None, :]
    indptr = torch.cat([seqlens.new_zeros(1), torch.cumsum(seqlens, 0)])
    n = max_tokens if max_tokens is not None else batch * cap
    dest = torch.where(live, indptr[:-1, None] + pos[None, :], torch.full_like(slots, n))
    flat = torch.zeros(n + 1, dtype=torch.int64, device=block_table.device)
    flat.scatter_(0, dest.reshape(-1).clamp_max(n), torch.where(live, slots, 0).reshape(-1))
    return indptr.to(torch.int32), flat[:n].to(torch.int32)


def repage_block_table(block_table: torch.Tensor, page_size: int, new_page_size: int) -> torch.Tensor:
    """Block table for viewing the same cache with a smaller page size.

    ``new_page_size`` must divide ``page_size``; the cache tensor is re-viewed as
    ``[num_blocks * (page_size // new_page_size), new_page_size, ...]`` (a pure
    view for a contiguous cache). Entry ``j`` of the new table is sub-page
    ``j % r`` of old page ``j // r``.
    """
    if page_size % new_page_size != 0:
        raise ValueError(f"new_page_size={new_page_size} must divide page_size={page_size}")
    r = page_size // new_page_size
    sub = torch.arange(r, device=block_table.device, dtype=torch.int64)
    table = block_table.to(torch.int64)[:, :, None] * r + sub
    return table.reshape(block_table.shape[0], -1).to(torch.int32)
