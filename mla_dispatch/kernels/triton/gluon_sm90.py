"""Split-KV paged MLA decode for Hopper (sm_90) in Gluon, for 64-row head tiles.

Since the twenty-second session, 16-bit caches on pages of whole 64-token tiles take :mod:`.gluon_seesaw` (two tiles
in flight, one per warpgroup; 1.14-1.24x this kernel on FlashMLA's grid, equal on the memory-bound configs), and since
the twenty-third fp8_e4m3 caches with at most 32 query rows take :mod:`.gluon_fp8` (tokens on M, a converting
warpgroup; ~1.9-2x), so this kernel runs the other page sizes and fp8_e4m3 caches with more rows, and those cases too
in plans made with ``backend_options={"kernel": "gluon"}`` (:mod:`.launch`).

Why a second kernel in the Triton backend
-----------------------------------------
The plain-Triton kernel (:mod:`.decode`) leaves two things on the table at 64 and 128 query rows, read in its
SASS (docs/notes/triton.md, "What the SASS of the TMA loop shows"):

1. Both warpgroups compute the whole score tile S: Triton lays a dot that feeds another dot out with every warp
   on M, and with M = 64 the second warpgroup repeats the first one's rows (1.53x the tensor work per tile).
2. The next tile's TMA is issued at the end of an iteration, after P V, so a program's load and compute run in
   series.

Gluon (``triton.experimental.gluon``) states layouts, shared memory, barriers and the async copies explicitly, so
this kernel does what plain Triton could not be made to do:

* S ``[64 rows, 64 tokens]`` is laid out ``warps_per_cta = [4, 2]``: each warpgroup computes 32 of the 64 tokens
  (64 x 32 x 576), and the row maximum and sum are reduced across the pair (the compiler exchanges the partial
  reductions through shared memory).
* P goes to shared memory; both warpgroups read all of it for ``O += P V`` with the 512 output channels split
  ``[4, 2]`` (256 each), V being the latent part of the same K tile (the MLA trick).
* The TMA of tile ``j + 1`` is issued at the top of iteration ``j``, into the stage whose last reader (P V of tile
  ``j - 1``) has completed, so the load of one tile overlaps the compute of the one before
  (FlashAttention-3's producer / consumer overlap, Shah et al. 2024, in one partition; FlashMLA's kernel does the
  same with a producer warp).

The rest is the plain kernel's contract: one program per (schedule part, 64-row tile), items of the shared split-KV
schedule, online softmax in base 2, natural-log LSE, and split items written as fp16 partial rows with a power-of-two
scale (:data:`.combine.PARTIAL_ROW_FORMAT`, one scale per row) for the same combine. A block id outside
``[0, num_blocks)`` is not loaded (block 0 is, in its place) and makes every row of its item NaN, out and LSE, through
the row sums (:func:`_tile_pages`, :func:`_issue_tile`; :mod:`.gluon_seesaw` and :mod:`.gluon_fp8` do the same).

How a tile reaches shared memory depends on the page size (``GATHER``, a compile-time constant):

* Pages holding whole 64-token tiles (64, 128, 256): a whole tile by TMA, one page each; an item's partial last tile
  by masked ``cp.async`` (zeros for tokens at or past the item's end), so cache slots past a request's length are
  never read.
* Any other page size (1, 16, 33, 96, ...): every tile by masked ``cp.async``, each of the 64 token rows from its own
  page. The table entries of tile ``j + 2`` are loaded while tile ``j`` is computed, so the table's latency is off the
  loop's path; one copy group per tile, waited for with ``wait_group(1)`` while the next tile's is in flight. On the
  H100 this reads pages of 1 and 16 tokens within 3% of the time of pages of 64 (graph replays, b=64 L=8K,
  docs/notes/triton.md, "The Gluon kernel on short pages").

fp8_e4m3 caches (``FP8``; :data:`GLUON_KV_FORMATS`): every tile is gathered as fp8 into one of two 36 KB stages and
converted to fp16 in shared memory (:func:`_dequant_tile`) into the one 72 KB buffer the wgmma read; the per-tensor
scale multiplies S and O. The operands are fp16 rather than bf16 because e4m3 -> f16 is one conversion per two values
and e4m3 -> bf16 went through f32, four instructions per two values, two of them ``F2F`` (measured +1.7-2.3 us per tile
against +1.0 us). A bf16 query tile is converted to fp16 in place once per item, each row times the power of two that
puts its largest magnitude in ``[2^14, 2^15)``, undone on S (:func:`_query_to_fp16`), so a bf16 query survives whatever
its range (rows whose largest magnitude is above 2^-112). The conversion runs between a tile's copies and its wgmma, so
an fp8 tile costs ~1.25x a bf16 one and the kernel reaches ~0.8x bf16's throughput (1.55x the plain kernel's fp8 path at
32 and 64 rows, 2.2x on FlashMLA's grid; H100, docs/notes/triton.md, "fp8_e4m3 in the Gluon kernel").

Applies (:func:`gluon_applies`): an NVIDIA sm_90 GPU, a plain (untraced) launch, bf16/fp16 q, a cache of q's type or
fp8_e4m3, one KV head, D_qk = 576 / D_v = 512, a contiguous cache and q with 16-byte aligned bases (the conditions of
the plain kernel's TMA path, :func:`.decode.tma_applies` / :func:`.decode.q_tma_applies`, any page size), and the Gluon
API this file was written against (triton 3.6; :data:`GLUON_API`).
"""

