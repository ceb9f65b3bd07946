"""Host cost of a decode step's calls (issue 55's table), on one GPU, in one process.

    source ci/gpu_setup.sh; source ci/flashmla_peer.sh    # FlashMLA beside us (optional)
    python dev/host_cost.py [--configs b1-L4096,b128-L8192v] [--backends cuda_sm90,triton,flashinfer,flashmla]
                            [--reps 50] [--out DIR]

For each config (h_q 128, s_q 1, page 64, bf16; ``v``: lengths drawn around L as FlashMLA's benchmark draws them)
and backend: the wall clock of ``plan_decode``, ``DecodePlan.update()``, ``DecodePlan.run`` (out and lse given) and
the one-shot ``mla_decode``, each followed by a device synchronisation, median of ``--reps`` (docs/design.md §6,
"Host cost"); the same calls' host cost alone (``*_host_us``: timed while the GPU works through a queued sleep, so
no launch waits and no synchronisation is in the span; the bare synchronisation's cost is ``sync_floor_us``); the kernel time of the same run (one CUDA-graph replay, median of 30) beside ``run``; the CUDA launches
and torch ops one call issues (torch.profiler); and FlashMLA's own whole call (``get_mla_metadata()`` and
``flash_mla_with_kvcache``, as its users call it per layer) and FlashInfer's own ``plan`` for the targets that
compare with them. Each backend's output is checked against the reference at the first config before it is timed.
A cProfile of each call (50 calls, top functions by own time) goes to ``DIR/profile-<config>-<backend>-<call>.txt``;
the table is printed last and written with everything else to ``DIR/host_cost.json``. A backend may carry
``backend_options``: ``--backends triton/launch_graphs=False`` (``name/option=value/...``, values as Python literals).
"""

from __future__ import annotations

import argparse
import ast
import cProfile
import io
import json
import math
import pathlib
import pstats
import statistics
import sys
import time
import traceback

import torch

import mla_dispatch
from mla_dispatch import mla_decode, plan_decode

D_QK, D_V = 576, 512
CALLS = ("plan", "update", "run", "call")


def make_inputs(batch: int, seqlen: int, varlen: bool, *, h_q: int = 128, page_size: int = 64, seed: int = 0):
    """FlashMLA-benchmark-style inputs made on the GPU: q, kv ~ randn/10 clamped, lengths ~ max(N(L, L/2), 1) or L,
    a random permutation of block ids, the unused table entries 2147480000."""
    g = torch.Generator().manual_seed(seed)
    if varlen:
        lens = torch.normal(float(seqlen), seqlen / 2, (batch,), generator=g).round().clamp_min(1).int()
    else:
        lens = torch.full((batch,), seqlen, dtype=torch.int32)
    max_blocks = math.ceil(int(lens.max()) / page_size)
    num_blocks = batch * max_blocks
    table = torch.randperm(num_blocks, generator=g).view(batch, max_blocks).int()
    used = torch.arange(max_blocks)[None, :] < ((lens + page_size - 1) // page_size)[:, None]
    table = torch.where(used, table, torch.full_like(table, 2147480000)).cuda()
    q = (torch.randn(batch, 1, h_q, D_QK, device="cuda", dtype=torch.bfloat16) / 10).clamp(-1, 1)
    kv = (torch.randn(num_blocks, page_size, 1, D_QK, device="cuda", dtype=torch.bfloat16) / 10).clamp(-1, 1)
    return q, kv, table, lens.cuda()


def host_us(fn, reps: int) -> float:
    """Median wall-clock µs of ``fn()`` followed by a device synchronisation (after 20 warm-up calls: with five, the
    first config measured in the process ran 1.5-2x high on the H200, 2026-11-29 afternoon)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def busy_us(fn, reps: int) -> float:
    """Median µs the host spends in ``fn()`` while the GPU is busy with a queued ~1 ms sleep kernel: nothing the call
    launches waits for the device and no synchronisation follows inside the timed span, so this is the call's host
    cost alone (a call that synchronises with the device shows the sleep: ~1000 µs)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        torch.cuda._sleep(2_000_000)  # ~1 ms at the H200's ~2 GHz
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    return statistics.median(samples) * 1e6


def graph_us(fn, reps: int = 30) -> float:
    """Median µs of one replay of a CUDA graph holding ``fn()`` (CUDA events around the replay)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def launches_and_ops(fn) -> tuple[int, int]:
    """(CUDA kernel launches, aten ops) of one call of ``fn`` (torch.profiler; after a warm-up call)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.events()
    launches = sum(1 for e in events if e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                                                   "cuLaunchKernelEx", "cudaLaunchCooperativeKernel"))
    ops = sum(1 for e in events if e.name.startswith("aten::"))
    return launches, ops


def profile_to(path: pathlib.Path, fn, calls: int = 50) -> None:
    """cProfile of ``calls`` calls of ``fn`` (then a sync), top functions by own time, written to ``path``."""
    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(25)
    path.write_text(text.getvalue())


