"""Contract tests of the FlashAttention-3 adapter against a fake FA3 (CPU) in its three packagings, and the real one
on a GPU (``gpu`` marker).

The fake (tests/fakes/fake_fa3.py) computes from FA3's own inputs (the 64-wide q and k_cache, the 512-wide qv and
v_cache, the page table and lengths) with FA3's host checks, returns FA3's LSE layouts and its -inf for rows that
see no key, and refuses scheduler metadata made for another configuration or for older lengths: a swapped rope /
latent split, a missing ``qv`` or ``fa_version=3``, an LSE left untransposed or at -inf, a stale schedule, or a
capability declared beyond what a build runs fails here.
"""

import sys

import pytest
import torch

import mla_dispatch
from fakes import B200, H100, fake_fa3, forget, simulate
from mla_dispatch.backends.fa3 import FA3Backend, provider
from mla_dispatch.dispatch.backend import ReasonCode
from mla_dispatch.dispatch.select import NoBackendError
from mla_dispatch.numerics.cases import case_reference, make_case, poisoned_outputs
from mla_dispatch.numerics.tolerance import compare_outputs

PACKAGINGS = ["upstream", "vllm", "sgl_kernel"]


@pytest.fixture(params=PACKAGINGS)
def fake(request, monkeypatch):
    build = fake_fa3.install(monkeypatch, request.param)
    simulate(monkeypatch, H100, FA3Backend)
    yield build
    forget(FA3Backend)


def _install(monkeypatch, packaging="upstream", **flags):
    build = fake_fa3.install(monkeypatch, packaging, flags=flags)
    simulate(monkeypatch, H100, FA3Backend)
    return build


def _check(case, **kw):
    out, lse = mla_dispatch.mla_decode(*case.args(), backend="fa3", **case.kwargs(), **kw)
    report = compare_outputs(out, lse, *case_reference(case), FA3Backend.TOLERANCE)
    assert report, report.message
    return out, lse


SHAPES = {"ps1-s1-h16": (1, 1, 16, 1, False), "ps16-s2-h16-causal": (16, 2, 16, 1, True),
          "ps64-s1-h64": (64, 1, 64, 1, False), "ps33-s3-h8-hkv2-causal": (33, 3, 8, 2, True)}
REFERENCE_CASES = [("upstream", shape) for shape in SHAPES] + [
    ("vllm", "ps16-s2-h16-causal"), ("vllm", "ps33-s3-h8-hkv2-causal"), ("sgl_kernel", "ps1-s1-h16"),
    ("sgl_kernel", "ps64-s1-h64")]


@pytest.mark.parametrize("packaging,shape", REFERENCE_CASES, ids=[f"{p}-{s}" for p, s in REFERENCE_CASES])
def test_matches_reference(monkeypatch, gen, packaging, shape):
    page_size, q_len, h_q, h_kv, causal = SHAPES[shape]
    build = _install(monkeypatch, packaging)
    try:
        case = make_case(3, q_len, h_q, 70, num_heads_kv=h_kv, page_size=page_size, causal=causal, zero_len_rows=1,
                         generator=gen, softmax_scale=192**-0.5)
        _check(case)
        assert build.calls and build.calls[-1]["varlen_q"] == (packaging == "vllm")
    finally:
        forget(FA3Backend)


def test_rows_without_keys_get_lse_plus_inf(fake, gen):
    """FA3 leaves -inf in the LSE of a row that sees no key (a zero-length request, a causal row cut off); the
    canonical sentinel is +inf (out stays FA3's 0)."""
    case = make_case(3, 4, 8, 3, causal=True, zero_len_rows=1, varlen=False, generator=gen)
    out, lse = _check(case)
    no_key = case.cache_seqlens == 0
    assert torch.isposinf(lse[no_key]).all() and (out[no_key] == 0).all()
    assert torch.isposinf(lse[~no_key][:, :, 0]).all()  # s_q=4 over 3 keys: the first query token sees none


def test_plan_schedules_once_per_step_and_update_refreshes_in_place(fake, gen):
    case = make_case(2, 1, 8, 120, page_size=16, generator=gen)
    plan = mla_dispatch.plan_decode(*case.args(), backend="fa3", **case.kwargs())
    for _ in range(2):  # two layers, one schedule
        plan.run(case.q, case.kv_cache)
    meta = plan.state.meta
    if provider().module == "sgl_kernel.flash_attn":  # no get_scheduler_metadata: FA3 schedules inside each call
        assert meta is None and not fake.metadata
    else:
        assert len(fake.metadata) == 1 and fake.calls[-1]["metadata"]
    shorter = (case.cache_seqlens - 37).clamp_min(0)
    plan.update(cache_seqlens=shorter)  # the fake refuses a schedule of the old lengths
    out, lse = plan.run(case.q, case.kv_cache, out=poisoned_outputs(case)[0])
    assert compare_outputs(out, lse, *case_reference(case, shorter), FA3Backend.TOLERANCE)
    assert plan.state.meta is meta or plan.state.meta.data_ptr() == meta.data_ptr()  # a captured graph reads it


