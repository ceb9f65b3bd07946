"""Every GPU backend at the sizes where 32-bit offsets overflow: a cache of more than 2^32 elements with its used
pages spread over all of it, and FlashMLA's largest serving shapes (b=128, mean length 32K: ~4M tokens). A backend
either matches the oracle there or declines the problem with a reason; it never returns a wrong answer.

GPU only (``gpu`` marker): each case needs ~10-15 GB of device memory, so they run one at a time (one xdist group).
"""

import pytest
import torch

from mla_dispatch.dispatch.registry import get_backend, registered_names
from mla_dispatch.numerics.oracle import reference_attention
from mla_dispatch.tools.conformance import check_backend, large_case_set

pytestmark = [pytest.mark.gpu, pytest.mark.xdist_group("gpu_heavy0"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

_GPU_BACKENDS = [n for n in registered_names() if n not in ("reference", "amla_emulation")]


@pytest.mark.parametrize("spec", large_case_set(), ids=lambda s: s.name.replace(" ", "_"))
def test_large_cache_matches_the_oracle_or_is_declined(spec):
    case = spec.make(torch.device("cuda"), torch.Generator().manual_seed(0))
    if spec.name.startswith("cache > 2^32"):
        assert case.kv_cache.numel() > 1 << 32
        used = case.block_table[case.block_table < case.kv_cache.shape[0]]
        assert int(used.max()) * case.kv_cache.stride(0) >= 1 << 32, "no used page lies past 2^32 elements"
    ref = reference_attention(case.q, case.kv_cache, case.block_table, case.cache_seqlens, head_dim_v=case.head_dim_v,
                              softmax_scale=case.softmax_scale, causal=case.causal, kv_format=case.kv_format,
                              kv_scale=case.kv_scale, indices=case.indices)
    ran, bad = [], []
    for name in _GPU_BACKENDS:
        if get_backend(name).availability_reasons():
            continue
        cell = check_backend(name, case, ref)
        if cell.status in ("fail", "error"):
            bad.append(f"{name}: {cell.status}: {cell.detail}")
        elif cell.status == "pass":
            ran.append(name)
        torch.cuda.empty_cache()
    assert not bad, "\n".join(bad)
    assert ran, "no GPU backend ran this case"
