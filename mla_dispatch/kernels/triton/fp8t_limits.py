"""What the kernel dispatcher (:mod:`.decode`) and the tokens-on-M fp8 kernel (:mod:`.gluon_fp8`) both need to know
of that kernel: its row limit and its switch. A module of its own, so the dispatcher decides without importing Gluon
and the kernel does not import the dispatcher."""

from __future__ import annotations

import os

__all__ = ["FP8T_MAX_ROWS", "fp8t_enabled"]

#: fp8_e4m3 caches with at most this many query rows take the tokens-on-M Gluon kernel (:mod:`.gluon_fp8`) instead,
#: under the same config (its launch is chosen in :func:`.decode.launch_decode_kernel`); ``MLA_TRITON_FP8T=0`` switches
#: it off. H100, b=64 L=8K, graph µs (2026-11-23, twenty-third session, calls 7 / 10): h16 140.9 / 144.8 vs 292.8 (the
#: plain 16-row config), h32 157.7 / 159.5 vs 305.8 (gluon_sm90); kernels/triton/NOTES.md, "fp8_e4m3 with tokens on M".
FP8T_MAX_ROWS = 32


def fp8t_enabled() -> bool:
    """Whether the tokens-on-M fp8 kernel may run (``MLA_TRITON_FP8T`` is not ``0``)."""
    return os.environ.get("MLA_TRITON_FP8T", "1") != "0"
