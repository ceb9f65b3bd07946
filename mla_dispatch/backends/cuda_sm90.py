"""Our native CUDA MLA decode kernel for Hopper (SM90a): the flagship backend.

The kernel lives in ``kernels/cuda/mla_decode_sm90/`` (its development history: docs/notes/cuda_sm90.md) and is
built just in time by :mod:`mla_dispatch.kernels.cuda.build` (nvcc >= 12.4 and
the ``nvidia-cutlass`` headers). One registered op,
``torch.ops.mla_dispatch.cuda_sm90_decode``, runs a persistent grid over the
shared split-KV schedule (:func:`mla_dispatch.metadata.schedule.split_kv_schedule`) and
then the combine of split requests. A sparse (top-k) problem runs as its flattened dense view
(:func:`sparse_view`: one request per query position, ``indices`` as the block table) on a mainloop that skips
-1 slots: etap (tokens on M) for <= 16 heads per KV head over an fp8 cache, wgmma otherwise.

The plan owns every choice of the launch: it computes the schedule, picks the
mainloop (:func:`choose_variant`), the CTA tile, the load path and where split
rows are merged (:func:`choose_fuse_combine`), and freezes them in a
:class:`Sm90Launch` that the extension checks and runs as given (an infeasible
configuration is an error there, never a silent change). ``backend_options``
(:attr:`CudaSM90Backend.OPTIONS`: ``variant``, ``fuse_combine``) override the
plan's choices for experiments and tests.

Plan also allocates the workspace (partial outputs); run allocates nothing and
does not sync, so it can be captured in a CUDA graph; update refreshes the
schedule in place before a replay. Eager runs on plain tensors skip the
dispatcher: ``DecodePlan.run`` calls the plan's bound ``PlannedDecode.run``
(:meth:`CudaSM90Backend.bind`), and where that declines,
:meth:`CudaSM90Backend.run` calls the extension module's function of the op's
name; traced runs (torch.compile, fake tensors) call the op.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from types import MappingProxyType

import torch

from mla_dispatch.dispatch.backend import (ArchSupport, BackendOption, BackendState, CGSupport, MLABackend,
                                           OptionNotSupported, Reason, ReasonCode, untraced_eager)
from mla_dispatch.metadata.schedule import BATCH_INVARIANT_SPLIT_TOKENS, SPLIT_TOKENS_CHOICES, check_invariant_workspace
from mla_dispatch.kernels.cuda.schedule import native_schedule
from mla_dispatch.metadata.split_plan import SplitKVLayout, SplitKVPlan
from mla_dispatch.dispatch.platform import Platform
from mla_dispatch.dispatch.problem import DecodeProblem
from mla_dispatch.kvcache.formats import KV_FORMAT_CODES

__all__ = ["CudaSM90Backend", "Mainloop", "MAINLOOPS", "Sm90Launch", "choose_variant", "invariant_variant",
           "choose_fuse_combine", "launch_config", "load_ops", "load_module"]

# ---- kernels/cuda/mla_decode_sm90/config.h, mirrored: the plan runs before (and without) a build; the CPU test
# tests/test_cuda_sm90_plan.py::test_plan_constants_match_config_h reads that file and compares ----
BLOCK_M = 64  # kBlockM: query rows of a CTA tile of the 64-row mainloops
BLOCK_N = 64  # kBlockN: KV tokens per mainloop step = split-KV chunk size
DS_V4_HEAD_DIM = 512  # kDsV4HeadDim: D_qk = D_v of the fp8_ds_v4 cache (DeepSeek-V4), decoded sparse only
WGMMA, SEESAW, ETAP, FP8T_CONVERT, FP8T_REGS, SEESAW_FP8 = 2, 5, 6, 7, 8, 9  # Mainloop (MAINLOOPS has their names)
SEESAW_MAX_Q_LEN = 64  # kSeesawMaxQLen
ETAP_MAX_ROWS, ETAP_FP8_MAX_ROWS, FP8T_MAX_ROWS = 32, 16, 32  # kEtapMaxRows, kEtapFp8MaxRows, kFp8tMaxRows
FUSED_MAX_SPLITS = 1024  # kFusedMaxSplits

_ANY_CACHE = frozenset(KV_FORMAT_CODES) - {"fp8_ds_v4"}
_16BIT_CACHE = frozenset({"bf16", "fp16"})
_FP8_CACHE = frozenset(f for f in KV_FORMAT_CODES if f.startswith("fp8"))


def rows_per_kv_head(problem: DecodeProblem) -> int:
    """Query rows one KV head serves: ``s_q * h_q / h_kv``."""
    return problem.q_len * problem.num_heads_q // problem.num_heads_kv


def sparse_view(problem: DecodeProblem) -> DecodeProblem:
    """The dense problem a sparse (top-k) one runs as: each query position ``(b, s)`` a request of ``topk`` tokens
    (``B * s_q`` requests of one query token) whose table is ``indices``, one entry per token (page size 1 for the
    table: each entry is a cache token id, ``block * page_size + offset``, which the kernel reads from the cache's own
    blocks); a -1 entry is a skipped slot (params.h, DecodeParams::sparse). FlashMLA's sparse decode splits the work
    the same way, per query position (``csrc/api/sparse_decode.h``). A dense problem is returned as it is."""
    p = problem
    if not p.sparse:
        return p
    return dataclasses.replace(p, batch=p.batch * p.q_len, q_len=1, page_size=1, max_blocks=p.topk, topk=0,
                               causal=False)


@dataclasses.dataclass(frozen=True)
class Mainloop:
    """What one mainloop of the kernel family runs (the binding checks the same rules; binding.cpp, check_config)."""

    variant: int
    #: the mainloop's one name: the enum member of config.h in snake case (kSeesawFp8: seesaw_fp8), its kernel
    #: ``mla_decode_<name>``, its folder of mla_decode_sm90/ (the fp8t pair: its header in fp8t/)
    name: str
    #: the header of its kernel, relative to kernels/cuda/mla_decode_sm90/
    header: str
    kv_formats: frozenset[str]
    #: query rows per KV head, None: any (64-row tiles, as many as the rows need); ``max_rows_fp8`` with fp8 caches
    max_rows: int | None = None
    max_rows_fp8: int | None = None
    #: a 64-token tile is one TMA box of one page: page_size % BLOCK_N == 0
    whole_tile_pages: bool = False
    max_q_len: int | None = None
    #: can merge the split rows itself, after a grid-wide barrier (fuse_combine)
    combine_tail: bool = True
    #: the cache formats of the sparse (top-k) decode it runs, masking the -1 slots of its flattened view (params.h,
    #: DecodeParams::sparse); empty: dense only
    sparse_formats: frozenset[str] = frozenset()
    #: a sparse view runs in row tiles of this many rows, whatever its rows (etap: its fp8 tile, ETAP_FP8_MAX_ROWS;
    #: the rows limits are dense ones), else None (as dense)
    sparse_tile_rows: int | None = None

    def rows_limit(self, kv_format: str) -> int | None:
        return self.max_rows_fp8 if self.max_rows_fp8 is not None and kv_format.startswith("fp8") else self.max_rows

    def reasons(self, problem: DecodeProblem) -> list[str]:
        """What this mainloop needs that ``problem`` lacks (empty: it can run it); a sparse problem is judged by its
        flattened view (:func:`sparse_view`)."""
        out = []
        p = sparse_view(problem)
        if problem.sparse and not self.sparse_formats:
            out.append(f"sparse indices (topk={problem.topk}; supported: dense block_table only)")
        elif problem.sparse and p.kv_format not in self.sparse_formats:
            out.append(f"sparse indices over a kv_format={p.kv_format!r} cache (supported: "
                       f"{', '.join(sorted(self.sparse_formats))})")
        if not problem.sparse and p.kv_format not in self.kv_formats:
            out.append(f"kv_format={p.kv_format!r} (supported: {', '.join(sorted(self.kv_formats))})")
        limit = None if problem.sparse and self.sparse_tile_rows else self.rows_limit(p.kv_format)
        if limit is not None and rows_per_kv_head(p) > limit:
            out.append(f"{rows_per_kv_head(p)} query rows per KV head (s_q * h_q / h_kv; supported: <= {limit})")
        if self.whole_tile_pages and p.page_size % BLOCK_N and not problem.sparse:  # (sparse: rows gathered by id)
            out.append(f"page_size={p.page_size} (supported: multiples of {BLOCK_N})")
        if self.max_q_len is not None and p.q_len > self.max_q_len:
            out.append(f"s_q={p.q_len} (supported: <= {self.max_q_len})")
        return out


#: the mainloops a plan can pick, by variant number (kernels/cuda/mla_decode_sm90/config.h, Mainloop)
MAINLOOPS = MappingProxyType({m.variant: m for m in (
    Mainloop(WGMMA, "wgmma", "wgmma/wgmma.cuh", _ANY_CACHE | {"fp8_ds_v4"}, sparse_formats=_ANY_CACHE | {"fp8_ds_v4"}),
    Mainloop(SEESAW, "seesaw", "seesaw/seesaw.cuh", _16BIT_CACHE, whole_tile_pages=True,
             max_q_len=SEESAW_MAX_Q_LEN, combine_tail=False),
    Mainloop(ETAP, "etap", "etap/etap.cuh", _ANY_CACHE | {"fp8_ds_v4"}, max_rows=ETAP_MAX_ROWS,
             max_rows_fp8=ETAP_FP8_MAX_ROWS, sparse_formats=_FP8_CACHE,
             sparse_tile_rows=ETAP_FP8_MAX_ROWS),
    Mainloop(FP8T_CONVERT, "fp8t_convert", "fp8t/fp8t_convert.cuh", frozenset({"fp8_e4m3"}), max_rows=FP8T_MAX_ROWS,
             sparse_formats=_FP8_CACHE),
    Mainloop(FP8T_REGS, "fp8t_regs", "fp8t/fp8t_regs.cuh", frozenset({"fp8_e4m3"}), max_rows=FP8T_MAX_ROWS,
             whole_tile_pages=True),
    Mainloop(SEESAW_FP8, "seesaw_fp8", "seesaw_fp8/seesaw_fp8.cuh", frozenset({"fp8_e4m3"}), whole_tile_pages=True,
             max_q_len=SEESAW_MAX_Q_LEN, combine_tail=False, sparse_formats=frozenset({"fp8_ds_mla", "fp8_ds_v4"})),
)})


def v6_min_chunks_per_part(rows: int, kv_format: str) -> float:
    """Fewest KV chunks per split-KV part (over the table's width) at which v6 measured faster than v2 for ``rows``
    query rows per KV head; ``math.inf`` where v6 does not run (see :func:`choose_variant`)."""
    fp8 = kv_format.startswith("fp8")
    if rows <= 16:
        return 4 if fp8 else 16
    if rows <= 32 and not fp8:
        return 96
    return math.inf


def v7_min_chunks_per_part(rows: int) -> int:
    """Fewest KV chunks per split-KV part at which v7 measured faster than v2 / v6 for ``rows`` (<= 32) query rows per
    KV head of an fp8_e4m3 cache (see :func:`choose_variant`)."""
    return 4 if rows <= 16 else 12


def choose_variant(problem: DecodeProblem, num_parts: int, max_chunks: int) -> int:
    """The mainloop that measured faster for this shape (benchmarks/RESULTS.md, H100, CUDA-graph replay).

    v6 (tokens on the wgmma M side) runs <= 16 query rows per KV head (any cache format) or <= 32 (bf16/fp16), but it
    pays only once each split-KV part has enough KV chunks; below that v2 (one 64-row tile, mostly padding) is faster.
    The cuts in :func:`v6_min_chunks_per_part` lie between the fourteenth session's measurements (chunks per part, v2 /
    v6 us, min_chunks = 1): with 16 rows and a bf16 cache 15.5 chunks 79.8 / 80.6, 23 chunks 106.7 / 105.6, and at
    b = 1..8 v2 5-9% faster; with 16 rows and an fp8 cache 3.9 chunks 34.0 / 33.9 (fp8_e4m3) and 35.8 / 36.9
    (fp8_ds_mla), 7.75 chunks 50.8 / 47.1; with 32 rows (bf16) 62 chunks 242.1 / 244.0 and 246.0 / 250.8, 124 chunks
    452.4 / 450.1 and 447.2 / 442.2, and v2 up to 27% faster at small batches.

    v5 (two tiles in flight) is the faster mainloop for 128 rows once each split-KV part has enough KV chunks to
    keep its two-tile pipeline full: on the H100 (benchmarks/RESULTS.md, 2026-11-22) b=128 h_q=128 (the FlashMLA
    grid, >= 64 chunks per part) and b=32 L=4096 (31 chunks per part; v5 114 us, v2 127 us), but not b=8 L=8192
    (16 chunks per part; v5 77 us, v2 74 us) nor b=1 or one-row-tile (h_q <= 64) shapes. The cut at 24 chunks per
    part and 32 requests lies between those measurements. Re-measured in the seventeenth session (RESULTS.md): with
    equal lengths v5 was faster from ~8-15 chunks per part at any batch, but with lengths drawn around the mean (as a
    server sees them) v2 was ~10% faster at b=2..16 (b=8 L=8192: 56.2 against 62.7 us) and v5 only from b=32, so
    the cut stays.

    v7 (v6's orientation with the fp8 conversion in a warpgroup of its own) takes fp8_e4m3 caches with <= 32 rows
    per KV head once the parts have enough chunks (:func:`v7_min_chunks_per_part`): H100 fp8_e4m3, 132 parts, graph
    us v2 / v6 / v7 (RESULTS.md, twenty-fifth session): 16 rows at 3.9 chunks per part (b=4 L=8K) 33.2 / 34.1 /
    34.0, at 7.75 (b=8 L=8K) 51.6 / 48.5 / 41.7, at 62 (b=64 L=8K) v6 186.1 / v7 148.4; 32 rows (v6 takes no 32-row
    fp8 cache) at 7.75 49.5 / - / 62.7 (b=8 L=8K) and 49.9 / - / 63.3 (b=16 L=4K), at 15.5 (b=32 L=4K) 81.1 / - /
    77.8, at 62 v2 243.8 / v7 177.8.

    v8 (v7 with the raw fp8 tile by TMA and the conversion in the consumers' registers) takes v7's place on pages of
    whole 64-token tiles (page_size % 64 == 0; v7 on other pages): H100, b=64 L=8K, graph us v7 / v8
    (RESULTS.md, twenty-seventh session) 16 rows 148.4 / 140.2, 32 rows 178.1 / 168.9; at v7's small-batch cut and
    below they are within 2 us of each other (b=1..32, same call), so v7's cut stands for v8.

    v9 (v5's schedule with a warpgroup converting each fp8_e4m3 tile in place in its stage) takes fp8_e4m3 caches
    where v5 would take a bf16 cache: H100, b=128 h_q=128 L=8K (RESULTS.md, thirty-first session), graph us v2 807.4 /
    v9 755.1-761.8 (bf16 v5 626.2).

    On the H200 v5 also beats v2 with 17-64 query rows per KV head and a 16-bit cache (its faster memory leaves
    v2's one-tile pipeline exposed): b=64 L=8K, graph replay, ratio to FlashMLA (RESULTS.md, 2026-11-29 06:03 UTC)
    h_q=32 v2 1.194 / v5 1.077, h_q=64 1.211 / 1.103, s_q=2 h_q=16 1.196 / 1.076, s_q=2 h_q=32 1.209 / 1.108, so v5
    takes those rows under the same batch and chunk cuts (not re-measured on an H100, where v2 was within 2% of
    FlashMLA there).

    ``max_chunks`` comes from the block table's width (no device sync at plan time): an upper bound, so a wide table
    over short sequences can pick v5 or v6 where v2 would be faster.
    """
    p = problem
    rows = rows_per_kv_head(p)
    if p.kv_format == "fp8_e4m3" and rows <= FP8T_MAX_ROWS and max_chunks >= v7_min_chunks_per_part(rows) * num_parts:
        return FP8T_REGS if p.page_size % BLOCK_N == 0 else FP8T_CONVERT
    if max_chunks >= v6_min_chunks_per_part(rows, p.kv_format) * num_parts:
        return ETAP
    v5_rows = rows > BLOCK_M or (rows > 16 and p.kv_format in ("bf16", "fp16"))
    if (p.kv_format in ("bf16", "fp16", "fp8_e4m3") and p.page_size % BLOCK_N == 0 and v5_rows
            and p.batch >= 32 and max_chunks >= 24 * num_parts and p.q_len <= SEESAW_MAX_Q_LEN):
        return SEESAW_FP8 if p.kv_format == "fp8_e4m3" else SEESAW
    return WGMMA


def choose_sparse_variant(view: DecodeProblem) -> int:
    """The mainloop of a sparse problem's flattened view (:func:`sparse_view`): fp8t_convert (tokens on the wgmma M side
    in one tile of 16 or 32 rows, a warpgroup gathering and converting each tile while two others compute) for at most
    FP8T_MAX_ROWS heads per KV head (its one tile) over an fp8 cache (:attr:`Mainloop.sparse_formats`), so a 64-token
    tile costs the tensor time of its rows, not of wgmma's 64-row tile (three quarters padding at h_q = 16, issue 57);
    wgmma otherwise. Chosen from the heads and the cache format alone, so it holds for a batch-invariant plan too (the
    choice never follows the batch).

    Measured on the H200 (benchmarks/RESULTS.md, 2026-11-29, "sparse decode of <= 32 heads"; top-k 2048 of L-bar 32K,
    b=128 s_q=2, CUDA-graph replay), fp8t_convert / etap / wgmma us: h_q=16 234.8 / 247.3 / 291.0 (fp8_ds_mla), 240.3 /
    247.9 / 291.4 (fp8_ds_v4); h_q=32 268.5 / 447.6 (etap in two row tiles) / 301.5. At 64 heads (b=64 s_q=1) etap in
    four row tiles took 231.2 against wgmma's 97.9: each extra row tile gathers the tokens again. etap (each warpgroup
    loading, converting and computing its own tiles in turn) runs sparse views in row tiles of 16 when forced
    (backend_options variant=6), for tests and measurements.

    seesaw_fp8 (a warpgroup gathering each tile's rows by id and converting them while two compute, on seesaw's
    schedule: FlashMLA's producer-warpgroup design) takes the fp8_ds_mla / fp8_ds_v4 views when forced (variant=9), but
    measured slower than wgmma above 32 heads (RESULTS.md, 2026-11-29, "the producer-warpgroup design for sparse decode
    of 64 / 128 heads"; graph us, wgmma / seesaw_fp8 / FlashMLA): b=64 h_q=64 s_q=1 97.1 / 115.8 / 81.2, b=128 h_q=128
    s_q=2 581.3 / 614.5 / 351.7, b=2 h_q=128 29.6 / 34.3 / 23.3 (fp8_ds_mla); fp8_ds_v4 98.1 / 133.2 / 84.1 and 578.2 /
    744.6 / 341.0, so the plan never picks it."""
    if view.kv_format in MAINLOOPS[FP8T_CONVERT].sparse_formats and rows_per_kv_head(view) <= FP8T_MAX_ROWS:
        return FP8T_CONVERT
    return WGMMA


def tile_shape(variant: int, problem: DecodeProblem) -> tuple[int, int]:
    """``(tile_rows, row_tiles)`` of mainloop ``variant`` for ``problem`` (a sparse one: its flattened view): 64-row
    tiles, as many as the rows need; one tile of 16 or 32 rows that holds them all (tokens on M, dense); or a sparse
    view's row tiles (:attr:`Mainloop.sparse_tile_rows`)."""
    rows, mainloop = rows_per_kv_head(sparse_view(problem)), MAINLOOPS[variant]
    if mainloop.max_rows is None:
        return BLOCK_M, math.ceil(rows / BLOCK_M)
    if problem.sparse and mainloop.sparse_tile_rows:
        return mainloop.sparse_tile_rows, math.ceil(rows / mainloop.sparse_tile_rows)
    return (16 if rows <= 16 else 32), 1


def invariant_variant(problem: DecodeProblem) -> int:
    """The mainloop of a ``batch_invariant`` plan: chosen from the rows per KV head, the cache format and the page
    size only (never the batch or the table's width, which :func:`choose_variant` weighs), since two mainloops round
    differently. Each takes the shapes where :func:`choose_variant` picks it with enough work per part (its
    measurements): v8/v7 for fp8_e4m3 caches up to 32 rows, v6 up to 16 rows, v5/v9 above 64 rows on pages of whole
    64-token tiles, else v2."""
    p, rows = problem, rows_per_kv_head(problem)
    whole_tiles = p.page_size % BLOCK_N == 0
    if p.kv_format == "fp8_e4m3" and rows <= FP8T_MAX_ROWS:
        return FP8T_REGS if whole_tiles else FP8T_CONVERT
    if rows <= 16:
        return ETAP
    if (p.kv_format in ("bf16", "fp16", "fp8_e4m3") and whole_tiles and rows > BLOCK_M
            and p.q_len <= SEESAW_MAX_Q_LEN):
        return SEESAW_FP8 if p.kv_format == "fp8_e4m3" else SEESAW
    return WGMMA


def choose_fuse_combine(problem: DecodeProblem, num_parts: int, ctas: int) -> bool:
    """Whether the decode launch merges the split rows itself (one launch instead of two).

    The tail hands each warp of the grid (8 per CTA) units of a quarter row (128 channels, all slots) in turn, so it
    pays while there is at most one unit per warp: at most min(batch, num_parts - 1) requests are split, with
    q_len * h_q rows of 4 quarters each. Measured on the H100 (benchmarks/RESULTS.md, 2026-11-22, CUDA-graph replay,
    h_q = 128, v2; second kernel -> tail): b=1 L=4096 24.9 -> 23.2 us and L=32768 54.8 -> 50.2 us (512 units,
    512 / 1056 warps); b=8 L=8192 74.3 -> 75.7 us and b=32 L=4096 127.3 -> 138.9 us (4x / 16x more units than warps).
    Where a fused combine cannot run (:func:`fuse_combine_reasons`) the plan does not ask for it.
    """
    split_requests = min(problem.batch, num_parts - 1)  # one part: nothing is split, nothing to merge
    return 0 < split_requests * problem.q_len * problem.num_heads_q * 4 <= ctas * 8


@dataclasses.dataclass(frozen=True)
class Sm90Launch:
    """The launch a plan froze: what the extension runs, as given (binding.cpp checks it against each call and
    raises ValueError naming a field that does not fit; params.h, LaunchConfig)."""

    #: the mainloop (:data:`MAINLOOPS`)
    variant: int
    #: query rows of a CTA tile: BLOCK_M for the 64-row mainloops (as many row tiles as the rows need), 16 or 32 for
    #: the tokens-on-M ones (v6, v7, v8: one tile that holds every row of a KV head)
    tile_rows: int
    #: KV tiles by TMA (a tensor map of the cache; v5, v8, v9, and v6 on whole-tile pages of a 16-bit cache)
    tma_loads: bool
    #: v5: the two row-tile CTAs of a part run as a cluster that starts each item together
    paired: bool
    #: split rows merged inside the decode launch (cooperative: every CTA resident at once), else by a second kernel
    fuse_combine: bool
    #: a batch-invariant schedule (fixed-size pieces, any request split anywhere): the second kernel merges per request
    fixed_splits: bool = False


def split_parts(problem: DecodeProblem, num_sms: int, min_chunks_per_part: int,
                row_tiles: int | None = None) -> tuple[int, int]:
    """``(num_parts, max_chunks)``: split-KV parts (one CTA per SM over the row tiles of all KV heads: ``row_tiles``
    per KV head where given, else 64-row tiles) and the work bound from shapes alone, every request at the table's
    width in chunks of BLOCK_N (no host sync)."""
    p = problem
    tiles = p.num_heads_kv * (row_tiles or math.ceil(rows_per_kv_head(p) / BLOCK_M))
    max_chunks = p.batch * math.ceil(p.max_blocks * p.page_size / BLOCK_N)
    return max(min(num_sms // tiles, math.ceil(max_chunks / min_chunks_per_part)), 1), max_chunks


def fuse_combine_reasons(problem: DecodeProblem, variant: int, grid: tuple[int, int, int], num_sms: int) -> list[str]:
    """Why the decode launch of ``grid`` cannot merge the split rows itself (empty: it can)."""
    out = []
    if not MAINLOOPS[variant].combine_tail:
        out.append(f"variant {variant} has no combine tail")
    ctas = grid[0] * grid[1] * grid[2]
    if ctas > num_sms:  # each kernel's shared memory holds one CTA per SM (launch.cu asserts it)
        out.append(f"its grid of {ctas} CTAs does not fit the {num_sms} SMs at once (a cooperative launch)")
    if grid[0] > FUSED_MAX_SPLITS:
        out.append(f"{grid[0]} split-KV parts (supported: <= {FUSED_MAX_SPLITS})")
    if grid[0] * problem.q_len * problem.num_heads_q * 4 + ctas * 8 >= 2**31:
        out.append("more merge units than an int32 counts")
    return out


def launch_config(problem: DecodeProblem, num_parts: int, max_chunks: int, num_sms: int,
                  options: dict[str, object]) -> Sm90Launch:
    """The plan's launch for ``problem`` split into ``num_parts`` on a GPU of ``num_sms`` SMs: the measured choices
    (:func:`choose_variant`, :func:`choose_fuse_combine`) unless ``options`` (checked backend_options) force them.

    Raises
    ------
    OptionNotSupported
        A forced ``variant`` cannot run the problem, or a forced ``fuse_combine=True`` cannot run (a ValueError); the
        message says what is required and what was given.
    """
    p = sparse_view(problem)  # a sparse problem runs as its flattened dense view
    if "variant" in options:
        variant = options["variant"]
    elif problem.sparse:
        variant = choose_sparse_variant(p)
    else:
        variant = invariant_variant(p) if p.batch_invariant else choose_variant(p, num_parts, max_chunks)
    mainloop = MAINLOOPS[variant]
    if reasons := mainloop.reasons(problem):
        raise OptionNotSupported(f"backend_options['variant']={variant} ({mainloop.name}) cannot run this problem: "
                         + "; ".join(reasons))
    tile_rows, row_tiles = tile_shape(variant, problem)
    tma_loads = (mainloop.whole_tile_pages and not problem.sparse) or (
        variant == ETAP and p.kv_format in _16BIT_CACHE and p.page_size % BLOCK_N == 0)
    grid = (num_parts, row_tiles, p.num_heads_kv)
    ctas = num_parts * row_tiles * p.num_heads_kv
    paired = variant == SEESAW and row_tiles % 2 == 0 and ctas <= num_sms  # the clusters fill the GPU at once
    cannot_fuse = fuse_combine_reasons(p, variant, grid, num_sms)
    if p.batch_invariant:  # the fused tail merges one split request per part boundary at most
        cannot_fuse.append("batch_invariant=True (any request may be split, the second kernel merges per request)")
    if "fuse_combine" in options:
        fuse = bool(options["fuse_combine"])
        if fuse and cannot_fuse:
            raise OptionNotSupported("backend_options['fuse_combine']=True cannot run: " + "; ".join(cannot_fuse))
    else:
        fuse = not cannot_fuse and choose_fuse_combine(p, num_parts, ctas)
    return Sm90Launch(variant, tile_rows, tma_loads, paired, fuse, fixed_splits=p.batch_invariant)


@functools.lru_cache(maxsize=256)
def _shape_plan(problem: DecodeProblem, num_sms: int, options: tuple) -> tuple[SplitKVLayout, Sm90Launch]:
    """What a plan decides from shapes alone, once per (problem, SM count, backend_options items): the split-KV
    layout (parts, overhead, capacity, workspace rows) and the frozen launch (:func:`launch_config`).

    Raises
    ------
    ValueError
        As :func:`launch_config`; ``split_tokens`` without ``batch_invariant``; a batch-invariant workspace past its
        bound (:func:`~mla_dispatch.metadata.schedule.check_invariant_workspace`).
    """
    options = dict(options)
    p = sparse_view(problem)
    # a sparse view's mainloop follows its shape alone, so its row tiles are known before the split (etap's of 16)
    row_tiles = tile_shape(options.get("variant") or choose_sparse_variant(p), problem)[1] if problem.sparse else None
    num_parts, max_chunks = split_parts(p, num_sms, options.get("min_chunks_per_part",
                                                                 CudaSM90Backend.MIN_CHUNKS_PER_PART), row_tiles)
    launch = launch_config(problem, num_parts, max_chunks, num_sms, options)
    if "split_tokens" in options and not p.batch_invariant:
        raise ValueError(f"backend_options['split_tokens']={options['split_tokens']} applies to "
                         "batch_invariant=True plans only")
    overhead = options.get("schedule_overhead") or CudaSM90Backend.schedule_overhead(launch.variant)
    # capacity: no item reaches past a block-table row, whatever cache_seqlens holds (update keeps it)
    capacity = p.max_blocks * p.page_size
    split = None
    if p.batch_invariant:
        split = options.get("split_tokens", BATCH_INVARIANT_SPLIT_TOKENS)
        # a partial row per query row of a piece: fp32 values (the kernels' fp16 rows and shifts) and the LSE
        check_invariant_workspace(p.batch, capacity, split, p.q_len * p.num_heads_q * (p.head_dim_v * 4 + 4))
    layout = SplitKVLayout(batch=p.batch, num_parts=num_parts, chunk_size=BLOCK_N, overhead=overhead,
                           capacity=capacity, partial_row=(p.q_len, p.num_heads_q, p.head_dim_v),
                           partial_dtype=torch.float32, split_tokens=split,
                           fixed_length=problem.topk if problem.sparse else None)
    return layout, launch


_fake_registered = False


def load_module():
    """Build/load the extension and return its Python module (``cuda_sm90_decode`` without the dispatcher).

    Raises
    ------
    mla_dispatch.kernels.cuda.build.KernelBuildError
        nvcc or CUTLASS missing, or the build failed (with the compiler's text).
    """
    load_ops()
    from mla_dispatch.kernels.cuda.build import load_sm90

    return load_sm90()


_EXTENSION_CALLS: list = []  # [(module, its calls)]: the last module's


def _extension_calls() -> tuple:
    """``(native schedule, op, module function)`` of the loaded extension, made once per module (a plan's host
    path took three loader calls and a new closure per plan)."""
    module = load_module()
    if not _EXTENSION_CALLS or _EXTENSION_CALLS[0][0] is not module:
        _EXTENSION_CALLS[:] = [(module, (native_schedule(module), load_ops().cuda_sm90_decode.default,
                                         module.cuda_sm90_decode))]
    return _EXTENSION_CALLS[0][1]


def load_ops():
    """Build/load the extension and return ``torch.ops.mla_dispatch``.

    Raises
    ------
    mla_dispatch.kernels.cuda.build.KernelBuildError
        nvcc or CUTLASS missing, or the build failed (with the compiler's text).
    """
    global _fake_registered
    from mla_dispatch.kernels.cuda.build import load_sm90

    load_sm90()
    if not _fake_registered:
        @torch.library.register_fake("mla_dispatch::cuda_sm90_decode")
        def _decode_fake(q, kv_cache, block_table, cache_seqlens, items, part_offsets, kv_scale, out, lse,
                         partial_out, partial_lse, num_splits, first_slot, softmax_scale, causal, kv_format,
                         variant, tile_rows, tma_loads, paired, fuse_combine, fixed_splits, sparse=False,
                         attn_sink=None):
            return None

        _fake_registered = True
    return torch.ops.mla_dispatch


class Sm90State(BackendState):
    """The backend's per-step state: the split-KV plan (``split``: schedule, first slots, workspace and ``lengths``,
    the plan's own copy of the lengths that every run reads; topk for every query position of a sparse plan's
    flattened view), the frozen :class:`Sm90Launch` (``launch``) and the extension's call bound to them (``bound``,
    :meth:`CudaSM90Backend.bind`). Sparse plans with s_q > 1 also hold the LSE of their flattened view
    (``sparse_lse``, ``[B * s_q, h_q, 1]``: the kernel writes it per query position, run transposes it into lse);
    with an extra cache, its state (``extra``) and the slots that merge both lists in one combine (``merged``)."""

    bound = None
    lengths = None
    sparse_lse = None
    extra = None  # a sparse plan's second key list (extra_kv_cache): its own state, and
    merged = None  # the slot layout that merges the two lists (_TwoLists)


#: ``(items, num_splits, first_slot, partial_out, partial_lse)`` of one launch (CudaSM90Backend._launch)
_Slots = tuple


def _without_partials(layout: SplitKVLayout) -> SplitKVLayout:
    """``layout`` whose plans hold no partial rows (zero rows per slot): a list of a two-list plan, whose pieces write
    into the rows of :class:`_TwoLists`."""
    return dataclasses.replace(layout, partial_row=(0, *layout.partial_row[1:]))


def _two_list_launch(launch: Sm90Launch) -> Sm90Launch:
    """The launch of each list of a two-list sparse plan: the combine in its own kernel, one block row per request
    (the fused tail and the per-boundary combine assume one schedule's slots)."""
    return dataclasses.replace(launch, fuse_combine=False, fixed_splits=True)


class _TwoLists:
    """The slot layout that merges a sparse plan's two key lists (the main cache's and the extra cache's, each a
    split-KV plan of its own over the same ``R = B * s_q`` flattened requests) in the combine kernel.

    Every item of both schedules writes a partial row (its slot rewritten; none writes out): request ``r``'s main
    pieces take slots ``first[r] ...``, its extra pieces the ``n_extra[r]`` slots after them, ``num_splits = n_main +
    n_extra``. The first launch runs with one slot per request (its combine merges nothing); the second with the merged
    counts, so its combine reads both lists' partial rows (fp16 with per-quarter shifts: ~11 bits), applies the sink
    and rounds to q's dtype once. Merging the two launches' bf16 outputs instead put 11 of FlashMLA's 4,502 MODEL1 test
    cases 0.1-1% past its cosine bound (benchmarks/RESULTS.md, 2026-11-29 evening). Made once per plan (a sparse
    plan's schedules depend on ``topk`` only): a few torch ops."""

    __slots__ = ("first", "second")

    def __init__(self, main: SplitKVPlan, extra: SplitKVPlan, rows: SplitKVLayout) -> None:
        n_main, n_extra = main.schedule.num_splits.long(), extra.schedule.num_splits.long()
        counts = n_main + n_extra
        first = torch.cumsum(counts, 0) - counts
        slots = int(main.schedule.items.shape[0] + extra.schedule.items.shape[0])
        device = counts.device
        # a partial row as the lists' layouts would have it (``rows``: the main list's, before _without_partials)
        partial_out = torch.empty(slots, *rows.partial_row, dtype=rows.partial_dtype, device=device)
        partial_lse = torch.empty(slots, *rows.partial_row[:-1], dtype=torch.float32, device=device)
        num_splits, first_slot = counts.to(torch.int32), first.to(torch.int32)
        items_main = self._rewritten(main, first)
        items_extra = self._rewritten(extra, first + n_main)
        ones = torch.ones_like(num_splits)
        self.first = (items_main, ones, first_slot, partial_out, partial_lse)
        self.second = (items_extra, num_splits, first_slot, partial_out, partial_lse)

    @staticmethod
    def _rewritten(plan: SplitKVPlan, base: torch.Tensor) -> torch.Tensor:
        """``plan``'s items with each piece's slot at ``base[req]`` + its rank within its request (padding rows
        kept)."""
        items = plan.schedule.items
        req, slot = items[:, 0].long(), items[:, 3].long()
        valid = req >= 0
        r = req.clamp_min(0)
        rank = torch.where(slot >= 0, slot - plan.first_slot.long()[r], 0)
        out = items.clone()
        out[:, 3] = torch.where(valid, base[r] + rank, -1).to(torch.int32)
        return out


class CudaSM90Backend(MLABackend):
    """Native SM90 MLA decode (the mainloops of :data:`MAINLOOPS`; see docs/notes/cuda_sm90.md)."""

    NAME = "cuda_sm90"
    DESCRIPTION = "our CUDA MLA decode kernel for Hopper (sm_90a), persistent split-KV grid + combine"
    PLATFORMS = frozenset({"cuda"})
    MIN_CAPABILITY = (9, 0)
    MAX_CAPABILITY = (9, 0)
    Q_DTYPES = frozenset({torch.bfloat16, torch.float16})
    KV_FORMATS = frozenset({"bf16", "fp16", "fp8_e4m3", "fp8_ds_mla", "fp8_ds_v4"})
    # 512 / 512: DeepSeek-V4's fp8_ds_v4 cache, sparse (extra_reasons)
    HEAD_DIMS = frozenset({(576, 512), (DS_V4_HEAD_DIM, DS_V4_HEAD_DIM)})
    PAGE_SIZES = None  # any page size >= 1
    MAX_HEADS_Q = None
    MAX_Q_LEN = None
    SUPPORTS_CAUSAL = True
    SUPPORTS_LSE = True
    # sparse (top-k) decode: the flattened view of sparse_view on a mainloop that skips -1 slots (choose_sparse_variant)
    SUPPORTS_SPARSE = True
    # topk_length: the lengths of the flattened view (the kernel ends a sparse item there); attn_sink: the epilogue
    # and the combine; the extra cache: a second launch over its own view, both lists merged by its combine (_TwoLists)
    SPARSE_EXTRAS = frozenset({"topk_length", "attn_sink", "extra_kv_cache", "extra_topk_length"})
    # batch_invariant=True: fixed-size pieces (fixed_split_schedule), one mainloop per shape (invariant_variant), the
    # per-request combine kernel
    SUPPORTS_BATCH_INVARIANT = True
    CUDA_GRAPH = CGSupport.ALWAYS
    KEEPS_LENGTHS = True  # the split-KV plan's own copy (metadata/split_plan.py), written by its schedule launch
    ARCH_SUPPORT = (ArchSupport("sm90", "Hopper (sm_90a)", notes="our native CUDA kernel", run_here="yes: H100, H200"),)
    OPTIONS = MappingProxyType({
        "variant": BackendOption(tuple(MAINLOOPS), "the mainloop, instead of the plan's choice (choose_variant): 2 "
                                 "wgmma, 5 seesaw (two tiles in flight), 6 etap (tokens on M), 7 fp8t_convert / 8 "
                                 "fp8t_regs (tokens on M for fp8_e4m3), 9 seesaw_fp8 (seesaw for fp8_e4m3); it must "
                                 "suit the problem (Mainloop.reasons)"),
        "fuse_combine": BackendOption((False, True), "merge split rows inside the decode launch (True) or in a second "
                                      "kernel (False), instead of the plan's choice (choose_fuse_combine); a sparse "
                                      "plan with an extra cache merges its two lists in a second kernel either way"),
        "split_tokens": BackendOption(SPLIT_TOKENS_CHOICES, "tokens per piece of a batch_invariant=True plan "
                                      f"(default {BATCH_INVARIANT_SPLIT_TOKENS})"),
        "min_chunks_per_part": BackendOption(tuple(range(1, 65)), "fewest 64-token chunks a split-KV part gets, "
                                             "instead of MIN_CHUNKS_PER_PART"),
        "schedule_overhead": BackendOption(tuple(range(1, 33)), "the schedule's fixed cost per work item, in "
                                           "chunks, instead of the mainloop's (SCHEDULE_OVERHEAD_BY_VARIANT)"),
    })
    #: fewest KV chunks (of 64 tokens) a split-KV part gets. It matters only where the batch has fewer chunks than
    #: two per CTA. A part costs a Q-tile load and a partial-row write besides its chunks, and with fp16 partial rows
    #: one chunk per part measured faster at every head count (benchmarks/RESULTS.md, thirteenth and fourteenth
    #: sessions, H100, CUDA-graph replay): b=1 L=4096 h_q=128 21.6 against 23.0 us, h_q = 16 / 32 / 64 (bf16)
    #: 21.5 / 28.0 / 21.3 against 22.6 / 29.2 / 22.7, fp8_e4m3 8-10% faster at b <= 2. Experiments pass
    #: ``backend_options={"min_chunks_per_part": n}``.
    MIN_CHUNKS_PER_PART: int = 1
    #: the split-KV schedule's fixed cost per work item, in chunks (metadata/schedule.py; FlashMLA charges 5), per
    #: mainloop: what an item costs besides its tiles, read in per-CTA timelines (sixteenth session in
    #: docs/notes/cuda_sm90.md; the timeline build is commit 8b1ee16's). A v2 item's metadata, first
    #: loads and stores take ~7 us, two tiles at b=64 L=8192 h_q=64; with 5 the parts holding one item ran 5 tiles
    #: longer than those holding two and finished last. Charging 2 measured 1% faster there and at h_q=32, 3% at b=8 L=8192 h_q=128 (CUDA-graph replay, H100,
    #: two runs each). v5's and v6's items cost ~4-5 tiles (their first pairs wait for loads); they keep 5. With 5
    #: at b=1 L=4096 h_q=128 the parts get two chunks (69 units over 64 parts) and half of them none; one chunk per
    #: part (counting the parts in cost units) doubles the splits and measured no faster (fifteenth session).
    #: Experiments pass ``backend_options={"schedule_overhead": n}``.
    SCHEDULE_OVERHEAD_BY_VARIANT: MappingProxyType = MappingProxyType({2: 2})

    @classmethod
    def schedule_overhead(cls, variant: int) -> int:
        """The schedule's fixed cost per work item, in chunks, for plans running mainloop ``variant``."""
        return cls.SCHEDULE_OVERHEAD_BY_VARIANT.get(variant, 5)

    @classmethod
    def extra_reasons(cls, problem: DecodeProblem, platform: Platform) -> list[Reason]:
        reasons = []
        v4 = problem.kv_format == "fp8_ds_v4"
        if problem.head_dim_qk == DS_V4_HEAD_DIM and not (v4 and problem.sparse):
            reasons.append(Reason(ReasonCode.HEAD_DIM, f"D_qk/D_v=512/{problem.head_dim_v} with kv_format="
                                                       f"{problem.kv_format}{'' if problem.sparse else ', dense'} "
                                                       "(supported: 576/512; 512/512 only for sparse fp8_ds_v4)"))
        if v4:  # the kernel reads a V4 block's bytes with 16-byte vectors from its start (binding.cpp)
            for what, stride in (("kv_cache", problem.kv_block_stride), ("extra_kv_cache", problem.extra_block_stride)):
                if stride % 16:
                    reasons.append(Reason(ReasonCode.FEATURE, f"{what} blocks {stride} bytes apart (supported: a "
                                                              "multiple of 16, as FlashMLA's fp8_ds_v4 layout pads each "
                                                              "block to a multiple of 576 bytes: "
                                                              "kvcache.formats.empty_ds_v4_cache)"))
        if problem.batch_invariant and problem.extra_topk:
            reasons.append(Reason(ReasonCode.FEATURE, "batch_invariant=True with extra_kv_cache (supported: without)"))
        requests = sparse_view(problem).batch  # sparse: one request per query position
        if (problem.batch_invariant or problem.extra_topk) and requests > 65535:  # the per-request combine's grid y
            what = "batch_invariant=True" if problem.batch_invariant else "extra_kv_cache"  # (launch.cu)
            reasons.append(Reason(ReasonCode.FEATURE, f"{what} with {requests} requests (batch * s_q for sparse; "
                                                      "supported: <= 65535)"))
        return reasons

    @classmethod
    def build(cls, *, verbose: bool = False) -> str:
        """Build (or load the cached build of) the extension: ``kernels/cuda/build.py`` (nvcc >= 12.4, CUTLASS).

        Raises
        ------
        mla_dispatch.kernels.cuda.build.KernelBuildError
            nvcc or CUTLASS missing, or the build failed (with the compiler's text).
        """
        from mla_dispatch.kernels.cuda.build import SM90_SOURCE_DIR, load_sm90

        return f"built {load_sm90(verbose=verbose).__name__} (sources: {SM90_SOURCE_DIR})"

    @classmethod
    def _check_availability(cls) -> list[Reason]:
        reasons = super()._check_availability()
        if reasons:
            return reasons
        if not torch.cuda.is_available() or torch.version.cuda is None:
            return [Reason(ReasonCode.UNAVAILABLE, "no CUDA device visible to torch (the kernel is built on first use)")]
        cap = torch.cuda.get_device_capability()
        if cap != (9, 0):  # do not spend a build on a GPU the sm_90a binary cannot run on
            return [Reason(ReasonCode.CAPABILITY, f"compute capability {cap[0]}.{cap[1]} (supported: 9.0, sm_90a)")]
        try:
            load_ops()
        except Exception as exc:
            return [Reason(ReasonCode.UNAVAILABLE, f"cuda_sm90 extension unavailable: {exc}")]
        return []

    @classmethod
    def plan(cls, problem: DecodeProblem, platform: Platform, block_table, cache_seqlens, *,
             softmax_scale: float, options: dict[str, object]) -> BackendState:
        device = (cache_seqlens.device if cache_seqlens is not None
                  else torch.device("cuda", torch.cuda.current_device()))
        sms = (platform.num_compute_units if platform is not None
               else torch.cuda.get_device_properties(device).multi_processor_count)
        if not problem.extra_topk:
            return cls._list_state(problem, cache_seqlens, device, sms, options)
        # DeepSeek-V4's extra cache: a second list of its own flattened view (extra_topk tokens, its page size),
        # launched after the main one over the same query rows. Both launches write partial rows only, into the
        # buffers of _TwoLists (the lists' own plans hold none), and the second one's combine merges both lists
        extra_problem = dataclasses.replace(problem, topk=problem.extra_topk, page_size=problem.extra_page_size,
                                            cache_numel=problem.extra_cache_numel, extra_topk=0,
                                            kv_block_stride=problem.extra_block_stride, extra_block_stride=0,
                                            extra_page_size=0, extra_cache_numel=0, topk_length=False,
                                            extra_topk_length=False, attn_sink=False)
        state = cls._list_state(problem, None, device, sms, options, two_lists=True)
        state.extra = cls._list_state(extra_problem, None, device, sms, options, two_lists=True)
        rows = _shape_plan(problem, sms, tuple(sorted(options.items())))[0]  # (the partial row of the lists' layout)
        state.merged = _TwoLists(state.split, state.extra.split, rows)
        return state

    @classmethod
    def _list_state(cls, problem: DecodeProblem, cache_seqlens, device: torch.device, sms: int,
                    options: dict[str, object], two_lists: bool = False) -> Sm90State:
        """The state of one key list: its split-KV plan (no partial rows of its own for a list of a two-list plan,
        whose launches take _TwoLists' buffers), its frozen launch and the extension's calls."""
        view = sparse_view(problem)  # the problem itself unless sparse
        layout, launch = _shape_plan(problem, sms, tuple(sorted(options.items())))
        if two_lists:
            layout, launch = _without_partials(layout), _two_list_launch(launch)
        native, op, direct = _extension_calls()
        # sparse: every query position attends to its topk slots (-1 ones are masked in the kernel), lengths unread
        split = SplitKVPlan(layout, None if problem.sparse else cache_seqlens, device, native=native)
        sparse_lse = None
        if problem.sparse and problem.q_len > 1:
            sparse_lse = torch.empty(view.batch, view.num_heads_q, 1, dtype=torch.float32, device=device)
        return Sm90State(
            split=split,
            lengths=split.lengths,
            sparse_lse=sparse_lse,
            op=op,
            direct=direct,
            schedule=split.schedule,
            first_slot=split.first_slot,
            # one 2048-byte row per (slot, query row); the kernels store fp16 rows with per-quarter shifts in them
            # (kernels/cuda/mla_decode_sm90/params.h, kPartialRowBytes)
            partial_out=split.partial_out,
            partial_lse=split.partial_lse,
            kv_format_code=KV_FORMAT_CODES[view.kv_format],
            launch=launch,
        )

    @classmethod
    def bind(cls, state: Sm90State, problem: DecodeProblem, kv_dtype: torch.dtype, block_table, cache_seqlens, *,
             softmax_scale: float):
        """The extension's ``PlannedDecode``: the schedule, workspace and launch checked and packed once, so an
        eager run passes q, the cache, its scale, out and lse to one native call that checks only those."""
        p, s, c = problem, state.schedule, state.launch
        try:
            state.bound = load_module().PlannedDecode(
                block_table, state.lengths, s.items, s.part_offsets, state.partial_out, state.partial_lse,
                s.num_splits, state.first_slot, p.q_dtype, kv_dtype, p.q_len, p.num_heads_q, p.num_heads_kv,
                p.page_size, 656 if p.kv_format == "fp8_ds_mla" else p.head_dim_qk, softmax_scale, p.causal,
                state.kv_format_code, c.variant, c.tile_rows, c.tma_loads, c.paired, c.fuse_combine, c.fixed_splits)
        except ValueError:  # e.g. a block table with strided rows: run raises the binding's message per call
            return None
        return state.bound.run

    @classmethod
    def update(cls, state: BackendState, block_table, cache_seqlens) -> None:
        state.split.update(cache_seqlens)  # (sparse: nothing, the schedule depends on topk only)

    @classmethod
    def run(cls, state: BackendState, q, kv_cache, block_table, cache_seqlens, *, problem: DecodeProblem,
            softmax_scale: float, kv_scale, indices, out, lse, topk_length=None, attn_sink=None, extra_kv_cache=None,
            extra_indices=None, extra_topk_length=None) -> None:
        if problem.sparse:
            merged = state.merged
            if merged is None:
                cls._run_sparse(state, q, kv_cache, indices, problem=problem, softmax_scale=softmax_scale,
                                kv_scale=kv_scale, out=out, lse=lse, topk_length=topk_length, attn_sink=attn_sink)
                return
            # two key lists: the first launch writes its partial rows (its combine sees one slot per request and
            # merges nothing), the second writes its own and merges both lists, the sink applied there
            cls._run_sparse(state, q, kv_cache, indices, problem=problem, softmax_scale=softmax_scale,
                            kv_scale=kv_scale, out=out, lse=lse, topk_length=topk_length, slots=merged.first,
                            finish=False)
            cls._run_sparse(state.extra, q, extra_kv_cache, extra_indices,
                            problem=dataclasses.replace(problem, topk=problem.extra_topk), softmax_scale=softmax_scale,
                            kv_scale=None, out=out, lse=lse, topk_length=extra_topk_length, attn_sink=attn_sink,
                            slots=merged.second)
            return
        cls._launch(state, q, kv_cache, block_table, state.lengths, kv_scale, out, lse, softmax_scale, problem.causal,
                    False)

    @staticmethod
    def _launch(state: Sm90State, q, kv_cache, block_table, cache_seqlens, kv_scale, out, lse, softmax_scale: float,
                causal: bool, sparse: bool, attn_sink=None, slots: "_Slots | None" = None) -> None:
        """The extension's decode (and combine) on these tensors with the plan's schedule, workspace and launch
        (``slots``: another slot layout over the plan's items, :class:`_TwoLists`)."""
        s, c = state.schedule, state.launch
        if slots is None:
            items, num_splits, first_slot, partial_out, partial_lse = (s.items, s.num_splits, state.first_slot,
                                                                       state.partial_out, state.partial_lse)
        else:
            items, num_splits, first_slot, partial_out, partial_lse = slots
        # Eager calls on plain tensors skip the dispatcher (binding.cpp; on the H100 host of 2026-11-22 the op
        # took 15.2-16.1 us of host time per call, the module function 8.2-8.9); under torch.compile, fake
        # tensors, functionalization or any other TorchDispatchMode the op runs, so it is traced.
        (state.direct if untraced_eager(q) else state.op)(
            q, kv_cache, block_table, cache_seqlens, items, s.part_offsets,
            kv_scale if state.kv_format_code == 1 else None, out, lse, partial_out, partial_lse,
            num_splits, first_slot, softmax_scale, causal, state.kv_format_code, c.variant,
            c.tile_rows, c.tma_loads, c.paired, c.fuse_combine, c.fixed_splits, sparse, attn_sink)

    @classmethod
    def _run_sparse(cls, state: Sm90State, q, kv_cache, indices, *, problem: DecodeProblem, softmax_scale: float,
                    kv_scale, out, lse, topk_length=None, attn_sink=None, slots: "_Slots | None" = None,
                    finish: bool = True) -> None:
        """A sparse run on the flattened view (:func:`sparse_view`): views of q, out and indices (no copy where
        their strides allow one; copies otherwise), the cache as it is (the kernel reads token id ``block *
        page_size + offset`` from its blocks, whatever their stride), the LSE through ``state.sparse_lse`` when
        s_q > 1. ``topk_length`` becomes the view's lengths (written in place: the kernel ends each item there, so
        entries past it are never read); ``attn_sink`` goes to the kernel. ``slots``: as :meth:`_launch`; ``finish``
        False: a launch whose out and lse another launch writes (the copies into a strided out and the LSE's
        transposition are left to that one)."""
        p = problem
        if topk_length is not None:  # every query position of request b reads its first clamp(topk_length[b]) ids
            state.lengths.view(p.batch, p.q_len).copy_(topk_length[:, None]).clamp_(0, p.topk)
        rows = p.batch * p.q_len
        q_flat = q.reshape(rows, 1, p.num_heads_q, q.shape[-1])  # a view for a q of contiguous (b, s) rows
        table = indices.reshape(rows, p.topk)
        if table.stride(1) != 1:
            table = table.contiguous()
        flat_out = p.q_len == 1 or out.stride(0) == p.q_len * out.stride(1)
        out_flat = (out.view(rows, 1, p.num_heads_q, p.head_dim_v) if flat_out
                    else torch.empty(rows, 1, p.num_heads_q, p.head_dim_v, dtype=out.dtype, device=out.device))
        lse_flat = lse if state.sparse_lse is None else state.sparse_lse
        cls._launch(state, q_flat, kv_cache, table, state.lengths, kv_scale, out_flat, lse_flat, softmax_scale, False,
                    True, attn_sink, slots)
        if not finish:
            return
        if not flat_out:
            out.copy_(out_flat.view(p.batch, p.q_len, p.num_heads_q, p.head_dim_v))
        if state.sparse_lse is not None:  # [B * s_q, h_q, 1] -> [B, h_q, s_q]
            lse.copy_(state.sparse_lse.view(p.batch, p.q_len, p.num_heads_q).transpose(1, 2))
