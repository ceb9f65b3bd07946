"""Benchmark of the native SM90 kernel (backend cuda_sm90) on issue 4's configs.

Counting as docs/design.md §6: FLOPs = 2*s_q*h_q*(D_qk+D_v)*sum(L); bytes = cache bytes
of sum(L) tokens (2*h_kv*D_qk per token for bf16; 1*h_kv*576 for fp8_e4m3; 656 for
fp8_ds_mla) + 2*B*s_q*h_q*(D_qk+D_v); roofline = max(FLOPs/peak_flops,
bytes/peak_bw) with both peaks measured in this run (1 GiB device copy counting
read+write; 8192^3 bf16 matmul). Times: triton.testing.do_bench median (L2
flushed) of the eager plan.run, and of CUDA-graph replay of plan.run. ``--check``
compares each config's eager and graph-replay outputs (poisoned with NaN first) with
the fp32 reference at docs/design.md §5 tolerances before timing it; ``--plot`` charts the
run against issue 4's targets (:data:`TARGETS`, :func:`target_rows`).

    python dev/bench_cuda_sm90.py [--quick] [--groups flashmla,small] [--variants 0,5,2]
                                 [--combine auto,fused,separate] [--check] [--seed N]
                                 [--json PATH] [--plot PNG]
    python dev/bench_cuda_sm90.py --from-json PATH --plot PNG    # chart an earlier run (no GPU)
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import random
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # target_chart, beside this script
from target_chart import plot_target_rows  # noqa: E402


def measure_peaks():
    import triton.testing

    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    t = triton.testing.do_bench(lambda: b.copy_(a), warmup=50, rep=300, return_mode="median") * 1e-3
    bw = 2 * n / t
    del a, b
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = triton.testing.do_bench(lambda: x @ y, warmup=50, rep=300, return_mode="median") * 1e-3
    flops = 2 * 8192**3 / t
    return bw, flops


def make_inputs(b, s_q, h_q, L, *, page_size=64, varlen=True, kv_format="bf16", h_kv=1, seed=0):
    from mla_dispatch.kvcache.formats import pack_ds_mla

    g = torch.Generator(device="cuda").manual_seed(seed)
    if varlen:
        lens = torch.normal(float(L), L / 2, (b,), generator=g, device="cuda").round().clamp_min(s_q).to(torch.int32)
    else:
        lens = torch.full((b,), L, dtype=torch.int32, device="cuda")
    max_blocks = math.ceil(int(lens.max()) / page_size)
    nb = b * max_blocks
    table = torch.randperm(nb, generator=g, device="cuda").to(torch.int32).view(b, max_blocks)
    q = (torch.randn(b, s_q, h_q, 576, generator=g, device="cuda") / 10).clamp(-1, 1).to(torch.bfloat16)
    kv_scale = None
    if kv_format == "fp8_ds_mla":
        kv = torch.empty(nb, page_size, h_kv, 656, dtype=torch.uint8, device="cuda")
        for i in range(0, nb, 4096):  # chunked to bound temporaries
            vals = (torch.randn(min(4096, nb - i), page_size, h_kv, 576, generator=g, device="cuda") / 10).clamp(-1, 1)
            kv[i:i + vals.shape[0]] = pack_ds_mla(vals)
    else:
        kv = (torch.randn(nb, page_size, h_kv, 576, generator=g, device="cuda") / 10).clamp(-1, 1)
        if kv_format == "fp8_e4m3":
            kv_scale = torch.tensor([1.25 / 448], device="cuda")
            kv = (kv / kv_scale).to(torch.float8_e4m3fn)
        else:
            kv = kv.to(torch.bfloat16)
    return q, kv, table, lens, kv_scale


def capture_graph(run):
    """A CUDA graph of ``run()`` (one warm-up call on a side stream first, as torch requires)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph


def config_name(cfg) -> str:
    """A config's name in the JSON and the chart, e.g. ``fp8-b64-s1-h16-L8192-fp8_e4m3`` (``-ps128`` where the page
    is not 64; no suffix for a bf16 cache)."""
    name = f"{cfg['group']}-b{cfg['b']}-s{cfg['s_q']}-h{cfg['h_q']}-L{cfg['L']}"
    if cfg.get("ps", 64) != 64:
        name += f"-ps{cfg['ps']}"
    return name + ("" if cfg.get("fmt", "bf16") == "bf16" else f"-{cfg['fmt']}")


