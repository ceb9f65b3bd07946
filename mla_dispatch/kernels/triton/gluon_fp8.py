"""Split-KV paged MLA decode of fp8_e4m3 caches for Hopper (sm_90) in Gluon: tokens on M, three warpgroups.

Why a third Gluon kernel
------------------------
:mod:`.gluon_sm90` reads fp8_e4m3 caches at ~0.8x the bf16 throughput of the same config (H100, b=64 L=8K; the
issue's target is 1.6x): the eight warps gather a tile, all of them convert it to fp16, then all of them compute on it,
so the conversion sits between every tile's copies and its wgmma; and with heads on M, 16 or 32 query rows still pay
for 64-row matrix instructions ([notes], "fp8_e4m3 in the Gluon kernel").

This kernel takes the two fixes named there, for at most 32 query rows (``s_q * h_q``; tensor-parallel DeepSeek has
16 heads per GPU):

* **Tokens on M** (the transposed pipeline of FlashMLA-ETAP, Dege et al. 2025): ``S^T = K Q^T`` is ``[64 tokens, R]``
  and ``O^T = V^T P^T`` is ``[512 channels, R]`` with ``R`` = 16 or 32 query rows per program, so the tensor work per
  tile scales with the rows instead of being padded to 64. V^T is the latent part of the same fp16 tile, read
  transposed (wgmma takes a transposed A operand from shared memory for 16-bit types).
* **The conversion off the critical path** (FlashMLA's fp8 kernels dequantise in a warpgroup of their own): three
  partitions of four warps (``gl.warp_specialize``):

  - the *converter* loads a tile's fp8 rows into registers as int32 words (16-byte loads, each token row from its own
    page, so any page size; a tile ahead, two tiles in flight, the tile after that already asked of L2 with
    ``cp.async.bulk.prefetch.L2``), converts them (``cvt.rn.f16x2.e4m3x2``) and stores fp16 into one of two
    shared-memory stages; it also asks L2 for each item's query tile, the first before any tile, the next ~4 tiles
    before an item's end, so that the scorer's TMA of it does not queue behind the tiles' loads;
  - the *scorer* computes S^T, the softmax over tokens and P^T (shared memory), with FlashAttention-4's conditional
    rescaling: the reference maximum of a row moves only when a score passes it by more than 2^8;
  - the *accumulator* computes O^T from P^T.

  Each tile's K and V are read by the tensor cores once (S^T by the scorer, O^T by the accumulator).

Per program a ``[R, 576]`` query tile by TMA; a bf16 query is converted to fp16 in place, each row times the power of
two that puts its largest magnitude in ``[2^14, 2^15)`` and S's columns by the inverse (as
:func:`.gluon_sm90._query_to_fp16`). The per-tensor scale multiplies S and O, not the tile. Shared memory: 2 x 72 KB of
fp16 stages, the query tile (18 / 36 KB), 2 x P^T: 171 / 194 KB.

The rest is the other Gluon kernels' contract: one program per (schedule part, R-row tile), items of the shared split-KV
schedule, online softmax in base 2, natural-log LSE, split items written as fp16 partial rows with one power-of-two
scale per row (:data:`.combine.PARTIAL_ROW_FORMAT`) for the same combine. Tokens at or past an item's end are loaded as
zeros (masked loads and prefetches: a cache slot past a request's length, possibly NaN, and its table entry are never
read) and their scores masked to -inf.

H100, b=64 L=8K, graph replays ([notes], "fp8_e4m3 with tokens on M"): 16 heads 140.9-144.8 us
(1.59-1.63x bf16's 229-230), 32 heads 157.7-160.5 us (1.47-1.50x), against 292.8 / 305.8 us for the kernels that ran
them before; with the query tiles asked of L2 (twenty-ninth session) 143.7 us (1.60x) and 152.0 us (1.55x).

Applies (:func:`fp8t_applies`): where :func:`.gluon_sm90.gluon_applies` does, to fp8_e4m3 caches with at most
``MAX_ROWS`` query rows (a plan may keep gluon_sm90 there: ``backend_options={"kernel": "gluon"}``). 64 rows do not fit: a 72 KB query tile beside two 72 KB stages.
"""

# [notes]: docs/notes/triton.md, the development history these comments cite
from __future__ import annotations

import torch
import triton

from mla_dispatch.kernels.triton import gluon_sm90 as _g
from mla_dispatch.kernels.triton.fp8t_limits import FP8T_MAX_ROWS
from mla_dispatch.kernels.triton.device import kernel_device

if _g.GLUON_API:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    _cta_barrier = _g._cta_barrier
    _tma_load = _g._tma_load

