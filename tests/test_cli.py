"""The CLI entry points a newcomer runs: info and demo (CPU)."""

import subprocess
import sys


def _run(*args):
    return subprocess.run([sys.executable, "-m", "mla_dispatch", *args], capture_output=True, text=True, timeout=300)


def test_info_lists_platform_and_every_backend():
    r = _run("info", "--heads", "16", "--page-size", "16")
    assert r.returncode == 0, r.stderr
    assert "platform: cpu" in r.stdout
    for name in ("reference", "triton", "cuda_sm90", "flashmla", "flashinfer", "aiter", "ascend_amla", "torch_npu"):
        assert f"  {name}@" in r.stdout, name
    assert "auto would choose: reference" in r.stdout
    assert "page_size=16" in r.stdout


def test_demo_runs_and_checks_on_cpu():
    r = _run("demo", "--lengths", "70,0,130", "--heads", "16", "--seed", "7")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "backend: reference@" in r.stdout and r.stdout.strip().endswith("PASS")


def test_unknown_command_and_help():
    r = _run("frobnicate")
    assert r.returncode == 2 and "unknown command 'frobnicate'" in r.stderr
    r = _run("--help")
    assert r.returncode == 0 and "demo" in r.stdout and "conformance" in r.stdout
