"""A Triton kernel launched many times with arguments a plan fixed: the compiled kernel, called directly.

``kernel[grid](*args, **kwargs)`` (Triton's ``JITFunction.run``) binds every argument to the signature, computes
each one's specialization (integer divisibility, pointer alignment), builds a cache key, looks the compiled kernel
up and only then calls Triton's generated C launcher (``CompiledKernel.run``). A decode step calls the same kernel
with the same constexprs, grid, workspace and schedule on every layer; only q, the cache, out and lse (and their
strides) change. :class:`CachedLaunch` keeps the compiled kernel each specialization of those changing arguments
got from ``kernel[grid]`` and calls its launcher directly when the specialization repeats: the per-call host work
is a key of the changing arguments and one list copy. Whatever Triton would decide differently (another
specialization, another current device, a launch hook installed, the interpreter) goes through ``kernel[grid]``,
so results never depend on which path ran.

The key of an argument, what Triton specializes on (``triton.runtime.jit.create_function_from_signature`` and
``native_specialize_impl``, triton 3.6-3.9): a tensor's dtype and whether its address is 16-byte aligned; an
integer's value (a superset of Triton's ``== 1`` / ``% 16 == 0`` / 64-bit classes, so equal keys imply equal
specializations); a float's type only (Triton does not specialize floats); a tensor descriptor's base dtype and
block shape (its shape and strides are runtime values of the launch). Anything else is keyed by its value.

Used by the schedule kernel of :mod:`.schedule_triton` and the decode kernels of ``kernels/triton`` (which may
import this layer); it lives here, in the lowest layer that launches Triton kernels.
"""

from __future__ import annotations

import inspect
from typing import Any, Iterable, Sequence

import torch

__all__ = ["CachedLaunch", "spec_key"]


#: compiled kernels kept across launches (and plans) of the same kernel, options, device and specializations
_SHARED: dict[tuple, Any] = {}
_MAX_SHARED = 4096
_MISSING = object()
_KERNEL_PARAMS: dict[int, tuple] = {}


def _kernel_params(fn) -> tuple[tuple[str, ...], dict[str, int], list]:
    """``(names, index of each name, default of each parameter or _MISSING)`` of a kernel's signature, once per
    function (``inspect.signature`` takes tens of µs)."""
    info = _KERNEL_PARAMS.get(id(fn))
    if info is None:
        params = inspect.signature(fn).parameters
        names = tuple(params)
        defaults = [_MISSING if p.default is inspect.Parameter.empty else p.default for p in params.values()]
        info = _KERNEL_PARAMS[id(fn)] = (names, {n: i for i, n in enumerate(names)}, defaults)
    return info


def spec_key(value: Any):
    """What Triton's specialization of ``value`` depends on (see the module docstring), as a hashable key."""
    kind = type(value)
    if kind is int or kind is bool or value is None:
        return value
    if kind is torch.Tensor or isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() & 15 == 0
    if kind is float:
        return float
    block = getattr(value, "block_shape", None)
    if block is not None:  # a host tensor descriptor (triton.tools.tensor_descriptor or Gluon's)
        return kind, value.base.dtype, tuple(block), id(getattr(value, "layout", None))
    return value


def _address(value):
    """A CUDA tensor's address (``data_ptr()``), anything else as it is: a launch argument as the kept kernel's
    launcher takes it (:class:`CachedLaunch`). A host tensor stays a tensor: Triton's launcher then says what is wrong
    with it, as for any launch (an address would reach the kernel unchecked)."""
    return value.data_ptr() if isinstance(value, torch.Tensor) and value.is_cuda else value


_runtime_knobs: list = []  # [triton.knobs.runtime] once resolved ([None]: this Triton has no knobs)


def _hooks_installed() -> bool:
    """Whether a launch hook (a profiler's) is installed: then every launch goes through ``kernel[grid]``."""
    if not _runtime_knobs:
        try:
            from triton import knobs
        except ImportError:  # older Triton: no knobs, no hooks to honour here
            _runtime_knobs.append(None)
        else:
            _runtime_knobs.append(knobs.runtime)
    runtime = _runtime_knobs[0]
    return runtime is not None and (_active(runtime.launch_enter_hook) or _active(runtime.launch_exit_hook))


def _active(hook) -> bool:
    """Whether ``hook`` does anything: triton 3.9 keeps an empty ``HookChain`` where no hook is installed."""
    return hook is not None and bool(getattr(hook, "calls", True))