__all__ = ["MAX_ROWS", "fp8t_applies", "launch_decode_fp8t", "rows_per_program"]

BLOCK_N = 64  # tokens per tile: the M of S^T's wgmma
RESCALE = 8.0  # log2 of how far a score may exceed the reference maximum before it moves (see _consumer)
MAX_ROWS = FP8T_MAX_ROWS  # query rows at most (the N of both wgmma)
#: registers per thread of the scorer and the accumulator partitions by rows per program (setmaxnreg; O^T takes 4 R of
#: the accumulator's): no spill in either loop (triton 3.6); the converter (the default partition) gets the rest of the
#: 512 per thread of a 128-thread warpgroup, at most 256
CONSUMER_REGS = {16: (96, 120), 32: (128, 176)}


def rows_per_program(rows: int) -> int:
    """``R``: the query rows a program covers, 16 or 32 (``s_q * h_q`` rounded up to a power of two, at least 16)."""
    return max(16, triton.next_power_of_2(rows))


def fp8t_applies(q, kv, *, kv_format: str) -> bool:
    """This kernel's own conditions on top of :func:`.gluon_sm90.gluon_applies`: an fp8_e4m3 cache and at most
    ``MAX_ROWS`` query rows (``s_q * h_q``). (A plan may keep :mod:`.gluon_sm90`'s kernel there instead:
    ``backend_options={"kernel": "gluon"}``, :mod:`.launch`.)"""
    return kv_format == "fp8_e4m3" and q.shape[1] * q.shape[2] <= MAX_ROWS


