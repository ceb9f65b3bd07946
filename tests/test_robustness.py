"""What a new user runs into (issue 45, item 5): each bug found trying the library from the outside, as a test.

1. ``out=`` with a strided last dim: the front end rejects it, naming ``out``, for backends that write rows with
   stride 1 (``MLABackend.ANY_OUT_STRIDES``); the others honour any strides.
2. ``PagedMLACache.append`` is all or nothing, whatever fails.
3. The Triton backend declines bf16 queries under Triton's interpreter (whose bf16 ``tl.dot`` is wrong).
4. ``softmax_scale`` must be finite and positive.
5. A float ``kv_scale`` becomes a device tensor once (at plan time, or on its first run), not on every
   ``DecodePlan.run``, so a CUDA-graph capture of ``run`` copies nothing from the host.

Cases that need Triton's interpreter run in one child process (``python tests/test_robustness.py SEED``, under
``TRITON_INTERPRET=1``), which prints one JSON line per case (``tests/conftest.py``, ``interpreter_child_results``).
"""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

import mla_dispatch
from mla_dispatch.backends.reference import ReferenceBackend
from mla_dispatch.kvcache.cache import CacheFullError, PagedMLACache
from mla_dispatch.numerics.cases import make_case
from mla_dispatch.numerics.oracle import reference_attention

BF = torch.bfloat16


# -- 1. out with a strided last dim ---------------------------------------------------------------------------------


def _strided_out(case, dtype):
    """A NaN-filled buffer twice as wide as ``out``, and ``out`` as its every other column."""
    b, s, h, _ = case.q.shape
    wide = torch.full((b, s, h, 2 * case.head_dim_v), float("nan"), dtype=dtype)
    return wide, wide[..., ::2]


def test_reference_honours_a_strided_out(gen):
    case = make_case(2, 1, 4, 30, page_size=8, generator=gen, head_dim_qk=64, head_dim_v=32)
    wide, out = _strided_out(case, BF)
    got, lse = mla_dispatch.mla_decode(*case.args(), **case.kwargs(), out=out, backend="reference")
    want, want_lse = reference_attention(*case.args(), **case.kwargs())
    assert got is out and torch.equal(out, want.to(BF)) and torch.equal(lse, want_lse)
    assert torch.isnan(wide[..., 1::2]).all()  # the columns between out's are not written


class _RowWriter(ReferenceBackend):
    """The reference declaring what the Triton and CUDA kernels declare: rows of ``out`` written with stride 1."""

    NAME = "row_writer_test"
    ANY_OUT_STRIDES = False


def test_strided_out_is_rejected_for_a_backend_that_writes_contiguous_rows(registered, gen):
    name = registered(_RowWriter)
    case = make_case(2, 1, 4, 30, page_size=8, generator=gen, head_dim_qk=64, head_dim_v=32)
    wide, out = _strided_out(case, BF)
    with pytest.raises(ValueError, match=r"out must be contiguous in its last dim \(stride 1\) for backend "
                                         r"'row_writer_test', got strides \[256, 256, 64, 2\]"):
        mla_dispatch.mla_decode(*case.args(), **case.kwargs(), out=out, backend=name)
    assert torch.isnan(wide).all()
    # any other strides are fine: out as a slice of a wider row
    wide = torch.full((2, 1, 4, 48), float("nan"), dtype=BF)
    got, _ = mla_dispatch.mla_decode(*case.args(), **case.kwargs(), out=wide[..., 8:40], backend=name)
    want, _ = reference_attention(*case.args(), **case.kwargs())
    assert torch.equal(got, want.to(BF)) and torch.isnan(wide[..., :8]).all() and torch.isnan(wide[..., 40:]).all()


def test_declared_out_strides():
    from mla_dispatch.dispatch.registry import get_backend

    assert get_backend("reference").ANY_OUT_STRIDES
    for name in ("triton", "cuda_sm90"):  # kernels that store rows of out with stride 1
        assert not get_backend(name).ANY_OUT_STRIDES


# -- 2. PagedMLACache.append is all or nothing ------------------------------------------------------------------------


def _cache_state(cache: PagedMLACache):
    return (cache.kv.clone(), list(cache._free), {k: (list(s.blocks), s.length) for k, s in cache._seqs.items()},
            cache.decode_inputs(list(cache._seqs)))


def _assert_unchanged(cache, before):
    kv, free, seqs, (table, lens) = before
    now_kv, now_free, now_seqs, (now_table, now_lens) = _cache_state(cache)
    assert torch.equal(now_kv.view(torch.uint8), kv.view(torch.uint8)), "cache data changed"
    assert now_free == free, "free list changed"
    assert now_seqs == seqs, "a sequence's blocks or length changed"
    assert torch.equal(now_table, table) and torch.equal(now_lens, lens)


