"""Where do small batches spend their time in the cuda_sm90 backend? (GPU machine)

    python dev/profile_small_batch.py [--min-chunks 1,2,4,8] [--variants 2,5] [--combine separate,fused]
    python dev/profile_small_batch.py --configs 128x4096,32x4096 --varlen --min-chunks 2 --variants 5,2 --combine separate
    python dev/profile_small_batch.py --heads 16,32,64 --variants default --min-chunks 1,2 --configs 1x4096,2x4096

For each small-batch config of issue 4 (h_q=128 unless ``--heads`` says otherwise, s_q=1) and each split size
(``backend_options['min_chunks_per_part']``), mainloop variant and place of the combine (``default``: the plan's own choice of either): the CUDA-graph replay
time (triton do_bench median, L2 flushed) and the GPU time of each kernel of one
eager call (torch.profiler, median of 20 calls), so the decode, the combine and the
gaps between them can be told apart.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton.testing
from torch.profiler import ProfilerActivity, profile

from mla_dispatch import plan_decode

from bench_cuda_sm90 import capture_graph, make_inputs  # noqa: E402  (same inputs and graphs as the benchmark)

CONFIGS = "1x4096,1x32768,8x8192,32x4096"  # batch x seqlen


def kernel_times(run, calls=20):
    """Median GPU time (us) of each kernel name over ``calls`` eager calls."""
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            run()
        torch.cuda.synchronize()
    per = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time > 0:
            name = ev.name.split("<")[0].split("(")[0][:40]
            per.setdefault(name, []).append(ev.device_time)
    return {k: statistics.median(v) for k, v in per.items() if len(v) >= calls // 2}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--min-chunks", default="1,2,4,8")
    ap.add_argument("--overhead", default=None, help="comma-separated schedule overheads per request, in chunks "
                    "(backend_options['schedule_overhead']; default: the backend's, per mainloop)")
    ap.add_argument("--variants", default="2,5", help="mainloop variants, or 'default': the plan's choice")
    ap.add_argument("--combine", default="separate,fused",
                    help="separate (second kernel), fused (in the decode launch) and/or default (the plan's choice)")
    ap.add_argument("--configs", default=CONFIGS, help="comma-separated BATCHxSEQLEN, s_q=1")
    ap.add_argument("--heads", default="128", help="comma-separated h_q values (one KV head)")
    ap.add_argument("--kv-format", default="bf16", choices=("bf16", "fp8_e4m3", "fp8_ds_mla"))
    ap.add_argument("--varlen", action="store_true", help="lengths drawn around SEQLEN as in the benchmark (default: equal)")
    args = ap.parse_args()

    print(f"device {torch.cuda.get_device_name()} torch {torch.__version__}")
    configs = [(int(x), int(y)) for x, y in (c.split("x") for c in args.configs.split(","))]
    for h_q, (b, L) in [(int(h), c) for h in args.heads.split(",") for c in configs]:
        q, kv, table, lens, kv_scale = make_inputs(b, 1, h_q, L, varlen=args.varlen, kv_format=args.kv_format)
        out = torch.empty(b, 1, h_q, 512, dtype=q.dtype, device="cuda")
        lse = torch.empty(b, h_q, 1, dtype=torch.float32, device="cuda")
        overheads = [int(x) for x in args.overhead.split(",")] if args.overhead else [None]
        for mc, ov in [(m, o) for m in (int(x) for x in args.min_chunks.split(",")) for o in overheads]:
            for v, comb in [(x, c) for x in args.variants.split(",") for c in args.combine.split(",")]:
                options = {} if v == "default" else {"variant": int(v)}
                options["min_chunks_per_part"] = mc
                if ov is not None:
                    options["schedule_overhead"] = ov
                if comb != "default":
                    options["fuse_combine"] = comb == "fused"
                plan = plan_decode(q, kv, table, lens, kv_format=args.kv_format, kv_scale=kv_scale, backend="cuda_sm90",
                                   backend_options=options, cuda_graph=True)
                launch = plan.state.launch
                ov_used = plan.state.schedule.overhead
                run = lambda: plan.run(q, kv, kv_scale=kv_scale, out=out, lse=lse)  # noqa: E731
                graph = capture_graph(run)
                t_graph = triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median") * 1e3
                kt = kernel_times(run)
                parts = plan.state.schedule.num_parts
                splits = int(plan.state.schedule.num_splits.max())
                comb_used = "fused" if launch.fuse_combine else "separate"
                ks = "  ".join(f"{k}={t:.1f}" for k, t in sorted(kt.items()))
                print(f"{args.kv_format} h={h_q:3d} b={b:3d} L={L:6d} min_chunks={mc:2d} "
                      f"overhead={ov_used} "
                      f"parts={parts:3d} splits<={splits:3d} v{launch.variant} "
                      f"{comb_used:8s}: graph {t_graph:7.1f} us | {ks}", flush=True)
        del q, kv, table
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
