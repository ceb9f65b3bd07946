"""The backend contract: capabilities as data, reasons as values, plan and run.

A backend is a class. Its class constants declare what it can run; one shared
method, :meth:`MLABackend.not_supported_reasons`, turns them into
:class:`Reason` values ("page_size=16 (supported: 64)"); a subclass overrides
:meth:`MLABackend.extra_reasons` only for what a table cannot say. The shape of
this follows xformers ``ops/fmha/common.py`` (``AttentionOpBase``) and vLLM's
``supports_*`` class methods.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar

import torch

from mla_dispatch.dispatch.platform import Platform
from mla_dispatch.dispatch.problem import DecodeProblem
from mla_dispatch.numerics.tolerance import BF16_TOLERANCE, Tolerance

__all__ = ["ReasonCode", "Reason", "CGSupport", "BackendOption", "MLABackend", "BackendState", "Unimplemented",
           "untraced_eager"]

_is_compiling = torch.compiler.is_compiling
_dispatch_modes = torch._C._len_torch_dispatch_stack


def untraced_eager(q: torch.Tensor) -> bool:
    """Whether a call on ``q`` is plain eager: not under torch.compile, no TorchDispatchMode active (fake tensors,
    functionalization, ``make_fx``) and not a tensor subclass. Only such calls may skip the dispatcher (native
    fast paths, :meth:`MLABackend.bind`); every other call must reach a registered op, so traces see it."""
    return not _is_compiling() and type(q) is torch.Tensor and not _dispatch_modes()


class ReasonCode(enum.Enum):
    UNAVAILABLE = "unavailable"  # library/extension missing or failed to import/build
    NOT_IMPLEMENTED = "not_implemented"
    DEVICE = "device"
    CAPABILITY = "capability"
    DTYPE = "dtype"
    KV_FORMAT = "kv_format"
    HEAD_DIM = "head_dim"
    HEADS = "heads"
    PAGE_SIZE = "page_size"
    Q_LEN = "q_len"
    FEATURE = "feature"
    CUDA_GRAPH = "cuda_graph"


@dataclasses.dataclass(frozen=True)
class Reason:
    """Why a backend cannot run a problem: what is required and what was given."""

    code: ReasonCode
    message: str

    def __str__(self) -> str:
        return self.message


class CGSupport(enum.Enum):
    """Whether ``DecodePlan.run`` can be captured in a CUDA graph (vLLM ``AttentionCGSupport``)."""

    NEVER = 0
    ALWAYS = 1


@dataclasses.dataclass(frozen=True)
class BackendOption:
    """One option of a backend's planning (``backend_options`` of :func:`mla_dispatch.plan_decode`): an explicit
    override, for experiments and tests, of a choice the plan otherwise makes itself (which kernel, where a merge
    runs). ``values`` are the accepted values (compared by type and value, so ``1`` is not ``True``)."""

    values: tuple
    doc: str

    def accepts(self, value: object) -> bool:
        return any(type(value) is type(v) and value == v for v in self.values)




class BackendState:
    """Whatever a backend computes once per decode step (schedule, workspace, vendor plan).

    Subclass it or use it as a plain attribute bag; the front end never looks inside.
    """

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)


def _fmt_set(values) -> str:
    def name(v):
        return str(v).replace("torch.", "") if isinstance(v, torch.dtype) else str(v)

    return "{" + ", ".join(sorted(name(v) for v in values)) + "}"


class MLABackend:
    """Base class of every backend adapter.

    Subclasses set the class constants below, then implement :meth:`plan` and
    :meth:`run`. ``None`` means "any".
    """

    NAME: ClassVar[str] = "?"
    DESCRIPTION: ClassVar[str] = ""
    #: platform kinds (``Platform.kind``) the backend runs on
    PLATFORMS: ClassVar[frozenset[str]] = frozenset()
    #: CUDA compute capability range, inclusive, for kind "cuda"
    MIN_CAPABILITY: ClassVar[tuple[int, int] | None] = None
    MAX_CAPABILITY: ClassVar[tuple[int, int] | None] = None
    #: exact architectures (ROCm gfx names, Ascend SoCs)
    ARCHS: ClassVar[frozenset[str] | None] = None
    Q_DTYPES: ClassVar[frozenset[torch.dtype]] = frozenset({torch.bfloat16, torch.float16})
    KV_FORMATS: ClassVar[frozenset[str]] = frozenset({"bf16", "fp16"})
    #: allowed (D_qk, D_v) pairs
    HEAD_DIMS: ClassVar[frozenset[tuple[int, int]] | None] = None
    PAGE_SIZES: ClassVar[frozenset[int] | None] = None
    MAX_PAGE_SIZE: ClassVar[int | None] = None
    NUM_HEADS_Q: ClassVar[frozenset[int] | None] = None
    MAX_HEADS_Q: ClassVar[int | None] = None
    MAX_HEADS_KV: ClassVar[int | None] = None
    MAX_Q_LEN: ClassVar[int | None] = None
    SUPPORTS_CAUSAL: ClassVar[bool] = True
    SUPPORTS_LSE: ClassVar[bool] = True
    SUPPORTS_SPARSE: ClassVar[bool] = False
    SUPPORTS_DENSE: ClassVar[bool] = True
    #: runs ``batch_invariant=True`` plans: a request's out and lse bitwise the same whatever the batch around it
    SUPPORTS_BATCH_INVARIANT: ClassVar[bool] = False
    CUDA_GRAPH: ClassVar[CGSupport] = CGSupport.NEVER
    #: ``True``: ``out`` may have any strides (the backend writes it through torch ops, ``out.copy_``); ``False``:
    #: its last dim must be contiguous (a kernel stores rows of D_v values with stride 1). The front end checks
    #: ``out`` against it (``DecodePlan.run``) and raises a ValueError naming ``out`` rather than copying.
    ANY_OUT_STRIDES: ClassVar[bool] = False
    TOLERANCE: ClassVar[Tolerance] = BF16_TOLERANCE
    #: ``False`` for names registered ahead of their implementation
    IMPLEMENTED: ClassVar[bool] = True
    #: modules that must import for the backend to be usable (checked lazily, once)
    REQUIRES: ClassVar[tuple[str, ...]] = ()
    #: the planning options the backend accepts (name -> :class:`BackendOption`); a backend that declares any takes
    #: them in :meth:`plan` as ``options``
    OPTIONS: ClassVar[Mapping[str, BackendOption]] = MappingProxyType({})
    #: ``True``: :meth:`plan` and :meth:`update` copy the values of ``cache_seqlens`` into the state (its ``lengths``,
    #: for dense plans) and :meth:`run` computes with that copy only. ``False``: the front end keeps the copy and
    #: hands it to :meth:`plan`, :meth:`update` and :meth:`run` as ``cache_seqlens``. Either way a plan computes with
    #: the lengths it was made or last updated for (docs/design.md §2, "Stale plans").
    KEEPS_LENGTHS: ClassVar[bool] = False

    # -- availability ----------------------------------------------------------------

    @classmethod
    def version(cls) -> str:
        """Version tag shown as ``name@version`` (the vendor library's version where one exists)."""
        return "builtin"

    @classmethod
    def availability_reasons(cls) -> list[Reason]:
        """Reasons the backend cannot run anywhere in this process (import failures). Cached."""
        cached = cls.__dict__.get("_availability_cache")
        if cached is None:
            cached = cls._check_availability()
            cls._availability_cache = cached
        return list(cached)

    @classmethod
    def _check_availability(cls) -> list[Reason]:
        if not cls.IMPLEMENTED:
            return [Reason(ReasonCode.NOT_IMPLEMENTED, f"{cls.NAME} is not implemented in this version")]
        reasons = []
        for module in cls.REQUIRES:
            try:
                importlib.import_module(module)
            except Exception as exc:
                reasons.append(Reason(ReasonCode.UNAVAILABLE, f"import {module} failed: {type(exc).__name__}: {exc}"))
        return reasons

    # -- feasibility ---------------------------------------------------------------------

    @classmethod
    def not_supported_reasons(cls, problem: DecodeProblem, platform: Platform) -> list[Reason]:
        """Every reason this backend cannot run ``problem`` on ``platform`` (empty: it can)."""
        reasons = cls.availability_reasons()
        if reasons and reasons[0].code is ReasonCode.NOT_IMPLEMENTED:
            return reasons
        p = problem
        R = ReasonCode
        if platform.kind not in cls.PLATFORMS:
            reasons.append(Reason(R.DEVICE, f"platform={platform.kind} (supported: {_fmt_set(cls.PLATFORMS)})"))
        elif platform.kind == "cuda" and platform.capability is not None:
            cap = platform.capability
            lo, hi = cls.MIN_CAPABILITY, cls.MAX_CAPABILITY
            if (lo and cap < lo) or (hi and cap > hi):
                rng = (f"{lo[0]}.{lo[1]}" if lo else "any") + (f"..{hi[0]}.{hi[1]}" if hi else "+")
                reasons.append(Reason(R.CAPABILITY, f"compute capability {cap[0]}.{cap[1]} (supported: {rng})"))
        if cls.ARCHS is not None and platform.kind in cls.PLATFORMS and platform.arch not in cls.ARCHS:
            reasons.append(Reason(R.CAPABILITY, f"arch={platform.arch} (supported: {_fmt_set(cls.ARCHS)})"))
        if p.q_dtype not in cls.Q_DTYPES:
            reasons.append(Reason(R.DTYPE, f"q dtype={_fmt_set([p.q_dtype])[1:-1]} (supported: {_fmt_set(cls.Q_DTYPES)})"))
        if p.kv_format not in cls.KV_FORMATS:
            reasons.append(Reason(R.KV_FORMAT, f"kv_format={p.kv_format} (supported: {_fmt_set(cls.KV_FORMATS)})"))
        if cls.HEAD_DIMS is not None and (p.head_dim_qk, p.head_dim_v) not in cls.HEAD_DIMS:
            dims = ", ".join(f"{a}/{b}" for a, b in sorted(cls.HEAD_DIMS))
            reasons.append(Reason(R.HEAD_DIM, f"D_qk/D_v={p.head_dim_qk}/{p.head_dim_v} (supported: {dims})"))
        if cls.PAGE_SIZES is not None and p.page_size not in cls.PAGE_SIZES and not p.sparse:
            reasons.append(Reason(R.PAGE_SIZE, f"page_size={p.page_size} (supported: {_fmt_set(cls.PAGE_SIZES)})"))
        if cls.MAX_PAGE_SIZE is not None and p.page_size > cls.MAX_PAGE_SIZE:
            reasons.append(Reason(R.PAGE_SIZE, f"page_size={p.page_size} (supported: <= {cls.MAX_PAGE_SIZE})"))
        if cls.NUM_HEADS_Q is not None and p.num_heads_q not in cls.NUM_HEADS_Q:
            reasons.append(Reason(R.HEADS, f"h_q={p.num_heads_q} (supported: {_fmt_set(cls.NUM_HEADS_Q)})"))
        if cls.MAX_HEADS_Q is not None and p.num_heads_q > cls.MAX_HEADS_Q:
            reasons.append(Reason(R.HEADS, f"h_q={p.num_heads_q} (supported: <= {cls.MAX_HEADS_Q})"))
        if cls.MAX_HEADS_KV is not None and p.num_heads_kv > cls.MAX_HEADS_KV:
            reasons.append(Reason(R.HEADS, f"h_kv={p.num_heads_kv} (supported: <= {cls.MAX_HEADS_KV})"))
        if cls.MAX_Q_LEN is not None and p.q_len > cls.MAX_Q_LEN:
            reasons.append(Reason(R.Q_LEN, f"s_q={p.q_len} (supported: <= {cls.MAX_Q_LEN})"))
        if p.causal and not cls.SUPPORTS_CAUSAL:
            reasons.append(Reason(R.FEATURE, "causal=True with s_q > 1 (supported: causal=False)"))
        if p.return_lse and not cls.SUPPORTS_LSE:
            reasons.append(Reason(R.FEATURE, "return_lse=True (this backend cannot return the LSE)"))
        if p.sparse and not cls.SUPPORTS_SPARSE:
            reasons.append(Reason(R.FEATURE, f"sparse indices (topk={p.topk}) (supported: dense block_table only)"))
        if not p.sparse and not cls.SUPPORTS_DENSE:
            reasons.append(Reason(R.FEATURE, "dense block_table decode (supported: sparse indices only)"))
        if p.batch_invariant and not cls.SUPPORTS_BATCH_INVARIANT:
            reasons.append(Reason(R.FEATURE, "batch_invariant=True (this backend's splits depend on the batch)"))
        if p.cuda_graph and cls.CUDA_GRAPH is CGSupport.NEVER:
            reasons.append(Reason(R.CUDA_GRAPH, "cuda_graph=True (this backend cannot be captured)"))
        reasons.extend(cls.extra_reasons(problem, platform))
        return reasons

    @classmethod
    def extra_reasons(cls, problem: DecodeProblem, platform: Platform) -> list[Reason]:
        """Constraints the class constants cannot express. Default: none."""
        return []

    @classmethod
    def check_options(cls, options: Mapping[str, object] | None) -> dict[str, object]:
        """``options`` (``backend_options`` as given, or None) checked against :attr:`OPTIONS`, as a new dict.

        Whether a valid value suits the problem is the plan's to check (:meth:`plan` raises ValueError).

        Raises
        ------
        ValueError
            An option the backend does not declare (the message names it and the accepted ones), or a value
            outside the option's declared values.
        """
        options = dict(options or {})
        for name, value in options.items():
            declared = cls.OPTIONS.get(name)
            if declared is None:
                accepted = ", ".join(sorted(cls.OPTIONS)) or "none"
                raise ValueError(f"backend_options: {cls.NAME} has no option {name!r} (accepted: {accepted})")
            if not declared.accepts(value):
                values = ", ".join(repr(v) for v in declared.values)
                raise ValueError(f"backend_options[{name!r}]={value!r} (supported: {values}): {declared.doc}")
        return options

    # -- execution ---------------------------------------------------------------------

    @classmethod
    def plan(
        cls,
        problem: DecodeProblem,
        platform: Platform,
        block_table: torch.Tensor | None,
        cache_seqlens: torch.Tensor | None,
        *,
        softmax_scale: float,
    ) -> BackendState:
        """Per-step work: schedules, workspaces, vendor plans. May allocate; should not sync.

        A backend that declares :attr:`OPTIONS` takes one more keyword, ``options``: the checked
        ``backend_options`` (:meth:`check_options`; a dict, empty when none were given). It raises ValueError for an
        option value that does not suit ``problem``.
        """
        return BackendState()

    @classmethod
    def update(cls, state: BackendState, block_table: torch.Tensor | None, cache_seqlens: torch.Tensor | None) -> None:
        """Refresh ``state`` in place for new values of the same shapes (CUDA-graph replay)."""

    @classmethod
    def bind(cls, state: BackendState, problem: DecodeProblem, kv_dtype: torch.dtype, block_table: torch.Tensor,
             cache_seqlens: torch.Tensor, *, softmax_scale: float):
        """An eager fast path for :meth:`DecodePlan.run <mla_dispatch.api.DecodePlan.run>`, or None (the default).

        The callable is ``fn(q, kv_cache, kv_scale, out, lse) -> (out, lse) | None`` with ``kv_cache`` 4-D,
        ``kv_scale`` a tensor or None, and ``out`` / ``lse`` the buffers to write or None (then it allocates
        them). In one native call it checks that the arguments are what the plan was made for (``problem``, a
        cache of ``kv_dtype``), runs the plan and returns the two tensors; it returns None, having done nothing,
        when they are not, and the plan's checked path then runs (or raises the error that names the argument).
        ``block_table``, ``cache_seqlens`` and ``softmax_scale`` are the plan's, as :meth:`run` gets them. The
        callable is called only where :func:`untraced_eager` holds, for dense plans.
        """
        return None

    @classmethod
    def run(
        cls,
        state: BackendState,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor | None,
        cache_seqlens: torch.Tensor | None,
        *,
        problem: DecodeProblem,
        softmax_scale: float,
        kv_scale: torch.Tensor | None,
        indices: torch.Tensor | None,
        out: torch.Tensor,
        lse: torch.Tensor,
    ) -> None:
        """Compute into ``out`` ``[B, s_q, h_q, D_v]`` and ``lse`` ``[B, h_q, s_q]`` fp32.

        ``kv_cache`` is 4-D ``[num_blocks, page_size, h_kv, D or 656]``. Must not
        allocate or sync when ``problem.cuda_graph`` is set.
        """
        raise NotImplementedError(f"{cls.NAME}.run")


class Unimplemented(MLABackend):
    """A registered name whose implementation is planned but not in this version."""

    IMPLEMENTED = False
