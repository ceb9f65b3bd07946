"""DeepSeek-V4 sparse decoding (FlashMLA's "MODEL1"): the fp8_ds_v4 cache format, the optional sparse arguments
(topk_length, attn_sink, the extra cache) and the reference that computes them, against the independent float64
oracle of tests/oracle64.py (which decodes the cache's bytes with its own code)."""

import pytest
import torch

import mla_dispatch
from mla_dispatch.kvcache.formats import (DS_V4_TOKEN_BYTES, ds_v4_block_bytes, empty_ds_v4_cache, gather_tokens,
                                          pack_ds_v4, unpack_ds_v4)
from mla_dispatch.numerics.cases import make_case, poisoned_outputs
from mla_dispatch.numerics.oracle import reference_attention
from mla_dispatch.numerics.tolerance import check_close, compare_outputs
from oracle64 import decode_v4_token, naive_attention

V4 = dict(head_dim_qk=512, head_dim_v=512, kv_format="fp8_ds_v4")


@pytest.mark.parametrize("page_size", [1, 2, 61, 64])
def test_pack_matches_the_documented_layout(page_size, gen):
    x = (torch.randn(3, page_size, 512, generator=gen) / 10).clamp(-1, 1)
    x[1, 0, 5] = 0.0  # a tile with a zero among its values
    x[2, -1, :64] = 0.0  # an all-zero tile: the smallest scale (2^-14 after the 1e-4 floor)
    cache = pack_ds_v4(x)
    assert cache.shape == (3, page_size, 1, DS_V4_TOKEN_BYTES) and cache.dtype == torch.uint8
    assert cache.stride(0) == ds_v4_block_bytes(page_size) and ds_v4_block_bytes(page_size) % 576 == 0
    decoded = unpack_ds_v4(cache)
    for b in range(3):
        for t in range(page_size):
            assert torch.equal(decoded[b, t].double(), decode_v4_token(cache, b, t)), (b, t)
    # the quantisation error of a power-of-two-scaled e4m3 value: at most 2^-4 of the tile's scale; RoPE exact in bf16
    assert torch.equal(decoded[..., 0, 448:], x[..., 448:].bfloat16().float())
    tile_max = x[..., :448].reshape(3, page_size, 7, 64).abs().amax(-1, keepdim=True)
    err = (decoded[..., 0, :448] - x[..., :448]).reshape(3, page_size, 7, 64).abs()
    assert bool((err <= tile_max / 16 + 1e-12).all())
    blocks, offsets = torch.tensor([2, 0]), torch.tensor([page_size - 1, 0])
    assert torch.equal(gather_tokens(cache, blocks, offsets, "fp8_ds_v4"), decoded[blocks, offsets])


def _v4_cases():
    # (page_size, topk, extra: (topk, page_size) or None, topk_length, extra_topk_length, attn_sink, h_q, s_q)
    return [
        (64, 32, None, False, False, True, 16, 1),
        (61, 40, (24, 2), True, False, True, 8, 2),
        (2, 16, (32, 69), True, True, False, 3, 1),
        (64, 24, (8, 64), False, True, True, 64, 2),
    ]


@pytest.mark.parametrize("page_size,topk,extra,topk_length,extra_topk_length,attn_sink,h_q,s_q", _v4_cases(),
                         ids=lambda v: str(v))
def test_reference_v4_sparse_matches_float64(page_size, topk, extra, topk_length, extra_topk_length, attn_sink, h_q,
                                             s_q, gen):
    extra_topk, extra_page = extra or (0, None)
    case = make_case(3, s_q, h_q, 80, page_size=page_size, topk=topk, topk_length=topk_length, attn_sink=attn_sink,
                     extra_topk=extra_topk, extra_page_size=extra_page, extra_topk_length=extra_topk_length,
                     zero_len_rows=1, generator=gen, **V4)
    out, lse = mla_dispatch.mla_decode(*case.args(), **case.kwargs(), backend="reference")
    want_out, want_lse = naive_attention(case)
    assert check_close("out", out.float(), want_out, 1e-3, 2.01 / 128)
    assert check_close("lse", lse, want_lse, 1e-5, 1e-5)
    assert torch.all(out[-1] == 0) and torch.all(torch.isposinf(lse[-1]))  # the empty request