def check_config(plan, run, graph, q, kv, table, lens, kv_scale, out, lse, cfg) -> str:
    """The eager call's and one graph replay's outputs, each written over NaN, against the fp32 reference with the
    backend's tolerances (docs/design.md §5). Returns ``"ok"`` or ``"MISMATCH <which>: <report>"``."""
    from mla_dispatch.backends.cuda_sm90 import CudaSM90Backend
    from mla_dispatch.numerics.oracle import reference_attention
    from mla_dispatch.numerics.tolerance import compare_outputs

    ref_out, ref_lse = reference_attention(q, kv, table, lens, head_dim_v=512, softmax_scale=plan.softmax_scale,
                                           causal=cfg.get("causal", False), kv_format=cfg.get("fmt", "bf16"),
                                           kv_scale=kv_scale)
    for which, fn in (("eager", run), ("graph", graph.replay)):
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        fn()
        torch.cuda.synchronize()
        rep = compare_outputs(out, lse, ref_out, ref_lse, CudaSM90Backend.TOLERANCE)
        if not rep:
            return f"MISMATCH {which}: {rep.message}"
    return "ok"


def bench_one(cfg, peaks, variant=2, combine="auto", *, check=False, seed=0, overhead=None):
    import triton.testing

    from mla_dispatch import plan_decode

    b, s_q, h_q, L = cfg["b"], cfg["s_q"], cfg["h_q"], cfg["L"]
    fmt = cfg.get("fmt", "bf16")
    ps = cfg.get("ps", 64)
    causal = cfg.get("causal", False)
    q, kv, table, lens, kv_scale = make_inputs(b, s_q, h_q, L, page_size=ps, varlen=cfg.get("varlen", True),
                                               kv_format=fmt, seed=seed)
    options = {"variant": variant} if variant else {}  # 0: the backend's own choice (choose_variant)
    if combine != "auto":  # auto: the backend's own choice (choose_fuse_combine)
        options["fuse_combine"] = combine == "fused"
    if overhead is not None:  # None: the mainloop's (CudaSM90Backend.schedule_overhead)
        options["schedule_overhead"] = overhead
    plan = plan_decode(q, kv, table, lens, causal=causal, kv_format=fmt, kv_scale=kv_scale, backend="cuda_sm90",
                       backend_options=options, cuda_graph=True)
    variant = plan.state.launch.variant
    combine = "fused" if plan.state.launch.fuse_combine else "separate"
    out = torch.empty(b, s_q, h_q, 512, dtype=q.dtype, device="cuda")
    lse = torch.empty(b, h_q, s_q, dtype=torch.float32, device="cuda")
    run = lambda: plan.run(q, kv, kv_scale=kv_scale, out=out, lse=lse)  # noqa: E731
    graph = capture_graph(run)
    verdict = check_config(plan, run, graph, q, kv, table, lens, kv_scale, out, lse, cfg) if check else None
    t_eager = triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median") * 1e-3
    t_graph = triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median") * 1e-3
    sum_l = int(lens.sum())
    tok_bytes = {"bf16": 2 * 576, "fp8_e4m3": 576, "fp8_ds_mla": 656}[fmt]
    flops = 2 * s_q * h_q * (576 + 512) * sum_l
    nbytes = tok_bytes * sum_l + 2 * b * s_q * h_q * (576 + 512)
    roof = max(flops / peaks[1], nbytes / peaks[0])
    t = min(t_eager, t_graph)
    row = dict(cfg, name=config_name(cfg), variant=variant, combine=combine, us_eager=t_eager * 1e6, us_graph=t_graph * 1e6, tflops=flops / t / 1e12, gbps=nbytes / t / 1e9,
               roofline_pct=100 * roof / t, bound="compute" if flops / peaks[1] > nbytes / peaks[0] else "memory",
               roofline_us=roof * 1e6)
    if verdict is not None:
        row["check"] = verdict
    del q, kv, table, plan, graph
    torch.cuda.empty_cache()
    return row


