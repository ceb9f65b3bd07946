"""``python -m mla_dispatch bench``: every available backend, side by side, against the roofline.

For each configuration of a named grid, in one process:

1. generate the inputs on the device (FlashMLA's test data, docs/design.md §5:
   ``randn/10`` clamped to ±1, varlen lengths ``max(N(L, L/2), s_q)``, a random
   block permutation, NaN in every unused cache slot, unused table entries
   2147480000) and compute the fp32 reference once;
2. for each backend: skip it with its own reasons if it cannot run the
   problem; run it once and compare with the reference at the backend's
   declared tolerance — a wrong (or crashing) backend is reported and never
   timed; otherwise time
   - ``run``: ``DecodePlan.run`` (the per-layer call; the plan is made once),
   - ``call``: the whole ``mla_decode`` (planning, metadata and combine included),
   - ``graph``: replay of a CUDA graph captured over ``DecodePlan.run``, its
     outputs allocated at capture, as FlashMLA's own call is (CUDA only, backends
     with ``CUDA_GRAPH`` ALWAYS; its output is checked against the reference too);
3. on a GPU, the host time of ``plan_decode``, ``DecodePlan.run`` and the one-shot
   ``mla_decode`` (wall clock with a device synchronisation after, median of 50);
4. where FlashMLA or FlashAttention-3 is installed, each called directly on the same
   inputs (:mod:`mla_dispatch.tools.peers`), and every row's "× FlashMLA" and "× FA3":
   its CUDA-graph time over that peer's (lower is better);
5. count FLOPs and bytes (:mod:`mla_dispatch.tools.roofline`) and report µs, TFLOP/s,
   GB/s and % of the roofline, whose ceilings were measured at the start of
   the run.

The backend ``auto`` is what ``backend="auto"`` chooses (the row's note names it); ``--check-auto TOL`` sets its
time on each config against the fastest correct backend's and fails the run where it is over by more than TOL
(:mod:`mla_dispatch.tools.autocheck`). ``--times`` restricts what is timed (``graph`` alone for such a check).

Results are printed as a Markdown table (ready for ``benchmarks/RESULTS.md``)
and written as JSON and CSV; ``--plot`` adds a PNG of % of roofline per config.
The exit code is 1 if any backend was wrong or crashed, or if nothing ran (every
backend unavailable, or declining every config); 2 for a usage mistake; else 0.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import importlib.util
import json
import logging
import math
import os
import platform as host_platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

from mla_dispatch.api import mla_decode, plan_decode
from mla_dispatch.dispatch.backend import CGSupport, OptionNotSupported
from mla_dispatch.kvcache.formats import empty_ds_v4_cache, pack_ds_mla, quantize_fp8_e4m3, write_ds_v4
from mla_dispatch.dispatch.platform import platform_for
from mla_dispatch.dispatch.problem import DecodeProblem, describe_inputs
from mla_dispatch.dispatch.registry import get_backend, registered_names
from mla_dispatch.dispatch.select import NoBackendError, select_backend
from mla_dispatch.dispatch.tuned import fingerprint
from mla_dispatch.tools.peers import (PEER_FA3, PEER_FLASHMLA, fa3_peer_available, fa3_runs, flashmla_peer_available,
                                      flashmla_runs, host_us, time_fa3, time_flashmla)
from mla_dispatch.tools.roofline import Ceilings, decode_work, measure_ceilings, time_fn, timer_name
from mla_dispatch.numerics.cases import UNUSED_BLOCK_ID, DecodeCase
from mla_dispatch.numerics.tolerance import compare_outputs
from mla_dispatch.tools.args import (CommandParser, UsageError, backend_names, backend_spec, comma_items,
                                     nonnegative_float, parse_device, positive_float, positive_int, seed_int,
                                     usage_error, writable_dir)

__all__ = ["BenchConfig", "BenchRow", "GRIDS", "grid_configs", "make_bench_case", "run_bench", "default_backends",
           "environment", "main"]

logger = logging.getLogger("mla_dispatch")

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Names never benchmarked unless asked for: the AMLA emulation is a conformance oracle.
_NOT_BY_DEFAULT = ("amla_emulation",)


# -- configurations -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """One benchmarked shape. ``kv_format=None`` means the q dtype's own format."""

    batch: int
    q_len: int
    num_heads_q: int
    seqlen: int  # L (fixed) or L-bar (varlen)
    varlen: bool = False
    causal: bool = False
    page_size: int = 64
    num_heads_kv: int = 1
    kv_format: str | None = None
    topk: int = 0
    head_dim_qk: int = 576
    head_dim_v: int = 512
    #: block ids in order, request after request (a freshly filled cache); False: a random permutation, as a
    #: serving engine's pages are after requests came and went (FlashMLA's test data)
    ordered: bool = False

    @property
    def label(self) -> str:
        """``b128-s2-h128-L8192v-ps64-causal``: v = varlen mean (else fixed); a kv format only if not q's."""
        parts = [f"b{self.batch}", f"s{self.q_len}", f"h{self.num_heads_q}"]
        if self.num_heads_kv != 1:
            parts.append(f"hkv{self.num_heads_kv}")
        parts.append(f"L{self.seqlen}{'v' if self.varlen else ''}")
        parts.append(f"ps{self.page_size}")
        if self.kv_format:
            parts.append(self.kv_format)
        if self.topk:
            parts.append(f"topk{self.topk}")
        if self.causal:
            parts.append("causal")
        if (self.head_dim_qk, self.head_dim_v) != (576, 512):
            parts.append(f"d{self.head_dim_qk}x{self.head_dim_v}")
        if self.ordered:
            parts.append("ordered")
        return "-".join(parts)


def _flashmla_grid() -> list[BenchConfig]:
    return [BenchConfig(128, s_q, 128, L, varlen=True, causal=causal)
            for s_q in (1, 2) for L in (4096, 8192, 16384, 32768)
            for causal in ((False,) if s_q == 1 else (False, True))]


def _dsv32_grid() -> list[BenchConfig]:
    # issue 57's table (FlashMLA's sparse kernel runs h_q 64 and 128; 16 and 32 are ours alone)
    rows = [(64, 1, 64), (64, 2, 128), (128, 2, 128), (2, 2, 128), (128, 2, 16), (128, 2, 32)]
    return [BenchConfig(b, s_q, h_q, 32768, kv_format="fp8_ds_mla", topk=2048) for b, s_q, h_q in rows]


