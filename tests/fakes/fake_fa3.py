"""A fake FlashAttention-3 (its paged forward with ``qv``) on CPU, in the three packagings the fa3 adapter imports.

Mirrors, as the contract:

- Dao-AILab/flash-attention ``hopper/flash_attn_interface.py`` at 0251105: ``flash_attn_with_kvcache(q, k_cache,
  v_cache, k, v, qv, ..., cache_seqlens, ..., page_table, ..., softmax_scale, causal, window_size,
  attention_chunk, softcap, rotary_interleaved, scheduler_metadata, num_splits, pack_gqa, sm_margin,
  return_softmax_lse)`` returning ``(out, softmax_lse, out_accum, lse_accum)`` with the LSE, and
  ``get_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim,
  cache_seqlens, qkv_dtype, headdim_v, cu_seqlens_q, ..., page_size, ..., causal, ..., num_splits, ...)``;
  its build flags as the module ``flash_attn_config`` (``CONFIG["build_flags"]``);
- vLLM's fork ``vllm_flash_attn/flash_attn_interface.py`` (vllm-project/flash-attention 03ef28b):
  ``flash_attn_varlen_func(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k, seqused_k, q_v, ...,
  block_table, return_softmax_lse, out, scheduler_metadata, ..., num_splits, fa_version=2, ...)``: packed
  ``[total_q, h, d]`` q, LSE ``[h, total_q]``, ``out`` written in place; ``fa_version`` defaults to 2 (FA2, which
  has no ``q_v`` and wants V's head dim equal to Q's);
- sgl-kernel ``python/sgl_kernel/flash_attn.py`` (sglang 01d2a3d): ``flash_attn_with_kvcache`` without
  ``attention_chunk``, and no ``get_scheduler_metadata``.

The host checks are ``hopper/flash_api_stable.cpp`` ``mha_fwd``'s (shapes, dtypes, last-dim strides, ``q_v``'s
head-dim and dtype rules, the build's ``FLASHATTENTION_DISABLE_*`` refusals). The kernel's semantics: score
``softmax_scale * (<q, k> + <qv, v>)`` over the tokens ``page_table`` maps for ``seqused_k`` / ``cache_seqlens``,
bottom-right causal, rows that see no key get out 0 and LSE -inf, natural-log LSE.

The scheduler metadata is an int32 tensor of FA3's size (``1 + round_up(b, 4) * vectors``). The fake fills it
with a token that remembers the configuration and the lengths it was computed for, and the forward raises where
the real kernel would silently split wrongly: metadata of another configuration (``max_seqlen_k``, ``num_splits``,
causal, ...) or of older lengths.
"""

from __future__ import annotations

import math
import sys
import types

import torch

from ._attend import attend

VERSION = "3.0.0"

#: Upstream's build flags, all features on (``hopper/setup.py`` ``create_build_config_file``).
FULL_BUILD = {
    "FLASHATTENTION_DISABLE_BACKWARD": False, "FLASHATTENTION_DISABLE_SPLIT": False,
    "FLASHATTENTION_DISABLE_PAGEDKV": False, "FLASHATTENTION_DISABLE_APPENDKV": False,
    "FLASHATTENTION_DISABLE_LOCAL": False, "FLASHATTENTION_DISABLE_SOFTCAP": False,
    "FLASHATTENTION_DISABLE_PACKGQA": False, "FLASHATTENTION_DISABLE_FP16": False,
    "FLASHATTENTION_DISABLE_FP8": False, "FLASHATTENTION_DISABLE_VARLEN": False,
    "FLASHATTENTION_DISABLE_CLUSTER": False, "FLASHATTENTION_DISABLE_HDIM64": False,
    "FLASHATTENTION_DISABLE_HDIM96": False, "FLASHATTENTION_DISABLE_HDIM128": False,
    "FLASHATTENTION_DISABLE_HDIM192": False, "FLASHATTENTION_DISABLE_HDIM256": False,
    "FLASHATTENTION_DISABLE_SM8x": False, "FLASHATTENTION_ENABLE_VCOLMAJOR": False,
    "FLASH_ATTENTION_DISABLE_HDIMDIFF64": False, "FLASH_ATTENTION_DISABLE_HDIMDIFF192": False,
}


