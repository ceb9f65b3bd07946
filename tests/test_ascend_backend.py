"""Ascend dispatch on a simulated NPU platform: our AMLA op first, then torch_npu, then reference.

The NPU is simulated on the CPU by replacing ``detect_platform``; "our kernel is
built" is simulated by reporting a PrivateUse1 kernel for ``mla_dispatch::amla_decode``
(the CPU tensors then run the op's CPU kernel, the emulation). Also checks that
the Ascend C sources use the emulation's constants.
"""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

import mla_dispatch
from mla_dispatch.backends.ascend_amla import AscendAMLABackend
from mla_dispatch.numerics.oracle import reference_attention
from mla_dispatch.kernels.ascend import amla_emulation as emu
from mla_dispatch.kernels.ascend import ops
from mla_dispatch.dispatch.platform import Platform
from mla_dispatch.dispatch.select import NoBackendError, explain, priority
from mla_dispatch.numerics.cases import make_case
from mla_dispatch.numerics.tolerance import compare_outputs

NPU = Platform("npu", "Ascend910B3", None, "Ascend910B", 20)
CPU = Platform("cpu", "cpu", None, "cpu", 2)
KERNEL_DIR = pathlib.Path(__file__).resolve().parents[1] / "mla_dispatch" / "kernels" / "ascend"


@pytest.fixture
def built(monkeypatch):
    """Pretend the C++ extension registered the NPU kernel."""
    monkeypatch.setattr(ops, "npu_kernel_registered", lambda: True)


def _problem(case, **kw):
    return mla_dispatch.plan_decode(*case.args(), softmax_scale=case.softmax_scale, causal=case.causal,
                                    backend="reference", **kw).problem


def test_unbuilt_kernel_is_a_reason_and_auto_falls_through(npu, gen):
    case = make_case(2, 1, 16, 300, page_size=128, generator=gen)
    report = explain(_problem(case), NPU)
    names = [name for name, _, _ in report.candidates]
    assert names == ["ascend_amla", "torch_npu", "reference"]
    reasons = {name: " ".join(map(str, rs)) for name, _, rs in report.candidates}
    assert "not built" in reasons["ascend_amla"]
    assert "torch_npu" in reasons["torch_npu"]  # not installed here
    assert report.chosen == "reference"


@pytest.mark.parametrize(
    "batch,q_len,heads,seqlen,page_size,causal",
    [(3, 1, 16, 1300, 64, False), (2, 4, 32, 700, 128, True), (1, 2, 128, 900, 16, True)],
    ids=["b3xs1xh16-ps64", "b2xs4xh32-ps128-causal", "b1xs2xh128-ps16-causal"],
)
def test_built_kernel_is_preferred_end_to_end(npu, built, gen, batch, q_len, heads, seqlen, page_size, causal):
    case = make_case(batch, q_len, heads, seqlen, page_size=page_size, causal=causal, generator=gen,
                     zero_len_rows=1 if batch > 2 else 0)
    plan = mla_dispatch.plan_decode(*case.args(), softmax_scale=case.softmax_scale, causal=causal)
    assert plan.backend == "ascend_amla"
    assert plan.state.num_cores == NPU.num_compute_units
    out, lse = plan.run(case.q, case.kv_cache)
    ref_out, ref_lse = reference_attention(*case.args(), softmax_scale=case.softmax_scale, causal=causal)
    report = compare_outputs(out, lse, ref_out, ref_lse, AscendAMLABackend.TOLERANCE)
    assert report, report.message


