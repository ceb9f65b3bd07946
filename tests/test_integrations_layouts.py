"""The engine-independent half of the vLLM / SGLang integrations.

Tensors are laid out the way each engine hands them to an attention backend
(vLLM: ``forward_mqa``'s q tuple and ``[num_blocks, block_size, 576]`` cache;
SGLang: ``forward_decode``'s ``[T, H*512]`` q plus ``q_rope``, the token pool
``[slots + page, 1, 576]`` and ``req_to_token``), translated with
``mla_dispatch.integrations.layouts``, run through ``mla_dispatch``, and checked
against a float64 oracle that reads the engine layout directly. No engine is
needed and none is imitated: only plain tensors.
"""

from __future__ import annotations

import importlib
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mla_dispatch
from mla_dispatch.dispatch.backend import CGSupport, MLABackend
from mla_dispatch.integrations import layouts as L
from mla_dispatch.numerics.cases import make_case
from mla_dispatch.numerics.tolerance import compare_outputs

TOL = mla_dispatch.get_backend("reference").TOLERANCE


def _attend(q_rows, keys, scale, dv=512):
    """float64 attention of q_rows [n_q, D] over keys [n, D]: (out [n_q, dv], lse [n_q])."""
    if keys.shape[0] == 0:
        return torch.zeros(q_rows.shape[0], dv, dtype=torch.float64), torch.full((q_rows.shape[0],), math.inf,
                                                                                  dtype=torch.float64)
    s = (q_rows.double() @ keys.double().T) * scale
    return torch.softmax(s, -1) @ keys.double()[:, :dv], torch.logsumexp(s, -1)


