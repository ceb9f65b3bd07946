"""FlashMLA's own decoding tests (``tests/test_flash_mla_dense_decoding.py`` and
``tests/test_flash_mla_sparse_decoding.py``) through our FlashMLA API on one of our backends.

    python dev/flashmla_test.py {dense,sparse} FLASHMLA_SRC/tests [--backend cuda_sm90] [--limit N] [--json FILE]
                                [--model {all,v32,model1}] [--sample N] [--shard K/N] [--cases JSON,...]

``import flash_mla`` resolves to :mod:`mla_dispatch.compat.flash_mla` (a real FlashMLA on the path is hidden for
this process), ``backend="auto"`` may choose only ``--backend``, and FlashMLA's own ``test_flash_mla`` runs each of
its cases: its data, its call, its reference and its bounds (``kk.check_is_allclose``). Its timing is not run
(dense: ``test_performance=False``; sparse: ``num_runs=0``): it reads FlashMLA's kernel names from a profiler
trace, and ``bench`` times ours.

- dense: FlashMLA's ``main`` for ``--dtype`` (its correctness, corner and performance-shape cases, in its order);
  it stops at the first case that fails, as FlashMLA's does.
- sparse: every case of its ``gen_testcase``: DeepSeek-V3.2's (``d_qk=576``, the ``fp8_ds_mla`` cache) and
  MODEL1's (``d_qk=512``: DeepSeek-V4's ``fp8_ds_v4`` cache, extra caches, ``topk_length``; all with
  ``attn_sink``), or only one model's (``--model``), or a random sample of ``--sample`` of them (the same
  for a given ``--seed``); the counts are reported per model. ``--shard K/N`` takes every N-th case from the K-th
  (N processes side by side on one GPU: the cases' data generation and reference are host-bound); ``--cases`` only
  those an earlier run's JSON files list as failed (``taken[k::n]`` of a shard, re-run alone).
- ``--reuse-meta`` (dense): FlashMLA's contract lets a ``FlashMLASchedMeta`` be reused while the shapes and the
  lengths stay the same, and reads ``block_table`` and the cache on every call. So before each of its calls on a
  fresh meta, the same meta is first filled by a call on another table: the cache's blocks moved to a random
  permutation of their places and the table rewritten to match (same attention, other block ids). FlashMLA's own
  check then judges its call, which must read its own table, not the one the meta was filled with.

Exit status 1 when a case fails.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import sys
import time
import warnings


def _dense(fm_test, args, torch, tqdm) -> dict:
    """FlashMLA's dense ``main`` with each case's timing switched off; counts the cases it ran."""
    bar = tqdm(desc=f"FlashMLA dense test on {args.backend}", file=sys.stderr, unit="case")
    run = fm_test.test_flash_mla
    count = {"n": 0}

    def correctness_only(t):
        if args.limit and count["n"] >= args.limit:
            return
        with contextlib.redirect_stdout(io.StringIO()):
            run(dataclasses.replace(t, test_performance=False))
        count["n"] += 1
        bar.update()

    fm_test.test_flash_mla = correctness_only  # main() looks the name up in its module
    failures = []
    try:
        fm_test.main({"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype])
    except Exception as exc:  # FlashMLA's own assert on the first wrong case
        failures.append({"case_index": count["n"], "note": f"{type(exc).__name__}: {exc}"[:600]})
    bar.close()
    return {"taken": count["n"] + len(failures), "passed": count["n"], "failed": len(failures), "not_run": {},
            "failures": failures, "dtype": args.dtype}


def _fill_meta_with_another_table(flash_mla, torch) -> None:
    """Wrap ``flash_mla.flash_mla_with_kvcache`` (the alias FlashMLA's test calls) so that a dense call on a fresh
    ``FlashMLASchedMeta`` is preceded by one on the same meta with the cache's blocks permuted and the table
    rewritten to match: the meta is then reused, with another table and cache, by FlashMLA's own call."""
    real = flash_mla.flash_mla_with_kvcache

    def reused(q, k_cache, block_table, cache_seqlens, head_dim_v, meta, *args, **kwargs):
        if block_table is not None and isinstance(meta, flash_mla.FlashMLASchedMeta) and not meta.have_initialized:
            num_blocks = k_cache.shape[0]
            perm = torch.randperm(num_blocks, device=k_cache.device)
            moved = torch.empty_like(k_cache)
            moved[perm] = k_cache  # block j now lives at perm[j]
            valid = (block_table >= 0) & (block_table < num_blocks)  # unused entries (2147480000) stay as they are
            table = torch.where(valid, perm[block_table.clamp(0, num_blocks - 1).long()].to(block_table.dtype),
                                block_table)
            real(q, moved, table, cache_seqlens, head_dim_v, meta, *args, **kwargs)
            del moved
        return real(q, k_cache, block_table, cache_seqlens, head_dim_v, meta, *args, **kwargs)

    flash_mla.flash_mla_with_kvcache = reused
def _model(c) -> str:
    return "v32" if c.d_qk == 576 else "model1"


def _sparse(fm_test, args, torch, tqdm) -> dict:
    import random

    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device("cuda:0")
    taken, not_run = [], {}
    for c in fm_test.gen_testcase():
        if args.model != "all" and _model(c) != args.model:
            reason = f"--model {args.model}"
            not_run[reason] = not_run.get(reason, 0) + 1
            continue
        taken.append(dataclasses.replace(c, num_runs=0, check_correctness=True))
    if args.cases:
        import glob

        wanted, paths = set(), [p for pattern in args.cases.split(",") for p in sorted(glob.glob(pattern))]
        if not paths:
            raise SystemExit(f"--cases {args.cases}: no such file")
        for path in paths:
            with open(path) as f:
                wanted |= {x["case"] for x in json.load(f).get("failures", [])}
        not_run["not in --cases"] = sum(repr(c) not in wanted for c in taken)
        taken = [c for c in taken if repr(c) in wanted]
    if args.shard:
        k, n = (int(x) for x in args.shard.split("/"))
        not_run[f"other shards of {n}"] = len(taken) - len(taken[k::n])
        taken = taken[k::n]
    if args.sample and args.sample < len(taken):
        keep = sorted(random.Random(args.seed).sample(range(len(taken)), args.sample))
        not_run["not sampled"] = len(taken) - len(keep)
        taken = [taken[i] for i in keep]
    if args.limit:
        taken = taken[: args.limit]
    failures = []
    per_model = {m: {"taken": 0, "passed": 0} for m in ("v32", "model1")}
    for c in tqdm(taken, desc=f"FlashMLA sparse test on {args.backend}", file=sys.stderr):
        buf = io.StringIO()
        try:
            with contextlib.redirect_stdout(buf):  # test_flash_mla prints a block per case
                result = fm_test.test_flash_mla(c.to_test_param())
            ok, note = result.is_correct, buf.getvalue()[-600:]
        except Exception as exc:  # a case that raises is a failure with its message
            ok, note = False, f"{type(exc).__name__}: {exc}"
        per_model[_model(c)]["taken"] += 1
        per_model[_model(c)]["passed"] += bool(ok)
        if not ok:
            failures.append({"case": repr(c), "note": note})
            print(f"FAIL {c}\n{note}", file=sys.stderr)
    return {"taken": len(taken), "passed": len(taken) - len(failures), "failed": len(failures), "not_run": not_run,
            "per_model": per_model, "failures": failures[:1000]}  # (--cases re-runs them)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("which", choices=("dense", "sparse"), help="FlashMLA's dense or sparse decoding test")
    ap.add_argument("tests_dir", help="FlashMLA's tests/ folder (lib.py, ref.py, kernelkit/)")
    ap.add_argument("--backend", default="cuda_sm90", help="the mla_dispatch backend that runs the cases")
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16", help="dense: q and cache dtype")
    ap.add_argument("--limit", type=int, default=0, help="run only the first N cases that we take (0: all)")
    ap.add_argument("--json", help="write the counts and failures here")
    ap.add_argument("--reuse-meta", action="store_true",
                    help="dense: fill each FlashMLASchedMeta with a call on another (permuted) table first")
    ap.add_argument("--model", choices=("all", "v32", "model1"), default="all",
                    help="sparse: DeepSeek-V3.2's cases (d_qk 576), MODEL1's (DeepSeek-V4, d_qk 512), or both")
    ap.add_argument("--sample", type=int, default=0, help="sparse: a random sample of N of the cases taken (0: all)")
    ap.add_argument("--seed", type=int, default=0, help="the sample's seed")
    ap.add_argument("--shard", help="sparse: K/N, every N-th case from the K-th (0 <= K < N)")
    ap.add_argument("--cases", help="sparse: only the cases that failed in these earlier --json files (comma-separated "
                                    "paths or a glob: each file's 'failures' list names its cases)")
    args = ap.parse_args(argv)

    import torch
    from tqdm import tqdm

    from mla_dispatch import use_backends
    from mla_dispatch.compat.flash_mla.alias import install_flash_mla_alias

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the shadow warning: hiding the real FlashMLA is the point here
        install_flash_mla_alias("current", shadow_installed=True)
    sys.path.insert(0, args.tests_dir)
    t0 = time.time()
    with use_backends(args.backend):
        if args.which == "dense":
            import test_flash_mla_dense_decoding as fm_test  # FlashMLA's file, after the alias
            if args.reuse_meta:
                _fill_meta_with_another_table(fm_test.flash_mla, torch)
            summary = _dense(fm_test, args, torch, tqdm)
        else:
            import test_flash_mla_sparse_decoding as fm_test
            summary = _sparse(fm_test, args, torch, tqdm)
    summary = {"test": args.which, "backend": args.backend, "reuse_meta": args.reuse_meta, **summary,
               "seconds": round(time.time() - t0, 1),
               "device": torch.cuda.get_device_name()}
    print(json.dumps({k: v for k, v in summary.items() if k != "failures"}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
