"""The conformance matrix on CPU: a second backend (amla_emulation, its own code) passes against the
reference, deliberately wrong backends are caught cell by cell, unsupported cells carry the backend's
own reason, and the exit code says so (1 also when nothing was checked)."""

import json

import torch

from mla_dispatch.tools import conformance
from mla_dispatch.backends.reference import ReferenceBackend

CPU = torch.device("cpu")


class WrongOffset(ReferenceBackend):
    NAME = "test_conf_offset"

    @classmethod
    def run(cls, state, q, kv_cache, block_table, cache_seqlens, **kw):
        super().run(state, q, kv_cache, block_table, cache_seqlens, **kw)
        kw["out"].add_(0.01)


class IgnoresCausal(ReferenceBackend):
    """Right except that it never applies the causal mask."""

    NAME = "test_conf_ignores_causal"

    @classmethod
    def run(cls, state, q, kv_cache, block_table, cache_seqlens, *, problem, **kw):
        import dataclasses

        super().run(state, q, kv_cache, block_table, cache_seqlens, problem=dataclasses.replace(problem, causal=False),
                    **kw)


class Base2Lse(ReferenceBackend):
    """Returns a base-2 LSE (the mistake docs/design.md §2 tells adapters to convert)."""

    NAME = "test_conf_base2_lse"

    @classmethod
    def run(cls, state, q, kv_cache, block_table, cache_seqlens, **kw):
        super().run(state, q, kv_cache, block_table, cache_seqlens, **kw)
        kw["lse"].mul_(1.4426950408889634)


class ReadsPastLength(ReferenceBackend):
    """Reads one slot past every request's length: the NaN poison (or the bad table entry) must show."""

    NAME = "test_conf_reads_past_length"

    @classmethod
    def run(cls, state, q, kv_cache, block_table, cache_seqlens, **kw):
        super().run(state, q, kv_cache, block_table, cache_seqlens + 1, **kw)


class Bf16Only(ReferenceBackend):
    NAME = "test_conf_bf16_only"
    KV_FORMATS = frozenset({"bf16"})
    SUPPORTS_SPARSE = False


class Fp16Only(ReferenceBackend):
    """Declines bf16 queries, as the Triton kernel does under TRITON_INTERPRET=1."""

    NAME = "test_conf_fp16_only"
    Q_DTYPES = frozenset({torch.float16})
    runs = 0

    @classmethod
    def run(cls, state, q, kv_cache, block_table, cache_seqlens, **kw):
        assert q.dtype == torch.float16
        cls.runs += 1
        super().run(state, q, kv_cache, block_table, cache_seqlens, **kw)


def _cases(*names):
    by_name = {c.name: c for c in conformance.case_set(quick=False)}
    return [by_name[n] for n in names]


def test_case_set_covers_the_design_features():
    quick, full = conformance.case_set(quick=True), conformance.case_set(quick=False)
    assert {c.name for c in quick} < {c.name for c in full}
    params = [c.params for c in quick]
    assert {p.get("page_size") for p in params} >= {1, 16, 64, 256}
    assert {p.get("num_heads_q") for p in params} >= {16, 64, 128}
    assert any(p.get("num_heads_kv", 1) > 1 for p in params)
    assert any(p.get("causal") for p in params) and any(p.get("q_len", 1) > 1 and not p.get("causal") for p in params)
    assert any(not p.get("varlen") for p in params) and any(p.get("zero_len_rows") for p in params)
    assert {p.get("kv_format") for p in params} >= {None, "fp8_e4m3", "fp8_ds_mla"}
    assert any(p.get("dtype") == torch.float16 for p in params)
    assert any(p.get("topk") for p in params) and any(p.get("head_dim_qk", 576) != 576 for p in params)


