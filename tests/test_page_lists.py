"""The packed page lists FlashInfer's wrapper plans with (mla_dispatch/metadata/page_lists.py): the one-launch Triton
kernel against the torch ops, bit for bit, and both against a plain loop over the table.

The kernel runs under Triton's interpreter in a child process (``python tests/test_page_lists.py SEED``, one JSON line
per case: TRITON_INTERPRET=1 must be set before triton is imported) and on the GPU (``gpu``)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from mla_dispatch.metadata.page_lists import PageLists, _kernel, packed_page_lists

# (id, batch, max_blocks, page_size)
CASES = [("b1-mb1-ps64", 1, 1, 64), ("b5-mb7-ps16", 5, 7, 16), ("b9-mb33-ps1", 9, 33, 1), ("b3-mb1500-ps64", 3, 1500, 64)]


def _inputs(batch: int, max_blocks: int, page_size: int, gen: torch.Generator, device="cpu"):
    """A table of random distinct block ids and lengths from 0 to past the table's capacity (clamped there)."""
    table = torch.randperm(batch * max_blocks * 2, generator=gen)[: batch * max_blocks].view(batch, max_blocks).int()
    lens = torch.randint(0, max_blocks * page_size + page_size, (batch,), generator=gen, dtype=torch.int32)
    lens[0] = 0
    return table.to(device), lens.to(device)


def _by_loop(table: torch.Tensor, lens: torch.Tensor, page_size: int):
    """The lists by a Python loop over requests (the definition)."""
    batch, max_blocks = table.shape
    indptr, pos, ids = [0], [], []
    for b in range(batch):
        n = min(max(int(lens[b]), 0), max_blocks * page_size)
        pages = -(-n // page_size)
        pos += [b * max_blocks + j for j in range(pages)]
        ids += [int(table[b, j]) for j in range(pages)]
        indptr.append(indptr[-1] + pages)
    pad = batch * max_blocks - len(pos)
    return (torch.tensor(indptr, dtype=torch.int32), torch.tensor(pos + [0] * pad, dtype=torch.int32),
            torch.tensor(ids + [0] * pad, dtype=torch.int32))


def _kernel_lists(table: torch.Tensor, lens: torch.Tensor, page_size: int):
    """The kernel launched directly (``kernel[grid]``: the interpreter on a CPU), into outputs poisoned with -7."""
    import triton

    batch, max_blocks = table.shape
    indptr = torch.full((batch + 1,), -7, dtype=torch.int32, device=table.device)
    pos = torch.full((batch * max_blocks,), -7, dtype=torch.int32, device=table.device)
    ids = torch.full((batch * max_blocks,), -7, dtype=torch.int32, device=table.device)
    _kernel()[(batch,)](table, lens, indptr, pos, ids, batch, max_blocks, page_size, table.stride(0), lens.stride(0),
                        BLOCK_B=triton.next_power_of_2(batch), BLOCK_J=min(1024, triton.next_power_of_2(max_blocks)))
    return indptr, pos, ids


def _mismatch(got, want) -> str:
    names = ("indptr", "page_pos", "indices")
    bad = [n for n, g, w in zip(names, got, want) if not torch.equal(g.cpu(), w.cpu())]
    return ", ".join(bad)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_torch_ops_match_the_loop(gen, case):
    _, batch, max_blocks, page_size = case
    table, lens = _inputs(batch, max_blocks, page_size, gen)
    assert _mismatch(packed_page_lists(table, lens, page_size), _by_loop(table, lens, page_size)) == ""
    lists = PageLists(batch, max_blocks, page_size, torch.device("cpu"))
    lists.indptr.fill_(-7)
    lists.update(table, lens)  # on a CPU: the torch ops, in place
    assert _mismatch((lists.indptr, lists.page_pos, lists.indices), _by_loop(table, lens, page_size)) == ""
    with pytest.raises(ValueError, match=r"block_table must be \["):
        lists.update(table[:, :-1] if max_blocks > 1 else table[:0], lens)


def _run_cases(seed: int) -> None:
    """Child process (TRITON_INTERPRET=1): one JSON line per case."""
    for i, (cid, batch, max_blocks, page_size) in enumerate(CASES):
        gen = torch.Generator().manual_seed(seed + i)
        try:
            table, lens = _inputs(batch, max_blocks, page_size, gen)
            bad = _mismatch(_kernel_lists(table, lens, page_size), _by_loop(table, lens, page_size))
            msg = f"kernel differs from the loop in: {bad}" if bad else ""
        except Exception as exc:  # reported to the parent
            bad, msg = True, f"{type(exc).__name__}: {exc}"
        print(json.dumps({"id": cid, "ok": not bad, "message": msg}), flush=True)


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    from tests.conftest import interpreter_child_results

    return interpreter_child_results(__file__)


@pytest.mark.parametrize("case_id", [c[0] for c in CASES])
def test_kernel_under_interpreter(interpreter_results, case_id):
    rec = interpreter_results.get(case_id)
    assert rec is not None, f"case {case_id} did not report (child crashed?)"
    assert rec["ok"], rec["message"]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_kernel_on_the_gpu_in_place(gen, case):
    """PageLists on a GPU (the kept launch): equal to the loop, then again after the lengths and table changed in
    place (the same launch, the tensors' new values)."""
    _, batch, max_blocks, page_size = case
    table, lens = _inputs(batch, max_blocks, page_size, gen, device="cuda")
    lists = PageLists(batch, max_blocks, page_size, table.device)
    for _ in range(2):
        lists.update(table, lens)
        assert lists._launch is not None, "the kernel did not run"
        got = (lists.indptr, lists.page_pos, lists.indices)
        assert _mismatch(got, _by_loop(table.cpu(), lens.cpu(), page_size)) == ""
        new_table, new_lens = _inputs(batch, max_blocks, page_size, gen, device="cuda")
        table.copy_(new_table)
        lens.copy_(new_lens)


if __name__ == "__main__":
    _run_cases(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
