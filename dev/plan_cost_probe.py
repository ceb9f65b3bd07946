"""Where a plan's host time goes beyond what cProfile sees (issue 55): ``plan_decode`` timed with the plan dropped
(as dev/host_cost.py times it), kept alive (no teardown in the span), its teardown alone, and the backend's
``plan`` alone; each with a device sync after it and with the GPU kept busy (dev/host_cost.py's host_us / busy_us).

    source ci/gpu_setup.sh; python -m mla_dispatch build
    python dev/plan_cost_probe.py [--backends cuda_sm90,triton] [--reps 50]

Prints one JSON line per backend (µs, medians).
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from host_cost import busy_us, host_us, make_inputs  # dev/ on sys.path (python dev/plan_cost_probe.py)
from mla_dispatch import plan_decode
from mla_dispatch.dispatch.registry import get_backend


def teardown_us(make, reps: int) -> float:
    """Median µs of dropping a plan ``make()`` returned (and the device sync after it)."""
    samples = []
    for _ in range(reps):
        plan = make()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        del plan
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - t0)
    samples.sort()
    return samples[len(samples) // 2] * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="cuda_sm90,triton")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    q, kv, table, lens = make_inputs(1, 4096, False)
    kw = dict(softmax_scale=192 ** -0.5)
    for name in args.backends.split(","):
        make = lambda: plan_decode(q, kv, table, lens, backend=name, **kw)  # noqa: E731
        kept: list = []
        plan = make()
        cls = get_backend(name)
        opts = cls.check_options(None)

        def backend_plan():
            return cls.plan(plan.problem, plan.platform, table, lens, softmax_scale=plan.softmax_scale,
                            options=opts)

        row = {"backend": name, "plan_dropped": host_us(make, args.reps),
               "plan_kept": host_us(lambda: kept.append(make()), args.reps)}
        kept.clear()
        row["teardown"] = teardown_us(make, args.reps)
        row["backend_plan_dropped"] = host_us(backend_plan, args.reps)
        gc.disable()
        row["plan_dropped_gc_off"] = host_us(make, args.reps)
        gc.enable()
        row["plan_dropped_busy"] = busy_us(make, args.reps)
        row["plan_kept_busy"] = busy_us(lambda: kept.append(make()), args.reps)
        kept.clear()
        row["backend_plan_busy"] = busy_us(backend_plan, args.reps)
        print(json.dumps({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
