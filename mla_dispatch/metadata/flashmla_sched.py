"""FlashMLA's decode schedule, computed by us, so a FlashMLA plan can be made before a CUDA graph is captured and
refreshed in place between replays.

FlashMLA (HEAD 9241ae3 and since late 2025) computes its tile schedule inside its first decode call and exposes
no function for it. Its kernel reads two int32 tensors (``csrc/params.h``, ``DecodingSchedMeta``):

- ``tile_scheduler_metadata [num_sm_parts, 8]``: per persistent CTA ``(begin_req, end_req, begin_block,
  end_block, begin_split, is_first_req_splitted, is_last_req_splitted, pad)``, requests inclusive, blocks
  inclusive-exclusive;
- ``num_splits [batch + 1]``: the running count of pieces the requests were split into.

This module computes the same two tensors from ``cache_seqlens`` on the device in one launch, with the algorithm
of FlashMLA's ``get_mla_metadata_kernel`` (``csrc/smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu``:
each request costs ``ceil(L / 64)`` blocks, at least one, plus 5; every CTA takes ``ceil(total / parts) + 5``;
requests are cut where a CTA's share ends). :func:`flashmla_sched_meta_host` is the same algorithm in plain Python,
the specification the tests hold the kernel to; on a GPU they also compare it with FlashMLA's own tensors.
"""

from __future__ import annotations

import contextlib
import math
import os

import torch
import triton
import triton.language as tl

__all__ = ["BLOCK_N", "FIXED_OVERHEAD_BLOCKS", "META_INTS", "num_sm_parts", "flashmla_sched_meta_host",
           "flashmla_sched_meta_into"]

BLOCK_N = 64                # FlashMLA's tokens per block (page_block_size must be 64)
FIXED_OVERHEAD_BLOCKS = 5   # FlashMLA's fixed cost of a request in a CTA, in blocks
META_INTS = 8               # sizeof(DecodingSchedMeta) / 4


