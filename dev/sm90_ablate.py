"""Which part of mainloop v7's (or v8's) work bounds its time: ablation builds (GPU machine).

    python ci/sm90_ablate.py [--masks 0,1,2,4,8,16,32,64] [--heads 16,32] [--variant 7|8] [--json F] [--plot F.png]
    python ci/sm90_ablate.py --replot F.json [G.json ...] --plot F.png   # a chart of saved runs, no GPU

Mask 0 is the normal build; any other mask builds a separate extension with ``-DMLA_SM90_ABLATE=mask``
(``kernels/cuda/build.py``, ``ablate_bits``) in which v7 skips the parts of its work named by the bits
(``Fp8t::kAblate*`` in ``kernels/cuda/mla_decode_sm90/mainloop_fp8t.cuh``, ``PARTS`` below): 1 the converter's
global loads and L2 prefetches, 2 its conversion and stores into the stage (the compiler then drops its register
loads too, their data unused: the L2 prefetches stay), 4 the scorer's S^T wgmma, 8 its softmax, 16 the accumulator's
O^T wgmma, 32 the scorer's P^T stores, 64 the output stores, 256 the converter's proxy fence (MEMBAR), 2048 the
scorer's global loads of the query tile (zeros); in v8 (no converter) bit 1 skips the producer's tensor copies, and
4 / 16 also drop the scorer's / accumulator's conversions (their results unused). Every build's
pipeline (the mbarriers between the three warpgroups) is kept, so a mask's time is the kernel without that work; what
drops the time most is what bounds it. The outputs of an ablation build are wrong by design; nothing here checks
them.

The builds run in parallel (``--jobs``), then each mask is timed in a process of its own (one extension per process):
b=64, s_q=1, L=8192 (equal lengths), page 64, fp8_e4m3, variant 7 or 8, CUDA-graph replay, triton's do_bench median with
L2 flushed, as ``bench_cuda_sm90.py`` times its rows.
"""

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

PARTS = {1: "load", 2: "store", 4: "S^T", 8: "softmax", 16: "O^T", 32: "P^T st", 64: "out", 256: "fence",
         2048: "Q loads"}


def describe(mask: int) -> str:
    """``mask``'s skipped parts in words (``-`` for the normal build)."""
    return "+".join(name for bit, name in PARTS.items() if mask & bit) or "-"


def env_for(mask: int) -> dict:
    """This process's environment with ``$MLA_SM90_ABLATE`` set to ``mask`` (unset for 0, the normal build)."""
    env = dict(os.environ)
    env.pop("MLA_SM90_ABLATE", None)
    if mask:
        env["MLA_SM90_ABLATE"] = str(mask)
    return env


def build(mask: int) -> tuple[int, int, str]:
    r = subprocess.run([sys.executable, "-m", "mla_dispatch", "build"], env=env_for(mask), capture_output=True,
                       text=True)
    return mask, r.returncode, (r.stdout + r.stderr)[-2000:]


def child(heads: list[int], variant: int = 7) -> None:
    """Time ``variant`` (7 or 8) in this process's build (the parent set ``$MLA_SM90_ABLATE``); one JSON line per
    head count."""
    import torch
    import triton

    sys.path.insert(0, HERE)
    from bench_cuda_sm90 import capture_graph, make_inputs

    from mla_dispatch import plan_decode

    for h_q in heads:
        q, kv, table, lens, kv_scale = make_inputs(64, 1, h_q, 8192, varlen=False, kv_format="fp8_e4m3")
        plan = plan_decode(q, kv, table, lens, kv_format="fp8_e4m3", kv_scale=kv_scale, backend="cuda_sm90",
                           cuda_graph=True)
        plan.state.variant = variant
        out = torch.empty(64, 1, h_q, 512, dtype=q.dtype, device="cuda")
        lse = torch.empty(64, h_q, 1, dtype=torch.float32, device="cuda")
        graph = capture_graph(lambda: plan.run(q, kv, kv_scale=kv_scale, out=out, lse=lse))
        us = triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median") * 1e3
        print(json.dumps({"h_q": h_q, "us_graph": us}), flush=True)
        del q, kv, table, plan, graph
        torch.cuda.empty_cache()


