"""Contract tests of the FlashMLA adapter against a fake ``flash_mla`` (CPU), both interfaces.

The fake (tests/fakes/fake_flash_mla.py) enforces page size 64, the metadata contract of
each interface (a FlashMLASchedMeta is one per step; legacy tensors encode s_q*h_q//h_kv
and the lengths), and the sparse-decode rules.
"""

import dataclasses
import warnings

import pytest
import torch

import mla_dispatch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fakes import B200, H100, H200, fake_flash_mla, forget, simulate
from mla_dispatch.backends.flashmla import FlashMLABackend
from mla_dispatch.dispatch.problem import DecodeProblem
from mla_dispatch.dispatch.select import NoBackendError, explain
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
    case = make_case(2, 2, 64, 90, page_size=32, kv_format="fp8_ds_mla", topk=64, generator=gen)
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
    assert "page_size=16" in text and "dense decode on compute capability 10.0 (supported on: sm90 dense)" in text


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


@pytest.mark.parametrize("platform", [H100, H200], ids=["h100", "h200"])
@pytest.mark.parametrize("page_size,h_q,q_len", [(64, 128, 1), (64, 16, 2), (128, 64, 1), (256, 1, 4)])
def test_auto_never_hands_flashmla_a_512_wide_problem(monkeypatch, fake, gen, platform, page_size, h_q, q_len):
    """FlashMLA's API accepts D_qk 512, its SM90 dense kernel asserts 576 and ends the process (issue 56: on the
    H200, auto chose flashmla for a 512/512 plan and the run killed the process). Declined with the kernel's
    assert as the reason; auto goes on to the next candidate; naming flashmla raises NoBackendError."""
    simulate(monkeypatch, platform, FlashMLABackend)
    case = make_case(2, q_len, h_q, 100, page_size=page_size, causal=q_len > 1, head_dim_qk=512, head_dim_v=512,
                     generator=gen)
    problem = mla_dispatch.plan_decode(*case.args(), **case.kwargs(), backend="reference").problem
    problem = dataclasses.replace(problem, device_type="cuda")
    report = explain(problem, platform)
    assert report.chosen not in (None, "flashmla")
    reasons = dict((name, [str(r) for r in why]) for name, _, why in report.candidates)["flashmla"]
    assert reasons == ["D_qk/D_v=512/512 (supported: 576/512) on sm90 dense: FlashMLA's SM90 dense kernel asserts "
                       "params.d == 576 and ends the process otherwise (csrc/sm90/decode/dense/splitkv_mla.cuh; its "
                       "API lets 512 through)"]
    with pytest.raises(NoBackendError, match="params.d == 576"):
        mla_dispatch.mla_decode(*case.args(), **case.kwargs(), backend="flashmla")


_PLATFORMS = st.sampled_from([H100, H200, B200])


@st.composite
def _problems(draw):
    sparse = draw(st.booleans())
    kv_format = draw(st.sampled_from(["bf16", "fp16", "fp8_e4m3", "fp8_ds_mla"]))
    q_dtype = draw(st.sampled_from([torch.bfloat16, torch.float16]))
    if kv_format in ("bf16", "fp16"):
        q_dtype = torch.bfloat16 if kv_format == "bf16" else torch.float16
    dims = (576, 512) if kv_format == "fp8_ds_mla" else draw(st.sampled_from([(576, 512), (512, 512), (320, 256)]))
    h_kv = draw(st.sampled_from([1, 2]))
    q_len = draw(st.integers(1, 4))
    return DecodeProblem(
        batch=draw(st.integers(1, 64)), q_len=q_len, num_heads_q=h_kv * draw(st.sampled_from([1, 8, 16, 32, 64, 128])),
        num_heads_kv=h_kv, head_dim_qk=dims[0], head_dim_v=dims[1],
        page_size=draw(st.sampled_from([1, 16, 32, 64, 128, 256])), max_blocks=8, q_dtype=q_dtype,
        kv_format=kv_format, causal=not sparse and q_len > 1 and draw(st.booleans()),
        topk=draw(st.sampled_from([24, 64, 96, 128, 2048])) if sparse else 0, return_lse=True, device_type="cuda")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(problem=_problems(), platform=_PLATFORMS)
def test_whatever_the_adapter_accepts_flashmlas_kernels_run(monkeypatch, fake, problem, platform):
    """The adapter's declaration against the kernels' own asserts (tests/fakes/fake_flash_mla.kernel_asserts, read
    from FlashMLA 9241ae3): no problem it accepts, on any architecture it names, reaches a failing one."""
    simulate(monkeypatch, platform, FlashMLABackend)
    if FlashMLABackend.not_supported_reasons(problem, platform):
        return
    assert problem.sparse or platform.capability == (9, 0)
    failed = fake_flash_mla.kernel_asserts(head_dim_qk=problem.head_dim_qk, head_dim_v=problem.head_dim_v,
                                           topk=problem.topk if problem.sparse else None)
    assert failed is None, (problem, platform.name, failed)


