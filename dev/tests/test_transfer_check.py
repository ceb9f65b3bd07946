"""dev/transfer_check.py on a saved run: the H100 run of RESULTS.md read as if made on an H800, a device with no table
of its own and the H100's spec-sheet compute and memory, so the carried ranking is the H100 table's measured one."""

import importlib.util
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("transfer_check", ROOT / "dev" / "transfer_check.py")
transfer_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(transfer_check)


def test_a_saved_run_read_as_another_device(tmp_path, capsys):
    doc = json.loads((ROOT / "benchmarks" / "h100-auto-shipped-table.json").read_text())
    doc["environment"]["platform"] = "cuda: NVIDIA H800 (sm_90 capability 9.0, 132 compute units)"
    run = tmp_path / "bench-h800.json"
    run.write_text(json.dumps(doc))
    status = transfer_check.main([str(run)])
    out = capsys.readouterr().out
    assert "rule: transferred from NVIDIA H100 80GB HBM3|sm_90" in out and "memory bandwidth x1.00" in out
    table_rows = [line for line in out.splitlines() if line.startswith("| b")]
    assert len(table_rows) == len(doc["configs"])
    summary = out.strip().splitlines()[-1]
    assert summary.startswith("carried rule within 3.0% of the fastest correct backend on ")
    assert status == (0 if " over: " not in summary else 1)


def test_p_sweep_reads_every_shipped_table(capsys):
    assert transfer_check.main(["--p-sweep"]) == 0
    assert "NVIDIA_H100_80GB_HBM3_sm_90.json: p=1: " in capsys.readouterr().out
