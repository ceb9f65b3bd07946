"""CPU checks of the cuda_sm90 plan: the launch config it freezes (mainloop, tile, load path, clusters, where split
rows merge), the backend_options that override it and the errors they raise, and the kernel constants the plan
mirrors from kernels/cuda/mla_decode_sm90/config.h. (The binding checks the same config on the GPU:
tests/test_cuda_sm90.py.)"""

from __future__ import annotations

import dataclasses
import re
import types

import pytest
import torch

from mla_dispatch.backends import cuda_sm90
from mla_dispatch.backends.cuda_sm90 import CudaSM90Backend, Sm90Launch, launch_config, split_parts
from mla_dispatch.dispatch.backend import OptionNotSupported
from mla_dispatch.dispatch.problem import DecodeProblem
from mla_dispatch.kernels.cuda.build import SM90_SOURCE_DIR
from mla_dispatch.kvcache.formats import KV_FORMAT_CODES

H100_SMS = 132


def problem(batch=128, q_len=1, h_q=128, h_kv=1, page_size=64, max_blocks=64, kv_format="bf16"):
    return DecodeProblem(batch=batch, q_len=q_len, num_heads_q=h_q, num_heads_kv=h_kv, head_dim_qk=576,
                         head_dim_v=512, page_size=page_size, max_blocks=max_blocks, q_dtype=torch.bfloat16,
                         kv_format=kv_format, causal=q_len > 1, topk=0, return_lse=True, device_type="cuda")


def plan_launch(p, sms=H100_SMS, **options) -> Sm90Launch:
    """The launch CudaSM90Backend.plan freezes for ``p`` on a GPU of ``sms`` SMs, with ``options`` checked first."""
    num_parts, max_chunks = split_parts(p, sms, CudaSM90Backend.MIN_CHUNKS_PER_PART)
    return launch_config(p, num_parts, max_chunks, sms, CudaSM90Backend.check_options(options))


def test_plan_constants_match_config_h():
    """The plan decides before (and without) a build, so it mirrors the constants of config.h; they must agree."""
    text = (SM90_SOURCE_DIR / "config.h").read_text()
    consts = {name: int(value) for name, value in re.findall(r"constexpr int (k\w+) = (\d+);", text)}
    enums = {name: int(value) for name, value in re.findall(r"^\s+(k\w+) = (\d+),", text, re.MULTILINE)}
    assert (consts["kBlockM"], consts["kBlockN"]) == (cuda_sm90.BLOCK_M, cuda_sm90.BLOCK_N)
    assert consts["kSeesawMaxQLen"] == cuda_sm90.SEESAW_MAX_Q_LEN
    assert (consts["kEtapMaxRows"], consts["kEtapFp8MaxRows"], consts["kFp8tMaxRows"]) == (
        cuda_sm90.ETAP_MAX_ROWS, cuda_sm90.ETAP_FP8_MAX_ROWS, cuda_sm90.FP8T_MAX_ROWS)
    assert consts["kFusedMaxSplits"] == cuda_sm90.FUSED_MAX_SPLITS
    assert {(consts["kHeadDimQK"], consts["kHeadDimV"]), (consts["kDsV4HeadDim"],) * 2} == CudaSM90Backend.HEAD_DIMS
    assert consts["kDsV4HeadDim"] == cuda_sm90.DS_V4_HEAD_DIM
    assert (enums["kKvSameAsQ"], enums["kKvFp8E4M3"], enums["kKvFp8DsMla"], enums["kKvFp8DsV4"]) == (
        KV_FORMAT_CODES["bf16"], KV_FORMAT_CODES["fp8_e4m3"], KV_FORMAT_CODES["fp8_ds_mla"],
        KV_FORMAT_CODES["fp8_ds_v4"])
    assert KV_FORMAT_CODES["fp16"] == enums["kKvSameAsQ"]
    # the Mainloop enum: one member per entry of MAINLOOPS, its name the entry's in camel case, its number the variant
    mainloop_enum = text[text.index("enum Mainloop"):]
    mainloop_enum = dict(re.findall(r"^\s+(k\w+) = (\d+),", mainloop_enum[:mainloop_enum.index("};")], re.MULTILINE))
    assert {int(v): k for k, v in mainloop_enum.items()} == {
        m.variant: "k" + "".join(w.capitalize() for w in m.name.split("_")) for m in cuda_sm90.MAINLOOPS.values()}
    assert (cuda_sm90.WGMMA, cuda_sm90.SEESAW, cuda_sm90.ETAP, cuda_sm90.FP8T_CONVERT, cuda_sm90.FP8T_REGS,
            cuda_sm90.SEESAW_FP8) == tuple(int(mainloop_enum[k]) for k in (
                "kWgmma", "kSeesaw", "kEtap", "kFp8tConvert", "kFp8tRegs", "kSeesawFp8"))
    assert set(cuda_sm90.MAINLOOPS) == set(CudaSM90Backend.OPTIONS["variant"].values)
    for m in cuda_sm90.MAINLOOPS.values():  # one name: its folder (the fp8t pair: its header), its kernel, its launcher
        header = SM90_SOURCE_DIR / m.header
        assert header.is_file() and (header.parent.name == m.name or header.stem == m.name), m
        assert re.search(rf"__global__ void .*\n?\s*mla_decode_{m.name}\(", header.read_text()), m
        assert (header.parent / "launch.cuh").read_text().count(f"int launch_{m.name}(") == 1, m