@pytest.mark.parametrize("kv_format", ["bf16", "fp8_ds_mla"])
def test_reference_sparse_extras_other_formats(kv_format, gen):
    dims = dict(head_dim_qk=576, head_dim_v=512) if kv_format == "fp8_ds_mla" else dict(head_dim_qk=96, head_dim_v=64)
    case = make_case(2, 2, 8, 60, page_size=16, topk=20, topk_length=True, attn_sink=True, extra_topk=12,
                     extra_page_size=5, kv_format=kv_format, generator=gen, **dims)
    out, lse = reference_attention(*case.args(), **case.kwargs())
    want_out, want_lse = naive_attention(case)
    assert check_close("out", out, want_out, 1e-5, 1e-4)
    assert check_close("lse", lse, want_lse, 1e-5, 1e-5)


def test_reference_v4_dense_matches_float64(gen):
    case = make_case(3, 2, 4, 70, page_size=16, causal=True, zero_len_rows=1, generator=gen, **V4)
    out, lse = mla_dispatch.mla_decode(*case.args(), **case.kwargs())
    want_out, want_lse = naive_attention(case)
    assert check_close("out", out.float(), want_out, 1e-3, 2.01 / 128)
    assert check_close("lse", lse, want_lse, 1e-5, 1e-5)


def test_sink_limits(gen):
    """+inf sink: output 0 for every row; -inf: the output without a sink. lse is the keys' own either way."""
    case = make_case(2, 1, 4, 50, page_size=16, topk=16, generator=gen, **V4)
    plain_out, plain_lse = reference_attention(*case.args(), **case.kwargs())
    sink = torch.tensor([float("inf"), float("-inf"), 0.0, 3.0])
    out, lse = reference_attention(*case.args(), **case.kwargs(), attn_sink=sink)
    assert torch.equal(lse, plain_lse)
    assert torch.all(out[:, :, 0] == 0) and torch.equal(out[:, :, 1], plain_out[:, :, 1])
    for h, s in ((2, 0.0), (3, 3.0)):
        factor = 1 / (1 + torch.exp(s - plain_lse[:, h, :].double()))  # [B, s_q]
        assert torch.allclose(out[:, :, h].double(), plain_out[:, :, h].double() * factor[..., None], atol=1e-6)


