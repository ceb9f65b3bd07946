"""What the kernel choosers (:mod:`.decode`, :mod:`.launch`) and the tokens-on-M fp8 kernel (:mod:`.gluon_fp8`) all
need to know of that kernel: its row limit. A module of its own, so the choosers decide without importing Gluon and
the kernel does not import the dispatcher."""

from __future__ import annotations

__all__ = ["FP8T_MAX_ROWS"]

#: fp8_e4m3 caches with at most this many query rows take the tokens-on-M Gluon kernel (:mod:`.gluon_fp8`) instead,
#: under the same config (a plan's launch chooses it, :mod:`.launch`; ``backend_options={"kernel": "gluon"}`` keeps
#: gluon_sm90 there). H100, b=64 L=8K, graph µs (2026-11-23, twenty-third session, calls 7 / 10): h16 140.9 / 144.8
#: vs 292.8 (the plain 16-row config), h32 157.7 / 159.5 vs 305.8 (gluon_sm90); docs/notes/triton.md, "fp8_e4m3
#: with tokens on M".
FP8T_MAX_ROWS = 32
