"""Split-KV paged MLA decode for Hopper (sm_90) in Gluon: two tiles in flight, one per warpgroup ("seesaw").

Why a third kernel
------------------
The Gluon kernel of :mod:`.gluon_sm90` computes a tile's S, softmax and P V in series in both warpgroups (S split
between them by tokens, the row maximum exchanged through shared memory): on FlashMLA's grid (128 query rows, near the
ridge) a 64-token tile costs ~3.0 us per program where the tensor work is ~1.7 us (docs/notes/triton.md). This kernel
runs FlashMLA's SM90 schedule (DeepSeek, "A Deep-Dive into the New Flash MLA Kernel", 2025; our CUDA backend's v5,
kernels/cuda/mla_decode_sm90/seesaw/seesaw.cuh) with Gluon's warp specialisation: the tiles of an item go in pairs
(a = 2i in stage 0, b = 2i + 1 in stage 1),

* warpgroup 0 (the default partition) computes S_a = Q K_a^T over all 64 tokens and owns O[:, 0:256),
* warpgroup 1 (the worker partition) computes S_b and owns O[:, 256:512),

and each runs its softmax while the other's wgmma occupy the tensor cores. Per pair, with m the running row maximum
(sc0 = 2^(m - m_a), sc1 = 2^(m_a - m_b)):

    WG0: softmax(S_a) against m -> P_a, m_a; P_a -> smem | WG1: waits for P_a, m_a
    WG0: O_L = O_L * sc0 + P_a V_aL  (P_a in regs)       | WG1: O_R = O_R * sc0 + P_a V_aR (P_a from smem), in flight
                                                         |      under softmax(S_b) against m_a -> P_b, m_b; P_b -> smem
    WG0: waits for P_b, m_b                              | WG1: O_R = O_R * sc1 + P_b V_bR  (P_b in regs)
    WG0: O_L = O_L * sc1 + P_b V_bL  (P_b from smem)     | WG1: S_{b+2}
    WG0: S_{a+2}                                         |

Of the softmax state only the row maxima cross between the warpgroups (each derives the other's rescale factor from
them; the row sums meet once per item), through shared memory and mbarriers; P_b lives in stage 1's RoPE block, dead
once S_b is done (P V reads only the latent part), as in the CUDA kernel. Each half of a stage (latent columns 0-255,
256-511; the RoPE block goes with the half its last reader refills) has its own mbarrier and is refilled by the
warpgroup that reads it last, as soon as it has, and S starts on the half that was refilled first. (FlashMLA's order,
warpgroup 1 running P_b V_bR before P_a V_aR with P_a rescaled to m_b, was this kernel's first version; the two orders
were compared only while the loop still spilled, and this one has not been compared with it since:
docs/notes/triton.md, "The seesaw kernel".)

Scope: bf16/fp16 caches of q's type, pages of whole 64-token tiles (every tile by TMA; a partial last tile's rows past
the item's end are zeroed in shared memory before P V reads them, and masked out of S), one KV head, D_qk = 576,
D_v = 512, 64-row head tiles. :func:`.gluon_sm90.gluon_applies` plus :func:`seesaw_applies` decide.
"""

from __future__ import annotations

from mla_dispatch.kernels.triton import gluon_sm90 as _g
from mla_dispatch.kernels.triton.device import kernel_device

if _g.GLUON_API:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    _cta_barrier = _g._cta_barrier
    _tma_load = _g._tma_load

__all__ = ["seesaw_applies", "launch_decode_seesaw"]

BLOCK_M = 64
BLOCK_N = 64
HALF = 256  # latent columns per warpgroup (and per TMA half)
WORKER_REGS = 240  # registers per thread of the worker partition (setmaxnreg); the default partition gets the rest


def seesaw_applies(kv) -> bool:
    """The seesaw kernel's own conditions on top of :func:`.gluon_sm90.gluon_applies`: a 16-bit cache (not fp8) with
    pages of whole 64-token tiles. (A plan may keep :mod:`.gluon_sm90`'s kernel there instead:
    ``backend_options={"kernel": "gluon"}``, :mod:`.launch`.)"""
    return kv.element_size() == 2 and kv.shape[1] % BLOCK_N == 0


