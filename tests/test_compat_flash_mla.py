"""FlashMLA-style tests of mla_dispatch.compat.flash_mla.

Data as FlashMLA's ``tests/test_flash_mla_dense_decoding.py`` makes it
(mla_dispatch.numerics.cases.make_case: random block-table permutation, NaN in unused
slots, unused table entries 2147480000, zero-length requests, causal MTP) and
docs/design.md §5 tolerances. The oracles are independent of the reference backend: the
per-request float64 ``oracle`` here, tests/oracle64.py's ``naive_attention``, and float64
loops for sparse prefill. The full grid (b, s_q, L, h_q, h_kv, varlen, causal) runs on a
GPU against every GPU backend; CI runs a slice on the CPU. Then the arguments vLLM 0.33.0's
copy and sgl-flash-mla 1.0.0 add (each with its meaning, each error naming its argument),
the prefill functions, and the import alias, which never hides an installed flash_mla
(a real package directory on a temporary sys.path).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import sys

import pytest
import torch

from mla_dispatch import NoBackendError, get_backend, registered_names
from mla_dispatch.compat import flash_mla as fm
from mla_dispatch.kvcache.formats import unpack_ds_mla
from mla_dispatch.numerics.cases import UNUSED_BLOCK_ID, make_case, poisoned_outputs
from mla_dispatch.numerics.tolerance import check_close, compare_outputs
from oracle64 import naive_attention


def oracle(q, kv, block_table, seqlens, *, head_dim_v=512, scale=None, causal=False, indices=None, kv_format="bf16"):
    """Per-request float64 attention, FlashMLA's reference written out: (out fp64, lse fp64 [b, h_q, s_q])."""
    b, s_q, h_q, d = q.shape
    nb, ps, h_kv = kv.shape[0], kv.shape[1], (kv.shape[2] if kv.dim() == 4 else 1)
    kv = kv.reshape(nb, ps, h_kv, kv.shape[-1])
    scale = d**-0.5 if scale is None else scale
    flat = kv.reshape(nb * ps, h_kv, kv.shape[-1])
    out = torch.zeros(b, s_q, h_q, head_dim_v, dtype=torch.float64)
    lse = torch.full((b, h_q, s_q), math.inf, dtype=torch.float64)
    group = h_q // h_kv
    for r in range(b):
        for i in range(s_q):
            if indices is not None:
                ids = [int(t) for t in indices[r, i] if int(t) >= 0]
            else:
                n = int(seqlens[r])
                visible = n - s_q + i + 1 if causal else n
                ids = [int(block_table[r, j // ps]) * ps + j % ps for j in range(max(visible, 0))]
            if not ids:
                continue
            tok = flat[torch.tensor(ids)]
            keys = unpack_ds_mla(tok).double() if kv_format == "fp8_ds_mla" else tok.double()  # [n, h_kv, D]
            for g in range(h_kv):  # query heads g*group .. (g+1)*group-1 read KV head g
                heads = slice(g * group, (g + 1) * group)
                k = keys[:, g]  # [n, D]
                s = (q[r, i, heads].double() @ k.T) * scale  # [group, n]
                lse[r, heads, i] = torch.logsumexp(s, 1)
                out[r, i, heads] = torch.softmax(s, 1) @ k[:, :head_dim_v]
    return out, lse


def check(out, lse, want_out, want_lse, backend="reference"):
    tol = get_backend(backend).TOLERANCE
    report = compare_outputs(out, lse, want_out.float(), want_lse.float(), tol)
    assert report, report.message


# -- the FlashMLA grid ----------------------------------------------------------------

GRID = [
    (b, s_q, L, h_q, h_kv, varlen, causal)
    for b, s_q, L, h_q, h_kv, varlen, causal in itertools.product(
        (1, 2, 6, 64), (1, 2, 4), (20, 140, 4096), (1, 3, 9, 63, 64, 126, 128), (1, 2, 3, 8), (False, True), (False, True)
    )
    if h_q % h_kv == 0 and not (causal and s_q == 1)
]

# The CPU slice: every value of every axis at least once, small enough for CI (~tens of seconds).
CPU_SLICE = [
    (1, 1, 20, 1, 1, False, False),
    (2, 2, 140, 3, 3, True, True),
    (6, 4, 140, 9, 3, True, True),
    (6, 1, 20, 64, 8, True, False),
    (2, 4, 20, 126, 2, False, True),
    (1, 2, 4096, 128, 1, True, True),
    (2, 1, 4096, 63, 1, False, False),
    (64, 1, 20, 8, 8, True, False),
    (64, 2, 20, 128, 2, True, True),
]


def _ids(case):
    b, s_q, L, h_q, h_kv, varlen, causal = case
    return f"b{b}xs{s_q}xL{L}xh{h_q}xkv{h_kv}{'-varlen' if varlen else ''}{'-causal' if causal else ''}"


def _run_case(case, gen, device, backend="auto"):
    b, s_q, L, h_q, h_kv, varlen, causal = case
    c = make_case(b, s_q, h_q, L, num_heads_kv=h_kv, varlen=varlen, causal=causal, generator=gen, device=device)
    meta, none = fm.get_mla_metadata(c.cache_seqlens, s_q * h_q // h_kv, h_kv)
    assert none is None
    meta.backend = backend
    out, lse = fm.flash_mla_with_kvcache(c.q, c.kv_cache, c.block_table, c.cache_seqlens, 512, meta, causal=causal)
    assert out.shape == (b, s_q, h_q, 512) and out.dtype == c.q.dtype
    assert lse.shape == (b, h_q, s_q) and lse.dtype == torch.float32
    want_out, want_lse = oracle(c.q.cpu(), c.kv_cache.cpu(), c.block_table.cpu(), c.cache_seqlens.cpu(), causal=causal)
    check(out.cpu(), lse.cpu(), want_out, want_lse, meta.plan.backend)
    return meta


@pytest.mark.parametrize("case", CPU_SLICE, ids=_ids)
def test_dense_grid_slice_cpu(case, gen):
    _run_case(case, gen, "cpu")


# A short GPU pass (a few minutes of device time): the CPU slice plus FlashMLA's corner case
# (b=128, s_q=2, L=4096, varlen, zero-length requests) and its decode shape.
GPU_SMOKE = CPU_SLICE + [(128, 2, 4096, 128, 1, True, True), (128, 1, 4096, 128, 1, True, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_SMOKE, ids=_ids)
def test_dense_smoke_gpu(case, gen):
    _check_gpu_backends(case, gen, zero_len_rows=case[0] // 16)


def _grid_params(cases, groups=4):
    # b=64, L=4096: up to ~6 GiB per case (the h_kv=8 varlen cache alone is 4.6 GiB). Fourteen of them at once ran
    # the 80 GB H100 out of memory (benchmarks/RESULTS.md, ninth session). With --dist loadgroup each of `groups`
    # xdist groups runs on one worker, so at most `groups` of them run at once.
    params, heavy = [], 0
    for c in cases:
        if c[0] >= 64 and c[2] >= 4096:
            params.append(pytest.param(c, marks=pytest.mark.xdist_group(f"gpu_heavy{heavy % groups}"), id=_ids(c)))
            heavy += 1
        else:
            params.append(pytest.param(c, id=_ids(c)))
    return params


@pytest.mark.gpu
@pytest.mark.parametrize("case", _grid_params(GRID))
def test_dense_grid_gpu(case, gen):
    _check_gpu_backends(case, gen)


def _check_gpu_backends(case, gen, zero_len_rows=0):
    """Every GPU backend that can run the case, through the compat API, against the
    fp32 reference computed once on the GPU (the float64 oracle is too slow for this grid)."""
    from mla_dispatch.numerics.oracle import reference_attention

    b, s_q, L, h_q, h_kv, varlen, causal = case
    c = make_case(b, s_q, h_q, L, num_heads_kv=h_kv, varlen=varlen, causal=causal, generator=gen, device="cuda",
                  zero_len_rows=zero_len_rows)
    want_out, want_lse = reference_attention(c.q, c.kv_cache, c.block_table, c.cache_seqlens, causal=causal)
    ran, failures, declined = [], [], []
    for backend in registered_names():
        if backend in ("reference", "amla_emulation"):
            continue
        meta, _ = fm.get_mla_metadata()
        meta.backend = backend
        try:
            out, lse = fm.flash_mla_with_kvcache(c.q, c.kv_cache, c.block_table, c.cache_seqlens, 512, meta,
                                                 causal=causal)
        except NoBackendError as exc:  # the backend's own reasons; `python -m mla_dispatch info` lists them
            declined += [f"{name}: " + "; ".join(map(str, reasons)) for name, _, reasons in exc.report.candidates]
            continue
        ran.append(backend)
        report = compare_outputs(out, lse, want_out, want_lse, get_backend(backend).TOLERANCE)
        if not report:
            failures.append(f"{backend}: {report.message}")
    assert not failures, "; ".join(failures)
    # Every case of the grid is one some GPU backend (triton at least) runs: if all decline, that is a regression
    # (or a broken install), and it must read as a failure, not a skip.
    assert ran, "every GPU backend declined this case: " + "; ".join(declined)


# -- FlashMLA's corner cases and the metadata contract ---------------------------------------


def test_zero_length_requests_and_poisoned_tables(gen):
    c = make_case(6, 2, 16, 140, causal=True, zero_len_rows=2, generator=gen)
    assert (c.block_table == UNUSED_BLOCK_ID).any() and torch.isnan(c.kv_cache.float()).any()
    meta, _ = fm.get_mla_metadata()
    out, lse = fm.flash_mla_with_kvcache(c.q, c.kv_cache, c.block_table, c.cache_seqlens, 512, meta, causal=True)
    assert torch.isinf(lse[-2:]).all() and (out[-2:] == 0).all()
    assert torch.isfinite(out).all()
    check(out, lse, *oracle(c.q, c.kv_cache, c.block_table, c.cache_seqlens, causal=True))


def test_meta_is_reused_across_layers_and_rejects_other_shapes(gen):
    c = make_case(2, 1, 16, 140, generator=gen)
    meta, _ = fm.get_mla_metadata()
    assert not meta.have_initialized
    fm.flash_mla_with_kvcache(c.q, c.kv_cache, c.block_table, c.cache_seqlens, 512, meta)
    plan = meta.plan
    assert meta.have_initialized and meta.config.b == 2 and meta.config.h_q == 16
    # Layer 2: new q and cache values, same geometry: same plan, correct result.
    q2 = (torch.randn(c.q.shape, generator=gen) / 10).to(c.q.dtype)
    kv2 = c.kv_cache.clone()
    kv2[~torch.isnan(kv2)] = (torch.randn(int((~torch.isnan(kv2)).sum()), generator=gen) / 10).to(kv2.dtype)
    out, lse = fm.flash_mla_with_kvcache(q2, kv2, c.block_table, c.cache_seqlens, 512, meta)
    assert meta.plan is plan
    check(out, lse, *oracle(q2, kv2, c.block_table, c.cache_seqlens))
    with pytest.raises(fm.FlashMLAArgumentError, match="h_q"):
        fm.flash_mla_with_kvcache(q2[:, :, :8].contiguous(), kv2, c.block_table, c.cache_seqlens, 512, meta)
    with pytest.raises(AssertionError, match="causal"):  # FlashMLA asserts; ours is also an AssertionError
        fm.flash_mla_with_kvcache(q2, kv2, c.block_table, c.cache_seqlens, 512, meta, causal=True)


def _dense_inputs(gen, device, b=3, s_q=2, h_q=16, length=150, page=64, num_blocks=40, dtype=torch.float16):
    """q and a cache with every slot valid (so any table of its block ids reads real tokens), two different random
    block tables of the same shape and the lengths."""
    width = -(-length // page)
    q = (torch.randn(b, s_q, h_q, 576, generator=gen) / 10).clamp(-1, 1).to(device, dtype)
    kv = (torch.randn(num_blocks, page, 1, 576, generator=gen) / 10).clamp(-1, 1).to(device, dtype)
    tables = [torch.randperm(num_blocks, generator=gen)[: b * width].view(b, width).to(device, torch.int32)
              for _ in range(2)]
    lens = torch.randint(s_q, length + 1, (b,), generator=gen, dtype=torch.int32).to(device)
    return q, kv, tables, lens


def _check_reused_meta(gen, backend, device):
    """FlashMLA reads block_table, softmax_scale, head_dim_v and the cache on every call of a reused sched_meta
    (flash_mla_interface.py); a plan made by the first call must not answer the later ones."""
    q, kv, (bt, bt2), lens = _dense_inputs(gen, device)
    meta, _ = fm.get_mla_metadata()
    meta.backend = backend

    def call(table, cache=kv, head_dim_v=512, **kw):
        out = torch.full((*q.shape[:3], head_dim_v), float("nan"), dtype=q.dtype, device=device)
        res, lse = fm.flash_mla_with_kvcache(q, cache, table, lens, head_dim_v, meta, causal=True, out=out, **kw)
        assert res is out and meta.plan.backend == backend
        return res.cpu(), lse.cpu()

    def want(table, cache=kv, scale=None, head_dim_v=512):
        return oracle(q.cpu(), cache.cpu(), table.cpu(), lens.cpu(), causal=True, scale=scale, head_dim_v=head_dim_v)

    try:
        first = call(bt)
    except NoBackendError as exc:
        pytest.skip(f"{backend} cannot run it here: {exc}"[:300])
    check(*first, *want(bt), backend)
    flipped = bt.flip(0).contiguous()  # the example: another table tensor, same shape
    check(*call(flipped), *want(flipped), backend)
    check(*call(bt2), *want(bt2), backend)
    check(*call(bt, softmax_scale=0.5), *want(bt, scale=0.5), backend)
    try:
        got = call(bt, softmax_scale=0.5, head_dim_v=256)
    except NoBackendError:  # a backend that runs D_v=512 only (re-planning for 256 asked it, and it declined)
        got = None
    if got is not None:
        check(*got, *want(bt, scale=0.5, head_dim_v=256), backend)
    wider = torch.cat([bt2, torch.full_like(bt2, UNUSED_BLOCK_ID)], 1)  # another table width: read per call too
    check(*call(wider), *want(bt2), backend)
    # The cache is read per call, whatever its number of blocks.
    kv2 = (torch.randn(kv.shape[0] + 7, *kv.shape[1:], generator=gen) / 10).to(device, kv.dtype)
    check(*call(bt, kv2), *want(bt, kv2), backend)
    check(*call(bt), *want(bt), backend)
    # A view of the same table made per call (vLLM slices its persistent buffer per layer) does not re-plan.
    plan = meta.plan
    call(bt[:, :])
    assert meta.plan is plan
    # A shape change is FlashMLA's assert, with its message.
    with pytest.raises(AssertionError, match=r"sched_meta\.config\.b must be equal to batch_size\. Your input"):
        fm.flash_mla_with_kvcache(q[:2], kv, bt[:2], lens[:2], 512, meta, causal=True)


def test_reused_meta_reads_every_per_call_argument(gen):
    _check_reused_meta(gen, "reference", "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [n for n in registered_names() if n not in ("reference", "amla_emulation")])
def test_reused_meta_reads_every_per_call_argument_gpu(gen, backend):
    _check_reused_meta(gen, backend, "cuda")


def test_reused_sparse_meta_reads_indices_scale_and_cache(gen):
    c = _sparse_case(gen)
    other = _sparse_case(gen)
    meta, _ = fm.get_mla_metadata()
    swapped = c.indices.flip(0).contiguous()  # each request reads another's tokens
    for kv, idx, scale in ((c.kv_cache, c.indices, None), (c.kv_cache, swapped, None),
                           (other.kv_cache, other.indices, None), (other.kv_cache, other.indices, 0.1),
                           (c.kv_cache, c.indices, 0.1)):
        out, lse = fm.flash_mla_with_kvcache(c.q, kv, None, None, 512, meta, is_fp8_kvcache=True, indices=idx,
                                             softmax_scale=scale)
        check(out, lse, *oracle(c.q, kv, None, None, indices=idx, scale=scale, kv_format="fp8_ds_mla"))
    with pytest.raises(AssertionError, match=r"sched_meta\.config\.topk must be equal to the last dim of indices"):
        fm.flash_mla_with_kvcache(c.q, c.kv_cache, None, None, 512, meta, is_fp8_kvcache=True,
                                  indices=c.indices[..., :40].contiguous())


def test_current_convention_rejects_num_splits_and_bad_metadata(gen):
    c = make_case(1, 1, 4, 20, generator=gen)
    meta, _ = fm.get_mla_metadata()
    with pytest.raises(ValueError, match="num_splits must be None"):
        fm.flash_mla_with_kvcache(c.q, c.kv_cache, c.block_table, c.cache_seqlens, 512, meta, torch.zeros(2))
    with pytest.raises(ValueError, match="FlashMLASchedMeta"):
        fm.flash_mla_with_kvcache(c.q, c.kv_cache, c.block_table, c.cache_seqlens, 512, None)


def test_softmax_scale_default_and_explicit(gen):
    c = make_case(2, 1, 8, 140, generator=gen)
    for scale in (None, 192**-0.5):
        meta, _ = fm.get_mla_metadata()
        out, lse = fm.flash_mla_with_kvcache(c.q, c.kv_cache, c.block_table, c.cache_seqlens, 512, meta,
                                             softmax_scale=scale)
        check(out, lse, *oracle(c.q, c.kv_cache, c.block_table, c.cache_seqlens, scale=scale))


def test_legacy_convention(gen):
    c = make_case(6, 2, 16, 700, causal=True, zero_len_rows=1, generator=gen)
    tile_md, num_splits = fm.get_mla_metadata_legacy(c.cache_seqlens, 2 * 16, 1)
    assert tile_md.dtype == torch.int32 and tile_md.shape[1] == fm.TILE_SCHEDULER_METADATA_SIZE
    assert num_splits.dtype == torch.int32 and num_splits.shape == (7,)
    assert num_splits[0] == 0 and bool((num_splits[1:] >= num_splits[:-1] + 1).all())  # every request >= 1 piece
    out, lse = fm.flash_mla_with_kvcache(c.q, c.kv_cache, c.block_table, c.cache_seqlens, 512, tile_md, num_splits,
                                         causal=True)
    check(out, lse, *oracle(c.q, c.kv_cache, c.block_table, c.cache_seqlens, causal=True))


def test_legacy_metadata_covers_every_token_once(gen):
    lens = torch.tensor([0, 1, 64, 65, 3000, 17, 4096], dtype=torch.int32)
    tile_md, num_splits = fm.get_mla_metadata_legacy(lens, 128, 1)
    covered = {b: 0 for b in range(len(lens))}
    for begin_req, begin_tok, end_req, end_tok, *_ in tile_md.tolist():
        for r in range(begin_req, end_req + 1):
            lo = begin_tok if r == begin_req else 0
            hi = end_tok if r == end_req else int(lens[r])
            covered[r] += max(hi - lo, 0)
    assert [covered[b] for b in range(len(lens))] == lens.tolist()


def test_batch_size_zero_both_conventions(gen):
    """get_mla_metadata_legacy raised IndexError on an empty batch (split_kv_schedule indexes request 0)."""
    lens = torch.zeros(0, dtype=torch.int32)
    tile_md, num_splits = fm.get_mla_metadata_legacy(lens, 2 * 16, 1)
    assert tile_md.dtype == torch.int32 and tile_md.shape[1] == fm.TILE_SCHEDULER_METADATA_SIZE
    assert not tile_md.any() and num_splits.tolist() == [0]
    q = torch.randn(0, 2, 16, 576, generator=gen).to(torch.bfloat16)
    kv = torch.randn(3, 64, 1, 576, generator=gen).to(torch.bfloat16)
    table = torch.zeros(0, 4, dtype=torch.int32)
    for meta, splits in ((tile_md, num_splits), (fm.get_mla_metadata()[0], None)):
        out, lse = fm.flash_mla_with_kvcache(q, kv, table, lens, 512, meta, splits, causal=True)
        assert out.shape == (0, 2, 16, 512) and lse.shape == (0, 16, 2) and lse.dtype == torch.float32


# -- sparse (DeepSeek-V3.2 style): fp8_ds_mla, topk_length, attn_sink, extra cache ---------


def _sparse_case(gen, topk=48):
    return make_case(3, 2, 64, 200, kv_format="fp8_ds_mla", topk=topk, generator=gen, page_size=64)


def test_sparse_fp8_ds_mla(gen):
    c = _sparse_case(gen)
    meta, _ = fm.get_mla_metadata()
    out, lse = fm.flash_mla_with_kvcache(c.q, c.kv_cache, None, None, 512, meta, is_fp8_kvcache=True,
                                         indices=c.indices)
    check(out, lse, *oracle(c.q, c.kv_cache, None, None, indices=c.indices, kv_format="fp8_ds_mla"))
    with pytest.raises(AssertionError, match="causal"):
        fm.flash_mla_with_kvcache(c.q, c.kv_cache, None, None, 512, fm.get_mla_metadata()[0], causal=True,
                                  is_fp8_kvcache=True, indices=c.indices)


def test_sparse_topk_length_sink_and_extra_cache(gen):
    c = _sparse_case(gen)
    e = _sparse_case(gen, topk=16)
    topk_length = torch.tensor([48, 10, 0], dtype=torch.int32)
    extra_len = torch.tensor([16, 0, 5], dtype=torch.int32)
    sink = torch.tensor([0.5, -1.0, float("inf"), float("-inf")] * 16, dtype=torch.float32)
    meta, _ = fm.get_mla_metadata()
    out, lse = fm.flash_mla_with_kvcache(
        c.q, c.kv_cache, None, None, 512, meta, is_fp8_kvcache=True, indices=c.indices, attn_sink=sink,
        extra_k_cache=e.kv_cache, extra_indices_in_kvcache=e.indices, topk_length=topk_length,
        extra_topk_length=extra_len,
    )
    # Oracle: one attention over the union of both caches' selected tokens.
    nb, ps = c.kv_cache.shape[:2]
    union_kv = torch.cat([c.kv_cache, e.kv_cache])
    keep = torch.arange(48)[None, None] < topk_length[:, None, None]
    main_ids = torch.where(keep, c.indices, -1)
    keep_e = torch.arange(16)[None, None] < extra_len[:, None, None]
    extra_ids = torch.where(keep_e & (e.indices >= 0), e.indices + nb * ps, -1)
    want_out, want_lse = oracle(c.q, union_kv, None, None, indices=torch.cat([main_ids, extra_ids], -1),
                                kv_format="fp8_ds_mla")
    factor = torch.sigmoid(want_lse - sink.double()[None, :, None]).nan_to_num(nan=0.0)
    want_out = want_out * factor.transpose(1, 2)[..., None]
    check(out, lse, want_out, want_lse)
    assert (out[:, :, 2::4] == 0).all()  # +inf sink zeroes those heads
    assert torch.isinf(lse[1]).all() == bool((main_ids[1] < 0).all() and (extra_ids[1] < 0).all())


def test_attn_sink_nan_is_not_a_silent_zero_and_its_shape_is_checked(gen):
    """A NaN sink once gave out = 0 (nan_to_num); a sink of the wrong length raised a broadcasting RuntimeError."""
    c = _sparse_case(gen)
    sink = torch.randn(64, generator=gen)
    sink[5] = float("nan")
    sink[6] = float("inf")
    meta, _ = fm.get_mla_metadata()
    out, lse = fm.flash_mla_with_kvcache(c.q, c.kv_cache, None, None, 512, meta, is_fp8_kvcache=True,
                                         indices=c.indices, attn_sink=sink)
    want_out, want_lse = oracle(c.q, c.kv_cache, None, None, indices=c.indices, kv_format="fp8_ds_mla")
    has_key = torch.isfinite(want_lse)  # [b, h_q, s_q]
    assert torch.equal(torch.isnan(out[:, :, 5]).all(-1), has_key[:, 5])  # NaN where a key was seen, else 0
    assert bool((out[:, :, 5][~has_key[:, 5]] == 0).all())
    assert bool((out[:, :, 6] == 0).all())
    others = [h for h in range(64) if h not in (5, 6)]
    factor = torch.sigmoid(want_lse - sink.double()[None, :, None]).transpose(1, 2)[..., None]
    want = torch.where(has_key.transpose(1, 2)[..., None], want_out * factor, 0.0)
    check(out[:, :, others], lse[:, others], want[:, :, others], want_lse[:, others])
    for bad in (sink[:63], sink.double(), sink[None], [0.0] * 64):
        with pytest.raises(fm.FlashMLAArgumentError, match=r"attn_sink must be float32 \[h_q=64\]"):
            fm.flash_mla_with_kvcache(c.q, c.kv_cache, None, None, 512, fm.get_mla_metadata()[0],
                                      is_fp8_kvcache=True, indices=c.indices, attn_sink=bad)


def test_sparse_deepseek_v4_model1(gen):
    """FlashMLA's MODEL1 call as its test makes it: d 512, the 584-byte cache as a float8_e4m3fn view of padded
    blocks, topk_length, a sink, an extra cache with its own page size and extra_topk_length; sgl-flash-mla's
    kv_format="V4" names the same cache."""
    c = make_case(3, 2, 64, 300, topk=64, page_size=61, topk_length=True, attn_sink=True, extra_topk=32,
                  extra_page_size=2, extra_topk_length=True, head_dim_qk=512, head_dim_v=512, kv_format="fp8_ds_v4",
                  generator=gen)
    want = naive_attention(c)
    kv, extra_kv = c.kv_cache.view(torch.float8_e4m3fn), c.extra_kv_cache.view(torch.float8_e4m3fn)
    meta, _ = fm.get_mla_metadata()
    for kv_format in (None, "V4"):
        out, lse = fm.flash_mla_with_kvcache(
            c.q, kv, None, None, 512, meta, None, c.softmax_scale, False, True, c.indices, c.attn_sink, extra_kv,
            c.extra_indices, c.topk_length, c.extra_topk_length, out=_nan_out(c), kv_format=kv_format)
        check(out, lse, *want)
    assert meta.plan.problem.kv_format == "fp8_ds_v4" and meta.plan.problem.extra_page_size == 2


# -- the import alias ---------------------------------------------------------------------------


@pytest.fixture
def clean_alias():
    saved = {n: sys.modules.get(n) for n in ("flash_mla", "flash_mla.flash_mla_interface")}
    yield
    fm.uninstall_flash_mla_alias()
    for n, mod in saved.items():
        if mod is not None:
            sys.modules[n] = mod


def test_importing_mla_dispatch_installs_no_alias():
    import subprocess

    code = "import mla_dispatch, mla_dispatch.compat.flash_mla, sys; print('flash_mla' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "False"


def test_alias_current_and_legacy(clean_alias, gen):
    fm.install_flash_mla_alias()
    import flash_mla
    from flash_mla.flash_mla_interface import FlashMLASchedMeta

    c = make_case(2, 1, 16, 140, generator=gen)
    meta, _ = flash_mla.get_mla_metadata(c.cache_seqlens, 16, 1)
    assert isinstance(meta, FlashMLASchedMeta)
    out, lse = flash_mla.flash_mla_with_kvcache(q=c.q, k_cache=c.kv_cache, block_table=c.block_table,
                                                cache_seqlens=c.cache_seqlens, head_dim_v=512,
                                                tile_scheduler_metadata=meta, softmax_scale=192**-0.5, causal=True)
    check(out, lse, *oracle(c.q, c.kv_cache, c.block_table, c.cache_seqlens, scale=192**-0.5))

    fm.install_flash_mla_alias("legacy")
    import flash_mla as legacy

    md, splits = legacy.get_mla_metadata(c.cache_seqlens, 16, 1)
    assert isinstance(md, torch.Tensor) and isinstance(splits, torch.Tensor)
    out2, _ = legacy.flash_mla_with_kvcache(c.q, c.kv_cache, c.block_table, c.cache_seqlens, 512, md, splits)
    assert torch.equal(out2, fm.flash_mla_with_kvcache(c.q, c.kv_cache, c.block_table, c.cache_seqlens, 512,
                                                       fm.get_mla_metadata()[0])[0])
    with pytest.raises(ValueError, match="api"):
        fm.install_flash_mla_alias("newest")


def test_run_and_pth_commands(tmp_path):
    import subprocess

    real = fm.find_installed_flash_mla()
    if real is not None:  # run and install-pth leave a real flash_mla in place (tested with a fake one below)
        pytest.skip(f"a real flash_mla is installed here ({real})")

    script = tmp_path / "uses_flash_mla.py"
    script.write_text("import flash_mla, sys\nprint(flash_mla.MLA_DISPATCH_ALIAS, sys.argv[1:])\n")
    cmd = [sys.executable, "-m", "mla_dispatch.compat.flash_mla", "run", "--legacy", str(script), "x", "--y"]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "legacy ['x', '--y']"

    # --backend: the script's calls plan only with the named backend (an unknown name is an error naming it)
    script = tmp_path / "decodes.py"
    script.write_text("import flash_mla\nfrom mla_dispatch.numerics.cases import make_case\n"
                      "c = make_case(2, 1, 4, 40, page_size=16)\nmeta, _ = flash_mla.get_mla_metadata()\n"
                      "flash_mla.flash_mla_with_kvcache(c.q, c.kv_cache, c.block_table, c.cache_seqlens, 512, meta, "
                      "None, softmax_scale=c.softmax_scale)\nprint(meta.plan.backend)\n")
    run = [sys.executable, "-m", "mla_dispatch.compat.flash_mla", "run"]
    res = subprocess.run(run + ["--backend", "reference", str(script)], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "reference"
    res = subprocess.run(run + ["--backend", "no_such_backend", str(script)], capture_output=True, text=True)
    assert res.returncode != 0 and "unknown backend 'no_such_backend'" in res.stderr

    site = tmp_path / "site"
    site.mkdir()
    pth, py = fm.install_pth("current", str(site))
    assert pth.read_text() == "import mla_dispatch_flash_mla_alias\n"
    # Simulate interpreter start with that site dir: the .pth line runs, flash_mla resolves lazily.
    code = (f"import site, sys; site.addsitedir({str(site)!r}); "
            "print('mla_dispatch' in sys.modules); import flash_mla; print(flash_mla.MLA_DISPATCH_ALIAS)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.split() == ["False", "current"]
    assert sorted(p.name for p in fm.uninstall_pth(str(site))) == sorted([pth.name, py.name])
    assert not pth.exists() and not py.exists()


# -- the arguments vLLM 0.33.0's copy and sgl-flash-mla 1.0.0 add --------------------------------------------


def _fresh_meta():
    return fm.get_mla_metadata()[0]


def _nan_out(c):
    """A NaN-filled ``out`` for case ``c``: an element the call does not write fails the comparison."""
    return poisoned_outputs(c)[0]


def test_out_is_written_in_place(gen):
    c = make_case(3, 2, 16, 140, causal=True, zero_len_rows=1, generator=gen)
    out = torch.full((3, 2, 16, 512), float("nan"), dtype=c.q.dtype)
    got, lse = fm.flash_mla_with_kvcache(c.q, c.kv_cache, c.block_table, c.cache_seqlens, 512, _fresh_meta(),
                                         causal=True, out=out)
    assert got is out
    check(out, lse, *naive_attention(c))
    # The old convention writes it too.
    md, splits = fm.get_mla_metadata_legacy(c.cache_seqlens, 2 * 16, 1)
    out2 = torch.full_like(out, float("nan"))
    assert fm.flash_mla_with_kvcache(c.q, c.kv_cache, c.block_table, c.cache_seqlens, 512, md, splits,
                                     causal=True, out=out2)[0] is out2
    assert torch.equal(out2, out)


def test_out_with_sink_and_extra_cache(gen):
    # The sparse path that merges two caches and applies the sink writes the final result into out.
    c, e = _sparse_case(gen), _sparse_case(gen, topk=16)
    sink = (torch.randn(64, generator=gen)).float()
    kwargs = dict(is_fp8_kvcache=True, indices=c.indices, attn_sink=sink, extra_k_cache=e.kv_cache,
                  extra_indices_in_kvcache=e.indices)
    want, want_lse = fm.flash_mla_with_kvcache(c.q, c.kv_cache, None, None, 512, _fresh_meta(), **kwargs)
    out = torch.full_like(want, float("nan"))
    got, lse = fm.flash_mla_with_kvcache(c.q, c.kv_cache, None, None, 512, _fresh_meta(), out=out, **kwargs)
    assert got is out and torch.equal(out, want) and torch.equal(lse, want_lse)


@pytest.mark.parametrize("bad", ["shape", "dtype", "strides", "not a tensor"])
def test_out_is_checked(gen, bad):
    c = make_case(2, 1, 8, 20, generator=gen)
    out = {"shape": torch.empty(2, 1, 8, 576, dtype=c.q.dtype),
           "dtype": torch.empty(2, 1, 8, 512, dtype=torch.float16),
           "strides": torch.empty(2, 1, 512, 8, dtype=c.q.dtype).transpose(2, 3),
           "not a tensor": [0.0]}[bad]
    with pytest.raises(fm.FlashMLAArgumentError, match="^out must be"):
        fm.flash_mla_with_kvcache(c.q, c.kv_cache, c.block_table, c.cache_seqlens, 512, _fresh_meta(), out=out)


def test_descale_k_is_the_scale_of_a_per_tensor_fp8_cache(gen):
    c = make_case(3, 2, 16, 140, kv_format="fp8_e4m3", causal=True, generator=gen)
    assert c.kv_cache.dtype == torch.float8_e4m3fn and c.kv_cache.shape[-1] == 576
    meta = _fresh_meta()
    out, lse = fm.flash_mla_with_kvcache(c.q, c.kv_cache, c.block_table, c.cache_seqlens, 512, meta, causal=True,
                                         descale_k=c.kv_scale, out=_nan_out(c))  # is_fp8_kvcache inferred
    assert meta.config.is_fp8_kvcache is True and meta.plan.problem.kv_format == "fp8_e4m3"
    check(out, lse, *naive_attention(c))
    # Layer 2 of the step: its own scale (the plan is reused, the scale is per call); the cache's bytes as uint8.
    layer2 = dataclasses.replace(c, kv_scale=c.kv_scale * 3)
    out2, lse2 = fm.flash_mla_with_kvcache(c.q, c.kv_cache.view(torch.uint8), c.block_table, c.cache_seqlens, 512,
                                           meta, causal=True, is_fp8_kvcache=True, descale_k=layer2.kv_scale,
                                           out=_nan_out(c))
    check(out2, lse2, *naive_attention(layer2))


def test_descale_k_sparse_fp8_e4m3(gen):
    c = make_case(2, 1, 16, 200, kv_format="fp8_e4m3", topk=24, generator=gen)
    out, lse = fm.flash_mla_with_kvcache(c.q, c.kv_cache, None, None, 512, _fresh_meta(), indices=c.indices,
                                         descale_k=c.kv_scale, out=_nan_out(c))
    check(out, lse, *naive_attention(c))
    e = make_case(2, 1, 16, 200, kv_format="fp8_e4m3", topk=8, generator=gen)
    with pytest.raises(NotImplementedError, match="extra_k_cache"):
        fm.flash_mla_with_kvcache(c.q, c.kv_cache, None, None, 512, _fresh_meta(), indices=c.indices,
                                  descale_k=c.kv_scale, extra_k_cache=e.kv_cache, extra_indices_in_kvcache=e.indices)


def test_descale_k_errors(gen):
    fp8 = make_case(2, 1, 8, 70, kv_format="fp8_e4m3", generator=gen)
    bf16 = make_case(2, 1, 8, 70, generator=gen)
    ds = _sparse_case(gen)
    args = lambda c: (c.q, c.kv_cache, c.block_table, c.cache_seqlens, 512, _fresh_meta())  # noqa: E731
    with pytest.raises(fm.FlashMLAArgumentError, match="descale_k is required"):
        fm.flash_mla_with_kvcache(*args(fp8))
    with pytest.raises(fm.FlashMLAArgumentError, match="descale_k must be a float32 tensor of shape"):
        fm.flash_mla_with_kvcache(*args(fp8), descale_k=torch.ones(2))
    with pytest.raises(fm.FlashMLAArgumentError, match="descale_k is the scale of a per-tensor fp8 cache"):
        fm.flash_mla_with_kvcache(*args(bf16), descale_k=torch.ones(1))
    with pytest.raises(fm.FlashMLAArgumentError, match="descale_k must be None"):
        fm.flash_mla_with_kvcache(ds.q, ds.kv_cache, None, None, 512, _fresh_meta(), indices=ds.indices,
                                  descale_k=torch.ones(1))
    with pytest.raises(fm.FlashMLAArgumentError, match="is_fp8_kvcache"):  # a 1-byte cache called not fp8
        fm.flash_mla_with_kvcache(*args(fp8), is_fp8_kvcache=False)


def test_descale_q_is_refused_and_its_message_holds(gen):
    c = make_case(2, 1, 16, 140, kv_format="fp8_e4m3", generator=gen)
    q8 = (c.q.float() * 40).to(torch.float8_e4m3fn)
    descale_q = torch.tensor([0.025])
    for q, dq in ((q8, descale_q), (c.q, descale_q), (q8, None)):
        with pytest.raises(NotImplementedError, match="descale_q"):
            fm.flash_mla_with_kvcache(q, c.kv_cache, c.block_table, c.cache_seqlens, 512, _fresh_meta(),
                                      descale_q=dq, descale_k=c.kv_scale)
    # What the message tells the caller to do instead is the same attention: bf16 q (exact for fp8 values)
    # and softmax_scale times descale_q, against the oracle of the dequantised q.
    scale = 192**-0.5
    out, lse = fm.flash_mla_with_kvcache(q8.to(torch.bfloat16), c.kv_cache, c.block_table, c.cache_seqlens, 512,
                                         _fresh_meta(), softmax_scale=scale * 0.025, descale_k=c.kv_scale,
                                         out=_nan_out(c))
    real_q = q8.double() * 0.025
    want = naive_attention(dataclasses.replace(c, softmax_scale=scale), q=real_q)
    check(out, lse, *want)


def test_is_fp8_kvcache_none_infers_the_cache_kind(gen):
    dense = make_case(2, 2, 8, 70, causal=True, generator=gen)
    meta = _fresh_meta()
    out, lse = fm.flash_mla_with_kvcache(*dense.args(), 512, meta, causal=True, is_fp8_kvcache=None,
                                         out=_nan_out(dense))
    assert meta.config.is_fp8_kvcache is False
    check(out, lse, *naive_attention(dense))
    sparse = _sparse_case(gen)
    meta = _fresh_meta()
    out, lse = fm.flash_mla_with_kvcache(sparse.q, sparse.kv_cache, None, None, 512, meta, indices=sparse.indices,
                                         out=_nan_out(sparse))
    assert meta.config.is_fp8_kvcache is True
    check(out, lse, *naive_attention(sparse))


def test_use_legacy_selects_the_kernel_familys_contract(gen):
    dense = make_case(2, 2, 8, 140, causal=True, generator=gen)
    sparse = _sparse_case(gen)
    with pytest.raises(fm.FlashMLAArgumentError, match="use_legacy=False .* no dense decoding"):
        fm.flash_mla_with_kvcache(*dense.args(), 512, _fresh_meta(), causal=True, use_legacy=False)
    out, lse = fm.flash_mla_with_kvcache(*dense.args(), 512, _fresh_meta(), causal=True, use_legacy=True,
                                         out=_nan_out(dense))
    check(out, lse, *naive_attention(dense))
    want = naive_attention(sparse)
    for legacy in (True, False, None):
        out, lse = fm.flash_mla_with_kvcache(sparse.q, sparse.kv_cache, None, None, 512, _fresh_meta(),
                                             indices=sparse.indices, use_legacy=legacy, out=_nan_out(sparse))
        check(out, lse, *want)
    with pytest.raises(fm.FlashMLAArgumentError, match="enable_batch_invariant=True exists only"):
        fm.flash_mla_with_kvcache(sparse.q, sparse.kv_cache, None, None, 512, _fresh_meta(), indices=sparse.indices,
                                  use_legacy=True, enable_batch_invariant=True)
    with pytest.raises(fm.FlashMLAArgumentError, match="kv_format only applies to the legacy kernels"):
        fm.flash_mla_with_kvcache(sparse.q, sparse.kv_cache, None, None, 512, _fresh_meta(), indices=sparse.indices,
                                  use_legacy=False, kv_format="V32")
    with pytest.raises(fm.FlashMLAArgumentError, match="kv_format does not apply to dense decoding"):
        fm.flash_mla_with_kvcache(*dense.args(), 512, _fresh_meta(), causal=True, use_legacy=True, kv_format="V32")


def test_kv_format_names(gen):
    c = _sparse_case(gen)
    call = lambda kv, fmt: fm.flash_mla_with_kvcache(  # noqa: E731
        c.q, kv, None, None, 512, _fresh_meta(), indices=c.indices, use_legacy=True, kv_format=fmt,
        out=_nan_out(c))
    out, lse = call(c.kv_cache, "V32")
    check(out, lse, *naive_attention(c))
    assert torch.equal(out, call(c.kv_cache, None)[0])
    for name in ("V32_NO_ROPE", "V41", "V41_FP4"):
        with pytest.raises(NotImplementedError, match=f"kv_format='{name}'.* not provided"):
            call(c.kv_cache, name)
    with pytest.raises(fm.FlashMLAArgumentError, match="Unknown kv_format: 'v32'"):
        call(c.kv_cache, "v32")
    with pytest.raises(fm.FlashMLAArgumentError, match="kv_format says V32"):
        call(c.kv_cache[..., :576].contiguous(), "V32")
    with pytest.raises(fm.FlashMLAArgumentError, match="kv_format says V4"):
        call(c.kv_cache, "V4")


def test_fp8_caches_told_by_their_bytes_per_token(gen):
    q = torch.randn(2, 1, 64, 512, generator=gen).to(torch.bfloat16)
    table, lens = torch.zeros(2, 1, dtype=torch.int32), torch.full((2,), 3, dtype=torch.int32)
    for token_bytes in (528, 288):  # DeepSeek-V3.2-no-RoPE / V4.1, V4.1 fp4
        cache = torch.zeros(1, 64, 1, token_bytes, dtype=torch.uint8)
        with pytest.raises(NotImplementedError, match=f"k_cache: the .*{token_bytes} bytes per token"):
            fm.flash_mla_with_kvcache(q, cache, table, lens, 512, _fresh_meta())
    with pytest.raises(fm.FlashMLAArgumentError, match=r"k_cache.shape\[-1\]=600 .* names no fp8 cache format"):
        fm.flash_mla_with_kvcache(q, torch.zeros(1, 64, 1, 600, dtype=torch.uint8), table, lens, 512, _fresh_meta())


def test_enable_batch_invariant(gen):
    c = make_case(5, 1, 8, 300, page_size=16, generator=gen)
    # enable_batch_invariant=True: a batch-invariant plan, right, and request 2 alone gives the same bits
    meta = _fresh_meta()
    out, lse = fm.flash_mla_with_kvcache(*c.args(), 512, meta, enable_batch_invariant=True, out=_nan_out(c))
    assert meta.plan.problem.batch_invariant
    check(out, lse, *naive_attention(c))
    alone = dataclasses.replace(c, q=c.q[2:3], block_table=c.block_table[2:3], cache_seqlens=c.cache_seqlens[2:3])
    out1, lse1 = fm.flash_mla_with_kvcache(*alone.args(), 512, _fresh_meta(), enable_batch_invariant=True)
    assert torch.equal(out1[0], out[2]) and torch.equal(lse1[0], lse[2])
    meta = _fresh_meta()
    out, lse = fm.flash_mla_with_kvcache(*c.args(), 512, meta, enable_batch_invariant=False, out=_nan_out(c))
    assert meta.config.enable_batch_invariant is False
    check(out, lse, *naive_attention(c))
    with pytest.raises(fm.FlashMLAArgumentError, match="enable_batch_invariant=False, this call has "
                                                       "enable_batch_invariant=True"):
        fm.flash_mla_with_kvcache(*c.args(), 512, meta, enable_batch_invariant=True)


def test_get_mla_decoding_metadata(gen):
    c = make_case(4, 2, 16, 700, causal=True, generator=gen)
    md, splits = fm.get_mla_decoding_metadata(c.cache_seqlens, 2 * 16, 1, 16, use_legacy=True)
    want_md, want_splits = fm.get_mla_metadata_legacy(c.cache_seqlens, 2 * 16, 1)
    assert torch.equal(md, want_md) and torch.equal(splits, want_splits)
    # sgl-flash-mla's convention: the tensors are assigned onto a FlashMLASchedMeta before the first call.
    meta = _fresh_meta()
    meta.tile_scheduler_metadata, meta.num_splits = md, splits
    out, lse = fm.flash_mla_with_kvcache(*c.args(), 512, meta, causal=True, use_legacy=True, out=_nan_out(c))
    check(out, lse, *naive_attention(c))
    with pytest.raises(fm.FlashMLAArgumentError, match="use_legacy must be True for dense fp8"):
        fm.get_mla_decoding_metadata(c.cache_seqlens, 32, 1, is_fp8_kvcache=True)
    assert fm.get_mla_decoding_metadata(c.cache_seqlens, 32, 1, is_fp8_kvcache=True, use_legacy=True)[1].shape == (5,)
    sparse_md = fm.get_mla_decoding_metadata(c.cache_seqlens, 32, 1, is_fp8_kvcache=True, topk=64)
    assert torch.equal(sparse_md[0], fm.get_mla_metadata_legacy(c.cache_seqlens, 32, 1, topk=64)[0])
    assert fm.has_legacy() is True


# -- prefill ------------------------------------------------------------------------------------------------


def sparse_prefill_oracle(q, kv, indices, scale, d_v, sink=None, topk_length=None):
    """float64 loops over tokens and heads: (out, max_logits, lse), as FlashMLA's tests/ref.py defines them."""
    s_q, h_q, _ = q.shape
    s_kv, h_kv, _ = kv.shape
    out = torch.zeros(s_q, h_q, d_v, dtype=torch.float64)
    max_logits = torch.full((s_q, h_q), -math.inf, dtype=torch.float64)
    lse = torch.full((s_q, h_q), math.inf, dtype=torch.float64)
    for t in range(s_q):
        for h in range(h_q):
            g = h // (h_q // h_kv)
            n = indices.shape[-1] if topk_length is None else int(topk_length[t])
            ids = [int(i) for i in indices[t, g, :n] if 0 <= int(i) < s_kv]
            if not ids:
                continue
            k = kv[ids, g].double()
            s = (k @ q[t, h].double()) * scale
            max_logits[t, h] = s.max()
            lse[t, h] = torch.logsumexp(s, 0)
            norm = lse[t, h] if sink is None else torch.logaddexp(lse[t, h], sink[h].double())
            if math.isinf(norm):
                continue
            out[t, h] = (torch.exp(s - norm)[:, None] * k[:, :d_v]).sum(0)
    return out, max_logits, lse


@pytest.mark.parametrize("h_kv", [1, 2])
def test_sparse_prefill_reference_path(gen, h_kv):
    s_q, h_q, s_kv, topk, d, d_v = 7, 16, 50, 12, 576, 512
    q = (torch.randn(s_q, h_q, d, generator=gen) / 10).to(torch.bfloat16)
    kv = (torch.randn(s_kv, h_kv, d, generator=gen) / 10).to(torch.bfloat16)
    indices = torch.randint(0, s_kv, (s_q, h_kv, topk), generator=gen, dtype=torch.int32)
    indices[0, :, ::3] = -1
    indices[1, :, 1::4] = s_kv + 5  # >= s_kv: skipped
    indices[2] = -1  # a token that sees nothing
    topk_length = torch.randint(1, topk + 1, (s_q,), generator=gen, dtype=torch.int32)
    topk_length[3], topk_length[4] = 0, topk // 2
    # Second run: tokens 0 and s_kv - 1 are NaN and no entry that is used points at them; the entries past
    # topk_length[4] do. Neither is read (a skipped entry must not be gathered as token 0 and multiplied by 0).
    indices[(indices == 0) | (indices == s_kv - 1)] = 1
    indices[4, :, topk // 2:] = s_kv - 1
    poisoned = kv.clone()
    poisoned[0] = poisoned[s_kv - 1] = float("nan")
    sink = torch.randn(h_q, generator=gen).float()
    sink[0], sink[1] = math.inf, -math.inf
    scale = 192**-0.5
    tol = get_backend("reference").TOLERANCE
    for keys, kwargs in ((kv, dict()), (poisoned, dict(attn_sink=sink, topk_length=topk_length))):
        want_out, want_max, want_lse = sparse_prefill_oracle(q, keys, indices, scale, d_v, kwargs.get("attn_sink"),
                                                             kwargs.get("topk_length"))
        out = torch.full((s_q, h_q, d_v), float("nan"), dtype=torch.bfloat16)
        got, max_logits, lse = fm.flash_mla_sparse_fwd(q, keys, indices, scale, d_v, out=out, **kwargs)
        assert got is out and max_logits.dtype == lse.dtype == torch.float32
        report = compare_outputs(out, lse, want_out.float(), want_lse.float(), tol)
        assert report, report.message
        assert check_close("max_logits", max_logits, want_max, tol.lse_atol, tol.lse_rtol)
        assert torch.isinf(lse[2]).all() and (out[2] == 0).all() and torch.isneginf(max_logits[2]).all()
        assert torch.isfinite(out).all()
    assert (out[:, 0] == 0).all()  # +inf sink


def test_sparse_prefill_return_log2_lse_and_use_legacy(gen):
    q = (torch.randn(4, 8, 64, generator=gen) / 4).to(torch.bfloat16)
    kv = (torch.randn(30, 1, 64, generator=gen) / 4).to(torch.bfloat16)
    indices = torch.randint(-1, 30, (4, 1, 6), generator=gen, dtype=torch.int32)
    indices[1] = -1
    out, max_logits, lse = fm.flash_mla_sparse_fwd(q, kv, indices, 0.125, 32)
    want = sparse_prefill_oracle(q, kv, indices, 0.125, 32)
    assert compare_outputs(out, lse, want[0].float(), want[2].float(), get_backend("reference").TOLERANCE)
    assert fm.flash_mla_sparse_fwd(q, kv, indices, 0.125, 32, return_log2_lse=False)[1:] == (None, None)
    out2, max2, lse2 = fm.flash_mla_sparse_fwd(q, kv, indices, 0.125, 32, use_legacy=True, return_log2_lse=True)
    assert torch.equal(out2, out)
    log2e = 1 / math.log(2)
    assert check_close("lse2", lse2, want[2] * log2e, 1e-6, 8.01 / 65536)
    assert check_close("max2", max2, want[1] * log2e, 1e-6, 8.01 / 65536)
    assert torch.isposinf(lse2[1]).all() and torch.isneginf(max2[1]).all()
    for legacy in (None, False):
        with pytest.raises(fm.FlashMLAArgumentError, match="return_log2_lse=True .* use_legacy=True"):
            fm.flash_mla_sparse_fwd(q, kv, indices, 0.125, 32, use_legacy=legacy, return_log2_lse=True)
    assert torch.equal(fm.flash_mla_sparse_fwd(q, kv, indices, 0.125, 32, use_legacy=False)[0], out)


@pytest.mark.parametrize("name, change", [
    ("q", dict(q=torch.zeros(4, 8, 64))),
    ("kv", dict(kv=torch.zeros(30, 1, 64, dtype=torch.float16))),
    ("h_q", dict(kv=torch.zeros(30, 3, 64, dtype=torch.bfloat16))),
    ("indices", dict(indices=torch.zeros(4, 1, 6, dtype=torch.int64))),
    ("indices", dict(indices=torch.zeros(4, 1, 0, dtype=torch.int32))),
    ("d_v", dict(d_v=65)),
    ("sm_scale", dict(sm_scale=math.nan)),
    ("attn_sink", dict(attn_sink=torch.zeros(4))),
    ("topk_length", dict(topk_length=torch.zeros(4, dtype=torch.int64))),
    ("out", dict(out=torch.zeros(4, 8, 64, dtype=torch.bfloat16))),
])
def test_sparse_prefill_argument_errors(name, change):
    args = dict(q=torch.zeros(4, 8, 64, dtype=torch.bfloat16), kv=torch.zeros(30, 1, 64, dtype=torch.bfloat16),
                indices=torch.zeros(4, 1, 6, dtype=torch.int32), sm_scale=0.1, d_v=32)
    args.update(change)
    with pytest.raises(fm.FlashMLAArgumentError, match=f"^{name}"):
        fm.flash_mla_sparse_fwd(**args)


@pytest.mark.parametrize("name", ["flash_attn_varlen_func", "flash_attn_varlen_qkvpacked_func",
                                  "flash_attn_varlen_kvpacked_func"])
def test_varlen_prefill_is_not_provided(name):
    func = getattr(fm, name)
    args = {"flash_attn_varlen_func": (None,) * 7, "flash_attn_varlen_qkvpacked_func": (None,) * 4,
            "flash_attn_varlen_kvpacked_func": (None,) * 7}[name]
    with pytest.raises(NotImplementedError, match=f"^{name} .*not provided.*flash_attn.flash_attn_varlen_func"):
        func(*args)


def test_alias_exports_every_name(clean_alias, gen):
    fm.install_flash_mla_alias()
    from flash_mla import (flash_attn_varlen_func, flash_mla_sparse_fwd, get_mla_decoding_metadata,  # noqa: F401
                           has_legacy)

    assert has_legacy() is True
    with pytest.raises(NotImplementedError, match="flash_attn_varlen_func"):
        flash_attn_varlen_func(*(None,) * 7)
    c = make_case(2, 1, 16, 140, causal=False, generator=gen)
    md, splits = get_mla_decoding_metadata(c.cache_seqlens, 16, 1, use_legacy=True)
    assert torch.equal(splits, fm.get_mla_metadata_legacy(c.cache_seqlens, 16, 1)[1])


# -- the alias never hides an installed flash_mla --------------------------------------------------------------


def _fake_installed_flash_mla(root, dist="sgl_flash_mla", version="1.0.0"):
    """A real package directory ``root/flash_mla`` (REAL = True) with the metadata pip writes for ``dist``."""
    pkg = root / "flash_mla"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("REAL = True\n")
    info = root / f"{dist}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist.replace('_', '-')}\nVersion: {version}\n")
    (info / "top_level.txt").write_text("flash_mla\n")
    return root


@pytest.fixture
def no_flash_mla_imported(clean_alias):
    saved = {n: sys.modules.pop(n) for n in ("flash_mla", "flash_mla.flash_mla_interface") if n in sys.modules}
    yield
    for n in ("flash_mla", "flash_mla.flash_mla_interface"):
        sys.modules.pop(n, None)
    sys.modules.update(saved)


def test_alias_never_shadows_an_installed_flash_mla(tmp_path, monkeypatch, no_flash_mla_imported):
    assert fm.find_installed_flash_mla() is None
    site = _fake_installed_flash_mla(tmp_path / "site")
    monkeypatch.syspath_prepend(str(site))
    found = fm.find_installed_flash_mla()
    assert str(site / "flash_mla" / "__init__.py") in found and "sgl-flash-mla 1.0.0" in found
    assert "flash_mla" not in sys.modules  # looked for, not imported

    with pytest.warns(fm.FlashMLAShadowWarning, match="sgl-flash-mla 1.0.0.*was not installed"):
        assert fm.install_flash_mla_alias() is None
    import flash_mla

    assert flash_mla.REAL is True
    with pytest.warns(fm.FlashMLAShadowWarning, match="was not installed"):  # imported now: still found
        assert fm.install_flash_mla_alias("legacy") is None
    assert sys.modules["flash_mla"] is flash_mla

    with pytest.warns(fm.FlashMLAShadowWarning, match="is hidden in this process"):
        alias = fm.install_flash_mla_alias(shadow_installed=True)
    import flash_mla as now

    assert now is alias and alias.MLA_DISPATCH_ALIAS == "current"
    with pytest.warns(fm.FlashMLAShadowWarning, match="was not written"):
        assert fm.install_pth(site_dir=str(tmp_path)) == ()
    assert not list(tmp_path.glob("mla_dispatch_flash_mla_alias*"))


def test_a_namespace_directory_is_not_an_installed_flash_mla(tmp_path, monkeypatch, no_flash_mla_imported):
    (tmp_path / "flash_mla").mkdir()  # no __init__.py: e.g. a source checkout's folder, not an install
    monkeypatch.syspath_prepend(str(tmp_path))
    assert fm.find_installed_flash_mla() is None
    assert fm.install_flash_mla_alias().MLA_DISPATCH_ALIAS == "current"


def test_run_and_pth_finder_step_aside_for_an_installed_flash_mla(tmp_path):
    import os
    import subprocess

    site = tmp_path / "site"
    site.mkdir()
    pth, _ = fm.install_pth("current", str(site))  # written while no real flash_mla is on this process's path
    real = _fake_installed_flash_mla(tmp_path / "real", dist="flash_mla")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(real), os.environ.get("PYTHONPATH", "")]))
    show = "import flash_mla; print(getattr(flash_mla, 'REAL', False), getattr(flash_mla, 'MLA_DISPATCH_ALIAS', None))"

    code = f"import site; site.addsitedir({str(site)!r}); {show}"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert res.stdout.split() == ["True", "None"]
    assert "steps aside" in res.stderr and str(real) in res.stderr
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)  # no real one
    assert res.stdout.split() == ["False", "current"]

    script = tmp_path / "uses_flash_mla.py"
    script.write_text(show + "\n")
    cmd = [sys.executable, "-m", "mla_dispatch.compat.flash_mla", "run", str(script)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    assert res.stdout.split() == ["True", "None"]
    assert "FlashMLAShadowWarning" in res.stderr and "(flash-mla 1.0.0)" in res.stderr
    res = subprocess.run(cmd[:-1] + ["--shadow-installed", str(script)], capture_output=True, text=True, check=True,
                         env=env)
    assert res.stdout.split() == ["False", "current"] and "is hidden in this process" in res.stderr
    res = subprocess.run([sys.executable, "-m", "mla_dispatch.compat.flash_mla", "install-pth", "--site-dir",
                          str(tmp_path / "other")], capture_output=True, text=True, env=env)
    assert res.returncode == 1 and "was not written" in res.stderr

    # --shadow-installed: written although a real flash_mla is installed, and every process gets the alias
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    res = subprocess.run([sys.executable, "-m", "mla_dispatch.compat.flash_mla", "install-pth", "--shadow-installed",
                          "--site-dir", str(shadow)], capture_output=True, text=True, env=env)
    assert res.returncode == 0 and res.stdout.count("wrote ") == 2, res.stderr
    code = f"import site; site.addsitedir({str(shadow)!r}); {show}"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert res.stdout.split() == ["False", "current"] and "steps aside" not in res.stderr
    assert len(fm.uninstall_pth(str(shadow))) == 2 and not list(shadow.iterdir())


@pytest.mark.parametrize("argv,expected", [
    (["run", "{tmp}/missing.py"], "script '{tmp}/missing.py' does not exist"),
    (["run", "{tmp}"], "script '{tmp}' is a folder without __main__.py"),
    (["run", "-m", "no_such_module_for_this_test"], "no module named 'no_such_module_for_this_test'"),
    (["run", "--backend", "nope", "{tmp}/script.py"], "argument --backend: unknown backend 'nope'"),
], ids=["missing-script", "folder", "missing-module", "unknown-backend"])
def test_run_command_mistakes_are_one_line_and_exit_2(argv, expected, tmp_path, capsys, clean_alias, monkeypatch):
    """`run missing.py` (and a folder) once printed runpy's traceback; nothing is installed or run then."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # run sets the script's argv
    (tmp_path / "script.py").write_text("raise SystemExit('the script ran')\n")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    with pytest.raises(SystemExit) as stop:
        fm.main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert expected.replace("{tmp}", str(tmp_path)) in err and err.startswith(
        "python -m mla_dispatch.compat.flash_mla: error: ")
    assert "flash_mla" not in sys.modules or not getattr(sys.modules["flash_mla"], "MLA_DISPATCH_ALIAS", None)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__main__.py").write_text("import flash_mla\nprint('ran', flash_mla.MLA_DISPATCH_ALIAS)\n")
    assert fm.main(["run", str(tmp_path / "pkg")]) == 0  # a folder with __main__.py runs, as under python
    assert "ran current" in capsys.readouterr().out


def test_megaattention_is_named_and_refused(no_flash_mla_imported):
    """sgl-flash-mla's MegaAttention submodule exists under the alias (SGLang's FlashMLA module imports it at load)
    and each of its functions raises NotImplementedError saying what to use."""
    alias = fm.install_flash_mla_alias()
    from flash_mla import fused_norm_rope_attn_rope_cast as mega

    assert mega is alias.fused_norm_rope_attn_rope_cast is fm.fused_norm_rope_attn_rope_cast
    for name in ("prefill", "decode"):
        with pytest.raises(NotImplementedError, match=f"fused_norm_rope_attn_rope_cast.{name}.*flashmla_mega"):
            getattr(mega, name)(q=None)
