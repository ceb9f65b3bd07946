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

__all__ = ["ReasonCode", "Reason", "CGSupport", "BackendOption", "ArchSupport", "MLABackend", "BackendState",
           "Unimplemented", "untraced_eager", "version_of", "dense_call_matcher"]

_is_compiling = torch.compiler.is_compiling
_dispatch_modes = torch._C._len_torch_dispatch_stack


def untraced_eager(q: torch.Tensor) -> bool:
    """Whether a call on ``q`` is plain eager: not under torch.compile, no TorchDispatchMode active (fake tensors,
    functionalization, ``make_fx``) and not a tensor subclass. Only such calls may skip the dispatcher (native
    fast paths, :meth:`MLABackend.bind`); every other call must reach a registered op, so traces see it."""
    return not _is_compiling() and type(q) is torch.Tensor and not _dispatch_modes()


def dense_call_matcher(problem: DecodeProblem, kv_dtype: torch.dtype):
    """``matches(q, kv, kv_scale, out, lse) -> bool`` for a bound eager call (:meth:`MLABackend.bind`) of a dense
    plan over a 16-bit cache: whether the arguments are what ``problem`` was planned for (q of its shape and dtype,
    a 4-D cache of its page, heads and width in ``kv_dtype``, both contiguous in their last dim, no ``kv_scale``, and
    ``out`` / ``lse``, where given, of the planned shapes and dtypes on q's device). The shapes are computed once."""
    p = problem
    q_shape, q_dtype = (p.batch, p.q_len, p.num_heads_q, p.head_dim_qk), p.q_dtype
    kv_tail = (p.page_size, p.num_heads_kv, p.head_dim_qk)
    out_shape, lse_shape = (p.batch, p.q_len, p.num_heads_q, p.head_dim_v), (p.batch, p.num_heads_q, p.q_len)
    fp32 = torch.float32

    def matches(q, kv, kv_scale, out, lse) -> bool:
        return not (kv_scale is not None or q.shape != q_shape or q.dtype != q_dtype or q.stride(-1) != 1
                    or kv.shape[1:] != kv_tail or kv.dtype != kv_dtype or kv.stride(-1) != 1
                    or (out is not None and (out.shape != out_shape or out.dtype != q_dtype or out.device != q.device))
                    or (lse is not None and (lse.shape != lse_shape or lse.dtype != fp32 or lse.device != q.device)))

    return matches


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


class OptionNotSupported(ValueError):
    """A valid ``backend_options`` value that cannot run the problem (a forced kernel that does not take its shape):
    raised by a backend's :meth:`MLABackend.plan`, with what the value needs and what the problem has. A ValueError,
    so callers that catch those keep working; a sweep of forced options (``bench``) reports it as unsupported rather
    than as an error."""


@dataclasses.dataclass(frozen=True)
class BackendOption:
    """One option of a backend's planning (``backend_options`` of :func:`mla_dispatch.plan_decode`): an explicit
    override, for experiments and tests, of a choice the plan otherwise makes itself (which kernel, where a merge
    runs). ``values`` are the accepted values (compared by type and value, so ``1`` is not ``True``)."""

    values: tuple
    doc: str

    def accepts(self, value: object) -> bool:
        return any(type(value) is type(v) and value == v for v in self.values)




@dataclasses.dataclass(frozen=True)
class ArchSupport:
    """What a backend runs on one architecture: one row of the README's support matrix.

    ``limits`` narrow the backend's class constants there, under the same names (``Q_DTYPES``, ``KV_FORMATS``,
    ``HEAD_DIMS``, ``NUM_HEADS_Q``, ``MAX_HEADS_KV``, ``SUPPORTS_DENSE``, ``SUPPORTS_SPARSE``, ``SUPPORTS_LSE``,
    ``CUDA_GRAPH``, ...). A vendor's are read from its kernels' own static checks (what the kernels assert, not
    what the API lets through), and ``sources`` says, per constant, which check (it is quoted in the reason).
    """

    #: short name, used in reasons ("sm90 dense", "gfx942", "cpu")
    name: str
    #: the matrix's hardware column ("Hopper (sm_90a)")
    hardware: str
    #: platform kinds it covers (None: all of the backend's ``PLATFORMS``)
    kinds: frozenset[str] | None = None
    #: CUDA compute capability range, inclusive (kind "cuda")
    min_capability: tuple[int, int] | None = None
    max_capability: tuple[int, int] | None = None
    #: exact architectures (ROCm gfx names, Ascend SoCs)
    archs: frozenset[str] | None = None
    limits: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict)
    #: what the matrix adds to what the constants say: the kernel's name, how the adapter adapts the layout, and
    #: what :meth:`MLABackend.extra_reasons` checks
    notes: str = ""
    #: hand-kept: where this project ran it, for the matrix's "run here" column
    run_here: str = "not recorded"

    def matches(self, platform: Platform, kinds: frozenset[str] = frozenset()) -> bool:
        """Whether ``platform`` is this architecture (``kinds``: the backend's platforms, when the entry names none)."""
        if platform.kind not in (self.kinds if self.kinds is not None else kinds):
            return False
        if self.archs is not None and platform.arch not in self.archs:
            return False
        cap = platform.capability if platform.kind == "cuda" else None
        if cap is not None:
            if self.min_capability is not None and cap < self.min_capability:
                return False
            if self.max_capability is not None and cap > self.max_capability:
                return False
        return True


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


