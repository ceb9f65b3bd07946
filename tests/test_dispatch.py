"""Dispatch on simulated platforms: priority, feasibility, errors, overrides, plugins.

Every platform is simulated on the CPU by replacing the one function that asks
the hardware (``mla_dispatch.dispatch.platform.detect_platform``) or by passing a
``Platform`` directly to the pure selection functions.
"""

import subprocess
import sys
import textwrap
from importlib import metadata as importlib_metadata

import pytest
import torch

import mla_dispatch
from mla_dispatch.dispatch import registry, select, tuned
from mla_dispatch.dispatch.backend import CGSupport, MLABackend, ReasonCode
from mla_dispatch.dispatch.platform import Platform
from mla_dispatch.dispatch.problem import DecodeProblem

SM90 = Platform("cuda", "NVIDIA H100 80GB HBM3", (9, 0), "sm_90", 132)
SM100 = Platform("cuda", "NVIDIA B200", (10, 0), "sm_100", 148)
SM80 = Platform("cuda", "NVIDIA A100", (8, 0), "sm_80", 108)
MI300X = Platform("rocm", "AMD Instinct MI300X", None, "gfx942", 304)
NPU = Platform("npu", "Ascend910B3", None, "Ascend910B", 20)
CPU = Platform("cpu", "cpu", None, "cpu", 2)


def problem(**kw) -> DecodeProblem:
    base = dict(batch=4, q_len=1, num_heads_q=128, num_heads_kv=1, head_dim_qk=576, head_dim_v=512, page_size=64,
                max_blocks=16, q_dtype=torch.bfloat16, kv_format="bf16", causal=False, topk=0, return_lse=True,
                device_type="cuda")
    base.update(kw)
    return DecodeProblem(**base)


@pytest.fixture(autouse=True)
def _fresh_selection():
    select.clear_selection_cache()
    yield
    select.clear_selection_cache()


def _fake_backend(name, **consts):
    attrs = dict(NAME=name, PLATFORMS=frozenset({"cuda", "rocm", "npu", "cpu"}), _availability_cache=[])
    attrs.update(consts)
    return type(f"Fake_{name}", (MLABackend,), attrs)


@pytest.fixture
def fake_backends(monkeypatch):
    """Replace every built-in with an always-available fake, restoring the registry afterwards."""
    saved_specs, saved_classes = dict(registry._SPECS), dict(registry._CLASSES)
    for name in list(registry._SPECS):
        registry.register_backend(name, _fake_backend(name), replace=True)
    yield
    registry._SPECS.clear(), registry._SPECS.update(saved_specs)
    registry._CLASSES.clear(), registry._CLASSES.update(saved_classes)


@pytest.mark.parametrize(
    "platform,expected",
    [
        (SM90, ("cuda_sm90", "flashmla", "fa3", "flashinfer", "triton", "reference")),
        (SM100, ("flashinfer", "triton", "reference")),
        (SM80, ("triton", "flashinfer", "reference")),
        (MI300X, ("aiter", "triton", "reference")),
        (NPU, ("ascend_amla", "torch_npu", "reference")),
        (CPU, ("reference",)),
    ],
    ids=["sm90", "sm100", "sm80", "mi300x", "npu", "cpu"],
)
def test_priority_per_platform(platform, expected):
    assert select.priority(problem(), platform) == expected, "docs/design.md §3 default order"


@pytest.mark.parametrize("platform,chosen", [(SM90, "cuda_sm90"), (SM100, "flashinfer"), (MI300X, "aiter"),
                                             (NPU, "ascend_amla"), (CPU, "reference")])
def test_first_feasible_backend_wins(fake_backends, platform, chosen):
    assert select.select_backend(problem(), platform).NAME == chosen


def test_infeasible_backends_are_skipped(fake_backends):
    registry.register_backend("cuda_sm90", _fake_backend("cuda_sm90", PAGE_SIZES=frozenset({64})), replace=True)
    registry.register_backend("flashmla", _fake_backend("flashmla", PAGE_SIZES=frozenset({64})), replace=True)
    registry.register_backend("fa3", _fake_backend("fa3", PAGE_SIZES=frozenset({64})), replace=True)
    assert select.select_backend(problem(page_size=16), SM90).NAME == "flashinfer"
    report = select.explain(problem(page_size=16), SM90)
    assert [r.message for r in report.candidates[0][2]] == ["page_size=16 (supported: {64})"]
    assert report.chosen == "flashinfer"


def test_unimplemented_names_are_listed_but_never_selected():
    for name in ("cuda_sm90", "flashmla", "aiter", "ascend_amla"):
        cls = registry.get_backend(name)
        reasons = cls.not_supported_reasons(problem(), SM90)
        if cls.IMPLEMENTED and reasons and reasons[0].code is not ReasonCode.NOT_IMPLEMENTED:
            continue  # implemented by now: covered by its own tests
        if not cls.IMPLEMENTED:
            assert reasons[0].code is ReasonCode.NOT_IMPLEMENTED
            assert "not implemented in this version" in reasons[0].message


