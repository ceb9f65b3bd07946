"""The Triton backend on a GPU against the fp32 reference (docs/design.md §5 tolerances).

Fresh random data every run (the session seed in the header replays it), output
poisoned with NaN before every run, NaN in every unused cache slot and garbage
block ids past every request's length (``make_case``). Speed is never asserted
here: see dev/bench_triton.py. The registered op ``torch.ops.mla_dispatch.triton_decode``
(a ``triton_op`` on the GPU) is checked with ``torch.library.opcheck`` and under
``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import pytest
import torch

from mla_dispatch.numerics.cases import case_reference, make_case, poisoned_outputs, scale_outputs
from mla_dispatch.numerics.tolerance import compare_outputs

pytestmark = pytest.mark.gpu

_V4 = dict(head_dim_qk=512, head_dim_v=512, kv_format="fp8_ds_v4")

# (make_case kwargs, make_state overrides); ids are generated from the kwargs
CASES = [
    (dict(batch=4, q_len=1, num_heads_q=16, seqlen=300, page_size=64), {}),
    (dict(batch=4, q_len=1, num_heads_q=128, seqlen=300, page_size=64), {}),
    (dict(batch=3, q_len=2, num_heads_q=128, seqlen=200, page_size=1, causal=True), {}),
    (dict(batch=3, q_len=16, num_heads_q=16, seqlen=200, page_size=16, causal=True, zero_len_rows=1), {}),
    (dict(batch=3, q_len=16, num_heads_q=16, seqlen=200, page_size=16), {}),
    (dict(batch=4, q_len=1, num_heads_q=1, seqlen=600, page_size=256), {}),
    (dict(batch=3, q_len=1, num_heads_q=32, num_heads_kv=2, seqlen=300, page_size=100), {}),
    (dict(batch=2, q_len=4, num_heads_q=8, seqlen=150, page_size=33, causal=True), {}),
    (dict(batch=4, q_len=1, num_heads_q=64, seqlen=300, page_size=64, dtype=torch.float16), {}),
    # 64 rows on small pages: the block table prefetched a stage ahead (decode.SMALL_PAGE_CONFIGS), split requests;
    # 32 rows on page 16; fp8 caches with 32 and 64 rows (the 64-row config)
    # (equal lengths: drawn ones once came out 1, 1 and 0 tokens, and nothing was split)
    (dict(batch=3, q_len=1, num_heads_q=64, seqlen=500, page_size=1, zero_len_rows=1, varlen=False),
     dict(num_parts=20, overhead=1)),
    (dict(batch=3, q_len=2, num_heads_q=32, seqlen=300, page_size=16, causal=True), {}),
    (dict(batch=3, q_len=2, num_heads_q=16, seqlen=300, page_size=64, kv_format="fp8_e4m3", causal=True), {}),
    (dict(batch=3, q_len=1, num_heads_q=64, seqlen=300, page_size=16, kv_format="fp8_e4m3"), {}),
    (dict(batch=3, q_len=1, num_heads_q=64, seqlen=300, page_size=32, kv_format="fp8_ds_mla"), {}),
    (dict(batch=3, q_len=2, num_heads_q=16, seqlen=300, page_size=1, kv_format="fp8_ds_mla", causal=True),
     dict(num_parts=20, overhead=1)),
    (dict(batch=3, q_len=2, num_heads_q=16, seqlen=300, page_size=16, dtype=torch.float16, causal=True), {}),
    (dict(batch=4, q_len=1, num_heads_q=16, seqlen=300, page_size=64, kv_format="fp8_e4m3"), {}),
    (dict(batch=4, q_len=1, num_heads_q=128, seqlen=300, page_size=64, kv_format="fp8_e4m3"), {}),
    # the plain kernel's fp8 configs for 64 / 128 rows, where the table now picks the Gluon kernel on sm_90
    (dict(batch=3, q_len=1, num_heads_q=64, seqlen=300, page_size=16, kv_format="fp8_e4m3"), dict(spec="hM64-n64-w8")),
    (dict(batch=4, q_len=1, num_heads_q=128, seqlen=300, page_size=64, kv_format="fp8_e4m3"), dict(spec="hM64-n32-w8")),
    (dict(batch=4, q_len=1, num_heads_q=16, seqlen=300, page_size=64, kv_format="fp8_ds_mla"), {}),
    (dict(batch=3, q_len=2, num_heads_q=16, seqlen=300, page_size=16, kv_format="fp8_e4m3", causal=True), {}),
    (dict(batch=3, q_len=2, num_heads_q=16, seqlen=300, page_size=16, kv_format="fp8_ds_mla", causal=True,
          zero_len_rows=1), {}),
    (dict(batch=3, q_len=2, num_heads_q=128, seqlen=300, page_size=64, kv_format="fp8_ds_mla", causal=True), {}),
    (dict(batch=3, q_len=2, num_heads_q=16, seqlen=300, page_size=64, topk=128), {}),
    (dict(batch=2, q_len=1, num_heads_q=128, seqlen=600, page_size=64, topk=256, kv_format="fp8_ds_mla"), {}),
    (dict(batch=3, q_len=2, num_heads_q=128, seqlen=400, page_size=64, causal=True, zero_len_rows=1),
     dict(num_parts=40, overhead=1)),
    (dict(batch=3, q_len=1, num_heads_q=16, seqlen=400, page_size=16, kv_format="fp8_e4m3"),
     dict(num_parts=33, overhead=1)),
    (dict(batch=2, q_len=1, num_heads_q=16, seqlen=200, page_size=64, head_dim_qk=512), {}),
    (dict(batch=2, q_len=1, num_heads_q=128, seqlen=5000, page_size=64, varlen=False), {}),
    # more requests than part boundaries: the combine's grid runs over the boundaries (combine.combine_by_boundary)
    (dict(batch=40, q_len=2, num_heads_q=16, seqlen=300, page_size=16, causal=True, zero_len_rows=2),
     dict(num_parts=12, overhead=1)),
    (dict(batch=200, q_len=1, num_heads_q=128, seqlen=1000, page_size=64), {}),
    # whole tiles by TMA (KernelConfig.tma), the partial last tile of each item by the masked gather; the cache's
    # unused slots hold NaN, so a tail read by TMA would show
    (dict(batch=4, q_len=1, num_heads_q=16, seqlen=300, page_size=64), dict(spec="tM16-n32-s4-tma")),
    (dict(batch=3, q_len=2, num_heads_q=32, seqlen=300, page_size=64, causal=True, zero_len_rows=1),
     dict(spec="hM64-n32-w8-s4-tma", num_parts=20, overhead=1)),
    (dict(batch=4, q_len=1, num_heads_q=128, seqlen=700, page_size=128), dict(spec="hM64-n64-w8-tma")),
    (dict(batch=3, q_len=1, num_heads_q=32, seqlen=600, page_size=256, dtype=torch.float16),
     dict(spec="tM32-n64-tma")),
    (dict(batch=2, q_len=1, num_heads_q=16, seqlen=200, page_size=64, head_dim_qk=512), dict(spec="tM16-n32-s4-tma")),
    # the Gluon sm_90 kernel (KernelConfig.gluon, kernels/triton/gluon_sm90.py): whole tiles by TMA, an item's
    # partial last tile by masked cp.async (NaN in the unused slots would show), 64-row tiles padded with the next
    # request's query rows (32 rows), causal s_q = 2 and 4, split requests, zero-length rows, pages 64 / 128 / 256
    (dict(batch=4, q_len=1, num_heads_q=128, seqlen=700, page_size=128), dict(spec="hM64-n64-w8-tma-gl")),
    (dict(batch=3, q_len=2, num_heads_q=128, seqlen=400, page_size=64, causal=True, zero_len_rows=1),
     dict(spec="hM64-n64-w8-tma-gl", num_parts=40, overhead=1)),
    (dict(batch=4, q_len=1, num_heads_q=64, seqlen=600, page_size=256, dtype=torch.float16),
     dict(spec="hM64-n64-w8-tma-gl")),
    (dict(batch=3, q_len=1, num_heads_q=32, seqlen=500, page_size=64), dict(spec="hM64-n64-w8-tma-gl", num_parts=20,
                                                                          overhead=1)),
    (dict(batch=3, q_len=4, num_heads_q=16, seqlen=100, page_size=64, causal=True, zero_len_rows=1),
     dict(spec="hM64-n64-w8-tma-gl")),
    (dict(batch=2, q_len=1, num_heads_q=128, seqlen=5000, page_size=64, varlen=False), dict(spec="hM64-n64-w8-tma-gl")),
    # the seesaw kernel (gluon_seesaw.py; the Gluon config on 16-bit pages of whole tiles, as the cases above): items
    # of one to a few tiles in both stages, partial last tiles in stage 0 and 1, s_q = 3 causal, fp16
    (dict(batch=5, q_len=1, num_heads_q=64, seqlen=700, page_size=64, zero_len_rows=1),
     dict(spec="hM64-n64-w8-tma-gl", num_parts=30, overhead=1)),
    (dict(batch=3, q_len=3, num_heads_q=128, seqlen=900, page_size=256, causal=True, dtype=torch.float16),
     dict(spec="hM64-n64-w8-tma-gl", num_parts=24, overhead=1)),
    # ... and kept on gluon_sm90 (backend_options={"kernel": "gluon"}): the gluon_sm90 kernel's TMA path
    (dict(batch=3, q_len=2, num_heads_q=128, seqlen=400, page_size=64, causal=True, zero_len_rows=1),
     dict(spec="hM64-n64-w8-tma-gl", num_parts=40, overhead=1, seesaw=False)),
    (dict(batch=4, q_len=1, num_heads_q=16, seqlen=700, page_size=128), dict(spec="hM64-n64-w8-tma-gl", seesaw=False)),
    # ... and on pages not holding whole tiles, every tile gathered by masked cp.async, one table entry per token
    # (garbage block ids past a request's length never read): pages 1 / 16 / 33 / 96, split and causal
    (dict(batch=3, q_len=1, num_heads_q=128, seqlen=300, page_size=1), dict(spec="hM64-n64-w8-tma-gl")),
    (dict(batch=3, q_len=2, num_heads_q=64, seqlen=400, page_size=16, causal=True, zero_len_rows=1),
     dict(spec="hM64-n64-w8-tma-gl", num_parts=40, overhead=1)),
    (dict(batch=4, q_len=1, num_heads_q=16, seqlen=500, page_size=33, dtype=torch.float16),
     dict(spec="hM64-n64-w8-tma-gl", num_parts=20, overhead=1)),
    (dict(batch=2, q_len=4, num_heads_q=32, seqlen=2000, page_size=96, causal=True), dict(spec="hM64-n64-w8-tma-gl")),
    # ... and on fp8_e4m3 caches: every tile gathered as fp8, converted in shared memory, the scale on S and O
    (dict(batch=3, q_len=1, num_heads_q=16, seqlen=300, page_size=64, kv_format="fp8_e4m3", zero_len_rows=1),
     dict(spec="hM64-n64-w8-tma-gl")),
    (dict(batch=3, q_len=2, num_heads_q=128, seqlen=700, page_size=16, kv_format="fp8_e4m3", causal=True),
     dict(spec="hM64-n64-w8-tma-gl", num_parts=30, overhead=1)),
    (dict(batch=4, q_len=1, num_heads_q=64, seqlen=500, page_size=1, kv_format="fp8_e4m3", dtype=torch.float16),
     dict(spec="hM64-n64-w8-tma-gl", num_parts=20, overhead=1)),
    (dict(batch=2, q_len=1, num_heads_q=32, seqlen=3000, page_size=128, kv_format="fp8_e4m3", varlen=False),
     dict(spec="hM64-n64-w8-tma-gl")),
    # (the cases above with at most 32 query rows take the tokens-on-M fp8 kernel, gluon_fp8.py; these keep
    # gluon_sm90's fp8 path checked at those row counts, backend_options={"kernel": "gluon"})
    (dict(batch=3, q_len=1, num_heads_q=16, seqlen=300, page_size=64, kv_format="fp8_e4m3", zero_len_rows=1),
     dict(spec="hM64-n64-w8-tma-gl", fp8t=False)),
    (dict(batch=4, q_len=1, num_heads_q=32, seqlen=500, page_size=1, kv_format="fp8_e4m3", dtype=torch.float16),
     dict(spec="hM64-n64-w8-tma-gl", num_parts=20, overhead=1, fp8t=False)),
    # the tokens-on-M fp8 kernel (gluon_fp8.py) at 16 and 32 rows per program: padding rows (8 and 24 query rows),
    # causal s_q = 2 and 3, split requests, zero-length rows, pages 1 / 16 / 33 / 64 / 256, fp16 queries
    (dict(batch=4, q_len=1, num_heads_q=8, seqlen=300, page_size=64, kv_format="fp8_e4m3"),
     dict(spec="hM64-n64-w8-tma-gl")),
    (dict(batch=3, q_len=2, num_heads_q=16, seqlen=400, page_size=16, kv_format="fp8_e4m3", causal=True),
     dict(spec="hM64-n64-w8-tma-gl", num_parts=30, overhead=1)),
    (dict(batch=3, q_len=3, num_heads_q=8, seqlen=500, page_size=33, kv_format="fp8_e4m3", causal=True,
          zero_len_rows=1), dict(spec="hM64-n64-w8-tma-gl", num_parts=30, overhead=1)),
    (dict(batch=3, q_len=1, num_heads_q=32, seqlen=900, page_size=256, kv_format="fp8_e4m3", dtype=torch.float16),
     dict(spec="hM64-n64-w8-tma-gl", num_parts=24, overhead=1)),
    (dict(batch=2, q_len=1, num_heads_q=16, seqlen=2000, page_size=1, kv_format="fp8_e4m3", varlen=False),
     dict(spec="hM64-n64-w8-tma-gl")),
    # DeepSeek-V4 (fp8_ds_v4) with FlashMLA's optional sparse arguments, bf16 queries (the interpreter runs fp16 only):
    # each rows bucket's config, FlashMLA's shapes (page 256, an extra cache on pages of 64 / 2), forced splits
    (dict(batch=3, q_len=2, num_heads_q=64, seqlen=2000, page_size=256, topk=128, extra_topk=512, extra_page_size=64,
          attn_sink=True, **_V4), {}),
    (dict(batch=4, q_len=2, num_heads_q=128, seqlen=2000, page_size=256, topk=128, extra_topk=1024,
          extra_page_size=2, extra_topk_length=True, attn_sink=True, **_V4), dict(num_parts=40, overhead=1)),
    (dict(batch=3, q_len=1, num_heads_q=16, seqlen=900, page_size=61, topk=200, topk_length=True, attn_sink=True,
          zero_len_rows=1, **_V4), dict(num_parts=20, overhead=1)),
    (dict(batch=2, q_len=2, num_heads_q=32, seqlen=900, page_size=64, topk=256, topk_length=True, attn_sink=True,
          kv_format="fp8_ds_mla"), {}),
]


def _case_id(kw: dict, overrides: dict) -> str:
    dt = "fp16" if kw.get("dtype") is torch.float16 else "bf16"
    fmt = kw.get("kv_format") or dt
    parts = [f"triton-{dt}-{fmt}", f"b{kw['batch']}xs{kw['q_len']}xh{kw['num_heads_q']}",
             f"ps{kw['page_size']}", f"L{kw['seqlen']}"]
    if kw.get("num_heads_kv", 1) > 1:
        parts.append(f"hkv{kw['num_heads_kv']}")
    if kw.get("head_dim_qk", 576) != 576:
        parts.append(f"d{kw['head_dim_qk']}")
    if kw.get("causal"):
        parts.append("causal")
    if kw.get("topk"):
        parts.append(f"topk{kw['topk']}")
    if kw.get("extra_topk"):
        parts.append(f"extra{kw['extra_topk']}ps{kw['extra_page_size']}")
    parts += [name for name in ("topk_length", "extra_topk_length", "attn_sink") if kw.get(name)]
    if kw.get("zero_len_rows"):
        parts.append("zero")
    if "spec" in overrides:
        parts.append(overrides["spec"])
    if "num_parts" in overrides:
        parts.append(f"split{overrides['num_parts']}")
    if overrides.get("seesaw") is False:
        parts.append("noseesaw")
    if overrides.get("fp8t") is False:
        parts.append("nofp8t")
    return "-".join(parts)


#: ids of CASES measured outside the tolerance on the H200 (2026-11-29, in two runs: out cosine difference
#: 1.24e-05 > 5e-06, max abs 1.8e-4; fp8_ds_mla, 256 query rows, causal): not explained yet. Strict xfails, so a fix
#: shows.
KNOWN_GPU_FAILURES = {"triton-bf16-fp8_ds_mla-b3xs2xh128-ps64-L300-causal"}


@pytest.mark.parametrize("kw,overrides", CASES, ids=[_case_id(*c) for c in CASES])
def test_triton_gpu_matches_reference(kw, overrides, gen, request):
    from mla_dispatch import plan_decode
    from mla_dispatch.backends.triton import TritonBackend

    if _case_id(kw, overrides) in KNOWN_GPU_FAILURES:
        request.applymarker(pytest.mark.xfail(strict=True, reason="H200: out cosine difference 1.24e-05 > 5e-06, "
                                                                  "not explained (KNOWN_GPU_FAILURES)"))

    kw = dict(kw)
    overrides = dict(overrides)
    # the seesaw kernel (16-bit pages of whole tiles) and the tokens-on-M fp8 kernel (fp8_e4m3, <= 32 query rows)
    # unless the case keeps gluon_sm90 there (backend_options={"kernel": "gluon"})
    seesaw = overrides.pop("seesaw", True)
    fp8t = overrides.pop("fp8t", True)
    dtype = kw.pop("dtype", torch.bfloat16)
    case = make_case(dtype=dtype, device="cuda", generator=gen, **kw)
    plan = plan_decode(*case.args(), backend="triton", **case.kwargs())
    if overrides or not (seesaw and fp8t):
        from mla_dispatch.kernels.triton.aot_report import parse_spec

        spec = overrides.pop("spec", None)
        cfg = parse_spec(spec) if spec else None
        plan._state = TritonBackend.make_state(plan.problem, plan.platform, plan.cache_seqlens, config=cfg,
                                               kernel=None if seesaw and fp8t else "gluon",
                                               block_table=plan.block_table, softmax_scale=plan.softmax_scale,
                                               **overrides)
        if "num_parts" in overrides:
            assert bool((plan.state.schedule.num_splits > 1).any()), "schedule override did not split any request"
        launch = plan.state.launch
        if cfg is not None and cfg.tma and not cfg.gluon:  # the case exists for the TMA path: the launch must take it
            assert launch.kernel == "tma", launch
        if cfg is not None and cfg.gluon:  # the case exists for the Gluon kernels: the launch must take one
            # 16-bit pages of whole tiles take the seesaw kernel, fp8_e4m3 caches with at most 32 query rows the
            # tokens-on-M fp8 kernel (unless the case keeps gluon_sm90); other cases the gluon_sm90 one
            want = "gluon"
            if seesaw and case.kv_cache.element_size() == 2 and case.kv_cache.shape[1] % 64 == 0:
                want = "seesaw"
            elif fp8t and case.kv_format == "fp8_e4m3" and case.q.shape[1] * case.q.shape[2] <= 32:
                want = "fp8t"
            assert launch.kernel == want, launch
    ref_out, ref_lse = case_reference(case)
    for _ in range(2):  # a second run over the same plan and workspace (the kept compiled kernel) must agree
        out, lse = poisoned_outputs(case)
        plan.run(case.q, case.kv_cache, kv_scale=case.kv_scale, indices=case.indices, out=out, lse=lse,
                 **case.sparse_extras())
        torch.cuda.synchronize()
        rep = compare_outputs(out, lse, ref_out, ref_lse, TritonBackend.TOLERANCE)
        assert rep, rep.message
        assert plan.state.prepared.kind == plan.state.launch.kernel  # contiguous q and cache: the plan's kernel


def _force_spec(plan, spec):
    """Replace ``plan``'s config by the one ``spec`` names (None: keep the table's; on an H100 / H200 with bf16 pages of
    64+ tokens, the Gluon kernel's)."""
    if spec is not None:
        from mla_dispatch.backends.triton import TritonBackend
        from mla_dispatch.kernels.triton.aot_report import parse_spec

        plan._state = TritonBackend.make_state(plan.problem, plan.platform, plan.cache_seqlens, config=parse_spec(spec),
                                               block_table=plan.block_table, softmax_scale=plan.softmax_scale)


