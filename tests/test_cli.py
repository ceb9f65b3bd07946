"""``python -m mla_dispatch``: the commands a newcomer runs, and what a user mistake gets.

Run in-process through ``mla_dispatch.tools.cli.main`` (a subprocess costs a torch import); one test goes through
the real ``python -m`` entry point.
"""

import os
import subprocess
import sys

import pytest
import torch

from mla_dispatch.backends.reference import ReferenceBackend
from mla_dispatch.tools.cli import main

NO_CUDA = not torch.cuda.is_available()
TRITON_RUNS_ON_CPU = os.environ.get("TRITON_INTERPRET") == "1"


def _one_line_error(capsys, argv, *expected):
    """Run ``argv``; it must exit non-zero with exactly one line on stderr containing each of ``expected``."""
    rc = main(argv)
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert rc != 0, (argv, captured.out[-500:])
    assert len(lines) == 1, (argv, captured.err)
    assert "Traceback" not in captured.err + captured.out
    for text in expected:
        assert text in lines[0], (argv, lines[0])
    return lines[0]


def test_info_lists_platform_and_every_backend(capsys):
    assert main(["info", "--heads", "16", "--page-size", "16"]) == 0
    out = capsys.readouterr().out
    assert "platform: cpu" in out or not NO_CUDA
    for name in ("reference", "triton", "cuda_sm90", "flashmla", "fa3", "flashinfer", "aiter", "ascend_amla",
                 "torch_npu"):
        assert f"  {name}@" in out, name
    if NO_CUDA:
        assert "auto would choose: reference" in out
    assert "page_size=16" in out


@pytest.mark.skipif(not NO_CUDA, reason="checks the CPU path of demo")
def test_demo_checks_against_float64_and_says_so(capsys):
    assert main(["demo", "--lengths", "70,0,130", "--heads", "16", "--seed", "7"]) == 0
    out = capsys.readouterr().out
    assert "backend: reference@" in out and out.strip().endswith("PASS")
    check = next(line for line in out.splitlines() if line.startswith("check:"))
    assert check.startswith("check: reference vs float64 attention: out max abs error ")
    similarity = float(check.split("cosine similarity ")[1].split(";")[0])
    assert 0.99999 < similarity <= 1.0 and check.endswith("within tolerance")
    assert "cos 0" not in out


class _WrongDemoBackend(ReferenceBackend):
    """The reference plus 0.01 on every output: the demo's check must catch it."""

    NAME = "test_cli_wrong"

    @classmethod
    def run(cls, state, q, kv_cache, block_table, cache_seqlens, **kw):
        super().run(state, q, kv_cache, block_table, cache_seqlens, **kw)
        kw["out"].add_(0.01)


def test_demo_check_fails_on_a_wrong_backend(registered, capsys):
    name = registered(_WrongDemoBackend)
    rc = main(["demo", "--lengths", "40,9", "--heads", "4", "--seed", "3", "--backend", name, "--device", "cpu"])
    out = capsys.readouterr().out
    assert rc == 1 and out.strip().endswith("FAIL")
    assert f"check: {name} vs float64 attention:" in out and "OUT OF TOLERANCE" in out


def test_unknown_command_and_help(capsys):
    _one_line_error(capsys, ["frobnicate"], "unknown command 'frobnicate'", "demo", "conformance")
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "demo" in out and "conformance" in out
    assert main(["demo", "--help"]) == 0  # argparse's exit(0) is returned, not raised
    assert "--lengths" in capsys.readouterr().out