def test_no_backend_error_lists_problem_and_every_reason():
    p = problem(device_type="cpu", q_dtype=torch.float32)
    with pytest.raises(mla_dispatch.NoBackendError) as info:
        select.select_backend(p, CPU)
    text = str(info.value)
    assert "No MLA decode backend supports this problem" in text
    assert "q dtype=float32 (supported: {bfloat16, float16})" in text
    assert "[4, 1, 128, 576] float32" in text
    assert info.value.report.chosen is None


def test_explicit_backend_that_cannot_run_raises_instead_of_falling_back(fake_backends):
    registry.register_backend("triton", _fake_backend("triton", MAX_Q_LEN=16), replace=True)
    with pytest.raises(mla_dispatch.NoBackendError, match=r"(?s)Backend 'triton' was requested.*s_q=32 \(supported: <= 16\)"):
        select.select_backend(problem(q_len=32), SM90, backend="triton")
    assert select.select_backend(problem(q_len=2), SM90, backend="triton").NAME == "triton"


def test_unknown_backend_name():
    with pytest.raises(ValueError, match=r"unknown backend 'nope' \(registered: reference"):
        select.select_backend(problem(), SM90, backend="nope")
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        with mla_dispatch.use_backends("nope"):
            pass


def test_use_backends_restricts_and_reorders_and_restores(fake_backends):
    with mla_dispatch.use_backends("triton", "reference"):
        assert select.select_backend(problem(), SM90).NAME == "triton"
        with mla_dispatch.use_backends("reference", "flashinfer", reorder=True):
            assert select.select_backend(problem(), SM90).NAME == "reference"
        assert select.select_backend(problem(), SM90).NAME == "triton"
    assert select.select_backend(problem(), SM90).NAME == "cuda_sm90"


def test_reason_messages_state_required_and_given():
    cls = _fake_backend("x", PLATFORMS=frozenset({"cuda"}), MIN_CAPABILITY=(9, 0), MAX_CAPABILITY=(9, 0),
                        KV_FORMATS=frozenset({"bf16"}), HEAD_DIMS=frozenset({(576, 512)}), MAX_HEADS_Q=64,
                        SUPPORTS_CAUSAL=False, CUDA_GRAPH=CGSupport.NEVER)
    p = problem(kv_format="fp8_e4m3", head_dim_qk=512, num_heads_q=128, q_len=2, causal=True, cuda_graph=True)
    msgs = [r.message for r in cls.not_supported_reasons(p, SM100)]
    assert msgs == [
        "compute capability 10.0 (supported: 9.0..9.0)",
        "kv_format=fp8_e4m3 (supported: {bf16})",
        "D_qk/D_v=512/512 (supported: 576/512)",
        "h_q=128 (supported: <= 64)",
        "causal=True with s_q > 1 (supported: causal=False)",
        "cuda_graph=True (this backend cannot be captured)",
    ]
    assert [r.message for r in cls.not_supported_reasons(problem(num_heads_q=64), CPU)] == ["platform=cpu (supported: {cuda})"]


