"""An independent float64 oracle for CPU tests: MLA decode attention written out naively.

It walks every request, query token and head with Python loops, gathers tokens one by one through the block table
(or the sparse indices) and decodes them with its own code, so it shares nothing with
:func:`mla_dispatch.numerics.oracle.reference_attention` (the reference backend) except the format definitions of
docs/design.md. Tests that check the reference backend, or anything run on it, compare with this instead of with the
reference itself.
"""

from __future__ import annotations

import math

import torch

from mla_dispatch.kvcache.formats import DS_MLA_TOKEN_BYTES

__all__ = ["decode_token", "decode_v4_token", "naive_attention"]


def decode_v4_token(kv: torch.Tensor, block: int, offset: int) -> torch.Tensor:
    """float64 [1, 512] values of token ``offset`` of block ``block`` of a DeepSeek-V4 (FlashMLA "MODEL1") cache
    ``[num_blocks, page_size, 1, 584]``, decoded from the block's bytes as FlashMLA's tests/quant.py lays them out:
    ``page_size`` tokens of 448 fp8 + 128 bf16-RoPE bytes, then ``page_size`` groups of 7 ue8m0 scales + 1 pad."""
    page_size = kv.shape[1]
    raw = kv[block].reshape(-1).view(torch.uint8)  # the block's page_size * 584 bytes (rows of 584 are contiguous)
    data = raw[offset * 576:(offset + 1) * 576].contiguous()
    scale_bytes = raw[page_size * 576 + offset * 8:page_size * 576 + offset * 8 + 7].tolist()
    scales = torch.tensor([math.nan if e == 255 else 2.0 ** (e - 127) for e in scale_bytes], dtype=torch.float64)
    nope = data[:448].view(torch.float8_e4m3fn).double() * scales.repeat_interleave(64)
    rope = data[448:].view(torch.bfloat16).double()
    return torch.cat([nope, rope])[None, :]


def decode_token(raw: torch.Tensor, kv_format: str, kv_scale) -> torch.Tensor:
    """float64 [h_kv, D] values of one cached token, decoded independently of kvcache/formats.py."""
    if kv_format in ("bf16", "fp16"):
        return raw.double()
    if kv_format == "fp8_e4m3":
        return raw.double() * float(kv_scale)
    assert raw.shape[-1] == DS_MLA_TOKEN_BYTES
    rows = []
    for head in raw:
        b = head.contiguous()
        nope = b[:512].view(torch.float8_e4m3fn).double()
        scales = b[512:528].view(torch.float32).double()
        rope = b[528:656].view(torch.bfloat16).double()
        rows.append(torch.cat([nope * scales.repeat_interleave(128), rope]))
    return torch.stack(rows)


def _sparse_keys(kv, indices, lengths, b, i, kv_format, kv_scale):
    """The decoded keys request b's query token i reads from one sparse cache (ids >= 0 within its length)."""
    ps = kv.shape[1]
    width = indices.shape[-1] if lengths is None else max(0, min(int(lengths[b]), indices.shape[-1]))
    slots = [int(s) for s in indices[b, i, :width] if int(s) >= 0]
    if kv_format == "fp8_ds_v4":
        return [decode_v4_token(kv, s // ps, s % ps) for s in slots]
    return [decode_token(kv[s // ps, s % ps], kv_format, kv_scale) for s in slots]


def naive_attention(case, head_dim_v: int | None = None, *, q=None, kv_cache=None, cache_seqlens=None):
    """float64 (out ``[B, s_q, h_q, D_v]``, lse ``[B, h_q, s_q]``) of a ``DecodeCase`` (``numerics/cases.py``).

    ``q``, ``kv_cache`` and ``cache_seqlens`` replace the case's (another layer's data, an updated step). Rows that
    see no key get out 0 and lse +inf. A sparse case's ``topk_length``, extra cache and ``attn_sink`` are applied as
    FlashMLA's tests/ref.py defines them: the keys of both lists in one softmax, then the output times
    ``1 / (1 + exp(sink - lse))``.
    """
    q = (case.q if q is None else q).double()
    kv = case.kv_cache if kv_cache is None else kv_cache
    kv = kv if kv.dim() == 4 else kv.unsqueeze(2)
    lens = case.cache_seqlens if cache_seqlens is None else cache_seqlens
    head_dim_v = case.head_dim_v if head_dim_v is None else head_dim_v
    batch, q_len, h_q, _ = q.shape
    nb, ps, h_kv, _ = kv.shape
    scale = case.softmax_scale
    out = torch.zeros(batch, q_len, h_q, head_dim_v, dtype=torch.float64)
    lse = torch.zeros(batch, h_q, q_len, dtype=torch.float64)
    for b in range(batch):
        for i in range(q_len):
            if case.indices is not None:
                keys = _sparse_keys(kv, case.indices, case.topk_length, b, i, case.kv_format, case.kv_scale)
                if case.extra_kv_cache is not None:
                    extra = case.extra_kv_cache if case.extra_kv_cache.dim() == 4 else case.extra_kv_cache.unsqueeze(2)
                    keys += _sparse_keys(extra, case.extra_indices, case.extra_topk_length, b, i, case.kv_format,
                                         case.kv_scale)
            else:
                length = int(lens[b])
                visible = length - q_len + i + 1 if case.causal else length
                slots = [int(case.block_table[b, j // ps]) * ps + j % ps for j in range(max(visible, 0))]
                keys = [decode_v4_token(kv, s // ps, s % ps) if case.kv_format == "fp8_ds_v4"
                        else decode_token(kv[s // ps, s % ps], case.kv_format, case.kv_scale) for s in slots]
            stacked = torch.stack(keys) if keys else None  # [n, h_kv, D], once per query token (not per head)
            for h in range(h_q):
                if stacked is None:
                    lse[b, h, i] = math.inf
                    continue
                k = stacked[:, h // (h_q // h_kv)]
                s = (k @ q[b, i, h]) * scale
                m = s.max()
                p = torch.exp(s - m)
                out[b, i, h] = (p[:, None] * k[:, :head_dim_v]).sum(0) / p.sum()
                lse[b, h, i] = m + torch.log(p.sum())
                if case.attn_sink is not None:
                    sink = float(case.attn_sink[h])
                    out[b, i, h] *= 0.0 if sink == math.inf else 1.0 / (1.0 + math.exp(sink - float(lse[b, h, i])))
    return out, lse