def _dsv4_grid() -> list[BenchConfig]:
    # DeepSeek-V4's sparse decode (FlashMLA's MODEL1): D_qk = D_v = 512, the fp8_ds_v4 cache (one key list, no sink)
    return [BenchConfig(b, s_q, h_q, 32768, kv_format="fp8_ds_v4", topk=2048, head_dim_qk=512, head_dim_v=512)
            for b, s_q, h_q in ((64, 1, 64), (128, 2, 128), (2, 2, 128), (128, 2, 16))]


def _hopper_grid() -> list[BenchConfig]:
    # docs/design.md §6's side-by-side table (issue 54's configs): FlashMLA's grid at s_q=1 and s_q=2 causal, head
    # counts at b=64, TP8 with MTP, small batches
    return ([c for c in _flashmla_grid() if c.q_len == 1 or c.causal]
            + [BenchConfig(64, 1, h, 8192) for h in (16, 32, 64, 128)]
            + [BenchConfig(128, 2, 16, 4096, causal=True)]
            + [BenchConfig(1, 1, 128, L) for L in (4096, 32768)]
            + [BenchConfig(8, 1, 128, 8192), BenchConfig(32, 1, 128, 4096)]
            + [BenchConfig(4, 4, 16, 2048, causal=True)])


def _heads_grid() -> list[BenchConfig]:
    return [BenchConfig(64, s_q, h, 8192) for s_q in (1, 2) for h in (16, 32, 64, 128)]


def _latency_grid() -> list[BenchConfig]:
    return [BenchConfig(b, 1, 128, L) for b in (1, 8, 32) for L in (4096, 32768)]


def _pages_grid() -> list[BenchConfig]:
    return [BenchConfig(64, 1, 128, 8192, varlen=True, page_size=ps) for ps in (1, 16, 64, 128, 256)]


def _fragmentation_grid() -> list[BenchConfig]:
    return [BenchConfig(64, 1, h_q, 8192, varlen=True, page_size=ps, ordered=ordered)
            for h_q in (128, 16) for ps in (1, 16, 64) for ordered in (False, True)]


def _fp8_heads_grid() -> list[BenchConfig]:
    memory_bound = [BenchConfig(64, 1, h_q, 8192, kv_format=fmt)
                    for h_q in (16, 32) for fmt in (None, "fp8_e4m3", "fp8_ds_mla")]
    compute_bound = [BenchConfig(128, 1, 128, 8192, varlen=True, kv_format=fmt) for fmt in (None, "fp8_e4m3")]
    return memory_bound + compute_bound


def _fp8_grid() -> list[BenchConfig]:
    dense = [BenchConfig(128, s_q, 128, 8192, varlen=True, kv_format=fmt)
             for fmt in ("fp8_e4m3", "fp8_ds_mla") for s_q in (1, 2)]
    sparse = [BenchConfig(128, s_q, 128, 32768, varlen=True, kv_format="fp8_ds_mla", topk=2048) for s_q in (1, 2)]
    return dense + sparse


def _sparse_grid() -> list[BenchConfig]:
    # DeepSeek-V3.2's decode (topk 2048 over varlen L-bar 32K, fp8_ds_mla): FlashMLA's sparse shapes (h_q 128 / 64),
    # then what FlashMLA's sparse kernel does not run (h_q 16 / 32, a bf16 cache, other page sizes)
    flashmla = [BenchConfig(128, 2, 128, 32768, varlen=True, kv_format="fp8_ds_mla", topk=2048),
                BenchConfig(64, 1, 64, 32768, varlen=True, kv_format="fp8_ds_mla", topk=2048)]
    others = ([BenchConfig(64, 1, h_q, 32768, varlen=True, kv_format="fp8_ds_mla", topk=2048) for h_q in (16, 32)]
              + [BenchConfig(64, 1, 64, 32768, varlen=True, topk=2048)]
              + [BenchConfig(64, 1, 64, 32768, varlen=True, kv_format="fp8_ds_mla", topk=2048, page_size=ps)
                 for ps in (1, 16)])
    return flashmla + others


def _quick_grid() -> list[BenchConfig]:
    return [
        BenchConfig(2, 1, 16, 256),
        BenchConfig(3, 2, 16, 200, varlen=True, causal=True, page_size=16),
        BenchConfig(2, 1, 32, 300, varlen=True, num_heads_kv=2, page_size=1),
        BenchConfig(2, 1, 16, 256, kv_format="fp8_e4m3"),
        BenchConfig(2, 1, 16, 256, kv_format="fp8_ds_mla", topk=64),
    ]


# name -> (what it is, configs)
GRIDS = {
    "flashmla": ("FlashMLA's own grid: b=128, h_q=128, s_q 1/2, varlen L-bar 4K..32K, causal on/off", _flashmla_grid),
    "hopper": ("docs/design.md §6's side-by-side table: b=128 h_q=128 varlen L-bar 4K..32K (s_q 1, s_q 2 causal), "
               "b=64 L=8192 h_q 16..128, b=128 L=4096 h_q=16 s_q=2 causal, b 1/8/32 h_q=128, b=4 h_q=16 s_q=4 causal",
               _hopper_grid),
    "heads": ("b=64, L=8192, h_q 16/32/64/128, s_q 1/2", _heads_grid),
    "latency": ("small batches: b 1/8/32, L 4096/32768, h_q=128, s_q=1", _latency_grid),
    "pages": ("page sizes 1/16/64/128/256: b=64, h_q=128, varlen L-bar 8192", _pages_grid),
    "fragmentation": ("pages 1/16/64 with random and ordered block tables: b=64, h_q 128/16, varlen L-bar 8192",
                      _fragmentation_grid),
    "fp8-heads": ("fp8 caches beside their 16-bit twin: b=64 L=8192 h_q 16/32 (fp8_e4m3, fp8_ds_mla) and b=128 "
                  "h_q=128 L-bar 8192 (fp8_e4m3)", _fp8_heads_grid),
    "fp8": ("fp8 caches: fp8_e4m3 and fp8_ds_mla dense (b=128, L-bar 8192) and sparse topk=2048", _fp8_grid),
    "sparse": ("sparse (top-k 2048) decode over varlen L-bar 32K: FlashMLA's sparse shapes (b=128 h_q=128 s_q=2, "
               "b=64 h_q=64, fp8_ds_mla) and what it does not run (h_q 16/32, a bf16 cache, pages 1/16)",
               _sparse_grid),
    "dsv32": ("DeepSeek-V3.2's sparse decode (top-k 2048 of L 32K, fp8_ds_mla), issue 57's rows: b=64 h_q=64 s_q=1, "
              "b=64 / 128 / 2 h_q=128 s_q=2, b=128 h_q=16 / 32 s_q=2", _dsv32_grid),
    "dsv4": ("DeepSeek-V4's sparse decode (FlashMLA's MODEL1: D 512/512, fp8_ds_v4, top-k 2048 of L 32K, one key "
             "list): b=64 h_q=64 s_q=1, b=128 / 2 h_q=128 s_q=2, b=128 h_q=16 s_q=2", _dsv4_grid),
    "quick": ("a handful of small configs (seconds on a CPU with the reference backend)", _quick_grid),
}