@pytest.mark.parametrize("p,want", [
    # the FlashMLA grid: v5 with its two row tiles paired, the second kernel merges (v5 has no tail)
    (problem(), Sm90Launch(variant=5, tile_rows=64, tma_loads=True, paired=True, fuse_combine=False)),
    # fp8_e4m3 there: v9, never paired
    (problem(kv_format="fp8_e4m3"), Sm90Launch(9, 64, True, False, False)),
    # b=1: v2, the split rows merged in the decode launch
    (problem(batch=1), Sm90Launch(2, 64, False, False, True)),
    # 16 heads, long parts: v6 by TMA on whole-tile pages, by cp.async on pages of 16
    (problem(batch=64, h_q=16), Sm90Launch(6, 16, True, False, False)),
    (problem(batch=64, h_q=16, page_size=16, max_blocks=256), Sm90Launch(6, 16, False, False, False)),
    # 32 rows of an fp8_e4m3 cache: v8 (tiles of 32 rows, TMA) on whole-tile pages, v7 on others
    (problem(batch=64, h_q=32, kv_format="fp8_e4m3"), Sm90Launch(8, 32, True, False, False)),
    (problem(batch=64, h_q=32, kv_format="fp8_e4m3", page_size=32, max_blocks=128), Sm90Launch(7, 32, False, False,
                                                                                               False)),
], ids=["flashmla-grid", "flashmla-grid-fp8", "b1", "h16", "h16-page16", "h32-fp8", "h32-fp8-page32"])
def test_plan_freezes_the_launch(p, want):
    launch = plan_launch(p)
    assert launch == want
    with pytest.raises(dataclasses.FrozenInstanceError):
        launch.variant = 2


def test_options_override_the_plans_choices():
    assert plan_launch(problem(), variant=2) == Sm90Launch(2, 64, False, False, False)
    assert plan_launch(problem(), variant=2, fuse_combine=True).fuse_combine
    assert not plan_launch(problem(batch=1), fuse_combine=False).fuse_combine
    # v5 with three row tiles per KV head: its CTAs run alone
    assert plan_launch(problem(q_len=3, h_q=64), variant=5) == Sm90Launch(5, 64, True, False, False)
    # v6 takes 20 rows in its 32-row tile; v6 on fp8 caches loads through registers
    assert plan_launch(problem(batch=8, h_q=20), variant=6) == Sm90Launch(6, 32, True, False, True)
    assert plan_launch(problem(h_q=16, kv_format="fp8_ds_mla"), variant=6).tma_loads is False


