"""Two GPUs in one process: each GPU backend runs on the device its tensors are on, whatever device is current.

Runs where torch sees two or more CUDA devices (the device tool's ``nvidia-h200-x2``); skipped elsewhere.
What it guards against:

- Triton launches on the *current* device, not on its tensors' device: with tensors on ``cuda:1`` while
  ``cuda:0`` was current, triton 3.6 refused the split-KV schedule's launch ("Pointer argument (at 0) cannot be
  accessed from Triton"), so neither backend could plan there. The schedule, decode and combine launches now run
  under ``mla_dispatch.kernels.triton.device.kernel_device``.
- ``cudaFuncSetAttribute`` (the opt-in to more than 48 KB of dynamic shared memory) acts on the current device
  only; the SM90 launchers remembered it once per process, so after a launch on ``cuda:0`` a launch on ``cuda:1``
  was refused ("kernel launch failed: invalid argument"). They now remember it per device.

Both failures were seen on the device tool's two-H200 machine before the fix (benchmarks/RESULTS.md).

Fresh random inputs, outputs poisoned before every run, each backend's declared tolerance.
"""

from __future__ import annotations

import pytest
import torch

from mla_dispatch import plan_decode
from mla_dispatch.dispatch.registry import get_backend
from mla_dispatch.numerics.cases import case_reference, make_case, poisoned_outputs
from mla_dispatch.numerics.tolerance import compare_outputs

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _two_gpus_device0_current():
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    before = torch.cuda.current_device()
    torch.cuda.set_device(0)
    yield
    torch.cuda.set_device(before)


def _sm90_on_both() -> bool:
    return all(torch.cuda.get_device_capability(i) == (9, 0) for i in (0, 1))


def _run(backend, shape, variant, device, gen):
    """Plan and run ``shape`` on ``device`` with cuda:0 current; check against the reference."""
    batch, s_q, h_q, seqlen, page_size = shape
    case = make_case(batch, s_q, h_q, seqlen, page_size=page_size, causal=s_q > 1, device=device, generator=gen)
    plan = plan_decode(*case.args(), backend=backend, backend_options={"variant": variant} if variant else None,
                       **case.kwargs())
    out, lse = poisoned_outputs(case)
    plan.run(case.q, case.kv_cache, kv_scale=case.kv_scale, out=out, lse=lse)
    torch.cuda.synchronize(device)
    assert torch.cuda.current_device() == 0
    report = compare_outputs(out, lse, *case_reference(case), get_backend(backend).TOLERANCE)
    assert report, f"{backend} variant {variant} on {device}: {report.message}"


# (backend, (batch, s_q, h_q, seqlen, page_size), forced cuda_sm90 mainloop or None)
CASES = [
    ("cuda_sm90", (3, 1, 128, 1500, 64), 2),
    ("cuda_sm90", (3, 1, 128, 1500, 64), 5),   # two row tiles: the clustered instance
    ("cuda_sm90", (4, 1, 16, 2000, 64), 6),
    ("triton", (3, 1, 128, 1500, 64), None),   # whole tiles by TMA, split requests (decode + combine)
    ("triton", (4, 1, 16, 2000, 16), None),    # the register-capped 16-row config, gathered tiles
]


@pytest.mark.parametrize("backend,shape,variant", CASES,
                         ids=[f"{b}-h{s[2]}-page{s[4]}" + (f"-v{v}" if v else "") for b, s, v in CASES])
def test_each_device_in_turn_with_cuda0_current(backend, shape, variant, gen):
    """cuda:0, then cuda:1, then cuda:0 again, all with cuda:0 current: the first launch configures a kernel on
    one device, the second must not rely on that for the other."""
    if backend == "cuda_sm90" and not _sm90_on_both():
        pytest.skip("cuda_sm90 needs SM90 GPUs")
    for device in ("cuda:0", "cuda:1", "cuda:0"):
        _run(backend, shape, variant, device, gen)
