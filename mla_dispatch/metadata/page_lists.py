"""A block table's packed page lists, the CSR form FlashInfer's MLA wrapper plans with, kept in place per plan.

Request ``b``'s pages are the first ``ceil(L_b / page_size)`` entries of its table row; packed request after request
they are ``indices[indptr[b]:indptr[b + 1]]``, and ``page_pos`` holds where each sits in the flattened table
(``b * max_blocks + j``), so a run can gather the table's current values with one ``index_select``
(docs/design.md §2: every run reads the block table). Entries past ``indptr[-1]`` are 0, a valid page id (a run's
gather leaves the table's first entry in ``indices`` there; neither is read). The shapes
are static (``[batch + 1]`` and ``[batch * max_blocks]``): no host synchronisation.

:class:`PageLists` owns the three int32 buffers of one plan and refreshes them in place for new lengths and a new
table: on a CUDA device with Triton, one launch of a Triton kernel (``packed_pages_kernel``) through a kept
:class:`~.triton_launch.CachedLaunch` (the same outputs as the torch ops, bit for bit; the FlashInfer adapter's plan
took ~30 torch ops for them, 62 launches a plan on the H200 with its replan: benchmarks/RESULTS.md, "NVIDIA H200,
2026-11-29 (afternoon)"); elsewhere (a CPU, no Triton, batches past :data:`MAX_BATCH`) the torch ops of
:func:`.conversions.token_indices`.
"""

from __future__ import annotations

import torch

from mla_dispatch.metadata.conversions import token_indices

__all__ = ["PageLists", "MAX_BATCH", "packed_page_lists"]

#: the largest batch the one-launch kernel takes (every program sums the pages of the requests before its own from one
#: block of all the lengths)
MAX_BATCH = 16384