def test_kernel_limits_are_reasons(npu, built, gen):
    case = make_case(1, 5, 16, 64, page_size=64, generator=gen)  # s_q = 5 > 4
    text = " ".join(map(str, AscendAMLABackend.not_supported_reasons(_problem(case), NPU)))
    assert "s_q=5" in text
    q = torch.zeros(1, 1, 16, 320, dtype=torch.bfloat16)
    kv = torch.zeros(2, 48, 2, 320, dtype=torch.bfloat16)
    problem = mla_dispatch.plan_decode(q, kv, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                                       head_dim_v=256, backend="reference").problem
    text = " ".join(map(str, AscendAMLABackend.not_supported_reasons(problem, NPU)))
    assert "D_qk/D_v=320/256" in text and "page_size=48" in text and "h_kv=2" in text


def test_emulation_is_never_auto_but_runs_by_name(gen):
    case = make_case(1, 1, 16, 100, generator=gen)
    problem = _problem(case)
    for plat in (NPU, CPU, Platform("cuda", "H100", (9, 0), "sm_90", 132)):
        assert "amla_emulation" not in priority(problem, plat)
    out, lse = mla_dispatch.mla_decode(*case.args(), softmax_scale=case.softmax_scale, backend="amla_emulation")
    ref_out, ref_lse = reference_attention(*case.args(), softmax_scale=case.softmax_scale)
    assert compare_outputs(out, lse, ref_out, ref_lse, AscendAMLABackend.TOLERANCE)


def test_ascend_amla_by_name_off_npu_raises(gen):
    case = make_case(1, 1, 16, 100, generator=gen)
    with pytest.raises(NoBackendError, match="platform=cpu"):
        mla_dispatch.mla_decode(*case.args(), backend="ascend_amla")


def test_op_schema_and_fake(gen):
    case = make_case(2, 2, 16, 150, page_size=64, causal=True, generator=gen)
    out = torch.empty(2, 2, 16, 512, dtype=torch.bfloat16)
    lse = torch.empty(2, 16, 2)
    args = (case.q, case.kv_cache, case.block_table, case.cache_seqlens, case.cache_seqlens.tolist(), out, lse,
            case.softmax_scale, True, 3)
    torch.library.opcheck(torch.ops.mla_dispatch.amla_decode.default, args)


def _constant(text: str, name: str) -> str:
    m = re.search(rf"\b{name}\s*=\s*([^;]+);", text)
    assert m, f"{name} not found"
    return m.group(1).strip()


def test_kernel_sources_use_the_emulation_constants():
    common = (KERNEL_DIR / "kernel" / "amla_common.h").read_text()
    tiling = (KERNEL_DIR / "kernel" / "tiling_data.h").read_text()
    assert int(_constant(common, "kFirstBlockBias"), 0) == emu.FIRST_BLOCK_BIAS_BITS
    assert float(_constant(common, "kDnClamp").rstrip("f")) == emu.DN_CLAMP
    assert float(_constant(common, "kEpsMantissa").rstrip("f")) == emu.EPS_MANTISSA
    assert float(_constant(common, "kEpsBias").rstrip("f")) == emu.EPS_BIAS
    assert float(_constant(common, "kMantissaOne").rstrip("f")) == emu.MANTISSA_ONE
    assert float(_constant(common, "kZeroGuard").rstrip("f")) == emu.ZERO_GUARD
    assert int(_constant(tiling, "kKvBlock")) == emu.BLOCK
    assert int(_constant(tiling, "kPreload")) == 2
    vec = (KERNEL_DIR / "kernel" / "amla_vec_block.h").read_text()
    assert "SetAtomicAdd<int32_t>()" in vec and "CAST_RINT" in vec
    cube = (KERNEL_DIR / "kernel" / "amla_cube_block.h").read_text()
    assert cube.index("CrossCoreWaitFlag(NUPDATE_DONE") < cube.index("SetAtomicAdd<float>()")
    unbuilt = [*(KERNEL_DIR / "kernel").iterdir(), KERNEL_DIR / "host" / "torch_binding.cpp",
               KERNEL_DIR / "CMakeLists.txt", KERNEL_DIR / "NOTES.md"]
    for path in unbuilt:
        assert "written, not compiled" in path.read_text(), f"{path} lacks its status line"
