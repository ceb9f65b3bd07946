"""Each in-house backend's plan freezes its launch record (STYLE.md 19; issue 55): after planning, nothing is
re-decided in ``run`` and ``run`` reads no environment. Every function that decides a launch is replaced by one that
raises, the environment by one that records who reads it from mla_dispatch, and the plan runs.

- cuda_sm90 (CPU): the plan is made with the extension replaced by a recorder (the test's stand-in for the GPU);
  the launch ``run`` hands the extension must be the record the plan froze. GPU (``gpu``): the real kernels, checked
  against the reference.
- triton: under Triton's interpreter (a child process, ``python tests/test_launch_records.py SEED``), the plan's
  frozen launch runs the kernels and must match the reference; GPU (``gpu``) the same on the device's kernels
  (Gluon's among them).
"""

from __future__ import annotations

import collections.abc
import dataclasses
import json
import os
import pathlib
import re
import sys
import types

import pytest
import torch

import mla_dispatch
from mla_dispatch.numerics.cases import case_reference, make_case, poisoned_outputs
from mla_dispatch.numerics.tolerance import compare_outputs

PACKAGE = str(pathlib.Path(mla_dispatch.__file__).resolve().parent)

#: the functions that decide a launch, by module
CUDA_SM90_CHOOSERS = ("choose_variant", "invariant_variant", "choose_fuse_combine", "launch_config", "split_parts",
                      "fuse_combine_reasons", "_shape_plan")
TRITON_CHOOSERS = {
    "mla_dispatch.kernels.triton.decode": ("choose_config", "tma_applies", "q_tma_applies", "tma_fits",
                                           "launch_decode_kernel"),
    "mla_dispatch.kernels.triton.launch": ("choose_launch", "kernel_reasons", "_config_for", "prepare"),
    "mla_dispatch.kernels.triton.gluon_sm90": ("gluon_possible", "gluon_applies"),
    "mla_dispatch.kernels.triton.gluon_seesaw": ("seesaw_applies",),
    "mla_dispatch.kernels.triton.gluon_fp8": ("fp8t_applies",),
    "mla_dispatch.backends.triton": ("_shape_plan", "_split_layout"),
}


class WatchedEnviron(collections.abc.MutableMapping):
    """``os.environ`` that records reads made from mla_dispatch's own files (Triton's and torch's are theirs)."""

    def __init__(self, real):
        self.real, self.ours = real, []

    def _note(self, key):
        frame = sys._getframe(2)
        if frame.f_code.co_filename.startswith(PACKAGE):
            self.ours.append((key, f"{frame.f_code.co_filename}:{frame.f_lineno}"))

    def __getitem__(self, key):
        self._note(key)
        return self.real[key]

    def get(self, key, default=None):
        self._note(key)
        return self.real.get(key, default)

    def __contains__(self, key):
        self._note(key)
        return key in self.real

    def __setitem__(self, key, value):
        self.real[key] = value

    def __delitem__(self, key):
        del self.real[key]

    def __iter__(self):
        return iter(self.real)

    def __len__(self):
        return len(self.real)


def freeze_choices(monkeypatch, modules: dict[str, tuple[str, ...]]) -> WatchedEnviron:
    """Replace every named chooser by one that raises, and the environment by a recorder; returns the recorder."""
    import importlib

    for module, names in modules.items():
        mod = importlib.import_module(module)
        for name in names:
            if not hasattr(mod, name):
                continue

            def refuse(*args, _name=f"{module}.{name}", **kwargs):
                raise AssertionError(f"{_name} was called after planning")

            monkeypatch.setattr(mod, name, refuse)
    watched = WatchedEnviron(os.environ)
    monkeypatch.setattr(os, "environ", watched)
    return watched


# --------------------------------------------------------------------------------------
# cuda_sm90
# --------------------------------------------------------------------------------------


def _sm90_problem(**kw):
    from mla_dispatch.dispatch.problem import DecodeProblem

    args = dict(batch=4, q_len=1, num_heads_q=128, num_heads_kv=1, head_dim_qk=576, head_dim_v=512, page_size=64,
                max_blocks=64, q_dtype=torch.bfloat16, kv_format="bf16", causal=False, topk=0, return_lse=True,
                device_type="cuda")
    args.update(kw)
    return DecodeProblem(**args)


