"""A fake ``aiter`` implementing the MLA decode signatures on CPU.

Mirrors ROCm/aiter ``aiter/mla.py`` ``mla_decode_fwd`` (HEAD e404860; the signature
after commit 739c631, Feb 2026, with ``page_size``/``nhead_kv`` before ``sm_scale``,
and with ``legacy=True`` the Dec-2025 one without them), ``aiter/ops/attention.py``
``get_mla_metadata_info_v1`` / ``get_mla_metadata_v1`` (positional order of the current
file), and ``csrc/py_itfs_cu/asm_mla.cu``'s checks: nhead_kv 1, contiguous q,
fp8 q needs q_scale and kv_scale, ``logit_cap <= 0``. The kernel lookup uses its own
copy of ``hsa/<arch>/mla/mla_asm.csv`` (decode rows) and raises :class:`AiterAbort`
where the real library would SIGABRT. gfx942's fp8 is ``float8_e4m3fnuz``.

The fake computes from the vendor inputs: token slots from ``kv_indices`` between
``kv_indptr`` entries (page size 1), checked against ``kv_last_page_lens``; in
persistent mode each request's KV range is taken from ``work_info_set`` as filled by
``get_mla_metadata_v1`` (so stale metadata gives a wrong or refused answer).
"""

from __future__ import annotations

import sys
import types

import torch

from ._attend import attend

# Decode rows of hsa/gfx942/mla/mla_asm.csv @074f473 and hsa/gfx950/mla/mla_asm.csv @0462c53:
# qType,kvType,Gqa,ps,qSeqLen
_CSV = {
    "gfx942": """bf16,bf16,128,0,0 bf16,bf16,16,1,4 bf16,bf16,16,0,1 bf16,bf16,16,0,4 bf16,bf16,16,0,8
        bf16,fp8,16,1,4 fp8,fp8,16,1,1 fp8,fp8,64,1,1 fp8,fp8,16,1,2 fp8,fp8,16,1,4 fp8,fp8,16,0,1 fp8,fp8,16,0,2
        fp8,fp8,16,0,4 fp8,fp8,128,0,0 fp8,fp8,128,1,0 bf16,bf16,32,0,0 bf16,bf16,64,0,0 bf16,bf16,8,0,1
        fp8,fp8,8,0,1 bf16,bf16,8,1,2""",
    "gfx950": """bf16,bf16,128,0,0 bf16,bf16,16,1,4 bf16,bf16,16,0,1 bf16,bf16,16,0,4 bf16,bf16,16,0,8
        bf16,fp8,16,1,4 fp8,fp8,16,1,1 fp8,fp8,16,1,2 fp8,fp8,16,1,4 fp8,fp8,64,1,1 fp8,fp8,16,0,1 fp8,fp8,16,0,2
        fp8,fp8,16,0,4 fp8,fp8,32,1,4 fp8,fp8,32,1,2 fp8,fp8,128,0,0 bf16,bf16,32,0,0 bf16,bf16,64,0,0
        bf16,bf16,64,0,1 bf16,bf16,8,0,1 bf16,bf16,8,0,2 fp8,fp8,8,0,1 fp8,fp8,8,1,4 bf16,bf16,32,1,4
        bf16,bf16,64,1,1""",
}


class AiterAbort(RuntimeError):
    """Stands for the SIGABRT the real AITER_CHECK raises: an adapter must never trigger it."""


def _table(arch):
    rows = set()
    for item in _CSV[arch].split():
        q, kv, gqa, ps, qlen = item.split(",")
        rows.add((q, kv, int(gqa), bool(int(ps)), int(qlen)))
    return rows