class CachedLaunch:
    """``kernel[grid](**args, **options)`` over and over, with the arguments named in ``varying`` given per call.

    Parameters
    ----------
    kernel
        A ``triton.jit`` (or Gluon) function.
    grid : tuple of int
        The launch grid (one to three dimensions).
    args : dict
        Every argument the plan fixes, by parameter name (constexprs included); parameters with defaults may be
        left out.
    varying : sequence of str
        Parameter names given to each call, in order (not in ``args``).
    options : dict
        Launch options (``num_warps``, ``num_stages``, ``maxnreg``, ...), as ``kernel[grid]`` takes them.
    device_index : int or None
        The CUDA device of the tensors (Triton launches on the current device): a call on another current device
        takes ``kernel[grid]`` under a device guard. None: no device (Triton's interpreter on a CPU).

    Raises
    ------
    ValueError
        A name that is not a parameter of ``kernel``, a varying name also in ``args``, or a parameter with no
        default left out of both.
    """

    __slots__ = ("kernel", "grid", "options", "device_index", "_names", "_template", "_slots", "_slot_of",
                 "_compiled", "_grid3", "_fixed_key", "_addresses")

    def __init__(self, kernel, grid: Sequence[int], args: dict[str, Any], varying: Sequence[str],
                 options: dict[str, Any] | None = None, device_index: int | None = None) -> None:
        self.kernel = kernel
        self.grid = tuple(grid)
        self._grid3 = (self.grid + (1, 1))[:3]
        self.options = dict(options or {})
        self.device_index = device_index
        fn = getattr(kernel, "fn", kernel)
        names, index, defaults = _kernel_params(fn)
        unknown = [n for n in (*args, *varying) if n not in index]
        if unknown:
            raise ValueError(f"{getattr(fn, '__name__', kernel)!r} has no parameter(s) {unknown} "
                             f"(parameters: {', '.join(names)})")
        both = sorted(set(args) & set(varying))
        if both:
            raise ValueError(f"parameters {both} are both fixed (args) and varying")
        template = defaults.copy()
        for name, value in args.items():
            template[index[name]] = value
        self._slots = tuple(index[n] for n in varying)
        for slot in self._slots:
            template[slot] = None
        missing = [names[i] for i, v in enumerate(template) if v is _MISSING]
        if missing:
            raise ValueError(f"parameter {missing[0]!r} of {getattr(fn, '__name__', kernel)!r} is neither fixed nor "
                             "varying and has no default")
        self._names = names
        self._template = template
        # what the kept kernel's launcher is given: each CUDA tensor as its address. Triton's generated launcher calls a
        # tensor argument's data_ptr() and asks the driver about that address (cuPointerGetAttribute, triton 3.6-3.9
        # driver getPointer) on every launch; an int it takes as the address as it is. The fixed tensors' addresses
        # are taken here (a plan's buffers keep theirs), the varying ones' per call.
        self._addresses = [_address(v) for v in template]
        self._slot_of = dict(zip(varying, self._slots))
        self._compiled: dict[tuple, Any] = {}
        self._fixed_key = None

    def _bound(self, values: Iterable[Any], addresses: bool = False) -> list:
        """Every argument, the varying ``values`` in their slots; ``addresses``: as the kept kernel's launcher takes
        them (CUDA tensors as their addresses, :func:`_address`)."""
        bound = (self._addresses if addresses else self._template).copy()
        for slot, value in zip(self._slots, values):
            bound[slot] = _address(value) if addresses else value
        return bound

    def _shared_key(self, key: tuple) -> tuple:
        """The key of a compiled kernel in the process-wide cache: the kernel, its options, its device and the
        specialization of every argument (the fixed ones computed once, on the first launch that needs them)."""
        if self._fixed_key is None:
            fixed = tuple(spec_key(v) for i, v in enumerate(self._template) if i not in self._slots)
            self._fixed_key = (id(self.kernel), tuple(sorted(self.options.items())), self.device_index, fixed)
        return self._fixed_key + (self._slots, key)

    def slow(self, *values):
        """``kernel[grid]`` with these varying values (under a device guard), keeping the compiled kernel it
        returns; returns Triton's launch handle."""
        bound = self._bound(values)
        if self.device_index is not None:
            with torch.cuda.device(self.device_index):
                handle = self.kernel[self.grid](*bound, **self.options)
        else:
            handle = self.kernel[self.grid](*bound, **self.options)
        if hasattr(handle, "packed_metadata") and hasattr(handle, "function"):  # a CompiledKernel (not the interpreter)
            key = tuple(map(spec_key, values))
            self._compiled[key] = handle
            if len(_SHARED) < _MAX_SHARED:
                _SHARED[self._shared_key(key)] = handle
        return handle

    def __call__(self, *values) -> None:
        """Launch with the varying arguments ``values`` (in the order ``varying`` named them), on the current
        stream; no allocation, no host synchronisation."""
        if self.device_index is None:  # the interpreter (a CPU): kernel[grid] every time
            self.slow(*values)
            return
        key = tuple(map(spec_key, values))
        compiled = self._compiled.get(key)
        if compiled is None:  # another plan of the same kernel and specialization may have it compiled
            compiled = _SHARED.get(self._shared_key(key))
            if compiled is not None:
                self._compiled[key] = compiled
        if compiled is None or torch.cuda.current_device() != self.device_index or _hooks_installed():
            self.slow(*values)
            return
        g0, g1, g2 = self._grid3
        compiled.run(g0, g1, g2, torch._C._cuda_getCurrentRawStream(self.device_index), compiled.function,
                     compiled.packed_metadata, None, None, None, *self._bound(values, addresses=True))

    def call(self, values: dict) -> None:
        """:meth:`__call__` with the varying arguments by name (every name of ``varying``; KeyError for a missing
        one)."""
        self(*[values[name] for name in self._slot_of])

    @property
    def compiled_variants(self) -> int:
        """How many specializations have a compiled kernel kept (for tests and profiles)."""
        return len(self._compiled)
