"""Contract tests of the AITER adapter against a fake ``aiter`` (CPU).

The fake (tests/fakes/fake_aiter.py) raises AiterAbort where the real library would abort
the process, reads token slots from kv_indptr/kv_indices (page size 1) and kv_last_page_lens,
and in persistent mode takes each request's KV range from the metadata buffers. A missing
head padding, a wrong indptr, a positional call into the moved signature, stale persistent
metadata or a wrong fp8 dtype on gfx942 fails here.
"""

import pytest
import torch

import mla_dispatch
from fakes import MI300X, MI355X, fake_aiter, forget, simulate
from mla_dispatch.backends.aiter import KERNELS, AiterBackend, choose_kernel
from mla_dispatch.dispatch.select import NoBackendError
from mla_dispatch.numerics.cases import case_reference, make_case, poisoned_outputs
from mla_dispatch.numerics.oracle import reference_attention
from mla_dispatch.numerics.tolerance import Tolerance, compare_outputs


@pytest.fixture(params=[False, True], ids=["sig2026", "sig2025"])
def legacy(request):
    return request.param


def _install(monkeypatch, platform, legacy=False):
    fake_aiter.install(monkeypatch, arch=platform.arch, legacy=legacy)
    simulate(monkeypatch, platform, AiterBackend)


@pytest.fixture(autouse=True)
def _forget():
    yield
    forget(AiterBackend)


@pytest.mark.parametrize("platform", [MI300X, MI355X], ids=["gfx942", "gfx950"])
@pytest.mark.parametrize("h_q,q_len,page_size", [(16, 1, 64), (4, 1, 16), (128, 1, 1), (16, 4, 32), (32, 4, 64)])
def test_bf16_matches_reference(monkeypatch, legacy, gen, platform, h_q, q_len, page_size):
    _install(monkeypatch, platform, legacy)
    case = make_case(3, q_len, h_q, 90, page_size=page_size, causal=q_len > 1, zero_len_rows=1, generator=gen,
                     softmax_scale=192**-0.5)
    out, lse = mla_dispatch.mla_decode(*case.args(), backend="aiter", **case.kwargs(), out=poisoned_outputs(case)[0])
    report = compare_outputs(out, lse, *case_reference(case), AiterBackend.TOLERANCE)
    assert report, report.message


@pytest.mark.parametrize("platform,h_q,q_len", [(MI300X, 16, 1), (MI300X, 128, 1), (MI355X, 32, 2)],
                         ids=["gfx942-h16", "gfx942-h128", "gfx950-h32s2"])
def test_fp8_matches_reference(monkeypatch, gen, platform, h_q, q_len):
    _install(monkeypatch, platform)
    case = make_case(2, q_len, h_q, 70, page_size=16, kv_format="fp8_e4m3", causal=q_len > 1, generator=gen)
    case.kv_cache.view(torch.uint8)[..., ::5] = 0x80  # e4m3fn negative zero: NaN if read as fnuz bits
    out, lse = poisoned_outputs(case)
    plan = mla_dispatch.plan_decode(*case.args(), backend="aiter", **case.kwargs())
    plan.run(case.q, case.kv_cache, kv_scale=case.kv_scale, out=out, lse=lse)
    # These kernels take an fp8 q: the adapter quantises it per call with one dynamic scale (amax / the fp8 type's
    # max). The oracle attends with q rounded the same way, so docs §5 tolerances hold (measured over 300 draws:
    # out abs error <= 2.5e-4, one bf16 ulp; lse abs error <= 1e-6); against the unrounded q, q's 3 mantissa bits
    # alone move the lse by up to ~1e-3.
    fp8 = torch.float8_e4m3fnuz if platform.arch == "gfx942" else torch.float8_e4m3fn
    assert plan.state.q_dtype == fp8, "this test expects AITER's fp8-q kernels"
    q_scale = case.q.float().abs().amax() / torch.finfo(fp8).max
    q_fp8 = (case.q.float() / q_scale).to(fp8).float() * q_scale
    want = reference_attention(q_fp8, case.kv_cache, case.block_table, case.cache_seqlens, **case.kwargs())
    report = compare_outputs(out, lse, *want, Tolerance())
    assert report, report.message


def test_persistent_metadata_refreshed_by_update(monkeypatch, gen):
    _install(monkeypatch, MI300X)
    case = make_case(2, 4, 16, 60, page_size=16, causal=True, generator=gen)
    plan = mla_dispatch.plan_decode(*case.args(), backend="aiter", **case.kwargs())
    assert plan.state.persistent and plan.state.meta is not None
    shorter = (case.cache_seqlens - 3).clamp_min(4)
    plan.update(cache_seqlens=shorter)
    out, lse = plan.run(case.q, case.kv_cache)
    assert compare_outputs(out, lse, *case_reference(case, shorter), AiterBackend.TOLERANCE)


def test_unsupported_combination_is_refused_before_calling(monkeypatch):
    """h_q=48, s_q=1, bf16 on gfx942 has no kernel: AITER would abort; we must raise NoBackendError."""
    _install(monkeypatch, MI300X)
    q = torch.zeros(1, 1, 48, 576, dtype=torch.bfloat16)
    kv = torch.zeros(2, 16, 1, 576, dtype=torch.bfloat16)
    with pytest.raises(NoBackendError, match="no AITER kernel"):
        mla_dispatch.mla_decode(q, kv, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                                backend="aiter")


def test_every_accepted_combination_exists_in_the_fake_table():
    """choose_kernel never picks a combination the (independently written) fake table lacks."""
    for arch in KERNELS:
        table = fake_aiter._table(arch)
        for kv in ("bf16", "fp8_e4m3"):
            for h in range(1, 129):
                for s in (1, 2, 3, 4, 8):
                    pick = choose_kernel(arch, kv, h, s)
                    if pick is None:
                        continue
                    q, heads, ps = pick
                    lookup = 16 if ps and heads in range(32, 129, 16) else heads
                    kvt = "bf16" if kv == "bf16" else "fp8"
                    assert any((q, kvt, lookup, ps, ql) in table for ql in (s, 0)), (arch, kv, h, s, pick)


def test_reasons_list_device_and_dtype(monkeypatch):
    _install(monkeypatch, MI300X)
    q = torch.zeros(1, 2, 16, 576, dtype=torch.float16)
    kv = torch.zeros(2, 16, 2, 576, dtype=torch.float16)
    with pytest.raises(NoBackendError) as err:
        mla_dispatch.mla_decode(q, kv, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                                backend="aiter")
    text = str(err.value)
    assert "float16" in text and "h_kv=2" in text and "causal=False" in text
