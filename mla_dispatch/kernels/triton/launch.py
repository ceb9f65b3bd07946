"""The Triton backend's launch, decided once per plan: which kernel runs it and everything about the launch.

A plan of the ``triton`` backend freezes a :class:`TritonLaunch` (STYLE.md 19, as ``cuda_sm90``'s ``Sm90Launch``):
the kernel family (:data:`KERNELS`: the plain kernel with gathered tiles or with whole tiles by TMA, the Gluon sm_90
kernel, its seesaw schedule for 16-bit pages of whole tiles, the tokens-on-M kernel for small fp8_e4m3 problems),
its tile config, and what a call whose tensors that kernel cannot take runs instead. TMA and the Gluon kernels need
q and the cache contiguous with 16-byte aligned bases, which only a call can tell: a call that meets those runs
the plan's kernel, one whose q does not runs ``kv_only`` (the plain kernel, the cache still by TMA where the config
allows, ``tma_kv``), one whose cache does not runs the gathered plain kernel. All three are decided here, at plan time; a run
checks the layout of its tensors and launches, nothing else (no config table, no environment).

:func:`prepare` binds a launch to a plan's buffers: one :class:`~mla_dispatch.metadata.triton_launch.CachedLaunch`
per kernel (decode, and the combine of split rows), so an eager run costs the per-call arguments and Triton's C
launcher. TMA descriptors over a cache are kept per cache (a layer's cache is the same tensor every step); those over
q are made per call (q is a new tensor each layer).

``backend_options={"kernel": ...}`` (:data:`KERNELS`) picks the family instead of the plan's choice (experiments and
tests; the former ``MLA_TRITON_SEESAW=0`` is ``kernel="gluon"`` on 16-bit pages, ``MLA_TRITON_FP8T=0`` is
``kernel="gluon"`` for fp8_e4m3); a family that cannot run the problem is an error at plan time.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from mla_dispatch.kernels.triton.decode import (CONFIGS, EXTRA_CACHE_ARGS, GLUON_CONFIG, SMALL_PAGE_CONFIGS,
                                                TMA_CONFIGS, KernelConfig, _clip_splits, _rows_bucket, choose_config,
                                                decode_kernel_call, decode_kernel_fixed, mla_decode_kernel,
                                                tma_descriptors, tma_fits)
from mla_dispatch.metadata.triton_launch import CachedLaunch

__all__ = ["KERNELS", "TritonLaunch", "choose_launch", "kernel_reasons", "prepare", "PreparedLaunch"]

#: The kernel families a plan can pick (``backend_options={"kernel": ...}``).
KERNELS = ("gather", "tma", "gluon", "seesaw", "fp8t")
_GLUON_FAMILY = ("gluon", "seesaw", "fp8t")
#: Most caches a launch keeps TMA descriptors for (a model's layers); past it the kept ones are dropped.
_MAX_KEPT_DESCRIPTORS = 256


@dataclasses.dataclass(frozen=True)
class TritonLaunch:
    """The launch a triton plan froze (see the module docstring)."""

    #: the family a call with q and the cache contiguous and 16-byte aligned runs (:data:`KERNELS`)
    kernel: str
    cfg: KernelConfig
    #: the config's V split and latent-dot chunk, as clipped to D_v
    v_split: int
    qk_chunk: int
    #: the plain kernel's query tiles by TMA too (``kernel == "tma"``)
    q_tma: bool
    #: what a call whose q is not contiguous or aligned (the cache is) runs: "tma_kv" (the plain kernel, the cache by
    #: TMA, q gathered) or "gather"
    kv_only: str

    @property
    def needs_layout(self) -> bool:
        """Whether a call's q and cache layout decide between this launch and its fallbacks."""
        return self.kernel != "gather"


def _rows(p) -> int:
    group = p.num_heads_q // p.num_heads_kv
    return group if p.sparse else p.q_len * group