def _make(arch: str, legacy: bool):
    fp8 = torch.float8_e4m3fnuz if arch == "gfx942" else torch.float8_e4m3fn

    def kind(dtype):
        if dtype == torch.bfloat16:
            return "bf16"
        if dtype == fp8:
            return "fp8"
        raise AiterAbort(f"AITER_CHECK: unsupported dtype {dtype} on {arch} (fp8 here is {fp8})")

    def get_mla_metadata_info_v1(batch_size, max_seqlen_qo, num_head_qo, q_dtype, kv_dtype, is_sparse,
                                 fast_mode=True, num_kv_splits=32, intra_batch_mode=False, max_split_per_batch=-1):
        assert num_head_qo % 8 == 0
        tiles = batch_size * max_seqlen_qo
        return (((2,), torch.uint64), ((8 + 1,), torch.int32), ((tiles * 4, 8), torch.int32),
                ((tiles + 1,), torch.int32), ((tiles, 2), torch.int32), ((tiles * 4,), torch.int32))

    def get_mla_metadata_v1(seqlens_qo_indptr, seqlens_kv_indptr, kv_last_page_lens, num_heads_per_head_k,
                            num_heads_k, is_causal, work_metadata_ptrs, work_info_set, work_indptr, reduce_indptr,
                            reduce_final_map, reduce_partial_map, page_size=1, kv_granularity=16, max_seqlen_qo=-1,
                            uni_seqlen_qo=-1, fast_mode=True, topk=-1, max_split_per_batch=-1,
                            intra_batch_mode=False, is_cp_round_robin=False, mla_version=0, **dtypes_):
        batch = seqlens_qo_indptr.shape[0] - 1
        if work_info_set.shape[1] != 8 or work_info_set.shape[0] < batch:
            raise AiterAbort("work_info_set too small / wrong layout (did you swap work_indptr and work_info_set?)")
        work_info_set.zero_()
        for b in range(batch):  # one work item per request: [bs, partial, q0, q1, kv0, kv1, offset, heads]
            work_info_set[b] = torch.tensor([b, -1, int(seqlens_qo_indptr[b]), int(seqlens_qo_indptr[b + 1]),
                                             int(seqlens_kv_indptr[b]), int(seqlens_kv_indptr[b + 1]), 0,
                                             num_heads_per_head_k], dtype=torch.int32)
        work_indptr.zero_()
        work_indptr[1:] = batch

    def mla_decode_fwd(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q,
                       page_size=1, nhead_kv=1, sm_scale=None, logit_cap=0.0, num_kv_splits=None,
                       num_kv_splits_indptr=None, work_meta_data=None, work_indptr=None, work_info_set=None,
                       reduce_indptr=None, reduce_final_map=None, reduce_partial_map=None, q_scale=None,
                       kv_scale=None, intra_batch_mode=False, return_logits=False, return_lse=False,
                       g_kv_indptr=None, cp_world_size=1, cp_rank=0, causal=True):
        if logit_cap > 0:
            raise AssertionError(f"logit_cap={logit_cap} is not support yet")
        if not q.is_contiguous() or q.dim() != 3:
            raise AiterAbort("Q must be contiguous [total_q, H, D]")
        if kv_buffer.dim() != 4 or kv_buffer.shape[2] != 1 or nhead_kv != 1:
            raise AiterAbort("nhead_kv must be 1 and kv_buffer [pages, page_size, 1, D]")
        if kv_buffer.shape[1] != page_size or page_size & (page_size - 1):
            raise AiterAbort(f"page_size={page_size} does not match kv_buffer {list(kv_buffer.shape)} / not 2^k")
        total_q, heads, d = q.shape
        if kv_buffer.shape[3] != d or o.shape != (total_q, heads, 512) or o.dtype != torch.bfloat16:
            raise AiterAbort("head_size / o shape mismatch")
        persistent = work_meta_data is not None
        qt, kt = kind(q.dtype), kind(kv_buffer.dtype)
        if qt == "fp8" and (q_scale is None or kv_scale is None):
            raise AiterAbort("fp8 Q requires q_scale and kv_scale")
        lookup = 16 if persistent and heads in range(32, 129, 16) else heads
        table = _table(arch)
        if not any((qt, kt, lookup, persistent, ql) in table for ql in (max_seqlen_q, 0)):
            raise AiterAbort(f"AITER_CHECK: no MLA kernel for q={qt} kv={kt} gqa={lookup} ps={int(persistent)} "
                             f"qSeqLen={max_seqlen_q} on {arch}")
        if sm_scale is None:
            sm_scale = d ** -0.5
        qf = q.float() * (float(q_scale) if q_scale is not None else 1.0)
        kvf = kv_buffer.float().reshape(-1, d) * (float(kv_scale) if kv_scale is not None else 1.0)
        lse = torch.empty(total_q, heads, dtype=torch.float32)
        batch = qo_indptr.shape[0] - 1
        for b in range(batch):
            k0, k1 = int(kv_indptr[b]), int(kv_indptr[b + 1])
            if persistent:
                row = work_info_set[b]
                if int(row[0]) != b or (int(row[4]), int(row[5])) != (k0, k1) or int(row[7]) != heads:
                    raise AiterAbort("persistent metadata does not match this call (stale or wrong heads)")
            n = k1 - k0
            if n > 0 and int(kv_last_page_lens[b]) != 1:  # page size 1: every page is full
                raise AiterAbort(f"kv_last_page_lens[{b}]={int(kv_last_page_lens[b])} inconsistent with {n} pages")
            slots = kv_indices[k0:k1].long()
            keys = kvf[slots]
            q0, q1 = int(qo_indptr[b]), int(qo_indptr[b + 1])
            ob, lb = attend(qf[q0:q1], keys, 512, sm_scale, causal and (q1 - q0) > 1)
            o[q0:q1] = ob.to(o.dtype)
            lse[q0:q1] = lb
        return o, (lse if return_lse else None)

    if legacy:
        def mla_decode_fwd_legacy(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens,
                                  max_seqlen_q, sm_scale=None, logit_cap=0.0, num_kv_splits=None,
                                  num_kv_splits_indptr=None, work_meta_data=None, work_indptr=None,
                                  work_info_set=None, reduce_indptr=None, reduce_final_map=None,
                                  reduce_partial_map=None, q_scale=None, kv_scale=None, intra_batch_mode=False,
                                  return_logits=False, return_lse=False):
            return mla_decode_fwd(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens,
                                  max_seqlen_q, kv_buffer.shape[1], 1, sm_scale, logit_cap, num_kv_splits,
                                  num_kv_splits_indptr, work_meta_data, work_indptr, work_info_set, reduce_indptr,
                                  reduce_final_map, reduce_partial_map, q_scale, kv_scale, intra_batch_mode,
                                  return_logits, return_lse)
        return get_mla_metadata_info_v1, get_mla_metadata_v1, mla_decode_fwd_legacy, fp8
    return get_mla_metadata_info_v1, get_mla_metadata_v1, mla_decode_fwd, fp8


def install(monkeypatch, arch: str = "gfx942", legacy: bool = False, version: str = "0.1.9") -> types.ModuleType:
    """Put the fake into ``sys.modules`` as ``aiter`` (+ ``aiter.mla``) for one test."""
    info, meta, decode, fp8 = _make(arch, legacy)
    pkg = types.ModuleType("aiter")
    pkg.__version__ = version
    pkg.get_mla_metadata_info_v1 = info
    pkg.get_mla_metadata_v1 = meta
    pkg.dtypes = types.SimpleNamespace(fp8=fp8, bf16=torch.bfloat16)
    mla = types.ModuleType("aiter.mla")
    mla.mla_decode_fwd = decode
    pkg.mla = mla
    monkeypatch.setitem(sys.modules, "aiter", pkg)
    monkeypatch.setitem(sys.modules, "aiter.mla", mla)
    return pkg
