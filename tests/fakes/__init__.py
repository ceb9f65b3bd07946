"""Fake vendor modules (FlashMLA, FlashAttention-3, FlashInfer, AITER) for CPU contract tests, and the
helpers that install them and simulate a platform for one test."""

from __future__ import annotations

import torch

from mla_dispatch.dispatch.platform import Platform

H100 = Platform("cuda", "NVIDIA H100 80GB HBM3", (9, 0), "sm_90", 132)
H200 = Platform("cuda", "NVIDIA H200", (9, 0), "sm_90", 132)
B200 = Platform("cuda", "NVIDIA B200", (10, 0), "sm_100", 148)
MI300X = Platform("rocm", "AMD Instinct MI300X", None, "gfx942", 304)
MI355X = Platform("rocm", "AMD Instinct MI355X", None, "gfx950", 256)


def simulate(monkeypatch, platform: Platform, backend_cls) -> None:
    """Make every device look like ``platform`` for this test and forget what ``backend_cls`` cached.

    The platform cache is replaced for the test, not cleared, so the simulated platform cannot outlive it (a
    cleared cache would be refilled with it and keep it for the tests after); the selection cache, which holds
    choices made for the simulated platform, is cleared after the test too.
    """
    import functools

    import mla_dispatch.dispatch.platform as plat
    import mla_dispatch.dispatch.select as sel

    monkeypatch.setattr(plat, "detect_platform", lambda device=None: platform)
    monkeypatch.setattr(plat, "_platform_cached", functools.lru_cache(maxsize=64)(lambda kind, index: platform))
    sel.clear_selection_cache()
    monkeypatch.setattr(sel, "_select_cached", functools.lru_cache(maxsize=1024)(sel._select_cached.__wrapped__))
    forget(backend_cls)


def forget(backend_cls) -> None:
    """Drop the backend's cached availability and feature probes (another fake may be installed next), and the
    cached platform and selections (the simulated platform must not outlive the test: the tests' teardowns call
    this)."""
    import mla_dispatch.dispatch.platform as plat
    import mla_dispatch.dispatch.select as sel

    plat.platform_for.cache_clear()
    sel.clear_selection_cache()
    if "_availability_cache" in backend_cls.__dict__:
        delattr(backend_cls, "_availability_cache")
    import sys

    module = sys.modules[backend_cls.__module__]
    for name in dir(module):
        obj = getattr(module, name)
        if hasattr(obj, "cache_clear") and callable(obj):
            obj.cache_clear()
