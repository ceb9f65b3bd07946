"""GPU feature grid of the native SM90 kernel (backend ``cuda_sm90``) against the reference.

Runs on the device tool's H100 (skipped elsewhere). Fresh random data per test
(``gen`` fixture), outputs poisoned with NaN before every run, docs/design.md §5
tolerances (the backend's declared TOLERANCE). Mainloops and the combine's
place are forced through ``backend_options``; a mainloop that cannot run a shape
is refused at plan time (ValueError), never replaced.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from mla_dispatch import plan_decode
from mla_dispatch.backends import cuda_sm90
from mla_dispatch.numerics.cases import case_reference, make_case, poisoned_outputs, scale_outputs
from mla_dispatch.numerics.tolerance import compare_outputs

pytestmark = pytest.mark.gpu


def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.fixture(autouse=True)
def _need_sm90():
    if not _sm90():
        pytest.skip("cuda_sm90 needs an SM90 (Hopper) GPU")


def _backend():
    from mla_dispatch.dispatch.registry import get_backend

    return get_backend("cuda_sm90")


def _check(case, out, lse, tol=None):
    """Compare with the reference at the backend's tolerance, or ``tol``."""
    report = compare_outputs(out, lse, *case_reference(case), tol or _backend().TOLERANCE)
    assert report, report.message


def _run_and_check(plan, case, tol=None):
    """One launch of ``plan`` on ``case`` (its scale and indices) into fresh NaN-poisoned outputs, checked."""
    out, lse = poisoned_outputs(case)
    plan.run(case.q, case.kv_cache, kv_scale=case.kv_scale, indices=case.indices, out=out, lse=lse)
    torch.cuda.synchronize()
    _check(case, out, lse, tol)


def _run_case(case):
    plan = plan_decode(*case.args(), backend="cuda_sm90", **case.kwargs())
    assert plan.backend == "cuda_sm90"
    _run_and_check(plan, case)
    return plan


def _plan(case, **backend_options):
    return plan_decode(*case.args(), backend="cuda_sm90", backend_options=backend_options, **case.kwargs())


def _refusal(case, variant):
    """What mainloop ``variant`` needs that ``case`` lacks (cuda_sm90.MAINLOOPS); empty: it runs the case."""
    return cuda_sm90.MAINLOOPS[variant].reasons(_plan(case).problem)


def _run_variant(case, variant, runs=1, fuse_combine=None, tol=None):
    """Plan with the backend forcing mainloop `variant` (and the combine's place when `fuse_combine` is given),
    and check `runs` launches (fresh poison each) at the backend's tolerance, or `tol`. Returns the plan. Where
    the mainloop cannot run the case, check instead that the plan refuses it, naming what is missing."""
    if reasons := _refusal(case, variant):
        with pytest.raises(ValueError, match=re.escape(reasons[0])):
            _plan(case, variant=variant)
        return None
    options = {"variant": variant} if fuse_combine is None else {"variant": variant, "fuse_combine": fuse_combine}
    plan = _plan(case, **options)
    launch = plan.state.launch
    assert (launch.variant, plan.state.bound.variant) == (variant, variant)
    if fuse_combine is not None:
        assert (launch.fuse_combine, plan.state.bound.fuse_combine) == (fuse_combine, fuse_combine)
    for _ in range(runs):
        _run_and_check(plan, case, tol)
    return plan


# (batch, s_q, h_q, h_kv, seqlen, page_size, causal, zero_len_rows)
GRID = [
    (4, 1, 16, 1, 300, 16, False, 0),
    (4, 1, 16, 1, 300, 32, False, 0),
    (4, 1, 16, 1, 300, 64, False, 0),
    (4, 1, 16, 1, 300, 128, False, 0),
    (4, 1, 16, 1, 300, 256, False, 0),
    (3, 1, 1, 1, 200, 64, False, 0),
    (3, 1, 2, 1, 777, 64, False, 0),
    (5, 1, 128, 1, 1000, 64, False, 1),
    (2, 2, 128, 1, 513, 64, True, 0),
    (3, 4, 32, 1, 257, 32, True, 0),
    (2, 16, 16, 1, 120, 16, True, 0),
    (2, 16, 8, 1, 40, 64, True, 0),
    (3, 3, 12, 1, 90, 128, True, 1),
    (2, 1, 32, 2, 400, 64, False, 0),
    (2, 2, 16, 4, 300, 16, True, 0),
    (6, 1, 64, 1, 5000, 64, False, 2),
    (1, 1, 128, 1, 20000, 256, False, 0),
    (8, 1, 16, 1, 1, 64, False, 0),
]


def _grid_id(c):
    b, s, h, hk, L, ps, causal, z = c
    return f"b{b}xs{s}xh{h}-hkv{hk}-L{L}-ps{ps}" + ("-causal" if causal else "") + (f"-zero{z}" if z else "")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("cfg", GRID, ids=[_grid_id(c) for c in GRID])
def test_dense_matches_reference(cfg, dtype, gen):
    b, s_q, h_q, h_kv, L, ps, causal, zero = cfg
    case = make_case(b, s_q, h_q, L, num_heads_kv=h_kv, page_size=ps, dtype=dtype, causal=causal,
                     zero_len_rows=zero, device="cuda", generator=gen)
    _run_case(case)


FP8_GRID = [
    (4, 1, 16, 1, 300, 64, False, 0),
    (3, 2, 128, 1, 700, 16, True, 1),
    (2, 1, 32, 2, 260, 128, False, 0),
]


