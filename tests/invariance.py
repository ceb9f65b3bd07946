"""Batch-invariance checks for the tests: one request's result alone and inside other batches, compared bit for bit.

Used by tests/test_batch_invariant.py (CPU: the reference and the Triton interpreter; GPU: the kernels) for
``plan_decode(batch_invariant=True)``. A *pool* is a :class:`~mla_dispatch.numerics.cases.DecodeCase` of many
requests sharing one cache; a batch is a list of pool rows, and :func:`subset_case` makes it a case of its own on
the same cache and block-table width (as a serving engine's table keeps its width from step to step).
"""

from __future__ import annotations

import dataclasses

import torch

from mla_dispatch import plan_decode
from mla_dispatch.numerics.cases import DecodeCase, poisoned_outputs

__all__ = ["subset_case", "random_batches", "invariance_mismatches"]


def subset_case(pool: DecodeCase, rows: list[int]) -> DecodeCase:
    """The pool's requests ``rows``, in that order, over the pool's cache (q, table, lengths, indices indexed)."""
    idx = torch.tensor(rows, dtype=torch.long, device=pool.q.device)
    return dataclasses.replace(
        pool, q=pool.q[idx].contiguous(), block_table=pool.block_table[idx].contiguous(),
        cache_seqlens=pool.cache_seqlens[idx].contiguous(),
        indices=None if pool.indices is None else pool.indices[idx].contiguous())


def random_batches(pool_size: int, target: int, others: list[int], generator: torch.Generator) -> list[list[int]]:
    """For each count in ``others``, a batch of that many other pool rows (drawn without replacement) with
    ``target`` inserted at a random position."""
    rest = [r for r in range(pool_size) if r != target]
    batches = []
    for n in others:
        if n > len(rest):
            raise ValueError(f"others: {n} other requests asked, the pool has {len(rest)}")
        pick = [rest[i] for i in torch.randperm(len(rest), generator=generator)[:n].tolist()]
        at = int(torch.randint(0, n + 1, (1,), generator=generator))
        batches.append(pick[:at] + [target] + pick[at:])
    return batches


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers, so NaN == NaN and -0 != +0 in comparisons."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def invariance_mismatches(pool: DecodeCase, target: int, batches: list[list[int]], *, backend: str,
                          backend_options: dict | None = None, check_plan=None) -> list[str]:
    """Run ``target`` alone and inside each batch with ``batch_invariant=True`` on ``backend``; describe each batch
    whose result for ``target`` differs from the alone result in any bit of ``out`` or ``lse`` (empty: invariant).

    Outputs are NaN-poisoned before each run. ``check_plan(plan, rows)``, if given, is called on each plan (tests
    assert what the plan chose, e.g. that the target really is split).
    """
    def run(rows):
        case = subset_case(pool, rows)
        plan = _plan(case, backend, backend_options)
        if check_plan is not None:
            check_plan(plan, rows)
        out, lse = poisoned_outputs(case)
        plan.run(case.q, case.kv_cache, kv_scale=case.kv_scale, indices=case.indices, out=out, lse=lse)
        pos = rows.index(target)
        return out[pos].clone(), lse[pos].clone()

    alone_out, alone_lse = run([target])
    problems = []
    if torch.isnan(alone_out).any() or torch.isnan(alone_lse).any():
        problems.append(f"target {target} alone: NaN in its result (a poisoned output was not written)")
    for rows in batches:
        out, lse = run(rows)
        if not (torch.equal(_bits(out), _bits(alone_out)) and torch.equal(_bits(lse), _bits(alone_lse))):
            diff = (out.float() - alone_out.float()).abs().nan_to_num(float("inf")).max().item()
            problems.append(f"batch of {len(rows)} (target at {rows.index(target)}): out differs by up to {diff:.3g}, "
                            f"lse equal: {torch.equal(_bits(lse), _bits(alone_lse))}")
    return problems


def _plan(case: DecodeCase, backend: str, backend_options: dict | None):
    return plan_decode(*case.args(), **case.kwargs(), backend=backend, backend_options=backend_options,
                       batch_invariant=True)
