"""Where does a whole ``mla_decode`` call spend its host time? (cProfile, GPU machine)

    python dev/profile_call.py [--backend cuda_sm90] [--batch 1] [--seqlen 4096]

Prints the per-call wall time of plan_decode, DecodePlan.run and mla_decode at a
small batch (where the host, not the GPU, bounds the call) and the top functions
by cumulative time.
"""

import argparse
import cProfile
import pstats
import time

import torch

import mla_dispatch
from mla_dispatch.numerics.cases import make_case


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="cuda_sm90")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    case = make_case(args.batch, 1, 128, args.seqlen, varlen=False, device="cuda")
    kw = case.kwargs()

    def plan():
        return mla_dispatch.plan_decode(*case.args(), **kw, backend=args.backend)

    p = plan()

    def run():
        return p.run(case.q, case.kv_cache)

    def call():
        return mla_dispatch.mla_decode(*case.args(), **kw, backend=args.backend)

    for name, fn in (("plan_decode", plan), ("DecodePlan.run", run), ("mla_decode", call)):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            fn()
        torch.cuda.synchronize()
        print(f"{name:16s} {(time.perf_counter() - t0) / args.calls * 1e6:8.1f} us/call (host-bound loop)")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        call()
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(22)


if __name__ == "__main__":
    main()