def test_checked_run_writes_given_buffers(fake, gen):
    """``plan.run`` with ``out`` / ``lse``: vLLM's varlen call writes ``out`` itself, the others are copied."""
    case = make_case(2, 2, 8, 50, page_size=32, causal=True, zero_len_rows=1, generator=gen)
    ref = case_reference(case)
    plan = mla_dispatch.plan_decode(*case.args(), backend="fa3", **case.kwargs())
    out, lse = poisoned_outputs(case)
    strided = torch.full(out.shape[:-1] + (2 * out.shape[-1],), float("nan"), dtype=out.dtype)[..., ::2]
    for buf in (out, strided):
        lse.fill_(float("nan"))
        o, l = plan.run(case.q, case.kv_cache, out=buf, lse=lse)
        assert o is buf and l is lse
        assert compare_outputs(buf, lse, *ref, FA3Backend.TOLERANCE)
    assert fake.calls[-2]["out_given"] == (provider().call == "varlen")  # the contiguous buffer
    assert not fake.calls[-1]["out_given"]  # FA3 writes only contiguous outputs: the strided one is a copy


def test_batch_invariant_plans_do_not_split(fake, gen):
    case = make_case(2, 1, 8, 100, generator=gen)
    plan = mla_dispatch.plan_decode(*case.args(), backend="fa3", **case.kwargs(), batch_invariant=True)
    out, lse = plan.run(case.q, case.kv_cache)
    assert compare_outputs(out, lse, *case_reference(case), FA3Backend.TOLERANCE)
    assert fake.calls[-1]["num_splits"] == 1
    assert all(config["num_splits"] == 1 for config, _ in fake.metadata.values())


def test_reasons(monkeypatch):
    _install(monkeypatch)
    try:
        q = torch.zeros(2, 1, 16, 576, dtype=torch.bfloat16)
        kv = torch.zeros(4, 64, 1, 576, dtype=torch.float8_e4m3fn)
        bt = torch.zeros(2, 2, dtype=torch.int32)
        sl = torch.ones(2, dtype=torch.int32)
        with pytest.raises(NoBackendError) as err:
            mla_dispatch.mla_decode(q, kv, bt, sl, backend="fa3", kv_scale=1.0)
        assert "kv_format=fp8_e4m3 (supported: {bf16, fp16})" in str(err.value)
        with pytest.raises(NoBackendError) as err:
            mla_dispatch.mla_decode(q[..., :512], kv[..., :512].to(torch.bfloat16), bt, sl, backend="fa3")
        assert "D_qk/D_v=512/512 (supported: 576/512)" in str(err.value)
        idx = torch.zeros(2, 1, 8, dtype=torch.int32)
        with pytest.raises(NoBackendError) as err:
            mla_dispatch.mla_decode(q, kv.to(torch.bfloat16), None, None, indices=idx, backend="fa3")
        assert "sparse indices" in str(err.value)
        problem = mla_dispatch.plan_decode(q, kv.to(torch.bfloat16), bt, sl, backend="reference").problem
        assert not FA3Backend.not_supported_reasons(problem, H100)
        reasons = FA3Backend.not_supported_reasons(problem, B200)
        assert [r.code for r in reasons] == [ReasonCode.CAPABILITY] and "10.0 (supported: 9.0..9.0)" in str(reasons[0])
    finally:
        forget(FA3Backend)


def _problem(**over):
    base = dict(batch=2, q_len=1, num_heads_q=16, num_heads_kv=1, head_dim_qk=576, head_dim_v=512, page_size=64,
                max_blocks=4, q_dtype=torch.bfloat16, kv_format="bf16", causal=False, topk=0, return_lse=True,
                device_type="cuda")
    return mla_dispatch.DecodeProblem(**(base | over))


