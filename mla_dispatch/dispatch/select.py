"""Which backend runs a problem: preference (a pure function) apart from feasibility.

:func:`priority` orders candidate names for a (problem, platform) pair; each
backend's ``not_supported_reasons`` says whether it can run. The first
candidate with no reason wins, and the choice is cached on the frozen problem
(xformers ``ops/fmha/dispatch.py``; vLLM ``attention/selector.py``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
from typing import Iterator, Mapping, Sequence

import torch

from mla_dispatch.dispatch.backend import MLABackend, Reason, version_of
from mla_dispatch.dispatch.platform import Platform, platform_for, platform_key
from mla_dispatch.dispatch.problem import DecodeProblem
from mla_dispatch.dispatch import tuned
from mla_dispatch.dispatch.registry import default_order, get_backend, registered_names
from mla_dispatch.dispatch.tuned import lookup_ranking, shape_bucket

__all__ = [
    "priority",
    "select_backend",
    "explain",
    "SelectionReport",
    "NoBackendError",
    "use_backends",
    "auto_candidates",
]

logger = logging.getLogger("mla_dispatch")

_OVERRIDE: contextvars.ContextVar[tuple[tuple[str, ...], bool] | None] = contextvars.ContextVar(
    "mla_dispatch_backends", default=None
)


def priority(problem: DecodeProblem, platform: Platform,
             table: Mapping[str, str | tuple[str, ...]] | None = None) -> tuple[str, ...]:
    """Candidate backend names for ``problem`` on ``platform``, best first. Pure.

    ``table`` maps a shape bucket (:func:`mla_dispatch.dispatch.tuned.shape_bucket`) to the backends measured
    fastest on this device, best first (or to the one fastest); the entry for the problem's bucket, or the nearest
    measured size of its shape class (:func:`~mla_dispatch.dispatch.tuned.lookup_ranking`), goes first, in its
    order, and the rest follow in the default order. The default order comes from the priorities
    registered with each backend (:func:`mla_dispatch.dispatch.registry.default_order`):
    third-party backends that declare none go just before ``reference``; a
    backend whose priority omits the platform (``amla_emulation``) is never a
    candidate for "auto". A ``batch_invariant`` problem ignores the table (its choice
    would change with the batch, and two backends round differently).
    """
    order = default_order(platform_key(platform))
    # a batch-invariant problem keeps one backend whatever the batch: the table's winner depends on the batch
    if table and not problem.batch_invariant:
        ranked = [name for name in lookup_ranking(table, problem) if name in order]
        order = tuple(ranked) + tuple(name for name in order if name not in ranked)
    return tuple(order)


@dataclasses.dataclass(frozen=True)
class SelectionReport:
    """Each candidate considered, in order, with its reasons (empty = can run); ``order`` says which table or rule
    put them in that order (empty where the caller named the candidates)."""

    problem: DecodeProblem
    platform: Platform
    candidates: tuple[tuple[str, str, tuple[Reason, ...]], ...]  # (name, version, reasons)
    order: str = ""

    @property
    def chosen(self) -> str | None:
        for name, _, reasons in self.candidates:
            if not reasons:
                return name
        return None

    def format(self) -> str:
        lines = ["problem:", self.problem.describe(), f"platform: {self.platform.describe()}"]
        if self.order:
            lines.append(f"order: {self.order}")
        lines.append("candidates:")
        for name, version, reasons in self.candidates:
            if not reasons:
                lines.append(f"  - {name}@{version}: can run")
            else:
                lines.append(f"  - {name}@{version}: " + "; ".join(str(r) for r in reasons))
        return "\n".join(lines)


class NoBackendError(NotImplementedError):
    """No backend can run the problem. ``report`` holds every candidate's reasons."""

    def __init__(self, report: SelectionReport, header: str = "No MLA decode backend supports this problem"):
        self.report = report
        super().__init__(f"{header}:\n{report.format()}\n(see: python -m mla_dispatch info)")


def _active_candidates(problem: DecodeProblem, platform: Platform) -> tuple[str, ...]:
    order = priority(problem, platform, tuned.active_ranking(platform))
    override = _OVERRIDE.get()
    if override is not None:
        names, reorder = override
        if reorder:
            order = tuple(names) + tuple(n for n in order if n not in names)
        else:
            order = tuple(n for n in order if n in names)
    return order