def packed_page_lists(block_table: torch.Tensor, cache_seqlens: torch.Tensor, page_size: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(indptr, page_pos, indices)`` of ``block_table`` (int32 ``[B, max_blocks]``) for ``cache_seqlens`` (int
    ``[B]``) in torch ops: int32 ``[B + 1]``, ``[B * max_blocks]``, ``[B * max_blocks]`` (module docstring)."""
    batch, max_blocks = block_table.shape
    pages = (cache_seqlens.to(torch.int64) + page_size - 1) // page_size
    positions = torch.arange(batch * max_blocks, dtype=torch.int32, device=block_table.device).view(batch, max_blocks)
    indptr, page_pos = token_indices(positions, pages, 1)
    indices = torch.index_select(block_table.reshape(-1), 0, page_pos.long())  # the padding gathers entry 0: zero it
    past = torch.arange(indices.numel(), device=indices.device) >= indptr[-1]
    return indptr, page_pos, indices.masked_fill(past, 0).to(torch.int32)


def _kernel():
    """The Triton kernel, defined on first use (Triton is optional: the torch path needs none)."""
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl

    @triton.jit
    def packed_pages_kernel(Table, SeqLens, Indptr, PagePos, Indices, batch, max_blocks, page_size, stride_tb,
                            stride_seq, BLOCK_B: tl.constexpr, BLOCK_J: tl.constexpr):
        """Program ``b`` (one per request): its first packed position is the pages of the requests before it, summed
        from all the lengths (the lengths of [0, capacity]); it writes its table entries and their positions there,
        and zeroes its own stretch of the outputs where that lies past the total (two disjoint sets of positions)."""
        b = tl.program_id(0)
        cap = max_blocks * page_size
        offs = tl.arange(0, BLOCK_B)
        lens = tl.load(SeqLens + offs * stride_seq, mask=offs < batch, other=0)
        pages = (tl.minimum(tl.maximum(lens, 0), cap) + page_size - 1) // page_size
        start = tl.sum(tl.where(offs < b, pages, 0), axis=0)
        total = tl.sum(pages, axis=0)
        mine_len = tl.load(SeqLens + b * stride_seq)
        mine = (tl.minimum(tl.maximum(mine_len, 0), cap) + page_size - 1) // page_size
        tl.store(Indptr + b, start)
        if b == batch - 1:
            tl.store(Indptr + batch, total)
        for j0 in range(0, max_blocks, BLOCK_J):
            j = j0 + tl.arange(0, BLOCK_J)
            live = j < mine
            ids = tl.load(Table + b * stride_tb + j, mask=live, other=0)
            tl.store(Indices + start + j, ids, mask=live)
            tl.store(PagePos + start + j, b * max_blocks + j, mask=live)
            own = b * max_blocks + j
            tail = (j < max_blocks) & (own >= total)
            tl.store(Indices + own, tl.zeros_like(ids), mask=tail)
            tl.store(PagePos + own, tl.zeros_like(ids), mask=tail)

    _KERNEL = packed_pages_kernel
    return _KERNEL


_KERNEL = None


class PageLists:
    """The packed page lists of one plan (module docstring), refreshed in place by :meth:`update`.

    Attributes
    ----------
    indptr : Tensor
        int32 ``[batch + 1]``.
    page_pos : Tensor
        int32 ``[batch * max_blocks]``: position of each packed page in the flattened table.
    indices : Tensor
        int32 ``[batch * max_blocks]``: the table's entries there when :meth:`update` ran.

    Parameters
    ----------
    batch, max_blocks, page_size : int
    device : torch.device
    """

    __slots__ = ("indptr", "page_pos", "indices", "page_size", "shape", "_launch", "_launched_with")

    def __init__(self, batch: int, max_blocks: int, page_size: int, device: torch.device) -> None:
        self.shape = (batch, max_blocks)
        buf = torch.empty(batch + 1 + 2 * batch * max_blocks, dtype=torch.int32, device=device)
        self.indptr, self.page_pos, self.indices = buf.split_with_sizes(
            (batch + 1, batch * max_blocks, batch * max_blocks))
        self.page_size = page_size
        self._launch = None
        self._launched_with = None

    def update(self, block_table: torch.Tensor, cache_seqlens: torch.Tensor) -> None:
        """Recompute the lists for the values ``block_table`` (int32 ``[batch, max_blocks]``, rows of unit stride) and
        ``cache_seqlens`` (int ``[batch]``) hold now, in place; no allocation on the kernel's path.

        Raises
        ------
        ValueError
            ``block_table`` or ``cache_seqlens`` of another shape than the lists were made for.
        """
        if tuple(block_table.shape) != self.shape or tuple(cache_seqlens.shape) != self.shape[:1]:
            raise ValueError(f"block_table must be [{self.shape[0]}, {self.shape[1]}] and cache_seqlens "
                             f"[{self.shape[0]}] (the plan's), got {list(block_table.shape)} and "
                             f"{list(cache_seqlens.shape)}")
        if self._kernel_takes(block_table, cache_seqlens):
            key = (block_table.data_ptr(), block_table.stride(0), cache_seqlens.data_ptr(), cache_seqlens.stride(0),
                   cache_seqlens.dtype)
            if self._launch is None or self._launched_with != key:
                self._launch = self._make_launch(block_table, cache_seqlens)
                self._launched_with = key
            self._launch()
            return
        indptr, page_pos, indices = packed_page_lists(block_table, cache_seqlens, self.page_size)
        self.indptr.copy_(indptr)
        self.page_pos.copy_(page_pos)
        self.indices.copy_(indices)

    def _kernel_takes(self, block_table: torch.Tensor, cache_seqlens: torch.Tensor) -> bool:
        if not (block_table.is_cuda and cache_seqlens.is_cuda and 1 <= block_table.shape[0] <= MAX_BATCH
                and block_table.dtype == torch.int32 and block_table.stride(1) == 1
                and cache_seqlens.dtype == torch.int32):
            return False
        try:
            _kernel()
        except ImportError:
            return False
        return True

    def _make_launch(self, block_table: torch.Tensor, cache_seqlens: torch.Tensor):
        import triton

        from mla_dispatch.metadata.triton_launch import CachedLaunch

        batch, max_blocks = block_table.shape
        args = dict(Table=block_table, SeqLens=cache_seqlens, Indptr=self.indptr, PagePos=self.page_pos,
                    Indices=self.indices, batch=batch, max_blocks=max_blocks, page_size=self.page_size,
                    stride_tb=block_table.stride(0), stride_seq=cache_seqlens.stride(0),
                    BLOCK_B=triton.next_power_of_2(batch), BLOCK_J=min(1024, triton.next_power_of_2(max_blocks)))
        device = block_table.device.index if block_table.device.index is not None else torch.cuda.current_device()
        return CachedLaunch(_kernel(), (batch,), args, (), {"num_warps": 4 if batch <= 4096 else 8}, device)
