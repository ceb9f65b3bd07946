"""Benchmark the Triton MLA decode kernel against the roofline measured in the same run.

    python dev/bench_triton.py [--grids flashmla,mem,pages,fp8,graph,choice,occupancy,small,tma,tmapage16,gluon,gluonpages,gluonfp8,gluonsched] [--json PATH]
                              [--check] [--only NAME,...] [--report] [--precompile N] [--plot PNG]
    python dev/bench_triton.py --from-json PATH --plot PNG      # chart an earlier run (no GPU needed)

Prints, per config: µs (triton.testing.do_bench median, L2 flushed) for
``DecodePlan.run`` (decode + combine), for ``update + run`` (the per-step
schedule included, FlashMLA's "whole call"), and for a CUDA-graph replay of
``run``; TFLOP/s, GB/s and % of the roofline (docs/design.md §6):

    FLOPs = 2 * s_q * h_q * (D_qk + D_v) * sum(L)
    bytes = h_kv * token_bytes * sum(L) + 2 * B * s_q * h_q * (D_qk + D_v)
            (token_bytes = 2 * D_qk for bf16 = the DESIGN formula; 576 fp8_e4m3; 656 fp8_ds_mla)
    roofline = max(FLOPs / matmul_peak, bytes / copy_peak), both measured here.

Also reports the compiled kernel's registers, spills and whether the PTX holds
wgmma (Hopper warpgroup MMA) or only mma.sync (``--report``); checks each config's
output against the reference first (``--check``); ``small`` adds the GPU time of the
decode and combine kernels per split count. ``--plot`` draws the run's results against the
speed targets of the Triton backend's issue (:func:`plot_targets`).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time

import torch
import triton
import triton.testing

from mla_dispatch import plan_decode
from mla_dispatch.backends.triton import TritonBackend
from mla_dispatch.kvcache.formats import pack_ds_mla
from mla_dispatch.kernels.triton.aot_report import parse_spec  # the tM16-n64-... config notation

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # target_chart, beside this script
from target_chart import plot_target_rows  # noqa: E402

D_QK, D_V = 576, 512


def measure_peaks() -> tuple[float, float]:
    """(bytes/s of a 1 GiB device copy counting read + write, FLOP/s of an 8192^3 bf16 matmul)."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    t_copy = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median") * 1e-3
    del src, dst
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    t_mm = triton.testing.do_bench(lambda: a @ b, warmup=100, rep=500, return_mode="median") * 1e-3
    return 2 * n / t_copy, 2 * 8192**3 / t_mm


