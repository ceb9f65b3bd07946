"""A fake ``flashinfer`` implementing the documented MLA signatures on CPU.

Mirrors flashinfer-python 0.6.0 ``flashinfer/mla.py`` (the wheel in .whl; same
signatures in flashinfer-ai/flashinfer v0.6.18 ``flashinfer/mla/_core.py``, commit
fb28d72):

- ``mla.BatchMLAPagedAttentionWrapper(float_workspace_buffer, use_cuda_graph, qo_indptr,
  kv_indptr, kv_indices, kv_len_arr, backend)`` with ``plan(...)`` (copies the indptrs
  to the host, as the real one does) and ``run(q_nope, q_pe, ckv_cache, kpe_cache, out,
  lse, return_lse, ..., return_lse_base_on_e)``. Attention is computed from the
  planned page ids; the LSE is **base 2** unless ``return_lse_base_on_e``.
- ``decode.trtllm_batch_decode_with_kv_cache_mla(query, kv_cache, workspace_buffer,
  qk_nope_head_dim, kv_lora_rank, qk_rope_head_dim, block_tables, seq_lens, max_seq_len,
  ...)``: 0.6.0's checks (4-D ``[pages, 1, ps, 576]`` cache, block size 32/64,
  qk_nope 128 / lora 512 / rope 64, ``block_num % (128/ps) == 0``), vLLM's head-count
  rule (``_trtllm_gen_mla_decode_supports_num_heads``) as a kernel-missing error, bf16
  only, zero workspace required, causal MTP mask, bf16 output ``query.shape[:-1]+(512,)``.
"""

from __future__ import annotations

import math
import types

import torch

from ._attend import attend

VERSION = "0.6.0"


