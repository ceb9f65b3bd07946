"""FlashMLA's own sparse-decoding test (``tests/test_flash_mla_sparse_decoding.py``) through our FlashMLA API on one
of our backends.

    python dev/flashmla_sparse_test.py FLASHMLA_SRC/tests [--backend cuda_sm90] [--limit N] [--json FILE]

``import flash_mla`` resolves to :mod:`mla_dispatch.compat.flash_mla` (a real FlashMLA on the path is hidden for
this process), ``backend="auto"`` may choose only ``--backend``, and FlashMLA's own ``test_flash_mla`` runs each of
its cases: its data (``lib.generate_testcase_for_decode``), its call (``lib.run_flash_mla_decode``), its reference
(``ref.ref_sparse_attn_decode``) and its bounds (``kk.check_is_allclose``). Its cases are run as correctness checks
only (``num_runs=0``: its timing reads FlashMLA's kernel names from a profiler trace; ``bench`` times ours). Cases
with what our API does not take (``d_qk=512``, the MODEL1 cache format, and the extra caches and ``topk_length``
that only those cases use) are counted as not run, with the reason. Exit status 1 when a case fails.
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tests_dir", help="FlashMLA's tests/ folder (lib.py, ref.py, kernelkit/)")
    ap.add_argument("--backend", default="cuda_sm90", help="the mla_dispatch backend that runs the cases")
    ap.add_argument("--limit", type=int, default=0, help="run only the first N cases that we take (0: all)")
    ap.add_argument("--json", help="write the counts and failures here")
    args = ap.parse_args(argv)

    import torch
    from tqdm import tqdm

    from mla_dispatch.compat.flash_mla.alias import install_flash_mla_alias
    from mla_dispatch import use_backends

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the shadow warning: hiding the real FlashMLA is the point here
        install_flash_mla_alias("current", shadow_installed=True)
    sys.path.insert(0, args.tests_dir)
    import test_flash_mla_sparse_decoding as fm_test  # noqa: E402  (FlashMLA's file, after the alias)

    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device("cuda:0")
    raw = fm_test.gen_testcase()
    taken, not_run = [], {}
    for c in raw:
        if c.d_qk != 576:
            reason = "d_qk=512 (MODEL1 cache format, extra caches, topk_length): not in mla_dispatch's API"
            not_run[reason] = not_run.get(reason, 0) + 1
            continue
        taken.append(dataclasses.replace(c, num_runs=0, check_correctness=True))
    if args.limit:
        taken = taken[: args.limit]
    failures, t0 = [], time.time()
    # test_flash_mla prints a block per case; keep the console to the progress bar and the failures
    with use_backends(args.backend):
        for c in tqdm(taken, desc=f"FlashMLA sparse test on {args.backend}", file=sys.stderr):
            buf = io.StringIO()
            try:
                with contextlib.redirect_stdout(buf):
                    result = fm_test.test_flash_mla(c.to_test_param())
                ok, note = result.is_correct, buf.getvalue()[-600:]
            except Exception as exc:  # a case that raises is a failure with its message
                ok, note = False, f"{type(exc).__name__}: {exc}"
            if not ok:
                failures.append({"case": repr(c), "note": note})
                print(f"FAIL {c}\n{note}", file=sys.stderr)
    summary = {"backend": args.backend, "taken": len(taken), "passed": len(taken) - len(failures),
               "failed": len(failures), "not_run": not_run, "seconds": round(time.time() - t0, 1),
               "device": torch.cuda.get_device_name(), "failures": failures[:20]}
    print(json.dumps({k: v for k, v in summary.items() if k != "failures"}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