def test_quick_matrix_second_backend_passes_wrong_backend_fails(registered, tmp_path, capsys, seed):
    """The passing column is amla_emulation (the AMLA recurrence, its own code) against the reference: not the
    reference against itself."""
    wrong = registered(WrongOffset)
    path = tmp_path / "conf.json"
    rc = conformance.main(["--quick", "--backends", f"amla_emulation,{wrong}", "--quiet", "--seed", str(seed),
                           "--json", str(path)])
    assert rc == 1
    printed = capsys.readouterr().out
    assert f"| case | amla_emulation | {wrong} |" in printed
    doc = json.loads(path.read_text())
    assert doc["seed"] == seed
    matrix = doc["matrix"]
    assert set(matrix) == {c.name for c in conformance.case_set(quick=True)}
    amla_runs = {c.name for c in conformance.case_set(quick=True)
                 if c.params.get("kv_format") is None and not c.params.get("topk")}  # bf16/fp16, dense
    assert len(amla_runs) >= 15
    for case, cells in matrix.items():
        assert cells["amla_emulation"]["status"] == ("pass" if case in amla_runs else "unsupported"), (case, cells)
        assert cells[wrong]["status"] == "fail", (case, cells[wrong])
        assert cells[wrong]["max_abs"] >= 0.005  # the worst error is reported
    assert "| baseline | pass | FAIL (max abs" in printed


def test_cells_fail_only_where_the_bug_shows(registered, seed):
    causal_bug, lse_bug = registered(IgnoresCausal), registered(Base2Lse)
    cases = _cases("baseline", "s_q=2", "s_q=2 causal", "zero-length rows")
    matrix = conformance.run_conformance(cases, [causal_bug, lse_bug], device=CPU, seed=seed, progress=False)
    assert matrix["baseline"][causal_bug].status == "pass"
    assert matrix["s_q=2"][causal_bug].status == "pass"
    assert matrix["s_q=2 causal"][causal_bug].status == "fail"
    for case in ("baseline", "s_q=2", "s_q=2 causal"):
        assert matrix[case][lse_bug].status == "fail" and "lse" in matrix[case][lse_bug].detail
    # +inf stays +inf when scaled: zero-length rows alone would not catch it, the other rows do
    assert matrix["zero-length rows"][lse_bug].status == "fail"


def test_reading_poisoned_slots_is_caught(registered, seed):
    leak = registered(ReadsPastLength)
    matrix = conformance.run_conformance(_cases("nan-poison", "page_size=1"), [leak], device=CPU, seed=seed,
                                         progress=False)
    for case, cells in matrix.items():
        assert cells[leak].status in ("fail", "error"), (case, cells[leak])


def test_unsupported_cells_carry_the_backends_reason(registered, seed):
    name = registered(Bf16Only)
    cases = _cases("baseline", "fp8_e4m3", "sparse topk=64")
    matrix = conformance.run_conformance(cases, [name], device=CPU, seed=seed, progress=False)
    assert matrix["baseline"][name].status == "pass"
    assert matrix["fp8_e4m3"][name].status == "unsupported"
    assert "kv_format=fp8_e4m3 (supported: {bf16})" in matrix["fp8_e4m3"][name].detail
    assert "sparse indices" in matrix["sparse topk=64"][name].detail
    text = conformance.format_matrix(matrix, [name])
    assert "| fp8_e4m3 | unsupported [1] |" in text
    assert f"[1] {name}: kv_format=fp8_e4m3 (supported: {{bf16}})" in text