def plot(rows: list[dict], path: str, title: str = "") -> None:
    """A horizontal bar per mask and head count (graph µs), the normal build's time marked: what each part costs is
    how far its bar falls short of the mark."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heads = sorted({int(k[1:-3]) for r in rows for k in r if k.startswith("h") and k.endswith("_us")})
    fig, axes = plt.subplots(1, len(heads), figsize=(5 * len(heads), 0.35 * len(rows) + 2.0), sharey=True,
                             squeeze=False)
    labels = [f"{r['mask']}: {r['skipped']}" for r in rows]
    for ax, h in zip(axes[0], heads):
        times = [r.get(f"h{h}_us", float("nan")) for r in rows]
        base = next((r[f"h{h}_us"] for r in rows if r["mask"] == 0 and f"h{h}_us" in r), None)
        ax.barh(range(len(rows)), times, color=["tab:gray" if r["mask"] == 0 else "tab:blue" for r in rows])
        if base is not None:
            ax.axvline(base, color="tab:red", lw=1, ls="--", label=f"normal build {base:.1f} µs")
            ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), fontsize=8)  # below: clear of the bars
        for y, t in enumerate(times):
            ax.text(t, y, f" {t:.1f}", va="center", fontsize=8)
        ax.set_title(f"h_q = {h}")
        ax.set_xlabel("µs (CUDA-graph replay)")
    axes[0][0].set_yticks(range(len(rows)), labels, fontsize=8)
    axes[0][0].invert_yaxis()
    variant = rows[0].get("variant", 7) if rows else 7  # rows saved before --variant existed are v7's
    fig.suptitle(title or f"v{variant} with parts of its work switched off (b=64, L=8192, fp8_e4m3)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--masks", default="0,1,2,3,4,8,32,16,20,64", help="comma-separated ablation masks (0: none)")
    parser.add_argument("--heads", default="16,32", help="h_q values (b=64, L=8192)")
    parser.add_argument("--variant", type=int, default=7, choices=(7, 8),
                        help="the mainloop to time: 7, or 8 (its bit 1 skips the producer's bulk copies)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel builds")
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--plot", default=None, help="draw the rows into this PNG")
    parser.add_argument("--replot", nargs="+", default=None, metavar="JSON",
                        help="no builds or timings: plot the rows of these saved runs (a mask's first row counts)")
    parser.add_argument("--title", default="", help="the chart's title")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    heads = [int(h) for h in args.heads.split(",")]
    if args.replot:
        if not args.plot:
            parser.error("--replot needs --plot PATH")
        rows, seen = [], set()
        for path in args.replot:
            with open(path) as f:
                for r in json.load(f):
                    if r["mask"] not in seen:
                        seen.add(r["mask"])
                        rows.append(r)
        plot(rows, args.plot, args.title)
        return
    if args.child:
        child(heads, args.variant)
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
        r = subprocess.run([sys.executable, __file__, "--child", "--heads", args.heads, "--variant", str(args.variant)],
                           env=env_for(mask),
                           capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"timing mask {mask} failed:\n{(r.stdout + r.stderr)[-2000:]}")
        times = {}
        for line in r.stdout.splitlines():
            if line.startswith("{"):
                d = json.loads(line)
                times[d["h_q"]] = d["us_graph"]
        rows.append({"mask": mask, "variant": args.variant, "skipped": describe(mask),
                     **{f"h{h}_us": times[h] for h in heads}})
        print(f"{mask:4d}  {describe(mask):24s}" + "".join(f"  {times[h]:8.1f}" for h in heads), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.plot:
        plot(rows, args.plot, args.title)


if __name__ == "__main__":
    main()
