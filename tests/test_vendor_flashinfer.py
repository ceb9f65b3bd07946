"""Contract tests of the FlashInfer adapter against a fake ``flashinfer`` (CPU), and the real
one on a GPU (``gpu`` marker).

The fake (tests/fakes/fake_flashinfer.py) computes from the wrapper's planned page ids and
returns a base-2 LSE, like FlashInfer: a wrong kv_indptr/kv_indices, a forgotten LSE
conversion or transpose, a missing head padding or block-table padding on SM100 fails here.
"""

import gc
import pytest
import torch

import mla_dispatch
from fakes import B200, H100, fake_flashinfer, forget, simulate
from mla_dispatch.dispatch.backend import ReasonCode
from mla_dispatch.backends.flashinfer import FlashInferBackend, trtllm_heads
from mla_dispatch.dispatch.select import NoBackendError
from mla_dispatch.numerics.cases import case_reference, make_case
from mla_dispatch.numerics.tolerance import compare_outputs


@pytest.fixture
def fake(monkeypatch):
    pkg = fake_flashinfer.install(monkeypatch)
    yield pkg
    forget(FlashInferBackend)


def _check(case, **kw):
    out, lse = mla_dispatch.mla_decode(*case.args(), backend="flashinfer", **case.kwargs(), **kw)
    report = compare_outputs(out, lse, *case_reference(case), FlashInferBackend.TOLERANCE)
    assert report, report.message
    return out, lse


@pytest.mark.parametrize("page_size,q_len,h_q,causal", [(1, 1, 16, False), (16, 2, 16, True), (64, 1, 128, False),
                                                        (32, 3, 8, False)])
def test_sm90_wrapper_matches_reference(monkeypatch, fake, gen, page_size, q_len, h_q, causal):
    simulate(monkeypatch, H100, FlashInferBackend)
    case = make_case(3, q_len, h_q, 70, page_size=page_size, causal=causal, zero_len_rows=1, generator=gen,
                     softmax_scale=192**-0.5)
    _check(case)


def test_sm90_lse_is_natural_log_with_old_run_signature(monkeypatch, fake, gen):
    """A flashinfer whose run() lacks return_lse_base_on_e: the adapter multiplies by ln 2."""
    orig = fake_flashinfer.BatchMLAPagedAttentionWrapper.run

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse=False, profiler_buffer=None,
            kv_len=None, page_table=None):
        return orig(self, q_nope, q_pe, ckv_cache, kpe_cache, out, lse, return_lse, profiler_buffer, kv_len, page_table)

    monkeypatch.setattr(fake.mla.BatchMLAPagedAttentionWrapper, "run", run)
    simulate(monkeypatch, H100, FlashInferBackend)
    case = make_case(2, 1, 16, 50, page_size=16, generator=gen)
    _check(case)


def test_sm90_plan_once_run_per_layer_and_update(monkeypatch, fake, gen):
    simulate(monkeypatch, H100, FlashInferBackend)
    case = make_case(2, 1, 16, 40, page_size=16, varlen=False, generator=gen)
    plan = mla_dispatch.plan_decode(*case.args(), backend="flashinfer", **case.kwargs())
    planned = plan.state.wrapper.plans
    for _ in range(2):  # two "layers", one plan
        plan.run(case.q, case.kv_cache)
    assert plan.state.wrapper.plans == planned
    shorter = (case.cache_seqlens - 7).clamp_min(1)
    plan.update(cache_seqlens=shorter)
    out, lse = plan.run(case.q, case.kv_cache)
    assert compare_outputs(out, lse, *case_reference(case, shorter), FlashInferBackend.TOLERANCE)


