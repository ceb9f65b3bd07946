"""The Triton backend: our portable split-KV paged MLA decode kernel.

Runs wherever Triton runs: NVIDIA SM80+ and AMD ROCm GPUs (auto-selected from
the platform priority table), and the CPU through Triton's interpreter. On a CPU
it is never auto-selected (the CPU row of the priority table lists only the
reference); ``backend="triton"`` on a CPU runs only when ``TRITON_INTERPRET=1``
was set in the environment *before* Triton was first imported (Triton reads it
at import), which is how the CPU tests use it. The interpreter is slow and, with
some triton/torch versions, computes ``tl.dot`` on bf16 operands wrongly, so the
backend declines bf16 queries there (a ``dtype`` reason): use fp16.

Per decode step :meth:`TritonBackend.plan` makes the shared split-KV plan
(:class:`mla_dispatch.metadata.split_plan.SplitKVPlan`: the schedule, its first slots, the plan's copy of the
lengths, the workspace of partial rows) and freezes its launch (``kernels/triton/launch.py``, ``TritonLaunch``: the
kernel family, its config and the fallbacks for calls whose q or cache layout the kernel cannot take, decided once,
``backend_options={"kernel": ...}`` to override), bound to the plan's buffers. An eager
:meth:`TritonBackend.run` launches that (decode and combine, each a kept compiled kernel:
``metadata/triton_launch.py``), and a dense one over a 16-bit cache goes through :meth:`TritonBackend.bind`'s fast
path, which replays those launches as one CUDA graph where the call's tensors repeat (``metadata/launch_graphs.py``;
``backend_options={"launch_graphs": False}`` turns that off); a traced one (torch.compile, fake tensors) calls the
registered op ``torch.ops.mla_dispatch.triton_decode`` (``kernels/triton/ops.py``). Neither allocates nor syncs, so
a run can be captured in a CUDA graph. Kernels compile on the first run: run once before capturing. After capture,
change the values of ``cache_seqlens`` / ``block_table`` and call ``DecodePlan.update`` (which recomputes the schedule
in place) before replaying.
"""

from __future__ import annotations

import functools
import os

import torch

from types import MappingProxyType

from mla_dispatch.dispatch.backend import (ArchSupport, BackendOption, BackendState, CGSupport, MLABackend,
                                           OptionNotSupported, Reason, ReasonCode)
from mla_dispatch.metadata.schedule import BATCH_INVARIANT_SPLIT_TOKENS, SPLIT_TOKENS_CHOICES, check_invariant_workspace
from mla_dispatch.kernels.cuda.schedule import loaded_native_schedule
from mla_dispatch.metadata.split_plan import SplitKVLayout, SplitKVPlan
from mla_dispatch.dispatch.platform import Platform
from mla_dispatch.dispatch.problem import DecodeProblem

from ._vendor import dist_version

__all__ = ["TritonBackend"]

_SCHEDULE_OVERHEAD_TOKENS = 320  # fixed cost of a work item, in tokens (FlashMLA: 5 blocks of 64)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=256)
def _shape_plan(p: DecodeProblem, platform: Platform, config, kernel: str | None, num_parts: int | None,
                overhead: int | None, split_tokens: int | None):
    """What a plan decides from shapes alone, once per (problem, platform, choices): the frozen launch
    (:func:`~mla_dispatch.kernels.triton.launch.choose_launch`) and the split-KV layout (:func:`_split_layout`).

    Raises
    ------
    OptionNotSupported
        A forced ``kernel`` that cannot run ``p`` (a ValueError; the message says what it needs).
    """
    from mla_dispatch.kernels.triton.launch import choose_launch, kernel_reasons

    if kernel is not None and (reasons := kernel_reasons(kernel, p, platform)):
        raise OptionNotSupported(f"backend_options['kernel']={kernel!r} cannot run this problem: it needs "
                                 + "; ".join(reasons))
    launch = choose_launch(p, platform, config, kernel)
    return launch, _split_layout(p, platform.num_compute_units, launch.cfg, num_parts, overhead, split_tokens)


