"""Compile the decode kernel ahead of time for a GPU target, no GPU needed, and report
registers, spills, shared memory and which MMA instructions the PTX/SASS holds.

    python -m mla_dispatch.kernels.triton.aot_report [--arch 90] [--fmt bf16] [--sass] [SPEC ...]

Used to choose configs without device time (ptxas ships with Triton). Registers
agree with the device's ``CompiledKernel.n_regs``; ``stack_bytes`` is the
cubin's local-memory frame (the device reports ``n_spills``, a smaller count of
spilled registers); this machine's Triton may be newer than the device's.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from mla_dispatch.kernels.triton.decode import KernelConfig, effective_splits, mla_decode_kernel, tma_fits
from mla_dispatch.kvcache.formats import KV_FORMAT_CODES

_PTR = {"bf16": "*bf16", "fp16": "*fp16", "fp8_e4m3": "*fp8e4nv", "fp8_ds_mla": "*u8", "fp8_ds_v4": "*u8"}


def compile_config(cfg: KernelConfig, *, kv_format="bf16", causal=False, sparse=False, arch=90, d_v=512, d_rope=64,
                   page_size=64, sass=False, seesaw=None, sparse_extras=False):
    """Compile ``cfg``'s kernel for ``sm_{arch}`` and report its registers, spills, shared memory and instruction
    counts. ``sparse_extras`` (sparse only): with every optional sparse argument (DeepSeek-V4's ``topk_length``,
    ``attn_sink``, an extra cache on pages of 2 tokens and its ``extra_topk_length``), else with none."""
    if cfg.gluon:
        if seesaw is None:  # the kernel a launch takes (decode.launch_decode_kernel)
            seesaw = kv_format in ("bf16", "fp16") and page_size % 64 == 0
        if seesaw:
            return compile_seesaw(kv_format=kv_format, causal=causal, arch=arch, page_size=page_size, sass=sass)
        return compile_gluon(kv_format=kv_format, causal=causal, arch=arch, page_size=page_size, sass=sass)
    names = list(mla_decode_kernel.arg_names)
    ptrs = dict(Q="*bf16", KV=_PTR[kv_format], BlockTable="*i32", Seqlens="*i32", Indices="*i32", KVScale="*fp32",
                Items="*i32", PartOffsets="*i32", Out="*bf16", Lse="*fp32", PartialOut="*fp32", PartialLse="*fp32")
    v_split, qk_chunk = effective_splits(cfg, d_v)
    tma = cfg.tma and tma_fits(kv_format=kv_format, sparse=sparse, page_size=page_size, heads_kv=1,
                               block_n=cfg.block_n, v_split=v_split, qk_chunk=qk_chunk, head_dim_v=d_v)
    constexprs = dict(PAGE_SIZE=page_size, D_V=d_v, D_ROPE=d_rope, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, V_SPLIT=v_split,
                      QK_CHUNK=qk_chunk, KV_FORMAT=KV_FORMAT_CODES[kv_format], CAUSAL=causal, SPARSE=sparse,
                      TOKENS_ON_M=cfg.tokens_on_m, TMA=tma, ASM_PAGE=tma, Q_TMA=tma)
    if tma:  # host tensor descriptors (decode.tma_descriptors)
        dt = _PTR[kv_format][1:]
        ptrs.update(KDesc=f"tensordesc<{dt}[{cfg.block_n}, {d_v}]>")
        ptrs.update(QDesc=f"tensordesc<bf16[{cfg.block_m}, {d_v}]>")
        if d_rope:
            ptrs.update(RDesc=f"tensordesc<{dt}[{cfg.block_n}, {d_rope}]>", QRDesc=f"tensordesc<bf16[{cfg.block_m}, {d_rope}]>")
    for desc in ("KDesc", "RDesc", "QDesc", "QRDesc"):
        if desc not in ptrs:
            constexprs[desc] = None
    if sparse_extras:  # the optional sparse arguments (DeepSeek-V4's), every one given
        ptrs.update(TopkLength="*i32", AttnSink="*fp32", ExtraKV=_PTR[kv_format], ExtraIndices="*i32",
                    ExtraTopkLength="*i32")
        constexprs.update(EXTRA_PAGE_SIZE=2, HAS_TOPK_LENGTH=True, HAS_SINK=True, HAS_EXTRA=True,
                          HAS_EXTRA_TOPK_LENGTH=True)
    else:  # absent, as a launch without them passes them
        constexprs.update(TopkLength=None, AttnSink=None, ExtraKV=None, ExtraIndices=None, ExtraTopkLength=None,
                          EXTRA_PAGE_SIZE=1, HAS_TOPK_LENGTH=False, HAS_SINK=False, HAS_EXTRA=False,
                          HAS_EXTRA_TOPK_LENGTH=False)
    src = ASTSource(mla_decode_kernel, *_signature(names, ptrs, constexprs))
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                       options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                                    **({"maxnreg": cfg.max_registers} if cfg.max_registers else {})))
    return _report(k, sass)


def compile_gluon(*, kv_format="bf16", causal=False, arch=90, page_size=64, sass=False):
    """:func:`compile_config` for the Gluon sm_90 kernel (:mod:`.gluon_sm90`; a ``gl`` spec): bf16/fp16,
    D_qk = 576, D_v = 512."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from mla_dispatch.kernels.triton import gluon_sm90 as g

    if kv_format not in g.GLUON_KV_FORMATS:
        raise ValueError(f"kv_format={kv_format!r}: the Gluon kernel reads {', '.join(g.GLUON_KV_FORMATS)} caches")
    fn = g.mla_decode_sm90_kernel
    names = list(fn.arg_names)
    fp8 = kv_format == "fp8_e4m3"
    dt = "bf16" if fp8 else kv_format  # the query's type (Triton's names for the two types)

    def desc(rows, cols):
        return _gluon_desc(dt, rows, cols)

    # an fp8 launch passes the query's descriptors for the unused cache ones (gluon_sm90.launch_decode_gluon)
    rows_kv = g.BLOCK_M if fp8 else g.BLOCK_N
    ptrs = dict(q_desc=desc(g.BLOCK_M, 512), qr_desc=desc(g.BLOCK_M, 64), k_desc=desc(rows_kv, 512),
                r_desc=desc(rows_kv, 64), KV=_PTR[kv_format], KVScale="*fp32" if fp8 else "*i32", BlockTable="*i32",
                Seqlens="*i32", Items="*i32", PartOffsets="*i32", Out=f"*{dt}", Lse="*fp32", PartialOut="*fp16",
                PartialLse="*fp32")
    constexprs = dict(PAGE_SIZE=page_size, D_V=512, D_ROPE=64, CAUSAL=causal, TILE_M=g.BLOCK_M, TILE_N=g.BLOCK_N,
                      STAGES=g.NUM_STAGES, GATHER=fp8 or page_size % g.BLOCK_N != 0, FP8=fp8)
    src = GluonASTSource(fn, *_signature(names, ptrs, constexprs))
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=g.NUM_WARPS))
    return _report(k, sass)