@pytest.mark.parametrize("scale", [1e9, 1e-30], ids=["large", "tiny"])
@pytest.mark.parametrize("num_heads_q,spec", [(16, None), (128, None), (16, "tM16-n64-s2-tma"), (128, "hM64-n64-w8-tma")],
                         ids=["h16-table", "h128-table", "tokens-on-m", "heads-on-m"])
def test_triton_gpu_split_rows_keep_the_output_range(num_heads_q, spec, scale, gen):
    """Split requests store fp16 partial rows with a power-of-two scale per row and decode program
    (kernels/triton/combine.py, PARTIAL_ROW_FORMAT). Outputs far outside fp16's range still merge right: at ~1e6 they
    would overflow fp16, at ~1e-33 flush to zero. The cache's latent channels are multiplied by `scale` and q's
    divided, so the scores stay as drawn and the outputs scale; so does the absolute tolerance (docs/design.md §5's
    is for outputs of order 1e-3)."""
    from mla_dispatch import plan_decode
    from mla_dispatch.backends.triton import TritonBackend

    # equal lengths: drawn ones can come out too short to split
    case = make_case(2, 1, num_heads_q, 3000, page_size=64, varlen=False, device="cuda", generator=gen)
    tol = scale_outputs(case, scale, TritonBackend.TOLERANCE)
    plan = plan_decode(*case.args(), backend="triton", **case.kwargs())
    _force_spec(plan, spec)
    assert int((plan.state.schedule.num_splits > 1).sum()) > 0, "the shape must split a request"
    out, lse = poisoned_outputs(case)
    plan.run(case.q, case.kv_cache, out=out, lse=lse)
    torch.cuda.synchronize()
    rep = compare_outputs(out, lse, *case_reference(case), tol)
    assert rep, rep.message


