"""The host path of plan_decode / run (issue 55): what depends only on shapes is computed once per geometry and
reused, and nothing the per-geometry caches keep lets a wrong call through.

The in-house backends' frozen launch records are tested beside them (tests/test_launch_records.py).
"""

from __future__ import annotations

import pytest
import torch

import mla_dispatch
from mla_dispatch import api
from mla_dispatch.numerics.cases import make_case


def _case(gen, **kw):
    args = dict(batch=3, q_len=1, num_heads_q=4, seqlen=40, page_size=16)
    args.update(kw)
    return make_case(generator=gen, **args)


def test_the_problem_of_a_geometry_is_described_once(gen, monkeypatch):
    calls = []
    real = api.describe_inputs
    monkeypatch.setattr(api, "_problems", {})
    monkeypatch.setattr(api, "describe_inputs", lambda *a, **k: calls.append(1) or real(*a, **k))
    case = _case(gen)
    first = mla_dispatch.plan_decode(*case.args(), backend="reference", **case.kwargs())
    for _ in range(3):  # other tensors of the same geometry: the layers of one step, or the next step
        q, kv = case.q.clone(), case.kv_cache.clone()
        again = mla_dispatch.plan_decode(q, kv, case.block_table.clone(), case.cache_seqlens.clone(),
                                         backend="reference", **case.kwargs())
        assert again.problem is first.problem
    assert len(calls) == 1
    mla_dispatch.plan_decode(*case.args(), backend="reference", **dict(case.kwargs(), causal=True))
    assert len(calls) == 2  # another argument, another problem


@pytest.mark.parametrize("bad,match", [
    (lambda c: dict(q=c.q.transpose(2, 3).contiguous().transpose(2, 3)), r"q must be contiguous in its last dim"),
    (lambda c: dict(kv=c.kv_cache.float()), r"kv_cache.dtype"),
    (lambda c: dict(block_table=c.block_table.long()), r"block_table must be int32"),
    (lambda c: dict(cache_seqlens=c.cache_seqlens[:2]), r"cache_seqlens must be int32 \[batch=3\]"),
    (lambda c: dict(q=c.q[:, :, :, :512].contiguous()), r"kv_cache.shape\[-1\] \(D_qk\) must equal"),
], ids=["q-strides", "kv-dtype", "table-dtype", "lens-shape", "q-width"])
def test_a_cached_geometry_lets_no_other_through(gen, bad, match):
    case = _case(gen)
    mla_dispatch.plan_decode(*case.args(), backend="reference", **case.kwargs())  # the geometry is now cached
    args = dict(q=case.q, kv=case.kv_cache, block_table=case.block_table, cache_seqlens=case.cache_seqlens)
    args.update(bad(case))
    for _ in range(2):  # and a bad geometry is never cached as a good one
        with pytest.raises(ValueError, match=match):
            mla_dispatch.plan_decode(args["q"], args["kv"], args["block_table"], args["cache_seqlens"],
                                     backend="reference", **case.kwargs())