def explain(problem: DecodeProblem, platform: Platform | None = None,
            candidates: Sequence[str] | None = None) -> SelectionReport:
    """Every candidate (default: the active priority order) with its reasons, for this problem.

    ``platform`` defaults to the current device of ``problem.device_type``.
    ``print(explain(p).format())`` shows the same text a ``NoBackendError`` would, with the line that says which
    table or rule ordered the candidates (the user's measured table, the one shipped for this device, one
    transferred from another device, or the default order).
    """
    if platform is None:
        platform = platform_for(torch.device(problem.device_type))
    order = ""
    if candidates is None:
        names = _active_candidates(problem, platform)
        order = tuned.explain_order(problem, platform)
        override = _OVERRIDE.get()
        if override is not None:
            how = "tried first, in this order" if override[1] else "the only candidates"
            order += f"; then use_backends({', '.join(map(repr, override[0]))}): {how}"
    else:
        names = tuple(candidates)
    rows = []
    for name in names:
        cls = get_backend(name)
        rows.append((name, version_of(cls), tuple(cls.not_supported_reasons(problem, platform))))
    return SelectionReport(problem, platform, tuple(rows), order)


@functools.lru_cache(maxsize=1024)
def _select_cached(problem: DecodeProblem, platform: Platform, backend: str, override, table_token) -> str:
    if backend != "auto":
        cls = get_backend(backend)  # ValueError for unknown names
        reasons = cls.not_supported_reasons(problem, platform)
        if reasons:
            report = SelectionReport(problem, platform, ((backend, version_of(cls), tuple(reasons)),))
            raise NoBackendError(report, header=f"Backend {backend!r} was requested but cannot run this problem")
        return backend
    for name in _active_candidates(problem, platform):
        if not get_backend(name).not_supported_reasons(problem, platform):
            logger.info("mla_dispatch: %s selected for %s", name, shape_bucket(problem))
            return name
    raise NoBackendError(explain(problem, platform))


def select_backend(problem: DecodeProblem, platform: Platform, backend: str = "auto") -> type[MLABackend]:
    """The backend class that will run ``problem`` (cached on the frozen problem).

    Raises
    ------
    NoBackendError
        No candidate can run it, or the explicitly named ``backend`` cannot
        (never a silent fallback).
    ValueError
        ``backend`` is not a registered name.
    """
    tuned.active_decision(platform)  # decides the measured table at the first selection on this platform
    name = _select_cached(problem, platform, backend, _OVERRIDE.get(), tuned.state_token())
    return get_backend(name)


def clear_selection_cache() -> None:
    _select_cached.cache_clear()


@contextlib.contextmanager
def use_backends(*names: str, reorder: bool = False) -> Iterator[None]:
    """Restrict (default) or reorder the candidates inside a ``with`` block.

    ``use_backends("triton", "reference")`` considers only those two, in the
    platform's order; with ``reorder=True`` they are tried first, in the given
    order, and the others after. Scoped with contextvars: threads and asyncio
    tasks do not see each other's choice.

    Raises
    ------
    ValueError
        A name is not registered.
    """
    known = registered_names()
    for n in names:
        if n not in known:
            raise ValueError(f"unknown backend {n!r} (registered: {', '.join(known)})")
    token = _OVERRIDE.set((tuple(names), reorder))
    try:
        yield
    finally:
        _OVERRIDE.reset(token)


def auto_candidates(platform: Platform) -> list[type[MLABackend]]:
    """The backend classes ``backend="auto"`` may choose on ``platform`` (best first, before any measured table).

    Conformance-only backends (``amla_emulation``) are not among them.
    """
    # priority() reads only the platform when no measured table is passed; any problem will do.
    probe = DecodeProblem(batch=1, q_len=1, num_heads_q=1, num_heads_kv=1, head_dim_qk=576, head_dim_v=512,
                          page_size=1, max_blocks=1, q_dtype=torch.bfloat16, kv_format="bf16", causal=False,
                          topk=0, return_lse=True, device_type=platform.kind)
    return [get_backend(name) for name in priority(probe, platform)]
