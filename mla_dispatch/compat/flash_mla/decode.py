"""FlashMLA's decode call, :func:`flash_mla_with_kvcache`, on :func:`mla_dispatch.plan_decode`.

One function takes the arguments of all three interfaces people call (the package docstring names the
versions read): FlashMLA's own; vLLM 0.33.0's bundled copy, which adds ``out`` and ``enable_batch_invariant``;
sgl-flash-mla 1.0.0, which adds ``enable_batch_invariant``, ``use_legacy``, ``kv_format``, ``descale_q``,
``descale_k`` and makes ``is_fp8_kvcache`` default to None ("infer"). vLLM and sgl-flash-mla put their
additions at different positions after ``extra_topk_length``, so here they are keyword-only.

``use_legacy`` picks one of sgl-flash-mla's two kernel families: ``True`` the frozen one (SM90, dense decoding,
the DeepSeek-V3.2 / V3.2-no-RoPE / V4 caches), ``False`` upstream's current one (sparse DeepSeek-V4.1 caches on
SM100). mla_dispatch has one implementation for both, so what ``use_legacy`` selects here is the family's
*contract*: the argument rules sgl-flash-mla asserts (dense decoding needs ``use_legacy=True``; ``kv_format``
belongs to the legacy side; ``enable_batch_invariant`` to the current side) are enforced, while the kernels'
own limits (head counts, page sizes, GPUs) are not inherited. ``None``, the default here, selects no family:
FlashMLA's and vLLM's contract, where dense and sparse share one surface.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Optional, Tuple, Union

import torch

from mla_dispatch.api import plan_decode
from mla_dispatch.compat.flash_mla.errors import FlashMLAArgumentError
from mla_dispatch.compat.flash_mla.metadata import FlashMLASchedMeta
from mla_dispatch.kvcache.formats import DS_MLA_TOKEN_BYTES, DS_V4_TOKEN_BYTES

__all__ = ["flash_mla_with_kvcache", "SGL_KV_FORMATS"]

logger = logging.getLogger(__name__)

#: sgl-flash-mla's ``kv_format`` names (``parse_kv_cache_format`` of its legacy extension) -> mla_dispatch's
#: kv_format, or None where mla_dispatch has no such format; with what each one is.
SGL_KV_FORMATS = {
    "V32": ("fp8_ds_mla", "DeepSeek-V3.2 (d_qk 576, 656 bytes per token)"),
    "V32_NO_ROPE": (None, "DeepSeek-V3.2 without RoPE (d_qk 512, 528 bytes per token)"),
    "V4": ("fp8_ds_v4", "DeepSeek-V4 (d_qk 512, 584 bytes per token)"),
    "V41": (None, "DeepSeek-V4.1 (d_qk 512, 528 bytes per token)"),
    "V41_FP4": (None, "DeepSeek-V4.1 fp4 (d_qk 512, 288 bytes per token)"),
}
#: (q head dim, bytes per token) of the byte-packed caches mla_dispatch reads, by its format name
_TOKEN_FORMATS = {(576, DS_MLA_TOKEN_BYTES): "fp8_ds_mla", (512, DS_V4_TOKEN_BYTES): "fp8_ds_v4"}
#: (q head dim, bytes per token) of the quantised caches FlashMLA's family reads and mla_dispatch does not.
_UNPROVIDED_TOKEN_FORMATS = {
    (512, 528): "DeepSeek-V3.2-no-RoPE / V4.1 (528 bytes per token)",
    (512, 288): "DeepSeek-V4.1 fp4 (288 bytes per token)",
    (576, 352): "NVFP4 (352 bytes per token)",
}
_PROVIDED_FORMATS = ("mla_dispatch reads caches in q's dtype, DeepSeek-V3.2's 656-byte and DeepSeek-V4's 584-byte fp8 "
                     "caches and per-tensor fp8_e4m3 caches (one byte per channel, with descale_k)")
_FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
                    if hasattr(torch, n))


def _describe(t) -> str:
    return f"{list(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__


def _check_q(q: torch.Tensor, descale_q) -> None:
    """mla_dispatch runs bf16/fp16 q; ``descale_q`` exists only for an fp8 q (sgl-flash-mla's dense fp8 kernel)."""
    fp8_q = isinstance(q, torch.Tensor) and q.dtype in _FP8_DTYPES
    if descale_q is not None or fp8_q:
        raise NotImplementedError(
            f"descale_q: an fp8 q is not taken (q is {_describe(q)}, descale_q is "
            f"{'None' if descale_q is None else _describe(descale_q)}); mla_dispatch runs bf16/fp16 q only. "
            "The same attention is q.to(torch.bfloat16) with softmax_scale multiplied by descale_q's value and "
            "descale_q=None: descale_q scales the scores only"
        )


def _sgl_kv_format(kv_format: str, head_dim: int, token_bytes: int, name: str) -> str:
    """sgl-flash-mla's ``kv_format`` name -> mla_dispatch's, checked against the cache as sgl-flash-mla checks it."""
    if kv_format not in SGL_KV_FORMATS:
        raise FlashMLAArgumentError(f"Unknown kv_format: {kv_format!r}. Expected one of "
                                    f"{', '.join(SGL_KV_FORMATS)} (sgl-flash-mla's names, or None to detect it)")
    ours, what = SGL_KV_FORMATS[kv_format]
    if ours is None:
        raise NotImplementedError(f"kv_format={kv_format!r}: the {what} cache is not provided; {_PROVIDED_FORMATS}")
    if _TOKEN_FORMATS.get((head_dim, token_bytes)) != ours:
        raise FlashMLAArgumentError(f"kv_format says {kv_format} ({what}) but q/{name} have d_qk {head_dim} and "
                                    f"{token_bytes} bytes per token")
    return ours


def _resolve_cache(k_cache, q: torch.Tensor, is_fp8_kvcache: Optional[bool], kv_format: Optional[str], descale_k,
                   name: str) -> Tuple[torch.Tensor, str, object, bool]:
    """FlashMLA's cache arguments -> (tensor for mla_dispatch, mla_dispatch kv_format, kv_scale, is_fp8).

    ``is_fp8_kvcache=None`` infers it from the element size (1 byte: fp8). An fp8 cache's format is told by its
    bytes per token, as FlashMLA tells it: 656 with d=576 is DeepSeek-V3.2's token (``fp8_ds_mla``), 584 with d=512
    DeepSeek-V4's (``fp8_ds_v4``, FlashMLA's MODEL1), d bytes a per-tensor fp8_e4m3 cache whose scale is
    ``descale_k``.
    """
    if not isinstance(k_cache, torch.Tensor):
        raise FlashMLAArgumentError(f"{name} must be a tensor, got {type(k_cache).__name__}")
    fp8 = k_cache.element_size() == 1 if is_fp8_kvcache is None else bool(is_fp8_kvcache)
    if not fp8:
        if k_cache.dtype != q.dtype:
            raise FlashMLAArgumentError(
                f"{name}.dtype must equal q.dtype ({q.dtype}) when is_fp8_kvcache is False, got {k_cache.dtype}")
        if descale_k is not None:
            raise FlashMLAArgumentError(
                f"descale_k is the scale of a per-tensor fp8 cache, but {name} is {k_cache.dtype} "
                "(is_fp8_kvcache False): pass descale_k=None")
        return k_cache, "auto", None, False
    if k_cache.element_size() != 1:
        raise FlashMLAArgumentError(f"{name} must hold 1-byte elements when is_fp8_kvcache is True, got {k_cache.dtype}")
    head_dim, token_bytes = q.shape[-1], k_cache.shape[-1]
    if kv_format is not None:
        fmt = _sgl_kv_format(kv_format, head_dim, token_bytes, name)
    elif (head_dim, token_bytes) in _TOKEN_FORMATS:
        fmt = _TOKEN_FORMATS[head_dim, token_bytes]
    elif token_bytes == head_dim:
        fmt = "fp8_e4m3"
    elif (head_dim, token_bytes) in _UNPROVIDED_TOKEN_FORMATS:
        raise NotImplementedError(f"{name}: the {_UNPROVIDED_TOKEN_FORMATS[head_dim, token_bytes]} fp8 cache is not "
                                  f"provided; {_PROVIDED_FORMATS}")
    else:
        raise FlashMLAArgumentError(
            f"{name}.shape[-1]={token_bytes} with q's head dim {head_dim} names no fp8 cache format: "
            f"is_fp8_kvcache=True takes {DS_MLA_TOKEN_BYTES} bytes per token (DeepSeek-V3.2, head dim 576), "
            f"{DS_V4_TOKEN_BYTES} (DeepSeek-V4, head dim 512) or {head_dim} (per-tensor fp8_e4m3 with descale_k)")
    if fmt in ("fp8_ds_mla", "fp8_ds_v4"):
        if descale_k is not None:
            raise FlashMLAArgumentError(f"descale_k must be None for {name} in DeepSeek's {token_bytes}-byte "
                                        "format: its scales are stored with every token")
        return (k_cache if k_cache.dtype in (torch.uint8, torch.int8) else k_cache.view(torch.uint8)), fmt, None, True
    if k_cache.dtype not in (torch.float8_e4m3fn, torch.uint8, torch.int8):
        raise FlashMLAArgumentError(f"a per-tensor fp8 {name} must be float8_e4m3fn (or its bytes as uint8/int8), "
                                    f"got {k_cache.dtype}")
    if descale_k is None:
        raise FlashMLAArgumentError(
            f"descale_k is required for the per-tensor fp8 {name} ({name}.shape[-1] == q's head dim {head_dim}): "
            "a float32 [1] tensor, the scale that turns stored values into real ones")
    if isinstance(descale_k, torch.Tensor):
        if descale_k.numel() != 1 or descale_k.dtype != torch.float32 or descale_k.device != q.device:
            raise FlashMLAArgumentError(f"descale_k must be a float32 tensor of shape [1] on {q.device}, got "
                                        f"{_describe(descale_k)} on {descale_k.device}")
        descale_k = descale_k.reshape(1)
    elif not (isinstance(descale_k, (int, float)) and math.isfinite(descale_k) and descale_k > 0):
        raise FlashMLAArgumentError(f"descale_k must be a float32 [1] tensor or a finite positive float, got {descale_k!r}")
    return k_cache.view(torch.float8_e4m3fn), fmt, descale_k, True


def _check_out(out, q: torch.Tensor, head_dim_v: int) -> None:
    """vLLM's ``out``: ``[b, s_q, h_q, head_dim_v]``, q's dtype and device, contiguous."""
    if out is None:
        return
    want = [q.shape[0], q.shape[1], q.shape[2], head_dim_v]
    if (not isinstance(out, torch.Tensor) or list(out.shape) != want or out.dtype != q.dtype
            or out.device != q.device):
        where = f" on {out.device}" if isinstance(out, torch.Tensor) else ""
        raise FlashMLAArgumentError(f"out must be {want} {q.dtype} on {q.device} (q's dtype and device), got "
                                    f"{_describe(out)}{where}")
    if not out.is_contiguous():
        raise FlashMLAArgumentError(f"out must be contiguous, got strides {list(out.stride())}")


def _config_of(q, k_cache, causal, is_fp8_kvcache, topk, extra_k_cache, extra_topk,
               enable_batch_invariant) -> FlashMLASchedMeta.Config:
    return FlashMLASchedMeta.Config(
        q.shape[0], q.shape[1], q.shape[2], k_cache.shape[1], k_cache.shape[2] if k_cache.dim() == 4 else 1,
        bool(causal), bool(is_fp8_kvcache), topk,
        None if extra_k_cache is None else extra_k_cache.shape[1], extra_topk, bool(enable_batch_invariant),
    )


#: What each ``Config`` field must equal on a reused ``FlashMLASchedMeta``, in the words of FlashMLA's own asserts
#: (flash_mla/flash_mla_interface.py, ``flash_mla_with_kvcache``), so that a message searched for there is found here.
_CONFIG_MEANING = {
    "b": "batch_size",
    "s_q": "seq_len_q",
    "h_q": "num_heads_q",
    "page_block_size": "page_block_size",
    "h_k": "num_heads_k",
    "causal": "causal",
    "is_fp8_kvcache": "is_fp8_kvcache",
    "topk": "the last dim of indices_in_kvcache",
    "extra_page_block_size": "the page_block_size of extra_k_cache",
    "extra_topk": "the last dim of extra_indices_in_kvcache",
    "enable_batch_invariant": "enable_batch_invariant",
}
_INCONSISTENT = (" Your input arguments are inconsistent with sched_meta. Please make sure the input arguments are "
                 "consistent across different invocations of flash_mla_with_kvcache on the same sched_meta.")


def _check_same_config(have: FlashMLASchedMeta.Config, want: FlashMLASchedMeta.Config) -> None:
    for field in dataclasses.fields(have):
        a, b = getattr(have, field.name), getattr(want, field.name)
        if a != b:
            raise FlashMLAArgumentError(
                f"sched_meta.config.{field.name} must be equal to {_CONFIG_MEANING[field.name]}.{_INCONSISTENT} "
                f"(sched_meta was filled for {field.name}={a!r}, this call has {field.name}={b!r}; a "
                "FlashMLASchedMeta may be reused only while shapes and cache_seqlens/topk_length values stay the "
                "same: make one with get_mla_metadata() per decode step)"
            )


def _per_call_key(q: torch.Tensor, kv: torch.Tensor, block_table, head_dim_v: int, softmax_scale, fmt: str,
                  sparse: bool) -> tuple:
    """What a plan freezes of the arguments FlashMLA reads on every call (not the ``Config``): the block table
    (its memory, shape and strides: a plan keeps the tensor and reads it), ``softmax_scale``, ``head_dim_v`` and
    the dtypes of q and the cache. A reused ``FlashMLASchedMeta`` re-plans when this changes."""
    table = None
    if not sparse:
        table = (block_table.data_ptr(), tuple(block_table.shape), block_table.stride(), block_table.dtype,
                 block_table.device)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    return table, scale, int(head_dim_v), q.dtype, kv.dtype, fmt


def _check_sink(attn_sink, q: torch.Tensor) -> None:
    """FlashMLA's ``attn_sink``: float32 ``[h_q]`` on q's device."""
    h_q = q.shape[2]
    if (not isinstance(attn_sink, torch.Tensor) or tuple(attn_sink.shape) != (h_q,)
            or attn_sink.dtype != torch.float32 or attn_sink.device != q.device):
        where = f" on {attn_sink.device}" if isinstance(attn_sink, torch.Tensor) else ""
        raise FlashMLAArgumentError(f"attn_sink must be float32 [h_q={h_q}] on {q.device}, one value per query head, "
                                    f"got {_describe(attn_sink)}{where}")


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: Optional[torch.Tensor],
    cache_seqlens: Optional[torch.Tensor],
    head_dim_v: int,
    tile_scheduler_metadata: Union[FlashMLASchedMeta, torch.Tensor],
    num_splits: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    is_fp8_kvcache: Optional[bool] = None,
    indices: Optional[torch.Tensor] = None,
    attn_sink: Optional[torch.Tensor] = None,
    extra_k_cache: Optional[torch.Tensor] = None,
    extra_indices_in_kvcache: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
    extra_topk_length: Optional[torch.Tensor] = None,
    *,
    out: Optional[torch.Tensor] = None,
    enable_batch_invariant: bool = False,
    use_legacy: Optional[bool] = None,
    kv_format: Optional[str] = None,
    descale_q: Optional[torch.Tensor] = None,
    descale_k: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's decode call (both metadata conventions: see the package docstring).

    Parameters
    ----------
    q : Tensor
        ``[b, s_q, h_q, d]`` bf16/fp16 (an fp8 q: see ``descale_q``).
    k_cache : Tensor
        ``[num_blocks, page_block_size, h_k, d_or_bytes]``: in q's dtype; or fp8 (``is_fp8_kvcache``), told apart
        by the bytes per token as FlashMLA does: 656 with ``d=576`` is DeepSeek-V3.2's token (uint8/int8 or
        float8 bytes), ``d`` a per-tensor ``float8_e4m3fn`` cache (or its bytes) scaled by ``descale_k``.
    block_table, cache_seqlens : Tensor or None
        int32 ``[b, max_blocks]`` and ``[b]``; ignored (may be None) with ``indices``.
    head_dim_v : int
    tile_scheduler_metadata : FlashMLASchedMeta or Tensor
        From :func:`get_mla_metadata` (current) or :func:`get_mla_metadata_legacy` (old).
    num_splits : None or Tensor
        None with a ``FlashMLASchedMeta``; the old convention's tensor otherwise.
    softmax_scale : float, optional
        Default ``d ** -0.5``.
    causal : bool
    is_fp8_kvcache : bool or None
        None (sgl-flash-mla's default): inferred, True when ``k_cache`` has 1-byte elements. (sgl-flash-mla infers
        it from ``indices``; both agree wherever sgl-flash-mla runs: sparse caches are fp8 there.)
    indices : Tensor, optional
        int32 ``[b, s_q, topk]`` sparse token ids ``block * page_block_size + offset``, -1 = skip.
    attn_sink : Tensor, optional
        fp32 ``[h_q]`` on q's device: the output is scaled by ``exp(lse) / (exp(lse) + exp(sink))``; lse unchanged.
        ``+inf`` zeroes a head's output, ``-inf`` leaves it, NaN makes it NaN (rows with no key stay 0).
    extra_k_cache, extra_indices_in_kvcache : Tensor, optional
        A second sparse cache (``k_cache``'s format, its own page size) attended to together with the first.
    topk_length, extra_topk_length : Tensor, optional
        int32 ``[b]``: only the leftmost that many indices are used.

    These four are :func:`mla_dispatch.mla_decode`'s ``attn_sink``, ``extra_kv_cache`` / ``extra_indices``,
    ``topk_length`` and ``extra_topk_length``: the backend computes them (one softmax over both caches).
    out : Tensor, optional
        vLLM's: ``[b, s_q, h_q, head_dim_v]`` in q's dtype on q's device, contiguous; written in place and
        returned.
    enable_batch_invariant : bool
        vLLM's / sgl-flash-mla's: results that do not depend on how the batch is split. Here
        ``plan_decode(batch_invariant=True)``: each request's out and lse are bitwise the same whatever the batch
        around it (fixed-size splits). Must stay the same for every reuse of a ``FlashMLASchedMeta``; not with
        ``use_legacy=True`` (sgl-flash-mla's legacy kernels always split).
    use_legacy : bool or None
        sgl-flash-mla's kernel family (module docstring): ``True`` legacy, ``False`` current (no dense decoding,
        no ``kv_format``), None FlashMLA's own contract.
    kv_format : str, optional
        sgl-flash-mla's name of a sparse fp8 cache's format (legacy side only): ``"V32"`` is DeepSeek-V3.2's
        656-byte token (mla_dispatch's ``"fp8_ds_mla"``), ``"V4"`` DeepSeek-V4's 584-byte one (``"fp8_ds_v4"``);
        ``"V32_NO_ROPE"``, ``"V41"``, ``"V41_FP4"`` are not provided (NotImplementedError). None: told by the
        cache's bytes per token.
    descale_q : Tensor, optional
        sgl-flash-mla's scale of an fp8 q. Not taken: raises NotImplementedError, which says how to pass such a
        q exactly (bf16 q, scale folded into ``softmax_scale``).
    descale_k : Tensor, optional
        float32 ``[1]``: the dequantisation scale of a per-tensor fp8_e4m3 ``k_cache`` (mla_dispatch's
        ``kv_scale``); required for one, refused for any other cache. Per call, so per layer.

    Returns
    -------
    out : Tensor
        ``[b, s_q, h_q, head_dim_v]`` in q's dtype (the ``out`` argument when given).
    softmax_lse : Tensor
        fp32 ``[b, h_q, s_q]``, natural log, ``+inf`` where a row sees no key.

    Raises
    ------
    FlashMLAArgumentError
        Where FlashMLA or sgl-flash-mla asserts (wrong metadata type, mismatch with a reused
        ``FlashMLASchedMeta``, sparse with causal, dense with ``use_legacy=False``, ...) and for a wrong ``out``,
        ``attn_sink`` (shape, dtype, device) or ``descale_k``; the message names the argument.
    NotImplementedError
        What the originals accept and mla_dispatch does not provide: an fp8 q (``descale_q``), the DeepSeek-V4.1 /
        V3.2-no-RoPE / NVFP4 caches (``kv_format`` or the cache's bytes per token), an extra cache next to
        a per-tensor fp8 one.
    ValueError, NoBackendError
        From :func:`mla_dispatch.plan_decode` / :meth:`~mla_dispatch.DecodePlan.run`.
    """
    sparse = indices is not None
    current = isinstance(tile_scheduler_metadata, FlashMLASchedMeta)
    if current:
        if num_splits is not None:
            raise FlashMLAArgumentError("num_splits must be None when tile_scheduler_metadata is a FlashMLASchedMeta")
    elif not isinstance(tile_scheduler_metadata, torch.Tensor):
        raise FlashMLAArgumentError(
            "tile_scheduler_metadata must be a FlashMLASchedMeta from get_mla_metadata() (or, old convention, the "
            f"tensor from get_mla_metadata_legacy()), got {type(tile_scheduler_metadata).__name__}"
        )
    _check_q(q, descale_q)
    if use_legacy is False and not sparse:
        raise FlashMLAArgumentError(
            "use_legacy=False selects sgl-flash-mla's current kernels, which have no dense decoding: pass indices "
            "(sparse), or use_legacy=True (None: FlashMLA's own contract) for dense decoding")
    if kv_format is not None:
        if not sparse:
            raise FlashMLAArgumentError("kv_format does not apply to dense decoding (it names a sparse fp8 cache's "
                                        "format), pass kv_format=None")
        if use_legacy is False:
            raise FlashMLAArgumentError("kv_format only applies to the legacy kernels: pass use_legacy=True "
                                        "(or kv_format=None)")
    if enable_batch_invariant and use_legacy:
        raise FlashMLAArgumentError("enable_batch_invariant=True exists only on sgl-flash-mla's current kernels "
                                    "(use_legacy=False or None); the legacy ones always split")
    if sparse:
        if causal:
            raise FlashMLAArgumentError("causal must be False when sparse attention is enabled (indices given)")
    else:
        if any(t is not None for t in (attn_sink, extra_k_cache, extra_indices_in_kvcache, topk_length, extra_topk_length)):
            raise FlashMLAArgumentError(
                "attn_sink, extra_k_cache, extra_indices_in_kvcache, topk_length and extra_topk_length must be None "
                "when dense attention is used"
            )
        if block_table is None or cache_seqlens is None:
            raise FlashMLAArgumentError("block_table and cache_seqlens must be provided when dense attention is used")
    if (extra_k_cache is None) != (extra_indices_in_kvcache is None):
        raise FlashMLAArgumentError("extra_k_cache and extra_indices_in_kvcache must be given together")
    if attn_sink is not None:
        _check_sink(attn_sink, q)

    kv, fmt, kv_scale, fp8 = _resolve_cache(k_cache, q, is_fp8_kvcache, kv_format, descale_k, "k_cache")
    if sparse and not fp8:
        raise FlashMLAArgumentError("is_fp8_kvcache must be True when sparse attention is enabled (FlashMLA's "
                                    f"contract), got a {k_cache.dtype} k_cache")
    idx = indices
    extra_kv = extra_idx = None
    if extra_k_cache is not None:
        if fmt == "fp8_e4m3":
            raise NotImplementedError("extra_k_cache next to a per-tensor fp8 k_cache is not provided (descale_k "
                                      "scales k_cache only); FlashMLA's extra caches are in DeepSeek's formats")
        extra_kv, extra_fmt, _, _ = _resolve_cache(extra_k_cache, q, fp8, None, None, "extra_k_cache")
        if extra_fmt != fmt:
            raise FlashMLAArgumentError(f"extra_k_cache must be in k_cache's format ({fmt}), got {extra_fmt}")
        extra_idx = extra_indices_in_kvcache
    _check_out(out, q, head_dim_v)
    topk = None if indices is None else indices.shape[-1]
    extra_topk = None if extra_indices_in_kvcache is None else extra_indices_in_kvcache.shape[-1]

    # FlashMLA's optional sparse arguments are mla_dispatch's (the same semantics, computed by the backend)
    sparse_args = {name: t for name, t in (("topk_length", topk_length), ("attn_sink", attn_sink),
                                           ("extra_kv_cache", extra_kv), ("extra_indices", extra_idx),
                                           ("extra_topk_length", extra_topk_length)) if t is not None}

    def make_plans(backend: str):
        # enable_batch_invariant: each request's result independent of the rest of the batch
        # (plan_decode(batch_invariant=True): fixed-size splits, one kernel configuration per shape)
        common = dict(head_dim_v=head_dim_v, softmax_scale=softmax_scale, causal=causal and not sparse,
                      kv_format=fmt, backend=backend, batch_invariant=bool(enable_batch_invariant))
        main = plan_decode(q, kv, None if sparse else block_table, None if sparse else cache_seqlens,
                           indices=idx, kv_scale=kv_scale, **common, **sparse_args)
        return main, None  # the extra cache is an argument of the one plan

    if current:
        meta = tile_scheduler_metadata
        config = _config_of(q, k_cache, causal, fp8, topk, extra_k_cache, extra_topk, enable_batch_invariant)
        key = _per_call_key(q, kv, block_table, head_dim_v, softmax_scale, fmt, sparse)
        if not meta.have_initialized:
            meta.plan, meta.extra_plan = make_plans(meta.backend)
            meta.config = config
            meta.have_initialized = True
        else:
            _check_same_config(meta.config, config)
            if key != meta.per_call_key:
                # FlashMLA reads block_table, softmax_scale, head_dim_v and the cache on every call; a plan freezes
                # the first three (and keeps the caller's table, which must not be overwritten): plan again.
                logger.debug("FlashMLASchedMeta reused with another block table, softmax_scale, head_dim_v or "
                             "dtype: re-planning")
                meta.plan, meta.extra_plan = make_plans(meta.backend)
        meta.per_call_key = key
        plan, extra_plan = meta.plan, meta.extra_plan
    else:
        plan, extra_plan = make_plans("auto")

    return plan.run(q, kv, kv_scale=kv_scale, indices=idx, out=out, **sparse_args)
