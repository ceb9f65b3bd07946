"""What a GPU can do, by name: peak memory bandwidth and dense bf16 tensor throughput from the vendor's spec sheets.

Selection uses these only to carry a table measured on one device to another of the same architecture
(:mod:`mla_dispatch.dispatch.transfer`): what matters there is the *ratio* of two devices' peaks, which the spec
sheets give well (the H100 and H200 copy and matmul ceilings ``bench`` measured, 3.00 / 4.25 TB/s and 696 / 682
TFLOP/s, stand in the same ratios as their sheets' 3.35 / 4.8 TB/s and 989 / 989 TFLOP/s within 1.5%). They are
never reported as measurements.

Sources: NVIDIA's datasheets for H100 (SXM5, PCIe, NVL), H200 (SXM, NVL) and GH200 (dense = half the "with
sparsity" figure); for the export variants, NVIDIA's figures as publicly reported (the H800 keeps the H100's
compute and memory and cuts NVLink; the H20 has 4.0 TB/s of HBM3 and 148 TFLOP/s dense bf16 on 78 SMs). A device
not listed here is treated by :func:`mla_dispatch.dispatch.transfer.assumed_peaks`.
"""

from __future__ import annotations

import dataclasses
import re

from mla_dispatch.dispatch.platform import Platform

__all__ = ["DevicePeaks", "KNOWN_DEVICES", "device_peaks"]


@dataclasses.dataclass(frozen=True)
class DevicePeaks:
    """One device's spec-sheet peaks. ``bytes_per_s``: HBM bandwidth; ``flops_per_s``: dense bf16 tensor-core
    throughput; ``sms``: streaming multiprocessors of the full part; ``name``: the spec-sheet entry it came from
    (with what was adjusted, e.g. a MIG slice's share of SMs)."""

    name: str
    bytes_per_s: float
    flops_per_s: float
    sms: int

    def describe(self) -> str:
        return f"{self.name}: {self.bytes_per_s / 1e12:g} TB/s, {self.flops_per_s / 1e12:g} TFLOP/s"


def _gpu(name: str, tb_per_s: float, tflops: float, sms: int) -> DevicePeaks:
    return DevicePeaks(name, tb_per_s * 1e12, tflops * 1e12, sms)


#: (pattern on the upper-cased device name, peaks), most specific first: torch reports e.g. "NVIDIA H100 80GB
#: HBM3", "NVIDIA H100 PCIe", "NVIDIA H200", "NVIDIA H200 NVL", "NVIDIA H20", "NVIDIA GH200 480GB".
KNOWN_DEVICES: tuple[tuple[str, DevicePeaks], ...] = (
    (r"\bGH200\b.*(144G|HBM3E)", _gpu("GH200 144GB HBM3e", 4.9, 989, 132)),
    (r"\bGH200\b", _gpu("GH200 96GB HBM3", 4.0, 989, 132)),
    (r"\bH200\b.*\bNVL\b", _gpu("H200 NVL", 4.8, 835, 132)),
    (r"\bH200\b", _gpu("H200 SXM", 4.8, 989, 132)),
    (r"\bH20\b", _gpu("H20", 4.0, 148, 78)),
    (r"\bH800\b.*\bPCIE\b", _gpu("H800 PCIe", 2.0, 756, 114)),
    (r"\bH800\b", _gpu("H800 SXM", 3.35, 989, 132)),
    (r"\bH100\b.*\bPCIE\b", _gpu("H100 PCIe", 2.0, 756, 114)),
    (r"\bH100\b.*\bNVL\b", _gpu("H100 NVL", 3.9, 835, 132)),
    (r"\bH100\b", _gpu("H100 SXM", 3.35, 989, 132)),
)


def device_peaks(platform: Platform) -> DevicePeaks | None:
    """The spec-sheet peaks of ``platform``'s device, or None for a device not in :data:`KNOWN_DEVICES` (and for
    anything but a CUDA GPU). A part with fewer SMs than its sheet says (a MIG slice) gets that share of the
    compute; its bandwidth is left as the sheet's."""
    if platform.kind != "cuda":
        return None
    name = platform.name.upper()
    for pattern, peaks in KNOWN_DEVICES:
        if re.search(pattern, name):
            units = platform.num_compute_units
            if 0 < units < peaks.sms:
                return DevicePeaks(f"{peaks.name} with {units} of {peaks.sms} SMs", peaks.bytes_per_s,
                                   peaks.flops_per_s * units / peaks.sms, units)
            return peaks
    return None
