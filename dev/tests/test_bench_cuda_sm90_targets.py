"""dev/bench_cuda_sm90.py's reading of a run against issue 4's targets: every row's panel, value and verdict follow from
the raw timings (fresh random timings per seed), configs without a bf16 page-64 counterpart get no relative row, and
the chart renders from a saved run without a GPU."""

import importlib.util
import pathlib
import random

import pytest

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_cuda_sm90", _ROOT / "bench_cuda_sm90.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def _rows(rng: random.Random) -> list[dict]:
    """A run's ``rows`` as bench_one writes them (the fields target_rows reads), with random times, from the script's
    own config list: one row per config, so every group and format appears."""
    rows = []
    for cfg in bench.CONFIGS:
        t = rng.uniform(5.0, 900.0)
        roof = rng.uniform(1.0, 700.0)
        bound = "memory" if cfg.get("group") in ("membound", "pages", "pages16", "fp8t", "fp8tsmall") else \
            rng.choice(["memory", "compute"])
        rows.append(dict(cfg, name=bench.config_name(cfg), us_graph=t, us_eager=t * rng.uniform(1.0, 1.5),
                         roofline_us=roof, bound=bound))
    return rows


def _host(rng: random.Random) -> list[dict]:
    return [dict(config=label, run=rng.uniform(2.0, 20.0)) for label, *_ in bench.HOST_CONFIGS]


def test_target_rows_follow_from_the_timings(seed):
    rng = random.Random(seed)
    rows, host = _rows(rng), _host(rng)
    got = {r["name"]: r for r in bench.target_rows(rows, host)}
    targets = bench.TARGETS

    def key(r):
        return (r["b"], r["s_q"], r["h_q"], r["L"], r.get("varlen", True), r.get("causal", False))

    base = {}
    for r in rows:  # the last bf16 page-64 row of a shape is its base
        if r.get("fmt", "bf16") == "bf16" and r.get("ps", 64) == 64:
            base[key(r)] = r["us_graph"]
    expected = {}
    for r in rows:
        t, fmt, b0 = r["us_graph"], r.get("fmt", "bf16"), base.get(key(r))
        if fmt != "bf16":
            if b0 is not None:
                tgt = targets["fp8_mem_speedup"] if r["bound"] == "memory" else targets["fp8_compute_speedup"]
                expected[r["name"]] = ("fp8", b0 / t, tgt, True)
        elif r.get("ps", 64) != 64:
            expected[r["name"]] = ("page", 100 * (t / b0 - 1), 100 * targets["page_within"], False)
        elif r["group"] == "flashmla":
            expected[r["name"]] = ("pct", 100 * r["roofline_us"] / t, targets["flashmla_pct"], True)
        elif r["group"] == "membound":
            expected[r["name"]] = ("pct", 100 * r["roofline_us"] / t, targets["mem_pct"], True)
        elif r["group"] == "small":
            if r["b"] == 1:
                expected[r["name"]] = ("b1", t, targets["b1_us"] if r["L"] == 4096 else None, False)
            else:
                tgt = {8: targets["b8_pct"], 32: targets["b32_pct"]}[r["b"]]
                expected[r["name"]] = ("pct", 100 * r["roofline_us"] / t, tgt, True)
    for h in host:
        expected[h["config"]] = ("host", h["run"], targets["host_us"], False)
    assert got.keys() == expected.keys()
    for name, (panel, value, target, higher) in expected.items():
        row = got[name]
        assert row["panel"] == panel and row["value"] == pytest.approx(value) and row["target"] == target, row
        assert row["met"] == (None if target is None else (value >= target) == higher), row
    # the fp8 configs of the small-batch sweep have no bf16 run of their shape: no row, rather than a wrong base
    assert not any(n.startswith("fp8tsmall-") for n in got)
    assert {"fp8-b128-s1-h128-L8192-fp8_e4m3", "fp8-b64-s1-h16-L8192-fp8_ds_mla"} <= got.keys()


def test_no_base_no_relative_row(seed):
    rng = random.Random(seed)
    rows = [r for r in _rows(rng) if r["group"] not in ("membound", "fp8t", "flashmla")]
    got = bench.target_rows(rows)
    assert not any(r["panel"] in ("page", "fp8") for r in got)


def test_chart_renders_from_a_saved_run(chart_from_saved_run, seed):
    pytest.importorskip("matplotlib")
    rng = random.Random(seed)
    saved = dict(device="a GPU", torch="x", triton="y", date="2026-11-27 00:00 UTC", seed=1, peaks=[3e12, 7e14],
                 rows=_rows(rng), host=_host(rng))
    png = chart_from_saved_run(bench, saved)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