def _table_reasons(get, p: DecodeProblem) -> list[tuple[str, Reason]]:
    """``(constant name, Reason)`` for every class constant (read through ``get(name)``) that ``p`` violates."""
    R = ReasonCode
    out = []

    def add(key: str, code: ReasonCode, message: str) -> None:
        out.append((key, Reason(code, message)))

    q_dtypes, kv_formats, head_dims = get("Q_DTYPES"), get("KV_FORMATS"), get("HEAD_DIMS")
    if p.q_dtype not in q_dtypes:
        add("Q_DTYPES", R.DTYPE, f"q dtype={_fmt_set([p.q_dtype])[1:-1]} (supported: {_fmt_set(q_dtypes)})")
    if p.kv_format not in kv_formats:
        add("KV_FORMATS", R.KV_FORMAT, f"kv_format={p.kv_format} (supported: {_fmt_set(kv_formats)})")
    if head_dims is not None and (p.head_dim_qk, p.head_dim_v) not in head_dims:
        dims = ", ".join(f"{a}/{b}" for a, b in sorted(head_dims))
        add("HEAD_DIMS", R.HEAD_DIM, f"D_qk/D_v={p.head_dim_qk}/{p.head_dim_v} (supported: {dims})")
    page_sizes, max_page = get("PAGE_SIZES"), get("MAX_PAGE_SIZE")
    if page_sizes is not None and p.page_size not in page_sizes and not p.sparse:
        add("PAGE_SIZES", R.PAGE_SIZE, f"page_size={p.page_size} (supported: {_fmt_set(page_sizes)})")
    if max_page is not None and p.page_size > max_page and not p.sparse:
        add("MAX_PAGE_SIZE", R.PAGE_SIZE, f"page_size={p.page_size} (supported: <= {max_page} for dense decoding)")
    page_multiple = get("PAGE_SIZE_MULTIPLE")
    if page_multiple is not None and p.page_size % page_multiple and not p.sparse:
        add("PAGE_SIZE_MULTIPLE", R.PAGE_SIZE, f"page_size={p.page_size} (supported: multiples of {page_multiple}, "
                                               f"re-viewed as pages the kernel takes)")
    heads_q, max_heads_q, max_heads_kv, max_q_len = (get("NUM_HEADS_Q"), get("MAX_HEADS_Q"), get("MAX_HEADS_KV"),
                                                      get("MAX_Q_LEN"))
    if heads_q is not None and p.num_heads_q not in heads_q:
        add("NUM_HEADS_Q", R.HEADS, f"h_q={p.num_heads_q} (supported: {_fmt_set(heads_q)})")
    if max_heads_q is not None and p.num_heads_q > max_heads_q:
        add("MAX_HEADS_Q", R.HEADS, f"h_q={p.num_heads_q} (supported: <= {max_heads_q})")
    if max_heads_kv is not None and p.num_heads_kv > max_heads_kv:
        add("MAX_HEADS_KV", R.HEADS, f"h_kv={p.num_heads_kv} (supported: <= {max_heads_kv})")
    if max_q_len is not None and p.q_len > max_q_len:
        add("MAX_Q_LEN", R.Q_LEN, f"s_q={p.q_len} (supported: <= {max_q_len})")
    if p.causal and not get("SUPPORTS_CAUSAL"):
        add("SUPPORTS_CAUSAL", R.FEATURE, "causal=True with s_q > 1 (supported: causal=False)")
    if p.return_lse and not get("SUPPORTS_LSE"):
        add("SUPPORTS_LSE", R.FEATURE, "return_lse=True (this backend cannot return the LSE)")
    if p.sparse and not get("SUPPORTS_SPARSE"):
        add("SUPPORTS_SPARSE", R.FEATURE, f"sparse indices (topk={p.topk}) (supported: dense block_table only)")
    if not p.sparse and not get("SUPPORTS_DENSE"):
        add("SUPPORTS_DENSE", R.FEATURE, "dense block_table decode (supported: sparse indices only)")
    sparse_extras = get("SPARSE_EXTRAS")
    for extra in p.sparse_extras:
        if extra not in sparse_extras:
            supported = ", ".join(sorted(sparse_extras)) or "none"
            add("SPARSE_EXTRAS", R.FEATURE, f"{extra} with sparse indices (supported: {supported})")
    if p.batch_invariant and not get("SUPPORTS_BATCH_INVARIANT"):
        add("SUPPORTS_BATCH_INVARIANT", R.FEATURE, "batch_invariant=True (this backend's splits depend on the batch)")
    if p.cuda_graph and get("CUDA_GRAPH") is CGSupport.NEVER:
        add("CUDA_GRAPH", R.CUDA_GRAPH, "cuda_graph=True (this backend cannot be captured)")
    return out


