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

__all__ = ["BackendSpec", "register_backend", "get_backend", "registered_names", "load_entry_points", "ENTRY_POINT_GROUP"]

logger = logging.getLogger("mla_dispatch")

ENTRY_POINT_GROUP = "mla_dispatch.backends"


@dataclasses.dataclass(frozen=True)
class BackendSpec:
    """A registered backend: its name and where its class lives (``"pkg.module:Class"``)."""

    name: str
    qualname: str


_SPECS: dict[str, BackendSpec] = {}
_CLASSES: dict[str, type[MLABackend]] = {}
_entry_points_loaded = False


def register_backend(name: str, qualname: str | type[MLABackend], *, replace: bool = False) -> None:
    """Register ``name``; ``qualname`` is ``"module:Class"`` (imported lazily) or the class itself.

    Raises
    ------
    ValueError
        If ``name`` is taken and ``replace`` is False.
    """
    if name in _SPECS and not replace:
        raise ValueError(f"backend {name!r} is already registered (as {_SPECS[name].qualname}); pass replace=True")
    if isinstance(qualname, type):
        _SPECS[name] = BackendSpec(name, f"{qualname.__module__}:{qualname.__qualname__}")
        _CLASSES[name] = qualname
    else:
        _SPECS[name] = BackendSpec(name, qualname)
        _CLASSES.pop(name, None)


def unregister_backend(name: str) -> None:
    """Remove ``name`` (tests and plugins that replace a backend)."""
    _SPECS.pop(name, None)
    _CLASSES.pop(name, None)


def registered_names() -> tuple[str, ...]:
    """All registered backend names, built-in first, in registration order."""
    load_entry_points()
    return tuple(_SPECS)


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


# Built-in backends, in no particular order (preference is select.priority's job).
# An adapter module that does not exist yet makes its name a planned backend that
# reports "not implemented in this version" and is never selected.
BUILTIN_BACKENDS = {
    "reference": "mla_dispatch.backends.reference:ReferenceBackend",
    "triton": "mla_dispatch.backends.triton:TritonBackend",
    "cuda_sm90": "mla_dispatch.backends.cuda_sm90:CudaSM90Backend",
    "flashmla": "mla_dispatch.backends.flashmla:FlashMLABackend",
    "flashinfer": "mla_dispatch.backends.flashinfer:FlashInferBackend",
    "aiter": "mla_dispatch.backends.aiter:AiterBackend",
    "ascend_amla": "mla_dispatch.backends.ascend_amla:AscendAMLABackend",
    "torch_npu": "mla_dispatch.backends.torch_npu:TorchNpuBackend",
    # Conformance-only: the bit-faithful AMLA emulation, never chosen by "auto".
    "amla_emulation": "mla_dispatch.backends.amla_emulation:AMLAEmulationBackend",
}
for _name, _qualname in BUILTIN_BACKENDS.items():
    register_backend(_name, _qualname)
