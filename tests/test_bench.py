"""The benchmark harness on CPU: the quick grid end to end, and the correctness gate.

Speed is never asserted; what is checked is that every artefact is produced,
that numbers are counted from the measured times, and that a wrong backend is
reported and never timed.
"""

import csv
import json
import math
from types import MappingProxyType

import pytest
import torch

from mla_dispatch.tools import bench
from mla_dispatch.backends.reference import ReferenceBackend
from mla_dispatch.dispatch.backend import BackendOption, OptionNotSupported
from mla_dispatch.numerics.oracle import reference_attention
from mla_dispatch.tools.roofline import Ceilings
from mla_dispatch.numerics.cases import UNUSED_BLOCK_ID

FIXED_CEILINGS = Ceilings("test", bytes_per_s=1e10, flops_per_s=1e11, how="fixed for the test")


class _Counting(ReferenceBackend):
    runs = 0

    @classmethod
    def run(cls, state, q, kv_cache, block_table, cache_seqlens, **kw):
        cls.runs += 1
        super().run(state, q, kv_cache, block_table, cache_seqlens, **kw)


class WrongOffset(_Counting):
    """Right everywhere except a constant 0.01 added to the output (10x the bf16 atol)."""

    NAME = "test_wrong_offset"

    @classmethod
    def run(cls, state, q, kv_cache, block_table, cache_seqlens, **kw):
        super().run(state, q, kv_cache, block_table, cache_seqlens, **kw)
        kw["out"].add_(0.01)


class WrongOneElement(_Counting):
    """Off in a single output element: the gate is per element, not an average."""

    NAME = "test_wrong_one_element"

    @classmethod
    def run(cls, state, q, kv_cache, block_table, cache_seqlens, **kw):
        super().run(state, q, kv_cache, block_table, cache_seqlens, **kw)
        kw["out"].view(-1)[7] += 0.05


class OnlyPage64(ReferenceBackend):
    NAME = "test_only_page64"
    PAGE_SIZES = frozenset({64})


