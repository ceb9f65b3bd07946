"""A fake vendor backend whose library ends the process on what its kernels do not run, as FlashMLA's SM90 dense
kernel does on a 512-wide q (``FLASH_ASSERT(params.d == Config::HEAD_DIM_K)``, csrc/sm90/decode/dense/
splitkv_mla.cuh, prints the assert and exits) and AITER does when no assembly kernel matches (``AITER_CHECK``,
SIGABRT). Everything else it computes with our reference, so its other cells pass."""

from __future__ import annotations

import os
import sys

from mla_dispatch.backends.reference import ReferenceBackend

ASSERT_TEXT = "Assertion failed (fake_splitkv_mla.cuh:1277): params.d == Config::HEAD_DIM_K"


class AbortingVendorBackend(ReferenceBackend):
    """Declares every head dim, as FlashMLA's adapter once did; aborts the process at run on D_qk != 576."""

    NAME = "test_fake_aborting_vendor"
    VENDOR = "a fake vendor library (tests/fakes/fake_abort.py)"

    @classmethod
    def run(cls, state, q, kv_cache, block_table, cache_seqlens, *, problem, **kw):
        if problem.head_dim_qk != 576:
            print(ASSERT_TEXT, file=sys.stderr, flush=True)
            os.abort()
        super().run(state, q, kv_cache, block_table, cache_seqlens, problem=problem, **kw)