class MLABackend:
    """Base class of every backend adapter.

    Subclasses set the class constants below, then implement :meth:`plan` and
    :meth:`run`. ``None`` means "any".
    """

    NAME: ClassVar[str] = "?"
    DESCRIPTION: ClassVar[str] = ""
    #: the vendor library whose kernels the adapter calls ("DeepSeek FlashMLA"); None for our own code. A vendor
    #: library may abort the process or fault the device on what its kernels do not run: ``conformance`` runs a
    #: vendor backend's cells in a child process (STYLE 20)
    VENDOR: ClassVar[str | None] = None
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
    #: the page sizes, the largest page and the page multiple below bound dense decoding only: a sparse kernel reads
    #: tokens by index, whatever the page
    PAGE_SIZES: ClassVar[frozenset[int] | None] = None
    MAX_PAGE_SIZE: ClassVar[int | None] = None
    #: dense page sizes must be multiples of this (the adapter re-views such a cache as the pages its kernel takes)
    PAGE_SIZE_MULTIPLE: ClassVar[int | None] = None
    NUM_HEADS_Q: ClassVar[frozenset[int] | None] = None
    MAX_HEADS_Q: ClassVar[int | None] = None
    MAX_HEADS_KV: ClassVar[int | None] = None
    MAX_Q_LEN: ClassVar[int | None] = None
    SUPPORTS_CAUSAL: ClassVar[bool] = True
    SUPPORTS_LSE: ClassVar[bool] = True
    SUPPORTS_SPARSE: ClassVar[bool] = False
    SUPPORTS_DENSE: ClassVar[bool] = True
    #: the optional sparse arguments the backend runs (names of :attr:`DecodeProblem.sparse_extras
    #: <mla_dispatch.dispatch.problem.DecodeProblem.sparse_extras>`: "topk_length", "attn_sink", "extra_kv_cache",
    #: "extra_topk_length"); :meth:`run` receives those a problem has as keywords of the same names
    SPARSE_EXTRAS: ClassVar[frozenset[str]] = frozenset()
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
    #: what the backend runs per architecture, where that is narrower than the constants above (a vendor build's
    #: kernels), and the rows of the README's support matrix (``python -m mla_dispatch info --markdown``). Empty:
    #: the constants hold everywhere, and the matrix shows one row made from them
    ARCH_SUPPORT: ClassVar[tuple[ArchSupport, ...]] = ()

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

    @classmethod
    def build(cls, *, verbose: bool = False) -> str | None:
        """Compile now what the backend would otherwise compile on its first call (``python -m mla_dispatch
        build``); returns what was built, or None where there is nothing to build (the default).

        Raises
        ------
        RuntimeError
            The build failed; the text says why (a missing compiler, a compiler error).
        """
        return None

    # -- feasibility ---------------------------------------------------------------------

    @classmethod
    def not_supported_reasons(cls, problem: DecodeProblem, platform: Platform) -> list[Reason]:
        """Every reason this backend cannot run ``problem`` on ``platform`` (empty: it can).

        The class constants are checked as narrowed on the platform's architecture by the entry of
        :attr:`ARCH_SUPPORT` that applies (:meth:`arch_support`); a reason that comes from such a narrowing names
        the entry and, where the entry says, the vendor check it mirrors.
        """
        reasons = cls.availability_reasons()
        if reasons and reasons[0].code is ReasonCode.NOT_IMPLEMENTED:
            return reasons
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
        entry = None
        if cls.ARCH_SUPPORT and not any(r.code in (R.DEVICE, R.CAPABILITY) for r in reasons):
            entry, missing = cls._arch_entry(problem, platform)
            if missing is not None:
                reasons.append(missing)
        limits = entry.limits if entry is not None else {}
        for key, reason in _table_reasons(lambda name: limits[name] if name in limits else getattr(cls, name),
                                          problem):
            if key in limits:
                source = entry.sources.get(key)
                reason = Reason(reason.code, f"{reason.message} on {entry.name}" + (f": {source}" if source else ""))
            reasons.append(reason)
        reasons.extend(cls.extra_reasons(problem, platform))
        return reasons

    @classmethod
    def arch_support(cls, problem: DecodeProblem, platform: Platform) -> ArchSupport | None:
        """The entry of :attr:`ARCH_SUPPORT` that says what this backend runs for ``problem`` on ``platform``: the
        first that matches the platform and runs the problem's kind of decode (dense or sparse); None where there is
        no such entry (or the backend declares none)."""
        return cls._arch_entry(problem, platform)[0]

    @classmethod
    def _arch_entry(cls, problem: DecodeProblem, platform: Platform) -> tuple[ArchSupport | None, Reason | None]:
        here = [e for e in cls.ARCH_SUPPORT if e.matches(platform, cls.PLATFORMS)]
        mode = "SUPPORTS_SPARSE" if problem.sparse else "SUPPORTS_DENSE"
        for e in here:
            if e.limits.get(mode, getattr(cls, mode)):
                return e, None
        where = (f"compute capability {platform.capability[0]}.{platform.capability[1]}"
                 if platform.kind == "cuda" and platform.capability is not None else f"arch={platform.arch}")
        if here:
            kind = "sparse" if problem.sparse else "dense"
            runs = [e.name for e in cls.ARCH_SUPPORT if e.limits.get(mode, getattr(cls, mode))]
            return None, Reason(ReasonCode.CAPABILITY, f"{kind} decode on {where} (supported on: "
                                                       f"{', '.join(runs) or 'none'})")
        names = ", ".join(e.name for e in cls.ARCH_SUPPORT)
        return None, Reason(ReasonCode.CAPABILITY, f"{where} (supported: {names})")

    @classmethod
    def extra_reasons(cls, problem: DecodeProblem, platform: Platform) -> list[Reason]:
        """Constraints the class constants cannot express. Default: none."""
        return []

    @classmethod
    def check_options(cls, options: Mapping[str, object] | None) -> dict[str, object]:
        """``options`` (``backend_options`` as given, or None) checked against :attr:`OPTIONS`, as a new dict.

        Whether a valid value suits the problem is the plan's to check (:meth:`plan` raises
        :class:`OptionNotSupported`).

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
        ``backend_options`` (:meth:`check_options`; a dict, empty when none were given). It raises
        :class:`OptionNotSupported` (a ValueError) for an option value that does not suit ``problem``.
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

        ``kv_cache`` is 4-D ``[num_blocks, page_size, h_kv, D or bytes]``. Must not
        allocate or sync when ``problem.cuda_graph`` is set. A sparse problem with optional arguments
        (``problem.sparse_extras``, all in :attr:`SPARSE_EXTRAS`) passes them as keywords: ``topk_length``,
        ``attn_sink``, ``extra_kv_cache`` (4-D) with ``extra_indices``, ``extra_topk_length``.
        """
        raise NotImplementedError(f"{cls.NAME}.run")


def version_of(cls: type[MLABackend]) -> str:
    """``cls.version()``, or ``"unknown (<the error>)"`` where it raises: a listing of backends (``info``,
    :func:`~mla_dispatch.dispatch.select.explain`, a ``NoBackendError``) never fails on one backend's version probe
    (a vendor library that does not import, a third-party backend's bug)."""
    try:
        return cls.version()
    except Exception as exc:
        return f"unknown ({type(exc).__name__}: {exc})"


class Unimplemented(MLABackend):
    """A registered name whose implementation is planned but not in this version."""

    IMPLEMENTED = False
