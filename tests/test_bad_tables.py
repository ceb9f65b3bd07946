"""The catalogue of bad block tables and lengths (``ci/bad_tables.py``) on a CPU.

The reference runs every case here; the Triton kernel runs a selection under Triton's interpreter in a child
process (``python tests/test_bad_tables.py SEED``, one JSON line per run: ``tests/conftest.py``,
``interpreter_child_results``), float16 (the interpreter's bf16 ``tl.dot`` is wrong), with the kernel paths the
interpreter can take forced where the default plan would not: split schedules (the combine of a NaN piece), whole tiles
by TMA, tokens on M with the V split. On the GPU, ``ci/bad_tables.py`` itself runs under compute-sanitizer.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import sys

from types import MappingProxyType

import pytest
import torch

from mla_dispatch.backends.reference import ReferenceBackend
from mla_dispatch.dispatch.backend import BackendOption

_PATH = pathlib.Path(__file__).resolve().parent.parent / "ci" / "bad_tables.py"


def _catalogue():
    """``ci/bad_tables.py`` as a module (ci/ is no package)."""
    module = sys.modules.get("bad_tables")
    if module is None:
        spec = importlib.util.spec_from_file_location("bad_tables", _PATH)
        module = importlib.util.module_from_spec(spec)
        sys.modules["bad_tables"] = module
        spec.loader.exec_module(module)
    return module


def _run(backends, case_id, page_size, tweak_plan=None):
    lines = []
    failures = _catalogue().run_catalogue(backends, device="cpu", dtype=torch.float16, page_sizes=(page_size,),
                                          small=True, names={case_id}, emit=lambda *line: lines.append(line),
                                          tweak_plan=tweak_plan)
    return failures, lines


REFERENCE_RUNS = [(case.id, (1, 16, 64)[i % 3]) for i, case in enumerate(_catalogue().CASES)]


@pytest.mark.parametrize("case_id,page_size", REFERENCE_RUNS, ids=[f"{c}-ps{p}" for c, p in REFERENCE_RUNS])
def test_reference_and_validate_follow_the_rule(case_id, page_size):
    """NaN rows for requests with a bad id, the reference and the repaired run for the others, nothing written
    outside out / lse, and validate=True naming the argument and the request."""
    failures, lines = _run(["reference"], case_id, page_size)
    assert failures == 0 and [status for status, *_ in lines] == ["PASS", "PASS"], lines


class _Unchecked(ReferenceBackend):
    """A backend that breaks the rule: it writes zeros where a bad block id was met."""

    NAME = "unchecked_test"

    @classmethod
    def run(cls, state, q, kv_cache, block_table, cache_seqlens, *, out, lse, **kwargs):
        super().run(state, q, kv_cache, block_table, cache_seqlens, out=out, lse=lse, **kwargs)
        out.nan_to_num_(0.0)


def test_the_script_fails_a_backend_that_breaks_the_rule(registered, capsys):
    name = registered(_Unchecked)
    argv = ["--device", "cpu", "--small", "--cases", "id-nb,garbage", "--page-sizes", "16"]
    assert _catalogue().main(argv + ["--backends", f"reference,{name}"]) == 1
    out = capsys.readouterr().out
    assert "FAIL unchecked_test id-nb-ps16" in out and "request 1: out/lse not all NaN" in out
    assert "PASS unchecked_test garbage-ps16" in out and "PASS reference id-nb-ps16" in out
    assert out.strip().endswith("1 failed")
    assert _catalogue().main(argv + ["--backends", "reference"]) == 0


class _WithOptions(ReferenceBackend):
    """The reference with a plan option: ``mode="refuse"`` cannot run anything, as a forced kernel that does not fit."""

    NAME = "options_test"
    OPTIONS = MappingProxyType({"mode": BackendOption(("plain", "refuse"), "refuse: no problem fits")})

    @classmethod
    def plan(cls, problem, platform, block_table, cache_seqlens, *, softmax_scale, options):
        if options.get("mode") == "refuse":
            raise ValueError("backend_options['mode']='refuse' cannot run this problem: a test")
        return super().plan(problem, platform, block_table, cache_seqlens, softmax_scale=softmax_scale)


def test_backends_carry_plan_options(registered, capsys):
    """``name:key=value`` runs the backend with those ``backend_options`` (ci/bad_tables.py on cuda_sm90's
    mainloops: ``cuda_sm90:variant=5``); a forced choice that cannot run a case is a SKIP with its reason."""
    assert _catalogue().backend_spec("cuda_sm90:variant=6:fuse_combine=true:name=x") == (
        "cuda_sm90", {"variant": 6, "fuse_combine": True, "name": "x"})
    assert _catalogue().backend_spec("reference") == ("reference", {})
    name = registered(_WithOptions)
    argv = ["--device", "cpu", "--small", "--cases", "id-nb", "--page-sizes", "16",
            "--backends", f"{name}:mode=plain,{name}:mode=refuse"]
    assert _catalogue().main(argv) == 0
    out = capsys.readouterr().out
    assert "PASS options_test:mode=plain id-nb-ps16" in out
    assert re.search(r"SKIP options_test:mode=refuse id-nb-ps16 +backend_options\['mode'\]='refuse' cannot run", out)


# -- the Triton kernel under the interpreter --------------------------------------------------------------------------

# (case id, page size, forced plan: None, "split" (5 parts), "tma" (whole tiles by TMA) or "tokm" (tokens on M, V split))
# page 4: whole pages per 16-token tile (tl.gather); 16, 32, 64: one page per tile; 1: per token
TRITON_RUNS = [
    ("id-1", 16, None),
    ("id-int32min", 4, None),
    ("mixed", 1, "split"),
    ("garbage", 4, None),
    ("len-cap-id-1", 32, "tma"),
    ("causal-len-cap", 16, "split"),
    ("fp8-id-1", 16, "tokm"),
    ("dsmla-id-nb", 1, None),
]


def _run_id(case_id, page_size, mode):
    return f"{case_id}-ps{page_size}" + (f"-{mode}" if mode else "")


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    from tests.conftest import interpreter_child_results

    return interpreter_child_results(__file__)


@pytest.mark.parametrize("run_id", [_run_id(*r) for r in TRITON_RUNS])
def test_triton_follows_the_rule_under_interpreter(interpreter_results, run_id):
    rec = interpreter_results.get(run_id)
    assert rec is not None, f"run {run_id} did not report (child crashed?)"
    assert rec["ok"], rec["message"]


def _tweak(mode):
    from mla_dispatch.backends.triton import TritonBackend
    from mla_dispatch.kernels.triton.decode import KernelConfig

    configs = {"split": None, "tma": KernelConfig(16, 16, 4, 2, tma=True, chunk_size=16),
               "tokm": KernelConfig(16, 16, 4, 1, tokens_on_m=True, v_split=2, qk_chunk=128, chunk_size=16)}

    def tweak(plan):
        state = TritonBackend.make_state(plan.problem, plan.platform, plan.cache_seqlens, num_parts=5, overhead=1,
                                         config=configs[mode])
        if not bool((state.schedule.num_splits > 1).any()):
            raise AssertionError("the forced schedule split no request")
        plan._state = state

    return tweak


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore", message="All-NaN slice")  # the interpreter's max over a NaN row
    for case_id, page_size, mode in TRITON_RUNS:
        try:
            failures, lines = _run(["triton"], case_id, page_size, None if mode is None else _tweak(mode))
            ok, msg = failures == 0 and [s for s, *_ in lines] == ["PASS", "PASS"], " | ".join(map(str, lines))
        except Exception as exc:  # reported to the parent
            ok, msg = False, f"{type(exc).__name__}: {exc}"
        print(json.dumps({"id": _run_id(case_id, page_size, mode), "ok": ok, "message": msg}), flush=True)
