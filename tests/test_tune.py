"""The measured dispatch table: written by `tune`, read back, loaded lazily at the first
selection, and able to reorder `priority()` — but never to pick a backend that was wrong."""

import pytest
import torch

import mla_dispatch
from mla_dispatch.dispatch import select, tuned
from mla_dispatch.tools import tune
from mla_dispatch.backends.reference import ReferenceBackend
from mla_dispatch.tools.bench import BenchRow
from mla_dispatch.dispatch.platform import detect_platform
from mla_dispatch.numerics.cases import make_case

CPU = detect_platform("cpu")


class FakeFast(ReferenceBackend):
    """A correct third-party backend: on a CPU, "auto" tries it before the reference."""

    NAME = "test_tune_fake_fast"


class WrongButInstant(ReferenceBackend):
    """Fastest of all because it computes nothing: the gate must keep it out of the table."""

    NAME = "test_tune_wrong_instant"

    @classmethod
    def run(cls, state, q, kv_cache, block_table, cache_seqlens, *, out, lse, **kw):
        out.zero_()
        lse.zero_()


@pytest.fixture
def clean(monkeypatch, tmp_path, registered):
    """No table from the environment or the user's cache; state restored afterwards.

    Returns the shared ``registered`` helper, so test backends are unregistered too.
    """
    monkeypatch.delenv(tuned.ENV_VAR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    tuned.reload_table()
    yield registered
    tuned.reload_table()


def _problem(gen, **kw):
    case = make_case(2, 1, 16, 64, generator=gen, **kw)
    plan = mla_dispatch.plan_decode(*case.args(), **case.kwargs(), backend="reference")
    return plan.problem


def _doc(fingerprint, table):
    return {"format": tuned.TABLE_FORMAT, "fingerprint": fingerprint, "device": "x", "versions": {},
            "created": "today", "metric": "run", "table": table, "measurements": {}}


def test_round_trip(clean, tmp_path):
    doc = _doc(tuned.fingerprint(CPU), {"rows16-hkv1-d576x512-ps64-bf16-dense": "reference", "b": "triton"})
    path = tmp_path / "sub" / "t.json"
    tune.write_table(path, doc)
    assert tuned.read_table(path) == doc


@pytest.mark.parametrize("text, message", [
    ("not json", "not JSON"),
    ('{"format": "other/9", "table": {}}', "expected 'mla_dispatch-tuned-table/1'"),
    ('{"format": "mla_dispatch-tuned-table/1", "fingerprint": "x", "table": {"a": 3}}', "map shape buckets"),
])
def test_bad_files_are_rejected_with_a_reason(tmp_path, text, message):
    path = tmp_path / "t.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        tuned.read_table(path)


def test_table_reorders_selection_loaded_lazily_from_env(clean, tmp_path, monkeypatch, gen):
    fake = clean(FakeFast)
    problem = _problem(gen)
    other_bucket = _problem(gen, page_size=16)
    assert select.select_backend(problem, CPU) is FakeFast  # default: plugins before the reference
    bucket = tuned.shape_bucket(problem)
    path = tmp_path / "table.json"
    tune.write_table(path, _doc(tuned.fingerprint(CPU), {bucket: "reference"}))
    monkeypatch.setenv(tuned.ENV_VAR, str(path))
    tuned.reload_table()  # forget the earlier look-up; nothing is read until the next selection
    assert tuned.tuned_table() is None
    assert select.select_backend(problem, CPU).NAME == "reference"
    assert tuned.tuned_table() == (tuned.fingerprint(CPU), {bucket: "reference"})
    assert select.explain(problem, CPU).chosen == "reference"
    assert select.priority(problem, CPU, tuned.tuned_table()[1])[0] == "reference"
    assert select.select_backend(other_bucket, CPU).NAME == fake  # buckets not in the table keep the default
    out, _ = mla_dispatch.mla_decode(*make_case(2, 1, 16, 64, generator=gen).args())
    assert out.shape == (2, 1, 16, 512)
    description = tuned.active_table_description(CPU)
    assert str(path) in description and "in use" in description and "1 buckets" in description


def test_table_of_another_device_is_ignored(clean, tmp_path, monkeypatch, gen):
    clean(FakeFast)
    problem = _problem(gen)
    path = tmp_path / "table.json"
    tune.write_table(path, _doc("NVIDIA H100 80GB HBM3|sm_90", {tuned.shape_bucket(problem): "reference"}))
    monkeypatch.setenv(tuned.ENV_VAR, str(path))
    tuned.reload_table()
    assert select.select_backend(problem, CPU) is FakeFast
    assert "NOT used: measured on NVIDIA H100" in tuned.active_table_description(CPU)


def test_unreadable_table_never_breaks_selection(clean, tmp_path, monkeypatch, gen):
    path = tmp_path / "table.json"
    path.write_text("{broken")
    monkeypatch.setenv(tuned.ENV_VAR, str(path))
    tuned.reload_table()
    assert select.select_backend(_problem(gen), CPU).NAME == "reference"
    assert "unreadable" in tuned.active_table_description(CPU)


def test_default_path_is_per_device_under_the_cache_dir(clean, tmp_path):
    path = tuned.table_path(CPU)
    assert path == tmp_path / "cache" / "mla_dispatch" / "tuned-cpu_cpu.json"
    assert "none (default order" in tuned.active_table_description(CPU)


def test_pick_winners_needs_every_config_correct():
    rows = [
        BenchRow("c1", "a", "", "ok", us_run=10.0), BenchRow("c2", "a", "", "ok", us_run=10.0),
        BenchRow("c1", "b", "", "ok", us_run=5.0), BenchRow("c2", "b", "", "wrong"),
        BenchRow("c1", "c", "", "ok", us_run=30.0, us_graph=1.0),
        BenchRow("c2", "c", "", "ok", us_run=30.0, us_graph=2.0),
        BenchRow("c3", "a", "", "unsupported"), BenchRow("c3", "b", "", "error"),
    ]
    buckets = {"c1": "x", "c2": "x", "c3": "y"}
    table, measured = tune.pick_winners(rows, buckets, "run")
    assert table == {"x": "a"} and measured == {"x": {"a": 20.0, "c": 60.0}}
    table, measured = tune.pick_winners(rows, buckets, "graph")  # graph time where there is one
    assert table == {"x": "c"} and measured["x"] == {"a": 20.0, "c": 3.0}


def test_tune_cli_end_to_end(clean, tmp_path, monkeypatch, capsys, gen):
    wrong = clean(WrongButInstant)
    out = tmp_path / "tuned.json"
    rc = tune.main(["--quick", "--backends", f"reference,{wrong}", "--out", str(out), "--quiet", "--rep-ms", "3"])
    assert rc == 0
    doc = tuned.read_table(out)
    configs = tune.tune_configs(quick=True, device_type="cpu")
    buckets = {tune.config_bucket(c, seed=i) for i, c in enumerate(configs)}
    assert set(doc["table"]) == buckets
    # the work of each bucket's configs, for carrying the table to another device
    assert set(doc["work"]) == buckets
    for bucket, work in doc["work"].items():
        mine = [i for i, c in enumerate(configs) if tune.config_bucket(c, seed=i) == bucket]
        assert work["configs"] == len(mine) and work["flops"] > 0 and work["bytes"] > 0
    assert set(doc["table"].values()) == {"reference"}  # the instant-but-wrong one never wins
    assert all(wrong not in m for m in doc["measurements"].values())
    assert doc["fingerprint"] == tuned.fingerprint(CPU) and doc["versions"]["torch"] == torch.__version__
    assert "excluded: " + wrong in capsys.readouterr().err
    # the bucket a config lands in is the one selection computes for its problems
    from mla_dispatch.tools.bench import case_problem, make_bench_case

    for i, cfg in enumerate(configs):
        problem = case_problem(make_bench_case(cfg, seed=i))  # the case run_bench made for config i
        assert tune.config_bucket(cfg, seed=i) == tuned.shape_bucket(problem)
    # and the written file, pointed to, drives selection
    monkeypatch.setenv(tuned.ENV_VAR, str(out))
    tuned.reload_table()
    assert select.select_backend(problem, CPU).NAME == "reference"


def test_lookup_takes_the_nearest_measured_size_of_the_same_shape_class():
    """A table measured at some batches and capacities answers for the others by the nearest size (octaves of
    batch + octaves of capacity), never across shape classes; a size-less entry (format-1 tables) is the fallback."""
    import dataclasses

    base = mla_dispatch.DecodeProblem(batch=128, q_len=1, num_heads_q=128, num_heads_kv=1, head_dim_qk=576,
                                      head_dim_v=512, page_size=64, max_blocks=512, q_dtype=torch.bfloat16,
                                      kv_format="bf16", causal=False, topk=0, return_lse=True, device_type="cuda")
    at = lambda b, blocks: dataclasses.replace(base, batch=b, max_blocks=blocks)  # noqa: E731
    table = {tuned.shape_bucket(at(1, 64)): "cuda_sm90", tuned.shape_bucket(at(128, 512)): "flashmla"}
    assert tuned.shape_bucket(at(128, 512)).endswith("-b128-L32768")
    assert tuned.lookup(table, at(1, 64)) == "cuda_sm90"           # its own bucket
    assert tuned.lookup(table, at(2, 64)) == "cuda_sm90"           # one octave of batch away
    assert tuned.lookup(table, at(100, 400)) == "flashmla"          # rounds up into the measured bucket
    assert tuned.lookup(table, at(16, 128)) == "flashmla"           # 4 + 1 octaves against 3 + 2: a tie, larger wins
    other_class = dataclasses.replace(base, page_size=16)
    assert tuned.lookup(table, other_class) is None
    assert tuned.lookup({tuned.shape_class(base): "triton"}, at(7, 3)) == "triton"


def test_table_from_a_saved_bench_run(clean, tmp_path, capsys):
    """`tune --from-json` ranks a saved bench run's rows (no measuring): the bucket of each config is the one its
    run drew, the winner the fastest backend correct on every config of the bucket, the device the run's."""
    from mla_dispatch.tools import bench

    wrong = clean(WrongButInstant)
    assert bench.main(["--grid", "quick", "--backends", f"reference,{wrong}", "--quiet", "--rep-ms", "2",
                       "--out", str(tmp_path), "--seed", "5"]) == 1  # the wrong backend fails the gate
    out = tmp_path / "table.json"
    assert tune.main(["--from-json", str(tmp_path / "bench-quick.json"), "--out", str(out)]) == 0
    doc = tuned.read_table(out)
    want = {tune.config_bucket(c, seed=5 + i) for i, c in enumerate(bench.grid_configs("quick"))}
    assert set(doc["table"]) == want and set(doc["table"].values()) == {"reference"}
    assert doc["fingerprint"] == tuned.fingerprint(CPU)
def test_tune_where_no_backend_ran_correctly_writes_nothing(clean, tmp_path, monkeypatch, capsys):
    import mla_dispatch.tools.bench as bench
    from mla_dispatch.tools.roofline import Ceilings

    monkeypatch.setattr(bench, "measure_ceilings", lambda device: Ceilings("test", 1e10, 1e11, "fixed"))
    wrong = clean(WrongButInstant)
    out = tmp_path / "tuned.json"
    rc = tune.main(["--grid", "quick", "--backends", wrong, "--out", str(out), "--quiet", "--rep-ms", "2"])
    err = capsys.readouterr().err
    assert rc == 1 and f"nothing ran: no backend ({wrong}) ran every config of any bucket correctly" in err
    assert not out.exists()


def test_the_shipped_h100_table_is_used_on_an_h100_unless_the_user_has_one(clean, tmp_path, monkeypatch):
    """The package ships the table measured on our H100 (bench + tune --from-json); on a simulated H100 with no
    table of the user's it reorders selection, a user's own table replaces it, and another device ignores it."""
    from fakes import B200, H100

    h100_problem = mla_dispatch.DecodeProblem(batch=128, q_len=1, num_heads_q=128, num_heads_kv=1, head_dim_qk=576,
                                              head_dim_v=512, page_size=64, max_blocks=160, q_dtype=torch.bfloat16,
                                              kv_format="bf16", causal=False, topk=0, return_lse=True,
                                              device_type="cuda")
    doc = tuned.read_table(tuned.shipped_table_path(H100))
    assert doc["fingerprint"] == tuned.fingerprint(H100) and doc["metric"] == "graph"
    assert "b128" in tuned.shape_bucket(h100_problem) and tuned.lookup(doc["table"], h100_problem)
    table = tuned.active_table(H100)
    assert table == doc["table"] and "shipped" in tuned.active_table_description(H100)
    assert select.priority(h100_problem, H100, table)[0] == tuned.lookup(doc["table"], h100_problem)
    tuned.reload_table()
    assert tuned.active_table(B200) is None  # no table shipped for it, and the H100's is not its
    tuned.reload_table()
    mine = tmp_path / "mine.json"
    tune.write_table(mine, _doc(tuned.fingerprint(H100), {tuned.shape_bucket(h100_problem): "triton"}))
    monkeypatch.setenv(tuned.ENV_VAR, str(mine))
    assert tuned.active_table(H100) == {tuned.shape_bucket(h100_problem): "triton"}


class SlowReference(ReferenceBackend):
    """Correct, and a quarter of a second per call: enough to spend a small time budget."""

    NAME = "test_tune_slow"

    @classmethod
    def run(cls, state, q, kv_cache, block_table, cache_seqlens, **kw):
        import time

        time.sleep(0.25)
        return super().run(state, q, kv_cache, block_table, cache_seqlens, **kw)


def test_tune_stops_at_its_time_budget_and_shows_it(clean, tmp_path, monkeypatch, capsys):
    """`--budget-s`: no config starts once the budget is spent; the table holds the configs measured (whole), the
    progress bar and the summary show the time against the budget."""
    import mla_dispatch.tools.bench as bench
    from mla_dispatch.tools.roofline import Ceilings

    monkeypatch.setattr(bench, "measure_ceilings", lambda device: Ceilings("test", 1e10, 1e11, "fixed"))
    slow = clean(SlowReference)
    out = tmp_path / "tuned.json"
    assert tune.main(["--quick", "--backends", slow, "--out", str(out), "--rep-ms", "1", "--budget-s", "1.5"]) == 0
    captured = capsys.readouterr()
    configs = tune.tune_configs(quick=True, device_type="cpu")
    doc = tuned.read_table(out)
    measured = [i for i, c in enumerate(configs) if tune.config_bucket(c, seed=i) in doc["table"]]
    assert 1 <= len(measured) < len(configs) and measured == list(range(len(measured))), "whole configs, in order"
    assert f"measured {len(measured)} of {len(configs)} configs in " in captured.out
    assert "of a 1.5 s budget" in captured.out
    skipped = next(line for line in captured.out.splitlines() if line.startswith("not measured (budget spent): "))
    assert skipped.endswith(", ".join(c.label for c in configs[len(measured):]))
    assert "tune:" in captured.err and "/1.5 s" in captured.err  # the progress bar


def test_quick_covers_every_shape_class_of_the_published_grids():
    """A table from `tune --quick` on a GPU answers for every config of the flashmla, heads, latency and pages grids
    (each has its shape class measured, at the nearest size); its configs are among the full grid's, most important
    first."""
    from mla_dispatch.tools.bench import grid_configs

    quick, full = tune.tune_configs(quick=True), tune.tune_configs()
    assert quick == full[:len(quick)] and len(quick) < len(full)
    table = {tune.config_bucket(c, seed=i): "x" for i, c in enumerate(quick)}
    for grid in ("flashmla", "heads", "latency", "pages"):
        for i, cfg in enumerate(grid_configs(grid)):
            assert tuned.lookup(table, tune.config_problem(cfg, seed=i)) == "x", f"{grid}: {cfg.label}"


@pytest.mark.gpu
def test_tune_quick_on_a_gpu_keeps_its_budget_and_drives_auto(clean, tmp_path, monkeypatch, capsys):
    """On a GPU: `tune --quick` with a short budget measures whole configs, most important first, until the budget is
    spent, writes a table with each bucket's work, and auto then runs that table's winner."""
    import re

    out = tmp_path / "tuned.json"
    assert tune.main(["--quick", "--budget-s", "10", "--rep-ms", "5", "--quiet", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    m = re.search(r"measured (\d+) of (\d+) configs in (\d+) s of a 10 s budget", text)
    assert m and int(m[1]) >= 1, text
    doc = tuned.read_table(out)
    assert doc["metric"] == "graph" and doc["table"] and set(doc["work"]) == set(doc["table"])
    monkeypatch.setenv(tuned.ENV_VAR, str(out))
    tuned.reload_table()
    platform = detect_platform("cuda")
    problem = tune.config_problem(tune.tune_configs(quick=True)[0], seed=0, device_type="cuda")
    assert tuned.shape_bucket(problem) in doc["table"], "the first config is measured first"
    assert select.select_backend(problem, platform).NAME == doc["table"][tuned.shape_bucket(problem)]
    assert "yours" in tuned.active_table_description(platform)