CONFIGS = (
    [dict(group="flashmla", b=128, s_q=s, h_q=128, L=L, causal=(s > 1)) for s in (1, 2) for L in (4096, 8192, 16384, 32768)]
    + [dict(group="membound", b=64, s_q=1, h_q=h, L=8192, varlen=False) for h in (16, 32, 64)]
    + [dict(group="small", b=1, s_q=1, h_q=128, L=4096, varlen=False), dict(group="small", b=1, s_q=1, h_q=128, L=32768, varlen=False),
       dict(group="small", b=8, s_q=1, h_q=128, L=8192, varlen=False), dict(group="small", b=32, s_q=1, h_q=128, L=4096, varlen=False)]
    + [dict(group="pages", b=64, s_q=1, h_q=64, L=8192, varlen=False, ps=ps) for ps in (16, 128, 256)]
    + [dict(group="pages16", b=64, s_q=1, h_q=16, L=8192, varlen=False, ps=ps) for ps in (16, 32, 128, 256)]
    + [dict(group="fp8", b=64, s_q=1, h_q=16, L=8192, varlen=False, fmt=f) for f in ("fp8_e4m3", "fp8_ds_mla")]
    + [dict(group="fp8", b=128, s_q=1, h_q=128, L=8192, fmt=f) for f in ("fp8_e4m3", "fp8_ds_mla")]
    # the FlashMLA grid with an fp8_e4m3 cache (v9 where v5 runs bf16): "never slower than bf16" on compute-bound configs
    + [dict(group="fp8grid", b=128, s_q=s, h_q=128, L=L, causal=(s > 1), fmt="fp8_e4m3")
       for s in (1, 2) for L in (4096, 8192, 16384, 32768)]
    # fp8_e4m3 at 16 / 32 heads (v7) and the bf16 configs they are compared with (membound's)
    + [dict(group="fp8t", b=64, s_q=1, h_q=h, L=8192, varlen=False, fmt=f) for h in (16, 32) for f in ("fp8_e4m3", "bf16")]
    # small batches of fp8_e4m3 at 16 / 32 heads: where v7 stops paying (v7_min_chunks_per_part); run with --variants 0,2,6,7
    + [dict(group="fp8tsmall", b=b, s_q=1, h_q=h, L=L, varlen=False, fmt="fp8_e4m3")
       for h in (16, 32) for b, L in ((1, 8192), (2, 8192), (4, 8192), (8, 8192), (16, 4096), (32, 4096))]
)


HOST_CONFIGS = (
    # (label, b, h_q, L): one split-KV part, so one launch; one launch with the combine inside (b=1);
    # a decode launch and a combine launch
    ("b1 h16 L64, 1 part, 1 launch", 1, 16, 64),
    ("b1 h128 L4096, combine fused, 1 launch", 1, 128, 4096),
    ("b64 h16 L8192, decode + combine, 2 launches", 64, 16, 8192),
)


def host_overhead_us(n=200):
    """Host time per eager call (µs), measured while the GPU is held busy by a long sleep kernel, so no call
    waits for the device. Per config of ``HOST_CONFIGS``: ``DecodePlan.run`` with ``out`` and ``lse`` given
    (its fast path: the plan's bound native call) and without them (two allocations more), the bound call
    alone (``PlannedDecode.run``), the op through the dispatcher and the extension's function of the same
    name (both with the op's 18 arguments), and two trivial torch launches for scale."""
    import time

    from mla_dispatch import plan_decode

    def per_call(fn):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e9 * 0.05))  # ~50 ms of GPU time ahead of the queued calls
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        return (t1 - t0) / n * 1e6

    empty = torch.empty(0, device="cuda")
    rows = []
    for label, b, h_q, L in HOST_CONFIGS:
        q, kv, table, lens, _ = make_inputs(b, 1, h_q, L, varlen=False)
        plan = plan_decode(q, kv, table, lens, backend="cuda_sm90")
        out = torch.empty(b, 1, h_q, 512, dtype=q.dtype, device="cuda")
        lse = torch.empty(b, h_q, 1, dtype=torch.float32, device="cuda")
        st, s, c = plan.state, plan.state.schedule, plan.state.launch
        args = (q, kv, table, lens, s.items, s.part_offsets, None, out, lse, st.partial_out, st.partial_lse,
                s.num_splits, st.first_slot, plan.softmax_scale, False, 0, c.variant, c.tile_rows, c.tma_loads,
                c.paired, c.fuse_combine, c.fixed_splits)
        for _ in range(20):
            plan.run(q, kv, out=out, lse=lse)
            st.op(*args)
        torch.cuda.synchronize()
        row = dict(config=label, parts=int(s.part_offsets.numel()) - 1, variant=c.variant, fused=c.fuse_combine)
        row["run"] = min(per_call(lambda: plan.run(q, kv, out=out, lse=lse)) for _ in range(3))
        row["run_alloc"] = min(per_call(lambda: plan.run(q, kv)) for _ in range(3))
        row["bound"] = min(per_call(lambda: st.bound.run(q, kv, None, out, lse)) for _ in range(3))
        row["op"] = min(per_call(lambda: st.op(*args)) for _ in range(3))
        row["direct"] = min(per_call(lambda: st.direct(*args)) for _ in range(3))
        row["launches"] = min(per_call(lambda: (empty.add_(1), empty.add_(1))) for _ in range(3))  # noqa: B023
        rows.append(row)
        del q, kv, table, plan, st, s, c, args
        torch.cuda.empty_cache()
    return rows