# -- vLLM ------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size,s_q", [(16, 1), (64, 2), (1, 1)])
def test_vllm_forward_mqa_layout_roundtrip(block_size, s_q, gen):
    B, N, scale = 5, 16, 192**-0.5
    case = make_case(B, s_q, N, 90, page_size=block_size, causal=s_q > 1, zero_len_rows=1, generator=gen)
    # What vLLM hands forward_mqa: tokens grouped by request, q split into (ql_nope, q_pe)
    # as strided views of a wider buffer, and the 3-D cache.
    T = B * s_q
    wide = torch.randn(T, N, 700, generator=gen).to(torch.bfloat16)
    wide[:, :, :576] = case.q.reshape(T, N, 576)
    q_tuple = (wide[:, :, :512], wide[:, :, 512:576])
    cache = case.kv_cache.squeeze(2)  # [num_blocks, block_size, 576]
    assert cache.dim() == 3

    query = L.vllm_decode_query(q_tuple, num_decodes=B)
    kv = L.vllm_kv_cache(cache)
    out, lse = mla_dispatch.mla_decode(query, kv, case.block_table, case.cache_seqlens, softmax_scale=scale,
                                       causal=True, kv_format=L.vllm_kv_format("auto"))
    o, lse_t = L.vllm_decode_outputs(out, lse)
    assert o.shape == (T, N, 512) and lse_t.shape == (T, N)

    want_o = torch.zeros(T, N, 512, dtype=torch.float64)
    want_l = torch.zeros(T, N, dtype=torch.float64)
    for t in range(T):
        r, i = divmod(t, s_q)
        n = int(case.cache_seqlens[r])
        visible = n - s_q + i + 1
        ids = [int(case.block_table[r, j // block_size]) * block_size + j % block_size for j in range(max(visible, 0))]
        keys = cache.reshape(-1, 576)[torch.tensor(ids, dtype=torch.long)]
        want_o[t], l_row = _attend(wide[t, :, :576], keys, scale)
        want_l[t] = torch.where(torch.isposinf(l_row), torch.full_like(l_row, -math.inf), l_row)  # vLLM: empty = -inf
    report = compare_outputs(o, lse_t, want_o.float(), want_l.float(), TOL)
    assert report, report.message
    assert torch.isneginf(lse_t[-s_q:]).all()  # the zero-length request


def test_vllm_query_checks():
    q = torch.zeros(6, 4, 576)
    assert L.vllm_decode_query(q, 3).shape == (3, 2, 4, 576)
    with pytest.raises(ValueError, match="uniform"):
        L.vllm_decode_query(q, 4)
    with pytest.raises(ValueError, match="num_blocks, block_size"):
        L.vllm_kv_cache(torch.zeros(2, 3, 1, 576))


def test_vllm_kv_formats():
    assert [L.vllm_kv_format(s) for s in ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3")] == [
        "auto", "bf16", "fp16", "fp8_e4m3", "fp8_e4m3"]
    for bad in ("fp8_e5m2", "fp8_ds_mla", "int8"):
        with pytest.raises(ValueError, match=bad):
            L.vllm_kv_format(bad)


def test_vllm_fp8_cache_with_layer_scale(gen):
    """fp8 caches arrive as float8_e4m3fn views with the per-tensor scale layer._k_scale (a 0-d fp32 tensor)."""
    case = make_case(3, 1, 8, 70, page_size=16, kv_format="fp8_e4m3", generator=gen)
    k_scale = case.kv_scale.reshape(())
    query = L.vllm_decode_query(case.q.reshape(3, 8, 576), 3)
    cache = case.kv_cache.squeeze(2)  # [num_blocks, block_size, 576] float8_e4m3fn, as vLLM holds it
    out = torch.full((3, 1, 8, 512), float("nan"), dtype=torch.bfloat16)
    out, lse = mla_dispatch.mla_decode(query, L.vllm_kv_cache(cache), case.block_table, case.cache_seqlens,
                                       kv_format=L.vllm_kv_format("fp8"), kv_scale=k_scale, out=out)
    want_o = torch.zeros(3, 1, 8, 512, dtype=torch.float64)
    want_l = torch.zeros(3, 8, 1, dtype=torch.float64)
    for r in range(3):
        n = int(case.cache_seqlens[r])
        ids = torch.tensor([int(case.block_table[r, j // 16]) * 16 + j % 16 for j in range(n)], dtype=torch.long)
        keys = cache.reshape(-1, 576)[ids].double() * float(k_scale)  # e4m3 value times the layer's scale
        want_o[r, 0], want_l[r, :, 0] = _attend(case.q[r, 0], keys, case.softmax_scale)
    report = compare_outputs(out, lse, want_o.float(), want_l.float(), TOL)
    assert report, report.message


# -- capabilities from the registry -----------------------------------------------------------


def _backend(name, **consts):
    return type(f"T_{name}", (MLABackend,), {"NAME": name, "PLATFORMS": frozenset({"cuda"}), **consts})


def test_engine_capabilities_fold():
    a = _backend("a", PAGE_SIZES=frozenset({64}), CUDA_GRAPH=CGSupport.ALWAYS)
    b = _backend("b", PAGE_SIZES=frozenset({32, 64}), KV_FORMATS=frozenset({"bf16", "fp8_e4m3"}))
    anywhere = _backend("c", PAGE_SIZES=None)
    off_platform = _backend("d", PAGE_SIZES=None, PLATFORMS=frozenset({"npu"}))
    missing = _backend("e", PAGE_SIZES=None, REQUIRES=("mla_dispatch_no_such_module",))
    planned = _backend("f", PAGE_SIZES=None, IMPLEMENTED=False)

    caps = L.engine_capabilities([a, b, off_platform, missing, planned], "cuda")
    assert caps.page_sizes == (32, 64) and caps.cuda_graph and caps.backends == ("a", "b")
    assert caps.kv_formats == ("bf16", "fp16", "fp8_e4m3") and caps.q_dtypes == (torch.bfloat16, torch.float16)
    assert L.vllm_kv_cache_dtypes(caps) == ["auto", "bfloat16", "float16", "fp8", "fp8_e4m3"]
    assert L.engine_capabilities([a, anywhere], "cuda").page_sizes is None
    assert not L.engine_capabilities([b], "cuda").cuda_graph
    assert L.engine_capabilities([off_platform], "cuda").backends == ()


def test_engine_capabilities_no_graphs_off_gpu():
    """A capturable backend on a CPU (or NPU) process declares no graph support: nothing is captured there."""
    anywhere = {"PLATFORMS": frozenset({"cpu", "cuda", "rocm", "npu"}), "CUDA_GRAPH": CGSupport.ALWAYS}
    a = _backend("a", **anywhere)
    assert L.engine_capabilities([a], "cuda").cuda_graph and L.engine_capabilities([a], "rocm").cuda_graph
    for kind in ("cpu", "npu"):
        caps = L.engine_capabilities([a], kind)
        assert caps.backends == ("a",) and not caps.cuda_graph
    here = mla_dispatch.detect_platform("cpu")
    assert not L.engine_capabilities(L.auto_candidates(here), here.kind).cuda_graph


def test_auto_candidates_follow_priority():
    h100 = mla_dispatch.Platform("cuda", "H100", (9, 0), "sm_90", 132)
    names = [c.NAME for c in L.auto_candidates(h100)]
    assert names[0] == "cuda_sm90" and names[-1] == "reference" and "amla_emulation" not in names
    cpu = [c.NAME for c in L.auto_candidates(mla_dispatch.detect_platform("cpu"))]
    assert cpu[-1] == "reference" and "triton" not in cpu


# -- SGLang ------------------------------------------------------------------------------------


def _sglang_pool(gen, lens, page_size, max_ctx=256):
    """A token pool as SGLang lays it out: buffer [num_pages*page + page, 1, 576] (NaN where unused),
    req_to_token [max_reqs, max_ctx] (garbage past each request's length), req_pool_indices."""
    num_pages = sum(-(-n // page_size) for n in lens) + 8  # some pages stay unused (NaN)
    slots = num_pages * page_size
    buf = torch.full((slots + page_size, 1, 576), float("nan"), dtype=torch.bfloat16)
    max_reqs = len(lens) + 3
    req_to_token = torch.randint(0, 1 << 30, (max_reqs, max_ctx), generator=gen, dtype=torch.int32)
    req_pool_indices = torch.randperm(max_reqs, generator=gen)[: len(lens)].to(torch.int32)
    pages = torch.randperm(num_pages, generator=gen).tolist()
    for r, n in zip(req_pool_indices.tolist(), lens):
        own = [pages.pop() for _ in range(-(-n // page_size))]
        tok = torch.tensor([own[j // page_size] * page_size + j % page_size for j in range(n)], dtype=torch.int32)
        req_to_token[r, :n] = tok
        buf[tok.long(), 0] = (torch.randn(n, 576, generator=gen) / 10).to(torch.bfloat16)
    return buf, req_to_token, req_pool_indices


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_sglang_forward_decode_layout(page_size, gen):
    lens = [37, 0, 200, 1, 129]
    B, H, scale = len(lens), 16, 0.1
    buf, req_to_token, rpi = _sglang_pool(gen, lens, page_size)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q_full = (torch.randn(B, H, 576, generator=gen) / 10).to(torch.bfloat16)
    q = q_full[..., :512].reshape(B, H * 512)  # forward_decode's q (absorbed nope part), flattened heads
    q_rope = q_full[..., 512:].reshape(B, H * 64)

    max_blocks = L.max_blocks_for(req_to_token.shape[1], page_size)
    table = L.sglang_block_table(req_to_token, rpi, seq_lens, page_size, max_blocks)
    assert table.dtype == torch.int32 and table.shape == (B, max_blocks)
    query = L.sglang_decode_query(q, q_rope, B, H, 576)
    kv = L.sglang_kv_cache(buf, page_size)
    out, _ = mla_dispatch.mla_decode(query, kv, table, seq_lens, softmax_scale=scale, causal=True,
                                     kv_format=L.sglang_kv_format(kv.dtype, query.dtype), return_lse=False)
    o = L.sglang_decode_output(out)
    assert o.shape == (B, H * 512)

    want = torch.zeros(B, H, 512, dtype=torch.float64)
    want_lse = torch.zeros(B, H, dtype=torch.float64)
    for b, (r, n) in enumerate(zip(rpi.tolist(), lens)):
        keys = buf[req_to_token[r, :n].long(), 0]
        want[b], want_lse[b] = _attend(q_full[b], keys, scale)
    report = compare_outputs(o.view(B, 1, H, 512), None, want.view(B, 1, H, 512).float(), want_lse, TOL)
    assert report, report.message
    assert (o[1] == 0).all()


def test_sglang_block_table_reads_only_live_entries(gen):
    buf, req_to_token, rpi = _sglang_pool(gen, [64, 65, 0], page_size=64)
    seq_lens = torch.tensor([64, 65, 0], dtype=torch.int32)
    table = L.sglang_block_table(req_to_token, rpi, seq_lens, 64, max_blocks=5)
    rows = req_to_token[rpi.long()]
    assert table[0].tolist() == [rows[0, 0].item() // 64, 0, 0, 0, 0]
    assert table[1, :2].tolist() == [rows[1, 0].item() // 64, rows[1, 64].item() // 64] and table[1, 2:].eq(0).all()
    assert table[2].eq(0).all()
    with pytest.raises(ValueError):
        L.sglang_block_table(req_to_token, rpi, seq_lens, 0, 5)


def test_sglang_pool_view_and_formats():
    buf = torch.zeros(130, 1, 576)
    assert L.sglang_kv_cache(buf, 64).shape == (2, 64, 1, 576)
    assert L.sglang_kv_cache(buf, 64).data_ptr() == buf.data_ptr()  # a view
    assert L.sglang_kv_cache(torch.zeros(10, 576), 1).shape == (10, 1, 1, 576)
    with pytest.raises(ValueError):
        L.sglang_kv_cache(torch.zeros(10, 2, 576), 1)
    assert L.sglang_kv_format(torch.bfloat16, torch.bfloat16) == "bf16"
    assert L.sglang_kv_format(torch.float8_e4m3fn, torch.bfloat16) == "fp8_e4m3"
    with pytest.raises(ValueError, match="float8_e5m2"):
        L.sglang_kv_format(torch.float8_e5m2, torch.bfloat16)
    with pytest.raises(ValueError, match="split evenly"):
        L.sglang_decode_query(torch.zeros(5, 2 * 576), None, 2, 2, 576)


# -- entry points --------------------------------------------------------------------------------


def test_entry_points_are_declared_and_resolve():
    tomllib = pytest.importorskip("tomllib", reason="Python < 3.11 has no tomllib")
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    eps = pyproject["project"]["entry-points"]
    for group, name in (("vllm.general_plugins", "register_vllm"), ("sglang.srt.plugins", "register_sglang")):
        target = eps[group]["mla_dispatch"]
        module, _, attr = target.partition(":")
        assert attr == name and callable(getattr(importlib.import_module(module), attr))


def test_loading_the_plugin_module_imports_no_engine():
    code = ("import sys, mla_dispatch.integrations.plugins, mla_dispatch.integrations.layouts; "
            "print([m for m in ('vllm', 'sglang') if m in sys.modules])")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "[]"


def test_plan_cache_keeps_recent_shapes_and_makes_each_once():
    """The engines' sparse plan cache: a shape's plan is made once while it stays among the recent ones; older
    shapes are evicted (a shape seen again is planned again); nothing is pinned outside a CUDA-graph capture."""
    from mla_dispatch.integrations.plan_cache import PlanCache

    made = []

    def maker(key):
        def make():
            made.append(key)
            return object()
        return make

    cache = PlanCache(max_recent=2)
    cpu = torch.device("cpu")
    a = cache.get("a", maker("a"), cpu)
    assert cache.get("a", maker("a"), cpu) is a and made == ["a"]
    cache.get("b", maker("b"), cpu)
    cache.get("a", maker("a"), cpu)  # a is the most recent again
    cache.get("c", maker("c"), cpu)  # evicts b
    assert len(cache) == 2 and made == ["a", "b", "c"]
    cache.get("b", maker("b"), cpu)
    assert made == ["a", "b", "c", "b"]
