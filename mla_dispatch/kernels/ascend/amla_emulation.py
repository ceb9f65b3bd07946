"""AMLA, emulated step by step as our Ascend C kernel executes it (CPU or CUDA).

AMLA ("MUL by ADD in FlashAttention Rescaling", arXiv 2509.25224) keeps the
output accumulator ``O`` of FlashAttention in global memory as fp32 and never
multiplies it: the rescale by ``exp(m_old - m_new)`` is rounded to a power of
two ``2**dn`` and applied by adding ``dn * 2**23`` to the int32 bit pattern of
every element (an int32 atomic add in GM), which moves the exponent field. The
part of the rescale that a power of two cannot express is folded into the
probabilities before the cube's P·V matmul, and the bf16 rounding of that
factor is corrected by a small extra integer ("error compensation") that acts
on the mantissa.

Per query row (head x query token) and KV block ``i`` of ``BLOCK`` = 512 tokens
(all fp32 unless said otherwise; this is the order of operations of
``kernel/amla_vec_block.h``):

1. ``m_i = max(m_{i-1}, rowmax(S_i))`` with ``S_i`` already scaled;
   ``P_i = exp(S_i - m_i)``; ``l_i = l_{i-1} * exp(m_{i-1} - m_i) + rowsum(P_i)``
   (``l`` is rescaled the ordinary way; only ``O`` is AMLA'd).
2. ``n_i = rint(m_i * (-1/ln2))``; ``dn = n_i - n_{i-1}`` (0 for block 0).
3. ``s32 = exp((m_i * (1/ln2) + n_i) * ln2)`` (in ``[2**-0.5, 2**0.5]``);
   ``s16 = float(bf16(s32))``.
4. ``P~_i = bf16(P_i * s16)``: the cube's left operand.
5. ``c_i = s32 / s16``; ``eps = (c_{i-1} / c_i - 1) * 1.5 + 1e-6`` (``c_{-1} = 1``).
   Adding ``k`` to the bits of a float of mantissa ``M`` multiplies it by
   ``1 + k 2**-23 / M``; 1.5 is the mid mantissa, so this applies
   ``c_{i-1}/c_i`` to within ``|1 - M/1.5|`` of the correction.
6. ``N_i = int32(rint((max(dn, -30) + eps) * 2**23))``.
7. In GM, in this order: ``bits(O) += N_i`` (vector core, int32 atomic add;
   not for block 0), then ``O += P~_i @ V_i`` (cube, fp32 atomic add, bf16
   operands, fp32 accumulation). Before block 0, ``O`` is filled with
   ``2**-80`` (bits 0x17800000) so that no element is ever exactly zero when
   the first integer add lands (``0 + N`` would be a huge number or a NaN).
   The price: an output column whose V is zero in every token comes out as
   ``2**(-80 + n_last - n_0) / (l * s16)`` (~1e-27), not exactly 0.
8. After the last block: every element that is not ``|O| <= 1e10`` (underflow
   through the sign bit, NaN) is set to 0, then ``out = O / (l * s16_last)``,
   ``lse = m + log(l)``.

Exact cancellation (a hazard of the algorithm, reproduced here, not guarded):
the bias of step 7 only covers block 0. When a later fp32 add ``O + P~ V``
cancels exactly (the result is 0.0 or -0.0) and the next ``N`` is negative, the
integer add turns the zero into a NaN (``0 + N`` sets the exponent field to all
ones). The NaN absorbs the following blocks' adds until a positive ``N`` wraps
its bits back into a tiny number, or until step 8 sets it to 0: either way
that element loses the contributions of the blocks in between. Measured with
this emulation on the accuracy study's inputs (h_q = 64, 4096 tokens, the six
distributions): 1 such element per ~130 M integer adds on O elements (2 exact
zeros, 1 of them before a negative ``N``, over 12 seeds). Guarding it needs a
read of O before the add, which is what AMLA avoids; ``stats`` counts the
occurrences.

A row that sees no key (empty request, causal cut) never enters the loop: out
0, lse +inf. With split-KV (a request's tokens spread over several cores) each
split runs the recurrence above on its own 512-aligned token range and writes
a normalised partial ``out`` and its ``lse``; the standard LSE-weighted combine
(``mla_dispatch.metadata.combine.combine_splits``) merges them. AMLA acts only inside a
split.

What is emulated exactly and what is not
---------------------------------------
* Exact: every fp32 elementwise step above in the kernel's order, the int32
  adds on the fp32 bit patterns (wrapping, done in int64 and wrapped to 32
  bits, never an fp32 multiply standing in for them), the bf16/fp16 casts
  (round-to-nearest-even: our kernel uses ``RoundMode::CAST_RINT``; Huawei's FIA
  kernel uses ``CAST_ROUND``, ties away from zero, which differs only on exact
  ties), the 2**-80 bias, the -30 clamp, the final guard.
* Not bit-exact: ``exp`` (the vector unit's implementation is not torch's) and
  the summation order inside the cube's matmuls and the row sums. These differ
  from the NPU by a few fp32 ulps; they are far below the bf16 effects AMLA is
  about.

Learned from (read, not copied; CANN Open Software License):
``hicann/ops-transformer`` ``attention/common/op_kernel/arch*/fia_block_vec_nonquant_mla.h``
(``AmlaVecCompute``, ``ProcessAmlaNupdate``, ``SetBmm2FirstSInnerBias``) and
``hicann/catlass`` ``include/catlass/epilogue/block/block_epilogue_amla_tp1_*.hpp``.
"""

