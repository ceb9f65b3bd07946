"""FlashMLA's prefill functions: sparse prefill as a reference computation, dense varlen prefill not provided.

- :func:`flash_mla_sparse_fwd` (DeepSeek Sparse Attention prefill: every query token attends to its own top-k
  tokens) is computed here in fp32 PyTorch on q's device, in chunks of query tokens. It is the *reference path*:
  the result FlashMLA's kernels are tested against (its ``tests/ref.py``, ``ref_sparse_attn_fwd``), at the
  speed of gathered matrix products, not a prefill kernel. Its signature joins FlashMLA's, vLLM 0.33.0's
  (``out``) and sgl-flash-mla 1.0.0's (``use_legacy``, ``return_log2_lse``).
- ``flash_attn_varlen_func`` and its ``qkvpacked`` / ``kvpacked`` forms are FlashMLA's dense multi-head
  prefill (SM100 kernels for head dims 192/128 and 128/128, with a backward pass): ordinary attention over
  un-absorbed heads, not MLA decode. They are not provided and raise ``NotImplementedError`` saying so.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from mla_dispatch.compat.flash_mla.errors import FlashMLAArgumentError

__all__ = ["flash_mla_sparse_fwd", "flash_attn_varlen_func", "flash_attn_varlen_qkvpacked_func",
           "flash_attn_varlen_kvpacked_func"]

#: fp32 elements of gathered keys per chunk of query tokens (256 MiB)
_CHUNK_ELEMENTS = 1 << 26
_LOG2_E = 1.0 / math.log(2.0)


def _shape(t) -> str:
    return f"{list(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__


def _check_sparse_args(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, out) -> None:
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.dtype not in (torch.bfloat16, torch.float16):
        raise FlashMLAArgumentError(f"q must be a bf16/fp16 tensor [s_q, h_q, d_qk], got {_shape(q)}")
    s_q, h_q, d_qk = q.shape
    if not isinstance(kv, torch.Tensor) or kv.dim() != 3 or kv.dtype != q.dtype or kv.shape[-1] != d_qk:
        raise FlashMLAArgumentError(f"kv must be [s_kv, h_kv, d_qk={d_qk}] in q's dtype ({q.dtype}), got {_shape(kv)}")
    h_kv = kv.shape[1]
    if h_kv < 1 or h_q % h_kv != 0:
        raise FlashMLAArgumentError(f"h_q={h_q} must be a multiple of h_kv (kv.shape[1])={h_kv}")
    if (not isinstance(indices, torch.Tensor) or indices.dtype != torch.int32 or indices.dim() != 3
            or tuple(indices.shape[:2]) != (s_q, h_kv)):
        raise FlashMLAArgumentError(f"indices must be int32 [s_q={s_q}, h_kv={h_kv}, topk], got {_shape(indices)}")
    if indices.shape[-1] < 1:
        raise FlashMLAArgumentError(f"indices must have topk >= 1 entries per token, got {_shape(indices)}")
    if not (isinstance(sm_scale, (int, float)) and math.isfinite(sm_scale)):
        raise FlashMLAArgumentError(f"sm_scale must be a finite float, got {sm_scale!r}")
    if not 1 <= d_v <= d_qk:
        raise FlashMLAArgumentError(f"d_v must be in [1, d_qk={d_qk}], got {d_v}")
    if attn_sink is not None and (not isinstance(attn_sink, torch.Tensor) or attn_sink.dtype != torch.float32
                                  or tuple(attn_sink.shape) != (h_q,)):
        raise FlashMLAArgumentError(f"attn_sink must be float32 [h_q={h_q}], got {_shape(attn_sink)}")
    if topk_length is not None and (not isinstance(topk_length, torch.Tensor) or topk_length.dtype != torch.int32
                                    or tuple(topk_length.shape) != (s_q,)):
        raise FlashMLAArgumentError(f"topk_length must be int32 [s_q={s_q}], got {_shape(topk_length)}")
    for name, t in (("kv", kv), ("indices", indices), ("attn_sink", attn_sink), ("topk_length", topk_length),
                    ("out", out)):
        if t is not None and isinstance(t, torch.Tensor) and t.device != q.device:
            raise FlashMLAArgumentError(f"{name} is on {t.device}, q on {q.device}: they must be on the same device")
    if out is not None and (not isinstance(out, torch.Tensor) or tuple(out.shape) != (s_q, h_q, d_v)
                            or out.dtype != q.dtype):
        raise FlashMLAArgumentError(f"out must be [s_q={s_q}, h_q={h_q}, d_v={d_v}] {q.dtype}, got {_shape(out)}")


def flash_mla_sparse_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
    *,
    out: Optional[torch.Tensor] = None,
    use_legacy: Optional[bool] = None,
    return_log2_lse: Optional[bool] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """FlashMLA's sparse prefill, computed by the fp32 PyTorch reference path (not a kernel; see the module).

    For query token ``t`` and head ``h`` (KV head ``k = h // (h_q / h_kv)``), over the valid entries ``j`` of
    ``indices[t, k]`` (``0 <= index < s_kv`` and, with ``topk_length``, ``j < topk_length[t]``)::

        S[j]       = sm_scale * <q[t, h], kv[indices[t, k, j], k]>
        max_logits = max_j S[j]                       (-inf when no entry is valid)
        lse        = log sum_j exp(S[j])              (+inf when no entry is valid)
        out        = sum_j exp(S[j] - L) * kv[indices[t, k, j], k, :d_v],   L = log(exp(lse) + exp(attn_sink[h]))

    so ``attn_sink`` scales ``out`` by ``exp(lse) / (exp(lse) + exp(sink))`` (+inf zeroes it, -inf changes
    nothing) and leaves ``lse`` and ``max_logits`` alone; a token with no valid entry gets ``out = 0``.
    Invalid entries are never read (FlashMLA's kernels may return NaN when an entry past ``topk_length`` points
    at a NaN token; this path does not).

    Parameters
    ----------
    q : Tensor
        ``[s_q, h_q, d_qk]`` bf16/fp16.
    kv : Tensor
        ``[s_kv, h_kv, d_qk]`` in q's dtype (FlashMLA: ``h_kv = 1``; here any divisor of ``h_q``).
    indices : Tensor
        int32 ``[s_q, h_kv, topk]``; entries ``< 0`` or ``>= s_kv`` are skipped.
    sm_scale : float
    d_v : int
        The first ``d_v`` channels of ``kv`` are the values (FlashMLA: 512).
    attn_sink : Tensor, optional
        float32 ``[h_q]``.
    topk_length : Tensor, optional
        int32 ``[s_q]``: token ``t`` uses only ``indices[t, :, :topk_length[t]]``.
    out : Tensor, optional
        vLLM's: ``[s_q, h_q, d_v]`` in q's dtype, written in place (any strides) and returned.
    use_legacy : bool, optional
        sgl-flash-mla's kernel family; the result is the same for both. ``return_log2_lse=True`` needs
        ``use_legacy=True``, as there.
    return_log2_lse : bool, optional
        sgl-flash-mla's: None, statistics in natural-log units; False, ``(out, None, None)``; True, both
        statistics in base 2 (multiplied by ``log2(e)``).

    Returns
    -------
    out : Tensor
        ``[s_q, h_q, d_v]`` in q's dtype.
    max_logits : Tensor or None
        float32 ``[s_q, h_q]``.
    lse : Tensor or None
        float32 ``[s_q, h_q]``.

    Raises
    ------
    FlashMLAArgumentError
        A wrong shape, dtype or device (the message names the argument), or ``return_log2_lse=True`` without
        ``use_legacy=True``.
    """
    if return_log2_lse is True and not use_legacy:
        raise FlashMLAArgumentError("return_log2_lse=True is a legacy-kernel feature in sgl-flash-mla: pass "
                                    "use_legacy=True (or return_log2_lse=None for natural-log statistics)")
    _check_sparse_args(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, out)
    s_q, h_q, d_qk = q.shape
    s_kv, h_kv, _ = kv.shape
    topk = indices.shape[-1]
    group = h_q // h_kv
    result = torch.empty(s_q, h_q, d_v, dtype=q.dtype, device=q.device)
    max_logits = torch.empty(s_q, h_q, dtype=torch.float32, device=q.device)
    lse = torch.empty(s_q, h_q, dtype=torch.float32, device=q.device)
    kv_heads = kv.transpose(0, 1)  # [h_kv, s_kv, d_qk]
    head_ids = torch.arange(h_kv, device=q.device)[None, :, None]
    positions = torch.arange(topk, device=q.device)
    sink = None if attn_sink is None else attn_sink.view(h_kv, group)
    chunk = max(1, _CHUNK_ELEMENTS // max(1, h_kv * topk * d_qk))
    for start in range(0, s_q, chunk):
        stop = min(start + chunk, s_q)
        ids = indices[start:stop].long()  # [c, h_kv, topk]
        valid = (ids >= 0) & (ids < s_kv)
        if topk_length is not None:
            valid &= positions[None, None, :] < topk_length[start:stop, None, None]
        keys = kv_heads[head_ids, torch.where(valid, ids, 0)].float()  # [c, h_kv, topk, d_qk]
        keys = torch.where(valid[..., None], keys, 0.0)  # an invalid entry's token is never used, NaN or not
        queries = q[start:stop].float().view(stop - start, h_kv, group, d_qk)
        scores = torch.einsum("ckgd,cktd->ckgt", queries, keys) * float(sm_scale)
        scores = scores.masked_fill(~valid[:, :, None, :], -math.inf)
        row_max = scores.amax(-1)  # [c, h_kv, group]
        row_lse = torch.logsumexp(scores, -1)  # -inf where no entry is valid
        norm = row_lse if sink is None else torch.logaddexp(row_lse, sink[None])
        norm = torch.where(torch.isneginf(norm), math.inf, norm)  # no key, or only a -inf sink: out = 0
        probs = torch.exp(scores - norm[..., None])
        values = torch.einsum("ckgt,cktv->ckgv", probs, keys[..., :d_v])
        result[start:stop] = values.reshape(stop - start, h_q, d_v).to(q.dtype)
        max_logits[start:stop] = row_max.reshape(stop - start, h_q)
        lse[start:stop] = torch.where(torch.isneginf(row_lse), math.inf, row_lse).reshape(stop - start, h_q)
    if out is not None:
        result = out.copy_(result)
    if return_log2_lse is False:
        return result, None, None
    if return_log2_lse is True:
        return result, max_logits * _LOG2_E, lse * _LOG2_E
    return result, max_logits, lse


def _varlen_not_provided(name: str):
    raise NotImplementedError(
        f"{name} (FlashMLA's dense multi-head prefill: SM100 kernels for head dims 192/128 and 128/128, with a "
        "backward pass) is not provided by mla_dispatch, whose operation is MLA decode. Use FlashAttention's "
        "flash_attn.flash_attn_varlen_func (the same arguments but is_varlen) or "
        "torch.nn.functional.scaled_dot_product_attention per sequence"
    )


def flash_attn_varlen_func(q, k, v, cu_seqlens_qo, cu_seqlens_kv, max_seqlen_qo, max_seqlen_kv, dropout_p=0.0,
                           softmax_scale=None, causal=False, deterministic=False, is_varlen=True):
    """FlashMLA's dense varlen prefill: not provided.

    Raises
    ------
    NotImplementedError
        Always, naming what to use instead.
    """
    _varlen_not_provided("flash_attn_varlen_func")


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, head_dim_qk, dropout_p=0.0, softmax_scale=None,
                                     causal=False, deterministic=False, is_varlen=True):
    """FlashMLA's dense varlen prefill on packed ``qkv``: not provided.

    Raises
    ------
    NotImplementedError
        Always, naming what to use instead.
    """
    _varlen_not_provided("flash_attn_varlen_qkvpacked_func")


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_qo, cu_seqlens_kv, max_seqlen_qo, max_seqlen_kv, head_dim_qk,
                                    dropout_p=0.0, softmax_scale=None, causal=False, deterministic=False,
                                    is_varlen=True):
    """FlashMLA's dense varlen prefill on packed ``kv``: not provided.

    Raises
    ------
    NotImplementedError
        Always, naming what to use instead.
    """
    _varlen_not_provided("flash_attn_varlen_kvpacked_func")
