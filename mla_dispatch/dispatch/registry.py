"""The backend registry: names, lazily imported classes, third-party entry points.

Backends are registered by name with the dotted path of their class, and are
imported only when first considered (vLLM ``attention/backends/registry.py``):
importing mla_dispatch on an Ascend box never imports Triton or a CUDA
extension. Third-party packages add backends through the entry-point group
``mla_dispatch.backends``; each entry point names a backend class (or a
callable returning one).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from importlib import metadata as importlib_metadata

from mla_dispatch.dispatch.backend import MLABackend, Reason, ReasonCode, Unimplemented
from mla_dispatch.dispatch.platform import PLATFORM_KEYS

__all__ = ["BackendSpec", "register_backend", "get_backend", "backend_qualname", "registered_names", "default_order",
           "load_entry_points", "ENTRY_POINT_GROUP", "LAST"]

logger = logging.getLogger("mla_dispatch")

ENTRY_POINT_GROUP = "mla_dispatch.backends"


#: Rank of the reference backend on every platform: after every other candidate.
LAST = 1000


@dataclasses.dataclass(frozen=True)
class BackendSpec:
    """A registered backend: its name, where its class lives (``"pkg.module:Class"``) and its default preference.

    ``priority`` maps a platform key (:func:`mla_dispatch.dispatch.platform.platform_key`: ``"sm90"``,
    ``"sm100"``, ``"cuda"``, ``"rocm"``, ``"npu"``, ``"cpu"``) to a rank, lower first; on a platform it does not
    name, the backend is never a candidate of ``backend="auto"`` (it still runs when named). ``None`` (third-party
    backends that declare nothing): a candidate on every platform, just before the reference.
    """

    name: str
    qualname: str
    priority: dict[str, int] | None = None


_SPECS: dict[str, BackendSpec] = {}
_CLASSES: dict[str, type[MLABackend]] = {}
_entry_points_loaded = False


_KEEP = object()


def register_backend(name: str, qualname: str | type[MLABackend], *, priority=_KEEP, replace: bool = False) -> None:
    """Register ``name``; ``qualname`` is ``"module:Class"`` (imported lazily) or the class itself.

    ``priority``: {platform key: rank} (see :class:`BackendSpec`); when replacing a backend and not given, the
    replaced one's is kept, otherwise it defaults to None (a candidate everywhere, before the reference).

    Raises
    ------
    ValueError
        If ``name`` is taken and ``replace`` is False, or a priority names an unknown platform key.
    """
    if name in _SPECS and not replace:
        raise ValueError(f"backend {name!r} is already registered (as {_SPECS[name].qualname}); pass replace=True")
    if priority is _KEEP:
        priority = _SPECS[name].priority if name in _SPECS else None
    if priority is not None:
        unknown = set(priority) - set(PLATFORM_KEYS)
        if unknown:
            raise ValueError(f"priority of backend {name!r} names {sorted(unknown)} (platform keys: {PLATFORM_KEYS})")
        priority = dict(priority)
    if isinstance(qualname, type):
        _SPECS[name] = BackendSpec(name, f"{qualname.__module__}:{qualname.__qualname__}", priority)
        _CLASSES[name] = qualname
    else:
        _SPECS[name] = BackendSpec(name, qualname, priority)
        _CLASSES.pop(name, None)


def unregister_backend(name: str) -> None:
    """Remove ``name`` (tests and plugins that replace a backend)."""
    _SPECS.pop(name, None)
    _CLASSES.pop(name, None)


def backend_qualname(name: str) -> str:
    """Where backend ``name``'s class lives (``"module:Class"``), without importing it.

    Raises
    ------
    ValueError
        If no backend of that name is registered.
    """
    load_entry_points()
    spec = _SPECS.get(name)
    if spec is None:
        raise ValueError(f"unknown backend {name!r} (registered: {', '.join(_SPECS)})")
    return spec.qualname


def registered_names() -> tuple[str, ...]:
    """All registered backend names, built-in first, in registration order."""
    load_entry_points()
    return tuple(_SPECS)


def default_order(key: str) -> tuple[str, ...]:
    """The candidates of ``backend="auto"`` on platforms of ``key``, best first, from the registered priorities."""
    load_entry_points()
    ranked = []
    for i, spec in enumerate(_SPECS.values()):
        if spec.priority is None:
            ranked.append((LAST - 1, i, spec.name))
        elif key in spec.priority:
            ranked.append((spec.priority[key], i, spec.name))
    return tuple(name for _, _, name in sorted(ranked))


class _ImportFailed(MLABackend):
    """Stands in for a backend whose adapter module itself failed to import."""

    IMPLEMENTED = True


def get_backend(name: str) -> type[MLABackend]:
    """The backend class registered as ``name``, imported on first use.

    An adapter module that fails to import yields a stand-in class whose only
    reason is the import error's text; it is never selected.

    Raises
    ------
    ValueError
        If no backend of that name is registered (the message lists the names).
    """
    cls = _CLASSES.get(name)
    if cls is not None:
        return cls
    load_entry_points()
    spec = _SPECS.get(name)
    if spec is None:
        raise ValueError(f"unknown backend {name!r} (registered: {', '.join(_SPECS)})")
    module_name, _, attr = spec.qualname.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:  # the adapter exists but one of its imports is missing
            cls = _failed(name, f"adapter {spec.qualname} failed to import: {type(exc).__name__}: {exc}")
        else:  # a planned backend whose adapter is not written yet
            cls = type(f"Planned_{name}", (Unimplemented,), {"NAME": name})
    except Exception as exc:
        cls = _failed(name, f"adapter {spec.qualname} failed to import: {type(exc).__name__}: {exc}")
    _CLASSES[name] = cls
    return cls


def _failed(name: str, message: str) -> type[MLABackend]:
    logger.debug(message)
    return type(f"ImportFailed_{name}", (_ImportFailed,), {"NAME": name, "_availability_cache": [Reason(ReasonCode.UNAVAILABLE, message)]})


def load_entry_points(group: str = ENTRY_POINT_GROUP) -> None:
    """Register third-party backends advertised under ``group`` (once per process).

    A name that collides with a registered backend is an error, logged and
    skipped (not silently replacing a built-in).
    """
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    try:
        eps = importlib_metadata.entry_points(group=group)
    except Exception as exc:  # a broken distribution's metadata must not break import
        logger.warning("could not read entry points %s: %s", group, exc)
        return
    for ep in eps:
        if ep.name in _SPECS:
            logger.error("entry point %s=%s ignored: backend %r is already registered", ep.name, ep.value, ep.name)
            continue
        _SPECS[ep.name] = BackendSpec(ep.name, ep.value)


def _reset_entry_points() -> None:
    """Forget that entry points were loaded (tests)."""
    global _entry_points_loaded
    _entry_points_loaded = False


# Built-in backends: class path and default preference per platform (rank, lower first). This table is the one
# place a built-in backend is registered: docs/adding-a-backend.md. An adapter module that does not exist yet makes
# its name a planned backend that reports "not implemented in this version" and is never selected.
_EVERYWHERE = {key: LAST for key in PLATFORM_KEYS}
BUILTIN_BACKENDS = {
    "reference": ("mla_dispatch.backends.reference:ReferenceBackend", _EVERYWHERE),
    "cuda_sm90": ("mla_dispatch.backends.cuda_sm90:CudaSM90Backend", {"sm90": 10}),
    "flashmla": ("mla_dispatch.backends.flashmla:FlashMLABackend", {"sm90": 20}),
    "fa3": ("mla_dispatch.backends.fa3:FA3Backend", {"sm90": 25}),
    "flashinfer": ("mla_dispatch.backends.flashinfer:FlashInferBackend", {"sm90": 30, "sm100": 10, "cuda": 20}),
    "triton": ("mla_dispatch.backends.triton:TritonBackend", {"sm90": 40, "sm100": 20, "cuda": 10, "rocm": 20}),
    "aiter": ("mla_dispatch.backends.aiter:AiterBackend", {"rocm": 10}),
    "ascend_amla": ("mla_dispatch.backends.ascend_amla:AscendAMLABackend", {"npu": 10}),
    "torch_npu": ("mla_dispatch.backends.torch_npu:TorchNpuBackend", {"npu": 20}),
    # Conformance-only: the bit-faithful AMLA emulation, never chosen by "auto".
    "amla_emulation": ("mla_dispatch.backends.amla_emulation:AMLAEmulationBackend", {}),
}
for _name, (_qualname, _priority) in BUILTIN_BACKENDS.items():
    register_backend(_name, _qualname, priority=_priority)