def grid_configs(name: str) -> list[BenchConfig]:
    """The configs of grid ``name`` (see :data:`GRIDS`)."""
    if name not in GRIDS:
        raise ValueError(f"unknown grid {name!r} (choose from: {', '.join(GRIDS)})")
    return GRIDS[name][1]()


# -- inputs on the device -------------------------------------------------------------------------


def make_bench_case(cfg: BenchConfig, *, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                    seed: int = 0, extra_blocks: int = 2) -> DecodeCase:
    """Inputs for ``cfg``, generated on ``device`` with the data of :func:`mla_dispatch.numerics.cases.make_case`.

    Unlike ``make_case`` it is vectorised and allocates only the blocks the
    requests use (plus ``extra_blocks`` of junk), so FlashMLA-sized grids
    (b=128, L=32K) build in seconds on a GPU. ``fp8_e4m3`` uses the fixed scale
    ``1.25/448`` (values are within ±1).
    """
    device = torch.device(device)
    cpu = torch.Generator().manual_seed(seed)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    kv_format = cfg.kv_format or ("bf16" if dtype == torch.bfloat16 else "fp16")
    B, ps, hkv, D = cfg.batch, cfg.page_size, cfg.num_heads_kv, cfg.head_dim_qk

    lens = case_lengths(cfg, cpu)
    nblk = (lens + ps - 1) // ps
    total = int(nblk.sum())
    max_blocks = max(1, int(nblk.max()))
    num_blocks = total + extra_blocks
    perm = torch.arange(num_blocks) if cfg.ordered else torch.randperm(num_blocks, generator=cpu)
    cols = torch.arange(max_blocks)
    live = cols[None, :] < nblk[:, None]
    block_table = torch.full((B, max_blocks), UNUSED_BLOCK_ID, dtype=torch.int64)
    block_table[live] = perm[:total]  # row-major: request b's blocks in order

    # Values, generated chunk by chunk in fp32 on the device and stored in the format. fp8_ds_v4 is laid out per
    # block (every token's data, then every token's scales: kvcache/formats.py), written by flat slot (write_ds_v4).
    v4 = kv_format == "fp8_ds_v4"
    if v4:
        if hkv != 1 or D != 512:
            raise ValueError(f"kv_format='fp8_ds_v4' takes one KV head and D_qk 512, got h_kv={hkv}, D_qk={D}")
        kv = empty_ds_v4_cache(num_blocks, ps, device=device, fill=None)
    else:
        width = 656 if kv_format == "fp8_ds_mla" else D
        store = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8_e4m3": torch.float8_e4m3fn,
                 "fp8_ds_mla": torch.uint8}[kv_format]
        kv = torch.empty(num_blocks, ps, hkv, width, dtype=store, device=device)
    kv_scale = torch.tensor([1.25 / 448.0], dtype=torch.float32, device=device) if kv_format == "fp8_e4m3" else None
    chunk = max(1, (64 << 20) // (ps * hkv * D))
    for s in range(0, num_blocks, chunk):
        vals = (torch.randn(min(chunk, num_blocks - s), ps, hkv, D, generator=gen, device=device) / 10).clamp(-1, 1)
        if v4:  # (flat slots block * ps + offset: the chunk's blocks, token after token)
            write_ds_v4(kv, torch.arange(s * ps, s * ps + vals.shape[0] * ps, device=device), vals.reshape(-1, D))
        else:
            kv[s:s + chunk] = _encode(vals, kv_format, kv_scale)
    # Poison every slot no request uses: the junk blocks and the tail of each last block (the other formats through
    # byte views: index_put has no float8 kernel on every device).
    has = nblk > 0
    last = block_table[has, nblk[has] - 1]
    used_in_last = lens[has] - (nblk[has] - 1) * ps
    tail = torch.arange(ps)[None, :] >= used_in_last[:, None]
    rows, offs = tail.nonzero(as_tuple=True)
    if v4:
        junk = perm[total:]
        slots = torch.cat([(junk[:, None] * ps + torch.arange(ps)[None, :]).reshape(-1), last[rows] * ps + offs])
        write_ds_v4(kv, slots.to(device), torch.full((slots.numel(), D), float("nan"), device=device))
    else:
        nan = _encode(torch.full((D,), float("nan"), device=device), kv_format, kv_scale).view(torch.uint8)
        raw = kv.view(torch.uint8)
        raw[perm[total:].to(device)] = nan
        if rows.numel():
            raw[last[rows].to(device), offs.to(device)] = nan

    indices = None
    if cfg.topk:
        maxlen = max(1, int(lens.max()))
        scores = torch.rand(B, cfg.q_len, maxlen, generator=cpu)
        scores[torch.arange(maxlen)[None, None, :].expand(B, cfg.q_len, -1) >= lens[:, None, None]] = -1.0
        k = min(cfg.topk, maxlen)
        top, tok = scores.topk(k, dim=-1)
        slot = torch.gather(block_table, 1, (tok // ps).view(B, -1)).view_as(tok) * ps + tok % ps
        skip = (top < 0) | (torch.rand(tok.shape, generator=cpu) < 0.1)  # past L_b, or ~10% skipped
        slot = torch.where(skip, -1, slot)
        indices = torch.full((B, cfg.q_len, cfg.topk), -1, dtype=torch.int64)
        indices[..., :k] = slot
        indices = indices.to(torch.int32).to(device)

    q = (torch.randn(B, cfg.q_len, cfg.num_heads_q, D, generator=gen, device=device) / 10).clamp(-1, 1).to(dtype)
    return DecodeCase(q=q, kv_cache=kv, block_table=block_table.to(torch.int32).to(device),
                      cache_seqlens=lens.to(torch.int32).to(device), kv_format=kv_format, kv_scale=kv_scale,
                      indices=indices, causal=cfg.causal, head_dim_v=cfg.head_dim_v, softmax_scale=D**-0.5)


def case_lengths(cfg: BenchConfig, generator: torch.Generator) -> torch.Tensor:
    """int64 ``[batch]`` cache lengths of ``cfg``: fixed, or ``max(N(L, L/2), s_q)`` drawn from ``generator``
    (a CPU generator seeded like :func:`make_bench_case`'s, which draws them first)."""
    if cfg.varlen:
        lens = torch.normal(float(cfg.seqlen), cfg.seqlen / 2, (cfg.batch,), generator=generator)
        return lens.round().clamp_min(cfg.q_len).to(torch.int64)
    return torch.full((cfg.batch,), cfg.seqlen, dtype=torch.int64)


def _encode(vals: torch.Tensor, kv_format: str, kv_scale) -> torch.Tensor:
    if kv_format == "fp8_e4m3":
        return quantize_fp8_e4m3(vals, kv_scale)
    if kv_format == "fp8_ds_mla":
        return pack_ds_mla(vals)
    return vals.to(torch.bfloat16 if kv_format == "bf16" else torch.float16)


def case_problem(case: DecodeCase, *, cuda_graph: bool = False) -> DecodeProblem:
    """The :class:`DecodeProblem` of a generated case (what backends decide feasibility on)."""
    return describe_inputs(case.q, case.kv_cache, case.block_table, case.cache_seqlens, head_dim_v=case.head_dim_v,
                           causal=case.causal, kv_format=case.kv_format, kv_scale=case.kv_scale,
                           indices=case.indices, return_lse=True, cuda_graph=cuda_graph)


# -- one backend on one config ----------------------------------------------------------------------


@dataclasses.dataclass
class BenchRow:
    """One (config, backend) result. Times in µs; None where not measured.

    ``status``: ``ok`` (checked, then timed), ``wrong`` (failed the correctness
    gate: not timed), ``error`` (raised), ``unsupported`` (the backend's reasons,
    or why a forced option does not take the config, in ``note``).
    """

    config: str
    backend: str
    version: str
    status: str
    note: str = ""
    us_run: float | None = None
    us_call: float | None = None
    us_graph: float | None = None
    flops: float = 0.0
    bytes: float = 0.0
    roofline_us: float = 0.0
    max_abs_err: float | None = None
    cos_diff: float | None = None
    host_plan_us: float | None = None  # plan_decode, wall clock + device sync
    host_run_us: float | None = None   # DecodePlan.run, wall clock + device sync
    host_call_us: float | None = None  # one-shot mla_decode, wall clock + device sync
    x_flashmla: float | None = None    # us_graph (else us_call) over FlashMLA's own, same config
    chosen: str | None = None          # the backend "auto" chose (auto's rows only)
    x_fa3: float | None = None         # the same over FlashAttention-3's own
    # auto's rows of a --check-auto run: auto and the fastest correct backend timed again in alternation
    # (:func:`pair_auto`), each the median of ``paired_rounds`` rounds
    paired_with: str | None = None
    paired_us: float | None = None       # auto's
    paired_with_us: float | None = None  # paired_with's
    paired_rounds: int | None = None
    paired_metric: str | None = None     # "graph" or "run": which times were paired

    @property
    def best_us(self) -> float | None:
        times = [t for t in (self.us_run, self.us_graph) if t is not None]
        return min(times) if times else None

    def tflops(self, us: float | None) -> float | None:
        return None if not us else self.flops / us * 1e-6

    def gbps(self, us: float | None) -> float | None:
        return None if not us else self.bytes / us * 1e-3

    def roof_pct(self, us: float | None) -> float | None:
        return None if not us else 100.0 * self.roofline_us / us

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(tflops_run=self.tflops(self.us_run), gbps_run=self.gbps(self.us_run),
                 roof_pct_run=self.roof_pct(self.us_run), roof_pct_call=self.roof_pct(self.us_call),
                 roof_pct_graph=self.roof_pct(self.us_graph))
        return d


def _check(out, lse, ref, tol):
    return compare_outputs(out, lse, ref[0], ref[1], tol)


#: What ``bench`` times per (config, backend): the eager ``DecodePlan.run``, the whole ``mla_decode``, the host
#: wall clocks of plan / run / call, and the CUDA-graph replay (module docstring).
TIMINGS = frozenset({"run", "call", "host", "graph"})


def bench_backend(name: str, case: DecodeCase, ref: tuple[torch.Tensor, torch.Tensor], row: BenchRow, *,
                  graphs: bool = True, rep_ms: float = 100.0, timings: frozenset[str] = TIMINGS,
                  timed: dict[str, Callable[[], object]] | None = None) -> BenchRow:
    """Check, then time, backend ``name`` (or ``"auto"``) on ``case``; fills and returns ``row``. ``name`` may carry
    options (``name:key=value:...``, :func:`~mla_dispatch.tools.args.backend_spec`): ``batch_invariant=true`` plans
    with ``batch_invariant=True``, the others go to ``backend_options``. ``timings``: which of :data:`TIMINGS` to
    measure (``run`` is measured too where ``graph`` is asked for and no graph can be timed). ``timed``: where given,
    ``timed[row.backend]`` is set to what the row's main time measured (the graph replay, else the eager run), kept
    alive for :func:`pair_auto`."""
    device = case.q.device
    name, options = backend_spec(name)
    invariant = bool(options.pop("batch_invariant", False))
    plan_kw = dict(case.kwargs(), backend=name, backend_options=options or None, batch_invariant=invariant)
    problem = dataclasses.replace(case_problem(case), batch_invariant=invariant)
    if name == "auto":
        try:
            cls = select_backend(problem, platform_for(device))
        except NoBackendError as exc:
            row.status, row.note = "unsupported", str(exc).splitlines()[0]
            return row
        row.note, row.chosen = f"chose {cls.NAME}", cls.NAME
    else:
        cls = get_backend(name)
        reasons = cls.not_supported_reasons(problem, platform_for(device))
        if reasons:
            row.status, row.note = "unsupported", "; ".join(map(str, reasons))
            return row
    run_kw = dict(kv_scale=case.kv_scale, indices=case.indices)
    try:
        plan = plan_decode(*case.args(), **plan_kw)
        out = torch.empty(ref[0].shape, dtype=case.q.dtype, device=device)
        lse = torch.empty(ref[1].shape, dtype=torch.float32, device=device)
        plan.run(case.q, case.kv_cache, **run_kw, out=out, lse=lse)
        report = _check(out, lse, ref, cls.TOLERANCE)
    except OptionNotSupported as exc:  # a forced option that does not take this config (the plan says why)
        row.status, row.note = "unsupported", str(exc).splitlines()[0][:300]
        return row
    except Exception as exc:  # a crashing backend is a result, not the end of the run
        row.status, row.note = "error", f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        return row
    row.max_abs_err, row.cos_diff = report.max_abs, report.cos_diff
    if not report:
        row.status, row.note = "wrong", (row.note + ": " if row.note else "") + report.message
        return row
    graph = graphs and "graph" in timings and device.type == "cuda" and cls.CUDA_GRAPH is CGSupport.ALWAYS
    def run():
        return plan.run(case.q, case.kv_cache, **run_kw, out=out, lse=lse)

    if "run" in timings or not graph:
        row.us_run = time_fn(run, device, rep_ms=rep_ms) * 1e6
        if timed is not None:
            timed[row.backend] = run
    if "call" in timings:
        row.us_call = time_fn(lambda: mla_decode(*case.args(), **plan_kw, out=out), device,
                              rep_ms=rep_ms) * 1e6
    row.status = "ok"
    if device.type == "cuda" and "host" in timings:
        row.host_plan_us = host_us(lambda: plan_decode(*case.args(), **plan_kw), device)
        row.host_run_us = host_us(lambda: plan.run(case.q, case.kv_cache, **run_kw, out=out, lse=lse), device)
        row.host_call_us = host_us(lambda: mla_decode(*case.args(), **plan_kw, out=out), device)
    if graph:
        replay = _bench_graph(plan_kw, case, ref, row, rep_ms)
        if replay is not None and timed is not None:
            timed[row.backend] = replay
        if replay is None and row.status == "ok" and row.us_run is None:
            # no graph could be captured (a plan that declines cuda_graph=True for this problem, as the flashmla
            # backend does for sparse decode on FlashMLA's current interface): the eager run stands in, so a table
            # tuned on graph times still weighs the backend for the callers that run eagerly
            row.us_run = time_fn(run, device, rep_ms=rep_ms) * 1e6
            if timed is not None:
                timed[row.backend] = run
    return row


def _bench_graph(plan_kw: dict, case: DecodeCase, ref, row: BenchRow, rep_ms: float) -> Callable[[], None] | None:
    """Capture ``plan.run`` into a CUDA graph, check one replay, time replays; returns the replay (holding the plan
    whose buffers the graph reads), or None where the capture failed or its replay was wrong.

    The captured call allocates its outputs (in the graph's pool, at capture), as FlashMLA's own call is captured
    and timed (:mod:`mla_dispatch.tools.peers`): a backend that writes into given buffers pays nothing for it, one
    whose vendor allocates its own outputs pays no copy."""
    run_kw = dict(kv_scale=case.kv_scale, indices=case.indices)
    try:
        plan = plan_decode(*case.args(), **plan_kw, cuda_graph=True)
        cls = get_backend(plan.backend)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                plan.run(case.q, case.kv_cache, **run_kw)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, lse = plan.run(case.q, case.kv_cache, **run_kw)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        report = _check(out, lse, ref, cls.TOLERANCE)
    except Exception as exc:
        row.note = f"graph capture failed: {type(exc).__name__}: {exc}".splitlines()[0][:300]
        return None
    if not report:
        row.status, row.note = "wrong", f"CUDA-graph replay: {report.message}"
        return None
    row.us_graph = time_fn(graph.replay, case.q.device, rep_ms=rep_ms) * 1e6

    def replay():
        graph.replay()
        return plan, out, lse  # the graph reads the plan's buffers and writes these: they live as long as it

    return replay


def alternate_times(fns: Sequence[Callable[[], object]], device: torch.device, *, rounds: int, rep_ms: float
                    ) -> list[float]:
    """Median µs of each of ``fns`` over ``rounds`` rounds, each round timing every one once (:func:`time_fn`), in
    an order reversed every other round: drift of the clocks or of the memory's temperature over the run falls on all
    alike, where one measurement of each, seconds apart, can differ by more than the check's tolerance."""
    samples: list[list[float]] = [[] for _ in fns]
    for r in range(rounds):
        order = range(len(fns)) if r % 2 == 0 else reversed(range(len(fns)))
        for i in order:
            samples[i].append(time_fn(fns[i], device, rep_ms=rep_ms) * 1e6)
    return [statistics.median(s) for s in samples]


def pair_auto(rows: Sequence[BenchRow], timed: dict[str, Callable[[], object]], device: torch.device, *,
              rounds: int, rep_ms: float) -> None:
    """On one config's ``rows``: time ``auto`` and the fastest correct backend (the one
    :func:`~mla_dispatch.tools.autocheck.check_auto` compares it with: by graph replay where any row has one, else by
    eager run) again, in alternation (:func:`alternate_times`), and record both on auto's row, with the metric. Nothing
    where auto was not timed by that metric, or that backend not at all."""
    from mla_dispatch.tools.autocheck import fastest_candidate, rows_metric

    auto = next((r for r in rows if r.backend == "auto" and r.status == "ok"), None)
    metric = rows_metric(rows)
    if auto is None or "auto" not in timed or (metric == "graph" and not auto.us_graph):
        return
    best = fastest_candidate(rows, metric)
    if best is None or best.backend not in timed:
        return
    auto.paired_us, auto.paired_with_us = alternate_times([timed["auto"], timed[best.backend]], device, rounds=rounds,
                                                          rep_ms=rep_ms)
    auto.paired_with, auto.paired_rounds, auto.paired_metric = best.backend, rounds, metric


# -- the run ------------------------------------------------------------------------------------------


def default_backends(device: torch.device) -> list[str]:
    """Registered backends available in this process; ``reference`` only on a CPU (it is the oracle)."""
    names = []
    for name in registered_names():
        if name in _NOT_BY_DEFAULT or (name == "reference" and device.type != "cpu"):
            continue
        if not get_backend(name).availability_reasons():
            names.append(name)
    if device.type != "cpu" and len(names) > 1:
        names.insert(0, "auto")  # what the library would choose, beside each candidate
    return names


def unavailable_backends() -> dict[str, str]:
    """Registered backends that cannot run anywhere in this process, with why."""
    out = {}
    for name in registered_names():
        reasons = get_backend(name).availability_reasons()
        if reasons:
            out[name] = "; ".join(map(str, reasons))
    return out


def environment(device: torch.device, backends: Sequence[str] | None = None) -> dict:
    """Device, date, software versions: the header of every published number.

    Versions are those of ``backends`` (default: every available one; asking
    imports, and for JIT-built kernels builds, each backend).
    """
    from mla_dispatch.version import __version__

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({os.cpu_count()} cores, "
                  f"{host_platform.processor() or host_platform.machine()})",
        "platform": platform_for(device).describe(),
        "mla_dispatch": __version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": host_platform.python_version(),
        "timer": timer_name(device),
        "fingerprint": fingerprint(platform_for(device)),
    }
    try:
        import importlib.metadata as md

        env["triton"] = md.version("triton")
    except Exception:
        env["triton"] = None
    if backends is None:
        backends = [n for n in registered_names() if not get_backend(n).availability_reasons()]
    names = dict.fromkeys(backend_spec(n)[0] for n in backends)
    env["backends"] = {n: get_backend(n).version() for n in names if n != "auto"}
    return env


def work_of(case: DecodeCase, cfg: BenchConfig):
    """FLOPs and bytes of one call on ``case`` (docs/design.md §6)."""
    return decode_work(batch=cfg.batch, q_len=cfg.q_len, num_heads_q=cfg.num_heads_q, num_heads_kv=cfg.num_heads_kv,
                       head_dim_qk=cfg.head_dim_qk, head_dim_v=cfg.head_dim_v,
                       total_kv_tokens=int(case.cache_seqlens.sum()), kv_format=case.kv_format,
                       q_elem_bytes=case.q.element_size(), topk=cfg.topk)


def run_bench(configs: Sequence[BenchConfig], backends: Sequence[str], *, device: torch.device,
              dtype: torch.dtype = torch.bfloat16, ceilings: Ceilings | None = None, graphs: bool = True,
              rep_ms: float = 100.0, seed: int = 0, progress: bool = True, timings: frozenset[str] = TIMINGS,
              peer: bool = True, budget_s: float | None = None, desc: str = "bench", pair_rounds: int = 0
              ) -> tuple[list[BenchRow], Ceilings]:
    """Benchmark ``backends`` on ``configs``; measures the ceilings first unless given.

    ``timings``: what to time (:data:`TIMINGS`); ``peer``: time FlashMLA itself beside them where installed.
    ``pair_rounds``: where > 0 and ``auto`` is among ``backends``, auto and the fastest correct backend of each config
    are timed again in alternation, that many rounds (:func:`pair_auto`; what ``--check-auto`` judges by).
    ``budget_s``: seconds from the call after which no further config is started (the ceilings count; a config is
    measured whole or not at all, so the rows hold only the configs that fit, in order); the progress bar shows the
    time spent against it.
    """
    from tqdm import tqdm

    from mla_dispatch.numerics.oracle import reference_attention

    start = time.monotonic()
    ceilings = ceilings or measure_ceilings(device)
    peers = [(PEER_FLASHMLA, flashmla_peer_available(), flashmla_runs, time_flashmla),
             (PEER_FA3, fa3_peer_available(), fa3_runs, time_fa3)] if device.type == "cuda" and peer else []
    rows: list[BenchRow] = []
    pairing = bool(pair_rounds) and "auto" in backends  # keep plans and graphs alive past their rows only then
    bar = tqdm(total=len(configs) * len(backends), desc=desc, unit="run", disable=not progress, leave=False,
               file=sys.stderr)
    for i, cfg in enumerate(configs):
        spent = time.monotonic() - start
        if budget_s is not None and spent >= budget_s:
            logger.info("mla_dispatch: %s stopped after %.0f s (budget %.0f s): %d of %d configs measured", desc,
                        spent, budget_s, i, len(configs))
            break
        bar.set_postfix_str(cfg.label + (f", {spent:.0f}/{budget_s:g} s" if budget_s is not None else ""))
        case = make_bench_case(cfg, dtype=dtype, device=device, seed=seed + i)
        ref = reference_attention(case.q, case.kv_cache, case.block_table, case.cache_seqlens,
                                  head_dim_v=case.head_dim_v, softmax_scale=case.softmax_scale, causal=case.causal,
                                  kv_format=case.kv_format, kv_scale=case.kv_scale, indices=case.indices)
        work = work_of(case, cfg)
        roof_us = work.roofline_seconds(ceilings) * 1e6
        config_rows = []
        timed: dict[str, Callable[[], object]] = {}
        for name in backends:
            version = "" if name == "auto" else get_backend(backend_spec(name)[0]).version()
            row = BenchRow(cfg.label, name, version, "?", flops=work.flops, bytes=work.bytes, roofline_us=roof_us)
            config_rows.append(bench_backend(name, case, ref, row, graphs=graphs, rep_ms=rep_ms, timings=timings,
                                             timed=timed if pairing else None))
            bar.update(1)
        if pairing:
            pair_auto(config_rows, timed, device, rounds=pair_rounds, rep_ms=rep_ms)
            timed.clear()
        for peer_name, peer_version, runs, time_peer in peers:
            if peer_version and runs(case):
                peer = BenchRow(cfg.label, peer_name, peer_version, "?", flops=work.flops, bytes=work.bytes,
                                roofline_us=roof_us)
                for key, value in time_peer(case, ref, time_fn, rep_ms=rep_ms).items():
                    setattr(peer, key, value)
                config_rows.append(peer)
        _ratios_to_peers(config_rows)
        rows.extend(config_rows)
        del case, ref
        if device.type == "cuda":
            torch.cuda.empty_cache()
    bar.close()
    return rows, ceilings


def _ratios_to_peers(rows: list[BenchRow]) -> None:
    """Each row's time over FlashMLA's (``x_flashmla``) and FA3's (``x_fa3``) on the same config: CUDA-graph replay
    where both have one, else the whole eager call."""
    for peer_name, field in ((PEER_FLASHMLA, "x_flashmla"), (PEER_FA3, "x_fa3")):
        peer = next((r for r in rows if r.backend == peer_name and r.status == "ok"), None)
        if peer is None:
            continue
        for r in rows:
            if r.status != "ok":
                continue
            if r.us_graph and peer.us_graph:
                setattr(r, field, r.us_graph / peer.us_graph)
            elif r.us_call and peer.us_call:
                setattr(r, field, r.us_call / peer.us_call)


# -- output ---------------------------------------------------------------------------------------------


def _f(x: float | None, fmt: str) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def format_table(rows: Iterable[BenchRow]) -> str:
    """Markdown table: one row per (config, backend); unsupported ones say why."""
    head = ("| config | backend | status | run µs | call µs | graph µs | × FlashMLA | × FA3 | TFLOP/s | GB/s "
            "| % roofline (run / graph) | host plan / run / call µs |\n"
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for r in rows:
        if r.status == "ok":
            pct = _f(r.roof_pct(r.us_run), ".1f") + (f" / {r.roof_pct(r.us_graph):.1f}" if r.us_graph else "")
            status = "ok" + (f" ({r.note})" if r.note else "")
            host = " / ".join(_f(x, ".0f") or "-" for x in (r.host_plan_us, r.host_run_us, r.host_call_us))
            lines.append(f"| {r.config} | {r.backend} | {status} | {_f(r.us_run, '.1f')} | {_f(r.us_call, '.1f')} | "
                         f"{_f(r.us_graph, '.1f')} | {_f(r.x_flashmla, '.3f')} | {_f(r.x_fa3, '.3f')} | "
                         f"{_f(r.tflops(r.us_run), '.3g')} | "
                         f"{_f(r.gbps(r.us_run), '.4g')} | {pct} | {host} |")
        else:
            note = r.note.replace("|", "/")
            lines.append(f"| {r.config} | {r.backend} | {r.status}: {note} | | | | | | | | | |")
    return "\n".join(lines)


def format_header(env: dict, ceilings: Ceilings, command: str) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in (("mla_dispatch", env["mla_dispatch"]), ("torch", env["torch"]),
                                                 ("CUDA", env["cuda"]), ("triton", env["triton"])) if v)
    backends = ", ".join(f"{k}@{v}" for k, v in env["backends"].items())
    return (f"- device: {env['device']}; date: {env['date']}\n- versions: {versions}; backends: {backends}\n"
            f"- ceilings (measured in this run): {ceilings.describe()}\n- command: `{command}`")


def write_json(path: Path, rows: Sequence[BenchRow], env: dict, ceilings: Ceilings, meta: dict) -> None:
    doc = {"environment": env, "ceilings": dataclasses.asdict(ceilings), **meta, "rows": [r.as_dict() for r in rows]}
    path.write_text(json.dumps(doc, indent=1, default=str))


def write_csv(path: Path, rows: Sequence[BenchRow]) -> None:
    dicts = [r.as_dict() for r in rows]
    fields = list(dicts[0]) if dicts else list(BenchRow.__dataclass_fields__)
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields)
        w.writeheader()
        w.writerows(dicts)


def write_plot(path: Path, rows: Sequence[BenchRow], title: str) -> None:
    """Grouped bars: % of roofline (eager ``run``) per config, one bar per backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys(r.config for r in rows))
    backends = list(dict.fromkeys(r.backend for r in rows if r.us_run))  # those that ran somewhere
    pct = {(r.config, r.backend): (r.roof_pct(r.us_run) or 0.0) for r in rows}
    width = 0.8 / max(1, len(backends))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(configs) * max(1, len(backends)) ** 0.5 + 2), 4.5))
    for j, name in enumerate(backends):
        xs = [i + (j - (len(backends) - 1) / 2) * width for i in range(len(configs))]
        ax.bar(xs, [pct.get((c, name), 0.0) for c in configs], width, label=name)
    ax.set_xticks(range(len(configs)))
    ax.set_xticklabels(configs, rotation=35, ha="right", fontsize=7)
    ax.set_ylabel("% of roofline (eager run; 0 = not run)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- CLI ------------------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    grids = "\n".join(f"  {name:<9} {desc}" for name, (desc, _) in GRIDS.items())
    p = CommandParser(prog="python -m mla_dispatch bench", description=__doc__.split("\n\n")[0],
                      epilog=f"grids:\n{grids}", formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grid", default="quick", help="grid name(s), comma-separated (default: quick, the one sized for a "
                                                   "CPU; the others are sized for a GPU)")
    p.add_argument("--backends", default=None,
                   help="comma-separated names (default: every backend whose library imports here, amla_emulation "
                        "aside; on a GPU, 'auto' beside them where more than one does; the reference, the oracle, "
                        "only on a CPU, where triton runs only under TRITON_INTERPRET=1 with --dtype fp16 and no CUDA-"
                        "graph or FlashMLA times are taken); a name may carry options, name:key=value:... "
                        "(batch_invariant=true, or the backend's backend_options, e.g. cuda_sm90:variant=2)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16", help="q (and dense cache) dtype")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--out", default="bench_out", help="directory for bench-<grid>.json/.csv/.png (default: bench_out)")
    p.add_argument("--plot", action="store_true", help="also write a PNG of %% of roofline per config")
    p.add_argument("--no-graph", action="store_true", help="skip CUDA-graph replay timing")
    p.add_argument("--times", default=None, metavar="LIST",
                   help=f"what to time, comma-separated, of {','.join(sorted(TIMINGS))} (default: all; eager run is "
                        f"timed too for a backend without a CUDA graph)")
    p.add_argument("--rep-ms", type=positive_float, default=100.0,
                   help="timing budget per measurement (do_bench rep)")
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument("--check-auto", type=nonnegative_float, default=None, metavar="TOL",
                   help="after the run, set auto's time on each config against the fastest correct backend's and "
                        "exit 1 if any is over by more than TOL (0.03 = 3%%); adds auto to the backends, and times "
                        "auto and the fastest backend of each config again in alternation (--pair-rounds)")
    p.add_argument("--pair-rounds", type=positive_int, default=5, metavar="N",
                   help="with --check-auto: rounds of the alternating timing of auto and the fastest backend, whose "
                        "medians the check compares (default: 5)")
    p.add_argument("--from-json", action="append", default=None, metavar="BENCH_JSON",
                   help="with --check-auto: check a saved run (bench-<grids>.json) instead of running; repeat it to "
                        "check several")
    p.add_argument("--only", default=None, metavar="TEXT",
                   help="run only the configs whose label contains one of these comma-separated texts (e.g. "
                        "'causal' or 'b1-,b8-'; --list shows the labels)")
    p.add_argument("--list", action="store_true", help="print the grid's configs and exit")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def only_configs(configs: Sequence[BenchConfig], text: str | None) -> list[BenchConfig]:
    """The configs whose label contains one of the comma-separated ``text`` (all of them for None). Raises
    UsageError for an empty filter or one that matches nothing."""
    if text is None:
        return list(configs)
    parts = comma_items(text)
    if not parts:
        raise UsageError(f"argument --only: expected comma-separated texts of config labels, got {text!r}")
    kept = [c for c in configs if any(t in c.label for t in parts)]
    if not kept:
        raise UsageError(f"argument --only: {text!r} matches none of the {len(configs)} configs (see --list)")
    return kept


def grid_names(text: str, option: str = "--grid") -> list[str]:
    """Comma-separated grid names, each checked against :data:`GRIDS`. Raises UsageError otherwise."""
    names = comma_items(text)
    if not names:
        raise UsageError(f"argument {option}: expected comma-separated grid names ({', '.join(GRIDS)}), got {text!r}")
    for name in names:
        if name not in GRIDS:
            raise UsageError(f"argument {option}: unknown grid {name!r} (choose from: {', '.join(GRIDS)})")
    return names


def nothing_can_run(backends: Sequence[str]) -> str | None:
    """Why none of ``backends`` can run anything in this process (each one's availability reasons), else None."""
    reasons = {n: get_backend(backend_spec(n)[0]).availability_reasons() for n in backends if n != "auto"}
    if all(reasons.values()):
        return "; ".join(f"{n} ({'; '.join(map(str, r))})" for n, r in reasons.items())
    return None


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        return _run(args, argv)
    except UsageError as exc:
        return usage_error(p.prog, exc)


def _check_auto(rows, tolerance: float) -> int:
    """Print the auto check of ``rows`` (:mod:`mla_dispatch.tools.autocheck`); 1 if it fails, else 0."""
    from mla_dispatch.tools.autocheck import check_auto, format_check

    results, metric = check_auto(rows, tolerance)
    print("\n" + format_check(results, tolerance, metric))
    failed = [r for r in results if r.failed]
    if failed or not results:
        print(f"auto check failed on {len(failed)} of {len(results)} configs" if results else
              "auto check: no rows to check", file=sys.stderr)
        return 1
    return 0


def _run(args: argparse.Namespace, argv: list[str] | None) -> int:
    if args.from_json:
        if args.check_auto is None:
            raise UsageError("argument --from-json: only with --check-auto (it checks a saved run)")
        from mla_dispatch.tools.autocheck import load_rows

        rows = []
        for path in args.from_json:
            try:
                rows += load_rows(Path(path))
            except (OSError, ValueError) as exc:
                raise UsageError(f"argument --from-json: {exc}") from None
        return _check_auto(rows, args.check_auto)
    grids = grid_names(args.grid)
    configs = only_configs([c for g in grids for c in grid_configs(g)], args.only)
    if args.list:
        print("\n".join(c.label for c in configs))
        return 0
    device = parse_device(args.device)
    timings = TIMINGS
    if args.times is not None:
        timings = frozenset(comma_items(args.times))
        if not timings or not timings <= TIMINGS:
            raise UsageError(f"argument --times: expected comma-separated names of {', '.join(sorted(TIMINGS))}, "
                             f"got {args.times!r}")
    chosen = backend_names(args.backends, also=("auto",), specs=True)
    backends = chosen or default_backends(device)
    if args.check_auto is not None and "auto" not in backends:
        backends = ["auto", *backends]
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise UsageError("argument --plot: needs matplotlib, which is not installed (pip install matplotlib)")
    out_dir = writable_dir(args.out, "--out")
    why = nothing_can_run(backends) if backends else "no registered backend is available here"
    if why:
        print(f"nothing to run: {why}", file=sys.stderr)
        return 1
    given = argv if argv is not None else sys.argv[1:]
    command = "python -m mla_dispatch bench " + " ".join(shlex.quote(a) for a in given)
    env = environment(device, backends)
    rows, ceilings = run_bench(configs, backends, device=device, dtype=_DTYPES[args.dtype], graphs=not args.no_graph,
                               rep_ms=args.rep_ms, seed=args.seed, progress=not args.quiet, timings=timings,
                               pair_rounds=args.pair_rounds if args.check_auto is not None else 0)
    print(f"## bench {'+'.join(grids)} ({args.dtype})\n")
    print(format_header(env, ceilings, command.strip()))
    skipped = {} if chosen else {n: r for n, r in unavailable_backends().items() if n not in backends}
    if skipped:
        print("- not available here: " + "; ".join(f"{n} ({r})" for n, r in skipped.items()))
    print()
    print(format_table(rows))
    stem = out_dir / f"bench-{'_'.join(grids)}"
    meta = {"grids": grids, "dtype": args.dtype, "seed": args.seed, "command": command.strip(),
            "configs": {c.label: dataclasses.asdict(c) for c in configs}}
    write_json(stem.with_suffix(".json"), rows, env, ceilings, meta)
    write_csv(stem.with_suffix(".csv"), rows)
    written = [stem.with_suffix(".json"), stem.with_suffix(".csv")]
    if args.plot:
        write_plot(stem.with_suffix(".png"), rows, f"{'+'.join(grids)} on {env['device']} ({env['date']})")
        written.append(stem.with_suffix(".png"))
    print("\nwrote: " + ", ".join(map(str, written)))
    status = 0
    bad = [r for r in rows if r.status in ("wrong", "error")]
    if bad:
        print(f"{len(bad)} result(s) failed the correctness gate or raised: "
              + ", ".join(f"{r.backend} on {r.config}" for r in bad), file=sys.stderr)
        status = 1
    elif not any(r.status == "ok" for r in rows):
        print(f"nothing ran: every backend ({', '.join(backends)}) declined every config; their reasons are in the "
              f"table", file=sys.stderr)
        status = 1
    if args.check_auto is not None:
        status = _check_auto(rows, args.check_auto) or status
    return status