def _gluon_reasons(p, platform) -> list[str]:
    """What the Gluon kernels need that a plan of ``p`` on ``platform`` lacks (see gluon_sm90.gluon_applies)."""
    from mla_dispatch.kernels.triton.gluon_sm90 import GLUON_API, GLUON_KV_FORMATS

    out = []
    if not GLUON_API:
        out.append("Gluon is not importable from this Triton")
    if platform is None or platform.kind != "cuda" or platform.capability != (9, 0):
        out.append("an NVIDIA GPU of compute capability 9.0 (sm_90)")
    if p.sparse:
        out.append(f"sparse indices (topk={p.topk}; supported: dense)")
    if p.kv_format not in GLUON_KV_FORMATS:
        out.append(f"kv_format={p.kv_format!r} (supported: {', '.join(GLUON_KV_FORMATS)})")
    if p.num_heads_kv != 1:
        out.append(f"h_kv={p.num_heads_kv} (supported: 1)")
    if (p.head_dim_qk, p.head_dim_v) != (576, 512):
        out.append(f"D_qk/D_v={p.head_dim_qk}/{p.head_dim_v} (supported: 576/512)")
    if p.batch * p.q_len * p.num_heads_q >= 2**31:
        out.append("2^31 or more query rows")
    return out


def _tma_reasons(p, platform, cfg: KernelConfig) -> list[str]:
    """What the plain kernel's TMA path needs (decode.tma_applies' plan-time half)."""
    v_split, qk_chunk = _clip_splits(cfg.v_split, cfg.qk_chunk, p.head_dim_v)
    out = []
    if not cfg.tma:
        out.append("a config with TMA tiles")
    if not tma_fits(kv_format=p.kv_format, sparse=p.sparse, page_size=p.page_size, heads_kv=p.num_heads_kv,
                    block_n=cfg.block_n, v_split=v_split, qk_chunk=qk_chunk, head_dim_v=p.head_dim_v):
        out.append("a bf16/fp16 cache, dense, one KV head, pages of whole tiles and the K tile reused as V")
    if platform is not None and platform.kind != "cpu" and not (platform.kind == "cuda" and platform.capability
                                                                 is not None and platform.capability >= (9, 0)):
        out.append("an NVIDIA GPU with TMA (compute capability 9.0 or newer), or Triton's interpreter")
    return out


def kernel_reasons(kernel: str, p, platform) -> list[str]:
    """What family ``kernel`` needs that a plan of ``p`` on ``platform`` lacks (empty: it can run it)."""
    if kernel == "gather":
        return []
    if kernel == "tma":
        cfg = TMA_CONFIGS.get((_rows_bucket(_rows(p)), p.kv_format))
        return _tma_reasons(p, platform, cfg) if cfg is not None else [
            f"kv_format={p.kv_format!r} (supported: bf16, fp16)"]
    out = _gluon_reasons(p, platform)
    if kernel == "fp8t":
        from mla_dispatch.kernels.triton.gluon_fp8 import MAX_ROWS

        if p.kv_format != "fp8_e4m3":
            out.append(f"kv_format={p.kv_format!r} (supported: fp8_e4m3)")
        if p.q_len * p.num_heads_q > MAX_ROWS:
            out.append(f"{p.q_len * p.num_heads_q} query rows (s_q * h_q; supported: <= {MAX_ROWS})")
    if kernel == "seesaw":
        if p.kv_format not in ("bf16", "fp16"):
            out.append(f"kv_format={p.kv_format!r} (supported: bf16, fp16)")
        if p.page_size % 64:
            out.append(f"page_size={p.page_size} (supported: multiples of 64)")
    return out


def _config_for(kernel: str | None, p, platform) -> KernelConfig:
    """The tile config of a plan: the table's (decode.choose_config) or, for a forced family, the one it runs."""
    rows = _rows(p)
    if kernel is None or kernel == "fp8t":
        gluon = not _gluon_reasons(p, platform)
        return choose_config(rows, p.kv_format, page_size=None if p.sparse else p.page_size, gluon=gluon,
                             heads_kv=p.num_heads_kv, interpret=platform is not None and platform.kind == "cpu",
                             fp8t=kernel is None or kernel == "fp8t")
    if kernel in _GLUON_FAMILY:
        return GLUON_CONFIG
    key = (_rows_bucket(rows), p.kv_format)
    if kernel == "tma":
        return TMA_CONFIGS[key]
    if platform is not None and platform.kind == "cpu":
        return choose_config(rows, p.kv_format, interpret=True)
    small = not p.sparse and p.page_size < 64 and key in SMALL_PAGE_CONFIGS
    return dataclasses.replace(SMALL_PAGE_CONFIGS[key] if small else CONFIGS[key], tma=False, gluon=False)