def test_append_of_mixed_dtypes_writes_both_sequences(gen):
    """The bug: [bf16 tokens, fp8 tokens] for two sequences advanced both sequences, then failed to concatenate; the
    second then decoded 6 phantom zero tokens. Any float dtype per sequence is fine."""
    cache = PagedMLACache(8, 4, head_dim=64)
    for s in "ab":
        cache.add_sequence(s)
    a = (torch.randn(5, 64, generator=gen) / 4).to(BF)
    b = (torch.randn(6, 64, generator=gen) / 4).to(torch.float8_e4m3fn)
    cache.append(["a", "b"], [a, b])
    assert torch.equal(cache.gather("a")[:, 0], a.float())
    assert torch.equal(cache.gather("b")[:, 0], b.float())


@pytest.mark.parametrize("kv_format", ["bf16", "fp8_e4m3", "fp8_ds_mla"])
def test_failed_append_leaves_the_cache_as_it_was(kv_format, gen, monkeypatch):
    d = 576 if kv_format == "fp8_ds_mla" else 64
    cache = PagedMLACache(6, 4, head_dim=d, kv_format=kv_format, kv_scale=0.01 if kv_format == "fp8_e4m3" else None)
    for s in "abc":
        cache.add_sequence(s)
    cache.append(["a", "b"], [torch.randn(5, d, generator=gen) / 4, torch.randn(2, d, generator=gen) / 4])
    before = _cache_state(cache)
    ok = torch.randn(3, d, generator=gen) / 4
    failures = [
        (CacheFullError, dict(seq_id=["a", "c"], values=[ok, torch.randn(13, d)])),  # 1 + 4 blocks, 3 free
        (KeyError, dict(seq_id=["a", "z"], values=[ok, ok])),
        (ValueError, dict(seq_id=["a", "b"], values=[ok, torch.randn(3, d + 1)])),  # second sequence's shape
        (ValueError, dict(seq_id=["a", "b"], values=[ok, torch.ones(3, d, dtype=torch.int32)])),  # not float
        (ValueError, dict(seq_id=["a", "a"], values=[ok, ok])),
        (ValueError, dict(seq_id=["a", "b"], values=[ok])),
    ]
    for exc, kw in failures:
        with pytest.raises(exc):
            cache.append(**kw)
        _assert_unchanged(cache, before)
    # a failure while writing: encoding (quantising) any values but the first sequence's 3 tokens alone fails
    real = PagedMLACache._encode

    def encode_or_fail(self, values):
        if values.shape[0] != 3:
            raise RuntimeError("injected")
        return real(self, values)

    monkeypatch.setattr(PagedMLACache, "_encode", encode_or_fail)
    with pytest.raises(RuntimeError, match="injected"):
        cache.append(["c", "a"], [ok, ok[:2]])
    _assert_unchanged(cache, before)
    monkeypatch.setattr(PagedMLACache, "_encode", real)
    cache.append(["c", "a"], [ok, ok[:2]])  # and the cache still works
    assert cache.seq_len("c") == 3 and cache.seq_len("a") == 7
    assert torch.equal(cache.gather("c")[:2], cache.gather("a")[5:])  # the same values, stored alike


# -- 4. softmax_scale --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [math.inf, -math.inf, math.nan, 0.0, -0.1])
def test_non_finite_or_non_positive_softmax_scale_is_rejected(scale, gen):
    case = make_case(2, 1, 4, 30, page_size=8, generator=gen, head_dim_qk=64, head_dim_v=32)
    kwargs = dict(case.kwargs(), softmax_scale=scale)
    with pytest.raises(ValueError, match=r"softmax_scale must be a finite positive float"):
        mla_dispatch.mla_decode(*case.args(), **kwargs)
    with pytest.raises(ValueError, match=r"softmax_scale must be a finite positive float"):
        mla_dispatch.plan_decode(*case.args(), **kwargs)


# -- 5. a float kv_scale is converted once ------------------------------------------------------------------------------