class _Build:
    """What one installed fake was built with, and the metadata it handed out."""

    def __init__(self, flags: dict[str, bool]):
        self.flags = dict(flags)
        self.metadata: dict[int, tuple[dict, torch.Tensor]] = {}
        self.calls: list[dict] = []  # one entry per forward: the configuration it ran

    def off(self, name: str) -> bool:
        return self.flags.get(name, False)


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise RuntimeError(message)  # TORCH_CHECK raises RuntimeError


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _effective_causal(causal: bool, seqlen_q: int, headdim: int, paged: bool) -> bool:
    """``mha_fwd``: with one query token causal is dropped (except hdim in (64, 128] with a paged cache)."""
    if seqlen_q == 1 and (headdim <= 64 or headdim > 128 or not paged):
        return False
    return causal


def _metadata_size(batch: int, causal: bool) -> int:
    """``1 + round_up(b, 4) * vectors``: prepare-varlen (2), batch sort (1, not local), head swizzle (1, causal)."""
    return 1 + _round_up(batch, 4) * (3 + int(causal))


def _make_get_scheduler_metadata(build: _Build, with_attention_chunk: bool):
    def get_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim,
                               cache_seqlens, qkv_dtype=torch.bfloat16, headdim_v=None, cu_seqlens_q=None,
                               cu_seqlens_k_new=None, cache_leftpad=None, page_size=None, max_seqlen_k_new=0,
                               causal=False, window_size=(-1, -1), attention_chunk=0, has_softcap=False,
                               num_splits=0, pack_gqa=None, sm_margin=0):
        _check(qkv_dtype in (torch.float16, torch.bfloat16, torch.float8_e4m3fn),
               "FlashAttention only supports fp16, bf16, and fp8_e4m3 data type")
        _check(num_heads_q % num_heads_kv == 0, "Number of heads in key/value must divide number of heads in query")
        _check(cache_seqlens.dtype == torch.int32 and cache_seqlens.shape == (batch_size,),
               "seqused_k must be int32 [batch_size]")
        headdim_v = headdim if headdim_v is None else headdim_v
        causal = _effective_causal(causal, max_seqlen_q, headdim, page_size is not None)
        config = dict(batch=batch_size, seqlen_q=max_seqlen_q, seqlen_k=max_seqlen_k, h=num_heads_q,
                      h_k=num_heads_kv, d=headdim, dv=headdim_v, dtype=qkv_dtype, page_size=page_size,
                      causal=causal, num_splits=num_splits, varlen_q=cu_seqlens_q is not None)
        token = len(build.metadata) + 1
        build.metadata[token] = (config, cache_seqlens.clone())
        return torch.full((_metadata_size(batch_size, causal),), token, dtype=torch.int32,
                          device=cache_seqlens.device)

    if not with_attention_chunk:
        def get_scheduler_metadata_vllm(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim,
                                        cache_seqlens, qkv_dtype=torch.bfloat16, headdim_v=None, cu_seqlens_q=None,
                                        cu_seqlens_k_new=None, cache_leftpad=None, page_size=None,
                                        max_seqlen_k_new=0, causal=False, window_size=(-1, -1), has_softcap=False,
                                        num_splits=0, pack_gqa=None, sm_margin=0):
            return get_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim,
                                          cache_seqlens, qkv_dtype, headdim_v, cu_seqlens_q, cu_seqlens_k_new,
                                          cache_leftpad, page_size, max_seqlen_k_new, causal, window_size, 0,
                                          has_softcap, num_splits, pack_gqa, sm_margin)

        return get_scheduler_metadata_vllm
    return get_scheduler_metadata