from __future__ import annotations

import torch
import triton

from mla_dispatch.kernels.triton.descriptors import rebased
from mla_dispatch.kernels.triton.device import kernel_device

try:  # Gluon is experimental: its API moves between Triton releases (written for 3.6, compiled with 3.6 and 3.9)
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 6):
        raise ImportError(f"triton {triton.__version__}: the Gluon kernel needs 3.6 or newer")
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    # the CTA-wide barrier: gl.thread_barrier in triton 3.6, gl.barrier from 3.7 on
    _cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
    # TMA and cp.async copies into shared memory: async_copy_global_to_shared in 3.6, async_load from 3.7 on
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    # a shared buffer viewed as another type: shared_memory_descriptor._reinterpret in 3.6, .reinterpret in 3.9
    from triton.experimental.gluon.language._core import shared_memory_descriptor as _smem_desc
    _PUBLIC_REINTERPRET = gl.constexpr(hasattr(_smem_desc, "reinterpret"))
    GLUON_API = True
except ImportError:  # pragma: no cover - a Triton without Gluon
    GLUON_API = False

__all__ = ["GLUON_API", "GLUON_KV_FORMATS", "gluon_applies", "gluon_possible", "launch_decode_gluon"]

#: cache formats the kernel reads: 16-bit as they are, fp8_e4m3 converted in shared memory (per-tensor scale)
GLUON_KV_FORMATS = ("bf16", "fp16", "fp8_e4m3")
BLOCK_M = 64  # query rows per program (heads on M): one wgmma M
BLOCK_N = 64  # tokens per tile: one page-aligned TMA box, 72 KB with the RoPE part
NUM_STAGES = 2  # 2 x 72 KB of KV tiles + 72 KB of query tile + 8 KB of P: 224 KB of the 227 KB
NUM_WARPS = 8  # two warpgroups


