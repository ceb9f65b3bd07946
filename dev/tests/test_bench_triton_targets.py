"""dev/bench_triton.py's chart of a run against issue 3's targets: every row's value and verdict follow from the raw
timings, on fresh random results, and the chart renders from a saved run (no GPU)."""

import importlib.util
import pathlib
import random

import pytest

pytest.importorskip("triton")  # the script imports it at the top, as it runs on the GPU machine

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_triton", _ROOT / "bench_triton.py")
bench_triton = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_triton)


def _results(rng: random.Random) -> list[dict]:
    """A run's ``results`` as bench_one writes them, with random times (some configs without a graph timing)."""
    def entry(name, h_q, kv_format="bf16"):
        us = rng.uniform(5.0, 500.0)
        graph = rng.choice([None, rng.uniform(5.0, 500.0)])
        return dict(name=name, h_q=h_q, kv_format=kv_format, us=us, us_graph=graph,
                    roofline_us=rng.uniform(1.0, 400.0))

    out = [entry(f"flashmla-s{s}-L{L}", 128) for s in (1, 2) for L in (4096, 32768)]
    out += [entry(f"mem-h{h}", h) for h in (16, 64)]
    out += [entry(f"page{p}-h{h}", h) for p in (1, 16) for h in (16, 64)]
    out += [entry(f"{f}-h{h}", h, f) for f in ("fp8_e4m3", "fp8_ds_mla") for h in (16, 32)]  # no mem-h32: no row
    out += [entry("graph-b1-L4096", 128), entry("graph-b1-L32768", 128)]
    return out


def test_target_rows_follow_from_the_timings(seed):
    rng = random.Random(seed)
    results = _results(rng)
    by = {r["name"]: r for r in results}

    def t(name):  # the graph replay where timed, else the eager run
        return by[name]["us_graph"] or by[name]["us"]

    rows = {r["name"]: r for r in bench_triton.target_rows(results)}
    targets = bench_triton.TARGETS
    expected = {}
    for n, r in by.items():
        if n.startswith("flashmla-"):
            expected[n] = ("pct", 100 * r["roofline_us"] / t(n), targets["flashmla_pct"], True)
        elif n.startswith("mem-"):
            expected[n] = ("pct", 100 * r["roofline_us"] / t(n), targets["mem_pct"], True)
        elif n.startswith("page"):
            expected[n] = ("page", 100 * (t(n) / t(f"mem-h{r['h_q']}") - 1), 100 * targets["page_within"], False)
        elif n.startswith("fp8_") and f"mem-h{r['h_q']}" in by:
            target = targets["fp8_speedup"] if r["kv_format"] == "fp8_e4m3" else None
            expected[n] = ("fp8", t(f"mem-h{r['h_q']}") / t(n), target, True)
        elif n == "graph-b1-L4096":
            expected[n] = ("b1", t(n), targets["b1_us"], False)
    assert rows.keys() == expected.keys()  # fp8 at 32 heads and b = 1 at 32K have no row
    for n, (panel, value, target, higher) in expected.items():
        row = rows[n]
        assert row["panel"] == panel and row["value"] == pytest.approx(value) and row["target"] == target, row
        assert row["met"] == (None if target is None else (value >= target) == higher), row


def test_chart_renders_from_a_saved_run(chart_from_saved_run, seed):
    pytest.importorskip("matplotlib")
    saved = dict(device="a GPU", torch="x", triton="y", copy_Bps=3e12, matmul_flops=7e14,
                 results=_results(random.Random(seed)))
    png = chart_from_saved_run(bench_triton, saved)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