def _mha_fwd(build: _Build, q, k, v, qv, out, cu_seqlens_q, seqused_k, max_seqlen_q, page_table, softmax_scale,
             causal, scheduler_metadata, num_splits):
    """``mha_fwd`` for a paged cache with ``seqused_k``: its host checks, then exact fp32 attention."""
    q_type = q.dtype
    _check(q_type in (torch.float16, torch.bfloat16, torch.float8_e4m3fn),
           "FlashAttention only supports fp16, bf16, and fp8_e4m3 data type")
    _check(k.dtype == q_type, "query and key must have the same dtype")
    _check(v.dtype == q_type, "query and value must have the same dtype")
    _check(q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1,
           "Input tensor must have contiguous last dimension")
    _check(page_table is not None, "this fake models the paged cache only (page_table)")
    _check(page_table.dtype == torch.int32, "page_table must have dtype torch.int32")
    _check(page_table.stride(-1) == 1, "page_table must have contiguous last dimension")
    varlen_q = cu_seqlens_q is not None
    if varlen_q:
        _check(cu_seqlens_q.dtype == torch.int32, "cu_seqlens_q must have dtype torch.int32")
        _check(max_seqlen_q is not None, "max_seqlen_q must be provided if cu_seqlens_q is provided")
    batch = q.shape[0] if not varlen_q else cu_seqlens_q.shape[0] - 1
    seqlen_q = q.shape[1] if not varlen_q else max_seqlen_q
    total_q = batch * q.shape[1] if not varlen_q else q.shape[0]
    num_heads, head_size = q.shape[-2], q.shape[-1]
    head_size_v = v.shape[-1]
    _check(k.dim() == 4 and v.dim() == 4, "k/v must be (num_pages, page_size, h_k, d) with a page table")
    num_pages, page_size, num_heads_k = k.shape[0], k.shape[1], k.shape[2]
    max_pages = page_table.shape[1]
    seqlen_k = max_pages * page_size
    _check(page_table.shape[0] == batch, "batch_size must be equal to batch_size_k")
    _check(head_size <= 256, "FlashAttention forward only supports head dimension at most 256")
    _check(num_heads % num_heads_k == 0, "Number of heads in key/value must divide number of heads in query")
    if head_size_v != head_size:
        _check((128 < head_size <= 192 and 96 < head_size_v <= 128) or (head_size <= 64 and head_size_v <= 512),
               "If V headdim is different from Q/K dim, we only support Q/K headdim in (128, 192] and V headdim in "
               "(96, 128], or (Q/K <= 64 and V <= 512).")
        if head_size_v > 256:
            _check(q_type in (torch.float16, torch.bfloat16), "HeaddimV > 256 requires fp16 and bf16 data type")
    expected_q = (total_q, num_heads, head_size) if varlen_q else (batch, seqlen_q, num_heads, head_size)
    _check(tuple(q.shape) == expected_q, f"q must be {expected_q}, got {tuple(q.shape)}")
    _check(tuple(k.shape) == (num_pages, page_size, num_heads_k, head_size), f"k shape {tuple(k.shape)}")
    _check(tuple(v.shape) == (num_pages, page_size, num_heads_k, head_size_v), f"v shape {tuple(v.shape)}")
    _check(seqused_k is not None, "this fake models seqused_k / cache_seqlens lengths only")
    _check(seqused_k.dtype == torch.int32, "seqused_k must have dtype int32")
    _check(seqused_k.is_contiguous() and tuple(seqused_k.shape) == (batch,), "seqused_k must be contiguous [b]")
    _check(not build.off("FLASHATTENTION_DISABLE_VARLEN"), "This flash attention build does not support varlen.")
    _check(head_size % 8 == 0 and head_size_v % 8 == 0, "head_size should be a multiple of 8")
    if q_type == torch.float16:
        _check(not build.off("FLASHATTENTION_DISABLE_FP16"), "This flash attention build does not support FP16.")
    _check(head_size <= 64 and not build.off("FLASHATTENTION_DISABLE_HDIM64")
           and not build.off("FLASH_ATTENTION_DISABLE_HDIMDIFF64"), "this fake models hdim 64 (with hdim_v 512) only")
    is_causal = _effective_causal(causal, seqlen_q, head_size, True)
    pagedkv_tma = page_size % 64 == 0 and seqlen_q * (num_heads // num_heads_k) > 64
    _check(pagedkv_tma or not build.off("FLASHATTENTION_DISABLE_PAGEDKV"),
           "This flash attention build does not support paged KV.")
    out_shape = (total_q, num_heads, head_size_v) if varlen_q else (batch, seqlen_q, num_heads, head_size_v)
    out_given = out is not None
    if out is not None:
        _check(out.dtype == q_type, "For FP16/BF16 input, output must have the same dtype as inputs")
        _check(out.stride(-1) == 1, "Output tensor must have contiguous last dimension")
        _check(tuple(out.shape) == out_shape, f"out must be {out_shape}, got {tuple(out.shape)}")
    else:
        out = torch.empty(out_shape, dtype=q_type, device=q.device)
    if scheduler_metadata is not None:
        _check(scheduler_metadata.dtype == torch.int32, "scheduler_metadata must have dtype int32")
        _check(scheduler_metadata.is_contiguous(), "scheduler_metadata must be contiguous")
        _check(tuple(scheduler_metadata.shape) == (_metadata_size(batch, is_causal),),
               f"scheduler_metadata must have size {_metadata_size(batch, is_causal)}")
        token = int(scheduler_metadata[0])
        _check(token in build.metadata and bool((scheduler_metadata == token).all()),
               "scheduler_metadata was not made by get_scheduler_metadata")
        config, lengths = build.metadata[token]
        now = dict(batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, h=num_heads, h_k=num_heads_k, d=head_size,
                   dv=head_size_v, dtype=q_type, page_size=page_size, causal=is_causal, num_splits=num_splits,
                   varlen_q=varlen_q)
        _check(config == now, f"scheduler_metadata was made for {config}, this call is {now} (the kernel would read "
                              "a schedule of other splits)")
        _check(torch.equal(lengths, seqused_k), "scheduler_metadata was made for other lengths (stale: the kernel "
                                                "would split the old lengths)")
    if qv is not None:
        _check(head_size <= 64, "q_v is only supported for head_size <= 64")
        _check(head_size_v >= 256, "q_v is only supported for hdim_v >= 256.")
        _check(q_type in (torch.float16, torch.bfloat16), "q_v is only supported for fp16 and bf16 data type")
        _check(qv.dtype == q_type, "q_v must have the same dtype as query")
        _check(qv.stride(-1) == 1, "q_v tensor must have contiguous last dimension")
        expected_qv = expected_q[:-1] + (head_size_v,)
        _check(tuple(qv.shape) == expected_qv, f"q_v must be {expected_qv}, got {tuple(qv.shape)}")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_size)
    build.calls.append(dict(batch=batch, seqlen_q=seqlen_q, page_size=page_size, causal=is_causal,
                            num_splits=num_splits, metadata=scheduler_metadata is not None, varlen_q=varlen_q,
                            out_given=out_given))

    # the kernel: per request, the tokens the table maps, the score over q.k + qv.v (no qv: q.k alone), out = P v
    group = num_heads // num_heads_k
    lse = (torch.empty(num_heads, total_q, dtype=torch.float32) if varlen_q
           else torch.empty(batch, num_heads, seqlen_q, dtype=torch.float32))
    for b in range(batch):
        length = int(seqused_k[b])
        q0, q1 = (int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])) if varlen_q else (0, seqlen_q)
        rows = q[q0:q1] if varlen_q else q[b]
        rows_v = None if qv is None else (qv[q0:q1] if varlen_q else qv[b])
        tok = torch.arange(length)
        pages = page_table[b].long()[tok // page_size]
        for hk in range(num_heads_k):
            heads = slice(hk * group, (hk + 1) * group)
            keys, values = k[pages, tok % page_size, hk].float(), v[pages, tok % page_size, hk].float()
            latent = (rows_v[:, heads].float() if rows_v is not None
                      else torch.zeros(q1 - q0, group, head_size_v))
            o, l = attend(torch.cat([latent, rows[:, heads].float()], dim=-1), torch.cat([values, keys], dim=-1),
                          head_size_v, softmax_scale, is_causal)
            o = torch.where(torch.isneginf(l)[..., None], 0.0, o)  # rows that see nothing: out 0, LSE -inf
            if varlen_q:
                out[q0:q1, heads] = o.to(q_type)
                lse[heads, q0:q1] = l.transpose(0, 1)
            else:
                out[b, :, heads] = o.to(q_type)
                lse[b, heads] = l.transpose(0, 1)
    return out, lse, None, None


def _install_upstream(build: _Build) -> dict[str, types.ModuleType]:
    iface = types.ModuleType("flash_attn_interface")

    def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
                                cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
                                cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                                q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
                                window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                                scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0,
                                return_softmax_lse=False):
        if k is not None or v is not None or rotary_cos is not None or cache_batch_idx is not None \
                or cache_leftpad is not None or window_size != (-1, -1) or attention_chunk or softcap:
            raise NotImplementedError("fake FA3: appending KV, rotary, batch idx, leftpad, windows, softcap")
        assert k_cache.stride(-1) == 1, "k_cache must have contiguous last dimension"
        assert v_cache.stride(-1) == 1, "v_cache must have contiguous last dimension"
        if softmax_scale is None:
            softmax_scale = (q.shape[-1] + (qv.shape[-1] if qv is not None else 0)) ** (-0.5)
        out, lse, *rest = _mha_fwd(build, q, k_cache, v_cache, qv, None, cu_seqlens_q, cache_seqlens, max_seqlen_q,
                                   page_table, softmax_scale, causal, scheduler_metadata, num_splits)
        return (out, lse, *rest) if return_softmax_lse else out

    iface.flash_attn_with_kvcache = flash_attn_with_kvcache
    iface.get_scheduler_metadata = _make_get_scheduler_metadata(build, with_attention_chunk=True)
    config = types.ModuleType("flash_attn_config")
    config.CONFIG = {"build_flags": dict(build.flags)}
    pkg = types.ModuleType("flash_attn_3")
    pkg.__version__ = VERSION
    return {"flash_attn_interface": iface, "flash_attn_config": config, "flash_attn_3": pkg}