if GLUON_API:

    @gluon.jit
    def _item_meta(Items, Seqlens, item):
        """Work item ``item`` of the split-KV schedule (:mod:`.schedule`: request, token range, partial-row slot or
        -1) and its request's length."""
        req = gl.load(Items + item * 4 + 0)
        tok_begin = gl.load(Items + item * 4 + 1)
        tok_end = gl.load(Items + item * 4 + 2)
        slot = gl.load(Items + item * 4 + 3)
        return req, tok_begin, tok_end, slot, gl.load(Seqlens + req)

    @gluon.jit
    def _view(buf, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
        """Shared buffer ``buf`` viewed as ``dtype`` / ``shape`` / ``layout`` (the same bytes; ``_reinterpret`` in
        triton 3.6, ``reinterpret`` from 3.9)."""
        if _PUBLIC_REINTERPRET:
            return buf.reinterpret(dtype, shape, layout)
        else:
            return buf._reinterpret(dtype, shape, layout)

    @gluon.jit
    def _tile_pages(bt_row, start, tok_end, num_blocks, PAGE_SIZE: gl.constexpr, TILE_N: gl.constexpr,
                    GATHER: gl.constexpr, row_layout: gl.constexpr):
        """The page of each token row of tile ``start ..`` in the 1-D layout ``row_layout`` (``GATHER``; 0 past
        ``tok_end``: table entries past an item's end are never read, garbage ids there are legal), and 1 where the
        entry is a block id outside ``[0, num_blocks)`` (its page is 0 instead, so nothing outside the cache is read;
        the caller poisons the item); zeros otherwise (unused)."""
        rows = gl.arange(0, TILE_N, layout=row_layout)
        if GATHER:
            tok = start + rows
            pages = gl.load(bt_row + tok // PAGE_SIZE, mask=tok < tok_end, other=0)
            ok = pages.to(gl.uint32, bitcast=True) < num_blocks  # 0 <= page < num_blocks, in one compare
            return gl.where(ok, pages, 0), gl.where(ok, 0, 1)
        else:
            return rows * 0, rows * 0

    @gluon.jit
    def _copy_rows(base, valid, kbuf, rbuf, D_V: gl.constexpr, cp_layout: gl.constexpr):
        """Masked cp.async of token rows ``base`` (row pointers, zeros where not ``valid``) into ``kbuf`` (latent, in
        64-column slices) and ``rbuf`` (RoPE), committed as one copy group."""
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, cp_layout))
        for c in gl.static_range(D_V // 64):
            _cp_async(kbuf.slice(c * 64, 64, dim=1), base[:, None] + (c * 64 + cols)[None, :], mask=valid[:, None])
        _cp_async(rbuf, base[:, None] + (D_V + cols)[None, :], mask=valid[:, None])
        async_copy.commit_group()

    @gluon.jit
    def _issue_tile(k_desc, r_desc, KV, bt_row, start, tok_end, num_blocks, pages, kbuf, rbuf, bar, stride_kt,
                    PAGE_SIZE: gl.constexpr, TILE_N: gl.constexpr, D_V: gl.constexpr, D_ROPE: gl.constexpr,
                    NBYTES: gl.constexpr, GATHER: gl.constexpr, cp_layout: gl.constexpr):
        """Start loading token tile ``start ..`` of an item into ``kbuf`` (latent) / ``rbuf`` (RoPE); returns 1 if its
        page is a block id outside ``[0, num_blocks)`` (then block 0 is loaded instead and the caller poisons the item),
        else 0.

        Pages of whole tiles (``GATHER`` false): a whole tile by TMA, ``bar`` completing when its bytes land; a partial
        last tile by masked cp.async, zeros past ``tok_end``, and one arrival on ``bar`` (it completes at once; the
        reader waits for the copy group). Shorter or unaligned pages (``GATHER``): every tile by masked cp.async, each
        token row from its own page (``pages``, from :func:`_tile_pages`, loaded a tile ahead so that the table's
        latency is not paid here, bad ids already replaced), one copy group per tile, ``bar`` left alone."""
        rows = gl.arange(0, TILE_N, layout=gl.SliceLayout(1, cp_layout))
        bad = start * 0
        if GATHER:
            tok = start + rows
            base = KV + (pages.to(gl.int64) * PAGE_SIZE + tok % PAGE_SIZE) * stride_kt
            _copy_rows(base, tok < tok_end, kbuf, rbuf, D_V, cp_layout)
        else:
            page = gl.load(bt_row + start // PAGE_SIZE)  # the request's table row; start < tok_end: within its length
            ok = page.to(gl.uint32, bitcast=True) < num_blocks
            bad = gl.where(ok, 0, 1)
            page = gl.where(ok, page, 0)
            r0 = page * PAGE_SIZE + start % PAGE_SIZE  # token row of the cache viewed as [pages * page_size, D_qk]
            if start + TILE_N <= tok_end:
                mbarrier.expect(bar, NBYTES)
                _tma_load(k_desc, [r0, 0], bar, kbuf)
                _tma_load(r_desc, [r0, D_V], bar, rbuf)
            else:
                base = KV + (r0.to(gl.int64) + rows.to(gl.int64)) * stride_kt
                _copy_rows(base, (start + rows) < tok_end, kbuf, rbuf, D_V, cp_layout)
                mbarrier.arrive(bar)
        return bad

    @gluon.jit
    def _clean_hidden(kbuf, hidden, TILE_N: gl.constexpr, layout: gl.constexpr):
        """The non-finite values of rows ``[hidden, TILE_N)`` of the latent tile ``kbuf`` (its V) set to 0: keys the
        causal mask hides from some row of the tile, whose p is 0 for them, where 0 * NaN in P V would reach its out
        (the rows that see such a key get NaN from its score already: V is the first D_v channels of K; decode.py's
        _hide_from_rows_that_do_not_see is the same rule). Rows past the item's end are zeros already (the masked
        copy of the partial tile). 8 rows a pass (few registers: acc is live), from the pass holding row ``hidden``;
        the caller fences and syncs."""
        for i in gl.static_range(TILE_N // 8):
            if hidden < (i + 1) * 8:
                part = kbuf.slice(i * 8, 8, dim=0)
                rows = (i * 8 + gl.arange(0, 8, layout=gl.SliceLayout(1, layout)))[:, None]
                x = part.load(layout)
                keep = (rows < hidden) | (gl.abs(x.to(gl.float32)) < float("inf"))
                part.store(gl.where(keep, x, gl.zeros_like(x)))

    @gluon.jit
    def _dequant_tile(k8, r8, kbuf, rbuf, TILE_N: gl.constexpr, D_V: gl.constexpr, D_ROPE: gl.constexpr):
        """Convert a gathered fp8_e4m3 tile (``k8`` latent / ``r8`` RoPE, shared memory) to fp16 into ``kbuf`` /
        ``rbuf``, the operands of the wgmma, 16 token rows at a time (32 values per thread, so the conversion fits
        beside the accumulator). fp16, not bf16: e4m3 -> f16 is one conversion per two values (``F2FP``), e4m3 -> bf16
        went through f32 (four per two, two of them ``F2F``), and the tile's conversion runs between the copies and the
        wgmma. The per-tensor scale is applied to S and O instead."""
        ROWS: gl.constexpr = 16
        cvt: gl.constexpr = gl.BlockedLayout([1, 16], [2, 16], [8, 1], [1, 0])  # 16 rows x 256 columns per pass
        cvt_r: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [8, 1], [1, 0])  # 64 rows x 64 columns
        for i in gl.static_range(TILE_N // ROWS):
            x = k8.slice(i * ROWS, ROWS, dim=0).load(cvt)
            kbuf.slice(i * ROWS, ROWS, dim=0).store(x.to(kbuf.dtype))
        rbuf.store(r8.load(cvt_r).to(rbuf.dtype))

    @gluon.jit
    def _query_to_fp16(q_smem, qr_smem, q_op, qr_op, qd_smem, TILE_M: gl.constexpr, ROWS: gl.constexpr,
                       lat: gl.constexpr, rop: gl.constexpr):
        """A bf16 query tile (``q_smem`` latent, ``qr_smem`` RoPE) to fp16 in place (``q_op`` / ``qr_op``, the same
        bytes), each row times a power of two that puts its largest magnitude in ``[2^14, 2^15)`` (so no row overflows
        fp16 or drowns in its subnormals, whatever the query's range); the inverse factors go to ``qd_smem`` for S.
        ``ROWS`` rows at a time, in the layouts ``lat`` / ``rop`` (the same rows in the same threads); each thread
        writes back exactly the values it read."""
        for i in gl.static_range(TILE_M // ROWS):
            x = q_smem.slice(i * ROWS, ROWS, dim=0).load(lat).to(gl.float32)
            xr = qr_smem.slice(i * ROWS, ROWS, dim=0).load(rop).to(gl.float32)
            amax = gl.maximum(gl.max(gl.abs(x), 1), gl.convert_layout(gl.max(gl.abs(xr), 1), gl.SliceLayout(1, lat)))
            up, down = _pow2_scale(amax)
            q_op.slice(i * ROWS, ROWS, dim=0).store((x * up[:, None]).to(gl.float16))
            up_r = gl.convert_layout(up, gl.SliceLayout(1, rop))
            qr_op.slice(i * ROWS, ROWS, dim=0).store((xr * up_r[:, None]).to(gl.float16))
            qd_smem.slice(i * ROWS, ROWS).store(down)

    @gluon.jit
    def _pow2_scale(amax):
        """``(2^s, 2^-s)`` with ``amax * 2^s`` in ``[2^14, 2^15)``, clamped to ``[-113, 126]`` (as
        :func:`.decode._pow2_scale`)."""
        e = (amax.to(gl.int32, bitcast=True) >> 23) & 0xFF
        s = gl.minimum(gl.maximum(141 - e, -113), 126)
        return ((127 + s) << 23).to(gl.float32, bitcast=True), ((127 - s) << 23).to(gl.float32, bitcast=True)

    @gluon.jit
    def mla_decode_sm90_kernel(
        q_desc, qr_desc, k_desc, r_desc,
        KV, KVScale, BlockTable, Seqlens, Items, PartOffsets,
        Out, Lse, PartialOut, PartialLse,
        qk_scale,  # softmax_scale * log2(e)
        q_len, group,  # s_q, h_q
        stride_kt, stride_bt,
        stride_ob, stride_os, stride_oh,
        stride_lb, stride_lh, stride_ls,
        stride_pob, stride_pos, stride_poh,
        stride_plb, stride_pls, stride_plh,
        num_blocks,  # kv.shape[0]: a block id outside [0, num_blocks) is not loaded, and its item's rows are NaN
        PAGE_SIZE: gl.constexpr, D_V: gl.constexpr, D_ROPE: gl.constexpr, CAUSAL: gl.constexpr,
        TILE_M: gl.constexpr, TILE_N: gl.constexpr, STAGES: gl.constexpr, GATHER: gl.constexpr, FP8: gl.constexpr,
    ):
        gl.static_assert(gl.num_warps() == 8)
        dtype: gl.constexpr = q_desc.dtype
        if FP8:  # the type of the wgmma operands: fp16 for fp8 caches (see _dequant_tile), else the query's
            cdt: gl.constexpr = gl.float16
        else:
            cdt: gl.constexpr = dtype
        LN2: gl.constexpr = 0.6931471805599453
        NBYTES: gl.constexpr = TILE_N * (D_V + D_ROPE) * 2
        # S [rows, tokens]: the two warpgroups split the tokens; O [rows, channels]: they split the channels
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                           instr_shape=[16, TILE_N // 2, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                           instr_shape=[16, D_V // 2, 16])
        cp_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
        row_cp: gl.constexpr = gl.SliceLayout(1, cp_layout)  # token rows of a gathered tile
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        col_o: gl.constexpr = gl.SliceLayout(0, o_layout)
        p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE_M, TILE_N], cdt)

        q_smem = gl.allocate_shared_memory(dtype, [TILE_M, D_V], q_desc.layout)
        qr_smem = gl.allocate_shared_memory(dtype, [TILE_M, D_ROPE], qr_desc.layout)
        k_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE_N, D_V], cdt)
        r_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE_N, D_ROPE], cdt)
        if FP8:  # tiles land as fp8 in STAGES buffers (64-byte swizzle: 64-column slices for the copies), converted
            # into one fp16 buffer that the wgmma read (2 x 36 + 72 KB, as 2 x 72 KB for bf16)
            gl.static_assert(GATHER)
            kv8_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
            kl_smem = gl.allocate_shared_memory(KV.dtype.element_ty, [STAGES, TILE_N, D_V], kv8_layout)
            rl_smem = gl.allocate_shared_memory(KV.dtype.element_ty, [STAGES, TILE_N, D_ROPE], kv8_layout)
            k_smem = gl.allocate_shared_memory(cdt, [1, TILE_N, D_V], k_layout)
            r_smem = gl.allocate_shared_memory(cdt, [1, TILE_N, D_ROPE], r_layout)
            kv_scale = gl.load(KVScale)
            # the query tile converted to fp16 in place (same 16-bit swizzled layout) and its rows' scales: see the
            # item loop
            q_layout: gl.constexpr = q_desc.layout
            qr_layout: gl.constexpr = qr_desc.layout
            q_op = _view(q_smem, cdt, [TILE_M, D_V], q_layout)
            qr_op = _view(qr_smem, cdt, [TILE_M, D_ROPE], qr_layout)
            qd_smem = gl.allocate_shared_memory(gl.float32, [TILE_M], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        else:
            k_smem = gl.allocate_shared_memory(dtype, [STAGES, TILE_N, D_V], k_layout)
            r_smem = gl.allocate_shared_memory(dtype, [STAGES, TILE_N, D_ROPE], r_layout)
            kl_smem = k_smem
            rl_smem = r_smem
            kv_scale = 1.0
            q_op = q_smem
            qr_op = qr_smem
        s_scale = qk_scale * kv_scale
        p_smem = gl.allocate_shared_memory(cdt, [TILE_M, TILE_N], p_layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)
        mbarrier.init(q_bar, count=1)
        fence_async_shared()

        part = gl.program_id(0)
        m_tile = gl.program_id(1)
        rows_total = q_len * group
        flat_s = m_tile * TILE_M + gl.arange(0, TILE_M, layout=row_s)
        q_tok_s = flat_s // group
        flat_o = m_tile * TILE_M + gl.arange(0, TILE_M, layout=row_o)
        row_ok_o = flat_o < rows_total
        q_tok_o = flat_o // group
        head_o = flat_o % group
        d_o = gl.arange(0, D_V, layout=col_o)

        item_begin = gl.load(PartOffsets + part)
        item_end = gl.load(PartOffsets + part + 1)
        it = 0  # tiles issued by this program so far: stage it % STAGES, barrier phase (it // STAGES) & 1
        q_phase = 0
        for item in range(item_begin, item_end):
            req, tok_begin, tok_end, slot, seqlen = _item_meta(Items, Seqlens, item)
            bt_row = BlockTable + req.to(gl.int64) * stride_bt
            # every warp is done with the previous item's tiles and query tile before they are overwritten
            _cta_barrier()
            # the query tile: q viewed as [B * s_q * h_q, D_qk]; rows past the request's are computed, never stored
            q_row0 = req * rows_total + m_tile * TILE_M
            mbarrier.expect(q_bar, TILE_M * (D_V + D_ROPE) * 2)
            _tma_load(q_desc, [q_row0, 0], q_bar, q_smem)
            _tma_load(qr_desc, [q_row0, D_V], q_bar, qr_smem)
            n_tiles = gl.cdiv(tok_end - tok_begin, TILE_N)
            # nonzero where a tile of this item met a block id outside [0, num_blocks): its rows become NaN
            poison = gl.zeros([TILE_N], gl.int32, layout=row_cp)
            if n_tiles > 0:
                st = it % STAGES
                pages, bad = _tile_pages(bt_row, tok_begin, tok_end, num_blocks, PAGE_SIZE, TILE_N, GATHER, row_cp)
                poison = poison | bad
                bad = _issue_tile(k_desc, r_desc, KV, bt_row, tok_begin, tok_end, num_blocks, pages,
                                  kl_smem.index(st), rl_smem.index(st), bars.index(st), stride_kt, PAGE_SIZE, TILE_N,
                                  D_V, D_ROPE, NBYTES, GATHER, cp_layout)
                poison = poison | bad

            # key t is visible to row (i, h) iff t < limit[i] (and t < tok_end: the partial tile's zeros)
            if CAUSAL:
                limit = gl.minimum(seqlen - q_len + 1 + q_tok_s, tok_end)
            else:
                limit = gl.minimum(seqlen, tok_end) + q_tok_s * 0
            first_hidden = gl.min(limit, 0)  # the first key some row of the tile does not see (causal: cleaned V)
            next_pages, bad = _tile_pages(bt_row, tok_begin + TILE_N, tok_end, num_blocks, PAGE_SIZE, TILE_N, GATHER,
                                          row_cp)
            poison = poison | bad
            m_i = gl.full([TILE_M], float("-inf"), gl.float32, layout=row_s)
            l2 = gl.zeros([TILE_M, TILE_N], gl.float32, layout=s_layout)  # row sums, reduced in the epilogue
            acc = gl.zeros([TILE_M, D_V], gl.float32, layout=o_layout)
            mbarrier.wait(q_bar, q_phase)
            q_phase ^= 1
            if FP8:
                if dtype != cdt:  # a bf16 query tile to fp16 in place, rows scaled by powers of two (undone on S)
                    # 16 rows x 128 / 64 columns a pass over the eight warps
                    _query_to_fp16(q_smem, qr_smem, q_op, qr_op, qd_smem, TILE_M, 16,
                                   gl.BlockedLayout([1, 8], [2, 16], [8, 1], [1, 0]),
                                   gl.BlockedLayout([1, 4], [2, 16], [8, 1], [1, 0]))
                    fence_async_shared()
                    _cta_barrier()
                    s_rows = s_scale * qd_smem.load(row_s)
                else:
                    s_rows = s_scale + gl.zeros([TILE_M], gl.float32, layout=row_s)
            for j in range(n_tiles):
                start = tok_begin + j * TILE_N
                st = it % STAGES
                # every warp has waited for P V of tile j - 1, so its stage (the next tile's) and P are free
                _cta_barrier()
                if j + 1 < n_tiles:  # the next tile's load runs under this tile's compute
                    nst = (it + 1) % STAGES
                    bad = _issue_tile(k_desc, r_desc, KV, bt_row, start + TILE_N, tok_end, num_blocks, next_pages,
                                      kl_smem.index(nst), rl_smem.index(nst), bars.index(nst), stride_kt, PAGE_SIZE,
                                      TILE_N, D_V, D_ROPE, NBYTES, GATHER, cp_layout)
                    poison = poison | bad
                    next_pages, bad = _tile_pages(bt_row, start + 2 * TILE_N, tok_end, num_blocks, PAGE_SIZE, TILE_N,
                                                  GATHER, row_cp)
                    poison = poison | bad
                if GATHER:  # tile j's copy group is complete when at most tile j + 1's is in flight
                    if j + 1 < n_tiles:
                        async_copy.wait_group(1)
                    else:
                        async_copy.wait_group(0)
                    fence_async_shared()  # this thread's copies, visible to the wgmma (async proxy) ...
                    _cta_barrier()  # ... and every thread's
                else:
                    mbarrier.wait(bars.index(st), (it // STAGES) & 1)
                    if start + TILE_N > tok_end:  # the partial last tile came by cp.async
                        async_copy.wait_group(0)
                        fence_async_shared()
                        _cta_barrier()
                if FP8:  # every warp has its copies (barrier above); P V of tile j - 1 is done with k_smem
                    kbuf = k_smem.index(0)
                    rbuf = r_smem.index(0)
                    _dequant_tile(kl_smem.index(st), rl_smem.index(st), kbuf, rbuf, TILE_N, D_V, D_ROPE)
                    fence_async_shared()
                    _cta_barrier()
                else:
                    kbuf = k_smem.index(st)
                    rbuf = r_smem.index(st)
                s = warpgroup_mma(q_op, kbuf.permute((1, 0)), gl.zeros([TILE_M, TILE_N], gl.float32, s_layout),
                                  use_acc=False, is_async=True)
                s = warpgroup_mma(qr_op, rbuf.permute((1, 0)), s, is_async=True)
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))

                n = start + gl.arange(0, TILE_N, layout=col_s)
                if FP8:
                    s = s * s_rows[:, None]
                else:
                    s = s * s_scale
                s = gl.where(n[None, :] < limit[:, None], s, float("-inf"))
                m_new = gl.maximum(m_i, gl.max(s, 1))
                m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = gl.exp2(m_i - m_safe)
                p = gl.exp2(s - m_safe[:, None])
                # the row sums stay per thread until the epilogue: the row maximum is the only reduction across the
                # warpgroups per tile (reducing the sums per tile too cost 2-5% on the FlashMLA grid, H100)
                l2 = l2 * alpha[:, None] + p
                m_i = m_new
                p_smem.store(p.to(cdt))
                fence_async_shared()
                _cta_barrier()  # both halves of P are in shared memory (and every S read of kbuf is done)
                if CAUSAL:
                    if start + TILE_N > first_hidden:  # keys some row of the tile does not see: out of its P V
                        _clean_hidden(kbuf, first_hidden - start, TILE_N,
                                      gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0]))
                        fence_async_shared()
                        _cta_barrier()
                acc = acc * gl.convert_layout(alpha, row_o)[:, None]
                acc = warpgroup_mma(p_smem, kbuf, acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                it += 1

            # -- epilogue: normalise; natural-log LSE (l_i = 0: no key; NaN, a bad block id: out and LSE NaN) -----
            l_i = gl.sum(l2, 1)
            l_i = gl.where(gl.max(poison, 0) != 0, float("nan"), l_i)
            has_key = l_i != 0.0
            inv_l = gl.where(has_key, kv_scale / gl.where(has_key, l_i, 1.0), 0.0)  # the fp8 scale of V
            lse_nat = (m_i + gl.log2(gl.where(has_key, l_i, 1.0))) * LN2
            o = acc * gl.convert_layout(inv_l, row_o)[:, None]
            row_ok_s = flat_s < rows_total
            head_s = flat_s % group
            if slot < 0:  # the whole request: final out / lse
                o_off = req.to(gl.int64) * stride_ob + q_tok_o.to(gl.int64) * stride_os + head_o.to(gl.int64) * stride_oh
                gl.store(Out + o_off[:, None] + d_o[None, :], o.to(Out.dtype.element_ty), mask=row_ok_o[:, None])
                l_off = req.to(gl.int64) * stride_lb + head_s.to(gl.int64) * stride_lh + q_tok_s.to(gl.int64) * stride_ls
                gl.store(Lse + l_off, gl.where(has_key, lse_nat, float("inf")), mask=row_ok_s)
            else:  # a piece of a split request (PARTIAL_ROW_FORMAT, one scale per row)
                p_off = (slot.to(gl.int64) * stride_pob + q_tok_o.to(gl.int64) * stride_pos
                         + head_o.to(gl.int64) * stride_poh)
                up, down = _pow2_scale(gl.max(gl.abs(o), 1))
                gl.store(PartialOut + p_off[:, None] + d_o[None, :], (o * up[:, None]).to(gl.float16),
                         mask=row_ok_o[:, None])
                gl.store((PartialOut + p_off + D_V).to(gl.pointer_type(gl.float32)), down, mask=row_ok_o)
                pl_off = (slot.to(gl.int64) * stride_plb + q_tok_s.to(gl.int64) * stride_pls
                          + head_s.to(gl.int64) * stride_plh)
                gl.store(PartialLse + pl_off, gl.where(has_key, lse_nat, float("-inf")), mask=row_ok_s)

        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))
        mbarrier.invalidate(q_bar)


