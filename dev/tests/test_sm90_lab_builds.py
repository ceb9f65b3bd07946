"""The diagnosis builds of the native kernel (per-CTA timeline, ablation masks) and their drivers in dev/
(``python -m pytest dev/tests``; not part of the README's test command)."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from mla_dispatch.kernels.cuda import build

DEV = pathlib.Path(__file__).resolve().parents[1]


def test_timeline_build_compiles_for_sm90a(tmp_path, monkeypatch):
    """The build that stamps a per-CTA timeline (``MLA_SM90_TIMELINE=1``, dev/sm90_timeline.py) compiles."""
    nvcc = build.nvcc_path()
    if nvcc is None:
        pytest.skip("nvcc not found (needs CUDA >= 12.4)")
    monkeypatch.setenv("MLA_SM90_TIMELINE", "1")
    obj = tmp_path / "launch.o"
    cmd = [nvcc, "-c", str(build.SM90_SOURCE_DIR / "launch.cu"), "-o", str(obj), "-I", str(build.SM90_SOURCE_DIR),
           "-I", build.cutlass_include_dir(), *build.nvcc_flags()]
    assert "-DMLA_SM90_TIMELINE" in cmd
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"nvcc failed:\n{proc.stdout}\n{proc.stderr}"


def test_timeline_build_is_a_separate_extension(monkeypatch):
    """The diagnosis build gets its own define and its own source hash, so it never loads in place of the kernels."""
    monkeypatch.delenv("MLA_SM90_TIMELINE", raising=False)
    plain_flags, plain_hash = build.nvcc_flags(), build._source_hash()
    monkeypatch.setenv("MLA_SM90_TIMELINE", "1")
    assert build.timeline_build()
    assert build.nvcc_flags() == plain_flags + ["-DMLA_SM90_TIMELINE"]
    assert build._source_hash() != plain_hash


def test_ablation_build_is_a_separate_extension_per_mask(monkeypatch):
    """``$MLA_SM90_ABLATE`` (dev/sm90_ablate.py) gives each mask its own define and source hash; a value that is not an
    integer is refused with the variable named."""
    monkeypatch.delenv("MLA_SM90_TIMELINE", raising=False)
    monkeypatch.delenv("MLA_SM90_ABLATE", raising=False)
    assert build.ablate_bits() is None
    plain_flags, plain_hash = build.nvcc_flags(), build._source_hash()
    hashes = set()
    for mask in (1, 16):
        monkeypatch.setenv("MLA_SM90_ABLATE", str(mask))
        assert build.ablate_bits() == mask
        assert build.nvcc_flags() == plain_flags + [f"-DMLA_SM90_ABLATE={mask}"]
        hashes.add(build._source_hash())
    assert len(hashes) == 2 and plain_hash not in hashes
    monkeypatch.setenv("MLA_SM90_ABLATE", "load")
    with pytest.raises(build.KernelBuildError, match="MLA_SM90_ABLATE"):
        build.nvcc_flags()

def test_ablation_driver_names_masks_and_refuses_unknown_bits(monkeypatch, capsys):
    """dev/sm90_ablate.py describes a mask by the parts it skips and refuses bits the kernel does not have, before it
    builds anything."""
    path = DEV / "sm90_ablate.py"
    spec = importlib.util.spec_from_file_location("sm90_ablate", path)
    ablate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ablate)
    assert ablate.describe(0) == "-"
    assert ablate.describe(1 | 16) == "load+O^T"
    monkeypatch.setattr(sys, "argv", ["sm90_ablate.py", "--masks", "0,1,128"])
    monkeypatch.setattr(ablate, "build", lambda mask: pytest.fail("built before the masks were checked"))
    with pytest.raises(SystemExit):
        ablate.main()
    assert "--masks" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["sm90_ablate.py", "--masks", "0", "--variant", "6"])  # v7 and v8 only
    with pytest.raises(SystemExit):
        ablate.main()
    assert "--variant" in capsys.readouterr().err


def test_ablation_driver_replots_saved_runs(tmp_path, monkeypatch):
    """``--replot`` draws saved rows (a mask's first row counts) without building or timing anything."""
    pytest.importorskip("matplotlib")
    path = DEV / "sm90_ablate.py"
    spec = importlib.util.spec_from_file_location("sm90_ablate", path)
    ablate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ablate)
    runs = [[{"mask": 0, "skipped": "-", "h16_us": 150.0}, {"mask": 1, "skipped": "load", "h16_us": 100.0}],
            [{"mask": 1, "skipped": "load", "h16_us": 999.0}, {"mask": 16, "skipped": "O^T", "h16_us": 140.0}]]
    files = []
    for i, rows in enumerate(runs):
        files.append(tmp_path / f"run{i}.json")
        files[-1].write_text(json.dumps(rows))
    drawn = []
    monkeypatch.setattr(ablate, "plot", lambda rows, out, title="": drawn.append((rows, out)))
    monkeypatch.setattr(ablate, "build", lambda mask: pytest.fail("--replot built an extension"))
    png = tmp_path / "chart.png"
    monkeypatch.setattr(sys, "argv", ["sm90_ablate.py", "--replot", *map(str, files), "--plot", str(png)])
    ablate.main()
    (rows, out), = drawn
    assert [(r["mask"], r["h16_us"]) for r in rows] == [(0, 150.0), (1, 100.0), (16, 140.0)] and out == str(png)
    monkeypatch.undo()
    ablate.plot(rows, str(png))  # the real chart
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

def test_timeline_reader_converts_wait_counters(monkeypatch):
    """dev/sm90_timeline.py reads v7 / v8's cycle counters (params.h, kTimelineCounterBase) as µs at the SM clock it
    measures from the stamps, and reports none for kernels that keep no counters."""
    pytest.importorskip("triton")
    ci = DEV
    monkeypatch.syspath_prepend(str(ci))  # the script imports bench_cuda_sm90 beside it
    spec = importlib.util.spec_from_file_location("sm90_timeline", ci / "sm90_timeline.py")
    tl_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tl_mod)
    params = (build.SM90_SOURCE_DIR / "params.h").read_text()
    assert re.search(rf"\bkTimelineCounters = {len(tl_mod.COUNTERS)}\b", params), "params.h and COUNTERS disagree"
    ctas, events = 3, tl_mod.COUNTER_BASE + len(tl_mod.COUNTERS)
    g = torch.Generator().manual_seed(0)
    ghz = 1.5 + torch.rand((), generator=g).item()  # cycles per ns
    life_ns = 50_000 + int(torch.randint(0, 10_000, (), generator=g))
    tl = torch.zeros(ctas, events, 2, dtype=torch.int64)
    cycles = torch.randint(1, 100_000, (ctas, len(tl_mod.COUNTERS)), generator=g)
    for c in range(ctas):
        tl[c, 0] = torch.tensor([1_000, 7])  # entry: globaltimer ns, clock64
        tl[c, tl_mod.END] = torch.tensor([1_000 + life_ns, 7 + round(life_ns * ghz)])
        tl[c, tl_mod.COUNTER_BASE:, 0] = cycles[c]
    items = [(c, 0, 64, -1) for c in range(ctas)]
    offsets = list(range(ctas + 1))
    got = tl_mod.analyse(tl, items, offsets, ctas)
    for i in range(len(tl_mod.COUNTERS)):
        want = [cycles[c, i].item() / ghz / 1e3 for c in range(ctas)]
        assert got["counters"][i] == pytest.approx(want, rel=1e-4)
    tl[:, tl_mod.COUNTER_BASE:, 0] = 0
    assert tl_mod.analyse(tl, items, offsets, ctas)["counters"] == []