@pytest.mark.parametrize("kw", [dict(), dict(batch=64, num_heads_q=16), dict(kv_format="fp8_e4m3", num_heads_q=32),
                                dict(batch=128, q_len=2, causal=True)],
                         ids=["b4-h128", "b64-h16", "fp8-h32", "b128-s2-causal"])
def test_cuda_sm90_run_launches_the_frozen_record(monkeypatch, kw):
    from mla_dispatch.backends import cuda_sm90
    from mla_dispatch.dispatch.platform import Platform

    launches = []

    def extension_call(*args):  # the extension's cuda_sm90_decode, recorded (its argument list: the op's schema)
        launches.append(args)

    module = types.SimpleNamespace(cuda_sm90_decode=extension_call)
    monkeypatch.setattr(cuda_sm90, "load_module", lambda: module)
    monkeypatch.setattr(cuda_sm90, "load_ops", lambda: types.SimpleNamespace(
        cuda_sm90_decode=types.SimpleNamespace(default=None)))
    p = _sm90_problem(**kw)
    h100 = Platform("cuda", "NVIDIA H100 80GB HBM3", (9, 0), "sm_90", 132)
    lens = torch.randint(0, p.max_blocks * p.page_size, (p.batch,), dtype=torch.int32)
    table = torch.zeros(p.batch, p.max_blocks, dtype=torch.int32)
    state = cuda_sm90.CudaSM90Backend.plan(p, h100, table, lens, softmax_scale=0.1, options={})
    frozen = state.launch
    watched = freeze_choices(monkeypatch, {"mla_dispatch.backends.cuda_sm90": CUDA_SM90_CHOOSERS})
    q = torch.zeros(p.batch, p.q_len, p.num_heads_q, 576, dtype=torch.bfloat16)
    kv = torch.zeros(8, p.page_size, 1, 576, dtype=torch.bfloat16 if p.kv_format == "bf16" else torch.float8_e4m3fn)
    out = torch.empty(p.batch, p.q_len, p.num_heads_q, 512, dtype=torch.bfloat16)
    lse = torch.empty(p.batch, p.num_heads_q, p.q_len)
    scale = torch.ones(1) if p.kv_format == "fp8_e4m3" else None
    for _ in range(2):
        cuda_sm90.CudaSM90Backend.run(state, q, kv, table, lens, problem=p, softmax_scale=0.1, kv_scale=scale,
                                      indices=None, out=out, lse=lse)
    assert watched.ours == []
    assert len(launches) == 2 and tuple(launches[0][13:]) == tuple(launches[1][13:])
    args = launches[0]
    # (..., variant, tile_rows, tma_loads, paired, fuse_combine, fixed_splits, sparse): the plan's record
    assert tuple(args[16:22]) == dataclasses.astuple(frozen)
    assert args[3] is state.split.lengths  # the plan's own lengths (docs/design.md §2)
    assert args[4] is state.schedule.items and args[11] is state.schedule.num_splits


ENVIRONMENT_READ = re.compile(r"\bos\.environ\b|\bgetenv\b|\benviron\[|\benviron\.get\b")


def test_cuda_sm90_reads_no_environment():
    """No process-wide switch: the plan's choices come from the problem and backend_options."""
    source = pathlib.Path(PACKAGE, "backends", "cuda_sm90.py").read_text()
    assert not ENVIRONMENT_READ.search(source)


# --------------------------------------------------------------------------------------
# triton
# --------------------------------------------------------------------------------------


def test_triton_launch_path_reads_no_environment():
    """The modules a triton run goes through hold no environment switch (the kernel is the plan's, or
    backend_options')."""
    for name in ("decode.py", "launch.py", "gluon_sm90.py", "gluon_seesaw.py", "gluon_fp8.py", "combine.py", "ops.py"):
        source = pathlib.Path(PACKAGE, "kernels", "triton", name).read_text()
        assert not ENVIRONMENT_READ.search(source), name
    for name in ("triton_launch.py", "split_plan.py"):
        assert not ENVIRONMENT_READ.search(pathlib.Path(PACKAGE, "metadata", name).read_text()), name