def test_paged_cache_v4_append_and_decode(gen):
    main = mla_dispatch.PagedMLACache(12, 61, head_dim=512, kv_format="fp8_ds_v4")
    extra = mla_dispatch.PagedMLACache(40, 2, head_dim=512, kv_format="fp8_ds_v4")
    values = {}
    for seq, n in (("a", 130), ("b", 7)):
        values[seq] = (torch.randn(n, 512, generator=gen) / 10).clamp(-1, 1)
        main.add_sequence(seq)
        main.append(seq, values[seq][: n // 2])
        main.append(seq, values[seq][n // 2:])
        extra.add_sequence(seq)
        extra.append(seq, values[seq][:5])
    assert main.kv.shape == (12, 61, 1, DS_V4_TOKEN_BYTES) and main.kv.stride(0) == ds_v4_block_bytes(61)
    # the cache holds what packing the same values gives (FlashMLA's quantisation)
    for seq in "ab":
        want = unpack_ds_v4(pack_ds_v4(values[seq][:, None, :]))[:, 0]
        assert torch.equal(main.gather(seq), want)
    table, lens = main.decode_inputs(["a", "b"])
    xtable, _ = extra.decode_inputs(["a", "b"])
    # sparse indices: every 3rd token of each request (main), all 5 (extra)
    idx = torch.full((2, 1, 48), -1, dtype=torch.int32)
    for b, n in enumerate(lens.tolist()):
        tok = torch.arange(0, n, 3)[:48]
        idx[b, 0, : len(tok)] = (table[b, tok // 61] * 61 + tok % 61).int()
    tok = torch.arange(5)
    xidx = (xtable[:, tok // 2] * 2 + tok % 2).int()[:, None, :]
    q = (torch.randn(2, 1, 8, 512, generator=gen) / 10).clamp(-1, 1).bfloat16()
    out, lse = mla_dispatch.mla_decode(q, main, None, None, indices=idx, extra_kv_cache=extra, extra_indices=xidx,
                                       softmax_scale=0.07)
    # the same attention written out: the selected tokens of both caches, one softmax
    for b, seq in enumerate("ab"):
        keys = torch.cat([main.gather(seq)[torch.arange(0, int(lens[b]), 3)[:48]], extra.gather(seq)])[:, 0].double()
        s = q[b, 0].double() @ keys.T * 0.07
        want = torch.softmax(s, -1) @ keys
        assert check_close("out", out[b, 0].float(), want, 1e-3, 2.01 / 128)
        assert check_close("lse", lse[b, :, 0], torch.logsumexp(s, -1), 1e-5, 1e-5)


def _plain(gen, **kw):
    return make_case(2, 1, 4, 40, page_size=16, topk=8, generator=gen, **{**V4, **kw})


def test_argument_errors(gen):
    case = _plain(gen)
    args, kw = case.args(), case.kwargs()
    with pytest.raises(ValueError, match=r"attn_sink must be a float32 tensor \[h_q=4\], got \[5\] float32"):
        mla_dispatch.mla_decode(*args, **kw, attn_sink=torch.zeros(5))
    with pytest.raises(ValueError, match=r"topk_length must be an int32 tensor \[batch=2\]"):
        mla_dispatch.mla_decode(*args, **kw, topk_length=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="extra_kv_cache and extra_indices must be given together"):
        mla_dispatch.mla_decode(*args, **kw, extra_kv_cache=case.kv_cache)
    with pytest.raises(ValueError, match="extra_topk_length needs extra_kv_cache"):
        mla_dispatch.mla_decode(*args, **kw, extra_topk_length=torch.zeros(2, dtype=torch.int32))
    bf16 = torch.zeros(4, 16, 1, 512, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="extra_kv_cache must be in kv_cache's format"):
        mla_dispatch.mla_decode(*args, **kw, extra_kv_cache=bf16, extra_indices=case.indices)
    dense = make_case(2, 1, 4, 40, page_size=16, generator=gen, **V4)
    with pytest.raises(ValueError, match="attn_sink need sparse decoding: pass indices"):
        mla_dispatch.mla_decode(*dense.args(), **dense.kwargs(), attn_sink=torch.zeros(4))
    # the V4 cache: one KV head, whole blocks, D 512/512
    with pytest.raises(ValueError, match=r"kv_format='fp8_ds_v4' is defined for D_qk=512, head_dim_v=512"):
        mla_dispatch.mla_decode(case.q, case.kv_cache, None, None, indices=case.indices, head_dim_v=448)
    torn = torch.zeros(4, 16, 2, DS_V4_TOKEN_BYTES, dtype=torch.uint8)[:, :, :1]
    with pytest.raises(ValueError, match=r"must keep each block contiguous for kv_format='fp8_ds_v4'"):
        mla_dispatch.mla_decode(case.q, torn, None, None, indices=case.indices)
    # "auto" tells the format by the bytes per token
    problem = mla_dispatch.plan_decode(case.q, case.kv_cache, None, None, indices=case.indices).problem
    assert problem.kv_format == "fp8_ds_v4"


def test_plan_run_checks_the_planned_extras(gen):
    case = _plain(gen, topk_length=True, attn_sink=True, extra_topk=8, extra_page_size=3)
    kw = case.kwargs()
    extras = case.sparse_extras()
    plan = mla_dispatch.plan_decode(*case.args(), **kw)
    assert plan.problem.sparse_extras == ("topk_length", "attn_sink", "extra_kv_cache")
    out, lse = poisoned_outputs(case)
    plan.run(case.q, case.kv_cache, indices=case.indices, out=out, lse=lse, **extras)
    assert compare_outputs(out, lse, *naive_attention(case), plan._cls.TOLERANCE)
    with pytest.raises(ValueError, match="attn_sink was not given, but the plan was made with it"):
        plan.run(case.q, case.kv_cache, indices=case.indices, **{**extras, "attn_sink": None})
    with pytest.raises(ValueError, match="extra_topk_length was given, but the plan was made without it"):
        plan.run(case.q, case.kv_cache, indices=case.indices, **extras, extra_topk_length=case.topk_length)
    with pytest.raises(ValueError, match=r"extra_indices must be int32 \[2, 1, 8\] as planned"):
        plan.run(case.q, case.kv_cache, indices=case.indices, **{**extras, "extra_indices": case.indices[..., :4]})
    with pytest.raises(ValueError, match=r"extra_kv_cache must be \[num_blocks, 3, 1, 584\]"):
        plan.run(case.q, case.kv_cache, indices=case.indices, **{**extras, "extra_kv_cache": case.kv_cache})


def test_validate_ignores_entries_past_topk_length(gen):
    case = _plain(gen)  # every entry in range (or -1)
    case.topk_length = torch.tensor([3, 0], dtype=torch.int32)
    case.indices[0, 0, 3:] = 2147480000  # past the length: never read, never checked
    case.indices[1] = -7
    mla_dispatch.mla_decode(*case.args(), **case.kwargs(), validate=True)
    case.indices[0, 0, 2] = 2147480000  # within it
    with pytest.raises(ValueError, match=r"indices must be in \[-1, num_blocks\*page_size=\d+\); offending batch rows "
                                         r"\[0\]"):
        mla_dispatch.mla_decode(*case.args(), **case.kwargs(), validate=True)


def test_backends_without_the_extras_decline_them():
    from mla_dispatch.dispatch.backend import MLABackend
    from mla_dispatch.dispatch.platform import Platform

    class Plain(MLABackend):
        NAME = "plain"
        PLATFORMS = frozenset({"cpu"})
        KV_FORMATS = frozenset({"fp8_ds_v4"})
        SUPPORTS_SPARSE = True
        SPARSE_EXTRAS = frozenset({"topk_length"})

    cache = empty_ds_v4_cache(4, 16)
    q = torch.zeros(1, 1, 4, 512, dtype=torch.bfloat16)
    idx = torch.zeros(1, 1, 8, dtype=torch.int32)
    problem = mla_dispatch.plan_decode(q, cache, None, None, indices=idx, attn_sink=torch.zeros(4),
                                       topk_length=torch.zeros(1, dtype=torch.int32)).problem
    reasons = [str(r) for r in Plain.not_supported_reasons(problem, Platform("cpu", "cpu", None, "cpu", 2))]
    assert reasons == ["attn_sink with sparse indices (supported: topk_length)"]


def test_a_case_moved_to_a_device_keeps_the_padded_blocks():
    """make_case builds on the CPU and moves the case: an fp8_ds_v4 cache keeps FlashMLA's padded block stride (a plain
    Tensor.to makes a dense copy, whose blocks of an odd page size are not 16-byte aligned: cuda_sm90 rejects it)."""
    from mla_dispatch.numerics.cases import _cache_to

    case = make_case(2, 1, 16, 100, page_size=61, head_dim_qk=512, head_dim_v=512, topk=64, kv_format="fp8_ds_v4",
                     generator=torch.Generator().manual_seed(0))
    moved = _cache_to(case.kv_cache, "fp8_ds_v4", torch.device("meta"))
    assert moved.shape == case.kv_cache.shape and moved.stride() == case.kv_cache.stride()
    assert moved.stride(0) % 576 == 0 and moved.stride(0) % 16 == 0


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
def test_cuda_sm90_declines_v4_blocks_its_vector_loads_cannot_start(padded):
    """cuda_sm90 reads a V4 block with 16-byte vectors from its start: an unpadded cache of an odd page size (blocks
    page_size * 584 bytes apart) is declined at plan time with the reason, for the cache and the extra cache alike,
    where the binding used to refuse it at run; FlashMLA's padded layout is taken."""
    from mla_dispatch.backends.cuda_sm90 import CudaSM90Backend

    page = 61
    if padded:
        cache, extra = empty_ds_v4_cache(3, page), empty_ds_v4_cache(2, page)
    else:
        cache = torch.zeros(3, page, 1, 584, dtype=torch.uint8)
        extra = torch.zeros(2, page, 1, 584, dtype=torch.uint8)
    q = torch.zeros(1, 1, 64, 512, dtype=torch.bfloat16)
    idx = torch.zeros(1, 1, 8, dtype=torch.int32)
    problem = mla_dispatch.plan_decode(q, cache, None, None, indices=idx, extra_kv_cache=extra,
                                       extra_indices=torch.zeros(1, 1, 4, dtype=torch.int32)).problem
    assert problem.kv_block_stride == cache.stride(0) and problem.extra_block_stride == extra.stride(0)
    reasons = [str(r) for r in CudaSM90Backend.extra_reasons(problem, None)]
    if padded:
        assert reasons == []
    else:
        assert reasons == [f"kv_cache blocks {page * 584} bytes apart (supported: a multiple of 16, as FlashMLA's "
                           "fp8_ds_v4 layout pads each block to a multiple of 576 bytes: "
                           "kvcache.formats.empty_ds_v4_cache)",
                           f"extra_kv_cache blocks {page * 584} bytes apart (supported: a multiple of 16, as "
                           "FlashMLA's fp8_ds_v4 layout pads each block to a multiple of 576 bytes: "
                           "kvcache.formats.empty_ds_v4_cache)"]
