"""Run one forced cuda_sm90 configuration many times on fresh inputs and keep every failure's details (GPU machine).

    python dev/sm90_stress.py --variant 6 --combine fused --shape 2,1,16,3000 --scale 1e9 --iters 200

Each iteration draws a new case (as tests/test_cuda_sm90.py's output-range test does: the cache's latent channels
times `--scale`, q's divided by it, so the outputs scale and the scores do not), poisons the outputs, runs the plan
with the mainloop and combine forced, and compares with the reference at the backend's tolerance (out_atol times the
scale). A failure prints the comparison's message, where the bad elements are (request, query row, head, channel
range) and how many poisoned (NaN) elements were never written, so an intermittent failure leaves its evidence.
Exit status: the number of failed iterations (0: all passed).
"""

import argparse
import sys

import torch
from tqdm import tqdm

from mla_dispatch import plan_decode
from mla_dispatch.dispatch.registry import get_backend
from mla_dispatch.numerics.cases import case_reference, make_case, poisoned_outputs, scale_outputs
from mla_dispatch.numerics.tolerance import compare_outputs


def describe_failure(out: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float) -> str:
    """Where `out` [B, s_q, h_q, D_v] leaves the tolerance: unwritten (NaN) elements and the worst bad elements."""
    got, want = out.double(), ref.double()
    unwritten = int(torch.isnan(got).sum())
    err = (got - want).abs()
    bad = (err > atol) & (err > rtol * want.abs()) | (torch.isnan(got) != torch.isnan(want))
    lines = [f"  unwritten (NaN) elements: {unwritten}; bad elements: {int(bad.sum())} of {bad.numel()}"]
    idx = bad.nonzero()
    rows = sorted({tuple(int(v) for v in i[:3]) for i in idx[:4096]})
    for b, s, h in rows[:8]:
        ch = idx[(idx[:, 0] == b) & (idx[:, 1] == s) & (idx[:, 2] == h)][:, 3]
        worst = int(ch[err[b, s, h, ch].nan_to_num(nan=float("inf")).argmax()])
        lines.append(f"  request {b} query {s} head {h}: {ch.numel()} channels in [{int(ch.min())}, {int(ch.max())}]; "
                     f"channel {worst}: got {float(got[b, s, h, worst]):.6g}, want {float(want[b, s, h, worst]):.6g}")
    if len(rows) > 8:
        lines.append(f"  ... {len(rows) - 8} more rows")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", type=int, default=6, help="mainloop variant to force (2, 5, 6, 7, 8, 9)")
    parser.add_argument("--combine", default="fused", choices=["fused", "separate", "auto"],
                        help="the combine in the decode launch, as a second kernel, or the plan's choice")
    parser.add_argument("--shape", default="2,1,16,3000", help="B,S_Q,H_Q,L (page 64, varlen)")
    parser.add_argument("--scale", type=float, default=1.0, help="output scale (1e9: ~1e6 outputs, past fp16's range)")
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    b, s_q, h_q, seqlen = (int(x) for x in args.shape.split(","))
    gen = torch.Generator().manual_seed(args.seed)
    base_tol = get_backend("cuda_sm90").TOLERANCE
    failed = 0
    for it in tqdm(range(args.iters), desc=f"v{args.variant} {args.combine} {args.shape} x{args.scale:g}"):
        case = make_case(b, s_q, h_q, seqlen, page_size=64, device="cuda", generator=gen)
        tol = scale_outputs(case, args.scale, base_tol)
        options = {"variant": args.variant}
        if args.combine != "auto":
            options["fuse_combine"] = args.combine == "fused"
        plan = plan_decode(*case.args(), backend="cuda_sm90", backend_options=options, **case.kwargs())
        out, lse = poisoned_outputs(case)
        plan.run(case.q, case.kv_cache, kv_scale=case.kv_scale, out=out, lse=lse)
        torch.cuda.synchronize()
        ref_out, ref_lse = case_reference(case)
        report = compare_outputs(out, lse, ref_out, ref_lse, tol)
        if not report:
            failed += 1
            splits = int((plan.state.schedule.num_splits > 1).sum())
            tqdm.write(f"iteration {it}: FAILED ({splits} split requests): {report.message}\n"
                       + describe_failure(out, ref_out.to(out.dtype), tol.out_atol, tol.out_rtol))
    print(f"{failed} of {args.iters} iterations failed")
    return min(failed, 255)


if __name__ == "__main__":
    sys.exit(main())
