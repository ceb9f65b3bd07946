"""LSE-weighted merge of split-KV partial results, in Triton.

Same contract as the torch reference :func:`mla_dispatch.metadata.combine_splits`:
for every request with ``num_splits > 1``, its slots
``first_slot[b] .. first_slot[b] + num_splits[b] - 1`` hold per-slot outputs
normalised by their own softmax denominator and natural-log LSEs (``-inf``: the
slot saw no key for that row).  With ``M = max_s lse_s``::

    w_s = exp(lse_s - M);  out = sum_s w_s * out_s / sum_s w_s;  lse = M + log(sum_s w_s)

A row whose every slot is ``-inf`` gets ``out = 0`` and ``lse = +inf``.
Requests that were not split are left untouched (the decode kernel wrote them).
One program per (request, tile of query rows, tile of channels); rows are ``(query token, head)``.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["combine_kernel", "launch_combine"]


@triton.jit
def combine_kernel(
    PartialOut, PartialLse, Out, Lse, NumSplits, FirstSlot,
    num_heads,
    stride_pob, stride_pos, stride_poh,
    stride_plb, stride_pls, stride_plh,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_lh, stride_ls,
    ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    n_splits = tl.load(NumSplits + b)
    if n_splits > 1:
        first = tl.load(FirstSlot + b).to(tl.int64)
        r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        ok = r < ROWS
        i = (r // num_heads).to(tl.int64)
        h = (r % num_heads).to(tl.int64)
        d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)

        # pass 1: the maximum LSE over the request's slots
        m = tl.full([BLOCK_R], float("-inf"), tl.float32)
        for s in range(n_splits):
            lse_s = tl.load(PartialLse + (first + s) * stride_plb + i * stride_pls + h * stride_plh,
                            mask=ok, other=float("-inf"))
            m = tl.maximum(m, lse_s)
        m_safe = tl.where(m == float("-inf"), 0.0, m)

        # pass 2: weighted sum of the partial outputs
        denom = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
        for s in range(n_splits):
            slot = first + s
            lse_s = tl.load(PartialLse + slot * stride_plb + i * stride_pls + h * stride_plh,
                            mask=ok, other=float("-inf"))
            w = tl.exp(lse_s - m_safe)
            denom += w
            o_s = tl.load(PartialOut + slot * stride_pob + (i * stride_pos + h * stride_poh)[:, None] + d[None, :],
                          mask=ok[:, None] & (w[:, None] > 0), other=0.0)
            acc += w[:, None] * o_s

        has = denom > 0
        out = acc / tl.where(has, denom, 1.0)[:, None]
        out = tl.where(has[:, None], out, 0.0)
        lse = tl.where(has, m_safe + tl.log(tl.where(has, denom, 1.0)), float("inf"))
        bo = b.to(tl.int64)
        tl.store(Out + bo * stride_ob + (i * stride_os + h * stride_oh)[:, None] + d[None, :],
                 out.to(Out.dtype.element_ty), mask=ok[:, None])
        tl.store(Lse + bo * stride_lb + h * stride_lh + i * stride_ls, lse, mask=ok & ((r * 0 + tl.program_id(2)) == 0))


def launch_combine(partial_out, partial_lse, num_splits, first_slot, out, lse, *, block_r: int = 4,
                   block_d: int = 128, kernel=combine_kernel):
    """Merge partials into ``out`` ``[B, s_q, h_q, D_v]`` / ``lse`` ``[B, h_q, s_q]`` (no allocation).

    One program per (request, ``block_r`` rows, ``block_d`` channels): many small
    programs, so a single long request split over every SM still merges in parallel.
    ``kernel`` is :func:`combine_kernel` or ``torch.library.wrap_triton`` of it (inside
    the registered op, :mod:`.ops`). Returns Triton's launch handle.
    """
    batch, q_len, h_q, d_v = out.shape
    rows = q_len * h_q
    block_d = min(block_d, d_v)
    grid = (batch, triton.cdiv(rows, block_r), triton.cdiv(d_v, block_d))
    return kernel[grid](
        partial_out, partial_lse, out, lse, num_splits, first_slot,
        h_q,
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1), partial_lse.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1), lse.stride(2),
        ROWS=rows, BLOCK_R=block_r, BLOCK_D=block_d,
        num_warps=4,
    )