def gluon_possible(*, capability, sparse: bool, head_dim_qk: int, head_dim_v: int) -> bool:
    """The problem half of :func:`gluon_applies`, known at planning time: Gluon importable, an NVIDIA GPU of compute
    capability 9.0 (``capability`` as :attr:`mla_dispatch.dispatch.platform.Platform.capability`), dense, ``D_qk = 576`` and
    ``D_v = 512``."""
    return GLUON_API and capability == (9, 0) and not sparse and head_dim_qk == 576 and head_dim_v == 512


def gluon_applies(q, kv, *, kv_format: str, sparse: bool, head_dim_v: int, traced: bool) -> bool:
    """Whether a launch can take :func:`mla_decode_sm90_kernel`: Gluon importable; a plain launch on an NVIDIA sm_90
    GPU; bf16/fp16 q; a cache of q's type or fp8_e4m3 (:data:`GLUON_KV_FORMATS`), dense, one KV head, ``D_qk = 576``,
    ``D_v = 512``; any page size; cache and q contiguous with 16-byte aligned bases and fewer than 2^31 token / query
    rows."""
    if not GLUON_API or traced or sparse or kv_format not in GLUON_KV_FORMATS:
        return False
    nb, page_size, h_kv, d_qk = kv.shape
    if h_kv != 1 or d_qk != 576 or head_dim_v != 512 or q.dtype not in (torch.bfloat16, torch.float16):
        return False
    if kv.dtype != (torch.float8_e4m3fn if kv_format == "fp8_e4m3" else q.dtype):
        return False
    if not (kv.is_contiguous() and q.is_contiguous()) or kv.data_ptr() % 16 or q.data_ptr() % 16:
        return False
    if nb * page_size >= 2**31 or q.numel() // q.shape[-1] >= 2**31:
        return False
    if kv.device.type != "cuda" or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(kv.device) == (9, 0)