@pytest.mark.parametrize("num_heads_q", [64, 8], ids=["gluon_sm90", "fp8t"])
@pytest.mark.parametrize("q_factor", [2.0**17, 2.0**-30], ids=["q-beyond-fp16", "q-below-fp16"])
def test_triton_gpu_gluon_fp8_query_outside_fp16_range(q_factor, num_heads_q, gen):
    """The Gluon kernel computes fp8_e4m3 caches in fp16 (kernels/triton/gluon_sm90.py, _dequant_tile) and converts a
    bf16 query tile to fp16 with a power of two per row, undone on S. A query scaled by 2^17 (beyond fp16's 65504) or
    2^-30 (below its subnormals), with the softmax scale divided by the same power of two, has the same scores and
    outputs; without the per-row factors the first would overflow and the second flush to zero. 64 heads (128 rows)
    take gluon_sm90's kernel, 8 heads (16 rows) the tokens-on-M one (gluon_fp8.py, the same conversion per query
    row)."""
    import dataclasses

    from mla_dispatch import plan_decode
    from mla_dispatch.backends.triton import TritonBackend
    from mla_dispatch.kernels.triton.gluon_sm90 import gluon_applies

    base = make_case(3, 2, num_heads_q, 400, page_size=16, kv_format="fp8_e4m3", causal=True, device="cuda",
                     generator=gen)
    case = dataclasses.replace(base, q=base.q * q_factor, softmax_scale=base.softmax_scale / q_factor)
    assert torch.isfinite(case.q).all()
    plan = plan_decode(*case.args(), backend="triton", **case.kwargs())
    _force_spec(plan, "hM64-n64-w8-tma-gl")
    assert gluon_applies(case.q, case.kv_cache, kv_format="fp8_e4m3", sparse=False, head_dim_v=case.head_dim_v,
                         traced=False)
    out, lse = poisoned_outputs(case)
    plan.run(case.q, case.kv_cache, kv_scale=case.kv_scale, out=out, lse=lse)
    torch.cuda.synchronize()
    rep = compare_outputs(out, lse, *case_reference(case), TritonBackend.TOLERANCE)
    assert rep, rep.message


