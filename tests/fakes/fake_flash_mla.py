"""A fake ``flash_mla`` implementing FlashMLA's decode signatures on CPU.

Mirrors deepseek-ai/FlashMLA ``flash_mla/flash_mla_interface.py`` at HEAD 9241ae3 (the
``FlashMLASchedMeta`` interface) and, with ``legacy=True``, the interface up to commit
c28eca9 (``get_mla_metadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_k,
num_heads_q=None, is_fp8_kvcache=False, topk=None) -> (tile_scheduler_metadata,
num_splits)``). Host checks follow ``csrc/api/dense_decode.h`` / ``sparse_decode.h``:
dense page size 64 only, q/kv same dtype, D_qk 576|512, D_v 512, h_q % h_kv == 0;
sparse needs ``is_fp8_kvcache``, h_kv 1, h_q in {64, 128}, bf16 q, 656-byte tokens.

Checks inside the kernels, which the API lets through, are modelled as they surface (:func:`kernel_asserts`):
the SM90 dense kernel's ``FLASH_ASSERT(params.d == Config::HEAD_DIM_K)`` (576) prints and exits the process
(``SystemExit`` here, so a test that reaches it fails instead of ending the session); the sparse kernels'
``KU_ASSERT(params.topk % 64 == 0)`` throws (``RuntimeError``).

Metadata misuse is detected the way the real asserts would surface it: the
``FlashMLASchedMeta`` remembers the config *and* the seqlens it was filled for
(reusing it across steps gives wrong splits upstream); the legacy tensors encode
``num_q_tokens_per_head_k`` and the lengths they were computed from.
"""

from __future__ import annotations

import dataclasses
import sys
import types

import torch

from mla_dispatch.kvcache.formats import unpack_ds_mla

from ._attend import attend


class FlashMLASchedMeta:
    """HEAD's class: a ``Config`` dataclass, ``have_initialized``, the two tensors (filled by the first call)."""

    @dataclasses.dataclass
    class Config:
        b: int
        s_q: int
        h_q: int
        page_block_size: int
        h_k: int
        causal: bool
        is_fp8_kvcache: bool
        topk: int | None
        extra_page_block_size: int | None
        extra_topk: int | None

    def __init__(self):
        self.have_initialized = False
        self.config = None
        self.tile_scheduler_metadata = None
        self.num_splits = None
        self._seqlens = None  # the fake's own: the lengths its first call scheduled


def get_mla_metadata(*args, **kwargs):
    """Current interface: ignores its arguments, returns an empty meta object."""
    return FlashMLASchedMeta(), None


def get_mla_metadata_legacy(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_heads_q=None,
                            is_fp8_kvcache=False, topk=None):
    if cache_seqlens.dtype != torch.int32:
        raise ValueError("cache_seqlens must be int32")
    tile = torch.zeros(4, 8, dtype=torch.int32)
    tile[0, 0], tile[0, 1] = num_q_tokens_per_head_k, num_heads_k
    num_splits = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(cache_seqlens, 0).to(torch.int32)])
    return tile, num_splits


def kernel_asserts(*, head_dim_qk: int, head_dim_v: int, topk: int | None) -> str | None:
    """The first check inside FlashMLA's kernels (9241ae3) that a call the API accepted fails, or None.

    Dense (``topk`` None): csrc/sm90/decode/dense/splitkv_mla.cuh asserts ``params.d == 576`` and ``params.d_v ==
    512``. Sparse: csrc/sm90/decode/sparse_fp8/splitkv_mla.cuh and csrc/sm100/decode/head64/kernel.cuh assert
    ``params.topk % 64 == 0``.
    """
    if topk is None:
        if head_dim_qk != 576:
            return "Assertion failed (splitkv_mla.cuh:1277): params.d == Config::HEAD_DIM_K"
        if head_dim_v != 512:
            return "Assertion failed (splitkv_mla.cuh:1278): params.d_v == Config::HEAD_DIM_V"
        return None
    if topk % 64:
        return "Assertion `params.topk % TOPK_BLOCK_SIZE == 0` failed (splitkv_mla.cuh:689)"
    return None