def test_quick_grid_end_to_end(tmp_path, capsys, seed):
    rc = bench.main(["--grid", "quick", "--backends", "reference", "--out", str(tmp_path), "--plot", "--quiet",
                     "--rep-ms", "5", "--seed", str(seed)])
    assert rc == 0
    printed = capsys.readouterr().out
    configs = bench.grid_configs("quick")
    assert "| config | backend | status | run µs |" in printed
    for cfg in configs:
        assert f"| {cfg.label} | reference | ok |" in printed
    assert "ceilings (measured in this run)" in printed and "CPU" in printed  # says the CPU sizes differ

    doc = json.loads((tmp_path / "bench-quick.json").read_text())
    assert doc["environment"]["torch"] == torch.__version__
    assert doc["ceilings"]["bytes_per_s"] > 0 and doc["ceilings"]["flops_per_s"] > 0
    rows = doc["rows"]
    assert [r["config"] for r in rows] == [c.label for c in configs]
    for r in rows:  # the reference is the oracle here: what is checked is the harness, not its numbers
        assert r["status"] == "ok" and r["us_run"] > 0 and r["us_call"] > 0
        assert r["us_graph"] is None  # no CUDA here
        # the derived columns are the counted work over the measured time
        assert r["tflops_run"] == pytest.approx(r["flops"] / r["us_run"] * 1e-6)
        assert r["gbps_run"] == pytest.approx(r["bytes"] / r["us_run"] * 1e-3)
        assert r["roof_pct_run"] == pytest.approx(100 * r["roofline_us"] / r["us_run"])

    with (tmp_path / "bench-quick.csv").open() as fh:
        csv_rows = list(csv.DictReader(fh))
    assert [r["config"] for r in csv_rows] == [r["config"] for r in rows]
    assert float(csv_rows[0]["us_run"]) == pytest.approx(rows[0]["us_run"])
    png = (tmp_path / "bench-quick.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_an_independent_backend_passes_the_gate_with_its_error_measured(seed):
    """amla_emulation (its own code: the AMLA recurrence) against the reference: checked, then timed, with a measured
    nonzero error within docs §5; an fp8 config it declines carries its reason."""
    configs = [bench.grid_configs("quick")[0], bench.grid_configs("quick")[3]]  # bf16 dense, fp8_e4m3
    rows, _ = bench.run_bench(configs, ["amla_emulation"], device=torch.device("cpu"), ceilings=FIXED_CEILINGS,
                              rep_ms=1, seed=seed, progress=False)
    dense, fp8 = rows
    assert dense.status == "ok", dense.note
    assert 0 < dense.max_abs_err < 8e-3 and dense.cos_diff <= 5e-6 and dense.us_run > 0
    assert fp8.status == "unsupported" and "kv_format=fp8_e4m3" in fp8.note


@pytest.mark.parametrize("wrong", [WrongOffset, WrongOneElement], ids=["offset", "one-element"])
def test_wrong_backend_is_caught_by_the_gate_and_never_timed(wrong, registered, seed):
    name = registered(wrong)
    configs = bench.grid_configs("quick")[:2]
    rows, _ = bench.run_bench(configs, ["reference", name], device=torch.device("cpu"), ceilings=FIXED_CEILINGS,
                              rep_ms=2, seed=seed, progress=False)
    by = {(r.config, r.backend): r for r in rows}
    for cfg in configs:
        bad = by[(cfg.label, name)]
        assert bad.status == "wrong", bad
        assert "out of tolerance" in bad.note
        assert bad.us_run is None and bad.us_call is None and bad.us_graph is None
        assert by[(cfg.label, "reference")].status == "ok"
    assert wrong.runs == len(configs)  # one checking run per config, none timed
    table = bench.format_table(rows)
    assert f"| {configs[0].label} | {name} | wrong: out:" in table


def test_cli_exit_code_is_nonzero_when_a_backend_is_wrong(registered, tmp_path, monkeypatch):
    name = registered(WrongOffset)
    monkeypatch.setattr(bench, "measure_ceilings", lambda device: FIXED_CEILINGS)
    monkeypatch.setattr(bench, "GRIDS", {"quick": ("two configs", lambda: bench._quick_grid()[:1])})
    rc = bench.main(["--grid", "quick", "--backends", f"reference,{name}", "--out", str(tmp_path), "--quiet",
                     "--rep-ms", "2"])
    assert rc == 1
    rows = json.loads((tmp_path / "bench-quick.json").read_text())["rows"]
    assert {r["backend"]: r["status"] for r in rows} == {"reference": "ok", name: "wrong"}


def test_unsupported_config_reports_the_backends_reason(registered):
    name = registered(OnlyPage64)
    cfg = bench.BenchConfig(2, 1, 16, 64, page_size=16)
    (row,), _ = bench.run_bench([cfg], [name], device=torch.device("cpu"), ceilings=FIXED_CEILINGS, rep_ms=2,
                                progress=False)
    assert row.status == "unsupported"
    assert "page_size=16 (supported: {64})" in row.note
    assert row.us_run is None


class ForcedSixteenHeads(ReferenceBackend):
    """The reference with an option whose one value runs 16 heads only (as a forced mainloop takes some shapes)."""

    NAME = "test_forced_heads"
    OPTIONS = MappingProxyType({"heads": BackendOption((16,), "run as if only 16 heads were possible")})

    @classmethod
    def plan(cls, problem, platform, block_table, cache_seqlens, *, softmax_scale, options):
        if options.get("heads") == 16 and problem.num_heads_q != 16:
            raise OptionNotSupported(f"backend_options['heads']=16 cannot run this problem: "
                                     f"h_q={problem.num_heads_q}")
        return super().plan(problem, platform, block_table, cache_seqlens, softmax_scale=softmax_scale)


def test_a_forced_option_that_cannot_run_a_config_is_unsupported_not_an_error(registered, tmp_path, monkeypatch):
    """A sweep of forced options (``name:key=value``) reports the configs an option does not take as unsupported,
    with the plan's reason, and exits 0: nothing was wrong."""
    name = registered(ForcedSixteenHeads)
    monkeypatch.setattr(bench, "measure_ceilings", lambda device: FIXED_CEILINGS)
    monkeypatch.setattr(bench, "GRIDS", {"quick": ("two configs", lambda: [bench.BenchConfig(2, 1, 16, 64),
                                                                           bench.BenchConfig(2, 1, 32, 64)])})
    rc = bench.main(["--grid", "quick", "--backends", f"{name}:heads=16", "--out", str(tmp_path), "--quiet",
                     "--rep-ms", "2", "--no-graph"])
    assert rc == 0
    rows = json.loads((tmp_path / "bench-quick.json").read_text())["rows"]
    assert [r["status"] for r in rows] == ["ok", "unsupported"]
    assert rows[1]["note"] == "backend_options['heads']=16 cannot run this problem: h_q=32"


@pytest.mark.parametrize("cfg", [
    bench.BenchConfig(5, 2, 16, 150, varlen=True, causal=True, page_size=16),
    bench.BenchConfig(3, 1, 16, 100, varlen=True, page_size=64, kv_format="fp8_e4m3"),
    bench.BenchConfig(4, 2, 16, 90, varlen=True, page_size=1, kv_format="fp8_ds_mla", topk=32),
    bench.BenchConfig(3, 2, 16, 150, varlen=True, page_size=64, kv_format="fp8_ds_v4", topk=48, head_dim_qk=512,
                      head_dim_v=512),
], ids=lambda c: c.label)
def test_generated_case_honours_the_data_contract(cfg, seed):
    """docs/design.md §5 data: lengths >= s_q, NaN in every unused slot, unused table entries, valid sparse ids."""
    case = bench.make_bench_case(cfg, seed=seed)
    nb, ps, hkv, _ = case.kv_cache.shape
    lens = case.cache_seqlens.long()
    assert case.q.shape == (cfg.batch, cfg.q_len, cfg.num_heads_q, cfg.head_dim_qk) and bool((lens >= cfg.q_len).all())
    used = torch.zeros(nb, ps, dtype=torch.bool)
    for b in range(cfg.batch):
        n = int(lens[b])
        nblk = math.ceil(n / ps)
        assert bool((case.block_table[b, nblk:] == UNUSED_BLOCK_ID).all())
        for j in range(n):
            used[case.block_table[b, j // ps], j % ps] = True
    from mla_dispatch.kvcache.formats import dequantize_tokens, unpack_ds_v4

    if case.kv_format == "fp8_ds_v4":  # laid out per block: its tokens are not rows of the tensor
        values = unpack_ds_v4(case.kv_cache)
    else:
        values = dequantize_tokens(case.kv_cache, case.kv_format, case.kv_scale)
    assert bool(values[~used].isnan().all()), "an unused slot is not poisoned"
    assert bool(values[used].isfinite().all()) and float(values[used].abs().max()) <= 1.0 + 1e-6
    if cfg.topk:
        idx = case.indices.long()
        for b in range(cfg.batch):
            live = idx[b][idx[b] >= 0]
            assert bool(used.view(-1)[live].all()), "a sparse index points at an unused slot"
    out, lse = reference_attention(case.q, case.kv_cache, case.block_table, case.cache_seqlens, causal=case.causal,
                                   head_dim_v=cfg.head_dim_v, kv_format=case.kv_format, kv_scale=case.kv_scale,
                                   indices=case.indices)
    assert bool(out.isfinite().all())


def test_nothing_ran_exits_nonzero(registered, tmp_path, monkeypatch, capsys):
    """A run in which no backend ran anything says so and exits 1: every named backend unavailable here (checked
    before measuring anything), or available but declining every config (after the table)."""
    rc = bench.main(["--backends", "cuda_sm90", "--out", str(tmp_path), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith("nothing to run: cuda_sm90 (") and len(err.strip().splitlines()) == 1
    name = registered(OnlyPage64)
    monkeypatch.setattr(bench, "measure_ceilings", lambda device: FIXED_CEILINGS)
    monkeypatch.setattr(bench, "GRIDS", {"quick": ("page 16", lambda: [bench.BenchConfig(2, 1, 16, 64, page_size=16)])})
    rc = bench.main(["--backends", name, "--out", str(tmp_path), "--quiet", "--rep-ms", "2"])
    captured = capsys.readouterr()
    assert rc == 1 and f"nothing ran: every backend ({name}) declined every config" in captured.err
    assert "page_size=16 (supported: {64})" in captured.out


def test_host_time_is_the_wall_clock_of_the_call():
    """peers.host_us: the median wall clock of a call (here one that sleeps 2 ms), reported in µs; the table has
    the host columns and the '× FlashMLA' column."""
    import time

    from mla_dispatch.tools.peers import host_us

    us = host_us(lambda: time.sleep(0.002), torch.device("cpu"), reps=5)
    assert 1900 < us < 20000
    head = bench.format_table([]).splitlines()[0]
    assert "host plan / run / call µs" in head and "× FlashMLA" in head


def test_every_row_gets_its_ratio_to_each_peer():
    """'× FlashMLA' and '× FA3': each row's CUDA-graph time over that peer's, the whole eager call's where either has
    no graph time; a peer that failed gives no ratio."""
    from mla_dispatch.tools.peers import PEER_FA3, PEER_FLASHMLA

    rows = [bench.BenchRow("c", "cuda_sm90", "", "ok", us_graph=120.0, us_call=150.0),
            bench.BenchRow("c", "triton", "", "ok", us_call=300.0),
            bench.BenchRow("c", PEER_FLASHMLA, "", "ok", us_graph=100.0, us_call=130.0),
            bench.BenchRow("c", PEER_FA3, "", "ok", us_graph=80.0, us_call=100.0)]
    bench._ratios_to_peers(rows)
    assert (rows[0].x_flashmla, rows[0].x_fa3) == (pytest.approx(1.2), pytest.approx(1.5))
    assert (rows[1].x_flashmla, rows[1].x_fa3) == (pytest.approx(300 / 130), pytest.approx(3.0))
    assert (rows[3].x_flashmla, rows[3].x_fa3) == (pytest.approx(0.8), pytest.approx(1.0))
    head, _, line = bench.format_table(rows[:1]).splitlines()
    assert "| × FlashMLA | × FA3 |" in head and "| 1.200 | 1.500 |" in line
    rows[3].status = "wrong"
    rows[0].x_fa3 = None
    bench._ratios_to_peers(rows)
    assert rows[0].x_fa3 is None and rows[0].x_flashmla == pytest.approx(1.2)


def test_ordered_tables_hold_each_requests_blocks_in_order(seed):
    cfg = bench.BenchConfig(4, 1, 16, 300, varlen=True, page_size=16, ordered=True)
    case = bench.make_bench_case(cfg, seed=seed)
    table, lens = case.block_table, case.cache_seqlens
    used = [table[b, : -(-int(lens[b]) // 16)].tolist() for b in range(4)]
    flat = [i for row in used for i in row]
    assert flat == list(range(len(flat)))  # request after request, block after block
    assert cfg.label.endswith("-ordered")
    shuffled = bench.make_bench_case(bench.BenchConfig(4, 1, 16, 300, varlen=True, page_size=16), seed=seed)
    flat_r = [i for b in range(4) for i in shuffled.block_table[b, : -(-int(shuffled.cache_seqlens[b]) // 16)].tolist()]
    assert flat_r != list(range(len(flat_r)))


def test_backends_help_says_what_runs_by_default_on_a_cpu():
    """The help of --backends matches :func:`bench.default_backends`: on a CPU the reference and every backend that
    imports (amla_emulation aside), no 'auto'; on a GPU no reference, and 'auto' where more than one would run."""
    text = " ".join(bench.parser().format_help().split())
    assert "on a GPU, 'auto' beside them where more than one does" in text
    assert "the reference, the oracle, only on a CPU" in text and "TRITON_INTERPRET=1 with --dtype fp16" in text
    from mla_dispatch.dispatch.registry import get_backend, registered_names

    importable = [n for n in registered_names() if not get_backend(n).availability_reasons() and n != "amla_emulation"]
    assert bench.default_backends(torch.device("cpu")) == importable
    gpu = bench.default_backends(torch.device("cuda"))
    others = [n for n in importable if n != "reference"]
    assert gpu == (["auto"] + others if len(others) > 1 else others)


def test_only_keeps_the_configs_whose_label_contains_a_text(capsys):
    assert bench.main(["--grid", "hopper,latency", "--only", "causal, b1-", "--list"]) == 0
    listed = capsys.readouterr().out.split()
    every = [c.label for g in ("hopper", "latency") for c in bench.grid_configs(g)]
    assert listed == [label for label in every if "causal" in label or "b1-" in label] and listed
    for bad in ("nothing-has-this", " , "):
        assert bench.main(["--grid", "hopper", "--only", bad, "--list"]) == 2
        assert "argument --only" in capsys.readouterr().err


def test_flashmla_sparse_peer_pads_heads_as_engines_do():
    """FlashMLA's SM90 sparse kernel runs 64 or 128 heads: the peer pads fewer to the smallest that holds them (as
    vLLM's FLASHMLA_SPARSE backend pads DeepSeek-V3.2's 16 heads per GPU at TP8 to 64), and runs no more than 128."""
    from mla_dispatch.tools.peers import sparse_padded_heads

    assert [sparse_padded_heads(h) for h in (1, 16, 32, 64, 65, 96, 128, 129, 256)] == [64, 64, 64, 64, 128, 128,
                                                                                       128, 0, 0]
