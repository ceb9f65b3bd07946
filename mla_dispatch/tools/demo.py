"""``python -m mla_dispatch demo``: one DeepSeek-V3-shaped decode step, end to end.

Builds a paged cache with :class:`PagedMLACache` (h_q=128, D_qk=576, D_v=512,
one latent KV head, a few requests of different lengths, one of them empty),
plans the step, runs it on the best backend here (or the one named), checks the
result against an independent float64 computation (plain softmax attention over
each request's gathered tokens) at the backend's tolerance (docs §5), and prints
the backend, the error and the time. The check is the same for every backend, the
reference included, so on a CPU-only machine it is not the reference against itself.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch

from mla_dispatch.api import plan_decode
from mla_dispatch.kvcache.cache import PagedMLACache
from mla_dispatch.kvcache.formats import DS_MLA_TOKEN_BYTES
from mla_dispatch.dispatch.platform import detect_platform
from mla_dispatch.dispatch.registry import get_backend, registered_names
from mla_dispatch.dispatch.select import NoBackendError
from mla_dispatch.numerics.tolerance import compare_outputs
from mla_dispatch.tools.args import (CommandParser, UsageError, int_list, parse_device, positive_int, seed_int,
                                     usage_error)

# DeepSeek-V3: qk_nope 128 + qk_rope 64 per head before absorption; YaRN mscale for
# factor 40 with mscale_all_dim 1.0 is 0.1*ln(40)+1.
DEEPSEEK_V3_SCALE = (1 / math.sqrt(192)) * (0.1 * math.log(40) + 1) ** 2
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _float64_attention(q, tokens, scale, head_dim_v):
    """Independent check for one request: plain float64 softmax attention."""
    if tokens.shape[0] == 0:
        return torch.zeros(q.shape[0], q.shape[1], head_dim_v, dtype=torch.float64), torch.full(q.shape[:2], math.inf)
    k = tokens[:, 0].double()  # [L, D]
    s = torch.einsum("shd,ld->shl", q.double(), k) * scale
    return torch.einsum("shl,ld->shd", torch.softmax(s, -1), k[:, :head_dim_v]), torch.logsumexp(s, -1)


def _float64_reference(q: torch.Tensor, cache: PagedMLACache, seq_ids: list[int], scale: float):
    """The float64 check of the whole step: (out ``[B, 1, h_q, 512]``, lse ``[B, h_q, 1]``), on the CPU."""
    outs, lses = zip(*(_float64_attention(q[i].float().cpu(), cache.gather(i).cpu(), scale, 512) for i in seq_ids))
    return torch.stack(outs), torch.stack(lses).transpose(1, 2)


def _available_bytes(device: torch.device) -> int | None:
    """Free memory on ``device`` (a CPU: available physical memory), or None where it cannot be told."""
    try:
        if device.type == "cuda":
            return torch.cuda.mem_get_info(device)[0]
        if device.type == "cpu":
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError, RuntimeError):
        pass
    return None


def _check_it_fits(lengths: list[int], page_size: int, heads: int, kv_format: str, blocks: int,
                   device: torch.device) -> None:
    """UsageError naming ``--lengths`` or ``--page-size`` (whichever makes it big) where the cache, or the CPU's
    float64 check of the longest request, would not fit in the memory free now: a huge value ends in one line,
    not in an allocator's traceback."""
    token_bytes = DS_MLA_TOKEN_BYTES if kv_format == "fp8_ds_mla" else 576 * (1 if kv_format == "fp8_e4m3" else 2)
    cache = blocks * page_size * token_bytes
    longest = max(lengths)
    check = longest * (576 * 20 + heads * 16)  # fp32 values appended, fp32 + fp64 gather, fp64 scores and weights
    needs = {device: cache}
    cpu = torch.device("cpu")
    needs[cpu] = needs.get(cpu, 0) + check
    tokens = sum(lengths)
    option = "--page-size" if blocks * page_size > 2 * tokens + 4 * page_size else "--lengths"
    for where, need in needs.items():
        free = _available_bytes(where)
        if free is not None and need > free:
            raise UsageError(f"argument {option}: {tokens} cached tokens in pages of {page_size} need "
                             f"{need / 2**30:.1f} GiB on {where}, {free / 2**30:.1f} GiB are free (choose smaller "
                             "--lengths / --page-size)")