@functools.lru_cache(maxsize=256)
def _split_layout(p: DecodeProblem, compute_units: int, cfg, num_parts: int | None, overhead: int | None,
                  split_tokens: int | None) -> SplitKVLayout:
    """The split-KV layout of a plan of ``p`` under ``cfg`` (shapes only, once per problem): one persistent program
    per compute unit and tile (times the config's ``programs_per_sm``) unless ``num_parts`` says otherwise.

    Raises
    ------
    ValueError
        ``split_tokens`` given without ``p.batch_invariant``, or not a positive multiple of the kernel's chunk; a
        batch-invariant workspace past its bound.
    """
    from mla_dispatch.kernels.triton.decode import num_m_tiles, programs_per_tile

    group = p.num_heads_q // p.num_heads_kv
    rows = group if p.sparse else p.q_len * group
    tiles = p.num_heads_kv * num_m_tiles(rows, cfg) * programs_per_tile(cfg, p.head_dim_v) * (p.q_len if p.sparse
                                                                                              else 1)
    if num_parts is None:
        num_parts = max(1, cfg.programs_per_sm * compute_units // tiles)
    # sparse: the "tokens" of a request are its top-k list positions, then its extra list's; dense: no item reaches
    # past a block-table row, whatever cache_seqlens holds
    positions = p.topk + p.extra_topk
    capacity = None if p.sparse else p.max_blocks * p.page_size
    if overhead is None:
        overhead = max(1, _SCHEDULE_OVERHEAD_TOKENS // cfg.chunk_size)
    if split_tokens is not None and not p.batch_invariant:
        raise ValueError(f"backend_options['split_tokens']={split_tokens} applies to batch_invariant=True plans "
                         "only")
    if p.batch_invariant:
        split_tokens = BATCH_INVARIANT_SPLIT_TOKENS if split_tokens is None else split_tokens
        if not (isinstance(split_tokens, int) and split_tokens > 0 and split_tokens % cfg.chunk_size == 0):
            raise ValueError(f"backend_options['split_tokens'] must be a positive multiple of the kernel's chunk "
                             f"({cfg.chunk_size} tokens), got {split_tokens!r}")
        capacity = positions if p.sparse else capacity
        # a partial row per query row of a piece: 2 D_v fp16 (PARTIAL_ROW_FORMAT) and the LSE
        check_invariant_workspace(p.batch, capacity, split_tokens, p.q_len * p.num_heads_q * (p.head_dim_v * 4 + 4))
    # split rows: fp16 values and their scales (kernels/triton/combine.py, PARTIAL_ROW_FORMAT)
    return SplitKVLayout(batch=p.batch, num_parts=num_parts, chunk_size=cfg.chunk_size, overhead=overhead,
                         capacity=capacity, partial_row=(p.q_len, p.num_heads_q, 2 * p.head_dim_v),
                         partial_dtype=torch.float16, split_tokens=split_tokens,
                         fixed_length=positions if p.sparse else None)


class TritonBackend(MLABackend):
    """Split-KV paged MLA decode in Triton (``kernels/triton/decode.py``)."""

    NAME = "triton"
    DESCRIPTION = "Triton split-KV paged MLA decode (NVIDIA SM80+, ROCm; CPU via TRITON_INTERPRET=1)"
    PLATFORMS = frozenset({"cuda", "rocm", "cpu"})
    MIN_CAPABILITY = (8, 0)
    Q_DTYPES = frozenset({torch.bfloat16, torch.float16})
    KV_FORMATS = frozenset({"bf16", "fp16", "fp8_e4m3", "fp8_ds_mla", "fp8_ds_v4"})
    # D_v must be a power of two (a tile width); the RoPE part D_qk - D_v is 0 or 64.
    HEAD_DIMS = frozenset({(576, 512), (512, 512), (320, 256), (192, 128)})
    # dense decoding's largest page (the pages the GPU tests run); sparse decoding takes any page size (its kernel turns
    # each index into a block and an offset: FlashMLA's DeepSeek-V4 tests use pages of 576 tokens)
    MAX_PAGE_SIZE = 256
    MAX_HEADS_Q = 128
    MAX_Q_LEN = 16
    SUPPORTS_CAUSAL = True
    SUPPORTS_LSE = True
    SUPPORTS_SPARSE = True
    SPARSE_EXTRAS = frozenset({"topk_length", "attn_sink", "extra_kv_cache", "extra_topk_length"})
    # the kernel config depends on the rows per KV head, the cache and the page size, never on the batch; a batch-
    # invariant plan cuts requests at fixed token counts and merges per request (metadata/schedule.py)
    SUPPORTS_BATCH_INVARIANT = True
    CUDA_GRAPH = CGSupport.ALWAYS
    KEEPS_LENGTHS = True  # the split-KV plan's own copy (metadata/split_plan.py), written by its schedule launch
    ANY_OUT_STRIDES = False  # the kernels store rows of out with stride 1
    ARCH_SUPPORT = (
        ArchSupport("cuda", "NVIDIA SM80+", kinds=frozenset({"cuda"}), notes="our Triton kernel (Gluon kernels on SM90)",
                    run_here="yes: H100, H200 (Ampere and Blackwell not run)"),
        ArchSupport("rocm", "AMD ROCm", kinds=frozenset({"rocm"}), notes="our Triton kernel", run_here="no: not run"),
        ArchSupport("cpu", "CPU (Triton's interpreter)", kinds=frozenset({"cpu"}),
                    limits={"Q_DTYPES": frozenset({torch.float16}), "CUDA_GRAPH": CGSupport.NEVER},
                    sources={"Q_DTYPES": "under TRITON_INTERPRET=1, Triton's interpreter computes tl.dot on bf16 "
                                         "operands wrongly (triton 3.9, torch 2.13)"},
                    notes="TRITON_INTERPRET=1 set before triton is imported; slow: for trying and testing the kernel",
                    run_here="yes: CPU"),
    )
    REQUIRES = ("triton",)
    OPTIONS = MappingProxyType({
        "split_tokens": BackendOption(SPLIT_TOKENS_CHOICES, "tokens per piece of a batch_invariant=True plan (a multiple of the "
                                      f"kernel's chunk; default {BATCH_INVARIANT_SPLIT_TOKENS})"),
        "kernel": BackendOption(("gather", "tma", "gluon", "seesaw", "fp8t"), "the kernel family, instead of the plan's "
                                "choice (kernels/triton/launch.py): the plain kernel with gathered tiles or TMA tiles, "
                                "the Gluon sm_90 kernel, its seesaw schedule (16-bit pages of whole tiles), the "
                                "tokens-on-M fp8_e4m3 kernel; it must suit the problem"),
        "launch_graphs": BackendOption((True, False), "replay an eager run's launches as a CUDA graph where its tensors "
                                       "repeat (True, the default: metadata/launch_graphs.py), or launch through "
                                       "Triton's launcher every time (False)"),
    })

    @classmethod
    def version(cls) -> str:
        # never imports triton: info and explain list this backend where triton is not installed (its import failure
        # is the availability reason, from REQUIRES)
        ver = dist_version("triton", "triton")
        return ver if ver == "not installed" else f"triton{ver}"

    @classmethod
    def extra_reasons(cls, problem: DecodeProblem, platform: Platform) -> list[Reason]:
        reasons = []
        if platform.kind == "cpu" and not _interpreting():
            reasons.append(Reason(ReasonCode.DEVICE, "platform=cpu needs TRITON_INTERPRET=1 set before triton is "
                                                     "imported (Triton's interpreter; for tests)"))
        if problem.kv_format == "fp8_ds_v4" and not problem.sparse:
            reasons.append(Reason(ReasonCode.FEATURE, "kv_format=fp8_ds_v4 with dense decoding (supported: sparse "
                                                      "indices, as DeepSeek-V4 decodes)"))
        if _interpreting() and problem.q_dtype == torch.bfloat16 and platform.kind != "cpu":  # cpu: ARCH_SUPPORT
            # the interpreter's tl.dot on bf16 operands returns values ~1e8 off (triton 3.9, torch 2.13)
            reasons.append(Reason(ReasonCode.DTYPE, "q dtype=bfloat16 under TRITON_INTERPRET=1 (supported there: "
                                                    "float16; Triton's interpreter computes bf16 tl.dot wrongly)"))
        return reasons

    # -- plan / update -----------------------------------------------------------------

    @classmethod
    def plan(cls, problem: DecodeProblem, platform: Platform, block_table, cache_seqlens, *,
             softmax_scale: float, options: dict[str, object]) -> BackendState:
        return cls.make_state(problem, platform, cache_seqlens, split_tokens=options.get("split_tokens"),
                              kernel=options.get("kernel"), block_table=block_table, softmax_scale=softmax_scale,
                              launch_graphs=options.get("launch_graphs", True))

    @classmethod
    def make_state(cls, problem: DecodeProblem, platform: Platform, cache_seqlens, *, config=None,
                   num_parts: int | None = None, overhead: int | None = None, split_tokens: int | None = None,
                   kernel: str | None = None, block_table=None, softmax_scale: float | None = None,
                   launch_graphs: bool = False) -> BackendState:
        """:meth:`plan` with its choices exposed (tests force splits; the benchmark compares configs).

        ``config`` a :class:`~mla_dispatch.kernels.triton.decode.KernelConfig` (default: the
        table's); ``num_parts`` persistent programs along the schedule (default: one
        per SM and tile, times the config's ``programs_per_sm``); ``overhead`` the
        schedule's fixed cost per item, in chunks; ``split_tokens`` the piece size of a batch-invariant plan;
        ``kernel`` the kernel family (:data:`~mla_dispatch.kernels.triton.launch.KERNELS`, default: the plan's
        choice). ``block_table`` and ``softmax_scale`` bind the plan's eager launch (without them, a state for
        :meth:`run`'s registered op only: tests that call the op themselves); ``launch_graphs``: :meth:`bind`'s fast
        path replays that launch as CUDA graphs where its tensors repeat (:mod:`~mla_dispatch.metadata.launch_graphs`;
        :meth:`plan` defaults it to True).

        Raises
        ------
        ValueError
            ``split_tokens`` given without ``problem.batch_invariant``, or not a positive multiple of the kernel's
            chunk; a ``kernel`` that cannot run the problem or does not go with ``config``.
        """
        import mla_dispatch.kernels.triton.ops  # noqa: F401  (registers torch.ops.mla_dispatch.triton_decode)
        from mla_dispatch.kernels.triton.launch import prepare

        p = problem
        device = torch.device(p.device_type, torch.cuda.current_device()) if p.device_type == "cuda" else torch.device(
            p.device_type)
        if cache_seqlens is not None:
            device = cache_seqlens.device
        launch, layout = _shape_plan(p, platform, config, kernel, num_parts, overhead, split_tokens)
        # the schedule: the SM90 extension's launch where it is loaded already, else one Triton launch
        native = loaded_native_schedule(platform.capability) if platform.kind == "cuda" else None
        split = SplitKVPlan(layout, None if p.sparse else cache_seqlens, device, native=native)
        prepared = None
        if softmax_scale is not None:
            prepared = prepare(launch, p, block_table=None if p.sparse else block_table, seqlens=split.lengths,
                               schedule=split.schedule, first_slot=split.first_slot, partial_out=split.partial_out,
                               partial_lse=split.partial_lse, softmax_scale=softmax_scale, device=device)
        return BackendState(op=torch.ops.mla_dispatch.triton_decode.default, cfg=launch.cfg, launch=launch,
                            prepared=prepared, launch_graphs=launch_graphs, split=split, schedule=split.schedule,
                            lengths=split.lengths,
                            first_slot=split.first_slot, partial_out=split.partial_out, partial_lse=split.partial_lse)

    @classmethod
    def bind(cls, state: BackendState, problem: DecodeProblem, kv_dtype: torch.dtype, block_table, cache_seqlens, *,
             softmax_scale: float):
        """Dense eager calls over a 16-bit cache on a GPU: the plan's frozen launch with no further checks than
        :func:`~mla_dispatch.dispatch.backend.dense_call_matcher`'s and contiguous ``out`` / ``lse``, replayed as a
        CUDA graph where its tensors repeat (``launch_graphs``; :class:`~mla_dispatch.metadata.launch_graphs.
        LaunchGraphs`). Anything else (fp8 caches, strided outputs, the interpreter) takes the checked path."""
        from mla_dispatch.dispatch.backend import dense_call_matcher
        from mla_dispatch.metadata.launch_graphs import LaunchGraphs

        prepared = state.prepared
        device = cache_seqlens.device if cache_seqlens is not None else None
        if prepared is None or problem.sparse or device is None or device.type != "cuda":
            return None
        p = problem
        matches = dense_call_matcher(p, kv_dtype)
        out_shape, lse_shape = (p.batch, p.q_len, p.num_heads_q, p.head_dim_v), (p.batch, p.num_heads_q, p.q_len)
        graphs = state.graphs = LaunchGraphs(device.index) if state.launch_graphs else None

        def fast(q, kv, kv_scale, out, lse):
            if not matches(q, kv, kv_scale, out, lse) or q.device != device:
                return None
            if out is None:
                out = torch.empty(out_shape, dtype=q.dtype, device=device)
            elif not out.is_contiguous():
                return None  # the checked path: its overlap check, then the same launch
            if lse is None:
                lse = torch.empty(lse_shape, dtype=torch.float32, device=device)
            elif not lse.is_contiguous():
                return None
            if graphs is None:
                prepared(q, kv, None, None, out, lse)
            else:
                # everything the launch reads from its arguments: addresses, the cache's blocks and strides, q's
                # strides (out and lse are contiguous, of the planned shapes)
                graphs((q.data_ptr(), q.stride(), kv.data_ptr(), kv.shape[0], kv.stride(), out.data_ptr(),
                        lse.data_ptr()), lambda: prepared(q, kv, None, None, out, lse))
            return out, lse

        return fast

    @classmethod
    def update(cls, state: BackendState, block_table, cache_seqlens) -> None:
        state.split.update(cache_seqlens)  # (sparse: nothing, the schedule depends on topk only)

    # -- run ---------------------------------------------------------------------------

    @classmethod
    def run(cls, state: BackendState, q, kv_cache, block_table, cache_seqlens, *, problem: DecodeProblem,
            softmax_scale, kv_scale, indices, out, lse, topk_length=None, attn_sink=None, extra_kv_cache=None,
            extra_indices=None, extra_topk_length=None) -> None:
        from mla_dispatch.kernels.triton.ops import traced_call

        p = problem
        # DeepSeek-V4's optional sparse arguments, those the plan was made with (DecodePlan.run checks them)
        extras = (topk_length, attn_sink, extra_kv_cache, extra_indices, extra_topk_length) if p.sparse_extras else ()
        prepared = state.prepared
        if prepared is not None and not traced_call(q, kv_cache, out, lse, kv_scale, indices, *extras):
            # the launch the plan froze (kernels/triton/launch.py)
            prepared(q, kv_cache, kv_scale, indices, out, lse, extras or None)
            return
        # traced (torch.compile, fake tensors, functionalization, tensor subclasses): the registered op, whose
        # wrap_triton launch of the plain kernel the trace records
        s, cfg = state.schedule, state.cfg
        state.op(q, kv_cache, None if p.sparse else block_table, state.lengths, indices, kv_scale, s.items,
                 s.part_offsets, s.num_splits, state.first_slot, out, lse, state.partial_out, state.partial_lse,
                 softmax_scale, p.causal, p.kv_format, cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages,
                 cfg.tokens_on_m, cfg.v_split, cfg.qk_chunk, cfg.max_registers, cfg.tma, cfg.gluon, s.fixed_splits,
                 *extras)