INTERPRETER_CASES = [
    ("gather-fp16-b3xs2xh4-ps16-causal", dict(batch=3, q_len=2, num_heads_q=4, seqlen=40, page_size=16, causal=True),
     {}),
    ("tma-fp16-b2xs1xh4-ps16", dict(batch=2, q_len=1, num_heads_q=4, seqlen=75, page_size=16, varlen=False),
     dict(config=dict(block_m=16, block_n=16, num_warps=4, num_stages=2, tma=True, chunk_size=16))),
    ("gather-fp8-b2xs1xh2-ps16", dict(batch=2, q_len=1, num_heads_q=2, seqlen=30, page_size=16,
                                      kv_format="fp8_e4m3"), {}),
    ("gather-sparse-b2xs2xh2-topk20", dict(batch=2, q_len=2, num_heads_q=2, seqlen=30, page_size=16, topk=20), {}),
    # DeepSeek-V4's cache and optional arguments: the plan fixes which are given (HAS_* constexprs), each run passes its
    # own tensors (the second run another layer's sink and top-k lengths); split rows merged with the sink too
    ("gather-v4-b2xs2xh4-topk32-extra", dict(batch=2, q_len=2, num_heads_q=4, seqlen=60, page_size=16, topk=32,
                                             topk_length=True, attn_sink=True, extra_topk=16, extra_page_size=3,
                                             extra_topk_length=True, head_dim_qk=512, head_dim_v=512,
                                             kv_format="fp8_ds_v4"), {}),
    # pages of 576 tokens, as FlashMLA's DeepSeek-V4 tests make them (past the dense kernels' 256)
    ("gather-v4-b2xs1xh4-topk32-ps576", dict(batch=2, q_len=1, num_heads_q=4, seqlen=700, page_size=576, topk=32,
                                            attn_sink=True, head_dim_qk=512, head_dim_v=512, kv_format="fp8_ds_v4"),
     {}),
    ("gather-v4-b2xs1xh4-topk48-split", dict(batch=2, q_len=1, num_heads_q=4, seqlen=60, page_size=16, topk=48,
                                             topk_length=True, attn_sink=True, head_dim_qk=512, head_dim_v=512,
                                             kv_format="fp8_ds_v4"), dict(num_parts=6, overhead=1)),
]