@pytest.mark.parametrize("p,options,match", [
    (problem(kv_format="bf16"), dict(variant=7), r"variant'\]=7 \(fp8t_convert\) cannot run this problem: "
                                                 r"kv_format='bf16' \(supported: fp8_e4m3\)"),
    (problem(kv_format="fp8_e4m3"), dict(variant=5), r"variant'\]=5 .*kv_format='fp8_e4m3' \(supported: bf16, fp16\)"),
    (problem(h_q=64), dict(variant=6), r"64 query rows per KV head \(s_q \* h_q / h_kv; supported: <= 32\)"),
    (problem(h_q=32, kv_format="fp8_ds_mla"), dict(variant=6), r"32 query rows per KV head .*supported: <= 16\)"),
    (problem(h_q=16, page_size=32, max_blocks=128, kv_format="fp8_e4m3"), dict(variant=8),
     r"page_size=32 \(supported: multiples of 64\)"),
    (problem(q_len=80, h_q=1), dict(variant=5), r"s_q=80 \(supported: <= 64\)"),
    (problem(batch=1), dict(variant=5, fuse_combine=True), r"fuse_combine'\]=True cannot run: variant 5 has no "
                                                           r"combine tail"),
    (problem(batch=2, h_q=256, h_kv=256, max_blocks=2), dict(fuse_combine=True),
     r"its grid of 256 CTAs does not fit the 132 SMs at once"),
], ids=["v7-bf16", "v5-fp8", "v6-64rows", "v6-fp8-32rows", "v8-page32", "v5-qlen80", "v5-fused", "fused-too-big"])
def test_options_that_cannot_run_raise(p, options, match):
    with pytest.raises(ValueError, match=match):
        plan_launch(p, **options)


@pytest.mark.parametrize("options,match", [
    (dict(variant=3), r"backend_options\['variant'\]=3 \(supported: 2, 5, 6, 7, 8, 9\)"),  # measured slower: deleted
    (dict(variant="5"), r"backend_options\['variant'\]='5'"),
    (dict(fuse_combine=1), r"backend_options\['fuse_combine'\]=1 \(supported: False, True\)"),
    (dict(tile_rows=32), r"cuda_sm90 has no option .tile_rows. \(accepted: fuse_combine, min_chunks_per_part, "
     r"schedule_overhead, split_tokens, variant\)"),
], ids=["deleted-variant", "str-variant", "int-flag", "unknown"])
def test_declared_options_are_checked(options, match):
    with pytest.raises(ValueError, match=match):
        CudaSM90Backend.check_options(options)


def sparse_problem(batch=128, q_len=2, h_q=128, topk=2048, page_size=64, kv_format="fp8_ds_mla", **kw):
    return dataclasses.replace(problem(batch, q_len, h_q, page_size=page_size, kv_format=kv_format), topk=topk,
                               causal=False, max_blocks=0, **kw)


def sparse_launch(p, **options) -> Sm90Launch:
    """What CudaSM90Backend.plan freezes for a sparse ``p`` (the parts of its flattened view)."""
    return cuda_sm90._shape_plan(p, H100_SMS, tuple(CudaSM90Backend.check_options(options).items()))[1]


