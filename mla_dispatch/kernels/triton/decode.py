"""Split-KV paged MLA decode in Triton (absorbed / "MQA mode" MLA).

Algorithm
---------
For one KV head, every query row ``r = (query token i, query head h)`` of a
request attends to the same latent cache: ``K[t] = kv[t, :D_qk]`` and
``V[t] = kv[t, :D_v]``.  The kernel loads each KV token once for all the rows of
a head tile and uses the same registers/shared-memory tile for both products
(the MLA trick: V is the first ``D_v`` channels of K)::

    S = Q_nope @ K_nope^T + Q_rope @ K_rope^T        # 576-wide dot split 512 + 64
    online softmax over token tiles in fp32, base 2   # FlashAttention-2 (Dao, 2023)
    O += P @ K_nope                                    # V == K_nope

The work is driven by the shared split-KV schedule
(:func:`mla_dispatch.metadata.schedule.split_kv_schedule`, after FlashMLA's tile
scheduler): program ``(part, tile)`` walks the items of its part; an item is a
token range of one request.  An item that covers a whole request writes the
final ``out``/``lse`` (``slot = -1``); otherwise it writes a partial result
(normalised output as fp16 with a power-of-two scale, and natural-log LSE) that :mod:`.combine` merges.

Two pipelines, chosen per problem class by measurement (``CONFIGS`` below):

* heads on M (``TOKENS_ON_M=False``): ``S[M=rows, N=tokens]`` -- the usual
  layout; with few rows (tensor-parallel DeepSeek: 16 heads per GPU) most of a
  64-row Hopper MMA is padding.
* tokens on M (``TOKENS_ON_M=True``): the transposed pipeline of FlashMLA-ETAP
  (``S^T = K Q^T``, ``O^T = V^T P^T``): KV tokens fill M and the few query rows
  sit on N, where 16 is a legal MMA width.

KV formats are dequantised in the kernel, in registers, right after the load:
``fp8_e4m3`` values are cast to the query dtype (exact) and the per-tensor scale
is folded into the softmax scale and the final output; ``fp8_ds_mla`` tokens
(512 fp8 NoPE + 4 fp32 scales + 64 bf16 RoPE in 656 bytes) are scaled per 128
channels (the scales are powers of two, so the product is exact) and cast.

``fp8_ds_v4`` (DeepSeek-V4, FlashMLA's MODEL1; sparse only) is run as ``D_qk = D_v = 512`` with no separate
RoPE part: V is the whole token. A token's channels 0..447 are fp8 bytes at ``block * stride + slot * 576``, scaled
per 64 channels by ue8m0 bytes at ``block * stride + PAGE_SIZE * 576 + slot * 8``, and channels 448..511 bf16 right
behind the fp8 bytes (FlashMLA ``csrc/sm90/decode/sparse_fp8/splitkv_mla.cuh`` reads the same layout).

Sparse decoding takes FlashMLA's optional arguments: ``topk_length`` ends a request's index list early (tiles past
it are skipped, entries past it never read), a second cache (``extra_*``: its own pointer, strides, page size and
index list) whose tokens follow the main list's in the schedule's token axis (positions ``topk ..``), and
``attn_sink``, which scales a finished row by ``1 / (1 + exp(sink - lse))`` where the row is written whole (here,
or in :mod:`.combine` for a split request).

Where the cache allows it (bf16/fp16, one KV head, contiguous, pages holding whole
tiles: :func:`tma_applies`), an item's whole tiles are loaded by TMA through host
tensor descriptors, which Triton pipelines a tile ahead (``TMA_CONFIGS``); its partial
last tile takes the masked gather. With ``q`` contiguous the query tile comes by TMA too
(:func:`q_tma_applies`), straight into shared memory.

Never read: cache slots at or past a request's length, block-table entries past
``ceil(L / page_size)`` (every load is masked by ``t < token_end``; the schedule's items
end at the table's capacity, ``max_blocks * page_size``, whatever the length), and sparse
``indices`` entries below 0. Nothing outside the cache either: a block id outside
``[0, num_blocks)`` (a sparse index at or past ``num_blocks * page_size``) is not loaded
and scores NaN for every row, so the item that met it writes NaN for all its rows, out and
LSE (the combine keeps the NaN): a bad table entry poisons its own request, nothing else.

Tuning happens *offline*: the config table is keyed on the problem class
(rows per KV head, D, kv format), never on sequence lengths, and there is no
autotuner at run time, so a CUDA graph captured after the first (compiling)
call stays valid for every ``cache_seqlens``.  Triton compiles on first use:
run once before capturing a graph.
"""

# [notes]: docs/notes/triton.md, the development history these comments cite
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from mla_dispatch.kernels.triton.descriptors import rebased
from mla_dispatch.kernels.triton.device import kernel_device
from mla_dispatch.kernels.triton.fp8t_limits import FP8T_MAX_ROWS
from mla_dispatch.kvcache.formats import KV_FORMAT_CODES

__all__ = ["KernelConfig", "choose_config", "launch_decode", "launch_decode_kernel"]

DS_MLA_SCALE_OFFSET = tl.constexpr(512)  # bytes
DS_MLA_ROPE_OFFSET = tl.constexpr(528)  # bytes
DS_MLA_TILE = tl.constexpr(128)  # channels per fp32 scale
DS_V4_NOPE = tl.constexpr(448)  # fp8 channels of an fp8_ds_v4 token; then 64 bf16 RoPE channels
DS_V4_TILE = tl.constexpr(64)  # channels per ue8m0 scale
DS_V4_DATA_BYTES = 576  # a token's fp8 + bf16 bytes, consecutive in its block (the token stride)
DS_V4_SCALE_BYTES = 8  # a token's 7 scale bytes + 1 pad, after the block's PAGE_SIZE * 576 data bytes
# the two as the jit code reads them (a compiled kernel reads only constexpr globals; the interpreter reads any)
_DS_V4_DATA_BYTES = tl.constexpr(DS_V4_DATA_BYTES)
_DS_V4_SCALE_BYTES = tl.constexpr(DS_V4_SCALE_BYTES)


# ----------------------------------------------------------------------------------------
# jit helpers
# ----------------------------------------------------------------------------------------


