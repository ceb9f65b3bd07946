#!/usr/bin/env python
"""AMLA accuracy study, the method of Tables 3/4 of arXiv 2509.25224.

Relative Frobenius error against an fp32 golden of AMLA (our Ascend kernel's
recurrence, emulated bit for bit: mla_dispatch/kernels/ascend/amla_emulation.py)
and of a standard FlashAttention "Base" with the same 512-token blocks, over
Gaussian and uniform inputs. Defaults are the paper's: context 8K, h_q = 128,
100 samples per distribution. Exits 1 if AMLA's error on the bf16 output (what
the kernel returns, and the quantity the paper's ~1.8e-3 figures describe) is
more than --max-ratio times Base's on any distribution.

    python dev/amla_accuracy.py                       # full study on the CPU (slow: ~1 h on 2 cores)
    python dev/amla_accuracy.py --device cuda         # the same on a GPU (TF32 is switched off)
    python dev/amla_accuracy.py --samples 4 --context 2048 --heads 32   # quick look
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from mla_dispatch.kernels.ascend.accuracy import DEFAULT_DISTRIBUTIONS, format_table, run_study


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=100)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    ap.add_argument("--max-ratio", type=float, default=1.05)
    args = ap.parse_args(argv)
    if args.device.startswith("cuda"):
        # The golden and the cube emulation are fp32 matmuls: TF32 would change them.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    t0 = time.time()
    rows = run_study(DEFAULT_DISTRIBUTIONS, samples=args.samples, context=args.context, num_heads=args.heads,
                     device=args.device, seed=args.seed, dtype=dtype)
    title = (f"AMLA vs Base, relative Frobenius error vs fp32 golden ({args.dtype}, context {args.context}, "
             f"h_q={args.heads}, D=576/512, block 512, {args.samples} samples, {args.device}, "
             f"{time.time() - t0:.0f} s)")
    print(format_table(rows, title, args.dtype))
    bad = [r for r in rows if r.amla_bf16 > args.max_ratio * r.base_bf16]
    for r in bad:
        print(f"FAIL {r.dist.label}: AMLA {r.amla_bf16:.4e} > {args.max_ratio} x Base {r.base_bf16:.4e}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
