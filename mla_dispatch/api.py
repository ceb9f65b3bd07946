"""The public front end: :func:`mla_decode`, :func:`plan_decode` and :class:`DecodePlan`."""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType

import torch

from mla_dispatch.dispatch.backend import BackendState, MLABackend, untraced_eager
from mla_dispatch.kvcache.cache import PagedMLACache
from mla_dispatch.kvcache.formats import token_bytes
from mla_dispatch.dispatch.platform import Platform, platform_for
from mla_dispatch.dispatch.problem import DecodeProblem, check_values, default_softmax_scale, describe_inputs
from mla_dispatch.dispatch.registry import get_backend
from mla_dispatch.dispatch.select import auto_candidates, select_backend

# whether a torch.profiler / autograd profile is on (~60 ns); a private torch function, so absent means "no"
_profiler_enabled = getattr(torch._C._autograd, "_profiler_enabled", lambda: False)

__all__ = ["mla_decode", "plan_decode", "DecodePlan", "auto_candidates"]


def _unwrap_cache(kv_cache, kv_format, kv_scale):
    """A PagedMLACache contributes its tensor, format and scale."""
    if isinstance(kv_cache, PagedMLACache):
        if kv_format == "auto":
            kv_format = kv_cache.kv_format
        if kv_scale is None and kv_cache.kv_format == "fp8_e4m3":
            kv_scale = kv_cache.kv_scale
        return kv_cache.kv, kv_format, kv_scale
    return kv_cache, kv_format, kv_scale


def _check_positive_finite(name: str, value) -> float:
    value = float(value)
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite positive float, got {value!r}")
    return value


def _as_scale_tensor(kv_scale, device) -> torch.Tensor | None:
    # A tensor's value is not checked (reading it would synchronise with the device); the kernels fold the
    # scale into the softmax scale and take maxima of unscaled scores, so it must be positive.
    if kv_scale is None or isinstance(kv_scale, torch.Tensor):
        return kv_scale
    return torch.tensor([_check_positive_finite("kv_scale", kv_scale)], dtype=torch.float32, device=device)