#: issue 4's speed targets (benchmarks/RESULTS.md has the issue's wording): % of the roofline per group; b = 1 L = 4K
#: in µs (CUDA-graph replay); b = 8 L = 8K and b = 32 L = 4K in % of the roofline; pages 16 / 128 / 256 within 5% of
#: page 64 (same shape); fp8 caches >= 1.7x bf16's throughput on memory-bound configs and >= 1.0x (never slower) on
#: compute-bound ones (same shape and lengths, bf16 cache); the host side of an eager ``DecodePlan.run`` <= 10 µs
TARGETS = dict(flashmla_pct=85.0, mem_pct=88.0, b1_us=8.0, b8_pct=70.0, b32_pct=75.0, page_within=0.05,
               fp8_mem_speedup=1.7, fp8_compute_speedup=1.0, host_us=10.0)


def target_rows(rows: list[dict], host: list[dict] | None = None) -> list[dict]:
    """A run's rows (and host timings) against :data:`TARGETS`: one dict per config that has a panel, with ``panel``
    (``pct``: % of the roofline; ``b1``: µs; ``page``: % more time than page 64; ``fp8``: throughput relative to the
    bf16 cache; ``host``: µs of host time per eager call), ``name``, ``value``, ``target`` (None: no target) and
    ``met`` (None without a target). Times are the CUDA-graph replay. Page and fp8 rows are compared with the run's
    bf16 page-64 row of the same shape (same seed, so the same lengths); without one they get no row. Where a config
    ran more than once (several variants), the last row counts."""
    def shape(r):
        return (r["b"], r["s_q"], r["h_q"], r["L"], r.get("varlen", True), r.get("causal", False))

    base = {shape(r): r for r in rows if r.get("fmt", "bf16") == "bf16" and r.get("ps", 64) == 64}
    out = {}

    def add(panel, r, value, target, higher_is_better=True):
        met = None if target is None else (value >= target) == higher_is_better
        out[r["name"]] = dict(panel=panel, name=r["name"], value=value, target=target, met=met)

    for r in rows:
        t, g, fmt = r["us_graph"], r["group"], r.get("fmt", "bf16")
        pct = 100 * r["roofline_us"] / t
        b0 = base.get(shape(r))
        if fmt != "bf16":
            if b0 is not None:
                target = TARGETS["fp8_mem_speedup" if r["bound"] == "memory" else "fp8_compute_speedup"]
                add("fp8", r, b0["us_graph"] / t, target)
        elif r.get("ps", 64) != 64:
            if b0 is not None:
                add("page", r, 100 * (t / b0["us_graph"] - 1), 100 * TARGETS["page_within"], higher_is_better=False)
        elif g in ("flashmla", "membound"):
            add("pct", r, pct, TARGETS["flashmla_pct" if g == "flashmla" else "mem_pct"])
        elif g == "small" and r["b"] == 1:
            add("b1", r, t, TARGETS["b1_us"] if r["L"] == 4096 else None, higher_is_better=False)
        elif g == "small" and (r["b"], r["L"]) in ((8, 8192), (32, 4096)):
            add("pct", r, pct, TARGETS["b8_pct" if r["b"] == 8 else "b32_pct"])
    for h in host or []:
        out[h["config"]] = dict(panel="host", name=h["config"], value=h["run"], target=TARGETS["host_us"],
                                met=h["run"] <= TARGETS["host_us"])
    return list(out.values())


PANELS = {
    "pct": "% of roofline (targets: FlashMLA grid 85, mem 88, b8 70, b32 75)",
    "b1": "µs, b=1 h=128 (target: L=4K <= 8)",
    "page": "time vs page 64, % (target: within 5)",
    "fp8": "throughput vs bf16 (targets: mem 1.7x, compute 1.0x)",
    "host": "host µs per eager call (target <= 10)",
}