def test_sparse_runs_as_its_flattened_view():
    """A top-k problem runs as B * s_q requests of one query token, each a table of topk token ids, on a mainloop
    that masks -1 slots; a dense problem is its own view."""
    p = sparse_problem()
    view = cuda_sm90.sparse_view(p)
    assert (view.batch, view.q_len, view.num_heads_q, view.page_size, view.max_blocks, view.topk, view.causal) == (
        256, 1, 128, 1, 2048, 0, False)
    assert cuda_sm90.sparse_view(problem()) == problem()
    assert sparse_launch(p) == Sm90Launch(cuda_sm90.WGMMA, 64, False, False, False)
    assert sparse_launch(sparse_problem(batch=1, q_len=1, h_q=64)).fuse_combine  # one request: merged in the launch
    assert CudaSM90Backend.SUPPORTS_SPARSE
    assert [v for v, m in cuda_sm90.MAINLOOPS.items() if m.sparse_formats] == [
        cuda_sm90.WGMMA, cuda_sm90.ETAP, cuda_sm90.FP8T_CONVERT, cuda_sm90.SEESAW_FP8]


@pytest.mark.parametrize("h_q,kv_format,variant", [
    (16, "fp8_ds_mla", cuda_sm90.FP8T_CONVERT), (16, "fp8_ds_v4", cuda_sm90.FP8T_CONVERT),
    (8, "fp8_e4m3", cuda_sm90.FP8T_CONVERT), (3, "fp8_ds_v4", cuda_sm90.FP8T_CONVERT),
    (32, "fp8_ds_mla", cuda_sm90.FP8T_CONVERT), (24, "fp8_ds_v4", cuda_sm90.FP8T_CONVERT),
    (33, "fp8_ds_mla", cuda_sm90.WGMMA), (64, "fp8_ds_v4", cuda_sm90.WGMMA), (128, "fp8_ds_mla", cuda_sm90.WGMMA),
    (16, "bf16", cuda_sm90.WGMMA), (16, "fp16", cuda_sm90.WGMMA),
])
@pytest.mark.parametrize("batch,invariant", [(1, False), (128, False), (4, True)])
def test_sparse_mainloop_follows_heads_and_format(h_q, kv_format, variant, batch, invariant):
    """fp8t_convert (tokens on M, one tile of 16 or 32 rows) takes a sparse view of <= 32 heads per KV head over an
    fp8 cache, at any batch and for a batch-invariant plan too (the choice reads heads and format only); wgmma takes
    the rest."""
    dims = dict(head_dim_qk=512, head_dim_v=512) if kv_format == "fp8_ds_v4" else {}
    p = sparse_problem(batch=batch, q_len=2, h_q=h_q, kv_format=kv_format, batch_invariant=invariant, **dims)
    launch = sparse_launch(p)
    assert launch.variant == variant
    tile = 64 if variant == cuda_sm90.WGMMA else 16 if h_q <= 16 else 32
    assert launch.tile_rows == tile and not launch.tma_loads
    assert cuda_sm90.tile_shape(variant, p) == (tile, -(-h_q // tile))


@pytest.mark.parametrize("h_q", [24, 32, 64])
def test_sparse_etap_forced_runs_row_tiles_of_16(h_q):
    """etap forced on more heads than one tile holds runs them in row tiles of 16, and the split counts them: one CTA
    per SM over parts x row tiles."""
    p = sparse_problem(h_q=h_q)
    launch = sparse_launch(p, variant=cuda_sm90.ETAP)
    assert (launch.variant, launch.tile_rows) == (cuda_sm90.ETAP, 16)
    layout, _ = cuda_sm90._shape_plan(p, H100_SMS, (("variant", cuda_sm90.ETAP),))
    assert 0 < layout.num_parts * -(-h_q // 16) <= H100_SMS


def test_sparse_refuses_mainloops_that_do_not_mask_slots():
    """A forced mainloop that cannot run the problem is an OptionNotSupported (a ValueError), which bench reports as
    unsupported."""
    with pytest.raises(OptionNotSupported, match=r"sparse indices \(topk=2048; supported: dense block_table only\)"):
        sparse_launch(sparse_problem(kv_format="bf16"), variant=cuda_sm90.SEESAW)


@pytest.mark.parametrize("kv_format", ["fp8_e4m3", "bf16"])
def test_sparse_seesaw_fp8_takes_the_scaled_caches_only(kv_format):
    with pytest.raises(ValueError, match=rf"sparse indices over a kv_format='{kv_format}' cache \(supported: "
                                         r"fp8_ds_mla, fp8_ds_v4\)"):
        sparse_launch(sparse_problem(kv_format=kv_format), variant=cuda_sm90.SEESAW_FP8)


@pytest.mark.parametrize("kv_format,page_size", [("fp8_ds_mla", 64), ("fp8_ds_v4", 576), ("fp8_ds_mla", 1)])
def test_sparse_seesaw_fp8_gathers_rows_by_id(kv_format, page_size):
    """seesaw_fp8 forced on a sparse view gathers its rows by id: no tensor map, any page size, 64-row tiles."""
    dims = dict(head_dim_qk=512, head_dim_v=512) if kv_format == "fp8_ds_v4" else {}
    p = sparse_problem(kv_format=kv_format, page_size=page_size, **dims)
    launch = sparse_launch(p, variant=cuda_sm90.SEESAW_FP8)
    assert (launch.variant, launch.tile_rows, launch.tma_loads, launch.paired, launch.fuse_combine) == (
        cuda_sm90.SEESAW_FP8, 64, False, False, False)


def test_sparse_etap_refuses_16_bit_caches():
    with pytest.raises(ValueError, match=r"sparse indices over a kv_format='bf16' cache \(supported: fp8_ds_mla, "
                                         r"fp8_ds_v4, fp8_e4m3\)"):
        sparse_launch(sparse_problem(h_q=16, kv_format="bf16"), variant=cuda_sm90.ETAP)


def test_sparse_batch_invariant_counts_query_positions():
    """The per-request combine's grid holds <= 65535 requests: a sparse problem has B * s_q of them."""
    plat = types.SimpleNamespace(kind="cuda", capability=(9, 0))
    assert not CudaSM90Backend.extra_reasons(sparse_problem(batch=30000, batch_invariant=True), plat)
    reasons = CudaSM90Backend.extra_reasons(sparse_problem(batch=40000, batch_invariant=True), plat)
    assert "80000 requests" in str(reasons[0])


def test_no_process_wide_switches():
    """The variant and the combine's place are the plan's (and backend_options'), not the environment's."""
    source = (SM90_SOURCE_DIR.parent.parent.parent / "backends" / "cuda_sm90.py").read_text()
    assert "environ" not in source and "MLA_SM90_" not in source


def test_plan_schedule_stops_at_the_table_capacity(monkeypatch):
    """A request's tokens are its first clamp(L, 0, max_blocks * page_size) (docs/design.md §1): the plan's schedule
    (and its update) gives no item a token past a table row's capacity, whatever cache_seqlens holds, so the kernel
    reads no table entry past the row. The causal cut still counts from L: the kernel reads L from cache_seqlens."""
    p = problem(batch=4, h_q=16, page_size=16, max_blocks=4)  # capacity 64
    table = torch.zeros(4, 4, dtype=torch.int32)

    def tokens(schedule):
        items = schedule.items[schedule.items[:, 0] >= 0]
        assert bool((items[:, 2] <= 64).all()), items
        return [int((items[items[:, 0] == b, 2] - items[items[:, 0] == b, 1]).sum()) for b in range(4)]

    state = _cpu_plan(monkeypatch, p, torch.tensor([2**31 - 1, -7, 100, 30], dtype=torch.int32))
    assert state.schedule.capacity == 64
    assert tokens(state.schedule) == [64, 0, 64, 30]
    CudaSM90Backend.update(state, table, torch.tensor([65, 64, -(2**31), 2**31 - 1], dtype=torch.int32))
    assert tokens(state.schedule) == [64, 64, 0, 64]


def _cpu_plan(monkeypatch, p, lens, **options):
    """CudaSM90Backend.plan on the CPU (an H100's SM count; no extension loaded)."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(
        multi_processor_count=H100_SMS))
    monkeypatch.setattr(cuda_sm90, "load_ops", lambda: types.SimpleNamespace(
        cuda_sm90_decode=types.SimpleNamespace(default=None)))
    monkeypatch.setattr(cuda_sm90, "load_module", lambda: types.SimpleNamespace(cuda_sm90_decode=None))
    table = torch.zeros(p.batch, p.max_blocks, dtype=torch.int32)
    return CudaSM90Backend.plan(p, None, table, lens, softmax_scale=0.1, options=options)


def test_schedule_options_reach_the_plan(monkeypatch):
    """min_chunks_per_part and schedule_overhead are per-plan options (no class attribute to overwrite)."""
    p = problem(batch=1, h_q=128, max_blocks=64)  # 64 chunks of one request: a part each by default
    lens = torch.tensor([4096], dtype=torch.int32)
    default = _cpu_plan(monkeypatch, p, lens)
    assert (default.schedule.num_parts, default.schedule.overhead) == (64, CudaSM90Backend.schedule_overhead(2))
    forced = _cpu_plan(monkeypatch, p, lens, min_chunks_per_part=8, schedule_overhead=7)
    assert (forced.schedule.num_parts, forced.schedule.overhead) == (8, 7)
    assert CudaSM90Backend.check_options({"schedule_overhead": 7, "min_chunks_per_part": 8})


def test_batch_invariant_plan_pins_its_launch(monkeypatch):
    """A batch-invariant plan: fixed-size pieces, the shape's mainloop whatever the batch, the second-kernel combine
    per request."""
    launches = set()
    for batch in (1, 8, 128):
        p = dataclasses.replace(problem(batch=batch), batch_invariant=True)
        state = _cpu_plan(monkeypatch, p, torch.full((batch,), 3000, dtype=torch.int32), split_tokens=512)
        assert state.schedule.split_tokens == 512 and state.schedule.num_splits.tolist() == [6] * batch
        launches.add((state.launch.variant, state.launch.fuse_combine, state.launch.fixed_splits))
    assert launches == {(cuda_sm90.invariant_variant(p), False, True)}
    with pytest.raises(ValueError, match=r"split_tokens'\]=512 applies to batch_invariant=True plans only"):
        _cpu_plan(monkeypatch, problem(), torch.full((128,), 10, dtype=torch.int32), split_tokens=512)


def test_batch_invariant_workspace_is_bounded(monkeypatch):
    """A batch-invariant plan holds a partial row per possible piece: a wide table at a large batch is refused with
    the split_tokens that would fit, not allocated (10+ GiB here)."""
    p = dataclasses.replace(problem(batch=256, max_blocks=2560), batch_invariant=True)  # 160K-token table
    lens = torch.full((256,), 1000, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"would take 10\.\d GiB .*split_tokens': 4096\}"):
        _cpu_plan(monkeypatch, p, lens)
    state = _cpu_plan(monkeypatch, p, lens, split_tokens=4096)
    assert state.schedule.max_items == 256 * 40
    too_many = dataclasses.replace(problem(batch=70000, max_blocks=1), batch_invariant=True)
    assert any("70000 requests" in str(r) for r in CudaSM90Backend.extra_reasons(too_many, None))


@pytest.mark.parametrize("requests,topk,extra_topk,parts", [(4, 64, 2048, 66), (12, 2048, 64, 132), (1, 576, 576, 7),
                                                            (300, 128, 512, 132)])
def test_two_key_lists_share_one_slot_layout(requests, topk, extra_topk, parts):
    """A sparse plan with an extra cache merges both lists in one combine (_TwoLists): every piece of either schedule
    writes a partial row; request r's pieces hold exactly slots first[r] .. first[r] + n_main[r] + n_extra[r] - 1,
    each once, the main cache's first and in their schedule's order; the first launch's combine sees one slot per
    request (it merges nothing), the second's the merged counts; padding rows stay padding."""
    from mla_dispatch.backends.cuda_sm90 import _TwoLists, _without_partials
    from mla_dispatch.metadata.split_plan import SplitKVLayout, SplitKVPlan

    def layout(length: int) -> SplitKVLayout:
        return SplitKVLayout(batch=requests, num_parts=parts, chunk_size=64, overhead=5, capacity=length,
                             partial_row=(1, 8, 512), partial_dtype=torch.float32, fixed_length=length)

    main, extra = (SplitKVPlan(_without_partials(layout(n)), None, torch.device("cpu")) for n in (topk, extra_topk))
    assert main.partial_out.numel() == extra.partial_out.numel() == 0  # the lists hold no rows of their own
    merged = _TwoLists(main, extra, layout(topk))
    items_main, ones, first, partial_out, partial_lse = merged.first
    items_extra, counts, first2, partial_out2, partial_lse2 = merged.second
    assert first is first2 and partial_out is partial_out2 and partial_lse is partial_lse2
    assert ones.tolist() == [1] * requests
    n_main, n_extra = main.schedule.num_splits, extra.schedule.num_splits
    assert counts.tolist() == (n_main + n_extra).tolist() and min(counts.tolist()) >= 2
    assert partial_out.shape[0] >= max(items_main.shape[0], items_extra.shape[0]) and partial_out.shape[1:] == (1, 8, 512)
    seen: dict[int, list[int]] = {r: [] for r in range(requests)}
    for rewritten, original in ((items_main, main.schedule.items), (items_extra, extra.schedule.items)):
        assert torch.equal(rewritten[:, :3], original[:, :3])  # the same pieces, only their slots moved
        for (req, begin, end, slot), old in zip(rewritten.tolist(), original.tolist()):
            if req < 0:
                assert slot == -1 and old[3] == -1
                continue
            seen[req].append(slot)
    for r in range(requests):
        f = int(first[r])
        assert seen[r] == list(range(f, f + int(counts[r]))), r  # each slot once, main's pieces first, in order
    assert int(first[-1] + counts[-1]) <= partial_out.shape[0]


def test_a_two_list_plan_holds_one_set_of_partial_rows(monkeypatch):
    """A sparse plan with an extra cache (DeepSeek-V4) is two lists whose pieces all write partial rows: the lists'
    own plans hold none, _TwoLists holds one row set per piece of either list; both launches run the combine in its
    own kernel, per request (no fused tail); a batch past the per-request combine's grid is a reason at plan time."""
    p = sparse_problem(batch=4, q_len=2, h_q=64, topk=64, kv_format="fp8_ds_v4", page_size=64, head_dim_qk=512,
                       extra_topk=2048, extra_page_size=2, extra_cache_numel=10, attn_sink=True)
    state = _cpu_plan(monkeypatch, p, torch.zeros(4, dtype=torch.int32))  # (read for its device only)
    extra = state.extra
    assert state.partial_out.numel() == extra.partial_out.numel() == 0
    items_main, ones, first, partial_out, partial_lse = state.merged.first
    assert state.merged.second[0].shape == extra.schedule.items.shape and items_main.shape == state.schedule.items.shape
    assert partial_out.shape == (items_main.shape[0] + extra.schedule.items.shape[0], 1, 64, 512)
    assert partial_lse.shape == partial_out.shape[:-1] and partial_out.dtype == torch.float32
    for s in (state, extra):
        assert (s.launch.fuse_combine, s.launch.fixed_splits, s.launch.variant) == (False, True, 2)
    assert state.sparse_lse.shape == (8, 64, 1) and extra.sparse_lse.shape == (8, 64, 1)
    too_many = dataclasses.replace(p, batch=40000)
    assert any("extra_kv_cache with 80000 requests" in str(r) for r in CudaSM90Backend.extra_reasons(too_many, None))
    assert not CudaSM90Backend.extra_reasons(dataclasses.replace(p, batch=30000), None)
