"""What accelerator is this?  One stateless function, :func:`detect_platform`,
is the only place in mla_dispatch that asks the hardware; tests replace it to
simulate every platform on a CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os

import torch

__all__ = ["Platform", "detect_platform", "platform_for", "platform_key", "KINDS", "PLATFORM_KEYS"]

KINDS = ("cuda", "rocm", "npu", "cpu")
#: The rows of the backends' default preference (:func:`platform_key`): Hopper and Blackwell apart from other CUDA GPUs.
PLATFORM_KEYS = ("sm90", "sm100", "cuda", "rocm", "npu", "cpu")


@dataclasses.dataclass(frozen=True)
class Platform:
    """The device a problem runs on.

    Attributes
    ----------
    kind : str
        ``"cuda"`` (NVIDIA), ``"rocm"`` (AMD under ROCm; torch calls it "cuda"
        too), ``"npu"`` (Huawei Ascend via torch_npu) or ``"cpu"``.
    name : str
        The device's marketing name (``"NVIDIA H100 80GB HBM3"``) or ``"cpu"``.
    capability : tuple[int, int] | None
        CUDA compute capability (``(9, 0)`` for Hopper, ``(10, 0)`` for B200);
        None elsewhere.
    arch : str
        ``"sm_90"``, ``"gfx942"`` (MI300X), ``"Ascend910B"``, ``"cpu"``.
    num_compute_units : int
        SMs, CUs or AI cores (CPU: logical cores).
    notes : tuple[str, ...]
        Facts about why an accelerator was *not* found (e.g. torch_npu failed to
        import); shown by ``info``.
    """

    kind: str
    name: str
    capability: tuple[int, int] | None
    arch: str
    num_compute_units: int
    notes: tuple[str, ...] = ()

    def describe(self) -> str:
        cap = f" capability {self.capability[0]}.{self.capability[1]}" if self.capability else ""
        return f"{self.kind}: {self.name} ({self.arch}{cap}, {self.num_compute_units} compute units)"


def _cpu_platform(notes: tuple[str, ...] = ()) -> Platform:
    return Platform(kind="cpu", name="cpu", capability=None, arch="cpu", num_compute_units=os.cpu_count() or 1, notes=notes)


def _npu_probe() -> tuple[object | None, str | None]:
    """Import torch_npu if it is installed; an import failure (no CANN) is a note, not a crash."""
    if importlib.util.find_spec("torch_npu") is None:
        return None, None
    try:
        import torch_npu  # noqa: F401  (registers the "npu" device)
    except Exception as exc:  # ImportError without CANN, OSError for missing .so, ...
        return None, f"torch_npu is installed but failed to import: {type(exc).__name__}: {exc}"
    return torch_npu, None


def detect_platform(device: torch.device | str | None = None) -> Platform:
    """Describe ``device`` (default: the best accelerator present, else the CPU).

    This is the only function that queries drivers. It never raises for a
    missing or broken vendor stack: those become ``notes``.
    """
    device = torch.device(device) if device is not None else None
    dtype = device.type if device is not None else None
    if dtype == "cpu":
        return _cpu_platform()
    if dtype in (None, "cuda") and torch.cuda.is_available():
        index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        if torch.version.hip is not None:
            arch = getattr(props, "gcnArchName", "gfx").split(":")[0]
            return Platform("rocm", props.name, None, arch, props.multi_processor_count)
        cap = (props.major, props.minor)
        return Platform("cuda", props.name, cap, f"sm_{props.major}{props.minor}", props.multi_processor_count)
    notes: tuple[str, ...] = ()
    if dtype in (None, "npu"):
        torch_npu, note = _npu_probe()
        if torch_npu is not None and torch.npu.is_available():  # type: ignore[attr-defined]
            index = device.index if device is not None and device.index is not None else torch.npu.current_device()  # type: ignore[attr-defined]
            name = torch.npu.get_device_name(index)  # type: ignore[attr-defined]
            cores = getattr(torch.npu.get_device_properties(index), "cube_core_num", 0) or 1  # type: ignore[attr-defined]
            arch = "Ascend910B" if "910B" in name else ("Ascend910C" if "910C" in name or "910_93" in name else name)
            return Platform("npu", name, None, arch, cores)
        if note:
            notes = (note,)
    if dtype not in (None, "cpu", "cuda", "npu"):
        notes = notes + (f"device type {dtype!r} is not one mla_dispatch knows",)
    if dtype == "cuda":
        notes = notes + ("a cuda device was named but torch.cuda.is_available() is False",)
    return _cpu_platform(notes)


@functools.lru_cache(maxsize=64)
def _platform_cached(device_type: str, index: int | None) -> Platform:
    return detect_platform(torch.device(device_type, index) if index is not None else torch.device(device_type))


def platform_for(device: torch.device) -> Platform:
    """Cached :func:`detect_platform` for a tensor's device (hot path)."""
    return _platform_cached(device.type, device.index)


platform_for.cache_clear = _platform_cached.cache_clear  # type: ignore[attr-defined]


def platform_key(platform: Platform) -> str:
    """The row of the backends' default preference a platform uses (one of :data:`PLATFORM_KEYS`)."""
    if platform.kind == "cuda" and platform.capability is not None:
        major = platform.capability[0]
        if major == 9:
            return "sm90"
        if major >= 10:
            return "sm100"
    return platform.kind