def _overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two indices of ``t`` may address one element (an ``expand``-ed tensor, a stride of 0): a kernel's
    stores to it would race and keep one request's value. Sufficient test, no device work: sorted by stride, every
    dimension must step past all the smaller ones reach (a rare layout that interleaves without sharing is refused
    too)."""
    if t.is_contiguous():
        return False
    reach = 0
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


_NO_OPTIONS = MappingProxyType({})

#: float kv_scales a plan keeps as device tensors (one per layer's scale, typically); past this many it stops adding
_MAX_CACHED_SCALES = 1024


class DecodePlan:
    """A decode step planned once and run once per layer.

    Built by :func:`plan_decode`. Holds the chosen backend, the frozen
    :class:`~mla_dispatch.dispatch.problem.DecodeProblem` it was planned for, and the
    backend's per-step state (split-KV schedule, workspace). :meth:`run` checks
    each call against the plan with cheap shape comparisons, does no host sync,
    and, for backends that declare CUDA-graph support, no allocation when
    ``out`` and ``lse`` are given: it can be captured in a CUDA graph. Where
    the backend binds an eager fast path (:meth:`MLABackend.bind
    <mla_dispatch.dispatch.backend.MLABackend.bind>`; ``cuda_sm90`` does), an eager
    call on plain tensors is checked against the plan and launched in one
    native call, and the Python checks run only when that call declines.

    Attributes
    ----------
    backend : str
        Name of the backend that runs this plan.
    problem : DecodeProblem
        What the plan was built for.
    softmax_scale : float
    backend_options : Mapping
        The ``backend_options`` the plan was made with (read-only; empty when none were given).
    """

    __slots__ = ("backend", "problem", "platform", "softmax_scale", "backend_options", "block_table", "cache_seqlens",
                 "_cls", "_st", "_q_shape", "_kv_tail", "_kv_dtype", "_q_dtype", "_out_shape", "_lse_shape",
                 "_fp8_scale", "_sparse", "_run", "_fast", "_lse_scratch", "_scales", "_any_out_strides", "_snapshot",
                 "_lens", "_extra_tail", "_sparse_args")

    def __init__(self, backend_cls: type[MLABackend], problem: DecodeProblem, platform: Platform,
                 softmax_scale: float, block_table, cache_seqlens, state: BackendState, q_shape, kv_tail, kv_dtype,
                 backend_options: Mapping[str, object] = MappingProxyType({}), snapshot=None, extra_tail=None):
        self.backend = backend_cls.NAME
        self.problem = problem
        self.platform = platform
        self.softmax_scale = softmax_scale
        self.backend_options = MappingProxyType(dict(backend_options)) if backend_options else _NO_OPTIONS
        self.block_table = block_table
        self.cache_seqlens = cache_seqlens
        # the lengths every run computes with (docs/design.md §2, "Stale plans"): the front end's copy, or the caller's
        # tensor for a backend that keeps its own copy (KEEPS_LENGTHS)
        self._snapshot = snapshot
        self._lens = cache_seqlens if snapshot is None else snapshot
        self._cls = backend_cls
        self._st = state
        self._q_shape = q_shape
        self._kv_tail = kv_tail
        self._kv_dtype = kv_dtype
        # what run() compares each call against, computed once (run's host time is part of every layer's step)
        self._q_dtype = problem.q_dtype
        self._out_shape = (problem.batch, problem.q_len, problem.num_heads_q, problem.head_dim_v)
        self._lse_shape = (problem.batch, problem.num_heads_q, problem.q_len)
        self._fp8_scale = problem.kv_format == "fp8_e4m3"
        self._sparse = problem.sparse
        self._extra_tail = extra_tail  # the extra cache's [page_size, h_kv, last] (None: no extra cache)
        self._sparse_args = problem.sparse_extras  # the optional sparse arguments every run must pass
        self._run = backend_cls.run
        self._any_out_strides = backend_cls.ANY_OUT_STRIDES
        self._lse_scratch = None
        self._bind_fast()
        # float kv_scale -> its fp32 [1] tensor on the plan's device: made once (plan_decode's scale here, a layer's
        # own on its first run), so run() copies nothing from the host (CUDA-graph capture forbids it)
        self._scales: dict[float, torch.Tensor] = {}

    def _scale_tensor(self, kv_scale, device: torch.device) -> torch.Tensor:
        """The device tensor of a float ``kv_scale``, converted on the first call with that value only."""
        tensor = self._scales.get(kv_scale)
        if tensor is None:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise ValueError(f"kv_scale={kv_scale!r} is a float this plan has not seen before this CUDA-graph "
                                 "capture, and copying it to the GPU cannot be captured: pass a float32 [1] tensor "
                                 "on the GPU, or run the plan once with this value before capturing")
            tensor = _as_scale_tensor(kv_scale, device)
            if len(self._scales) < _MAX_CACHED_SCALES:
                self._scales[kv_scale] = tensor
        return tensor

    def __repr__(self) -> str:
        p = self.problem
        options = f", backend_options={dict(self.backend_options)}" if self.backend_options else ""
        return (f"DecodePlan(backend={self.backend!r}, q=[{p.batch}, {p.q_len}, {p.num_heads_q}, {p.head_dim_qk}], "
                f"page_size={p.page_size}, h_kv={p.num_heads_kv}, kv_format={p.kv_format!r}, causal={p.causal}, "
                f"topk={p.topk}{options})")

    def _bind_fast(self) -> None:
        """The backend's one-call eager path for the current state (MLABackend.bind), and where it writes an LSE
        nobody asked for."""
        p = self.problem
        self._fast = None if p.sparse or not p.batch else self._cls.bind(
            self._st, p, self._kv_dtype, self.block_table, self._lens, softmax_scale=self.softmax_scale)
        if self._fast is not None and not p.return_lse and self._lse_scratch is None:
            self._lse_scratch = torch.empty(self._lse_shape, dtype=torch.float32, device=self.cache_seqlens.device)

    @property
    def _state(self) -> BackendState:
        return self._st

    @_state.setter
    def _state(self, state: BackendState) -> None:
        """A new backend state (tests and benchmarks force a config this way): the eager path is bound to it again,
        so no run takes the old state's launch."""
        self._st = state
        self._bind_fast()

    @property
    def state(self) -> BackendState:
        """The backend's per-step state (schedule, workspace); for tests and adapters."""
        return self._state

    @property
    def planned_lengths(self) -> torch.Tensor | None:
        """The lengths every :meth:`run` computes with: a copy of ``cache_seqlens`` as of :func:`plan_decode` or the
        last :meth:`update` (docs/design.md §2, "Stale plans"); None for a sparse plan or one made without
        ``cache_seqlens``. A view of the plan's own buffers, like :attr:`state`'s tensors: valid while the plan lives
        (a dropped plan's buffers go to the next plan of their sizes)."""
        if self._sparse or self.cache_seqlens is None or not self.problem.batch:
            return None
        return self._snapshot if self._snapshot is not None else self._state.lengths

    def update(self, block_table: torch.Tensor | None = None, cache_seqlens: torch.Tensor | None = None) -> None:
        """Re-plan for new block-table / sequence-length *values* of the same shapes.

        Copies the new values into the tensors the plan was built with (if
        other tensors are given), takes the values ``cache_seqlens`` holds now
        as the plan's lengths and refreshes the backend's schedule in place, so
        CUDA graphs captured over :meth:`run` stay valid. Until the next
        ``update``, every run computes with these lengths, whatever the tensor
        holds later (docs/design.md §2, "Stale plans"); the block table's
        values are read by every run.

        Raises
        ------
        ValueError
            A new tensor's shape or dtype differs from the planned one.
        """
        for name, new in (("block_table", block_table), ("cache_seqlens", cache_seqlens)):
            if new is None:
                continue
            old = getattr(self, name)
            if old is None or new.shape != old.shape or new.dtype != old.dtype:
                raise ValueError(f"{name} must keep the planned shape/dtype "
                                 f"{None if old is None else (list(old.shape), old.dtype)}, got {list(new.shape)} {new.dtype}")
            if new.data_ptr() != old.data_ptr():
                old.copy_(new)
        if self._snapshot is not None:
            self._snapshot.copy_(self.cache_seqlens)
        if self.problem.batch:  # a plan for no request has no backend state (plan_decode)
            self._cls.update(self._state, self.block_table, self._lens)

    def _sparse_extras(self, topk_length, attn_sink, extra_kv_cache, extra_indices, extra_topk_length) -> dict:
        """The optional sparse arguments of one run, checked against the plan (presence, shape, dtype): the keywords
        for the backend's ``run``."""
        p = self.problem
        given = {"topk_length": topk_length, "attn_sink": attn_sink, "extra_kv_cache": extra_kv_cache,
                 "extra_indices": extra_indices, "extra_topk_length": extra_topk_length}
        planned = set(p.sparse_extras) | ({"extra_indices"} if p.extra_topk else set())
        for name, t in given.items():
            if (t is not None) != (name in planned):
                raise ValueError(f"{name} was {'not ' if t is None else ''}given, but the plan was made "
                                 f"{'with' if t is None else 'without'} it (plan with the same optional sparse "
                                 "arguments as you run)")
        extras = {name: t for name, t in given.items() if t is not None}
        for name, want in (("topk_length", (p.batch,)), ("extra_topk_length", (p.batch,))):
            t = extras.get(name)
            if t is not None and (t.shape != want or t.dtype != torch.int32):
                raise ValueError(f"{name} must be int32 {list(want)} as planned, got {list(t.shape)} {t.dtype}")
        if attn_sink is not None and (attn_sink.shape != (p.num_heads_q,) or attn_sink.dtype != torch.float32):
            raise ValueError(f"attn_sink must be float32 [{p.num_heads_q}] as planned, got {list(attn_sink.shape)} "
                             f"{attn_sink.dtype}")
        if extra_kv_cache is not None:
            extra, _, _ = _unwrap_cache(extra_kv_cache, "auto", None)
            if extra.dim() == 3:
                extra = extra.unsqueeze(2)
            if extra.shape[1:] != self._extra_tail or extra.dtype != self._kv_dtype or extra.stride(-1) != 1:
                raise ValueError(f"extra_kv_cache must be [num_blocks, {', '.join(map(str, self._extra_tail))}] "
                                 f"{self._kv_dtype}, contiguous in its last dim, as planned, got {list(extra.shape)} "
                                 f"{extra.dtype}")
            extras["extra_kv_cache"] = extra
            want = (p.batch, p.q_len, p.extra_topk)
            if extra_indices.shape != want or extra_indices.dtype != torch.int32:
                raise ValueError(f"extra_indices must be int32 {list(want)} as planned, got {list(extra_indices.shape)} "
                                 f"{extra_indices.dtype}")
        return extras

    def run(self, q: torch.Tensor, kv_cache, *, kv_scale: torch.Tensor | float | None = None,
            indices: torch.Tensor | None = None, out: torch.Tensor | None = None,
            lse: torch.Tensor | None = None, topk_length: torch.Tensor | None = None,
            attn_sink: torch.Tensor | None = None, extra_kv_cache=None, extra_indices: torch.Tensor | None = None,
            extra_topk_length: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run one layer's decode attention.

        Parameters
        ----------
        q : Tensor
            ``[B, s_q, h_q, D_qk]``, the planned shape and dtype.
        kv_cache : Tensor or PagedMLACache
            The planned geometry (page size, heads, format); any number of blocks.
        kv_scale : float or Tensor, optional
            Per-tensor fp32 scale, positive (``fp8_e4m3`` only); per layer. A float is made a device tensor
            once per value (the one given to :func:`plan_decode` at planning, any other on its first run):
            run once with each float before capturing a CUDA graph, or pass a float32 ``[1]`` device tensor.
        indices : Tensor, optional
            int32 ``[B, s_q, topk]`` sparse token ids (sparse plans only); per layer.
        out : Tensor, optional
            ``[B, s_q, h_q, D_v]`` in q's dtype, written in place. Its last dim must be contiguous
            (stride 1) unless the backend declares ``ANY_OUT_STRIDES`` (the reference does; the
            Triton and CUDA kernels do not); no two of its elements may share memory (no ``expand``).
        lse : Tensor, optional
            fp32 ``[B, h_q, s_q]``, written in place; no two of its elements may share memory.
            Without it, a plan made with ``return_lse=False`` on a backend with a fast path
            writes the LSE to a buffer of its own (no allocation per call).
        topk_length, attn_sink, extra_kv_cache, extra_indices, extra_topk_length : optional
            The optional sparse arguments of :func:`mla_decode`, per layer: exactly those the plan was made
            with, of the planned shapes.

        Returns
        -------
        (out, lse)
            ``lse`` is None when the plan was made with ``return_lse=False`` and
            no ``lse`` buffer was passed.

        Raises
        ------
        ValueError
            An argument does not match the plan, or ``out`` / ``lse`` overlaps itself.
        """
        p = self.problem
        kv, _, kv_scale = _unwrap_cache(kv_cache, "auto", kv_scale)
        if kv.dim() == 3:
            kv = kv.unsqueeze(2)
        fast = self._fast
        if fast is not None and indices is None and (kv_scale is None or isinstance(kv_scale, torch.Tensor)) \
                and untraced_eager(q):
            # One native call checks the arguments against the plan and launches (MLABackend.bind); on a mismatch
            # it does nothing and the checks below raise the error that names the argument. It skips the
            # dispatcher, so under torch.profiler it gets a range of its own (the op's name would be missing).
            lse_buf = self._lse_scratch if lse is None else lse
            if _profiler_enabled():
                with torch.profiler.record_function(f"mla_dispatch::{self.backend}_decode (bound)"):
                    done = fast(q, kv, kv_scale, out, lse_buf)
            else:
                done = fast(q, kv, kv_scale, out, lse_buf)
            if done is not None:
                return done[0], (done[1] if lse is not None or p.return_lse else None)
        if q.shape != self._q_shape or q.dtype != self._q_dtype:
            raise ValueError(f"q must be {list(self._q_shape)} {p.q_dtype} as planned, got {list(q.shape)} {q.dtype}")
        if q.stride(-1) != 1:
            raise ValueError(f"q must be contiguous in its last dim, got strides {list(q.stride())}")
        if kv.shape[1:] != self._kv_tail or kv.dtype != self._kv_dtype:
            raise ValueError(f"kv_cache must be [num_blocks, {', '.join(map(str, self._kv_tail))}] {self._kv_dtype} "
                             f"as planned, got {list(kv.shape)} {kv.dtype}")
        if kv.stride(-1) != 1:
            raise ValueError(f"kv_cache must be contiguous in its last dim, got strides {list(kv.stride())}")
        if self._fp8_scale:
            if kv_scale is None:
                raise ValueError("kv_scale is required for kv_format='fp8_e4m3'")
            if not isinstance(kv_scale, torch.Tensor):
                kv_scale = self._scale_tensor(kv_scale, q.device)
        elif kv_scale is not None:
            raise ValueError(f"kv_scale is only used with kv_format='fp8_e4m3' (planned: {p.kv_format!r})")
        if self._sparse:
            if indices is None or indices.shape != (p.batch, p.q_len, p.topk) or indices.dtype != torch.int32:
                got = None if indices is None else f"{list(indices.shape)} {indices.dtype}"
                raise ValueError(f"indices must be int32 [{p.batch}, {p.q_len}, {p.topk}] as planned, got {got}")
        elif indices is not None:
            raise ValueError("indices were given but the plan is dense (plan with indices to run sparse)")
        extras = {}
        if self._sparse and (self._sparse_args or topk_length is not None or attn_sink is not None
                             or extra_kv_cache is not None or extra_indices is not None
                             or extra_topk_length is not None):
            extras = self._sparse_extras(topk_length, attn_sink, extra_kv_cache, extra_indices, extra_topk_length)
        elif not self._sparse and any(t is not None for t in (topk_length, attn_sink, extra_kv_cache, extra_indices,
                                                                extra_topk_length)):
            raise ValueError("topk_length, attn_sink and the extra cache need a sparse plan (plan with indices)")
        device = q.device
        out_shape = self._out_shape
        if out is None:
            out = torch.empty(out_shape, dtype=q.dtype, device=device)
        elif out.shape != out_shape or out.dtype != q.dtype or out.device != device:
            raise ValueError(f"out must be {list(out_shape)} {q.dtype} on {device}, got {list(out.shape)} {out.dtype} "
                             f"on {out.device}")
        elif out.stride(-1) != 1 and out_shape[-1] > 1 and not self._any_out_strides:
            raise ValueError(f"out must be contiguous in its last dim (stride 1) for backend {self.backend!r}, got "
                             f"strides {list(out.stride())} (pass a tensor whose rows of {out_shape[-1]} values are "
                             f"contiguous, or out=None)")
        elif _overlaps_itself(out):
            raise ValueError(f"out must not overlap itself: its strides {list(out.stride())} give two elements one "
                             "address (an expanded tensor?), so results would overwrite each other")
        lse_shape = self._lse_shape
        give_lse = lse is not None or p.return_lse
        if lse is None:
            lse = self._lse_scratch if self._lse_scratch is not None else torch.empty(lse_shape, dtype=torch.float32,
                                                                                       device=device)
        elif lse.shape != lse_shape or lse.dtype != torch.float32 or lse.device != device:
            raise ValueError(f"lse must be {list(lse_shape)} float32 on {device}, got {list(lse.shape)} {lse.dtype}")
        elif _overlaps_itself(lse):
            raise ValueError(f"lse must not overlap itself: its strides {list(lse.stride())} give two elements one "
                             "address (an expanded tensor?), so results would overwrite each other")
        if p.batch:  # no request: the empty out and lse are the result (plan_decode)
            self._run(self._state, q, kv, self.block_table, self._lens, problem=p,
                      softmax_scale=self.softmax_scale, kv_scale=kv_scale, indices=indices, out=out, lse=lse, **extras)
        return out, (lse if give_lse else None)


def plan_decode(
    q: torch.Tensor,
    kv_cache,
    block_table: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None,
    *,
    head_dim_v: int = 512,
    softmax_scale: float | None = None,
    causal: bool = False,
    kv_format: str = "auto",
    kv_scale: torch.Tensor | float | None = None,
    indices: torch.Tensor | None = None,
    return_lse: bool = True,
    backend: str = "auto",
    backend_options: Mapping[str, object] | None = None,
    cuda_graph: bool = False,
    batch_invariant: bool = False,
    validate: bool = False,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_kv_cache=None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
) -> DecodePlan:
    """Plan one decode step: choose the backend and compute its per-step state.

    ``q``, ``kv_cache``, ``indices`` and the optional sparse arguments (``topk_length``,
    ``attn_sink``, ``extra_kv_cache``, ``extra_indices``, ``extra_topk_length``) are read for
    their shapes, dtypes and device only (pass layer 0's tensors, or any tensors of the same
    geometry; :meth:`DecodePlan.run` takes each layer's); ``block_table`` and ``cache_seqlens``
    are kept: every :meth:`DecodePlan.run` reads the block table's values as they are then,
    and computes with the *values* ``cache_seqlens`` holds now, until :meth:`DecodePlan.update`
    (docs/design.md §2, "Stale plans"). Arguments are those of :func:`mla_decode`, plus:

    Parameters
    ----------
    backend_options : Mapping, optional
        Overrides of the named ``backend``'s own choices, for experiments and
        tests: each backend declares the options it accepts
        (``MLABackend.OPTIONS``; e.g. ``cuda_sm90``: ``variant``, the mainloop,
        and ``fuse_combine``, where split rows are merged). Recorded on the plan
        (:attr:`DecodePlan.backend_options`). Needs a named ``backend``.
    cuda_graph : bool
        Require a backend whose ``run`` can be captured in a CUDA graph. After
        capture, change the *values* of ``block_table``/``cache_seqlens`` and
        call :meth:`DecodePlan.update` before replaying.
    batch_invariant : bool
        Make each request's ``out`` and ``lse`` bitwise independent of the rest of
        the batch and of its place in it (reproducible sampling, RL rollouts,
        debugging). The split-KV schedule then cuts each request at fixed token
        counts (:func:`mla_dispatch.metadata.schedule.fixed_split_schedule`) and the
        backend runs one kernel configuration for every batch size. Needs a backend
        that declares it (``SUPPORTS_BATCH_INVARIANT``: reference, triton, cuda_sm90);
        others decline with a reason. Results are reproducible on one backend and
        device, not across them. Its cost against the default schedule is in
        benchmarks/RESULTS.md.

    Returns
    -------
    DecodePlan

    Raises
    ------
    ValueError, TypeError
        Invalid arguments (see :func:`mla_decode`); ``backend_options`` with
        ``backend="auto"``, an option the backend does not declare, or a value
        it does not accept or that does not suit the problem.
    NoBackendError
        No backend here can run the problem (the message lists every
        candidate's reasons), or the named ``backend`` cannot.
    """
    options = _checked_options(backend, backend_options)
    kv, kv_format, kv_scale = _unwrap_cache(kv_cache, kv_format, kv_scale)
    extra_kv = None if extra_kv_cache is None else _unwrap_cache(extra_kv_cache, "auto", None)[0]
    problem = _problem(q, kv, block_table, cache_seqlens, indices, kv_scale, head_dim_v, causal, kv_format, return_lse,
                       cuda_graph, batch_invariant, topk_length, attn_sink, extra_kv, extra_indices, extra_topk_length)
    extra_tail = None
    if extra_kv is not None:
        extra_kv = extra_kv.unsqueeze(2) if extra_kv.dim() == 3 else extra_kv
        extra_tail = tuple(extra_kv.shape[1:])
    if validate:
        check_values(problem, kv.shape[0], block_table, cache_seqlens, indices, topk_length=topk_length)
        if extra_kv is not None:
            check_values(problem, extra_kv.shape[0], None, None, extra_indices, page_size=problem.extra_page_size,
                         name="extra_indices", topk_length=extra_topk_length)
    if kv_scale is not None and not isinstance(kv_scale, torch.Tensor):
        _check_positive_finite("kv_scale", kv_scale)
    if softmax_scale is None:
        softmax_scale = default_softmax_scale(problem.head_dim_qk)
    else:
        softmax_scale = _check_positive_finite("softmax_scale", softmax_scale)
    platform = platform_for(q.device)
    cls = select_backend(problem, platform, backend)
    # only a backend that declares options takes them (MLABackend.plan)
    extra = {"options": options} if cls.OPTIONS else {}
    # the plan computes with the lengths as of now (docs/design.md §2, "Stale plans"): the backend's own copy, or ours
    snapshot = None if cache_seqlens is None or cls.KEEPS_LENGTHS else cache_seqlens.clone()
    if problem.batch:
        state = cls.plan(problem, platform, block_table, cache_seqlens if snapshot is None else snapshot,
                         softmax_scale=float(softmax_scale), **extra)
    else:
        # Batch size 0 (an engine step with no decode request): the backend is chosen and the arguments checked as
        # for any batch, but no backend plans or runs (their schedules index request 0); run() returns out and lse
        # of the documented shapes, [0, s_q, h_q, D_v] and [0, h_q, s_q].
        state = BackendState()
    p = problem
    kv_tail = (p.page_size, p.num_heads_kv, token_bytes(p.kv_format) or p.head_dim_qk)
    plan = DecodePlan(cls, problem, platform, float(softmax_scale), block_table, cache_seqlens, state,
                      (p.batch, p.q_len, p.num_heads_q, p.head_dim_qk), kv_tail, kv.dtype, options, snapshot,
                      extra_tail)
    if kv_scale is not None and not isinstance(kv_scale, torch.Tensor):
        plan._scale_tensor(kv_scale, q.device)  # checked and converted now, not in run()
    return plan


#: problems of the tensor geometries plan_decode has seen (:func:`_problem`); past this many it stops adding
_MAX_CACHED_PROBLEMS = 1024
_problems: dict[tuple, DecodeProblem] = {}


def _problem(q, kv, block_table, cache_seqlens, indices, kv_scale, head_dim_v, causal, kv_format, return_lse,
             cuda_graph, batch_invariant, topk_length=None, attn_sink=None, extra_kv_cache=None, extra_indices=None,
             extra_topk_length=None) -> DecodeProblem:
    """:func:`~mla_dispatch.dispatch.problem.describe_inputs` once per geometry: every check it makes reads only the
    shapes, strides, dtypes and devices of the tensors and the scalar arguments, so those, as a key, find the problem
    an earlier call of the same geometry made (a plan per decode step repeats the same key). Tensor subclasses and
    anything that is not a tensor take ``describe_inputs`` every time (its errors included)."""
    plain = torch.Tensor
    sparse_args = (topk_length, attn_sink, extra_kv_cache, extra_indices, extra_topk_length)
    if not (type(q) is plain and type(kv) is plain and (block_table is None or type(block_table) is plain)
            and (cache_seqlens is None or type(cache_seqlens) is plain) and (indices is None or type(indices) is plain)
            and all(t is None or type(t) is plain for t in sparse_args)):
        return describe_inputs(q, kv, block_table, cache_seqlens, head_dim_v=head_dim_v, causal=causal,
                               kv_format=kv_format, kv_scale=kv_scale, indices=indices, return_lse=return_lse,
                               cuda_graph=cuda_graph, batch_invariant=batch_invariant, topk_length=topk_length,
                               attn_sink=attn_sink, extra_kv_cache=extra_kv_cache, extra_indices=extra_indices,
                               extra_topk_length=extra_topk_length)
    key = (q.shape, q.stride(), q.dtype, q.device, kv.shape, kv.stride(), kv.dtype, kv.device,
           None if block_table is None else (block_table.shape, block_table.stride(), block_table.dtype,
                                             block_table.device),
           None if cache_seqlens is None else (cache_seqlens.shape, cache_seqlens.dtype, cache_seqlens.device),
           None if indices is None else (indices.shape, indices.dtype, indices.device),
           (kv_scale.shape, kv_scale.dtype) if isinstance(kv_scale, plain) else type(kv_scale),
           head_dim_v, causal, kv_format, return_lse, cuda_graph, batch_invariant)
    if any(t is not None for t in sparse_args):  # DeepSeek-V4's optional sparse arguments (their checks read these)
        key += tuple(None if t is None else (t.shape, t.stride(), t.dtype, t.device) for t in sparse_args)
    try:
        problem = _problems.get(key)
    except TypeError:  # an unhashable scalar argument: describe_inputs says what is wrong with it
        problem, key = None, None
    if problem is None:
        problem = describe_inputs(q, kv, block_table, cache_seqlens, head_dim_v=head_dim_v, causal=causal,
                                  kv_format=kv_format, kv_scale=kv_scale, indices=indices, return_lse=return_lse,
                                  cuda_graph=cuda_graph, batch_invariant=batch_invariant, topk_length=topk_length,
                                  attn_sink=attn_sink, extra_kv_cache=extra_kv_cache, extra_indices=extra_indices,
                                  extra_topk_length=extra_topk_length)
        if key is not None and len(_problems) < _MAX_CACHED_PROBLEMS:
            _problems[key] = problem
    return problem


def _checked_options(backend: str, backend_options: Mapping[str, object] | None) -> dict[str, object]:
    """``backend_options`` checked against the named backend's declared options (before any other work)."""
    if not backend_options:
        return {}
    if backend == "auto":
        raise ValueError(f"backend_options={dict(backend_options)} need a named backend (backend='auto' picks one per "
                         "machine, and each backend declares its own options)")
    return get_backend(backend).check_options(backend_options)


def mla_decode(
    q: torch.Tensor,
    kv_cache,
    block_table: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None,
    *,
    head_dim_v: int = 512,
    softmax_scale: float | None = None,
    causal: bool = False,
    kv_format: str = "auto",
    kv_scale: torch.Tensor | float | None = None,
    indices: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    return_lse: bool = True,
    backend: str = "auto",
    backend_options: Mapping[str, object] | None = None,
    batch_invariant: bool = False,
    plan: DecodePlan | None = None,
    validate: bool = False,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_kv_cache=None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Decode-step Multi-head Latent Attention (DeepSeek MLA, absorbed "MQA mode").

    For request ``b``, query token ``i`` and head ``h`` (KV head ``h // (h_q/h_kv)``)::

        S[j] = softmax_scale * <q[b, i, h, :], K[b, j, :]>     over the request's cached tokens j
        out  = sum_j softmax(S)[j] * K[b, j, :head_dim_v]     (V is the first head_dim_v channels of K)
        lse  = log sum_j exp(S[j])                            (natural log)

    Parameters
    ----------
    q : Tensor
        ``[B, s_q, h_q, D_qk]`` bfloat16 or float16, last dim contiguous.
        DeepSeek-V3: ``D_qk = 576`` (512 latent + 64 RoPE). ``B`` may be 0 (a step with no
        decode request): the arguments are checked and a backend chosen as for any batch,
        nothing runs, and ``out`` / ``lse`` are empty tensors of the shapes below.
    kv_cache : Tensor or PagedMLACache
        ``[num_blocks, page_size, h_kv, D_qk]`` (or 3-D ``[num_blocks, page_size, D_qk]``
        for ``h_kv = 1``), in q's dtype, ``float8_e4m3fn`` (``"fp8_e4m3"``) or
        ``uint8 [..., 656]`` (``"fp8_ds_mla"``).
    block_table : Tensor
        int32 ``[B, max_blocks]``: request ``b``'s token ``j`` is in block
        ``block_table[b, j // page_size]``. Entries past ``ceil(L_b / page_size)``
        are never read. Unused (None) with sparse ``indices``. A block id outside
        ``[0, num_blocks)`` among the entries a request uses is never read either:
        that request's ``out`` rows and ``lse`` are NaN, the other requests'
        results do not change (``validate=True`` raises instead).
    cache_seqlens : Tensor
        int32 ``[B]``, ``L_b``: cached tokens per request (including the
        ``s_q`` new ones). Slots past ``L_b`` are never read. A request's tokens
        are its first ``clamp(L_b, 0, max_blocks * page_size)``: a negative length
        counts as 0, one past the table's capacity as the capacity (the causal
        cut is still counted from ``L_b``; ``validate=True`` raises instead).
    head_dim_v : int
        ``D_v`` (DeepSeek: 512 = kv_lora_rank); ``<= D_qk``.
    softmax_scale : float, optional
        Defaults to ``1/sqrt(D_qk)``. **DeepSeek models need
        ``1/sqrt(192) * mscale**2``** (qk_nope + qk_rope head dims, YaRN): pass
        it explicitly, as every serving engine does.
    causal : bool
        With ``s_q > 1`` (speculative / multi-token decode), query token ``i``
        sees keys ``0 .. L_b - s_q + i``. No effect when ``s_q == 1``.
    kv_format : {"auto", "bf16", "fp16", "fp8_e4m3", "fp8_ds_mla", "fp8_ds_v4"}
        ``"auto"`` infers it from the cache dtype (and, for bytes, the last dim: 656 is
        ``"fp8_ds_mla"``, 584 ``"fp8_ds_v4"``). ``"fp8_ds_v4"`` is DeepSeek-V4's cache
        (FlashMLA's "MODEL1"): ``D_qk = head_dim_v = 512`` (448 fp8 NoPE + 64 bf16 RoPE
        channels; V is the whole token), one KV head, laid out per block
        (:mod:`mla_dispatch.kvcache.formats`; ``PagedMLACache(kv_format="fp8_ds_v4")`` makes one).
    kv_scale : float or Tensor, optional
        The per-tensor fp32 dequantisation scale, positive; required for ``"fp8_e4m3"``.
    indices : Tensor, optional
        int32 ``[B, s_q, topk]`` sparse attention (DeepSeek Sparse Attention):
        entry ``block_id * page_size + offset``, ``-1`` = skip. An entry at or past
        ``num_blocks * page_size`` is never read: that query token's ``out`` rows and
        ``lse`` are NaN (``validate=True`` raises instead).
    topk_length : Tensor, optional
        Sparse only. int32 ``[B]``: request ``b`` reads only the first ``topk_length[b]``
        entries of its ``indices`` (clamped to ``[0, topk]``); the rest may hold anything.
    attn_sink : Tensor, optional
        Sparse only. float32 ``[h_q]``, one logit per query head (DeepSeek-V4): head h's
        output is scaled by ``exp(lse) / (exp(lse) + exp(attn_sink[h]))``, as if one more key
        of that score and a zero value were attended to; ``+inf`` gives 0, ``-inf`` changes
        nothing. The returned ``lse`` is the keys' own, without the sink.
    extra_kv_cache, extra_indices : optional
        Sparse only, together. A second cache (Tensor or PagedMLACache) in ``kv_cache``'s
        format and head count, with its own page size, and int32 ``[B, s_q, extra_topk]``
        token ids into it (as ``indices``): each query attends to both lists in one softmax
        (DeepSeek-V4's compressed and sliding-window caches).
    extra_topk_length : Tensor, optional
        int32 ``[B]``: ``topk_length`` for ``extra_indices``.
    out : Tensor, optional
        ``[B, s_q, h_q, D_v]`` in q's dtype, written in place; contiguous in its last dim
        unless the backend takes any strides (``ANY_OUT_STRIDES``: the reference does).
    return_lse : bool
        Return the LSE (otherwise the second element is None).
    backend : str
        ``"auto"`` or a registered name (``python -m mla_dispatch info`` lists
        them); a named backend that cannot run the problem raises.
    backend_options : Mapping, optional
        Overrides of the named backend's own choices (see :func:`plan_decode`).
    batch_invariant : bool
        Each request's result bitwise independent of the rest of the batch (see :func:`plan_decode`).
    plan : DecodePlan, optional
        Reuse a plan from :func:`plan_decode` (then only ``q``, ``kv_cache``,
        ``kv_scale``, ``indices``, the optional sparse arguments and ``out`` are used;
        the plan computes with the lengths it was made or last updated for).
    validate : bool
        Also check values (block ids, sequence lengths, indices): a ValueError
        names ``block_table`` / ``cache_seqlens`` / ``indices`` and the offending
        requests (rows). Syncs with the device. With ``plan``, the plan's table
        and planned lengths are checked, and a ``cache_seqlens`` whose values
        changed since the plan was made or updated raises (a stale plan).

    Returns
    -------
    out : Tensor
        ``[B, s_q, h_q, D_v]`` in q's dtype. Rows with no visible key are 0.
    lse : Tensor or None
        fp32 ``[B, h_q, s_q]`` natural-log sum-exp (FlashMLA's layout); ``+inf``
        for rows with no visible key.

    Raises
    ------
    ValueError
        An argument has the wrong dtype, rank, shape, device or layout, or
        ``softmax_scale`` / a float ``kv_scale`` is not finite and positive; the
        message names it and the expected value. Bad ``backend_options``
        (see :func:`plan_decode`).
    TypeError
        ``q``, ``kv_cache``, ``block_table``, ``cache_seqlens`` or ``indices`` is
        not a tensor (a Python list of lengths, say); the message names it.
    NoBackendError
        No available backend can run the problem; the message lists the
        problem and every candidate's reasons.

    Examples
    --------
    >>> import torch, mla_dispatch
    >>> q = torch.randn(2, 1, 16, 576, dtype=torch.bfloat16)
    >>> kv = torch.randn(4, 64, 1, 576, dtype=torch.bfloat16)
    >>> table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    >>> lens = torch.tensor([100, 7], dtype=torch.int32)
    >>> out, lse = mla_dispatch.mla_decode(q, kv, table, lens, softmax_scale=192**-0.5)
    >>> out.shape, lse.shape
    (torch.Size([2, 1, 16, 512]), torch.Size([2, 16, 1]))
    """
    extras = dict(topk_length=topk_length, attn_sink=attn_sink, extra_kv_cache=extra_kv_cache,
                  extra_indices=extra_indices, extra_topk_length=extra_topk_length)
    if plan is None:
        plan = plan_decode(q, kv_cache, block_table, cache_seqlens, head_dim_v=head_dim_v, softmax_scale=softmax_scale,
                           causal=causal, kv_format=kv_format, kv_scale=kv_scale, indices=indices,
                           return_lse=return_lse, backend=backend, backend_options=backend_options,
                           batch_invariant=batch_invariant, validate=validate, **extras)
    elif validate:  # the plan's own table and lengths (what run() reads), against this cache
        kv = _unwrap_cache(kv_cache, "auto", None)[0]
        planned = plan.planned_lengths
        check_values(plan.problem, kv.shape[0], plan.block_table, plan.cache_seqlens if planned is None else planned,
                     indices, topk_length=topk_length)
        if extra_kv_cache is not None:
            extra = _unwrap_cache(extra_kv_cache, "auto", None)[0]
            check_values(plan.problem, extra.shape[0], None, None, extra_indices, page_size=extra.shape[1],
                         name="extra_indices", topk_length=extra_topk_length)
        if planned is not None and not torch.equal(planned, plan.cache_seqlens):
            stale = torch.nonzero(planned != plan.cache_seqlens).flatten().tolist()
            raise ValueError(f"cache_seqlens changed since the plan was made or last updated (rows {stale[:8]}: "
                             f"planned {planned[stale[:8]].tolist()}, now {plan.cache_seqlens[stale[:8]].tolist()}); "
                             "the plan computes with the planned lengths until plan.update() (docs/design.md §2, "
                             "'Stale plans')")
    return plan.run(q, kv_cache, kv_scale=kv_scale, indices=indices, out=out, **extras)