_LAYOUTS: dict = {}


def _layout(block_rows: int, cols: int, dtype: torch.dtype):
    """The shared-memory layout of a ``[block_rows, cols]`` TMA block (cached: ``get_default_for`` took ~9 us a call,
    four calls per launch)."""
    key = (block_rows, cols, dtype)
    if key not in _LAYOUTS:
        gdt = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
        _LAYOUTS[key] = gl.NVMMASharedLayout.get_default_for([block_rows, cols], gdt)
    return _LAYOUTS[key]


def _descriptors(t, rows: int, block_rows: int, head_dim_v: int, cols: int | None = None):
    """(latent, RoPE) Gluon TMA descriptors over ``t`` viewed as ``[rows, D_qk]``, blocks of ``block_rows`` rows; the
    latent one ``cols`` wide (default all ``head_dim_v`` columns; :mod:`.gluon_seesaw` loads the latent part in halves),
    the RoPE one the ``D_qk - head_dim_v`` columns after the latent part."""
    width = t.shape[-1]
    cols = cols or head_dim_v
    flat = t.view(rows, width)
    # the same geometry every call of a plan: built and checked once, copied with the new base after (.descriptors)
    key = ("gluon", rows, width, block_rows, cols, head_dim_v, t.dtype)
    return (rebased(key + ("latent",), flat, lambda f: TensorDescriptor(
                f, [rows, width], [width, 1], [block_rows, cols], _layout(block_rows, cols, t.dtype))),
            rebased(key + ("rope",), flat, lambda f: TensorDescriptor(
                f, [rows, width], [width, 1], [block_rows, width - head_dim_v],
                _layout(block_rows, width - head_dim_v, t.dtype))))