def _no_host_to_device_conversion(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("run() converted a host value to a tensor")

    monkeypatch.setattr(torch, "tensor", refuse)  # how a float became a tensor in run()
    monkeypatch.setattr(mla_dispatch.api, "_as_scale_tensor", refuse)


def test_float_kv_scale_is_converted_at_plan_time_not_per_run(gen, monkeypatch):
    case = make_case(2, 1, 4, 30, page_size=8, generator=gen, head_dim_qk=64, head_dim_v=32, kv_format="fp8_e4m3")
    scale = float(case.kv_scale)
    kwargs = dict(case.kwargs(), kv_scale=scale)
    plan = mla_dispatch.plan_decode(*case.args(), **kwargs)
    want, want_lse = reference_attention(*case.args(), **case.kwargs())
    out = torch.empty(2, 1, 4, 32, dtype=BF)
    lse = torch.empty(2, 4, 1)
    other = scale * 2
    plan.run(case.q, case.kv_cache, kv_scale=other, out=out, lse=lse)  # a second layer's scale: converted once here
    with monkeypatch.context() as m:
        _no_host_to_device_conversion(m)
        for _ in range(2):
            plan.run(case.q, case.kv_cache, kv_scale=scale, out=out, lse=lse)
            assert torch.equal(out, want.to(BF)) and torch.equal(lse, want_lse)
            plan.run(case.q, case.kv_cache, kv_scale=other, out=out, lse=lse)
    with pytest.raises(ValueError, match=r"kv_scale must be a finite positive float, got inf"):
        plan.run(case.q, case.kv_cache, kv_scale=math.inf)
    with pytest.raises(ValueError, match=r"kv_scale must be a finite positive float, got nan"):
        mla_dispatch.plan_decode(*case.args(), **dict(kwargs, kv_scale=math.nan))


# -- validate=True with a plan checks the plan's table ------------------------------------------------------------------


def test_validate_with_a_plan_checks_the_plans_table(gen):
    """validate=True was ignored when a plan was passed: the plan's table (what run() reads) was never checked."""
    case = make_case(2, 1, 4, 30, page_size=8, generator=gen, head_dim_qk=64, head_dim_v=32)
    table = case.block_table.clone()
    table[1, 0] = case.kv_cache.shape[0]
    plan = mla_dispatch.plan_decode(case.q, case.kv_cache, table, case.cache_seqlens, **case.kwargs())
    with pytest.raises(ValueError, match=r"block_table has block ids outside .* rows \[1\]"):
        mla_dispatch.mla_decode(case.q, case.kv_cache, None, None, plan=plan, validate=True)
    out, lse = mla_dispatch.mla_decode(case.q, case.kv_cache, None, None, plan=plan)  # unchecked: request 1 is NaN
    assert torch.isnan(out[1]).all() and torch.isnan(lse[1]).all() and torch.isfinite(lse[0]).all()


# -- the cases that need Triton's interpreter (1 and 3), in a child process --------------------------------------------


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    from tests.conftest import interpreter_child_results

    return interpreter_child_results(__file__)


INTERPRETER_CASES = ["triton-strided-out-rejected", "triton-contiguous-out-ok", "triton-declines-bf16"]


@pytest.mark.parametrize("case_id", INTERPRETER_CASES)
def test_under_triton_interpreter(interpreter_results, case_id):
    rec = interpreter_results.get(case_id)
    assert rec is not None, f"case {case_id} did not report (child crashed?)"
    assert rec["ok"], rec["message"]


def _child_strided_out(seed: int):
    case = make_case(2, 1, 4, 40, page_size=16, dtype=torch.float16, generator=torch.Generator().manual_seed(seed))
    wide = torch.full((2, 1, 4, 1024), float("nan"), dtype=torch.float16)
    guard = torch.full((2, 1, 4, 1024), float("nan"), dtype=torch.float16)
    try:
        mla_dispatch.mla_decode(*case.args(), **case.kwargs(), out=wide[..., ::2], backend="triton")
    except ValueError as exc:
        ok = "out must be contiguous in its last dim (stride 1) for backend 'triton'" in str(exc)
        return ok and bool(torch.isnan(wide).all()), str(exc)
    return False, (f"no error; NaN left in out: {int(torch.isnan(wide[..., ::2]).sum())}, written between its "
                   f"columns: {int((~torch.isnan(wide[..., 1::2])).sum())}, guard written: "
                   f"{int((~torch.isnan(guard)).sum())}")


def _child_contiguous_out(seed: int):
    from mla_dispatch.numerics.tolerance import compare_outputs
    from mla_dispatch.backends.triton import TritonBackend

    case = make_case(2, 1, 4, 40, page_size=16, dtype=torch.float16, generator=torch.Generator().manual_seed(seed))
    wide = torch.full((2, 1, 8, 512), float("nan"), dtype=torch.float16)
    out = wide[:, :, ::2]  # heads strided, rows contiguous: fine
    got, lse = mla_dispatch.mla_decode(*case.args(), **case.kwargs(), out=out, backend="triton")
    rep = compare_outputs(got, lse, *reference_attention(*case.args(), **case.kwargs()), TritonBackend.TOLERANCE)
    return bool(rep) and got is out and bool(torch.isnan(wide[:, :, 1::2]).all()), rep.message


def _child_declines_bf16(seed: int):
    from mla_dispatch.dispatch.backend import ReasonCode
    from mla_dispatch.dispatch.select import NoBackendError

    case = make_case(1, 1, 2, 20, page_size=16, dtype=BF, generator=torch.Generator().manual_seed(seed))
    try:
        mla_dispatch.mla_decode(*case.args(), **case.kwargs(), backend="triton")
    except NoBackendError as exc:
        reasons = exc.report.candidates[0][2]
        ok = any(r.code is ReasonCode.DTYPE and "q dtype=bfloat16" in r.message and "TRITON_INTERPRET=1" in r.message
                 for r in reasons)
        return ok, str(exc)
    return False, "backend='triton' ran bf16 under the interpreter"


if __name__ == "__main__":
    _seed = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    for cid, fn in zip(INTERPRETER_CASES, (_child_strided_out, _child_contiguous_out, _child_declines_bf16)):
        try:
            ok, msg = fn(_seed)
        except Exception as exc:  # reported to the parent
            ok, msg = False, f"{type(exc).__name__}: {exc}"
        print(json.dumps({"id": cid, "ok": bool(ok), "message": msg}), flush=True)
