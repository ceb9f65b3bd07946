"""Front-end validation (every documented error) and plan/run behaviour."""

import pytest
import torch

import mla_dispatch
from mla_dispatch.backends.reference import ReferenceBackend
from mla_dispatch.numerics.oracle import reference_attention
from mla_dispatch.dispatch.backend import BackendOption, BackendState
from mla_dispatch.numerics.cases import make_case, poisoned_outputs
from mla_dispatch.numerics.tolerance import compare_outputs
from oracle64 import naive_attention

BF = torch.bfloat16


def _inputs(B=2, s_q=1, h_q=4, D=64, nb=6, ps=8, h_kv=1, max_blocks=3):
    q = torch.randn(B, s_q, h_q, D, dtype=BF)
    kv = torch.randn(nb, ps, h_kv, D, dtype=BF)
    table = torch.arange(B * max_blocks, dtype=torch.int32).view(B, max_blocks) % nb
    lens = torch.full((B,), 10, dtype=torch.int32)
    return q, kv, table, lens


def _call(**overrides):
    q, kv, table, lens = _inputs()
    args = dict(q=q, kv_cache=kv, block_table=table, cache_seqlens=lens)
    kwargs = dict(head_dim_v=32)
    for k, v in overrides.items():
        (args if k in args else kwargs)[k] = v
    return mla_dispatch.mla_decode(args["q"], args["kv_cache"], args["block_table"], args["cache_seqlens"], **kwargs)


BAD_INPUTS = [
    ("q-rank", dict(q=torch.randn(2, 4, 64, dtype=BF)), ValueError, r"q must be 4-D \[batch, s_q, h_q, D_qk\], got shape \[2, 4, 64\]"),
    ("q-dtype", dict(q=torch.randn(2, 1, 4, 64)), ValueError, "q.dtype must be bfloat16 or float16, got float32"),
    ("q-stride", dict(q=torch.randn(2, 1, 64, 4, dtype=BF).transpose(2, 3)), ValueError, "q must be contiguous in its last dim"),
    ("s_q-0", dict(q=torch.randn(2, 0, 4, 64, dtype=BF)), ValueError, r"q.shape\[1\] \(s_q.*\) must be >= 1, got 0"),
    ("kv-dim", dict(kv_cache=torch.randn(6, 8, 1, 65, dtype=BF)), ValueError, r"kv_cache.shape\[-1\] \(D_qk\) must equal q.shape\[-1\]=64, got 65"),
    ("kv-rank", dict(kv_cache=torch.randn(6, 8 * 64, dtype=BF)), ValueError, "kv_cache must be .num_blocks, page_size, h_kv, D_qk."),
    ("kv-dtype", dict(kv_cache=torch.randn(6, 8, 1, 64, dtype=torch.float16)), ValueError, "kv_cache.dtype float16 does not match q.dtype bfloat16"),
    ("h_kv", dict(kv_cache=torch.randn(6, 8, 3, 64, dtype=BF)), ValueError, r"h_q=4 must be a multiple of h_kv \(kv_cache.shape\[2\]\)=3"),
    ("dv", dict(head_dim_v=65), ValueError, r"head_dim_v must be in \[1, D_qk=64\], got 65"),
    ("table-dtype", dict(block_table=torch.zeros(2, 3, dtype=torch.int64)), ValueError, "block_table must be int32 .batch, max_blocks., got shape .2, 3. int64"),
    ("table-batch", dict(block_table=torch.zeros(3, 3, dtype=torch.int32)), ValueError, r"block_table.shape\[0\] must equal batch=2"),
    ("seqlens", dict(cache_seqlens=torch.zeros(3, dtype=torch.int32)), ValueError, r"cache_seqlens must be int32 \[batch=2\], got shape \[3\] int32"),
    ("missing-table", dict(block_table=None), ValueError, "block_table and cache_seqlens are required unless sparse indices"),
    ("format", dict(kv_format="int4"), ValueError, "kv_format must be one of 'auto'"),
    ("format-dtype", dict(kv_format="fp8_e4m3", kv_scale=1.0), ValueError, "kv_cache.dtype must be float8_e4m3fn for kv_format='fp8_e4m3', got bfloat16"),
    ("scale-needed", dict(kv_cache=torch.zeros(6, 8, 1, 64, dtype=torch.float8_e4m3fn)), ValueError, "kv_scale is required for kv_format='fp8_e4m3'"),
    ("scale-unused", dict(kv_scale=0.5), ValueError, "kv_scale is only used with kv_format='fp8_e4m3'"),
    ("kv-scale-zero", dict(kv_cache=torch.zeros(6, 8, 1, 64, dtype=torch.float8_e4m3fn), kv_scale=0.0), ValueError, "kv_scale must be a finite positive float, got 0.0"),
    ("ds-mla-bytes", dict(kv_cache=torch.zeros(6, 8, 1, 600, dtype=torch.uint8)), ValueError, "kv_cache.shape.-1. must be 656 bytes"),
    ("indices", dict(indices=torch.zeros(2, 1, 4, dtype=torch.int64)), ValueError, r"indices must be int32 \[batch=2, s_q=1, topk\]"),
    ("sparse-causal", dict(q=torch.randn(2, 2, 4, 64, dtype=BF), indices=torch.zeros(2, 2, 4, dtype=torch.int32), causal=True), ValueError, "causal=True cannot be combined with sparse indices"),
    ("scale-neg", dict(softmax_scale=-1.0), ValueError, "softmax_scale must be a finite positive float, got -1.0"),
    ("q-type", dict(q=[1, 2]), TypeError, "q must be a torch.Tensor, got list"),
    ("seqlens-list", dict(cache_seqlens=[10, 7]), TypeError,
     r"cache_seqlens must be a torch.Tensor \(int32 \[batch\]\) on q's device, got list \(e.g. torch.tensor"),
    ("table-list", dict(block_table=[[0, 1, 2], [3, 4, 5]]), TypeError, r"block_table must be a torch.Tensor \(int32"),
    ("indices-list", dict(indices=[[[0, 1]], [[2, -1]]]), TypeError, r"indices must be a torch.Tensor \(int32"),
    ("backend", dict(backend="fastest"), ValueError, "unknown backend 'fastest'"),
]