def _title(saved: dict) -> str:
    return (f"cuda_sm90, {saved['device']}, torch {saved['torch']}, {saved['date']}; ceilings: copy "
            f"{saved['peaks'][0] / 1e12:.2f} TB/s, bf16 matmul {saved['peaks'][1] / 1e12:.0f} TFLOP/s; bars: CUDA-graph "
            "replay of the plan's own mainloop (green: target met, red: missed, grey: no target)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a few configs only")
    ap.add_argument("--json", default=None)
    ap.add_argument("--variants", default="2", help="mainloop variants to time, e.g. 0,5,2 (0 = the backend's per-plan "
                    "choice, else backend_options variant: 2 = wgmma, 5 = two tiles in flight, 6 = tokens on M, 7 / 8 = "
                    "tokens on M for fp8_e4m3, 9 = v5 for fp8_e4m3; a variant that cannot run a config raises)")
    ap.add_argument("--groups", default=None, help="comma-separated config groups to run (flashmla, membound, small, "
                    "pages, pages16, fp8, fp8grid, fp8t, fp8tsmall; \"none\": only the host overhead); default all")
    ap.add_argument("--combine", default="auto", help="where split requests are merged, e.g. fused,separate (auto = the "
                    "backend's per-plan choice, fused = inside the decode launch, separate = a second kernel)")
    ap.add_argument("--overhead", type=int, default=None, help="the schedule's fixed cost per request, in chunks "
                    "(backend_options['schedule_overhead']; default: the backend's, per mainloop)")
    ap.add_argument("--check", action="store_true", help="compare each config's eager and graph outputs with the "
                    "reference before timing it")
    ap.add_argument("--seed", type=int, default=None, help="seed of the inputs (default: a fresh one, printed and "
                    "saved in the JSON)")
    ap.add_argument("--plot", default=None, metavar="PNG", help="chart the run against issue 4's targets")
    ap.add_argument("--from-json", default=None, metavar="PATH", help="with --plot: chart an earlier run's --json "
                    "output instead of running (no GPU needed)")
    args = ap.parse_args()
    if args.from_json:
        if not args.plot:
            ap.error("--from-json needs --plot PNG")
        saved = json.loads(pathlib.Path(args.from_json).read_text())
        plot_target_rows(target_rows(saved["rows"], saved.get("host")), PANELS, args.plot, _title(saved))
        return
    import datetime

    import triton

    seed = args.seed if args.seed is not None else random.randrange(2**31)
    peaks = measure_peaks()
    print(f"device {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__} seed {seed}")
    print(f"measured peaks: copy {peaks[0] / 1e12:.2f} TB/s, bf16 matmul {peaks[1] / 1e12:.0f} TFLOP/s")
    configs = CONFIGS if not args.quick else [CONFIGS[0], CONFIGS[2], CONFIGS[8], CONFIGS[11], CONFIGS[13]]
    if args.groups:
        configs = [c for c in configs if c["group"] in args.groups.split(",")]
    rows = []
    hdr = f"{'v':1s} {'comb':4s} {'group':9s} {'b':>4s} {'s_q':>3s} {'h_q':>4s} {'L':>6s} {'ps':>4s} {'fmt':10s} {'causal':6s} {'eager us':>9s} {'graph us':>9s} {'TFLOP/s':>8s} {'GB/s':>7s} {'%roof':>6s} bound"
    runs = [(c, int(v), m) for v in args.variants.split(",") for c in configs for m in args.combine.split(",")]
    for cfg, variant, combine in runs:
        try:
            r = bench_one(cfg, peaks, variant, combine, check=args.check, seed=seed, overhead=args.overhead)
        except Exception as exc:  # keep going; report the failure
            print(f"FAILED {cfg}: {type(exc).__name__}: {exc}")
            continue
        rows.append(r)
        print(f"{r['variant']:1d} {r['combine'][:4]:4s} {r['group']:9s} {r['b']:4d} {r['s_q']:3d} {r['h_q']:4d} {r['L']:6d} {r.get('ps', 64):4d} "
              f"{r.get('fmt', 'bf16'):10s} {str(r.get('causal', False)):6s} {r['us_eager']:9.1f} {r['us_graph']:9.1f} "
              f"{r['tflops']:8.1f} {r['gbps']:7.0f} {r['roofline_pct']:6.1f} {r['bound']} {r.get('check', '')}", flush=True)
    print(hdr)
    host = host_overhead_us()
    print("host time per eager call (us), GPU kept busy: DecodePlan.run with out/lse | without | the bound call "
          "alone | the op through the dispatcher | the extension's function without it | two trivial torch launches")
    for h in host:
        print(f"  {h['config']:44s} v{h['variant']} parts {h['parts']:3d}: run {h['run']:5.1f} | run_alloc "
              f"{h['run_alloc']:5.1f} | bound {h['bound']:5.1f} | op {h['op']:5.1f} | direct {h['direct']:5.1f} | "
              f"launches {h['launches']:5.1f}")
    saved = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                 date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), seed=seed,
                 peaks=peaks, rows=rows, host=host)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(saved, f, indent=1)
    if args.plot:
        plot_target_rows(target_rows(rows, host), PANELS, args.plot, _title(saved))


if __name__ == "__main__":
    main()