@triton.jit
def _token_rows(BlockTable, Indices, req, i_row0, start, end, num_blocks, PAGE_SIZE: tl.constexpr, stride_bt,
                stride_ib, stride_is, stride_kb, stride_kt, kv_head_off, BLOCK_N: tl.constexpr, SPARSE: tl.constexpr,
                KV_FORMAT: tl.constexpr = 0):
    """Token positions, validity mask, int64 cache offsets of one token tile, and which of its tokens have a block id
    outside ``[0, num_blocks)`` (not loaded: ``valid`` is false there, and the caller poisons the item); and the
    offsets of the tokens' scale bytes (``fp8_ds_v4``, sparse; else the token offsets again)."""
    n = start + tl.arange(0, BLOCK_N)
    in_range = n < end
    if SPARSE:
        # n indexes the request's top-k list for query token i_row0; negative = skip, past the cache = bad
        idx = tl.load(Indices + req.to(tl.int64) * stride_ib + i_row0 * stride_is + n, mask=in_range, other=-1)
        block = tl.maximum(idx, 0) // PAGE_SIZE
        bad = in_range & (block >= num_blocks)
        valid = in_range & (idx >= 0) & ~bad
        idx = tl.where(valid, idx, 0).to(tl.int64)
        block = idx // PAGE_SIZE
        rows = block * stride_kb + (idx - block * PAGE_SIZE) * stride_kt + kv_head_off
        srows = rows
        if KV_FORMAT == 3:  # the block's scale bytes follow its PAGE_SIZE tokens of 576 data bytes
            srows = block * stride_kb + PAGE_SIZE * _DS_V4_DATA_BYTES + (idx - block * PAGE_SIZE) * _DS_V4_SCALE_BYTES
    elif PAGE_SIZE % BLOCK_N == 0:
        # the tile lies in one page (tiles start at multiples of BLOCK_N: schedule items are
        # chunk-aligned, metadata.split_kv_schedule, and chunk_size % BLOCK_N == 0): one table entry,
        # read as a scalar (the page holds `start`, so the entry is within the request's length),
        # and rows = scalar base + a loop-invariant ramp
        block = tl.load(BlockTable + req.to(tl.int64) * stride_bt + start // PAGE_SIZE)
        ok = block.to(tl.uint32, bitcast=True) < num_blocks  # 0 <= block < num_blocks, in one compare
        bad = tl.where(ok, False, in_range)  # (a scalar `&` a tensor of int1 gives a mask the interpreter refuses)
        valid = tl.where(ok, in_range, False)
        block = tl.where(ok, block, 0).to(tl.int64)
        base = block * stride_kb + (start % PAGE_SIZE) * stride_kt + kv_head_off  # in-page term fits int32
        rows = base + tl.arange(0, BLOCK_N).to(tl.int64) * stride_kt
        srows = rows
    elif PAGE_SIZE > 1 and BLOCK_N % PAGE_SIZE == 0:
        # whole pages per tile: BLOCK_N / PAGE_SIZE table entries (masked: entries past the
        # request's length are never read), spread over their pages' slots
        NP: tl.constexpr = BLOCK_N // PAGE_SIZE
        page = start // PAGE_SIZE + tl.arange(0, NP)
        block = tl.load(BlockTable + req.to(tl.int64) * stride_bt + page, mask=page * PAGE_SIZE < end, other=0)
        block = tl.gather(block, tl.arange(0, BLOCK_N) // PAGE_SIZE, 0)
        ok = block.to(tl.uint32, bitcast=True) < num_blocks
        bad = in_range & ~ok
        valid = in_range & ok  # (a bad id's rows are computed and never loaded)
        block = block.to(tl.int64)
        rows = block * stride_kb + (n % PAGE_SIZE).to(tl.int64) * stride_kt + kv_head_off
        srows = rows
    else:
        # masked: table entries past the request's length are never read
        block = tl.load(BlockTable + req.to(tl.int64) * stride_bt + n // PAGE_SIZE, mask=in_range, other=0)
        ok = block.to(tl.uint32, bitcast=True) < num_blocks
        bad = in_range & ~ok
        valid = in_range & ok  # (a bad id's rows are computed and never loaded)
        block = block.to(tl.int64)
        rows = block * stride_kb + (n % PAGE_SIZE).to(tl.int64) * stride_kt + kv_head_off
        srows = rows
    return n, valid, rows, bad, srows


@triton.jit
def _load_latent(KV, rows, valid, col0, DTYPE: tl.constexpr, NCOLS: tl.constexpr, KV_FORMAT: tl.constexpr,
                 srows=None):
    """``[BLOCK_N, NCOLS]`` latent (NoPE) channels ``col0 ..`` in the query dtype; 0 for invalid tokens. ``srows``:
    the tokens' scale-byte offsets (``fp8_ds_v4``)."""
    d = col0 + tl.arange(0, NCOLS)
    ptrs = KV + rows[:, None] + d[None, :]
    if KV_FORMAT == 3:  # fp8_ds_v4: fp8 channels < 448 scaled per 64 by ue8m0 bytes, then 64 bf16 channels
        tl.static_assert(NCOLS % 64 == 0)  # whole scale tiles (DS_V4_TILE)
        NG: tl.constexpr = NCOLS // DS_V4_TILE
        nope = d < DS_V4_NOPE
        raw = tl.load(ptrs, mask=valid[:, None] & nope[None, :], other=0)
        val = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        g = col0 // DS_V4_TILE + tl.arange(0, NG)  # scale tile of each group of 64 channels (7: the RoPE part)
        sbyte = tl.load(KV + srows[:, None] + g[None, :], mask=valid[:, None] & (g < 7)[None, :], other=0)
        # 2 ** (byte - 127) is the fp32 with that biased exponent; 255 is NaN
        scale = tl.where(sbyte == 255, float("nan"), (sbyte.to(tl.int32) << 23).to(tl.float32, bitcast=True))
        val = tl.reshape(tl.reshape(val, (val.shape[0], NG, DS_V4_TILE)) * scale[:, :, None], (val.shape[0], NCOLS))
        rptrs = (KV + rows[:, None] + DS_V4_NOPE + 2 * (d[None, :] - DS_V4_NOPE)).to(tl.pointer_type(tl.bfloat16))
        rope = tl.load(rptrs, mask=valid[:, None] & ~nope[None, :], other=0.0).to(tl.float32)
        return tl.where(nope[None, :], val, rope).to(DTYPE)
    elif KV_FORMAT == 2:  # fp8_ds_mla: fp8 bytes, one fp32 scale per 128 channels (powers of two: exact)
        raw = tl.load(ptrs, mask=valid[:, None], other=0)
        val = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        if NCOLS <= DS_MLA_TILE:  # one scale per token
            sptr = (KV + rows + DS_MLA_SCALE_OFFSET + (col0 // DS_MLA_TILE) * 4).to(tl.pointer_type(tl.float32))
            scale = tl.load(sptr, mask=valid, other=0.0)
            return (val * scale[:, None]).to(DTYPE)
        else:  # NCOLS / 128 scales per token, broadcast over their 128 channels
            NG: tl.constexpr = NCOLS // DS_MLA_TILE
            g = col0 // DS_MLA_TILE + tl.arange(0, NG)
            sptr = (KV + rows[:, None] + DS_MLA_SCALE_OFFSET + g[None, :] * 4).to(tl.pointer_type(tl.float32))
            scale = tl.load(sptr, mask=valid[:, None], other=0.0)  # [BLOCK_N, NG]
            val = tl.reshape(val, (val.shape[0], NG, DS_MLA_TILE)) * scale[:, :, None]
            return tl.reshape(val, (val.shape[0], NCOLS)).to(DTYPE)
    else:  # native, or fp8_e4m3 whose per-tensor scale is folded in later (the cast is exact)
        return tl.load(ptrs, mask=valid[:, None], other=0.0).to(DTYPE)


@triton.jit
def _load_rope(KV, rows, valid, DTYPE: tl.constexpr, D_V: tl.constexpr, D_ROPE: tl.constexpr,
               KV_FORMAT: tl.constexpr):
    """``[BLOCK_N, D_ROPE]`` RoPE channels in the query dtype."""
    d = tl.arange(0, D_ROPE)
    if KV_FORMAT == 2:  # bf16 values at byte 528 of the 656-byte token
        ptrs = (KV + rows[:, None] + DS_MLA_ROPE_OFFSET + 2 * d[None, :]).to(tl.pointer_type(tl.bfloat16))
    else:
        ptrs = KV + rows[:, None] + D_V + d[None, :]
    return tl.load(ptrs, mask=valid[:, None], other=0.0).to(DTYPE)


@triton.jit
def _qk(k, q, acc, TOKENS_ON_M: tl.constexpr):
    """Scores of key tile ``k`` ``[BLOCK_N, d]`` against query rows ``q`` ``[BLOCK_M, d]``, added to ``acc`` (None:
    from zero): ``K Q^T`` ``[BLOCK_N, BLOCK_M]`` with tokens on M, else ``Q K^T``."""
    if TOKENS_ON_M:
        s = tl.dot(k, tl.trans(q), acc)
    else:
        s = tl.dot(q, tl.trans(k), acc)
    return s


@triton.jit
def _scores(Q, q_off, row_ok, q_whole, q_rope, KV, rows, valid, DTYPE: tl.constexpr, D_V: tl.constexpr,
            D_ROPE: tl.constexpr, QK_CHUNK: tl.constexpr, KV_FORMAT: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, TOKENS_ON_M: tl.constexpr, srows=None):
    """Raw scores of one token tile: ``[BLOCK_M, BLOCK_N]`` (heads on M) or its transpose.

    The latent dot runs in ``D_V / QK_CHUNK`` pieces; with ``QK_CHUNK < D_V`` the
    query chunks are re-read from L1/L2 inside the loop instead of being held in
    registers (the register budget is what limits this kernel).
    """
    if TOKENS_ON_M:
        s = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        s = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if QK_CHUNK == D_V:
        k = _load_latent(KV, rows, valid, 0, DTYPE, D_V, KV_FORMAT, srows)
        s = _qk(k, q_whole, s, TOKENS_ON_M)
    else:
        for c in tl.static_range(D_V // QK_CHUNK):
            dq = c * QK_CHUNK + tl.arange(0, QK_CHUNK)
            q_c = tl.load(Q + q_off[:, None] + dq[None, :], mask=row_ok[:, None], other=0.0)
            k_c = _load_latent(KV, rows, valid, c * QK_CHUNK, DTYPE, QK_CHUNK, KV_FORMAT, srows)
            s = _qk(k_c, q_c, s, TOKENS_ON_M)
    if D_ROPE > 0:
        k_r = _load_rope(KV, rows, valid, DTYPE, D_V, D_ROPE, KV_FORMAT)
        s = _qk(k_r, q_rope, s, TOKENS_ON_M)
    return s


@triton.jit
def _page_of(ptr, ASM: tl.constexpr):
    """The block-table entry at ``ptr`` (a scalar).

    On the GPU it is read with inline PTX (``ld.global.nc``) rather than ``tl.load``: Triton's
    software pipeliner gives every ``tl.load`` in the loop a stage of its own, so a table read
    feeding the TMA coordinate pushed the TMA one stage later and left one tile in flight whatever
    ``num_stages`` was (read in the TTGIR, triton 3.9 for sm_90: the TMA of tile i + 1 issued at the
    end of iteration i). Read as an opaque instruction it shares the TMA's stage, and with
    ``num_stages = s`` the TMA of tile i + s - 1 is issued in iteration i. The table is read-only
    during the kernel, so the non-coherent path is safe. The interpreter has no inline PTX (ASM=False).
    """
    if ASM:
        return tl.inline_asm_elementwise("ld.global.nc.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32, is_pure=True,
                                         pack=1)
    else:
        return tl.load(ptr)


@triton.jit
def _tma_tile(KDesc, RDesc, r0, D_ROPE: tl.constexpr):
    """Latent ``[BLOCK_N, D_V]`` and RoPE ``[BLOCK_N, D_ROPE]`` channels of cache rows ``r0 ..`` (one page, every row
    valid) by TMA: ``KDesc`` views a bf16/fp16 cache as ``[rows, D_qk]`` with block ``[BLOCK_N, D_V]``, ``RDesc``
    the same rows with block ``[BLOCK_N, D_ROPE]`` at column ``D_V``. The tiles stay in shared memory, where the
    wgmma reads them."""
    k = KDesc.load([r0, 0])
    k_r = k  # placeholder when there is no RoPE part
    if D_ROPE > 0:
        k_r = RDesc.load([r0, k.shape[1]])
    return k, k_r


@triton.jit
def _hide_from_rows_that_do_not_see(v, vis, valid, ROW_AXIS: tl.constexpr):
    """``v`` ``[BLOCK_N, DV]`` with the non-finite values of the keys some row of the tile does not see set to 0.

    The causal mask gives such a row p = 0 for the key, but 0 * NaN (or inf) in ``P V`` is NaN: a NaN in a key a
    query cannot see made that query's out NaN. The rows that do see the key still get NaN from its score (V is the
    first D_v channels of K), so only the rows that must not see it change."""
    hidden = valid & (tl.min(vis.to(tl.int32), ROW_AXIS) == 0)  # [BLOCK_N]: valid, not visible to every row
    return tl.where(hidden[:, None] & ~(tl.abs(v) < float("inf")), tl.zeros_like(v), v)


@triton.jit
def _online_update(s, v, n, valid, bad, limit, m_i, l_i, acc, s_scale, DTYPE: tl.constexpr,
                   TOKENS_ON_M: tl.constexpr, CAUSAL: tl.constexpr):
    """One token tile of the online softmax (base 2): mask, rescale, ``acc += P V``. ``s`` raw scores
    ``[BLOCK_N, BLOCK_M]`` (tokens on M) or ``[BLOCK_M, BLOCK_N]``; returns ``(m_i, l_i, acc)``. A token with a bad
    block id (``bad``, not loaded) scores NaN for every row, visible or not: the row sums and the accumulator become
    NaN, and so the item's out and LSE (nothing is carried between tiles for it). ``CAUSAL``: a tile that holds a key
    some row does not see (the last s_q - 1 keys of a request) has that key's non-finite values zeroed in ``v``
    first, so they reach only the rows that see it (:func:`_hide_from_rows_that_do_not_see`)."""
    if TOKENS_ON_M:
        # S^T = K Q^T : tokens on M, query rows on N
        vis = valid[:, None] & (n[:, None] < limit[None, :])
        if CAUSAL:
            if tl.max(n) >= tl.min(limit):  # only the tiles that reach the causal tail pay for it
                v = _hide_from_rows_that_do_not_see(v, vis, valid, 1)
        s = tl.where(vis, s * s_scale, tl.where(bad, float("nan"), float("-inf"))[:, None])  # (bad: never valid)
        m_new = tl.maximum(m_i, tl.max(s, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[None, :])
        l_i = l_i * alpha + tl.sum(p, 0)
        # O^T = V^T P^T : the latent channels fill M
        acc = tl.dot(tl.trans(v), p.to(DTYPE), acc * alpha[None, :])
    else:
        vis = valid[None, :] & (n[None, :] < limit[:, None])
        if CAUSAL:
            if tl.max(n) >= tl.min(limit):
                v = _hide_from_rows_that_do_not_see(v, vis, valid, 0)
        s = tl.where(vis, s * s_scale, tl.where(bad, float("nan"), float("-inf"))[None, :])
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(DTYPE), v, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def _gather_tiles(Q, q_off, row_ok, q_whole, q_rope, KV, BlockTable, Indices, req, i_row0, begin, end, num_blocks,
                  PAGE_SIZE: tl.constexpr, stride_bt, stride_ib, stride_is, stride_kb, stride_kt, kv_head_off, limit,
                  m_i, l_i, acc, s_scale, v_lo, DTYPE: tl.constexpr, D_V: tl.constexpr, D_ROPE: tl.constexpr,
                  QK_CHUNK: tl.constexpr, DV_BLOCK: tl.constexpr, REUSE_K: tl.constexpr, KV_FORMAT: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPARSE: tl.constexpr, TOKENS_ON_M: tl.constexpr,
                  CAUSAL: tl.constexpr):
    """The online softmax over the gathered token tiles ``begin ..`` (masked at ``end``) of one cache: returns
    ``(m_i, l_i, acc)``. Sparse items run it once per index list (the main one, then the extra cache's)."""
    for start in range(begin, end, BLOCK_N):
        n, valid, rows, bad, srows = _token_rows(BlockTable, Indices, req, i_row0, start, end, num_blocks, PAGE_SIZE,
                                                 stride_bt, stride_ib, stride_is, stride_kb, stride_kt, kv_head_off,
                                                 BLOCK_N, SPARSE, KV_FORMAT)
        if REUSE_K:
            k = _load_latent(KV, rows, valid, 0, DTYPE, D_V, KV_FORMAT, srows)
            s = _qk(k, q_whole, None, TOKENS_ON_M)
            if D_ROPE > 0:
                k_r = _load_rope(KV, rows, valid, DTYPE, D_V, D_ROPE, KV_FORMAT)
                s = _qk(k_r, q_rope, s, TOKENS_ON_M)
            v = k
        else:
            s = _scores(Q, q_off, row_ok, q_whole, q_rope, KV, rows, valid, DTYPE, D_V, D_ROPE, QK_CHUNK,
                        KV_FORMAT, BLOCK_M, BLOCK_N, TOKENS_ON_M, srows)
            v = _load_latent(KV, rows, valid, v_lo, DTYPE, DV_BLOCK, KV_FORMAT, srows)
        m_i, l_i, acc = _online_update(s, v, n, valid, bad, limit, m_i, l_i, acc, s_scale, DTYPE, TOKENS_ON_M,
                                       CAUSAL)
    return m_i, l_i, acc


@triton.jit
def _sink_factor(AttnSink, head, row_ok, has_key, lse_nat):
    """``1 / (1 + exp(sink - lse))`` per row (natural-log LSE), 0 for a row without keys; a sink of +inf gives 0."""
    sink = tl.load(AttnSink + head, mask=row_ok, other=float("-inf"))
    return tl.where(has_key, 1.0 / (1.0 + tl.exp(sink - lse_nat)), 0.0)


@triton.jit
def _pow2_scale(amax):
    """``(2^s, 2^-s)`` for a partial row whose largest magnitude is ``amax`` (>= 0): ``s = 141 - E`` for
    ``amax = 1.f * 2^(E - 127)`` puts ``amax * 2^s`` in ``[2^14, 2^15)``, where fp16 keeps all 11 bits and cannot
    overflow. Clamped to ``[-113, 126]`` so both factors are normal floats: zero gets 126, inf / NaN -113 (the values
    stay inf / NaN). The CUDA kernel's ``partial_shift`` (kernels/cuda/mla_decode_sm90/epilogue.cuh) does the same."""
    e = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    s = tl.minimum(tl.maximum(141 - e, -113), 126)
    return ((127 + s) << 23).to(tl.float32, bitcast=True), ((127 - s) << 23).to(tl.float32, bitcast=True)


# ----------------------------------------------------------------------------------------
# the kernel
# ----------------------------------------------------------------------------------------


@triton.jit
def mla_decode_kernel(
    Q, KV, BlockTable, Seqlens, Indices, KVScale,
    KDesc, RDesc,  # TMA descriptors of the cache (TMA only, else None; see _tma_tile)
    QDesc, QRDesc,  # TMA descriptors of q's latent / RoPE channels (Q_TMA only, else None; see tma_descriptors)
    Items, PartOffsets,
    Out, Lse, PartialOut, PartialLse,
    qk_scale,  # softmax_scale * log2(e)
    q_len, group,  # s_q, h_q // h_kv
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_bt, stride_ib, stride_is,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_lh, stride_ls,
    stride_pob, stride_pos, stride_poh,
    stride_plb, stride_pls, stride_plh,
    H_KV, NUM_M_TILES,
    num_blocks,  # kv_cache.shape[0]: block ids outside [0, num_blocks) are not loaded (the item's rows become NaN)
    PAGE_SIZE: tl.constexpr,  # a constant: the token -> (page, slot) split compiles to shifts / a multiply
    D_V: tl.constexpr, D_ROPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    V_SPLIT: tl.constexpr, QK_CHUNK: tl.constexpr,
    KV_FORMAT: tl.constexpr, CAUSAL: tl.constexpr, SPARSE: tl.constexpr, TOKENS_ON_M: tl.constexpr,
    TMA: tl.constexpr = False,  # whole tiles by TMA (dense, h_kv = 1, PAGE_SIZE % BLOCK_N == 0, REUSE_K)
    ASM_PAGE: tl.constexpr = False,  # TMA: block-table reads as inline PTX (see _page_of); False interpreting
    Q_TMA: tl.constexpr = False,  # TMA and q contiguous: the query tile by TMA, straight into shared memory
    # sparse only, FlashMLA's optional arguments (see the module docstring); None / 0 when absent
    TopkLength=None, AttnSink=None, ExtraKV=None, ExtraIndices=None, ExtraTopkLength=None,
    topk=0,  # width of Indices: the extra list's tokens are the schedule's positions topk ..
    stride_ekb=0, stride_ekt=0, stride_ekh=0, stride_eib=0, stride_eis=0, extra_num_blocks=0,
    EXTRA_PAGE_SIZE: tl.constexpr = 1,
    HAS_TOPK_LENGTH: tl.constexpr = False, HAS_SINK: tl.constexpr = False, HAS_EXTRA: tl.constexpr = False,
    HAS_EXTRA_TOPK_LENGTH: tl.constexpr = False,
):
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16)
    tl.static_assert(D_V % V_SPLIT == 0 and D_V % QK_CHUNK == 0)
    tl.static_assert(KV_FORMAT != 2 or (D_V == 512 and D_ROPE == 64))
    tl.static_assert(KV_FORMAT != 3 or (D_V == 512 and D_ROPE == 0 and SPARSE))
    tl.static_assert(SPARSE or not (HAS_TOPK_LENGTH or HAS_SINK or HAS_EXTRA))
    DV_BLOCK: tl.constexpr = D_V // V_SPLIT  # output channels this program accumulates
    # V can reuse the K tile only when one program holds all of it
    REUSE_K: tl.constexpr = V_SPLIT == 1 and QK_CHUNK == D_V
    tl.static_assert(not TMA or (REUSE_K and not SPARSE and KV_FORMAT == 0 and PAGE_SIZE % BLOCK_N == 0))
    tl.static_assert(not Q_TMA or TMA)
    DTYPE = Q.dtype.element_ty
    LN2: tl.constexpr = 0.6931471805599453
    # a plain launch passes the Python float as fp32; torch.compile (Inductor) passes it as fp64, which
    # would promote the scores, P and the accumulator to fp64
    qk_scale = tl.cast(qk_scale, tl.float32)

    # -- which rows and output channels this program owns -------------------------------
    # tile id = (((sparse query token, M tile), V split), KV head). Dense problems
    # flatten (query token, head) into rows; sparse ones keep one query token per
    # tile because every query token has its own key list.
    part = tl.program_id(0)
    tile = tl.program_id(1)
    kv_head = tile % H_KV
    v_idx = (tile // H_KV) % V_SPLIT
    m_tile = (tile // (H_KV * V_SPLIT)) % NUM_M_TILES
    flat = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    if SPARSE:
        i_row0 = tile // (H_KV * V_SPLIT * NUM_M_TILES)
        row_ok = flat < group
        q_tok = i_row0 + flat * 0
        head = kv_head * group + flat
    else:
        i_row0 = 0
        row_ok = flat < q_len * group
        q_tok = flat // group
        head = kv_head * group + flat % group
    kv_head_off = kv_head.to(tl.int64) * stride_kh
    kv_scale = 1.0
    if KV_FORMAT == 1:
        kv_scale = tl.load(KVScale)
    v_lo = v_idx * DV_BLOCK
    d_o = v_lo + tl.arange(0, DV_BLOCK)

    item_begin = tl.load(PartOffsets + part)
    item_end = tl.load(PartOffsets + part + 1)
    for item in range(item_begin, item_end):
        req = tl.load(Items + item * 4 + 0)
        tok_begin = tl.load(Items + item * 4 + 1)
        tok_end = tl.load(Items + item * 4 + 2)
        slot = tl.load(Items + item * 4 + 3)
        seqlen = tl.load(Seqlens + req)
        # key t is visible to row (i, h) iff t < limit[i]
        if CAUSAL:
            limit = seqlen - q_len + 1 + q_tok
        else:
            limit = seqlen + q_tok * 0

        # -- the query tile: held for the whole item, or re-read per token tile ---------
        q_off = req.to(tl.int64) * stride_qb + q_tok.to(tl.int64) * stride_qs + head.to(tl.int64) * stride_qh
        q_whole = q_off  # placeholder when the latent dot is chunked
        q_rope = q_off
        if Q_TMA:
            # q viewed as [B * s_q * h_q, D_qk] rows (one KV head): the tile's rows are consecutive. Rows past the
            # request's (the next request's, or zeros past the tensor) are computed and never stored (row_ok).
            q_row0 = req * (q_len * group) + m_tile * BLOCK_M
            q_whole = QDesc.load([q_row0, 0])
            if D_ROPE > 0:
                q_rope = QRDesc.load([q_row0, D_V])
        else:
            if QK_CHUNK == D_V:
                q_whole = tl.load(Q + q_off[:, None] + tl.arange(0, D_V)[None, :], mask=row_ok[:, None], other=0.0)
            if D_ROPE > 0:
                q_rope = tl.load(Q + q_off[:, None] + D_V + tl.arange(0, D_ROPE)[None, :], mask=row_ok[:, None],
                                 other=0.0)

        # -- online softmax over the item's token tiles (base 2) ---------------------------
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        if TOKENS_ON_M:
            acc = tl.zeros([DV_BLOCK, BLOCK_M], tl.float32)  # O^T
        else:
            acc = tl.zeros([BLOCK_M, DV_BLOCK], tl.float32)
        s_scale = qk_scale * kv_scale
        gather_begin = tok_begin
        if TMA:
            # whole tiles: one page each (items start at multiples of BLOCK_N), every row valid, so the
            # tile needs no mask and TMA can fetch it whole; Triton pipelines these loads num_stages - 1
            # tiles ahead (_page_of). A partial last tile takes the masked gather below.
            gather_begin = tok_begin + (tok_end - tok_begin) // BLOCK_N * BLOCK_N
            for start in range(tok_begin, gather_begin, BLOCK_N):
                page = _page_of(BlockTable + req.to(tl.int64) * stride_bt + start // PAGE_SIZE, ASM_PAGE)
                page_ok = page.to(tl.uint32, bitcast=True) < num_blocks
                page = tl.where(page_ok, page, 0)  # (block 0 is read instead, and scored NaN)
                k, k_r = _tma_tile(KDesc, RDesc, page * PAGE_SIZE + start % PAGE_SIZE, D_ROPE)
                s = _qk(k, q_whole, None, TOKENS_ON_M)
                if D_ROPE > 0:
                    s = _qk(k_r, q_rope, s, TOKENS_ON_M)
                n = start + tl.arange(0, BLOCK_N)
                m_i, l_i, acc = _online_update(s, k, n, tl.where(page_ok, n < tok_end, False),
                                               tl.where(page_ok, False, n < tok_end), limit, m_i, l_i, acc, s_scale,
                                               DTYPE, TOKENS_ON_M, CAUSAL)
        main_end = tok_end
        if HAS_EXTRA:
            main_end = tl.minimum(tok_end, topk)  # positions topk .. are the extra cache's
        if HAS_TOPK_LENGTH:  # tiles past the request's topk_length are skipped, entries past it never read
            main_end = tl.minimum(main_end, tl.maximum(tl.load(TopkLength + req), 0))
        m_i, l_i, acc = _gather_tiles(Q, q_off, row_ok, q_whole, q_rope, KV, BlockTable, Indices, req, i_row0,
                                      gather_begin, main_end, num_blocks, PAGE_SIZE, stride_bt, stride_ib, stride_is,
                                      stride_kb, stride_kt, kv_head_off, limit, m_i, l_i, acc, s_scale, v_lo, DTYPE,
                                      D_V, D_ROPE, QK_CHUNK, DV_BLOCK, REUSE_K, KV_FORMAT, BLOCK_M, BLOCK_N, SPARSE,
                                      TOKENS_ON_M, CAUSAL)
        if HAS_EXTRA:
            extra_end = tok_end - topk
            if HAS_EXTRA_TOPK_LENGTH:
                extra_end = tl.minimum(extra_end, tl.maximum(tl.load(ExtraTopkLength + req), 0))
            m_i, l_i, acc = _gather_tiles(Q, q_off, row_ok, q_whole, q_rope, ExtraKV, BlockTable, ExtraIndices, req,
                                          i_row0, tl.maximum(tok_begin - topk, 0), extra_end, extra_num_blocks,
                                          EXTRA_PAGE_SIZE, stride_bt, stride_eib, stride_eis, stride_ekb, stride_ekt,
                                          kv_head.to(tl.int64) * stride_ekh, limit, m_i, l_i, acc, s_scale, v_lo,
                                          DTYPE, D_V, D_ROPE, QK_CHUNK, DV_BLOCK, REUSE_K, KV_FORMAT, BLOCK_M, BLOCK_N,
                                          SPARSE, TOKENS_ON_M, CAUSAL)

        # -- epilogue: normalise; natural-log LSE (l_i = 0: no key; NaN, a bad block id: out and LSE NaN) ------
        has_key = l_i != 0.0
        inv_l = tl.where(has_key, kv_scale / tl.where(has_key, l_i, 1.0), 0.0)
        lse_nat = (m_i + tl.log2(tl.where(has_key, l_i, 1.0))) * LN2
        if TOKENS_ON_M:
            o = acc * inv_l[None, :]
        else:
            o = acc * inv_l[:, None]
        lse_row_ok = row_ok & ((flat * 0 + v_idx) == 0)
        if slot < 0:  # the item is the whole request: final out / lse
            if HAS_SINK:
                if TOKENS_ON_M:
                    o = o * _sink_factor(AttnSink, head, row_ok, has_key, lse_nat)[None, :]
                else:
                    o = o * _sink_factor(AttnSink, head, row_ok, has_key, lse_nat)[:, None]
            o_off = req.to(tl.int64) * stride_ob + q_tok.to(tl.int64) * stride_os + head.to(tl.int64) * stride_oh
            if TOKENS_ON_M:
                tl.store(Out + o_off[None, :] + d_o[:, None], o.to(Out.dtype.element_ty), mask=row_ok[None, :])
            else:
                tl.store(Out + o_off[:, None] + d_o[None, :], o.to(Out.dtype.element_ty), mask=row_ok[:, None])
            lse_val = tl.where(has_key, lse_nat, float("inf"))
            l_off = req.to(tl.int64) * stride_lb + head.to(tl.int64) * stride_lh + q_tok.to(tl.int64) * stride_ls
            tl.store(Lse + l_off, lse_val, mask=lse_row_ok)
        else:  # a piece of a split request: a partial row for the combine (PARTIAL_ROW_FORMAT in .combine)
            p_off = slot.to(tl.int64) * stride_pob + q_tok.to(tl.int64) * stride_pos + head.to(tl.int64) * stride_poh
            if TOKENS_ON_M:
                up, down = _pow2_scale(tl.max(tl.abs(o), 0))
                tl.store(PartialOut + p_off[None, :] + d_o[:, None], (o * up[None, :]).to(tl.float16),
                         mask=row_ok[None, :])
            else:
                up, down = _pow2_scale(tl.max(tl.abs(o), 1))
                tl.store(PartialOut + p_off[:, None] + d_o[None, :], (o * up[:, None]).to(tl.float16),
                         mask=row_ok[:, None])
            # this program's 2^-s, an fp32 behind the row's values
            tl.store((PartialOut + p_off + D_V + 2 * v_idx).to(tl.pointer_type(tl.float32)), down, mask=row_ok)
            lse_val = tl.where(has_key, lse_nat, float("-inf"))
            pl_off = slot.to(tl.int64) * stride_plb + q_tok.to(tl.int64) * stride_pls + head.to(tl.int64) * stride_plh
            tl.store(PartialLse + pl_off, lse_val, mask=lse_row_ok)


# ----------------------------------------------------------------------------------------
# configs (measured on H100, see [notes]) and the launcher
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tile shape and launch parameters for one problem class."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tokens_on_m: bool = False
    v_split: int = 1  # programs sharing one head tile, each accumulating D_v / v_split channels
    qk_chunk: int = 512  # latent-dot chunk; < D_v re-reads Q chunks per token tile (fewer registers)
    chunk_size: int = 64  # split-KV schedule granularity (multiple of block_n)
    # persistent programs per SM: Triton issues a tile's gathered loads one tile ahead and
    # waits for them at the top of the next iteration ([notes] "pipeline"), so a program
    # has at most one tile in flight; more programs per SM overlap each other's loads.
    programs_per_sm: int = 1
    max_registers: int = 0  # ptxas register cap per thread (Triton's maxnreg); 0 = the compiler's choice
    # whole tiles by TMA (tensor descriptors), pipelined num_stages - 1 tiles ahead, where the launch allows it
    # (see ``tma_applies``); the partial last tile of an item keeps the masked gather
    tma: bool = False
    # the Gluon sm_90 kernel (:mod:`.gluon_sm90`: S split between the warpgroups, the next tile's TMA issued before
    # this tile's compute) where it applies (``gluon_applies``, on the TMA path); elsewhere this config's plain kernel
    gluon: bool = False

    def __post_init__(self):
        if self.chunk_size % self.block_n:
            raise ValueError(f"chunk_size={self.chunk_size} must be a multiple of block_n={self.block_n}")


def _rows_bucket(rows: int) -> int:
    for b in (16, 32, 64):
        if rows <= b:
            return b
    return 128


# (rows bucket, kv format) -> config. rows = query rows per KV head (s_q*h_q/h_kv, or
# h_q/h_kv for sparse). Never keyed on sequence length (CUDA graphs stay valid).
# Measured with dev/bench_triton.py --grids choice / occupancy; register reports from
# kernels/triton/aot_report.py (see [notes]).
_H64 = KernelConfig(64, 32, 8, 2)  # heads on M, wgmma; spills 168 regs (see [notes]); fp8 caches' 128 rows
# 64 rows: 64-token tiles (H100, b=64 L=8K: 390 us vs 460 for 32-token tiles, page 64; fp8_e4m3 484 vs 662 us,
# fp8_ds_mla 502 vs 753 us); bf16/fp16 caches where a tile
# spans several pages (page_size < 64) with the block-table entries prefetched a stage ahead (num_stages=3:
# page 1 359 vs 404 us, page 16 388 vs 394 us), which is slower where a tile lies in one page (531 us).
_H64_N64 = KernelConfig(64, 64, 8, 2)
_H64_N64_S3 = KernelConfig(64, 64, 8, 3)
# 16 rows: 32-token tiles, three programs per SM under a 168-register cap (the loop is issue-bound with
# one program per SM: [notes] "pipeline"). bf16 b=64 L=8K h=16 (H200): 220 us vs 267 for tM16-n64.
_T16_P3 = KernelConfig(16, 32, 4, 2, tokens_on_m=True, programs_per_sm=3, max_registers=168)
CONFIGS: dict[tuple[int, str], KernelConfig] = {}
for _fmt in ("bf16", "fp16"):
    CONFIGS.update({
        (16, _fmt): _T16_P3,
        (32, _fmt): KernelConfig(32, 64, 4, 2, tokens_on_m=True),  # 303 us vs 342 tM32-n32-p2, 375 tM16-n32-p3
        (64, _fmt): _H64_N64,
        (128, _fmt): _H64_N64,  # 1546 µs vs 1978 for block_n=32; num_stages=3: 1798 vs 1423 µs (H100, L̄=8K)
    })
# fp8: the tile is dequantised in registers (no cp.async). b=64 L=8K (H200): h=16 fp8_e4m3 heads on M
# 16x32 at three programs per SM 299 us (one per SM: 431); fp8_ds_mla tokens on M 16x32, three per SM
# 437 us (heads on M: 592). h=32 (H100): the 64-row config with 64-token tiles, half its rows padding,
# 471 us fp8_e4m3 / 492 us fp8_ds_mla vs 562 / 797 us for the 16-row configs above.
# fp8_ds_mla with tokens on M, block 16x64, 4 warps gave wrong results / an illegal address on an H200
# with triton 3.6 (right in the interpreter): not used ([notes]).
_H16_P3 = KernelConfig(16, 32, 4, 2, programs_per_sm=3, max_registers=168)
CONFIGS.update({(16, "fp8_e4m3"): _H16_P3, (32, "fp8_e4m3"): _H64_N64, (64, "fp8_e4m3"): _H64_N64,
                (128, "fp8_e4m3"): _H64,
                (16, "fp8_ds_mla"): _T16_P3, (32, "fp8_ds_mla"): _H64_N64, (64, "fp8_ds_mla"): _H64_N64,
                (128, "fp8_ds_mla"): _H64})
# fp8_ds_v4 (DeepSeek-V4) takes fp8_ds_mla's configs (the same dequantise-in-registers loop, 512 channels): not yet
# measured on its own
CONFIGS.update({(rows, "fp8_ds_v4"): CONFIGS[rows, "fp8_ds_mla"] for rows in (16, 32, 64, 128)})
#: (rows bucket, kv format) -> config for bf16/fp16 caches with one KV head whose pages hold whole 64-token tiles
#: (page_size % 64 == 0): whole tiles by TMA, pipelined a tile ahead (``KernelConfig.tma``). H100, same run
#: (dev/bench_triton.py --grids tma, page 64): b=64 L=8K h=16 250.9 us vs 268.1 (the 16-row config above), h=32
#: 276.7 vs 316.7, h=64 329.7 vs 397.6; b=128 h=128 L̄=8K 1133.6 vs 1376.2. Deeper pipelines with 32-token tiles
#: (tM16-n32-s4 264.0 us, hM64-n32-w8-s4 359.7 / 369.7 / 1316.5 us) lost to 64-token tiles with two stages.
TMA_CONFIGS: dict[tuple[int, str], KernelConfig] = {}
for _fmt in ("bf16", "fp16"):
    TMA_CONFIGS.update({
        (16, _fmt): KernelConfig(16, 64, 4, 2, tokens_on_m=True, tma=True),
        (32, _fmt): KernelConfig(32, 64, 4, 2, tokens_on_m=True, tma=True),
        (64, _fmt): KernelConfig(64, 64, 8, 2, tma=True),
        (128, _fmt): KernelConfig(64, 64, 8, 2, tma=True),
    })
#: The config of the Gluon sm_90 kernel (:mod:`.gluon_sm90`), for every rows bucket of a bf16/fp16 cache with one KV head,
#: D_qk = 576 / D_v = 512 and any page size, where ``choose_config`` is told the kernel can run (an sm_90 GPU, Gluon
#: importable). 64-row tiles, so 16- and 32-row problems pad. H100, b=64 L=8K, eager µs (dev/bench_triton.py
#: --grids gluon, calls 1-4 of 2026-11-22's twentieth session): h=16 232.8 vs 240.5 (TMA_CONFIGS), h=32 239.0 vs 267.9,
#: h=64 248.2 vs 313.2; FlashMLA grid b=128 h=128 s_q=1 L=8K 696.1-737.2 vs 1118.0 ([notes], "The Gluon
#: kernel"). On pages of 1 / 16 / 33 tokens (every tile gathered), graph µs (--grids gluonpages, 2026-11-22, twenty-first
#: session): h=16 239.4 / 233.9 / 232.2 vs the plain table's 258.1 / 251.7 / 259.7, h=32 244.8 / 239.9 / 238.6 vs
#: 327.9 / 386.4 / 391.9, h=64 254.1 / 248.7 / 248.6 vs 351.5 / 388.4 / 397.4. Where a launch does not meet
#: ``gluon_sm90.gluon_applies`` (q not contiguous, say), the plain kernel runs with the same tiles (by TMA on pages of
#: whole tiles, gathered on others). On 16-bit pages of whole tiles the launch takes the seesaw kernel
#: (:mod:`.gluon_seesaw`, ``seesaw_applies``) instead: FlashMLA grid b=128 h=128 s_q=1/2 graph µs at L=8K 635.9 / 1172.5
#: vs 736.5 / 1415.5 for ``gluon_sm90``, the memory-bound configs equal (2026-11-22, twenty-second session, call 5;
#: [notes], "The seesaw kernel").
GLUON_CONFIG = KernelConfig(64, 64, 8, 2, tma=True, gluon=True)
#: fp8_e4m3 caches take the Gluon kernel from this rows bucket up: each tile is gathered as fp8 and converted to fp16 in
#: shared memory, so it costs ~1.25x a bf16 tile's time. H100, b=64 L=8K, graph µs, Gluon vs the plain table (--grids
#: gluonfp8, 2026-11-22, twenty-first session, call 5): h16 298.1 vs 288.0 (page 64) and 299.2 vs 282.2 (page 16): plain
#: kept; h32 303.6 vs 474.5, h64 311.5 vs 482.5; FlashMLA grid b=128 h128 L=8K s1 1132.2 vs 2493.4, s2 2187.2 vs 4871.1.
GLUON_FP8_MIN_ROWS = 32
# FP8T_MAX_ROWS: the tokens-on-M fp8 kernel's row limit (.fp8t_limits, imported above).


#: (rows bucket, kv format) -> config where a 64-token tile spans several pages (page_size < 64, dense caches)
SMALL_PAGE_CONFIGS: dict[tuple[int, str], KernelConfig] = {(64, "bf16"): _H64_N64_S3, (64, "fp16"): _H64_N64_S3}
INTERPRETER_CONFIG = KernelConfig(16, 16, 4, 1, chunk_size=16)


def choose_config(rows: int, kv_format: str, *, page_size: int | None = None, heads_kv: int = 1,
                  interpret: bool = False, gluon: bool = False, fp8t: bool = True) -> KernelConfig:
    """The config for a problem class (see ``CONFIGS``; ``TMA_CONFIGS`` for bf16/fp16 caches with one KV head
    and pages of whole 64-token tiles; ``GLUON_CONFIG`` for bf16/fp16 caches (and fp8_e4m3 ones from
    ``GLUON_FP8_MIN_ROWS`` rows, or up to ``FP8T_MAX_ROWS`` rows where ``fp8t`` allows the tokens-on-M kernel) with one
    KV head and any page size when ``gluon`` says the Gluon sm_90 kernel can run
    (:func:`.gluon_sm90.gluon_possible`); ``SMALL_PAGE_CONFIGS`` for dense caches with pages shorter than 64 tokens;
    ``page_size=None``: sparse or unknown)."""
    if interpret:
        return INTERPRETER_CONFIG
    key = (_rows_bucket(rows), kv_format)
    if gluon and page_size is not None and heads_kv == 1 and (
            kv_format in ("bf16", "fp16") or (kv_format == "fp8_e4m3" and (
                key[0] >= GLUON_FP8_MIN_ROWS or (rows <= FP8T_MAX_ROWS and fp8t)))):
        return GLUON_CONFIG
    tma = TMA_CONFIGS.get(key)
    if tma is not None and page_size is not None and heads_kv == 1 and page_size % tma.block_n == 0:
        return tma
    if page_size is not None and page_size < 64 and key in SMALL_PAGE_CONFIGS:
        return SMALL_PAGE_CONFIGS[key]
    return CONFIGS[key]


def num_m_tiles(rows: int, cfg: KernelConfig) -> int:
    return triton.cdiv(rows, cfg.block_m)


def effective_splits(cfg: KernelConfig, head_dim_v: int) -> tuple[int, int]:
    """(v_split, qk_chunk) clipped to D_v (D_v is a power of two >= 128 or the whole width)."""
    return _clip_splits(cfg.v_split, cfg.qk_chunk, head_dim_v)


def _clip_splits(v_split: int, qk_chunk: int, head_dim_v: int) -> tuple[int, int]:
    v_split = v_split if head_dim_v % v_split == 0 and head_dim_v // v_split >= 16 else 1
    qk_chunk = min(qk_chunk, head_dim_v)
    if head_dim_v % qk_chunk:
        qk_chunk = head_dim_v
    return v_split, qk_chunk


def programs_per_tile(cfg: KernelConfig, head_dim_v: int) -> int:
    return effective_splits(cfg, head_dim_v)[0]


def tma_fits(*, kv_format: str, sparse: bool, page_size: int, heads_kv: int, block_n: int, v_split: int,
             qk_chunk: int, head_dim_v: int) -> bool:
    """The problem half of :func:`tma_applies`: a bf16/fp16 cache (fp8 tiles by TMA measured no faster than the
    gather on the H100, and fp8_ds_mla's faulted: [notes]), dense, with one KV head; pages holding whole tiles;
    the K tile reused as V (``v_split``, ``qk_chunk`` as clipped by :func:`effective_splits`)."""
    return (kv_format in ("bf16", "fp16") and not sparse and heads_kv == 1 and page_size % block_n == 0
            and v_split == 1 and qk_chunk == head_dim_v)


def tma_applies(cfg_tma: bool, kv, *, kv_format: str, sparse: bool, block_n: int, v_split: int, qk_chunk: int,
                head_dim_v: int, traced: bool) -> bool:
    """Whether a launch takes the TMA path: asked for by the config; the problem fits (:func:`tma_fits`); an
    NVIDIA GPU with TMA (SM90+) or Triton's interpreter; a plain launch (a ``wrap_triton`` launch traced by
    torch.compile / export runs the gathered loads: same results); the cache ``kv`` laid out contiguously
    (16-byte aligned base, fewer than 2^31 token rows)."""
    nb, page_size, h_kv, _ = kv.shape
    if not cfg_tma or traced or not tma_fits(kv_format=kv_format, sparse=sparse, page_size=page_size, heads_kv=h_kv,
                                             block_n=block_n, v_split=v_split, qk_chunk=qk_chunk,
                                             head_dim_v=head_dim_v):
        return False
    if not kv.is_contiguous() or kv.data_ptr() % 16 or nb * page_size >= 2**31:
        return False
    if kv.device.type == "cpu":
        return True  # the interpreter
    return kv.device.type == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability(kv.device)[0] >= 9


def tma_descriptors(t, head_dim_v: int, block_rows: int):
    """(latent, RoPE) host tensor descriptors over ``t`` ``[n0, n1, 1, D_qk]`` (bf16 or fp16, contiguous) viewed as
    ``[n0 * n1, D_qk]`` rows, with blocks of ``block_rows`` rows: the cache's token rows for :func:`_tma_tile`
    (``block_rows = BLOCK_N``), or q's ``[B * s_q, h_q, 1, D_qk]`` query rows (``BLOCK_M``). The RoPE descriptor is
    None without a RoPE part."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows, width = t.shape[0] * t.shape[1], t.shape[-1]
    flat = t.view(rows, width)
    # the same geometry every call of a plan: built and checked once, copied with the new base after (.descriptors)
    key = ("plain", rows, width, block_rows, head_dim_v, t.dtype)
    kd = rebased(key + ("latent",), flat, lambda f: TensorDescriptor(f, [rows, width], [width, 1],
                                                                     [block_rows, head_dim_v]))
    rd = rebased(key + ("rope",), flat, lambda f: TensorDescriptor(f, [rows, width], [width, 1],
                                                                   [block_rows, width - head_dim_v])) \
        if width > head_dim_v else None
    return kd, rd


def q_tma_applies(q) -> bool:
    """Whether the query tiles of a TMA launch come by TMA too: ``q`` contiguous (its rows consecutive per request,
    one KV head) with a 16-byte aligned base and fewer than 2^31 rows."""
    return q.is_contiguous() and q.data_ptr() % 16 == 0 and q.numel() // q.shape[-1] < 2**31


def launch_decode(q, kv, block_table, cache_seqlens, indices, kv_scale, schedule, out, lse, partial_out,
                  partial_lse, *, softmax_scale: float, causal: bool, kv_format: str, head_dim_v: int,
                  cfg: KernelConfig):
    """Launch :func:`mla_decode_kernel` over ``schedule`` (no allocation, no sync).

    Shapes: q ``[B, s_q, h_q, D_qk]``; kv ``[nb, ps, h_kv, D_qk or 656]``; out
    ``[B, s_q, h_q, D_v]``; lse ``[B, h_q, s_q]`` fp32; partial_out fp16
    ``[max_slots, s_q, h_q, 2 D_v]`` (rows in :data:`.combine.PARTIAL_ROW_FORMAT`); partial_lse fp32
    ``[max_slots, s_q, h_q]``.
    Returns Triton's launch handle (the compiled kernel; ``dev/bench_triton.py`` reads
    its registers). The backend launches through the registered op instead
    (:mod:`.ops`, ``torch.ops.mla_dispatch.triton_decode``). Raises ValueError if
    ``out.shape[-1] != head_dim_v``.
    """
    if out.shape[-1] != head_dim_v:
        raise ValueError(f"out.shape[-1]={out.shape[-1]} (expected head_dim_v={head_dim_v})")
    return launch_decode_kernel(
        mla_decode_kernel, q, kv, block_table, cache_seqlens, indices, kv_scale, schedule.items,
        schedule.part_offsets, out, lse, partial_out, partial_lse, softmax_scale=softmax_scale, causal=causal,
        kv_format=kv_format, block_m=cfg.block_m, block_n=cfg.block_n, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, tokens_on_m=cfg.tokens_on_m, v_split=cfg.v_split, qk_chunk=cfg.qk_chunk,
        max_registers=cfg.max_registers, tma=cfg.tma, gluon=cfg.gluon)


def launch_decode_kernel(kernel, q, kv, block_table, cache_seqlens, indices, kv_scale, items, part_offsets, out,
                         lse, partial_out, partial_lse, *, softmax_scale: float, causal: bool, kv_format: str,
                         block_m: int, block_n: int, num_warps: int, num_stages: int, tokens_on_m: bool,
                         v_split: int, qk_chunk: int, max_registers: int = 0, tma: bool = False,
                         gluon: bool = False, topk_length=None, attn_sink=None, extra_kv=None, extra_indices=None,
                         extra_topk_length=None):
    """The launch itself, on tensors and plain scalars: ``kernel[grid](...)``, with the kernel decided here, per call
    (the registered op's path; a plan's eager runs take the launch its plan froze, :mod:`.launch`).

    ``kernel`` is :func:`mla_decode_kernel` or ``torch.library.wrap_triton`` of it
    (inside the registered op). One program per (schedule part, tile): the grid is
    ``(num_parts, h_kv * v_split * m_tiles * (s_q if sparse else 1))`` with
    ``num_parts = part_offsets.shape[0] - 1``; ``D_v = out.shape[-1]``. Only shapes and
    strides are read on the host (no sync), so it traces with fake tensors. Sparse launches take FlashMLA's optional
    arguments (int32 ``[B]`` ``topk_length`` / ``extra_topk_length``, fp32 ``[h_q]`` ``attn_sink``, a second cache
    ``extra_kv`` in ``kv``'s format with int32 ``[B, s_q, extra_topk]`` ``extra_indices``), and ``cache_seqlens``
    then holds ``topk + extra_topk`` per request (the schedule's token axis).
    """
    batch, q_len, h_q, d_qk = q.shape
    _, page_size, h_kv, _ = kv.shape
    head_dim_v = out.shape[-1]
    sparse = indices is not None
    v_split, qk_chunk = _clip_splits(v_split, qk_chunk, head_dim_v)
    traced = not isinstance(kernel, (JITFunction, InterpretedFunction))
    use_tma = tma_applies(tma, kv, kv_format=kv_format, sparse=sparse, block_n=block_n, v_split=v_split,
                          qk_chunk=qk_chunk, head_dim_v=head_dim_v, traced=traced)
    q_tma = use_tma and q_tma_applies(q)
    if gluon and block_m == 64 and not tokens_on_m:
        from mla_dispatch.kernels.triton.gluon_sm90 import gluon_applies, launch_decode_gluon

        if gluon_applies(q, kv, kv_format=kv_format, sparse=sparse, head_dim_v=head_dim_v, traced=traced):
            from mla_dispatch.kernels.triton.gluon_fp8 import fp8t_applies, launch_decode_fp8t
            from mla_dispatch.kernels.triton.gluon_seesaw import launch_decode_seesaw, seesaw_applies

            if fp8t_applies(q, kv, kv_format=kv_format):  # fp8_e4m3, <= 32 rows: tokens on M, a converting warpgroup
                return launch_decode_fp8t(q, kv, block_table, cache_seqlens, kv_scale, items, part_offsets, out, lse,
                                          partial_out, partial_lse, softmax_scale=softmax_scale, causal=causal)

            if seesaw_applies(kv):  # 16-bit caches on pages of whole tiles: two tiles in flight, one per warpgroup
                return launch_decode_seesaw(q, kv, block_table, cache_seqlens, items, part_offsets, out, lse,
                                            partial_out, partial_lse, softmax_scale=softmax_scale, causal=causal)
            return launch_decode_gluon(q, kv, block_table, cache_seqlens, kv_scale, items, part_offsets, out, lse,
                                       partial_out, partial_lse, softmax_scale=softmax_scale, causal=causal)
    grid, fixed, options = decode_kernel_fixed(
        batch=batch, q_len=q_len, h_q=h_q, d_qk=d_qk, page_size=page_size, h_kv=h_kv, head_dim_v=head_dim_v,
        block_table=block_table, seqlens=cache_seqlens, items=items, part_offsets=part_offsets,
        partial_out=partial_out, partial_lse=partial_lse, softmax_scale=softmax_scale, causal=causal,
        kv_format=kv_format, sparse=sparse, block_m=block_m, block_n=block_n, num_warps=num_warps,
        num_stages=num_stages, tokens_on_m=tokens_on_m, v_split=v_split, qk_chunk=qk_chunk,
        max_registers=max_registers if isinstance(kernel, JITFunction) else 0, tma=use_tma, q_tma=q_tma,
        device_is_cuda=kv.device.type == "cuda", topk=indices.shape[-1] if sparse else 0,
        has_topk_length=topk_length is not None, has_sink=attn_sink is not None,
        extra_page_size=extra_kv.shape[1] if extra_kv is not None else 0,
        has_extra_topk_length=extra_topk_length is not None)
    call = decode_kernel_call(q, kv, kv_scale, indices, out, lse, tma=use_tma, q_tma=q_tma, head_dim_v=head_dim_v,
                              block_m=block_m, block_n=block_n, kv_format=kv_format, topk_length=topk_length,
                              attn_sink=attn_sink, extra_kv=extra_kv, extra_indices=extra_indices,
                              extra_topk_length=extra_topk_length)
    with kernel_device(q):  # Triton launches on the current device, not the tensors'
        return kernel[grid](**fixed, **call, **options)


def decode_kernel_fixed(*, batch: int, q_len: int, h_q: int, d_qk: int, page_size: int, h_kv: int, head_dim_v: int,
                        block_table, seqlens, items, part_offsets, partial_out, partial_lse, softmax_scale: float,
                        causal: bool, kv_format: str, sparse: bool, block_m: int, block_n: int, num_warps: int,
                        num_stages: int, tokens_on_m: bool, v_split: int, qk_chunk: int, max_registers: int,
                        tma: bool, q_tma: bool, device_is_cuda: bool, topk: int = 0, has_topk_length: bool = False,
                        has_sink: bool = False, extra_page_size: int = 0, has_extra_topk_length: bool = False):
    """``(grid, arguments, launch options)`` of :func:`mla_decode_kernel` that a plan fixes: everything but what
    :func:`decode_kernel_call` gives per call. ``v_split`` / ``qk_chunk`` as clipped (:func:`_clip_splits`); ``tma``
    and ``q_tma`` as decided for the launch (:func:`tma_applies`, :func:`q_tma_applies`); ``max_registers`` 0 where the
    launch takes no register cap (the interpreter; torch's wrap_triton forwards no ``maxnreg``). Sparse launches:
    ``topk`` the width of the indices, and which of the optional sparse arguments every call gives (the ``HAS_*``
    constexprs; ``extra_page_size`` > 0: an extra cache of that page size)."""
    group = h_q // h_kv
    rows = group if sparse else q_len * group
    tiles_m = -(-rows // block_m)  # (cdiv; triton.cdiv is a constexpr function, slow on the host)
    grid = (part_offsets.shape[0] - 1, h_kv * v_split * tiles_m * (q_len if sparse else 1))
    fixed = dict(
        BlockTable=block_table if block_table is not None else seqlens,  # a dummy pointer when sparse
        Seqlens=seqlens, Items=items, PartOffsets=part_offsets, PartialOut=partial_out, PartialLse=partial_lse,
        qk_scale=softmax_scale * 1.4426950408889634, q_len=q_len, group=group,
        stride_bt=block_table.stride(0) if block_table is not None else 0,
        stride_pob=partial_out.stride(0), stride_pos=partial_out.stride(1), stride_poh=partial_out.stride(2),
        stride_plb=partial_lse.stride(0), stride_pls=partial_lse.stride(1), stride_plh=partial_lse.stride(2),
        H_KV=h_kv, NUM_M_TILES=tiles_m, PAGE_SIZE=page_size, D_V=head_dim_v, D_ROPE=d_qk - head_dim_v,
        BLOCK_M=block_m, BLOCK_N=block_n, V_SPLIT=v_split, QK_CHUNK=qk_chunk, KV_FORMAT=KV_FORMAT_CODES[kv_format],
        CAUSAL=causal, SPARSE=sparse, TOKENS_ON_M=tokens_on_m, TMA=tma, ASM_PAGE=tma and device_is_cuda, Q_TMA=q_tma,
        HAS_TOPK_LENGTH=has_topk_length, HAS_SINK=has_sink, HAS_EXTRA=extra_page_size > 0,
        HAS_EXTRA_TOPK_LENGTH=has_extra_topk_length,
    )
    if sparse:
        fixed["topk"] = topk
    else:
        fixed.update(Indices=seqlens, stride_ib=0, stride_is=0)  # dummies
    if extra_page_size:
        fixed["EXTRA_PAGE_SIZE"] = extra_page_size
    if kv_format != "fp8_e4m3":
        fixed["KVScale"] = seqlens  # a dummy pointer
    if not tma:
        fixed.update(KDesc=None, RDesc=None)
    if not q_tma:
        fixed.update(QDesc=None, QRDesc=None)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if max_registers:
        options["maxnreg"] = max_registers
    return grid, fixed, options


#: the per-call arguments of :func:`mla_decode_kernel` that come with an extra cache (:func:`decode_kernel_call`)
EXTRA_CACHE_ARGS = ("ExtraKV", "ExtraIndices", "stride_ekb", "stride_ekt", "stride_ekh", "stride_eib", "stride_eis",
                    "extra_num_blocks")


def decode_kernel_call(q, kv, kv_scale, indices, out, lse, *, tma: bool, q_tma: bool, head_dim_v: int, block_m: int,
                       block_n: int, kv_descriptors=None, kv_format: str | None = None, topk_length=None,
                       attn_sink=None, extra_kv=None, extra_indices=None, extra_topk_length=None) -> dict:
    """The arguments of :func:`mla_decode_kernel` that change per call (layer): q, the cache, the scale, the sparse
    indices, out and lse, their strides, the cache's block count and the TMA descriptors over q and the cache
    (``kv_descriptors``: a function of the cache giving its pair, for a caller that keeps them); and a sparse call's
    optional arguments where given (``topk_length``, ``attn_sink``, the extra cache with its indices and
    ``extra_topk_length``: :data:`EXTRA_CACHE_ARGS`). ``kv_format="fp8_ds_v4"``: a token's data bytes are 576 apart in
    its block (the tensor's dim-1 stride, 584, is the layout's size per token, not the distance between tokens)."""
    v4 = kv_format == "fp8_ds_v4"
    call = dict(Q=q, KV=kv, Out=out, Lse=lse,
                stride_qb=q.stride(0), stride_qs=q.stride(1), stride_qh=q.stride(2),
                stride_kb=kv.stride(0), stride_kt=DS_V4_DATA_BYTES if v4 else kv.stride(1), stride_kh=kv.stride(2),
                stride_ob=out.stride(0), stride_os=out.stride(1), stride_oh=out.stride(2),
                stride_lb=lse.stride(0), stride_lh=lse.stride(1), stride_ls=lse.stride(2),
                num_blocks=kv.shape[0])
    if indices is not None:
        call.update(Indices=indices, stride_ib=indices.stride(0), stride_is=indices.stride(1))
    if kv_scale is not None:
        call["KVScale"] = kv_scale
    if tma:
        call["KDesc"], call["RDesc"] = (kv_descriptors(kv) if kv_descriptors is not None
                                        else tma_descriptors(kv, head_dim_v, block_n))
    if q_tma:
        batch, q_len, h_q, d_qk = q.shape
        call["QDesc"], call["QRDesc"] = tma_descriptors(q.view(batch * q_len, h_q, 1, d_qk), head_dim_v, block_m)
    if topk_length is not None:
        call["TopkLength"] = topk_length
    if attn_sink is not None:
        call["AttnSink"] = attn_sink
    if extra_kv is not None:
        call.update(ExtraKV=extra_kv, ExtraIndices=extra_indices, stride_ekb=extra_kv.stride(0),
                    stride_ekt=DS_V4_DATA_BYTES if v4 else extra_kv.stride(1), stride_ekh=extra_kv.stride(2),
                    stride_eib=extra_indices.stride(0), stride_eis=extra_indices.stride(1),
                    extra_num_blocks=extra_kv.shape[0])
        if extra_topk_length is not None:
            call["ExtraTopkLength"] = extra_topk_length
    return call