if _g.GLUON_API:
    _M = gl.constexpr(BLOCK_M)  # the same three, as Gluon constants
    _N = gl.constexpr(BLOCK_N)
    _H = gl.constexpr(HALF)

    @gluon.jit
    def _page(bt_row, start, valid, num_blocks, PAGE_SIZE: gl.constexpr):
        """The page of the tile from ``start`` (0 where not ``valid``: no table entry past an item's end is read), and 1
        if the entry is a block id outside ``[0, num_blocks)`` (the page is 0 instead: nothing outside the cache is
        read; the caller poisons the item), else 0."""
        page = gl.load(bt_row + start // PAGE_SIZE, mask=valid, other=0)
        ok = page.to(gl.uint32, bitcast=True) < num_blocks  # 0 <= page < num_blocks, in one compare
        return gl.where(ok, page, 0), gl.where(ok, 0, 1)

    @gluon.jit
    def _load_half(k_desc, r_desc, page, start, kbuf, rbuf, bar, PAGE_SIZE: gl.constexpr, H: gl.constexpr,
                   ROPE: gl.constexpr):
        """TMA of latent columns ``[H * 256, H * 256 + 256)`` of the 64-token tile from ``start`` (and its RoPE block
        when ``ROPE``) into ``kbuf`` / ``rbuf``, completing on ``bar``. The tile lies in one page (PAGE_SIZE % 64 ==
        0), ``page`` (:func:`_page`, loaded ahead so that the table's latency is not paid here)."""
        r0 = page * PAGE_SIZE + start % PAGE_SIZE
        if ROPE:
            mbarrier.expect(bar, 64 * (_H + 64) * 2)
        else:
            mbarrier.expect(bar, 64 * _H * 2)
        _tma_load(k_desc, [r0, H * _H], bar, kbuf.slice(H * _H, _H, dim=1))
        if ROPE:
            _tma_load(r_desc, [r0, 2 * _H], bar, rbuf)

    @gluon.jit
    def _scores(q_all, qr_all, k_smem, r_smem, z, bar_first, bar_second, phase, s_layout: gl.constexpr,
                ST: gl.constexpr, FIRST: gl.constexpr):
        """S = Q K^T of the tile in stage ``ST`` [64 rows, 64 tokens] (raw, fp32): latent half ``FIRST`` as soon as its
        barrier completes, then the other half and the RoPE block (which lands with the second half for warpgroup 0's
        stage and with the first for warpgroup 1's: each half carries it where its refiller reads it last).

        ``z`` is 0, computed from a value loaded in the loop: indexing the buffers with it keeps the compiler from
        hoisting the 36 k-steps' wgmma descriptors out of the loop, where they took 144 registers and spilled (the
        CUDA kernel's v5 hit the same and passes its bases through an empty asm)."""
        SECOND: gl.constexpr = 1 - FIRST
        q_smem = q_all.index(z)
        kbuf = k_smem.index(ST + z)
        mbarrier.wait(bar_first, phase)
        s = warpgroup_mma(q_smem.slice(FIRST * _H, _H, dim=1), kbuf.slice(FIRST * _H, _H, dim=1).permute((1, 0)),
                          gl.zeros([_M, _N], gl.float32, s_layout), use_acc=False, is_async=True)
        mbarrier.wait(bar_second, phase)
        s = warpgroup_mma(q_smem.slice(SECOND * _H, _H, dim=1),
                          kbuf.slice(SECOND * _H, _H, dim=1).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma(qr_all.index(z), r_smem.index(ST + z).permute((1, 0)), s, is_async=True)
        return warpgroup_mma_wait(num_outstanding=0, deps=(s, ))

    @gluon.jit
    def _clean_rows(vbuf, hidden, valid, layout: gl.constexpr):
        """In a ``[64, 256]`` V half in shared memory: rows ``[valid, 64)`` set to 0 (unused cache slots of a partial
        tile, possibly NaN: P is 0 there, but 0 * NaN is not), and the non-finite values of rows ``[hidden, valid)``
        set to 0 (keys the causal mask hides from some row of the tile: that row's p is 0 for them, and 0 * NaN would
        reach its out; the rows that see such a key get NaN from its score already, V being the first 512 channels
        of K; the same rule as decode.py's _hide_from_rows_that_do_not_see). 8 rows at a time (few registers: the
        accumulator is live), from the first 8-row slice holding row ``hidden``; then fence and sync the warpgroup.
        ``hidden == valid`` (no causal mask): the partial tile's zeroing only."""
        for i in gl.static_range(_N // 8):
            if hidden < (i + 1) * 8:
                part = vbuf.slice(i * 8, 8, dim=0)
                rows = (i * 8 + gl.arange(0, 8, layout=gl.SliceLayout(1, layout)))[:, None]
                x = part.load(layout)
                keep = (rows < hidden) | ((rows < valid) & (gl.abs(x.to(gl.float32)) < float("inf")))
                part.store(gl.where(keep, x, gl.zeros_like(x)))
        fence_async_shared()
        _cta_barrier()

    @gluon.jit
    def _zero_rows(vbuf, valid, layout: gl.constexpr):
        """Zero rows ``[valid, 64)`` of a ``[64, 256]`` V half in shared memory (unused cache slots of a partial tile,
        possibly NaN: P is 0 there, but 0 * NaN is not), 16 rows at a time; then fence and sync the warpgroup."""
        for i in gl.static_range(_N // 16):
            if valid < (i + 1) * 16:
                part = vbuf.slice(i * 16, 16, dim=0)
                rows = i * 16 + gl.arange(0, 16, layout=gl.SliceLayout(1, layout))
                x = part.load(layout)
                part.store(gl.where(rows[:, None] < valid, x, gl.zeros_like(x)))
        fence_async_shared()
        _cta_barrier()

    @gluon.jit
    def _masked(s, start, limit, qk_scale, col_s: gl.constexpr):
        n = start + gl.arange(0, _N, layout=col_s)
        return gl.where(n[None, :] < limit[:, None], s * qk_scale, float("-inf"))

    @gluon.jit
    def _safe(m):
        return gl.where(m == float("-inf"), 0.0, m)

    @gluon.jit
    def _epilogue(acc, l_i, m_i, poison, sums, s_sum, s_amax, parity, req, slot, q_len, group, m_tile,
                  Out, Lse, PartialOut, PartialLse,
                  stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
                  stride_pob, stride_pos, stride_poh, stride_plb, stride_pls, stride_plh,
                  WG: gl.constexpr, o_layout: gl.constexpr):
        """Both warpgroups' row sums and largest |O| through shared memory (one barrier of count 2 per item), then
        this warpgroup's 256 channels of out (or of the partial row: fp16 with one power-of-two scale per row,
        :data:`.combine.PARTIAL_ROW_FORMAT`) and, from warpgroup 0, the LSE and the row scale. A warpgroup that met a
        bad block id in the item (``poison``) passes NaN row sums, so out and LSE are NaN in both."""
        LN2: gl.constexpr = 0.6931471805599453
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        col_o: gl.constexpr = gl.SliceLayout(0, o_layout)
        l_o = gl.where(poison != 0, float("nan"), gl.convert_layout(l_i, row_o))
        s_sum.index(parity * 2 + WG).store(l_o)
        s_amax.index(parity * 2 + WG).store(gl.max(gl.abs(acc), 1))
        _cta_barrier()
        mbarrier.arrive(sums)
        mbarrier.wait(sums, parity)
        l_tot = s_sum.index(parity * 2).load(row_o) + s_sum.index(parity * 2 + 1).load(row_o)
        amax = gl.maximum(s_amax.index(parity * 2).load(row_o), s_amax.index(parity * 2 + 1).load(row_o))
        m_o = gl.convert_layout(m_i, row_o)
        has_key = l_tot != 0.0  # 0: no key; NaN: a bad block id (out and LSE NaN)
        inv_l = gl.where(has_key, 1.0 / gl.where(has_key, l_tot, 1.0), 0.0)
        lse_nat = (m_o + gl.log2(gl.where(has_key, l_tot, 1.0))) * LN2
        o = acc * inv_l[:, None]
        rows_total = q_len * group
        flat = m_tile * _M + gl.arange(0, _M, layout=row_o)
        row_ok = flat < rows_total
        q_tok = flat // group
        head = flat % group
        d = WG * _H + gl.arange(0, _H, layout=col_o)
        if slot < 0:
            o_off = req.to(gl.int64) * stride_ob + q_tok.to(gl.int64) * stride_os + head.to(gl.int64) * stride_oh
            gl.store(Out + o_off[:, None] + d[None, :], o.to(Out.dtype.element_ty), mask=row_ok[:, None])
            if WG == 0:
                l_off = req.to(gl.int64) * stride_lb + head.to(gl.int64) * stride_lh + q_tok.to(gl.int64) * stride_ls
                gl.store(Lse + l_off, gl.where(has_key, lse_nat, float("inf")), mask=row_ok)
        else:
            p_off = slot.to(gl.int64) * stride_pob + q_tok.to(gl.int64) * stride_pos + head.to(gl.int64) * stride_poh
            up, down = _g._pow2_scale(amax * inv_l)
            gl.store(PartialOut + p_off[:, None] + d[None, :], (o * up[:, None]).to(gl.float16), mask=row_ok[:, None])
            if WG == 0:
                gl.store((PartialOut + p_off + 2 * _H).to(gl.pointer_type(gl.float32)), down, mask=row_ok)
                pl_off = (slot.to(gl.int64) * stride_plb + q_tok.to(gl.int64) * stride_pls
                          + head.to(gl.int64) * stride_plh)
                gl.store(PartialLse + pl_off, gl.where(has_key, lse_nat, float("-inf")), mask=row_ok)

    @gluon.jit
    def _partition(args, WG: gl.constexpr):
        """One warpgroup's side of the schedule (``WG`` 0: even tiles, O[:, 0:256), issues the query tile and each
        item's first two tiles; 1: odd tiles, O[:, 256:512)); ``args``: the kernel's arguments and shared buffers, the
        same tuple for both partitions. ``bars`` rows: 0-3 the stage halves (stage * 2 + half), 4 the query tile, 5-7
        the hand-offs of a pair (below), 8 the item's sums (count 2)."""
        (q_desc, qr_desc, k_desc, r_desc, BlockTable, Seqlens, Items, PartOffsets,
         Out, Lse, PartialOut, PartialLse,
         q_smem, qr_smem, k_smem, r_smem, p0_smem, s_m, s_sum, s_amax, bars,
         qk_scale, q_len, group, stride_bt, num_blocks,
         stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
         stride_pob, stride_pos, stride_poh, stride_plb, stride_pls, stride_plh, PAGE_SIZE, CAUSAL) = args
        cdt: gl.constexpr = q_desc.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, _N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, _H, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        z_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])  # 16 x 256 per pass
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        q_bar = bars.index(4)
        a_ready = bars.index(5)  # P_a in p0_smem, m_a in s_m (warpgroup 0 -> 1)
        b_ready = bars.index(6)  # P_b in stage 1's RoPE block, m_b in s_m (1 -> 0)
        pa_free = bars.index(7)  # P_a V_aR done: p0_smem free (1 -> 0)
        sums = bars.index(8)
        k0 = k_smem.index(0)
        k1 = k_smem.index(1)
        r0 = r_smem.index(0)
        r1 = r_smem.index(1)  # P_b lives here once S_b is done
        v_own0 = k0.slice(WG * _H, _H, dim=1)
        v_own1 = k1.slice(WG * _H, _H, dim=1)

        part = gl.program_id(0)
        m_tile = gl.program_id(1)
        rows_total = q_len * group
        flat_s = m_tile * _M + gl.arange(0, _M, layout=row_s)
        q_tok_s = flat_s // group
        item_begin = gl.load(PartOffsets + part)
        item_end = gl.load(PartOffsets + part + 1)
        base0 = 0  # tiles loaded into stage 0 / 1 before this item (mbarrier phases)
        base1 = 0
        n_q = 0  # query tiles loaded so far
        n_pairs = 0  # pairs done so far (the hand-off barriers complete once per pair)
        n_items = 0
        for item in range(item_begin, item_end):
            req, tok_begin, tok_end, slot, seqlen = _g._item_meta(Items, Seqlens, item)
            bt_row = BlockTable + req.to(gl.int64) * stride_bt
            n_tiles = gl.cdiv(tok_end - tok_begin, _N)
            if CAUSAL:
                limit = gl.minimum(seqlen - q_len + 1 + q_tok_s, tok_end)
            else:
                limit = gl.minimum(seqlen, tok_end) + q_tok_s * 0
            # the first key of the item some row of this tile does not see (tok_end where they all see every key):
            # V rows from there on are cleaned before P V (_clean_rows)
            first_hidden = gl.min(limit, 0)
            m_i = gl.full([_M], float("-inf"), gl.float32, layout=row_s)
            l_i = gl.zeros([_M], gl.float32, layout=row_s)
            acc = gl.zeros([_M, _H], gl.float32, layout=o_layout)
            s = gl.zeros([_M, _N], gl.float32, layout=s_layout)
            poison = n_tiles * 0  # nonzero once a page of this item was a bad block id (warpgroup 0 reads every page)
            if n_tiles > 0:
                if WG == 0:  # both warpgroups are done with the previous item (its sums barrier)
                    q_row0 = req * rows_total + m_tile * _M
                    mbarrier.expect(q_bar, _M * (2 * _H + 64) * 2)
                    _tma_load(q_desc, [q_row0, 0], q_bar, q_smem.index(0))
                    _tma_load(qr_desc, [q_row0, 2 * _H], q_bar, qr_smem.index(0))
                    pg0, bad = _page(bt_row, tok_begin, True, num_blocks, PAGE_SIZE)
                    poison = poison | bad
                    _load_half(k_desc, r_desc, pg0, tok_begin, k0, r0, bars.index(0), PAGE_SIZE, 0, False)
                    _load_half(k_desc, r_desc, pg0, tok_begin, k0, r0, bars.index(1), PAGE_SIZE, 1, True)
                    if n_tiles > 1:
                        pg1, bad = _page(bt_row, tok_begin + _N, True, num_blocks, PAGE_SIZE)
                        poison = poison | bad
                        _load_half(k_desc, r_desc, pg1, tok_begin + _N, k1, r1, bars.index(2), PAGE_SIZE, 0, True)
                        _load_half(k_desc, r_desc, pg1, tok_begin + _N, k1, r1, bars.index(3), PAGE_SIZE, 1, False)
                    mbarrier.wait(q_bar, n_q & 1)
                    s = _scores(q_smem, qr_smem, k_smem, r_smem, (pg0 < 0).to(gl.int32), bars.index(0), bars.index(1),
                                   base0 & 1, s_layout, 0, 0)
                else:
                    if n_tiles > 1:
                        mbarrier.wait(q_bar, n_q & 1)
                        s = _scores(q_smem, qr_smem, k_smem, r_smem, (tok_begin < 0).to(gl.int32), bars.index(3),
                                       bars.index(2), base1 & 1, s_layout, 1, 1)
                n_q += 1

            for a in range(0, n_tiles, 2):
                has_b = a + 1 < n_tiles
                next_a = a + 2 < n_tiles
                next_b = a + 3 < n_tiles
                ph = n_pairs & 1
                buf = n_pairs & 1
                start_a = tok_begin + a * _N
                start_b = start_a + _N
                ph_a = (base0 + a // 2) & 1  # stage phases of tiles a, b (a + 2, b + 2: the opposite)
                ph_b = (base1 + a // 2) & 1
                # the pages of tiles a + 2 and b + 2, read now: the refills below would otherwise wait for them
                pg_a2, bad_a = _page(bt_row, start_a + 2 * _N, next_a, num_blocks, PAGE_SIZE)
                pg_b2, bad_b = _page(bt_row, start_b + 2 * _N, next_b, num_blocks, PAGE_SIZE)
                if WG == 0:  # (warpgroup 1's rows get the NaN through the row sums: no register of its own for it)
                    poison = poison | bad_a | bad_b
                if WG == 0:
                    # -- softmax of tile a against m (the maximum after the previous pair's tile b); P_a and m_a out
                    s = _masked(s, start_a, limit, qk_scale, col_s)
                    m_a = gl.maximum(m_i, gl.max(s, 1))
                    sc0 = gl.exp2(m_i - _safe(m_a))
                    p = gl.exp2(s - _safe(m_a)[:, None])
                    l_i = l_i * sc0 + gl.sum(p, 1)
                    p16 = p.to(cdt)
                    mbarrier.wait(pa_free, ph)  # warpgroup 1's P_a V_aR of the previous pair is done
                    p0_smem.store(p16)
                    s_m.index(buf).store(m_a)
                    fence_async_shared()
                    _cta_barrier()
                    mbarrier.arrive(a_ready)
                    # -- O_L = O_L * sc0 + P_a V_aL
                    acc = acc * gl.convert_layout(sc0, row_o)[:, None]
                    if CAUSAL:  # a partial tile (the last), or keys some row does not see
                        if start_a + _N > first_hidden:
                            _clean_rows(v_own0, first_hidden - start_a, tok_end - start_a, z_layout)
                    elif start_a + _N > tok_end:  # (a partial tile: the last)
                        _zero_rows(v_own0, tok_end - start_a, z_layout)
                    acc = warpgroup_mma(gl.convert_layout(p16, a_layout), v_own0, acc, is_async=True)
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                    if next_a:  # stage 0's first half: warpgroup 0 read it last
                        _load_half(k_desc, r_desc, pg_a2, start_a + 2 * _N, k0, r0, bars.index(0), PAGE_SIZE, 0, False)
                    # -- the maximum after tile b; O_L = O_L * sc1 + P_b V_bL
                    mbarrier.wait(b_ready, ph)
                    m_b = s_m.index(buf).load(row_s)
                    sc1 = gl.exp2(m_a - _safe(m_b))
                    m_i = m_b
                    l_i = l_i * sc1
                    acc = acc * gl.convert_layout(sc1, row_o)[:, None]
                    if has_b:
                        mbarrier.wait(bars.index(2), ph_b)  # stage 1's first half (V_bL; P_b's block)
                        if CAUSAL:
                            if start_b + _N > first_hidden:
                                _clean_rows(v_own1, first_hidden - start_b, tok_end - start_b, z_layout)
                        elif start_b + _N > tok_end:  # (a partial tile: the last)
                            _zero_rows(v_own1, tok_end - start_b, z_layout)
                        acc = warpgroup_mma(r1, v_own1, acc, is_async=True)
                        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                        if next_b:  # stage 1's first half and RoPE block (P_b): warpgroup 0 read them last
                            _load_half(k_desc, r_desc, pg_b2, start_b + 2 * _N, k1, r1, bars.index(2), PAGE_SIZE, 0,
                                       True)
                    if next_a:
                        s = _scores(q_smem, qr_smem, k_smem, r_smem, (pg_a2 < 0).to(gl.int32), bars.index(0),
                                   bars.index(1), ph_a ^ 1, s_layout, 0, 0)
                else:
                    # -- O_R = O_R * sc0 + P_a V_aR, in flight while this warpgroup runs the softmax of tile b
                    mbarrier.wait(a_ready, ph)
                    m_a = s_m.index(buf).load(row_s)
                    sc0 = gl.exp2(m_i - _safe(m_a))
                    l_i = l_i * sc0
                    acc = acc * gl.convert_layout(sc0, row_o)[:, None]
                    mbarrier.wait(bars.index(1), ph_a)  # V_aR landed (warpgroup 0 waited for it, for S_a)
                    if CAUSAL:
                        if start_a + _N > first_hidden:
                            _clean_rows(v_own0, first_hidden - start_a, tok_end - start_a, z_layout)
                    elif start_a + _N > tok_end:  # (a partial tile: the last)
                        _zero_rows(v_own0, tok_end - start_a, z_layout)
                    acc = warpgroup_mma(p0_smem, v_own0, acc, is_async=True)
                    # -- softmax of tile b against m_a; P_b (into stage 1's RoPE block, which S_b no longer needs) and
                    # m_b out
                    if has_b:
                        s = _masked(s, start_b, limit, qk_scale, col_s)
                        m_b = gl.maximum(m_a, gl.max(s, 1))
                        sc1 = gl.exp2(m_a - _safe(m_b))
                        p = gl.exp2(s - _safe(m_b)[:, None])
                        l_i = l_i * sc1 + gl.sum(p, 1)
                        p16 = p.to(cdt)
                        r1.store(p16)
                    else:
                        m_b = m_a
                        sc1 = gl.full([_M], 1.0, gl.float32, layout=row_s)
                        p16 = gl.zeros([_M, _N], cdt, layout=s_layout)
                    m_i = m_b
                    _cta_barrier()  # every thread has read m_a: m_b takes its place
                    s_m.index(buf).store(m_b)
                    fence_async_shared()
                    _cta_barrier()
                    mbarrier.arrive(b_ready)
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                    _cta_barrier()
                    mbarrier.arrive(pa_free)
                    if next_a:  # stage 0's second half and RoPE block: warpgroup 1 read them last
                        _load_half(k_desc, r_desc, pg_a2, start_a + 2 * _N, k0, r0, bars.index(1), PAGE_SIZE, 1, True)
                    # -- O_R = O_R * sc1 + P_b V_bR
                    acc = acc * gl.convert_layout(sc1, row_o)[:, None]
                    if has_b:
                        if CAUSAL:
                            if start_b + _N > first_hidden:
                                _clean_rows(v_own1, first_hidden - start_b, tok_end - start_b, z_layout)
                        elif start_b + _N > tok_end:  # (a partial tile: the last)
                            _zero_rows(v_own1, tok_end - start_b, z_layout)
                        acc = warpgroup_mma(gl.convert_layout(p16, a_layout), v_own1, acc, is_async=True)
                        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                        if next_b:  # stage 1's second half: warpgroup 1 read it last
                            _load_half(k_desc, r_desc, pg_b2, start_b + 2 * _N, k1, r1, bars.index(3), PAGE_SIZE, 1,
                                       False)
                    if next_b:
                        s = _scores(q_smem, qr_smem, k_smem, r_smem, (pg_b2 < 0).to(gl.int32), bars.index(3),
                                   bars.index(2), ph_b ^ 1, s_layout, 1, 1)
                n_pairs += 1
            base0 += (n_tiles + 1) // 2
            base1 += n_tiles // 2

            _epilogue(acc, l_i, m_i, poison, sums, s_sum, s_amax, n_items & 1, req, slot, q_len, group, m_tile,
                      Out, Lse, PartialOut, PartialLse,
                      stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
                      stride_pob, stride_pos, stride_poh, stride_plb, stride_pls, stride_plh, WG, o_layout)
            n_items += 1

    @gluon.jit
    def mla_decode_seesaw_kernel(
        q_desc, qr_desc, k_desc, r_desc,
        BlockTable, Seqlens, Items, PartOffsets,
        Out, Lse, PartialOut, PartialLse,
        qk_scale,  # softmax_scale * log2(e)
        q_len, group,  # s_q, h_q
        stride_bt,
        stride_ob, stride_os, stride_oh,
        stride_lb, stride_lh, stride_ls,
        stride_pob, stride_pos, stride_poh,
        stride_plb, stride_pls, stride_plh,
        num_blocks,  # kv.shape[0]: a block id outside [0, num_blocks) is not loaded, and its item's rows are NaN
        PAGE_SIZE: gl.constexpr, CAUSAL: gl.constexpr, WORKER_NUM_REGS: gl.constexpr,
    ):
        gl.static_assert(gl.num_warps() == 4)
        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [1, _M, 2 * _H], q_desc.layout)  # [1, ...]: see _scores
        qr_smem = gl.allocate_shared_memory(dtype, [1, _M, 64], qr_desc.layout)
        k_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_N, 2 * _H], dtype)
        r_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_N, 64], dtype)
        k_smem = gl.allocate_shared_memory(dtype, [2, _N, 2 * _H], k_layout)
        r_smem = gl.allocate_shared_memory(dtype, [2, _N, 64], r_layout)
        p0_smem = gl.allocate_shared_memory(dtype, [_M, _N], r_layout)
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])  # rows of [n, 64] buffers
        # the row maximum after tile a (written by warpgroup 0), then after tile b (warpgroup 1), by pair parity
        s_m = gl.allocate_shared_memory(gl.float32, [2, _M], flat)
        s_sum = gl.allocate_shared_memory(gl.float32, [4, _M], flat)  # by item parity x warpgroup
        s_amax = gl.allocate_shared_memory(gl.float32, [4, _M], flat)
        bars = gl.allocate_shared_memory(gl.int64, [9, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(8):
            mbarrier.init(bars.index(i), count=1)
        mbarrier.init(bars.index(8), count=2)
        mbarrier.arrive(bars.index(7))  # P_a's buffer starts free
        fence_async_shared()
        args = (q_desc, qr_desc, k_desc, r_desc, BlockTable, Seqlens, Items, PartOffsets,
                Out, Lse, PartialOut, PartialLse,
                q_smem, qr_smem, k_smem, r_smem, p0_smem, s_m, s_sum, s_amax, bars,
                qk_scale, q_len, group, stride_bt, num_blocks,
                stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
                stride_pob, stride_pos, stride_poh, stride_plb, stride_pls, stride_plh, PAGE_SIZE, CAUSAL)
        gl.warp_specialize([(_partition, (args, 0)), (_partition, (args, 1))], [4], [WORKER_NUM_REGS])


def launch_decode_seesaw(q, kv, block_table, cache_seqlens, items, part_offsets, out, lse, partial_out, partial_lse,
                         *, softmax_scale: float, causal: bool):
    """Launch :func:`mla_decode_seesaw_kernel` (check :func:`.gluon_sm90.gluon_applies` and :func:`seesaw_applies`
    first): grid ``(num_parts, ceil(s_q * h_q / 64))``, 8 warps (two partitions of 4). Arguments as
    :func:`.gluon_sm90.launch_decode_gluon`. No allocation, no sync."""
    grid, fixed, options = seesaw_fixed(q_len=q.shape[1], h_q=q.shape[2], page_size=kv.shape[1],
                                        block_table=block_table, seqlens=cache_seqlens, items=items,
                                        part_offsets=part_offsets, partial_out=partial_out, partial_lse=partial_lse,
                                        softmax_scale=softmax_scale, causal=causal)
    with kernel_device(q):
        return mla_decode_seesaw_kernel[grid](**fixed, **seesaw_call(q, kv, out, lse), **options)


def seesaw_fixed(*, q_len: int, h_q: int, page_size: int, block_table, seqlens, items, part_offsets, partial_out,
                 partial_lse, softmax_scale: float, causal: bool):
    """``(grid, arguments, launch options)`` of :func:`mla_decode_seesaw_kernel` that a plan fixes (everything but
    :func:`seesaw_call`'s)."""
    grid, fixed = _g.split_kv_fixed(block_m=BLOCK_M, q_len=q_len, h_q=h_q, page_size=page_size,
                                    block_table=block_table, seqlens=seqlens, items=items, part_offsets=part_offsets,
                                    partial_out=partial_out, partial_lse=partial_lse, softmax_scale=softmax_scale,
                                    causal=causal)
    fixed["WORKER_NUM_REGS"] = WORKER_REGS
    return grid, fixed, {"num_warps": 4}


def seesaw_descriptors(kv):
    """The (latent, RoPE) TMA descriptors over the cache the seesaw kernel loads from (the latent part in halves)."""
    return _g._descriptors(kv, kv.shape[0] * kv.shape[1], BLOCK_N, 2 * HALF, cols=HALF)


def seesaw_call(q, kv, out, lse, *, kv_descriptors=None) -> dict:
    """The arguments of :func:`mla_decode_seesaw_kernel` that change per call: the TMA descriptors over q and the
    cache (``kv_descriptors``: a function of the cache giving its pair, for a caller that keeps them), out and lse and
    their strides, the cache's block count."""
    batch, q_len, h_q, _ = q.shape
    qd, qrd = _g._descriptors(q, batch * q_len * h_q, BLOCK_M, 2 * HALF)
    kd, rd = (kv_descriptors or seesaw_descriptors)(kv)
    return dict(q_desc=qd, qr_desc=qrd, k_desc=kd, r_desc=rd, Out=out, Lse=lse,
                stride_ob=out.stride(0), stride_os=out.stride(1), stride_oh=out.stride(2),
                stride_lb=lse.stride(0), stride_lh=lse.stride(1), stride_ls=lse.stride(2), num_blocks=kv.shape[0])
