"""The torch_npu adapter against a fake torch_npu that implements the documented signatures.

The fake mirrors the vendor documentation (op-plugin
``docs/context/torch_npu-npu_fused_infer_attention_score_v2.md`` and
``torch_npu-npu_fused_infer_attention_score.md``; the legacy
``_npu_paged_attention_mla`` as called by vllm-ascend <= Jul-2025, see
shared/reference/peer_apis.md §4): argument names, MLA-mode constraints (split
NoPE/RoPE caches, contiguous inputs, page size 16/128, N in {32, 64, 128}, KV
N = 1, Q_S = 1 with sparse_mode 0 and no mask, host lists of KV lengths, no
LSE in MLA mode) are checked, and the math is our fp32 reference. The NPU
platform is simulated on the CPU by replacing ``detect_platform``.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest
import torch

import mla_dispatch
import mla_dispatch.dispatch.platform as platform_mod
from mla_dispatch.numerics.oracle import reference_attention
from mla_dispatch.backends.torch_npu import TorchNpuBackend, padded_heads
from mla_dispatch.dispatch.platform import Platform
from mla_dispatch.dispatch.select import explain, select_backend
from mla_dispatch.numerics.cases import make_case
from mla_dispatch.numerics.tolerance import compare_outputs

NPU = Platform("npu", "Ascend910B3", None, "Ascend910B", 20)


class VendorContractError(RuntimeError):
    """The adapter called the fake in a way the vendor doc does not allow."""


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise VendorContractError(msg)


def _mla_reference(q_nope, q_rope, k_nope, k_rope, block_table, lens, scale, block_size):
    """[B, 1, N, 512] output of the documented MLA computation, via our reference."""
    q = torch.cat([q_nope, q_rope], dim=-1)  # [B, 1, N, 576]
    kv = torch.cat([k_nope, k_rope], dim=-1).reshape(-1, block_size, 1, q.shape[-1])
    seqlens = torch.tensor(lens, dtype=torch.int32)
    out, _ = reference_attention(q, kv, block_table, seqlens, head_dim_v=k_nope.shape[-1], softmax_scale=scale)
    return out.to(q_nope.dtype)


def _check_fia_mla(query, key, value, query_rope, key_rope, n_q, n_kv, layout, sparse_mode, atten_mask,
                   block_table, block_size, kv_lens, lse_flag):
    _require(query_rope is not None and key_rope is not None, "MLA needs query_rope and key_rope together")
    for name, t in (("query", query), ("key", key), ("value", value), ("query_rope", query_rope),
                    ("key_rope", key_rope)):
        _require(t.is_contiguous(), f"{name} must be contiguous")
    _require(key is value or torch.equal(key, value), "MLA: key and value are the same NoPE cache")
    _require(layout == "BSND", f"fake implements input_layout BSND only, got {layout}")
    _require(query.dim() == 4 and query.shape[1] == 1, "Q_S must be 1 here")
    _require(query.shape[-1] == 512 and query_rope.shape[-1] == 64, "query d 512, rope d 64")
    _require(query.shape[2] == n_q and n_q in (32, 64, 128), f"N must be 32/64/128 and match, got {n_q}")
    _require(n_kv == 1, "key N must be 1")
    _require(key.dim() == 3 and key.shape[-1] == 512 and key_rope.shape[-1] == 64, "PA key [blocks, bs, H=512]")
    _require(block_table is not None and block_table.dtype == torch.int32, "PageAttention with int32 block_table")
    _require(block_size in (16, 128) and key.shape[1] == block_size, f"block_size 16 or 128, got {block_size}")
    _require(sparse_mode == 0 and atten_mask is None, "Q_S=1 MLA: sparse_mode 0 and no mask")
    _require(isinstance(kv_lens, list) and all(type(x) is int for x in kv_lens), "actual seq kv lens: host ints")
    _require(len(kv_lens) >= query.shape[0], "one kv length per batch")
    _require(not lse_flag, "MLA mode does not support SoftMaxLse")
    _require(query.dtype in (torch.float16, torch.bfloat16) and key.dtype == query.dtype, "fp16/bf16")


def make_fake_torch_npu(ops=("v2", "v1", "legacy")) -> types.ModuleType:
    mod = types.ModuleType("torch_npu")
    mod.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    mod.__version__ = "2.13.0.fake"
    mod.calls = []

    def npu_fused_infer_attention_score_v2(query, key, value, *, query_rope=None, key_rope=None, pse_shift=None,
                                           atten_mask=None, actual_seq_qlen=None, actual_seq_kvlen=None,
                                           block_table=None, num_query_heads=1, num_key_value_heads=0,
                                           softmax_scale=1.0, pre_tokens=2147483647, next_tokens=2147483647,
                                           input_layout="BSH", sparse_mode=0, block_size=0, inner_precise=0,
                                           return_softmax_lse=False, **quant_args):
        _require(not quant_args, f"unexpected arguments {sorted(quant_args)}")
        _check_fia_mla(query, key, value, query_rope, key_rope, num_query_heads, num_key_value_heads, input_layout,
                       sparse_mode, atten_mask, block_table, block_size, actual_seq_kvlen, return_softmax_lse)
        mod.calls.append("v2")
        out = _mla_reference(query, query_rope, key, key_rope, block_table, actual_seq_kvlen[: query.shape[0]],
                             softmax_scale, block_size)
        return out, torch.zeros(1)

    def npu_fused_infer_attention_score(query, key, value, *, pse_shift=None, atten_mask=None,
                                        actual_seq_lengths=None, actual_seq_lengths_kv=None, block_table=None,
                                        query_rope=None, key_rope=None, num_heads=1, scale=1.0,
                                        pre_tokens=2147483647, next_tokens=2147483647, input_layout="BSH",
                                        num_key_value_heads=0, sparse_mode=0, inner_precise=0, block_size=0,
                                        antiquant_mode=0, softmax_lse_flag=False, **quant_args):
        _require(not quant_args, f"unexpected arguments {sorted(quant_args)}")
        _check_fia_mla(query, key, value, query_rope, key_rope, num_heads, num_key_value_heads, input_layout,
                       sparse_mode, atten_mask, block_table, block_size, actual_seq_lengths_kv, softmax_lse_flag)
        mod.calls.append("v1")
        out = _mla_reference(query, query_rope, key, key_rope, block_table, actual_seq_lengths_kv[: query.shape[0]],
                             scale, block_size)
        return out, torch.zeros(1)

    def _npu_paged_attention_mla(*, query, key_cache, num_kv_heads, num_heads, scale_value, block_table,
                                 context_lens, mla_vheadsize, out):
        _require(query.dim() == 3 and query.shape[1] == num_heads and query.shape[2] == 576, "query [T, N, 576]")
        _require(num_heads in (8, 16, 32, 64, 128) and num_kv_heads == 1, "ATB MLA heads {8..128}, kv heads 1")
        _require(key_cache.dim() == 4 and key_cache.shape[2] == 1 and key_cache.shape[1] <= 128, "key_cache 4-D")
        _require(context_lens.device.type == "cpu" and context_lens.dtype == torch.int32, "context_lens: CPU int32")
        _require(mla_vheadsize == 512 and out.shape == (query.shape[0], num_heads, 512), "out [T, N, 512]")
        mod.calls.append("legacy")
        o, _ = reference_attention(query[:, None], key_cache, block_table, context_lens, head_dim_v=mla_vheadsize,
                                   softmax_scale=scale_value)
        out.copy_(o[:, 0])

    table = {"v2": npu_fused_infer_attention_score_v2, "v1": npu_fused_infer_attention_score,
             "legacy": _npu_paged_attention_mla}
    for key in ops:
        fn = table[key]
        setattr(mod, fn.__name__, fn)
    return mod


def _install(monkeypatch, fake):
    monkeypatch.setitem(sys.modules, "torch_npu", fake)


@pytest.mark.parametrize("ops", [("v2", "v1", "legacy"), ("v1", "legacy"), ("legacy",)], ids=["v2", "v1", "legacy"])
@pytest.mark.parametrize(
    "batch,q_len,heads,seqlen,page_size,causal",
    [(3, 1, 16, 300, 64, False), (2, 3, 32, 200, 128, True), (2, 2, 128, 150, 256, False), (3, 1, 64, 90, 16, False)],
    ids=["b3xs1xh16-ps64", "b2xs3xh32-ps128-causal", "b2xs2xh128-ps256", "b3xs1xh64-ps16"],
)
def test_end_to_end_simulated_npu(npu, monkeypatch, gen, ops, batch, q_len, heads, seqlen, page_size, causal):
    fake = make_fake_torch_npu(ops)
    _install(monkeypatch, fake)
    case = make_case(batch, q_len, heads, seqlen, page_size=page_size, causal=causal, generator=gen, zero_len_rows=1)
    out, lse = mla_dispatch.mla_decode(*case.args(), head_dim_v=512, softmax_scale=case.softmax_scale,
                                       causal=causal, return_lse=False)
    assert lse is None
    assert fake.calls == [ops[0]]
    ref_out, ref_lse = reference_attention(*case.args(), softmax_scale=case.softmax_scale, causal=causal)
    report = compare_outputs(out, None, ref_out, ref_lse, TorchNpuBackend.TOLERANCE)
    assert report, report.message
    assert torch.count_nonzero(out[-1]) == 0  # the zero-length request


def test_plan_reused_across_layers_and_updated(npu, monkeypatch, gen):
    _install(monkeypatch, make_fake_torch_npu())
    case = make_case(2, 1, 32, 400, page_size=128, varlen=False, generator=gen)
    plan = mla_dispatch.plan_decode(*case.args(), softmax_scale=case.softmax_scale, return_lse=False)
    assert plan.backend == "torch_npu"
    for _ in range(2):  # two "layers"
        q = torch.randn(case.q.shape, generator=gen).div(10).to(case.q.dtype)
        out, _ = plan.run(q, case.kv_cache)
        ref, ref_lse = reference_attention(q, case.kv_cache, case.block_table, case.cache_seqlens,
                                           softmax_scale=case.softmax_scale)
        assert compare_outputs(out, None, ref, ref_lse, TorchNpuBackend.TOLERANCE)
    case.cache_seqlens -= 7  # next step's lengths (same shapes)
    plan.update(cache_seqlens=case.cache_seqlens)
    out, _ = plan.run(case.q, case.kv_cache)
    ref, ref_lse = reference_attention(*case.args(), softmax_scale=case.softmax_scale)
    assert compare_outputs(out, None, ref, ref_lse, TorchNpuBackend.TOLERANCE)


def test_lse_request_falls_back_with_reason(npu, monkeypatch, gen):
    _install(monkeypatch, make_fake_torch_npu())
    case = make_case(1, 1, 32, 64, page_size=128, generator=gen)
    problem = mla_dispatch.plan_decode(*case.args(), return_lse=False).problem
    with_lse = type(problem)(**{**problem.__dict__, "return_lse": True})
    report = explain(with_lse, NPU)
    reasons = dict((name, [str(r) for r in rs]) for name, _, rs in report.candidates)
    assert any("return_lse" in r for r in reasons["torch_npu"])
    assert report.chosen == "reference"  # ascend_amla is not built here
    assert select_backend(problem, NPU).NAME == "torch_npu"


def test_unsupported_shapes_have_reasons(npu, monkeypatch):
    _install(monkeypatch, make_fake_torch_npu())
    q = torch.zeros(1, 1, 256, 576, dtype=torch.bfloat16)
    kv = torch.zeros(4, 24, 1, 576, dtype=torch.bfloat16)
    problem = mla_dispatch.plan_decode(q, kv, torch.zeros(1, 1, dtype=torch.int32),
                                       torch.ones(1, dtype=torch.int32), return_lse=False,
                                       backend="reference").problem
    text = " ".join(str(r) for r in TorchNpuBackend.not_supported_reasons(problem, NPU))
    assert "h_q=256" in text and "page_size=24" in text


def test_head_padding():
    assert [padded_heads(h) for h in (1, 16, 32, 33, 64, 100, 128)] == [32, 32, 32, 64, 64, 128, 128]


def test_absent_torch_npu_is_a_reason(npu, monkeypatch):
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "torch_npu" else _spec(name))
    reasons = [str(r) for r in TorchNpuBackend.not_supported_reasons(_tiny_problem(), NPU)]
    assert any("torch_npu is not installed" in r for r in reasons)


_real_find_spec = importlib.util.find_spec


def _spec(name):
    return _real_find_spec(name)


def _tiny_problem():
    q = torch.zeros(1, 1, 32, 576, dtype=torch.bfloat16)
    kv = torch.zeros(1, 128, 1, 576, dtype=torch.bfloat16)
    return mla_dispatch.plan_decode(q, kv, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                                    return_lse=False, backend="reference").problem


def test_broken_torch_npu_import_is_a_reason_not_a_crash(npu, monkeypatch, tmp_path):
    """Without CANN, ``import torch_npu`` raises (libhccl.so); that must become a reason."""
    pkg = tmp_path / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "raise ImportError('libhccl.so: cannot open shared object file: No such file or directory')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    reasons = [str(r) for r in TorchNpuBackend.not_supported_reasons(_tiny_problem(), NPU)]
    assert any("libhccl.so" in r for r in reasons), reasons
    assert "torch_npu" not in sys.modules
    # the platform probe turns the same failure into a note, not an exception
    assert platform_mod._npu_probe()[1] and "libhccl.so" in platform_mod._npu_probe()[1]


def test_vendor_contract_is_enforced_by_the_fake(gen):
    """The fake rejects calls the doc forbids (so the end-to-end tests can fail)."""
    fake = make_fake_torch_npu()
    q = torch.zeros(1, 1, 16, 512, dtype=torch.bfloat16)  # 16 heads: not allowed unpadded
    k = torch.zeros(2, 128, 512, dtype=torch.bfloat16)
    with pytest.raises(VendorContractError, match="N must be"):
        fake.npu_fused_infer_attention_score_v2(q, k, k, query_rope=torch.zeros(1, 1, 16, 64, dtype=torch.bfloat16),
                                                key_rope=torch.zeros(2, 128, 64, dtype=torch.bfloat16),
                                                num_query_heads=16, num_key_value_heads=1, input_layout="BSND",
                                                block_table=torch.zeros(1, 1, dtype=torch.int32), block_size=128,
                                                actual_seq_kvlen=[1])