class BatchMLAPagedAttentionWrapper:
    def __init__(self, float_workspace_buffer, use_cuda_graph=False, qo_indptr=None, kv_indptr=None,
                 kv_indices=None, kv_len_arr=None, backend="auto"):
        if not isinstance(float_workspace_buffer, torch.Tensor):
            raise TypeError("float_workspace_buffer must be a tensor")
        self._use_cuda_graph = use_cuda_graph
        if use_cuda_graph and any(b is None for b in (qo_indptr, kv_indptr, kv_indices, kv_len_arr)):
            raise ValueError("use_cuda_graph=True needs qo_indptr, kv_indptr, kv_indices, kv_len_arr buffers")
        self._bufs = (qo_indptr, kv_indptr, kv_indices, kv_len_arr)
        self._backend = backend
        self.plans = 0

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe,
             page_size, causal, sm_scale, q_data_type, kv_data_type, use_profiler=False):
        for name, t in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr), ("kv_indices", kv_indices),
                        ("kv_len_arr", kv_len_arr)):
            if t.dtype != torch.int32:
                raise ValueError(f"{name} must be int32, got {t.dtype}")
        if qo_indptr.shape[0] != kv_indptr.shape[0] or kv_len_arr.shape[0] != qo_indptr.shape[0] - 1:
            raise ValueError("qo_indptr/kv_indptr must be [B+1], kv_len_arr [B]")
        if self._use_cuda_graph:
            qb, kb, ib, lb = self._bufs
            qb.copy_(qo_indptr)
            kb.copy_(kv_indptr)
            ib[: len(kv_indices)].copy_(kv_indices)
            lb.copy_(kv_len_arr)
            kv_indices = ib
        self._qo = qo_indptr.to("cpu").long()  # the real plan syncs here
        self._kv = kv_indptr.to("cpu").long()
        self._len = kv_len_arr.to("cpu").long()
        self._indices = kv_indices
        pages_needed = (self._len + page_size - 1) // page_size
        if not torch.equal(self._kv[1:] - self._kv[:-1], pages_needed):
            raise ValueError("kv_indptr does not match ceil(kv_len / page_size) pages per request")
        self._cfg = dict(num_heads=num_heads, ckv=head_dim_ckv, kpe=head_dim_kpe, page_size=page_size,
                         causal=causal, sm_scale=sm_scale, q_dtype=q_data_type, kv_dtype=kv_data_type)
        self.plans += 1

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse=False, profiler_buffer=None,
            kv_len=None, page_table=None, return_lse_base_on_e=False):
        c = self._cfg
        n, h, d_ckv = q_nope.shape
        if h != c["num_heads"] or d_ckv != c["ckv"] or q_pe.shape != (n, h, c["kpe"]):
            raise ValueError(f"q_nope {list(q_nope.shape)} / q_pe {list(q_pe.shape)} do not match the plan {c}")
        if q_nope.dtype != c["q_dtype"] or ckv_cache.dtype != c["kv_dtype"]:
            raise ValueError("dtype differs from plan")
        if ckv_cache.dim() != 3 or ckv_cache.shape[1] != c["page_size"] or ckv_cache.shape[2] != c["ckv"]:
            raise ValueError(f"ckv_cache must be [pages, {c['page_size']}, {c['ckv']}], got {list(ckv_cache.shape)}")
        if kpe_cache.shape != ckv_cache.shape[:2] + (c["kpe"],):
            raise ValueError(f"kpe_cache shape {list(kpe_cache.shape)}")
        if n != int(self._qo[-1]):
            raise ValueError(f"q has {n} rows, plan has {int(self._qo[-1])}")
        if out is None:
            out = torch.empty_like(q_nope)
        elif out.shape != q_nope.shape or out.dtype != q_nope.dtype:
            raise ValueError(f"out must be {list(q_nope.shape)} {q_nope.dtype}")
        if return_lse:
            if lse is None:
                lse = torch.empty(n, h, dtype=torch.float32)
            elif lse.shape != (n, h) or lse.dtype != torch.float32:
                raise ValueError(f"lse must be [{n}, {h}] float32, got {list(lse.shape)} {lse.dtype}")
        ps = c["page_size"]
        q = torch.cat([q_nope, q_pe], dim=-1).float()
        for b in range(len(self._len)):
            pages = self._indices[self._kv[b]: self._kv[b + 1]].long()
            length = int(self._len[b])
            tok = torch.arange(length)
            keys = torch.cat([ckv_cache[pages[tok // ps], tok % ps], kpe_cache[pages[tok // ps], tok % ps]], -1).float()
            q0, q1 = int(self._qo[b]), int(self._qo[b + 1])
            o, l = attend(q[q0:q1], keys, c["ckv"], c["sm_scale"], c["causal"])
            out[q0:q1] = o.to(out.dtype)
            if return_lse:
                lse[q0:q1] = l if return_lse_base_on_e else l / math.log(2.0)
        return (out, lse) if return_lse else out


def _trtllm_head_ok(h: int) -> bool:
    if 64 < h < 128:
        return False
    tile = 8 if h <= 8 else (16 if h <= 32 else 64)
    return h % min(h, tile) == 0


def trtllm_batch_decode_with_kv_cache_mla(query, kv_cache, workspace_buffer, qk_nope_head_dim, kv_lora_rank,
                                          qk_rope_head_dim, block_tables, seq_lens, max_seq_len,
                                          sparse_mla_top_k=0, out=None, bmm1_scale=1.0, bmm2_scale=1.0, sinks=None,
                                          enable_pdl=None, backend="auto"):
    if query.ndim != 4 or kv_cache.ndim != 4:
        raise ValueError(f"Expected query.ndim == 4 and kv_cache.ndim == 4, got {query.ndim}, {kv_cache.ndim}")
    block_size = kv_cache.size(-2)
    if block_size not in (32, 64):
        raise ValueError(f"Supported block_size are 32 and 64, got {block_size}")
    if (qk_nope_head_dim, kv_lora_rank, qk_rope_head_dim) != (128, 512, 64):
        raise ValueError("Expected qk_nope_head_dim 128, kv_lora_rank 512, qk_rope_head_dim 64")
    b, s_q, h, d = query.shape
    if d != 576 or kv_cache.shape[3] != 576 or kv_cache.shape[1] != 1:
        raise ValueError(f"Expected kv_cache [pages, 1, ps, 576] and query [..., 576], got {list(kv_cache.shape)}")
    if block_tables.shape[0] != b or block_tables.shape[1] % (128 // block_size) != 0:
        raise ValueError(f"Expected block_num % (128 / block_size) == 0, got {block_tables.shape[1]=} {block_size=}")
    if not _trtllm_head_ok(h):
        raise RuntimeError(f"trtllm-gen: no kernel for num_heads={h}")
    if query.dtype != torch.bfloat16 or kv_cache.dtype != torch.bfloat16:
        raise ValueError("this fake supports the bf16 path only")
    if bool(workspace_buffer.any()):
        raise RuntimeError("workspace_buffer must be zero-initialised (semaphores)")
    if int(seq_lens.max()) > max_seq_len:
        raise ValueError("max_seq_len smaller than a sequence length")
    if not isinstance(bmm1_scale, float):
        raise TypeError("bmm1_scale must be a float for this fake")
    cache = kv_cache[:, 0]
    result = torch.empty(b, s_q, h, kv_lora_rank, dtype=torch.bfloat16)
    for i in range(b):
        length = int(seq_lens[i])
        tok = torch.arange(length)
        keys = cache[block_tables[i].long()[tok // block_size], tok % block_size].float()
        o, _ = attend(query[i].float(), keys, kv_lora_rank, bmm1_scale, True)
        result[i] = (o * bmm2_scale).to(torch.bfloat16)
    return result


def install(monkeypatch, version: str = VERSION) -> types.ModuleType:
    """Put the fake into ``sys.modules`` as ``flashinfer`` (+ ``.mla``, ``.decode``) for one test."""
    pkg = types.ModuleType("flashinfer")
    pkg.__version__ = version
    mla = types.ModuleType("flashinfer.mla")
    mla.BatchMLAPagedAttentionWrapper = BatchMLAPagedAttentionWrapper
    mla.trtllm_batch_decode_with_kv_cache_mla = trtllm_batch_decode_with_kv_cache_mla
    decode = types.ModuleType("flashinfer.decode")
    decode.trtllm_batch_decode_with_kv_cache_mla = trtllm_batch_decode_with_kv_cache_mla
    pkg.mla, pkg.decode = mla, decode
    pkg.BatchMLAPagedAttentionWrapper = BatchMLAPagedAttentionWrapper
    for name, mod in (("flashinfer", pkg), ("flashinfer.mla", mla), ("flashinfer.decode", decode)):
        monkeypatch.setitem(__import__("sys").modules, name, mod)
    return pkg
