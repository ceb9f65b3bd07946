"""Which part of mainloop v7's work bounds its time: ablation builds (GPU machine).

    python ci/sm90_ablate.py [--masks 0,1,2,4,8,16,32,64] [--heads 16,32] [--json F]

Mask 0 is the normal build; any other mask builds a separate extension with ``-DMLA_SM90_ABLATE=mask``
(``kernels/cuda/build.py``, ``ablate_bits``) in which v7 skips the parts of its work named by the bits
(``Fp8t::kAblate*`` in ``kernels/cuda/mla_decode_sm90/mainloop_fp8t.cuh``, ``PARTS`` below): 1 the converter's
global loads and L2 prefetches, 2 its conversion and stores into the stage (the compiler then drops its register
loads too, their data unused: the L2 prefetches stay), 4 the scorer's S^T wgmma, 8 its softmax, 16 the accumulator's
O^T wgmma, 32 the scorer's P^T stores, 64 the output stores, 256 the converter's proxy fence (MEMBAR). Every build's
pipeline (the mbarriers between the three warpgroups) is kept, so a mask's time is the kernel without that work; what
drops the time most is what bounds it. The outputs of an ablation build are wrong by design; nothing here checks
them.

The builds run in parallel (``--jobs``), then each mask is timed in a process of its own (one extension per process):
b=64, s_q=1, L=8192 (equal lengths), page 64, fp8_e4m3, variant 7, CUDA-graph replay, triton's do_bench median with
L2 flushed, as ``bench_cuda_sm90.py`` times its rows.
"""

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

PARTS = {1: "load", 2: "store", 4: "S^T", 8: "softmax", 16: "O^T", 32: "P^T st", 64: "out", 256: "fence"}


def describe(mask: int) -> str:
    """``mask``'s skipped parts in words (``-`` for the normal build)."""
    return "+".join(name for bit, name in PARTS.items() if mask & bit) or "-"


def env_for(mask: int) -> dict:
    env = dict(os.environ)
    env.pop("MLA_SM90_ABLATE", None)
    if mask:
        env["MLA_SM90_ABLATE"] = str(mask)
    return env


def build(mask: int) -> tuple[int, int, str]:
    r = subprocess.run([sys.executable, "-m", "mla_dispatch", "build"], env=env_for(mask), capture_output=True,
                       text=True)
    return mask, r.returncode, (r.stdout + r.stderr)[-2000:]


def child(heads: list[int]) -> None:
    """Time v7 in this process's build (the parent set ``$MLA_SM90_ABLATE``); one JSON line per head count."""
    import torch
    import triton

    sys.path.insert(0, HERE)
    from bench_cuda_sm90 import capture_graph, make_inputs

    from mla_dispatch import plan_decode

    for h_q in heads:
        q, kv, table, lens, kv_scale = make_inputs(64, 1, h_q, 8192, varlen=False, kv_format="fp8_e4m3")
        plan = plan_decode(q, kv, table, lens, kv_format="fp8_e4m3", kv_scale=kv_scale, backend="cuda_sm90",
                           cuda_graph=True)
        plan.state.variant = 7
        out = torch.empty(64, 1, h_q, 512, dtype=q.dtype, device="cuda")
        lse = torch.empty(64, h_q, 1, dtype=torch.float32, device="cuda")
        graph = capture_graph(lambda: plan.run(q, kv, kv_scale=kv_scale, out=out, lse=lse))
        us = triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median") * 1e3
        print(json.dumps({"h_q": h_q, "us_graph": us}), flush=True)
        del q, kv, table, plan, graph
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--masks", default="0,1,2,3,4,8,32,16,20,64", help="comma-separated ablation masks (0: none)")
    parser.add_argument("--heads", default="16,32", help="h_q values (b=64, L=8192)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel builds")
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    heads = [int(h) for h in args.heads.split(",")]
    if args.child:
        child(heads)
        return
    masks = [int(m) for m in args.masks.split(",")]
    bad = [m for m in masks if m < 0 or m & ~sum(PARTS)]
    if bad:
        parser.error(f"--masks: each mask is a sum of {sorted(PARTS)}; got {bad}")
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for mask, rc, log in pool.map(build, masks):
            if rc:
                sys.exit(f"the build of mask {mask} failed:\n{log}")
    print(f"{'mask':>4s}  {'skipped':24s}" + "".join(f"  h{h:<3d} us" for h in heads))
    rows = []
    for mask in masks:
        r = subprocess.run([sys.executable, __file__, "--child", "--heads", args.heads], env=env_for(mask),
                           capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"timing mask {mask} failed:\n{(r.stdout + r.stderr)[-2000:]}")
        times = {}
        for line in r.stdout.splitlines():
            if line.startswith("{"):
                d = json.loads(line)
                times[d["h_q"]] = d["us_graph"]
        rows.append({"mask": mask, "skipped": describe(mask), **{f"h{h}_us": times[h] for h in heads}})
        print(f"{mask:4d}  {describe(mask):24s}" + "".join(f"  {times[h]:8.1f}" for h in heads), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