def _compute(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal, is_fp8_kvcache, indices):
    b, s_q, h_q, d = q.shape
    nb, ps, h_k, dk = k_cache.shape
    if softmax_scale is None:
        softmax_scale = d ** -0.5
    if indices is None:
        if q.dtype not in (torch.bfloat16, torch.float16) or k_cache.dtype != q.dtype:
            raise RuntimeError("Dense FP8 MLA is not supported on SM90 (kcache dtype must equal q dtype)")
        if ps != 64:
            raise RuntimeError("Currently page_block_size must be 64")
        if dk not in (576, 512) or dk != d or head_dim_v != 512:
            raise RuntimeError(f"head_size_k must be 576 or 512 and head_size_v 512, got {dk}, {head_dim_v}")
        if h_q % h_k or block_table.dtype != torch.int32 or cache_seqlens.dtype != torch.int32:
            raise RuntimeError("h_q % h_k, int32 block_table/cache_seqlens")
        causal = causal and s_q > 1
    else:
        if not is_fp8_kvcache or causal or h_k != 1 or h_q not in (64, 128) or q.dtype != torch.bfloat16:
            raise RuntimeError("sparse decode: fp8 kv, causal=False, h_kv 1, h_q in {64,128}, bf16 q")
        if dk != 656 or k_cache.stride(1) != 656 * h_k:
            raise RuntimeError("sparse decode: 656-byte tokens, stride(1) == bytes_per_token")
    failed = kernel_asserts(head_dim_qk=d, head_dim_v=head_dim_v, topk=None if indices is None else indices.shape[-1])
    if failed is not None:
        if indices is None:
            raise SystemExit(f"{failed} (FlashMLA's FLASH_ASSERT exits the process)")
        raise RuntimeError(failed)
    out = torch.empty(b, s_q, h_q, head_dim_v, dtype=q.dtype)
    lse = torch.empty(b, h_q, s_q, dtype=torch.float32)
    g = h_q // h_k
    for i in range(b):
        for kh in range(h_k):
            qi = q[i, :, kh * g:(kh + 1) * g].float()
            if indices is None:
                length = int(cache_seqlens[i])
                tok = torch.arange(length)
                keys = k_cache[block_table[i].long()[tok // ps], tok % ps, kh].float()
                o, l = attend(qi, keys, head_dim_v, softmax_scale, causal)
            else:
                o = torch.empty(s_q, g, head_dim_v)
                l = torch.empty(s_q, g)
                flat = k_cache.view(nb * ps, 656)
                for t in range(s_q):
                    idx = indices[i, t].long()
                    keys = unpack_ds_mla(flat[idx[idx >= 0]])
                    o[t:t + 1], l[t:t + 1] = attend(qi[t:t + 1], keys, head_dim_v, softmax_scale, False)
            empty = torch.isneginf(l)  # FlashMLA's convention: out 0, lse +inf
            o = torch.where(empty[..., None], 0.0, o)
            l = torch.where(empty, float("inf"), l)
            out[i, :, kh * g:(kh + 1) * g] = o.to(q.dtype)
            lse[i, kh * g:(kh + 1) * g] = l.transpose(0, 1)
    return out, lse


def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                           num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=False, indices=None,
                           attn_sink=None, extra_k_cache=None, extra_indices_in_kvcache=None, topk_length=None,
                           extra_topk_length=None):
    meta = tile_scheduler_metadata
    if not isinstance(meta, FlashMLASchedMeta):
        raise TypeError("tile_scheduler_metadata must be a FlashMLASchedMeta (from get_mla_metadata())")
    if num_splits is not None:
        raise AssertionError("num_splits must be None")
    b, s_q, h_q, _ = q.shape
    config = FlashMLASchedMeta.Config(b, s_q, h_q, k_cache.shape[1], k_cache.shape[2], causal, is_fp8_kvcache,
                                      None if indices is None else indices.shape[-1], None, None)
    if not meta.have_initialized:
        meta.have_initialized = True
        meta.config = config
        meta._seqlens = None if cache_seqlens is None else cache_seqlens.clone()
        meta.tile_scheduler_metadata = torch.zeros(4, 8, dtype=torch.int32)
        meta.num_splits = torch.zeros(b + 1, dtype=torch.int32)
    elif meta.config != config:
        raise AssertionError(f"FlashMLASchedMeta reused for another config {meta.config} != {config}")
    elif meta._seqlens is None:  # filled by its user, as FlashMLA's first call would (shapes as dense_decode.h checks)
        t, n = meta.tile_scheduler_metadata, meta.num_splits
        if t is None or t.dim() != 2 or t.shape[1] != 8 or t.dtype != torch.int32 or n is None or n.shape != (b + 1,):
            raise RuntimeError("tile_scheduler_metadata must be int32 [num_sm_parts, 8], num_splits int32 [b + 1]")
    elif cache_seqlens is not None and not torch.equal(meta._seqlens, cache_seqlens):
        raise AssertionError("FlashMLASchedMeta reused after cache_seqlens changed (make one per decode step)")
    return _compute(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal, is_fp8_kvcache,
                    indices)


def flash_mla_with_kvcache_legacy(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                                  num_splits, softmax_scale=None, causal=False, is_fp8_kvcache=False, indices=None):
    b, s_q, h_q, _ = q.shape
    h_k = k_cache.shape[2]
    if int(tile_scheduler_metadata[0, 0]) != s_q * h_q // h_k or int(tile_scheduler_metadata[0, 1]) != h_k:
        raise AssertionError("tile_scheduler_metadata was computed for another num_q_tokens_per_head_k / num_heads_k")
    if cache_seqlens is not None and indices is None:
        expect = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(cache_seqlens, 0).to(torch.int32)])
        if not torch.equal(num_splits, expect):
            raise AssertionError("num_splits was computed for other cache_seqlens")
    return _compute(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal, is_fp8_kvcache,
                    indices)


def install(monkeypatch, legacy: bool = False, version: str = "1.0.0") -> types.ModuleType:
    """Put the fake into ``sys.modules`` as ``flash_mla`` (+ ``.flash_mla_interface``) for one test."""
    pkg = types.ModuleType("flash_mla")
    iface = types.ModuleType("flash_mla.flash_mla_interface")
    pkg.__version__ = version
    if legacy:
        iface.get_mla_metadata = get_mla_metadata_legacy
        iface.flash_mla_with_kvcache = flash_mla_with_kvcache_legacy
    else:
        iface.FlashMLASchedMeta = FlashMLASchedMeta
        iface.get_mla_metadata = get_mla_metadata
        iface.flash_mla_with_kvcache = flash_mla_with_kvcache
    pkg.get_mla_metadata = iface.get_mla_metadata
    pkg.flash_mla_with_kvcache = iface.flash_mla_with_kvcache
    pkg.flash_mla_interface = iface
    monkeypatch.setitem(sys.modules, "flash_mla", pkg)
    monkeypatch.setitem(sys.modules, "flash_mla.flash_mla_interface", iface)
    return pkg
