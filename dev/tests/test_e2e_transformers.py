"""dev/e2e_transformers.py in its --tiny mode on the CPU: it runs stock and the reference backend on the same
prompts, its JSON carries the environment and one row per (batch, backend), and the figures follow from the
measured times."""

import importlib.util
import json
import pathlib
import sys

import pytest

pytest.importorskip("transformers", minversion="5.17", reason="transformers>=5.17 is not installed")

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("e2e_transformers", _ROOT / "e2e_transformers.py")
e2e = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(e2e)


def test_tiny_run_writes_consistent_rows(tmp_path, seed, monkeypatch):
    out = tmp_path / "run.json"
    argv = ["--tiny", "--batch", "1,2", "--prompt", "24", "--new", "5", "--repeats", "2", "--left-pad",
            "--backends", "stock:eager,reference,no_such_backend", "--seed", str(seed % 1000), "--host-time",
            "--json", str(out)]
    monkeypatch.setattr(sys, "argv", ["e2e_transformers.py", *argv])
    assert e2e.main(argv) == 1  # the unknown backend is reported as an error row, the others still run
    doc = json.loads(out.read_text())
    env = doc["environment"]
    for key in ("date", "device", "torch", "transformers", "mla_dispatch", "command", "model"):
        assert env[key], key
    assert env["model"]["kv_lora_rank"] == 512 and env["model"]["qk_rope_head_dim"] == 64
    assert "--tiny" in env["command"]
    rows = {(r["batch"], r["backend"]): r for r in doc["rows"]}
    assert set(rows) == {(b, n) for b in (1, 2) for n in ("stock:eager", "reference", "no_such_backend")}
    for batch in (1, 2):
        assert "unknown backend 'no_such_backend'" in rows[batch, "no_such_backend"]["error"]
        stock, ours = rows[batch, "stock:eager"], rows[batch, "reference"]
        assert stock["attn_implementation"] == "eager"
        assert ours["tokens_compared_with"] == "stock:eager" and ours["speedup_baseline"] == "stock:eager"
        assert ours["backend_used"] == "reference"
        # warm-up (2 + 1 tokens) and repeats (5 + 1 tokens each): every step after the prefill decodes through us
        assert ours["decode_steps_through_mla_dispatch"] == 2 + 2 * 5
        assert ours["tokens_compared"] == batch * 6
        for row in (stock, ours):
            assert row["decode_ms"] == pytest.approx(1e3 * _median(row["decode_s_runs"]))
            assert row["decode_tokens_per_s"] == pytest.approx(batch * 5 / (row["decode_ms"] / 1e3))
            assert row["ms_per_step"] == pytest.approx(row["decode_ms"] / 5)
        assert stock["speedup_vs_stock"] == 1.0
        assert ours["speedup_vs_stock"] == pytest.approx(ours["decode_tokens_per_s"] / stock["decode_tokens_per_s"])
        # host time: one sample per layer (2) and decode step (5) of each repeat (2), the p90 at least the median
        for row in (stock, ours):
            assert row["host_samples"] == 2 * 5 * 2
            assert 0 < row["host_us_per_layer_step"] <= row["host_us_per_layer_step_p90"]


def _median(values):
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2
