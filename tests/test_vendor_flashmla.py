"""Contract tests of the FlashMLA adapter against a fake ``flash_mla`` (CPU), both interfaces.

The fake (tests/fakes/fake_flash_mla.py) enforces page size 64, the metadata contract of
each interface (a FlashMLASchedMeta is one per step; legacy tensors encode s_q*h_q//h_kv
and the lengths), and the sparse-decode rules.
"""

import warnings

import pytest
import torch

import mla_dispatch
from fakes import B200, H100, fake_flash_mla, forget, simulate
from mla_dispatch.backends.flashmla import FlashMLABackend
from mla_dispatch.dispatch.select import NoBackendError
from mla_dispatch.numerics.cases import case_reference, make_case
from mla_dispatch.numerics.tolerance import compare_outputs


@pytest.fixture(params=[False, True], ids=["schedmeta", "legacy"])
def fake(request, monkeypatch):
    pkg = fake_flash_mla.install(monkeypatch, legacy=request.param)
    yield request.param
    forget(FlashMLABackend)


@pytest.mark.parametrize("page_size,q_len,h_q,h_kv,causal", [(64, 1, 16, 1, False), (128, 2, 8, 2, True),
                                                             (64, 2, 3, 1, False)])
def test_dense_matches_reference(monkeypatch, fake, gen, page_size, q_len, h_q, h_kv, causal):
    simulate(monkeypatch, H100, FlashMLABackend)
    case = make_case(3, q_len, h_q, 150, num_heads_kv=h_kv, page_size=page_size, causal=causal, zero_len_rows=1,
                     generator=gen)
    out, lse = mla_dispatch.mla_decode(*case.args(), backend="flashmla", **case.kwargs())
    assert compare_outputs(out, lse, *case_reference(case), FlashMLABackend.TOLERANCE)


def test_plan_update_refreshes_metadata(monkeypatch, fake, gen):
    simulate(monkeypatch, H100, FlashMLABackend)
    case = make_case(2, 1, 16, 100, generator=gen)
    plan = mla_dispatch.plan_decode(*case.args(), backend="flashmla", **case.kwargs())
    plan.run(case.q, case.kv_cache)
    plan.run(case.q, case.kv_cache)  # second layer, same step
    shorter = (case.cache_seqlens - 5).clamp_min(1)
    plan.update(cache_seqlens=shorter)
    out, lse = plan.run(case.q, case.kv_cache)
    assert compare_outputs(out, lse, *case_reference(case, shorter), FlashMLABackend.TOLERANCE)


@pytest.mark.parametrize("platform", [H100, B200], ids=["sm90", "sm100"])
def test_sparse_fp8_ds_mla_matches_reference(monkeypatch, fake, gen, platform):
    simulate(monkeypatch, platform, FlashMLABackend)
    case = make_case(2, 2, 64, 90, page_size=32, kv_format="fp8_ds_mla", topk=24, generator=gen)
    out, lse = mla_dispatch.mla_decode(*case.args(), backend="flashmla", **case.kwargs())
    ref = case_reference(case)
    tol = FlashMLABackend.TOLERANCE
    assert compare_outputs(out, lse, *ref, tol)


def test_reasons(monkeypatch, fake):
    simulate(monkeypatch, B200, FlashMLABackend)
    q = torch.zeros(1, 1, 16, 576, dtype=torch.bfloat16)
    kv = torch.zeros(2, 16, 1, 576, dtype=torch.bfloat16)
    with pytest.raises(NoBackendError) as err:
        mla_dispatch.mla_decode(q, kv, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                                backend="flashmla")
    text = str(err.value)
    assert "page_size=16" in text and "compute capability 10.0 for dense decode" in text


def test_cuda_graph_refused_only_for_sparse_schedmeta(monkeypatch, fake):
    """Dense CUDA-graph plans run on both interfaces (the current one with its schedule filled by us before
    capture); sparse ones only on the legacy interface."""
    import dataclasses

    simulate(monkeypatch, H100, FlashMLABackend)
    legacy = fake
    from mla_dispatch.dispatch.problem import DecodeProblem

    p = DecodeProblem(2, 1, 16, 1, 576, 512, 64, 4, torch.bfloat16, "bf16", False, 0, True, "cuda", cuda_graph=True)
    assert FlashMLABackend.not_supported_reasons(p, H100) == []
    sparse = dataclasses.replace(p, num_heads_q=64, kv_format="fp8_ds_mla", topk=64)
    codes = [r.message for r in FlashMLABackend.not_supported_reasons(sparse, H100)]
    assert (codes == []) == legacy, codes


def test_graph_plan_fills_the_schedule_before_the_first_call(monkeypatch, fake, gen):
    """A cuda_graph plan hands FlashMLA a schedule object already filled (FlashMLA's layout, FlashMLA's algorithm);
    update() refreshes its tensors in place (a captured graph keeps their addresses); results match the oracle."""
    if fake:
        pytest.skip("the legacy interface takes metadata tensors directly")
    simulate(monkeypatch, H100, FlashMLABackend)
    from mla_dispatch.metadata.flashmla_sched import flashmla_sched_meta_host

    case = make_case(3, 2, 16, 300, causal=True, zero_len_rows=1, generator=gen)
    plan = mla_dispatch.plan_decode(*case.args(), backend="flashmla", **case.kwargs(), cuda_graph=True)
    meta = plan.state.meta
    assert meta.have_initialized and meta.config.b == 3 and meta.config.causal
    parts = meta.tile_scheduler_metadata.shape[0]
    assert parts == max(132 // 1 // -(-2 * 16 // 64), 1)  # FlashMLA's num_sm_parts on an H100
    rows, splits = flashmla_sched_meta_host(case.cache_seqlens.tolist(), parts)
    assert meta.tile_scheduler_metadata.tolist() == rows and meta.num_splits.tolist() == splits
    out, lse = torch.full_like(case.q[..., :512], float("nan")), torch.full((3, 16, 2), float("nan"))
    plan.run(case.q, case.kv_cache, out=out, lse=lse)
    assert compare_outputs(out, lse, *case_reference(case), FlashMLABackend.TOLERANCE)
    address = meta.tile_scheduler_metadata.data_ptr()
    longer = case.cache_seqlens + 7
    plan.update(cache_seqlens=longer)
    assert plan.state.meta is meta and meta.tile_scheduler_metadata.data_ptr() == address
    assert meta.num_splits.tolist() == flashmla_sched_meta_host(longer.tolist(), parts)[1]


def test_compat_alias_is_not_mistaken_for_flashmla(monkeypatch):
    from mla_dispatch.compat.flash_mla import (FlashMLAShadowWarning, install_flash_mla_alias,
                                               uninstall_flash_mla_alias)

    forget(FlashMLABackend)
    # shadow_installed: where a real flash_mla is installed too (the alias then warns that it hides it), the alias
    # must still be seen for what it is
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FlashMLAShadowWarning)
        install_flash_mla_alias(shadow_installed=True)
    try:
        reasons = FlashMLABackend.availability_reasons()
        assert reasons and "own alias" in reasons[0].message
    finally:
        uninstall_flash_mla_alias()
        forget(FlashMLABackend)
