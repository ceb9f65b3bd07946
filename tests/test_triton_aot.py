"""The ahead-of-time report of the Triton kernel (``python -m mla_dispatch.kernels.triton.aot_report``): compiles
for sm_90 on a machine without a GPU (Triton ships ptxas and nvdisasm), so it runs in CI."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":  # @triton.jit then gives interpreted functions, which do not compile
    pytest.skip("compiling needs Triton without its interpreter", allow_module_level=True)

from mla_dispatch.kernels.triton.aot_report import compile_config, parse_spec  # noqa: E402


def test_sass_loops_follow_the_tma_loop():
    """``--sass`` finds the whole-tile (TMA) loop of a TMA config and lists its wgmma and TMA issues in order."""
    report = compile_config(parse_spec("tM16-n64-tma"), sass=True)
    loops = report["sass_loops"]
    tma_loops = [loop for loop in loops if "UTMALDG" in loop]
    assert tma_loops, loops
    loop = tma_loops[0]
    assert "HGMMA.64x16x16" in loop  # 16 query rows on the wgmma N side (tokens on M)
    assert loop.index("SYNCS.PHASECHK") < loop.index("HGMMA")  # the tile's barrier is waited for before its S
    assert report["tma"] > 0 and report["wgmma"] > 0


def test_the_report_without_sass_has_no_loops():
    report = compile_config(parse_spec("hM64-n64-w8"))
    assert "sass_loops" not in report and report["wgmma"] > 0