def test_import_failure_is_a_reason_with_the_real_text(tmp_path, monkeypatch):
    (tmp_path / "broken_backend_mod.py").write_text("import definitely_missing_module_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.register_backend("broken", "broken_backend_mod:Backend")
    try:
        cls = registry.get_backend("broken")
        (reason,) = cls.not_supported_reasons(problem(), SM90)[:1]
        assert reason.code is ReasonCode.UNAVAILABLE
        assert "No module named 'definitely_missing_module_xyz'" in reason.message
    finally:
        registry.unregister_backend("broken")


def test_entry_point_backends_register_and_rank_before_reference(monkeypatch, tmp_path):
    (tmp_path / "third_party_mla.py").write_text(textwrap.dedent("""
        from mla_dispatch.dispatch.backend import MLABackend
        class Plugin(MLABackend):
            NAME = "plugin"
            PLATFORMS = frozenset({"cpu"})
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    eps = [importlib_metadata.EntryPoint("plugin", "third_party_mla:Plugin", registry.ENTRY_POINT_GROUP),
           importlib_metadata.EntryPoint("reference", "third_party_mla:Plugin", registry.ENTRY_POINT_GROUP)]
    monkeypatch.setattr(registry.importlib_metadata, "entry_points", lambda group: eps if group == registry.ENTRY_POINT_GROUP else [])
    registry._reset_entry_points()
    try:
        names = registry.registered_names()
        assert "plugin" in names
        assert registry._SPECS["reference"].qualname.startswith("mla_dispatch.backends.reference"), "no hijack"
        assert select.priority(problem(device_type="cpu"), CPU) == ("plugin", "reference")
        assert select.select_backend(problem(device_type="cpu"), CPU).NAME == "plugin"
    finally:
        registry.unregister_backend("plugin")
        registry._reset_entry_points()


def test_tuned_table_moves_measured_best_first():
    p = problem()
    tuned.set_tuned_table(tuned.fingerprint(SM90), {tuned.shape_bucket(p): "triton"})
    try:
        assert select.priority(p, SM90, dict(tuned.tuned_table()[1]))[0] == "triton"
        assert select._active_candidates(p, SM90)[0] == "triton"
        assert select._active_candidates(p, SM100)[0] == "flashinfer", "table is per device"
    finally:
        tuned.set_tuned_table(None, None)


def test_auto_on_a_hopper_without_its_own_table_follows_the_measured_one(fake_backends, monkeypatch, tmp_path):
    """An H200 has no table of its own: auto used to fall back to the default order (cuda_sm90 first), 1.24-1.37x
    FlashMLA's time at 128 heads there (docs/design.md §6); the H100's measurements, carried over, rank FlashMLA's
    kernel first."""
    monkeypatch.delenv(tuned.ENV_VAR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    h100_table = tuned.SHIPPED_DIR / "NVIDIA_H100_80GB_HBM3_sm_90.json"
    (tmp_path / h100_table.name).write_text(h100_table.read_text())
    monkeypatch.setattr(tuned, "SHIPPED_DIR", tmp_path)  # the H100's table only, whatever ships later
    tuned.reload_table()
    try:
        h200 = Platform("cuda", "NVIDIA H200", (9, 0), "sm_90", 132)
        assert select.select_backend(problem(batch=128, max_blocks=300), h200).NAME == "flashmla"
    finally:
        tuned.reload_table()


def test_simulated_platform_through_mla_decode(simulate_platform, fake_backends, gen):
    """The front end asks detect_platform; mocking it steers the whole call."""
    from mla_dispatch.numerics.cases import make_case

    calls = []

    class Recorder(MLABackend):
        NAME = "aiter"
        PLATFORMS = frozenset({"rocm"})
        _availability_cache = []

        @classmethod
        def run(cls, state, q, kv, bt, sl, *, problem, softmax_scale, kv_scale, indices, out, lse):
            calls.append(problem)
            out.zero_(), lse.zero_()

    registry.register_backend("aiter", Recorder, replace=True)
    simulate_platform(MI300X)
    case = make_case(2, 1, 16, 30, page_size=16, generator=gen)
    plan = mla_dispatch.plan_decode(*case.args(), **case.kwargs())
    assert plan.backend == "aiter"
    plan.run(case.q, case.kv_cache)
    assert calls and calls[0].page_size == 16


def test_importing_mla_dispatch_imports_no_backend_or_kernel_library():
    code = textwrap.dedent("""
        import sys, mla_dispatch
        from mla_dispatch.tools.info import report
        heavy = [m for m in ("triton", "flash_mla", "flashinfer", "aiter", "torch_npu", "flash_attn_interface",
                             "vllm", "sgl_kernel", "mla_dispatch.backends.triton", "mla_dispatch.backends.cuda_sm90",
                             "mla_dispatch.backends.flashinfer", "mla_dispatch.backends.fa3") if m in sys.modules]
        print(heavy)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr


def test_platform_detection_on_this_cpu_machine():
    from mla_dispatch.dispatch.platform import detect_platform

    p = detect_platform("cpu")
    assert p.kind == "cpu" and p.capability is None and p.num_compute_units >= 1


def test_kernel_device_is_a_no_op_off_cuda():
    """The device guard the Triton launches run under does nothing for CPU tensors (Triton's interpreter); on two
    GPUs it is exercised by tests/test_multi_gpu.py."""
    import contextlib

    from mla_dispatch.kernels.triton.device import kernel_device

    guard = kernel_device(torch.zeros(1))
    assert isinstance(guard, contextlib.nullcontext)
    with guard:
        pass


def test_a_backend_registered_with_a_priority_takes_its_place_in_the_default_order():
    """One place to register a backend: its registry row's priority is where ``auto`` tries it, per platform."""
    registry.register_backend("ranked_plugin", _fake_backend("ranked_plugin"), priority={"sm90": 15, "cpu": 5})
    try:
        assert select.priority(problem(), SM90) == ("cuda_sm90", "ranked_plugin", "flashmla", "fa3", "flashinfer",
                                                    "triton", "reference")
        assert select.priority(problem(device_type="cpu"), CPU) == ("ranked_plugin", "reference")
        assert "ranked_plugin" not in select.priority(problem(), SM100), "absent from the platforms it does not name"
        with pytest.raises(ValueError, match="platform keys"):
            registry.register_backend("bad_plugin", _fake_backend("bad_plugin"), priority={"gpu": 1})
    finally:
        registry.unregister_backend("ranked_plugin")