@pytest.mark.parametrize("flag,declined,accepted", [
    ("FLASHATTENTION_DISABLE_FP16", dict(q_dtype=torch.float16, kv_format="fp16"), {}),
    ("FLASHATTENTION_DISABLE_PAGEDKV", dict(page_size=16, num_heads_q=128), None),
    ("FLASHATTENTION_DISABLE_PAGEDKV", dict(page_size=64, num_heads_q=64), None),
    ("FLASH_ATTENTION_DISABLE_HDIMDIFF64", {}, None),
    ("FLASHATTENTION_DISABLE_VARLEN", {}, None),
])
def test_an_upstream_build_declares_what_it_was_built_with(monkeypatch, gen, flag, declined, accepted):
    """A build's ``FLASHATTENTION_DISABLE_*`` flags (``flash_attn_config``): what it left out is declined with the
    flag named, what it kept still runs, through the fake that refuses exactly what the real build would."""
    _install(monkeypatch, **{flag: True})
    try:
        reasons = FA3Backend.not_supported_reasons(_problem(**declined), H100)
        assert reasons and flag in str(reasons[0]), reasons
        if accepted is not None:
            assert not FA3Backend.not_supported_reasons(_problem(**accepted), H100)
            p = _problem(**accepted)
            case = make_case(2, 1, p.num_heads_q, 80, page_size=p.page_size, generator=gen)
            _check(case)
    finally:
        forget(FA3Backend)


@pytest.mark.parametrize("packaging", PACKAGINGS)
def test_pack_rows_decide_the_tma_path(monkeypatch, packaging):
    """FA3 takes whole pages by TMA where the page holds whole 64-token tiles and s_q * h_q / h_kv > 64 (rows packed
    per KV head): declined on every build (a NaN in an unused slot reaches the output there, measured on the H200);
    a build without the non-TMA paged path (FLASHATTENTION_DISABLE_PAGEDKV) then runs no paged problem at all."""
    def reasons(**over):
        return " ".join(map(str, FA3Backend.not_supported_reasons(_problem(**over), H100)))

    _install(monkeypatch, packaging)
    try:
        for tma in (dict(num_heads_q=128), dict(num_heads_q=64, q_len=2), dict(num_heads_q=128, page_size=128),
                    dict(num_heads_q=32, q_len=4, causal=True)):
            assert "paged-TMA path" in reasons(**tma), tma
        for other in (dict(num_heads_q=64), dict(num_heads_q=128, num_heads_kv=2), dict(num_heads_q=128, page_size=16),
                      dict(num_heads_q=128, page_size=96)):
            assert reasons(**other) == "", other
    finally:
        forget(FA3Backend)
    _install(monkeypatch, FLASHATTENTION_DISABLE_PAGEDKV=True)
    try:
        assert "FLASHATTENTION_DISABLE_PAGEDKV" in reasons(num_heads_q=64)
        assert "paged-TMA path" in reasons(num_heads_q=128)
    finally:
        forget(FA3Backend)


def test_vllm_without_its_fa3_kernels_is_unavailable(monkeypatch):
    """vLLM's vllm_flash_attn imports with FA2 alone (its _vllm_fa3_C missing): FA3 is then unavailable, with vLLM's
    own reason."""
    _install(monkeypatch, "vllm", FA3_MISSING=True)
    try:
        reasons = FA3Backend.availability_reasons()
        assert reasons and "vllm.vllm_flash_attn has no usable FA3: FA3 is unavaible due to" in reasons[0].message
        assert provider() is None
    finally:
        forget(FA3Backend)


def test_unavailable_reason_keeps_each_import_error(monkeypatch):
    for name in ("flash_attn_interface", "vllm", "vllm.vllm_flash_attn", "sgl_kernel", "sgl_kernel.flash_attn"):
        monkeypatch.setitem(sys.modules, name, None)
    forget(FA3Backend)
    try:
        reasons = FA3Backend.availability_reasons()
        assert len(reasons) == 1 and reasons[0].code is ReasonCode.UNAVAILABLE
        for module in ("flash_attn_interface", "vllm.vllm_flash_attn", "sgl_kernel.flash_attn"):
            assert f"import {module} failed: ModuleNotFoundError" in reasons[0].message
        assert FA3Backend.version() == "not installed"
        with pytest.raises(RuntimeError, match="FlashAttention-3 is not available: import flash_attn_interface failed"):
            FA3Backend.vendor()
    finally:
        forget(FA3Backend)


# -- on the GPU: the installed FA3 (a wheel, vLLM's, SGLang's, or the peer build of ci/build_fa3_peer.sh) --------


def _real_fa3():
    forget(FA3Backend)
    reasons = FA3Backend.availability_reasons()
    if reasons:
        pytest.skip(f"FlashAttention-3 not installed: {reasons[0]}")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("FA3's qv path needs an SM90 GPU")