BAD_ARGUMENTS = [
    pytest.param(["demo", "--device", "cuda"], ["--device", "no CUDA device"], id="demo-device-cuda-on-cpu",
                 marks=pytest.mark.skipif(not NO_CUDA, reason="a CUDA device is present")),
    pytest.param(["demo", "--device", "cuda:99"], ["--device", "cuda:99"], id="demo-device-index"),
    pytest.param(["demo", "--device", "xyz"], ["--device", "not a torch device"], id="demo-device-name"),
    pytest.param(["demo", "--lengths", "abc"], ["--lengths", "comma-separated integers >= 0"], id="demo-lengths"),
    pytest.param(["demo", "--lengths", "5,-3"], ["--lengths", "'5,-3'"], id="demo-lengths-negative"),
    pytest.param(["demo", "--lengths", ""], ["--lengths"], id="demo-lengths-empty"),
    pytest.param(["demo", "--page-size", "0"], ["--page-size", "integer >= 1"], id="demo-page-size"),
    pytest.param(["demo", "--heads", "0"], ["--heads", "integer >= 1"], id="demo-heads"),
    pytest.param(["demo", "--backend", "nope"], ["--backend", "unknown backend 'nope'", "reference"],
                 id="demo-backend-unknown"),
    pytest.param(["demo", "--backend", "triton", "--lengths", "10", "--heads", "4", "--device", "cpu"],
                 ["--backend", "'triton' cannot run", "TRITON_INTERPRET=1"], id="demo-backend-triton-on-cpu",
                 marks=pytest.mark.skipif(TRITON_RUNS_ON_CPU, reason="TRITON_INTERPRET=1 is set")),
    pytest.param(["demo", "--kv-format", "int4"], ["--kv-format", "invalid choice"], id="demo-kv-format"),
    pytest.param(["demo", "--seed", "x"], ["--seed", "'x'"], id="demo-seed"),
    pytest.param(["demo", "--bogus"], ["unrecognized arguments: --bogus"], id="demo-unknown-option"),
    pytest.param(["info", "--batch", "0"], ["--batch", "integer >= 1"], id="info-batch"),
    pytest.param(["info", "--heads", "x"], ["--heads", "'x'"], id="info-heads"),
    pytest.param(["info", "--q-len", "0"], ["--q-len"], id="info-q-len"),
    pytest.param(["info", "--page-size", "-1"], ["--page-size", "'-1'"], id="info-page-size"),
    pytest.param(["info", "--dtype", "fp8"], ["--dtype", "invalid choice"], id="info-dtype"),
    pytest.param(["conformance", "--backends", "nope"], ["--backends", "unknown backend 'nope'"],
                 id="conformance-backends"),
    pytest.param(["conformance", "--backends", ","], ["--backends", "backend names"], id="conformance-backends-empty"),
    pytest.param(["conformance", "--device", "xyz"], ["--device", "not a torch device"], id="conformance-device"),
    pytest.param(["conformance", "--seed", "x"], ["--seed"], id="conformance-seed"),
    pytest.param(["bench", "--grid", "nope"], ["--grid", "unknown grid 'nope'", "quick"], id="bench-grid"),
    pytest.param(["bench", "--backends", "nope"], ["--backends", "unknown backend 'nope'"], id="bench-backends"),
    pytest.param(["bench", "--device", "xyz"], ["--device"], id="bench-device"),
    pytest.param(["bench", "--rep-ms", "0"], ["--rep-ms", "number > 0"], id="bench-rep-ms"),
    pytest.param(["bench", "--dtype", "fp32"], ["--dtype"], id="bench-dtype"),
    pytest.param(["tune", "--device", "xyz"], ["--device", "not a torch device"], id="tune-device"),
    pytest.param(["tune", "--grid", "nope"], ["--grid", "unknown grid"], id="tune-grid"),
    pytest.param(["tune", "--backends", "nope"], ["--backends", "unknown backend"], id="tune-backends"),
    pytest.param(["tune", "--rep-ms", "-1"], ["--rep-ms", "number > 0"], id="tune-rep-ms"),
    pytest.param(["tune", "--metric", "fastest"], ["--metric", "invalid choice"], id="tune-metric"),
    pytest.param(["build", "--bogus"], ["unrecognized arguments: --bogus"], id="build-unknown-option"),
]


@pytest.mark.parametrize("argv,expected", BAD_ARGUMENTS)
def test_a_user_mistake_is_one_line_naming_the_argument(argv, expected, capsys):
    _one_line_error(capsys, argv, "error:", *expected)


@pytest.mark.parametrize("command,option", [("bench", "--out"), ("conformance", "--json"), ("tune", "--out")])
def test_an_unwritable_output_path_is_refused_before_any_work(command, option, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    target = str(blocker / ("sub" if command == "bench" else "table.json"))
    argv = [command, option, target, "--backends", "reference", "--quiet"]
    _one_line_error(capsys, argv, option, repr(target))


@pytest.mark.skipif(not NO_CUDA, reason="cuda_sm90 runs where there is a GPU")
@pytest.mark.parametrize("argv,expected", [
    (["conformance", "--quick", "--backends", "cuda_sm90", "--quiet"], "nothing was checked: every backend declined"),
    (["bench", "--backends", "cuda_sm90", "--quiet"], "nothing to run: cuda_sm90 ("),
    (["tune", "--quick", "--backends", "cuda_sm90", "--dry-run", "--quiet"], "nothing to run: cuda_sm90 ("),
], ids=["conformance", "bench", "tune"])
def test_a_run_where_nothing_ran_says_so_and_fails(argv, expected, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # bench's default --out folder
    line = _one_line_error(capsys, argv, expected)
    assert "pass" not in line


def test_the_module_entry_point_exits_with_the_status(tmp_path):
    r = subprocess.run([sys.executable, "-m", "mla_dispatch", "demo", "--page-size", "0"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == ("python -m mla_dispatch demo: error: argument --page-size: expected an integer >= 1, "
                                "got '0' (see --help)")
