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


@pytest.mark.parametrize("kv_format", ["fp8_ds_v4", "fp8_ds_mla"])
def test_sparse_kernel_with_every_optional_argument_compiles(kv_format):
    """DeepSeek-V4's sparse decode (the fp8_ds_v4 loader, topk_length, the sink, an extra cache and its lengths)
    compiles for sm_90, not only under the interpreter, which reads any global where a compiled kernel reads only
    constexpr ones."""
    from mla_dispatch.kernels.triton.decode import CONFIGS

    d_rope = 0 if kv_format == "fp8_ds_v4" else 64
    for rows in (16, 64):
        for extras in (False, True):
            report = compile_config(CONFIGS[rows, kv_format], kv_format=kv_format, sparse=True, d_rope=d_rope,
                                    sparse_extras=extras)
            assert report["regs"] <= 255 and report["smem"] <= 227 * 1024, report


def test_the_report_without_sass_has_no_loops():
    report = compile_config(parse_spec("hM64-n64-w8"))
    assert "sass_loops" not in report and report["wgmma"] > 0


def test_gluon_kernel_splits_s_between_the_warpgroups():
    """The Gluon sm_90 kernel (kernels/triton/gluon_sm90.py) compiles with this machine's Triton, and its tile loop has
    what the kernel exists for: each warpgroup's S is 36 ``HGMMA.64x32x16`` (64 rows x 32 of the 64 tokens x 576; the
    plain kernel's warpgroups each compute all 64 tokens, 72), P V as 4 ``HGMMA.64x256x16`` (256 of the 512 channels per
    warpgroup), the tile waited for on its mbarrier before S, and no local memory in the loop."""
    from mla_dispatch.kernels.triton.gluon_sm90 import GLUON_API

    if not GLUON_API:
        pytest.skip("this Triton has no usable Gluon")
    for causal in (False, True):
        report = compile_config(parse_spec("hM64-n64-w8-tma-gl"), causal=causal, sass=True, seesaw=False)
        loops = [loop for loop in report["sass_loops"] if "HGMMA.64x32x16" in loop]
        assert len(loops) == 1, report["sass_loops"]
        loop = loops[0]
        assert "HGMMA.64x32x16 x36" in loop and "HGMMA.64x256x16 x4" in loop, loop
        assert "0 local loads/stores" in loop, loop
        assert loop.index("SYNCS.PHASECHK") < loop.index("HGMMA.64x32x16")
        assert "UTMALDG" in loop  # the next tile's TMA
        assert report["smem"] <= 227 * 1024 and report["regs"] <= 255


def test_gluon_kernel_gathers_tiles_on_short_pages():
    """On pages that do not hold whole 64-token tiles the Gluon kernel gathers every tile with cp.async (``LDGSTS``),
    the next tile's table entries loaded a tile ahead (``LDG``), no TMA and no mbarrier in the loop; the tensor work
    is the same as on pages of whole tiles, with no local memory in the loop."""
    from mla_dispatch.kernels.triton.gluon_sm90 import GLUON_API

    if not GLUON_API:
        pytest.skip("this Triton has no usable Gluon")
    report = compile_config(parse_spec("hM64-n64-w8-tma-gl"), page_size=16, sass=True)
    loops = [loop for loop in report["sass_loops"] if "HGMMA.64x32x16" in loop]
    assert len(loops) == 1, report["sass_loops"]
    loop = loops[0]
    assert "HGMMA.64x32x16 x36" in loop and "HGMMA.64x256x16 x4" in loop, loop
    assert "0 local loads/stores" in loop, loop
    assert "LDGSTS" in loop and "LDG.E" in loop and "LDGDEPBAR" in loop, loop
    assert "UTMALDG" not in loop and "SYNCS.PHASECHK" not in loop, loop
    assert report["tma"] == 2  # the query tile's two loads only


def test_gluon_kernel_converts_fp8_tiles_in_shared_memory():
    """On fp8_e4m3 caches the Gluon kernel gathers every tile as fp8 and converts it to fp16 in shared memory before the
    same 36 + 4 wgmma (fp16 operands), with no local memory in the loop and no TMA of the cache."""
    from mla_dispatch.kernels.triton.gluon_sm90 import GLUON_API

    if not GLUON_API:
        pytest.skip("this Triton has no usable Gluon")
    report = compile_config(parse_spec("hM64-n64-w8-tma-gl"), kv_format="fp8_e4m3", page_size=64, sass=True)
    loops = [loop for loop in report["sass_loops"] if "HGMMA.64x32x16" in loop]
    assert len(loops) == 1, report["sass_loops"]
    loop = loops[0]
    assert "HGMMA.64x32x16 x36" in loop and "HGMMA.64x256x16 x4" in loop, loop
    assert "0 local loads/stores" in loop and "LDGSTS" in loop and "UTMALDG" not in loop, loop
    assert report["tma"] == 2 and report["smem"] <= 227 * 1024