@pytest.mark.parametrize("kv_format", ["fp8_e4m3", "fp8_ds_mla"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("cfg", FP8_GRID, ids=[_grid_id(c) for c in FP8_GRID])
def test_fp8_matches_reference(cfg, dtype, kv_format, gen):
    b, s_q, h_q, h_kv, L, ps, causal, zero = cfg
    if kv_format == "fp8_ds_mla" and h_kv != 1:
        h_kv = 1
    case = make_case(b, s_q, h_q, L, num_heads_kv=h_kv, page_size=ps, dtype=dtype, causal=causal,
                     zero_len_rows=zero, kv_format=kv_format, device="cuda", generator=gen)
    _run_case(case)


@pytest.mark.parametrize("kv_format", ["bf16", "fp8_e4m3", "fp8_ds_mla"])
@pytest.mark.parametrize("variant", sorted(cuda_sm90.MAINLOOPS), ids=[f"v{v}" for v in sorted(cuda_sm90.MAINLOOPS)])
@pytest.mark.parametrize("cfg", [GRID[0], GRID[8], GRID[12], GRID[15]], ids=_grid_id)
def test_each_mainloop_variant_matches_reference(cfg, variant, kv_format, gen):
    """Every mainloop a plan can pick, forced, on shapes it takes (matching the reference) and on shapes it does not
    (refused at plan time with the backend's own reason)."""
    b, s_q, h_q, h_kv, L, ps, causal, zero = cfg
    if kv_format != "bf16" and h_kv != 1:
        pytest.skip("fp8 caches: h_kv = 1 configs")
    case = make_case(b, s_q, h_q, L, num_heads_kv=h_kv, page_size=ps, causal=causal, zero_len_rows=zero,
                     kv_format=kv_format, device="cuda", generator=gen)
    _run_variant(case, variant)


V5_GRID = [c for c in GRID if c[5] % 64 == 0] + [
    (4, 4, 64, 1, 4096, 64, True, 0),
    (16, 1, 128, 1, 4096, 64, False, 1),
    (3, 2, 128, 1, 191, 128, True, 0),
    (3, 2, 128, 2, 700, 64, True, 1),  # two KV heads of two row tiles each: clusters of two along y, grid z = 2
    (2, 64, 2, 1, 900, 64, True, 0),  # q_len = 64, causal: the edge of v5's unmasked steady state
    (2, 80, 1, 1, 700, 64, True, 0),  # q_len > 64: v5 leaves steady-state tiles unmasked, so the plan refuses it
    # several items per part, of 1 to 5 tiles (odd and even), zero-length requests among them
    (64, 1, 128, 1, 300, 64, False, 3),
    (48, 2, 64, 1, 250, 128, True, 1),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("cfg", V5_GRID, ids=[_grid_id(c) for c in V5_GRID])
def test_variant5_matches_reference(cfg, dtype, gen):
    """v5, seesaw (seesaw/) on the page sizes it takes (multiples of 64): odd and even tile counts per item,
    partial last tiles, split requests, causal MTP, zero-length requests, h_kv > 1, several items per part; q_len > 64
    is refused."""
    b, s_q, h_q, h_kv, L, ps, causal, zero = cfg
    case = make_case(b, s_q, h_q, L, num_heads_kv=h_kv, page_size=ps, dtype=dtype, causal=causal,
                     zero_len_rows=zero, device="cuda", generator=gen)
    _run_variant(case, 5, runs=2)  # a second launch of the configured kernel


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("cfg", V5_GRID, ids=[_grid_id(c) for c in V5_GRID])
def test_variant9_fp8_matches_reference(cfg, dtype, gen):
    """v9, seesaw_fp8 (v5's schedule for fp8_e4m3 caches, a warpgroup converting each tile in place; seesaw_fp8/)
    on v5's grid: odd and even tile counts, partial last tiles (rows past the end stored as zeros), split requests,
    causal MTP, zero-length requests, h_kv > 1, several items per CTA (the converter running an item ahead), and
    q_len > 64 (refused). Two launches of the configured kernel."""
    b, s_q, h_q, h_kv, L, ps, causal, zero = cfg
    case = make_case(b, s_q, h_q, L, num_heads_kv=h_kv, page_size=ps, dtype=dtype, causal=causal,
                     zero_len_rows=zero, kv_format="fp8_e4m3", device="cuda", generator=gen)
    _run_variant(case, 9, runs=2)


@pytest.mark.parametrize("kv_format", ["bf16", "fp8_ds_mla"])
def test_variant9_refuses_other_caches(kv_format, gen):
    """v9 takes fp8_e4m3 caches only: a plan forcing it on another cache raises, naming the formats it takes."""
    case = make_case(3, 1, 128, 900, page_size=64, kv_format=kv_format, device="cuda", generator=gen)
    with pytest.raises(ValueError, match=r"variant'\]=9 .* \(supported: fp8_e4m3\)"):
        _plan(case, variant=9)


@pytest.mark.parametrize("s_q,h_q,paired", [(1, 128, True), (2, 128, True), (1, 64, False), (3, 64, False)],
                         ids=["2-row-tiles", "4-row-tiles", "1-row-tile", "3-row-tiles"])
def test_variant5_runs_row_tile_pairs_as_clusters(s_q, h_q, paired, gen):
    """The plan pairs v5's two row-tile CTAs of a part in a cluster (the `kPaired` instance, which starts each item
    in step) exactly where a part's row tiles pair up (and the grid fits the GPU at once, as it does on an H100 /
    H200); the name of the kernel the profiler saw says which instance ran, and its results match the reference."""
    case = make_case(4, s_q, h_q, 2000, page_size=64, device="cuda", generator=gen, varlen=False, causal=s_q > 1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        plan = _run_variant(case, 5)
    assert (plan.state.launch.paired, plan.state.bound.paired) == (paired, paired)
    names = {e.name for e in prof.events() if "mla_decode_seesaw<" in e.name}
    assert len(names) == 1, names
    assert (", true>" in names.pop()) == paired  # <T, kPaired>


V6_GRID = [c for c in GRID if c[1] * c[2] // c[3] <= 32] + [
    (4, 1, 16, 1, 4096, 64, False, 1),   # long items: many tiles per warpgroup, split requests
    (3, 2, 16, 1, 1031, 32, True, 0),    # 32 rows, causal, odd tile count
    (2, 1, 20, 1, 200, 16, False, 0),    # 20 rows: the 32-row kernel with 12 empty columns
    (2, 1, 64, 1, 300, 64, False, 0),    # 64 rows: v6 does not take it, the plan refuses it
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("cfg", V6_GRID, ids=[_grid_id(c) for c in V6_GRID])
def test_variant6_matches_reference(cfg, dtype, gen):
    """v6, etap (etap/, tokens on M) on the shapes it takes (<= 32 query rows per KV head, any page size):
    one and two warpgroups' worth of tiles, partial tiles, split requests, causal MTP, zero-length requests,
    h_kv > 1; a 64-row shape is refused."""
    b, s_q, h_q, h_kv, L, ps, causal, zero = cfg
    case = make_case(b, s_q, h_q, L, num_heads_kv=h_kv, page_size=ps, dtype=dtype, causal=causal,
                     zero_len_rows=zero, device="cuda", generator=gen)
    _run_variant(case, 6, runs=2)  # a second launch of the configured kernel


V6_FP8_GRID = [
    (4, 1, 16, 1, 300, 64, False, 0),
    (4, 1, 16, 1, 4096, 64, False, 1),   # many tiles per warpgroup, split requests
    (3, 2, 8, 1, 1031, 16, True, 0),     # causal MTP, page 16, odd tile count
    (2, 1, 1, 1, 200, 32, False, 0),
    (2, 1, 32, 2, 300, 128, False, 0),   # 16 rows per KV head, h_kv = 2 (fp8_e4m3 only)
    (2, 1, 32, 1, 300, 64, False, 0),    # 32 rows: v6 takes no fp8 cache there, the plan refuses it
]


@pytest.mark.parametrize("kv_format", ["fp8_e4m3", "fp8_ds_mla"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("cfg", V6_FP8_GRID, ids=[_grid_id(c) for c in V6_FP8_GRID])
def test_variant6_fp8_matches_reference(cfg, dtype, kv_format, gen):
    """v6 with fp8 caches (tiles staged in registers and dequantised into shared memory; <= 16 rows per KV head)."""
    b, s_q, h_q, h_kv, L, ps, causal, zero = cfg
    if kv_format == "fp8_ds_mla" and h_kv != 1:
        pytest.skip("fp8_ds_mla caches have one KV head")
    case = make_case(b, s_q, h_q, L, num_heads_kv=h_kv, page_size=ps, dtype=dtype, causal=causal,
                     zero_len_rows=zero, kv_format=kv_format, device="cuda", generator=gen)
    _run_variant(case, 6, runs=2)


V7_GRID = [
    (4, 1, 16, 1, 300, 64, False, 0),
    (4, 1, 16, 1, 4096, 64, False, 1),   # long items, split requests, a zero-length request
    (3, 1, 32, 1, 1031, 16, False, 0),   # 32 rows, page 16 (L2 prefetch per row), odd tile count
    (3, 2, 16, 1, 1031, 32, True, 0),    # causal MTP, 32 rows, page 32
    (2, 1, 20, 1, 200, 128, False, 0),   # 20 rows: the 32-row kernel with 12 empty columns
    (2, 1, 1, 1, 200, 256, False, 0),    # one row, page 256
    (2, 4, 8, 1, 513, 64, True, 2),      # causal MTP, zero-length requests, a tile with one token
    (2, 1, 32, 2, 300, 128, False, 0),   # h_kv = 2: 16 rows per KV head, strided cache rows
    (2, 2, 16, 4, 300, 16, True, 0),     # h_kv = 4, causal
    (1, 1, 16, 1, 20000, 64, False, 0),  # one request over every part
    (2, 1, 64, 1, 300, 64, False, 0),    # 64 rows: v7 does not take it, the plan refuses it
]


@pytest.mark.parametrize("variant", [7, 8], ids=["v7", "v8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("cfg", V7_GRID, ids=[_grid_id(c) for c in V7_GRID])
def test_variant7_fp8_matches_reference(cfg, dtype, variant, gen):
    """v7, fp8t_convert (fp8t/: a converter, a scorer and an accumulator warpgroup) and v8, fp8t_regs (bulk copies of
    the raw rows, the conversion in the consumers' registers) on fp8_e4m3 caches with <= 32 query rows per KV head:
    every page size (v8: multiples of 64; the plan refuses others), partial tiles, split requests, causal MTP,
    zero-length requests, h_kv > 1; a 64-row shape is refused."""
    b, s_q, h_q, h_kv, L, ps, causal, zero = cfg
    case = make_case(b, s_q, h_q, L, num_heads_kv=h_kv, page_size=ps, dtype=dtype, causal=causal,
                     zero_len_rows=zero, kv_format="fp8_e4m3", device="cuda", generator=gen)
    _run_variant(case, variant, runs=2)  # a second launch of the configured kernel


@pytest.mark.parametrize("variant", [7, 8], ids=["v7", "v8"])
@pytest.mark.parametrize("kv_format", ["bf16", "fp8_ds_mla"])
def test_variant7_refuses_other_caches(kv_format, variant, gen):
    case = make_case(2, 1, 16, 700, page_size=64, kv_format=kv_format, device="cuda", generator=gen)
    with pytest.raises(ValueError, match=rf"variant'\]={variant} .* \(supported: fp8_e4m3\)"):
        _plan(case, variant=variant)


@pytest.mark.parametrize("dtype,k", [(torch.bfloat16, -100), (torch.bfloat16, 24), (torch.float16, -20),
                                     (torch.float16, 10)], ids=["bf16-tiny", "bf16-large", "fp16-tiny", "fp16-large"])
@pytest.mark.parametrize("variant", [7, 8], ids=["v7", "v8"])
def test_variant7_query_rows_scaled_into_fp16(dtype, k, variant, gen):
    """v7 multiplies S^T in fp16: each query row is first scaled by a power of two into fp16's range. q times 2^k with
    the softmax scale times 2^-k leaves the scores as drawn; unscaled, bf16 q times 2^-100 would flush to zero in fp16
    (uniform attention) and times 2^24 overflow it (fp16 q: subnormal at 2^-20, large at 2^10)."""
    case = make_case(3, 1, 16, 900, page_size=64, dtype=dtype, kv_format="fp8_e4m3", device="cuda", generator=gen)
    case = dataclasses.replace(case, q=case.q * 2.0**k, softmax_scale=case.softmax_scale * 2.0**-k)
    _run_variant(case, variant)


@pytest.mark.parametrize("variant", [7, 8], ids=["v7", "v8"])
@pytest.mark.parametrize("fuse_combine", [True, False], ids=["fused", "separate"])
def test_variant7_combine_inside_and_after_the_decode_launch(fuse_combine, variant, gen):
    case = make_case(3, 2, 16, 3000, page_size=64, causal=True, zero_len_rows=1, kv_format="fp8_e4m3",
                     device="cuda", generator=gen)
    plan = _run_variant(case, variant, runs=2, fuse_combine=fuse_combine)
    assert int((plan.state.schedule.num_splits > 1).sum()) > 0, "the shape must split a request"


# Shapes whose split requests the combine merges: one request over every part (b = 1, 64 slots), a few
# slots per request with zero-length and causal MTP rows, h_kv = 2, page 16; h_kv = 256, whose grid
# (256 CTAs of one part, so nothing is split) does not fit the GPU at once: the plan refuses a fused combine;
# and more requests than part boundaries (66 parts for 128 rows, 132 for 16 on an H100), where the combine
# kernel runs one block row per boundary and most requests are not split.
COMBINE_GRID = [
    (1, 1, 128, 1, 4096, 64, False, 0),
    (3, 2, 16, 1, 3000, 64, True, 1),
    (8, 1, 64, 2, 2000, 32, False, 2),
    (5, 1, 32, 1, 1500, 16, False, 0),
    (2, 1, 256, 256, 100, 64, False, 0),
    (200, 1, 128, 1, 1000, 64, False, 3),
    (150, 2, 8, 1, 900, 32, True, 2),
    # more split rows than one wave of combine blocks holds (128 x 40 and 127 x 65 blocks), per request and per
    # part boundary, with an odd head count
    (40, 1, 128, 1, 2000, 64, False, 1),
    (180, 1, 127, 1, 800, 64, False, 2),
]


@pytest.mark.parametrize("fuse_combine", [True, False], ids=["fused", "separate"])
@pytest.mark.parametrize("variant", [2, 5, 6], ids=["v2", "v5", "v6"])
@pytest.mark.parametrize("cfg", COMBINE_GRID, ids=[_grid_id(c) for c in COMBINE_GRID])
def test_combine_inside_and_after_the_decode_launch(cfg, variant, fuse_combine, gen):
    """The split-row merge as the tail of the (cooperative) decode launch and as a second kernel, each mainloop
    that is chosen by default somewhere where it takes the shape. v5 has no tail and a grid larger than the GPU
    cannot launch cooperatively: the plan refuses a fused combine there, naming why."""
    b, s_q, h_q, h_kv, L, ps, causal, zero = cfg
    case = make_case(b, s_q, h_q, L, num_heads_kv=h_kv, page_size=ps, causal=causal, zero_len_rows=zero,
                     device="cuda", generator=gen)
    if fuse_combine and not _refusal(case, variant) and (variant == 5 or h_kv == 256):
        with pytest.raises(ValueError, match="fuse_combine'\\]=True cannot run: "
                                             + ("variant 5 has no combine tail" if variant == 5 else "its grid of")):
            _plan(case, variant=variant, fuse_combine=True)
        return
    _run_variant(case, variant, runs=2, fuse_combine=fuse_combine)


@pytest.mark.parametrize("dtype,kv_format", [(torch.float16, None), (torch.bfloat16, "fp8_e4m3"),
                                             (torch.float16, "fp8_ds_mla")], ids=["fp16", "fp8_e4m3", "fp8_ds_mla"])
@pytest.mark.parametrize("variant", [2, 6], ids=["v2", "v6"])
def test_fused_combine_other_dtypes_and_formats(variant, dtype, kv_format, gen):
    """The tail writes fp16 outputs and follows fp8 caches' decodes (v6 takes fp8 with <= 16 rows, v2 the rest)."""
    case = make_case(2, 1, 16 if variant == 6 else 128, 3000, page_size=64, dtype=dtype, kv_format=kv_format,
                     zero_len_rows=0, device="cuda", generator=gen)
    _run_variant(case, variant, runs=2, fuse_combine=True)


@pytest.mark.parametrize("scale", [1e9, 1e-30], ids=["large", "tiny"])
@pytest.mark.parametrize("variant,h_q,fuse_combine", [(2, 128, True), (5, 128, False), (6, 16, False), (6, 16, True)],
                         ids=["v2-fused", "v5", "v6", "v6-fused"])
def test_split_rows_keep_the_output_range(variant, h_q, fuse_combine, scale, gen):
    """Split requests store their partial rows in fp16, scaled per quarter row (kernels/cuda/mla_decode_sm90/
    params.h). Outputs far outside fp16's range still merge right: at ~1e6 they would overflow fp16, at ~1e-33 flush
    to zero. The cache's latent channels are multiplied by `scale` and q's divided, so the scores stay as drawn and
    the outputs scale; so does the absolute tolerance (docs/design.md §5's is for outputs of order 1e-3)."""
    # equal lengths: drawn ones can come out too short to split
    case = make_case(2, 1, h_q, 3000, page_size=64, varlen=False, device="cuda", generator=gen)
    tol = scale_outputs(case, scale, _backend().TOLERANCE)
    plan = _run_variant(case, variant, fuse_combine=fuse_combine, tol=tol)
    assert int((plan.state.schedule.num_splits > 1).sum()) > 0, "the shape must split a request"


# A block id outside [0, num_blocks) in one request's live part (docs/design.md §1): (variant, kv_format, batch, s_q,
# h_q, seqlen, page_size, causal, zero_len_rows, fuse_combine). Every mainloop on each of its load paths (v6: TMA on
# whole-tile pages, cp.async on others, fp8 through registers), v5 paired and not, causal MTP, split requests (the
# combine of a NaN piece, in a second kernel and fused), zero-length requests after the bad one.
BAD_ID_GRID = [
    (2, "bf16", 4, 1, 128, 1000, 64, False, 0, None),
    (2, "fp16", 3, 2, 16, 700, 16, True, 1, True),
    (2, "fp8_e4m3", 4, 1, 64, 900, 32, False, 0, None),
    (2, "fp8_ds_mla", 4, 1, 16, 900, 64, False, 0, None),
    (5, "bf16", 4, 1, 128, 1000, 64, False, 0, None),  # two row tiles: paired in clusters
    (5, "bf16", 48, 1, 128, 300, 64, False, 0, None),  # several items per part: the flag of each its own
    (5, "fp16", 3, 2, 32, 900, 128, True, 1, None),    # one row tile
    (6, "bf16", 4, 1, 16, 1000, 64, False, 0, None),   # TMA
    (6, "fp16", 3, 2, 16, 700, 16, True, 1, True),     # cp.async
    (6, "fp8_e4m3", 4, 1, 16, 900, 16, False, 0, None),
    (6, "fp8_ds_mla", 4, 1, 16, 900, 64, False, 0, True),
    (7, "fp8_e4m3", 4, 1, 16, 1000, 16, False, 0, None),
    (7, "fp8_e4m3", 3, 2, 16, 700, 32, True, 1, True),
    (8, "fp8_e4m3", 4, 1, 32, 1000, 64, False, 0, None),
    (8, "fp8_e4m3", 3, 1, 16, 700, 128, False, 1, True),
    (9, "fp8_e4m3", 4, 1, 128, 1000, 64, False, 0, None),
    (9, "fp8_e4m3", 3, 2, 32, 900, 128, True, 1, None),
]
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
# (name, the bad id for a cache of n blocks, where in the request's live pages)
BAD_IDS = [("m1-middle", lambda n: -1, "middle"), ("nb-last", lambda n: n, "last"),
           ("int32min-first", lambda n: INT32_MIN, "first"), ("int32max-middle", lambda n: INT32_MAX, "middle")]


def _bad_id_run_id(c):
    v, fmt, b, s, h, L, ps, causal, zero, fused = c
    return (f"v{v}-{fmt}-b{b}xs{s}xh{h}-L{L}-ps{ps}" + ("-causal" if causal else "") + (f"-zero{zero}" if zero else "")
            + ({True: "-fused", False: "-separate", None: ""}[fused]))


@pytest.mark.parametrize("bad", BAD_IDS, ids=[b[0] for b in BAD_IDS])
@pytest.mark.parametrize("cfg", BAD_ID_GRID, ids=[_bad_id_run_id(c) for c in BAD_ID_GRID])
def test_bad_block_id_poisons_its_request_only(cfg, bad, gen):
    """Each mainloop, forced, on a table with one bad block id in request 1's live part: that request's out rows and
    lse are all NaN (written: the outputs start as finite sentinels), nothing is read outside the cache (the GPU run
    of ci/bad_tables.py is under compute-sanitizer), and every other request is bitwise what a run on the repaired
    table gives."""
    variant, kv_format, b, s_q, h_q, L, ps, causal, zero, fused = cfg
    _, bad_id, where = bad
    dtype = torch.float16 if kv_format == "fp16" else torch.bfloat16
    case = make_case(b, s_q, h_q, L, page_size=ps, dtype=dtype, causal=causal, zero_len_rows=zero,
                     kv_format=None if kv_format in ("bf16", "fp16") else kv_format, device="cuda", generator=gen)
    live = -(-int(case.cache_seqlens[1]) // ps)
    assert live > 0
    j = {"first": 0, "middle": live // 2, "last": live - 1}[where]
    table = case.block_table.clone()
    table[1, j] = bad_id(case.kv_cache.shape[0])
    options = {"variant": variant} if fused is None else {"variant": variant, "fuse_combine": fused}

    def run(block_table):
        c = dataclasses.replace(case, block_table=block_table)
        plan = _plan(c, **options)
        assert plan.state.launch.variant == variant
        out = torch.full((b, s_q, h_q, case.head_dim_v), 1024.0, dtype=case.q.dtype, device="cuda")
        lse = torch.full((b, h_q, s_q), 1024.0, dtype=torch.float32, device="cuda")
        plan.run(c.q, c.kv_cache, kv_scale=c.kv_scale, out=out, lse=lse)
        torch.cuda.synchronize()
        return plan, out, lse

    plan, out, lse = run(table)
    _, good_out, good_lse = run(case.block_table)
    if fused is not None:
        assert plan.state.launch.fuse_combine == fused
    assert torch.isnan(out[1]).all() and torch.isnan(lse[1]).all(), (
        f"{int((~torch.isnan(out[1])).sum())} out and {int((~torch.isnan(lse[1])).sum())} lse values of request 1 "
        "are not NaN")
    others = [i for i in range(b) if i != 1]
    assert torch.equal(out[others].view(torch.int16), good_out[others].view(torch.int16))
    assert torch.equal(lse[others].view(torch.int32), good_lse[others].view(torch.int32))
    _check(case, good_out, good_lse)  # the repaired run is right


# Sparse (top-k) decode: (batch, s_q, h_q, h_kv, seqlen, page_size, topk, kv_format, zero_len_rows). make_case draws
# each query position's top-k slots from its request's tokens (~10% of them -1, and -1 past a short request's end);
# the cache's unused slots hold NaN, so a kernel that reads a skipped slot fails.
SPARSE_GRID = [
    (2, 1, 64, 1, 3000, 64, 2048, "fp8_ds_mla", 0),
    (3, 2, 128, 1, 2500, 64, 2048, "fp8_ds_mla", 1),
    (4, 3, 64, 1, 700, 61, 576, "fp8_ds_mla", 0),
    (4, 1, 128, 1, 1000, 2, 64, "fp8_ds_mla", 0),
    (2, 2, 16, 1, 900, 1, 128, "fp8_ds_mla", 0),
    (3, 1, 32, 1, 5000, 16, 2500, "bf16", 0),
    (2, 4, 8, 1, 400, 64, 100, "fp16", 1),
    (2, 2, 128, 1, 1200, 32, 256, "fp8_e4m3", 0),
    (2, 1, 32, 2, 800, 64, 300, "bf16", 0),
    (1, 1, 128, 1, 40000, 64, 8192, "fp8_ds_mla", 0),
    (3, 2, 32, 1, 2000, 64, 1024, "fp8_ds_mla", 0),
    (2, 1, 24, 1, 1500, 16, 512, "fp8_e4m3", 1),
]


def _sparse_id(c):
    b, s, h, hk, L, ps, topk, fmt, z = c
    return f"b{b}xs{s}xh{h}-hkv{hk}-L{L}-ps{ps}-topk{topk}-{fmt}" + (f"-zero{z}" if z else "")


def _sparse_case(cfg, gen):
    b, s_q, h_q, h_kv, L, ps, topk, fmt, zero = cfg
    dtype = torch.float16 if fmt == "fp16" else torch.bfloat16
    return make_case(b, s_q, h_q, L, num_heads_kv=h_kv, page_size=ps, topk=topk, dtype=dtype, zero_len_rows=zero,
                     kv_format=None if fmt in ("bf16", "fp16") else fmt, device="cuda", generator=gen)


def _sparse_variants(case):
    """The plan's mainloop for a sparse case first, then every other sparse mainloop that takes the case."""
    chosen = cuda_sm90.choose_sparse_variant(cuda_sm90.sparse_view(_plan(case).problem))
    others = [v for v, m in cuda_sm90.MAINLOOPS.items() if m.sparse_formats and v != chosen]
    return [chosen] + [v for v in others if not _refusal(case, v)]


@pytest.mark.parametrize("cfg", SPARSE_GRID, ids=[_sparse_id(c) for c in SPARSE_GRID])
def test_sparse_matches_reference(cfg, gen):
    """Top-k decode on the flattened view, on the plan's mainloop (fp8t_convert for <= 32 heads over an fp8 cache,
    wgmma otherwise) and on every other sparse one where it runs (etap in row tiles of 16 above 16 heads), checked over
    two runs with fresh poison each; query positions whose slots are all -1 give out 0 and lse +inf as the reference
    does."""
    case = _sparse_case(cfg, gen)
    variants = _sparse_variants(case)
    assert _plan(case).state.launch.variant == variants[0]
    for variant in variants:
        plan = _plan(case, variant=variant)
        assert plan.backend == "cuda_sm90" and plan.state.launch.variant == variant
        for _ in range(2):
            _run_and_check(plan, case)


@pytest.mark.parametrize("fuse_combine", [True, False], ids=["fused", "separate"])
def test_sparse_combine_inside_and_after_the_decode_launch(fuse_combine, gen):
    case = _sparse_case((2, 2, 64, 1, 3000, 64, 2048, "fp8_ds_mla", 0), gen)
    plan = _plan(case, fuse_combine=fuse_combine)
    assert plan.state.launch.fuse_combine == fuse_combine
    _run_and_check(plan, case)


def test_sparse_refuses_other_mainloops(gen):
    case = _sparse_case((2, 1, 16, 1, 900, 64, 128, "bf16", 0), gen)
    with pytest.raises(ValueError, match="sparse indices"):
        _plan(case, variant=cuda_sm90.ETAP)


@pytest.mark.parametrize("h_q,variant", [(64, cuda_sm90.WGMMA), (16, cuda_sm90.FP8T_CONVERT), (16, cuda_sm90.ETAP)],
                         ids=["wgmma", "fp8t_convert", "etap"])
def test_sparse_bad_index_poisons_its_query_position_only(h_q, variant, gen):
    """An index outside [-1, num_blocks * page_size) is a bad id (NaN out and lse for that query position, nothing
    read outside the cache); -1 stays a skipped slot; other positions are bitwise unchanged."""
    case = _sparse_case((3, 2, h_q, 1, 900, 16, 256, "fp8_ds_mla", 0), gen)
    tokens = case.kv_cache.shape[0] * case.kv_cache.shape[1]
    bad = case.indices.clone()
    bad[1, 0, 5] = tokens
    bad[2, 1, 0] = -7

    def run(indices):
        plan = plan_decode(*dataclasses.replace(case, indices=indices).args(), backend="cuda_sm90",
                           validate=False, backend_options={"variant": variant},
                           **dataclasses.replace(case, indices=indices).kwargs())
        assert plan.state.launch.variant == variant
        out = torch.full((3, 2, h_q, 512), 1024.0, dtype=case.q.dtype, device="cuda")
        lse = torch.full((3, h_q, 2), 1024.0, dtype=torch.float32, device="cuda")
        plan.run(case.q, case.kv_cache, indices=indices, out=out, lse=lse)
        torch.cuda.synchronize()
        return out, lse

    out, lse = run(bad)
    good_out, good_lse = run(case.indices)
    for b, s in ((1, 0), (2, 1)):
        assert torch.isnan(out[b, s]).all() and torch.isnan(lse[b, :, s]).all()
    for b, s in ((0, 0), (0, 1), (1, 1), (2, 0)):
        assert torch.equal(out[b, s].view(torch.int16), good_out[b, s].view(torch.int16))
        assert torch.equal(lse[b, :, s].view(torch.int32), good_lse[b, :, s].view(torch.int32))
    _check(case, good_out, good_lse)


def test_sparse_cuda_graph_capture_and_replay(gen):
    """A sparse plan is captured whole (views, decode, combine, the LSE transpose for s_q > 1) and replays new
    indices written in place."""
    case = _sparse_case((4, 2, 128, 1, 3000, 64, 2048, "fp8_ds_mla", 0), gen)
    plan = plan_decode(*case.args(), backend="cuda_sm90", cuda_graph=True, **case.kwargs())
    out, lse = poisoned_outputs(case)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        plan.run(case.q, case.kv_cache, indices=case.indices, out=out, lse=lse)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(case.q, case.kv_cache, indices=case.indices, out=out, lse=lse)
    original = case.indices.clone()
    for _ in range(2):  # other top-k sets of the same cache, written in place: about 30% more slots skipped
        keep = torch.rand(original.shape, generator=gen, device="cpu").to("cuda") > 0.3
        case.indices.copy_(torch.where(keep, original, torch.full_like(original, -1)))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(dataclasses.replace(case, indices=case.indices.clone()), out, lse)


@pytest.mark.parametrize("fmt,ps", [("fp8_ds_mla", 64), ("fp8_ds_mla", 53), ("bf16", 16)])
def test_sparse_cache_blocks_with_padding(fmt, ps, gen):
    """Token ids are block * page_size + offset whatever the cache's block stride: blocks padded with NaN bytes (as
    FlashMLA's sparse test lays its cache out) are read from their own rows, the padding never."""
    case = _sparse_case((3, 2, 64, 1, 900, ps, 256, fmt, 0), gen)
    kv = case.kv_cache
    padded = torch.full((kv.shape[0], ps + 3, *kv.shape[2:]), 0xFF if fmt == "fp8_ds_mla" else float("nan"),
                        dtype=kv.dtype, device="cuda")
    padded[:, :ps] = kv
    case = dataclasses.replace(case, kv_cache=padded[:, :ps])
    assert case.kv_cache.stride(0) == (ps + 3) * case.kv_cache.stride(1)
    _run_and_check(_plan(case), case)


# DeepSeek-V4 (fp8_ds_v4, FlashMLA's MODEL1) and FlashMLA's optional sparse arguments: (b, s_q, h_q, page, topk,
# extra (topk, page) or None, topk_length, extra_topk_length, sink, kv_format). FlashMLA's own shapes (page 256 + an
# extra cache on pages of 64 / 2, topk 128 + 512 / 1024) and odd ones (pages of 61 / 2, h_q 16 / 3, topk 40).
V4_GRID = [
    (2, 2, 64, 256, 128, (512, 64), False, False, True, "fp8_ds_v4"),
    (4, 2, 128, 256, 128, (1024, 2), False, True, True, "fp8_ds_v4"),
    (3, 1, 16, 61, 40, (24, 2), True, True, True, "fp8_ds_v4"),
    (3, 2, 3, 64, 64, None, True, False, False, "fp8_ds_v4"),
    (2, 2, 64, 64, 256, None, True, False, True, "fp8_ds_mla"),
    (2, 1, 16, 16, 96, (32, 5), True, False, True, "bf16"),
]


def _v4_id(c):
    b, s, h, ps, topk, extra, tl, etl, sink, fmt = c
    return (f"{fmt}-b{b}xs{s}xh{h}-ps{ps}-topk{topk}" + (f"+{extra[0]}ps{extra[1]}" if extra else "")
            + ("-len" if tl else "") + ("-xlen" if etl else "") + ("-sink" if sink else ""))


def _v4_case(cfg, gen):
    b, s_q, h_q, ps, topk, extra, tl, etl, sink, fmt = cfg
    dims = dict(head_dim_qk=512, head_dim_v=512) if fmt == "fp8_ds_v4" else {}
    return make_case(b, s_q, h_q, 4 * topk, page_size=ps, topk=topk, kv_format=fmt, topk_length=tl, attn_sink=sink,
                     extra_topk=extra[0] if extra else 0, extra_page_size=extra[1] if extra else None,
                     extra_topk_length=etl, zero_len_rows=1, device="cuda", generator=gen, **dims)


@pytest.mark.parametrize("cfg", V4_GRID, ids=[_v4_id(c) for c in V4_GRID])
def test_sparse_v4_and_optional_arguments(cfg, gen):
    """DeepSeek-V4's cache and FlashMLA's topk_length / attn_sink / extra cache on the plan's mainloop and on the other
    sparse one where it runs (the extra cache by a second launch whose combine merges both lists), twice into fresh
    poison; forced splits with the combine inside and after the decode launch (a plan with an extra cache merges in
    the second kernel whatever fuse_combine says)."""
    case = _v4_case(cfg, gen)
    variants = _sparse_variants(case)
    runs = [({}, variants[0]), ({"fuse_combine": True, "min_chunks_per_part": 1}, variants[0]),
            ({"fuse_combine": False}, variants[0])] + [({"variant": v, "min_chunks_per_part": 1}, v)
                                                        for v in variants[1:]]
    for options, variant in runs:
        plan = _plan(case, **options)
        assert plan.backend == "cuda_sm90" and plan.state.launch.variant == variant
        for _ in range(2):
            out, lse = poisoned_outputs(case)
            plan.run(case.q, case.kv_cache, indices=case.indices, out=out, lse=lse, **case.sparse_extras())
            torch.cuda.synchronize()
            _check(case, out, lse)


def test_sparse_v4_cuda_graph(gen):
    """A V4 plan with every optional argument is captured and replays new topk lengths and sinks written in place."""
    case = _v4_case((4, 2, 64, 256, 128, (512, 64), True, True, True, "fp8_ds_v4"), gen)
    plan = plan_decode(*case.args(), backend="cuda_sm90", cuda_graph=True, **case.kwargs())
    out, lse = poisoned_outputs(case)
    run = lambda: plan.run(case.q, case.kv_cache, indices=case.indices, out=out, lse=lse,  # noqa: E731
                           **case.sparse_extras())
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    original = case.topk_length.clone()  # entries past it hold ids that must not be read: lengths may only shrink
    for _ in range(2):
        shrink = torch.rand(original.shape, generator=gen).to("cuda")
        case.topk_length.copy_((original * shrink).to(torch.int32))
        case.attn_sink.copy_(torch.randn(case.attn_sink.shape, generator=gen).to("cuda"))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(case, out, lse)


def test_sparse_out_with_strided_rows(gen):
    """out whose (b, s) rows cannot be flattened (a slice of a larger buffer) is written through a copy."""
    case = _sparse_case((3, 2, 16, 1, 600, 64, 128, "bf16", 0), gen)
    plan = _plan(case)
    big = torch.full((3, 3, 16, 512), float("nan"), dtype=case.q.dtype, device="cuda")
    out = big[:, :2]
    _, lse = poisoned_outputs(case)
    plan.run(case.q, case.kv_cache, indices=case.indices, out=out, lse=lse)
    torch.cuda.synchronize()
    _check(case, out, lse)
    assert torch.isnan(big[:, 2]).all()


@pytest.mark.parametrize("h_q", [64, 16])
def test_long_context_128k(h_q, gen):
    # 131072 tokens x 1152 bytes: 64-bit offsets into the cache are exercised (h_q 16: the mainloop of <= 32 rows)
    case = make_case(1, 1, h_q, 131072, varlen=False, page_size=64, device="cuda", generator=gen)
    _run_case(case)


def test_batch_1024(gen):
    case = make_case(1024, 1, 16, 64, page_size=64, device="cuda", generator=gen)
    _run_case(case)


@pytest.mark.parametrize("fuse_combine", [True, False], ids=["fused", "separate"])
def test_cuda_graph_capture_and_replay_with_update(fuse_combine, gen):
    case = make_case(6, 2, 64, 700, page_size=64, causal=True, device="cuda", generator=gen)
    # the cooperative launch is captured too
    plan = plan_decode(*case.args(), backend="cuda_sm90", cuda_graph=True,
                       backend_options={"fuse_combine": fuse_combine}, **case.kwargs())
    out, lse = poisoned_outputs(case)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up off the capture
        plan.run(case.q, case.kv_cache, out=out, lse=lse)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(case.q, case.kv_cache, out=out, lse=lse)
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _check(case, out, lse)

    # New lengths (shorter, never past the table's blocks; one request emptied) and fresh q in place.
    new_lens = (case.cache_seqlens.float() * torch.rand(6, generator=gen).to("cuda")).to(torch.int32).clamp_min(2)
    new_lens[-1] = 0
    case.cache_seqlens.copy_(new_lens)
    case.q.copy_((torch.randn(case.q.shape, generator=gen) / 10).clamp(-1, 1).to(case.q.dtype))
    plan.update()
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _check(case, out, lse)


def test_out_argument_and_default_allocation(gen):
    case = make_case(3, 1, 16, 200, page_size=32, device="cuda", generator=gen)
    plan = plan_decode(*case.args(), backend="cuda_sm90", **case.kwargs())
    out, lse = plan.run(case.q, case.kv_cache)
    torch.cuda.synchronize()
    _check(case, out, lse)
    out2, _ = poisoned_outputs(case)
    got, _ = plan.run(case.q, case.kv_cache, out=out2)
    assert got.data_ptr() == out2.data_ptr()
    torch.cuda.synchronize()
    _check(case, out2, lse)


_BINDING_CHECKS = r"""
import pytest, torch
from mla_dispatch import plan_decode
from mla_dispatch.numerics.cases import make_case
case = make_case(2, 1, 16, 100, page_size=64, device="cuda", generator=torch.Generator().manual_seed(SEED))
plan = plan_decode(*case.args(), backend="cuda_sm90", **case.kwargs())
st, s = plan.state, plan.state.schedule
out = torch.full((2, 1, 16, 512), float("nan"), dtype=case.q.dtype, device="cuda")
lse = torch.full((2, 16, 1), float("nan"), device="cuda")

def call(**over):
    args = dict(q=case.q, kv_cache=case.kv_cache, block_table=case.block_table, cache_seqlens=case.cache_seqlens,
                items=s.items, part_offsets=s.part_offsets, kv_scale=None, out=out, lse=lse,
                partial_out=st.partial_out, partial_lse=st.partial_lse, num_splits=s.num_splits,
                first_slot=st.first_slot, softmax_scale=0.1, causal=False, kv_format=0, variant=2, tile_rows=64,
                tma_loads=False, paired=False, fuse_combine=False, fixed_splits=False)
    args.update(over)
    torch.ops.mla_dispatch.cuda_sm90_decode(*args.values())

for over, pattern in [
    (dict(q=case.q.float()), "q must be bfloat16 or float16"),
    (dict(q=case.q[..., :512]), r"q must be \[B, s_q, h_q, 576\]"),
    (dict(block_table=case.block_table.long()), "block_table must be int32"),
    (dict(cache_seqlens=case.cache_seqlens[:1]), "cache_seqlens must be contiguous"),
    (dict(out=out.float()), "out must be"),
    (dict(out=torch.empty(2, 1, 16, 513, dtype=case.q.dtype, device="cuda")[..., :512]),
     "out rows must start at 4-byte boundaries"),
    (dict(partial_out=st.partial_out.half()), "partial_out must be contiguous float32"),
    (dict(lse=lse.double()), "lse must be float32"),
    (dict(kv_format=1, kv_cache=case.kv_cache.view(torch.uint8)[..., :576].contiguous()), "kv_scale must be"),
    (dict(q=case.q.cpu()), "must be a CUDA tensor"),
    (dict(kv_cache=case.kv_cache[:0]), "kv_cache needs num_blocks >= 1"),  # a bad block id reads block 0 instead
    # the launch config: refused with the field and what it must be, never replaced by another kernel
    (dict(variant=10), "variant must be 2 .wgmma., 5"),
    (dict(variant=7, tile_rows=16), "variant 7 needs an fp8_e4m3 cache .kv_format 1., got kv_format 0"),
    (dict(tile_rows=32), "tile_rows must be 64 for variant 2, got 32"),
    (dict(variant=6), "tile_rows must be 16 or 32 and hold the 16 query rows per KV head for variant 6, got 64"),
    (dict(tma_loads=True), "tma_loads must be false for variant 2"),
    (dict(variant=5, tma_loads=True, paired=True), "paired=true needs variant 5 and an even number of 64-row tiles"),
    (dict(variant=5, tma_loads=True, fuse_combine=True), "fuse_combine must be false for variant 5 .it has no combine"),
    (dict(fuse_combine=True, fixed_splits=True), "fuse_combine must be false with fixed_splits=true"),
    # sparse launches: etap in row tiles of its fp8 tile; fp8t_convert and etap over fp8 caches, seesaw_fp8 over the
    # scaled ones only
    (dict(variant=6, tile_rows=32, sparse=True), "tile_rows must be 16 for a sparse launch of variant 6 .its fp8 tile., "
     "got 32"),
    (dict(variant=7, tile_rows=16, sparse=True), "sparse=true needs variant 2, variant 6 or 7 with an fp8 cache, or "
     "variant 9 with an fp8_ds_mla or fp8_ds_v4 cache"),
    (dict(variant=9, sparse=True), "sparse=true needs variant 2, variant 6 or 7 with an fp8 cache, or variant 9 with "
     "an fp8_ds_mla or fp8_ds_v4 cache .the mainloops that skip -1 top-k slots., got variant 9 and kv_format 0"),
]:
    with pytest.raises(ValueError, match=pattern):
        call(**over)
    print("ok", pattern, flush=True)
call()  # the unmodified call is accepted
torch.cuda.synchronize()
assert not torch.isnan(out).any()
print("ALL OK")
"""


def test_binding_rejects_bad_arguments(seed):
    # In a subprocess: a crash in the binding's error path must fail this test, not the session.
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _BINDING_CHECKS.replace("SEED", str(seed))], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "ALL OK" in proc.stdout, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("fuse_combine", [False, True], ids=["separate", "fused"])
def test_opcheck(fuse_combine, gen):
    case = make_case(2, 1, 16, 100, page_size=64, device="cuda", generator=gen)
    plan = plan_decode(*case.args(), backend="cuda_sm90", **case.kwargs())
    st, s = plan.state, plan.state.schedule
    out, lse = poisoned_outputs(case)
    args = (case.q, case.kv_cache, case.block_table, case.cache_seqlens, s.items, s.part_offsets, None, out, lse,
            st.partial_out, st.partial_lse, s.num_splits, st.first_slot, case.softmax_scale, False, 0, 2, 64, False,
            False, fuse_combine, False)
    torch.library.opcheck(torch.ops.mla_dispatch.cuda_sm90_decode.default, args,
                          test_utils=("test_schema", "test_faketensor"))


def _forbid(name):
    def call(*args):
        raise AssertionError(f"{name} was called")

    return call


def test_eager_run_calls_the_bound_plan_without_the_dispatcher(gen):
    """A plain eager run takes the plan's bound native call (PlannedDecode.run); where that declines, the module
    function (no dispatcher either); their results are the op's."""
    case = make_case(4, 1, 16, 300, page_size=64, device="cuda", generator=gen)
    plan = plan_decode(*case.args(), backend="cuda_sm90", **case.kwargs())
    direct = plan.state.direct
    plan.state.op = _forbid("the dispatcher op")
    plan.state.direct = _forbid("the extension function")
    out, lse = poisoned_outputs(case)
    plan.run(case.q, case.kv_cache, out=out, lse=lse)
    torch.cuda.synchronize()
    _check(case, out, lse)

    plan.state.direct = direct
    plan._fast = _forbid("the bound call")
    out, lse = poisoned_outputs(case)
    with pytest.raises(AssertionError, match="the bound call was called"):
        plan.run(case.q, case.kv_cache, out=out, lse=lse)
    plan._fast = lambda *args: None  # declines: the checked path and the module function run
    plan.run(case.q, case.kv_cache, out=out, lse=lse)
    torch.cuda.synchronize()
    _check(case, out, lse)


def test_bound_call_declines_what_the_plan_was_not_made_for(gen):
    """PlannedDecode.run returns None and launches nothing for arguments off the plan; DecodePlan.run then raises
    the checked path's error, which names the argument. Given no out / lse it allocates them."""
    case = make_case(2, 1, 16, 200, page_size=64, device="cuda", generator=gen)
    plan = plan_decode(*case.args(), backend="cuda_sm90", **case.kwargs())
    bound = plan.state.bound
    out, lse = poisoned_outputs(case)
    bad = {
        "q batch": (case.q[:1], case.kv_cache, None, out, lse),
        "q dtype": (case.q.half(), case.kv_cache, None, out, lse),
        "cache dtype": (case.q, case.kv_cache.half(), None, out, lse),
        "cache page size": (case.q, case.kv_cache[:, :32], None, out, lse),
        "scale on a bf16 cache": (case.q, case.kv_cache, torch.ones(1, device="cuda"), out, lse),
        "out dtype": (case.q, case.kv_cache, None, out.float(), lse),
        "lse shape": (case.q, case.kv_cache, None, out, lse[:1]),
        "q on the CPU": (case.q.cpu(), case.kv_cache, None, out, lse),
    }
    for name, args in bad.items():
        assert bound.run(*args) is None, name
    torch.cuda.synchronize()
    assert torch.isnan(out).all() and torch.isnan(lse).all()  # nothing was launched
    with pytest.raises(ValueError, match=r"out must be \[2, 1, 16, 512\] torch.bfloat16"):
        plan.run(case.q, case.kv_cache, out=out.float(), lse=lse)
    got = bound.run(case.q, case.kv_cache, None, out, lse)
    assert got[0] is out and got[1] is lse
    torch.cuda.synchronize()
    _check(case, out, lse)
    new_out, new_lse = bound.run(case.q, case.kv_cache, None, None, None)  # allocated by the call
    assert new_out.shape == out.shape and new_out.dtype == out.dtype and new_lse.shape == lse.shape
    torch.cuda.synchronize()
    _check(case, new_out, new_lse)


def test_the_plans_launch_reaches_the_bound_call(gen):
    """The bound native call runs the plan's frozen launch (forced here through backend_options); neither can be
    changed after planning."""
    case = make_case(2, 1, 16, 200, page_size=64, device="cuda", generator=gen)
    for options, invariant, want in [(dict(variant=2, fuse_combine=True), False, (2, 64, False, False, True, False)),
                                     (dict(variant=6, fuse_combine=False), False, (6, 16, True, False, False, False)),
                                     (dict(variant=2), True, (2, 64, False, False, False, True))]:
        plan = plan_decode(*case.args(), **case.kwargs(), backend="cuda_sm90", backend_options=options,
                           batch_invariant=invariant)
        b = plan.state.bound
        assert dataclasses.astuple(plan.state.launch) == (b.variant, b.tile_rows, b.tma_loads, b.paired,
                                                          b.fuse_combine, b.fixed_splits) == want
        assert dict(plan.backend_options) == options
    with pytest.raises(AttributeError):
        plan.state.bound.variant = 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.state.launch.variant = 2


@pytest.mark.parametrize("variant", [5, 6, 9])
def test_cached_tensor_maps_follow_the_cache(variant, gen):
    """The TMA tensor map is cached per cache (address, shape, strides). Two layers' caches alternate, so a map
    reused across addresses would read the other layer's values; a narrower view of one (the same address, fewer
    blocks) runs too. Every run matches the reference. (v9: an fp8_e4m3 cache, whose raw map is cached apart from
    v8's.)"""
    b, h_q = (2, 16) if variant == 6 else (32, 128)
    kv_format = "fp8_e4m3" if variant == 9 else "bf16"
    case = make_case(b, 1, h_q, 300, page_size=64, device="cuda", generator=gen, varlen=False, kv_format=kv_format)
    plan = _plan(case, variant=variant)
    used = int(case.block_table.max()) + 1
    other = (torch.randn_like(case.kv_cache.float()) / (10 if variant == 9 else 1)).to(case.kv_cache.dtype)
    caches = [case.kv_cache, other, case.kv_cache[:used]]
    for kv in caches + caches[::-1]:
        out, lse = poisoned_outputs(case)
        plan.run(case.q, kv, kv_scale=case.kv_scale, out=out, lse=lse)
        torch.cuda.synchronize()
        _check(dataclasses.replace(case, kv_cache=kv), out, lse)


def test_fake_tensors_and_torch_compile_take_the_op(gen):
    """Under a TorchDispatchMode (fake tensors) and under torch.compile the op runs, so it is traced; compiled, the
    results match the reference."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    case = make_case(3, 2, 16, 200, page_size=64, causal=True, device="cuda", generator=gen)
    plan = plan_decode(*case.args(), backend="cuda_sm90", **case.kwargs())
    direct, fast = plan.state.direct, plan._fast
    plan.state.direct = _forbid("the extension function")
    plan._fast = _forbid("the bound call")
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fq, fkv = mode.from_tensor(case.q), mode.from_tensor(case.kv_cache)
        fout, flse = plan.run(fq, fkv)  # the op's fake implementation: shapes only
    assert fout.shape == (3, 2, 16, 512) and flse.shape == (3, 16, 2)

    out, lse = poisoned_outputs(case)
    compiled = torch.compile(lambda q, kv: plan.run(q, kv, out=out, lse=lse), fullgraph=True)
    compiled(case.q, case.kv_cache)
    torch.cuda.synchronize()
    _check(case, out, lse)
    plan.state.direct, plan._fast = direct, fast