def warm_up(seconds: float) -> None:
    """Keep the GPU copying for ``seconds`` before the timed entries. Without it the first few entries after the
    compile pass sometimes ran at ~45% of their speed for ~20 s (H100, 2026-11-22: b=64 L=8K h=16 / 32 / 64 all at
    ~450 us, then 235-250 us in the same process)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t0 = time.time()
    while time.time() - t0 < seconds:
        for _ in range(20):
            dst.copy_(src)
        torch.cuda.synchronize()
    del src, dst


def make_inputs(batch, q_len, h_q, seqlen, *, page_size=64, kv_format="bf16", varlen=True, seed=0):
    """FlashMLA-benchmark-style inputs generated directly on the GPU (no NaN poison: speed only)."""
    g = torch.Generator().manual_seed(seed)
    if varlen:
        lens = torch.normal(float(seqlen), seqlen / 2, (batch,), generator=g).round().clamp_min(q_len).int()
    else:
        lens = torch.full((batch,), seqlen, dtype=torch.int32)
    max_blocks = math.ceil(int(lens.max()) / page_size)
    num_blocks = batch * max_blocks
    table = torch.randperm(num_blocks, device="cuda").view(batch, max_blocks).int()
    q = (torch.randn(batch, q_len, h_q, D_QK, device="cuda", dtype=torch.bfloat16) / 10).clamp(-1, 1)
    kv_scale = None
    if kv_format == "bf16":
        kv = (torch.randn(num_blocks, page_size, 1, D_QK, device="cuda", dtype=torch.bfloat16) / 10).clamp(-1, 1)
    else:
        kv = torch.empty(num_blocks, page_size, 1, D_QK if kv_format == "fp8_e4m3" else 656, device="cuda",
                         dtype=torch.float8_e4m3fn if kv_format == "fp8_e4m3" else torch.uint8)
        step = max(1, (1 << 26) // (page_size * D_QK))
        for b0 in range(0, num_blocks, step):  # quantise in slices to bound memory
            vals = (torch.randn(min(step, num_blocks - b0), page_size, 1, D_QK, device="cuda") / 10).clamp(-1, 1)
            if kv_format == "fp8_e4m3":
                kv[b0:b0 + step] = (vals / 0.002).clamp(-448, 448).to(torch.float8_e4m3fn)
            else:
                kv[b0:b0 + step] = pack_ds_mla(vals)
        if kv_format == "fp8_e4m3":
            kv_scale = torch.tensor([0.002], device="cuda")
    return q, kv, table, lens.cuda(), kv_scale


def kernel_report(plan, q, kv, kv_scale) -> dict:
    """Registers / spills / MMA flavour of the decode kernel this plan launches."""
    from mla_dispatch.kernels.triton.decode import launch_decode

    p, st = plan.problem, plan.state
    out = torch.empty(p.batch, p.q_len, p.num_heads_q, p.head_dim_v, dtype=q.dtype, device="cuda")
    lse = torch.empty(p.batch, p.num_heads_q, p.q_len, device="cuda")
    k = launch_decode(q, kv, plan.block_table, plan.cache_seqlens, None, kv_scale, st.schedule, out, lse,
                      st.partial_out, st.partial_lse, softmax_scale=plan.softmax_scale, causal=p.causal,
                      kv_format=p.kv_format, head_dim_v=p.head_dim_v, cfg=st.cfg)
    ptx = k.asm.get("ptx", "")
    return dict(regs=getattr(k, "n_regs", None), spills=getattr(k, "n_spills", None),
                smem=k.metadata.shared if hasattr(k.metadata, "shared") else None,
                wgmma=ptx.count("wgmma.mma_async"), mma_sync=ptx.count("mma.sync"))


def bench_one(name, peaks, batch, q_len, h_q, seqlen, *, page_size=64, kv_format="bf16", varlen=True,
              config=None, num_parts=None, overhead=None, graph=True, report=False, kernels=False, check=False,
              compile_only=False) -> dict:
    q, kv, table, lens, kv_scale = make_inputs(batch, q_len, h_q, seqlen, page_size=page_size, kv_format=kv_format,
                                               varlen=varlen)
    plan = plan_decode(q, kv, table, lens, kv_format=kv_format, kv_scale=kv_scale, causal=q_len > 1,
                       backend="triton", cuda_graph=True)
    if config is not None or num_parts is not None or overhead is not None:
        plan._state = TritonBackend.make_state(plan.problem, plan.platform, lens, config=config, num_parts=num_parts,
                                               overhead=overhead, block_table=plan.block_table,
                                               softmax_scale=plan.softmax_scale)
    out = torch.empty(batch, q_len, h_q, D_V, dtype=q.dtype, device="cuda")
    lse = torch.empty(batch, h_q, q_len, device="cuda")

    def run():
        plan.run(q, kv, kv_scale=kv_scale, out=out, lse=lse)

    def step():
        plan.update()
        run()

    if compile_only:  # one run fills Triton's on-disk cache for this config (see precompile)
        run()
        torch.cuda.synchronize()
        return {}
    check_msg = None
    if check:  # the config's output against the fp32 reference, docs/design.md §5 tolerances (poisoned first)
        from mla_dispatch.numerics.oracle import reference_attention
        from mla_dispatch.numerics.tolerance import compare_outputs

        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        run()
        ref_out, ref_lse = reference_attention(q, kv, table, lens, head_dim_v=D_V, softmax_scale=plan.softmax_scale,
                                               causal=q_len > 1, kv_format=kv_format, kv_scale=kv_scale)
        rep = compare_outputs(out, lse, ref_out, ref_lse, TritonBackend.TOLERANCE)
        check_msg = "ok" if rep else f"MISMATCH {rep.message}"
        del ref_out, ref_lse
    run()
    torch.cuda.synchronize()
    t_run = triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median") * 1e-3
    t_step = triton.testing.do_bench(step, warmup=10, rep=50, return_mode="median") * 1e-3
    t_graph = None
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run()
        t_graph = triton.testing.do_bench(g.replay, warmup=25, rep=100, return_mode="median") * 1e-3
    total = int(lens.sum())
    token_bytes = {"bf16": 2 * D_QK, "fp8_e4m3": D_QK, "fp8_ds_mla": 656}[kv_format]
    flops = 2 * q_len * h_q * (D_QK + D_V) * total
    nbytes = token_bytes * total + 2 * batch * q_len * h_q * (D_QK + D_V)
    bw, fl = peaks
    roof = max(flops / fl, nbytes / bw)
    res = dict(name=name, batch=batch, q_len=q_len, h_q=h_q, seqlen=seqlen, page_size=page_size, kv_format=kv_format,
               varlen=varlen, config=str(plan.state.cfg), us=t_run * 1e6, us_step=t_step * 1e6,
               us_graph=None if t_graph is None else t_graph * 1e6, tflops=flops / t_run / 1e12,
               gbs=nbytes / t_run / 1e9, roofline_us=roof * 1e6, pct_roofline=100 * roof / t_run,
               bound="compute" if flops / fl > nbytes / bw else "memory")
    res["num_parts"] = plan.state.schedule.num_parts
    if check_msg is not None:
        res["check"] = check_msg
    if kernels:  # GPU time of each kernel of one eager call (decode vs combine)
        from profile_small_batch import kernel_times

        res["kernel_us"] = kernel_times(run)
    if report:
        res.update(kernel_report(plan, q, kv, kv_scale))
    del q, kv, table, plan, out, lse
    torch.cuda.empty_cache()
    return res


def grids(names):
    g = []
    if "quick" in names:
        g.append(("flashmla-s1-L8192", dict(batch=128, q_len=1, h_q=128, seqlen=8192), True))
        g.append(("mem-h16", dict(batch=64, q_len=1, h_q=16, seqlen=8192, varlen=False), True))
        g.append(("mem-h64", dict(batch=64, q_len=1, h_q=64, seqlen=8192, varlen=False), True))
        g.append(("graph-b1-L4096", dict(batch=1, q_len=1, h_q=128, seqlen=4096, varlen=False), True))
    if "flashmla" in names:
        for s_q in (1, 2):
            for L in (4096, 8192, 16384, 32768):
                g.append((f"flashmla-s{s_q}-L{L}", dict(batch=128, q_len=s_q, h_q=128, seqlen=L), True))
    if "mem" in names:
        for h in (16, 32, 64):
            g.append((f"mem-h{h}", dict(batch=64, q_len=1, h_q=h, seqlen=8192, varlen=False), True))
    if "pages" in names:
        for ps in (1, 16, 128):
            for h in (16, 64):
                g.append((f"page{ps}-h{h}", dict(batch=64, q_len=1, h_q=h, seqlen=8192, varlen=False,
                                                 page_size=ps), True))
    if "fp8" in names:
        for fmt in ("fp8_e4m3", "fp8_ds_mla"):
            for h in (16, 32, 64):
                g.append((f"{fmt}-h{h}", dict(batch=64, q_len=1, h_q=h, seqlen=8192, varlen=False,
                                              kv_format=fmt), True))
    if "graph" in names:
        g.append(("graph-b1-L4096", dict(batch=1, q_len=1, h_q=128, seqlen=4096, varlen=False), True))
        g.append(("graph-b1-L32768", dict(batch=1, q_len=1, h_q=128, seqlen=32768, varlen=False), True))
    if "small" in names:  # split count vs decode / combine time at batch 1 (docs/notes/triton.md gap 4)
        for L in (4096, 32768):
            for parts in (None, 32, 16, 8):
                g.append((f"small-b1-L{L}-parts{parts or 'auto'}", dict(batch=1, q_len=1, h_q=128, seqlen=L,
                                                                       varlen=False, num_parts=parts,
                                                                       kernels=True), True))
    if "tma" in names:  # whole tiles by TMA (KernelConfig.tma, bf16) against the gather configs they replaced
        cands = {16: ("tM16-n32-s2-p3-r168", "tM16-n32-s4-tma", "tM16-n64-s2-tma"),
                 32: ("tM32-n64", "tM32-n64-tma", "hM64-n32-w8-s4-tma"),
                 64: ("hM64-n64-w8", "hM64-n64-w8-tma", "hM64-n32-w8-s4-tma")}
        for h, specs in cands.items():
            for spec in specs:
                g.append((f"tma-h{h}-{spec}", dict(batch=64, q_len=1, h_q=h, seqlen=8192, varlen=False,
                                                   config=parse_spec(spec)), False))
        for spec in ("hM64-n64-w8", "hM64-n64-w8-tma", "hM64-n32-w8-s4-tma"):
            g.append((f"tma-flashmla-s1-L8192-{spec}", dict(batch=128, q_len=1, h_q=128, seqlen=8192,
                                                            config=parse_spec(spec)), False))
    if "gluon" in names:  # the Gluon sm_90 kernel (KernelConfig.gluon) against the plain TMA configs of its classes
        for h, specs in ((16, ("tM16-n64-s2-tma", "hM64-n64-w8-tma-gl")), (32, ("tM32-n64-tma", "hM64-n64-w8-tma-gl")),
                         (64, ("hM64-n64-w8-tma", "hM64-n64-w8-tma-gl"))):
            for spec in specs:
                g.append((f"gluon-h{h}-{spec}", dict(batch=64, q_len=1, h_q=h, seqlen=8192, varlen=False,
                                                     config=parse_spec(spec)), False))
        for spec in ("hM64-n64-w8-tma", "hM64-n64-w8-tma-gl"):
            for s_q in (1, 2):
                for L in (4096, 8192, 16384, 32768):
                    g.append((f"gluon-flashmla-s{s_q}-L{L}-{spec}", dict(batch=128, q_len=s_q, h_q=128, seqlen=L,
                                                                         config=parse_spec(spec)), False))
            g.append((f"gluon-graph-b1-L4096-{spec}", dict(batch=1, q_len=1, h_q=128, seqlen=4096, varlen=False,
                                                          config=parse_spec(spec)), True))
    if "gluonpages" in names:  # the Gluon kernel gathering every tile (pages not holding whole 64-token tiles)
        from mla_dispatch.kernels.triton.decode import choose_config

        for h in (16, 32, 64):
            for ps in (64, 1, 16, 33):
                plain = choose_config(h, "bf16", page_size=ps)  # the table without the Gluon kernel
                for spec, cfg in (("plain", plain), ("gl", parse_spec("hM64-n64-w8-tma-gl"))):
                    g.append((f"gluonpages-h{h}-page{ps}-{spec}", dict(batch=64, q_len=1, h_q=h, seqlen=8192,
                                                                      varlen=False, page_size=ps, config=cfg), True))
    if "gluonfp8" in names:  # the Gluon kernel on fp8_e4m3 caches (converted in shared memory) against the plain table
        from mla_dispatch.kernels.triton.decode import choose_config

        for h in (16, 32, 64):
            for ps in (64, 16):
                plain = choose_config(h, "fp8_e4m3", page_size=ps)
                for spec, cfg in (("plain", plain), ("gl", parse_spec("hM64-n64-w8-tma-gl"))):
                    g.append((f"gluonfp8-h{h}-page{ps}-{spec}", dict(batch=64, q_len=1, h_q=h, seqlen=8192,
                                                                    varlen=False, page_size=ps, kv_format="fp8_e4m3",
                                                                    config=cfg), True))
        for s_q in (1, 2):
            for spec in ("plain", "gl"):
                cfg = choose_config(128 * s_q, "fp8_e4m3", page_size=64) if spec == "plain" else \
                    parse_spec("hM64-n64-w8-tma-gl")
                g.append((f"gluonfp8-flashmla-s{s_q}-L8192-{spec}", dict(batch=128, q_len=s_q, h_q=128, seqlen=8192,
                                                                        kv_format="fp8_e4m3", config=cfg), True))
    if "gluonsched" in names:  # the schedule's fixed cost per item (in 64-token chunks; default 5) for the Gluon kernel
        for s_q, L in ((1, 4096), (2, 4096), (1, 8192)):
            for overhead in (None, 2, 10):
                g.append((f"gluonsched-s{s_q}-L{L}-ovh{overhead or 'default'}",
                          dict(batch=128, q_len=s_q, h_q=128, seqlen=L, overhead=overhead), True))
    if "tmapage16" in names:  # page 16: TMA needs tiles inside a page, so 16-token tiles, deeper pipelines
        for spec in ("hM64-n64-w8-s3", "hM64-n16-w8-s4-tma", "hM64-n16-w8-s6-tma"):
            g.append((f"tmapage16-h64-{spec}", dict(batch=64, q_len=1, h_q=64, seqlen=8192, varlen=False, page_size=16,
                                                    config=parse_spec(spec)), False))
    if "fp8choice" in names:
        for h, spec in ((16, "hM16-n32"), (16, "hM16-n64"), (32, "hM16-n32"), (32, "hM32-n32"), (32, "tM32-n64"),
                        (64, "hM16-n32")):
            for fmt in ("fp8_e4m3",) if spec[0] == "t" else ("fp8_e4m3", "fp8_ds_mla"):  # see docs/notes/triton.md
                g.append((f"fp8choice-h{h}-{spec}-{fmt}", dict(batch=64, q_len=1, h_q=h, seqlen=8192, varlen=False,
                                                               kv_format=fmt, config=parse_spec(spec)), False))
    if "choice2" in names:  # tokens on M with several M tiles for 64/128 rows
        for h, spec in ((64, "tM32-n64"), (64, "tM16-n64"), (64, "hM64-n32-w8"), (128, "tM32-n64"),
                        (128, "hM64-n64-w8")):
            kw = dict(batch=64, q_len=1, h_q=h, seqlen=8192, varlen=False) if h < 128 else \
                dict(batch=128, q_len=1, h_q=128, seqlen=8192)
            g.append((f"choice2-h{h}-{spec}", dict(kw, config=parse_spec(spec)), False))
    if "page1" in names:  # configs for page size 1 at 64 rows (issue 3: within 15% of page 64)
        kw = dict(batch=64, q_len=1, h_q=64, seqlen=8192, varlen=False)
        g.append(("page1-h64-base-page64", dict(kw), False))
        for spec in ("hM64-n32-w8", "hM64-n32-w8-s3", "hM64-n64-w8", "hM64-n64-w8-s3", "tM32-n64", "tM16-n32-s2-p3-r168"):
            g.append((f"page1-h64-{spec}", dict(kw, page_size=1, config=parse_spec(spec)), False))
    if "stages" in names:  # 64-token tiles with the block-table entry prefetched a stage ahead (s3), 32-128 rows
        for ps in (64, 16, 128, 1):
            for spec in ("hM64-n32-w8", "hM64-n64-w8", "hM64-n64-w8-s3"):
                g.append((f"stages-h64-page{ps}-{spec}", dict(batch=64, q_len=1, h_q=64, seqlen=8192, varlen=False,
                                                              page_size=ps, config=parse_spec(spec)), False))
        for spec in ("tM32-n64", "tM32-n64-s3", "hM64-n64-w8-s3"):
            g.append((f"stages-h32-{spec}", dict(batch=64, q_len=1, h_q=32, seqlen=8192, varlen=False,
                                                 config=parse_spec(spec)), False))
        for fmt in ("fp8_e4m3", "fp8_ds_mla"):
            for h, spec in ((64, "hM64-n32-w8"), (64, "hM64-n64-w8"), (32, "hM64-n64-w8")):
                g.append((f"stages-h{h}-{spec}-{fmt}", dict(batch=64, q_len=1, h_q=h, seqlen=8192, varlen=False,
                                                           kv_format=fmt, config=parse_spec(spec)), False))
        for s_q in (1, 2):
            for spec in ("hM64-n64-w8", "hM64-n64-w8-s3"):
                g.append((f"stages-flashmla-s{s_q}-L8192-{spec}", dict(batch=128, q_len=s_q, h_q=128, seqlen=8192,
                                                                       config=parse_spec(spec)), False))
    if "occupancy" in names:
        # programs per SM (p), table prefetch (s3) and register caps (r): docs/notes/triton.md "pipeline"
        picks = {
            16: ("tM16-n64", "tM16-n32-s2-p3-r168", "tM16-n32-s2-p2", "tM16-n32-s3-p3-r168", "tM16-n32-s2-p4-r128", "hM16-n32:fp8_e4m3", "tM16-n32-s2-p3-r168:fp8_e4m3",
                 "hM16-n32-p3-r168:fp8_e4m3", "hM16-n32:fp8_ds_mla", "tM16-n32-s2-p3-r168:fp8_ds_mla",
                 "hM16-n32-p3-r168:fp8_ds_mla"),
            32: ("tM32-n64", "tM16-n32-s2-p3-r168", "tM32-n32-s2-p2", "hM16-n32:fp8_e4m3", "hM16-n32-p3-r168:fp8_e4m3",
                 "hM16-n32:fp8_ds_mla", "tM16-n32-s2-p3-r168:fp8_ds_mla", "hM16-n32-p3-r168:fp8_ds_mla"),
            64: ("hM64-n32-w8", "tM16-n32-s2-p3-r168"),
        }
        for h, specs in picks.items():
            kw = dict(batch=64, q_len=1, h_q=h, seqlen=8192, varlen=False) if h < 128 else \
                dict(batch=128, q_len=1, h_q=128, seqlen=8192)
            for spec in specs:
                spec, fmt = spec.split(":") if ":" in spec else (spec, "bf16")
                g.append((f"occ-h{h}-{spec}-{fmt}", dict(kw, config=parse_spec(spec), kv_format=fmt), False))
    if "choice" in names:
        # heads on M vs tokens on M for h_q*s_q < 64, tile shapes and register-saving splits per class.
        cfg = parse_spec
        picks = {
            16: ("tM16-n32-w8", "tM16-n32-w8-v2", "tM16-n32-w8-q128", "tM16-n64", "hM16-n64-v2-q128"),
            32: ("tM32-n32-w8-v2-q128", "tM16-n32-w8-v2"),
            64: ("hM64-n32-w8", "tM32-n32-w8-v2-q128", "tM16-n32-w8-v2", "tM16-n32-w8-v2:fp8_e4m3",
                 "tM32-n32-w8-v2-q128:fp8_e4m3", "tM16-n32-w8-v2:fp8_ds_mla", "hM64-n32-w8:fp8_ds_mla"),
            128: ("hM64-n32-w8", "hM64-n64-w8", "tM32-n32-w8-v2-q128", "tM16-n32-w8-v2"),
        }
        for h, specs in picks.items():
            for spec in specs:
                fmt = "bf16"
                if ":" in spec:
                    spec, fmt = spec.split(":")
                kw = dict(batch=64, q_len=1, h_q=h, seqlen=8192, varlen=False) if h < 128 else \
                    dict(batch=128, q_len=1, h_q=128, seqlen=8192)
                g.append((f"choice-h{h}-{spec}-{fmt}", dict(kw, config=cfg(spec), kv_format=fmt), False))
    return g


def _compile_entry(entry) -> str:
    name, kw = entry
    try:
        bench_one(name, None, compile_only=True, **kw)
        return ""
    except Exception as exc:  # the timed pass reports it again
        return f"{name}: {type(exc).__name__}: {exc}"


def precompile(entries, workers: int) -> None:
    """Compile every entry's kernels in ``workers`` processes at once (Triton compiles on the CPU, one config at a
    time per process; its on-disk cache then serves the timed pass), so a grid of new configs costs its slowest
    compile rather than the sum."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    t0 = time.time()
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        errors = [e for e in pool.map(_compile_entry, [(n, kw) for n, kw, _ in entries]) if e]
    print(f"precompiled {len(entries)} configs in {time.time() - t0:.0f}s with {workers} processes"
          + "".join(f"\n  {e}" for e in errors), flush=True)