def test_sm90_eager_plans_reuse_dropped_wrappers_never_live_ones(monkeypatch, fake, gen):
    """An eager plan takes the wrapper of a plan that was dropped (building one allocates a pinned host buffer), and
    its page lists, query offsets and LSE buffer where the shapes are the same; two live plans never share them, a
    plan of other shapes makes its own, and a plan made from reused ones is right."""
    simulate(monkeypatch, H100, FlashInferBackend)
    case = make_case(2, 1, 16, 40, page_size=16, varlen=False, generator=gen)
    first = mla_dispatch.plan_decode(*case.args(), backend="flashinfer", **case.kwargs())
    second = mla_dispatch.plan_decode(*case.args(), backend="flashinfer", **case.kwargs())
    assert first.state.wrapper is not second.state.wrapper and first.state.lists is not second.state.lists
    dropped = id(first.state.wrapper)
    dropped_buffers = [id(first.state.lists), id(first.state.qo_indptr), id(first.state.lse_buf)]
    del first
    gc.collect()
    third = mla_dispatch.plan_decode(*case.args(), backend="flashinfer", **case.kwargs())
    assert id(third.state.wrapper) == dropped and third.state.wrapper is not second.state.wrapper
    assert [id(third.state.lists), id(third.state.qo_indptr), id(third.state.lse_buf)] == dropped_buffers
    other = make_case(3, 1, 16, 40, page_size=16, varlen=False, generator=gen)
    second_wrapper = second.state.wrapper
    del second
    gc.collect()
    wider = mla_dispatch.plan_decode(*other.args(), backend="flashinfer", **other.kwargs())  # another batch
    assert wider.state.lists.shape == (3, other.block_table.shape[1]) and wider.state.lse_buf.shape[0] == 3
    out, lse = wider.run(other.q, other.kv_cache)
    assert compare_outputs(out, lse, *case_reference(other, other.cache_seqlens), FlashInferBackend.TOLERANCE)
    out, lse = third.run(case.q, case.kv_cache)
    assert compare_outputs(out, lse, *case_reference(case, case.cache_seqlens), FlashInferBackend.TOLERANCE)
    graphed = mla_dispatch.plan_decode(*case.args(), backend="flashinfer", cuda_graph=True, **case.kwargs())
    assert graphed.state.wrapper not in (second_wrapper, third.state.wrapper)  # its own, captured buffers


@pytest.mark.parametrize("page_size,h_q,q_len", [(64, 16, 1), (32, 24, 1), (128, 96, 2), (64, 5, 1)])
def test_sm100_trtllm_matches_reference(monkeypatch, fake, gen, page_size, h_q, q_len):
    simulate(monkeypatch, B200, FlashInferBackend)
    case = make_case(3, q_len, h_q, 150, page_size=page_size, causal=q_len > 1, zero_len_rows=1, generator=gen,
                     softmax_scale=192**-0.5)
    _check(case, return_lse=False)


def test_sm90_refuses_causal_mtp_with_heads_not_a_power_of_two(monkeypatch, fake):
    """Measured wrong on the GPU with flashinfer 0.6.0 (backends/flashinfer.py): never selected there."""
    simulate(monkeypatch, H100, FlashInferBackend)
    q = torch.zeros(2, 4, 63, 576, dtype=torch.bfloat16)
    kv = torch.zeros(4, 64, 1, 576, dtype=torch.bfloat16)
    bt = torch.zeros(2, 2, dtype=torch.int32)
    sl = torch.full((2,), 70, dtype=torch.int32)
    with pytest.raises(NoBackendError) as err:
        mla_dispatch.mla_decode(q, kv, bt, sl, backend="flashinfer", causal=True)
    assert "h_q=63" in str(err.value) and "power of two" in str(err.value)
    # the same shapes without the causal mask, or with 64 heads, still run
    case = make_case(2, 4, 64, 70, causal=True, generator=torch.Generator().manual_seed(0), softmax_scale=192**-0.5)
    _check(case)


def test_sm100_head_padding_rule():
    assert [trtllm_heads(h) for h in (1, 5, 8, 16, 24, 32, 48, 96, 128, 129)] == [1, 5, 8, 16, 32, 32, 48, 128, 128, None]