from __future__ import annotations

import torch

__all__ = [
    "BLOCK",
    "amla_rows",
    "base_rows",
    "golden_rows",
    "amla_decode",
    "relative_frobenius_error",
    "add_int32_bits",
]

BLOCK = 512  # KV tokens per step (FIA sInnerSize)
LN2 = 0.6931471805599453
RECIP_OF_LN2 = 1.4426950408889634
FIRST_BLOCK_BIAS_BITS = 0x17800000  # fp32 2**-80: O's initial value, so no element is exactly 0
DN_CLAMP = -30.0  # shift the exponent by at most 30 per block
EPS_MANTISSA = 1.5  # mid mantissa used by the compensation
EPS_BIAS = 1e-6
MANTISSA_ONE = float(1 << 23)  # 2**23: one unit of the exponent field
ZERO_GUARD = 1e10  # final: elements not |O| <= 1e10 are set to 0


def _f32(x: float, device) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32, device=device)


def add_int32_bits(o: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """``O`` with ``n`` added to the int32 bit pattern of each element (two's complement, wrapping).

    ``o`` fp32 ``[R, D]``, ``n`` int32 ``[R]`` (one addend per row, as the
    vector core broadcasts it). This is the GM int32 atomic add of the kernel;
    the sum is formed in int64 and wrapped to 32 bits explicitly so no signed
    overflow is left to chance.
    """
    bits = o.contiguous().view(torch.int32).to(torch.int64) + n.to(torch.int64)[:, None]
    bits = (bits + (1 << 31)) % (1 << 32) - (1 << 31)
    return bits.to(torch.int32).view(torch.float32)


def amla_rows(
    scores: torch.Tensor,
    values: torch.Tensor,
    *,
    cast_dtype: torch.dtype = torch.bfloat16,
    block: int = BLOCK,
    compensate: bool = True,
    stats: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The AMLA recurrence over one token range for a group of rows.

    Parameters
    ----------
    scores : Tensor
        fp32 ``[R, T]``: ``softmax_scale * q.k`` (the cube's fp32 result,
        scaled), ``-inf`` where a row may not see a key.
    values : Tensor
        ``[T, D_v]`` in ``cast_dtype`` (or fp32 holding such values).
    cast_dtype : torch.dtype
        The KV dtype the kernel casts ``s16`` and ``P~`` to (bf16 or fp16).
    block : int
        KV tokens per step (512 in the kernel).
    compensate : bool
        Apply the error-compensation term (False only for the ablation study).
    stats : dict, optional
        If given, ``stats["zero_nan"]`` is increased by the number of elements
        that were exactly 0 when a negative ``N`` was added to their bits (they
        became NaN: see the module docstring, "exact cancellation").

    Returns
    -------
    out : Tensor
        fp32 ``[R, D_v]``, normalised; 0 for rows with no visible key.
    lse : Tensor
        fp32 ``[R]`` natural log; ``-inf`` for rows with no visible key (the
        partial-result convention; callers turn it into +inf for final rows).
    """
    dev = scores.device
    rows, tokens = scores.shape
    v32 = values.to(cast_dtype).float()
    o = torch.full((rows, v32.shape[1]), FIRST_BLOCK_BIAS_BITS, dtype=torch.int32, device=dev).view(torch.float32)
    m = torch.full((rows,), float("-inf"), device=dev)
    l = torch.zeros(rows, device=dev)
    n_prev = torch.zeros(rows, device=dev)
    c_prev = torch.ones(rows, device=dev)
    s16 = torch.ones(rows, device=dev)
    neg_recip, recip, ln2 = _f32(-RECIP_OF_LN2, dev), _f32(RECIP_OF_LN2, dev), _f32(LN2, dev)
    for i, t0 in enumerate(range(0, tokens, block)):
        s = scores[:, t0 : t0 + block]
        m_new = torch.maximum(m, s.amax(dim=1))
        # Rows that have seen no key yet keep m = -inf; compute with 0 there (P = 0, l = 0).
        m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        p = torch.exp(s - m_safe[:, None])
        alpha = torch.where(torch.isfinite(m), torch.exp(m - m_safe), torch.zeros_like(m))
        l = l * alpha + p.sum(dim=1)
        n = torch.round(m_safe * neg_recip)
        dn = torch.zeros_like(n) if i == 0 else n - n_prev
        s32 = torch.exp((m_safe * recip + n) * ln2)
        s16 = s32.to(cast_dtype).float()
        p_tilde = (p * s16[:, None]).to(cast_dtype).float()
        c = s32 / s16
        eps = (c_prev / c - 1.0) * EPS_MANTISSA if compensate else torch.zeros_like(c)
        big_n = torch.round((torch.clamp_min(dn, DN_CLAMP) + (eps + EPS_BIAS)) * MANTISSA_ONE).to(torch.int32)
        if i > 0:  # vector core: int32 atomic add on O's bits, before the cube's add of this block
            if stats is not None:
                hits = ((o == 0) & (big_n < 0)[:, None]).sum()
                stats["zero_nan"] = stats.get("zero_nan", 0) + int(hits)
            o = add_int32_bits(o, big_n)
        o = o + p_tilde @ v32[t0 : t0 + block]  # cube: fp32 atomic add of P~ V
        m, n_prev, c_prev = m_new, n, c
    o = torch.where(o.abs() <= ZERO_GUARD, o, torch.zeros_like(o))  # also catches NaN
    seen = l > 0
    out = torch.where(seen[:, None], o / (l * s16).clamp_min(1e-30)[:, None], torch.zeros_like(o))
    lse = torch.where(seen, m + torch.log(l.clamp_min(1e-30)), torch.full_like(l, float("-inf")))
    return out, lse


def base_rows(
    scores: torch.Tensor, values: torch.Tensor, *, cast_dtype: torch.dtype = torch.bfloat16, block: int = BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Standard FlashAttention ("Base" of the paper's Tables 3/4): same blocks,
    fp32 multiplicative rescale of O, bf16 P for the P·V matmul, fp32 accumulate.
    Same arguments and returns as :func:`amla_rows`."""
    dev = scores.device
    rows, tokens = scores.shape
    v32 = values.to(cast_dtype).float()
    o = torch.zeros(rows, v32.shape[1], device=dev)
    m = torch.full((rows,), float("-inf"), device=dev)
    l = torch.zeros(rows, device=dev)
    for t0 in range(0, tokens, block):
        s = scores[:, t0 : t0 + block]
        m_new = torch.maximum(m, s.amax(dim=1))
        m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        p = torch.exp(s - m_safe[:, None])
        alpha = torch.where(torch.isfinite(m), torch.exp(m - m_safe), torch.zeros_like(m))
        l = l * alpha + p.sum(dim=1)
        o = o * alpha[:, None] + p.to(cast_dtype).float() @ v32[t0 : t0 + block]
        m = m_new
    seen = l > 0
    out = torch.where(seen[:, None], o / l.clamp_min(1e-30)[:, None], torch.zeros_like(o))
    lse = torch.where(seen, m + torch.log(l.clamp_min(1e-30)), torch.full_like(l, float("-inf")))
    return out, lse


def golden_rows(scores: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 golden: exact softmax in fp32, P kept in fp32, fp32 P·V."""
    lse = torch.logsumexp(scores, dim=1)
    seen = torch.isfinite(lse)
    p = torch.exp(scores - torch.where(seen, lse, torch.zeros_like(lse))[:, None])
    out = p @ values.float()
    return out, lse


def relative_frobenius_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want||_F / ||want||_F`` in float64 (the paper's accuracy metric)."""
    got, want = got.double(), want.double()
    return float(torch.linalg.norm(got - want) / torch.linalg.norm(want).clamp_min(1e-300))


def _row_limits(seqlen: int, q_len: int, num_rows_per_token: int, causal: bool, device) -> torch.Tensor:
    """Visible-key count of every row, rows ordered (token i, head h)."""
    lim = torch.full((q_len,), seqlen, dtype=torch.int64, device=device)
    if causal:
        lim = lim - q_len + 1 + torch.arange(q_len, device=device)
    return lim.clamp_min(0).repeat_interleave(num_rows_per_token)


def amla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    head_dim_v: int = 512,
    softmax_scale: float | None = None,
    causal: bool = False,
    num_cores: int = 20,
    compensate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged MLA decode the way the Ascend kernel runs it: split-KV work items of
    512-token-aligned ranges, AMLA inside each, LSE combine across splits.

    Parameters follow :func:`mla_dispatch.mla_decode` (``kv_cache`` 4-D
    ``[num_blocks, page_size, h_kv, D_qk]`` bf16/fp16). ``num_cores`` is the
    number of cube cores the work is spread over (the split-KV schedule is
    :func:`mla_dispatch.metadata.schedule.split_kv_schedule` with ``chunk_size=512``, the
    partition the host tiling computes).

    Returns
    -------
    out : Tensor
        ``[B, s_q, h_q, head_dim_v]`` in q's dtype; 0 for rows with no key.
    lse : Tensor
        fp32 ``[B, h_q, s_q]``; ``+inf`` for rows with no key.
    """
    from mla_dispatch.metadata.schedule import split_kv_schedule
    from mla_dispatch.metadata.combine import combine_splits

    batch, q_len, h_q, d_qk = q.shape
    _, page_size, h_kv, _ = kv_cache.shape
    group = h_q // h_kv
    scale = softmax_scale if softmax_scale is not None else d_qk**-0.5
    cast_dtype = kv_cache.dtype
    dev = q.device
    sched = split_kv_schedule(cache_seqlens.to(torch.int32), num_parts=num_cores, chunk_size=BLOCK, overhead=1)
    items = sched.items.tolist()  # host side: the tiling runs on the host from host seqlens
    out32 = torch.zeros(batch, q_len, h_q, head_dim_v, device=dev)
    lse_bsh = torch.full((batch, q_len, h_q), float("inf"), device=dev)
    partial_out = torch.zeros(sched.max_slots, q_len, h_q, head_dim_v, device=dev)
    partial_lse = torch.full((sched.max_slots, q_len, h_q), float("-inf"), device=dev)
    seqlens = cache_seqlens.tolist()
    for req, t_begin, t_end, slot in items:
        if req < 0:
            continue
        length = int(seqlens[req])
        pos = torch.arange(t_begin, t_end, device=dev)
        pages = block_table[req].long()[pos // page_size] if t_end > t_begin else pos
        keys = kv_cache[pages, pos % page_size] if t_end > t_begin else kv_cache.new_zeros(0, h_kv, d_qk)
        limits = _row_limits(length, q_len, group, causal, dev)  # [s_q * group]
        for g in range(h_kv):
            qg = q[req, :, g * group : (g + 1) * group].reshape(q_len * group, d_qk)
            k = keys[:, g].float()
            scores = (qg.float() @ k.t()) * scale  # cube: bf16 operands, fp32 accumulate
            scores = scores.masked_fill(pos[None, :] >= limits[:, None], float("-inf"))
            o, l = amla_rows(scores, keys[:, g, :head_dim_v], cast_dtype=cast_dtype, compensate=compensate)
            o = o.view(q_len, group, head_dim_v)
            l = l.view(q_len, group)
            if slot < 0:
                out32[req, :, g * group : (g + 1) * group] = o
                lse_bsh[req, :, g * group : (g + 1) * group] = torch.where(torch.isfinite(l), l, float("inf"))
            else:
                partial_out[slot, :, g * group : (g + 1) * group] = o
                partial_lse[slot, :, g * group : (g + 1) * group] = l
    out = out32.to(q.dtype)
    lse = lse_bsh.transpose(1, 2).contiguous()
    combine_splits(partial_out, partial_lse, sched, out, lse)
    return out, lse

