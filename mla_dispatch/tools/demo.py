"""``python -m mla_dispatch demo``: one DeepSeek-V3-shaped decode step, end to end.

Builds a paged cache with :class:`PagedMLACache` (h_q=128, D_qk=576, D_v=512,
one latent KV head, a few requests of different lengths, one of them empty),
plans the step, runs it on the best backend here, checks the result against
the fp32 reference with docs/design.md tolerances, and prints the backend, the
error and the time. On a CPU-only machine the best backend is the reference
itself, so the check compares it with an independent float64 computation.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from mla_dispatch.api import plan_decode
from mla_dispatch.numerics.oracle import reference_attention
from mla_dispatch.kvcache.cache import PagedMLACache
from mla_dispatch.dispatch.platform import detect_platform
from mla_dispatch.dispatch.registry import get_backend
from mla_dispatch.numerics.tolerance import compare_outputs

# DeepSeek-V3: qk_nope 128 + qk_rope 64 per head before absorption; YaRN mscale for
# factor 40 with mscale_all_dim 1.0 is 0.1*ln(40)+1.
DEEPSEEK_V3_SCALE = (1 / math.sqrt(192)) * (0.1 * math.log(40) + 1) ** 2


def _float64_attention(q, tokens, scale, head_dim_v):
    """Independent check for one request: plain float64 softmax attention."""
    if tokens.shape[0] == 0:
        return torch.zeros(q.shape[0], q.shape[1], head_dim_v, dtype=torch.float64), torch.full(q.shape[:2], math.inf)
    k = tokens[:, 0].double()  # [L, D]
    s = torch.einsum("shd,ld->shl", q.double(), k) * scale
    return torch.einsum("shl,ld->shd", torch.softmax(s, -1), k[:, :head_dim_v]), torch.logsumexp(s, -1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mla_dispatch demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="1000,37,4096,0,513", help="comma-separated cached tokens per request")
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--kv-format", default="bf16", choices=["bf16", "fp8_e4m3", "fp8_ds_mla"])
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    seed = args.seed if args.seed is not None else int(time.time()) % 100000
    g = torch.Generator().manual_seed(seed)
    lengths = [int(x) for x in args.lengths.split(",")]
    plat = detect_platform(device)
    print(f"platform: {plat.describe()}   seed: {seed}")

    # The cache, filled the way an engine would: per-request appends.
    blocks_needed = sum(math.ceil(n / args.page_size) for n in lengths) + 4
    kv_scale = 0.1 / 448 * 1.5 if args.kv_format == "fp8_e4m3" else None
    cache = PagedMLACache(blocks_needed, args.page_size, kv_format=args.kv_format, kv_scale=kv_scale, device=device)
    for i, n in enumerate(lengths):
        cache.add_sequence(i)
        cache.append(i, (torch.randn(n, 576, generator=g) / 10).clamp(-1, 1))
    seq_ids = list(range(len(lengths)))
    block_table, cache_seqlens = cache.decode_inputs(seq_ids)
    q = (torch.randn(len(lengths), 1, args.heads, 576, generator=g) / 10).clamp(-1, 1).to(torch.bfloat16).to(device)

    plan = plan_decode(q, cache, block_table, cache_seqlens, softmax_scale=DEEPSEEK_V3_SCALE, backend=args.backend)
    cls = get_backend(plan.backend)
    print(f"backend: {plan.backend}@{cls.version()}   problem: B={len(lengths)} s_q=1 h_q={args.heads} "
          f"D=576/512 page={args.page_size} kv={args.kv_format} lengths={lengths}")

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

    # Check: against the fp32 reference, and the reference against float64 per request.
    ref_out, ref_lse = reference_attention(q, cache.kv, block_table, cache_seqlens, softmax_scale=DEEPSEEK_V3_SCALE,
                                           kv_format=args.kv_format, kv_scale=cache.kv_scale)
    result = compare_outputs(out, lse, ref_out, ref_lse, cls.TOLERANCE)
    worst64 = 0.0
    for i in seq_ids:
        o64, l64 = _float64_attention(q[i].float().cpu(), cache.gather(i).cpu(), DEEPSEEK_V3_SCALE, 512)
        worst64 = max(worst64, float((ref_out[i].cpu().double() - o64).abs().max()))
        if not torch.equal(torch.isinf(ref_lse[i].cpu()), torch.isinf(l64.T)):
            worst64 = math.inf
    ok = bool(result) and worst64 < 1e-5
    print(f"check vs fp32 reference: {result.message}")
    print(f"reference vs float64:    max abs {worst64:.2e}")
    print(f"time per call: {elapsed_us:.1f} µs (eager, {reps} calls, includes Python overhead)")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1