if _g.GLUON_API:
    _N = gl.constexpr(BLOCK_N)
    RESCALE_LOG2 = gl.constexpr(RESCALE)

    @gluon.jit
    def _load_fp8(KV32, pages, start, tok_end, stride_kt, PAGE_SIZE: gl.constexpr, ld: gl.constexpr):
        """The fp8 rows of the 64-token tile from ``start`` into registers as int32 words (four e4m3 values each; a
        tensor of fp8 carried through a loop takes a register per byte): five ``[64, 32]`` / ``[64, 16]`` pieces (latent
        bytes 0-127, ..., 384-511, RoPE), converted and stored one at a time. Each token row from its page
        (``pages``, :func:`.gluon_sm90._tile_pages`), zeros at or past ``tok_end`` (masked: nothing read there)."""
        rows = gl.arange(0, _N, layout=gl.SliceLayout(1, ld))
        cols = gl.arange(0, 32, layout=gl.SliceLayout(0, ld))
        tok = start + rows
        valid = (tok < tok_end)[:, None]
        base = (KV32 + (pages.to(gl.int64) * PAGE_SIZE + tok % PAGE_SIZE) * stride_kt)[:, None]
        x0 = gl.load(base + cols[None, :], mask=valid, other=0)
        x1 = gl.load(base + (32 + cols)[None, :], mask=valid, other=0)
        x2 = gl.load(base + (64 + cols)[None, :], mask=valid, other=0)
        x3 = gl.load(base + (96 + cols)[None, :], mask=valid, other=0)
        cols_r = gl.arange(0, 16, layout=gl.SliceLayout(0, ld))
        xr = gl.load(base + (128 + cols_r)[None, :], mask=valid, other=0)
        return x0, x1, x2, x3, xr

    @gluon.jit
    def _prefetch_l2(KV32, pages, start, tok_end, stride_kt, PAGE_SIZE: gl.constexpr):
        """Ask L2 for the rows of the 64-token tile from ``start`` that lie before ``tok_end``
        (``cp.async.bulk.prefetch.L2``; ``pages`` from :func:`.gluon_sm90._tile_pages` in a one-row-per-thread layout):
        the converter's register loads of that tile, two iterations later, then wait for L2 rather than DRAM. Profiled
        without it (H100, 16 heads), the converter spent most of its time waiting for the loads of the tile it had
        issued one iteration before. On pages of whole tiles (the schedule's items start on 64-token chunks) the tile is
        one contiguous range and one prefetch; on shorter pages one per 576-byte row."""
        rows = gl.arange(0, _N, layout=pages.type.layout)
        tok = start + rows
        if PAGE_SIZE % 64 == 0:
            ptr = KV32 + (pages.to(gl.int64) * PAGE_SIZE + start % PAGE_SIZE) * stride_kt
            nbytes = gl.minimum(tok_end - start, _N) * 576 + rows * 0
            pred = (rows == 0) & (start < tok_end)
        else:
            ptr = KV32 + (pages.to(gl.int64) * PAGE_SIZE + tok % PAGE_SIZE) * stride_kt
            nbytes = rows * 0 + 576
            pred = tok < tok_end
        _bulk_prefetch_l2(ptr, pred, nbytes)

    @gluon.jit
    def _bulk_prefetch_l2(ptr, pred, nbytes):
        """``cp.async.bulk.prefetch.L2`` of ``nbytes`` (a multiple of 16) from ``ptr`` where ``pred`` holds (tensors of
        one layout: each element that holds issues one)."""
        gl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $3; mov.u32 $0, 0; }",
            "=r,l,r,r", [ptr, pred.to(gl.int32), nbytes], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _prefetch_q(Q, Items, item, item_end, rows_total, m_tile, q_rows, R: gl.constexpr, pf: gl.constexpr):
        """Ask L2 for the query tile of work item ``item`` if it is one of this program's (``< item_end``): its ``R``
        rows from row ``req * rows_total + m_tile * R`` of q viewed as ``[q_rows, 576]``, clipped to the view, so that
        the scorer's TMA of them hits L2. The CUDA kernel's fp8 mainloop measured its first item's query tile queued
        behind the tiles' loads at a CTA's start, 12.6 -> 7.7 us with this (docs/notes/cuda_sm90.md,
        twenty-eighth session)."""
        ok = item < item_end
        req = gl.load(Items + item * 4, mask=ok, other=0)  # (masked: nothing read past the program's entries)
        row0 = req * rows_total + m_tile * R
        n = gl.minimum(q_rows - row0, R)
        lanes = gl.arange(0, _N, layout=pf)
        ptr = Q + row0.to(gl.int64) * 576 + lanes * 0
        _bulk_prefetch_l2(ptr, (lanes == 0) & ok & (n > 0), n * 1152 + lanes * 0)

    @gluon.jit
    def _e4m3_words_to_f16(w):
        """int32 words of four e4m3 values ``[64, C]`` -> int32 words of two fp16 values ``[64, 2 C]``, in order (one
        ``cvt.rn.f16x2.e4m3x2`` per pair, the conversion :mod:`.gluon_sm90` measured fastest)."""
        lo, hi = gl.inline_asm_elementwise(
            "{ .reg .b16 a, b; mov.b32 {a, b}, $2; cvt.rn.f16x2.e4m3x2 $0, a; cvt.rn.f16x2.e4m3x2 $1, b; }",
            "=r,=r,r", [w], dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
        return gl.reshape(gl.join(lo, hi), [w.shape[0], 2 * w.shape[1]])

    @gluon.jit
    def _store_fp16(x0, x1, x2, x3, xr, kbuf, rbuf):
        """The pieces of :func:`_load_fp8` converted to fp16 into ``kbuf`` (latent) / ``rbuf`` (RoPE), one at a time,
        through int32 views of the two buffers (the same bytes: the 128-byte swizzle is a function of the byte
        offset)."""
        w32: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
        k32 = _g._view(kbuf, gl.int32, [_N, 256], w32)
        r32 = _g._view(rbuf, gl.int32, [_N, 32], w32)
        k32.slice(0, 64, dim=1).store(_e4m3_words_to_f16(x0))
        k32.slice(64, 64, dim=1).store(_e4m3_words_to_f16(x1))
        k32.slice(128, 64, dim=1).store(_e4m3_words_to_f16(x2))
        k32.slice(192, 64, dim=1).store(_e4m3_words_to_f16(x3))
        r32.store(_e4m3_words_to_f16(xr))

    @gluon.jit
    def _put_tile(x0, x1, x2, x3, xr, bad, k_smem, r_smem, bad_smem, bars, it):
        """Tile ``it`` of this program (fp8 words in registers, :func:`_load_fp8`) into stage ``it % 2`` as fp16, and
        which of its token rows had a bad block id (``bad``, from :func:`.gluon_sm90._tile_pages`: those rows read block
        0) into the stage's row of ``bad_smem`` for the scorer, once both consumers have released the stage (a fresh
        barrier's wait for the previous phase passes), then the stage's ``full``."""
        st = it % 2
        mbarrier.wait(bars.index(2 + st), ((it // 2) & 1) ^ 1)
        _store_fp16(x0, x1, x2, x3, xr, k_smem.index(st), r_smem.index(st))
        bad_smem.index(st).store(bad)
        fence_async_shared()
        _cta_barrier()
        mbarrier.arrive(bars.index(st))

    @gluon.jit
    def _converter(args):
        """The converting partition (``args``: the cache and its table, the schedule, the stages and their barriers):
        every tile of every item of this program, fp8 rows loaded a tile ahead (registers) and asked of L2 two ahead,
        converted to fp16 into stage ``it % 2`` (:func:`_put_tile`).

        The loop takes two tiles per iteration, one in each of two register sets (``x*`` / ``y*``), so that no set is
        copied into the other: with one set per iteration, the copy of the next tile's registers at the back edge
        waited for their loads (H100 profile: the converter's top stall), and the load latency was not hidden."""
        (KV32, BlockTable, Seqlens, Items, PartOffsets, k_smem, r_smem, bad_smem, bars, stride_kt, stride_bt,
         num_blocks, PAGE_SIZE, Q, q_rows, rows_total, R) = args
        # 16-byte loads; four threads cover 64 bytes of a row, eight rows per warp: each warp's stores touch 8 rows of
        # one 128-byte swizzle span (no bank conflicts) and its loads 64-byte pieces of 8 token rows
        ld: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])
        row_ld: gl.constexpr = gl.SliceLayout(1, ld)  # token rows of a tile
        pf: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])  # token rows for the L2 prefetches
        part = gl.program_id(0)
        item_begin = gl.load(PartOffsets + part)
        item_end = gl.load(PartOffsets + part + 1)
        m_tile = gl.program_id(1)
        it = 0
        # the first item's query tile into L2 before any tile's loads (H100, b=64 L=8K fp8_e4m3, graph us, with
        # against without both prefetches, same call: 16 heads 143.7 / 144.0, 32 heads 152.0 / 158.7; [notes])
        _prefetch_q(Q, Items, item_begin, item_end, rows_total, m_tile, q_rows, R, pf)
        for item in range(item_begin, item_end):
            req, tok_begin, tok_end, slot, seqlen = _g._item_meta(Items, Seqlens, item)
            bt_row = BlockTable + req.to(gl.int64) * stride_bt
            n_tiles = gl.cdiv(tok_end - tok_begin, _N)
            j_qpf = gl.maximum(n_tiles - 4, 0) // 2 * 2  # the next item's query tile into L2 ~4 tiles before the end
            # pages of bad block ids come as 0 with their rows flagged (bx, by, bb, ba), which go with the tile to the
            # scorer; the prefetches' flags are not needed (the same entries reach the register loads)
            pages, bx = _g._tile_pages(bt_row, tok_begin, tok_end, num_blocks, PAGE_SIZE, _N, True, row_ld)
            x0, x1, x2, x3, xr = _load_fp8(KV32, pages, tok_begin, tok_end, stride_kt, PAGE_SIZE, ld)
            # table entries: of tiles j + 1 / j + 2 for the register loads (pb / pa), of tiles j + 2 / j + 3 for the L2
            # prefetches (fa / fb); each set is read a whole iteration before its use
            pb, bb = _g._tile_pages(bt_row, tok_begin + _N, tok_end, num_blocks, PAGE_SIZE, _N, True, row_ld)
            pa, ba = _g._tile_pages(bt_row, tok_begin + 2 * _N, tok_end, num_blocks, PAGE_SIZE, _N, True, row_ld)
            f1, _f = _g._tile_pages(bt_row, tok_begin + _N, tok_end, num_blocks, PAGE_SIZE, _N, True, pf)
            _prefetch_l2(KV32, f1, tok_begin + _N, tok_end, stride_kt, PAGE_SIZE)
            fa, _f = _g._tile_pages(bt_row, tok_begin + 2 * _N, tok_end, num_blocks, PAGE_SIZE, _N, True, pf)
            fb, _f = _g._tile_pages(bt_row, tok_begin + 3 * _N, tok_end, num_blocks, PAGE_SIZE, _N, True, pf)
            for j in range(0, n_tiles, 2):
                start = tok_begin + j * _N
                # tile j + 1 into the y registers (all masked past the item's last tile), in flight while tile j is
                # stored; tile j + 2 into L2
                y0, y1, y2, y3, yr = _load_fp8(KV32, pb, start + _N, tok_end, stride_kt, PAGE_SIZE, ld)
                by = bb
                pb, bb = _g._tile_pages(bt_row, start + 3 * _N, tok_end, num_blocks, PAGE_SIZE, _N, True, row_ld)
                _prefetch_l2(KV32, fa, start + 2 * _N, tok_end, stride_kt, PAGE_SIZE)
                fa, _f = _g._tile_pages(bt_row, start + 4 * _N, tok_end, num_blocks, PAGE_SIZE, _N, True, pf)
                if j == j_qpf:
                    _prefetch_q(Q, Items, item + 1, item_end, rows_total, m_tile, q_rows, R, pf)
                _put_tile(x0, x1, x2, x3, xr, bx, k_smem, r_smem, bad_smem, bars, it)
                it += 1
                # tile j + 2 into the x registers while tile j + 1 is stored; tile j + 3 into L2
                x0, x1, x2, x3, xr = _load_fp8(KV32, pa, start + 2 * _N, tok_end, stride_kt, PAGE_SIZE, ld)
                bx = ba
                pa, ba = _g._tile_pages(bt_row, start + 4 * _N, tok_end, num_blocks, PAGE_SIZE, _N, True, row_ld)
                _prefetch_l2(KV32, fb, start + 3 * _N, tok_end, stride_kt, PAGE_SIZE)
                fb, _f = _g._tile_pages(bt_row, start + 5 * _N, tok_end, num_blocks, PAGE_SIZE, _N, True, pf)
                if j + 1 < n_tiles:
                    _put_tile(y0, y1, y2, y3, yr, by, k_smem, r_smem, bad_smem, bars, it)
                    it += 1

    @gluon.jit
    def _q_operands(q_smem, qr_smem, i, ROWS: gl.constexpr):
        """Query tile ``i`` (latent, RoPE) as the fp16 operands of S^T's wgmma: the buffers themselves for an fp16
        query, their bytes viewed as fp16 for a bf16 one (converted in place by :func:`.gluon_sm90._query_to_fp16`)."""
        q_in = q_smem.index(i)
        qr_in = qr_smem.index(i)
        if q_smem.dtype == gl.float16:
            return q_in, qr_in
        else:
            q_layout: gl.constexpr = q_in.layout
            qr_layout: gl.constexpr = qr_in.layout
            return (_g._view(q_in, gl.float16, [ROWS, 512], q_layout),
                    _g._view(qr_in, gl.float16, [ROWS, 64], qr_layout))

    @gluon.jit
    def _consumer(args, WG: gl.constexpr):
        """Consumer ``WG``. 0, the scorer: the query tile, then per tile S^T, the softmax over tokens (the reference
        maximum and the sums of every query row), P^T and the rescale factors into shared memory; at the end the LSE.
        1, the accumulator: O^T from the scorer's P^T for every tile, then out (or the partial rows). Each releases a
        stage when it is done with it.

        Splitting the work this way has each tile's K and V read by the tensor cores once. The first version split the
        query rows between the two (each computing S^T and O^T for half of them): with tokens on M every wgmma over a
        tile reads all of the tile from shared memory whatever its N, and at 16 rows the double reads kept shared memory
        ~80% busy (H100 profile). Giving the scorer half of O^T's channels as well measured no faster (16 and 32 rows).

        ``bars`` rows: 0-1 the stages' ``full`` (converter -> consumers), 2-3 their ``empty`` (count 2: both consumers
        -> converter), 4-5 ``P^T ready`` (scorer -> accumulator, by stage), 6 the query tile, 7 the item's row sums
        (count 2: both arrive, so that neither runs an item ahead of the other's reads)."""
        (q_desc, qr_desc, KVScale, Seqlens, Items, PartOffsets, Out, Lse, PartialOut, PartialLse,
         q_smem, qr_smem, qd_smem, k_smem, r_smem, p_smem, a_smem, l_smem, bad_smem, bars,
         qk_scale, q_len, group,
         stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
         stride_pob, stride_pos, stride_poh, stride_plb, stride_pls, stride_plh, CAUSAL) = args
        R: gl.constexpr = q_smem.shape[1]
        LN2: gl.constexpr = 0.6931471805599453
        dtype: gl.constexpr = q_desc.dtype
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, R, 16])  # S^T [64, R] and O^T [512, R]
        tok_l: gl.constexpr = gl.SliceLayout(1, layout)  # along tokens (S^T's M) or channels (O^T's M)
        row_l: gl.constexpr = gl.SliceLayout(0, layout)  # along query rows (N)
        q_bar = bars.index(6)
        sums = bars.index(7)
        kv_scale = gl.load(KVScale)

        part = gl.program_id(0)
        m_tile = gl.program_id(1)
        rows_total = q_len * group
        flat = m_tile * R + gl.arange(0, R, layout=row_l)
        q_tok = flat // group
        head = flat % group
        row_ok = flat < rows_total
        item_begin = gl.load(PartOffsets + part)
        item_end = gl.load(PartOffsets + part + 1)
        it = 0
        n_items = 0
        for item in range(item_begin, item_end):
            req, tok_begin, tok_end, slot, seqlen = _g._item_meta(Items, Seqlens, item)
            n_tiles = gl.cdiv(tok_end - tok_begin, _N)
            par = n_items & 1
            if WG == 0:
                if CAUSAL:
                    limit = gl.minimum(seqlen - q_len + 1 + q_tok, tok_end)
                else:
                    limit = gl.minimum(seqlen, tok_end) + q_tok * 0
                # the query tile (q viewed as [B * s_q * h_q, 576]: rows past the request's are computed, never
                # stored); S^T of the previous item is done (it waited for every wgmma)
                q_row0 = req * rows_total + m_tile * R
                mbarrier.expect(q_bar, R * 576 * 2)
                _tma_load(q_desc, [q_row0, 0], q_bar, q_smem.index(0))
                _tma_load(qr_desc, [q_row0, 512], q_bar, qr_smem.index(0))
                mbarrier.wait(q_bar, par)
                if dtype == gl.float16:
                    s_cols = qk_scale * kv_scale + gl.zeros([R], gl.float32, layout=row_l)
                else:
                    q_op, qr_op = _q_operands(q_smem, qr_smem, 0, R)
                    # 8 rows x 256 / 64 columns a pass over the four warps
                    _g._query_to_fp16(q_smem.index(0), qr_smem.index(0), q_op, qr_op, qd_smem, R, 8,
                                      gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0]),
                                      gl.BlockedLayout([1, 2], [1, 32], [4, 1], [1, 0]))
                    fence_async_shared()
                    _cta_barrier()
                    s_cols = qk_scale * kv_scale * qd_smem.load(row_l)
                m_i = gl.full([R], float("-inf"), gl.float32, layout=row_l)
                l2 = gl.zeros([_N, R], gl.float32, layout=layout)  # per-thread row sums, reduced in the epilogue
                poison = gl.zeros([_N], gl.int32, layout=tok_l)  # token rows whose block id was bad (the converter's)
            else:
                acc = gl.zeros([512, R], gl.float32, layout=layout)
            for j in range(n_tiles):
                st = it % 2
                ph = (it // 2) & 1
                kbuf = k_smem.index(st)
                pbuf = p_smem.index(st)
                if WG == 0:
                    start = tok_begin + j * _N
                    mbarrier.wait(bars.index(st), ph)
                    poison = poison | bad_smem.index(st).load(tok_l)
                    # the query indexed with a zero the compiler cannot fold (tok_begin is loaded): its 36 k-steps'
                    # descriptors would otherwise be hoisted out of the loop and spill (as in gluon_seesaw._scores)
                    q_op, qr_op = _q_operands(q_smem, qr_smem, (start < 0).to(gl.int32), R)
                    s = warpgroup_mma(kbuf, q_op.permute((1, 0)), gl.zeros([_N, R], gl.float32, layout),
                                      use_acc=False, is_async=True)
                    s = warpgroup_mma(r_smem.index(st), qr_op.permute((1, 0)), s, is_async=True)
                    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
                    tok = start + gl.arange(0, _N, layout=tok_l)
                    s = gl.where(tok[:, None] < limit[None, :], s * s_cols[None, :], float("-inf"))
                    # the reference maximum moves only when a score exceeds it by more than 2^RESCALE_LOG2 (or a row
                    # sees its first key): P <= 2^8 is exact enough in fp16 and far from its range. The check is one
                    # reduction over the whole tile (two short chains of shuffles); the per-row maximum over the
                    # tile's tokens (a chain per column) runs only when it fires (FlashAttention-4's conditional
                    # rescaling). Profiled at 32 rows (H100), the per-row maximum of every tile took ~1/3 of this
                    # warpgroup's time, and this warpgroup bounded the kernel.
                    t = gl.where(s == float("-inf"), float("-inf"), s - m_i[None, :])
                    if gl.max(gl.max(t, 1), 0) > RESCALE_LOG2:
                        m_new = gl.maximum(m_i, gl.max(s, 0))
                        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
                        alpha = gl.exp2(m_i - m_safe)
                        p = gl.exp2(s - m_safe[None, :])
                        m_i = m_new
                    else:
                        alpha = gl.full([R], 1.0, gl.float32, layout=row_l)
                        p = gl.exp2(t)
                    l2 = l2 * alpha[None, :] + p
                    pbuf.store(gl.permute(p.to(gl.float16), (1, 0)))  # P^T's transpose [R, 64]: a K-major B
                    a_smem.index(st).store(alpha)
                    fence_async_shared()
                    _cta_barrier()
                    mbarrier.arrive(bars.index(4 + st))
                else:
                    mbarrier.wait(bars.index(4 + st), ph)
                    acc = acc * a_smem.index(st).load(row_l)[None, :]
                    acc = warpgroup_mma(kbuf.slice(0, 512, dim=1).permute((1, 0)), pbuf.permute((1, 0)), acc,
                                        is_async=True)
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                    _cta_barrier()  # every warp's share of the wgmma is done
                mbarrier.arrive(bars.index(2 + st))  # (the scorer is done with the stage once S^T is)
                it += 1

            # -- epilogue: the row sums from the scorer to the accumulator (NaN if a page of the item was a bad block id:
            # out and LSE NaN; 0: no key); natural-log LSE; out or partial rows ------------------------------------
            if WG == 0:
                l_smem.index(par).store(gl.where(gl.max(poison, 0) != 0, float("nan"), gl.sum(l2, 0)))
                _cta_barrier()
            mbarrier.arrive(sums)
            mbarrier.wait(sums, par)
            l_i = l_smem.index(par).load(row_l)
            has_key = l_i != 0.0
            if WG == 0:
                lse_nat = gl.where(has_key, (m_i + gl.log2(gl.where(has_key, l_i, 1.0))) * LN2, float("inf"))
                if slot < 0:  # the whole request
                    l_off = (req.to(gl.int64) * stride_lb + head.to(gl.int64) * stride_lh
                             + q_tok.to(gl.int64) * stride_ls)
                    gl.store(Lse + l_off, lse_nat, mask=row_ok)
                else:  # a piece of a split request
                    pl_off = (slot.to(gl.int64) * stride_plb + q_tok.to(gl.int64) * stride_pls
                              + head.to(gl.int64) * stride_plh)
                    gl.store(PartialLse + pl_off, gl.where(has_key, lse_nat, float("-inf")), mask=row_ok)
            else:
                o = acc * gl.where(has_key, kv_scale / gl.where(has_key, l_i, 1.0), 0.0)[None, :]  # V's fp8 scale
                ch = gl.arange(0, 512, layout=tok_l)
                if slot < 0:
                    o_off = (req.to(gl.int64) * stride_ob + q_tok.to(gl.int64) * stride_os
                             + head.to(gl.int64) * stride_oh)
                    gl.store(Out + o_off[None, :] + ch[:, None], o.to(Out.dtype.element_ty), mask=row_ok[None, :])
                else:  # PARTIAL_ROW_FORMAT: fp16 values and one power-of-two scale per row
                    p_off = (slot.to(gl.int64) * stride_pob + q_tok.to(gl.int64) * stride_pos
                             + head.to(gl.int64) * stride_poh)
                    up, down = _g._pow2_scale(gl.max(gl.abs(o), 0))
                    gl.store(PartialOut + p_off[None, :] + ch[:, None], (o * up[None, :]).to(gl.float16),
                             mask=row_ok[None, :])
                    gl.store((PartialOut + p_off + 512).to(gl.pointer_type(gl.float32)), down, mask=row_ok)
            n_items += 1

    @gluon.jit
    def mla_decode_fp8t_kernel(
        q_desc, qr_desc, Q, q_rows,
        KV32, KVScale, BlockTable, Seqlens, Items, PartOffsets,
        Out, Lse, PartialOut, PartialLse,
        qk_scale,  # softmax_scale * log2(e)
        q_len, group,  # s_q, h_q
        stride_kt, stride_bt,
        stride_ob, stride_os, stride_oh,
        stride_lb, stride_lh, stride_ls,
        stride_pob, stride_pos, stride_poh,
        stride_plb, stride_pls, stride_plh,
        num_blocks,  # kv.shape[0]: a block id outside [0, num_blocks) is not loaded, and its item's rows are NaN
        PAGE_SIZE: gl.constexpr, CAUSAL: gl.constexpr, R: gl.constexpr,
        SCORER_NUM_REGS: gl.constexpr, ACC_NUM_REGS: gl.constexpr,
    ):
        gl.static_assert(gl.num_warps() == 4)
        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [1, R, 512], q_desc.layout)  # [1, ...]: see _consumer's q_op
        qr_smem = gl.allocate_shared_memory(dtype, [1, R, 64], qr_desc.layout)
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        qd_smem = gl.allocate_shared_memory(gl.float32, [R], flat)
        k_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_N, 512], gl.float16)
        r_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_N, 64], gl.float16)
        k_smem = gl.allocate_shared_memory(gl.float16, [2, _N, 512], k_layout)
        r_smem = gl.allocate_shared_memory(gl.float16, [2, _N, 64], r_layout)
        p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([R, _N], gl.float16)
        p_smem = gl.allocate_shared_memory(gl.float16, [2, R, _N], p_layout)
        a_smem = gl.allocate_shared_memory(gl.float32, [2, R], flat)  # a tile's rescale factors, by stage
        l_smem = gl.allocate_shared_memory(gl.float32, [2, R], flat)  # an item's row sums, by item parity
        bad_smem = gl.allocate_shared_memory(gl.int32, [2, _N], flat)  # a tile's rows with a bad block id, by stage
        bars = gl.allocate_shared_memory(gl.int64, [8, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(bars.index(i), count=1)
            mbarrier.init(bars.index(2 + i), count=2)
            mbarrier.init(bars.index(4 + i), count=1)
        mbarrier.init(bars.index(6), count=1)
        mbarrier.init(bars.index(7), count=2)
        fence_async_shared()
        args = (q_desc, qr_desc, KVScale, Seqlens, Items, PartOffsets, Out, Lse, PartialOut, PartialLse,
                q_smem, qr_smem, qd_smem, k_smem, r_smem, p_smem, a_smem, l_smem, bad_smem, bars,
                qk_scale, q_len, group,
                stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
                stride_pob, stride_pos, stride_poh, stride_plb, stride_pls, stride_plh, CAUSAL)
        conv_args = (KV32, BlockTable, Seqlens, Items, PartOffsets, k_smem, r_smem, bad_smem, bars, stride_kt,
                     stride_bt, num_blocks, PAGE_SIZE, Q, q_rows, q_len * group, R)  # the converter's: what it reads
        gl.warp_specialize([(_converter, (conv_args, )), (_consumer, (args, 0)), (_consumer, (args, 1))],
                           [4, 4], [SCORER_NUM_REGS, ACC_NUM_REGS])


def launch_decode_fp8t(q, kv, block_table, cache_seqlens, kv_scale, items, part_offsets, out, lse, partial_out,
                       partial_lse, *, softmax_scale: float, causal: bool):
    """Launch :func:`mla_decode_fp8t_kernel` (check :func:`.gluon_sm90.gluon_applies` and :func:`fp8t_applies` first):
    grid ``(num_parts, 1)``, 12 warps (three partitions of 4). Arguments as :func:`.gluon_sm90.launch_decode_gluon`
    (``kv_scale`` fp32 ``[1]``). No allocation, no sync."""
    grid, fixed, options = fp8t_fixed(batch=q.shape[0], q_len=q.shape[1], h_q=q.shape[2], page_size=kv.shape[1],
                                      block_table=block_table, seqlens=cache_seqlens, items=items,
                                      part_offsets=part_offsets, partial_out=partial_out, partial_lse=partial_lse,
                                      softmax_scale=softmax_scale, causal=causal)
    with kernel_device(q):
        return mla_decode_fp8t_kernel[grid](**fixed, **fp8t_call(q, kv, kv_scale, out, lse), **options)


def fp8t_fixed(*, batch: int, q_len: int, h_q: int, page_size: int, block_table, seqlens, items, part_offsets,
               partial_out, partial_lse, softmax_scale: float, causal: bool):
    """``(grid, arguments, launch options)`` of :func:`mla_decode_fp8t_kernel` that a plan fixes (everything but
    :func:`fp8t_call`'s)."""
    rows = q_len * h_q
    r = rows_per_program(rows)
    scorer_regs, acc_regs = CONSUMER_REGS[r]
    grid = (part_offsets.shape[0] - 1, -(-rows // r))
    fixed = dict(
        q_rows=batch * rows, BlockTable=block_table, Seqlens=seqlens, Items=items, PartOffsets=part_offsets,
        PartialOut=partial_out, PartialLse=partial_lse, qk_scale=softmax_scale * 1.4426950408889634, q_len=q_len,
        group=h_q, stride_bt=block_table.stride(0),
        stride_pob=partial_out.stride(0), stride_pos=partial_out.stride(1), stride_poh=partial_out.stride(2),
        stride_plb=partial_lse.stride(0), stride_pls=partial_lse.stride(1), stride_plh=partial_lse.stride(2),
        PAGE_SIZE=page_size, CAUSAL=causal, R=r, SCORER_NUM_REGS=scorer_regs, ACC_NUM_REGS=acc_regs)
    return grid, fixed, {"num_warps": 4}


def fp8t_call(q, kv, kv_scale, out, lse) -> dict:
    """The arguments of :func:`mla_decode_fp8t_kernel` that change per call: q and its TMA descriptors, the cache (as
    int32 words: four e4m3 values each, see _load_fp8), its scale, out and lse and their strides, the block count."""
    batch, q_len, h_q, _ = q.shape
    kv32 = kv.view(torch.int32)  # [nb, page, 1, 144]
    qd, qrd = _g._descriptors(q, batch * q_len * h_q, rows_per_program(q_len * h_q), 512)
    return dict(q_desc=qd, qr_desc=qrd, Q=q, KV32=kv32, KVScale=kv_scale, Out=out, Lse=lse,
                stride_kt=kv32.stride(1),
                stride_ob=out.stride(0), stride_os=out.stride(1), stride_oh=out.stride(2),
                stride_lb=lse.stride(0), stride_lh=lse.stride(1), stride_ls=lse.stride(2), num_blocks=kv.shape[0])