def choose_launch(p, platform, cfg: KernelConfig | None = None, kernel: str | None = None) -> TritonLaunch:
    """The launch of a plan of problem ``p`` on ``platform``: the family the config leads to (the Gluon config: the
    tokens-on-M kernel for fp8_e4m3 with at most 32 query rows, the seesaw kernel on 16-bit pages of whole tiles, else
    gluon_sm90; a TMA config the plain kernel's TMA path; else gathered tiles), or ``kernel`` where given.

    ``cfg`` a config of the caller's (tests, benchmarks), else the table's (:func:`_config_for`). A forced ``kernel``
    must be one that can run ``p`` (:func:`kernel_reasons` empty): the backend refuses the others first, with their
    reasons (backends/triton.py, _shape_plan).

    Raises
    ------
    ValueError
        ``kernel`` is not one of :data:`KERNELS`.
    """
    if kernel is not None and kernel not in KERNELS:
        raise ValueError(f"backend_options['kernel']={kernel!r} (supported: {', '.join(KERNELS)})")
    cfg = cfg or _config_for(kernel, p, platform)
    v_split, qk_chunk = _clip_splits(cfg.v_split, cfg.qk_chunk, p.head_dim_v)
    tma_ok = not _tma_reasons(p, platform, cfg)
    family = "gather"
    if kernel == "gather":
        pass
    elif cfg.gluon and cfg.block_m == 64 and not cfg.tokens_on_m and not _gluon_reasons(p, platform):
        from mla_dispatch.kernels.triton.gluon_fp8 import MAX_ROWS

        family = "gluon"
        if kernel != "gluon" and p.kv_format == "fp8_e4m3" and p.q_len * p.num_heads_q <= MAX_ROWS:
            family = "fp8t"  # fp8_e4m3, <= 32 rows: tokens on M, a converting warpgroup
        elif kernel != "gluon" and p.kv_format in ("bf16", "fp16") and p.page_size % 64 == 0:
            family = "seesaw"  # 16-bit caches on pages of whole tiles: two tiles in flight, one per warpgroup
    elif tma_ok:
        family = "tma"
    if kernel is not None and family != kernel:
        raise ValueError(f"backend_options['kernel']={kernel!r} does not go with the config {cfg}")
    kv_only = "tma_kv" if tma_ok and family != "gather" else "gather"
    return TritonLaunch(family, cfg, v_split, qk_chunk, q_tma=family == "tma", kv_only=kv_only)


# ----------------------------------------------------------------------------------------
# the launch bound to a plan's buffers
# ----------------------------------------------------------------------------------------


class _KeptDescriptors:
    """TMA descriptors over caches, kept per cache tensor (its address, blocks and block stride): the layers' caches
    are the same tensors every step. Keeping one keeps its cache alive, which the model does anyway."""

    __slots__ = ("make", "kept")

    def __init__(self, make: Callable):
        self.make, self.kept = make, {}

    def __call__(self, kv):
        key = (kv.data_ptr(), kv.shape[0], kv.stride(0), kv.dtype)
        pair = self.kept.get(key)
        if pair is None:
            if len(self.kept) >= _MAX_KEPT_DESCRIPTORS:
                self.kept.clear()
            pair = self.kept[key] = self.make(kv)
        return pair


class PreparedLaunch:
    """A :class:`TritonLaunch` bound to one plan's buffers: ``launch(q, kv, kv_scale, indices, out, lse)`` runs the
    decode (and the combine of split rows) on the current stream; no allocation, no host synchronisation. Each of the
    launch's kernels is bound to the buffers on its first call (which of them a call runs is the launch's, decided at
    plan time). ``kind`` says which ran last (for tests and profiles). A sparse plan made with DeepSeek-V4's optional
    arguments takes them per call as ``extras``: ``(topk_length, attn_sink, extra_kv_cache, extra_indices,
    extra_topk_length)``, those the plan was made without None (the plan's ``HAS_*`` constexprs say which are read)."""

    __slots__ = ("launch", "page_size", "kind", "_bind", "_runs")

    def __init__(self, launch: TritonLaunch, bind: Callable[[str], Callable], page_size: int):
        self.launch, self._bind, self.page_size, self.kind, self._runs = launch, bind, page_size, None, {}

    def __call__(self, q, kv, kv_scale, indices, out, lse, extras=None) -> None:
        kind = self.launch.kernel
        if self.launch.needs_layout:
            if not (kv.is_contiguous() and kv.data_ptr() % 16 == 0 and kv.shape[0] * self.page_size < 2**31):
                kind = "gather"
            elif not (q.is_contiguous() and q.data_ptr() % 16 == 0):
                kind = self.launch.kv_only
        self.kind = kind
        run = self._runs.get(kind)
        if run is None:
            run = self._runs[kind] = self._bind(kind)
        run(q, kv, kv_scale, indices, out, lse, extras)