def _cosine_similarity(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """<a, b> / (|a| |b|) over the finite elements, in float64; None where either is all zeros."""
    a, b = a.double().flatten(), b.double().flatten()
    keep = torch.isfinite(a) & torch.isfinite(b)
    a, b = a[keep], b[keep]
    norms = float(a.norm() * b.norm())
    return float(a @ b) / norms if norms > 0 else None


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(prog="python -m mla_dispatch demo", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int_list, default=[1000, 37, 4096, 0, 513],
                        help="comma-separated cached tokens per request (default: 1000,37,4096,0,513)")
    parser.add_argument("--heads", type=positive_int, default=128, help="h_q (default: 128)")
    parser.add_argument("--page-size", type=positive_int, default=64)
    parser.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES),
                        help="q's dtype, and the cache's unless --kv-format says otherwise (default: bf16; fp16 runs "
                             "the Triton kernel on a CPU: TRITON_INTERPRET=1 ... --backend triton --dtype fp16)")
    parser.add_argument("--kv-format", default=None, choices=["bf16", "fp16", "fp8_e4m3", "fp8_ds_mla"],
                        help="the cache's format (default: --dtype's)")
    parser.add_argument("--backend", default="auto", help="a registered backend name, or auto (default)")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--seed", type=seed_int, default=None)
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except UsageError as exc:
        return usage_error(parser.prog, exc)


def _run(args: argparse.Namespace) -> int:
    device = parse_device(args.device)
    if args.backend != "auto" and args.backend not in registered_names():
        raise UsageError(f"argument --backend: unknown backend {args.backend!r} "
                         f"(registered: {', '.join(registered_names())}, or auto)")
    kv_format = args.kv_format or args.dtype
    if kv_format in _DTYPES and kv_format != args.dtype:
        raise UsageError(f"argument --kv-format: {kv_format} with --dtype {args.dtype} (a bf16/fp16 cache has q's "
                         f"dtype: --kv-format {args.dtype}, fp8_e4m3 or fp8_ds_mla)")
    seed = args.seed if args.seed is not None else int(time.time()) % 100000
    g = torch.Generator().manual_seed(seed)
    lengths = args.lengths
    plat = detect_platform(device)
    print(f"platform: {plat.describe()}   seed: {seed}")

    # The cache, filled the way an engine would: per-request appends.
    blocks_needed = sum(math.ceil(n / args.page_size) for n in lengths) + 4
    kv_scale = 0.1 / 448 * 1.5 if kv_format == "fp8_e4m3" else None
    _check_it_fits(lengths, args.page_size, args.heads, kv_format, blocks_needed, device)
    cache = PagedMLACache(blocks_needed, args.page_size, kv_format=kv_format, kv_scale=kv_scale, device=device)
    for i, n in enumerate(lengths):
        cache.add_sequence(i)
        cache.append(i, (torch.randn(n, 576, generator=g) / 10).clamp(-1, 1))
    seq_ids = list(range(len(lengths)))
    block_table, cache_seqlens = cache.decode_inputs(seq_ids)
    q = (torch.randn(len(lengths), 1, args.heads, 576, generator=g) / 10).clamp(-1, 1).to(_DTYPES[args.dtype]).to(device)

    try:
        plan = plan_decode(q, cache, block_table, cache_seqlens, softmax_scale=DEEPSEEK_V3_SCALE,
                           backend=args.backend)
    except NoBackendError as exc:
        reasons = "; ".join(f"{name}: " + "; ".join(map(str, why)) for name, _, why in exc.report.candidates if why)
        what = "no backend can" if args.backend == "auto" else f"{args.backend!r} cannot"
        raise UsageError(f"argument --backend: {what} run this problem on {plat.describe()}: {reasons}") from None
    cls = get_backend(plan.backend)
    print(f"backend: {plan.backend}@{cls.version()}   problem: B={len(lengths)} s_q=1 h_q={args.heads} "
          f"D=576/512 page={args.page_size} q={args.dtype} kv={kv_format} lengths={lengths}")

    out, lse = plan.run(q, cache)  # warm-up (JIT builds, autotuning)
    if device.type == "cuda":
        torch.cuda.synchronize()
    reps = 5
    t0 = time.perf_counter()
    for _ in range(reps):
        out, lse = plan.run(q, cache)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed_us = (time.perf_counter() - t0) / reps * 1e6
    out, lse = plan.run(q, cache, out=torch.full_like(out, float("nan")))  # checked: it must write every element

    # Check: the backend's last result against float64 attention per request (independent of every backend).
    want_out, want_lse = _float64_reference(q, cache, seq_ids, DEEPSEEK_V3_SCALE)
    result = compare_outputs(out.cpu(), lse.cpu(), want_out, want_lse, cls.TOLERANCE)
    max_abs = float((out.cpu().double() - want_out).abs().nan_to_num(nan=math.inf).max())
    cos = _cosine_similarity(out.cpu(), want_out)
    cos_text = "n/a (all outputs zero)" if cos is None else f"{cos:.9f}"
    verdict = "within tolerance" if result else f"OUT OF TOLERANCE: {result.message}"
    print(f"check: {plan.backend} vs float64 attention: out max abs error {max_abs:.2e}, "
          f"cosine similarity {cos_text}; {verdict}")
    print(f"time per call: {elapsed_us:.1f} µs (eager, {reps} calls, includes Python overhead)")
    print("PASS" if result else "FAIL")
    return 0 if result else 1
