"""FlashMLA-style tests of mla_dispatch.compat.flash_mla.

Data as FlashMLA's ``tests/test_flash_mla_dense_decoding.py`` makes it
(mla_dispatch.numerics.cases.make_case: random block-table permutation, NaN in unused
slots, unused table entries 2147480000, zero-length requests, causal MTP) and
docs/design.md §5 tolerances. The oracle is written here, per request, in float64,
independently of the reference backend. The full grid
(b, s_q, L, h_q, h_kv, varlen, causal) runs on a GPU against every GPU backend;
CI runs a slice on the CPU.
"""

from __future__ import annotations

import itertools
import math
import sys

import pytest
import torch

from mla_dispatch import NoBackendError, get_backend, registered_names
from mla_dispatch.compat import flash_mla as fm
from mla_dispatch.kvcache.formats import unpack_ds_mla
from mla_dispatch.numerics.cases import UNUSED_BLOCK_ID, make_case
from mla_dispatch.numerics.tolerance import compare_outputs


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

    script = tmp_path / "uses_flash_mla.py"
    script.write_text("import flash_mla, sys\nprint(flash_mla.MLA_DISPATCH_ALIAS, sys.argv[1:])\n")
    cmd = [sys.executable, "-m", "mla_dispatch.compat.flash_mla", "run", "--legacy", str(script), "x", "--y"]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "legacy ['x', '--y']"

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