def test_all_pass_exits_zero(capsys, seed):
    """The reference's own cells (the oracle against itself) are not counted among the passes."""
    rc = conformance.main(["--quick", "--backends", "reference,amla_emulation", "--quiet", "--seed", str(seed)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    quick = conformance.case_set(quick=True)
    amla = sum(c.params.get("kv_format") is None and not c.params.get("topk") for c in quick)
    assert (f"{amla} cell(s) checked against the reference: all pass; {len(quick) - amla} unsupported; "
            f"{len(quick)} cell(s) of the reference itself, not counted") in captured.out


def test_nothing_checked_exits_nonzero(capsys, seed):
    """Every cell unsupported (cuda_sm90 on this CPU), or only the reference (the oracle) ran: exit 1, and say so."""
    rc = conformance.main(["--quick", "--backends", "cuda_sm90", "--quiet", "--seed", str(seed)])
    captured = capsys.readouterr()
    assert rc == 1 and "nothing was checked: every backend declined every case" in captured.err
    assert "pass or are unsupported" not in captured.out + captured.err
    rc = conformance.main(["--quick", "--backends", "reference", "--quiet", "--seed", str(seed)])
    assert rc == 1 and "only the reference ran, and it is the oracle itself" in capsys.readouterr().err


def test_dtype_replaces_every_cases_q_dtype(registered, tmp_path, capsys, seed):
    """``--dtype fp16``: every row runs fp16 q (and cache), so an fp16-only backend (Triton in the interpreter) is
    checked on every row instead of declining all but the fp16 one."""
    name = registered(Fp16Only)
    cases = _cases("baseline", "fp8_e4m3", "fp16")
    as_given = conformance.run_conformance(cases, [name], device=CPU, seed=seed, progress=False)
    assert as_given["baseline"][name].status == "unsupported" and "q dtype=bfloat16" in as_given["baseline"][name].detail
    assert as_given["fp16"][name].status == "pass"
    fp16 = conformance.run_conformance(cases, [name], device=CPU, seed=seed, progress=False, dtype=torch.float16)
    assert {c: row[name].status for c, row in fp16.items()} == {"baseline": "pass", "fp8_e4m3": "pass", "fp16": "pass"}
    Fp16Only.runs = 0
    path = tmp_path / "conf.json"
    rc = conformance.main(["--quick", "--dtype", "fp16", "--backends", name, "--quiet", "--seed", str(seed),
                           "--json", str(path)])
    assert rc == 0, capsys.readouterr().err
    assert "fp16 throughout" in capsys.readouterr().out
    doc = json.loads(path.read_text())
    assert doc["dtype"] == "fp16"
    statuses = [cell["status"] for row in doc["matrix"].values() for cell in row.values()]
    assert statuses.count("pass") == len(statuses) == Fp16Only.runs  # the reference runs everything, fp16 too


def test_the_reference_column_is_the_oracle_not_passes(seed):
    """On a CPU the default columns include the reference: its cells compare it with itself, so they read
    ``oracle`` and the summary counts only the other backends' passes."""
    cases = _cases("baseline", "fp8_e4m3")
    matrix = conformance.run_conformance(cases, ["reference", "amla_emulation"], device=CPU, seed=seed, progress=False)
    assert [matrix[c]["reference"].status for c in matrix] == ["oracle", "oracle"]
    assert matrix["baseline"]["amla_emulation"].status == "pass"
    text = conformance.format_matrix(matrix, ["reference", "amla_emulation"])
    assert "| baseline | oracle | pass |" in text and "not counted as passes" in text


def test_a_vendor_library_that_aborts_fails_its_cell_and_the_run_goes_on(registered, seed):
    """A vendor backend's cells run in a child process: the cell whose call aborts the process reads ERROR with how
    the child died and the vendor's own assert text; a fresh child runs that backend's next cells; the other
    backends' cells run as usual, and this process lives on."""
    from fakes.fake_abort import ASSERT_TEXT, AbortingVendorBackend

    name = registered(AbortingVendorBackend)
    assert conformance.isolated(name) and not conformance.isolated("amla_emulation")
    small = dict(batch=2, q_len=1, num_heads_q=4, seqlen=40, page_size=16, varlen=True)
    cases = [conformance.ConformanceCase("small", "576/512", small),
             conformance.ConformanceCase("small d=512/512", "the vendor aborts", {**small, "head_dim_qk": 512}),
             conformance.ConformanceCase("small fp16", "after the abort", {**small, "dtype": torch.float16})]
    matrix = conformance.run_conformance(cases, ["amla_emulation", name], device=CPU, seed=seed, progress=False)
    assert {c: row["amla_emulation"].status for c, row in matrix.items()} == dict.fromkeys(matrix, "pass")
    assert matrix["small"][name].status == "pass" and matrix["small fp16"][name].status == "pass"
    died = matrix["small d=512/512"][name]
    assert died.status == "error", died
    assert "died of SIGABRT in this cell" in died.detail and ASSERT_TEXT in died.detail, died.detail