@pytest.mark.parametrize("name,overrides,exc,match", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_raises_documented_error(name, overrides, exc, match):
    with pytest.raises(exc, match=match):
        _call(**overrides)


def test_good_call_passes_and_three_d_cache_means_one_kv_head(gen):
    q, kv, table, lens = _inputs()
    out4, lse4 = mla_dispatch.mla_decode(q, kv, table, lens, head_dim_v=32)
    out3, lse3 = mla_dispatch.mla_decode(q, kv[:, :, 0], table, lens, head_dim_v=32)
    assert torch.equal(out4, out3) and torch.equal(lse4, lse3)


def test_validate_names_offending_rows():
    q, kv, table, lens = _inputs()
    bad_table = table.clone()
    bad_table[1, 0] = 99
    with pytest.raises(ValueError, match=r"block ids outside \[0, 6\).*rows \[1\] \(row 1, columns \[0\]: \[99\]\)"):
        mla_dispatch.mla_decode(q, kv, bad_table, lens, head_dim_v=32, validate=True)
    # Garbage past a request's length is allowed: only ceil(L/ps) entries are checked.
    ok_table = table.clone()
    ok_table[:, 2] = 2147480000
    mla_dispatch.mla_decode(q, kv, ok_table, lens, head_dim_v=32, validate=True)
    with pytest.raises(ValueError, match=r"exceed the block table's capacity max_blocks\*page_size=24 in rows \[0\]: \[25\]"):
        mla_dispatch.mla_decode(q, kv, table, torch.tensor([25, 3], dtype=torch.int32), head_dim_v=32, validate=True)
    with pytest.raises(ValueError, match=r"cache_seqlens must be >= 0; rows \[1\]"):
        mla_dispatch.mla_decode(q, kv, table, torch.tensor([2, -3], dtype=torch.int32), head_dim_v=32, validate=True)
    with pytest.raises(ValueError, match=r"indices must be in \[-1, num_blocks\*page_size=48\); offending batch rows \[0\]"):
        mla_dispatch.mla_decode(q, kv, None, None, head_dim_v=32, validate=True,
                                indices=torch.tensor([[[48, 1]], [[0, -1]]], dtype=torch.int32))


def test_out_buffer_is_written_in_place_and_checked(gen):
    case = make_case(2, 1, 4, 30, page_size=8, generator=gen, head_dim_qk=64, head_dim_v=32)
    out = torch.full((2, 1, 4, 32), float("nan"), dtype=BF)
    got, lse = mla_dispatch.mla_decode(*case.args(), **case.kwargs(), out=out)
    assert got.data_ptr() == out.data_ptr()
    _assert_matches_float64(out, lse, case)
    with pytest.raises(ValueError, match=r"out must be \[2, 1, 4, 32\] torch.bfloat16"):
        mla_dispatch.mla_decode(*case.args(), **case.kwargs(), out=torch.empty(2, 1, 4, 32))


def _assert_matches_float64(out, lse, case, **replace):
    """``out``/``lse`` against the independent float64 oracle (tests/oracle64.py) at docs §5 tolerances."""
    report = compare_outputs(out, lse, *naive_attention(case, **replace), mla_dispatch.Tolerance())
    assert report, report.message


class _CountingReference(ReferenceBackend):
    """The reference, counting its runs; like triton and cuda_sm90 it takes only rows of ``out`` with stride 1."""

    NAME = "counting_reference_test"
    ANY_OUT_STRIDES = False
    runs = 0

    @classmethod
    def run(cls, state, *args, **kwargs):
        cls.runs += 1
        return super().run(state, *args, **kwargs)


def test_out_or_lse_that_overlaps_itself_is_refused_before_a_backend_runs(registered, gen):
    """An expanded lse once reached triton's kernel, which wrote every request's lse to one place."""
    name = registered(_CountingReference)
    case = make_case(3, 2, 4, 30, page_size=8, generator=gen, head_dim_qk=64, head_dim_v=32)
    plan = mla_dispatch.plan_decode(*case.args(), **case.kwargs(), backend=name)
    b, s_q, h = 3, 2, 4
    bad_lse = [torch.empty(1, h, s_q).expand(b, h, s_q), torch.empty(b, 1, s_q).expand(b, h, s_q),
               torch.empty(b, h * s_q)[:, :h * s_q - 1].as_strided((b, h, s_q), (h * s_q, 1, 1))]
    for lse in bad_lse:
        with pytest.raises(ValueError, match=r"lse must not overlap itself: its strides \["):
            plan.run(case.q, case.kv_cache, lse=lse)
    out = torch.empty(1, s_q, h, 32, dtype=BF).expand(b, s_q, h, 32)
    with pytest.raises(ValueError, match=r"out must not overlap itself: its strides \[0, "):
        plan.run(case.q, case.kv_cache, out=out)
    assert _CountingReference.runs == 0
    # Strided but disjoint: FlashMLA's own lse layout (heads outermost) and a slice of a wider out are written.
    lse = torch.full((h, b, s_q), float("nan")).transpose(0, 1)
    wide = torch.full((b, s_q, h, 40), float("nan"), dtype=BF)
    got, got_lse = plan.run(case.q, case.kv_cache, out=wide[..., :32], lse=lse)
    assert got_lse is lse and _CountingReference.runs == 1
    want_out, want_lse = reference_attention(*case.args(), **case.kwargs())
    assert torch.equal(got, want_out.to(BF)) and torch.equal(lse, want_lse)
    assert torch.isnan(wide[..., 32:].float()).all()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda_sm90"])
def test_gpu_backends_refuse_out_or_lse_that_overlaps_itself(backend, gen):
    """On the GPU backends, the bound fast path included (cuda_sm90's binding checks it too): nothing is written."""
    case = make_case(3, 2, 16, 300, generator=gen, device="cuda")
    try:
        plan = mla_dispatch.plan_decode(*case.args(), **case.kwargs(), backend=backend)
    except mla_dispatch.NoBackendError as exc:
        pytest.skip(str(exc)[:300])
    out = torch.full((3, 2, 16, 512), float("nan"), dtype=case.q.dtype, device="cuda")
    lse = torch.full((1, 16, 2), float("nan"), device="cuda")
    with pytest.raises(ValueError, match="lse must not overlap itself"):
        plan.run(case.q, case.kv_cache, out=out, lse=lse.expand(3, 16, 2))
    with pytest.raises(ValueError, match="out must not overlap itself"):
        plan.run(case.q, case.kv_cache, out=out[:1].expand(3, 2, 16, 512))
    torch.cuda.synchronize()
    assert torch.isnan(out.float()).all() and torch.isnan(lse).all()


class _NeverRuns(ReferenceBackend):
    """A backend whose plan, update and run fail the test: a batch of no request must reach none of them."""

    NAME = "never_runs_test"

    @classmethod
    def plan(cls, *args, **kwargs):
        raise AssertionError("plan was called for batch size 0")

    update = run = plan


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_batch_size_zero_returns_empty_outputs_without_a_backend_running(registered, gen, sparse):
    """Batch size 0 once raised IndexError in triton's split_kv_schedule (the reference returned empty tensors)."""
    never = registered(_NeverRuns)
    q = torch.randn(0, 2, 8, 64, generator=gen).to(BF)
    kv = torch.randn(5, 16, 1, 64, generator=gen).to(BF)
    table, lens = torch.zeros(0, 3, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)
    idx = torch.zeros(0, 2, 10, dtype=torch.int32) if sparse else None
    args = (q, kv, None, None) if sparse else (q, kv, table, lens)
    for backend in ("reference", never):
        out, lse = mla_dispatch.mla_decode(*args, head_dim_v=32, indices=idx, backend=backend)
        assert out.shape == (0, 2, 8, 32) and out.dtype == BF and lse.shape == (0, 8, 2) and lse.dtype == torch.float32
        plan = mla_dispatch.plan_decode(*args, head_dim_v=32, indices=idx, backend=backend, return_lse=False)
        assert plan.backend == backend
        if not sparse:
            plan.update(table.clone(), lens.clone())
        given = torch.empty(0, 2, 8, 32, dtype=BF)
        got, no_lse = plan.run(q, kv, indices=idx, out=given)
        assert got is given and no_lse is None
        with pytest.raises(ValueError, match=r"out must be \[0, 2, 8, 32\]"):
            plan.run(q, kv, indices=idx, out=torch.empty(1, 2, 8, 32, dtype=BF))
    with pytest.raises(ValueError, match="q"):  # the arguments are still checked
        mla_dispatch.mla_decode(q.float(), kv, table, lens, head_dim_v=32, backend=never)


@pytest.mark.gpu
def test_batch_size_zero_on_every_gpu_backend():
    q = torch.randn(0, 2, 16, 576, device="cuda").to(BF)
    kv = torch.randn(4, 64, 1, 576, device="cuda").to(BF)
    table, lens = torch.zeros(0, 2, dtype=torch.int32, device="cuda"), torch.zeros(0, dtype=torch.int32, device="cuda")
    ran = []
    for backend in mla_dispatch.registered_names():
        try:
            out, lse = mla_dispatch.mla_decode(q, kv, table, lens, causal=True, backend=backend)
        except mla_dispatch.NoBackendError:
            continue
        assert out.shape == (0, 2, 16, 512) and lse.shape == (0, 16, 2) and out.device.type == "cuda"
        ran.append(backend)
    assert "triton" in ran and "cuda_sm90" in ran, ran


def test_return_lse_false_gives_none(gen):
    case = make_case(2, 1, 4, 30, page_size=8, generator=gen, head_dim_qk=64, head_dim_v=32)
    out, lse = mla_dispatch.mla_decode(*case.args(), **case.kwargs(), return_lse=False)
    assert lse is None and out.shape == (2, 1, 4, 32)


def test_plan_once_run_many_and_checks_calls_against_plan(gen):
    case = make_case(3, 2, 8, 40, page_size=16, causal=True, generator=gen, head_dim_qk=64, head_dim_v=32)
    plan = mla_dispatch.plan_decode(*case.args(), **case.kwargs())
    assert plan.backend == "reference" and "page_size=16" in repr(plan)
    for _ in range(2):  # two "layers" with different data
        q = (torch.randn(case.q.shape, generator=gen) / 10).to(BF)
        kv = case.kv_cache.clone()
        kv[~torch.isnan(kv)] = (torch.randn(int((~torch.isnan(kv)).sum()), generator=gen) / 10).to(BF)
        out, lse = poisoned_outputs(case)
        got, got_lse = plan.run(q, kv, out=out, lse=lse)
        assert got is out and got_lse is lse
        _assert_matches_float64(out, lse, case, q=q, kv_cache=kv)
    with pytest.raises(ValueError, match=r"q must be \[3, 2, 8, 64\] torch.bfloat16 as planned"):
        plan.run(case.q[:2], case.kv_cache)
    with pytest.raises(ValueError, match=r"kv_cache must be \[num_blocks, 16, 1, 64\]"):
        plan.run(case.q, case.kv_cache[:, :8])
    with pytest.raises(ValueError, match="indices were given but the plan is dense"):
        plan.run(case.q, case.kv_cache, indices=torch.zeros(3, 2, 4, dtype=torch.int32))


def test_plan_update_sees_new_lengths(gen):
    case = make_case(2, 1, 4, 40, page_size=8, varlen=False, generator=gen, head_dim_qk=64, head_dim_v=32)
    plan = mla_dispatch.plan_decode(*case.args(), **case.kwargs())
    shorter = torch.tensor([5, 0], dtype=torch.int32)
    plan.update(cache_seqlens=shorter)
    assert plan.cache_seqlens.tolist() == [5, 0]
    out, lse = poisoned_outputs(case)
    plan.run(case.q, case.kv_cache, out=out, lse=lse)
    _assert_matches_float64(out, lse, case, cache_seqlens=shorter)
    assert torch.isposinf(lse[1]).all() and (out[1] == 0).all()
    with pytest.raises(ValueError, match="cache_seqlens must keep the planned shape"):
        plan.update(cache_seqlens=torch.zeros(3, dtype=torch.int32))


@pytest.mark.parametrize("kv_format", ["fp8_e4m3", "fp8_ds_mla"])
def test_quantised_formats_are_inferred_from_the_cache(kv_format, gen):
    case = make_case(2, 1, 4, 30, page_size=16, kv_format=kv_format, generator=gen)
    kwargs = case.kwargs()
    kwargs["kv_format"] = "auto"
    out, lse = mla_dispatch.mla_decode(*case.args(), **kwargs, out=poisoned_outputs(case)[0])
    _assert_matches_float64(out, lse, case)


# -- the eager fast path (MLABackend.bind) ----------------------------------------------------------


class _BoundReference(ReferenceBackend):
    """The reference with a bound eager path that behaves like cuda_sm90's PlannedDecode.run: it accepts
    exactly the planned shapes and dtypes (else returns None, having written nothing) and writes the
    reference's result into out and lse (new tensors where they are None)."""

    NAME = "bound_reference_test"
    calls: list = []

    @classmethod
    def bind(cls, state, problem, kv_dtype, table, lens, *, softmax_scale):
        p = problem

        def run(q, kv, kv_scale, out, lse):
            cls.calls.append(dict(kv=kv, kv_scale=kv_scale, out=out, lse=lse))
            if (q.shape != (p.batch, p.q_len, p.num_heads_q, p.head_dim_qk) or q.dtype != p.q_dtype or kv.dim() != 4
                    or kv.shape[1:] != (p.page_size, p.num_heads_kv, p.head_dim_qk) or kv.dtype != kv_dtype):
                return None
            o, ls = reference_attention(q, kv, table, lens, head_dim_v=p.head_dim_v, softmax_scale=softmax_scale,
                                        causal=p.causal, kv_format=p.kv_format, kv_scale=kv_scale)
            out = o.to(q.dtype) if out is None else out.copy_(o)
            return out, ls if lse is None else lse.copy_(ls)

        return run

    @classmethod
    def run(cls, state, *args, **kwargs):
        cls.slow_runs += 1
        return super().run(state, *args, **kwargs)


def _bound_plan(registered, gen, kv_format="bf16", **plan_kw):
    _BoundReference.calls, _BoundReference.slow_runs = [], 0
    name = registered(_BoundReference)
    case = make_case(2, 1, 4, 30, page_size=8, generator=gen, head_dim_qk=64, head_dim_v=32, kv_format=kv_format)
    return case, mla_dispatch.plan_decode(*case.args(), **case.kwargs(), **plan_kw, backend=name)


def test_fast_path_runs_the_bound_call_and_only_it(registered, gen):
    case, plan = _bound_plan(registered, gen)
    out = torch.full((2, 1, 4, 32), float("nan"), dtype=BF)
    got, lse = plan.run(case.q, case.kv_cache[:, :, 0], out=out)  # a 3-D cache reaches the bound call as 4-D
    want_out, want_lse = reference_attention(*case.args(), **case.kwargs())
    assert got is out and torch.equal(out, want_out.to(BF)) and torch.equal(lse, want_lse)
    assert len(_BoundReference.calls) == 1 and _BoundReference.calls[0]["kv"].dim() == 4
    assert _BoundReference.slow_runs == 0


def test_fast_path_declines_and_the_checked_path_names_the_argument(registered, gen):
    case, plan = _bound_plan(registered, gen)
    with pytest.raises(ValueError, match=r"q must be \[2, 1, 4, 64\] torch.bfloat16 as planned"):
        plan.run(case.q[:1], case.kv_cache)
    with pytest.raises(ValueError, match=r"kv_cache must be \[num_blocks, 8, 1, 64\]"):
        plan.run(case.q, case.kv_cache[:, :4])
    assert len(_BoundReference.calls) == 2 and _BoundReference.slow_runs == 0  # both declined, nothing ran


def test_fast_path_is_skipped_for_float_scales_and_dispatch_modes(registered, gen):
    from torch.utils._python_dispatch import TorchDispatchMode

    class PassThrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    case, plan = _bound_plan(registered, gen, kv_format="fp8_e4m3")
    want_out, want_lse = reference_attention(*case.args(), **case.kwargs())
    out, lse = plan.run(case.q, case.kv_cache, kv_scale=float(case.kv_scale))  # a float: the checked path
    assert _BoundReference.calls == [] and _BoundReference.slow_runs == 1
    assert torch.equal(out, want_out.to(BF)) and torch.equal(lse, want_lse)
    with PassThrough():
        plan.run(case.q, case.kv_cache, kv_scale=case.kv_scale)
    assert _BoundReference.calls == [] and _BoundReference.slow_runs == 2
    out, lse = plan.run(case.q, case.kv_cache, kv_scale=case.kv_scale)  # a tensor scale: the fast path
    assert len(_BoundReference.calls) == 1 and _BoundReference.calls[0]["kv_scale"] is case.kv_scale
    assert _BoundReference.slow_runs == 2 and torch.equal(out, want_out.to(BF)) and torch.equal(lse, want_lse)


def test_fast_path_writes_an_unrequested_lse_into_the_plans_buffer(registered, gen):
    case, plan = _bound_plan(registered, gen, return_lse=False)
    for _ in range(2):
        out, lse = plan.run(case.q, case.kv_cache)
        assert lse is None
    first, second = (c["lse"] for c in _BoundReference.calls)
    assert first is second is not None  # the plan's own buffer: no allocation per call
    want_out, _ = reference_attention(*case.args(), **case.kwargs())
    assert torch.equal(out, want_out.to(BF))
    given = torch.empty(2, 4, 1)
    _, lse = plan.run(case.q, case.kv_cache, lse=given)
    assert lse is given and _BoundReference.calls[-1]["lse"] is given


def test_fast_path_shows_in_a_torch_profiler_trace(registered, gen):
    """The bound call skips the dispatcher, so a profiled run gets a named range instead (and still takes the fast
    path); unprofiled runs add nothing."""
    case, plan = _bound_plan(registered, gen)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out, _ = plan.run(case.q, case.kv_cache)
    names = [e.name for e in prof.events()]
    assert f"mla_dispatch::{plan.backend}_decode (bound)" in names
    assert len(_BoundReference.calls) == 1 and _BoundReference.slow_runs == 0
    want_out, _ = reference_attention(*case.args(), **case.kwargs())
    assert torch.equal(out, want_out.to(BF))


# -- backend_options: a named backend's declared planning options ---------------------------------------------


class _OptionsReference(ReferenceBackend):
    """The reference with two planning options, which its plan records."""

    NAME = "options_reference_test"
    OPTIONS = {"mode": BackendOption(values=("a", "b"), doc="a test choice"),
               "fused": BackendOption(values=(False, True), doc="a test switch")}

    @classmethod
    def plan(cls, problem, platform, block_table, cache_seqlens, *, softmax_scale, options):
        if options.get("mode") == "b" and problem.num_heads_q > 2:
            raise ValueError("backend_options['mode']='b' needs h_q <= 2")
        return BackendState(options=options)


def test_backend_options_reach_the_plan_and_are_recorded(registered, gen):
    name = registered(_OptionsReference)
    case = make_case(2, 1, 2, 30, page_size=8, generator=gen, head_dim_qk=64, head_dim_v=32)
    plan = mla_dispatch.plan_decode(*case.args(), **case.kwargs(), backend=name,
                                    backend_options={"mode": "b", "fused": True})
    assert plan.state.options == {"mode": "b", "fused": True}
    assert dict(plan.backend_options) == {"mode": "b", "fused": True}
    with pytest.raises(TypeError):
        plan.backend_options["mode"] = "a"  # read-only: the plan was made for these
    assert "backend_options={'mode': 'b', 'fused': True}" in repr(plan)
    plain = mla_dispatch.plan_decode(*case.args(), **case.kwargs(), backend=name)
    assert plain.state.options == {} and dict(plain.backend_options) == {}
    out, _ = mla_dispatch.mla_decode(*case.args(), **case.kwargs(), backend=name, backend_options={"mode": "a"})
    want_out, _ = reference_attention(*case.args(), **case.kwargs())
    assert torch.equal(out, want_out.to(BF))


@pytest.mark.parametrize("options,match", [
    ({"mdoe": "a"}, r"options_reference_test has no option 'mdoe' \(accepted: fused, mode\)"),
    ({"mode": "c"}, r"backend_options\['mode'\]='c' \(supported: 'a', 'b'\): a test choice"),
    ({"fused": 1}, r"backend_options\['fused'\]=1 \(supported: False, True\)"),  # 1 is not True
    ({"mode": "b"}, r"backend_options\['mode'\]='b' needs h_q <= 2"),  # the plan's own check of the problem
], ids=["unknown", "value", "type", "problem"])
def test_bad_backend_options_raise(registered, gen, options, match):
    name = registered(_OptionsReference)
    case = make_case(2, 1, 4, 30, page_size=8, generator=gen, head_dim_qk=64, head_dim_v=32)
    with pytest.raises(ValueError, match=match):
        mla_dispatch.plan_decode(*case.args(), **case.kwargs(), backend=name, backend_options=options)


def test_backend_options_need_a_named_backend_that_declares_them(gen):
    case = make_case(2, 1, 4, 30, page_size=8, generator=gen, head_dim_qk=64, head_dim_v=32)
    with pytest.raises(ValueError, match="need a named backend"):
        mla_dispatch.plan_decode(*case.args(), **case.kwargs(), backend_options={"variant": 2})
    with pytest.raises(ValueError, match=r"reference has no option 'variant' \(accepted: none\)"):
        mla_dispatch.mla_decode(*case.args(), **case.kwargs(), backend="reference", backend_options={"variant": 2})
    # the named backend's options are checked before anything else, even where it cannot run
    with pytest.raises(ValueError, match=r"cuda_sm90 has no option 'varaint'"):
        mla_dispatch.plan_decode(*case.args(), **case.kwargs(), backend="cuda_sm90", backend_options={"varaint": 2})