def _another_layer(case):
    """``case`` with another layer's per-call sparse arguments: another sink, shorter top-k lengths (what a plan must
    not keep from its first run)."""
    if case.attn_sink is None and case.topk_length is None:
        return case
    return dataclasses.replace(
        case, attn_sink=None if case.attn_sink is None else case.attn_sink.flip(0) + 0.5,
        topk_length=None if case.topk_length is None else case.topk_length // 2)


def _triton_frozen_problems(case, plan, kernel: str | None = None) -> list[str]:
    """Run ``plan`` twice with every chooser refusing and the environment watched; the broken expectations."""
    mp = pytest.MonkeyPatch()
    problems = []
    try:
        watched = freeze_choices(mp, TRITON_CHOOSERS)
        for layer in (case, _another_layer(case)):
            ref = case_reference(layer)
            out, lse = poisoned_outputs(layer)
            plan.run(layer.q, layer.kv_cache, kv_scale=layer.kv_scale, indices=layer.indices, out=out, lse=lse,
                     **layer.sparse_extras())
            report = compare_outputs(out, lse, *ref, _triton_tolerance())
            if not report:
                problems.append(report.message)
        if watched.ours:
            problems.append(f"run read the environment: {watched.ours[:3]}")
    except AssertionError as exc:
        problems.append(str(exc))
    finally:
        mp.undo()
    if plan.state.prepared.kind != plan.state.launch.kernel:
        problems.append(f"ran {plan.state.prepared.kind}, the plan froze {plan.state.launch}")
    if kernel is not None and plan.state.launch.kernel != kernel:
        problems.append(f"the plan froze {plan.state.launch.kernel}, not {kernel}")
    return problems


def _triton_tolerance():
    from mla_dispatch.backends.triton import TritonBackend

    return TritonBackend.TOLERANCE


def _run_cases(seed: int) -> None:
    """Child process (TRITON_INTERPRET=1): one JSON line per case."""
    from mla_dispatch.backends.triton import TritonBackend
    from mla_dispatch.kernels.triton.decode import KernelConfig

    for i, (cid, kw, overrides) in enumerate(INTERPRETER_CASES):
        try:
            case = make_case(dtype=torch.float16, generator=torch.Generator().manual_seed(seed + i), **kw)
            plan = mla_dispatch.plan_decode(*case.args(), backend="triton", **case.kwargs())
            if overrides:
                overrides = dict(overrides)
                if "config" in overrides:
                    overrides["config"] = KernelConfig(**overrides["config"])
                plan._state = TritonBackend.make_state(plan.problem, plan.platform, plan.cache_seqlens,
                                                       block_table=plan.block_table, softmax_scale=plan.softmax_scale,
                                                       **overrides)
            problems = _triton_frozen_problems(case, plan, cid.split("-")[0])
            if cid.endswith("-split") and not bool((plan.state.schedule.num_splits > 1).any()):
                problems.append("the schedule split no request (the combine's sink is not exercised)")
            msg = "; ".join(problems)[:4000]
        except Exception as exc:  # reported to the parent
            problems, msg = [exc], f"{type(exc).__name__}: {exc}"
        print(json.dumps({"id": cid, "ok": not problems, "message": msg}), flush=True)


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    from tests.conftest import interpreter_child_results

    return interpreter_child_results(__file__)


@pytest.mark.parametrize("case_id", [c[0] for c in INTERPRETER_CASES])
def test_triton_run_launches_the_frozen_record_under_interpreter(interpreter_results, case_id):
    rec = interpreter_results.get(case_id)
    assert rec is not None, f"case {case_id} did not report (child crashed?)"
    assert rec["ok"], rec["message"]


# --------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------

GPU_TRITON_CASES = [  # (make_case kwargs, the family the plan must freeze on an H100 / H200)
    (dict(batch=4, q_len=1, num_heads_q=128, seqlen=700, page_size=64), "seesaw"),
    (dict(batch=4, q_len=2, num_heads_q=64, seqlen=700, page_size=16, causal=True), "gluon"),
    (dict(batch=4, q_len=1, num_heads_q=16, seqlen=700, page_size=64, kv_format="fp8_e4m3"), "fp8t"),
    (dict(batch=4, q_len=1, num_heads_q=64, seqlen=700, page_size=64, kv_format="fp8_ds_mla"), "gather"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("kw,kernel", GPU_TRITON_CASES, ids=[k for _, k in GPU_TRITON_CASES])
def test_triton_gpu_run_launches_the_frozen_record(kw, kernel, gen):
    case = make_case(device="cuda", generator=gen, **kw)
    plan = mla_dispatch.plan_decode(*case.args(), backend="triton", **case.kwargs())
    assert _triton_frozen_problems(case, plan, kernel) == []


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [dict(batch=4, num_heads_q=128), dict(batch=64, num_heads_q=16),
                                dict(batch=8, num_heads_q=32, kv_format="fp8_e4m3")], ids=["h128", "h16", "fp8-h32"])
def test_cuda_sm90_gpu_run_launches_the_frozen_record(kw, gen, monkeypatch):
    from mla_dispatch.backends.cuda_sm90 import CudaSM90Backend

    case = make_case(q_len=1, seqlen=900, page_size=64, device="cuda", generator=gen, **kw)
    plan = mla_dispatch.plan_decode(*case.args(), backend="cuda_sm90", **case.kwargs())
    if reasons := CudaSM90Backend.availability_reasons():
        pytest.skip(str(reasons[0]))
    ref = case_reference(case)
    watched = freeze_choices(monkeypatch, {"mla_dispatch.backends.cuda_sm90": CUDA_SM90_CHOOSERS})
    for _ in range(2):
        out, lse = poisoned_outputs(case)
        plan.run(case.q, case.kv_cache, kv_scale=case.kv_scale, out=out, lse=lse)
        report = compare_outputs(out, lse, *ref, CudaSM90Backend.TOLERANCE)
        assert report, report.message
    assert watched.ours == []


if __name__ == "__main__":
    _run_cases(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