def num_sm_parts(num_sms: int, num_heads_q: int, num_heads_k: int, q_len: int) -> int:
    """FlashMLA's CTA count for dense decode (``csrc/api/dense_decode.h``)."""
    return max(num_sms // num_heads_k // math.ceil(q_len * num_heads_q // num_heads_k / 64), 1)


def flashmla_sched_meta_host(seqlens: list[int], parts: int) -> tuple[list[list[int]], list[int]]:
    """FlashMLA's schedule for ``seqlens`` over ``parts`` CTAs, in Python: (``parts`` rows of 8 ints, num_splits)."""
    b = len(seqlens)
    num_blocks = [max(L - 1, 0) // BLOCK_N + 1 for L in seqlens]
    last_block = [n - 1 for n in num_blocks]
    total = sum(n + FIXED_OVERHEAD_BLOCKS for n in num_blocks)
    payload = -(-total // parts) + FIXED_OVERHEAD_BLOCKS
    req = block = split = cum = 0
    splits = [0] * (b + 1)
    meta = []
    for _ in range(parts):
        # A CTA left with no work (every request already placed) gets begin_block = last_block[0]: FlashMLA reads
        # first_block[b], one past its shared array, which is where last_block[0] lies. Its kernel ignores the
        # value (begin_req > end_req); it is copied so the two tensors are equal bit for bit.
        begin_block = block + (last_block[0] if req == b else 0)
        begin_req, begin_split, first_split = req, split, int(block != 0)
        remain = payload
        while req < b:
            left = num_blocks[req] - block
            if remain >= left + FIXED_OVERHEAD_BLOCKS:
                cum += split + 1
                splits[req + 1] = cum
                remain -= left + FIXED_OVERHEAD_BLOCKS
                req, block, split = req + 1, 0, 0
            else:
                if remain - FIXED_OVERHEAD_BLOCKS > 0:
                    block += remain - FIXED_OVERHEAD_BLOCKS
                    split += 1
                break
        end_req = req if block > 0 else req - 1
        if block > 0:
            end_block = block
        else:
            end_block = 0 if seqlens[req - 1] == 0 else last_block[req - 1] + 1
        last_split = int(end_block != last_block[end_req] + 1 and seqlens[end_req] != 0)
        if begin_req == end_req:
            first_split = last_split = int(first_split or last_split)
        meta.append([begin_req, end_req, begin_block, end_block, begin_split, first_split, last_split, 0])
    return meta, splits


@triton.jit
def _sched_kernel(Seqlens, Meta, Splits, batch, parts, BLOCK_B: tl.constexpr, BLOCK: tl.constexpr,
                  OVERHEAD: tl.constexpr):
    # One program, as FlashMLA's one warp: the per-request block counts in parallel, then the cut made
    # sequentially, CTA after CTA (its loop has a `break`; here a flag ends the inner loop).
    offs = tl.arange(0, BLOCK_B)
    lens = tl.load(Seqlens + offs, mask=offs < batch, other=0)
    nblk = tl.maximum(lens - 1, 0) // BLOCK + 1
    total = tl.sum(tl.where(offs < batch, nblk + OVERHEAD, 0), axis=0)
    payload = (total + parts - 1) // parts + OVERHEAD
    tl.store(Splits, 0)
    req = 0
    block = 0
    split = 0
    cum = 0
    last0 = tl.maximum(tl.load(Seqlens) - 1, 0) // BLOCK  # FlashMLA's first_block[b] (see the host function)
    for i in range(parts):
        begin_req = req
        begin_block = block + tl.where(req == batch, last0, 0)
        begin_split = split
        first_split = (block != 0).to(tl.int32)
        remain = payload
        going = req < batch
        while going:
            left = (tl.maximum(tl.load(Seqlens + req) - 1, 0) // BLOCK + 1) - block
            if remain >= left + OVERHEAD:
                cum += split + 1
                tl.store(Splits + req + 1, cum)
                remain -= left + OVERHEAD
                req += 1
                block = 0
                split = 0
                going = req < batch
            else:
                if remain - OVERHEAD > 0:
                    block += remain - OVERHEAD
                    split += 1
                going = False
        end_req = tl.where(block > 0, req, req - 1)
        prev_len = tl.load(Seqlens + tl.maximum(req - 1, 0))
        prev_last = tl.maximum(prev_len - 1, 0) // BLOCK
        end_block = tl.where(block > 0, block, tl.where(prev_len == 0, 0, prev_last + 1))
        end_len = tl.load(Seqlens + tl.maximum(end_req, 0))
        last_split = ((end_block != tl.maximum(end_len - 1, 0) // BLOCK + 1) & (end_len != 0)).to(tl.int32)
        both = tl.maximum(first_split, last_split)
        first_split = tl.where(begin_req == end_req, both, first_split)
        last_split = tl.where(begin_req == end_req, both, last_split)
        row = Meta + i * 8
        tl.store(row + 0, begin_req)
        tl.store(row + 1, end_req)
        tl.store(row + 2, begin_block)
        tl.store(row + 3, end_block)
        tl.store(row + 4, begin_split)
        tl.store(row + 5, first_split)
        tl.store(row + 6, last_split)
        tl.store(row + 7, 0)


def flashmla_sched_meta_into(cache_seqlens: torch.Tensor, meta: torch.Tensor, num_splits: torch.Tensor) -> None:
    """Write FlashMLA's schedule for ``cache_seqlens`` (int32 ``[b]``) into ``meta`` (int32 ``[parts, 8]``) and
    ``num_splits`` (int32 ``[b + 1]``): on a GPU one launch, no host synchronisation (capturable); on a CPU the
    host algorithm (Triton's interpreter, where it is on, runs the kernel)."""
    batch, parts = cache_seqlens.shape[0], meta.shape[0]
    if not cache_seqlens.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        rows, splits = flashmla_sched_meta_host(cache_seqlens.tolist(), parts)
        meta.copy_(torch.tensor(rows, dtype=torch.int32))
        num_splits.copy_(torch.tensor(splits, dtype=torch.int32))
        return
    guard = torch.cuda.device(cache_seqlens.device) if cache_seqlens.is_cuda else contextlib.nullcontext()
    with guard:  # Triton launches on the current device, not the tensors'
        _sched_kernel[(1,)](cache_seqlens, meta, num_splits, batch, parts, BLOCK_B=triton.next_power_of_2(batch),
                            BLOCK=BLOCK_N, OVERHEAD=FIXED_OVERHEAD_BLOCKS, num_warps=1)
