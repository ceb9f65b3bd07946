"""LSE-weighted merge of split-KV partial results, in Triton.

Same contract as the torch reference :func:`mla_dispatch.metadata.combine.combine_splits`:
for every request with ``num_splits > 1``, its slots
``first_slot[b] .. first_slot[b] + num_splits[b] - 1`` hold per-slot outputs
normalised by their own softmax denominator and natural-log LSEs (``-inf``: the
slot saw no key for that row).  With ``M = max_s lse_s``::

    w_s = exp(lse_s - M);  out = sum_s w_s * out_s / sum_s w_s;  lse = M + log(sum_s w_s)

A row whose every slot is ``-inf`` gets ``out = 0`` and ``lse = +inf``; a row with a NaN slot (the decode
kernel met a bad block id in that piece of the request) gets NaN for both.
Requests that were not split are left untouched (the decode kernel wrote them).
One program per (request, tile of query rows, tile of channels); rows are ``(query token, head)``.
Where the batch has more requests than the schedule has part boundaries, the first grid axis
runs over the boundaries instead (``BY_BOUNDARY``): at most ``num_parts - 1`` requests are
split, so programs for the unsplit ones, which would only read ``num_splits`` and exit, are
not launched (b = 512, 66 parts: 65 instead of 512 program rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_dispatch.kernels.triton.device import kernel_device

__all__ = ["PARTIAL_ROW_FORMAT", "combine_kernel", "combine_by_boundary", "launch_combine", "combine_fixed", "combine_call"]

#: How the decode kernel (:mod:`.decode`) stores a split request's partial row in the plan's fp16 workspace row
#: ``partial_out[slot, i, h, :]`` (``2 D_v`` fp16, the bytes of an fp32 row) and this combine reads it:
#:
#: - elements ``0 .. D_v - 1``: the normalised output times ``2^s``, in fp16;
#: - elements ``D_v + 2 v, D_v + 2 v + 1``, one fp32, for decode program ``v`` of the row (``v < v_split``,
#:   channels ``v D_v / v_split ..``): ``2^-s``, with ``s`` putting that program's largest magnitude in
#:   ``[2^14, 2^15)`` (``_pow2_scale`` in :mod:`.decode`), so fp16 neither overflows nor drops bits however large or
#:   small the outputs.
#:
#: Half the bytes of fp32 rows are written and read back (as the CUDA kernel's partial rows, kernels/cuda/
#: mla_decode_sm90/params.h, which scale per quarter row); fp16 rounds to 2^-12 relative, 8x finer than bf16. The
#: combine reads the values as 32-bit words (two channels each) through an int32 view of the workspace
#: (docs/notes/triton.md, "fp16 partial rows").
PARTIAL_ROW_FORMAT = "fp16 values times 2^s, then one fp32 2^-s per decode program of the row"


@triton.jit
def combine_kernel(
    PartialOut, PartialLse, Out, Lse, NumSplits, FirstSlot, Items, PartOffsets,
    num_heads,
    stride_pob, stride_pos, stride_poh,
    stride_plb, stride_pls, stride_plh,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_lh, stride_ls,
    ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    BY_BOUNDARY: tl.constexpr, D_V: tl.constexpr, SCALE_BLOCK: tl.constexpr,
    AttnSink=None, HAS_SINK: tl.constexpr = False,  # fp32 [h_q]: a merged row is scaled by 1 / (1 + exp(sink - lse))
):
    # Partial rows (PARTIAL_ROW_FORMAT) are read as 32-bit words, two fp16 channels each (`PartialOut` is the
    # workspace viewed as int32, strides in words): loaded as fp16 elements, the same bytes made the combine 1.2-2.5x
    # slower with triton 3.6 (docs/notes/triton.md). Word j of a row holds channels 2j (low half) and 2j + 1.
    # SCALE_BLOCK channels share one scale (D_V / the decode's v_split).
    tl.static_assert(BLOCK_D % 2 == 0 and (BLOCK_D % SCALE_BLOCK == 0 or SCALE_BLOCK % BLOCK_D == 0))
    BLOCK_W: tl.constexpr = BLOCK_D // 2
    if BY_BOUNDARY:
        # program_id(0) = boundary k between parts k and k + 1. A split request's second slot is
        # the first item of the part after one of its boundaries (the schedule cuts the cost axis
        # at the boundaries and numbers a request's slots in part order): that boundary merges it.
        part = tl.program_id(0) + 1
        it = tl.load(PartOffsets + part)
        has_item = it < tl.load(PartOffsets + part + 1)
        it64 = it.to(tl.int64) * 4
        req = tl.load(Items + it64, mask=has_item, other=-1)
        item_slot = tl.load(Items + it64 + 3, mask=has_item, other=-1)
        b = tl.maximum(req, 0)
        owner = (req >= 0) & (item_slot >= 0) & (item_slot == tl.load(FirstSlot + b) + 1)
        n_splits = tl.where(owner, tl.load(NumSplits + b), 0)
    else:
        b = tl.program_id(0)
        n_splits = tl.load(NumSplits + b)
    if n_splits > 1:
        first = tl.load(FirstSlot + b).to(tl.int64)
        r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        ok = r < ROWS
        i = (r // num_heads).to(tl.int64)
        h = (r % num_heads).to(tl.int64)
        d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
        word = tl.program_id(2) * BLOCK_W + tl.arange(0, BLOCK_W)

        row_off = i * stride_pls + h * stride_plh
        out_off = i * stride_pos + h * stride_poh
        # one pass over blocks of BLOCK_S slots, rescaled online (the running max m): the loads of a
        # block are independent, so BLOCK_S of them are in flight instead of one per loop trip
        m = tl.full([BLOCK_R], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_R], tl.float32)
        acc_lo = tl.zeros([BLOCK_R, BLOCK_W], tl.float32)  # channels 2 word
        acc_hi = tl.zeros([BLOCK_R, BLOCK_W], tl.float32)  # channels 2 word + 1
        for s0 in range(0, n_splits, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)
            slot = first + s
            s_ok = s < n_splits
            lse_s = tl.load(PartialLse + slot[None, :] * stride_plb + row_off[:, None],
                            mask=ok[:, None] & s_ok[None, :], other=float("-inf"))  # [R, S]
            m_new = tl.maximum(m, tl.max(lse_s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_safe)
            w = tl.exp(lse_s - m_safe[:, None])
            row_s = slot[None, :] * stride_pob + out_off[:, None]  # [R, S]: offset of each partial row
            seen = w > 0  # slots that saw no key are not read
            pair = tl.load(PartialOut + row_s[:, :, None] + word[None, None, :], mask=seen[:, :, None], other=0)
            lo = (pair & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)  # [R, S, W]
            hi = ((pair >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
            if SCALE_BLOCK >= BLOCK_D:  # one scale per row and slot for this program's channels
                sc = tl.load(PartialOut + row_s + D_V // 2 + (tl.program_id(2) * BLOCK_D) // SCALE_BLOCK, mask=seen,
                             other=0)
                ws = (w * sc.to(tl.float32, bitcast=True))[:, :, None]
            else:
                sc = tl.load(PartialOut + row_s[:, :, None] + D_V // 2 + (2 * word[None, None, :]) // SCALE_BLOCK,
                             mask=seen[:, :, None], other=0)
                ws = w[:, :, None] * sc.to(tl.float32, bitcast=True)
            acc_lo = acc_lo * alpha[:, None] + tl.sum(ws * lo, 1)
            acc_hi = acc_hi * alpha[:, None] + tl.sum(ws * hi, 1)
            denom = denom * alpha + tl.sum(w, 1)
            m = m_new
        m_safe = tl.where(m == float("-inf"), 0.0, m)

        # no key in any slot: denom = 0; a NaN slot makes denom NaN, and out and lse stay NaN
        empty = denom == 0.0
        acc = tl.reshape(tl.join(acc_lo, acc_hi), [BLOCK_R, BLOCK_D])  # channels back in order: 2 word, 2 word + 1
        out = acc / tl.where(empty, 1.0, denom)[:, None]
        out = tl.where(empty[:, None], 0.0, out)
        lse = tl.where(empty, float("inf"), m_safe + tl.log(tl.where(empty, 1.0, denom)))
        if HAS_SINK:  # the decode kernel's _sink_factor, for the rows it left split
            sink = tl.load(AttnSink + h, mask=ok, other=float("-inf"))
            out = out * tl.where(empty, 0.0, 1.0 / (1.0 + tl.exp(sink - lse)))[:, None]
        bo = b.to(tl.int64)
        tl.store(Out + bo * stride_ob + (i * stride_os + h * stride_oh)[:, None] + d[None, :],
                 out.to(Out.dtype.element_ty), mask=ok[:, None])
        tl.store(Lse + bo * stride_lb + h * stride_lh + i * stride_ls, lse, mask=ok & ((r * 0 + tl.program_id(2)) == 0))


def combine_by_boundary(batch: int, num_parts: int) -> bool:
    """Whether the combine runs one program row per part boundary (``num_parts - 1 < batch``) rather than per request."""
    return num_parts - 1 < batch


# (block_r, block_d, block_s) per grid, by measurement (H100, h_q = 128, benchmarks/RESULTS.md "fourth session"):
# per request (few requests, many slots each: b = 1 has 66) 4 x 256 channels, 8 slots per trip; per boundary
# (many requests, two or three slots each) two whole 512-channel rows, 4 slots per trip. Since the fp16 partial rows
# (fifteenth session, H100): 256 channels per request row block are 128 words, as many 4-byte loads as the 128 fp32
# channels before (2 rows: slower); per boundary, 2 rows took 15 us at b=128 h=128 L=8K against 32 for 1 row, 92 for
# 1 row of 256 channels and 35 for 8 slots per trip (the fp32 rows' 1 x 512 x 4: 19 us).
_BLOCKS_PER_REQUEST = (4, 256, 8)
_BLOCKS_PER_BOUNDARY = (2, 512, 4)


def launch_combine(partial_out, partial_lse, num_splits, first_slot, out, lse, items, part_offsets, *,
                   v_split: int = 1, block_r: int | None = None, block_d: int | None = None,
                   block_s: int | None = None, kernel=combine_kernel, fixed_splits: bool = False, attn_sink=None):
    """Merge partials into ``out`` ``[B, s_q, h_q, D_v]`` / ``lse`` ``[B, h_q, s_q]`` (no allocation).

    One program per (request, or part boundary where :func:`combine_by_boundary` says so,
    ``block_r`` rows, ``block_d`` channels): many small
    programs, so a single long request split over every SM still merges in parallel;
    each reads ``block_s`` slots per loop trip. Block sizes left as None take the measured
    defaults of the chosen grid.
    ``kernel`` is :func:`combine_kernel` or ``torch.library.wrap_triton`` of it (inside
    the registered op, :mod:`.ops`). ``items`` int32 ``[max_items, 4]`` and ``part_offsets`` int32
    ``[num_parts + 1]`` are the schedule's (read by the per-boundary grid). ``partial_out`` fp16 ``[max_slots, s_q, h_q,
    2 D_v]`` holds rows in :data:`PARTIAL_ROW_FORMAT`, written by a decode launched with ``v_split`` (as it clipped it).
    ``fixed_splits``: the schedule is batch-invariant (``SplitKVSchedule.fixed_splits``): any request may be split,
    even with one part, so the grid runs per request (the per-boundary grid assumes the balanced schedule's at most
    one split request per boundary) with the per-request block sizes, whatever the batch. ``attn_sink`` (fp32
    ``[h_q]``, optional): each merged row is scaled by ``1 / (1 + exp(sink - lse))``, the returned lse unchanged.
    Returns Triton's launch handle, or None when there is nothing to merge (one part, or no requests).
    """
    batch, q_len, h_q, d_v = out.shape
    prepared = combine_fixed(partial_out, partial_lse, num_splits, first_slot, items, part_offsets, batch=batch,
                             q_len=q_len, h_q=h_q, d_v=d_v, v_split=v_split, block_r=block_r, block_d=block_d,
                             block_s=block_s, fixed_splits=fixed_splits, has_sink=attn_sink is not None)
    if prepared is None:
        return None
    grid, fixed, options = prepared
    with kernel_device(out):  # Triton launches on the current device, not the tensors'
        return kernel[grid](**fixed, **combine_call(out, lse, attn_sink), **options)


def combine_fixed(partial_out, partial_lse, num_splits, first_slot, items, part_offsets, *, batch: int, q_len: int,
                  h_q: int, d_v: int, v_split: int = 1, block_r: int | None = None, block_d: int | None = None,
                  block_s: int | None = None, fixed_splits: bool = False, has_sink: bool = False):
    """``(grid, arguments, launch options)`` of :func:`combine_kernel` that a plan fixes (everything but out and lse
    and their strides and the attention sink, :func:`combine_call`), or None when there is nothing to merge (one part
    of a balanced schedule, or no requests). Arguments as :func:`launch_combine`; ``has_sink``: every call gives an
    ``attn_sink`` (the ``HAS_SINK`` constexpr).

    Raises ValueError for a ``partial_out`` that does not hold rows in :data:`PARTIAL_ROW_FORMAT`.
    """
    if partial_out.dtype != torch.float16 or partial_out.shape[-1] != 2 * d_v:
        raise ValueError(f"partial_out: dtype {partial_out.dtype}, last dim {partial_out.shape[-1]} "
                         f"(expected float16 and 2 * D_v = {2 * d_v}: PARTIAL_ROW_FORMAT)")
    rows = q_len * h_q
    num_parts = part_offsets.shape[0] - 1
    if batch == 0 or rows == 0 or (num_parts <= 1 and not fixed_splits):  # one part: no request is split
        return None
    by_boundary = not fixed_splits and combine_by_boundary(batch, num_parts)
    defaults = _BLOCKS_PER_BOUNDARY if by_boundary else _BLOCKS_PER_REQUEST
    block_r = block_r or defaults[0]
    block_s = block_s or defaults[2]
    block_d = min(block_d or defaults[1], d_v)
    grid = (num_parts - 1 if by_boundary else batch, -(-rows // block_r), -(-d_v // block_d))  # (cdiv; triton.cdiv is a constexpr function, slow on the host)
    words = partial_out.view(torch.int32)  # [max_slots, s_q, h_q, D_v]: two fp16 channels per word
    fixed = dict(
        PartialOut=words, PartialLse=partial_lse, NumSplits=num_splits, FirstSlot=first_slot, Items=items,
        PartOffsets=part_offsets, num_heads=h_q,
        stride_pob=words.stride(0), stride_pos=words.stride(1), stride_poh=words.stride(2),
        stride_plb=partial_lse.stride(0), stride_pls=partial_lse.stride(1), stride_plh=partial_lse.stride(2),
        ROWS=rows, BLOCK_R=block_r, BLOCK_D=block_d, BLOCK_S=block_s, BY_BOUNDARY=by_boundary, D_V=d_v,
        SCALE_BLOCK=d_v // v_split, HAS_SINK=has_sink)
    return grid, fixed, {"num_warps": 4}


def combine_call(out, lse, attn_sink=None) -> dict:
    """The arguments of :func:`combine_kernel` that change per call: out and lse and their strides, and the layer's
    ``attn_sink`` where the plan has one (``combine_fixed(..., has_sink=True)``)."""
    call = dict(Out=out, Lse=lse, stride_ob=out.stride(0), stride_os=out.stride(1), stride_oh=out.stride(2),
                stride_lb=lse.stride(0), stride_lh=lse.stride(1), stride_ls=lse.stride(2))
    if attn_sink is not None:
        call["AttnSink"] = attn_sink
    return call
