"""Host (CPU) cost of the Triton backend's ``DecodePlan.run``, against its GPU time (GPU machine).

    python dev/triton_host_cost.py [--specs hM64-n64-w8-tma-gl,hM64-n64-w8-tma] [--heads 64] [--profile]

For each config: 50 calls enqueued back to back (host µs per call), then the same with the GPU's completion (µs per
call); ``--profile`` adds a cProfile of 50 calls. Where the host takes longer than the GPU, eager timings
(``bench_triton.py``'s ``us`` column) measure the host; CUDA-graph replay does not (docs/notes/triton.md,
"Host cost"). b=64, L=8192, bf16, page 64.
"""
import argparse
import cProfile
import pstats
import time

import torch

from bench_triton import make_inputs
from mla_dispatch import plan_decode
from mla_dispatch.backends.triton import TritonBackend
from mla_dispatch.kernels.triton.aot_report import parse_spec


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--specs", default="hM64-n64-w8-tma-gl,hM64-n64-w8-tma")
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    for spec in args.specs.split(","):
        q, kv, table, lens, _ = make_inputs(64, 1, args.heads, 8192, varlen=False)
        plan = plan_decode(q, kv, table, lens, causal=False, backend="triton")
        plan._state = TritonBackend.make_state(plan.problem, plan.platform, lens, config=parse_spec(spec),
                                               block_table=plan.block_table, softmax_scale=plan.softmax_scale)
        out = torch.empty(64, 1, args.heads, 512, dtype=q.dtype, device="cuda")
        lse = torch.empty(64, args.heads, 1, device="cuda")
        for _ in range(3):  # compile
            plan.run(q, kv, out=out, lse=lse)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(50):
            plan.run(q, kv, out=out, lse=lse)
        t_host = (time.perf_counter() - t) / 50
        torch.cuda.synchronize()
        t_all = (time.perf_counter() - t) / 50
        print(f"{spec}: host {t_host * 1e6:.1f} us per call (enqueue), with the GPU {t_all * 1e6:.1f} us", flush=True)
        if args.profile:
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(50):
                plan.run(q, kv, out=out, lse=lse)
            pr.disable()
            torch.cuda.synchronize()
            pstats.Stats(pr).sort_stats("cumulative").print_stats(14)


if __name__ == "__main__":
    main()
