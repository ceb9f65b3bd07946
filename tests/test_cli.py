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


def _one_line_error(capsys, argv, *expected, status=None):
    """Run ``argv``; it must exit non-zero (``status`` where given) with exactly one line on stderr containing each
    of ``expected``."""
    rc = main(argv)
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert rc != 0 and status in (None, rc), (argv, rc, captured.out[-500:])
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


@pytest.mark.skipif(not NO_CUDA, reason="checks the CPU path of demo")
def test_demo_dtype_fp16(capsys):
    """``--dtype fp16`` makes q and the cache fp16 (how the Triton kernel runs on a CPU, under TRITON_INTERPRET=1)."""
    assert main(["demo", "--dtype", "fp16", "--lengths", "40,0,9", "--heads", "4", "--seed", "5"]) == 0
    out = capsys.readouterr().out
    assert "q=fp16 kv=fp16" in out and out.strip().endswith("PASS")
    assert main(["demo", "--dtype", "fp16", "--kv-format", "fp8_e4m3", "--lengths", "40,9", "--heads", "4"]) == 0
    assert "q=fp16 kv=fp8_e4m3" in capsys.readouterr().out
    _one_line_error(capsys, ["demo", "--dtype", "fp16", "--kv-format", "bf16"], "--kv-format", "--dtype fp16")


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
    pytest.param(["demo", "--lengths", "-5,10"], ["--lengths", "integers >= 0", "'-5,10'"],
                 id="demo-lengths-negative-first"),
    pytest.param(["demo", "--heads", "-2"], ["--heads", "integer >= 1", "'-2'"], id="demo-heads-negative"),
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


@pytest.mark.parametrize("argv,expected", [
    (["demo", "--seed", "99999999999999999999"], ["--seed", "[-2**63, 2**63 - 1]"]),
    (["conformance", "--seed", str(1 << 64)], ["--seed", "[-2**63, 2**63 - 1]"]),
    (["bench", "--seed", str(-(1 << 63) - 1)], ["--seed", "[-2**63, 2**63 - 1]"]),
    (["demo", "--page-size", "99999999", "--device", "cpu"], ["--page-size", "GiB on cpu", "are free"]),
    (["demo", "--lengths", "99999999999", "--device", "cpu"], ["--lengths", "99999999999 cached tokens", "are free"]),
], ids=["demo-seed-overflow", "conformance-seed-overflow", "bench-seed-underflow", "demo-page-size-huge",
        "demo-lengths-huge"])
def test_values_too_large_are_one_line_and_exit_2(argv, expected, capsys):
    """These once ended in tracebacks: torch's seed overflow, an allocator's "can't allocate memory"."""
    _one_line_error(capsys, argv, "error:", *expected, status=2)


def _bench_json_problems(tmp_path):
    (tmp_path / "folder").mkdir()
    (tmp_path / "text.json").write_text("not json")
    (tmp_path / "binary.json").write_bytes(bytes(range(128, 256)))
    (tmp_path / "list.json").write_text("[1, 2, 3]")
    (tmp_path / "other.json").write_text('{"rows": 5}')
    (tmp_path / "bad-config.json").write_text('{"configs": {"a": {"no_such_field": 1}}, "rows": [], "environment": {}}')
    return [("missing.json", "does not exist"), ("folder", "is a folder, not a file"),
            ("text.json", "is not JSON (Expecting value at line 1, column 1)"), ("binary.json", "is not text"),
            ("list.json", "holds a JSON list, expected an object"), ("other.json", "is not a saved bench run (no 'configs')"),
            ("bad-config.json", "is not a saved bench run")]


def test_tune_from_json_that_is_not_a_saved_run_is_one_line_and_exit_2(tmp_path, capsys):
    for name, expected in _bench_json_problems(tmp_path):
        path = str(tmp_path / name)
        argv = ["tune", "--from-json", path, "--dry-run"]
        _one_line_error(capsys, argv, "argument --from-json", repr(path), expected, status=2)


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


def test_a_closed_pipe_ends_quietly():
    """``python -m mla_dispatch --help | head -3``: the reader closes the pipe early; no BrokenPipeError traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "mla_dispatch", "--help"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # closed before the child writes: its first write meets EPIPE
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(timeout=300) == 1
    assert "Traceback" not in err and "BrokenPipe" not in err, err