#: issue 3's speed targets for the Triton backend (the fp8 and page targets are relative to the bf16 page-64 config)
TARGETS = dict(flashmla_pct=60.0, mem_pct=80.0, page_within=0.15, fp8_speedup=1.6, b1_us=15.0)


def target_rows(results: list[dict]) -> list[dict]:
    """A run's results against :data:`TARGETS`, one row per config that has a target panel: ``panel`` (``pct``: % of
    the roofline on the FlashMLA and memory-bound grids; ``page``: % more time than page 64 at the same heads; ``fp8``:
    throughput relative to bf16 at the same heads; ``b1``: µs at b = 1, L = 4K), ``name``, ``value``, ``target``
    (None: no target, as for fp8_ds_mla), ``met`` (None without a target). Times are the CUDA-graph replay where one was
    timed, else the eager run; page and fp8 rows need the run's ``mem-h<heads>`` config (bf16, page 64)."""
    by = {r["name"]: r for r in results}

    def us(name):
        r = by[name]
        return r["us_graph"] if r.get("us_graph") else r["us"]

    def base(n):
        return f"mem-h{by[n]['h_q']}"

    rows = []

    def add(panel, name, value, target, higher_is_better=True):
        met = None if target is None else (value >= target) == higher_is_better
        rows.append(dict(panel=panel, name=name, value=value, target=target, met=met))

    for n in by:
        if n.startswith(("flashmla-", "mem-h")):
            add("pct", n, 100 * by[n]["roofline_us"] / us(n),
                TARGETS["mem_pct" if n.startswith("mem-") else "flashmla_pct"])
        elif n.startswith("page") and base(n) in by:
            add("page", n, 100 * (us(n) / us(base(n)) - 1), 100 * TARGETS["page_within"], higher_is_better=False)
        elif n.startswith("fp8_") and base(n) in by:
            add("fp8", n, us(base(n)) / us(n), TARGETS["fp8_speedup"] if by[n]["kv_format"] == "fp8_e4m3" else None)
        elif n.startswith("graph-b1-L4096"):
            add("b1", n, us(n), TARGETS["b1_us"], higher_is_better=False)
    return rows