def test_sm100_reasons(monkeypatch, fake):
    simulate(monkeypatch, B200, FlashInferBackend)
    q = torch.zeros(2, 2, 16, 576, dtype=torch.float16)
    kv = torch.zeros(4, 16, 1, 576, dtype=torch.float16)
    bt = torch.zeros(2, 2, dtype=torch.int32)
    sl = torch.ones(2, dtype=torch.int32)
    with pytest.raises(NoBackendError) as err:
        mla_dispatch.mla_decode(q, kv, bt, sl, backend="flashinfer")
    text = str(err.value)
    assert "page_size=16" in text and "float16" in text and "causal=False" in text and "no LSE" in text


def test_unavailable_reason_keeps_import_error(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "flashinfer", None)
    forget(FlashInferBackend)
    try:
        reasons = FlashInferBackend.availability_reasons()
        assert reasons and reasons[0].code is ReasonCode.UNAVAILABLE and "import flashinfer failed" in reasons[0].message
    finally:
        forget(FlashInferBackend)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size,q_len,h_q,causal,dtype", [
    (64, 1, 128, False, torch.bfloat16), (1, 1, 16, False, torch.bfloat16), (16, 2, 64, True, torch.bfloat16),
    (64, 1, 16, False, torch.float16), (33, 4, 128, True, torch.bfloat16)])
def test_real_flashinfer_on_gpu(gen, page_size, q_len, h_q, causal, dtype):
    """The installed flashinfer on this GPU, through mla_decode, against the reference."""
    pytest.importorskip("flashinfer")
    reasons = FlashInferBackend.availability_reasons()
    assert not reasons, reasons
    case = make_case(8, q_len, h_q, 1000, page_size=page_size, causal=causal, zero_len_rows=1, dtype=dtype,
                     device="cuda", generator=gen, softmax_scale=192**-0.5)
    out, lse = _check(case)
    plan = mla_dispatch.plan_decode(*case.args(), backend="flashinfer", **case.kwargs(), cuda_graph=True)
    o2, l2 = torch.empty_like(out), torch.empty_like(lse)
    plan.run(case.q, case.kv_cache, out=o2, lse=l2)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        plan.run(case.q, case.kv_cache, out=o2, lse=l2)
    o2.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(o2, out) and torch.equal(l2.nan_to_num(), lse.nan_to_num())


@pytest.mark.parametrize("version,declined", [("0.6.0", True), ("0.6.10", True), ("0.6.11", False)])
def test_sm90_declines_caches_past_2_32_elements_before_the_offset_fix(monkeypatch, version, declined):
    """flashinfer < 0.6.11 computes MLA page offsets in 32-bit arithmetic: wrong output once a used page lies past
    2^32 cache elements (NaN in ~98% of out at b=128, mean length 32K, on an H100). Declined there with the
    limit named; a cache of exactly 2^32 elements, or a fixed version, still runs."""
    import dataclasses

    fake_flashinfer.install(monkeypatch, version=version)
    simulate(monkeypatch, H100, FlashInferBackend)
    try:
        problem = mla_dispatch.DecodeProblem(batch=128, q_len=1, num_heads_q=128, num_heads_kv=1, head_dim_qk=576,
                                             head_dim_v=512, page_size=64, max_blocks=1386, q_dtype=torch.bfloat16,
                                             kv_format="bf16", causal=False, topk=0, return_lse=True,
                                             device_type="cuda", cache_numel=177410 * 64 * 576)
        reasons = FlashInferBackend.not_supported_reasons(problem, H100)
        assert bool(reasons) == declined, reasons
        if declined:
            assert "2^32" in reasons[0].message and str(problem.cache_numel) in reasons[0].message
        at_limit = dataclasses.replace(problem, cache_numel=1 << 32)
        assert not FlashInferBackend.not_supported_reasons(at_limit, H100)
    finally:
        forget(FlashInferBackend)