def launch_decode_gluon(q, kv, block_table, cache_seqlens, kv_scale, items, part_offsets, out, lse, partial_out,
                        partial_lse, *, softmax_scale: float, causal: bool):
    """Launch :func:`mla_decode_sm90_kernel` (check :func:`gluon_applies` first): grid
    ``(num_parts, ceil(s_q * h_q / 64))``. Shapes as :func:`.decode.launch_decode`; ``kv_scale`` fp32 ``[1]`` for an
    fp8_e4m3 cache, else None; the partial rows carry one scale each (combine with ``v_split = 1``). No allocation, no
    sync."""
    batch, q_len, h_q, d_qk = q.shape
    fp8 = kv.dtype == torch.float8_e4m3fn
    grid, fixed, options = gluon_fixed(q_len=q_len, h_q=h_q, d_qk=d_qk, page_size=kv.shape[1], head_dim_v=out.shape[-1],
                                       fp8=fp8, block_table=block_table, seqlens=cache_seqlens, items=items,
                                       part_offsets=part_offsets, partial_out=partial_out, partial_lse=partial_lse,
                                       softmax_scale=softmax_scale, causal=causal)
    with kernel_device(q):
        return mla_decode_sm90_kernel[grid](**fixed, **gluon_call(q, kv, kv_scale, out, lse, fp8=fp8), **options)