GPU_CASES = [  # (page_size, q_len, h_q, h_kv, causal): the non-TMA paged path (the TMA one is declined), GQA packing, MTP
    (64, 1, 64, 1, False), (64, 1, 16, 1, False), (1, 1, 16, 1, False), (16, 2, 64, 1, True),
    (33, 4, 128, 1, True), (128, 1, 32, 2, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("page_size,q_len,h_q,h_kv,causal", GPU_CASES,
                         ids=[f"ps{c[0]}-s{c[1]}-h{c[2]}-hkv{c[3]}{'-causal' if c[4] else ''}" for c in GPU_CASES])
def test_real_fa3_on_gpu(gen, page_size, q_len, h_q, h_kv, causal):
    """The installed FA3 through mla_decode against the reference, then a CUDA graph of the plan's run, refreshed
    by update() for new lengths and replayed."""
    _real_fa3()
    case = make_case(8, q_len, h_q, 1000, num_heads_kv=h_kv, page_size=page_size, causal=causal, zero_len_rows=1,
                     device="cuda", generator=gen, softmax_scale=192**-0.5)
    out, lse = _check(case)
    plan = mla_dispatch.plan_decode(*case.args(), backend="fa3", **case.kwargs(), cuda_graph=True)
    o2, l2 = poisoned_outputs(case)
    plan.run(case.q, case.kv_cache, out=o2, lse=l2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(case.q, case.kv_cache, out=o2, lse=l2)
    shorter = (case.cache_seqlens - 300).clamp_min(0)
    plan.update(cache_seqlens=shorter)
    o2.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    report = compare_outputs(o2, l2, *case_reference(case, shorter), FA3Backend.TOLERANCE)
    assert report, report.message


@pytest.mark.gpu
def test_real_fa3_is_batch_invariant(gen):
    """``batch_invariant=True`` (num_splits=1): the longest request's bits alone and inside batches of 1-64 others."""
    from invariance import invariance_mismatches, random_batches

    _real_fa3()
    pool = make_case(65, 1, 16, 3000, device="cuda", generator=gen)
    target = int(pool.cache_seqlens.argmax())
    batches = random_batches(65, target, [1, 3, 16, 64, 64], gen)
    assert invariance_mismatches(pool, target, batches, backend="fa3") == []


@pytest.mark.gpu
def test_real_fa3_splits_when_not_invariant(gen):
    """The plan's own schedule (FA3's split heuristic, num_splits=0) on a batch too small to fill the GPU: the
    result still matches, and equals FA3 called without our scheduler metadata."""
    _real_fa3()
    case = make_case(2, 1, 16, 20000, varlen=False, device="cuda", generator=gen)
    out, lse = _check(case)
    plan = mla_dispatch.plan_decode(*case.args(), backend="fa3", **case.kwargs())
    assert plan.state.meta is not None or provider().module == "sgl_kernel.flash_attn"
    plan.state.meta = None  # FA3 schedules inside the call
    o2, l2 = plan.run(case.q, case.kv_cache)
    assert torch.equal(o2, out) and torch.equal(l2, lse)


@pytest.mark.gpu
def test_fa3_peer_in_bench_checks_then_times_the_direct_call(seed):
    """bench's "FA3 (direct)" row: FA3 called on the bench case as vLLM calls it, checked, then timed eagerly and as a
    CUDA graph."""
    from mla_dispatch.numerics.oracle import reference_attention
    from mla_dispatch.tools.bench import BenchConfig, make_bench_case
    from mla_dispatch.tools.peers import fa3_runs, time_fa3
    from mla_dispatch.tools.roofline import time_fn

    _real_fa3()
    case = make_bench_case(BenchConfig(4, 2, 16, 2048, varlen=True, causal=True), device="cuda", seed=seed)
    ref = reference_attention(case.q, case.kv_cache, case.block_table, case.cache_seqlens, causal=True,
                              softmax_scale=case.softmax_scale)
    assert fa3_runs(case)
    result = time_fa3(case, ref, time_fn, rep_ms=5)
    assert result["status"] == "ok", result["note"]
    assert result["us_graph"] > 0 and result["us_call"] > 0 and result["host_call_us"] > 0
    fp8 = make_bench_case(BenchConfig(2, 1, 16, 256, kv_format="fp8_e4m3"), device="cuda", seed=seed)
    assert not fa3_runs(fp8)
    # FA3's paged-TMA path (page 64, 128 rows per KV head), which the backend declines: timed on the cache with its
    # unused slots (NaN here) zeroed, and said so
    tma = make_bench_case(BenchConfig(3, 1, 128, 700, varlen=True), device="cuda", seed=seed)
    assert tma.kv_cache.isnan().any() and fa3_runs(tma)
    ref = reference_attention(tma.q, tma.kv_cache, tma.block_table, tma.cache_seqlens, softmax_scale=tma.softmax_scale)
    result = time_fa3(tma, ref, time_fn, rep_ms=5)
    assert result["status"] == "ok" and "unused slots zeroed" in result["note"], result["note"]