def check(spec: str, q, kv, table, lens, scale: float) -> str:
    """The one-shot call and a plan's third run on the same tensors (a replayed graph where the plan keeps them),
    outputs poisoned first, against the reference."""
    from mla_dispatch.dispatch.registry import get_backend
    from mla_dispatch.numerics.oracle import reference_attention
    from mla_dispatch.numerics.tolerance import compare_outputs

    name, options = backend_spec(spec)
    kw = dict(softmax_scale=scale, backend=name, backend_options=options or None)
    ref = reference_attention(q, kv, table, lens, softmax_scale=scale)
    tol = get_backend(name).TOLERANCE
    one_shot = compare_outputs(*mla_decode(q, kv, table, lens, **kw), *ref, tol)
    if not one_shot:
        return f"one-shot: {one_shot.message}"
    plan = plan_decode(q, kv, table, lens, **kw)
    out = torch.empty(q.shape[0], 1, q.shape[2], D_V, dtype=q.dtype, device="cuda")
    lse = torch.empty(q.shape[0], q.shape[2], 1, device="cuda")
    for _ in range(3):
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        plan.run(q, kv, out=out, lse=lse)
    return compare_outputs(out, lse, *ref, tol).message


def backend_spec(spec: str) -> tuple[str, dict]:
    """``"name"`` or ``"name/option=value/..."`` (values as Python literals: ``triton/launch_graphs=False``) ->
    ``(name, backend_options)``."""
    name, *pairs = spec.split("/")
    options = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        options[key] = ast.literal_eval(value)
    return name, options


def measure_backend(spec: str, cfg: str, q, kv, table, lens, scale: float, reps: int, out_dir: pathlib.Path,
                    profile: bool) -> dict:
    name, options = backend_spec(spec)
    kw = dict(softmax_scale=scale, backend=name, backend_options=options or None)
    plan = plan_decode(q, kv, table, lens, **kw)
    out = torch.empty(q.shape[0], 1, q.shape[2], D_V, dtype=q.dtype, device="cuda")
    lse = torch.empty(q.shape[0], q.shape[2], 1, device="cuda")
    fns = {"plan": lambda: plan_decode(q, kv, table, lens, **kw),
           "update": lambda: plan.update(),
           "run": lambda: plan.run(q, kv, out=out, lse=lse),
           "call": lambda: mla_decode(q, kv, table, lens, **kw, out=out)}
    row = {"config": cfg, "backend": spec, "plan_object": repr(plan)}
    for call, fn in fns.items():
        row[f"{call}_us"] = host_us(fn, reps)
        row[f"{call}_host_us"] = busy_us(fn, reps)
    graph_plan = plan_decode(q, kv, table, lens, **kw, cuda_graph=True)
    row["kernel_us"] = graph_us(lambda: graph_plan.run(q, kv, out=out, lse=lse))
    for call, fn in fns.items():
        row[f"{call}_launches"], row[f"{call}_ops"] = launches_and_ops(fn)
        if profile:
            profile_to(out_dir / f"profile-{cfg}-{spec.replace('/', '-')}-{call}.txt", fn)
    state = plan.state
    if hasattr(state, "launch"):
        row["launch"] = repr(state.launch)
    return row


def measure_flashmla(cfg: str, q, kv, table, lens, scale: float, reps: int, out_dir: pathlib.Path,
                     profile: bool) -> dict:
    import flash_mla

    def whole():
        meta, _ = flash_mla.get_mla_metadata()
        return flash_mla.flash_mla_with_kvcache(q, kv, table, lens, D_V, meta, None, softmax_scale=scale)

    meta, _ = flash_mla.get_mla_metadata()

    def reused():  # metadata filled by the first call, reused (its contract: same lengths)
        return flash_mla.flash_mla_with_kvcache(q, kv, table, lens, D_V, meta, None, softmax_scale=scale)

    row = {"config": cfg, "backend": "FlashMLA (direct)", "call_us": host_us(whole, reps),
           "run_us": host_us(reused, reps), "call_host_us": busy_us(whole, reps), "run_host_us": busy_us(reused, reps),
           "version": getattr(flash_mla, "__version__", "?")}
    row["call_launches"], row["call_ops"] = launches_and_ops(whole)
    row["kernel_us"] = graph_us(reused)
    if profile:
        profile_to(out_dir / f"profile-{cfg}-flashmla-direct-call.txt", whole)
    return row