def split_kv_fixed(*, block_m: int, q_len: int, h_q: int, page_size: int, block_table, seqlens, items, part_offsets,
                   partial_out, partial_lse, softmax_scale: float, causal: bool) -> tuple[tuple[int, int], dict]:
    """The grid and the arguments a plan fixes that every Gluon split-KV kernel takes (this one's and
    gluon_seesaw's): the table, lengths, schedule, partial buffers and their strides, the scale in log2 units."""
    grid = (part_offsets.shape[0] - 1, -(-(q_len * h_q) // block_m))
    return grid, dict(
        BlockTable=block_table, Seqlens=seqlens, Items=items, PartOffsets=part_offsets, PartialOut=partial_out,
        PartialLse=partial_lse, qk_scale=softmax_scale * 1.4426950408889634, q_len=q_len, group=h_q,
        stride_bt=block_table.stride(0),
        stride_pob=partial_out.stride(0), stride_pos=partial_out.stride(1), stride_poh=partial_out.stride(2),
        stride_plb=partial_lse.stride(0), stride_pls=partial_lse.stride(1), stride_plh=partial_lse.stride(2),
        PAGE_SIZE=page_size, CAUSAL=causal)


def gluon_fixed(*, q_len: int, h_q: int, d_qk: int, page_size: int, head_dim_v: int, fp8: bool, block_table, seqlens,
                items, part_offsets, partial_out, partial_lse, softmax_scale: float, causal: bool):
    """``(grid, arguments, launch options)`` of :func:`mla_decode_sm90_kernel` that a plan fixes (everything but
    :func:`gluon_call`'s)."""
    grid, fixed = split_kv_fixed(block_m=BLOCK_M, q_len=q_len, h_q=h_q, page_size=page_size, block_table=block_table,
                                 seqlens=seqlens, items=items, part_offsets=part_offsets, partial_out=partial_out,
                                 partial_lse=partial_lse, softmax_scale=softmax_scale, causal=causal)
    fixed.update(D_V=head_dim_v, D_ROPE=d_qk - head_dim_v, TILE_M=BLOCK_M, TILE_N=BLOCK_N, STAGES=NUM_STAGES,
                 GATHER=fp8 or page_size % BLOCK_N != 0, FP8=fp8)
    if not fp8:
        fixed["KVScale"] = seqlens  # a dummy pointer
    return grid, fixed, {"num_warps": NUM_WARPS}


def gluon_call(q, kv, kv_scale, out, lse, *, fp8: bool, kv_descriptors=None) -> dict:
    """The arguments of :func:`mla_decode_sm90_kernel` that change per call: the TMA descriptors over q and the cache
    (``kv_descriptors``: a function of the cache giving its pair, for a caller that keeps them), the cache, its scale,
    out and lse and their strides, the cache's block count."""
    batch, q_len, h_q, d_qk = q.shape
    head_dim_v = out.shape[-1]
    qd, qrd = _descriptors(q, batch * q_len * h_q, BLOCK_M, head_dim_v)
    if fp8:  # fp8 tiles are always gathered (no cache descriptors; the query's stand in for the unused arguments)
        kd, rd = qd, qrd
    elif kv_descriptors is not None:
        kd, rd = kv_descriptors(kv)
    else:
        kd, rd = _descriptors(kv, kv.shape[0] * kv.shape[1], BLOCK_N, head_dim_v)
    call = dict(q_desc=qd, qr_desc=qrd, k_desc=kd, r_desc=rd, KV=kv, Out=out, Lse=lse, stride_kt=kv.stride(1),
                stride_ob=out.stride(0), stride_os=out.stride(1), stride_oh=out.stride(2),
                stride_lb=lse.stride(0), stride_lh=lse.stride(1), stride_ls=lse.stride(2), num_blocks=kv.shape[0])
    if fp8:
        call["KVScale"] = kv_scale
    return call