def compile_seesaw(*, kv_format="bf16", causal=False, arch=90, page_size=64, sass=False):
    """:func:`compile_config` for the seesaw kernel (:mod:`.gluon_seesaw`: the ``gl`` spec on 16-bit pages of whole
    tiles), D_qk = 576, D_v = 512."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from mla_dispatch.kernels.triton import gluon_seesaw as ss

    if kv_format not in ("bf16", "fp16") or page_size % ss.BLOCK_N:
        raise ValueError(f"kv_format={kv_format!r}, page_size={page_size}: the seesaw kernel reads 16-bit caches on "
                         f"pages of whole {ss.BLOCK_N}-token tiles")
    fn = ss.mla_decode_seesaw_kernel

    def desc(rows, cols):
        return _gluon_desc(kv_format, rows, cols)

    ptrs = dict(q_desc=desc(ss.BLOCK_M, 2 * ss.HALF), qr_desc=desc(ss.BLOCK_M, 64), k_desc=desc(ss.BLOCK_N, ss.HALF),
                r_desc=desc(ss.BLOCK_N, 64), BlockTable="*i32", Seqlens="*i32", Items="*i32", PartOffsets="*i32",
                Out=f"*{kv_format}", Lse="*fp32", PartialOut="*fp16", PartialLse="*fp32")
    constexprs = dict(PAGE_SIZE=page_size, CAUSAL=causal, WORKER_NUM_REGS=ss.WORKER_REGS)
    src = GluonASTSource(fn, *_signature(list(fn.arg_names), ptrs, constexprs))
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=4))
    return _report(k, sass)


def compile_fp8t(*, q_dtype="bf16", rows=16, causal=False, arch=90, page_size=64, sass=False, ptx=False):
    """:func:`compile_config` for the fp8_e4m3 tokens-on-M kernel (:mod:`.gluon_fp8`): ``rows`` query rows (``s_q *
    h_q``, at most :data:`.gluon_fp8.MAX_ROWS`), a bf16 / fp16 query, D_qk = 576, D_v = 512. ``ptx``: return the PTX
    instead of the report."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from mla_dispatch.kernels.triton import gluon_fp8 as f8

    if rows > f8.MAX_ROWS:
        raise ValueError(f"rows={rows}: the fp8 tokens-on-M kernel covers at most {f8.MAX_ROWS} query rows")
    fn = f8.mla_decode_fp8t_kernel
    r = f8.rows_per_program(rows)
    ptrs = dict(q_desc=_gluon_desc(q_dtype, r, 512), qr_desc=_gluon_desc(q_dtype, r, 64),
                Q=f"*{q_dtype}", KV32="*i32", KVScale="*fp32", BlockTable="*i32", Seqlens="*i32", Items="*i32",
                PartOffsets="*i32", Out=f"*{q_dtype}", Lse="*fp32", PartialOut="*fp16", PartialLse="*fp32")
    scorer_regs, acc_regs = f8.CONSUMER_REGS[r]
    constexprs = dict(PAGE_SIZE=page_size, CAUSAL=causal, R=r, SCORER_NUM_REGS=scorer_regs, ACC_NUM_REGS=acc_regs)
    src = GluonASTSource(fn, *_signature(list(fn.arg_names), ptrs, constexprs))
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=4))
    return k.asm["ptx"] if ptx else _report(k, sass)


