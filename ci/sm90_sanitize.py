"""compute-sanitizer / ncu target: one call of each cuda_sm90 mainloop variant (GPU machine).

    compute-sanitizer --tool memcheck python ci/sm90_sanitize.py [--variants 2,5,6]
    compute-sanitizer --tool racecheck python ci/sm90_sanitize.py --variants 5
    compute-sanitizer --tool memcheck python ci/sm90_sanitize.py --variants 2,6 --combine fused
    compute-sanitizer --tool memcheck python ci/sm90_sanitize.py --variants 0 --kv-format fp8_ds_mla --sparse 256
    compute-sanitizer --tool memcheck python ci/sm90_sanitize.py --variants 2,6 --kv-format fp8_ds_v4 --sparse 128
    ncu --section WarpStateStats -k mla_decode_seesaw -c 1 python ci/sm90_sanitize.py --variants 5 --big
    ncu ... -k mla_decode_etap -c 1 python ci/sm90_sanitize.py --variants 6 --big --big-heads 16 --kv-format fp8_e4m3

Small shapes with odd and even tile counts, a partial last tile, split requests and a
zero-length request, so every code path of the mainloops runs once under the tool.
"""

import argparse

import torch

from mla_dispatch import plan_decode
from mla_dispatch.numerics.cases import make_case


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", default="2,5,6", help="mainloops to force (0: the plan's own choice)")
    parser.add_argument("--kv-format", default="bf16", help="bf16, fp8_e4m3, fp8_ds_mla or fp8_ds_v4 (sparse only)")
    parser.add_argument("--shape", default=None, help="one call of shape B,S_Q,H_Q,L (page 64, equal lengths) instead")
    parser.add_argument("--combine", default="auto", help="auto (the plan's choice), fused (the combine as the "
                        "decode kernel's tail, cooperative launch) or separate (a second kernel)")
    parser.add_argument("--big", action="store_true", help="one b=128, h_q=128, L=4096 call instead (profiling)")
    parser.add_argument("--sparse", type=int, default=0, help="top-k decode with this many slots per query "
                        "(-1 slots among them; the shapes' own page sizes, plus page 61)")
    parser.add_argument("--big-heads", type=int, default=128, help="h_q of --big (not 128: b=64, L=8192, the "
                        "memory-bound config)")
    args = parser.parse_args()
    # (batch, s_q, h_q, seqlen, causal, page_size)
    shapes = [(3, 1, 128, 300, False, 64), (2, 2, 64, 700, True, 64), (4, 1, 16, 130, False, 64),
              (2, 2, 16, 333, True, 16)]
    if args.big:
        shapes = [(128, 1, 128, 4096, False, 64) if args.big_heads == 128 else (64, 1, args.big_heads, 8192, False, 64)]
    if args.sparse:
        shapes.append((3, 2, 64, 500, False, 61))
    if args.shape:
        b, s_q, h_q, L = (int(x) for x in args.shape.split(","))
        shapes = [(b, s_q, h_q, L, False, 64)]
    gen = torch.Generator().manual_seed(0)
    for variant in (int(v) for v in args.variants.split(",")):
        for b, s_q, h_q, L, causal, page_size in shapes:
            dims = dict(head_dim_qk=512, head_dim_v=512) if args.kv_format == "fp8_ds_v4" else {}
            case = make_case(b, s_q, h_q, L, page_size=page_size, causal=causal and not args.sparse,
                             kv_format=args.kv_format, topk=args.sparse,
                             zero_len_rows=0 if args.shape else 1, varlen=not args.shape, device="cuda",
                             generator=gen, **dims)
            options = {"variant": variant} if variant else {}
            if args.combine != "auto":
                options["fuse_combine"] = args.combine == "fused"
            try:
                plan = plan_decode(*case.args(), backend="cuda_sm90", backend_options=options, **case.kwargs())
            except ValueError as exc:  # the mainloop does not take the shape: nothing to check there
                print(f"variant {variant} b={b} s_q={s_q} h_q={h_q} L={L}: not run ({exc})")
                continue
            out, lse = plan.run(case.q, case.kv_cache, kv_scale=case.kv_scale, indices=case.indices)
            torch.cuda.synchronize()
            launch = plan.state.launch
            print(f"variant {launch.variant} fused={launch.fuse_combine} b={b} s_q={s_q} h_q={h_q} L={L}: "
                  f"finite={bool(torch.isfinite(out).all())}")


if __name__ == "__main__":
    main()