def test_triton_gpu_mla_decode_auto_uses_triton_when_named(gen):
    from mla_dispatch import mla_decode
    from mla_dispatch.backends.triton import TritonBackend

    case = make_case(2, 1, 16, 100, page_size=64, device="cuda", generator=gen)
    out, lse = mla_decode(*case.args(), backend="triton", **case.kwargs())
    ref_out, ref_lse = case_reference(case)
    rep = compare_outputs(out, lse, ref_out, ref_lse, TritonBackend.TOLERANCE)
    assert rep, rep.message


@pytest.mark.parametrize("num_heads_q,q_len,spec,kv_format", [(16, 1, None, None), (128, 2, None, None),
                                                               (128, 2, "hM64-n64-w8-tma", None),
                                                               (16, 2, None, "fp8_e4m3")])
def test_triton_gpu_cuda_graph_replay_with_new_seqlens(num_heads_q, q_len, spec, kv_format, gen):
    """Capture DecodePlan.run once; change cache_seqlens values, plan.update, replay: matches the reference (the
    table's config, on an H100 the Gluon kernels: seesaw, and the tokens-on-M one for the fp8_e4m3 case; and the
    plain kernel's TMA config)."""
    from mla_dispatch import plan_decode
    from mla_dispatch.backends.triton import TritonBackend

    case = make_case(4, q_len, num_heads_q, 2000, page_size=64, device="cuda", generator=gen, causal=q_len > 1,
                     kv_format=kv_format)
    plan = plan_decode(*case.args(), backend="triton", cuda_graph=True, **case.kwargs())
    _force_spec(plan, spec)
    out, lse = poisoned_outputs(case)
    # compile outside the capture; the second run captures the plan's own launch graph for these tensors
    # (metadata/launch_graphs.py, once; a capture while no other graph is alive also makes torch's RNG seed and
    # offset tensors, CUDAGeneratorState::register_graph: 2 allocations, measured 2026-11-29), the third replays it
    for _ in range(2):
        plan.run(case.q, case.kv_cache, kv_scale=case.kv_scale, out=out, lse=lse)
    torch.cuda.synchronize()
    # the allocator's count of allocations made, not the bytes held: a tensor of an earlier test that Python's
    # collector frees meanwhile lowers the bytes (the H200 of 2026-11-29: 287.5 MB before, 274.2 after) and could
    # hide an allocation of the same size
    allocations = torch.cuda.memory_stats()["allocation.all.allocated"]
    plan.run(case.q, case.kv_cache, kv_scale=case.kv_scale, out=out, lse=lse)
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == allocations, "run() allocated device memory"

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(case.q, case.kv_cache, kv_scale=case.kv_scale, out=out, lse=lse)

    original = case.cache_seqlens.clone()
    for trial in range(3):
        # new lengths within each request's filled blocks (slots below the original length hold data)
        frac = torch.rand(original.shape, generator=gen).to(original.device)
        new = torch.maximum((original.float() * frac).to(torch.int32), torch.full_like(original, q_len))
        if trial == 2:
            new[-1] = 0  # a request that became empty
        plan.update(cache_seqlens=new)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        rep = compare_outputs(out, lse, *case_reference(case, new), TritonBackend.TOLERANCE)
        assert rep, f"replay {trial}: {rep.message}"