PANELS = dict(pct="% of roofline (target: FlashMLA grid 60, mem 80)",
              page="time vs page 64, % (target: within 15)",
              fp8="throughput vs bf16 (target 1.6x, fp8_e4m3)",
              b1="us, b=1 L=4K h=128 (target 15)")


def plot_targets(results: list[dict], path: str, title: str = "") -> None:
    """The four panels of :func:`target_rows` side by side (dev/target_chart.py), a bar per config: green where it
    meets its target (a dashed line), red where it misses it, grey where it has none. Panels whose configs the run
    lacks stay empty."""
    plot_target_rows(target_rows(results), PANELS, path, title)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grids", default="flashmla,mem,pages,fp8,graph")
    ap.add_argument("--json", default=None)
    ap.add_argument("--report", action="store_true", help="registers/spills/wgmma per config")
    ap.add_argument("--check", action="store_true", help="compare each config's output with the reference")
    ap.add_argument("--kernels", action="store_true", help="also the GPU time of each kernel (decode, combine) of "
                    "one eager call, for every entry")
    ap.add_argument("--overhead", type=int, default=None, help="the schedule's fixed cost per item, in chunks "
                    "(default: the backend's, 320 tokens)")
    ap.add_argument("--only", default=None, help="comma-separated names: run just these grid entries")
    ap.add_argument("--precompile", type=int, default=0, metavar="N",
                    help="compile the entries' kernels in N processes first (Triton's cache serves the timed pass); "
                         "each process builds its entry's inputs on the GPU: 12 ran out of memory on the default grids "
                         "of an 80 GB H100 (those entries then compile in the timed pass), 4 did not")
    ap.add_argument("--warm-up", type=float, default=5.0, metavar="S", help="seconds of GPU copies before timing")
    ap.add_argument("--plot", default=None, metavar="PNG", help="chart the results against the issue's targets")
    ap.add_argument("--from-json", default=None, metavar="PATH", help="with --plot: chart an earlier run's --json "
                    "output instead of running (no GPU needed)")
    args = ap.parse_args()
    if args.from_json:
        if not args.plot:
            ap.error("--from-json needs --plot PNG")
        with open(args.from_json) as f:
            saved = json.load(f)
        plot_targets(saved["results"], args.plot, _title(saved))
        return
    names = set(args.grids.split(","))
    print(f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton {triton.__version__}")
    peaks = measure_peaks()
    print(f"measured peaks: copy {peaks[0] / 1e12:.2f} TB/s, bf16 matmul {peaks[1] / 1e12:.0f} TFLOP/s")
    results = []
    only = set(args.only.split(",")) if args.only else None
    entries = [e for e in grids(names) if only is None or e[0] in only]
    if args.precompile:
        precompile(entries, args.precompile)
    warm_up(args.warm_up)
    for name, kw, graph in entries:
        t0 = time.time()
        try:
            if args.kernels:
                kw = dict(kw, kernels=True)
            kw = dict({"overhead": args.overhead}, **kw)  # an entry's own overhead wins
            r = bench_one(name, peaks, graph=graph, report=args.report, check=args.check, **kw)
        except Exception as exc:
            print(f"{name}: FAILED {type(exc).__name__}: {exc}")
            continue
        r["wall_s"] = time.time() - t0
        results.append(r)
        extra = f" regs={r.get('regs')} spills={r.get('spills')} wgmma={r.get('wgmma')} mma={r.get('mma_sync')}" \
            if args.report else ""
        if "check" in r:
            extra += f" check={r['check']}"
        if "kernel_us" in r:
            extra += f" parts={r['num_parts']} " + " ".join(f"{k}={t:.1f}" for k, t in sorted(r["kernel_us"].items()))
        print(f"{name:28s} {r['us']:9.1f} us  step {r['us_step']:9.1f}  graph "
              f"{r['us_graph'] if r['us_graph'] is None else round(r['us_graph'], 1)!s:>8}  "
              f"{r['tflops']:6.1f} TF/s {r['gbs']:7.0f} GB/s  {r['pct_roofline']:5.1f}% ({r['bound']}) "
              f"[{r['config']}] ({r['wall_s']:.0f}s){extra}", flush=True)
    saved = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__, triton=triton.__version__,
                 copy_Bps=peaks[0], matmul_flops=peaks[1], results=results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(saved, f, indent=1)
    if args.plot:
        plot_targets(results, args.plot, _title(saved))


def _title(saved: dict) -> str:
    return (f"Triton backend, {saved['device']}, torch {saved['torch']}, triton {saved['triton']}; ceilings: copy "
            f"{saved['copy_Bps'] / 1e12:.2f} TB/s, bf16 matmul {saved['matmul_flops'] / 1e12:.0f} TFLOP/s; "
            "bars: CUDA-graph replay where timed, else the eager run (green: target met, red: missed)")


if __name__ == "__main__":
    main()