def _install_vllm(build: _Build) -> dict[str, types.ModuleType]:
    """vLLM's package holds FA2 and FA3; ``fa_version_unsupported_reason(3)`` says why FA3 cannot run (its
    ``_vllm_fa3_C`` failed to import, or the GPU is not SM80/SM90), here when the build has ``FA3_MISSING``."""
    vllm = types.ModuleType("vllm")
    vllm.__version__ = "0.33.0"
    fa = types.ModuleType("vllm.vllm_flash_attn")

    def flash_attn_varlen_func(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None, seqused_k=None,
                               q_v=None, dropout_p=0.0, softmax_scale=None, causal=False, window_size=None,
                               softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                               block_table=None, return_softmax_lse=False, out=None, scheduler_metadata=None,
                               q_descale=None, k_descale=None, v_descale=None, num_splits=0, fa_version=2,
                               s_aux=None, cp_world_size=1, cp_rank=0, cp_tot_seqused_k=None):
        assert cu_seqlens_k is not None or seqused_k is not None, "cu_seqlens_k or seqused_k must be provided"
        assert cu_seqlens_k is None or seqused_k is None, "cu_seqlens_k and seqused_k cannot both be provided"
        assert block_table is None or seqused_k is not None, "seqused_k must be provided if block_table is provided"
        if softmax_scale is None:
            softmax_scale = q.shape[-1] ** (-0.5)
        if fa_version == 2:  # FA2's varlen_fwd: no q_v, V's head dim must be Q's
            _check(v.shape[-1] == q.shape[-1], "FA2: v must have the head dim of q")
            raise NotImplementedError("fake FA3: FA2 is not modelled")
        _check(fa_version == 3, f"Unsupported FA version: {fa_version}")
        if window_size not in (None, (-1, -1), [-1, -1]) or softcap or alibi_slopes is not None or s_aux is not None \
                or cp_world_size != 1:
            raise NotImplementedError("fake FA3: windows, softcap, alibi, sinks, context parallel")
        o, lse, *_ = _mha_fwd(build, q, k, v, q_v, out, cu_seqlens_q, seqused_k, max_seqlen_q, block_table,
                              softmax_scale, causal, scheduler_metadata, num_splits)
        return (o, lse) if return_softmax_lse else o

    def fa_version_unsupported_reason(fa_version, device=None):
        assert fa_version in (2, 3, 4), f"Unsupported FA version: {fa_version}"
        if fa_version == 3 and build.off("FA3_MISSING"):
            return "FA3 is unavaible due to: No module named 'vllm.vllm_flash_attn._vllm_fa3_C'"
        return None

    fa.flash_attn_varlen_func = flash_attn_varlen_func
    fa.get_scheduler_metadata = _make_get_scheduler_metadata(build, with_attention_chunk=False)
    fa.fa_version_unsupported_reason = fa_version_unsupported_reason
    vllm.vllm_flash_attn = fa
    return {"vllm": vllm, "vllm.vllm_flash_attn": fa}