def _gluon_desc(dt: str, rows: int, cols: int) -> str:
    """The signature type of a Gluon TMA descriptor argument: a ``[rows, cols]`` block of ``dt`` (bf16 / fp16) with the
    default shared-memory layout, as the launchers build them (:func:`.gluon_sm90._descriptors`)."""
    from triton.experimental.gluon import language as gl

    gdt = {"bf16": gl.bfloat16, "fp16": gl.float16}[dt]
    return f"tensordesc<{dt}[{rows}, {cols}],{gl.NVMMASharedLayout.get_default_for([rows, cols], gdt)!r}>"


def _signature(names, ptrs, constexprs):
    """(signature, constants, attributes) of a kernel with arguments ``names`` for ``triton.compile``: ``ptrs`` maps
    pointer / descriptor arguments to their types, ``constexprs`` the compile-time constants to their values;
    ``qk_scale`` is fp32 and every other argument i32. Pointers and strides are marked 16-divisible, as the JIT
    specialises them for the benchmark's tensors, except the LSE tensors' strides (1 or the head / query count)."""
    sig, attrs = {}, {}
    for i, n in enumerate(names):
        if n in constexprs:
            sig[n] = "constexpr"
        elif n in ptrs:
            sig[n] = ptrs[n]
            if not ptrs[n].startswith("tensordesc"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif n == "qk_scale":
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
            if n.startswith("stride_") and n not in ("stride_ls", "stride_pls", "stride_plh", "stride_lh"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, {(names.index(k),): v for k, v in constexprs.items()}, attrs


def _report(k, sass):
    ptx = k.asm["ptx"]
    report = dict(regs=_reg_count(k), stack_bytes=_spills(k), smem=k.metadata.shared,
                  wgmma=ptx.count("wgmma.mma_async"), mma_sync=ptx.count("mma.sync"),
                  cp_async=ptx.count("cp.async"), tma=ptx.count("cp.async.bulk.tensor"))
    if sass:
        report["sass_loops"] = sass_loops(k.asm["cubin"])
    return report


def _reg_count(k):
    try:
        k._init_handles()
    except Exception:
        pass
    n = getattr(k, "n_regs", None)
    if n:
        return n
    m = re.search(r"\.maxnreg (\d+)", k.asm["ptx"])
    return _cubin_regs(k) or (int(m.group(1)) if m else None)


def _cubin_tool(tool: str, cubin: bytes, *args: str, check: bool = False) -> str:
    """The standard output of ``tool`` (a binary Triton ships: ``cuobjdump``, ``nvdisasm``) run on ``cubin``."""
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([path, *args, f.name], capture_output=True, text=True, check=check).stdout


def _cubin_regs(k):
    out = _cubin_tool("cuobjdump", k.asm["cubin"], "-res-usage")
    m = re.search(r"REG:(\d+)", out)
    s = re.search(r"STACK:(\d+)", out)
    k._stack = int(s.group(1)) if s else None
    return int(m.group(1)) if m else None


def _spills(k):
    return getattr(k, "_stack", None)


# SASS events worth following through a loop body: barrier waits, the matrix instructions by shape, TMA issues,
# cp.async and global loads (the block-table read), CTA barriers, waits for outstanding wgmma
_EVENTS = re.compile(r"(SYNCS\.PHASECHK\S*|HGMMA\.\d+x\d+x\d+|UTMALDG|LDGSTS|LDG\S*|BAR\.SYNC|WARPGROUP\.DEPBAR)")


def sass_loops(cubin: bytes) -> list[str]:
    """The innermost loops of a cubin (a backward branch to a label above it, with no other loop inside), each as
    its instruction count, its local-memory loads / stores, and its events in program order with repeats folded
    (``HGMMA.64x32x16 x36``): where in an iteration the next tile's TMA is issued, which wgmma shapes run and how
    many times. Disassembled with the ``nvdisasm`` Triton ships."""
    lines = _cubin_tool("nvdisasm", cubin, "-c", check=True).splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", line))}
    spans = []
    for i, line in enumerate(lines):
        m = re.search(r"BRA\s+`\((\.L_x_\d+)\)", line)
        if m and labels.get(m.group(1), i) < i:
            spans.append((labels[m.group(1)], i))
    loops = []
    for lo, hi in spans:
        if any(lo <= a and b <= hi and (a, b) != (lo, hi) for a, b in spans):
            continue  # an outer loop
        body = lines[lo:hi + 1]
        count = sum(1 for b in body if re.search(r"/\*[0-9a-f]{4,}\*/", b))
        local = sum(1 for b in body if re.search(r"\b(LDL|STL)\b", b))
        events: list[list] = []
        for b in body:
            e = _EVENTS.search(b)
            if e:
                name = e.group(1)
                if events and events[-1][0] == name:
                    events[-1][1] += 1
                else:
                    events.append([name, 1])
        if any(n.startswith("HGMMA") for n, _ in events):
            loops.append(f"{count} instructions, {local} local loads/stores: "
                         + ", ".join(n if c == 1 else f"{n} x{c}" for n, c in events))
    return loops


def parse_spec(spec: str) -> KernelConfig:
    """'tM16-n64-w8-v2-q128-s2' -> KernelConfig: t|h tokens/heads on M, M block_m, n block_n,
    w warps, v v_split, q qk_chunk, s stages, p programs per SM, r register cap, tma whole tiles by TMA, gl the Gluon
    sm_90 kernel where it applies (the notation of dev/bench_triton.py)."""
    f = dict(block_m=16, block_n=64, num_warps=4, num_stages=2, tokens_on_m=spec[0] == "t", v_split=1, qk_chunk=512)
    for tok in spec[1:].split("-"):
        if tok in ("tma", "gl"):
            f[{"tma": "tma", "gl": "gluon"}[tok]] = True
            continue
        key = {"M": "block_m", "n": "block_n", "w": "num_warps", "v": "v_split", "q": "qk_chunk",
               "s": "num_stages", "p": "programs_per_sm", "r": "max_registers"}[tok[0]]
        f[key] = int(tok[1:])
    f["chunk_size"] = max(64, f["block_n"])
    return KernelConfig(**f)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--fmt", default="bf16", choices=sorted(KV_FORMAT_CODES))
    ap.add_argument("--sass", action="store_true", help="also each loop's SASS events in order (sass_loops)")
    ap.add_argument("specs", nargs="*", default=["tM16-n64", "tM32-n64", "hM64-n32-w8", "hM64-n64-w8"])
    args = ap.parse_args()
    for spec in args.specs:
        try:
            r = compile_config(parse_spec(spec), kv_format=args.fmt, arch=args.arch, sass=args.sass)
        except Exception as exc:  # out of shared memory etc.: report and go on
            r = f"{type(exc).__name__}: {str(exc)[:120]}"
        loops = r.pop("sass_loops", []) if isinstance(r, dict) else []
        print(f"{spec:24s} {args.fmt:10s} {r}", flush=True)
        for i, loop in enumerate(loops):
            print(f"  loop {i}: {loop}", flush=True)


if __name__ == "__main__":
    main()