def measure_flashinfer_plan(cfg: str, q, kv, table, lens, scale: float, reps: int) -> dict:
    """FlashInfer's own BatchMLAPagedAttentionWrapper.plan with the page lists made once (what our adapter's plan
    adds to is this)."""
    import flashinfer

    from mla_dispatch.metadata.page_lists import packed_page_lists

    b = q.shape[0]
    qo_indptr = torch.arange(0, b + 1, dtype=torch.int32, device="cuda")
    kv_indptr, _, kv_indices = packed_page_lists(table, lens, kv.shape[1])
    wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"))

    def plan():
        wrapper.plan(qo_indptr, kv_indptr, kv_indices, lens, q.shape[2], D_V, D_QK - D_V, kv.shape[1], False, scale,
                     q.dtype, q.dtype)

    return {"config": cfg, "backend": "FlashInfer plan (direct)", "plan_us": host_us(plan, reps),
            "plan_host_us": busy_us(plan, reps), "version": getattr(flashinfer, "__version__", "?")}


def fmt(x, spec=".0f") -> str:
    return "-" if x is None else format(x, spec)


def table_text(rows: list[dict]) -> str:
    lines = ["| config | backend | plan | update | run (kernel) | one-shot call | launches plan/update/run/call |",
             "|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['config']} | {r['backend']} | error: {r['error'][:80]} | | | | |")
            continue
        run = fmt(r.get("run_us"))
        if r.get("kernel_us") is not None:
            run += f" ({r['kernel_us']:.1f})"
        launches = "/".join(fmt(r.get(f"{c}_launches"), "d") for c in CALLS)
        lines.append(f"| {r['config']} | {r['backend']} | {fmt(r.get('plan_us'))} | {fmt(r.get('update_us'))} | "
                     f"{run} | {fmt(r.get('call_us'))} | {launches} |")
    return "\n".join(lines)


def host_table_text(rows: list[dict]) -> str:
    """The host cost alone (:func:`busy_us`: the GPU kept busy, no synchronisation in the timed span)."""
    lines = ["| config | backend | plan | update | run | one-shot call |", "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        if "error" not in r:
            lines.append(f"| {r['config']} | {r['backend']} | "
                         + " | ".join(fmt(r.get(f"{c}_host_us")) for c in CALLS) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="b1-L4096,b128-L8192v")
    ap.add_argument("--backends", default="cuda_sm90,triton,flashinfer,flashmla")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("."))
    ap.add_argument("--no-profile", action="store_true", help="skip the cProfile files")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    scale = 192 ** -0.5
    rows, checked = [], {}
    env = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "mla_dispatch": getattr(mla_dispatch, "__version__", "?"), "argv": sys.argv}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    env["sync_floor_us"] = host_us(lambda: None, 200)  # what the synchronisation alone adds to every host_us
    def save(rows: list[dict], complete: bool = False) -> None:
        """The JSON as it stands and, while measuring, the newest row's line: a run cut short (a device call's
        timeout) keeps what it measured."""
        (args.out / "host_cost.json").write_text(json.dumps({"environment": env, "checked": checked, "rows": rows,
                                                             "complete": complete}, indent=2) + "\n")
        if rows and not complete:
            print(table_text(rows[-1:]).splitlines()[-1], flush=True)

    for i, cfg in enumerate(args.configs.split(",")):
        b, length = cfg.split("-")
        varlen = length.endswith("v")
        q, kv, table, lens = make_inputs(int(b[1:]), int(length[1:].rstrip("v")), varlen)
        for name in args.backends.split(","):
            t0 = time.perf_counter()
            try:
                if i == 0:
                    checked[name] = check(name, q, kv, table, lens, scale)
                    if not checked[name].startswith("ok"):
                        rows.append({"config": cfg, "backend": name, "error": f"wrong: {checked[name]}"})
                        continue
                rows.append(measure_backend(name, cfg, q, kv, table, lens, scale, args.reps, args.out,
                                            not args.no_profile))
            except Exception as exc:  # a backend that cannot run here is a row, not the end of the run
                rows.append({"config": cfg, "backend": name, "error": f"{type(exc).__name__}: {exc}"})
                traceback.print_exc()
            print(f"host_cost: {cfg} {name} done in {time.perf_counter() - t0:.1f} s", flush=True)
            save(rows)
        for peer in ("flashmla", "flashinfer"):
            try:
                if peer == "flashmla":
                    rows.append(measure_flashmla(cfg, q, kv, table, lens, scale, args.reps, args.out,
                                                 not args.no_profile))
                else:
                    rows.append(measure_flashinfer_plan(cfg, q, kv, table, lens, scale, args.reps))
            except Exception as exc:
                rows.append({"config": cfg, "backend": f"{peer} (direct)", "error": f"{type(exc).__name__}: {exc}"})
            save(rows)
        del q, kv, table, lens
        torch.cuda.empty_cache()
    save(rows, complete=True)
    print(json.dumps(env))
    print("checked against the reference (first config):", json.dumps(checked))
    print("host µs per call (wall clock + device sync, median); run's kernel µs (CUDA-graph replay) in brackets")
    print(table_text(rows))
    print(f"host µs per call with the GPU kept busy (no synchronisation in the span; a bare synchronisation took "
          f"{env['sync_floor_us']:.1f} µs in the table above)")
    print(host_table_text(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
