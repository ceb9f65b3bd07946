"""Host TMA descriptors over a new tensor of a known geometry, without building and validating them again.

A query tile's descriptors are made per call (q is a new tensor every layer). Triton's descriptor classes (the plain
``triton.tools.tensor_descriptor.TensorDescriptor`` and Gluon's) check shape, strides, block and layout when built:
the same checks, with the same answer, for every q of a plan's geometry. :func:`rebased` builds a descriptor once per
geometry (its checks run then) and afterwards copies it with another base: same shape, strides, block, layout and
padding, so what the checks looked at is what they passed. The base's 16-byte alignment, the one property of the new
tensor TMA needs, is the caller's to check (kernels/triton/launch.py checks it before taking a TMA path). A descriptor
class without an instance ``__dict__`` is built normally every time.
"""

from __future__ import annotations

from typing import Callable

__all__ = ["rebased"]

_TEMPLATES: dict[tuple, object] = {}  # key -> a validated descriptor whose base was dropped (nothing kept alive)
_MAX_TEMPLATES = 256


def rebased(key: tuple, base, make: Callable[[object], object]):
    """A descriptor over ``base`` equal to ``make(base)``: ``make`` runs on the first call of ``key`` (which must hold
    everything ``make`` reads from ``base`` except its address: shape, strides, dtype), a copy afterwards."""
    template = _TEMPLATES.get(key)
    if template is None:
        desc = make(base)
        if not hasattr(desc, "__dict__") or len(_TEMPLATES) >= _MAX_TEMPLATES:
            return desc
        template = object.__new__(type(desc))
        template.__dict__.update(desc.__dict__)
        template.base = None
        _TEMPLATES[key] = template
        return desc
    desc = object.__new__(type(template))
    desc.__dict__.update(template.__dict__)
    desc.base = base
    return desc
