"""One config, FlashMLA's decode kernel and ours on the same inputs, for Nsight Compute to profile side by side.

    ncu --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section InstructionStats \\
        --section MemoryWorkloadAnalysis --section Occupancy \\
        -k regex:"flash_fwd_splitkv_mla|mla_decode_(wgmma|seesaw|etap|fp8t)" \\
        -c 4 --csv --page details python dev/ncu_vs_flashmla.py --config 128,1,128,8192

Runs FlashMLA's call twice (the first fills its schedule), then ours twice: with `-c 4` ncu profiles two launches
of each decode kernel. Needs FlashMLA importable (ci/flashmla_peer.sh). ``--topk N`` profiles sparse decode instead
(fp8_ds_mla cache, FlashMLA's SM90 sparse kernel: regex "flash_fwd_splitkv_mla_fp8_sparse|mla_decode_wgmma").
``--variants 9,2`` runs ours with each of those mainloops forced in turn (two launches each).
``--kv-format fp8_e4m3|fp8_ds_mla`` (dense) profiles ours on that cache alone: FlashMLA's dense kernel takes 16-bit
caches only (profile its bf16 twin with the same --config and no --kv-format).
"""

import argparse

import torch

import mla_dispatch
from mla_dispatch.tools.bench import BenchConfig, make_bench_case


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="128,1,128,8192", help="batch,s_q,h_q,mean length (varlen, page 64)")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--topk", type=int, default=0, help="sparse decode with this many top-k slots (fp8_ds_mla)")
    p.add_argument("--kv-format", default=None, help="dense: our kernel alone on this cache format")
    p.add_argument("--fixed", action="store_true", help="every request at the mean length (default: varlen)")
    p.add_argument("--variants", default="", help="ours with these mainloops forced, comma-separated, one after the "
                   "other (default: the plan's own)")
    args = p.parse_args()
    b, s_q, h_q, L = map(int, args.config.split(","))
    cfg = BenchConfig(b, s_q, h_q, L, varlen=not args.fixed, causal=args.causal, topk=args.topk,
                      kv_format="fp8_ds_mla" if args.topk else args.kv_format)
    case = make_bench_case(cfg, device="cuda")
    import flash_mla

    meta, _ = flash_mla.get_mla_metadata()
    if args.kv_format and not args.topk:
        fm = None  # FlashMLA's dense kernel takes 16-bit caches only
    elif args.topk:
        fm = lambda: flash_mla.flash_mla_with_kvcache(case.q, case.kv_cache, None, None, 512, meta,  # noqa: E731
                                                      None, softmax_scale=case.softmax_scale, is_fp8_kvcache=True,
                                                      indices=case.indices)
    else:
        fm = lambda: flash_mla.flash_mla_with_kvcache(case.q, case.kv_cache, case.block_table,  # noqa: E731
                                                      case.cache_seqlens, 512, meta, None,
                                                      softmax_scale=case.softmax_scale, causal=case.causal)
    ours = []
    for variant in [int(v) for v in args.variants.split(",") if v] or [None]:
        options = {} if variant is None else {"variant": variant}
        plan = mla_dispatch.plan_decode(*case.args(), **case.kwargs(), backend="cuda_sm90", backend_options=options)
        ours.append(lambda plan=plan: plan.run(case.q, case.kv_cache, kv_scale=case.kv_scale, indices=case.indices))
    for fn in (f for f in (fm, *ours) if f is not None):
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
    print("ran", args.config, "causal" if args.causal else "", f"topk={args.topk}" if args.topk else "")


if __name__ == "__main__":
    main()