def _install_sgl_kernel(build: _Build) -> dict[str, types.ModuleType]:
    sgl = types.ModuleType("sgl_kernel")
    sgl.__version__ = "0.3.0"
    fa = types.ModuleType("sgl_kernel.flash_attn")

    def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
                                cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
                                cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                                q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
                                window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, scheduler_metadata=None,
                                num_splits=0, pack_gqa=None, sm_margin=0, return_softmax_lse=False):
        if k is not None or v is not None or rotary_cos is not None or cache_batch_idx is not None \
                or cache_leftpad is not None or window_size != (-1, -1) or softcap:
            raise NotImplementedError("fake FA3: appending KV, rotary, batch idx, leftpad, windows, softcap")
        if softmax_scale is None:
            softmax_scale = (q.shape[-1] + (qv.shape[-1] if qv is not None else 0)) ** (-0.5)
        out, lse, *rest = _mha_fwd(build, q, k_cache, v_cache, qv, None, cu_seqlens_q, cache_seqlens, max_seqlen_q,
                                   page_table, softmax_scale, causal, scheduler_metadata, num_splits)
        return (out, lse, *rest) if return_softmax_lse else out

    fa.flash_attn_with_kvcache = flash_attn_with_kvcache
    sgl.flash_attn = fa
    return {"sgl_kernel": sgl, "sgl_kernel.flash_attn": fa}


_INSTALLERS = {"upstream": _install_upstream, "vllm": _install_vllm, "sgl_kernel": _install_sgl_kernel}
#: every module name any packaging provides: those of the other packagings are made unimportable
_ALL_MODULES = ("flash_attn_interface", "flash_attn_config", "flash_attn_3", "vllm", "vllm.vllm_flash_attn",
                "sgl_kernel", "sgl_kernel.flash_attn")


def install(monkeypatch, packaging: str = "upstream", flags: dict[str, bool] | None = None) -> _Build:
    """Put the fake into ``sys.modules`` as one packaging (``upstream``, ``vllm`` or ``sgl_kernel``) for one test,
    the others unimportable. ``flags`` override upstream's build flags. Returns the build (its ``calls`` and
    handed-out ``metadata``)."""
    build = _Build({**FULL_BUILD, **(flags or {})})
    modules = _INSTALLERS[packaging](build)
    for name in _ALL_MODULES:
        monkeypatch.setitem(sys.modules, name, modules.get(name))
    return build
