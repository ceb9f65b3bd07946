"""Shared pytest configuration.

- Tests marked ``gpu`` run only where torch sees a CUDA device; elsewhere they are skipped with
  :data:`GPU_SKIP_REASON`, which says what to run where there is one.
- Every test gets a fresh random seed, printed in the header, so failures can be replayed
  with ``MLA_DISPATCH_SEED=<seed>``.
- After each ``gpu`` test the caching allocator's free blocks go back to the driver, so an idle
  pytest-xdist worker does not sit on the GB its last case needed. Cases too big to run many at
  once carry ``xdist_group("gpu_heavy<k>")``: with ``-n N --dist loadgroup`` each group runs on one
  worker (README "GPU tests").
"""

import json
import os
import random
import subprocess
import sys
import zlib

import pytest
import torch

SEED = int(os.environ.get("MLA_DISPATCH_SEED", random.SystemRandom().randrange(1 << 31)))

#: Why a ``gpu`` test is skipped here, and what a user with a GPU runs (tests/test_docs.py holds it to the README).
GPU_SKIP_REASON = 'needs a CUDA GPU; where there is one: python -m pytest -q -m gpu (README "GPU tests")'


def pytest_report_header(config):
    return f"mla_dispatch test seed: {SEED} (replay with MLA_DISPATCH_SEED={SEED})"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _release_gpu_memory(request):
    yield
    if "gpu" in request.keywords and torch.cuda.is_available():
        torch.cuda.empty_cache()


@pytest.fixture
def seed(request) -> int:
    """A per-test seed derived from the session seed and the test id."""
    return (SEED + zlib.crc32(request.node.nodeid.encode())) % (1 << 31)


@pytest.fixture
def gen(seed) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def registered():
    """``register(cls) -> name``: register a test backend class under ``cls.NAME`` for this test.

    Every backend registered through it is unregistered afterwards and the selection cache is
    cleared, so test backends never leak into other tests. A ``runs`` counter on the class, if
    it has one, is reset.
    """
    from mla_dispatch.dispatch.registry import register_backend, unregister_backend
    from mla_dispatch.dispatch.select import clear_selection_cache

    names = []

    def register(cls):
        if hasattr(cls, "runs"):
            cls.runs = 0
        register_backend(cls.NAME, cls)
        names.append(cls.NAME)
        return cls.NAME

    yield register
    for name in names:
        unregister_backend(name)
    clear_selection_cache()


def interpreter_child_results(test_file: str) -> dict:
    """Run ``test_file`` as a script under ``TRITON_INTERPRET=1`` and collect its results.

    Triton reads TRITON_INTERPRET when it is imported, so interpreter tests run their kernels in a
    child process (``python test_file SEED``) that prints one JSON record per case,
    ``{"id": ..., "ok": ..., "message": ...}``; returns ``{id: record}``. Fails the test if the
    child printed no record (with the end of its stderr).
    """
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, test_file, str(SEED)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            results[rec["id"]] = rec
    if not results:
        pytest.fail(f"interpreter child produced no results (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    return results


@pytest.fixture
def simulate_platform(monkeypatch):
    """``simulate_platform(platform)``: for this test every device looks like ``platform``.

    Replaces the one function that asks the hardware (``mla_dispatch.dispatch.platform.detect_platform``)
    and clears the platform and selection caches before and after, so nothing leaks.
    """
    import mla_dispatch.dispatch.platform as platform_mod
    from mla_dispatch.dispatch.select import clear_selection_cache

    def use(platform):
        monkeypatch.setattr(platform_mod, "detect_platform", lambda device=None: platform)
        platform_mod.platform_for.cache_clear()
        clear_selection_cache()
        return platform

    yield use
    platform_mod.platform_for.cache_clear()
    clear_selection_cache()


@pytest.fixture
def npu(monkeypatch, simulate_platform):
    """A simulated Ascend 910B, with the Ascend backends' cached availability forgotten."""
    import mla_dispatch.dispatch.registry
    from mla_dispatch.dispatch.platform import Platform

    platform = simulate_platform(Platform("npu", "Ascend910B3", None, "Ascend910B", 20))
    for name in ("torch_npu", "ascend_amla"):
        monkeypatch.setattr(mla_dispatch.dispatch.registry.get_backend(name), "_availability_cache", None, raising=False)
    return platform


@pytest.fixture(autouse=True)
def no_measured_table():
    """No measured dispatch table unless a test loads one (tests/test_tune.py's ``clean`` fixture reloads): the
    table shipped for the H100 would otherwise reorder selection in tests that simulate an H100 and check the
    default order."""
    from mla_dispatch.dispatch import tuned

    tuned.set_tuned_table(None, None)
    yield
    tuned.reload_table()