def prepare(launch: TritonLaunch, p, *, block_table, seqlens, schedule, first_slot, partial_out, partial_lse,
            softmax_scale: float, device: torch.device) -> PreparedLaunch:
    """Bind ``launch`` to a plan of problem ``p``: its table (None when sparse), lengths, schedule, first slots and
    partial buffers. Each kernel the launch may run (its own and its fallbacks) is bound on its first call (and
    compiles then, unless an earlier plan compiled it). Which of the optional sparse arguments a call gives
    (``p.topk_length``, ``p.attn_sink``, ``p.extra_topk``, ``p.extra_topk_length``) is the plan's: their ``HAS_*``
    constexprs are fixed here, the tensors are per-call arguments."""
    from mla_dispatch.kernels.triton.combine import combine_call, combine_fixed, combine_kernel
    from triton.runtime.jit import JITFunction

    device_index = device.index if device.type == "cuda" else None
    if device.type == "cuda" and device_index is None:
        device_index = torch.cuda.current_device()
    combines: list = []  # [the combine's launch, or None: nothing to merge], bound with the first kernel
    has_sink = p.attn_sink  # the sink scales a split request's merged rows (the decode scales the others)

    def combine(out, lse, attn_sink) -> None:
        if not combines:
            prepared = combine_fixed(partial_out, partial_lse, schedule.num_splits, first_slot, schedule.items,
                                     schedule.part_offsets, batch=p.batch, q_len=p.q_len, h_q=p.num_heads_q,
                                     d_v=p.head_dim_v, v_split=launch.v_split, fixed_splits=schedule.fixed_splits,
                                     has_sink=has_sink)
            combines.append(None if prepared is None else CachedLaunch(
                combine_kernel, prepared[0], prepared[1], ("Out", "Lse", "stride_ob", "stride_os", "stride_oh",
                                                          "stride_lb", "stride_lh", "stride_ls")
                + (("AttnSink",) if has_sink else ()), prepared[2], device_index))
        if combines[0] is not None:
            combines[0].call(combine_call(out, lse, attn_sink))

    plan_side = dict(block_table=block_table, seqlens=seqlens, items=schedule.items, part_offsets=schedule.part_offsets,
                     partial_out=partial_out, partial_lse=partial_lse, softmax_scale=softmax_scale, causal=p.causal)
    fp8_scale = p.kv_format == "fp8_e4m3"
    cfg = launch.cfg
    # the optional sparse arguments a call of this plan gives (DeepSeek-V4's), by kernel parameter
    sparse_names = (["TopkLength"] if p.topk_length else []) + (["AttnSink"] if p.attn_sink else [])
    if p.extra_topk:
        sparse_names += [*EXTRA_CACHE_ARGS, *(["ExtraTopkLength"] if p.extra_topk_length else [])]

    def plain(tma: bool, q_tma: bool) -> Callable:
        grid, fixed, options = decode_kernel_fixed(
            batch=p.batch, q_len=p.q_len, h_q=p.num_heads_q, d_qk=p.head_dim_qk, page_size=p.page_size,
            h_kv=p.num_heads_kv, head_dim_v=p.head_dim_v, kv_format=p.kv_format, sparse=p.sparse,
            block_m=cfg.block_m, block_n=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            tokens_on_m=cfg.tokens_on_m, v_split=launch.v_split, qk_chunk=launch.qk_chunk,
            max_registers=cfg.max_registers if isinstance(mla_decode_kernel, JITFunction) else 0, tma=tma,
            q_tma=q_tma, device_is_cuda=device.type == "cuda", topk=p.topk, has_topk_length=p.topk_length,
            has_sink=p.attn_sink, extra_page_size=p.extra_page_size if p.extra_topk else 0,
            has_extra_topk_length=p.extra_topk_length, **plan_side)
        names = ["Q", "KV", "Out", "Lse", "stride_qb", "stride_qs", "stride_qh", "stride_kb", "stride_kt", "stride_kh",
                 "stride_ob", "stride_os", "stride_oh", "stride_lb", "stride_lh", "stride_ls", "num_blocks"]
        names += ["Indices", "stride_ib", "stride_is"] if p.sparse else []
        names += ["KVScale"] if fp8_scale else []
        names += ["KDesc", "RDesc"] if tma else []
        names += ["QDesc", "QRDesc"] if q_tma else []
        names += sparse_names
        for name in names:
            fixed.pop(name, None)
        decode = CachedLaunch(mla_decode_kernel, grid, fixed, names, options, device_index)
        descriptors = _KeptDescriptors(lambda kv: tma_descriptors(kv, p.head_dim_v, cfg.block_n)) if tma else None

        def run(q, kv, kv_scale, indices, out, lse, extras):
            if kv.dtype == torch.int8:  # fp8_ds_mla caches may come as int8 (FlashMLA's convention)
                kv = kv.view(torch.uint8)
            topk_length = attn_sink = extra_kv = extra_indices = extra_topk_length = None
            if extras is not None:
                topk_length, attn_sink, extra_kv, extra_indices, extra_topk_length = extras
                if extra_kv is not None and extra_kv.dtype == torch.int8:
                    extra_kv = extra_kv.view(torch.uint8)
            decode.call(decode_kernel_call(q, kv, kv_scale, indices, out, lse, tma=tma, q_tma=q_tma,
                                           head_dim_v=p.head_dim_v, block_m=cfg.block_m, block_n=cfg.block_n,
                                           kv_descriptors=descriptors, kv_format=p.kv_format,
                                           topk_length=topk_length, attn_sink=attn_sink, extra_kv=extra_kv,
                                           extra_indices=extra_indices, extra_topk_length=extra_topk_length))
            combine(out, lse, attn_sink)

        return run

    def gluon_family(kernel: str) -> Callable:
        if kernel == "fp8t":
            from mla_dispatch.kernels.triton.gluon_fp8 import fp8t_call, fp8t_fixed, mla_decode_fp8t_kernel

            grid, fixed, options = fp8t_fixed(batch=p.batch, q_len=p.q_len, h_q=p.num_heads_q, page_size=p.page_size,
                                              **plan_side)
            make_call, kernel_fn = (lambda q, kv, kv_scale, out, lse: fp8t_call(q, kv, kv_scale, out, lse)), \
                mla_decode_fp8t_kernel
        elif kernel == "seesaw":
            from mla_dispatch.kernels.triton.gluon_seesaw import (mla_decode_seesaw_kernel, seesaw_call,
                                                                  seesaw_descriptors, seesaw_fixed)

            grid, fixed, options = seesaw_fixed(q_len=p.q_len, h_q=p.num_heads_q, page_size=p.page_size, **plan_side)
            kept = _KeptDescriptors(seesaw_descriptors)
            make_call, kernel_fn = (lambda q, kv, kv_scale, out, lse: seesaw_call(q, kv, out, lse,
                                                                                  kv_descriptors=kept)), \
                mla_decode_seesaw_kernel
        else:
            from mla_dispatch.kernels.triton.gluon_sm90 import (BLOCK_N, _descriptors, gluon_call, gluon_fixed,
                                                                mla_decode_sm90_kernel)

            fp8 = p.kv_format == "fp8_e4m3"
            grid, fixed, options = gluon_fixed(q_len=p.q_len, h_q=p.num_heads_q, d_qk=p.head_dim_qk,
                                               page_size=p.page_size, head_dim_v=p.head_dim_v, fp8=fp8, **plan_side)
            kept = _KeptDescriptors(lambda kv: _descriptors(kv, kv.shape[0] * kv.shape[1], BLOCK_N, p.head_dim_v))
            make_call, kernel_fn = (lambda q, kv, kv_scale, out, lse: gluon_call(q, kv, kv_scale, out, lse, fp8=fp8,
                                                                                 kv_descriptors=kept)), \
                mla_decode_sm90_kernel
        decode: list = []  # made on the first call, from the names that call gives

        def run(q, kv, kv_scale, indices, out, lse, extras):  # dense only (_gluon_reasons): no sparse extras
            values = make_call(q, kv, kv_scale, out, lse)
            if not decode:
                decode.append(CachedLaunch(kernel_fn, grid, {k: v for k, v in fixed.items() if k not in values},
                                           tuple(values), options, device_index))
            decode[0].call(values)
            combine(out, lse, None)

        return run

    def bind(kind: str) -> Callable:
        if kind == "gather":
            return plain(False, False)
        if kind == "tma":
            return plain(True, launch.q_tma)
        if kind == "tma_kv":
            return plain(True, False)
        return gluon_family(kind)

    return PreparedLaunch(launch, bind, p.page_size)