# opcheck cases: (make_case kwargs, make_state overrides); split so the combine launch is traced too
OPCHECK_CASES = [
    # 16 rows: the config with a register cap (a plain launch's option, dropped when traced)
    (dict(batch=3, q_len=1, num_heads_q=16, seqlen=300, page_size=64, varlen=False),
     dict(num_parts=24, overhead=1)),
    (dict(batch=3, q_len=2, num_heads_q=16, seqlen=300, page_size=64, causal=True, varlen=False),
     dict(num_parts=24, overhead=1)),
    (dict(batch=2, q_len=2, num_heads_q=16, seqlen=300, page_size=64, topk=128, kv_format="fp8_ds_mla"), {}),
]


def _op_plan(kw, overrides, gen):
    from mla_dispatch import plan_decode
    from mla_dispatch.backends.triton import TritonBackend

    case = make_case(dtype=torch.bfloat16, device="cuda", generator=gen, **kw)
    plan = plan_decode(*case.args(), backend="triton", **case.kwargs())
    if overrides:
        plan._state = TritonBackend.make_state(plan.problem, plan.platform, plan.cache_seqlens, **overrides)
        assert bool((plan.state.schedule.num_splits > 1).any()), "schedule override did not split any request"
    return case, plan


@pytest.mark.parametrize("kw,overrides", OPCHECK_CASES, ids=[_case_id(*c) for c in OPCHECK_CASES])
def test_triton_gpu_opcheck(kw, overrides, gen):
    """torch.ops.mla_dispatch.triton_decode is a triton_op: opcheck's every test (fake tensors, AOT dispatch
    traced through wrap_triton) passes on bf16, and the op itself matches the reference."""
    from mla_dispatch.backends.triton import TritonBackend
    from tests.test_triton_interpret import triton_op_args

    case, plan = _op_plan(kw, overrides, gen)
    op = torch.ops.mla_dispatch.triton_decode.default
    assert plan.state.op is op
    out, lse = poisoned_outputs(case)
    args = triton_op_args(plan, case, out, lse)
    torch.library.opcheck(op, args)
    op(*args)  # opcheck ran on clones
    torch.cuda.synchronize()
    rep = compare_outputs(out, lse, *case_reference(case), TritonBackend.TOLERANCE)
    assert rep, rep.message


@pytest.mark.xfail(strict=True, raises=TypeError, reason="H200, torch 2.11 (2026-11-29, two runs): inductor's "
                   "launcher of the traced decode kernel is called without the kernel's defaulted parameters "
                   "(TypeError: launcher() missing 13 required positional arguments: 'ExtraIndices', ...); passing "
                   "them explicitly did not fix it")
def test_triton_gpu_op_under_torch_compile(gen):
    """The op traces into a torch.compile graph with no graph break (fullgraph) and gives the reference."""
    from mla_dispatch.backends.triton import TritonBackend
    from tests.test_triton_interpret import triton_op_args

    case, plan = _op_plan(*OPCHECK_CASES[0], gen)
    out, lse = poisoned_outputs(case)

    @torch.compile(fullgraph=True)
    def step(*args):
        torch.ops.mla_dispatch.triton_decode(*args)

    step(*triton_op_args(plan, case, out, lse))
    torch.cuda.synchronize()
    rep = compare_outputs(out, lse, *case_reference(case), TritonBackend.TOLERANCE)
    assert rep, rep.message