def test_sparse_topk_must_be_a_multiple_of_64(monkeypatch, fake):
    simulate(monkeypatch, H100, FlashMLABackend)
    p = DecodeProblem(2, 1, 64, 1, 576, 512, 64, 0, torch.bfloat16, "fp8_ds_mla", False, 96, True, "cuda")
    assert [str(r) for r in FlashMLABackend.not_supported_reasons(p, H100)] == [
        "topk=96 for sparse decode (supported: multiples of 64; FlashMLA's sparse kernels assert topk % 64 == 0)"]
    assert not FlashMLABackend.not_supported_reasons(dataclasses.replace(p, topk=128), H100)


def test_a_build_without_sparse_kernels_declines_sparse_and_still_runs_dense(monkeypatch, gen):
    """FlashMLA from before its sparse kernels (c28eca9) has no ``indices`` / ``is_fp8_kvcache`` parameters: sparse
    is declined with that reason, and dense calls pass neither."""
    pkg = fake_flash_mla.install(monkeypatch, legacy=True)
    strict = pkg.flash_mla_with_kvcache

    def pre_sparse(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits,
                   softmax_scale=None, causal=False):
        return strict(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits,
                      softmax_scale=softmax_scale, causal=causal)

    monkeypatch.setattr(pkg, "flash_mla_with_kvcache", pre_sparse)
    monkeypatch.setattr(pkg.flash_mla_interface, "flash_mla_with_kvcache", pre_sparse)
    try:
        simulate(monkeypatch, H100, FlashMLABackend)
        sparse = DecodeProblem(2, 1, 64, 1, 576, 512, 64, 0, torch.bfloat16, "fp8_ds_mla", False, 64, True, "cuda")
        assert any("takes no indices" in str(r) for r in FlashMLABackend.not_supported_reasons(sparse, H100))
        case = make_case(2, 1, 16, 100, generator=gen)
        plan = mla_dispatch.plan_decode(*case.args(), **case.kwargs(), backend="flashmla")
        out, lse = plan.run(case.q, case.kv_cache)  # eager: the bound call
        assert compare_outputs(out, lse, *case_reference(case), FlashMLABackend.TOLERANCE)
        out, lse = torch.full_like(out, float("nan")), torch.full_like(lse, float("nan"))
        FlashMLABackend.run(plan.state, case.q, case.kv_cache, plan.block_table, plan.cache_seqlens,
                            problem=plan.problem, softmax_scale=plan.softmax_scale, kv_scale=None, indices=None,
                            out=out, lse=lse)  # what traced calls (torch.compile) reach
        assert compare_outputs(out, lse, *case_reference(case), FlashMLABackend.TOLERANCE)
    finally:
        forget(FlashMLABackend)


_FLASHMLA_512 = """
import torch, flash_mla
q = torch.randn(1, 1, 16, 512, dtype=torch.bfloat16, device="cuda") / 10
kv = torch.randn(4, 64, 1, 512, dtype=torch.bfloat16, device="cuda") / 10
table = torch.arange(4, dtype=torch.int32, device="cuda").view(1, 4)
lens = torch.tensor([200], dtype=torch.int32, device="cuda")
meta, splits = flash_mla.get_mla_metadata()
flash_mla.flash_mla_with_kvcache(q, kv, table, lens, 512, meta, splits, softmax_scale=0.05)
torch.cuda.synchronize()
print("FlashMLA ran D_qk=512")
"""


@pytest.mark.gpu
def test_real_flashmla_ends_the_process_on_512_and_conformance_survives(seed):
    """With DeepSeek's FlashMLA installed (ci/flashmla_peer.sh): calling it directly with D_qk 512 ends the process
    (in a child here), which is why the adapter declines it; the adapter declines it on this GPU; and conformance
    of flashmla over the quick set runs to its end with no errored cell."""
    import os
    import subprocess
    import sys

    from mla_dispatch.tools import conformance

    if FlashMLABackend.availability_reasons():
        pytest.skip(f"FlashMLA is not installed here: {FlashMLABackend.availability_reasons()[0]}")
    proc = subprocess.run([sys.executable, "-c", _FLASHMLA_512], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p)))
    assert proc.returncode != 0 and "FlashMLA ran" not in proc.stdout, (proc.returncode, proc.stdout)
    assert "HEAD_DIM_K" in proc.stderr or "params.d" in proc.stderr, proc.stderr[-2000:]
    cases = conformance.case_set(quick=True)
    matrix = conformance.run_conformance(cases, ["flashmla"], device=torch.device("cuda"), seed=seed, progress=False)
    cells = {case: row["flashmla"] for case, row in matrix.items()}
    assert not [c for c, cell in cells.items() if cell.status in ("error", "fail")], cells
    assert cells["d=512/512"].status == "unsupported" and "params.d == 576" in cells["d=512/512"].detail
    assert cells["baseline"].status == "pass"