def test_seesaw_kernel_runs_two_tiles_one_per_warpgroup():
    """The seesaw kernel (kernels/triton/gluon_seesaw.py), which the Gluon config takes on 16-bit pages of whole tiles,
    compiles for sm_90 with this machine's Triton into two warp-specialised loops, one per warpgroup: each computes the
    S of its own tile over all 64 tokens (36 ``HGMMA.64x64x16``: 16 on the latent half whose TMA landed first, an
    mbarrier wait, then the other 20), and two P V of 4 ``HGMMA.64x256x16`` on its 256 channels (its own tile's P from
    registers, the other warpgroup's from shared memory); each refills the stage halves it read last (``UTMALDG`` in the
    loop), with the next tiles' pages loaded at the top of the pair (``LDG``). Triton 3.6 (the device's) keeps local
    memory out of both loops; 3.9 spills a few registers in the worker's."""
    from mla_dispatch.kernels.triton.gluon_sm90 import GLUON_API

    if not GLUON_API:
        pytest.skip("this Triton has no usable Gluon")
    for causal in (False, True):
        report = compile_config(parse_spec("hM64-n64-w8-tma-gl"), causal=causal, sass=True)
        loops = [loop for loop in report["sass_loops"] if "HGMMA.64x64x16" in loop]
        assert len(loops) == 2, report["sass_loops"]
        for loop in loops:
            events = loop.split(": ", 1)[1].split(", ")
            s_counts = [int(e.rsplit(" x", 1)[1]) for e in events if e.startswith("HGMMA.64x64x16")]
            assert sum(s_counts) == 36 and s_counts[0] == 16, loop
            assert events.count("HGMMA.64x256x16 x4") == 2, loop
            assert "UTMALDG" in loop and "LDG.E" in loop, loop
            assert loop.index("SYNCS.PHASECHK") < loop.index("HGMMA.64x64x16"), loop
            local = int(loop.split(" local loads/stores")[0].rsplit(" ", 1)[1])
            assert local <= 32, loop
        assert report["smem"] <= 227 * 1024 and report["regs"] <= 255 and report["wgmma"] > 0


@pytest.mark.parametrize("rows", [16, 32])
def test_fp8t_kernel_scores_and_accumulates_in_two_warpgroups(rows):
    """The tokens-on-M fp8_e4m3 kernel (kernels/triton/gluon_fp8.py; at most 32 query rows) compiles for sm_90 with this
    machine's Triton into its two consumer loops: the scorer's S^T (36 ``HGMMA.64xRx16`` over the 576 channels, N = the
    rows per program) after a wait for the stage, and the accumulator's O^T (32: 8 blocks of 64 channels x 4 steps of
    16 tokens), neither touching local memory. The converter's e4m3 -> fp16 conversion and its L2 prefetches are in the
    PTX, and shared memory fits the 227 KB."""
    from mla_dispatch.kernels.triton.aot_report import compile_fp8t
    from mla_dispatch.kernels.triton.gluon_sm90 import GLUON_API

    if not GLUON_API:
        pytest.skip("this Triton has no usable Gluon")
    report = compile_fp8t(rows=rows, causal=True, sass=True)
    shape = f"HGMMA.64x{rows}x16"
    loops = [loop for loop in report["sass_loops"] if shape in loop]
    assert len(loops) == 2, report["sass_loops"]
    assert sum(f"{shape} x36" in loop for loop in loops) == 1 and sum(f"{shape} x32" in loop for loop in loops) == 1
    for loop in loops:
        assert " 0 local loads/stores" in loop and loop.index("SYNCS.PHASECHK") < loop.index(shape), loop
    assert report["wgmma"] == 68 and report["smem"] <= 227 * 1024
    ptx = compile_fp8t(rows=rows, causal=True, ptx=True)
    assert "cvt.rn.f16x2.e4m3x2" in ptx and "cp.async.bulk.prefetch.L2.global" in ptx and "setmaxnreg" in ptx
